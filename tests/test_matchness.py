"""The matchness interface and its online backend's arithmetic (fake forward: no vLLM engine)."""

from __future__ import annotations

import numpy as np
import torch

from vllm_selfspec.layers.matchness import MatchnessScorer, MatchResult
from vllm_selfspec.layers.online_scoring import WindowMatchness
from vllm_selfspec.layers.skip_set import SkipSet


def _window() -> dict[str, np.ndarray]:
    # two rows: 3 positions and 2 positions; emitted tokens 1 1 1 | 2 2
    return {
        "rows": np.array([0, 1]),
        "lengths": np.array([3, 2]),
        "positions": np.array([5, 6, 7, 3, 4]),
        "inputs": np.zeros(5, dtype=np.int64),
        "targets": np.array([1, 1, 1, 2, 2]),
    }


def _fake_run(predictions: dict[SkipSet, list[int]]):
    """A forward whose argmax per window position is ``predictions[skip set]``."""

    def run(**kw):
        skip = SkipSet.of(kw["skip_attention"], kw["skip_mlp"])
        assert kw["write_kv"] is False  # scoring never writes the cache
        return torch.nn.functional.one_hot(torch.tensor(predictions[skip]), 4).float()

    return run


def test_window_matchness_scores_against_the_reference_pass() -> None:
    full, cand = SkipSet(), SkipSet.of([1], [2])
    # the reference (nothing skipped) disagrees with one emitted token: a diagnostic only
    run = _fake_run({full: [1, 1, 3, 2, 2], cand: [1, 0, 3, 2, 0]})
    scorer: MatchnessScorer = WindowMatchness(run, _window(), torch.device("cpu"))
    assert scorer.positions == 5 and scorer.reference_hits == 4
    result = scorer.score(cand, keep_hits=True)
    assert isinstance(result, MatchResult)
    assert (result.matches, result.positions) == (3, 5) and result.matchness == 0.6
    assert result.hits == [[True, False, True], [True, False]]  # per window row
    assert scorer.score(full).matchness == 1.0 and scorer.score(full).hits == []
