"""What one engine step showed a drafter, the same on every tensor-parallel rank.

Both drafters build one :class:`StepObservation` per step, after the verification of their
previous drafts and before the next draft round, and hand it to the draft-length controller
(:meth:`~vllm_selfspec.control.controller.DraftLengthController.observe`) and to online layer
selection. Everything in it is identical across TP ranks: the rows and the verified counts follow
from the input batch and the sampled tokens, and ``costs`` is rank 0's measured table, which
:class:`~vllm_selfspec.drafting.cost_feed.CostFeed` broadcasts (the only TP collective the
drafter's decisions need).
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_selfspec.control.step_costs import StepCosts


@dataclass(frozen=True)
class Verification:
    """One request's layer-skip drafts verified this step: ``accepted`` of ``drafted``;
    ``confidences``: the drafts' top-1 probabilities, in draft order, where the drafter keeps
    them (they calibrate the draft exit)."""

    req_id: str
    drafted: int
    accepted: int
    confidences: tuple[float, ...] = ()


@dataclass(frozen=True)
class StepObservation:
    """``req_ids`` / ``decoding``: per row of the input batch, its request and whether it sampled
    a token this step (False: a partial prefill); ``verified``: the requests whose layer-skip
    drafts were verified this step (prompt-lookup drafts are not in it); ``costs``: the measured
    step costs every rank plans with."""

    req_ids: tuple[str, ...]
    decoding: tuple[bool, ...]
    verified: tuple[Verification, ...]
    costs: StepCosts

    @property
    def drafted(self) -> int:
        return sum(v.drafted for v in self.verified)

    @property
    def accepted(self) -> int:
        return sum(v.accepted for v in self.verified)

    @property
    def batch_size(self) -> int:
        return len(self.decoding)

    def draft_and_plain_seconds(self) -> tuple[float | None, float | None]:
        """One draft forward over the whole batch and one plain decoding step of it, in seconds
        (None: not measured yet). Without a plain step measured at this batch size, the plain
        step reads the cheapest measured verification of its bucket (an upper bound)."""
        b = max(1, self.batch_size)
        costs = self.costs
        draft = float(costs.draft_cost(b, b)) if costs.draft else None
        plain = costs.plain_cost(b) if costs.verify else None
        return draft, plain
