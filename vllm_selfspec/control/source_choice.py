"""Prompt-lookup drafts beside layer-skip drafts: which source drafts for a request this step.

A prompt-lookup draft (vLLM's ``ngram`` method: the tokens that followed the newest earlier
occurrence of the request's last n-gram) costs no forward at all, only its verification; a
layer-skip draft costs draft forwards too. With ``"drafts": "hybrid"`` the device drafter asks,
per request and step, whether the lookup draft it found pays better than the layer-skip budget
the draft-length controller planned, in expected tokens per unit of time (plain decoding steps):

    lookup:      max over j <= n of E(a_lookup, j) / v(j)   (the first j of the n found)
    layer skip:  E(a_skip, k) / (v(k) + k * r)      (1.0, plain decoding, when k == 0)

``E(a, k)`` is :func:`vllm_selfspec.control.controller.expected_tokens`, ``v(k)`` a step verifying
``k`` drafts per request and ``r`` one draft forward, both in plain steps of the batch (the
controller's measured costs). A lookup draft is taken when it pays at least as well as the
layer-skip plan and beats plain decoding by :data:`LOOKUP_MIN_GAIN` (5%: its cost is a
verification alone, whose estimate spreads less than a draft forward's; the controller asks 10%
of layer-skip drafts). A step in which every
drafting request takes its lookup draft runs no draft forward.

The rule above prices each request alone, as if every request of the batch verified as many
drafts; a step in which *any* request verifies drafts also leaves vLLM's plain path as a whole
(its rejection sampler runs over the batch: at temperature > 0 on a CPU, about as costly as a few
requests' drafts). :func:`lookups_that_pay_the_step` then keeps the lookups only while the step
as a whole gains: expected tokens of the batch over the measured cost of a step verifying that
many draft tokens per request (the cost table is keyed by exactly that), against the same step
without them.

Acceptance is measured per request and per source: :class:`LookupAcceptance` keeps the lookup
drafts' per-token acceptance as the controller keeps the layer-skip drafts' (discounted counts,
positions up to and including the first rejection count as tried), a new request starting from
the engine-wide lookup acceptance.

Pure Python: importable without vLLM or torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from vllm_selfspec.control.controller import best_speedup, expected_tokens
from vllm_selfspec.control.step_costs import quantise_x

DRAFT_SOURCES = ("layer_skip", "hybrid", "lookup")
"""``layer_skip``: drafts from the layer-skipping forward only (the default). ``lookup``: prompt
lookup only (no draft forward ever runs). ``hybrid``: per request and step, the better one."""
DEFAULT_DRAFTS = "layer_skip"
DEFAULT_PROMPT_LOOKUP_MIN = 2
DEFAULT_PROMPT_LOOKUP_MAX = 4
LOOKUP_MIN_GAIN = 0.05  # a lookup draft must beat plain decoding by this share (see above)


@dataclass
class _Counts:
    accepted: float
    tried: float


class LookupAcceptance:
    """Per-request and engine-wide per-token acceptance of prompt-lookup drafts."""

    def __init__(self, prior: float = 0.5, prior_weight: float = 2.0, decay: float = 0.9,
                 engine_decay: float = 0.99) -> None:
        self.prior, self.prior_weight = prior, prior_weight
        self.decay, self.engine_decay = decay, engine_decay
        self._requests: dict[str, _Counts] = {}
        self._engine = _Counts(prior * prior_weight, prior_weight)

    def engine_acceptance(self) -> float:
        return self._engine.accepted / self._engine.tried

    def acceptance(self, req_id: str) -> float:
        counts = self._requests.get(req_id)
        if counts is None:
            return self.engine_acceptance()
        return counts.accepted / counts.tried if counts.tried > 0 else 0.0

    def observe(self, req_id: str, drafted: int, accepted: int) -> None:
        """``accepted`` of ``drafted`` lookup drafts of ``req_id`` passed verification."""
        if drafted <= 0:
            return
        accepted = min(max(int(accepted), 0), int(drafted))
        tried = accepted + (1 if accepted < drafted else 0)
        counts = self._requests.get(req_id)
        if counts is None:
            a = self.engine_acceptance()
            counts = self._requests[req_id] = _Counts(a * self.prior_weight, self.prior_weight)
        counts.accepted = self.decay * counts.accepted + accepted
        counts.tried = self.decay * counts.tried + tried
        self._engine.accepted = self.engine_decay * self._engine.accepted + accepted
        self._engine.tried = self.engine_decay * self._engine.tried + tried

    def retain(self, active_req_ids: Iterable[str]) -> None:
        keep = set(active_req_ids)
        for req_id in [r for r in self._requests if r not in keep]:
            del self._requests[req_id]


def lookup_length(
    *,
    lookup_acceptance: float,
    lookup_len: int,
    skip_acceptance: float,
    skip_budget: int,
    verify_cost: Callable[[int], float],
    draft_cost: float,
    min_gain: float,
) -> int:
    """How many of the ``lookup_len`` lookup drafts to verify: the length ``j`` that maximises
    ``E(a_lookup, j) / v(j)`` (fewer drafts cost less verification where they rarely land), when
    that pays at least as well as the layer-skip budget and beats plain decoding by
    ``min_gain`` (see the module docstring); 0: draft by layer skipping (or not at all).
    ``verify_cost(k)`` and ``draft_cost`` in plain steps."""
    if lookup_len <= 0:
        return 0
    best_rate, best_len = best_speedup(
        lookup_acceptance, lookup_len, draft_cost=0.0, verify_cost=verify_cost, allow_zero=False
    )
    if skip_budget > 0:
        rate_skip = expected_tokens(skip_acceptance, skip_budget) / (
            verify_cost(skip_budget) + skip_budget * draft_cost
        )
    else:
        rate_skip = 1.0
    return best_len if best_rate >= rate_skip and best_rate > 1.0 + min_gain else 0


@dataclass(frozen=True)
class StepDrafts:
    """What a step drafts besides the lookups being weighed: ``tokens``, the expected tokens it
    gains over plain decoding (sum over requests of ``E - 1``); ``drafts``, the draft tokens it
    verifies; ``pass_len``, the layer-skip pass's length (draft forwards)."""

    tokens: float = 0.0
    drafts: int = 0
    pass_len: int = 0


def lookups_that_pay_the_step(
    *,
    batch_size: int,
    lookups: list[tuple[float, int]],
    others: StepDrafts,
    verify_cost: Callable[[float], float],
    draft_cost: float,
) -> int:
    """How many of ``lookups`` (``(expected tokens E, drafts j)`` per request, best first) the
    step keeps: the prefix that maximises the batch's expected tokens per unit of step time,
    ``(B + others.tokens + sum(E - 1)) / (v(x) + pass_len * r)`` with ``x`` the draft tokens per
    request of the whole step (:func:`~vllm_selfspec.control.step_costs.quantise_x`); 0 when
    no prefix beats the step without lookups. ``verify_cost(x)`` and ``draft_cost`` in plain
    steps of the batch."""
    b = max(int(batch_size), 1)
    forwards = others.pass_len * draft_cost

    def rate(gain: float, drafts: int) -> float:
        # priced as the cost table measured it: per request, in quarters, any drafting >= 1/4
        return (b + gain) / (verify_cost(quantise_x(drafts, b)) + forwards)

    best_rate, best_n = rate(others.tokens, others.drafts), 0
    gain, drafts = others.tokens, others.drafts
    for n, (expected, j) in enumerate(lookups, start=1):
        gain += expected - 1.0
        drafts += j
        r = rate(gain, drafts)
        if r > best_rate:
            best_rate, best_n = r, n
    return best_n
