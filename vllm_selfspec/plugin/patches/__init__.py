"""Every place where vllm-selfspec patches vLLM internals, one module per vLLM area.

Each patch wraps and delegates to the vLLM original, says why it exists, is idempotent, and is
installed only when the installed vLLM lies in :data:`SUPPORTED_VLLM`. None of them changes the
behaviour of an engine that did not ask for ``"method": "selfspec"``.

* :mod:`.speculative_config` (``EngineArgs``, ``VllmConfig``): 1. the ``selfspec`` method
  alias; 2. the V1 model runner for selfspec engines.
* :mod:`.cpu_sampler` (samplers of the CPU build): 3. ``expand_batch_to_tokens``; 6. top-k-only
  sampling on an empty batch of draft tokens; 11. cheap recovered-token noise for selfspec
  runners' rejection sampling.
* :mod:`.front_end` (front-end process): 5. the plugin's metrics (and the pull of the per-source
  draft counters from the workers); 7. per-request overrides refused when the request arrives.
* :mod:`.model_runner` (``GPUModelRunner``, worker processes): 4. drafting kept per request, CPU
  generators of discarded rows; 8. the device drafter built in place of vLLM's draft-model
  proposer; 9. plain sampling on steps without drafts; 10. the workers' per-source draft
  counters, readable by ``collective_rpc``.
"""

from __future__ import annotations

import logging

from vllm_selfspec.plugin.patches.cpu_sampler import (
    _patch_cpu_empty_top_k_only,
    _patch_cpu_expand_batch_to_tokens,
    _patch_cpu_recovered_token_noise,
)
from vllm_selfspec.plugin.patches.front_end import install_metrics, install_request_validation
from vllm_selfspec.plugin.patches.model_runner import install_device_drafter
from vllm_selfspec.plugin.patches.speculative_config import (
    _patch_create_speculative_config,
    _patch_v1_model_runner,
)

logger = logging.getLogger("vllm.selfspec.patches")

SUPPORTED_VLLM = (">=0.32", "<0.34")

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
    _patch_v1_model_runner()
    _patch_cpu_expand_batch_to_tokens()
    _patch_cpu_empty_top_k_only()
    _patch_cpu_recovered_token_noise()
    install_metrics(only_if_imported=True)
    install_request_validation(only_if_imported=True)
    install_device_drafter()
