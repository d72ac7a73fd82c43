"""The offline layer-selection search: Optuna over the 2L skip choices, stored on disk.

Objective of a candidate skip set: the estimated speedup ``max_k E(a, k) / (k c_draft +
c_verify(k))`` (:mod:`vllm_selfspec.layers.search.cost`) with ``a`` its teacher-forced matchness
(:mod:`vllm_selfspec.layers.search.matchness`). The study lives in an SQLite file: stop the search
at any time (Ctrl-C) and run the same command again to continue; the references (the full model's
continuations) and the calibrated cost model are stored in the study, so resumed trials are
scored exactly like the first ones.

Trials, in order (each counts against the budget; a skip set is never scored twice):

1. ``seed``: sensible starting points -- the plugin's depth-based default (attention of a quarter
   of the layers in the upper half), attention of every other upper-half layer, and attention of
   every upper-half layer;
2. ``probe``: every searchable sub-layer skipped alone (a sensitivity scan);
3. ``greedy``: the ``m`` sub-layers with the best probe matchness (ties: the bigger saving
   first), for growing ``m`` while the estimate keeps improving;
4. ``tpe`` / ``gp``: Optuna's sampler over all searchable sub-layers for the rest of the budget;
   when it proposes a set already scored (it is told the stored score; that costs nothing and
   does not count), a ``local`` trial scores a random unseen neighbour (one or two flips) of one
   of the five best sets instead.

The budget counts scored skip sets.

Layers ``0 .. protect_first-1`` and the last ``protect_last`` layers are never skipped.
Imports neither vLLM nor matplotlib (the plot is drawn by :mod:`vllm_selfspec.layers.search.plot`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_selfspec.layers.matchness import MatchnessScorer
from vllm_selfspec.layers.search.cost import (
    COST_KINDS,
    LinearCostModel,
    SpeedupEstimate,
    estimate_speedup,
)
from vllm_selfspec.layers.search.matchness import CONTEXTS, HFMatchnessScorer, Reference
from vllm_selfspec.layers.skip_set import SkipSet

logger = logging.getLogger("vllm.selfspec.search")

STUDY_NAME = "selfspec-profile"
SAMPLERS = ("tpe", "gp")
PHASES = ("seed", "probe", "greedy", "tpe", "gp", "local")
_CONFIG_ATTR = "selfspec_config"
_REFS_ATTR = "selfspec_references"
_COST_ATTR = "selfspec_cost_model"
_WALL_ATTR = "selfspec_session_wall_s"


@dataclass
class SearchConfig:
    """Everything that decides the scores of a study (stored in it; a resume must match)."""

    model_dir: str
    prompts: str = "mtbench+humaneval"
    num_prompts: int = 16
    max_new_tokens: int = 64
    chat: str = "auto"
    budget: int = 200
    k_max: int = 8
    context: str = "target"
    cost: str = "measured"
    overhead: float = 0.1  # params cost model: fixed share of a step
    verify_slope: float = 0.0  # params cost model: extra verify cost per draft token
    step_overhead: float = 0.0  # engine overhead share of a step, paid by verification only
    protect_first: int = 1
    protect_last: int = 1
    sampler: str = "tpe"
    seed: int = 0
    dtype: str = "float32"
    device: str = "cpu"
    probes: bool = True
    greedy_patience: int = 3

    def validate(self) -> None:
        if self.context not in CONTEXTS:
            raise ValueError(f"context must be one of {CONTEXTS}, got {self.context!r}")
        if self.cost not in COST_KINDS:
            raise ValueError(f"cost must be one of {COST_KINDS}, got {self.cost!r}")
        if self.sampler not in SAMPLERS:
            raise ValueError(f"sampler must be one of {SAMPLERS}, got {self.sampler!r}")
        for name in ("num_prompts", "max_new_tokens", "budget", "k_max"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if not 0.0 <= self.step_overhead < 1.0:
            raise ValueError(f"step_overhead must be in [0, 1), got {self.step_overhead!r}")
        if self.protect_first < 0 or self.protect_last < 0:
            raise ValueError("protect_first / protect_last must be >= 0")

    def scoring_key(self) -> dict[str, Any]:
        """The settings that change a trial's score (a resumed study must have the same)."""
        keys = ("prompts", "num_prompts", "max_new_tokens", "chat", "k_max", "context", "cost",
                "protect_first", "protect_last", "dtype")
        out = {k: getattr(self, k) for k in keys}
        if self.cost == "params":
            out.update(overhead=self.overhead, verify_slope=self.verify_slope)
        if self.step_overhead:
            out["step_overhead"] = self.step_overhead
        return out


