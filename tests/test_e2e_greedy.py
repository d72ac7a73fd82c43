"""Greedy selfspec decoding is token-identical to plain vLLM decoding of the same model (CPU).

One plain engine computes the reference; then one selfspec engine per configuration (several skip
sets, K in {1, 4, 8}, adaptive on and off) runs the same workloads: batch 8 and batch 1, prompts of
different lengths, requests that end early (max_tokens, stop strings, stop token ids), prompts that
run into max_model_len, and per-request draft caps mixed in one batch.

The model has two layers with zero output projections (skipping them is exact). The default path
(adaptive draft lengths) skips exactly those: every draft lands, and its confidence exit fires on
the random model's low-confidence tokens. Its engine plans with pinned step costs
(``pin_step_costs``: a draft forward 0.3 plain steps): whether measured costs make drafting pay on a
tiny model follows the machine's timings (a CI run once drafted nothing for one test's requests
after five tests of drafting), and these tests are about what the path does when it drafts. The
fixed configurations skip real sub-layers, so their drafts are also rejected. Every test asserts
that drafts were verified during its own requests (a selfspec engine that drafts nothing would pass
any identity check).
"""

from __future__ import annotations

import pytest

from tests.engine_utils import MetricsWindow, drafter_stats, engine, token_ids
from tests.pinned_costs import PINNED_COSTS_EXTENSION, pin_step_costs

pytestmark = pytest.mark.engine

MAX_MODEL_LEN = 192
NUM_LAYERS = 8
ZERO_LAYERS = [2, 5]  # o_proj / down_proj are zero: skipping these sub-layers is exact
ADAPTIVE = "zero,k4,adaptive"

LAYER_SKIP = {"drafts": "layer_skip"}  # layer-skip drafts only: acceptance is the skip set's
CONFIGS = {
    # hybrid drafts (the default): prompt lookup where the corpus text repeats, layer skip
    # elsewhere
    "attn+mlp,k8,hybrid,fixed": {
        "skip_attention": [3, 5],
        "skip_mlp": [6],
        "num_speculative_tokens": 8,
        "adaptive": False,
    },
    # the default controller: adaptive is on unless switched off
    ADAPTIVE: {
        "skip_attention": ZERO_LAYERS,
        "skip_mlp": ZERO_LAYERS,
        "num_speculative_tokens": 4,
        **LAYER_SKIP,
    },
    "attn,k1,fixed": {"skip_attention": [4], "num_speculative_tokens": 1, "adaptive": False,
                      **LAYER_SKIP},
    "none,k4,fixed": {
        "skip_attention": [],
        "skip_mlp": [],
        "num_speculative_tokens": 4,
        "adaptive": False,
        **LAYER_SKIP,
    },
}
# configurations whose drafts are expected to land during any workload
EXPECT_ACCEPTED = {ADAPTIVE, "none,k4,fixed"}


@pytest.fixture(scope="module")
def model_dir():
    from tests.tiny_models import tiny_model_dir

    return tiny_model_dir(
        "e2e-zero", arch="llama", num_layers=NUM_LAYERS, zero_output_layers=ZERO_LAYERS
    )


@pytest.fixture(scope="module")
def workloads(model_dir):
    """Named lists of (prompt, SamplingParams)."""
    from transformers import AutoTokenizer
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from tests.tiny_models import tokenizer_corpus

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
    with engine(model_dir, config, max_model_len=MAX_MODEL_LEN,
                worker_extension_cls=PINNED_COSTS_EXTENSION) as llm:
        llm.config_name = request.param
        if request.param == ADAPTIVE:
            pin_step_costs(llm)
        yield llm


class Drafted:
    """Asserts, for the requests run inside the block, that the engine drafted (vLLM verified
    draft tokens) and, where the configuration's drafts are expected to land, that some were
    accepted."""

    def __init__(self, llm) -> None:
        self.llm = llm

    def __enter__(self) -> Drafted:
        self.window = MetricsWindow(self.llm)
        return self

    def __exit__(self, exc_type, *_) -> None:
        if exc_type is not None:
            return
        self.delta = d = self.window.delta()
        assert d["num_draft_tokens"] > 0, f"{self.llm.config_name} drafted nothing: {d}"
        if self.llm.config_name in EXPECT_ACCEPTED:
            assert d["num_accepted_tokens"] > 0, f"{self.llm.config_name}: nothing accepted {d}"


