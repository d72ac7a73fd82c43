"""Prompt-lookup drafts: the source choice and acceptance estimate (no vLLM), and the matcher
(vLLM's n-gram kernel over the runner's token table plus the step's sampled tokens)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from vllm_selfspec.control.controller import expected_tokens
from vllm_selfspec.control.source_choice import (
    LookupAcceptance,
    StepDrafts,
    choose_lookups,
    lookup_length,
    lookup_lengths_for_the_step,
)
from vllm_selfspec.control.step_costs import quantise_x


def _length(lookup_acceptance: float = 0.6, lookup_len: int = 4, **kw) -> int:
    """:func:`lookup_length` for a lookup of ``lookup_len`` drafts landing with a per-token
    acceptance (the first ``i`` land with ``a ** i``)."""
    args = dict(lookup_landing=[lookup_acceptance**i for i in range(1, lookup_len + 1)],
                skip_acceptance=0.6, skip_budget=4, verify_cost=lambda k: 1.0 + 0.05 * k,
                draft_cost=0.4, min_gain=0.05)
    return lookup_length(**{**args, **kw})


def _pays(**kw) -> bool:
    return _length(**kw) > 0


def test_lookup_wins_at_equal_acceptance_it_costs_no_forward():
    assert _pays()


def test_lookup_loses_to_much_better_layer_skip_drafts():
    assert not _pays(lookup_acceptance=0.2, skip_acceptance=0.95, draft_cost=0.05)


def test_lookup_must_beat_plain_decoding():
    # nothing to compare with (layer skip off): a lookup draft that lands too rarely is not
    # worth its verification
    assert not _pays(lookup_acceptance=0.02, skip_budget=0, verify_cost=lambda k: 1.0 + 0.2 * k)
    assert _pays(lookup_acceptance=0.5, skip_budget=0)
    assert not _pays(lookup_len=0)


def test_rarely_landing_lookups_are_cut_where_verification_is_dear():
    # a CPU verifies 4 drafts at nearly twice a plain step: at 27% acceptance only the first
    # lookup draft pays (1.27 / 1.15), all four would not (1.37 / 1.9)
    dear = lambda k: 1.0 + 0.15 * k + (0.3 if k > 1 else 0.0)  # noqa: E731
    assert _length(lookup_acceptance=0.27, skip_budget=0, verify_cost=dear) == 1
    assert _length(lookup_acceptance=0.95, skip_budget=0, verify_cost=dear) == 4
    assert _length(lookup_acceptance=0.6, lookup_len=2) == 2


def test_the_rule_is_expected_tokens_per_time():
    v = lambda k: 1.0 + 0.1 * k  # noqa: E731
    lookup = expected_tokens(0.5, 3) / v(3)
    skip = expected_tokens(0.8, 4) / (v(4) + 4 * 0.1)
    assert _pays(lookup_acceptance=0.5, lookup_len=3, skip_acceptance=0.8, verify_cost=v,
                 draft_cost=0.1) == (lookup >= skip and lookup > 1.05)


def _step_verify(fixed: float, per_token: float):
    """A batch's verification cost in plain steps, by draft tokens per request ``x`` (quarters):
    any drafting leaves the plain path (``fixed``), then each draft token per request costs
    ``per_token``."""
    return lambda x: 1.0 if x == 0 else 1.0 + fixed + per_token * x


GOOD = [0.7, 0.5, 0.3]  # a lookup of 3 drafts, E = 2.5
POOR = [0.01, 0.005, 0.003, 0.002]  # 4 drafts that rarely land, E = 1.02


def _step(lookups, batch_size=32, others=None, verify_cost=None, draft_cost=0.5,
          min_gain=0.05):
    verify_cost = verify_cost or _step_verify(fixed=0.08, per_token=0.05)
    others = others or StepDrafts()
    return lookup_lengths_for_the_step(batch_size=batch_size, lookups=lookups, others=others,
                                       verify_cost=verify_cost, draft_cost=draft_cost,
                                       min_gain=min_gain)


def test_a_lone_lookup_does_not_pay_the_step_where_leaving_the_plain_path_is_dear():
    # batch 32, one request with a good lookup (E = 2.5 of 3 drafts): +1.5 tokens on 32 is +4.7%,
    # while any drafting costs 8% of the step (the sampled rejection sampler over the batch)
    assert _step([GOOD]) == [0]
    # where leaving the plain path is cheap (greedy), several such lookups pay together
    cheap = _step_verify(fixed=0.005, per_token=0.05)
    assert _step([GOOD] * 8, verify_cost=cheap) == [3] * 8
    # at batch 1 the lookup is the whole step: it pays
    assert _step([GOOD], batch_size=1) == [3]


def test_many_lookups_pay_the_step_together_and_the_poor_tail_is_cut():
    dear = _step_verify(fixed=0.08, per_token=0.05)
    # eight good lookups then two that rarely land: the poor ones are verified only as far as
    # the cost table prices them at nothing (it is keyed by draft tokens per request rounded
    # to quarters: 24 and 26 draft tokens on 32 requests are both 0.75)
    lengths = _step([GOOD] * 8 + [POOR] * 2)
    assert lengths[:8] == [3] * 8
    assert quantise_x(sum(lengths), 32) == quantise_x(24, 32)
    assert _step([GOOD] * 8 + [[0.01] * 4] * 4)[8:] == [3, 0, 0, 0]  # 27 tokens: still 0.75

    # the rule is the batch's tokens per unit of time, token by token, best first
    def rate(lengths: list[int]) -> float:
        gain = sum(sum(GOOD[:n]) for n in lengths)
        return (32 + gain) / dear(quantise_x(sum(lengths), 32))

    assert rate([3] * 8) > max(rate([0] * 8), rate([2] * 8), rate([3] * 7 + [2]))


def test_a_lookup_is_cut_to_the_tokens_that_pay():
    # the tail of a long lookup lands too rarely to pay for its verification at batch 1
    tail = [0.9, 0.8, 0.02, 0.01]
    assert _step([tail], batch_size=1, verify_cost=_step_verify(fixed=0.05, per_token=0.1)) == [2]
    # a run that keeps landing is verified whole
    run = [0.9, 0.85, 0.8, 0.75]
    assert _step([run], batch_size=1, verify_cost=_step_verify(fixed=0.05, per_token=0.1)) == [4]


def test_lookups_must_beat_the_step_by_the_min_gain():
    # batch 1: +5.5% over plain decoding passes a 5% margin, not a 6% one
    lookup = [0.16]
    verify = _step_verify(fixed=0.0, per_token=0.1)  # 1.16 tokens / 1.1 steps
    assert _step([lookup], batch_size=1, verify_cost=verify) == [1]
    assert _step([lookup], batch_size=1, verify_cost=verify, min_gain=0.06) == [0]
    # the margin is the step's: at batch 32 one good lookup (+1.5 tokens, +4.7%) is below it
    # even where its verification is nearly free, three of them are not
    cheap = _step_verify(fixed=0.0, per_token=0.01)
    assert _step([GOOD], verify_cost=cheap) == [0]
    assert _step([GOOD] * 3, verify_cost=cheap) == [3] * 3
    # tokens the cost table prices at nothing more (the same quarter) need no margin
    assert _step([[0.01]], batch_size=32, verify_cost=lambda x: 1.0 if x == 0 else 1.2,
                 others=StepDrafts(tokens=8.0, drafts=32)) == [1]
    assert _step([[0.01]], batch_size=32, verify_cost=lambda x: 1.0 if x == 0 else 1.2) == [0]


def test_a_step_that_verifies_drafts_anyway_takes_a_lone_lookup():
    # a layer-skip pass runs this step (its drafts already left the plain path): the lookup's
    # only cost is its own verification
    drafting = StepDrafts(tokens=16.0, drafts=64, pass_len=4)
    assert _step([GOOD], others=drafting, draft_cost=0.05) == [3]
    assert _step([], others=drafting, draft_cost=0.05) == []


def _choice(hybrid: bool, budgets: list[int], found: dict[str, list[int]], verify_slope: float,
            draft: float = 0.9):
    """:func:`choose_lookups` with a controller whose costs are known (a plain step 1, each
    draft token per request verified for ``verify_slope`` more, a draft forward ``draft``)."""
    from vllm_selfspec.control.controller import ControllerConfig, DraftLengthController
    from vllm_selfspec.control.step_costs import StepCosts, bucket

    ctl = DraftLengthController(ControllerConfig(k_max=4, explore_interval=0))
    req_ids = [f"r{i}" for i in range(len(budgets))]
    b = bucket(len(req_ids))
    ctl.set_step_costs(StepCosts(verify={(b, float(x)): 1.0 + verify_slope * x for x in range(9)},
                                 draft={b: draft}))
    return choose_lookups(ctl, LookupAcceptance(), hybrid=hybrid, req_ids=req_ids,
                          budgets=budgets, found=found, k_limit=4)


def test_choose_lookups_lookup_mode_takes_every_lookup_cut_to_its_cap():
    found = {"r0": [1, 2, 3, 4, 5, 6], "r1": [7, 8]}
    choice = _choice(False, [0, 0], found, verify_slope=10.0)  # prices do not matter here
    assert choice.drafts == {"r0": [1, 2, 3, 4], "r1": [7, 8]} and choice.declined == 0


def test_choose_lookups_hybrid_follows_the_prices():
    found = {"r0": [1, 2, 3, 4], "r1": [5, 6, 7]}
    # verification nearly free, draft forwards dear: every lookup found is taken
    cheap = _choice(True, [0, 0], found, verify_slope=0.01)
    assert set(cheap.drafts) == {"r0", "r1"}
    # verification dearer than anything a lookup can land: none is taken, and the requests
    # without a layer-skip budget are counted as declined for the step or cut to nothing
    dear = _choice(True, [0, 0], found, verify_slope=5.0)
    assert dear.drafts == {}
    # nothing found: nothing chosen
    assert _choice(True, [2, 2], {}, verify_slope=0.01).drafts == {}


def test_acceptance_per_request_from_the_engine_prior():
    acc = LookupAcceptance(prior=0.5, prior_weight=2.0)
    assert acc.acceptance("a") == 0.5
    for _ in range(20):
        acc.observe("a", drafted=4, accepted=4)
    assert acc.acceptance("a") > 0.9
    # a new request starts from what the engine saw
    assert 0.5 < acc.acceptance("b") < acc.acceptance("a")
    for _ in range(20):
        acc.observe("b", drafted=4, accepted=0)
    assert acc.acceptance("b") < 0.1
    acc.observe("c", drafted=0, accepted=0)  # nothing verified: no-op
    acc.retain(["b"])
    assert acc.acceptance("a") == acc.engine_acceptance()


def test_lookup_acceptance_is_kept_by_position():
    """Lookups land as runs: a first token that lands is followed by the rest. The model keeps
    the first token's acceptance per request and the ones after it for the engine, given the
    ones before, and prices a lookup by the probability that each prefix lands."""
    acc = LookupAcceptance(prior=0.5, prior_weight=2.0, continuation_prior=0.7)
    assert acc.landing("a", 3) == pytest.approx([0.5, 0.35, 0.245])
    assert acc.expected("a", 3) == pytest.approx(1 + 0.5 + 0.35 + 0.245)
    with pytest.raises(ValueError):
        acc.continuation(1)
    # half the lookups miss at once, the other half land whole (ngram on code at T = 0.7)
    for _ in range(200):
        acc.observe("a", drafted=4, accepted=0)
        acc.observe("a", drafted=4, accepted=4)
    assert acc.acceptance("a") == pytest.approx(0.5, abs=0.05)
    for position in (2, 3, 4):
        assert acc.continuation(position) > 0.95
    # by position, the expected tokens are the true ones: 1 + 0.5 * j
    assert acc.expected("a", 1) == pytest.approx(1.5, abs=0.05)
    assert acc.expected("a", 4) == pytest.approx(3.0, abs=0.15)
    # a per-token (geometric) acceptance fitted to the same drafts (4 accepted of 5 tried per
    # pair) is 0.8: it prices the first token at 0.8 where half land, so a one-token lookup at
    # 1.8 tokens, and the four-token one at 3.36
    assert expected_tokens(0.8, 1) - acc.expected("a", 1) > 0.25
    # a rejection at position 3 counts position 3 as tried, position 4 not at all
    fresh = LookupAcceptance(prior_weight=1.0, continuation_prior=0.5, engine_decay=1.0)
    fresh.observe("b", drafted=4, accepted=2)
    assert fresh.continuation(2) == pytest.approx((0.5 + 1) / 2)
    assert fresh.continuation(3) == pytest.approx((0.5 + 0) / 2)
    assert fresh.continuation(4) == 0.5  # the prior: never tried
    # the landing probabilities never grow with the position
    probs = acc.landing("a", 6)
    assert all(x >= y for x, y in zip(probs, probs[1:], strict=False))


_MATCHER_CHECKS = """
import numpy as np
from vllm_selfspec.drafting.prompt_lookup import PromptLookup, valid_sampled

