"""What a front end or a driver reads from the drafters in the workers.

``LLM(..., worker_extension_cls="vllm_selfspec.plugin.worker_ext.SelfSpecWorkerExtension")`` then
``llm.collective_rpc("selfspec_stats")`` returns one dict per worker.

:func:`source_totals` needs no extension: patch 10 adds it to every worker as the method
``selfspec_source_totals``, which the front end calls by name through ``collective_rpc`` when it
exports the per-source draft counters (:mod:`vllm_selfspec.plugin.metrics`).
"""

from __future__ import annotations

from typing import Any

from vllm_selfspec.control.observation import SourceTotals


def _drafter(worker: Any) -> Any:
    """The worker's selfspec drafter (it keeps :class:`SourceTotals`), or None."""
    drafter = getattr(getattr(worker, "model_runner", None), "drafter", None)
    return drafter if isinstance(getattr(drafter, "source_totals", None), SourceTotals) else None


def source_totals(worker: Any) -> tuple[int, dict[str, dict[str, int]]] | None:
    """``(data-parallel rank, the drafter's per-source totals)`` on the first tensor-parallel
    rank of an engine (every rank of an engine counts the same drafts, in lockstep), None on the
    others and on workers without a selfspec drafter."""
    drafter = _drafter(worker)
    if drafter is None:
        return None
    from vllm.distributed import get_tensor_model_parallel_rank

    if get_tensor_model_parallel_rank() != 0:
        return None
    parallel = worker.vllm_config.parallel_config
    return int(getattr(parallel, "data_parallel_rank", 0) or 0), drafter.source_totals.as_dict()


class SelfSpecWorkerExtension:
    model_runner: Any

    def selfspec_stats(self) -> dict[str, Any]:
        drafter = _drafter(self)
        return drafter.stats() if drafter is not None else {}
