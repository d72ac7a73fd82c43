"""Temperature > 0: selfspec output has the same token distribution as plain vLLM decoding.

Setup: the 8-layer tiny llama (576-token vocabulary, fp32), one prompt, ``NUM_SAMPLES`` seeded
requests of ``NEW_TOKENS`` tokens per sampling configuration, on plain vLLM and on selfspec with
``num_speculative_tokens=4``, adaptive drafting off (every round drafts 4 tokens, so all four draft
slots are verified in every round and the sequences span several verification rounds). Sampling
configurations: temperature 0.3, 0.7 and 1.3, and at temperature 1.0 top-p 0.9 and top-k 20
(layer-skip drafts; prompt lookups have their own test below). vLLM
0.32 refuses min-p with any speculative decoding (``VLLMValidationError``), so for min-p the test
asserts that refusal instead. Each run asserts that drafts were verified and accepted at every
draft slot.

Test: for every configuration and every generated position, a two-sample chi-square test of
homogeneity compares the token marginal of selfspec with plain vLLM (``tests/sampling_stats.py``;
the ``MAX_CELLS`` most frequent tokens get a cell each, the others, and tokens with fewer than 10
occurrences, share one cell). Losslessness makes the joint distribution of the sequences equal,
hence every marginal. Family-wise false-alarm rate: ``ALPHA`` = 1e-3,
Bonferroni over every equality test of the module (``NUM_EQUALITY_TESTS`` comparisons x
``NEW_TOKENS`` positions), so each position is tested at ``ALPHA_PER_TEST``.

Power: the alternative is a 5% mixture at one position, selfspec's marginal there being
``0.95 p + 0.05 r`` with ``r`` a point mass on the 10th most likely token of ``p`` (a plausible
but wrong token emitted 5% of the time; ``sampling_stats.point_mass_on_rank``).
``test_sample_size_has_power`` computes, from the plain samples of every configuration and
position, the power of the test at ``ALPHA_PER_TEST`` by the noncentral chi-square approximation
(noncentrality ``n/2 * sum_k (p_k - q_k)^2 / m_k`` over the test's cells, see
``sampling_stats.mixture_power``) and asserts it is at least 0.9 at every position of every
configuration; ``test_power_formula_matches_simulation`` checks that approximation against
simulated runs of the same test. Measured (one run, n = 3000): weakest power over the 12
positions 0.995 (t0.3, position 3), 0.999 (t0.7, position 1), 0.999 (t1.3, position 0), 0.997
(top-p, position 0), 0.993 (top-k, position 0); the approximation predicted 0.44 where 300
simulated tests detected 0.50.

The test is weak against alternatives spread thinly over many tokens: the marginals of positions
after the second are nearly flat over ~400 tokens on this random model (the sequences' prefixes
differ), and moving 5% of the mass from ``p[x]`` to ``p[x - 1]`` (an off-by-one token id) or to the
uniform distribution there is caught with probability near 0 at this sample size; at positions 0-1
of temperature 0.3 / top-k / min-p it is caught with probability near 1.

Negative controls (must be detected, same sample size and per-position level), one for every
sampled configuration: the selfspec engine runs a worker extension (``tests/sampling_faults.py``)
that patches its drafter for one block of requests, drafts drawn at another temperature (1.0 below
1.0, a third of the request's from 1.0 up) while the draft probabilities handed to the verifier
are those at the request's temperature and truncation; and for hybrid drafts, a lookup draft handed
on with the pass's draft probabilities instead of its deterministic proposal.
Argmax drafts must also keep the distribution (and be accepted less often than sampled drafts),
and greedy requests mixed into a sampled batch stay token-identical to plain greedy decoding.
The drafter's adaptive controller (step costs pinned) cuts drafts at planned budgets and at the
confidence exit in one more configuration.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.engine_utils import drafter_stats, engine, spec_metrics, token_ids
from tests.sampling_stats import mixture_power, point_mass_on_rank, position_p_values

pytestmark = pytest.mark.engine

NUM_SAMPLES = 3000
NEW_TOKENS = 12
K = 4
VOCAB_SIZE = 576
ALPHA = 1e-3  # family-wise false-alarm rate of the module's equality tests
CONFIGS: dict[str, dict[str, float]] = {
    "t0.3": {"temperature": 0.3},
    "t0.7": {"temperature": 0.7},
    "t1.3": {"temperature": 1.3},
    "top_p": {"temperature": 1.0, "top_p": 0.9},
    "top_k": {"temperature": 1.0, "top_k": 20},
}
ARGMAX_CONFIG = "t0.7"
# the same configurations under the adaptive controller (step costs pinned): drafts cut to planned
# budgets and at the confidence exit
ADAPTIVE_CONFIGS = {"t0.7 adaptive": "t0.7"}
# hybrid drafts (prompt lookup beside layer skipping): a model with small weights
# whose greedy text loops, prompted with its own greedy continuation, and n-grams of 1..2 tokens,
# so that lookups are frequent in sampled text; k fixed; step costs pinned with a dear draft
# forward and the lookup acceptance pinned high, so that a lookup draft is taken wherever one is
# found
HYBRID = {"drafts": "hybrid", "prompt_lookup_min": 1, "prompt_lookup_max": 2}
HYBRID_CONFIG = "t0.7"
HYBRID_PROMPT_GREEDY_TOKENS = 25
# every prefill of a step fits the token budget (vLLM's CPU build kills a plain engine when a
# seeded request's prefill is chunked: patch 4 covers selfspec engines only)
HYBRID_ENGINE = {"max_num_batched_tokens": 8192}
# probabilistic drafts per configuration, adaptive ones, argmax drafts, hybrid drafts
NUM_EQUALITY_TESTS = len(CONFIGS) + len(ADAPTIVE_CONFIGS) + 1 + 1
ALPHA_PER_TEST = ALPHA / (NUM_EQUALITY_TESTS * NEW_TOKENS)
MIN_POWER = 0.9
MAX_CELLS = 16
WRONG_TOKEN_RANK = 9  # r: a point mass on the 10th most likely token
SKIP = {"skip_attention": [3, 5], "skip_mlp": [6], "num_speculative_tokens": K,
        "drafts": "layer_skip"}
K_FIXED = {"selfspec": {"adaptive": False}}  # per request: every round drafts K tokens
FAULT_EXTENSION = "tests.sampling_faults.SamplingFaultExtension"


@pytest.fixture(scope="module")
def model_dir():
    from tests.tiny_models import tiny_model_dir

    return tiny_model_dir("e2e-llama", arch="llama", num_layers=8)


@pytest.fixture(scope="module")
def prompt():
    from vllm.inputs import TokensPrompt

    return TokensPrompt(prompt_token_ids=[5, 77, 301, 12, 96, 140, 33])


def _sample(llm, prompt, config: str, seed_base: int, extra_args=None) -> np.ndarray:
    from vllm import SamplingParams

    params = [
        SamplingParams(max_tokens=NEW_TOKENS, seed=seed_base + i, ignore_eos=True,
                       extra_args=extra_args, **CONFIGS[config])
        for i in range(NUM_SAMPLES)
    ]
    outputs = llm.generate([prompt] * NUM_SAMPLES, params, use_tqdm=False)
    samples = np.array(token_ids(outputs))
    assert samples.shape == (NUM_SAMPLES, NEW_TOKENS)
    return samples


def _sample_drafting(
    llm, prompt, config: str, seed_base: int, extra_args=None, every_slot: bool = True
) -> tuple[np.ndarray, dict]:
    """Samples and the spec-decode counters of the block; asserts drafts were verified and (with
    ``every_slot``) every draft slot accepted at least once."""
    from vllm_selfspec.tools.spec_decode_counters import counter_delta

    before = spec_metrics(llm)
    samples = _sample(llm, prompt, config, seed_base, extra_args)
    counters = counter_delta(before, spec_metrics(llm))
    assert counters["num_drafts"] > 0 and counters["num_draft_tokens"] > 0, counters
    per_slot = counters["num_accepted_tokens_per_pos"]
    assert len(per_slot) == K and (min(per_slot) > 0 or not every_slot), counters
    return samples, counters


def _acceptance(counters: dict) -> float:
    return counters["num_accepted_tokens"] / counters["num_draft_tokens"]


def _greedy_mix(llm, prompt):
    """Sampled and greedy requests in one batch; returns the greedy outputs."""
    from vllm import SamplingParams

    params = [
        SamplingParams(temperature=0.9, max_tokens=24, seed=10_000 + i, ignore_eos=True)
        for i in range(24)
    ]
    greedy = SamplingParams(temperature=0.0, max_tokens=24)
    params[::3] = [greedy] * len(params[::3])
    outputs = llm.generate([prompt] * len(params), params, use_tqdm=False)
    return [list(outputs[i].outputs[0].token_ids) for i in range(0, len(params), 3)]


def _min_p_error(llm, prompt) -> str:
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    with pytest.raises(VLLMValidationError) as refused:
        llm.generate([prompt], SamplingParams(temperature=1.0, min_p=0.1, max_tokens=4),
                     use_tqdm=False)
    return str(refused.value)


@pytest.fixture(scope="module")
def plain(model_dir, prompt):
    with engine(model_dir) as llm:
        result = {c: _sample(llm, prompt, c, 0) for c in CONFIGS}
        result["greedy"] = _greedy_mix(llm, prompt)
        return result


@pytest.fixture(scope="module")
def probabilistic(model_dir, prompt):
    """One selfspec engine (adaptive, step costs pinned): every configuration with k fixed per
    request, the adaptive ones, greedy rows in a sampled batch, the min-p refusal, and every
    configuration's negative control."""
    from tests.pinned_costs import pin_step_costs

    spec = {"method": "selfspec", **SKIP, "adaptive": True}
    with engine(model_dir, spec, worker_extension_cls=FAULT_EXTENSION) as llm:
        # cheap drafts: the controller drafts at this set's sampled acceptance
        pin_step_costs(llm, draft_ratio=0.05)
        result: dict = {"samples": {}, "counters": {}, "faults": {}, "fault_hits": {}}
        for i, config in enumerate(CONFIGS):
            samples, counters = _sample_drafting(llm, prompt, config, 100_000 * (i + 1),
                                                 K_FIXED)
            result["samples"][config] = samples
            result["counters"][config] = counters
        for i, (name, config) in enumerate(ADAPTIVE_CONFIGS.items()):
            [before] = drafter_stats(llm)
            samples, counters = _sample_drafting(llm, prompt, config, 20_000_000 * (i + 1),
                                                 every_slot=False)
            [after] = drafter_stats(llm)
            counters["confidence_exits"] = after["confidence_exits"] - before["confidence_exits"]
            result["samples"][name] = samples
            result["counters"][name] = counters
        result["greedy"] = _greedy_mix(llm, prompt)
        result["min_p_error"] = _min_p_error(llm, prompt)
        for i, config in enumerate(CONFIGS):
            assert llm.collective_rpc("sampling_fault_install", args=("temperature",)) == [True]
            try:
                samples, _ = _sample_drafting(llm, prompt, config, 1_000_000 * (i + 1), K_FIXED)
            finally:
                result["fault_hits"][config] = llm.collective_rpc("sampling_fault_remove")
            result["faults"][config] = samples
        return result


