"""Engine-start validation: turn the user's ``{"method": "selfspec", ...}`` into vLLM's config.

Runs in the front-end process before vLLM builds its ``SpeculativeConfig``, so every configuration
error is raised at engine start with a clear message and nothing else runs.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm_selfspec.config import SELFSPEC_KEYS, resolve_settings
from vllm_selfspec.errors import SelfSpecConfigError
from vllm_selfspec.layers.profiles import ModelFingerprint

logger = logging.getLogger("vllm.selfspec.engine_config")

# SpeculativeConfig fields that make no sense for a drafter that is the target model itself.
_REFUSED_VLLM_KEYS = {
    "model": "selfspec drafts with the served model itself; do not set 'model'",
    "quantization": "selfspec shares the target's weights; do not set 'quantization'",
    "draft_tensor_parallel_size": "the selfspec drafter uses the target's tensor parallelism",
    "revision": "selfspec has no separate draft model; do not set 'revision'",
}


def _speculative_config_fields() -> set[str]:
    import dataclasses

    from vllm.config import SpeculativeConfig

    return {f.name for f in dataclasses.fields(SpeculativeConfig) if f.init}


def rewrite_selfspec_request(
    spec: dict[str, Any], engine_args: Any, model_config: Any, parallel_config: Any
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Validate a selfspec speculative config; return (vLLM speculative config, settings dict)."""
    spec = {str(k).replace("-", "_"): v for k, v in spec.items()}
    spec.pop("method", None)
    spec.pop("target_model_config", None)
    spec.pop("target_parallel_config", None)
    num_speculative_tokens = spec.pop("num_speculative_tokens", None)

    vllm_fields = _speculative_config_fields()
    own: dict[str, Any] = {}
    passthrough: dict[str, Any] = {}
    for key, value in spec.items():
        if key in _REFUSED_VLLM_KEYS:
            if key == "model" and value in (None, model_config.model):
                continue
            raise SelfSpecConfigError(f"speculative config: {_REFUSED_VLLM_KEYS[key]}")
        if key in vllm_fields and key not in SELFSPEC_KEYS:
            passthrough[key] = value
        else:  # selfspec keys, and unknown keys (resolve_settings names them)
            own[key] = value

    _check_engine_features(engine_args, parallel_config)
    fingerprint = ModelFingerprint.from_hf_config(
        _text_config(model_config), name=str(model_config.model)
    )
    settings = resolve_settings(own, fingerprint, num_speculative_tokens)
    choose_async_scheduling(engine_args)
    logger.info(
        "selfspec: drafting with %d of %d attention and %d of %d MLP sub-layers skipped "
        "(%s), drafts=%s, num_speculative_tokens=%d, adaptive=%s, draft sampling=%s, layer "
        "selection=%s",
        len(settings.skip_attention),
        settings.num_hidden_layers,
        len(settings.skip_mlp),
        settings.num_hidden_layers,
        settings.source,
        settings.drafts,
        settings.num_speculative_tokens,
        settings.adaptive,
        settings.draft_sampling,
        settings.layer_selection,
    )

    # vLLM's draft-model path with the target as its own draft model; the runner patch
    # (patches.model_runner.install_device_drafter) swaps our proposer in, which loads no
    # weights and allocates no KV of its own.
    vllm_spec = {
        **passthrough,
        "method": "draft_model",
        "model": model_config.model,
        "num_speculative_tokens": settings.num_speculative_tokens,
        "draft_tensor_parallel_size": getattr(parallel_config, "tensor_parallel_size", 1),
        "draft_sample_method": (
            "probabilistic" if settings.draft_sampling == "probabilistic" else "greedy"
        ),
    }
    return vllm_spec, settings.to_dict()


def choose_async_scheduling(engine_args: Any) -> None:
    """selfspec engines run with async scheduling off, set here (before vLLM builds its scheduler
    config from ``engine_args``): under async scheduling vLLM's scheduler fills each request's
    drafts with placeholders and never hands the drafter's per-request draft lengths, lookup
    drafts and verification counts back through ``take_draft_token_ids``; per-request budgets,
    prompt lookup and the draft-length controller would not run (see docs/cuda.md). vLLM turns
    async scheduling on by default for ``draft_model`` on CUDA; the CPU platform turns it off for
    every engine. An explicit ``--async-scheduling`` is refused rather than silently dropped."""
    if getattr(engine_args, "async_scheduling", None):
        raise SelfSpecConfigError(
            "selfspec does not support async scheduling yet (async_scheduling=True): its "
            "per-request draft lengths, prompt-lookup drafts and draft-length controller need the "
            "synchronous path, where vLLM hands the drafts back to the drafter before "
            "scheduling them. Remove --async-scheduling (selfspec turns it off itself)."
        )
    if hasattr(engine_args, "async_scheduling"):
        engine_args.async_scheduling = False
        logger.info(
            "selfspec: async scheduling off for this engine (selfspec's per-request draft "
            "lengths and lookup drafts run on vLLM's synchronous scheduling path)"
        )


def _text_config(model_config: Any) -> Any:
    hf_config = model_config.hf_config
    text = getattr(model_config, "hf_text_config", None) or hf_config
    if not getattr(text, "architectures", None):
        # Multimodal wrappers keep the architecture on the outer config.
        class _View:
            architectures = getattr(hf_config, "architectures", None) or []
            num_hidden_layers = text.num_hidden_layers
            hidden_size = text.hidden_size
            vocab_size = text.vocab_size

        return _View
    return text


def _check_engine_features(engine_args: Any, parallel_config: Any) -> None:
    if getattr(parallel_config, "pipeline_parallel_size", 1) > 1:
        raise SelfSpecConfigError(
            "selfspec does not support pipeline parallelism (pipeline_parallel_size="
            f"{parallel_config.pipeline_parallel_size}): vLLM builds drafters only on the last "
            "pipeline stage, which lacks the earlier layers a self-draft needs. Use "
            "tensor parallelism instead (see README, 'Pipeline parallelism')."
        )
    if getattr(engine_args, "kv_transfer_config", None) is not None:
        raise SelfSpecConfigError(
            "selfspec does not support KV-transfer connectors (kv_transfer_config is set): "
            "draft steps write into the target's KV cache, which a connector would ship."
        )
    if getattr(engine_args, "enable_lora", False):
        raise SelfSpecConfigError("selfspec does not support LoRA adapters yet (enable_lora=True).")
