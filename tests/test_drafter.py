"""End-to-end tests of the drafter's layer-skip pass (``"drafts": "layer_skip"``) against plain
vLLM decoding (prompt-lookup drafts: tests/test_hybrid_drafts.py).

The drafter runs on vLLM's own ``draft_model`` machinery with the target as its own draft model
(see :mod:`vllm_selfspec.drafting.device_drafter`). Every test compares with a plain engine of the
same model: greedy outputs token-identical, drafts verified (and all accepted where the skip set is
exact: the e2e-zero model's skipped sub-layers have zero output projections).

Workloads: a ragged batch of 8, a single request, a prompt near ``max_model_len`` with ``k = 8``
(draft rows step past the end: the regression test of the cache corruption the drafter masks),
per-request draft caps, chunked prefills (a small token budget), argmax drafts through the
probabilistic draft sampler and the rejection sampler, and a compiled engine (vLLM's default
mode: the draft model is compiled through ``support_torch_compile``). Each runs with k fixed
(two skip sets) and with the adaptive controller (its step costs pinned: its verdict must not
follow this machine's timings).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.drafter_probe import DRAFTER_PROBE_EXTENSION
from tests.engine_utils import MetricsWindow, drafter_stats, engine, token_ids
from tests.pinned_costs import pin_step_costs

ZERO_LAYERS = [2, 5]
ZERO = {"skip_attention": ZERO_LAYERS, "skip_mlp": ZERO_LAYERS, "num_speculative_tokens": 4}
LOSSY = {"skip_attention": [1, 2, 5, 6], "skip_mlp": [2, 3, 5], "num_speculative_tokens": 8}
MAX_MODEL_LEN = 192
EXT = {"worker_extension_cls": DRAFTER_PROBE_EXTENSION}


def _spec(cfg: dict[str, Any]) -> dict[str, Any]:
    # layer-skip drafts only, k fixed unless cfg says: the pass is what this module tests
    return {"method": "selfspec", "drafts": "layer_skip", "adaptive": False, **cfg}


@pytest.fixture(scope="module")
def model_dir():
    from tests.tiny_models import tiny_model_dir

    return tiny_model_dir("e2e-zero", arch="llama", num_layers=8, zero_output_layers=ZERO_LAYERS)


def _prompt(n: int, seed: int) -> list[int]:
    return [(7 * seed + 13 * j) % 500 + 3 for j in range(n)]


def _workloads() -> dict[str, list[tuple[list[int], dict[str, Any]]]]:
    """name -> [(prompt token ids, SamplingParams kwargs)]."""
    greedy = {"temperature": 0.0, "ignore_eos": True}
    return {
        "batch": [(_prompt(5 + 3 * i, i), {**greedy, "max_tokens": 40 + 7 * i}) for i in range(8)],
        "single": [(_prompt(9, 3), {**greedy, "max_tokens": 64})],
        # 170 + 40 > MAX_MODEL_LEN: the request ends at the limit, draft rows step past it
        "near_end": [(_prompt(170, i), {**greedy, "max_tokens": 40}) for i in range(2)],
        "caps": [
            (
                _prompt(12, 20 + i),
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
        "long_prompts": [
            (_prompt(120 + 9 * i, 40 + i), {**greedy, "max_tokens": 24}) for i in range(4)
        ],
    }


def _generate(llm: Any, requests: list[tuple[list[int], dict[str, Any]]]) -> list[list[int]]:
    from vllm import SamplingParams

    prompts = [{"prompt_token_ids": p} for p, _ in requests]
    return token_ids(llm.generate(prompts, [SamplingParams(**kw) for _, kw in requests]))


@pytest.fixture(scope="module")
def reference(model_dir):
    with engine(model_dir, **EXT) as llm:
        outputs = {name: _generate(llm, reqs) for name, reqs in _workloads().items()}
        memory = llm.collective_rpc("memory_probe")
    return {"outputs": outputs, "memory": memory}


SETS = {
    "zero": (ZERO, {}),
    "lossy": (LOSSY, {"max_num_batched_tokens": 96}),
    "adaptive": ({**ZERO, "adaptive": True}, {}),
    # every attention sub-layer skipped: the draft reads no KV and writes none
    "no_attention": ({**ZERO, "skip_attention": list(range(8))}, {}),
}
EXACT = ("zero", "adaptive")  # sets whose drafts are all accepted


@pytest.fixture(scope="module", params=list(SETS))
def dev(request, model_dir, reference):
    """A device-drafter engine per configuration, one alive at a time (vLLM's metrics of two
    engines in one process mix). The lossy one has a small token budget: long prompts are
    prefilled in chunks, and the partial prefills are drafted for and discarded. The adaptive one
    plans with pinned step costs under which drafting pays."""
    cfg, extra = SETS[request.param]
    with engine(model_dir, _spec(cfg), **extra, **EXT) as llm:
        if cfg.get("adaptive"):
            pin_step_costs(llm)
        yield request.param, llm


def _drafted(window: MetricsWindow, exact: bool) -> dict[str, float]:
    delta = window.delta()
    assert delta["num_draft_tokens"] > 0, delta
    if exact:  # the zero set's drafts are the full model's tokens
        assert delta["num_accepted_tokens"] == delta["num_draft_tokens"], delta
    return delta


@pytest.mark.parametrize("name", list(_workloads()))
def test_greedy_identical(dev, reference, name):
    kind, llm = dev
    window = MetricsWindow(llm)
    assert _generate(llm, _workloads()[name]) == reference["outputs"][name]
    _drafted(window, exact=kind in EXACT)


def test_draft_rows_stopped_at_max_model_len(dev):
    """The near-end workload ran (test_greedy_identical): draft rows reached max_model_len and
    were masked there (no write past the end; vLLM's step kernel would have wrapped them to
    position 0 and written real slots of the request's first tokens)."""
    [stats] = drafter_stats(dev[1])
    assert stats["drafter"] == "device"
    assert stats["rows_past_end"] > 0, stats


def test_per_request_caps_shorten_the_pass(dev, reference):
    """Caps 0 and 1: the pass drafts one token (the longest budget), not k; cap 0 gets none."""
    kind, llm = dev
    window = MetricsWindow(llm)
    before = drafter_stats(llm)[0]
    capped = _workloads()["caps"][:2]  # caps 0 and 1
    assert _generate(llm, capped) == reference["outputs"]["caps"][:2]
    delta = _drafted(window, exact=kind in EXACT)
    # cap 0 drafts nothing, cap 1 one token per verification
    assert delta["num_draft_tokens"] == delta["num_drafts"], delta
    after = drafter_stats(llm)[0]
    passes = after["draft_passes"] - before["draft_passes"]
    assert after["draft_forwards"] - before["draft_forwards"] == passes > 0, (before, after)


def test_every_request_capped_to_zero_runs_no_pass(dev, reference):
    """A request capped at 0 alone: no pass, and after its prefill (no drafts verified, none
    planned) not even vLLM's preparation of the pass's inputs."""
    kind, llm = dev
    window = MetricsWindow(llm)
    before = drafter_stats(llm)[0]
    assert _generate(llm, _workloads()["caps"][:1]) == reference["outputs"]["caps"][:1]
    assert window.delta()["num_draft_tokens"] == 0
    after = drafter_stats(llm)[0]
    assert after["draft_passes"] == before["draft_passes"], (before, after)
    assert after["passes_skipped"] > before["passes_skipped"], (before, after)
    skipped = after["passes_skipped"] - before["passes_skipped"]
    prepared_for_nothing = skipped - (after["prepare_skipped"] - before["prepare_skipped"])
    assert prepared_for_nothing == 0, (before, after)
    # every decoding request-step it was planned counts as drafting off
    considered = after["rows_considered"] - before["rows_considered"]
    assert after["rows_off"] - before["rows_off"] == considered > 0, (before, after)
    # and every one of its steps (prefill included: no drafts) skipped the rejection sampler
    steps = after["steps"] - before["steps"]
    assert after["plain_sampled"] - before["plain_sampled"] == steps > 0, (before, after)


def test_controller_sees_what_vllm_verified(dev, reference):
    """The controller's drafted / accepted counts (the scheduled drafts of each request and vLLM's
    rejected counts, read once per step) equal vLLM's spec-decode counters."""
    kind, llm = dev
    window = MetricsWindow(llm)
    start = drafter_stats(llm)[0]
    before = start["controller"]
    assert _generate(llm, _workloads()["batch"]) == reference["outputs"]["batch"]
    delta = _drafted(window, exact=kind in EXACT)
    after = drafter_stats(llm)[0]["controller"]
    assert after["drafted"] - before["drafted"] == delta["num_draft_tokens"], (before, after)
    assert after["accepted"] - before["accepted"] == delta["num_accepted_tokens"]
    # steps that verified drafts went through vLLM's rejection sampler
    counters = drafter_stats(llm)[0]
    assert counters["plain_sampled"] - start["plain_sampled"] < counters["steps"] - start["steps"]


def test_confidence_exit_fires_only_when_adaptive(dev):
    """The adaptive engine cut a pass's drafts where their chained top-1 probability did not pay
    for their verification (counted as ``confidence_exits``) in the tests above (whose outputs
    all equalled plain's), and never with k fixed. (The tiny model's top-1 probabilities are
    low, so its chained probabilities soon fall under the marginal verification cost.)"""
    kind, llm = dev
    [stats] = drafter_stats(llm)
    assert (stats["confidence_exits"] > 0) == (kind == "adaptive"), stats


def test_argmax_drafts_through_the_rejection_sampler(dev, reference):
    """top_k=1 at temperature 1: drafts are sampled (probabilistic draft sampler, draft probs to
    the rejection sampler) and the output is still the greedy one.

    The drafter samples from the request's truncated distribution (vLLM's draft sampler applies
    the temperature only): with top_k=1 every draft is the draft's argmax, so the exact sets have
    every draft accepted. (Drawn from the whole T=1 distribution, as before, 95 of 1664 drafts
    were accepted.)"""
    kind, llm = dev
    # k fixed for these requests in the adaptive engine too (its pinned costs are about greedy
    # drafts)
    fixed = {"extra_args": {"selfspec": {"adaptive": False}}} if kind == "adaptive" else {}
    reqs = [
        (p, {**kw, "temperature": 1.0, "top_k": 1, "seed": 7, **fixed})
        for p, kw in _workloads()["batch"]
    ]
    window = MetricsWindow(llm)
    assert _generate(llm, reqs) == reference["outputs"]["batch"]
    assert _drafted(window, exact=kind in EXACT)["num_accepted_tokens"] > 0


def test_plugin_metrics_exported(dev):
    """The ``vllm:selfspec_*`` metrics come from the scheduler's stats: the device engines export
    them as the host ones do (mean draft length within 1..k after the tests above)."""
    kind, llm = dev
    metrics = llm.get_metrics()
    names = {m.name for m in metrics}
    assert {"vllm:selfspec_mean_draft_length", "vllm:selfspec_requests_drafting_off"} <= names
    mean = sum(m.value for m in metrics if m.name == "vllm:selfspec_mean_draft_length")
    assert 1.0 <= mean <= SETS[kind][0]["num_speculative_tokens"], mean


def test_no_extra_weights_or_kv_cache(dev, reference):
    """The drafter loads no weights and allocates no KV cache: parameter storage and KV cache
    tensors equal the plain engine's; its attention layers are the target's non-skipped ones."""
    kind, llm = dev
    [plain] = reference["memory"]
    [mem] = llm.collective_rpc("memory_probe")
    assert mem["drafter"] == "SelfSpecDeviceProposer"
    assert mem["param_bytes"] == plain["param_bytes"]
    assert (mem["kv_tensors"], mem["kv_bytes"]) == (plain["kv_tensors"], plain["kv_bytes"])
    assert mem["drafter_own_params"] == 0
    skipped = SETS[kind][0]["skip_attention"]
    expected = {f"model.layers.{i}.self_attn.attn" for i in range(8) if i not in skipped}
    # a draft without attention reads none of them: vLLM still builds one metadata group
    expected = expected or {f"model.layers.{i}.self_attn.attn" for i in range(8)}
    assert set(mem["drafter_layers"]) == expected
    assert expected <= set(mem["target_layers"])


def test_compiled_engine_greedy_identical(model_dir):
    """vLLM's default mode (inductor on CPU): the draft model is compiled too, outputs equal a
    compiled plain engine's."""
    reqs = _workloads()["batch"]
    with engine(model_dir, enforce_eager=False, **EXT) as plain:
        expected = _generate(plain, reqs)
    with engine(model_dir, _spec(ZERO), enforce_eager=False, **EXT) as llm:
        window = MetricsWindow(llm)
        assert _generate(llm, reqs) == expected
        delta = window.delta()
        assert delta["num_accepted_tokens"] == delta["num_draft_tokens"] > 0, delta
        [mem] = llm.collective_rpc("memory_probe")
        assert mem["compiled"], mem


def test_tensor_parallel_2_greedy_identical(model_dir, reference):
    """TP=2: each rank runs the draft pass over its shard of the target (vLLM's draft-model path
    with the target's tensor parallelism); the output is the plain TP=1 one and both ranks drafted
    in lockstep."""
    from tests.engine_utils import env

    tp = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
    # One core per rank (vLLM's CPU TP needs explicit thread binding on this kind of machine).
    with env(VLLM_CPU_OMP_THREADS_BIND="0|1"), engine(model_dir, _spec(ZERO), **tp, **EXT) as llm:
        window = MetricsWindow(llm)
        assert _generate(llm, _workloads()["batch"]) == reference["outputs"]["batch"]
        _drafted(window, exact=True)
        ranks = drafter_stats(llm)
    # the same counters and plans on both ranks (the time each rank measured is its own)
    same = [{k: v for k, v in r.items() if not k.endswith("_s")} for r in ranks]
    assert len(ranks) == 2 and same[0] == same[1], ranks
