"""Every place where vllm-selfspec touches vLLM internals.

Each patch wraps and delegates to the vLLM original, says why it exists, is idempotent, and is
installed only when the installed vLLM lies in :data:`SUPPORTED_VLLM`. None of them changes the
behaviour of an engine that did not ask for ``"method": "selfspec"``.

1. ``EngineArgs.create_speculative_config``: the user contract is
   ``{"method": "selfspec", ...selfspec keys...}``. vLLM's ``SpeculativeConfig`` knows no such
   method and forbids unknown keys, so the wrapper validates the selfspec keys against the served
   model (clear errors at engine start), rewrites the method into vLLM's ``custom_class`` proposer
   hook pointing at :class:`vllm_selfspec.proposer.SelfSpecProposer`, and ships the resolved
   settings inside ``VllmConfig.additional_config["selfspec"]``: that object travels with the
   config to every worker (multiprocessing and Ray), and two engines in one process each carry
   their own.
2. ``VllmConfig.num_lookahead_tokens``: vLLM reserves lookahead KV slots only for EAGLE-style
   drafters. Our draft steps write K/V up to ``k`` positions past the verified tokens, so the
   scheduler must reserve ``k`` lookahead slots for us too.
3. ``rejection_sampler.expand_batch_to_tokens`` (vLLM CPU build without Triton only): the C++
   ``expand_kernel_impl`` fills an int64 *copy* of a float32/int32 output and the function returns
   uninitialised memory, so rejection sampling at temperature > 0 uses garbage temperatures /
   top-k / top-p for every speculative method. The wrapper computes the expansion with PyTorch for
   those dtypes and delegates otherwise.
4. ``GPUModelRunner._input_fits_in_drafter`` (per runner instance, selfspec runners only): vLLM
   switches drafting off for the *whole batch* as soon as one request is within ``k`` tokens of
   ``max_model_len``. Our proposer clips each request's draft length itself, so it keeps drafting
   for the others.
5. ``StatLoggerManager.__init__`` (front-end process only; installed by
   :func:`vllm_selfspec.metrics.install` when a selfspec config is built, or at plugin load when
   vLLM's metrics loggers are already imported): appends the plugin's own Prometheus logger
   (``vllm:selfspec_*`` metrics) to the stat loggers of selfspec engines only.
6. ``topk_topp_sampler.apply_top_k_only`` (vLLM without Triton only, i.e. the CPU build): with any
   speculative method vLLM runs every step through the rejection sampler, also steps in which no
   request has drafts; the target logits are then ``[0, vocab]`` and, for a batch with a top-k-only
   request (``top_k`` set, ``top_p`` not), ``k.max()`` of the empty ``k`` raises and kills the
   engine core (one ``"top_k": 1`` request takes the whole server down). The wrapper returns the
   empty logits unchanged and delegates otherwise.
"""

from __future__ import annotations

import logging
import os
from typing import Any

logger = logging.getLogger("vllm.selfspec.patches")

SUPPORTED_VLLM = (">=0.32", "<0.34")
METHOD_NAME = "selfspec"
PROPOSER_PATH = "vllm_selfspec.proposer.SelfSpecProposer"
ADDITIONAL_CONFIG_KEY = "selfspec"

_SENTINEL = "_vllm_selfspec_patched"
# Test-only switch: leave vLLM's lookahead at 0 to show that the drafter's KV-bounds check fires.
_TEST_DISABLE_LOOKAHEAD = "VLLM_SELFSPEC_TEST_DISABLE_LOOKAHEAD"
_applied = False


def vllm_version() -> str:
    import vllm

    return getattr(vllm, "__version__", "0")


