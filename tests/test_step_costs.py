"""Unit tests for vllm_selfspec.control.step_costs (numpy only, no vLLM)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from vllm_selfspec.control.step_costs import StepCostRecorder, StepCosts, bucket, quantise_x


def test_bucket_and_quantise() -> None:
    assert [bucket(n) for n in (0, 1, 2, 3, 4, 5, 8, 9, 32, 33)] == [1, 1, 2, 4, 4, 8, 8, 16, 32,
                                                                     64]
    assert quantise_x(0, 8) == 0.0
    assert quantise_x(1, 32) == 0.25  # any drafting is at least a quarter
    assert quantise_x(32, 8) == 4.0
    assert quantise_x(9, 8) == 1.0  # 1.125 -> 1.0
    assert quantise_x(10, 8) == 1.25


def test_recorder_medians_ignore_outliers_and_bad_samples() -> None:
    rec = StepCostRecorder(window=5, quantile=0.5)
    for s in (0.10, 0.11, 5.0, 0.09, 0.10):  # one 5 s outlier (a step that also prefilled)
        rec.observe_verify(8, 0, s)
    rec.observe_verify(8, 0, math.nan)
    rec.observe_verify(8, 0, -1.0)
    rec.observe_verify(0, 0, 0.1)
    rec.observe_verify(8, 32, 0.35)
    rec.observe_draft(8, 0.05)
    rec.observe_draft(7, 0.04)
    rec.observe_draft(0, 9.0)
    snap = rec.snapshot()
    # keys with fewer than 3 samples are left out (first runs of a shape are slow)
    assert snap.verify == {(8, 0.0): pytest.approx(0.10)}
    assert not snap.draft
    snap = rec.snapshot(min_samples=1)
    assert snap.verify == {(8, 0.0): pytest.approx(0.10), (8, 4.0): pytest.approx(0.35)}
    assert snap.draft == {8: pytest.approx(0.045)}
    for _ in range(5):  # the window forgets old samples
        rec.observe_verify(8, 0, 0.2)
    assert rec.snapshot().verify[(8, 0.0)] == pytest.approx(0.2)
    with pytest.raises(ValueError):
        StepCostRecorder(window=0)


def test_recorder_reads_the_fast_spell_of_each_key() -> None:
    """Step times come in spells (a CPU engine: 22 ms plain steps for a while, then 30 ms) and the
    keys are sampled at different times. Medians of a plain key sampled mostly in the slow spell
    and a draft key sampled mostly in the fast one gave a draft/plain ratio of 0.66 where every
    spell's is 0.9; the default lower quartile reads the fast spell of both."""
    plain = [0.022] * 5 + [0.030] * 10
    draft = [0.0198] * 10 + [0.027] * 5
    for quantile, expected in ((0.5, 0.0198 / 0.030), (None, 0.9)):
        rec = StepCostRecorder() if quantile is None else StepCostRecorder(quantile=quantile)
        for p, d in zip(plain, draft, strict=True):
            rec.observe_verify(1, 0, p)
            rec.observe_draft(1, d)
        snap = rec.snapshot()
        assert snap.draft_cost(1, 1) / snap.plain_cost(1) == pytest.approx(expected, rel=0.01)
    with pytest.raises(ValueError, match="quantile"):
        StepCostRecorder(quantile=1.5)


def test_verify_cost_interpolates_and_extrapolates() -> None:
    c = StepCosts(verify={(8, 0.0): 1.0, (8, 2.0): 2.0, (8, 4.0): 4.0})
    assert c.plain_cost(8) == 1.0
    assert c.verify_cost(8, 1.0) == pytest.approx(1.5)
    assert c.verify_cost(8, 3.0) == pytest.approx(3.0)
    # above the largest x: along the line through the plain step and the largest x
    assert c.verify_cost(8, 6.0) == pytest.approx(4.0 + 0.75 * 2)
    arr = c.verify_cost(8, np.array([0.0, 1.0, 6.0]))
    assert isinstance(arr, np.ndarray) and arr.tolist() == pytest.approx([1.0, 1.5, 5.5])
    # nothing measured: unit cost, verification free
    assert StepCosts().verify_cost(4, 3.0) == 1.0
    # only drafted steps measured: cost below the first x assumed flat
    only = StepCosts(verify={(1, 4.0): 2.0})
    assert only.plain_cost(1) == 2.0 and not only.has_plain(1)


def test_verify_cost_never_decreases_with_more_drafts() -> None:
    # medians of a noisy batch-1 bucket (measured on a busy CPU): 3 drafts read cheaper than
    # a plain step, 2 drafts cheaper than 1
    c = StepCosts(verify={(1, 0.0): 0.0757, (1, 1.0): 0.0782, (1, 2.0): 0.0704, (1, 3.0): 0.0641})
    xs = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0])
    got = c.verify_cost(1, xs)
    assert np.all(np.diff(got) >= 0), got
    assert got[0] == pytest.approx(0.0757)
    assert got[2] == got[4] == got[5] == pytest.approx(0.0782)  # the dips read as the 1-draft cost
    assert c.plain_cost(1) == pytest.approx(0.0757)
    # and a controller planning with them sees no free verification (v >= 1 plain step)
    assert float(c.verify_cost(1, 3.0)) / c.plain_cost(1) >= 1.0


