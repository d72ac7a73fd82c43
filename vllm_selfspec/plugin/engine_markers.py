"""How a vLLM engine's config says that it runs selfspec (names only: no vLLM import).

Engine start (:mod:`vllm_selfspec.plugin.engine_config`) writes these markers, and the patches, the
metrics hookup and the drafter read them, so they live here rather than in any of those modules.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

METHOD_NAME = "selfspec"
# ``VllmConfig.additional_config[ADDITIONAL_CONFIG_KEY]``: the resolved settings, for every worker
ADDITIONAL_CONFIG_KEY = "selfspec"


def is_selfspec_engine(vllm_config: Any) -> bool:
    """True for an engine configured by selfspec: vLLM's ``draft_model`` method (the target as
    its own draft model) with selfspec's settings in ``additional_config``."""
    spec = getattr(vllm_config, "speculative_config", None)
    settings = (getattr(vllm_config, "additional_config", None) or {}).get(ADDITIONAL_CONFIG_KEY)
    return getattr(spec, "method", None) == "draft_model" and isinstance(settings, Mapping)
