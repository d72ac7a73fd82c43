"""Which compiled draft models the drafter may run: one per skip set, with the platform's rule.

A compiled draft model bakes its skip set into the graph, so online layer selection keeps one per
set it settles on. On CPU (inductor, no graph capture) a model built at any time is safe to run.
With CUDA graphs, vLLM captures the drafter's graphs once, at start-up, for the model that is
active then; a compiled model first run later would try to capture inside a serving step, which
vLLM refuses ("CUDA graph capturing detected at an inappropriate time"). So off CPU only the
models built during start-up are run, and a set settled on later drafts on the eager explorer.

Pure Python (the models are built by a callable): unit-testable without vLLM or torch.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

M = TypeVar("M")


class DraftModelCache(Generic[M]):
    """Draft models by skip set. ``build(key)`` makes one; ``compile_after_start``: whether a
    model built after :meth:`end_start_up` may run (True on CPU only)."""

    def __init__(self, build: Callable[[Hashable], M], *, compile_after_start: bool) -> None:
        self._build = build
        self.compile_after_start = compile_after_start
        self._models: dict[Hashable, M] = {}
        self._started = False

    def __len__(self) -> int:
        return len(self._models)

    def start_up_model(self, key: Hashable) -> M:
        """The model of ``key``, built now if new: only before :meth:`end_start_up`."""
        if self._started:
            raise RuntimeError("start_up_model() after end_start_up(): use settled_model()")
        return self._get_or_build(key)

    def end_start_up(self) -> None:
        """Start-up (and, on CUDA, graph capture of the model active then) is over."""
        self._started = True

    def cached(self, key: Hashable) -> M | None:
        """A model built already for ``key``, or None."""
        return self._models.get(key)

    def settled_model(self, key: Hashable) -> M | None:
        """The compiled model for a set the search settled on: the cached one, else one built now
        where the platform allows it, else None (the caller drafts eagerly)."""
        model = self._models.get(key)
        if model is None and (self.compile_after_start or not self._started):
            model = self._get_or_build(key)
        return model

    def _get_or_build(self, key: Hashable) -> M:
        model = self._models.get(key)
        if model is None:
            model = self._models[key] = self._build(key)
        return model
