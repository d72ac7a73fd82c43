"""Per-request draft-length control for self-speculative decoding.

Two mechanisms, both per request:

1. **Adaptive draft-exiting** (Draft & Verify, Zhang et al., ACL 2024, "Draft & Verify: Lossless
   Large Language Model Acceleration via Self-Speculative Decoding"). While drafting, stop as soon
   as the draft's top-1 probability falls below the request's threshold ``th``. After each
   verification (``acc`` of ``drafted`` drafts accepted)::

       m  = 0.5*m + 0.5*(acc/drafted)          # acceptance EMA, m starts at 0
       if m < target:          new = th + eps  # too many rejections: exit earlier
       elif drafted == cap:    new = th        # the cap, not the threshold, ended drafting
       else:                   new = th - eps
       th = 0.9*th + 0.1*new                   # momentum; th is clamped to [0, 0.999]

   ``cap`` is the budget :meth:`DraftLengthController.plan` gave the request for the verified step
   (``k_max`` unless the cost model below or an override lowered it): drafting that stopped at the
   budget says nothing about the threshold.

2. **Cost-aware budget** (beyond the paper). A per-token acceptance estimate ``a`` (discounted
   counts of accepted / tried draft positions, with an optimistic prior) and the measured cost
   ratio ``r = c_draft / c_verify`` give the expected tokens per unit time of ``k`` drafts::

       E(k) = (1 - a**(k+1)) / (1 - a)   (k + 1 when a == 1),   time(k) = k*r + 1

   :meth:`plan` picks the ``k`` maximising ``E(k) / time(k)``; ``k = 0`` scores exactly 1. A request
   for which no ``k > 0`` wins drafts nothing ("drafting off") and is re-probed with a small
   budget every ``probe_interval`` of its steps, the interval doubling (up to
   ``max_probe_interval``) while probes keep failing.

3. **Engine-wide acceptance prior** (``engine_prior``). A new request's acceptance estimate starts
   from the engine-wide per-token acceptance (discounted counts over every verification of every
   request) instead of the fixed optimistic ``prior_acceptance``, which is used only until the
   engine's first verification. A new request for which that prior already rules drafting out
   starts with drafting off, with the probe interval that failing probes last reached (reset to
   ``probe_interval`` when a probe brings a request back). Without this every new request re-paid
   the learning on a skip set whose drafts never land: a few wasted draft rounds before its own
   estimate turned it off (measured on SmolLM2-135M with a bad skip set: ~5 draft forwards per
   48-token request, ~9% of the time at batch 1). The draft-exit threshold still starts at
   ``initial_threshold`` for every request.

4. **Batch-aware budget** (``batch_aware``). A draft forward runs over all drafting rows of a step
   and the whole batch waits for it, so :meth:`plan` finally clips the adaptive budgets of a step
   to the common cap ``K`` maximising ``(B + sum_i (E(a_i, min(k_i, K)) - 1)) / (1 + K r)``
   (``K = 0``: nobody drafts). Per request, ``a`` just above ``r`` says "draft"; in a batch of 32
   that one request's gain does not pay for 32 requests waiting (measured on SmolLM2-135M with a
   bad skip set: 0.75-0.8x plain at batch 32 before this rule).

5. **Cost-aware probe interval** (``probe_overhead``). A probe costs about
   ``probe_budget * r`` verification steps, so once ``r`` has been measured a request that is off
   probes at most every ``probe_budget * r / probe_overhead`` steps (at most
   ``max_probe_interval``): probing, the insurance against a workload change, costs at most ~2% of
   the time. With ``r = 0.65`` (SmolLM2-135M, bad skip set, batch 1) the fixed 16-step interval
   cost ~8%.

Everything is deterministic: the same sequence of calls gives the same plans on every
tensor-parallel rank, provided every rank is given the same cost figures (measure on one rank and
broadcast them, or pass identical values).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("vllm.selfspec.controller")

_OVERRIDE_KEYS = ("num_speculative_tokens", "adaptive", "draft_confidence_threshold")
MAX_THRESHOLD = 0.999


def validate_request_overrides(
    overrides: Mapping[str, Any] | None, k_max: int | None = None
) -> dict[str, Any]:
    """Check per-request overrides (``SamplingParams.extra_args["selfspec"]``).

    Returns a normalised copy; raises ``ValueError`` naming the offending key and value.
    """
    if overrides is None:
        return {}
    if not isinstance(overrides, Mapping):
        raise ValueError(f"selfspec overrides must be a dict, got {type(overrides).__name__}")
    out: dict[str, Any] = {}
    for key, value in overrides.items():
        if key == "num_speculative_tokens":
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"selfspec 'num_speculative_tokens' must be an int >= 0, "
                                 f"got {value!r}")
            if k_max is not None and value > k_max:
                raise ValueError(f"selfspec 'num_speculative_tokens'={value} exceeds the "
                                 f"configured maximum of {k_max}")
            out[key] = value
        elif key == "adaptive":
            if not isinstance(value, bool):
                raise ValueError(f"selfspec 'adaptive' must be a bool, got {value!r}")
            out[key] = value
        elif key == "draft_confidence_threshold":
            if (isinstance(value, bool) or not isinstance(value, int | float)
                    or not 0.0 <= value <= 1.0):
                raise ValueError(f"selfspec 'draft_confidence_threshold' must be a number in "
                                 f"[0, 1], got {value!r}")
            out[key] = min(float(value), MAX_THRESHOLD)
        else:
            raise ValueError(f"unknown selfspec override key {key!r} "
                             f"(allowed: {', '.join(_OVERRIDE_KEYS)})")
    return out


@dataclass
class ControllerConfig:
    """Settings of :class:`DraftLengthController` (defaults: Draft & Verify's constants)."""

    k_max: int
    adaptive: bool = True
    initial_threshold: float = 0.6
    target_acceptance: float = 0.9
    eps: float = 0.01
    threshold_momentum: float = 0.9  # th = momentum*th + (1-momentum)*new
    m_decay: float = 0.5  # m = m_decay*m + (1-m_decay)*(acc/drafted)
    prior_acceptance: float = 0.85  # optimistic per-token acceptance of a new request
    prior_weight: float = 2.0  # pseudo-trials behind the prior
    acceptance_decay: float = 0.7  # discount of old counts per verification
    prior_cost_ratio: float = 0.5  # r before any measurement
    cost_ema: float = 0.2  # weight of a new cost measurement
    probe_interval: int = 16
    max_probe_interval: int = 256
    probe_budget: int = 2
    engine_prior: bool = True  # new requests start from the engine-wide acceptance estimate
    engine_acceptance_decay: float = 0.95  # discount of engine-wide counts per verification
    batch_aware: bool = True  # clip a step's budgets to what pays for the whole batch
    probe_overhead: float = 0.02  # probes of a request cost at most this share of its time

    def __post_init__(self) -> None:
        if isinstance(self.k_max, bool) or not isinstance(self.k_max, int) or self.k_max < 1:
            raise ValueError(f"k_max must be an int >= 1, got {self.k_max!r}")
        for name in ("initial_threshold", "target_acceptance", "threshold_momentum", "m_decay",
                     "prior_acceptance", "acceptance_decay", "engine_acceptance_decay"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)!r}")
        if not 0.0 < self.cost_ema <= 1.0:
            raise ValueError(f"cost_ema must be in (0, 1], got {self.cost_ema!r}")
        if self.eps < 0 or self.prior_weight <= 0 or self.prior_cost_ratio < 0:
            raise ValueError("need eps >= 0, prior_weight > 0 and prior_cost_ratio >= 0")
        if not 1 <= self.probe_interval <= self.max_probe_interval or self.probe_budget < 1:
            raise ValueError("need 1 <= probe_interval <= max_probe_interval and probe_budget >= 1")