@pytest.fixture(scope="module")
def argmax(model_dir, prompt):
    spec = {"method": "selfspec", **SKIP, "adaptive": False, "draft_sampling": "argmax"}
    with engine(model_dir, spec) as llm:
        samples, counters = _sample_drafting(llm, prompt, ARGMAX_CONFIG, 9_000_000)
        return {"samples": samples, "counters": counters}


@pytest.fixture(scope="module")
def hybrid_model_dir():
    from tests.tiny_models import tiny_model_dir

    return tiny_model_dir("e2e-llama-loops", arch="llama", num_layers=8, initializer_range=0.05)


@pytest.fixture(scope="module")
def hybrid_plain(hybrid_model_dir, prompt):
    """The looping model's plain samples, from its own greedy continuation of the prompt."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    with engine(hybrid_model_dir, **HYBRID_ENGINE) as llm:
        greedy = SamplingParams(temperature=0.0, max_tokens=HYBRID_PROMPT_GREEDY_TOKENS,
                                ignore_eos=True)
        [out] = llm.generate([prompt], greedy, use_tqdm=False)
        looping = TokensPrompt(
            prompt_token_ids=list(prompt["prompt_token_ids"]) + list(out.outputs[0].token_ids)
        )
        return looping, _sample(llm, looping, HYBRID_CONFIG, 0)


@pytest.fixture(scope="module")
def hybrid(hybrid_model_dir, hybrid_plain):
    from tests.pinned_costs import pin_step_costs

    looping, _ = hybrid_plain
    spec = {"method": "selfspec", **SKIP, "adaptive": False, **HYBRID}
    with engine(hybrid_model_dir, spec, worker_extension_cls=FAULT_EXTENSION,
                **HYBRID_ENGINE) as llm:
        pin_step_costs(llm, draft_ratio=1.0)
        # lookups land rarely in text sampled at 0.7, and the drafter would stop taking them:
        # pinned, it takes every lookup draft it finds, so that the test is about them
        assert llm.collective_rpc("pin_lookup_acceptance", args=(0.9,)) == [True]
        out = {}
        for name, seed, fault in (("ok", 40_000_000, None), ("fault", 50_000_000, "lookup_probs")):
            [before] = drafter_stats(llm)
            if fault:
                assert llm.collective_rpc("sampling_fault_install", args=(fault,)) == [True]
            try:
                samples, counters = _sample_drafting(
                    llm, looping, HYBRID_CONFIG, seed, every_slot=False
                )
            finally:
                if fault:
                    out["fault_hits"] = llm.collective_rpc("sampling_fault_remove")
            [after] = drafter_stats(llm)
            for key in ("lookup_tokens", "lookup_rows", "lookup_only_steps", "draft_tokens"):
                counters[key] = after[key] - before[key]
            out[name] = samples, counters
        return out


def _min_p_value(a: np.ndarray, b: np.ndarray) -> float:
    p_values = position_p_values(a, b, max_cells=MAX_CELLS)
    print(f"per-position p-values: {np.array2string(p_values, precision=3)}")
    return float(p_values.min())


def test_sample_size_has_power(plain):
    worst = {}
    for config in CONFIGS:
        powers = [
            mixture_power(
                np.bincount(plain[config][:, t], minlength=VOCAB_SIZE) / NUM_SAMPLES,
                NUM_SAMPLES, NUM_SAMPLES, ALPHA_PER_TEST,
                alternative=point_mass_on_rank(WRONG_TOKEN_RANK), max_cells=MAX_CELLS,
            )
            for t in range(NEW_TOKENS)
        ]
        worst[config] = (min(powers), int(np.argmin(powers)))
    print(f"weakest power (position) per configuration: {worst}")
    assert min(power for power, _ in worst.values()) >= MIN_POWER, worst


def test_power_formula_matches_simulation():
    # The noncentral chi-square approximation against simulated runs of the same test, on a
    # distribution shaped like the model's (a softmax of random logits), at a sample size where
    # the power is in the informative middle.
    rng = np.random.default_rng(0)
    p = np.exp(1.5 * rng.standard_normal(VOCAB_SIZE))
    p /= p.sum()
    q = 0.95 * p + 0.05 * point_mass_on_rank(WRONG_TOKEN_RANK)(p)
    n, alpha, runs = 1000, ALPHA_PER_TEST, 300
    predicted = mixture_power(p, n, n, alpha, alternative=point_mass_on_rank(WRONG_TOKEN_RANK),
                              max_cells=MAX_CELLS)
    detected = np.mean([
        position_p_values(rng.choice(VOCAB_SIZE, (n, 1), p=p),
                          rng.choice(VOCAB_SIZE, (n, 1), p=q), max_cells=MAX_CELLS)[0] < alpha
        for _ in range(runs)
    ])
    print(f"predicted power {predicted:.3f}, simulated {detected:.3f}")
    assert 0.2 < predicted < 0.8
    assert abs(detected - predicted) < 0.1


@pytest.mark.parametrize("config", list(CONFIGS))
def test_probabilistic_drafts_keep_the_distribution(plain, probabilistic, config):
    """Drafts sampled from the request's distribution (temperature, then its top-k / top-p
    truncation) with their probabilities handed to vLLM's rejection sampler: plain's
    distribution."""
    p = _min_p_value(plain[config], probabilistic["samples"][config])
    print(f"{config}: acceptance {_acceptance(probabilistic['counters'][config]):.3f}, min "
          f"p-value {p:.3g} (level {ALPHA_PER_TEST:.2g})")
    assert p > ALPHA_PER_TEST


@pytest.mark.parametrize("name", list(ADAPTIVE_CONFIGS))
def test_adaptive_drafts_keep_the_distribution(plain, probabilistic, name):
    """Drafts cut at planned budgets and at the confidence exit (which fired)."""
    counters = probabilistic["counters"][name]
    print(f"{name}: acceptance {_acceptance(counters):.3f}, confidence exits "
          f"{counters['confidence_exits']}")
    assert counters["confidence_exits"] > 0, counters
    p = _min_p_value(plain[ADAPTIVE_CONFIGS[name]], probabilistic["samples"][name])
    assert p > ALPHA_PER_TEST


@pytest.mark.parametrize("config", list(CONFIGS))
def test_injected_draft_probability_bug_is_detected(plain, probabilistic, config):
    """Negative control of every configuration above, caught at the same level: drafts drawn at
    another temperature, their probabilities handed on at the request's."""
    hits = probabilistic["fault_hits"][config]
    assert hits and min(hits) > 0, hits  # the fault really replaced the drafts
    p = _min_p_value(plain[config], probabilistic["faults"][config])
    print(f"fault at {config}: min p-value {p:.3g}")
    assert p < ALPHA_PER_TEST


