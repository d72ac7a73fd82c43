"""vllm-selfspec: lossless self-speculative (layer-skip) decoding for vLLM.

The package is loaded by vLLM through the ``vllm.general_plugins`` entry point in every vLLM process
(front end, engine core, workers). :func:`register` must stay cheap: it imports vLLM lazily and only
installs the small, version-checked patches in :mod:`vllm_selfspec.plugin.patches`.
"""

__version__ = "0.1.0"


def register() -> None:
    """vLLM general-plugin entry point (idempotent)."""
    from vllm_selfspec.plugin.patches import apply_patches

    apply_patches()
