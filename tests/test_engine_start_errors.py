"""Bad selfspec configuration fails at engine start with a clear message; nothing else runs.

Each case builds a real ``vllm.LLM`` (the user's entry point); the error comes from the front end
while vLLM builds its engine config, before any engine process starts.
"""

from __future__ import annotations

import json

import pytest

from vllm_selfspec.errors import SelfSpecConfigError

NUM_LAYERS = 6


@pytest.fixture(scope="module")
def model_dir():
    from tests.tiny_models import tiny_model_dir

    return tiny_model_dir("errors-llama", arch="llama", num_layers=NUM_LAYERS)


def _start(model_dir, speculative_config, **kw):
    from vllm import LLM

    llm = LLM(
        model=str(model_dir),
        speculative_config=speculative_config,
        dtype="float32",
        enforce_eager=True,
        max_model_len=128,
        kv_cache_memory_bytes=1 << 26,
        **kw,
    )
    llm.llm_engine.engine_core.shutdown()  # pragma: no cover - only reached when a test fails
    return llm


def _expect(model_dir, config, match, **kw):
    with pytest.raises(SelfSpecConfigError, match=match):
        _start(model_dir, {"method": "selfspec", **config}, **kw)


def test_layer_index_out_of_range(model_dir):
    _expect(model_dir, {"skip_attention": [2, 6]}, r"skip_attention.*6.*0\.\.5")


def test_negative_layer_index(model_dir):
    _expect(model_dir, {"skip_mlp": [-1]}, r"skip_mlp.*-1")


def test_duplicate_layer_index(model_dir):
    _expect(model_dir, {"skip_attention": [3, 3]}, r"skip_attention.*3 more than once")


def test_skipping_every_sub_layer(model_dir):
    every = list(range(NUM_LAYERS))
    _expect(model_dir, {"skip_attention": every, "skip_mlp": every}, r"every|all")


def test_profile_for_another_model(model_dir):
    _expect(model_dir, {"profile": "llama-2-13b.draft-verify"}, r"num_hidden_layers.*40.*6")


def test_malformed_profile_json(model_dir, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema_version": 1, "skip_attention": [1, 2,,]}')
    _expect(model_dir, {"profile": str(bad)}, r"bad\.json.*(JSON|json)")


def test_missing_profile(model_dir, tmp_path):
    _expect(model_dir, {"profile": str(tmp_path / "nope.json")}, r"nope\.json")


def test_unknown_selfspec_key(model_dir):
    _expect(model_dir, {"skip_attn": [1]}, r"skip_attn.*skip_attention")


def test_num_speculative_tokens_below_one(model_dir):
    _expect(model_dir, {"num_speculative_tokens": 0}, r"num_speculative_tokens")


def test_bad_threshold(model_dir):
    _expect(model_dir, {"draft_confidence_threshold": 1.5}, r"draft_confidence_threshold")


def test_profile_and_lists_together(model_dir, tmp_path):
    _expect(
        model_dir,
        {"profile": "llama-2-13b.draft-verify", "skip_attention": [1]},
        r"profile.*skip_attention|skip_attention.*profile",
    )


def test_separate_draft_model_refused(model_dir):
    _expect(model_dir, {"model": "/some/other/model"}, r"model")


def test_pipeline_parallel_refused(model_dir):
    _expect(model_dir, {"skip_attention": [3]}, r"pipeline", pipeline_parallel_size=2)


def test_unsupported_architecture(tmp_path):
    from tests.tiny_models import tiny_model_dir

    src = tiny_model_dir("errors-llama", arch="llama", num_layers=NUM_LAYERS)
    # Same weights, but the config claims an architecture selfspec does not drive.
    import shutil

    dst = tmp_path / "gemma-like"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["architectures"] = ["GemmaForCausalLM"]
    cfg["model_type"] = "gemma"
    (dst / "config.json").write_text(json.dumps(cfg))
    _expect(dst, {"skip_attention": [3]}, r"GemmaForCausalLM.*LlamaForCausalLM")


def test_kv_transfer_connector_refused(model_dir):
    _expect(
        model_dir,
        {"skip_attention": [3]},
        r"KV-transfer",
        kv_transfer_config={"kv_connector": "ExampleConnector", "kv_role": "kv_both"},
    )


def test_lora_refused(model_dir):
    _expect(model_dir, {"skip_attention": [3]}, r"LoRA", enable_lora=True)
