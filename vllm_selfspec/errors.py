"""Exceptions raised by vllm-selfspec for bad user input (configuration, profiles).

Both are :class:`ValueError` subclasses so callers that already handle ``ValueError`` (vLLM's
argument parsing does) report them as ordinary configuration errors. The helpers below word the
messages the same way everywhere (the bad key, a close match, what is allowed).
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence

__all__ = [
    "ProfileError",
    "SelfSpecConfigError",
    "check_known_keys",
    "check_required_keys",
    "did_you_mean",
    "is_int",
]


class SelfSpecConfigError(ValueError):
    """The selfspec configuration is invalid; the message names the key, the value and what is
    allowed."""


class ProfileError(SelfSpecConfigError):
    """A skip profile cannot be found, parsed, validated, or does not fit the served model."""


def is_int(value: object) -> bool:
    """An integer that is not a bool (JSON ``true`` is not a layer index or a count)."""
    return isinstance(value, int) and not isinstance(value, bool)


def did_you_mean(word: object, choices: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``choices``, or an empty string."""
    if not isinstance(word, str):
        return ""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def check_known_keys(
    keys: Iterable[object],
    allowed: Sequence[str],
    where: str,
    error: type[ValueError] = SelfSpecConfigError,
) -> None:
    """Raise ``error`` naming the first key not in ``allowed``, a close match and the allowed
    keys (``where`` names the mapping: ``"selfspec settings"``, a profile's file...)."""
    for key in keys:
        if key not in allowed:
            raise error(
                f"{where}: unknown key {key!r}{did_you_mean(key, allowed)}; "
                f"allowed keys: {', '.join(allowed)}"
            )


def check_required_keys(
    keys: Iterable[object],
    required: Sequence[str],
    where: str,
    error: type[ValueError] = SelfSpecConfigError,
    note: str = "",
) -> None:
    """Raise ``error`` listing every key of ``required`` missing from ``keys`` (``note``: what
    follows the list, e.g. what the mapping needs)."""
    present = set(keys)
    missing = [k for k in required if k not in present]
    if missing:
        raise error(f"{where}: missing key(s) {', '.join(missing)}{note}")
