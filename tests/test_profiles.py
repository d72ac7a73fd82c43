"""Unit tests for vllm_selfspec.layers.profiles (pure Python, no vLLM)."""

from __future__ import annotations

import json
import types
from pathlib import Path
from typing import Any

import pytest

from vllm_selfspec.errors import ProfileError, SelfSpecConfigError
from vllm_selfspec.layers.profiles import (
    SCHEMA_VERSION,
    ModelFingerprint,
    Profile,
    find_shipped_profile,
    load_profile,
    shipped_profile_names,
    shipped_profiles,
)

LLAMA_13B = ModelFingerprint("LlamaForCausalLM", 40, 5120, 32000)
PUBLISHED = {
    "codellama-13b.draft-verify",
    "codellama-13b.swift-humaneval",
    "codellama-34b.swift-humaneval",
    "llama-2-13b-chat.draft-verify",
    "llama-2-13b-chat.swift-cnndm",
    "llama-2-13b.draft-verify",
    "llama-2-13b.swift-cnndm",
    "llama-2-70b.draft-verify",
    "llama-2-70b.swift-cnndm",
}
SEARCHED = {"smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"}  # found by selfspec-profile
EXPECTED_SHIPPED = PUBLISHED | SEARCHED


def _doc(**overrides: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "schema_version": 1,
        "model": {
            "name": "tiny/model",
            "architecture": "LlamaForCausalLM",
            "num_hidden_layers": 8,
            "hidden_size": 64,
            "vocab_size": 100,
        },
        "skip_attention": [4, 6],
        "skip_mlp": [5],
        "draft": {"num_speculative_tokens": 6},
        "provenance": {"method": "test", "source": "unit test", "acceptance": 0.8, "date": None},
    }
    doc.update(overrides)
    return doc


def _write(tmp_path: Path, doc: Any, name: str = "mine.json") -> Path:
    path = tmp_path / name
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc), encoding="utf-8")
    return path


# ------------------------------------------------------------------------------ fingerprint


def test_fingerprint_from_hf_config_duck_typed() -> None:
    cfg = types.SimpleNamespace(
        architectures=["LlamaForCausalLM"],
        num_hidden_layers=30,
        hidden_size=576,
        vocab_size=49152,
        name_or_path="HuggingFaceTB/SmolLM2-135M",
    )
    fp = ModelFingerprint.from_hf_config(cfg)
    assert fp == ModelFingerprint("LlamaForCausalLM", 30, 576, 49152)
    assert fp.name == "HuggingFaceTB/SmolLM2-135M"
    assert ModelFingerprint.from_hf_config(cfg, name="other").name == "other"


def test_fingerprint_from_hf_config_text_config_fallback() -> None:
    text = types.SimpleNamespace(num_hidden_layers=4, hidden_size=8, vocab_size=10)
    cfg = types.SimpleNamespace(architectures=["X"], get_text_config=lambda: text)
    assert ModelFingerprint.from_hf_config(cfg) == ModelFingerprint("X", 4, 8, 10)


def test_fingerprint_from_hf_config_missing_architectures() -> None:
    cfg = types.SimpleNamespace(
        architectures=None, num_hidden_layers=2, hidden_size=8, vocab_size=9
    )
    with pytest.raises(SelfSpecConfigError, match="'architectures' must be a non-empty list"):
        ModelFingerprint.from_hf_config(cfg)


def test_fingerprint_from_hf_config_missing_size() -> None:
    cfg = types.SimpleNamespace(architectures=["X"], num_hidden_layers=2, hidden_size=8)
    with pytest.raises(SelfSpecConfigError, match="no 'vocab_size'"):
        ModelFingerprint.from_hf_config(cfg)


def test_fingerprint_from_hf_config_bad_type() -> None:
    cfg = types.SimpleNamespace(
        architectures=["X"], num_hidden_layers="2", hidden_size=8, vocab_size=9
    )
    with pytest.raises(SelfSpecConfigError, match="num_hidden_layers must be a positive integer"):
        ModelFingerprint.from_hf_config(cfg)