def test_hybrid_drafts_keep_the_distribution(hybrid_plain, hybrid):
    """Prompt-lookup drafts (deterministic proposals: probability 1 on the looked-up token) beside
    sampled layer-skip drafts, in the same steps and across steps."""
    samples, counters = hybrid["ok"]
    print(f"hybrid drafts: acceptance {_acceptance(counters):.3f}, {counters['lookup_tokens']} "
          f"of {counters['draft_tokens']} draft tokens from lookups ({counters['lookup_rows']} "
          f"request-steps, {counters['lookup_only_steps']} steps without a pass)")
    # both sources drafted, enough for the test to be about them
    assert 0.05 * counters["draft_tokens"] < counters["lookup_tokens"] < counters["draft_tokens"]
    assert _min_p_value(hybrid_plain[1], samples) > ALPHA_PER_TEST


def test_injected_lookup_probability_bug_is_detected(hybrid_plain, hybrid):
    """Negative control of the hybrid test: a lookup draft handed to the verifier with the
    pass's draft probabilities at its row instead of its deterministic proposal."""
    assert hybrid["fault_hits"][0] > 0, hybrid["fault_hits"]
    p = _min_p_value(hybrid_plain[1], hybrid["fault"][0])
    print(f"hybrid drafts, fault lookup_probs at {HYBRID_CONFIG}: min p-value {p:.3g}")
    assert p < ALPHA_PER_TEST


def test_argmax_drafts_keep_the_distribution(plain, argmax):
    p = _min_p_value(plain[ARGMAX_CONFIG], argmax["samples"])
    print(f"argmax {ARGMAX_CONFIG}: min p-value {p:.3g}")
    assert p > ALPHA_PER_TEST


def test_sampled_drafts_are_accepted_more_often(probabilistic, argmax):
    sampled = _acceptance(probabilistic["counters"][ARGMAX_CONFIG])
    assert 0.0 < _acceptance(argmax["counters"]) < sampled


def test_min_p_is_refused_with_speculative_decoding(probabilistic):
    assert "min_p" in probabilistic["min_p_error"]


def test_greedy_rows_in_sampled_batches_are_identical(plain, probabilistic):
    assert probabilistic["greedy"] == plain["greedy"]
