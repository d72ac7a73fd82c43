"""Hands the draft-length controller the measured step costs, identical on every TP rank.

The drafter measures step costs on its own worker (:class:`~vllm_selfspec.control.step_costs.
StepCostRecorder`) and plans with a :class:`~vllm_selfspec.control.step_costs.StepCosts` snapshot.
Every tensor-parallel rank must take the same decisions (a draft pass is a collective), so the table
the controller gets is rank 0's, broadcast to the others, as soon as the recorder gains an entry
(what a plan at a new batch size waits for; the event is the same on every rank, whose sample
counts are equal) and every ``SYNC_INTERVAL`` steps for the estimates' drift.
"""

from __future__ import annotations

from typing import Any

import torch

from vllm_selfspec.control.controller import DraftLengthController
from vllm_selfspec.control.step_costs import StepCosts

SYNC_INTERVAL = 16  # steps between (TP-synchronised) cost updates of the controller
MAX_ENTRIES = 1024  # cost-table entries broadcast over TP (a fixed-size tensor)


def tp_world() -> tuple[int, int]:
    """(world size, rank) of the tensor-parallel group; (1, 0) where none is initialised."""
    try:
        from vllm.distributed import get_tp_group

        group = get_tp_group()
        return group.world_size, group.rank_in_group
    except Exception:  # not initialised (unit tests)
        return 1, 0


class CostFeed:
    """Call :meth:`step` once per engine step with the drafter's recorder."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.world_size, self.rank = tp_world()
        self._steps_since_sync = 0
        self._synced_keys = 0

    def step(self, recorder: Any, controller: DraftLengthController) -> None:
        self._steps_since_sync += 1
        ready = recorder.ready_keys
        if self._steps_since_sync < SYNC_INTERVAL and ready == self._synced_keys:
            return
        self._steps_since_sync = 0
        self._synced_keys = ready
        flat = recorder.snapshot().to_flat()
        if self.world_size > 1:
            from vllm.distributed import get_tp_group

            buf = torch.full((4 * MAX_ENTRIES,), -1.0, dtype=torch.float64)
            n = min(len(flat), buf.numel())
            buf[:n] = torch.tensor(flat[:n], dtype=torch.float64)
            buf = get_tp_group().broadcast(buf.to(self.device), src=0)
            flat = buf.cpu().tolist()
        controller.set_step_costs(StepCosts.from_flat(flat))