@dataclass
class _RequestState:
    threshold: float
    acc_count: float  # discounted accepted draft positions (prior included)
    try_count: float  # discounted tried draft positions (prior included)
    m: float = 0.0
    budget: int = -1  # budget of the last plan (-1: never planned)
    adaptive: bool = True
    cap: int = 0
    threshold_overridden: bool = False
    off: bool = False  # drafting switched off by the cost model
    off_steps: int = 0
    interval: int = 0
    probing: bool = False  # the last plan was a probe

    @property
    def acceptance(self) -> float:
        return self.acc_count / self.try_count if self.try_count > 0 else 0.0


@dataclass
class _Window:
    planned: int = 0
    planned_drafts: int = 0
    planned_off: int = 0
    probes: int = 0
    verifications: int = 0
    drafted: int = 0
    accepted: int = 0
    cost_observations: int = 0
    verify_tokens: int = 0


def expected_tokens(a: float, k: int) -> float:
    """Expected tokens from one verification of ``k`` drafts, per-token acceptance ``a``."""
    if a >= 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def best_draft_length(a: float, r: float, cap: int) -> int:
    """The ``k`` in ``0..cap`` maximising ``E(k) / (k*r + 1)``; ties go to the smaller ``k``."""
    a = min(max(a, 0.0), 1.0)
    best_k, best_rate = 0, 1.0
    for k in range(1, cap + 1):
        rate = expected_tokens(a, k) / (k * r + 1.0)
        if rate > best_rate * (1.0 + 1e-12):
            best_k, best_rate = k, rate
    return best_k