def test_fingerprint_from_model_dir(tmp_path: Path) -> None:
    model_dir = tmp_path / "Llama-2-13b-chat-hf"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "num_hidden_layers": 40,
                "hidden_size": 5120,
                "vocab_size": 32000,
                "_name_or_path": "meta-llama/Llama-2-13b-hf",
            }
        )
    )
    fp = ModelFingerprint.from_model_dir(model_dir)
    assert fp == LLAMA_13B
    assert fp.name == str(model_dir)  # the directory, not the inherited _name_or_path
    assert ModelFingerprint.from_model_dir(model_dir / "config.json") == LLAMA_13B


def test_fingerprint_from_model_dir_errors(tmp_path: Path) -> None:
    with pytest.raises(SelfSpecConfigError, match="cannot read model config"):
        ModelFingerprint.from_model_dir(tmp_path)
    (tmp_path / "config.json").write_text("{ nope")
    with pytest.raises(SelfSpecConfigError, match="malformed JSON at line 1, column 3"):
        ModelFingerprint.from_model_dir(tmp_path)


def test_fingerprint_mismatches_and_name_ignored() -> None:
    other = ModelFingerprint("MistralForCausalLM", 30, 5120, 32016, name="x")
    assert LLAMA_13B.mismatches(other) == [
        "architecture: profile LlamaForCausalLM, model MistralForCausalLM",
        "num_hidden_layers: profile 40, model 30",
        "vocab_size: profile 32000, model 32016",
    ]
    renamed = ModelFingerprint("LlamaForCausalLM", 40, 5120, 32000, name="something-else")
    assert LLAMA_13B.mismatches(renamed) == []
    assert LLAMA_13B == renamed


def test_fingerprint_dict_round_trip() -> None:
    fp = ModelFingerprint("Qwen2ForCausalLM", 24, 896, 151936, name="Qwen/Qwen2.5-0.5B")
    d = fp.to_dict()
    assert d == {
        "name": "Qwen/Qwen2.5-0.5B",
        "architecture": "Qwen2ForCausalLM",
        "num_hidden_layers": 24,
        "hidden_size": 896,
        "vocab_size": 151936,
    }
    back = ModelFingerprint.from_dict(json.loads(json.dumps(d)))
    assert back == fp and back.name == fp.name


def test_fingerprint_rejects_bool_layers() -> None:
    with pytest.raises(SelfSpecConfigError, match="num_hidden_layers must be a positive integer"):
        ModelFingerprint("X", True, 1, 1)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------- profile


def test_profile_round_trip(tmp_path: Path) -> None:
    path = _write(tmp_path, _doc())
    profile = load_profile(str(path))
    assert profile.name == "mine"
    assert profile.path == str(path)
    assert profile.skip_attention == (4, 6)
    assert profile.skip_mlp == (5,)
    assert profile.draft == {"num_speculative_tokens": 6}
    assert profile.to_dict() == _doc()
    (tmp_path / "copy").mkdir()
    out = tmp_path / "copy" / "mine.json"
    profile.save(out)
    again = load_profile(out)
    assert again == profile and again.path == str(out)
    assert json.loads(out.read_text()) == _doc()
    profile.save(tmp_path / "renamed.json")
    assert load_profile(tmp_path / "renamed.json").name == "renamed"
    assert not [p for p in tmp_path.rglob("*.tmp")]


def test_profile_sorts_lists_and_optional_keys(tmp_path: Path) -> None:
    doc = _doc(skip_attention=[6, 4])
    del doc["draft"], doc["provenance"]
    profile = load_profile(_write(tmp_path, doc))
    assert profile.skip_attention == (4, 6)
    assert profile.draft == {} and profile.provenance == {}


