"""Offline layer-selection search for self-speculative decoding (``selfspec-profile``).

* :mod:`~vllm_selfspec.layers.search.matchness` -- teacher-forced matchness of a skip set on a
  Hugging Face model (the acceptance estimate), the offline backend of
  :class:`~vllm_selfspec.layers.matchness.MatchnessScorer`;
* :mod:`~vllm_selfspec.layers.search.cost` -- step-cost models and the estimated speedup;
* :mod:`~vllm_selfspec.layers.search.optimize` -- the Optuna study (seeds, probes, TPE/GP),
  resumable;
* :mod:`~vllm_selfspec.layers.search.output` / :mod:`~vllm_selfspec.layers.search.plot` -- profile
  and plot;
* :mod:`~vllm_selfspec.layers.search.confirm` -- end-to-end check with vLLM (the only vLLM import).

Nothing is imported eagerly: ``import vllm_selfspec.layers.search`` needs neither torch nor Optuna.
"""

from __future__ import annotations

from typing import Any

_EXPORTS = {  # name -> the module that defines it
    "SkipSet": "vllm_selfspec.layers.skip_set",
    "HFMatchnessScorer": "vllm_selfspec.layers.search.matchness",
    "MatchnessScorer": "vllm_selfspec.layers.matchness",
    "MatchResult": "vllm_selfspec.layers.matchness",
    "Reference": "vllm_selfspec.layers.search.matchness",
    "generate_references": "vllm_selfspec.layers.search.matchness",
    "load_model": "vllm_selfspec.layers.search.matchness",
    "simulate_chain_acceptance": "vllm_selfspec.layers.search.matchness",
    "LinearCostModel": "vllm_selfspec.layers.search.cost",
    "estimate_speedup": "vllm_selfspec.layers.search.cost",
    "SearchConfig": "vllm_selfspec.layers.search.optimize",
    "LayerSearch": "vllm_selfspec.layers.search.optimize",
    "SearchResult": "vllm_selfspec.layers.search.optimize",
    "ScoredSkipSet": "vllm_selfspec.layers.search.optimize",
    "make_profile": "vllm_selfspec.layers.search.output",
    "show_profile": "vllm_selfspec.layers.search.output",
    "validate_profile": "vllm_selfspec.layers.search.output",
    "plot_search": "vllm_selfspec.layers.search.plot",
    "confirm_candidates": "vllm_selfspec.layers.search.confirm",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'vllm_selfspec.layers.search' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
