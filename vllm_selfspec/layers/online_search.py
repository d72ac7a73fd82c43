"""On-the-fly layer selection: the search algorithm, free of vLLM and torch.

The drafter of a ``layer_selection="online"`` engine improves its skip set while serving (SWIFT's
idea, see the design notes section 4): between draft rounds it scores candidate skip sets by
teacher-forced *matchness* over recently verified tokens (the scoring pass lives in
:mod:`vllm_selfspec.layers.online_scoring`) and adopts a candidate when its estimated speedup beats
the current one. This module decides *which* candidates to score and *when* to stop:

* **Proposals.** One candidate per scoring pass by default. Most are random sets of the current
  budget (fresh random sets, and local moves: the incumbent grown / shrunk to the budget, or one
  skipped sub-layer swapped for a kept one; a set is never scored twice); every
  ``bayes_every``-th is a Bayesian proposal (Optuna TPE ask/tell over one ``[0, 1]`` score per
  sub-layer, the ``budget`` highest-scored are skipped).
  Every scored candidate, random or not, is told to the Optuna study. Without Optuna installed the
  Bayesian proposals fall back to random ones.
* **Objective.** ``speedup = max_k E[tokens](a, k) / (k * c_draft + 1)`` with ``a`` the matchness
  (an estimate of the per-token acceptance of greedy drafts) and ``c_draft`` the draft step's cost
  relative to a verification step: a parameter-fraction model (:class:`SubLayerCosts`) scaled by
  the measured ratio of draft to verification time (:meth:`OnlineLayerSearch.observe_costs`).
* **Noise.** Candidates are scored on whatever traffic is running, so the incumbent (the set the
  drafter uses) is re-scored every ``incumbent_every``-th pass and its matchness is the pooled
  hit rate of all its passes.
* **Budget** (number of skipped sub-layers). Adaptive unless ``budget`` is given: after
  ``budget_trials`` candidates at one budget, the search moves to an unexplored neighbour
  (``best budget +- step``; upwards first when the best set reaches ``target_matchness``), halves
  the step once both neighbours are explored, and settles when the neighbours at step 1 are worse.
* **Stopping.** Converged when the budget has settled and the best set reaches
  ``target_matchness``, after ``patience`` passes without improvement, or after ``max_steps``
  passes. The scoring cadence is set from measured costs so that scoring stays under
  ``overhead_share`` of the step time (:meth:`OnlineLayerSearch.set_pass_cost`).
* **Restart.** After convergence the acceptance of live drafts is watched in windows of
  ``restart_window`` drafted tokens; a window more than ``restart_drop`` below the first window
  after convergence (new traffic, a change of task) restarts the search from the current set.

Every decision is a deterministic function of the seed and of the values passed in, so tensor
parallel ranks that see the same (all-gathered) scores and (broadcast) timings agree.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import Field, StrictBool, model_validator

from vllm_selfspec.control.controller import best_speedup, expected_tokens
from vllm_selfspec.layers.skip_set import SkipSet
from vllm_selfspec.schema import NonNegativeInt, PositiveInt, Schema, fraction

__all__ = [
    "SkipSet",
    "OnlineSearchConfig",
    "OnlineLayerSearch",
    "SubLayerCosts",
    "estimated_speedup",
    "expected_tokens",
]


def estimated_speedup(a: float, c_draft: float, k_max: int) -> tuple[float, int]:
    """:func:`~vllm_selfspec.control.controller.best_speedup` with verification free (the
    search's objective): ``(max over k in 1..k_max of E[tokens](a, k) / (k * c_draft + 1), that
    k)``; (1.0, 0) when no draft length beats plain decoding."""
    return best_speedup(a, k_max, draft_cost=c_draft)


@dataclass(frozen=True)
class SubLayerCosts:
    """Shares of one full model forward: each attention / MLP sub-layer, and the rest (``fixed``:
    embeddings, final norm, LM head, per-step overhead). Sums to 1 after :meth:`normalised`."""

    attention: tuple[float, ...]
    mlp: tuple[float, ...]
    fixed: float

    @classmethod
    def uniform(cls, num_layers: int, attention_share: float = 1 / 3, fixed: float = 0.1):
        """A parameter-fraction model without a model at hand: attention is ``attention_share``
        of a layer (Llama-style MLPs hold about twice the attention's weights)."""
        per_layer = (1.0 - fixed) / num_layers
        return cls(
            (per_layer * attention_share,) * num_layers,
            (per_layer * (1 - attention_share),) * num_layers,
            fixed,
        )

    def normalised(self) -> SubLayerCosts:
        total = self.fixed + sum(self.attention) + sum(self.mlp)
        if total <= 0 or not math.isfinite(total):
            raise ValueError(f"sub-layer costs must have a positive finite sum, got {total!r}")
        return SubLayerCosts(
            tuple(x / total for x in self.attention),
            tuple(x / total for x in self.mlp),
            self.fixed / total,
        )

    def kept_share(self, skip: SkipSet) -> float:
        """The share of a full forward a draft with ``skip`` still runs."""
        saved = sum(self.attention[i] for i in skip.attention) + sum(self.mlp[i] for i in skip.mlp)
        return max(1.0 - saved, 1e-6)


# ------------------------------------------------------------------------------------ config


_Fraction = fraction(low_open=True, high_open=False)  # (0, 1]


class OnlineSearchConfig(Schema):
    """Knobs of the online search (the ``online_search`` mapping of a selfspec config)."""

    WHERE = "online_search."

    seed: NonNegativeInt = 0
    target_matchness: _Fraction = 0.94
    patience: PositiveInt = 300
    max_steps: PositiveInt = 1000
    bayes_every: PositiveInt = 25
    candidates_per_step: PositiveInt = 1
    overhead_share: _Fraction = 0.10
    window: PositiveInt = 32
    max_window_tokens: PositiveInt = 256
    min_tokens: NonNegativeInt = 32
    incumbent_every: PositiveInt = 8
    budget: Annotated[
        PositiveInt | None, Field(description="null (adaptive) or an integer >= 1")
    ] = None
    budget_trials: PositiveInt = 20
    protect_first: NonNegativeInt = 1
    protect_last: NonNegativeInt = 1
    restart_drop: _Fraction = 0.15
    restart_window: PositiveInt = 256
    use_optuna: StrictBool = True

    @model_validator(mode="after")
    def _window_fits(self) -> OnlineSearchConfig:
        if self.max_window_tokens < self.window:
            raise ValueError(
                f"online_search.max_window_tokens ({self.max_window_tokens}) must be >= "
                f"online_search.window ({self.window})"
            )
        return self

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> OnlineSearchConfig:
        if d is None:
            return cls()
        if not isinstance(d, Mapping):
            raise ValueError(f"online_search must be a mapping of knobs, got {d!r}")
        return cls.validated(d, label="online_search")

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump()


# ------------------------------------------------------------------------------------ search


@dataclass
class _Record:
    hits: int = 0
    positions: int = 0

    @property
    def matchness(self) -> float:
        return self.hits / self.positions if self.positions else 0.0


class OnlineLayerSearch:
    """The state machine of the online search (see the module docstring)."""

    def __init__(
        self,
        num_layers: int,
        k_max: int,
        config: OnlineSearchConfig | None = None,
        costs: SubLayerCosts | None = None,
        initial: SkipSet | None = None,
    ) -> None:
        self.config = cfg = config or OnlineSearchConfig()
        if num_layers < 1 or k_max < 1:
            raise ValueError("num_layers and k_max must be >= 1")
        self.num_layers = num_layers
        self.k_max = k_max
        self.costs = (costs or SubLayerCosts.uniform(num_layers)).normalised()
        if len(self.costs.attention) != num_layers or len(self.costs.mlp) != num_layers:
            raise ValueError("costs must have one attention and one MLP entry per layer")
        lo, hi = cfg.protect_first, num_layers - cfg.protect_last
        self.choices: tuple[tuple[str, int], ...] = tuple(
            (kind, i) for kind in ("a", "m") for i in range(lo, hi)
        )
        if not self.choices:
            raise ValueError(
                f"online search: no sub-layer of a {num_layers}-layer model may be skipped with "
                f"protect_first={cfg.protect_first}, protect_last={cfg.protect_last}"
            )
        n_sub = len(self.choices)
        self.rng = random.Random(cfg.seed)
        initial = initial or SkipSet((), ())
        if initial.size == 0:
            # nothing to start from: skip the attention of about a sixth of the layers
            initial = self._random_set(max(1, n_sub // 12), self.rng)
        self.incumbent = initial
        self.budget = cfg.budget if cfg.budget is not None else max(1, min(initial.size, n_sub))
        self.budget = min(self.budget, n_sub)
        self.budget_step = max(1, n_sub // 8)
        self.draft_ratio = 1.0  # measured draft-step time / verification-step time, full model
        self.score_interval = 1  # score on every ``score_interval``-th call of :meth:`due`
        self.state = "searching"
        self.history: list[dict[str, Any]] = []
        self.restarts = 0
        self.converged_reason: str | None = None
        self._records: dict[SkipSet, _Record] = {}
        self._reset_search()
        self._acc_window = [0, 0]
        self._acc_baseline: float | None = None
        self._calls = 0
        self._study: Any = None
        self._optuna_failed = not cfg.use_optuna
        self._pending_trials: dict[SkipSet, Any] = {}

    # ---- public API ----------------------------------------------------------------------

    @property
    def searching(self) -> bool:
        return self.state == "searching"

    def due(self) -> bool:
        """Called once per engine step: whether to run scoring passes now (deterministic)."""
        if not self.searching:
            return False
        self._calls += 1
        return self._calls % self.score_interval == 0

    def next_candidates(self) -> list[SkipSet]:
        """The candidates for this step's scoring passes (empty when converged)."""
        if not self.searching:
            return []
        out: list[SkipSet] = []
        for _ in range(self.config.candidates_per_step):
            self.steps += 1
            inc = self._records.get(self.incumbent)
            if inc is None or inc.positions == 0 or self.steps % self.config.incumbent_every == 0:
                cand = self.incumbent
            elif self.steps % self.config.bayes_every == 0:
                cand = self._bayes_candidate()
            else:
                # never re-score a set (except the incumbent): a few tries for a fresh one
                for _ in range(20):
                    local = self.rng.random() < (0.5 if self.incumbent.size == self.budget else 0.7)
                    cand = self._local_move() if local else self._random_set(self.budget, self.rng)
                    if cand not in self._records:
                        break
            if cand not in out:
                out.append(cand)
        return out

    def report(self, candidate: SkipSet, hits: int, positions: int) -> bool:
        """Record a scoring pass of ``candidate``; returns True when the incumbent changed."""
        if positions <= 0:
            return False
        rec = self._records.setdefault(candidate, _Record())
        rec.hits += int(hits)
        rec.positions += int(positions)
        obj = self.objective(candidate)
        self._tell_optuna(candidate, obj)
        self.history.append(
            {
                "step": self.steps,
                "budget": self.budget,
                "size": candidate.size,
                "set": [list(candidate.attention), list(candidate.mlp)],
                "matchness": round(hits / positions, 4),
                "objective": round(obj, 4),
                "incumbent": candidate == self.incumbent,
            }
        )
        changed = False
        if candidate != self.incumbent:
            self.budget_scored += 1
            if obj > self.objective(self.incumbent) * (1 + 1e-3):
                self.incumbent = candidate
                changed = True
        best_here = self.budget_best.get(candidate.size)
        if candidate.size == self.budget and (best_here is None or obj > best_here[0]):
            self.budget_best[self.budget] = (obj, candidate)
        if obj > self.best_objective * (1 + 1e-3) and candidate == self.incumbent:
            self.best_objective = obj
            self.since_improvement = 0
        else:
            self.since_improvement += 1
        if self.budget_scored >= self.config.budget_trials:
            self._move_budget()
        self._check_convergence()
        return changed

    def objective(self, candidate: SkipSet) -> float:
        """Estimated speedup of ``candidate`` over plain decoding (1.0 when never scored)."""
        rec = self._records.get(candidate)
        if rec is None or rec.positions == 0:
            return 1.0
        return estimated_speedup(rec.matchness, self.c_draft(candidate), self.k_max)[0]

    def matchness(self, candidate: SkipSet) -> float | None:
        rec = self._records.get(candidate)
        return rec.matchness if rec and rec.positions else None

    def c_draft(self, candidate: SkipSet) -> float:
        return self.draft_ratio * self.costs.kept_share(candidate)

    def observe_costs(self, draft_step_s: float, verify_step_s: float) -> None:
        """Measured seconds per draft step of the incumbent and per verification step."""
        if draft_step_s > 0 and verify_step_s > 0:
            ratio = draft_step_s / verify_step_s / self.costs.kept_share(self.incumbent)
            self.draft_ratio = min(max(ratio, 0.05), 5.0)

    def set_pass_cost(self, pass_s: float, step_s: float) -> None:
        """Scoring every ``m``-th step costs ``pass_s / (m * step_s + pass_s)`` of the time:
        pick the smallest ``m`` that keeps it under ``overhead_share``."""
        share = self.config.overhead_share
        if pass_s <= 0 or step_s <= 0 or share >= 1:
            self.score_interval = 1
            return
        self.score_interval = max(1, math.ceil(pass_s * (1 - share) / (share * step_s) - 1e-9))

    def observe_acceptance(self, drafted: int, accepted: int) -> bool:
        """Live acceptance after convergence; returns True when the search restarts."""
        if self.searching or drafted <= 0:
            return False
        self._acc_window[0] += drafted
        self._acc_window[1] += accepted
        if self._acc_window[0] < self.config.restart_window:
            return False
        rate = self._acc_window[1] / self._acc_window[0]
        self._acc_window = [0, 0]
        if self._acc_baseline is None:
            self._acc_baseline = rate
            return False
        if rate < self._acc_baseline - self.config.restart_drop:
            self.restart(f"acceptance fell from {self._acc_baseline:.2f} to {rate:.2f}")
            return True
        return False

    def restart(self, reason: str) -> None:
        self.restarts += 1
        self.history.append({"step": self.steps, "restart": reason})
        self._records.clear()  # scores were measured on the old traffic
        self._reset_search()
        self._study = None
        self._pending_trials.clear()
        self.state = "searching"
        self.converged_reason = None
        self._acc_baseline = None

    def summary(self) -> dict[str, Any]:
        inc = self.incumbent
        return {
            "state": self.state,
            "converged_reason": self.converged_reason,
            "steps": self.steps,
            "total_steps": self.total_steps + self.steps,
            "restarts": self.restarts,
            "budget": self.budget,
            "skip_attention": list(inc.attention),
            "skip_mlp": list(inc.mlp),
            "matchness": self.matchness(inc),
            "scored_positions": self._records[inc].positions if inc in self._records else 0,
            "estimated_speedup": round(self.objective(inc), 4),
            "draft_k": estimated_speedup(
                self.matchness(inc) or 0.0, self.c_draft(inc), self.k_max
            )[1],
            "draft_ratio": round(self.draft_ratio, 4),
            "score_interval": self.score_interval,
            "candidates_scored": len(self._records),
        }

    # ---- internals -----------------------------------------------------------------------

    def _reset_search(self) -> None:
        self.total_steps = getattr(self, "total_steps", 0) + getattr(self, "steps", 0)
        self.steps = 0
        self.since_improvement = 0
        self.best_objective = 1.0
        self.budget_scored = 0
        self.budget_best: dict[int, tuple[float, SkipSet]] = {}
        self.budget_blocks: dict[int, int] = {}
        self.budget_settled = self.config.budget is not None
        self.budget_step = max(1, len(self.choices) // 8)

    def _to_candidate(self, chosen: Iterable[tuple[str, int]]) -> SkipSet:
        chosen = list(chosen)
        return SkipSet.of(
            (i for kind, i in chosen if kind == "a"), (i for kind, i in chosen if kind == "m")
        )

    def _members(self, cand: SkipSet) -> set[tuple[str, int]]:
        return {("a", i) for i in cand.attention} | {("m", i) for i in cand.mlp}

    def _random_set(self, size: int, rng: random.Random) -> SkipSet:
        return self._to_candidate(rng.sample(self.choices, min(size, len(self.choices))))

    def _local_move(self) -> SkipSet:
        """From the incumbent (or the best set of the current budget when that is at least as
        good): resize it to the budget, or, when it already has the budget's size, swap one
        skipped sub-layer for a kept one."""
        base = self.incumbent
        best_here = self.budget_best.get(self.budget)
        if best_here is not None and best_here[0] >= self.objective(self.incumbent):
            base = best_here[1]
        members = self._members(base) & set(self.choices)
        others = [c for c in self.choices if c not in members]
        resized = len(members) != self.budget
        while len(members) > self.budget:
            members.remove(self.rng.choice(sorted(members)))
        while len(members) < self.budget and others:
            pick = self.rng.choice(others)
            others.remove(pick)
            members.add(pick)
        if not resized and members and others:
            members.remove(self.rng.choice(sorted(members)))
            members.add(self.rng.choice(others))
        return self._to_candidate(members)

    def _param_name(self, choice: tuple[str, int]) -> str:
        return f"{choice[0]}{choice[1]}"

    def _ensure_study(self) -> Any:
        if self._study is not None or self._optuna_failed:
            return self._study
        try:
            import optuna
        except ImportError:
            self._optuna_failed = True
            return None
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        sampler = optuna.samplers.TPESampler(
            seed=self.config.seed + self.restarts, n_startup_trials=10
        )
        self._study = optuna.create_study(direction="maximize", sampler=sampler)
        return self._study

    def _bayes_candidate(self) -> SkipSet:
        study = self._ensure_study()
        if study is None:
            return self._random_set(self.budget, self.rng)
        from optuna.distributions import FloatDistribution

        trial = study.ask({self._param_name(c): FloatDistribution(0.0, 1.0) for c in self.choices})
        ranked = sorted(self.choices, key=lambda c: (-trial.params[self._param_name(c)], c))
        cand = self._to_candidate(ranked[: self.budget])
        self._pending_trials[cand] = trial
        return cand

    def _tell_optuna(self, cand: SkipSet, obj: float) -> None:
        study = self._ensure_study()
        if study is None:
            return
        import optuna
        from optuna.distributions import FloatDistribution

        trial = self._pending_trials.pop(cand, None)
        if trial is not None:
            study.tell(trial, obj)
            return
        members = self._members(cand)
        params = {self._param_name(c): (1.0 if c in members else 0.0) for c in self.choices}
        dists = {self._param_name(c): FloatDistribution(0.0, 1.0) for c in self.choices}
        study.add_trial(optuna.trial.create_trial(params=params, distributions=dists, value=obj))

    def _move_budget(self) -> None:
        self.budget_scored = 0
        if self.budget_settled:
            return
        n_sub = len(self.choices)
        best_b = max(self.budget_best, key=lambda b: (self.budget_best[b][0], -b), default=None)
        if best_b is None:
            return
        best_obj, best_cand = self.budget_best[best_b]
        self.budget_blocks[self.budget] = self.budget_blocks.get(self.budget, 0) + 1
        up_first = (self.matchness(best_cand) or 0.0) >= self.config.target_matchness
        while True:
            order = (1, -1) if up_first else (-1, 1)
            for sign in order:
                nb = best_b + sign * self.budget_step
                # growing a set that reaches the target: a budget explored from a worse
                # incumbent gets a second block (local moves then grow the new incumbent)
                blocks = 2 if sign > 0 and up_first else 1
                if 1 <= nb <= n_sub and self.budget_blocks.get(nb, 0) < blocks:
                    self.budget = nb
                    self.history.append({"step": self.steps, "budget_to": nb})
                    return
            if self.budget_step == 1:
                self.budget = best_b
                self.budget_settled = True
                self.history.append({"step": self.steps, "budget_settled": best_b})
                return
            self.budget_step = max(1, self.budget_step // 2)

    def _check_convergence(self) -> None:
        cfg = self.config
        reason = None
        inc_match = self.matchness(self.incumbent) or 0.0
        if self.budget_settled and inc_match >= cfg.target_matchness:
            if self.budget_best.get(self.budget, (0.0, None))[1] == self.incumbent:
                reason = f"matchness {inc_match:.3f} >= {cfg.target_matchness}"
        if reason is None and self.since_improvement >= cfg.patience:
            reason = f"{cfg.patience} passes without improvement"
        if reason is None and self.steps >= cfg.max_steps:
            reason = f"{cfg.max_steps} passes"
        if reason is not None:
            self.state = "converged"
            self.converged_reason = reason
            self._acc_window = [0, 0]
            self._acc_baseline = None
            self.history.append({"step": self.steps, "converged": reason})
