"""The online layer search's algorithm (no vLLM, no engine): milliseconds per test."""

from __future__ import annotations

import random

import pytest

from vllm_selfspec.control.controller import expected_tokens
from vllm_selfspec.layers.online_search import (
    OnlineLayerSearch,
    OnlineSearchConfig,
    SubLayerCosts,
    estimated_speedup,
)
from vllm_selfspec.layers.skip_set import SkipSet

ZERO = SkipSet.of([2, 5], [2, 5])  # a model whose layers 2 and 5 add nothing


def _oracle(cand: SkipSet, zero: SkipSet = ZERO) -> float:
    """Matchness of a synthetic 8-layer model: zero-output sub-layers are free, others cost."""
    bad = len(set(cand.attention) - set(zero.attention)) + len(set(cand.mlp) - set(zero.mlp))
    return max(0.0, 1.0 - 0.3 * bad)


def _run(search: OnlineLayerSearch, oracle=_oracle, passes: int = 2000, positions: int = 64):
    for _ in range(passes):
        if not search.searching:
            break
        for cand in search.next_candidates():
            search.report(cand, round(oracle(cand) * positions), positions)
    return search


def test_expected_tokens_and_speedup():
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(0.5, 1) == pytest.approx(1.5)
    # a free, perfect draft: k_max drafts per step
    assert estimated_speedup(1.0, 0.0, 4) == (5.0, 4)
    # a draft as costly as verification never pays
    assert estimated_speedup(0.5, 1.0, 4) == (1.0, 0)


def test_config_validation():
    assert OnlineSearchConfig.from_dict(None) == OnlineSearchConfig()
    for bad in ({"window": 0}, {"overhead_share": 0}, {"overhead_share": 1.5}, {"nope": 1},
                {"budget": 0}, {"use_optuna": "yes"}, {"target_matchness": True},
                {"window": 64, "max_window_tokens": 32}):
        with pytest.raises(ValueError):
            OnlineSearchConfig.from_dict(bad)


@pytest.mark.parametrize("use_optuna", [False, True])
def test_converges_to_the_free_layers(use_optuna):
    cfg = OnlineSearchConfig(seed=3, budget_trials=15, use_optuna=use_optuna, incumbent_every=8)
    search = _run(OnlineLayerSearch(8, 4, cfg, initial=SkipSet.of([4, 6], [])))
    assert not search.searching, search.summary()
    assert search.incumbent == ZERO, search.summary()
    assert search.budget == 4
    assert search.matchness(ZERO) == 1.0


def test_deterministic_for_a_seed():
    def trace(seed):
        s = _run(OnlineLayerSearch(8, 4, OnlineSearchConfig(seed=seed, use_optuna=True)),
                 passes=120)
        return [h for h in s.history], s.incumbent

    assert trace(1) == trace(1)
    assert trace(1) != trace(2)


def test_fixed_budget_and_protected_layers():
    cfg = OnlineSearchConfig(seed=0, budget=3, use_optuna=False, max_steps=200)
    search = OnlineLayerSearch(10, 4, cfg)
    seen = []
    for _ in range(200):
        if not search.searching:
            break
        for cand in search.next_candidates():
            seen.append(cand)
            search.report(cand, 10, 64)
    assert not search.searching and "200 passes" in (search.converged_reason or "")
    assert search.budget == 3
    for cand in seen:
        assert 0 not in cand.attention + cand.mlp and 9 not in cand.attention + cand.mlp


def test_patience_stops_a_hopeless_search():
    cfg = OnlineSearchConfig(seed=0, patience=30, use_optuna=False)
    search = _run(OnlineLayerSearch(12, 4, cfg), oracle=lambda c: 0.0)
    assert not search.searching
    assert "without improvement" in (search.converged_reason or "")


def test_overhead_cadence():
    search = OnlineLayerSearch(8, 4, OnlineSearchConfig(overhead_share=0.1))
    search.set_pass_cost(pass_s=0.05, step_s=0.05)  # a pass costs a step: score every 9th
    assert search.score_interval == 9
    due = [search.due() for _ in range(27)]
    assert sum(due) == 3
    # share of time actually spent: 3 passes against 27 steps
    assert 3 * 0.05 / (27 * 0.05 + 3 * 0.05) <= 0.1 + 1e-9
    search.set_pass_cost(pass_s=0.001, step_s=0.05)
    assert search.score_interval == 1


