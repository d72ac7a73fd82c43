"""Unit tests for vllm_selfspec.control.controller (pure Python, no vLLM needed)."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from vllm_selfspec.control.controller import (
    MAX_THRESHOLD,
    ControllerConfig,
    DraftLengthController,
    best_speedup,
    expected_tokens,
    expected_tokens_array,
    validate_request_overrides,
)
from vllm_selfspec.control.step_costs import StepCostRecorder, StepCosts, bucket


def make(k_max: int = 8, **kw) -> DraftLengthController:
    """A controller; plain-step exploration off unless asked for (it has its own tests)."""
    kw.setdefault("explore_interval", 0)
    return DraftLengthController(ControllerConfig(k_max=k_max, **kw))


def costs(draft: float, plain: float = 1.0, slope: float = 0.0, batch: int = 1,
          k_max: int = 8) -> StepCosts:
    """A cost table: plain step ``plain``, verification ``plain + slope * x`` for ``x`` drafts
    per request, draft forward ``draft`` (all in the batch's bucket)."""
    b = bucket(batch)
    return StepCosts(verify={(b, float(x)): plain + slope * x for x in range(k_max + 1)},
                     draft={b: draft})


def threshold(ctl: DraftLengthController, req: str) -> float:
    return ctl._states[req].threshold


# ---- Draft & Verify threshold rule --------------------------------------------------------------
def test_threshold_rises_under_low_acceptance() -> None:
    ctl = make()
    prev = 0.6
    for _ in range(30):
        ctl.observe_verification("r", drafted=4, accepted=1)
        th = threshold(ctl, "r")
        assert th > prev
        prev = th
    assert prev <= MAX_THRESHOLD


def test_threshold_first_step_matches_formula() -> None:
    ctl = make()
    ctl.observe_verification("r", drafted=4, accepted=0)  # m = 0 < 0.9 -> new = th + eps
    assert threshold(ctl, "r") == pytest.approx(0.9 * 0.6 + 0.1 * 0.61)
    assert ctl._states["r"].m == pytest.approx(0.0)
    ctl.observe_verification("r", drafted=4, accepted=4)
    assert ctl._states["r"].m == pytest.approx(0.5)


def test_threshold_falls_under_high_acceptance_below_cap() -> None:
    ctl = make()
    ths = []
    for _ in range(30):
        ctl.observe_verification("r", drafted=3, accepted=3)  # 3 < k_max: exited early
        ths.append(threshold(ctl, "r"))
    # m = 0.5, 0.75, 0.875 < 0.9 for the first three reports, then >= 0.9: threshold decreases
    assert all(b < a for a, b in zip(ths[3:], ths[4:], strict=False))
    assert ths[-1] < 0.6


def test_threshold_holds_when_drafting_hit_k_max() -> None:
    ctl = make()
    ths = []
    for _ in range(20):
        ctl.observe_verification("r", drafted=8, accepted=8)
        ths.append(threshold(ctl, "r"))
    assert ths[3] == ths[-1]  # once m >= target, drafted == k_max keeps th


def test_threshold_holds_when_drafting_hit_planned_budget() -> None:
    ctl = make()
    ctl.set_step_costs(costs(draft=0.6))
    for _ in range(5):
        ctl.observe_verification("r", drafted=8, accepted=5)
    ctl._states["r"].m = 0.95  # recent acceptance above target
    (k,) = ctl.plan(["r"])
    assert 0 < k < 8
    before = threshold(ctl, "r")
    ctl.observe_verification("r", drafted=k, accepted=k)
    assert threshold(ctl, "r") == before


def test_threshold_clamped() -> None:
    ctl = make(initial_threshold=1.0, eps=0.5)
    for _ in range(10):
        ctl.observe_verification("r", drafted=2, accepted=0)
    assert threshold(ctl, "r") == MAX_THRESHOLD
    ctl = make(initial_threshold=0.0, eps=0.5)
    for _ in range(10):
        ctl.observe_verification("r", drafted=2, accepted=2)
    assert threshold(ctl, "r") == 0.0


def test_should_stop() -> None:
    ctl = make()
    ctl.plan(["r"])
    assert ctl.should_stop("r", 0.59)
    assert not ctl.should_stop("r", 0.6)
    assert not ctl.should_stop("r", 0.99)
    assert ctl.should_stop("r", math.nan)


# ---- cost-aware budget, drafting off and probes -------------------------------------------------
def test_expected_tokens_edges() -> None:
    assert expected_tokens(1.0, 5) == 6.0
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(0.5, 0) == 1.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


@pytest.mark.parametrize("a", [0.0, 0.3, 0.7, 0.95, 1.0])
@pytest.mark.parametrize("r", [0.0, 0.2, 0.9])
def test_best_speedup_is_the_brute_force_argmax(a: float, r: float) -> None:
    verify = lambda k: 1.0 + 0.4 * k  # noqa: E731  (verification grows with the tokens)
    rates = [1.0] + [expected_tokens(a, k) / (verify(k) + k * r) for k in range(1, 7)]
    rate, k = best_speedup(a, 6, draft_cost=r, verify_cost=verify)
    assert rate == pytest.approx(max(rates)) and k == rates.index(max(rates))
    # at least one draft: the best k >= 1 even where plain decoding would be better
    rate1, k1 = best_speedup(a, 6, draft_cost=r, verify_cost=verify, allow_zero=False)
    assert k1 >= 1 and rate1 == pytest.approx(max(rates[1:]))


def test_best_speedup_edges() -> None:
    assert best_speedup(1.0, 4, draft_cost=0.0) == (5.0, 4)  # free, always-right drafts
    assert best_speedup(0.0, 4, draft_cost=0.1) == (1.0, 0)  # drafts that never land
    assert best_speedup(1.0, 4, draft_cost=1.0)[1] == 0  # (k+1)/(k+1) ties go to k = 0
    assert expected_tokens(-0.5, 3) == 1.0 and expected_tokens(1.5, 3) == 4.0  # a clamped


def test_expected_tokens_array_matches_the_scalar_form() -> None:
    a = np.array([-0.5, 0.0, 0.3, 0.7, 0.999, 1.0, 1.5])
    k = np.arange(0, 9)
    grid = expected_tokens_array(a[:, None], k[None, :])
    scalar = [[expected_tokens(float(x), int(n)) for n in k] for x in a]
    np.testing.assert_allclose(grid, scalar, rtol=1e-12)


def test_new_request_drafts() -> None:
    ctl = make()
    assert ctl.plan(["new"])[0] > 0
    assert "new" in ctl._states


def test_drafting_turns_off_backs_off_and_comes_back() -> None:
    ctl = make(probe_interval=4, max_probe_interval=16, probe_budget=2)
    budgets = []
    for _ in range(80):  # drafts never land
        (k,) = ctl.plan(["r"])
        budgets.append(k)
        if k and 0 in budgets:
            assert k == 2  # probe budget
            assert not ctl.should_stop("r", 0.0)  # a probe is never cut short
        ctl.observe_verification("r", drafted=k, accepted=0)
    assert budgets[0] > 0
    first_off = budgets.index(0)
    assert all(k == 0 for k in budgets[first_off:first_off + 3])
    probes = [i for i, k in enumerate(budgets) if i > first_off and k]
    # a probe every probe_interval planned steps; failed probes double it, up to the maximum
    assert probes[0] - first_off == 3
    assert [b - a for a, b in zip(probes, probes[1:], strict=False)][:4] == [8, 16, 16, 16]

    while True:  # next probe succeeds: drafting comes back
        (k,) = ctl.plan(["r"])
        if k:
            break
    ctl.observe_verification("r", drafted=k, accepted=k)
    assert ctl.plan(["r"]) == [1]  # nothing measured: the ramp's one draft
    ctl.set_step_costs(StepCosts(verify={(1, 0.0): 1.0, (1, 1.0): 1.0}))
    assert ctl.plan(["r"])[0] == 2  # twice what was measured
    assert not ctl._states["r"].off


def test_first_probe_after_probe_interval() -> None:
    ctl = make(probe_interval=5)
    ctl.plan(["r"])
    ctl.observe_verification("r", drafted=8, accepted=0)
    for _ in range(6):
        ctl.observe_verification("r", drafted=1, accepted=0)
    budgets = [ctl.plan(["r"])[0] for _ in range(5)]
    assert budgets == [0, 0, 0, 0, 2]


def test_cost_ratio_high_gives_small_k() -> None:
    ctl = make()
    for _ in range(20):
        ctl.observe_verification("r", drafted=8, accepted=8)
    ctl.set_step_costs(costs(draft=1.0))
    assert ctl.plan(["r"]) == [0]  # draft as costly as verify: drafting never pays
    ctl = make()
    for _ in range(20):
        ctl.observe_verification("r", drafted=7, accepted=6)
    ctl.set_step_costs(costs(draft=0.6))
    assert 0 < ctl.plan(["r"])[0] <= 3


def test_cost_ratio_tiny_and_high_acceptance_gives_k_max() -> None:
    ctl = make()
    for _ in range(20):
        ctl.observe_verification("r", drafted=8, accepted=8)
    ctl.set_step_costs(costs(draft=1e-3))
    assert ctl.plan(["r"]) == [8]


def test_verification_cost_limits_drafting() -> None:
    """Drafts cheap and landing 90% of the time: free verification drafts to the cap, a
    verification that grows with the drafts it checks makes drafting shorter, then pointless."""
    def plan(slope: float) -> int:
        ctl = make()
        for _ in range(30):
            ctl.observe_verification("r", drafted=8, accepted=7)  # a = 7/8
        ctl.set_step_costs(costs(draft=0.02, slope=slope))
        return ctl.plan(["r"])[0]

    free, some, steep = plan(0.0), plan(0.15), plan(1.0)
    assert free == 8
    assert 0 < some < 8
    assert steep == 0


def test_verification_jump_counts() -> None:
    """A verification of any drafts costing 3 plain steps (a slow multi-token path) while each
    extra token is free: only long drafts of landing tokens pay."""
    ctl = make()
    verify = {(1, 0.0): 1.0, **{(1, float(x)): 3.0 for x in range(1, 9)}}
    ctl.set_step_costs(StepCosts(verify=verify, draft={1: 0.01}))
    for _ in range(30):
        ctl.observe_verification("r", drafted=8, accepted=8)
    assert ctl.plan(["r"]) == [8]
    for _ in range(30):
        ctl.observe_verification("r", drafted=8, accepted=3)  # a ~ 0.75: E(8) ~ 3.6 > 3.08
    k = ctl.plan(["r"])[0]
    assert k >= 6
    for _ in range(30):
        ctl.observe_verification("r", drafted=8, accepted=1)  # a ~ 0.5: E < 2 < 3
    assert ctl.plan(["r"]) == [0]


def test_costs_are_per_batch_size_bucket() -> None:
    ctl = make()
    verify = {(1, 0.0): 1.0, (1, 8.0): 1.0, (64, 0.0): 1.0, (64, 8.0): 9.0}
    ctl.set_step_costs(StepCosts(verify=verify, draft={1: 0.05, 64: 0.3}))
    assert ctl.cost_ratio(1) == pytest.approx(0.05)
    assert ctl.cost_ratio(64) == pytest.approx(0.3)
    assert ctl.verify_cost_ratio(64) == pytest.approx(9.0)
    assert ctl.verify_cost_ratio(2) == pytest.approx(1.0)  # nearest measured bucket
    assert make().cost_ratio(4) == 0.5  # prior
    ids = [f"r{i}" for i in range(64)]
    assert ctl.plan(["r0"])[0] > 0
    # in a batch of 64 verifying 8 drafts each costs 9 plain steps: no k pays for a = 0.85
    assert ctl.plan(ids) == [0] * 64
    assert not any(ctl._states[r].off for r in ids)  # left out of the plan, not off


def test_plain_step_exploration() -> None:
    ctl = make(explore_interval=64)
    for _ in range(5):
        ctl.observe_verification("r", drafted=8, accepted=8)
    plans = [ctl.plan(["r"])[0] for _ in range(40)]
    # the first plan of a batch size measures a plain step; while the cost table has no plain
    # step of that size, one every 2 drafting steps (a new batch size learns its costs fast)
    assert [i for i, k in enumerate(plans) if k == 0] == list(range(0, 40, 3))
    # once measured: one plain step every explore_interval drafting steps
    ctl = make(explore_interval=8)
    ctl.set_step_costs(costs(draft=0.01))
    for _ in range(5):
        ctl.observe_verification("r", drafted=8, accepted=8)
    plans = [ctl.plan(["r"])[0] for _ in range(30)]
    assert [i for i, k in enumerate(plans) if k == 0] == [0, 9, 18, 27]
    assert ctl.stats()["explorations"] == 4
    assert ctl.stats()["drafting_off_share"] == 0.0  # exploring is not "drafting off"
    # another batch size has its own schedule: its first plan explores
    assert ctl.plan(["r", "s", "t"]) == [0, 0, 0]
    # a step that drafts anyway (a probe, a fixed budget) is not made plain
    assert not ctl._explore_due(1, [(0.5, 2)])
    assert not make(explore_interval=0)._explore_due(1, [])


def _run_engine(ctl: DraftLengthController, rec: StepCostRecorder, steps: int,
                plain_s) -> list[tuple[int, float, list[int]]]:
    """Drive ``ctl`` like the drafter drives it: one request whose drafts always land, each
    step's verification time recorded in ``rec`` (plain steps cost ``plain_s(step)``, a
    verification 2% more per draft, a draft forward 10% of a plain step), the cost table
    handed over when it gains an entry and every 16 steps. Per step: the controller's plain
    cost, and the ages of the recorder's plain samples."""
    out = []
    synced, since_sync = -1, 0
    for step in range(steps):
        (k,) = ctl.plan(["r"])
        plain = plain_s(step)
        for _ in range(k):
            rec.observe_draft(1, 0.1 * plain)
        rec.observe_verify(1, k, plain * (1.0 + 0.02 * k))
        ctl.observe_verification("r", drafted=k, accepted=k)
        since_sync += 1
        if since_sync >= 16 or rec.ready_keys != synced:
            ctl.set_step_costs(rec.snapshot())
            synced, since_sync = rec.ready_keys, 0
        out.append((k, ctl.step_costs.plain_cost(1), rec.plain_ages(1)))
    return out


def test_plain_baseline_stays_fresh_while_drafting() -> None:
    """The plain step the controller compares drafting with is at most ``max_plain_age`` (256)
    measured steps old, plus the 16 steps between cost-table hand-overs: with the defaults a
    bucket that always drafts measures ~8 plain steps in every 256, and a plain step that got
    2x slower (another process took a core) is the baseline within ~150 steps (the median of
    ~8 turns once 5 new samples are in). With one plain step in 65 and 15-sample medians, the
    baseline stayed at the old cost for ~500 steps."""
    ctl = DraftLengthController(ControllerConfig(k_max=2))
    rec = StepCostRecorder()
    drift = 300
    trace = _run_engine(ctl, rec, 600, lambda step: 0.1 if step < drift else 0.2)
    plans = [k for k, _, _ in trace]
    assert 0.9 < sum(k == 2 for k in plans[50:]) / len(plans[50:]) < 0.99  # mostly drafting
    assert all(max(ages) < 256 and len(ages) >= 3 for _, _, ages in trace[100:])
    assert all(c == pytest.approx(0.1) for _, c, _ in trace[50:drift])
    turned = next(i for i, (_, c, _) in enumerate(trace) if c == pytest.approx(0.2))
    assert drift < turned <= drift + 256 + 16
    assert all(c == pytest.approx(0.2) for _, c, _ in trace[turned:])


def test_calibrated_exit_floor() -> None:
    ctl = make()
    ctl.plan(["r"])
    assert ctl.exit_threshold("r") == pytest.approx(0.6)
    # drafts of any confidence land: the floor goes down where there is evidence
    for _ in range(200):
        conf = [0.95, 0.75, 0.55, 0.35]
        ctl.observe_verification("r", drafted=4, accepted=4, confidences=conf)
    assert ctl.stats()["exit_threshold_floor"] == pytest.approx(0.3)
    assert ctl.exit_threshold("r") == pytest.approx(0.3)
    assert not ctl.should_stop("r", 0.4)
    assert ctl.should_stop("r", 0.2)
    # low-confidence drafts start failing: the floor rises back above them
    for _ in range(400):
        ctl.observe_verification("r", drafted=4, accepted=2, confidences=[0.95, 0.75, 0.35, 0.3])
    assert ctl.stats()["exit_threshold_floor"] >= 0.4
    assert ctl.should_stop("r", 0.35)
    # the top bin not qualifying leaves the paper's threshold alone
    bad = make()
    bad.plan(["r"])
    for _ in range(200):
        bad.observe_verification("r", drafted=2, accepted=0, confidences=[0.99, 0.99])
    assert bad.stats()["exit_threshold_floor"] == 1.0
    assert bad.exit_threshold("r") == threshold(bad, "r")
    # switched off: the paper's threshold only
    off = make(calibrated_exit=False)
    off.plan(["r"])
    for _ in range(200):
        off.observe_verification("r", drafted=4, accepted=4, confidences=[0.35] * 4)
    assert off.exit_threshold("r") == threshold(off, "r")


# ---- edge cases ---------------------------------------------------------------------------------
def test_k_max_one() -> None:
    ctl = make(k_max=1)
    assert ctl.plan(["r"]) == [1]
    for _ in range(10):
        ctl.observe_verification("r", drafted=1, accepted=1)
    th = threshold(ctl, "r")
    ctl.observe_verification("r", drafted=1, accepted=1)
    assert threshold(ctl, "r") == th  # drafted == k_max
    for _ in range(50):
        (k,) = ctl.plan(["r"])
        assert k in (0, 1)
        ctl.observe_verification("r", drafted=k, accepted=0)
    assert ctl.plan(["r"]) == [0] or ctl._states["r"].probing


def test_acceptance_exactly_zero_and_one() -> None:
    ctl = make()
    for _ in range(200):
        ctl.observe_verification("zero", drafted=8, accepted=0)
        ctl.observe_verification("one", drafted=8, accepted=8)
    assert ctl._states["zero"].acceptance == pytest.approx(0.0, abs=1e-12)
    assert ctl._states["one"].acceptance == pytest.approx(1.0, abs=1e-9)
    ctl._states["one"].acc_count = ctl._states["one"].try_count  # exactly 1
    ctl.set_step_costs(costs(draft=0.1, batch=2))
    assert ctl.plan(["zero", "one"]) == [0, 8]
    stats = ctl.stats()
    assert all(math.isfinite(v) for v in stats.values())


def test_drafted_zero_is_noop() -> None:
    ctl = make()
    ctl.plan(["r"])
    before = (threshold(ctl, "r"), ctl._states["r"].acceptance, ctl.stats())
    ctl.observe_verification("r", drafted=0, accepted=0)
    ctl.observe_verification("unknown", drafted=0, accepted=0)
    assert (threshold(ctl, "r"), ctl._states["r"].acceptance, ctl.stats()) == before
    assert "unknown" not in ctl._states


def test_retain_drops_state() -> None:
    ctl = make()
    ctl.plan(["a", "b"])
    for _ in range(5):
        ctl.observe_verification("a", drafted=4, accepted=0)
    ctl.retain(["b", "never-seen"])
    assert set(ctl._states) == {"b"}
    ctl.plan(["a"])
    assert threshold(ctl, "a") == 0.6  # fresh state
    ctl.retain([])
    assert ctl.stats()["num_requests"] == 0


def test_adaptive_off() -> None:
    ctl = make(adaptive=False)
    for _ in range(30):
        ctl.observe_verification("r", drafted=8, accepted=0)
    ctl.set_step_costs(costs(draft=1.0, batch=2))
    assert ctl.plan(["r", "s"]) == [8, 8]
    assert not ctl.should_stop("r", 0.0)


# ---- per-request overrides ----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"num_speculative_tokens": -1}, "num_speculative_tokens"),
        ({"num_speculative_tokens": 2.0}, "num_speculative_tokens"),
        ({"num_speculative_tokens": True}, "num_speculative_tokens"),
        ({"num_speculative_tokens": 9}, "exceeds"),
        ({"adaptive": "yes"}, "adaptive"),
        ({"draft_confidence_threshold": 1.5}, "draft_confidence_threshold"),
        ({"draft_confidence_threshold": "0.5"}, "draft_confidence_threshold"),
        ({"k": 3}, "unknown selfspec override key 'k'"),
        (["num_speculative_tokens"], "dict"),
    ],
)
def test_override_validation_errors(overrides, match) -> None:
    with pytest.raises(ValueError, match=match):
        validate_request_overrides(overrides, k_max=8)


