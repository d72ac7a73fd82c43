"""What every patch module shares: one way to install a wrapper, once."""

from __future__ import annotations

from typing import Any

SENTINEL = "_vllm_selfspec_patched"
"""Set on every wrapper: a second installation finds it and does nothing."""


def already_wrapped(original: Any) -> bool:
    """Whether ``original`` (a function, or a property whose getter is checked) is ours."""
    target = original.fget if isinstance(original, property) else original
    return bool(getattr(target, SENTINEL, False))


def install(owner: Any, name: str, wrapper: Any, original: Any) -> None:
    """Set ``owner.name`` to ``wrapper`` (a function, or a property whose getter is marked),
    marked with :data:`SENTINEL` and with ``__wrapped__`` pointing at the ``original`` it
    delegates to (for introspection, and for tests that unwrap it)."""
    target = wrapper.fget if isinstance(wrapper, property) else wrapper
    setattr(target, SENTINEL, True)
    target.__wrapped__ = original
    setattr(owner, name, wrapper)
