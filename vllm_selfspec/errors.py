"""Exceptions raised by vllm-selfspec for bad user input (configuration, profiles).

Both are :class:`ValueError` subclasses so callers that already handle ``ValueError`` (vLLM's
argument parsing does) report them as ordinary configuration errors.
"""

from __future__ import annotations

__all__ = ["ProfileError", "SelfSpecConfigError"]


class SelfSpecConfigError(ValueError):
    """The selfspec configuration is invalid; the message names the key, the value and what is
    allowed."""


class ProfileError(SelfSpecConfigError):
    """A skip profile cannot be found, parsed, validated, or does not fit the served model."""
