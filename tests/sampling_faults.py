"""Worker extension that injects draft-probability bugs into a running selfspec drafter.

Negative controls of the sampling tests: the rejection sampler keeps the output distribution
exactly the target's only when the draft probability it is handed is the distribution the draft
token was drawn from. Each fault breaks that in one specific way, patched onto the drafter
instance inside the worker (``llm.collective_rpc("sampling_fault_install", args=(kind,))``) and
removed again with ``sampling_fault_remove``; production code has no switch for them.

* ``"temperature"``: drafts are drawn from ``softmax(logits)`` (the request's temperature
  forgotten when drawing), while the draft probabilities handed to the verifier are
  ``softmax(logits / T)`` at the request's temperature, as the drafter computes them.
* ``"full_model"``: drafts are drawn from the layer-skip model as usual, but the draft
  probabilities are the full model's distribution at the same position (all layers run on the
  drafted prefix), so every draft looks as likely to the verifier as to the target.

On the device drafter (``"drafter": "device"``, vLLM's draft sampler) the ``"temperature"`` fault
wraps its ``_sample_from_logits``: tokens drawn at temperature 1.0, the probabilities handed on at
the request's temperature (:class:`DeviceSamplingFaultExtension`, which also pins step costs).
Its ``"lookup_probs"`` fault (``"drafts": "hybrid"``) hands the verifier, for a prompt-lookup
draft in a step that also ran a layer-skip pass, the pass's draft probabilities at that row
instead of the lookup's deterministic proposal (probability 1 on the looked-up token).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from tests.pinned_costs import PinnedCostsExtension
from vllm_selfspec.plugin.worker_ext import SelfSpecWorkerExtension

_PATCHED = ("_pick_tokens", "_draft_forward", "_sample_from_logits", "take_last_draft_probs")


class SamplingFaultExtension(SelfSpecWorkerExtension):
    _drafter_kind = "host"

    def _sampling_fault_drafter(self) -> Any:
        if self._drafter_kind == "device":
            from vllm_selfspec.drafting.device_drafter import (
                SelfSpecDeviceProposer as drafter_class,
            )
        else:
            from vllm_selfspec.drafting.host_drafter import SelfSpecProposer as drafter_class

        drafter = getattr(self.model_runner, "drafter", None)
        assert isinstance(drafter, drafter_class), type(drafter)
        return drafter

    def sampling_fault_install(self, kind: str) -> bool:
        drafter = self._sampling_fault_drafter()
        self.sampling_fault_remove()
        drafter._fault_hits = 0  # sampled draft rows whose probabilities the fault replaced
        if kind == "lookup_probs" and self._drafter_kind == "device":
            _install_device_lookup_probs_fault(drafter)
        elif kind == "temperature" and self._drafter_kind == "device":
            _install_device_temperature_fault(drafter)
        elif kind == "temperature":
            _install_temperature_fault(drafter)
        elif kind == "full_model":
            _install_full_model_fault(drafter)
        else:
            raise ValueError(f"unknown fault {kind!r}")
        return True

    def sampling_fault_remove(self) -> int:
        """Restores the drafter's own methods; returns how many draft rows the fault changed."""
        drafter = self._sampling_fault_drafter()
        for name in _PATCHED:
            drafter.__dict__.pop(name, None)
        drafter.__dict__.pop("_fault_full_logits", None)
        return int(drafter.__dict__.pop("_fault_hits", 0))


