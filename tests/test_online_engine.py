"""On-the-fly layer selection in a real engine (CPU, fp32, tiny models).

One plain engine (the reference) and one online engine are shared by the module; the online
engine runs the search aggressively (every step, several candidates, short warm-up) so that it
converges within a few hundred generated tokens. Drafting is asserted, not assumed: the engine
drafts while it searches, and once converged to the zero-output layers every draft is accepted.
"""

from __future__ import annotations

import json

import pytest

from tests.engine_utils import MetricsWindow, drafter_stats, engine, env, token_ids
from tests.online_kv_probe import ONLINE_KV_PROBE_EXTENSION
from tests.pinned_costs import pin_step_costs

pytestmark = pytest.mark.engine

ZERO = [2, 5]  # layers whose o_proj / down_proj are zero: skipping them is exact
PROMPTS = [[5, 77, 301, 12], [9, 8, 7, 6, 5, 4, 3, 2, 1, 400, 401], [33] * 20, [100, 200, 300]]
AGGRESSIVE = {
    "seed": 0,
    "overhead_share": 1.0,
    "candidates_per_step": 4,
    "min_tokens": 4,
    "window": 16,
    "budget_trials": 12,
}


def _zero_model():
    from tests.tiny_models import tiny_model_dir

    return tiny_model_dir("e2e-zero", arch="llama", num_layers=8, zero_output_layers=ZERO)


def _greedy(llm, max_tokens=96, prompts=PROMPTS):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    batch = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    return token_ids(llm.generate(batch, params, use_tqdm=False))


def _spec(**online):
    return {
        "method": "selfspec",
        "drafts": "layer_skip",  # layer-skip drafts only: the search is what these tests are about
        "layer_selection": "online",
        "skip_attention": [3, 6],  # a bad starting set: real layers
        "num_speculative_tokens": 4,
        "online_search": {**AGGRESSIVE, **online},
    }


@pytest.fixture(scope="module")
def reference():
    with engine(_zero_model()) as llm:
        return _greedy(llm)


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory):
    return str(tmp_path_factory.mktemp("online") / "found.json")


@pytest.fixture(scope="module")
def online(profile_path, reference):
    # the reference engine runs (and is shut down) first: vLLM's metrics registry is
    # per-process, and an engine started later would hide this one's spec-decode counters
    # pinned step costs (tests/pinned_costs.py): whether measured costs make drafting pay on this
    # tiny model follows the machine's timings, and the asserts below need the engine to draft
    # wherever acceptance says so
    with engine(_zero_model(), {**_spec(), "online_profile_out": profile_path},
                worker_extension_cls=ONLINE_KV_PROBE_EXTENSION) as llm:
        pin_step_costs(llm)
        yield llm


def _online_stats(llm):
    return [s["online"] for s in drafter_stats(llm)]


@pytest.fixture(scope="module")
def first_run(online):
    """The online engine's first requests, with the KV check armed for three scoring steps."""
    assert online.collective_rpc("selfspec_online_arm_kv_check", args=(3,)) == [True]
    window = MetricsWindow(online)
    outputs = _greedy(online)
    [checks] = online.collective_rpc("selfspec_online_kv_checks")
    return outputs, {**_online_stats(online)[0], "kv_checks": checks}, window.delta()


def test_greedy_identical_while_searching(online, first_run, reference):
    outputs, stats, drafted = first_run
    assert stats["passes"] > 0, stats  # the search really ran during these requests
    assert len(stats["trace"]) > 0, stats  # ... and changed the skip set
    # ... while the engine drafted and verified (the default, adaptive controller is on)
    assert drafted["num_draft_tokens"] > 0 and drafted["num_accepted_tokens"] > 0, drafted
    assert outputs == reference
    window = MetricsWindow(online)
    assert _greedy(online) == reference
    assert window.delta()["num_draft_tokens"] > 0, window.delta()


def test_scoring_passes_leave_the_kv_cache_untouched(first_run):
    _, stats, _ = first_run
    checks, failures = stats["kv_checks"]
    assert checks == 3 and failures == 0


def _zero_output_only(attention: list[int], mlp: list[int]) -> bool:
    """A non-empty set of zero-output sub-layers only: drafting with it is exact."""
    return bool(attention or mlp) and set(attention) <= set(ZERO) and set(mlp) <= set(ZERO)


