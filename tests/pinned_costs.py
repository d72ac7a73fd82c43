"""Worker extension that gives the selfspec drafter a fixed step-cost table (tests only).

The adaptive controller drafts only where the measured costs say drafting pays, and on a tiny model
that verdict follows the machine's timings: in one CI run an engine that had drafted through five
tests drafted nothing for the sixth one's requests. Tests about what the default path does when it
drafts (identity, per-request caps, the confidence exit) pin the costs so that its decisions are
the same on every machine. Start the engine with ``worker_extension_cls=PINNED_COSTS_EXTENSION``,
then call :func:`pin_step_costs`. Every other part of the controller runs as in production;
production code has no switch for this.
"""

from __future__ import annotations

from typing import Any

from vllm_selfspec.plugin.worker_ext import SelfSpecWorkerExtension

PINNED_COSTS_EXTENSION = "tests.pinned_costs.PinnedCostsExtension"


def pinned_table(draft_ratio: float, verify_per_token: float) -> list[float]:
    """A cost table in ``StepCosts.to_flat`` form: a plain step 1, a draft forward
    ``draft_ratio`` plain steps, each draft token per request verified for ``verify_per_token``
    more, at every batch-size bucket from 1 to 64."""
    from vllm_selfspec.control.step_costs import StepCosts

    verify = {(1 << i, x): 1.0 + verify_per_token * x
              for i in range(7) for x in (0.0, 1.0, 2.0, 4.0, 8.0)}
    draft = {1 << i: draft_ratio for i in range(7)}
    return StepCosts(verify=verify, draft=draft).to_flat()


class _PinnedRecorder:
    """Stands in for the drafter's ``StepCostRecorder``: measures nothing, answers the table."""

    ready_keys = 0

    def __init__(self, table: Any) -> None:
        self.table = table

    def observe_verify(self, *args: Any, **kwargs: Any) -> None:
        pass

    def observe_draft(self, *args: Any, **kwargs: Any) -> None:
        pass

    def snapshot(self, min_samples: int | None = None) -> Any:
        return self.table


class PinnedCostsExtension(SelfSpecWorkerExtension):
    def selfspec_pin_step_costs(self, flat: list[float]) -> bool:
        from vllm_selfspec.control.step_costs import StepCosts
        from vllm_selfspec.drafting.device_drafter import SelfSpecDeviceProposer

        drafter = getattr(self.model_runner, "drafter", None)
        if not isinstance(drafter, SelfSpecDeviceProposer):
            return False
        table = StepCosts.from_flat(flat)
        drafter._costs = _PinnedRecorder(table)
        drafter.controller.set_step_costs(table)
        return True


def pin_step_costs(llm: Any, draft_ratio: float = 0.3, verify_per_token: float = 0.05) -> None:
    flat = pinned_table(draft_ratio, verify_per_token)
    assert all(llm.collective_rpc("selfspec_pin_step_costs", args=(flat,))), (
        "not every worker runs the selfspec drafter"
    )