@dataclass
class ScoredSkipSet:
    """A scored skip set."""

    skip: SkipSet
    acceptance: float
    c_draft: float
    speedup: float
    k: int
    trial: int = -1
    phase: str = ""
    duplicate: bool = False  # a sampler proposal of an already scored set (not counted)

    def to_dict(self) -> dict[str, Any]:
        return {
            "skip_attention": list(self.skip.attention),
            "skip_mlp": list(self.skip.mlp),
            "acceptance": self.acceptance,
            "c_draft": self.c_draft,
            "speedup": self.speedup,
            "k": self.k,
            "trial": self.trial,
            "phase": self.phase,
        }


@dataclass
class SearchResult:
    config: SearchConfig
    best: ScoredSkipSet
    top: list[ScoredSkipSet]
    trials: list[ScoredSkipSet]  # every completed trial, in order
    cost_model: LinearCostModel
    prompt_source: str
    num_positions: int
    wall_s: float
    interrupted: bool = False
    info: dict[str, Any] = field(default_factory=dict)


def searchable_layers(num_layers: int, protect_first: int = 1, protect_last: int = 1) -> list[int]:
    return list(range(protect_first, max(protect_first, num_layers - protect_last)))


def seed_sets(num_layers: int, searchable: Sequence[int]) -> list[SkipSet]:
    """Starting points: attention skips in the upper half (published profiles cluster there)."""
    from vllm_selfspec.config import default_skip_set

    allowed = set(searchable)
    upper = [i for i in searchable if i >= num_layers // 2]
    out: list[SkipSet] = []
    for attention in (
        [i for i in default_skip_set(num_layers)[0] if i in allowed],
        upper[1::2],
        upper,
    ):
        s = SkipSet.of(attention)
        if s.size and s not in out:
            out.append(s)
    return out


# ---------------------------------------------------------------------------------- the search


def _param_name(kind: str, layer: int) -> str:
    return f"{kind}_{layer:03d}"


class LayerSearch:
    """One search over one study file. ``run()`` continues wherever the study stands."""

    def __init__(
        self,
        config: SearchConfig,
        storage: str | os.PathLike[str],
        *,
        fresh: bool = False,
        progress: bool = True,
        timeout_s: float | None = None,
        log: Callable[[str], None] | None = None,
        model: Any = None,
        tokenizer: Any = None,
    ) -> None:
        config.validate()
        self.config = config
        self.storage_path = Path(storage)
        self.fresh = fresh
        self.progress = progress
        self.timeout_s = timeout_s
        self.log = log or (lambda msg: logger.info("%s", msg))
        self.model = model
        self.tokenizer = tokenizer
        self._cache: dict[SkipSet, ScoredSkipSet] = {}
        self._trials: list[ScoredSkipSet] = []  # scored trials (no duplicates), in order
        self._duplicates = 0
        self._deadline: float | None = None
        self._bar: Any = None

    # ---- setup -------------------------------------------------------------------------------
    def _open_study(self) -> Any:
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self.storage_path.parent.mkdir(parents=True, exist_ok=True)
        if self.fresh:
            for suffix in ("", "-wal", "-shm"):
                Path(f"{self.storage_path}{suffix}").unlink(missing_ok=True)
        storage = open_storage(self.storage_path)
        cfg = self.config
        if cfg.sampler == "gp":
            sampler = optuna.samplers.GPSampler(seed=cfg.seed, n_startup_trials=10)
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                sampler = optuna.samplers.TPESampler(seed=cfg.seed, multivariate=True,
                                                     n_startup_trials=10)
        study = optuna.create_study(
            storage=storage, study_name=STUDY_NAME, direction="maximize", sampler=sampler,
            load_if_exists=True,
        )
        stored = study.user_attrs.get(_CONFIG_ATTR)
        mine = cfg.scoring_key()
        if stored is None:
            study.set_user_attr(_CONFIG_ATTR, mine)
        elif stored != mine:
            diffs = [f"{k}: study {stored.get(k)!r}, now {mine.get(k)!r}"
                     for k in sorted(set(stored) | set(mine)) if stored.get(k) != mine.get(k)]
            raise ValueError(
                f"the study {self.storage_path} was run with other settings ({'; '.join(diffs)}); "
                f"use the same settings to resume, --fresh to start over, or another --study"
            )
        return study

    def _load_model(self) -> None:
        if self.model is None:
            from vllm_selfspec.layers.search.matchness import load_model

            self.log(f"loading {self.config.model_dir} ({self.config.dtype}, {self.config.device})")
            self.model, self.tokenizer = load_model(
                self.config.model_dir, self.config.dtype, self.config.device
            )

    def _references(self, study: Any) -> tuple[list[Reference], str]:
        from vllm_selfspec.layers.search import prompts as prompt_sets

        cfg = self.config
        stored = study.user_attrs.get(_REFS_ATTR)
        if stored is not None:
            refs = [Reference(list(p), list(c)) for p, c in stored["references"]]
            return refs, stored["source"]
        texts, used_chat = prompt_sets.load_prompt_texts(
            cfg.prompts, cfg.num_prompts, self.tokenizer, cfg.chat
        )
        source = prompt_sets.describe(cfg.prompts, len(texts), used_chat)
        from vllm_selfspec.layers.search.matchness import generate_references

        self.log(f"generating reference continuations: {source}, {cfg.max_new_tokens} greedy "
                 f"tokens each (full model)")
        t0 = time.perf_counter()
        refs = generate_references(self.model, self.tokenizer, texts, cfg.max_new_tokens)
        self.log(f"  {sum(len(r.continuation) for r in refs)} tokens in "
                 f"{time.perf_counter() - t0:.0f} s")
        study.set_user_attr(
            _REFS_ATTR,
            {"source": source, "texts": texts,
             "references": [[r.prompt, r.continuation] for r in refs]},
        )
        return refs, source

    def _cost_model(self, study: Any, searchable: Sequence[int]) -> LinearCostModel:
        cfg = self.config
        stored = study.user_attrs.get(_COST_ATTR)
        if stored is not None:
            return LinearCostModel.from_dict(stored).with_step_overhead(cfg.step_overhead)
        if cfg.cost == "params":
            cost = LinearCostModel.from_parameters(self.model, cfg.overhead, cfg.verify_slope)
        else:
            self.log("measuring step costs (1-token steps with and without sub-layers) ...")
            cost = LinearCostModel.measure(self.model, searchable, k_max=cfg.k_max)
        study.set_user_attr(_COST_ATTR, cost.to_dict())
        return cost.with_step_overhead(cfg.step_overhead)

    # ---- trials ------------------------------------------------------------------------------
    def _distributions(self) -> dict[str, Any]:
        from optuna.distributions import IntDistribution

        dists = {}
        for layer in self.searchable:
            dists[_param_name("attn", layer)] = IntDistribution(0, 1)
            dists[_param_name("mlp", layer)] = IntDistribution(0, 1)
        return dists

    def _params(self, skip: SkipSet) -> dict[str, int]:
        params = {}
        for layer in self.searchable:
            params[_param_name("attn", layer)] = int(layer in skip.attention)
            params[_param_name("mlp", layer)] = int(layer in skip.mlp)
        return params

    def _skip_of(self, params: dict[str, Any]) -> SkipSet:
        attention = [i for i in self.searchable if params.get(_param_name("attn", i))]
        mlp = [i for i in self.searchable if params.get(_param_name("mlp", i))]
        return SkipSet.of(attention, mlp)

    def _score(self, skip: SkipSet) -> tuple[float, SpeedupEstimate]:
        result = self.scorer.score(skip)
        c_draft = self.cost.c_draft(skip)
        return result.matchness, estimate_speedup(result.matchness, c_draft, self.cost,
                                                  self.config.k_max)

    def _record(self, cand: ScoredSkipSet) -> None:
        if cand.duplicate:
            self._duplicates += 1
            return
        self._cache.setdefault(cand.skip, cand)
        self._trials.append(cand)
        if self._bar is not None:
            self._bar.update(1)
            best = self.best()
            if best is not None:
                self._bar.set_postfix_str(
                    f"best {best.speedup:.3f}x (a={best.acceptance:.3f}, k={best.k}, "
                    f"{len(best.skip.attention)} attn + {len(best.skip.mlp)} mlp)"
                )

    def _tell(self, trial: Any, skip: SkipSet, phase: str) -> ScoredSkipSet:
        import optuna

        cached = self._cache.get(skip)
        t0 = time.perf_counter()
        try:
            if cached is not None:
                a, c_draft = cached.acceptance, cached.c_draft
                est = estimate_speedup(a, c_draft, self.cost, self.config.k_max)
            else:
                a, est = self._score(skip)
                c_draft = est.c_draft
        except BaseException:  # Ctrl-C or an error: do not leave the trial RUNNING
            self.study.tell(trial, state=optuna.trial.TrialState.FAIL)
            raise
        trial.set_user_attr("score", {
            "phase": phase, "acceptance": a, "c_draft": c_draft, "k": est.k,
            "expected_tokens": est.expected_tokens, "duplicate": cached is not None,
            "seconds": round(time.perf_counter() - t0, 4),
        })
        self.study.tell(trial, est.speedup)
        cand = ScoredSkipSet(skip, a, c_draft, est.speedup, est.k, trial.number, phase,
                         duplicate=cached is not None)
        self._record(cand)
        return cand

    def _budget_left(self) -> int:
        left = self.config.budget - len(self._trials)
        if self._deadline is not None and time.monotonic() > self._deadline:
            return 0
        return left

    def evaluate(self, skip: SkipSet, phase: str) -> ScoredSkipSet | None:
        """Score a fixed skip set as a trial (cached sets cost nothing and add no trial)."""
        if skip in self._cache:
            return self._cache[skip]
        import optuna

        dists = self._distributions()
        params = self._params(skip)
        waiting = self.study.get_trials(deepcopy=False,
                                        states=(optuna.trial.TrialState.WAITING,))
        if not any(t.system_attrs.get("fixed_params", t.params) == params for t in waiting):
            # not already queued (e.g. by a run that stopped at its budget)
            self.study.enqueue_trial(params, user_attrs={"phase": phase})
        while self._budget_left() > 0:
            trial = self.study.ask(dists)
            got = self._skip_of(trial.params)
            got_phase = trial.user_attrs.get("phase", phase)
            cand = self._tell(trial, got, got_phase)
            if got == skip:
                return cand
        return None

    def _load_completed(self) -> None:
        import optuna

        for t in self.study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)):
            skip = self._skip_of(t.params)
            attrs = t.user_attrs.get("score")
            if not attrs:
                continue
            cand = ScoredSkipSet(skip, float(attrs["acceptance"]), float(attrs["c_draft"]),
                             float(t.value), int(attrs["k"]), t.number, attrs.get("phase", ""),
                             duplicate=bool(attrs.get("duplicate")))
            self._record(cand)

    # ---- results -----------------------------------------------------------------------------
    def best(self) -> ScoredSkipSet | None:
        ranked = self.ranked()
        return ranked[0] if ranked else None

    def ranked(self) -> list[ScoredSkipSet]:
        """Unique non-empty candidates, best estimated speedup first (ties: higher acceptance)."""
        cands = [c for c in self._cache.values() if c.skip.size]
        return sorted(cands, key=lambda c: (-c.speedup, -c.acceptance, c.trial))

    # ---- phases ------------------------------------------------------------------------------
    def _phases(self) -> Iterator[None]:
        cfg = self.config
        n = self.num_layers
        for skip in seed_sets(n, self.searchable):
            if self.evaluate(skip, "seed") is None:
                return
            yield
        if cfg.probes:
            probes: list[tuple[str, int, ScoredSkipSet]] = []
            for layer in self.searchable:
                for kind in ("attn", "mlp"):
                    skip = SkipSet.of([layer]) if kind == "attn" else SkipSet.of((), [layer])
                    cand = self.evaluate(skip, "probe")
                    if cand is None:
                        return
                    probes.append((kind, layer, cand))
                    yield
            # greedy prefixes of the probe ranking
            probes.sort(key=lambda p: (-p[2].acceptance, p[2].c_draft, p[0], p[1]))
            best_s, stale = -math.inf, 0
            for m in range(2, len(probes) + 1):
                chosen = probes[:m]
                skip = SkipSet.of([i for kind, i, _ in chosen if kind == "attn"],
                                  [i for kind, i, _ in chosen if kind == "mlp"])
                cand = self.evaluate(skip, "greedy")
                if cand is None:
                    return
                yield
                if cand.speedup > best_s + 1e-9:
                    best_s, stale = cand.speedup, 0
                else:
                    stale += 1
                if stale >= cfg.greedy_patience or cand.acceptance < 0.05:
                    break
        dists = self._distributions()
        repeats = 0
        while self._budget_left() > 0:
            trial = self.study.ask(dists)
            cand = self._tell(trial, self._skip_of(trial.params), cfg.sampler)
            if cand.duplicate:
                # the sampler repeats itself: Optuna has been told (it learns from it), and a
                # random unseen neighbour of a top candidate is scored instead
                repeats += 1
                neighbour = self._neighbour()
                if neighbour is None or repeats > 1000:
                    self.log("the search has converged: no unseen skip set near the best ones")
                    return
                if self.evaluate(neighbour, "local") is None:
                    return
            yield

    def _neighbour(self) -> SkipSet | None:
        """A random unscored non-empty set one or two flips away from a top-5 candidate."""
        import random

        ranked = self.ranked()[:5]
        if not ranked:
            return None
        rng = random.Random(self.config.seed * 1_000_003 + len(self._cache))
        bits = [(kind, layer) for layer in self.searchable for kind in ("attn", "mlp")]
        for _ in range(200):
            base = ranked[min(int(rng.expovariate(1.0)), len(ranked) - 1)].skip
            attention, mlp = set(base.attention), set(base.mlp)
            for kind, layer in rng.sample(bits, rng.choice((1, 1, 2))):
                target = attention if kind == "attn" else mlp
                target.symmetric_difference_update({layer})
            skip = SkipSet.of(attention, mlp)
            if skip.size and skip not in self._cache:
                return skip
        return None

    def run(self) -> SearchResult:
        t_start = time.perf_counter()
        self.study = self._open_study()
        self._load_model()
        from vllm_selfspec.layers.search.matchness import decoder_layers

        self.num_layers = len(decoder_layers(self.model))
        cfg = self.config
        self.searchable = searchable_layers(self.num_layers, cfg.protect_first, cfg.protect_last)
        if not self.searchable:
            raise ValueError(f"no searchable layers in a {self.num_layers}-layer model with "
                             f"protect_first={cfg.protect_first}, protect_last={cfg.protect_last}")
        refs, source = self._references(self.study)
        self.cost = self._cost_model(self.study, self.searchable)
        self.log(self.cost.summary())
        t0 = time.perf_counter()
        self.scorer: MatchnessScorer = HFMatchnessScorer(self.model, refs, context=cfg.context)
        self.log(f"scorer ready: {self.scorer.positions} positions over {len(refs)} prompts "
                 f"({cfg.context} context), {time.perf_counter() - t0:.1f} s")
        self._load_completed()
        done = len(self._trials)
        if done:
            self.log(f"resuming: {done} of {cfg.budget} trials already in {self.storage_path}")
        if self.timeout_s is not None:
            self._deadline = time.monotonic() + self.timeout_s
        interrupted = False
        if self.progress and done < cfg.budget:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=cfg.budget, initial=done, desc="selfspec-profile",
                             unit="trial", dynamic_ncols=True)
        try:
            for _ in self._phases():
                pass
        except KeyboardInterrupt:
            interrupted = True
        finally:
            if self._bar is not None:
                self._bar.close()
                self._bar = None
        ranked = self.ranked()
        if not ranked:
            raise RuntimeError("the search scored no non-empty skip set (budget too small?)")
        wall = time.perf_counter() - t_start
        sessions = self.study.user_attrs.get(_WALL_ATTR, [])
        sessions = [*sessions, round(wall, 1)]
        self.study.set_user_attr(_WALL_ATTR, sessions)
        return SearchResult(
            config=cfg,
            best=ranked[0],
            top=ranked[:10],
            trials=list(self._trials),
            cost_model=self.cost,
            prompt_source=source,
            num_positions=self.scorer.positions,
            wall_s=wall,
            interrupted=interrupted,
            info={"reference_disagreements": getattr(self.scorer, "reference_disagreements", 0),
                  "session_wall_s": sessions, "total_wall_s": round(sum(sessions), 1),
                  "duplicates": self._duplicates,
                  "num_layers": self.num_layers, "searchable": list(self.searchable),
                  "study": str(self.storage_path)},
        )


