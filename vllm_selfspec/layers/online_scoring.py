"""On-the-fly layer selection inside the drafter: scoring passes over verified tokens.

:class:`OnlineSelector` drives :class:`~vllm_selfspec.layers.online_search.OnlineLayerSearch` from
the drafter. Once per engine step (between the verification of the previous drafts and the next
draft round, never inside a round) it may score candidate skip sets: for each candidate one
draft-mode forward over a *window* of the most recent verified tokens of the running requests,
teacher-forced (input: the tokens at positions ``q``), and matchness is the share of positions where
the draft's argmax equals the reference's (below).

No KV is written: every scored position gets slot ``-1`` (in the attention metadata and in the
forward context's per-layer slot mapping), which ``reshape_and_cache`` skips, so the verified
cache is never touched. Every scored position ``q`` is ``<= n - 2`` for a request of ``n`` tokens,
so its paged-cache slot already holds the full model's K/V.

What the attention of a window reads (vLLM's CPU backend, ``cpu_attn.py``): the kernel
``cpu_attention_with_kv_cache`` takes K/V **only from the paged cache** (the freshly computed
key/value of the window are used solely by the cache write, skipped here). Attending to
positions ``0..q`` would therefore give the draft at ``q`` the *full model's* K/V of ``q`` itself,
which leaks the full model's state of the scored token into the draft and made a 13-sub-layer set
of SmolLM2 score 0.75 while it accepted ~0.5 live. So the metadata gives each row the sequence
length ``q_last`` (not ``q_last + 1``): every query ``q`` attends to the verified full-model K/V of
positions ``0..q-1`` and not to its own slot. A real first draft of a round also sees its own
(draft) K/V on the diagonal; the scoring pass sees none, for every candidate alike.

Matchness targets are the argmax of a reference pass with nothing skipped under the same
attention (one extra forward per scoring step), so a score isolates the skipped sub-layers (a set
of zero-output layers scores exactly 1.0) and sampled requests are scored like greedy ones. The
reference's agreement with the emitted tokens is kept as a diagnostic (``reference_hits``).

Tensor parallel: every rank runs the same passes (the schedule is deterministic), the logits are
all-gathered by ``compute_logits`` so every rank computes the same scores, and the timings the
search decides with come from the step's
:class:`~vllm_selfspec.control.observation.StepObservation`: the drafter's cost table, rank 0's on
every rank. The selector's own cost, a step's scoring round, goes into that table's recorder and
is broadcast with it; the selector holds no clock and no collective of its own.
"""

from __future__ import annotations

import atexit
import datetime as _dt
import functools
import logging
import time
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from vllm_selfspec.control.observation import StepObservation
from vllm_selfspec.control.step_costs import StepCostRecorder
from vllm_selfspec.drafting.batch_forward import skip_model_logits
from vllm_selfspec.drafting.skip_forward import LayerSkipForward
from vllm_selfspec.layers.matchness import MatchResult
from vllm_selfspec.layers.online_search import (
    OnlineLayerSearch,
    OnlineSearchConfig,
    SubLayerCosts,
)
from vllm_selfspec.layers.skip_set import SkipSet
from vllm_selfspec.plugin.runner_view import RunnerView

logger = logging.getLogger("vllm.selfspec.online")



def sublayer_costs(target: torch.nn.Module, layers: Any, overhead: float = 0.1) -> SubLayerCosts:
    """A parameter-fraction cost model: each sub-layer's weights (with its pre-norm), plus the LM
    head and an ``overhead`` share of the step that skipping cannot remove."""

    def count(*modules: Any) -> float:
        return float(sum(p.numel() for m in modules if m is not None for p in m.parameters()))

    attention = tuple(count(layer.self_attn, layer.input_layernorm) for layer in layers)
    mlp = tuple(count(layer.mlp, layer.post_attention_layernorm) for layer in layers)
    head = count(getattr(target, "lm_head", None))
    weights = head + sum(attention) + sum(mlp)
    fixed = head + overhead * weights / (1.0 - overhead)
    return SubLayerCosts(attention, mlp, fixed)


