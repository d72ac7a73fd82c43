"""Offline layer-selection search for self-speculative decoding (``selfspec-profile``).

* :mod:`~vllm_selfspec.layers.search.matchness` -- teacher-forced matchness of a skip set on a
  Hugging Face model (the acceptance estimate; reusable by an on-the-fly search);
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

_EXPORTS = {
    "SkipSet": "skip_set",
    "MatchnessScorer": "matchness",
    "Reference": "matchness",
    "generate_references": "matchness",
    "load_model": "matchness",
    "simulate_chain_acceptance": "matchness",
    "LinearCostModel": "cost",
    "estimate_speedup": "cost",
    "SearchConfig": "optimize",
    "LayerSearch": "optimize",
    "SearchResult": "optimize",
    "ScoredSkipSet": "optimize",
    "make_profile": "output",
    "show_profile": "output",
    "validate_profile": "output",
    "plot_search": "plot",
    "confirm_candidates": "confirm",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'vllm_selfspec.layers.search' has no attribute {name!r}")
    import importlib

    package = "vllm_selfspec.layers" if module == "skip_set" else "vllm_selfspec.layers.search"
    return getattr(importlib.import_module(f"{package}.{module}"), name)