def open_storage(path: str | os.PathLike[str]) -> Any:
    """Optuna RDB storage on an SQLite file, in WAL mode with ``synchronous=NORMAL``: every
    trial is committed (an interrupted search loses at most the running trial) without an fsync
    per write (Optuna writes each parameter separately)."""
    import sqlite3

    import optuna

    file = str(Path(path).resolve())

    def connect() -> sqlite3.Connection:
        conn = sqlite3.connect(file, check_same_thread=False, timeout=60)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        return conn

    return optuna.storages.RDBStorage(f"sqlite:///{file}", engine_kwargs={"creator": connect})


def stored_prompt_texts(storage: str | os.PathLike[str]) -> list[str]:
    """The prompt texts a study was run with (for confirming on exactly the same prompts)."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.load_study(study_name=STUDY_NAME, storage=open_storage(storage))
    return list(study.user_attrs[_REFS_ATTR]["texts"])


def result_summary(result: SearchResult) -> dict[str, Any]:
    """JSON-able summary (for logs and ``--json``)."""
    return {
        "best": result.best.to_dict(),
        "top": [c.to_dict() for c in result.top],
        "trials": len(result.trials),
        "wall_s": result.wall_s,
        "interrupted": result.interrupted,
        "cost_model": result.cost_model.to_dict(),
        "prompt_source": result.prompt_source,
        "positions": result.num_positions,
        "config": dataclasses.asdict(result.config),
        **result.info,
    }


def dumps(obj: Any) -> str:
    return json.dumps(obj, indent=2, default=str)