def test_bucket_fallback_prefers_buckets_with_a_plain_step() -> None:
    c = StepCosts(verify={(1, 0.0): 1.0, (1, 4.0): 1.2, (64, 4.0): 9.0, (32, 0.0): 3.0,
                          (32, 4.0): 9.0})
    assert c.has_plain(1) and not c.has_plain(64)
    assert c.plain_cost(2) == 1.0  # nearest bucket with a plain step
    assert c.plain_cost(64) == 3.0  # 64 has no plain step: bucket 32 answers
    assert c.verify_cost(16, 4.0) == 9.0


def test_draft_cost() -> None:
    c = StepCosts(verify={(1, 0.0): 2.0}, draft={1: 0.1, 4: 0.3})
    assert c.draft_cost(1, 1) == pytest.approx(0.1)
    assert c.draft_cost(2, 1) == pytest.approx(0.2)  # log-scale interpolation
    assert c.draft_cost(64, 1) == pytest.approx(0.3)  # constant beyond the measured buckets
    assert c.draft_cost(0, 1) == 0.0
    assert c.draft_cost(np.array([0, 1, 4]), 1).tolist() == pytest.approx([0.0, 0.1, 0.3])
    # nothing measured: the prior share of a plain step
    assert StepCosts(verify={(1, 0.0): 2.0}).draft_cost(3, 1, prior_ratio=0.25) == 0.5


def test_flat_round_trip_and_padding() -> None:
    c = StepCosts(verify={(1, 0.0): 0.1, (8, 2.5): 0.3}, draft={1: 0.05})
    flat = c.to_flat()
    assert flat[:4] == [1.0, 1.0, 0.0, 0.05]  # draft forwards first
    assert StepCosts.from_flat(flat) == c
    padded = flat + [-1.0] * 8 + [0.0, 2.0]  # padding and a ragged tail are ignored
    assert StepCosts.from_flat(padded) == c
    assert not StepCosts.from_flat([])


def test_scoring_rounds_ride_in_the_same_table() -> None:
    """Online selection's scoring rounds: their median once ``min_samples`` are in, counted as a
    ready key (so the cost feed syncs when it appears), carried through the flat form, and no
    part of the decoding costs."""
    rec = StepCostRecorder(window=5, min_samples=3)
    for seconds in (0.2, 0.9):
        rec.observe_scoring(seconds)
    rec.observe_scoring(math.inf)  # ignored
    assert rec.snapshot().scoring is None and rec.ready_keys == 0
    rec.observe_scoring(0.4)
    assert rec.ready_keys == 1
    costs = rec.snapshot()
    assert costs.scoring == pytest.approx(0.4) and not costs  # median; not a decoding cost
    table = StepCosts(verify={(1, 0.0): 0.1}, draft={1: 0.05}, scoring=0.4)
    assert table.to_flat()[-4:] == [2.0, 1.0, 0.0, 0.4]  # scoring last
    assert StepCosts.from_flat(table.to_flat()) == table
    assert table.of_bucket(1).scoring == 0.4


def test_ready_keys_counts_keys_as_they_reach_min_samples() -> None:
    rec = StepCostRecorder(window=4, min_samples=3)
    seen = []
    for _ in range(6):  # one key: counted once, when its third sample lands, never again
        rec.observe_verify(8, 0, 0.1)
        seen.append(rec.ready_keys)
    assert seen == [0, 0, 1, 1, 1, 1]
    for _ in range(3):
        rec.observe_draft(8, 0.05)
    rec.observe_verify(8, 32, 0.3)  # rejected / young keys do not count
    rec.observe_verify(8, 0, math.nan)
    assert rec.ready_keys == 2
    assert len(rec.snapshot().verify) + len(rec.snapshot().draft) == rec.ready_keys
    full = StepCostRecorder(window=2, min_samples=2)
    for _ in range(5):
        full.observe_draft(1, 0.01)
    assert full.ready_keys == 1
    with pytest.raises(ValueError):
        StepCostRecorder(window=2, min_samples=3)