class OnlineSelector:
    """Online layer selection for the drafter with ``layer_selection="online"``.

    The drafter calls :meth:`attach` once it has the target, then :meth:`step` once per engine
    step between the verification of its drafts and its next draft round; both return the skip
    set the drafter is to draft with from then on (``step``: only when it changed). The selector
    never touches the drafter: it reads the runner's input batch and paged cache through a
    :class:`~vllm_selfspec.plugin.runner_view.RunnerView` (read-only: its scoring passes write no
    KV) and runs its passes with :func:`~vllm_selfspec.drafting.batch_forward.skip_model_logits`.
    """

    def __init__(
        self,
        settings: Any,
        *,
        runner_view: RunnerView,
        vllm_config: Any,
        k_max: int,
        costs: StepCostRecorder,
        tp_rank: int = 0,
    ) -> None:
        self.runner_view = runner_view
        self.costs = costs  # the drafter's recorder: the selector's scoring rounds go in it
        self.vllm_config = vllm_config
        self.k_max = int(k_max)
        self.tp_rank = tp_rank
        self.config = OnlineSearchConfig.from_dict(settings.online_search)
        self.profile_out: str | None = settings.online_profile_out
        self.search: OnlineLayerSearch | None = None
        self.initial = SkipSet.of(settings.skip_attention, settings.skip_mlp)
        self.current = self.initial  # the set the drafter drafts with
        self.counters: dict[str, Any] = {
            "passes": 0,
            "scored_positions": 0,
            "switches": 0,
            "overhead_s": 0.0,
            "first_step_t": None,
            "last_step_t": None,
            "converged_at_step": None,
            "reference_hits": 0,
            "reference_positions": 0,
            "profile_written": None,
        }
        self.trace: list[dict[str, Any]] = []  # (engine step, incumbent, matchness) per change
        self._run: Any = None  # skip_model_logits bound to the runner and the target
        self._engine_steps = 0
        # the costs the search last decided with (from the observation's table), for stats
        self._pass_s: float | None = None
        self._verify_s: float | None = None
        self._draft_s: float | None = None
        self._announced_convergence = False
        self._finalizer: Any = None

    # ---- lifecycle ---------------------------------------------------------------------------

    def attach(self, forward: LayerSkipForward, target: torch.nn.Module) -> SkipSet:
        """Once the drafter has the target: build the search; returns the set to start with."""
        self._run = functools.partial(
            skip_model_logits, self.runner_view, self.vllm_config, forward, target
        )
        costs = sublayer_costs(target, forward.stack.layers)
        self.search = OnlineLayerSearch(
            forward.num_layers, self.k_max, self.config, costs, self.initial
        )
        self._adopt(self.search.incumbent)
        if self.profile_out and self.tp_rank == 0:
            ref = weakref.ref(self)
            self._finalizer = atexit.register(_write_at_exit, ref)
        logger.info(
            "selfspec online layer selection on TP rank %d: starting from %s; %s",
            self.tp_rank,
            self.search.incumbent.describe(),
            ", ".join(f"{k}={v}" for k, v in self.config.to_dict().items()),
        )
        return self.current

    @property
    def searching(self) -> bool:
        return self.search is not None and self.search.searching

    # ---- per step ----------------------------------------------------------------------------

    def step(self, observation: StepObservation) -> SkipSet | None:
        """One engine step (see :class:`~vllm_selfspec.control.observation.StepObservation`);
        scoring windows read the runner's token table, whose first ``num_tokens_no_spec[row]``
        tokens of a row all have the full model's K/V but the newest (scoring reads positions up
        to ``n - 2``). Returns the new skip set to draft with, or None when it is unchanged."""
        search = self.search
        if search is None:
            return None
        start = time.perf_counter()
        self._engine_steps += 1
        if self.counters["first_step_t"] is None:
            self.counters["first_step_t"] = time.time()
        self._apply_costs(observation)
        if not search.searching and search.observe_acceptance(
            observation.drafted, observation.accepted
        ):
            self._announced_convergence = False
            logger.info("selfspec online: acceptance drifted down; search restarted")
        if search.searching:
            if search.due():
                window = self._window(observation.decoding)
                if window is not None:
                    self._score(window)
            if not search.searching and not self._announced_convergence:
                self._on_converged()
        changed = self._adopt(search.incumbent)
        self.counters["overhead_s"] += time.perf_counter() - start
        self.counters["last_step_t"] = time.time()
        return self.current if changed else None

    def _adopt(self, cand: SkipSet) -> bool:
        """Make ``cand`` the set to draft with; returns whether it changed."""
        if cand == self.current:
            return False
        assert self.search is not None
        self.current = cand
        self.counters["switches"] += 1
        self.trace.append(
            {
                "engine_step": self._engine_steps,
                "skip_attention": list(cand.attention),
                "skip_mlp": list(cand.mlp),
                "matchness": self.search.matchness(cand),
            }
        )
        return True

    def _apply_costs(self, observation: StepObservation) -> None:
        """Hand the search the step's costs: identical on every rank (rank 0's table), so its
        decisions are too."""
        search = self.search
        assert search is not None
        draft_s, step_s = observation.draft_and_plain_seconds()
        pass_s = observation.costs.scoring
        self._draft_s, self._verify_s, self._pass_s = draft_s, step_s, pass_s
        if pass_s is not None and step_s is not None:
            search.set_pass_cost(pass_s, step_s)
        if draft_s is not None and step_s is not None:
            search.observe_costs(draft_s, step_s)

    # ---- windows and scoring passes ---------------------------------------------------------

    def _window(self, decoding: Sequence[bool]) -> dict[str, Any] | None:
        """The most recent verified generated tokens of the decoding requests (same on every
        rank: it depends only on the input batch)."""
        cfg = self.config
        view = self.runner_view
        num_prompt_tokens = view.num_prompt_tokens
        num_tokens_no_spec, token_ids_cpu = view.num_tokens_no_spec, view.token_ids_cpu
        rows: list[int] = []
        starts: list[int] = []
        lengths: list[int] = []
        total = 0
        for row, sampled in enumerate(decoding):
            if not sampled:
                continue
            n = int(num_tokens_no_spec[row])
            prompt = int(num_prompt_tokens[row])
            generated = n - prompt
            if generated < max(cfg.min_tokens, 2):
                continue
            # inputs at q in [first, n - 2] (K/V present), targets at q + 1 (generated tokens)
            # position 0 has no earlier key to attend to (see score_forward)
            first = max(prompt - 1, n - 1 - cfg.window, 1)
            length = n - 1 - first
            length = min(length, cfg.max_window_tokens - total)
            if length <= 0:
                break
            first = n - 1 - length
            rows.append(row)
            starts.append(first)
            lengths.append(length)
            total += length
        if not rows:
            return None
        positions = np.concatenate(
            [np.arange(s, s + w, dtype=np.int64) for s, w in zip(starts, lengths, strict=True)]
        )
        row_of_token = np.repeat(np.asarray(rows, dtype=np.int64), lengths)
        inputs = token_ids_cpu[row_of_token, positions].astype(np.int64)
        targets = token_ids_cpu[row_of_token, positions + 1].astype(np.int64)
        return {
            "rows": np.asarray(rows, dtype=np.int64),
            "lengths": np.asarray(lengths, dtype=np.int64),
            "positions": positions,
            "inputs": inputs,
            "targets": targets,
        }

    def _score(self, window: dict[str, Any]) -> None:
        search = self.search
        assert search is not None
        candidates = search.next_candidates()
        t0 = time.perf_counter()
        scorer = WindowMatchness(self._run, window, self.runner_view.device)
        self.counters["reference_hits"] += scorer.reference_hits
        self.counters["reference_positions"] += scorer.positions
        for cand in candidates:
            result = scorer.score(cand)
            self.counters["passes"] += 1
            self.counters["scored_positions"] += result.positions
            search.report(cand, result.matches, result.positions)
        if candidates:
            self.costs.observe_scoring(time.perf_counter() - t0)

    def _on_converged(self) -> None:
        assert self.search is not None
        self._announced_convergence = True
        self.counters["converged_at_step"] = self._engine_steps
        if self.tp_rank == 0:
            summary = self.search.summary()
            logger.info(
                "selfspec online search converged (%s) after %d passes: %s, matchness %s, "
                "estimated speedup %.3f",
                summary["converged_reason"],
                summary["steps"],
                self.search.incumbent.describe(),
                summary["matchness"],
                summary["estimated_speedup"],
            )
            self.write_profile()

    # ---- output ------------------------------------------------------------------------------

    def write_profile(self, path: str | None = None) -> str | None:
        """Write the best set found as a profile (rank 0 only); returns the path written."""
        path = path or self.profile_out
        if not path or self.search is None or self.tp_rank != 0:
            return None
        from pathlib import Path

        from vllm_selfspec.layers.profiles import ModelFingerprint, Profile
        from vllm_selfspec.plugin.engine_config import _text_config

        model_config = self.vllm_config.model_config
        name = Path(path).name.removesuffix(".json")
        fp = ModelFingerprint.from_hf_config(
            _text_config(model_config), name=str(model_config.model)
        )
        s = self.search.summary()
        k = int(s["draft_k"]) or self.k_max
        profile = Profile(
            name=name,
            model=fp,
            skip_attention=tuple(s["skip_attention"]),
            skip_mlp=tuple(s["skip_mlp"]),
            draft={"num_speculative_tokens": k},
            provenance={
                "method": (
                    "selfspec online layer selection while serving: teacher-forced matchness "
                    "over recently verified tokens (no KV writes), random + Optuna TPE "
                    "proposals, adaptive budget, parameter-fraction cost model scaled by "
                    "measured draft/verify step times"
                ),
                "source": f"live traffic, {self.counters['scored_positions']} scored positions",
                "acceptance": None if s["matchness"] is None else round(s["matchness"], 4),
                "date": _dt.date.today().isoformat(),
                "estimated_acceptance": (
                    None if s["matchness"] is None else round(s["matchness"], 4)
                ),
                "estimated_speedup": s["estimated_speedup"],
                "state": s["state"],
                "converged_reason": s["converged_reason"],
                "passes": s["total_steps"],
                "restarts": s["restarts"],
                "budget": s["budget"],
                "seed": self.config.seed,
                "k_max": self.k_max,
            },
        )
        profile.save(path)
        self.counters["profile_written"] = str(path)
        logger.info("selfspec online: wrote profile %s", path)
        return str(path)

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.counters)
        out["engine_steps"] = self._engine_steps
        out["initial_skip_attention"] = list(self.initial.attention)
        out["initial_skip_mlp"] = list(self.initial.mlp)
        out["pass_s"] = self._pass_s
        out["verify_step_s"] = self._verify_s
        out["draft_step_s"] = self._draft_s
        if self.search is not None:
            out.update(self.search.summary())
        out["trace"] = list(self.trace)
        out["history_tail"] = list(self.search.history[-100:]) if self.search is not None else []
        return out


