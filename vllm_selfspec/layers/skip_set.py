"""The one skip-set type: which attention and MLP sub-layers a draft forward skips.

Used by the offline search (matchness, the Optuna study, profiles out of it) and by online layer
selection alike. Pure Python: importable without vLLM or torch.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple


class SkipSet(NamedTuple):
    """The sub-layers a draft skips: sorted, duplicate-free 0-based layer indices."""

    attention: tuple[int, ...] = ()
    mlp: tuple[int, ...] = ()

    @classmethod
    def of(cls, attention: Iterable[int] = (), mlp: Iterable[int] = ()) -> SkipSet:
        return cls(tuple(sorted({int(i) for i in attention})), tuple(sorted({int(i) for i in mlp})))

    @property
    def size(self) -> int:
        return len(self.attention) + len(self.mlp)

    def key(self) -> str:
        """A compact, stable text key, e.g. ``'a:3,5|m:7'``."""
        return f"a:{','.join(map(str, self.attention))}|m:{','.join(map(str, self.mlp))}"

    def describe(self) -> str:
        return f"attention {list(self.attention)}, MLP {list(self.mlp)}"