def _sampled_rows(sample_mask: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(sample_mask).to(device).unsqueeze(1)


def _install_temperature_fault(drafter: Any) -> None:
    original = drafter._pick_tokens

    def pick_tokens(logits, temperatures, sample_mask, *truncation):
        right = original(logits, temperatures, sample_mask, *truncation)
        probs = right[2]
        if probs is None:  # no sampled row: nothing to break
            return right
        # Draw at temperature 1.0, report the distribution at the request's temperature.
        tokens, confidence, _ = original(logits, np.ones_like(temperatures), sample_mask,
                                         *truncation)
        drafter._fault_hits += int(sample_mask.sum())
        return tokens, confidence, probs

    drafter._pick_tokens = pick_tokens


def _install_full_model_fault(drafter: Any) -> None:
    original_forward = drafter._draft_forward
    original_pick = drafter._pick_tokens

    def draft_forward(rows, positions, tokens, step):
        draft_logits = original_forward(rows, positions, tokens, step)
        # The same position through every layer. It runs after the draft step, so its K/V (all
        # layers) is what the next draft and full steps read for this position; verification
        # overwrites these slots before any real full-model read, as for any draft write.
        skip_attention, skip_mlp = drafter.skip_attention, drafter.skip_mlp
        drafter.skip_attention, drafter.skip_mlp = frozenset(), frozenset()
        try:
            drafter._fault_full_logits = original_forward(rows, positions, tokens, step)
        finally:
            drafter.skip_attention, drafter.skip_mlp = skip_attention, skip_mlp
        return draft_logits

    def pick_tokens(logits, temperatures, sample_mask, *truncation):
        tokens, confidence, probs = original_pick(logits, temperatures, sample_mask, *truncation)
        if probs is not None:
            temps = torch.from_numpy(np.where(sample_mask, temperatures, 1.0)).to(probs.device)
            full = drafter._fault_full_logits.float() / temps.unsqueeze(-1)
            wrong = torch.softmax(full, dim=-1)
            probs = torch.where(_sampled_rows(sample_mask, probs.device), wrong, probs)
            drafter._fault_hits += int(sample_mask.sum())
        return tokens, confidence, probs

    drafter._draft_forward = draft_forward
    drafter._pick_tokens = pick_tokens


class DeviceSamplingFaultExtension(SamplingFaultExtension, PinnedCostsExtension):
    """The faults for the device drafter, and its step costs pinned (tests/pinned_costs.py)."""

    _drafter_kind = "device"

    def pin_lookup_acceptance(self, value: float) -> bool:
        """Hybrid drafts: every request's lookup acceptance estimate reads ``value``, so that
        the source choice does not follow what the sampled text happens to repeat."""
        drafter = self._sampling_fault_drafter()
        assert drafter.lookup_acceptance is not None, "not a hybrid drafter"
        drafter.lookup_acceptance.acceptance = lambda req_id: value
        return True


def _install_device_temperature_fault(drafter: Any) -> None:
    original = drafter._sample_from_logits

    def sample_from_logits(logits, sampling_metadata):
        if sampling_metadata.all_greedy or sampling_metadata.temperature is None:
            return original(logits, sampling_metadata)
        # Draw at temperature 1.0, report the distribution at the request's temperature. vLLM's
        # draft sampler divides the logits by the temperature in place: draw from a copy first.
        at_one = dataclasses.replace(
            sampling_metadata, temperature=torch.ones_like(sampling_metadata.temperature)
        )
        tokens, _ = original(logits.clone(), at_one)
        right, probs = original(logits, sampling_metadata)
        if probs is None:  # argmax drafts: nothing to break
            return right, probs
        drafter._fault_hits += int(tokens.shape[0])
        return tokens, probs

    drafter._sample_from_logits = sample_from_logits


def _install_device_lookup_probs_fault(drafter: Any) -> None:
    original = drafter.take_last_draft_probs

    def take_last_draft_probs():
        raw = drafter._last_draft_probs
        if raw is None or not drafter._lookups:
            return original()
        raw = raw.clone()
        right = original()  # lookup rows one-hot (and widened to the longest lookup draft)
        wrong = right.clone()
        wrong[:, : raw.shape[1]] = raw  # lookup rows: the pass's probabilities there
        drafter._fault_hits += len(drafter._lookups)
        return wrong

    drafter.take_last_draft_probs = take_last_draft_probs
