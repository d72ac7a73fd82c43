"""Matchness: the one interface by which a skip set is scored, whatever computes it.

Matchness (SWIFT's name) is the share of positions at which a draft with the skip set predicts
what the full model predicts, teacher-forced over tokens the full model produced; it estimates
the per-token acceptance of greedy speculative decoding with that draft. Two backends score it:

* offline, :class:`~vllm_selfspec.layers.search.matchness.HFMatchnessScorer`: a Hugging Face
  model over fixed reference continuations (``selfspec-profile search``);
* online, :class:`~vllm_selfspec.layers.online_scoring.WindowMatchness`: the served vLLM model
  over a window of the running requests' verified tokens, reading the paged KV cache.

The searches see only :class:`MatchnessScorer`. Pure Python: importable without vLLM or torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from vllm_selfspec.layers.skip_set import SkipSet


@dataclass
class MatchResult:
    """Matchness of one skip set: ``matches / positions``; ``hits`` per reference (or window
    row), per position, when asked for."""

    matchness: float
    matches: int
    positions: int
    hits: list[list[bool]] = field(default_factory=list, repr=False)


class MatchnessScorer(Protocol):
    """Scores skip sets over a fixed set of positions (``positions`` of them)."""

    positions: int

    def score(self, skip: SkipSet, keep_hits: bool = False) -> MatchResult: ...