def test_measured_costs_steer_the_objective():
    search = OnlineLayerSearch(8, 4, OnlineSearchConfig(), costs=SubLayerCosts.uniform(8))
    cand = SkipSet.of([1, 2, 3, 4], [1, 2, 3, 4])
    search.report(cand, 58, 64)
    cheap = search.objective(cand)
    assert cheap > 1.2
    search.observe_costs(draft_step_s=0.09, verify_step_s=0.1)  # drafting nearly as slow
    assert search.objective(cand) < cheap - 0.2


def test_restart_on_acceptance_drift():
    cfg = OnlineSearchConfig(seed=0, use_optuna=False, restart_window=50, restart_drop=0.2)
    search = _run(OnlineLayerSearch(8, 4, cfg))
    assert not search.searching
    assert not search.observe_acceptance(50, 45)  # baseline 0.9
    assert not search.observe_acceptance(50, 40)  # 0.8: within the margin
    assert search.observe_acceptance(50, 10)  # 0.2: a new task
    assert search.searching and search.restarts == 1
    # the new traffic makes other layers free: the search follows
    other = SkipSet.of([3], [3, 4])
    _run(search, oracle=lambda c: _oracle(c, other))
    assert search.incumbent == other, search.summary()


def test_tp_ranks_agree():
    """Two searches fed the same scores take the same decisions (the TP contract)."""
    a = OnlineLayerSearch(8, 4, OnlineSearchConfig(seed=7))
    b = OnlineLayerSearch(8, 4, OnlineSearchConfig(seed=7))
    rng = random.Random(0)
    for _ in range(200):
        ca, cb = a.next_candidates(), b.next_candidates()
        assert ca == cb
        for cand in ca:
            hits = rng.randint(0, 64)
            a.report(cand, hits, 64)
            b.report(cand, hits, 64)
    assert a.summary() == b.summary()


# ------------------------------------------------------------------ selfspec config keys


def _fp(layers: int = 8):
    from vllm_selfspec.layers.profiles import ModelFingerprint

    return ModelFingerprint("LlamaForCausalLM", layers, 128, 576, name="tiny")


def test_online_is_the_default_only_when_nothing_chose_the_set():
    from vllm_selfspec.config import default_skip_set, resolve_settings

    s = resolve_settings({}, _fp())
    assert s.layer_selection == "online"
    assert (s.skip_attention, s.skip_mlp) == default_skip_set(8)  # the starting set
    assert resolve_settings({"skip_attention": [3]}, _fp()).layer_selection == "static"
    assert resolve_settings({"layer_selection": "static"}, _fp()).layer_selection == "static"
    assert resolve_settings({}, _fp(3)).layer_selection == "static"  # nothing to skip
    seeded = resolve_settings({"skip_attention": [3], "layer_selection": "online"}, _fp())
    assert seeded.layer_selection == "online" and seeded.skip_attention == (3,)


def test_online_keys_fail_at_engine_start(tmp_path):
    from vllm_selfspec.config import SelfSpecSettings, resolve_settings
    from vllm_selfspec.errors import SelfSpecConfigError

    ok = resolve_settings(
        {"layer_selection": "online", "online_search": {"window": 8},
         "online_profile_out": str(tmp_path / "p.json")},
        _fp(),
    )
    assert ok.online_search["window"] == 8
    assert SelfSpecSettings.from_dict(ok.to_dict()) == ok
    bad = [
        ({"layer_selection": "offline"}, "layer_selection must be"),
        ({"layer_selection": "online", "online_search": {"windw": 8}}, "unknown key 'windw'"),
        ({"layer_selection": "online", "online_search": {"overhead_share": 2}}, "overhead_share"),
        ({"layer_selection": "online", "online_search": [1]}, "mapping"),
        ({"layer_selection": "online", "online_search": {"budget": 99}}, "exceeds"),
        ({"layer_selection": "online", "online_search": {"protect_first": 4, "protect_last": 4}},
         "no layer to skip"),
        ({"layer_selection": "online", "online_profile_out": "/no/such/dir/p.json"},
         "does not exist"),
        ({"layer_selection": "online", "online_profile_out": "p.txt"}, ".json"),
        ({"skip_attention": [3], "online_profile_out": str(tmp_path / "p.json")},
         "needs layer_selection='online'"),
        ({"layer_selection": "static", "online_search": {}}, "needs layer_selection='online'"),
    ]
    for spec, message in bad:
        with pytest.raises(SelfSpecConfigError, match=message.replace("(", r"\(")):
            resolve_settings(spec, _fp())