def test_profile_save_keeps_lists_on_one_line(tmp_path: Path) -> None:
    load_profile(_write(tmp_path, _doc())).save(tmp_path / "out.json")
    assert '"skip_attention": [4, 6],' in (tmp_path / "out.json").read_text()


def test_profile_save_rejects_non_json(tmp_path: Path) -> None:
    profile = Profile("p", LLAMA_13B, (), (), provenance={"acceptance": float("nan")})
    with pytest.raises(ProfileError, match="cannot be written as JSON"):
        profile.save(tmp_path / "p.json")
    assert not list(tmp_path.iterdir())


def test_profile_check_model_names_profile_path_and_mismatches(tmp_path: Path) -> None:
    profile = load_profile(_write(tmp_path, _doc()))
    profile.check_model(ModelFingerprint("LlamaForCausalLM", 8, 64, 100))
    served = ModelFingerprint("LlamaForCausalLM", 30, 576, 100, name="HuggingFaceTB/SmolLM2-135M")
    with pytest.raises(ProfileError) as info:
        profile.check_model(served)
    msg = str(info.value)
    assert "profile 'mine'" in msg and str(tmp_path / "mine.json") in msg
    assert "num_hidden_layers: profile 8, model 30" in msg
    assert "hidden_size: profile 64, model 576" in msg
    assert "tiny/model" in msg and "SmolLM2-135M" in msg


# ------------------------------------------------------------------------ load_profile errors


def test_load_unknown_shipped_name_lists_shipped() -> None:
    with pytest.raises(ProfileError, match="no shipped profile named 'llama-2-13b.draft'") as info:
        load_profile("llama-2-13b.draft")
    assert "llama-2-13b.draft-verify" in str(info.value)
    assert "shipped profiles: codellama-13b.draft-verify" in str(info.value)


def test_load_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match=r"profile file .*nope\.json' not found; shipped"):
        load_profile(str(tmp_path / "nope.json"))


def test_load_malformed_json(tmp_path: Path) -> None:
    path = _write(tmp_path, '{\n  "schema_version": 1,\n  "model": {,\n}')
    with pytest.raises(ProfileError, match=r"malformed JSON at line 3, column 13 \(char 37\)"):
        load_profile(path)


def test_load_duplicate_json_key(tmp_path: Path) -> None:
    path = _write(tmp_path, '{"schema_version": 1, "schema_version": 1}')
    with pytest.raises(ProfileError, match="key 'schema_version' appears twice"):
        load_profile(path)


def test_load_nan_rejected(tmp_path: Path) -> None:
    path = _write(tmp_path, json.dumps(_doc(provenance={"acceptance": float("nan")})))
    with pytest.raises(ProfileError, match="NaN is not valid JSON"):
        load_profile(path)


def test_load_top_level_not_object(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match="top level must be a JSON object, got array"):
        load_profile(_write(tmp_path, [1, 2]))


@pytest.mark.parametrize("version", [2, 0, "1", None, True])
def test_load_wrong_schema_version(tmp_path: Path, version: Any) -> None:
    with pytest.raises(ProfileError, match=r"unsupported schema_version .*reads schema_version 1"):
        load_profile(_write(tmp_path, _doc(schema_version=version)))


def test_load_missing_key(tmp_path: Path) -> None:
    doc = _doc()
    del doc["skip_mlp"]
    with pytest.raises(ProfileError, match="missing key.s. skip_mlp"):
        load_profile(_write(tmp_path, doc))


def test_load_extra_key_suggests(tmp_path: Path) -> None:
    with pytest.raises(
        ProfileError, match="unknown key 'skip_attn' .did you mean 'skip_attention'"
    ):
        load_profile(_write(tmp_path, _doc(skip_attn=[1])))


def test_load_model_extra_key(tmp_path: Path) -> None:
    doc = _doc()
    doc["model"]["layers"] = 8
    with pytest.raises(ProfileError, match=r"mine.json\): model: unknown key 'layers'"):
        load_profile(_write(tmp_path, doc))


