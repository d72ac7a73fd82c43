"""Test helpers: tiny random-weight models with a locally trained tokenizer (no hub needed), and
an OpenAI-server harness (:mod:`vllm_selfspec.testing.serve`)."""

from vllm_selfspec.testing.tiny_models import (
    TINY_ARCHS,
    build_tiny_model,
    build_tiny_tokenizer,
    tiny_cache_root,
    tiny_model_dir,
)

__all__ = [
    "TINY_ARCHS",
    "build_tiny_model",
    "build_tiny_tokenizer",
    "tiny_cache_root",
    "tiny_model_dir",
]