def _write_at_exit(ref: weakref.ref) -> None:
    selector = ref()
    if selector is None or selector.search is None:
        return
    if selector.counters.get("profile_written") and not selector.search.searching:
        return
    try:
        selector.write_profile()
    except Exception as exc:  # never fail interpreter shutdown
        logger.warning("selfspec online: could not write the profile at exit: %s", exc)


def online_selector(
    settings: Any,
    runner_view: RunnerView,
    vllm_config: Any,
    k_max: int,
    costs: StepCostRecorder,
    tp_rank: int,
) -> OnlineSelector | None:
    """A drafter's online layer selection, or None unless ``layer_selection="online"``."""
    if settings.layer_selection != "online":
        return None
    return OnlineSelector(settings, runner_view=runner_view, vllm_config=vllm_config,
                          k_max=k_max, costs=costs, tp_rank=tp_rank)


class WindowMatchness:
    """The online :class:`~vllm_selfspec.layers.matchness.MatchnessScorer`: matchness of skip
    sets over one window of the running requests' verified tokens, on the served model.

    Construction runs the reference pass (nothing skipped) under the same attention as the
    candidates (no diagonal, see :func:`score_forward`): its argmax is the target, so a score
    isolates the skipped sub-layers; its agreement with the emitted tokens is kept as a
    diagnostic (``reference_hits``). Each :meth:`score` is one draft-mode forward."""

    def __init__(self, run: Any, window: dict[str, Any], device: torch.device) -> None:
        self._run = run
        self._window = window
        emitted = torch.from_numpy(window["targets"]).to(device)
        self._targets = score_forward(run, window, SkipSet((), ())).argmax(dim=-1)
        self.positions = int(self._targets.numel())
        self.reference_hits = int((self._targets == emitted).sum().item())

    def score(self, skip: SkipSet, keep_hits: bool = False) -> MatchResult:
        ok = score_forward(self._run, self._window, skip).argmax(dim=-1) == self._targets
        matches = int(ok.sum().item())
        hits: list[list[bool]] = []
        if keep_hits:  # per window row
            flat = ok.tolist()
            ends = np.cumsum(self._window["lengths"])
            hits = [flat[e - n:e] for e, n in zip(ends, self._window["lengths"], strict=True)]
        return MatchResult(matches / max(self.positions, 1), matches, self.positions, hits)


