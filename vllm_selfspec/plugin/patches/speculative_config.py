"""Patches of vLLM's engine arguments and config (every process that builds a ``VllmConfig``).

1. ``EngineArgs.create_speculative_config``: the user contract is
   ``{"method": "selfspec", ...selfspec keys...}``. vLLM's ``SpeculativeConfig`` knows no such
   method and forbids unknown keys, so the wrapper validates the selfspec keys against the served
   model (clear errors at engine start), rewrites the method into vLLM's ``draft_model`` method
   with the target as its own draft model (patch 8 builds our drafter in place of vLLM's), turns
   async scheduling off (:func:`~vllm_selfspec.plugin.engine_config.choose_async_scheduling`),
   and ships the resolved settings inside ``VllmConfig.additional_config["selfspec"]``: that
   object travels with the config to every worker (multiprocessing and Ray), and two engines in
   one process each carry their own. Can go once vLLM lets a plugin register a speculative method
   by name.
2. ``VllmConfig._get_v2_model_runner_unsupported_features`` and ``use_v2_model_runner``: with
   Triton (every CUDA install) vLLM 0.32 runs ``draft_model`` engines on its V2 model runner,
   whose speculator would load a second copy of the target and skip nothing, without a word: the
   drafter patch (8) hooks the V1 runner. selfspec engines name themselves an unsupported V2
   feature, so vLLM picks V1 and logs why ("Model Runner V2 does not yet support selfspec ..."),
   and a selfspec engine that something else forces onto V2 (``VLLM_USE_V2_MODEL_RUNNER=1``,
   HiSparse, watermarking) is refused at engine start. Can go once selfspec has a V2 speculator.
"""

from __future__ import annotations

from vllm_selfspec.plugin.engine_markers import (
    ADDITIONAL_CONFIG_KEY,
    METHOD_NAME,
    is_selfspec_engine,
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


# --- 2. the V1 model runner -------------------------------------------------------------------

V2_UNSUPPORTED_FEATURE = "selfspec (its drafter hooks the V1 model runner)"


def _patch_v1_model_runner() -> None:
    from vllm.config import VllmConfig

    features = VllmConfig._get_v2_model_runner_unsupported_features
    if not already_wrapped(features):

        def _get_v2_model_runner_unsupported_features(self) -> list[str]:
            unsupported = features(self)
            if is_selfspec_engine(self):
                unsupported.append(V2_UNSUPPORTED_FEATURE)
            return unsupported

        install(VllmConfig, "_get_v2_model_runner_unsupported_features",
                _get_v2_model_runner_unsupported_features, features)

    use_v2 = VllmConfig.use_v2_model_runner
    if already_wrapped(use_v2):
        return

    def use_v2_model_runner(self) -> bool:
        chosen = use_v2.fget(self)
        if chosen and is_selfspec_engine(self):
            from vllm_selfspec.errors import SelfSpecConfigError

            raise SelfSpecConfigError(
                "selfspec runs on vLLM's V1 model runner, but this engine is forced onto the V2 "
                "model runner (VLLM_USE_V2_MODEL_RUNNER=1, HiSparse attention or watermarking), "
                "where it would run as a second copy of the model that skips nothing; unset "
                "VLLM_USE_V2_MODEL_RUNNER (or set it to 0) and leave those features off"
            )
        return chosen

    install(VllmConfig, "use_v2_model_runner", property(use_v2_model_runner, doc=use_v2.__doc__),
            use_v2)