def test_verification_is_not_free_where_only_another_batch_size_measured_it() -> None:
    # bucket 8 measured verifications (4 drafts per request: 3x a plain step); bucket 32 has
    # only its plain step (every plan there was plain so far)
    c = StepCosts(verify={(8, 0.0): 0.1, (8, 4.0): 0.3, (32, 0.0): 0.2})
    assert c.plain_cost(32) == pytest.approx(0.2)
    assert c.verify_cost(32, 4.0) == pytest.approx(0.6)  # bucket 8's curve, scaled to 32's plain
    assert c.verify_cost(32, 2.0) == pytest.approx(0.4)
    # a bucket's own measurement wins inside its range; beyond it, the higher of the two
    c = StepCosts(verify={(8, 0.0): 0.1, (8, 4.0): 0.3, (32, 0.0): 0.2, (32, 0.25): 0.2})
    assert c.verify_cost(32, 0.25) == pytest.approx(0.2)
    assert c.verify_cost(32, 4.0) == pytest.approx(0.6)
    c = StepCosts(verify={(8, 0.0): 0.1, (8, 4.0): 0.3, (32, 0.0): 0.2, (32, 2.0): 0.8})
    assert c.verify_cost(32, 4.0) == pytest.approx(1.4)  # its own steeper line
    # with no other bucket to borrow from, the own line (flat for a plain step alone)
    assert StepCosts(verify={(32, 0.0): 0.2}).verify_cost(32, 4.0) == pytest.approx(0.2)


def test_comparable_drops_draft_forwards_without_a_verification() -> None:
    # draft forwards in seconds, no verification: verify_cost is the unit 1.0, so the two
    # cannot be added up; the comparable table is the empty one (the prior prices drafts)
    only_draft = StepCosts(draft={1: 0.05})
    assert only_draft.verify_cost(1, 2.0) == 1.0 and only_draft.draft_cost(1, 1) == 0.05
    assert only_draft.comparable() == StepCosts()
    assert only_draft.comparable().draft_cost(1, 1, prior_ratio=0.5) == 0.5
    both = StepCosts(verify={(1, 0.0): 0.2}, draft={1: 0.05})
    assert both.comparable() is both
    assert StepCosts(verify={(1, 0.0): 0.2}).comparable().plain_cost(1) == 0.2


def test_plain_step_samples_age_out() -> None:
    rec = StepCostRecorder(window=15, min_samples=3, max_plain_age=100)
    for _ in range(15):  # measured steps 1..15 are plain (drafting off): 1.0 s
        rec.observe_verify(4, 0, 1.0)
    assert rec.plain_ages(4) == list(range(14, -1, -1))
    for now in range(16, 113):  # drafting steps only: the plain samples age, 3 are left
        rec.observe_verify(4, 8, 3.0)
        assert max(rec.plain_ages(4)) < 100, now
    assert rec.plain_ages(4) == [99, 98, 97] and rec.snapshot().has_plain(4)
    ready = rec.ready_keys
    rec.observe_verify(4, 8, 3.0)  # step 113: the plain step of step 13 is 100 steps old
    assert rec.plain_ages(4) == [99, 98] and not rec.snapshot().has_plain(4)
    assert rec.snapshot().verify == {(4, 2.0): 3.0}
    # back once 3 fresh plain steps are measured; a new value is not outvoted by old ones
    for _ in range(3):
        rec.observe_verify(3, 0, 2.0)
    assert rec.snapshot().verify[(4, 0.0)] == 2.0
    assert rec.ready_keys == ready + 1  # the key's return counts as a gain (a new table)
    # another bucket's steps do not age this one, and the window still caps the samples
    for _ in range(300):
        rec.observe_verify(16, 0, 5.0)
    assert rec.snapshot().verify[(4, 0.0)] == 2.0 and len(rec.plain_ages(16)) == 15
    with pytest.raises(ValueError):
        StepCostRecorder(max_plain_age=0)


def test_cost_curves_are_built_once_per_table_and_answer_as_a_fresh_table() -> None:
    """The interpolation curves are kept per table (a table serves many plans): repeated calls,
    scalar or array, answer what a fresh copy of the table answers, and tables do not share
    them."""
    import numpy as np

    verify = {(8, 0.0): 0.04, (8, 0.5): 0.07, (8, 2.0): 0.085, (32, 0.0): 0.15, (32, 1.0): 0.3}
    draft = {8: 0.05, 32: 0.12}
    table = StepCosts(verify=verify, draft=draft)
    queries = [(b, x) for b in (1, 6, 8, 20, 32, 64) for x in (0.0, 0.25, 0.9, 3.0, 7.5)]
    first = [table.verify_cost(b, x) for b, x in queries]
    again = [table.verify_cost(b, x) for b, x in queries]
    fresh = [StepCosts(verify=dict(verify), draft=dict(draft)).verify_cost(b, x)
             for b, x in queries]
    assert first == again == fresh
    xs = np.array([0.0, 0.3, 2.5, 9.0])
    assert np.array_equal(table.verify_cost(8, xs), StepCosts(verify=verify).verify_cost(8, xs))
    assert table.draft_cost(20, 32) == StepCosts(verify=verify, draft=draft).draft_cost(20, 32)
    other = StepCosts(verify={(8, 0.0): 1.0})
    assert other.plain_cost(8) == 1.0 and table.plain_cost(8) == 0.04
    assert table == StepCosts(verify=verify, draft=draft)  # the curves take no part in equality