def test_override_validation_ok() -> None:
    assert validate_request_overrides(None) == {}
    assert validate_request_overrides({"num_speculative_tokens": 100}) == {
        "num_speculative_tokens": 100}  # no k_max given: no upper bound
    out = validate_request_overrides(
        {"num_speculative_tokens": 3, "adaptive": False, "draft_confidence_threshold": 1},
        k_max=8)
    assert out == {"num_speculative_tokens": 3, "adaptive": False,
                   "draft_confidence_threshold": MAX_THRESHOLD}


def test_overrides_in_plan() -> None:
    ctl = make()
    ctl.set_step_costs(costs(0.5, batch=4))  # measured: the ramp does not bound these plans
    ov = {"off": {"num_speculative_tokens": 0},
          "cap": {"num_speculative_tokens": 1},
          "fixed": {"adaptive": False},
          "th": {"draft_confidence_threshold": 0.3}}
    assert ctl.plan(["off", "cap", "fixed", "th"], overrides=ov)[:3] == [0, 1, 8]
    assert not ctl.should_stop("fixed", 0.0)
    assert threshold(ctl, "th") == 0.3
    assert not ctl.should_stop("th", 0.35)
    ctl.observe_verification("th", drafted=4, accepted=0)
    ctl.plan(["th"], overrides=ov)
    assert threshold(ctl, "th") > 0.3  # initial only: the rule keeps adapting it
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        ctl.plan(["x"], overrides={"x": {"num_speculative_tokens": 9}})


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="k_max"):
        ControllerConfig(k_max=0)
    with pytest.raises(ValueError, match="initial_threshold"):
        ControllerConfig(k_max=4, initial_threshold=1.5)


