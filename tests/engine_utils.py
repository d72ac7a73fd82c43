"""Helpers shared by the end-to-end tests: start/stop real vLLM engines, read their counters."""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterator, Sequence
from typing import Any

ENGINE_DEFAULTS: dict[str, Any] = {
    "dtype": "float32",  # random-weight models have near ties: compare in fp32 only
    "enforce_eager": True,
    "max_model_len": 192,
    "kv_cache_memory_bytes": 1 << 27,
    "disable_log_stats": False,  # spec-decode counters need stats
    "seed": 0,
    "worker_extension_cls": "vllm_selfspec.plugin.worker_ext.SelfSpecWorkerExtension",
}


@contextlib.contextmanager
def engine(model_dir: os.PathLike | str, speculative_config: dict | None = None, **kw: Any):
    """A vLLM ``LLM`` that is shut down (engine core and workers) on exit."""
    from vllm import LLM

    args = {**ENGINE_DEFAULTS, **kw}
    llm = LLM(model=str(model_dir), speculative_config=speculative_config, **args)
    try:
        yield llm
    finally:
        shutdown(llm)


def shutdown(llm: Any) -> None:
    with contextlib.suppress(Exception):
        llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def token_ids(outputs: Sequence[Any]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def spec_metrics(llm: Any) -> dict[str, Any]:
    """vLLM's own spec-decode counters (``vllm:spec_decode_*``), summed over engines."""
    from vllm_selfspec.tools.spec_decode_counters import read_spec_decode_counters

    return read_spec_decode_counters(llm)


def acceptance_rate(llm: Any) -> float:
    m = spec_metrics(llm)
    assert m.get("num_draft_tokens", 0) > 0, f"no drafts were verified: {m}"
    return m["num_accepted_tokens"] / m["num_draft_tokens"]


class MetricsWindow:
    """Difference of the spec-decode counters across a block of requests."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self.before = spec_metrics(llm)

    def delta(self) -> dict[str, float]:
        after = spec_metrics(self.llm)
        return {
            k: after.get(k, 0) - self.before.get(k, 0)
            for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
        }

    def acceptance(self) -> float:
        d = self.delta()
        assert d["num_draft_tokens"] > 0, f"no drafts were verified: {d}"
        return d["num_accepted_tokens"] / d["num_draft_tokens"]


def drafter_stats(llm: Any) -> list[dict[str, Any]]:
    """The selfspec drafter's counters from every worker."""
    return llm.collective_rpc("selfspec_stats")


@contextlib.contextmanager
def env(**values: str) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
