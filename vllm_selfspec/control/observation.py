"""What one engine step showed a drafter, the same on every tensor-parallel rank.

The drafter builds one :class:`StepObservation` per step, after the verification of its
previous drafts and before the next draft round, and hand it to the draft-length controller
(:meth:`~vllm_selfspec.control.controller.DraftLengthController.observe`) and to online layer
selection. Everything in it is identical across TP ranks: the rows and the verified counts follow
from the input batch and the sampled tokens, and ``costs`` is rank 0's measured table, which
:class:`~vllm_selfspec.drafting.cost_feed.CostFeed` broadcasts (the only TP collective the
drafter's decisions need).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_selfspec.control.step_costs import StepCosts

COUNTED_SOURCES = ("lookup", "layer_skip")
"""The draft sources a verified draft is counted under (a request's draft in one step comes from
one of them)."""


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
    step costs every rank plans with; ``lookup``: the requests whose prompt-lookup drafts were
    verified this step (the controller and online selection do not read them)."""

    req_ids: tuple[str, ...]
    decoding: tuple[bool, ...]
    verified: tuple[Verification, ...]
    costs: StepCosts
    lookup: tuple[Verification, ...] = ()

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


def _zeros() -> dict[str, int]:
    return dict.fromkeys(COUNTED_SOURCES, 0)


@dataclass
class SourceTotals:
    """Verified drafts per source since the engine started: draft tokens, accepted draft tokens
    and request-steps drafted (a request verified with drafts in one step). Summed over sources
    they are vLLM's own ``vllm:spec_decode_num_draft_tokens`` / ``num_accepted_tokens`` /
    ``num_drafts``; the plugin's per-source Prometheus counters export them
    (:mod:`vllm_selfspec.plugin.metrics`)."""

    draft_tokens: dict[str, int] = field(default_factory=_zeros)
    accepted_tokens: dict[str, int] = field(default_factory=_zeros)
    request_steps: dict[str, int] = field(default_factory=_zeros)

    def add(self, observation: StepObservation) -> None:
        for source, verifications in (
            ("layer_skip", observation.verified),
            ("lookup", observation.lookup),
        ):
            for v in verifications:
                if v.drafted:
                    self.draft_tokens[source] += v.drafted
                    self.accepted_tokens[source] += v.accepted
                    self.request_steps[source] += 1

    def as_dict(self) -> dict[str, dict[str, int]]:
        """``{source: {"draft_tokens": .., "accepted_tokens": .., "request_steps": ..}}``."""
        return {
            source: {
                "draft_tokens": self.draft_tokens[source],
                "accepted_tokens": self.accepted_tokens[source],
                "request_steps": self.request_steps[source],
            }
            for source in COUNTED_SOURCES
        }
