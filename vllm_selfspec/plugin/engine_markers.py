"""How a vLLM engine's config says that it runs selfspec (names only: no vLLM import).

Engine start (:mod:`vllm_selfspec.plugin.engine_config`) writes these markers, and the patches, the
metrics hookup and the drafters read them, so they live here rather than in any of those modules.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

METHOD_NAME = "selfspec"
# vLLM's ``custom_class`` proposer hook builds the host drafter from this path
PROPOSER_PATH = "vllm_selfspec.drafting.host_drafter.SelfSpecProposer"
# ``VllmConfig.additional_config[ADDITIONAL_CONFIG_KEY]``: the resolved settings, for every worker
ADDITIONAL_CONFIG_KEY = "selfspec"


def is_selfspec_config(speculative_config: Any) -> bool:
    """True for a vLLM ``SpeculativeConfig`` that runs the host drafter."""
    return (
        speculative_config is not None
        and getattr(speculative_config, "method", None) == "custom_class"
        and getattr(speculative_config, "model", None) == PROPOSER_PATH
    )


def wants_device_drafter(vllm_config: Any) -> bool:
    """True for an engine configured by selfspec for its device drafter."""
    spec = getattr(vllm_config, "speculative_config", None)
    settings = (getattr(vllm_config, "additional_config", None) or {}).get(ADDITIONAL_CONFIG_KEY)
    return (
        getattr(spec, "method", None) == "draft_model"
        and isinstance(settings, Mapping)
        and settings.get("drafter") == "device"
    )
