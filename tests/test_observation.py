"""Unit tests for vllm_selfspec.control.observation (no vLLM)."""

from __future__ import annotations

import pytest

from vllm_selfspec.control.observation import StepObservation
from vllm_selfspec.control.step_costs import StepCosts


def test_draft_and_plain_seconds_read_the_table() -> None:
    empty = StepObservation(decoding=(True, True), drafted=0, accepted=0, costs=StepCosts())
    assert empty.batch_size == 2 and empty.draft_and_plain_seconds() == (None, None)
    costs = StepCosts(verify={(2, 0.0): 0.10, (2, 2.0): 0.16}, draft={2: 0.04})
    obs = StepObservation(decoding=(True, False), drafted=4, accepted=3, costs=costs)
    draft, plain = obs.draft_and_plain_seconds()
    assert draft == pytest.approx(0.04) and plain == pytest.approx(0.10)
    verify = obs.verify_cost()
    assert verify is not None
    assert verify(0) == pytest.approx(1.0) and verify(2) == pytest.approx(1.6)
    assert empty.verify_cost() is None  # nothing measured: verification free
    # no plain step at this bucket: the cheapest measured verification stands in (upper bound)
    drafting_only = StepCosts(verify={(2, 2.0): 0.16}, draft={})
    obs = StepObservation(decoding=(True, True), drafted=0, accepted=0, costs=drafting_only)
    assert obs.draft_and_plain_seconds() == (None, pytest.approx(0.16))