def test_batch8_identical(spec_engine, workloads, reference):
    with Drafted(spec_engine):
        assert _run(spec_engine, workloads["batch8"]) == reference["batch8"]


def test_batch1_identical(spec_engine, workloads, reference):
    with Drafted(spec_engine):
        assert _run_one_by_one(spec_engine, workloads["batch8"]) == reference["batch1"]


def test_early_stops_identical(spec_engine, workloads, reference):
    with Drafted(spec_engine):
        tokens, reasons = _run(spec_engine, workloads["early"])
    assert (tokens, reasons) == reference["early"]
    assert "stop" in reasons  # the workload really exercises early stops


def test_max_model_len_identical(spec_engine, workloads, reference):
    with Drafted(spec_engine):
        tokens, reasons = _run(spec_engine, workloads["long"])
    assert (tokens, reasons) == reference["long"]
    assert reasons == ["length"] * len(reasons)


def test_mixed_batch_identical(spec_engine, workloads, reference):
    with Drafted(spec_engine):
        assert _run(spec_engine, workloads["mixed"]) == reference["mixed"]


def test_per_request_draft_caps(spec_engine, workloads, reference):
    before = drafter_stats(spec_engine)[0]
    # a cap above the engine's k_max is refused when the request arrives: clip to this engine's
    ragged = []
    for prompt, params in workloads["ragged"]:
        params = params.clone()
        cap = params.extra_args["selfspec"]["num_speculative_tokens"]
        params.extra_args = {"selfspec": {"num_speculative_tokens": min(cap, before["k_max"])}}
        ragged.append((prompt, params))
    with Drafted(spec_engine):
        assert _run(spec_engine, ragged)[0] == reference["batch8"][0]
    after = drafter_stats(spec_engine)[0]
    if spec_engine.config_name.endswith("fixed") and after["k_max"] >= 4:
        # caps 1/4/8/0 in one batch: the pass drafted the longest budget and the drafts of the
        # requests with smaller caps were cut to theirs
        assert after["trimmed_tokens"] > before["trimmed_tokens"]


def test_acceptance(spec_engine, workloads):
    with Drafted(spec_engine) as drafted:
        _run(spec_engine, workloads["batch8"])
    d = drafted.delta
    acceptance = d["num_accepted_tokens"] / d["num_draft_tokens"]
    name = spec_engine.config_name
    if name.startswith(("none", "zero")):
        # nothing skipped, or only sub-layers that add exactly zero: every draft is accepted
        assert acceptance == 1.0, d
    else:
        # the drafter really skips a real sub-layer: some drafts are rejected
        assert acceptance < 1.0, d


def test_confidence_exit(spec_engine, workloads, reference):
    """Draft & Verify's draft-exiting: with adaptive drafting a draft round stops before its
    budget when the draft's top-1 probability falls under the request's exit threshold; with it
    off, never. Outputs stay identical either way.

    The requests set their own threshold (0.95): the engine-wide one is calibrated down to 0 on
    this model once its drafts are seen to always land, and then no longer fires."""
    from vllm import SamplingParams

    overridden = [
        (p, SamplingParams(temperature=0.0, max_tokens=sp.max_tokens,
                           extra_args={"selfspec": {"draft_confidence_threshold": 0.95}}))
        for p, sp in workloads["batch8"]
    ]
    before = drafter_stats(spec_engine)[0]
    with Drafted(spec_engine):
        assert _run(spec_engine, overridden) == reference["batch8"]
    after = drafter_stats(spec_engine)[0]
    exits = after["confidence_exits"] - before["confidence_exits"]
    if spec_engine.config_name == ADAPTIVE:
        assert exits > 0, after
    else:
        assert exits == 0, after
