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
   counts of accepted / tried draft positions, with an optimistic prior) gives the expected tokens
   of ``k`` drafts, ``E(k) = (1 - a**(k+1)) / (1 - a)`` (``k + 1`` when ``a == 1``). The costs are
   measured, not assumed (:mod:`vllm_selfspec.control.step_costs`, lower quartiles of recent
   samples): a plain decoding step of the batch, a verification step as a function of the draft
   tokens it verifies (verification is *not* free: on a CPU it grows almost linearly with the
   tokens), and a draft forward as a function of its rows. A step of ``B`` requests in which
   request ``i`` drafts ``k_i`` tokens yields
   ``sum_i E(a_i, k_i)`` tokens in ``c_verify(B, sum k_i) + sum_j c_draft(rows drafting at j)``;
   :meth:`DraftLengthController.plan` picks the drafting requests (highest ``a`` first) and their
   common cap ``K`` that maximise tokens per second, against ``B / c_plain(B)`` for no drafting.
   Costs measured in seconds are set only against each other: while no verification has been
   measured, a measured draft forward is not used either (it would be compared with the unit
   an unmeasured verification stands for) and the prior prices the draft forward at
   ``prior_cost_ratio`` plain steps with verification free.
   Drafting must beat plain decoding by ``min_gain`` (10%): closer to break-even the decision
   would follow the noise of the measured costs (prompt-lookup drafts, which cost verification
   only, keep 5%: :data:`vllm_selfspec.control.source_choice.LOOKUP_MIN_GAIN`; docs/design.md
   gives the measurements behind both). A plan verifies at most twice the draft tokens
   per request measured so far at its batch size (at least one, also before anything has been
   measured; :meth:`DraftLengthController.draft_limit`): a new batch size is learnt from cheap
   steps before a costly one is risked on costs borrowed from another size or on the prior.
   A request whose drafts do not pay even when it is alone (``B = 1`` costs) is "off": it drafts
   nothing and is re-probed with a small budget every ``probe_interval`` of its steps, the
   interval doubling (up to ``max_probe_interval``) while probes keep failing, and never more often
   than keeps all probes of the batch within a ``probe_overhead`` share of the time (the batch
   waits for a probe's draft forwards). A request merely left out of one step's
   plan (its gain does not pay for the batch waiting on its draft forwards) is not off.

3. **Plain-step exploration** (``explore_interval``). The plain-step cost of a batch size is the
   baseline of every decision, but an engine that always drafts never measures it: the first
   plan for a batch-size bucket, and then one plan every ``explore_interval`` drafting steps of
   that bucket, drafts nothing; until the cost table has a plain step of that size (3 samples),
   one every 2 drafting steps, so that a new batch size stops planning with another size's costs
   within a few steps (the drafter hands the controller a new cost table as soon as it gains an
   entry). The default of 32 (one step in 33 plain, 3%) is chosen with the recorder's age bound
   on plain samples (``StepCostRecorder.max_plain_age``, 256 measured steps): the baseline is then
   the lower quartile of the ~8 plain steps of the last 256 steps of the bucket, never older, and
   stays measured when a few of those steps go unmeasured. A plain step taken while drafting
   gives up that step's drafting gain: at a 1.5x speedup, 3% plain steps cost ~1% of the
   throughput.

4. **Engine-wide acceptance prior** (``engine_prior``). A new request's acceptance estimate starts
   from the engine-wide per-token acceptance (discounted counts over every verification of every
   request) instead of the fixed optimistic ``prior_acceptance``, which is used only until the
   engine's first verification. A new request for which that prior already rules drafting out
   starts with drafting off, with the probe interval that failing probes last reached (reset to
   ``probe_interval`` when a probe brings a request back). Without this every new request re-pays
   the learning on a skip set whose drafts never land.

5. **Calibrated draft-exit floor** (``calibrated_exit``). The Draft & Verify threshold moves by
   ``0.1 * eps`` per verification, so with drafts that always land it takes hundreds of steps to
   stop exiting early. Every verified draft position also records the draft's top-1 probability and
   whether it was accepted, engine-wide, in ``calibration_bins`` probability bins. The exit
   threshold a request uses is ``min(th, floor)``, where ``floor`` is the lower edge of the lowest
   bin of the run of well-measured bins, from the top, whose acceptance is at least
   ``target_acceptance`` (bins with too little data are passed over; 1.0 when no bin qualifies: then
   the paper's threshold alone decides). Drafts of 0.3 confidence that land 95% of the time no
   longer stop a round.

Everything is deterministic: the same sequence of calls gives the same plans on every
tensor-parallel rank, provided every rank is given the same cost figures (measure on one rank and
broadcast them, or pass identical values).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from vllm_selfspec.control.observation import StepObservation
from vllm_selfspec.control.step_costs import StepCosts, bucket

logger = logging.getLogger("vllm.selfspec.controller")

_OVERRIDE_KEYS = ("num_speculative_tokens", "adaptive", "draft_confidence_threshold")
MAX_THRESHOLD = 0.999
# The user-facing defaults of draft_confidence_threshold and target_acceptance (config.py).
DEFAULT_EXIT_THRESHOLD = 0.6
DEFAULT_TARGET_ACCEPTANCE = 0.9


OVERRIDES_KEY = "selfspec"  # SamplingParams.extra_args[OVERRIDES_KEY]: the nested overrides
FLAT_PREFIX = "selfspec_"  # or flat extra_args entries (the OpenAI server's vllm_xargs)


def flat_overrides(extra: dict[str, Any]) -> dict[str, Any] | None:
    """Per-request overrides given as flat ``selfspec_<key>`` entries of ``extra_args``.

    The OpenAI server fills ``extra_args`` from the request's ``vllm_xargs``, whose values can only
    be strings, numbers or lists (no nested dict, and JSON ``true`` arrives as ``1``), so
    ``{"vllm_xargs": {"selfspec_num_speculative_tokens": 0}}`` is how an API client caps drafting.
    """
    flat = {k[len(FLAT_PREFIX) :]: v for k, v in extra.items() if k.startswith(FLAT_PREFIX)}
    if not flat:
        return None
    adaptive = flat.get("adaptive")
    if isinstance(adaptive, str) and adaptive.lower() in ("true", "false", "1", "0"):
        flat["adaptive"] = adaptive.lower() in ("true", "1")
    elif isinstance(adaptive, int) and not isinstance(adaptive, bool) and adaptive in (0, 1):
        flat["adaptive"] = bool(adaptive)
    k = flat.get("num_speculative_tokens")
    if isinstance(k, float) and k.is_integer():
        flat["num_speculative_tokens"] = int(k)
    elif isinstance(k, str) and k.strip().isdigit():
        flat["num_speculative_tokens"] = int(k)
    return flat


def request_overrides(
    extra_args: Mapping[str, Any] | None, k_max: int | None = None
) -> dict[str, Any] | None:
    """A request's validated selfspec overrides from its ``SamplingParams.extra_args`` (nested
    under OVERRIDES_KEY, or flat ``selfspec_<key>`` entries), None when it has none; raises
    ``ValueError`` as :func:`validate_request_overrides` does."""
    extra = dict(extra_args or {})
    raw = extra.get(OVERRIDES_KEY)
    if raw is None:
        raw = flat_overrides(extra)
        if raw is None:
            return None
    return validate_request_overrides(raw, k_max=k_max)


def running_request_overrides(
    extra_args: Callable[[str], Mapping[str, Any] | None],
    req_ids: Iterable[str],
    k_max: int,
    warned: set[str],
) -> dict[str, dict[str, Any]]:
    """The overrides of running requests, by request id, from ``extra_args(req_id)`` (the
    request's ``SamplingParams.extra_args``); requests without any are left out. Invalid
    ones were refused when the request arrived; should any reach a drafter, it drafts with the
    defaults and logs once per request (in ``warned``) rather than fail a running request."""
    out: dict[str, dict[str, Any]] = {}
    for req_id in req_ids:
        try:
            overrides = request_overrides(extra_args(req_id), k_max)
        except ValueError as exc:
            if req_id not in warned:
                warned.add(req_id)
                logger.warning("request %s: ignoring extra_args['selfspec']: %s", req_id, exc)
            continue
        if overrides:
            out[req_id] = overrides
    return out


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
    initial_threshold: float = DEFAULT_EXIT_THRESHOLD
    target_acceptance: float = DEFAULT_TARGET_ACCEPTANCE
    eps: float = 0.01
    threshold_momentum: float = 0.9  # th = momentum*th + (1-momentum)*new
    m_decay: float = 0.5  # m = m_decay*m + (1-m_decay)*(acc/drafted)
    prior_acceptance: float = 0.85  # optimistic per-token acceptance of a new request
    prior_weight: float = 2.0  # pseudo-trials behind the prior
    acceptance_decay: float = 0.7  # discount of old counts per verification
    prior_cost_ratio: float = 0.5  # a draft forward in plain steps, before any measurement
    probe_interval: int = 16
    max_probe_interval: int = 256
    probe_budget: int = 2
    engine_prior: bool = True  # new requests start from the engine-wide acceptance estimate
    engine_acceptance_decay: float = 0.95  # discount of engine-wide counts per verification
    probe_overhead: float = 0.02  # probes of a request cost at most this share of its time
    explore_interval: int = 32  # drafting steps of a batch-size bucket between plain steps
    calibrated_exit: bool = True  # lower the exit threshold where drafts are known to land
    calibration_bins: int = 10
    calibration_min_count: float = 8.0  # discounted verified drafts a bin needs to be trusted
    calibration_decay: float = 0.998  # discount of the calibration counts per verified draft
    min_gain: float = 0.10  # drafting must beat plain decoding by this share (measurement noise)

    def __post_init__(self) -> None:
        if isinstance(self.k_max, bool) or not isinstance(self.k_max, int) or self.k_max < 1:
            raise ValueError(f"k_max must be an int >= 1, got {self.k_max!r}")
        for name in ("initial_threshold", "target_acceptance", "threshold_momentum", "m_decay",
                     "prior_acceptance", "acceptance_decay", "engine_acceptance_decay",
                     "calibration_decay"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)!r}")
        if self.eps < 0 or self.prior_weight <= 0 or self.prior_cost_ratio < 0:
            raise ValueError("need eps >= 0, prior_weight > 0 and prior_cost_ratio >= 0")
        if not 1 <= self.probe_interval <= self.max_probe_interval or self.probe_budget < 1:
            raise ValueError("need 1 <= probe_interval <= max_probe_interval and probe_budget >= 1")
        if self.explore_interval < 0 or self.calibration_bins < 1:
            raise ValueError("need explore_interval >= 0 and calibration_bins >= 1")
        if not 0.0 <= self.min_gain < 1.0:
            raise ValueError(f"min_gain must be in [0, 1), got {self.min_gain!r}")


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
    off: bool = False  # drafting switched off: its drafts do not pay even alone
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
    explorations: int = 0
    verifications: int = 0
    drafted: int = 0
    accepted: int = 0


def expected_tokens(a: float, k: int) -> float:
    """Expected tokens from one verification of ``k`` drafts, per-token acceptance ``a``
    (clamped to ``[0, 1]``)."""
    a = min(max(a, 0.0), 1.0)
    if a >= 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def best_speedup(
    a: float,
    k_max: int,
    *,
    draft_cost: float,
    verify_cost: Callable[[int], float] | None = None,
    allow_zero: bool = True,
) -> tuple[float, int]:
    """The one speedup model of a single request's draft length: ``(rate, k)`` maximising
    ``E(a, k) / (verify_cost(k) + k * draft_cost)`` over ``k = 1 .. k_max``, costs in plain
    decoding steps (``verify_cost`` None: verification free, 1.0). With ``allow_zero``, ``k = 0``
    (plain decoding, rate 1.0) competes and wins unless drafting beats it. Ties go to the smaller
    ``k`` (a rate must beat the best so far by a relative 1e-12).

    The online search (verification free), the offline search (its linear cost model) and the
    benchmark analysis call this; the controller's batch plan extends it to a batch sharing one
    verification step. (Prompt-lookup drafts land as runs, not token by token: their lengths
    follow :class:`vllm_selfspec.control.source_choice.LookupAcceptance` instead.)"""
    best, best_k = (1.0, 0) if allow_zero else (0.0, 0)
    for k in range(1, int(k_max) + 1):
        v = 1.0 if verify_cost is None else verify_cost(k)
        rate = expected_tokens(a, k) / (v + k * draft_cost)
        if rate > best * (1.0 + 1e-12):
            best, best_k = rate, k
    return best, best_k


def expected_tokens_array(a: np.ndarray, k: np.ndarray) -> np.ndarray:
    """:func:`expected_tokens` element-wise (``a`` and ``k`` broadcast), for the batch plan,
    which prices every candidate row at every cap in one step. The scalar form stays plain Python
    because the per-request loops call it a few hundred times a step, where numpy's per-call
    overhead would cost more than the arithmetic; a unit test keeps the two equal."""
    a = np.clip(np.asarray(a, dtype=np.float64), 0.0, 1.0)
    k = np.asarray(k, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        geometric = (1.0 - a ** (k + 1.0)) / (1.0 - a)
    return np.where(a >= 1.0, k + 1.0, geometric)


class DraftLengthController:
    """Per-request draft budgets and exit thresholds; see the module docstring for the rules."""

    def __init__(self, config: ControllerConfig) -> None:
        self.config = config
        self._states: dict[str, _RequestState] = {}
        self._costs = StepCosts()
        self._priced = self._costs  # self._costs in one unit (see set_step_costs)
        self._prices: dict[tuple[Any, ...], Any] = {}  # see _memo
        self._window = _Window()
        # engine-wide discounted accepted / tried draft positions (the new requests' prior)
        self._engine_acc = 0.0
        self._engine_try = 0.0
        self._inherited_interval = config.probe_interval
        # drafting plans since the last plain plan, per batch-size bucket (absent: never planned)
        self._since_plain: dict[int, int] = {}
        # draft-exit calibration: discounted tried / accepted drafts per top-1 probability bin
        self._cal_try = np.zeros(config.calibration_bins)
        self._cal_acc = np.zeros(config.calibration_bins)
        self._exit_floor = 1.0
        self.explored_last_plan = False  # the last plan drafted nothing to measure a plain step

    @classmethod
    def for_settings(cls, settings: Any, k_max: int) -> DraftLengthController:
        """The controller of a drafter with these ``SelfSpecSettings`` (adaptive, exit threshold,
        target acceptance; Draft & Verify's constants otherwise)."""
        return cls(
            ControllerConfig(
                k_max=k_max,
                adaptive=settings.adaptive,
                initial_threshold=settings.draft_confidence_threshold,
                target_acceptance=settings.target_acceptance,
            )
        )

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

    def observe(self, observation: StepObservation) -> None:
        """One engine step: every verification of layer-skip drafts
        (:meth:`observe_verification`), then the state of requests that left the batch is
        dropped (:meth:`retain`)."""
        for v in observation.verified:
            self.observe_verification(v.req_id, drafted=v.drafted, accepted=v.accepted,
                                      confidences=v.confidences)
        self.retain(observation.req_ids)

    def retain(self, active_req_ids: Iterable[str]) -> None:
        """Drop the state of every request not in ``active_req_ids`` (unknown ids are ignored)."""
        keep = set(active_req_ids)
        for req_id in [r for r in self._states if r not in keep]:
            del self._states[req_id]

    def restart_acceptance(self, estimate: float | None = None) -> None:
        """The draft changed (online layer selection switched the skip set), so everything
        learnt about acceptance describes the old one. The engine-wide estimate restarts from
        ``estimate`` (the new set's measured matchness; ``prior_acceptance`` when None) behind
        ``prior_weight`` pseudo-trials, the draft-exit calibration is forgotten, and every active
        request restarts from that estimate with drafting on and the probe back-off reset.

        Without this, a poor starting set switched every request off with a low engine-wide
        prior that nothing updated any more (no drafts, so no verifications, and probes spaced
        for their cost are rarer than short requests are long): the set the search found was
        never drafted with (a tiny model: 1 drafting step in 352, after converging to an exact
        set)."""
        cfg = self.config
        a = cfg.prior_acceptance if estimate is None else min(max(float(estimate), 0.0), 1.0)
        self._engine_acc, self._engine_try = a * cfg.prior_weight, cfg.prior_weight
        self._inherited_interval = cfg.probe_interval
        self._cal_try[:] = 0.0
        self._cal_acc[:] = 0.0
        self._exit_floor = 1.0
        for st in self._states.values():
            st.acc_count, st.try_count, st.m = a * cfg.prior_weight, cfg.prior_weight, 0.0
            st.off, st.off_steps, st.interval, st.probing = False, 0, cfg.probe_interval, False

    def observe_verification(self, req_id: str, drafted: int, accepted: int,
                             confidences: Iterable[float] | None = None) -> None:
        """Record that ``accepted`` of ``drafted`` drafts of ``req_id`` passed verification.

        Updates the Draft & Verify threshold, the per-token acceptance estimate (draft positions
        up to and including the first rejection count as tried) and, given the drafts' top-1
        probabilities (``confidences``, in draft order), the draft-exit calibration.
        ``drafted == 0`` is a no-op."""
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
        if confidences is not None:
            self._calibrate(list(confidences)[:tried], accepted)

    # ---- draft-exit calibration --------------------------------------------------------------
    def _calibrate(self, confidences: list[float], accepted: int) -> None:
        if not confidences:
            return
        cfg = self.config
        nb = cfg.calibration_bins
        for j, conf in enumerate(confidences):
            if not math.isfinite(conf):
                continue
            b = min(max(int(conf * nb), 0), nb - 1)
            self._cal_try *= cfg.calibration_decay
            self._cal_acc *= cfg.calibration_decay
            self._cal_try[b] += 1.0
            self._cal_acc[b] += 1.0 if j < accepted else 0.0
        self._exit_floor = self._calibrated_floor()

    def _calibrated_floor(self) -> float:
        """Walking down from the top bin: the lower edge of the last well-measured bin before
        the first well-measured one whose acceptance misses ``target_acceptance`` (bins with
        too few verified drafts are passed over); 1.0 when none qualifies."""
        cfg = self.config
        nb = cfg.calibration_bins
        floor = 1.0
        for b in range(nb - 1, -1, -1):
            tried, acc = self._cal_try[b], self._cal_acc[b]
            if tried < cfg.calibration_min_count:
                continue  # no evidence either way: neither lowers the floor nor stops the walk
            if acc < cfg.target_acceptance * tried:
                break
            floor = b / nb
        return floor

    def exit_threshold(self, req_id: str) -> float:
        """The top-1 probability below which ``req_id`` stops drafting this round."""
        st = self._state(req_id)
        if self.config.calibrated_exit and not st.threshold_overridden:
            return min(st.threshold, self._exit_floor)
        return st.threshold

    # ---- costs -------------------------------------------------------------------------------
    def set_step_costs(self, costs: StepCosts) -> None:
        """Plan with these measured costs from now on (a snapshot of a
        :class:`~vllm_selfspec.control.step_costs.StepCostRecorder`; give every tensor-parallel
        rank the same one).

        Costs are combined only from a :meth:`StepCosts.comparable` table: a table with draft
        forwards (seconds) but no verification (then the unit 1.0) prices drafts with the prior
        (``prior_cost_ratio`` plain steps), as an empty one does."""
        self._costs = costs
        self._priced = costs.comparable()
        self._prices = {}

    def _memo(self, key: tuple[Any, ...], price: Callable[[], Any]) -> Any:
        """``price()``, computed once per cost table and ``key``. A table is immutable and
        serves ~16 steps (:mod:`vllm_selfspec.drafting.cost_feed`), while a step's planning asks
        for the same few prices hundreds of times (at batch 32 the batch plan, the probes'
        bound and the lookup choice asked ~50 interpolations a step: ~1 ms of Python beside a
        ~100 ms step, SmolLM2 on 2 CPU cores)."""
        value = self._prices.get(key)
        if value is None:
            if len(self._prices) >= _MAX_MEMO_ENTRIES:
                self._prices.clear()
            value = self._prices[key] = price()
        return value

    @property
    def step_costs(self) -> StepCosts:
        return self._costs

    def cost_ratio(self, batch_size: int) -> float:
        """One draft forward over the whole batch, in plain steps of that batch."""
        c = self._priced
        return self._memo(("draft", int(batch_size)), lambda: float(
            c.draft_cost(batch_size, batch_size, self.config.prior_cost_ratio)
        ) / c.plain_cost(batch_size))

    def verify_cost_ratio(self, batch_size: int, k: int | None = None) -> float:
        """Verifying ``k`` (default ``k_max``) drafts per request, in plain steps."""
        k = self.config.k_max if k is None else k
        c = self._priced
        # verification is priced per batch-size bucket (StepCosts.verify_cost)
        return self._memo(("verify", bucket(batch_size), float(k)), lambda: float(
            c.verify_cost(batch_size, float(k))) / c.plain_cost(batch_size))

    def draft_limit(self, batch_size: int) -> float:
        """Most draft tokens per request a step of ``batch_size`` may verify, layer-skip and
        lookup drafts alike: twice the most measured in its bucket, at least 1 (the ramp, rule
        2). A new batch size learns its verification cost from cheap steps before a costly one
        is risked on costs borrowed from another size or on the prior, which prices verification
        free: an engine whose first batch was 32 requests drafted 4 tokens each on it while its
        first cost samples came in, and on a CPU (Qwen2.5-Coder-0.5B, 2 cores) every such step
        took ~9 plain steps (verifying 4 drafts per request ~4.9, each draft forward ~1)."""
        # asked once per lookup token a step weighs: kept per table like the prices
        return self._memo(("limit", bucket(batch_size)),
                          lambda: max(1.0, 2.0 * self._costs.measured_x(batch_size)))

    def _standalone_lengths(self, acceptances: np.ndarray, caps: np.ndarray) -> np.ndarray:
        """Per request, the best ``k`` if it were alone: measured batch-size-1 costs, else the
        prior (free verification, a draft forward of ``prior_cost_ratio``); 0: drafting off.
        With no batch-size-1 verification measured, a measured batch-size-1 draft forward is not
        used either (it is in seconds, the unmeasured verification in plain steps): the prior.

        The batch size's own costs do not enter: a request that would draft alone but is left
        out of a large batch's plan is not off (its acceptance is known, there is nothing to
        probe; the plan takes it back as soon as the batch shrinks)."""
        cfg = self.config
        kmax = int(caps.max(initial=0))
        if kmax <= 0 or acceptances.size == 0:
            return np.zeros(acceptances.shape, dtype=np.int64)
        ks = np.arange(kmax + 1, dtype=np.float64)

        def alone_time() -> np.ndarray:
            c = self._costs.of_bucket(1).comparable()
            time = (np.asarray(c.verify_cost(1, ks))
                    + ks * float(c.draft_cost(1, 1, cfg.prior_cost_ratio)))
            return time / c.plain_cost(1)

        time = self._memo(("alone", kmax), alone_time)
        rate = expected_tokens_array(acceptances[:, None], ks[None, :]) / time[None, :]
        rate[:, 0] = 1.0
        rate = np.where(ks[None, :] <= caps[:, None], rate, -np.inf)
        # ties go to the smaller k: only a strict improvement over plain counts
        best = rate.argmax(axis=1)
        best_rate = rate[np.arange(len(best)), best]
        return np.where(best_rate > 1.0 + cfg.min_gain, best, 0)

    def _batch_plan(self, batch_size: int, acceptances: np.ndarray, caps: np.ndarray,
                    fixed: list[tuple[float, int]]) -> np.ndarray:
        """Budgets for the drafting candidates of one step (see the module docstring, rule 2).

        ``acceptances`` / ``caps``: the candidates; ``fixed``: ``(a, k)`` of rows whose budget is
        decided already (probes, non-adaptive requests, overrides). Candidates are taken in
        order of decreasing ``a``; for each common cap ``K`` and each count ``m`` of the best
        candidates drafting, tokens per second are computed from the measured costs; the best
        plan wins only if it beats the plan without candidates (ties: fewer drafts)."""
        cfg = self.config
        n = acceptances.size
        ks_out = np.zeros(n, dtype=np.int64)
        if n == 0:
            return ks_out
        c = self._priced
        b = float(batch_size)
        fixed_k = np.array([k for _, k in fixed if k > 0], dtype=np.int64)
        fixed_gain = float(sum(expected_tokens(a, k) - 1.0 for a, k in fixed if k > 0))
        fixed_extra = float(fixed_k.sum()) if fixed_k.size else 0.0
        kmax = int(caps.max())
        depth = max(kmax, int(fixed_k.max()) if fixed_k.size else 0)
        fixed_rows = np.array([(fixed_k >= j).sum() for j in range(depth + 1)], dtype=np.float64)

        order = np.lexsort((np.arange(n), -acceptances))
        a_sorted, cap_sorted = acceptances[order], caps[order]
        prior = cfg.prior_cost_ratio

        def step_time(extra: np.ndarray, rows_by_depth: list[np.ndarray]) -> np.ndarray:
            t = np.asarray(c.verify_cost(batch_size, extra / b), dtype=np.float64)
            for rows in rows_by_depth:
                t = t + np.asarray(c.draft_cost(rows, batch_size, prior), dtype=np.float64)
            return t

        base_time = step_time(np.array([fixed_extra]), [np.array([fixed_rows[j]])
                                                        for j in range(1, depth + 1)])[0]
        best_rate = base_rate = (b + fixed_gain) / base_time
        x_limit = self.draft_limit(batch_size)
        best = (0, 0)
        # row cap_k - 1, column m: the best m candidates drafting with the common cap cap_k
        # (every cap priced in one pass over the cost curves)
        kk = np.minimum(np.arange(1, kmax + 1)[:, None], cap_sorted[None, :])
        zero = np.zeros((kmax, 1))
        gain = np.hstack([zero, np.cumsum(expected_tokens_array(a_sorted, kk) - 1.0, axis=1)])
        extra = fixed_extra + np.hstack([zero, np.cumsum(kk, axis=1)])
        rows = [fixed_rows[j] + np.hstack([zero, np.cumsum(kk >= j, axis=1)])
                for j in range(1, depth + 1)]
        rates = (b + fixed_gain + gain) / step_time(extra, rows)
        rates[:, 1:] = np.where(extra[:, 1:] <= x_limit * b + 1e-9, rates[:, 1:], -np.inf)
        for cap_k in range(1, kmax + 1):
            rate = rates[cap_k - 1]
            m = int(rate[1:].argmax()) + 1
            if rate[m] > best_rate * (1.0 + 1e-9) and rate[m] > base_rate * (1.0 + cfg.min_gain):
                best_rate, best = float(rate[m]), (cap_k, m)
        cap_k, m = best
        if m:
            ks_out[order[:m]] = np.minimum(cap_k, cap_sorted[:m])
        return ks_out

    # ---- planning ----------------------------------------------------------------------------
    def plan(self, req_ids: Iterable[str],
             overrides: Mapping[str, Mapping[str, Any]] | None = None) -> list[int]:
        """Return, per request in ``req_ids``, how many drafts to make at most this step."""
        ids = list(req_ids)
        cfg = self.config
        states: list[_RequestState] = []
        was_probing: list[bool] = []
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
            was_probing.append(st.probing)
            st.probing = False
            states.append(st)

        budgets = [st.cap if (st.cap == 0 or not st.adaptive) else 0 for st in states]
        free = [i for i, st in enumerate(states) if st.cap > 0 and st.adaptive]
        explored = False
        if free:
            acc = np.array([states[i].acceptance for i in free])
            caps = np.array([states[i].cap for i in free], dtype=np.int64)
            alone = self._standalone_lengths(acc, caps)
            candidates: list[int] = []
            num_off = int((alone == 0).sum())
            for pos, i in enumerate(free):
                k = self._on_off(ids[i], states[i], int(alone[pos]), was_probing[i], len(ids),
                                 num_off)
                if k < 0:  # on: a candidate of the batch plan
                    candidates.append(i)
                else:  # off: 0, or a probe's budget
                    budgets[i] = k
            chosen = set(candidates)
            fixed = [(st.acceptance, budgets[i]) for i, st in enumerate(states)
                     if i not in chosen]
            if candidates and self._explore_due(len(ids), fixed):
                explored = True
                self._window.explorations += 1
            elif candidates:
                plan = self._batch_plan(
                    len(ids), np.array([states[i].acceptance for i in candidates]),
                    np.array([states[i].cap for i in candidates], dtype=np.int64), fixed)
                for i, k in zip(candidates, plan, strict=True):
                    budgets[i] = int(k)

        self.explored_last_plan = explored
        b = bucket(len(ids))
        drafting = any(k > 0 for k in budgets)
        self._since_plain[b] = self._since_plain.get(b, 0) + 1 if drafting else 0
        w = self._window
        for st, k in zip(states, budgets, strict=True):
            st.budget = k
            w.planned += 1
            w.planned_drafts += k
            w.planned_off += k == 0 and not explored
        return budgets

    def request_acceptance(self, req_id: str) -> float:
        """The per-token acceptance estimate of ``req_id``'s drafts."""
        return self._state(req_id).acceptance

    def request_cap(self, req_id: str) -> int:
        """``req_id``'s most drafts per step as of the last plan (``k_max`` or its override)."""
        return self._state(req_id).cap

    def _explore_due(self, batch_size: int, fixed: list[tuple[float, int]]) -> bool:
        """Whether this step should be a plain step to measure its cost (rule 3)."""
        cfg = self.config
        if cfg.explore_interval <= 0 or any(k > 0 for _, k in fixed):
            return False
        since = self._since_plain.get(bucket(batch_size))
        if since is None:
            return True
        if not self._costs.has_plain(batch_size) and since >= _EARLY_EXPLORE_INTERVAL:
            return True
        return since >= cfg.explore_interval

    def _on_off(self, req_id: str, st: _RequestState, alone: int, was_probing: bool,
                batch_size: int, num_off: int) -> int:
        """Drafting on/off and probes of one adaptive request: -1 when it is on (the batch plan
        decides its budget), else its budget (0, or a probe's)."""
        cfg = self.config
        first_plan = st.budget < 0
        if alone > 0:
            if st.off:
                logger.debug("request %s: drafting back on (a=%.3f)", req_id, st.acceptance)
                st.off, st.interval = False, cfg.probe_interval
                self._inherited_interval = cfg.probe_interval
            return -1
        if not st.off:
            logger.debug("request %s: drafting off (a=%.3f)", req_id, st.acceptance)
            # a request that starts off (the engine-wide prior) keeps the engine's probe back-off
            interval = self._inherited_interval if first_plan else cfg.probe_interval
            st.off, st.off_steps, st.interval = True, 0, interval
        elif was_probing:  # the probe did not bring the request back: back off
            st.interval = min(2 * st.interval, cfg.max_probe_interval)
            st.off_steps = 0
            self._inherited_interval = st.interval
        st.off_steps += 1
        if st.off_steps >= max(st.interval, self._min_probe_interval(batch_size, num_off)):
            st.off_steps, st.probing = 0, True
            self._window.probes += 1
            return min(cfg.probe_budget, st.cap)
        return 0

    def _min_probe_interval(self, batch_size: int = 1, num_off: int = 1) -> int:
        """Steps between probes of one request so that the probes of the ``num_off`` requests
        that are off in a batch of ``batch_size`` cost at most ``probe_overhead`` of the time.
        A probe costs its draft forwards (one row) plus the extra verification, and the whole
        batch waits for it. Only once costs have been measured (before that the configured
        schedule applies, also while only draft forwards are measured: their seconds cannot be
        set against an unmeasured verification); at most ``_MAX_COST_BOUND_INTERVAL``."""
        cfg = self.config
        c = self._priced
        if not c or cfg.probe_overhead <= 0:
            return 0
        pb = cfg.probe_budget
        b = max(int(batch_size), 1)

        def probe_cost() -> float:
            plain = c.plain_cost(b)
            return (float(c.verify_cost(b, pb / b)) - plain
                    + pb * float(c.draft_cost(1, b, cfg.prior_cost_ratio))) / plain

        cost = self._memo(("probe", b), probe_cost)
        steps = max(cost, 0.0) * max(int(num_off), 1) / cfg.probe_overhead
        return min(math.ceil(steps), _MAX_COST_BOUND_INTERVAL)

    def should_stop(self, req_id: str, top1_prob: float) -> bool:
        """Draft-exiting: True when ``top1_prob`` is below the request's exit threshold
        (:meth:`exit_threshold`).

        Never stops when adaptivity is off (globally or for the request) or during a probe
        (a probe must reach its budget to measure acceptance). NaN stops.
        """
        if not self.config.adaptive:
            return False
        st = self._state(req_id)
        if not st.adaptive or st.probing:
            return False
        return not top1_prob >= self.exit_threshold(req_id)

    def drafts_worth_verifying(self, req_id: str, confidences: list[float], budget: int,
                               marginal_verify_cost: float) -> int:
        """How many of ``budget`` drafts made already (a device pass: their draft forwards are
        spent) to hand to verification: the drafts before the first whose chained top-1
        probability (the chance that it and every draft before it land) is below
        ``marginal_verify_cost``, the plain steps one more draft token adds to its request's
        verification; a request that set its own ``draft_confidence_threshold`` also stops
        after its first draft below it (:meth:`should_stop`).

        Draft & Verify's engine-wide threshold decides when to stop *drafting*, which a pass
        that has run cannot: applied to a device pass it cut the drafts to about half of the
        forwards the plan had paid for, and the plan never learnt of it (acceptance is measured
        on the drafts verified, so it read 1.0 and kept planning passes that did not pay).

        The first draft is always handed over: its verification is the only feedback the plan
        gets (a tiny model's drafts, all of top-1 probability under 0.05, were all cut, the
        controller saw no verification and planned a pass at every step). All ``budget`` when
        adaptivity is off (globally or for the request) or during a probe; NaN counts as 0."""
        if not self.config.adaptive:
            return budget
        st = self._state(req_id)
        if not st.adaptive or st.probing:
            return budget
        chained = 1.0
        for j, conf in enumerate(confidences[:budget]):
            chained *= conf if math.isfinite(conf) else 0.0
            if j > 0 and marginal_verify_cost > 0.0 and chained < marginal_verify_cost:
                return j
            if st.threshold_overridden and self.should_stop(req_id, conf):
                return j + 1
        return budget

    def marginal_verify_cost(self, batch_size: int, k: int) -> float:
        """One more draft token of one request in a step whose requests verify ``k`` drafts
        each, in plain steps (``(v(k) - 1) / k``; 0 for ``k == 0`` and while verification is
        unmeasured)."""
        if k <= 0:
            return 0.0
        return max(0.0, (self.verify_cost_ratio(batch_size, k) - 1.0) / k)

    # ---- logging -----------------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        """Plain numbers for logging: window figures since :meth:`reset_stats_window`, and
        current per-request means."""
        w = self._window
        states = list(self._states.values())
        n = len(states)
        b = max(1, n)
        return {
            "num_requests": n,
            "mean_planned_draft_len": w.planned_drafts / w.planned if w.planned else 0.0,
            "drafting_off_share": w.planned_off / w.planned if w.planned else 0.0,
            "mean_threshold": sum(s.threshold for s in states) / n if n else 0.0,
            "exit_threshold_floor": self._exit_floor,
            "mean_acceptance_estimate": sum(s.acceptance for s in states) / n if n else 0.0,
            "engine_acceptance_estimate": self.engine_acceptance(),
            "acceptance_rate": w.accepted / w.drafted if w.drafted else 0.0,
            "drafted": w.drafted,
            "accepted": w.accepted,
            "probes": w.probes,
            "explorations": w.explorations,
            "planned_steps": w.planned,
            "cost_ratio": self.cost_ratio(b),
            "verify_cost_ratio": self.verify_cost_ratio(b),
            "plain_step_s": self._costs.plain_cost(b) if self._costs.verify else 0.0,
        }

    def reset_stats_window(self) -> None:
        """Start a new logging window (per-request state is kept)."""
        self._window = _Window()


_EARLY_EXPLORE_INTERVAL = 2  # drafting steps between plain steps until a plain cost is known
_MAX_COST_BOUND_INTERVAL = 4096  # the cost bound on probe intervals never exceeds this
_MAX_MEMO_ENTRIES = 4096  # prices kept per cost table (a bound: each step asks for a few)
