"""Engine-level robustness behind serving: preemption, mixed sampling batches, offline metrics.

* Preemption: a KV cache of a few hundred tokens and 24 concurrent requests of ~150 tokens force
  vLLM to preempt and recompute requests over and over (``vllm:num_preemptions`` confirms it);
  selfspec (drafting every step, K lookahead slots reserved per request) must give the same greedy
  output as plain vLLM under the same pressure.
* Mixed batches: greedy requests next to sampled ones whose draft cap is smaller (so at later
  draft steps only greedy rows are still drafting), and a top-k-only sampled request. Both used to
  kill the engine (see patch 6 in vllm_selfspec/plugin/patches/cpu_sampler.py).
* Aborts mid-draft: half of a drafting batch is aborted between engine steps; the other half
  must finish with plain vLLM's tokens, and the engine serves on (the tests after it).
* The plugin's metrics are also there for the offline ``LLM`` (``LLM.get_metrics()``).

The selfspec engine drafts by layer skipping only (``"drafts": "layer_skip"``: the top-k test
compares draft counts, which the hybrid's source choice would make follow measured step costs);
prompt lookup under the same workloads is in tests/test_hybrid_drafts.py. One engine alive at a
time.
"""

from __future__ import annotations

import pytest

from tests.engine_utils import MetricsWindow, drafter_stats, engine, token_ids

pytestmark = pytest.mark.engine

MAX_MODEL_LEN = 192
KV_BYTES = 3 << 20  # ~500 tokens of KV for this model: far less than the workload needs
SPEC = {"method": "selfspec", "skip_attention": [3, 5], "skip_mlp": [6],
        "num_speculative_tokens": 4, "adaptive": False, "drafts": "layer_skip"}


@pytest.fixture(scope="module")
def model_dir():
    from tests.tiny_models import tiny_model_dir

    return tiny_model_dir("e2e-llama", arch="llama", num_layers=8)


def _ids() -> list[int]:
    from tests.tiny_models import build_tiny_tokenizer, tokenizer_corpus

    tok = build_tiny_tokenizer()
    out: list[int] = []
    for line in tokenizer_corpus():
        out.extend(tok(line, add_special_tokens=False)["input_ids"])
    return out


@pytest.fixture(scope="module")
def workloads():
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    ids = _ids()
    pressure = []
    for i in range(24):
        n_prompt = 20 + (i * 7) % 41
        prompt = TokensPrompt(prompt_token_ids=ids[i * 11 : i * 11 + n_prompt])
        pressure.append((prompt, SamplingParams(temperature=0.0, max_tokens=100 + (i % 4) * 10,
                                                ignore_eos=True)))
    mixed = []
    for i in range(8):
        prompt = TokensPrompt(prompt_token_ids=ids[300 + i * 9 : 300 + i * 9 + 12 + i])
        if i % 2 == 0:
            sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        else:  # sampled, drafts capped at 1 while the greedy rows draft 4
            sp = SamplingParams(temperature=0.8, seed=i, max_tokens=40, ignore_eos=True,
                                extra_args={"selfspec": {"num_speculative_tokens": 1}})
        mixed.append((prompt, sp))
    # top-k-only sampling at top_k=1 samples the argmax: equal to greedy
    top_k = [(mixed[0][0], SamplingParams(temperature=1.0, top_k=1, max_tokens=40,
                                          ignore_eos=True))]
    abort = [
        (TokensPrompt(prompt_token_ids=ids[500 + i * 13 : 500 + i * 13 + 10 + i]),
         SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True))
        for i in range(8)
    ]
    return {"pressure": pressure, "mixed": mixed, "top_k": top_k, "abort": abort}


def _generate(llm, workload):
    outs = llm.generate([p for p, _ in workload], [sp for _, sp in workload], use_tqdm=False)
    return token_ids(outs)


def _metric(llm, name):
    return sum(getattr(m, "value", 0) for m in llm.get_metrics() if m.name == name)


@pytest.fixture(scope="module")
def reference(model_dir, workloads):
    with engine(model_dir, max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes=KV_BYTES) as llm:
        out = {name: _generate(llm, wl) for name, wl in workloads.items()}
        out["preemptions"] = _metric(llm, "vllm:num_preemptions")
        out["metric_names"] = {m.name for m in llm.get_metrics()}
    return out


