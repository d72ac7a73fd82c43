"""Patches of vLLM's engine arguments and config (every process that builds a ``VllmConfig``).

1. ``EngineArgs.create_speculative_config``: the user contract is
   ``{"method": "selfspec", ...selfspec keys...}``. vLLM's ``SpeculativeConfig`` knows no such
   method and forbids unknown keys, so the wrapper validates the selfspec keys against the served
   model (clear errors at engine start), rewrites the method into vLLM's ``custom_class`` proposer
   hook pointing at :class:`vllm_selfspec.drafting.host_drafter.SelfSpecProposer`, and ships the
   resolved settings inside ``VllmConfig.additional_config["selfspec"]``: that object travels
   with the config to every worker (multiprocessing and Ray), and two engines in one process
   each carry their own. Can go once vLLM lets a plugin register a speculative method by name.
2. ``VllmConfig.num_lookahead_tokens``: vLLM reserves lookahead KV slots only for EAGLE-style
   drafters. Our draft steps write K/V up to ``k`` positions past the verified tokens, so the
   scheduler must reserve ``k`` lookahead slots for us too. Can go once vLLM asks the proposer
   (or the method) how many lookahead slots it writes.
"""

from __future__ import annotations

from vllm_selfspec.plugin.engine_markers import (
    ADDITIONAL_CONFIG_KEY,
    METHOD_NAME,
    is_selfspec_config,
)
from vllm_selfspec.plugin.patches._shared import already_wrapped, install
from vllm_selfspec.plugin.patches.front_end import install_metrics, install_request_validation

# --- 1. the "selfspec" method alias -------------------------------------------------------------


def _patch_create_speculative_config(unsupported: str | None = None) -> None:
    from vllm.engine.arg_utils import EngineArgs

    original = EngineArgs.create_speculative_config
    if already_wrapped(original):
        return

    def create_speculative_config(self, target_model_config, target_parallel_config):
        spec = self.speculative_config
        if isinstance(spec, dict) and spec.get("method") == METHOD_NAME:
            if unsupported is not None:
                from vllm_selfspec.errors import SelfSpecConfigError

                raise SelfSpecConfigError(unsupported)
            from vllm_selfspec.plugin.engine_config import rewrite_selfspec_request

            self.speculative_config, settings = rewrite_selfspec_request(
                spec, self, target_model_config, target_parallel_config
            )
            additional = dict(self.additional_config or {})
            additional[ADDITIONAL_CONFIG_KEY] = settings
            self.additional_config = additional
            install_metrics()
            install_request_validation()
        return original(self, target_model_config, target_parallel_config)

    install(EngineArgs, "create_speculative_config", create_speculative_config, original)


# --- 2. lookahead KV slots --------------------------------------------------------------------


def _patch_num_lookahead_tokens() -> None:
    from vllm.config import VllmConfig

    original = VllmConfig.num_lookahead_tokens
    if already_wrapped(original):
        return

    def num_lookahead_tokens(self) -> int:
        if is_selfspec_config(self.speculative_config):
            return self.speculative_config.num_speculative_tokens
        return original.fget(self)

    wrapper = property(num_lookahead_tokens, doc=original.__doc__)
    install(VllmConfig, "num_lookahead_tokens", wrapper, original)