def _bucket(batch_size: int) -> int:
    """Power-of-two batch-size bucket: cost ratios are kept per bucket."""
    return 1 << max(0, int(batch_size) - 1).bit_length()


class DraftLengthController:
    """Per-request draft budgets and exit thresholds; see the module docstring for the rules."""

    def __init__(self, config: ControllerConfig) -> None:
        self.config = config
        self._states: dict[str, _RequestState] = {}
        self._cost_ratio: dict[int, float] = {}  # batch-size bucket -> EMA of c_draft/c_verify
        self._window = _Window()
        # engine-wide discounted accepted / tried draft positions (the new requests' prior)
        self._engine_acc = 0.0
        self._engine_try = 0.0
        self._inherited_interval = config.probe_interval

    def engine_acceptance(self) -> float:
        """Engine-wide per-token acceptance estimate (a new request's prior);
        ``prior_acceptance`` before any verification or with ``engine_prior`` off."""
        if not self.config.engine_prior or self._engine_try <= 0:
            return self.config.prior_acceptance
        return self._engine_acc / self._engine_try

    # ---- per-request state -------------------------------------------------------------------
    def _state(self, req_id: str) -> _RequestState:
        st = self._states.get(req_id)
        if st is None:
            cfg = self.config
            st = _RequestState(threshold=min(cfg.initial_threshold, MAX_THRESHOLD),
                               acc_count=self.engine_acceptance() * cfg.prior_weight,
                               try_count=cfg.prior_weight,
                               cap=cfg.k_max, interval=cfg.probe_interval)
            self._states[req_id] = st
        return st

    def retain(self, active_req_ids: Iterable[str]) -> None:
        """Drop the state of every request not in ``active_req_ids`` (unknown ids are ignored)."""
        keep = set(active_req_ids)
        for req_id in [r for r in self._states if r not in keep]:
            del self._states[req_id]

    def observe_verification(self, req_id: str, drafted: int, accepted: int) -> None:
        """Record that ``accepted`` of ``drafted`` drafts of ``req_id`` passed verification.

        Updates the Draft & Verify threshold and the per-token acceptance estimate (draft
        positions up to and including the first rejection count as tried). ``drafted == 0`` is a
        no-op."""
        if drafted <= 0:
            return
        accepted = min(max(int(accepted), 0), int(drafted))
        cfg = self.config
        st = self._state(req_id)
        w = self._window
        w.verifications += 1
        w.drafted += drafted
        w.accepted += accepted

        # Draft & Verify threshold update.
        st.m = cfg.m_decay * st.m + (1.0 - cfg.m_decay) * (accepted / drafted)
        cap = st.budget if st.budget > 0 else min(st.cap, cfg.k_max)
        if st.m < cfg.target_acceptance:
            new = st.threshold + cfg.eps
        elif drafted >= cap:
            new = st.threshold
        else:
            new = st.threshold - cfg.eps
        th = cfg.threshold_momentum * st.threshold + (1.0 - cfg.threshold_momentum) * new
        st.threshold = min(max(th, 0.0), MAX_THRESHOLD)

        # Per-token acceptance: positions up to and including the first rejection were tried.
        if st.probing:  # the off-state estimate is stale: let the probe speak for itself
            st.acc_count = st.try_count = 0.0
        tried = accepted + (1 if accepted < drafted else 0)
        st.acc_count = cfg.acceptance_decay * st.acc_count + accepted
        st.try_count = cfg.acceptance_decay * st.try_count + tried
        self._engine_acc = cfg.engine_acceptance_decay * self._engine_acc + accepted
        self._engine_try = cfg.engine_acceptance_decay * self._engine_try + tried

    # ---- costs -------------------------------------------------------------------------------
    def observe_step_costs(self, batch_size: int, draft_step_s: float, verify_step_s: float,
                           verify_tokens: int | None = None) -> None:
        """Record the cost of one draft forward over ``batch_size`` rows and of the target
        (verification) forward of the same step; the ratio feeds an EMA per batch-size bucket.
        ``verify_tokens`` is only reported in :meth:`stats`."""
        if (batch_size < 1 or not math.isfinite(draft_step_s) or not math.isfinite(verify_step_s)
                or draft_step_s < 0 or verify_step_s <= 0):
            logger.debug("ignoring step costs B=%s draft=%s verify=%s", batch_size, draft_step_s,
                         verify_step_s)
            return
        ratio = draft_step_s / verify_step_s
        b = _bucket(batch_size)
        old = self._cost_ratio.get(b)
        self._cost_ratio[b] = ratio if old is None else (
            (1.0 - self.config.cost_ema) * old + self.config.cost_ema * ratio)
        self._window.cost_observations += 1
        self._window.verify_tokens += int(verify_tokens or 0)

    def cost_ratio(self, batch_size: int) -> float:
        """Current ``c_draft / c_verify`` for ``batch_size``: its bucket's EMA, else the nearest
        measured bucket's, else the prior."""
        if not self._cost_ratio:
            return self.config.prior_cost_ratio
        b = _bucket(batch_size)
        if b in self._cost_ratio:
            return self._cost_ratio[b]
        nearest = min(self._cost_ratio, key=lambda x: (abs(x.bit_length() - b.bit_length()), x))
        return self._cost_ratio[nearest]

    # ---- planning ----------------------------------------------------------------------------
    def plan(self, req_ids: Iterable[str],
             overrides: Mapping[str, Mapping[str, Any]] | None = None) -> list[int]:
        """Return, per request in ``req_ids``, how many drafts to make at most this step."""
        ids = list(req_ids)
        cfg = self.config
        r = self.cost_ratio(len(ids))
        budgets: list[int] = []
        states: list[_RequestState] = []
        w = self._window
        for req_id in ids:
            st = self._state(req_id)
            ov = overrides.get(req_id) if overrides else None
            if ov:
                ov = validate_request_overrides(ov, cfg.k_max)
                if "draft_confidence_threshold" in ov and not st.threshold_overridden:
                    st.threshold = ov["draft_confidence_threshold"]
                    st.threshold_overridden = True
            st.cap = ov.get("num_speculative_tokens", cfg.k_max) if ov else cfg.k_max
            st.adaptive = cfg.adaptive and (ov.get("adaptive", True) if ov else True)
            budgets.append(self._plan_one(req_id, st, r))
            states.append(st)
        if cfg.batch_aware and len(ids) > 1:
            budgets = self._batch_clip(states, budgets, r)
        for st, k in zip(states, budgets, strict=True):
            st.budget = k
            w.planned += 1
            w.planned_drafts += k
            w.planned_off += k == 0
        return budgets

    def _batch_clip(self, states: list[_RequestState], budgets: list[int],
                    r: float) -> list[int]:
        """Clip the adaptive (non-probe) budgets of one step to the common cap ``K`` that
        maximises the batch's expected tokens per unit time.

        A draft forward runs over every drafting row at once and the whole batch waits for it,
        so its cost is shared by all ``B`` requests, not paid by the drafting request alone:
        with ``K`` draft forwards the step yields ``B + sum_i (E(a_i, min(k_i, K)) - 1)`` tokens
        in ``1 + K * r`` verification-step units. Per-request planning alone lets a few
        requests with ``a`` just above ``r`` draft in a large batch and slow everyone down
        (measured: 0.75-0.8x plain at batch 32 with a bad skip set). Probes, non-adaptive
        requests and overrides keep their budgets (their forwards are paid anyway, so other
        rows may ride along up to that length); requests whose cap is 0 are not counted in
        ``B``; ties keep the longer budget.
        """
        fixed = [k for st, k in zip(states, budgets, strict=True)
                 if not st.adaptive or st.probing]
        free = max(fixed, default=0)  # draft forwards that run whatever K is
        fixed_gain = sum(expected_tokens(st.acceptance, k) - 1.0
                         for st, k in zip(states, budgets, strict=True)
                         if (not st.adaptive or st.probing) and k > 0)
        clippable = [(st.acceptance, k) for st, k in zip(states, budgets, strict=True)
                     if st.adaptive and not st.probing and k > 0]
        if not clippable:
            return budgets
        # requests that switched drafting off for themselves (cap 0) are left out of the
        # objective: the rule weighs the requests that take part in speculation
        n = sum(1 for st in states if st.cap > 0)
        if n <= 1:
            return budgets
        best_k, best_rate = 0, None
        for cap in range(max(k for _, k in clippable), -1, -1):  # ties keep the longer budget
            gain = fixed_gain + sum(expected_tokens(a, min(k, cap)) - 1.0 for a, k in clippable)
            rate = (n + gain) / (1.0 + max(cap, free) * r)
            if best_rate is None or rate > best_rate * (1.0 + 1e-12):
                best_k, best_rate = cap, rate
        return [k if (not st.adaptive or st.probing) else min(k, best_k)
                for st, k in zip(states, budgets, strict=True)]

    def _plan_one(self, req_id: str, st: _RequestState, r: float) -> int:
        cfg = self.config
        was_probing, st.probing = st.probing, False
        if st.cap == 0 or not st.adaptive:
            return st.cap
        k = best_draft_length(st.acceptance, r, st.cap)
        first_plan = st.budget < 0
        if k > 0:
            if st.off:
                logger.debug("request %s: drafting back on (k=%d, a=%.3f)", req_id, k,
                             st.acceptance)
                st.off, st.interval = False, cfg.probe_interval
                self._inherited_interval = cfg.probe_interval
            return k
        if not st.off:
            logger.debug("request %s: drafting off (a=%.3f, r=%.3f)", req_id, st.acceptance, r)
            # a request that starts off (the engine-wide prior) keeps the engine's probe back-off
            interval = self._inherited_interval if first_plan else cfg.probe_interval
            st.off, st.off_steps, st.interval = True, 0, interval
        elif was_probing:  # the probe did not bring the request back: back off
            st.interval = min(2 * st.interval, cfg.max_probe_interval)
            st.off_steps = 0
            self._inherited_interval = st.interval
        st.off_steps += 1
        if st.off_steps >= max(st.interval, self._min_probe_interval(r)):
            st.off_steps, st.probing = 0, True
            self._window.probes += 1
            return min(cfg.probe_budget, st.cap)
        return 0

    def _min_probe_interval(self, r: float) -> int:
        """Steps between probes so that probing costs at most ``probe_overhead`` of the time:
        a probe costs about ``probe_budget * r`` verification steps. Only once a cost ratio has
        been measured (before that the configured schedule applies); at most
        ``max_probe_interval``."""
        cfg = self.config
        if not self._cost_ratio or cfg.probe_overhead <= 0:
            return 0
        return min(math.ceil(cfg.probe_budget * r / cfg.probe_overhead), cfg.max_probe_interval)

    def should_stop(self, req_id: str, top1_prob: float) -> bool:
        """Draft-exiting: True when ``top1_prob`` is below the request's threshold.

        Never stops when adaptivity is off (globally or for the request) or during a probe
        (a probe must reach its budget to measure acceptance). NaN stops.
        """
        if not self.config.adaptive:
            return False
        st = self._state(req_id)
        if not st.adaptive or st.probing:
            return False
        return not top1_prob >= st.threshold

    # ---- logging -----------------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        """Plain numbers for logging: window figures since :meth:`reset_stats_window`, and
        current per-request means."""
        w = self._window
        states = list(self._states.values())
        n = len(states)
        return {
            "num_requests": n,
            "mean_planned_draft_len": w.planned_drafts / w.planned if w.planned else 0.0,
            "drafting_off_share": w.planned_off / w.planned if w.planned else 0.0,
            "mean_threshold": sum(s.threshold for s in states) / n if n else 0.0,
            "mean_acceptance_estimate": sum(s.acceptance for s in states) / n if n else 0.0,
            "engine_acceptance_estimate": self.engine_acceptance(),
            "acceptance_rate": w.accepted / w.drafted if w.drafted else 0.0,
            "drafted": w.drafted,
            "accepted": w.accepted,
            "probes": w.probes,
            "planned_steps": w.planned,
            "cost_ratio": self.cost_ratio(max(1, n)),
            "mean_verify_tokens": (w.verify_tokens / w.cost_observations
                                   if w.cost_observations else 0.0),
        }

    def reset_stats_window(self) -> None:
        """Start a new logging window (per-request state is kept)."""
        self._window = _Window()
