"""Unit tests for vllm_selfspec.config (pure Python, no vLLM)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from vllm_selfspec.config import (
    DEFAULT_NUM_SPECULATIVE_TOKENS,
    SELFSPEC_KEYS,
    SUPPORTED_ARCHITECTURES,
    SelfSpecSettings,
    default_skip_set,
    resolve_settings,
)
from vllm_selfspec.errors import ProfileError, SelfSpecConfigError
from vllm_selfspec.layers.profiles import DRAFT_KEYS, ModelFingerprint, Profile

SMOL = ModelFingerprint("LlamaForCausalLM", 30, 576, 49152, name="HuggingFaceTB/SmolLM2-135M")
UNPROFILED_30 = ModelFingerprint("LlamaForCausalLM", 30, 640, 50000, name="some/other-30-layer")
LLAMA_13B_CHAT = ModelFingerprint(
    "LlamaForCausalLM", 40, 5120, 32000, name="meta-llama/Llama-2-13b-chat-hf"
)


def _profile_file(tmp_path: Path, name: str = "smol", **kw: Any) -> Path:
    profile = Profile(
        name=name,
        model=SMOL,
        skip_attention=kw.pop("skip_attention", (10, 12, 14)),
        skip_mlp=kw.pop("skip_mlp", (20,)),
        draft=kw.pop("draft", {}),
        provenance={"method": "test"},
    )
    path = tmp_path / f"{name}.json"
    profile.save(path)
    return path


# --------------------------------------------------------------------------- constants


def test_draft_keys_are_the_tunable_selfspec_keys() -> None:
    online = {"layer_selection", "online_search", "online_profile_out"}
    # how the engine drafts, not a property of the skip set
    serving = {"drafter", "drafts", "prompt_lookup_min", "prompt_lookup_max"}
    tunables = SELFSPEC_KEYS - {"skip_attention", "skip_mlp", "profile"} - online - serving
    assert DRAFT_KEYS == tunables | {"num_speculative_tokens"}


def test_supported_architectures() -> None:
    assert SUPPORTED_ARCHITECTURES == (
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
    )


# ------------------------------------------------------------------------- default_skip_set


@pytest.mark.parametrize("n", range(1, 101))
def test_default_skip_set_properties(n: int) -> None:
    attention, mlp = default_skip_set(n)
    assert mlp == ()
    assert list(attention) == sorted(set(attention))
    if n < 4:
        assert attention == ()
        return
    assert all(2 <= i <= n - 2 for i in attention)  # never 0, 1 nor the last layer
    assert all(i >= n // 2 for i in attention)  # upper half
    assert abs(len(attention) - n / 4) < 1
    assert default_skip_set(n) == (attention, mlp)  # deterministic


def test_default_skip_set_is_spread() -> None:
    attention, _ = default_skip_set(40)
    assert attention == (20, 22, 24, 26, 28, 30, 32, 34, 36, 38)
    gaps = [b - a for a, b in zip(attention, attention[1:], strict=False)]
    assert max(gaps) - min(gaps) <= 1
    assert default_skip_set(30)[0] == (16, 18, 20, 22, 24, 26, 28)


@pytest.mark.parametrize("bad", [0, -3, 2.0, True, "8"])
def test_default_skip_set_rejects_bad_depth(bad: Any) -> None:
    with pytest.raises(SelfSpecConfigError, match="num_hidden_layers must be an integer >= 1"):
        default_skip_set(bad)


# ------------------------------------------------------------------------ resolve: sources


def test_explicit_lists() -> None:
    s = resolve_settings({"skip_attention": [12, 3], "skip_mlp": []}, SMOL, 5)
    assert s.skip_attention == (3, 12) and s.skip_mlp == ()
    assert s.source == "explicit skip lists"
    assert s.num_speculative_tokens == 5 and s.num_hidden_layers == 30


def test_explicit_single_list_and_empty_lists() -> None:
    s = resolve_settings({"skip_mlp": [1]}, SMOL, None)
    assert s.skip_attention == () and s.skip_mlp == (1,)
    empty = resolve_settings({"skip_attention": [], "skip_mlp": []}, SMOL, None)
    assert empty.skip_attention == () and empty.skip_mlp == ()
    assert empty.source == "explicit skip lists"


def test_shipped_smollm2_profile_is_found() -> None:
    s = resolve_settings({}, SMOL, None)
    assert "smollm2-135m-instruct" in s.source


def test_default_when_nothing_matches() -> None:
    s = resolve_settings({}, UNPROFILED_30, None)
    assert (s.skip_attention, s.skip_mlp) == default_skip_set(30)
    assert s.source == (
        "default for a 30-layer model (no profile matched; a searched profile would be faster)"
    )
    assert s.num_speculative_tokens == DEFAULT_NUM_SPECULATIVE_TOKENS
    assert s.adaptive is True
    assert s.draft_confidence_threshold == 0.6
    assert s.target_acceptance == 0.9
    assert s.draft_sampling == "probabilistic"


def test_none_spec_and_none_values_mean_not_given() -> None:
    assert resolve_settings(None, SMOL, None) == resolve_settings({}, SMOL, None)
    assert resolve_settings(None, UNPROFILED_30, None) == resolve_settings({}, UNPROFILED_30, None)
    s = resolve_settings({"profile": None, "skip_attention": [2], "adaptive": None}, SMOL, None)
    assert s.skip_attention == (2,) and s.adaptive is True


def test_shipped_profile_matched_by_fingerprint() -> None:
    s = resolve_settings({}, LLAMA_13B_CHAT, None)
    assert s.source == (
        "shipped profile 'llama-2-13b-chat.draft-verify' matched the model fingerprint"
    )
    assert s.skip_mlp == (7, 10, 11, 14, 27, 30, 32, 33, 37, 38)


def test_ambiguous_shipped_profile_falls_back_to_default() -> None:
    unnamed = ModelFingerprint("LlamaForCausalLM", 40, 5120, 32000, name="my/finetune")
    s = resolve_settings({}, unnamed, None)
    assert s.source.startswith("default for a 40-layer model")
    assert (s.skip_attention, s.skip_mlp) == default_skip_set(40)


def test_profile_by_shipped_name() -> None:
    s = resolve_settings({"profile": "llama-2-13b-chat.swift-cnndm"}, LLAMA_13B_CHAT, 7)
    assert s.source.startswith("profile 'llama-2-13b-chat.swift-cnndm' (")
    assert s.source.endswith("llama-2-13b-chat.swift-cnndm.json)")
    assert s.skip_attention[0] == 7 and len(s.skip_attention) == 18
    assert s.num_speculative_tokens == 7


def test_profile_by_path(tmp_path: Path) -> None:
    path = _profile_file(tmp_path)
    s = resolve_settings({"profile": str(path)}, SMOL, None)
    assert s.skip_attention == (10, 12, 14) and s.skip_mlp == (20,)
    assert s.source == f"profile 'smol' ({path})"


def test_profile_draft_defaults(tmp_path: Path) -> None:
    draft = {"num_speculative_tokens": 6, "draft_sampling": "argmax", "adaptive": False}
    path = _profile_file(tmp_path, draft=draft)
    s = resolve_settings({"profile": str(path)}, SMOL, None)
    assert s.num_speculative_tokens == 6
    assert s.draft_sampling == "argmax" and s.adaptive is False
    # explicit values win over the profile's defaults
    s = resolve_settings({"profile": str(path), "adaptive": True}, SMOL, 3)
    assert s.num_speculative_tokens == 3 and s.adaptive is True
    assert s.draft_sampling == "argmax"


def test_profile_draft_default_out_of_range(tmp_path: Path) -> None:
    path = _profile_file(tmp_path, draft={"target_acceptance": 1.5})
    with pytest.raises(
        SelfSpecConfigError,
        match=r"profile 'smol' .*draft\.target_acceptance must be a number in \(0, 1\]",
    ):
        resolve_settings({"profile": str(path)}, SMOL, None)


def test_knobs() -> None:
    s = resolve_settings(
        {
            "adaptive": False,
            "draft_confidence_threshold": 0,
            "target_acceptance": 1,
            "draft_sampling": "argmax",
        },
        SMOL,
        None,
    )
    assert s.adaptive is False
    assert s.draft_confidence_threshold == 0.0 and isinstance(s.draft_confidence_threshold, float)
    assert s.target_acceptance == 1.0 and isinstance(s.target_acceptance, float)
    assert s.draft_sampling == "argmax"


# ------------------------------------------------------------------------- resolve: errors


def test_unknown_key_suggests_closest() -> None:
    with pytest.raises(
        SelfSpecConfigError,
        match=r"unknown selfspec key 'skip_atention' \(did you mean 'skip_attention'\?\); "
        r"valid selfspec keys: adaptive, draft_confidence_threshold",
    ):
        resolve_settings({"skip_atention": [1]}, SMOL, None)


def test_unknown_key_without_suggestion() -> None:
    with pytest.raises(SelfSpecConfigError, match=r"unknown selfspec key 'zzz'; valid") as info:
        resolve_settings({"zzz": 1}, SMOL, None)
    assert "did you mean" not in str(info.value)


def test_unsupported_architecture() -> None:
    gpt2 = ModelFingerprint("GPT2LMHeadModel", 12, 768, 50257)
    with pytest.raises(
        SelfSpecConfigError,
        match="architecture 'GPT2LMHeadModel' is not supported by selfspec; supported: "
        "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM",
    ):
        resolve_settings({}, gpt2, None)


@pytest.mark.parametrize("arch", SUPPORTED_ARCHITECTURES)
def test_supported_architecture_accepted(arch: str) -> None:
    fp = ModelFingerprint(arch, 24, 896, 151936)
    assert resolve_settings({}, fp, None).num_hidden_layers == 24


def test_profile_with_lists_is_ambiguous() -> None:
    with pytest.raises(
        SelfSpecConfigError,
        match=r"'profile' \('x'\) cannot be combined with skip_mlp: give either a profile or",
    ):
        resolve_settings({"profile": "x", "skip_mlp": [1]}, SMOL, None)


@pytest.mark.parametrize("value", ["1,2", 3, {"a": 1}])
def test_list_wrong_type(value: Any) -> None:
    with pytest.raises(
        SelfSpecConfigError,
        match=r"skip_attention must be a list of layer indices \(valid layer indices are 0\.\.29",
    ):
        resolve_settings({"skip_attention": value}, SMOL, None)


@pytest.mark.parametrize("item", [True, 1.0, "2"])
def test_list_item_not_int(item: Any) -> None:
    with pytest.raises(SelfSpecConfigError, match=r"skip_mlp\[1\] = .* is not an integer layer"):
        resolve_settings({"skip_mlp": [3, item]}, SMOL, None)


def test_list_negative() -> None:
    with pytest.raises(
        SelfSpecConfigError, match=r"skip_attention\[0\] = -2 is negative; valid .* 0\.\.29"
    ):
        resolve_settings({"skip_attention": [-2]}, SMOL, None)


def test_list_out_of_range() -> None:
    with pytest.raises(
        SelfSpecConfigError,
        match=r"skip_mlp\[2\] = 30 is out of range; valid layer indices are 0\.\.29 "
        r"\(the model has 30 layers\)",
    ):
        resolve_settings({"skip_mlp": [1, 2, 30]}, SMOL, None)


def test_list_duplicates() -> None:
    with pytest.raises(
        SelfSpecConfigError, match=r"skip_attention lists layer\(s\) 5, 7 more than once"
    ):
        resolve_settings({"skip_attention": [5, 7, 5, 7, 5]}, SMOL, None)


def test_skipping_everything() -> None:
    every = list(range(30))
    with pytest.raises(SelfSpecConfigError, match="together skip every sub-layer of all 30 layers"):
        resolve_settings({"skip_attention": every, "skip_mlp": every}, SMOL, None)
    # one sub-layer kept is allowed
    s = resolve_settings({"skip_attention": every, "skip_mlp": every[1:]}, SMOL, None)
    assert len(s.skip_attention) == 30 and len(s.skip_mlp) == 29


def test_profile_not_found() -> None:
    with pytest.raises(ProfileError, match="no shipped profile named 'nope'; shipped profiles:"):
        resolve_settings({"profile": "nope"}, SMOL, None)


@pytest.mark.parametrize("value", ["", "   ", 3, ["a"]])
def test_profile_wrong_type(value: Any) -> None:
    with pytest.raises(SelfSpecConfigError, match="profile must be the name of a shipped profile"):
        resolve_settings({"profile": value}, SMOL, None)


def test_profile_model_mismatch() -> None:
    with pytest.raises(
        ProfileError,
        match=r"profile 'llama-2-13b.draft-verify' \(.*\) was made for "
        r"'meta-llama/Llama-2-13b-hf' .* does not fit the served model "
        r"'HuggingFaceTB/SmolLM2-135M' .*num_hidden_layers: profile 40, model 30",
    ):
        resolve_settings({"profile": "llama-2-13b.draft-verify"}, SMOL, None)


def test_profile_malformed_file(tmp_path: Path) -> None:
    path = tmp_path / "broken.json"
    path.write_text('{"schema_version": 1,}')
    with pytest.raises(ProfileError, match=r"profile 'broken' .*malformed JSON at line 1"):
        resolve_settings({"profile": str(path)}, SMOL, None)


@pytest.mark.parametrize("k", [0, -1, 2.0, True, "4"])
def test_num_speculative_tokens_invalid(k: Any) -> None:
    with pytest.raises(SelfSpecConfigError, match="num_speculative_tokens must be an integer >= 1"):
        resolve_settings({}, SMOL, k)


@pytest.mark.parametrize("value", [1, 0, "true"])
def test_adaptive_not_bool(value: Any) -> None:
    with pytest.raises(SelfSpecConfigError, match="adaptive must be true or false"):
        resolve_settings({"adaptive": value}, SMOL, None)


@pytest.mark.parametrize("value", [1.0, -0.1, 2, "0.5", True, float("nan")])
def test_draft_confidence_threshold_invalid(value: Any) -> None:
    with pytest.raises(
        SelfSpecConfigError, match=r"draft_confidence_threshold must be a number in \[0, 1\)"
    ):
        resolve_settings({"draft_confidence_threshold": value}, SMOL, None)


@pytest.mark.parametrize("value", [0, 0.0, 1.01, -1, "0.9", False, float("inf")])
def test_target_acceptance_invalid(value: Any) -> None:
    with pytest.raises(
        SelfSpecConfigError, match=r"target_acceptance must be a number in \(0, 1\]"
    ):
        resolve_settings({"target_acceptance": value}, SMOL, None)


@pytest.mark.parametrize("value", ["greedy", "ARGMAX", 1])
def test_draft_sampling_invalid(value: Any) -> None:
    with pytest.raises(
        SelfSpecConfigError, match="draft_sampling must be 'probabilistic' or 'argmax'"
    ):
        resolve_settings({"draft_sampling": value}, SMOL, None)


def test_spec_not_mapping() -> None:
    with pytest.raises(SelfSpecConfigError, match="must be a mapping of selfspec keys, got list"):
        resolve_settings([("profile", "x")], SMOL, None)  # type: ignore[arg-type]


def test_errors_are_value_errors() -> None:
    with pytest.raises(ValueError):
        resolve_settings({"skip_mlp": [99]}, SMOL, None)


# ------------------------------------------------------------------------------ settings


def test_settings_round_trip_through_json() -> None:
    s = resolve_settings(
        {"skip_attention": [9, 3], "skip_mlp": [4], "draft_sampling": "argmax"}, SMOL, 6
    )
    d = s.to_dict()
    assert d["skip_attention"] == [3, 9]
    wire = json.loads(json.dumps(d))
    back = SelfSpecSettings.from_dict(wire)
    assert back == s
    assert isinstance(back.skip_attention, tuple)
    assert set(d) == {
        "num_speculative_tokens",
        "skip_attention",
        "skip_mlp",
        "source",
        "num_hidden_layers",
        "adaptive",
        "draft_confidence_threshold",
        "target_acceptance",
        "draft_sampling",
        "layer_selection",
        "online_search",
        "online_profile_out",
        "drafts",
        "prompt_lookup_min",
        "prompt_lookup_max",
    }


def test_settings_from_dict_unknown_key() -> None:
    d = resolve_settings({}, SMOL, None).to_dict()
    d["skip_atn"] = []
    with pytest.raises(SelfSpecConfigError, match="unknown key 'skip_atn'"):
        SelfSpecSettings.from_dict(d)


def test_settings_from_dict_missing_key() -> None:
    d = resolve_settings({}, SMOL, None).to_dict()
    del d["num_hidden_layers"]
    with pytest.raises(SelfSpecConfigError, match="missing key.s. num_hidden_layers"):
        SelfSpecSettings.from_dict(d)


def test_settings_from_dict_validates() -> None:
    d = resolve_settings({}, SMOL, None).to_dict()
    d["skip_mlp"] = [30]
    with pytest.raises(SelfSpecConfigError, match=r"skip_mlp\[0\] = 30 is out of range"):
        SelfSpecSettings.from_dict(d)


def test_settings_defaults_and_sorting() -> None:
    s = SelfSpecSettings(4, (5, 2), (), "test", 8)
    assert s.skip_attention == (2, 5)
    assert (s.adaptive, s.draft_confidence_threshold, s.target_acceptance, s.draft_sampling) == (
        True,
        0.6,
        0.9,
        "probabilistic",
    )
    assert "2/8 attention" in s.describe()


def test_import_is_light() -> None:
    code = (
        "import sys, vllm_selfspec.config, vllm_selfspec.layers.profiles; "
        "heavy = sorted(m for m in ('vllm', 'torch') if m in sys.modules); "
        "assert not heavy, heavy"
    )
    root = Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)


def test_one_drafter_defaults_hybrid_adaptive_and_selects_layers() -> None:
    s = resolve_settings({}, SMOL, 6)  # a shipped profile matches
    assert (s.drafts, s.adaptive, s.layer_selection) == ("hybrid", True, "static")
    assert "drafter" not in s.to_dict()
    # no profile matches: online layer selection from the default set
    unprofiled = ModelFingerprint("LlamaForCausalLM", 8, 128, 576, name="tiny")
    assert resolve_settings({}, unprofiled, 4).layer_selection == "online"
    assert resolve_settings({"adaptive": False}, SMOL, 6).adaptive is False


def test_removed_drafter_key() -> None:
    """``"drafter": "host"`` names the removed drafter: a clear error that says what to use;
    ``"device"``, the one drafter left, is still taken (with a warning); anything else fails."""
    with pytest.raises(SelfSpecConfigError, match=r"drafter='host': the 'drafter' key was "
                       r"removed.*remove the key"):
        resolve_settings({"drafter": "host"}, SMOL, 6)
    with pytest.raises(SelfSpecConfigError, match="'drafter' key was removed"):
        resolve_settings({"drafter": "gpu"}, SMOL, 6)
    assert resolve_settings({"drafter": "device"}, SMOL, 6) == resolve_settings({}, SMOL, 6)


def test_draft_without_attention() -> None:
    """Every attention sub-layer skipped (some MLPs kept) is a draft; every sub-layer is not."""
    s = resolve_settings({"skip_attention": list(range(30)), "skip_mlp": [1]}, SMOL, 6)
    assert len(s.skip_attention) == 30 and s.skip_mlp == (1,)
    with pytest.raises(SelfSpecConfigError, match="every"):
        resolve_settings({"skip_attention": list(range(30)), "skip_mlp": list(range(30))},
                         SMOL, 6)


def test_draft_sources_and_lookup_sizes() -> None:
    s = resolve_settings({}, SMOL, 6)
    assert (s.drafts, s.prompt_lookup_min, s.prompt_lookup_max) == ("hybrid", 2, 4)
    assert "drafts=hybrid" in s.describe()
    layer_skip = resolve_settings({"drafts": "layer_skip"}, SMOL, 6)
    assert layer_skip.drafts == "layer_skip" and "drafts=" not in layer_skip.describe()
    assert SelfSpecSettings.from_dict(json.loads(json.dumps(s.to_dict()))) == s
    # one size given: the other follows it (as vLLM's ngram method does)
    low = resolve_settings({"drafts": "lookup", "prompt_lookup_max": 1}, SMOL, 6)
    assert (low.prompt_lookup_min, low.prompt_lookup_max) == (1, 1)
    high = resolve_settings({"drafts": "lookup", "prompt_lookup_min": 6}, SMOL, 6)
    assert (high.prompt_lookup_min, high.prompt_lookup_max) == (6, 6)


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ({"drafts": "ngram"}, "drafts must be one of 'layer_skip'"),
        ({"prompt_lookup_min": 0}, "prompt_lookup_min must be an integer"),
        ({"prompt_lookup_max": "4"}, "prompt_lookup_max must be an integer"),
        ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "must be <="),
        ({"draft": "hybrid"}, "did you mean 'drafts'"),
    ],
)
def test_draft_source_errors(spec: dict, match: str) -> None:
    with pytest.raises(SelfSpecConfigError, match=match):
        resolve_settings(spec, SMOL, 6)