def test_load_model_missing_key(tmp_path: Path) -> None:
    doc = _doc()
    del doc["model"]["hidden_size"]
    with pytest.raises(ProfileError, match="model: missing key.s. hidden_size"):
        load_profile(_write(tmp_path, doc))


def test_load_model_wrong_type(tmp_path: Path) -> None:
    doc = _doc()
    doc["model"]["vocab_size"] = "100"
    with pytest.raises(ProfileError, match="model: vocab_size must be a positive integer"):
        load_profile(_write(tmp_path, doc))


def test_load_list_wrong_type(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match="skip_mlp must be a list of layer indices"):
        load_profile(_write(tmp_path, _doc(skip_mlp="5")))


@pytest.mark.parametrize("bad", [1.0, "3", True, None])
def test_load_index_not_int(tmp_path: Path, bad: Any) -> None:
    with pytest.raises(ProfileError, match=r"skip_attention\[1\] = .* is not an integer layer"):
        load_profile(_write(tmp_path, _doc(skip_attention=[4, bad])))


def test_load_index_negative(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match=r"skip_mlp\[0\] = -1 is negative; valid .* 0\.\.7"):
        load_profile(_write(tmp_path, _doc(skip_mlp=[-1])))


def test_load_index_out_of_range(tmp_path: Path) -> None:
    with pytest.raises(
        ProfileError,
        match=r"skip_attention\[1\] = 8 is out of range; valid layer indices are 0\.\.7 "
        r"\(the profile's model has 8 layers\)",
    ):
        load_profile(_write(tmp_path, _doc(skip_attention=[7, 8])))


def test_load_duplicates(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match=r"skip_attention lists layer\(s\) 4 more than once"):
        load_profile(_write(tmp_path, _doc(skip_attention=[4, 6, 4])))


def test_load_draft_unknown_key(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match="draft: unknown key 'num_spec_tokens'"):
        load_profile(_write(tmp_path, _doc(draft={"num_spec_tokens": 3})))


def test_load_draft_bad_num_speculative_tokens(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match="draft.num_speculative_tokens must be an integer >= 1"):
        load_profile(_write(tmp_path, _doc(draft={"num_speculative_tokens": 0})))


def test_load_provenance_not_object(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match="provenance must be an object, got string"):
        load_profile(_write(tmp_path, _doc(provenance="paper")))


def test_load_profile_errors_are_value_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        load_profile(str(tmp_path / "absent.json"))


# ------------------------------------------------------------------------- shipped profiles


def test_shipped_names() -> None:
    assert set(shipped_profile_names()) == EXPECTED_SHIPPED
    assert shipped_profile_names() == sorted(shipped_profile_names())


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_every_shipped_profile_is_valid(name: str) -> None:
    profile = load_profile(name)
    assert profile.name == name
    assert Path(profile.path or "").name == f"{name}.json"
    profile.check_model(profile.model)
    n = profile.model.num_hidden_layers
    assert profile.skip_attention and profile.skip_mlp
    assert all(0 <= i < n for i in profile.skip_attention + profile.skip_mlp)
    assert profile.model.architecture == "LlamaForCausalLM"
    assert profile.provenance["source"].split(" ")[0] in (
        "dilab-zju/self-speculative-decoding",
        "hemingkx/SWIFT",
    )
    assert set(profile.provenance) == {"method", "source", "acceptance", "date"}
    assert profile.draft == {}
    text = Path(profile.path or "").read_text(encoding="utf-8")
    assert json.loads(text)["schema_version"] == SCHEMA_VERSION


