"""Optional worker extension: lets a driver read the drafter's counters on every rank.

``LLM(..., worker_extension_cls="vllm_selfspec.worker_ext.SelfSpecWorkerExtension")`` then
``llm.collective_rpc("selfspec_stats")`` returns one dict per worker.
"""

from __future__ import annotations

from typing import Any


class SelfSpecWorkerExtension:
    model_runner: Any

    def selfspec_stats(self) -> dict[str, Any]:
        from vllm_selfspec.proposer import SelfSpecProposer

        drafter = getattr(self.model_runner, "drafter", None)
        if isinstance(drafter, SelfSpecProposer) or type(drafter).__name__ == (
            "SelfSpecDeviceProposer"
        ):
            return drafter.stats()
        return {}

    def selfspec_online_arm_kv_check(self, count: int = 1, write_slots: bool = False) -> bool:
        """Test hook of online layer selection: byte-compare the paged KV cache around the next
        ``count`` scoring steps (see ``OnlineSelector.arm_kv_check``). False when not online."""
        drafter = getattr(self.model_runner, "drafter", None)
        online = getattr(drafter, "online", None)
        if online is None:
            return False
        online.arm_kv_check(count, write_slots)
        return True

    def selfspec_online_write_profile(self, path: str | None = None) -> str | None:
        """Write the online search's best set as a profile now (rank 0; None elsewhere)."""
        drafter = getattr(self.model_runner, "drafter", None)
        online = getattr(drafter, "online", None)
        return None if online is None else online.write_profile(path)