def test_converges_to_the_zero_output_layers(online, profile_path, reference):
    for _ in range(6):
        stats = _online_stats(online)[0]
        if stats["state"] == "converged":
            break
        _greedy(online)
    assert stats["state"] == "converged", stats
    # In one CI run the search settled its budget at 3 and converged on patience at attention
    # [2, 5], MLP [2] (matchness 1.0), in other runs on all four: any exact set is a correct
    # answer.
    assert _zero_output_only(stats["skip_attention"], stats["skip_mlp"]), stats
    assert stats["matchness"] == 1.0
    # drafting with the found set: drafts are made and, the skipped sub-layers adding exactly
    # zero, every one of them is accepted
    window = MetricsWindow(online)
    assert _greedy(online) == reference
    drafted = window.delta()
    assert drafted["num_draft_tokens"] > 0, drafted
    assert drafted["num_accepted_tokens"] == drafted["num_draft_tokens"], drafted
    from vllm_selfspec.layers.profiles import load_profile

    profile = load_profile(profile_path)
    assert list(profile.skip_attention) == stats["skip_attention"]
    assert list(profile.skip_mlp) == stats["skip_mlp"]
    with open(profile_path) as f:
        assert json.load(f)["provenance"]["converged_reason"]


def test_kv_check_detects_writes():
    """Negative control for the KV check: scoring with real slots overwrites verified K/V."""
    spec = _spec(min_tokens=2, candidates_per_step=1)
    with engine(_zero_model(), spec, worker_extension_cls=ONLINE_KV_PROBE_EXTENSION) as llm:
        assert llm.collective_rpc("selfspec_online_arm_kv_check", args=(2, True)) == [True]
        _greedy(llm, max_tokens=16)
        [(checks, failures)] = llm.collective_rpc("selfspec_online_kv_checks")
    assert checks >= 1 and failures >= 1


def test_tensor_parallel_ranks_agree(reference):
    with (
        env(VLLM_CPU_OMP_THREADS_BIND="0|1"),
        engine(_zero_model(), _spec(), tensor_parallel_size=2,
               distributed_executor_backend="mp") as llm,
    ):
        assert _greedy(llm) == reference
        drafters = drafter_stats(llm)
    ranks = [s["online"] for s in drafters]
    assert len(ranks) == 2
    assert ranks[0]["passes"] > 0
    # both ranks drafted, the same number of tokens in the same number of forwards
    counts = [(s["draft_tokens"], s["draft_forwards"]) for s in drafters]
    assert counts[0][0] > 0 and counts[0] == counts[1], counts
    keys = ("passes", "trace", "skip_attention", "skip_mlp", "budget", "state", "matchness",
            "steps", "candidates_scored", "score_interval")
    assert {k: ranks[0][k] for k in keys} == {k: ranks[1][k] for k in keys}


def test_compiles_the_set_it_settles_on():
    """vLLM's default mode (inductor on CPU): the drafter explores with an eager draft and
    compiles the set the search settles on, mid-serving; outputs equal a compiled plain engine's
    throughout, and the compiled draft of the zero-output layers has every draft accepted."""
    with engine(_zero_model(), enforce_eager=False) as plain:
        expected = _greedy(plain)
    # k fixed: with measured costs the adaptive controller may find that drafting does not pay
    # on this tiny model, and the chosen set's compiled draft would not run
    with engine(_zero_model(), {**_spec(), "adaptive": False}, enforce_eager=False) as llm:
        for _ in range(6):
            assert _greedy(llm) == expected
            [stats] = drafter_stats(llm)
            if stats["online"]["state"] == "converged":
                break
        assert stats["online"]["state"] == "converged", stats["online"]
        # an exact set (see test_converges_to_the_zero_output_layers)
        assert _zero_output_only(stats["skip_attention"], stats["skip_mlp"]), stats
        window = MetricsWindow(llm)
        assert _greedy(llm) == expected
        drafted = window.delta()
        [stats] = drafter_stats(llm)
    # the starting set's draft (compiled at start-up) and the chosen set's, which drafted last
    assert stats["compiled_drafts"] == 2 and stats["draft_model"] == "compiled", stats
    assert drafted["num_accepted_tokens"] == drafted["num_draft_tokens"] > 0, drafted