# ---- determinism and stats ----------------------------------------------------------------------
def _drive(ctl: DraftLengthController, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    ids = [f"r{i}" for i in range(6)]
    plans = []
    for step in range(300):
        active = [r for r in ids if rng.random() > 0.1]
        ctl.retain(active)
        budgets = ctl.plan(active)
        plans.append(budgets)
        for req, k in zip(active, budgets, strict=True):
            made = 0
            for _ in range(k):
                made += 1
                if ctl.should_stop(req, rng.random()):
                    break
            ctl.observe_verification(req, drafted=made, accepted=rng.randint(0, made))
        if step % 16 == 0:
            ctl.set_step_costs(costs(draft=rng.uniform(1, 5) * 1e-3, plain=1e-2, slope=1e-3,
                                     batch=len(active) or 1))
    return plans


def test_determinism() -> None:
    a, b = make(explore_interval=16), make(explore_interval=16)
    assert _drive(a, 7) == _drive(b, 7)
    assert a.stats() == b.stats()


def test_stats_and_window() -> None:
    ctl = make()
    ctl.set_step_costs(costs(draft=0.001, plain=0.01, batch=2))
    ctl.plan(["a", "b"], overrides={"b": {"num_speculative_tokens": 0}})
    ctl.observe_verification("a", drafted=4, accepted=3)
    s = ctl.stats()
    assert all(isinstance(v, int | float) and not isinstance(v, bool) for v in s.values())
    assert s["drafting_off_share"] == 0.5
    assert s["mean_planned_draft_len"] > 0
    assert s["acceptance_rate"] == 0.75
    assert s["num_requests"] == 2
    assert s["plain_step_s"] == 0.01 and s["cost_ratio"] == pytest.approx(0.1)
    assert 0 < s["mean_threshold"] < 1 and 0 < s["mean_acceptance_estimate"] <= 1
    ctl.reset_stats_window()
    s = ctl.stats()
    assert s["planned_steps"] == 0 and s["drafted"] == 0 and s["acceptance_rate"] == 0.0
    assert s["num_requests"] == 2


def test_min_gain_keeps_drafting_off_near_break_even() -> None:
    # a = 1, k = 4, free verification: 5 tokens in 1 + 4 d plain steps. d = 0.2: 2.8x;
    # d = 0.77: 1.22x; d = 0.93: 1.06x, which drafts with no margin or a 5% one, and not with
    # the default 10% (a gain that small is within the noise of the measured costs)
    for draft, min_gain, drafts in ((0.2, None, True), (0.77, None, True), (0.93, None, False),
                                    (0.93, 0.05, True), (0.93, 0.0, True)):
        ctl = make(k_max=4) if min_gain is None else make(k_max=4, min_gain=min_gain)
        ctl.set_step_costs(costs(draft=draft, k_max=4))
        for _ in range(20):
            ctl.observe_verification("r", drafted=4, accepted=4)
        assert (ctl.plan(["r"])[0] > 0) == drafts, (draft, min_gain)
    with pytest.raises(ValueError):
        make(min_gain=1.0)


def test_draft_cost_alone_is_not_set_against_a_unit_verification() -> None:
    """The reported case: the table holds only a draft forward (50 ms at one row), no
    verification yet, so ``verify_cost`` is the unit 1.0; added to the draft's seconds, drafts
    looked nearly free (1 + 0.05 k "plain steps") and a request at acceptance 0.3 was judged
    worth k = 2 alone. Without a measured verification the prior prices the draft forward
    (0.5 plain steps): nothing pays at a = 0.3."""
    ctl = make(prior_acceptance=0.3)
    ctl.set_step_costs(StepCosts(draft={1: 0.05}))
    assert ctl._state("r").acceptance == pytest.approx(0.3)
    assert ctl._standalone_lengths(np.array([0.3]), np.array([8])).tolist() == [0]
    assert ctl.plan(["r"]) == [0]
    assert ctl.cost_ratio(1) == pytest.approx(0.5)  # the prior, not 0.05
    assert ctl._min_probe_interval(1, 1) == 0  # the configured probe schedule, as with no costs
    # a batch plan with draft forwards only: (4 + 4 * 0.5) tokens in 1.5 plain steps is no gain
    assert ctl._batch_plan(4, np.full(4, 0.5), np.full(4, 8), []).tolist() == [0] * 4
    # once the verification is measured the same 50 ms decide, in the plain step's units
    ctl.set_step_costs(StepCosts(verify={(1, 0.0): 1.0}, draft={1: 0.05}))  # 5% of a step
    assert ctl._standalone_lengths(np.array([0.3]), np.array([8])).tolist() == [2]
    assert ctl.cost_ratio(1) == pytest.approx(0.05)
    ctl.set_step_costs(StepCosts(verify={(1, 0.0): 0.1}, draft={1: 0.05}))  # half a step
    assert ctl._standalone_lengths(np.array([0.3]), np.array([8])).tolist() == [0]
    # only another batch size's verification measured: batch 1 has no verification, the prior
    ctl.set_step_costs(StepCosts(verify={(8, 0.0): 1.0}, draft={1: 0.05}))
    assert ctl._standalone_lengths(np.array([0.3]), np.array([8])).tolist() == [0]


def test_new_batch_size_ramps_up_its_drafts() -> None:
    # batch 8 has only its plain step measured (verification borrowed from batch 1, nearly
    # free): the plan verifies at most 1 draft per request until more has been measured there
    ctl = make(k_max=4)
    base = {(1, 0.0): 1.0, (1, 4.0): 1.0, (8, 0.0): 1.0}
    ctl.set_step_costs(StepCosts(verify=base, draft={1: 0.05, 8: 0.05}))
    ids = [f"r{i}" for i in range(8)]
    for rid in ids:
        for _ in range(10):
            ctl.observe_verification(rid, drafted=4, accepted=4)
    assert ctl.plan(ids) == [1] * 8
    ctl.set_step_costs(StepCosts(verify={**base, (8, 1.0): 1.0}, draft={1: 0.05, 8: 0.05}))
    assert ctl.plan(ids) == [2] * 8  # twice what was measured
    ctl.set_step_costs(StepCosts(verify={**base, (8, 2.0): 1.0}, draft={1: 0.05, 8: 0.05}))
    assert ctl.plan(ids) == [4] * 8
    # nothing measured at all (the prior prices verification free): the ramp still holds
    assert make(k_max=4).plan(["fresh"]) == [1]


def test_ramp_holds_on_a_first_batch_of_32() -> None:
    # an engine whose first batch is 32 requests: nothing measured, every request confident;
    # the plan verifies at most one draft per request on average until verifications are measured
    ctl = make(k_max=4, explore_interval=32)
    ids = [f"r{i}" for i in range(32)]
    for rid in ids:
        for _ in range(10):
            ctl.observe_verification(rid, drafted=4, accepted=4)
    assert ctl.draft_limit(32) == 1.0
    plan = ctl.plan(ids)  # the bucket's first plan measures a plain step
    assert plan == [0] * 32
    plan = ctl.plan(ids)
    assert 0 < sum(plan) <= 32
    ctl.set_step_costs(StepCosts(verify={(32, 0.0): 1.0, (32, 1.0): 1.1}))
    assert ctl.draft_limit(32) == 2.0 and ctl.draft_limit(8) == 1.0


def test_restart_acceptance_after_the_draft_changed() -> None:
    # a poor draft switched every request off with a low engine-wide prior; probes of four off
    # requests, priced at the prior draft cost, come every 200 steps: longer than most requests
    ctl = make(k_max=4)
    ids = ["a", "b", "c", "d"]
    ctl.plan(ids)
    for rid, acc in zip(ids, [1, 1, 0, 0], strict=True):
        ctl.observe_verification(rid, drafted=1, accepted=acc, confidences=[0.5])
    ctl.set_step_costs(StepCosts(verify={(4, 0.0): 0.4}))
    assert ctl._min_probe_interval(4, 4) > 96
    assert all(ctl.plan(ids) == [0] * 4 for _ in range(96))
    assert ctl.plan(["new"]) == [0]  # a new request starts from the engine-wide prior: off
    # the online search switched to a set it measured at matchness 1.0: everything restarts
    ctl.restart_acceptance(1.0)
    assert ctl.engine_acceptance() == pytest.approx(1.0)
    assert all(k > 0 for k in ctl.plan(ids + ["new"]))
    assert ctl.stats()["exit_threshold_floor"] == 1.0  # the old calibration is forgotten
    # a set measured poor is not drafted with; no estimate falls back to the optimistic prior
    ctl.restart_acceptance(0.05)
    assert ctl.plan(["x"]) == [0]
    ctl.restart_acceptance(None)
    assert ctl.engine_acceptance() == pytest.approx(ctl.config.prior_acceptance)


def test_for_settings_takes_the_drafters_settings():
    from types import SimpleNamespace

    settings = SimpleNamespace(adaptive=False, draft_confidence_threshold=0.4,
                               target_acceptance=0.8)
    c = DraftLengthController.for_settings(settings, 5)
    assert (c.config.k_max, c.config.adaptive) == (5, False)
    assert (c.config.initial_threshold, c.config.target_acceptance) == (0.4, 0.8)


def test_running_request_overrides_never_fail_a_request():
    """A running request's overrides as both drafters read them: valid ones parsed, invalid
    ones (refused at arrival, so only reachable by a bypass) are left out with one warning."""
    from types import SimpleNamespace

    from vllm_selfspec.control.controller import running_request_overrides
    from vllm_selfspec.plugin.runner_view import RunnerView

    def state(extra):
        return SimpleNamespace(sampling_params=SimpleNamespace(extra_args=extra))

    runner = RunnerView(SimpleNamespace(requests={
        "ok": state({"selfspec": {"num_speculative_tokens": 2}}),
        "bad": state({"selfspec": {"num_speculative_tokens": 99}}),
        "none": state(None),
    })).extra_args
    warned: set[str] = set()
    assert running_request_overrides(runner, ["ok", "none", "gone"], 4, warned) == {
        "ok": {"num_speculative_tokens": 2}
    }
    import logging

    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # type: ignore[method-assign]
    log = logging.getLogger("vllm.selfspec.controller")  # vLLM may stop propagation to root
    log.addHandler(handler)
    try:
        assert running_request_overrides(runner, ["bad", "ok"], 4, warned) == {
            "ok": {"num_speculative_tokens": 2}
        }
        assert running_request_overrides(runner, ["bad"], 4, warned) == {}
    finally:
        log.removeHandler(handler)
    assert warned == {"bad"}
    assert sum("ignoring extra_args" in r.getMessage() for r in records) == 1


def test_drafts_worth_verifying() -> None:
    """A device pass's drafts (forwards already spent) are handed over up to the first whose
    chained top-1 probability is below the marginal verification cost (the first always: its
    verification is the plan's only feedback); all of them while
    verification is unmeasured, with adaptivity off, or during a probe. A request's own
    draft_confidence_threshold also cuts after its first draft below it (Draft & Verify)."""
    ctl = DraftLengthController(ControllerConfig(k_max=4))
    conf = [0.9, 0.8, 0.5, 0.9]  # chained: 0.9, 0.72, 0.36, 0.324
    assert ctl.drafts_worth_verifying("r", conf, 4, 0.05) == 4
    assert ctl.drafts_worth_verifying("r", conf, 4, 0.4) == 2
    assert ctl.drafts_worth_verifying("r", conf, 4, 0.95) == 1  # the first is always verified
    assert ctl.drafts_worth_verifying("r", [0.01, 0.9], 2, 0.05) == 1
    assert ctl.drafts_worth_verifying("r", conf, 2, 0.1) == 2  # never past the budget
    assert ctl.drafts_worth_verifying("r", conf, 4, 0.0) == 4
    assert ctl.drafts_worth_verifying("r", [0.9, math.nan, 0.9], 3, 0.01) == 1
    # the engine-wide Draft & Verify threshold (0.6) does not cut drafts already made ...
    assert ctl.drafts_worth_verifying("r", [0.5, 0.5], 2, 0.01) == 2
    # ... a request's own threshold does, after the first draft below it
    ctl.plan(["own"], overrides={"own": {"draft_confidence_threshold": 0.7}})
    assert ctl.drafts_worth_verifying("own", conf, 4, 0.01) == 3
    fixed = DraftLengthController(ControllerConfig(k_max=4, adaptive=False))
    assert fixed.drafts_worth_verifying("r", conf, 4, 0.95) == 4
    probing = DraftLengthController(ControllerConfig(k_max=4))
    probing._state("p").probing = True
    assert probing.drafts_worth_verifying("p", conf, 4, 0.95) == 4


def test_marginal_verify_cost() -> None:
    """(v(k) - 1) / k plain steps per draft token, from the measured costs; 0 while
    verification is unmeasured (free) and for k == 0."""
    ctl = DraftLengthController(ControllerConfig(k_max=4))
    assert ctl.marginal_verify_cost(1, 4) == 0.0
    ctl.set_step_costs(costs(draft=0.5, slope=0.05))
    assert ctl.marginal_verify_cost(1, 4) == pytest.approx(0.05, rel=0.05)
    assert ctl.marginal_verify_cost(1, 0) == 0.0


def _random_table(rng: np.random.Generator) -> StepCosts:
    """A measured-looking table over a few batch-size buckets (plain step, some drafting x's,
    a draft forward per bucket)."""
    verify: dict[tuple[int, float], float] = {}
    draft: dict[int, float] = {}
    for b in rng.choice([1, 4, 8, 32], size=int(rng.integers(1, 4)), replace=False):
        plain = 0.02 * float(b) ** 0.5 * rng.uniform(0.8, 1.2)
        for x in [0.0, 0.25, 0.5, 1.0, 2.0, 4.0][: int(rng.integers(1, 7))]:
            verify[(int(b), x)] = plain * (1.0 + rng.uniform(0.01, 0.4) * x)
        draft[int(b)] = plain * rng.uniform(0.02, 0.5)
    return StepCosts(verify=verify, draft=draft)


def _batch_plan_brute_force(ctl: DraftLengthController, batch_size: int, acc: np.ndarray,
                            caps: np.ndarray, x_limit: float) -> list[int]:
    """The batch plan's rule, one (cap, m) at a time in scalar arithmetic (no fixed rows)."""
    c, b, prior = ctl._priced, batch_size, ctl.config.prior_cost_ratio
    order = sorted(range(acc.size), key=lambda i: (-acc[i], i))

    def rate(ks: list[int]) -> float:
        time = float(c.verify_cost(b, sum(ks) / b))
        for depth in range(1, max(ks, default=0) + 1):
            time += float(c.draft_cost(sum(k >= depth for k in ks), b, prior))
        return (b + sum(expected_tokens(float(acc[i]), k) - 1.0
                        for i, k in zip(order, ks, strict=False))) / time

    base = best = rate([])
    plan = [0] * acc.size
    for cap_k in range(1, int(caps.max()) + 1):
        ks_all = [min(cap_k, int(caps[i])) for i in order]
        rates = [rate(ks_all[:m]) if sum(ks_all[:m]) <= x_limit * b + 1e-9 else -math.inf
                 for m in range(1, acc.size + 1)]
        m = int(np.argmax(rates)) + 1
        if rates[m - 1] > best * (1 + 1e-9) and rates[m - 1] > base * (1 + ctl.config.min_gain):
            best = rates[m - 1]
            plan = [0] * acc.size
            for i, k in zip(order[:m], ks_all[:m], strict=True):
                plan[i] = k
    return plan


def test_batch_plan_is_the_brute_force_argmax() -> None:
    # the plan prices every (common cap, number of candidates drafting) at once on arrays; the
    # same rule evaluated one plan at a time gives the same budgets
    rng = np.random.default_rng(0)
    for _ in range(150):
        ctl = make(k_max=int(rng.integers(1, 7)))
        ctl.set_step_costs(_random_table(rng))
        n = int(rng.choice([1, 3, 8, 17, 32]))
        acc = rng.beta(4.0, 1.5, size=n)
        caps = rng.integers(1, ctl.config.k_max + 1, size=n)
        x_limit = ctl.draft_limit(n)
        assert x_limit == max(1.0, 2.0 * ctl.step_costs.measured_x(n))
        plan = ctl._batch_plan(n, acc, caps, fixed=[]).tolist()
        assert plan == _batch_plan_brute_force(ctl, n, acc, caps, x_limit)


def test_prices_follow_each_new_cost_table() -> None:
    # prices are kept per table while planning: every new table prices afresh, exactly as a
    # controller that has only ever seen that table
    rng = np.random.default_rng(1)
    ctl = make(k_max=4)
    ids = [f"r{i}" for i in range(8)]
    for _ in range(20):
        table = _random_table(rng)
        ctl.set_step_costs(table)
        fresh = make(k_max=4)
        fresh.set_step_costs(table)
        for b in (1, 5, 8, 32):
            assert ctl.cost_ratio(b) == fresh.cost_ratio(b)
            for k in (0, 1, 2.5, 4):
                assert ctl.verify_cost_ratio(b, k) == fresh.verify_cost_ratio(b, k)
            assert ctl._min_probe_interval(b, 3) == fresh._min_probe_interval(b, 3)
        assert (ctl._standalone_lengths(np.full(8, 0.7), np.full(8, 4)).tolist()
                == fresh._standalone_lengths(np.full(8, 0.7), np.full(8, 4)).tolist())
        assert ctl.plan(ids) == fresh.plan(ids)
