"""Temperature > 0: selfspec output has the same token distribution as plain vLLM decoding.

The tiny model has a 576-token vocabulary, so a few hundred samples per position give a two-sample
chi-square test real power; the test first shows that power by telling T=1.0 from T=0.8 samples of
the plain engine apart. Then probabilistic drafts (the default) and argmax drafts must both match
plain decoding, and probabilistic drafts must be accepted more often. Greedy requests mixed into a
sampled batch stay token-identical to plain greedy decoding.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.engine_utils import MetricsWindow, engine, token_ids
from tests.sampling_stats import two_sample_p_value

pytestmark = pytest.mark.engine

NUM_SAMPLES = 800
NEW_TOKENS = 5
ALPHA = 1e-3  # family-wise false-alarm rate of the equality test
SKIP = {"skip_attention": [3, 5], "skip_mlp": [6], "num_speculative_tokens": 4, "adaptive": False}


@pytest.fixture(scope="module")
def model_dir():
    from vllm_selfspec.testing.tiny_models import tiny_model_dir

    return tiny_model_dir("e2e-llama", arch="llama", num_layers=8)


@pytest.fixture(scope="module")
def prompt():
    from vllm.inputs import TokensPrompt

    return TokensPrompt(prompt_token_ids=[5, 77, 301, 12, 96, 140, 33])


def _params(temperature, seed_base, **kw):
    from vllm import SamplingParams

    return [
        SamplingParams(
            temperature=temperature,
            max_tokens=NEW_TOKENS,
            seed=seed_base + i,
            ignore_eos=True,
            **kw,
        )
        for i in range(NUM_SAMPLES)
    ]


def _sample(llm, prompt, temperature, seed_base, **kw):
    params = _params(temperature, seed_base, **kw)
    outputs = llm.generate([prompt] * len(params), params, use_tqdm=False)
    samples = np.array(token_ids(outputs))
    assert samples.shape == (NUM_SAMPLES, NEW_TOKENS)
    return samples


def _greedy_mix(llm, prompt):
    """Sampled and greedy requests in one batch; returns the greedy outputs."""
    from vllm import SamplingParams

    params = _params(0.9, 10_000)[:24]
    greedy = SamplingParams(temperature=0.0, max_tokens=24)
    params[::3] = [greedy] * len(params[::3])
    outputs = llm.generate([prompt] * len(params), params, use_tqdm=False)
    return [list(outputs[i].outputs[0].token_ids) for i in range(0, len(params), 3)]


@pytest.fixture(scope="module")
def plain(model_dir, prompt):
    with engine(model_dir) as llm:
        return {
            "t1": _sample(llm, prompt, 1.0, 0),
            "t1_topk": _sample(llm, prompt, 1.0, 0, top_k=20, top_p=0.9),
            "t08": _sample(llm, prompt, 0.8, 0),
            "greedy": _greedy_mix(llm, prompt),
        }


@pytest.fixture(scope="module")
def probabilistic(model_dir, prompt):
    with engine(model_dir, {"method": "selfspec", **SKIP}) as llm:
        window = MetricsWindow(llm)
        result = {"t1": _sample(llm, prompt, 1.0, 50_000)}
        result["acceptance"] = window.acceptance()
        result["t1_topk"] = _sample(llm, prompt, 1.0, 60_000, top_k=20, top_p=0.9)
        result["greedy"] = _greedy_mix(llm, prompt)
        return result


@pytest.fixture(scope="module")
def argmax(model_dir, prompt):
    with engine(model_dir, {"method": "selfspec", **SKIP, "draft_sampling": "argmax"}) as llm:
        window = MetricsWindow(llm)
        result = {"t1": _sample(llm, prompt, 1.0, 70_000)}
        result["acceptance"] = window.acceptance()
        return result


def test_the_test_has_power(plain):
    # Different temperatures must be told apart with this sample size.
    assert two_sample_p_value(plain["t1"], plain["t08"]) < ALPHA


def test_probabilistic_drafts_keep_the_distribution(plain, probabilistic):
    assert two_sample_p_value(plain["t1"], probabilistic["t1"]) > ALPHA


def test_probabilistic_drafts_with_top_k_top_p(plain, probabilistic):
    assert two_sample_p_value(plain["t1_topk"], probabilistic["t1_topk"]) > ALPHA


def test_argmax_drafts_keep_the_distribution(plain, argmax):
    assert two_sample_p_value(plain["t1"], argmax["t1"]) > ALPHA


def test_sampled_drafts_are_accepted_more_often(probabilistic, argmax):
    assert 0.0 < argmax["acceptance"] < probabilistic["acceptance"]


def test_greedy_rows_in_sampled_batches_are_identical(plain, probabilistic):
    assert probabilistic["greedy"] == plain["greedy"]
