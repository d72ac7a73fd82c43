"""End-to-end confirmation with real vLLM engines: tokens/s and measured acceptance.

The same greedy requests go through a plain engine (the reference outputs and tokens/s) and a
selfspec engine per candidate (one engine at a time, each shut down before the next starts). In
the selfspec engine every prompt runs in three modes in turn, so that the load of a shared
machine drifts alike over all of them:

* ``off``: drafting switched off for the request (``num_speculative_tokens: 0``): the baseline
  the speedups are measured against (same engine, same moments);
* ``fixed``: every request drafts exactly ``k`` tokens per round (per-request override
  ``adaptive: false``), so vLLM's spec-decode counters give the per-token acceptance
  ``accepted / (accepted + rounds with a rejection)`` -- the quantity the search estimates -- as
  well as vLLM's own acceptance rate ``accepted / drafted``;
* ``adaptive``: the plugin's defaults (draft-exiting and the cost-aware controller), the
  production setting, for tokens/s.

This is the only module of the search that imports vLLM.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm_selfspec.layers.skip_set import SkipSet
from vllm_selfspec.tools.spec_decode_counters import counter_delta, read_spec_decode_counters


@dataclass
class EngineRun:
    outputs: list[list[int]]
    tokens_per_s: float
    spec: dict[str, Any] = field(default_factory=dict)


def _add(a: list[Any], b: list[Any]) -> list[Any]:
    return [x + y for x, y in zip(a, b, strict=False)]


def _same(a: Sequence[list[int]], b: Sequence[list[int]]) -> int:
    """How many outputs are token-identical."""
    return sum(x == y for x, y in zip(a, b, strict=True))


def acceptance_from_counters(spec: dict[str, Any], k: int) -> dict[str, float]:
    """vLLM's acceptance rate, and the per-token acceptance of fixed-``k`` drafting.

    With every round drafting ``k`` tokens, position ``i`` of a round is tried in the rounds
    whose first ``i`` drafts were accepted (``per_pos[i-1]``; all rounds for ``i = 0``), so the
    pooled per-token acceptance is ``sum(per_pos) / (rounds + sum(per_pos[:k-1]))``.
    """
    drafted = float(spec.get("num_draft_tokens", 0))
    accepted = float(spec.get("num_accepted_tokens", 0))
    rounds = float(spec.get("num_drafts", 0))
    per_pos = [float(x) for x in spec.get("num_accepted_tokens_per_pos", [])][:k]
    out = {"drafted": drafted, "accepted": accepted, "rounds": rounds}
    if drafted:
        out["acceptance_rate"] = accepted / drafted
        out["mean_accepted_length"] = 1 + accepted / rounds
        tried = rounds + sum(per_pos[: max(k - 1, 0)])
        if per_pos and tried:
            out["per_token_acceptance"] = sum(per_pos) / tried
        out["per_position_acceptance"] = [x / rounds for x in per_pos]
    return out


def _params(max_tokens: int, extra: dict[str, Any] | None) -> Any:
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens,
                          extra_args={"selfspec": extra} if extra else None)


def _run(
    llm: Any, prompts: Sequence[str], max_tokens: int, batch_size: int,
    extra: dict[str, Any] | None = None,
) -> EngineRun:
    params = _params(max_tokens, extra)
    before = read_spec_decode_counters(llm)
    start = time.perf_counter()
    results = []
    for i in range(0, len(prompts), batch_size):
        results += llm.generate(list(prompts[i : i + batch_size]), params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    outputs = [list(r.outputs[0].token_ids) for r in results]
    return EngineRun(outputs, sum(map(len, outputs)) / elapsed,
                     counter_delta(before, read_spec_decode_counters(llm)))


_MODES = {"off": {"num_speculative_tokens": 0}, "fixed": {"adaptive": False}, "adaptive": None}


def _run_interleaved(
    llm: Any, prompts: Sequence[str], max_tokens: int, batch_size: int, repeats: int
) -> dict[str, EngineRun]:
    """Each batch of prompts runs in every mode in turn (drafting off, fixed k, adaptive), so
    slow drifts of a shared machine's load hit all modes alike. Spec-decode counters are kept
    for the fixed-k requests only."""
    seconds = {m: 0.0 for m in _MODES}
    tokens = {m: 0 for m in _MODES}
    outputs: dict[str, list[list[int]]] = {m: [] for m in _MODES}
    counters: dict[str, Any] = {}
    for rep in range(repeats):
        for i in range(0, len(prompts), batch_size):
            batch = list(prompts[i : i + batch_size])
            for mode, extra in _MODES.items():
                before = read_spec_decode_counters(llm) if mode == "fixed" else None
                start = time.perf_counter()
                results = llm.generate(batch, _params(max_tokens, extra), use_tqdm=False)
                seconds[mode] += time.perf_counter() - start
                out = [list(r.outputs[0].token_ids) for r in results]
                tokens[mode] += sum(map(len, out))
                if rep == repeats - 1:
                    outputs[mode] += out
                if before is not None:
                    for key, value in counter_delta(before, read_spec_decode_counters(llm)).items():
                        if isinstance(value, list):
                            prev = counters.get(key) or [0] * len(value)
                            counters[key] = _add(prev, value)
                        else:
                            counters[key] = counters.get(key, 0) + value
    return {m: EngineRun(outputs[m], tokens[m] / seconds[m], counters if m == "fixed" else {})
            for m in _MODES}


@contextlib.contextmanager
def _engine(model_dir: str, spec: dict[str, Any] | None, engine_kwargs: dict[str, Any]):
    from vllm import LLM

    llm = LLM(model=str(model_dir), speculative_config=spec, **engine_kwargs)
    try:
        yield llm
    finally:
        with contextlib.suppress(Exception):
            llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def confirm_candidates(
    model_dir: str,
    prompts: Sequence[str],
    candidates: Sequence[tuple[SkipSet, int]],
    max_tokens: int = 64,
    batch_size: int = 1,
    repeats: int = 1,
    dtype: str = "float32",
    enforce_eager: bool = False,
    max_model_len: int = 2048,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Plain vLLM vs selfspec for each ``(skip set, k)``; returns a JSON-able report."""
    engine_kwargs: dict[str, Any] = dict(
        dtype=dtype, max_model_len=max_model_len, kv_cache_memory_bytes=1 << 30,
        disable_log_stats=False, seed=0, enforce_eager=enforce_eager,
        worker_extension_cls="vllm_selfspec.plugin.worker_ext.SelfSpecWorkerExtension",
    )
    warm = list(prompts[:1])
    log(f"confirm: plain vLLM on {len(prompts)} prompts, {max_tokens} greedy tokens, "
        f"batch size {batch_size}")
    with _engine(model_dir, None, engine_kwargs) as llm:
        _run(llm, warm, 8, 1)
        plain_runs = [_run(llm, prompts, max_tokens, batch_size) for _ in range(repeats)]
    plain_tps = statistics.median(r.tokens_per_s for r in plain_runs)
    plain_out = plain_runs[-1].outputs
    log(f"  plain: {plain_tps:.1f} tokens/s")
    report: dict[str, Any] = {"plain_tokens_per_s": plain_tps, "prompts": len(prompts),
                              "max_tokens": max_tokens, "batch_size": batch_size,
                              "plain_outputs": plain_out, "candidates": []}
    for skip, k in candidates:
        spec = {"method": "selfspec", "num_speculative_tokens": int(k),
                "skip_attention": list(skip.attention), "skip_mlp": list(skip.mlp)}
        log(f"confirm: selfspec k={k}, {skip.describe()}")
        with _engine(model_dir, spec, engine_kwargs) as llm:
            _run(llm, warm, 8, 1)
            runs = _run_interleaved(llm, prompts, max_tokens, batch_size, repeats)
            try:
                stats = llm.collective_rpc("selfspec_stats")[0]
            except Exception:  # noqa: BLE001 - diagnostics only
                stats = {}
        acc = acceptance_from_counters(runs["fixed"].spec, int(k))
        off = runs["off"].tokens_per_s
        # the drafter's medians: one draft forward, one plain step (the "off" runs measure it)
        draft_s = stats.get("draft_cost_s")
        step_s = stats.get("plain_step_s") or (stats.get("verify_cost_s") or {}).get("0")
        entry = {
            "skip_attention": list(skip.attention),
            "skip_mlp": list(skip.mlp),
            "k": int(k),
            **acc,
            "off_tokens_per_s": off,
            "fixed_tokens_per_s": runs["fixed"].tokens_per_s,
            "adaptive_tokens_per_s": runs["adaptive"].tokens_per_s,
            "speedup": runs["adaptive"].tokens_per_s / off,
            "fixed_speedup": runs["fixed"].tokens_per_s / off,
            "speedup_vs_plain_engine": runs["adaptive"].tokens_per_s / plain_tps,
            "identical_outputs": _same(plain_out, runs["fixed"].outputs),
            "identical_outputs_adaptive": _same(plain_out, runs["adaptive"].outputs),
            "identical_outputs_off": _same(plain_out, runs["off"].outputs),
            "vllm_draft_step_s": draft_s,
            "vllm_step_s": step_s,
            "vllm_draft_cost_ratio": draft_s / step_s if draft_s and step_s else None,
        }
        log(f"  per-token acceptance {entry.get('per_token_acceptance', float('nan')):.3f}, "
            f"vLLM acceptance rate {entry.get('acceptance_rate', float('nan')):.3f}; tokens/s: "
            f"drafting off {off:.1f}, fixed k {entry['fixed_tokens_per_s']:.1f} "
            f"({entry['fixed_speedup']:.2f}x), adaptive {entry['adaptive_tokens_per_s']:.1f} "
            f"({entry['speedup']:.2f}x); identical {entry['identical_outputs']}/{len(prompts)}")
        report["candidates"].append(entry)
    return report
