"""Unit tests for vllm_selfspec.control.observation and the controller's use of it (no vLLM)."""

from __future__ import annotations

import pytest

from vllm_selfspec.control.controller import ControllerConfig, DraftLengthController
from vllm_selfspec.control.observation import StepObservation, Verification
from vllm_selfspec.control.step_costs import StepCosts


def _observation(costs: StepCosts, verified: tuple[Verification, ...] = ()) -> StepObservation:
    return StepObservation(req_ids=("a", "b"), decoding=(True, True), verified=verified,
                           costs=costs)


def test_draft_and_plain_seconds_read_the_table() -> None:
    empty = _observation(StepCosts())
    assert empty.batch_size == 2 and empty.draft_and_plain_seconds() == (None, None)
    costs = StepCosts(verify={(2, 0.0): 0.10, (2, 2.0): 0.16}, draft={2: 0.04})
    obs = _observation(costs)
    draft, plain = obs.draft_and_plain_seconds()
    assert draft == pytest.approx(0.04) and plain == pytest.approx(0.10)
    # no plain step at this bucket: the cheapest measured verification stands in (upper bound)
    drafting_only = _observation(StepCosts(verify={(2, 2.0): 0.16}, draft={}))
    assert drafting_only.draft_and_plain_seconds() == (None, pytest.approx(0.16))


def test_controller_observes_a_step_as_its_verifications_then_retains_the_batch() -> None:
    verified = (Verification("a", 4, 1, (0.9, 0.8, 0.4, 0.2)), Verification("b", 3, 3))
    obs = _observation(StepCosts(), verified)
    assert (obs.drafted, obs.accepted) == (7, 4)
    by_step = DraftLengthController(ControllerConfig(k_max=4))
    by_call = DraftLengthController(ControllerConfig(k_max=4))
    for ctl in (by_step, by_call):
        ctl.plan(["a", "b", "gone"])
    by_step.observe(obs)
    by_call.observe_verification("a", drafted=4, accepted=1, confidences=[0.9, 0.8, 0.4, 0.2])
    by_call.observe_verification("b", drafted=3, accepted=3)
    by_call.retain(["a", "b"])
    assert set(by_step._states) == set(by_call._states) == {"a", "b"}
    assert by_step.stats() == by_call.stats()
    assert by_step.plan(["a", "b"]) == by_call.plan(["a", "b"])


def test_source_totals_count_each_source_of_a_step() -> None:
    from vllm_selfspec.control.observation import SourceTotals

    totals = SourceTotals()
    assert totals.as_dict() == {
        source: {"draft_tokens": 0, "accepted_tokens": 0, "request_steps": 0}
        for source in ("lookup", "layer_skip")
    }
    step = StepObservation(
        req_ids=("a", "b", "c"), decoding=(True, True, True),
        verified=(Verification("a", 4, 1), Verification("b", 0, 0)),
        costs=StepCosts(), lookup=(Verification("c", 3, 3),),
    )
    totals.add(step)
    totals.add(StepObservation(req_ids=("c",), decoding=(True,), verified=(),
                               costs=StepCosts(), lookup=(Verification("c", 2, 0),)))
    assert totals.as_dict() == {
        "lookup": {"draft_tokens": 5, "accepted_tokens": 3, "request_steps": 2},
        # a request with nothing drafted is not a draft
        "layer_skip": {"draft_tokens": 4, "accepted_tokens": 1, "request_steps": 1},
    }
    # the controller reads the layer-skip verifications only: lookup ones do not change its sums
    assert (step.drafted, step.accepted) == (4, 1)