@pytest.fixture(scope="module")
def spec_llm(model_dir, reference):
    kw = {"max_model_len": MAX_MODEL_LEN, "kv_cache_memory_bytes": KV_BYTES}
    with engine(model_dir, SPEC, **kw) as llm:
        yield llm


def test_preemption_greedy_identical_to_plain(spec_llm, workloads, reference):
    before = _metric(spec_llm, "vllm:num_preemptions")
    got = _generate(spec_llm, workloads["pressure"])
    preemptions = _metric(spec_llm, "vllm:num_preemptions") - before
    stats = drafter_stats(spec_llm)[0]
    shown = ("steps", "draft_tokens", "lookup_tokens", "rows_past_end")
    print(f"\npreemptions: selfspec {preemptions:.0f}, plain {reference['preemptions']:.0f}; "
          f"drafter {dict((k, stats.get(k)) for k in shown)}")
    assert preemptions > 0, "the KV cache was large enough: no preemption happened"
    assert got == reference["pressure"]
    assert stats["draft_tokens"] > 0


ABORT_AFTER_STEPS = 6


def test_requests_aborted_mid_draft(spec_llm, workloads, reference):
    """Every other request of a drafting batch is aborted after a few engine steps (drafts in
    flight for all of them); the others finish with plain vLLM's tokens. The tests after this one
    run on the same engine: no KV block, draft or controller state of the aborted requests may
    be left over."""
    eng = spec_llm.llm_engine
    ids = [f"abort-{i}" for i in range(len(workloads["abort"]))]
    for req_id, (prompt, params) in zip(ids, workloads["abort"], strict=True):
        eng.add_request(req_id, prompt, params)
    drafted_before = drafter_stats(spec_llm)[0]["draft_tokens"]
    finished, steps, drafted_at_abort = {}, 0, None
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                finished[out.request_id] = list(out.outputs[0].token_ids)
        steps += 1
        if steps == ABORT_AFTER_STEPS:
            drafted_at_abort = drafter_stats(spec_llm)[0]["draft_tokens"] - drafted_before
            eng.abort_request(ids[1::2])
    assert drafted_at_abort, "no drafts before the abort"
    assert [finished.get(r) for r in ids[0::2]] == reference["abort"][0::2]
    full = workloads["abort"][0][1].max_tokens
    assert all(len(finished.get(r, [])) < full for r in ids[1::2]), finished.keys()


def test_mixed_greedy_and_sampled_with_ragged_caps(spec_llm, workloads, reference):
    got = _generate(spec_llm, workloads["mixed"])
    for i, (ref, out) in enumerate(zip(reference["mixed"], got, strict=True)):
        if i % 2 == 0:
            assert out == ref, f"greedy request {i}"
        else:
            assert len(out) == 40


def test_top_k_only_sampling(spec_llm, workloads, reference):
    """top_k=1 at temperature 1 samples the argmax: the output is greedy's. The drafts are
    sampled from the request's truncated distribution too, so they are the draft's argmax, and
    exactly the drafts of the same request run greedy are drafted and accepted."""
    greedy = MetricsWindow(spec_llm)
    assert _generate(spec_llm, workloads["mixed"][:1]) == reference["mixed"][:1]
    greedy_counts = greedy.delta()
    assert greedy_counts["num_accepted_tokens"] > 0, greedy_counts
    sampled = MetricsWindow(spec_llm)
    assert _generate(spec_llm, workloads["top_k"]) == [reference["mixed"][0]]
    assert sampled.delta() == greedy_counts


def test_offline_llm_exports_plugin_metrics(spec_llm, reference):
    names = {m.name for m in spec_llm.get_metrics()}
    assert {"vllm:selfspec_mean_draft_length", "vllm:selfspec_requests_drafting_off"} <= names
    assert not any(n.startswith("vllm:selfspec_") for n in reference["metric_names"])
    assert 1.0 <= _metric(spec_llm, "vllm:selfspec_mean_draft_length") <= SPEC[
        "num_speculative_tokens"]
