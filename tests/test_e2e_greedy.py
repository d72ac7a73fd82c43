"""Greedy selfspec decoding is token-identical to plain vLLM decoding of the same model (CPU).

One plain engine computes the reference; then one selfspec engine per configuration (several skip
sets, K in {1, 4, 8}, adaptive on and off) runs the same workloads: batch 8 and batch 1, prompts of
different lengths, requests that end early (max_tokens, stop strings, stop token ids), prompts that
run into max_model_len, and per-request draft caps mixed in one batch.
"""

from __future__ import annotations

import pytest

from tests.engine_utils import MetricsWindow, drafter_stats, engine, token_ids

pytestmark = pytest.mark.engine

MAX_MODEL_LEN = 192
NUM_LAYERS = 8

CONFIGS = {
    "attn+mlp,k8,fixed": {
        "skip_attention": [3, 5],
        "skip_mlp": [6],
        "num_speculative_tokens": 8,
        "adaptive": False,
    },
    "attn,k4,adaptive": {"skip_attention": [2, 4, 6], "num_speculative_tokens": 4},
    "attn,k1,fixed": {"skip_attention": [5], "num_speculative_tokens": 1, "adaptive": False},
    "none,k4,fixed": {
        "skip_attention": [],
        "skip_mlp": [],
        "num_speculative_tokens": 4,
        "adaptive": False,
    },
}


@pytest.fixture(scope="module")
def model_dir():
    from vllm_selfspec.testing.tiny_models import tiny_model_dir

    return tiny_model_dir("e2e-llama", arch="llama", num_layers=NUM_LAYERS)


@pytest.fixture(scope="module")
def workloads(model_dir):
    """Named lists of (prompt, SamplingParams)."""
    from transformers import AutoTokenizer
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_selfspec.testing.tiny_models import tokenizer_corpus

    tok = AutoTokenizer.from_pretrained(model_dir)
    ids: list[int] = []
    for line in tokenizer_corpus():
        ids.extend(tok(line, add_special_tokens=False)["input_ids"])
    lengths = [3, 7, 12, 20, 33, 50, 80, 120]
    prompts = [TokensPrompt(prompt_token_ids=ids[i * 7 : i * 7 + n]) for i, n in enumerate(lengths)]
    max_tokens = [40, 24, 5, 1, 40, 17, 40, 33]

    def greedy(n: int, **kw) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=n, **kw)

    batch8 = [(p, greedy(n)) for p, n in zip(prompts, max_tokens, strict=True)]
    # requests that end early: a stop string, a stop token id, a tiny max_tokens
    early = [
        (prompts[0], greedy(40, stop=["e"])),
        (prompts[4], greedy(40, stop=[" the", "."])),
        (prompts[5], greedy(40, stop_token_ids=[ids[3], ids[9], ids[11]])),
        (prompts[1], greedy(2)),
    ]
    # prompts whose generation runs into max_model_len (finish reason "length")
    long_prompts = [
        (TokensPrompt(prompt_token_ids=ids[:170]), greedy(64)),
        (TokensPrompt(prompt_token_ids=ids[5:185]), greedy(64)),
        (TokensPrompt(prompt_token_ids=ids[9:199][: MAX_MODEL_LEN - 3]), greedy(64)),
    ]
    # per-request draft caps 1, 4, 8 and drafting switched off, in one batch
    caps = [1, 4, 8, 0, 1, 4, 8, 2]
    ragged = [
        (p, greedy(n, extra_args={"selfspec": {"num_speculative_tokens": c}}))
        for p, n, c in zip(prompts, max_tokens, caps, strict=True)
    ]
    mixed = batch8 + early + long_prompts
    return {
        "batch8": batch8,
        "early": early,
        "long": long_prompts,
        "ragged": ragged,
        "mixed": mixed,
    }


def _run(llm, workload):
    prompts = [p for p, _ in workload]
    params = [sp for _, sp in workload]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return token_ids(outputs), [o.outputs[0].finish_reason for o in outputs]


def _run_one_by_one(llm, workload):
    return [_run(llm, [item])[0][0] for item in workload]


@pytest.fixture(scope="module")
def reference(model_dir, workloads):
    with engine(model_dir, max_model_len=MAX_MODEL_LEN) as llm:
        ref = {name: _run(llm, wl) for name, wl in workloads.items()}
        ref["batch1"] = _run_one_by_one(llm, workloads["batch8"])
    return ref


@pytest.fixture(scope="module", params=list(CONFIGS), ids=list(CONFIGS))
def spec_engine(request, model_dir, reference):
    config = {"method": "selfspec", **CONFIGS[request.param]}
    with engine(model_dir, config, max_model_len=MAX_MODEL_LEN) as llm:
        llm.config_name = request.param
        yield llm


def test_batch8_identical(spec_engine, workloads, reference):
    assert _run(spec_engine, workloads["batch8"]) == reference["batch8"]


def test_batch1_identical(spec_engine, workloads, reference):
    assert _run_one_by_one(spec_engine, workloads["batch8"]) == reference["batch1"]


def test_early_stops_identical(spec_engine, workloads, reference):
    tokens, reasons = _run(spec_engine, workloads["early"])
    assert (tokens, reasons) == reference["early"]
    assert "stop" in reasons  # the workload really exercises early stops


def test_max_model_len_identical(spec_engine, workloads, reference):
    tokens, reasons = _run(spec_engine, workloads["long"])
    assert (tokens, reasons) == reference["long"]
    assert reasons == ["length"] * len(reasons)


def test_mixed_batch_identical(spec_engine, workloads, reference):
    assert _run(spec_engine, workloads["mixed"]) == reference["mixed"]


def test_per_request_draft_caps(spec_engine, workloads, reference):
    before = drafter_stats(spec_engine)[0]
    assert _run(spec_engine, workloads["ragged"])[0] == reference["batch8"][0]
    after = drafter_stats(spec_engine)[0]
    if spec_engine.config_name.endswith("fixed") and after["k_max"] >= 4:
        # caps 1/4/8/0 in one batch: some steps carried drafts of different lengths
        assert after["steps_with_ragged_drafts"] > before["steps_with_ragged_drafts"]


def test_acceptance(spec_engine, workloads):
    window = MetricsWindow(spec_engine)
    _run(spec_engine, workloads["batch8"])
    name = spec_engine.config_name
    if name.startswith("none"):
        # nothing skipped: the draft is the full model, every draft is accepted
        assert window.acceptance() == 1.0
    elif name.endswith("fixed"):
        # a random skip set on a random model: the drafter really skips layers
        assert window.acceptance() < 1.0


def test_drafts_never_pass_allocated_kv(spec_engine, workloads):
    _run(spec_engine, workloads["mixed"])
    for stats in drafter_stats(spec_engine):
        assert stats["kv_overflow_clips"] == 0, stats
        assert stats["draft_tokens"] > 0 or not spec_engine.config_name.endswith("fixed")