def test_shipped_profiles_match_published_shapes() -> None:
    shapes = {p.name: (p.model.num_hidden_layers, p.model.hidden_size, p.model.vocab_size)
              for p in shipped_profiles()}
    assert shapes["llama-2-13b.draft-verify"] == (40, 5120, 32000)
    assert shapes["llama-2-13b-chat.swift-cnndm"] == (40, 5120, 32000)
    assert shapes["codellama-13b.draft-verify"] == (40, 5120, 32016)
    assert shapes["llama-2-70b.swift-cnndm"] == (80, 8192, 32000)
    assert shapes["codellama-34b.swift-humaneval"] == (48, 8192, 32000)
    dv_13b = load_profile("llama-2-13b.draft-verify")
    assert dv_13b.skip_mlp == (6, 9, 10, 11, 15, 24, 25, 27, 28, 35)
    assert len(load_profile("llama-2-70b.draft-verify").skip_attention) == 47


def test_shipped_file_formatting_is_canonical(tmp_path: Path) -> None:
    for profile in shipped_profiles():
        out = tmp_path / f"{profile.name}.json"
        profile.save(out)
        assert out.read_text() == Path(profile.path or "").read_text(), profile.name


def test_load_by_path_and_name_agree() -> None:
    by_name = load_profile("codellama-34b.swift-humaneval")
    assert load_profile(by_name.path or "") == by_name


# ---------------------------------------------------------------------- find_shipped_profile


def _fp(name: str | None, layers: int = 40, hidden: int = 5120, vocab: int = 32000) -> Any:
    return ModelFingerprint("LlamaForCausalLM", layers, hidden, vocab, name=name)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("meta-llama/Llama-2-13b-chat-hf", "llama-2-13b-chat.draft-verify"),
        ("/models/LLAMA-2-13B-CHAT-HF/", "llama-2-13b-chat.draft-verify"),
        ("Llama-2-13b-hf", "llama-2-13b.draft-verify"),
        (
            "/cache/hub/models--meta-llama--Llama-2-13b-hf/snapshots/0123abcd",
            "llama-2-13b.draft-verify",
        ),
    ],
)
def test_find_prefers_matching_name(name: str, expected: str) -> None:
    found = find_shipped_profile(_fp(name))
    assert found is not None and found.name == expected


@pytest.mark.parametrize("name", [None, "my-org/llama2-13b-finetune", "Llama-2-13b"])
def test_find_ambiguous_shape_returns_none(name: str | None) -> None:
    assert find_shipped_profile(_fp(name)) is None


def test_find_unique_checkpoint_without_name() -> None:
    found = find_shipped_profile(_fp(None, layers=80, hidden=8192))
    assert found is not None and found.name == "llama-2-70b.draft-verify"
    found = find_shipped_profile(_fp("my-org/finetuned-70b", layers=80, hidden=8192))
    assert found is not None and found.name == "llama-2-70b.draft-verify"
    found = find_shipped_profile(_fp(None, vocab=32016))
    assert found is not None and found.model.name == "codellama/CodeLlama-13b-hf"
    found = find_shipped_profile(_fp("codellama/CodeLlama-34b-Instruct-hf", 48, 8192))
    assert found is not None and found.name == "codellama-34b.swift-humaneval"


@pytest.mark.parametrize("name", sorted(SEARCHED))
def test_searched_profiles_are_valid(name: str) -> None:
    profile = load_profile(name)
    profile.check_model(profile.model)
    assert profile.skip_attention or profile.skip_mlp
    assert "selfspec-profile" in profile.provenance["method"]
    # estimated and measured acceptance are recorded side by side
    assert 0 < profile.provenance["estimated_acceptance"] <= 1
    assert 0 < profile.provenance["measured_acceptance"] <= 1
    assert find_shipped_profile(profile.model) == profile


def test_find_no_match() -> None:
    assert find_shipped_profile(_fp("HuggingFaceTB/SmolLM2-360M", 32, 960, 49152)) is None
    mistral = ModelFingerprint("MistralForCausalLM", 40, 5120, 32000, "Llama-2-13b-hf")
    assert find_shipped_profile(mistral) is None


def test_shipped_profiles_returns_copy() -> None:
    first = shipped_profiles()
    first.clear()
    assert len(shipped_profiles()) == len(EXPECTED_SHIPPED)
