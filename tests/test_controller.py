"""Unit tests for vllm_selfspec.controller (pure Python, no vLLM needed)."""

from __future__ import annotations

import math
import random

import pytest

from vllm_selfspec.controller import (
    MAX_THRESHOLD,
    ControllerConfig,
    DraftLengthController,
    best_draft_length,
    expected_tokens,
    validate_request_overrides,
)


def make(k_max: int = 8, **kw) -> DraftLengthController:
    return DraftLengthController(ControllerConfig(k_max=k_max, **kw))


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
    ctl.observe_step_costs(batch_size=1, draft_step_s=0.6, verify_step_s=1.0)
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
    assert best_draft_length(0.0, 0.0, 8) == 0
    assert best_draft_length(1.0, 0.0, 8) == 8
    assert best_draft_length(1.0, 0.5, 8) == 8
    assert best_draft_length(1.0, 1.0, 8) == 0  # (k+1)/(k+1) never beats 1
    assert best_draft_length(0.3, 0.5, 8) == 0  # drafting pays only when a > r


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
    assert ctl.plan(["r"])[0] > 2
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
    ctl.observe_step_costs(batch_size=1, draft_step_s=0.01, verify_step_s=0.01, verify_tokens=9)
    assert ctl.plan(["r"]) == [0]  # draft as costly as verify: drafting never pays
    ctl = make()
    for _ in range(20):
        ctl.observe_verification("r", drafted=7, accepted=6)
    ctl.observe_step_costs(batch_size=1, draft_step_s=0.006, verify_step_s=0.01)
    assert 0 < ctl.plan(["r"])[0] <= 3


def test_cost_ratio_tiny_and_high_acceptance_gives_k_max() -> None:
    ctl = make()
    for _ in range(20):
        ctl.observe_verification("r", drafted=8, accepted=8)
    ctl.observe_step_costs(batch_size=1, draft_step_s=1e-5, verify_step_s=0.01)
    assert ctl.plan(["r"]) == [8]


def test_cost_ratio_is_per_batch_size_bucket() -> None:
    ctl = make()
    ctl.observe_step_costs(batch_size=1, draft_step_s=0.001, verify_step_s=0.01)
    ctl.observe_step_costs(batch_size=64, draft_step_s=0.009, verify_step_s=0.01)
    assert ctl.cost_ratio(1) == pytest.approx(0.1)
    assert ctl.cost_ratio(60) == pytest.approx(0.9)
    assert ctl.cost_ratio(2) == pytest.approx(0.1)  # nearest measured bucket
    assert make().cost_ratio(4) == 0.5  # prior
    ids = [f"r{i}" for i in range(64)]
    assert ctl.plan(["r0"])[0] > 0
    assert ctl.plan(ids) == [0] * 64


def test_cost_ratio_ema_and_bad_measurements_ignored() -> None:
    ctl = make(cost_ema=0.5)
    ctl.observe_step_costs(batch_size=4, draft_step_s=0.2, verify_step_s=1.0)
    ctl.observe_step_costs(batch_size=4, draft_step_s=0.4, verify_step_s=1.0)
    assert ctl.cost_ratio(4) == pytest.approx(0.3)
    ctl.observe_step_costs(batch_size=4, draft_step_s=0.4, verify_step_s=0.0)
    ctl.observe_step_costs(batch_size=4, draft_step_s=math.nan, verify_step_s=1.0)
    ctl.observe_step_costs(batch_size=0, draft_step_s=0.4, verify_step_s=1.0)
    assert ctl.cost_ratio(4) == pytest.approx(0.3)


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
    ctl.observe_step_costs(batch_size=2, draft_step_s=1.0, verify_step_s=1.0)
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
        ctl.observe_step_costs(batch_size=len(active) or 1, draft_step_s=rng.uniform(1, 5) * 1e-3,
                               verify_step_s=1e-2, verify_tokens=step)
    return plans


def test_determinism() -> None:
    a, b = make(), make()
    assert _drive(a, 7) == _drive(b, 7)
    assert a.stats() == b.stats()


def test_stats_and_window() -> None:
    ctl = make()
    ctl.plan(["a", "b"], overrides={"b": {"num_speculative_tokens": 0}})
    ctl.observe_verification("a", drafted=4, accepted=3)
    ctl.observe_step_costs(batch_size=2, draft_step_s=0.001, verify_step_s=0.01, verify_tokens=5)
    s = ctl.stats()
    assert all(isinstance(v, int | float) and not isinstance(v, bool) for v in s.values())
    assert s["drafting_off_share"] == 0.5
    assert s["mean_planned_draft_len"] > 0
    assert s["acceptance_rate"] == 0.75
    assert s["num_requests"] == 2
    assert s["mean_verify_tokens"] == 5
    assert 0 < s["mean_threshold"] < 1 and 0 < s["mean_acceptance_estimate"] <= 1
    ctl.reset_stats_window()
    s = ctl.stats()
    assert s["planned_steps"] == 0 and s["drafted"] == 0 and s["acceptance_rate"] == 0.0
    assert s["num_requests"] == 2
