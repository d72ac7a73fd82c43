"""End-to-end tests of prompt-lookup drafts (``"drafts": "hybrid"``, the default, and
``"lookup"``) against plain vLLM decoding.

Every test compares with a plain engine of the same model: greedy outputs token-identical. The
workloads repeat themselves (prompts made of a repeated phrase, and a tiny random model with small
weights, whose greedy continuations fall into loops), so that prompt lookup finds drafts: a test
fails if it found none or if none was accepted. The ``lookup`` engine never runs a layer-skip
pass; the hybrid engines (k fixed, and adaptive with pinned step costs) mix lookup and layer-skip
drafts, in one step and across steps. vLLM verifies what the drafter handed out, by both sources
(less the drafts of requests that end in the step).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.drafter_probe import DRAFTER_PROBE_EXTENSION
from tests.engine_utils import MetricsWindow, drafter_stats, engine, spec_metrics, token_ids
from tests.pinned_costs import pin_step_costs

pytestmark = pytest.mark.engine

LOSSY = {"skip_attention": [1, 2, 5, 6], "skip_mlp": [2, 3, 5], "num_speculative_tokens": 5}
LIGHT = {"skip_attention": [5, 6], "skip_mlp": [], "num_speculative_tokens": 5}
MAX_MODEL_LEN = 192
EXT = {"worker_extension_cls": DRAFTER_PROBE_EXTENSION}
CONFIGS = {
    "lookup": {**LOSSY, "drafts": "lookup"},
    "hybrid": {**LOSSY, "drafts": "hybrid", "prompt_lookup_min": 1, "prompt_lookup_max": 3},
    # a light skip set and cheap pinned draft forwards: the controller keeps layer-skip drafting on
    "hybrid adaptive": {**LIGHT, "drafts": "hybrid", "adaptive": True},
}


def _spec(cfg: dict[str, Any]) -> dict[str, Any]:
    return {"method": "selfspec", "adaptive": False, **cfg}  # k fixed unless cfg says


@pytest.fixture(scope="module")
def model_dir():
    from tests.tiny_models import tiny_model_dir

    # small initial weights: greedy continuations fall into short loops, which prompt lookup
    # predicts often but not always (offline: ~70% of its draft tokens right)
    return tiny_model_dir("e2e-llama-loops", arch="llama", num_layers=8, initializer_range=0.05)


def _repeated(n: int, seed: int, period: int) -> list[int]:
    return [(7 * seed + 13 * (j % period)) % 500 + 3 for j in range(n)]


def _workloads() -> dict[str, list[tuple[list[int], dict[str, Any]]]]:
    """name -> [(prompt token ids, SamplingParams kwargs)]."""
    greedy = {"temperature": 0.0, "ignore_eos": True}
    return {
        "batch": [
            (_repeated(12 + 5 * i, i, 4 + i % 3), {**greedy, "max_tokens": 48 + 5 * i})
            for i in range(8)
        ],
        "single": [(_repeated(24, 3, 6), {**greedy, "max_tokens": 96})],
        # 160 + 48 > MAX_MODEL_LEN: lookup drafts must stop at the limit
        "near_end": [(_repeated(160, i, 5), {**greedy, "max_tokens": 48}) for i in range(2)],
        "caps": [
            (
                _repeated(16, 20 + i, 4),
                {
                    **greedy,
                    "max_tokens": 48,
                    "extra_args": None
                    if cap is None
                    else {"selfspec": {"num_speculative_tokens": cap}},
                },
            )
            for i, cap in enumerate([0, 1, 2, None])
        ],
    }


def _generate(llm: Any, requests: list[tuple[list[int], dict[str, Any]]]) -> list[list[int]]:
    from vllm import SamplingParams

    prompts = [{"prompt_token_ids": p} for p, _ in requests]
    return token_ids(llm.generate(prompts, [SamplingParams(**kw) for _, kw in requests]))


@pytest.fixture(scope="module")
def reference(model_dir):
    with engine(model_dir, max_model_len=MAX_MODEL_LEN) as llm:
        return {name: _generate(llm, reqs) for name, reqs in _workloads().items()}


@pytest.fixture(scope="module", params=list(CONFIGS))
def dev(request, model_dir, reference):
    """One engine per configuration, one alive at a time (vLLM's metrics of two engines in one
    process mix). Step costs pinned; the adaptive one's (cheap draft forwards) keep layer-skip
    drafting on."""
    cfg = CONFIGS[request.param]
    with engine(model_dir, _spec(cfg), max_model_len=MAX_MODEL_LEN, **EXT) as llm:
        # the source choice weighs step costs: pinned, it does not follow this machine's timings
        pin_step_costs(llm, draft_ratio=0.05 if cfg.get("adaptive") else 0.3)
        yield request.param, llm


def _delta(before: dict[str, Any], after: dict[str, Any], key: str) -> int:
    return after[key] - before[key]


@pytest.mark.parametrize("name", list(_workloads()))
def test_greedy_identical_and_lookup_drafts_land(dev, reference, name):
    kind, llm = dev
    window = MetricsWindow(llm)
    [before] = drafter_stats(llm)
    assert _generate(llm, _workloads()[name]) == reference[name]
    [after] = drafter_stats(llm)
    delta = window.delta()
    # vLLM verified what the drafter handed out, from both sources (less the drafts of requests
    # that ended in the step: the scheduler drops those)
    assert 0 < delta["num_draft_tokens"] <= _delta(before, after, "draft_tokens"), (before, after)
    lookup_tokens = _delta(before, after, "lookup_tokens")
    assert lookup_tokens > 0 and _delta(before, after, "lookup_accepted") > 0, (before, after)
    assert _delta(before, after, "lookup_accepted") <= lookup_tokens
    # a lookup draft handed out was found first (found and not taken: it did not pay)
    handed = _delta(before, after, "lookup_rows")
    assert _delta(before, after, "lookup_found") >= handed > 0, (before, after)
    if kind == "lookup":
        assert after["draft_passes"] == 0 and lookup_tokens == _delta(before, after, "draft_tokens")
        assert _delta(before, after, "lookup_only_steps") > 0
        # every step ran without a pass, and none of them had vLLM prepare the pass's inputs:
        # the rejected counts come from the sampled tokens, and match vLLM's own
        assert _delta(before, after, "prepare_skipped") == _delta(before, after, "steps")
        assert _delta(before, after, "lookup_accepted") == delta["num_accepted_tokens"]
        # a request-step handed a lookup draft is not "drafting off"
        off = _delta(before, after, "rows_off")
        assert off + handed == _delta(before, after, "rows_considered"), (before, after)
    print(f"{kind} / {name}: {lookup_tokens} lookup and "
          f"{_delta(before, after, 'draft_tokens') - lookup_tokens} layer-skip draft tokens, "
          f"acceptance {delta['num_accepted_tokens'] / delta['num_draft_tokens']:.2f}")


def test_hybrid_mixes_sources(dev, reference):
    """The hybrid engines draft by both sources; steps whose every draft was a lookup ran no
    pass."""
    kind, llm = dev
    if kind == "lookup":
        pytest.skip("lookup only")
    [before] = drafter_stats(llm)
    assert _generate(llm, _workloads()["batch"]) == reference["batch"]
    [after] = drafter_stats(llm)
    lookup = _delta(before, after, "lookup_tokens")
    assert 0 < lookup < _delta(before, after, "draft_tokens"), (before, after)
    assert _delta(before, after, "draft_passes") > 0, (before, after)


def test_cap_zero_gets_no_lookup_drafts(dev, reference):
    kind, llm = dev
    window = MetricsWindow(llm)
    [before] = drafter_stats(llm)
    assert _generate(llm, _workloads()["caps"][:1]) == reference["caps"][:1]
    [after] = drafter_stats(llm)
    assert window.delta()["num_draft_tokens"] == 0
    assert _delta(before, after, "lookup_rows") == 0 and _delta(before, after, "draft_passes") == 0


def test_tensor_parallel_2_hybrid_greedy_identical(model_dir, reference):
    """TP=2, hybrid drafts with the machine's own step costs (not pinned): each rank finds the
    same lookups in its copy of the token ids and chooses between them and layer-skip drafts by
    rank 0's step costs, so both ranks run the same passes; the output is the plain TP=1 one."""
    from tests.engine_utils import env

    tp = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
    # one core per rank (vLLM's CPU TP needs explicit thread binding on this kind of machine)
    with env(VLLM_CPU_OMP_THREADS_BIND="0|1"), engine(
        model_dir, _spec(CONFIGS["hybrid"]), max_model_len=MAX_MODEL_LEN, **tp, **EXT
    ) as llm:
        assert _generate(llm, _workloads()["batch"]) == reference["batch"]
        ranks = drafter_stats(llm)
    assert len(ranks) == 2
    # the same counters and plans on both ranks (the times each rank measured are its own)
    same = [{k: v for k, v in r.items() if not k.endswith("_s")} for r in ranks]
    assert same[0] == same[1], ranks
    stats = ranks[0]
    assert stats["lookup_tokens"] > 0 and stats["lookup_accepted"] > 0, stats
    assert stats["draft_passes"] > 0 and stats["draft_tokens"] > stats["lookup_tokens"], stats
    print(f"TP=2 hybrid: {stats['lookup_tokens']} lookup draft tokens "
          f"({stats['lookup_accepted']} accepted), "
          f"{stats['draft_tokens'] - stats['lookup_tokens']} layer-skip, "
          f"{stats['draft_passes']} passes")


def test_metrics_split_by_source(dev, reference):
    """``vllm:selfspec_num_*{source=...}`` summed over the sources are vLLM's own spec-decode
    counters (one engine, counted since it started); the lookup ones are what the drafter counted
    as accepted lookup tokens; the ``lookup`` engine has no layer-skip drafts, the hybrid ones
    have both."""
    from vllm_selfspec.tools.spec_decode_counters import read_source_counters

    kind, llm = dev
    assert _generate(llm, _workloads()["batch"]) == reference["batch"]
    by_source = read_source_counters(llm)
    vllm_counts = spec_metrics(llm)
    assert set(by_source) == {"lookup", "layer_skip"}, by_source
    for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        assert sum(c[key] for c in by_source.values()) == vllm_counts[key], (by_source, key)
    [stats] = drafter_stats(llm)
    assert by_source["lookup"]["num_accepted_tokens"] == stats["lookup_accepted"] > 0
    layer_skip = by_source["layer_skip"]["num_draft_tokens"]
    assert layer_skip == 0 if kind == "lookup" else layer_skip > 0, by_source
