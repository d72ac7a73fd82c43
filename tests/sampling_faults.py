"""Worker extension that injects draft-probability bugs into a running selfspec drafter.

Negative controls of the sampling tests: the rejection sampler keeps the output distribution
exactly the target's only when the draft probability it is handed is the distribution the draft
token was drawn from. Each fault breaks that in one specific way, patched onto the drafter
instance inside the worker (``llm.collective_rpc("sampling_fault_install", args=(kind,))``) and
removed again with ``sampling_fault_remove``; production code has no switch for them.

* ``"temperature"`` wraps the drafter's ``_sample_from_logits``: tokens drawn at another
  temperature than the request's (1.0 for a request below 1.0, a third of the request's from 1.0
  up, so that it bites at temperature 1.0 with top-k / top-p too), the probabilities handed on at
  the request's temperature and truncation.
* ``"lookup_probs"`` (``"drafts": "hybrid"``) hands the verifier, for a prompt-lookup draft in a
  step that also ran a layer-skip pass, the pass's draft probabilities at that row instead of the
  lookup's deterministic proposal (probability 1 on the looked-up token).

The extension also pins step costs (:class:`~tests.pinned_costs.PinnedCostsExtension`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from tests.pinned_costs import PinnedCostsExtension

_PATCHED = ("_sample_from_logits", "take_last_draft_probs")


class SamplingFaultExtension(PinnedCostsExtension):
    def _sampling_fault_drafter(self) -> Any:
        from vllm_selfspec.drafting.device_drafter import SelfSpecDeviceProposer

        drafter = getattr(self.model_runner, "drafter", None)
        assert isinstance(drafter, SelfSpecDeviceProposer), type(drafter)
        return drafter

    def sampling_fault_install(self, kind: str) -> bool:
        drafter = self._sampling_fault_drafter()
        self.sampling_fault_remove()
        drafter._fault_hits = 0  # sampled draft rows whose probabilities the fault replaced
        if kind == "lookup_probs":
            _install_lookup_probs_fault(drafter)
        elif kind == "temperature":
            _install_temperature_fault(drafter)
        else:
            raise ValueError(f"unknown fault {kind!r}")
        return True

    def sampling_fault_remove(self) -> int:
        """Restores the drafter's own methods; returns how many draft rows the fault changed."""
        drafter = self._sampling_fault_drafter()
        for name in _PATCHED:
            drafter.__dict__.pop(name, None)
        return int(drafter.__dict__.pop("_fault_hits", 0))

    def pin_lookup_acceptance(self, value: float) -> bool:
        """Hybrid drafts: every request's lookup acceptance estimate reads ``value``, so that
        the source choice does not follow what the sampled text happens to repeat."""
        drafter = self._sampling_fault_drafter()
        assert drafter.lookup_acceptance is not None, "not a hybrid drafter"
        drafter.lookup_acceptance.acceptance = lambda req_id: value
        return True


def _install_temperature_fault(drafter: Any) -> None:
    original = drafter._sample_from_logits

    def sample_from_logits(logits, sampling_metadata):
        temperature = sampling_metadata.temperature
        if sampling_metadata.all_greedy or temperature is None:
            return original(logits, sampling_metadata)
        # Draw at another temperature, report the distribution at the request's. vLLM's draft
        # sampler divides the logits by the temperature in place: draw from a copy first.
        wrong = torch.where(temperature < 1.0, torch.ones_like(temperature), temperature / 3)
        wrong = torch.where(temperature > 0, wrong, temperature)  # greedy rows stay greedy
        at_wrong = dataclasses.replace(sampling_metadata, temperature=wrong)
        tokens, _ = original(logits.clone(), at_wrong)
        right, probs = original(logits, sampling_metadata)
        if probs is None:  # argmax drafts: nothing to break
            return right, probs
        drafter._fault_hits += int(tokens.shape[0])
        return tokens, probs

    drafter._sample_from_logits = sample_from_logits


def _install_lookup_probs_fault(drafter: Any) -> None:
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
