"""The known-redundancy model, two engines in one process, the bare config.

Each decoder family (greedy, sampled, TP=2, sliding windows) is in tests/test_architectures.py.
"""

from __future__ import annotations

import pytest

from tests.engine_utils import MetricsWindow, drafter_stats, engine, token_ids

pytestmark = pytest.mark.engine

PROMPTS = [[5, 77, 301, 12], [9, 8, 7, 6, 5, 4, 3, 2, 1, 400, 401], [33] * 20, [100, 200, 300]]


def _greedy(llm, max_tokens=40):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=p) for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return token_ids(llm.generate(prompts, params, use_tqdm=False))


def _tiny(name, **kw):
    from tests.tiny_models import tiny_model_dir

    return tiny_model_dir(name, **kw)


def test_zero_output_layers_are_free_to_skip():
    """Layers whose o_proj/down_proj are zero add nothing: skipping exactly them accepts all."""
    zero = [2, 5]
    model_dir = _tiny("e2e-zero", arch="llama", num_layers=8, zero_output_layers=zero)
    with engine(model_dir) as llm:
        reference = _greedy(llm)
    spec = {
        "method": "selfspec",
        "skip_attention": zero,
        "skip_mlp": zero,
        "num_speculative_tokens": 6,
        "adaptive": False,
        "drafts": "layer_skip",  # lookups are not exact: this is about the skipped layers
    }
    with engine(model_dir, spec) as llm:
        window = MetricsWindow(llm)
        assert _greedy(llm) == reference
        assert window.acceptance() == 1.0
        # ... while skipping a real layer of the same model does reject drafts
    spec_bad = {**spec, "skip_attention": [3], "skip_mlp": [4]}
    with engine(model_dir, spec_bad) as llm:
        window = MetricsWindow(llm)
        assert _greedy(llm) == reference
        assert window.acceptance() < 1.0


def test_two_engines_in_one_process_do_not_interfere():
    model_dir = _tiny("e2e-qwen2", arch="qwen2", num_layers=6)
    with engine(model_dir) as llm:
        reference = _greedy(llm)
    a = {
        "method": "selfspec",
        "skip_attention": [1],
        "num_speculative_tokens": 3,
        "adaptive": False,
    }
    b = {
        "method": "selfspec",
        "skip_attention": [2, 3],
        "skip_mlp": [4],
        "num_speculative_tokens": 5,
        "adaptive": False,
    }
    with engine(model_dir, a) as llm_a, engine(model_dir, b) as llm_b:
        assert _greedy(llm_a) == reference
        assert _greedy(llm_b) == reference
        stats_a, stats_b = drafter_stats(llm_a)[0], drafter_stats(llm_b)[0]
    assert (stats_a["skip_attention"], stats_a["skip_mlp"], stats_a["k_max"]) == ([1], [], 3)
    assert (stats_b["skip_attention"], stats_b["skip_mlp"], stats_b["k_max"]) == ([2, 3], [4], 5)


def test_bare_method_selfspec_works():
    """`{"method": "selfspec"}` alone: documented default k; online layer selection from the
    depth-based default skip set; it drafts, and its drafts are accepted.

    The model's zero-output layers are the default set's, so the default drafts are good ones."""
    from vllm_selfspec.config import DEFAULT_NUM_SPECULATIVE_TOKENS, default_skip_set

    attention, mlp = default_skip_set(8)
    assert not mlp
    model_dir = _tiny("e2e-bare", arch="llama", num_layers=8, zero_output_layers=attention)
    with engine(model_dir) as llm:
        reference = _greedy(llm)
    with engine(model_dir, {"method": "selfspec"}) as llm:
        window = MetricsWindow(llm)
        assert _greedy(llm) == reference
        drafted = window.delta()
        stats = drafter_stats(llm)[0]
    assert drafted["num_draft_tokens"] > 0, drafted
    assert drafted["num_accepted_tokens"] > 0, drafted
    assert stats["draft_tokens"] > 0, stats
    # no profile matches the tiny model: online layer selection starts from the default set
    online = stats["online"]
    assert online is not None
    assert online["initial_skip_attention"] == list(attention)
    assert online["initial_skip_mlp"] == list(mlp)
    assert stats["k_max"] == DEFAULT_NUM_SPECULATIVE_TOKENS