def check_vllm_version(version: str | None = None) -> str | None:
    """Return None when ``version`` is supported, else a message saying what is supported."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    version = version or vllm_version()
    spec = SpecifierSet(",".join(SUPPORTED_VLLM))
    try:
        parsed = Version(version)
    except InvalidVersion:
        return f"vllm-selfspec cannot parse the installed vLLM version {version!r}"
    # Treat dev/rc builds of a supported release as that release.
    if Version(parsed.base_version) in spec:
        return None
    return (
        f"vllm-selfspec supports vLLM {','.join(SUPPORTED_VLLM)}, but vLLM {version} is installed; "
        "install a supported vLLM (CPU: pip install 'vllm-selfspec[cpu]', "
        "GPU: pip install 'vllm-selfspec[cuda]')"
    )


def is_selfspec_config(speculative_config: Any) -> bool:
    """True for a vLLM ``SpeculativeConfig`` that runs our proposer."""
    return (
        speculative_config is not None
        and getattr(speculative_config, "method", None) == "custom_class"
        and getattr(speculative_config, "model", None) == PROPOSER_PATH
    )


def apply_patches() -> None:
    """Install every global patch once per process (called from the plugin entry point)."""
    global _applied
    if _applied:
        return
    _applied = True
    problem = check_vllm_version()
    if problem is not None:
        # Engines that do not ask for selfspec must keep working: only the alias patch is installed,
        # and it refuses "selfspec" with this message.
        logger.warning("%s; the selfspec method is disabled.", problem)
        _patch_create_speculative_config(unsupported=problem)
        return
    _patch_create_speculative_config()
    if os.environ.get(_TEST_DISABLE_LOOKAHEAD) != "1":
        _patch_num_lookahead_tokens()
    _patch_cpu_expand_batch_to_tokens()
    _patch_cpu_empty_top_k_only()
    _install_metrics(only_if_imported=True)


# --- 1. the "selfspec" method alias -------------------------------------------------------------


def _patch_create_speculative_config(unsupported: str | None = None) -> None:
    from vllm.engine.arg_utils import EngineArgs

    original = EngineArgs.create_speculative_config
    if getattr(original, _SENTINEL, False):
        return

    def create_speculative_config(self, target_model_config, target_parallel_config):
        spec = self.speculative_config
        if isinstance(spec, dict) and spec.get("method") == METHOD_NAME:
            if unsupported is not None:
                from vllm_selfspec.errors import SelfSpecConfigError

                raise SelfSpecConfigError(unsupported)
            from vllm_selfspec.engine_config import rewrite_selfspec_request

            self.speculative_config, settings = rewrite_selfspec_request(
                spec, self, target_model_config, target_parallel_config
            )
            additional = dict(self.additional_config or {})
            additional[ADDITIONAL_CONFIG_KEY] = settings
            self.additional_config = additional
            _install_metrics()
        return original(self, target_model_config, target_parallel_config)

    setattr(create_speculative_config, _SENTINEL, True)
    create_speculative_config.__wrapped__ = original  # type: ignore[attr-defined]
    EngineArgs.create_speculative_config = create_speculative_config


# --- 2. lookahead KV slots --------------------------------------------------------------------


def _patch_num_lookahead_tokens() -> None:
    from vllm.config import VllmConfig

    original = VllmConfig.num_lookahead_tokens
    if getattr(original.fget, _SENTINEL, False):
        return

    def num_lookahead_tokens(self) -> int:
        if is_selfspec_config(self.speculative_config):
            return self.speculative_config.num_speculative_tokens
        return original.fget(self)

    setattr(num_lookahead_tokens, _SENTINEL, True)
    VllmConfig.num_lookahead_tokens = property(num_lookahead_tokens, doc=original.__doc__)


# --- 3. CPU rejection-sampler bug -------------------------------------------------------------


def cpu_expand_bug_present() -> bool:
    """True where vLLM expands sampling parameters with the broken C++ op (CPU, no Triton)."""
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON

    return current_platform.is_cpu() and not HAS_TRITON


def _patch_cpu_expand_batch_to_tokens() -> None:
    if not cpu_expand_bug_present():
        return
    import torch
    import vllm.v1.sample.rejection_sampler as rejection_sampler

    original = rejection_sampler.expand_batch_to_tokens
    if getattr(original, _SENTINEL, False):
        return

    def expand_batch_to_tokens(x, cu_num_tokens, num_tokens, replace_from=0, replace_to=0):
        if x.dtype == torch.int64:  # the C++ op fills int64 outputs in place: correct as it is
            return original(x, cu_num_tokens, num_tokens, replace_from, replace_to)
        counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
        out = torch.repeat_interleave(x, counts, output_size=num_tokens)
        if replace_from != replace_to:
            out = out.masked_fill(out == replace_from, replace_to)
        return out

    setattr(expand_batch_to_tokens, _SENTINEL, True)
    expand_batch_to_tokens.__wrapped__ = original  # type: ignore[attr-defined]
    rejection_sampler.expand_batch_to_tokens = expand_batch_to_tokens


# --- 4. per-runner: do not switch drafting off for the whole batch ----------------------------


def patch_runner_input_fits_in_drafter(runner: Any) -> None:
    """Instance patch on one selfspec model runner (never on the class)."""
    original = runner._input_fits_in_drafter
    if getattr(original, _SENTINEL, False):
        return

    def _input_fits_in_drafter(common_attn_metadata):
        # The proposer clips every request to max_model_len itself; only "no metadata" means
        # there is nothing to draft for.
        return common_attn_metadata is not None

    setattr(_input_fits_in_drafter, _SENTINEL, True)
    _input_fits_in_drafter.__wrapped__ = original  # type: ignore[attr-defined]
    runner._input_fits_in_drafter = _input_fits_in_drafter


# --- 5. the plugin's own metrics (front end) --------------------------------------------------


def _install_metrics(only_if_imported: bool = False) -> None:
    """Lazy on purpose: importing vLLM's metrics loggers costs about a second, and only front ends
    that build a selfspec engine (or imported them already) need the wrapper."""
    import sys

    if only_if_imported and "vllm.v1.metrics.loggers" not in sys.modules:
        return
    try:
        from vllm_selfspec.metrics import install
    except ImportError as exc:  # pragma: no cover - a vLLM without that module
        logger.warning("selfspec metrics unavailable: %s", exc)
        return
    install()


# --- 6. CPU top-k-only on an empty batch of draft tokens ----------------------------------------


def _patch_cpu_empty_top_k_only() -> None:
    from vllm.triton_utils import HAS_TRITON

    if HAS_TRITON:  # the Triton top-k/top-p kernel is used instead
        return
    import vllm.v1.sample.ops.topk_topp_sampler as topk_topp_sampler

    original = topk_topp_sampler.apply_top_k_only
    if getattr(original, _SENTINEL, False):
        return

    def apply_top_k_only(logits, k):
        if k.numel() == 0:  # no rows (a step without draft tokens): nothing to mask
            return logits
        return original(logits, k)

    setattr(apply_top_k_only, _SENTINEL, True)
    apply_top_k_only.__wrapped__ = original  # type: ignore[attr-defined]
    topk_topp_sampler.apply_top_k_only = apply_top_k_only