def score_forward(run: Any, window: dict[str, Any], cand: SkipSet) -> torch.Tensor:
    """Logits ``[tokens, vocab]`` of a draft-mode forward with skip set ``cand`` over ``window``,
    teacher-forced, reading the paged cache and writing no KV (slot -1 everywhere). ``run`` is
    :func:`~vllm_selfspec.drafting.batch_forward.skip_model_logits` bound to the runner and the
    target (``tests/online_kv_probe.py`` checks, byte for byte, that the paged cache is
    untouched)."""
    rows: np.ndarray = window["rows"]
    lengths: np.ndarray = window["lengths"]
    positions: np.ndarray = window["positions"]
    # The kernel treats a row's W queries as the last W positions of a sequence of length S and
    # lets query i see keys 0..S-W+i. With S = (last input position) instead of +1, every query q
    # sees the verified full-model K/V of positions 0..q-1 and NOT its own slot: the CPU backend
    # reads K/V only from the paged cache, so the diagonal would be the full model's K/V of q
    # itself, which leaks the full model's state of the scored token into the draft (measured on
    # SmolLM2: a 13-sub-layer set scored 0.75 that way, against ~0.5 live acceptance).
    ends = np.cumsum(lengths)
    query_start_cpu = torch.zeros(len(rows) + 1, dtype=torch.int32)
    query_start_cpu[1:] = torch.from_numpy(ends.astype(np.int32))
    return run(
        rows=rows,
        row_of_token=np.repeat(rows, lengths),
        positions=positions,
        tokens=window["inputs"],
        query_start_cpu=query_start_cpu,
        seq_lens_cpu=torch.from_numpy(positions[ends - 1].astype(np.int32)),
        max_query_len=int(lengths.max()),
        skip_attention=cand.attention,
        skip_mlp=cand.mlp,
        write_kv=False,
    )
