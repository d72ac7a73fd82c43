"""Optional worker extension: lets a driver read the drafter's counters on every rank.

``LLM(..., worker_extension_cls="vllm_selfspec.plugin.worker_ext.SelfSpecWorkerExtension")`` then
``llm.collective_rpc("selfspec_stats")`` returns one dict per worker.
"""

from __future__ import annotations

from typing import Any


class SelfSpecWorkerExtension:
    model_runner: Any

    def selfspec_stats(self) -> dict[str, Any]:
        from vllm_selfspec.drafting.host_drafter import SelfSpecProposer

        drafter = getattr(self.model_runner, "drafter", None)
        if isinstance(drafter, SelfSpecProposer) or type(drafter).__name__ == (
            "SelfSpecDeviceProposer"
        ):
            return drafter.stats()
        return {}