lookup = PromptLookup(min_n=2, max_n=4, k=4, max_model_len=64)
table = np.zeros((3, 64), dtype=np.int32)
table[0, :7] = [5, 6, 7, 8, 9, 5, 6]
table[1, :3] = [1, 2, 3]
table[2, :4] = [4, 4, 4, 4]
sampled = valid_sampled(np.array([[7, -1], [1, 2], [4, -1]]), 3)
assert sampled == [[7], [1, 2], [4]], sampled
found = lookup.find(table, np.array([7, 3, 4]), sampled, rows=[0, 1])
# row 0: ...5 6 7 matches 5 6 7 at the start, then 8 9 5 6; row 1: 1 2 then 3 1 2;
# row 2 not asked for
assert found == {0: [8, 9, 5, 6], 1: [3, 1, 2]}, found
# the table itself is not written
assert table[0, 7] == 0 and table[1, 3] == 0
# no match: left out; near max_model_len: cut at the limit
assert lookup.find(table, np.array([7, 3, 4]), [[1], [9], [4]], rows=[0, 1]) == {}
near = np.zeros((1, 64), dtype=np.int32)
near[0, :62] = [1, 2] * 31
assert lookup.find(near, np.array([62]), [[1]], rows=[0]) == {0: [2]}
assert lookup.find(table, np.array([7, 3, 4]), sampled, rows=[]) == {}
print("ok")
"""


def test_prompt_lookup_matches_with_this_steps_tokens():
    """In a fresh interpreter: numba's JIT leaves llvmlite objects in ``sys.modules`` that vLLM's
    CPU kernel-override scan (``register_triton_kernel_overrides``, run by test_patches in this
    process) trips over; a worker runs that scan at start, before any drafter compiles."""
    if importlib.util.find_spec("numba") is None:  # (importing it here is what must not happen)
        pytest.skip("numba is not installed")
    out = subprocess.run([sys.executable, "-c", _MATCHER_CHECKS], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
