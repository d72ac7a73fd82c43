"""Prompt-lookup drafts beside layer-skip drafts: which source drafts for a request this step.

A prompt-lookup draft (vLLM's ``ngram`` method: the tokens that followed the newest earlier
occurrence of the request's last n-gram) costs no forward at all, only its verification; a
layer-skip draft costs draft forwards too. With ``"drafts": "hybrid"`` the device drafter decides,
per step, which requests draft by lookup and how many of their lookup tokens are verified, in
expected tokens per unit of time (plain decoding steps of the batch, the controller's measured
costs):

* Each request's lookup draft is cut to the length ``j`` that pays best priced as if every
  request of the batch verified as many (a bound on its cost whatever the rest of the batch
  does), and taken when that pays at least as well as the layer-skip budget ``k`` the
  draft-length controller planned,
  ``max over j <= n of E_lookup(j) / v(j) >= E(a_skip, k) / (v(k) + k * r)`` (1.0, plain
  decoding, when ``k == 0``), and beats plain decoding by :data:`LOOKUP_MIN_GAIN`
  (:func:`lookup_length`). ``v(k)`` is a step verifying ``k`` drafts per request, ``r`` one draft
  forward. A request with a budget drafts either way: its lookup replaces the budget.
* The lookups of requests that would not draft otherwise are then weighed for the step as a whole
  (:func:`lookup_lengths_for_the_step`): a step in which *any* request verifies drafts leaves
  vLLM's plain path for the whole batch (its rejection sampler runs over the batch: at
  temperature > 0 on a CPU, about as costly as a few requests' drafts), so a lone lookup among
  32 requests pays that whole fixed cost. Their draft tokens are taken best first while the
  batch's expected tokens per unit of step time grow, priced at the measured cost of a step
  verifying that many draft tokens per request (the cost table is keyed by exactly that), and
  kept when the step beats the same step without them by :data:`LOOKUP_MIN_GAIN` (5%: a lookup's
  cost is a verification alone, whose estimate spreads less than a draft forward's; the
  controller asks 10% of layer-skip drafts). The margin is the step's: the noise it guards
  against, that of the measured step costs, is shared by every request of the step.

A step in which every drafting request takes its lookup draft runs no draft forward.

Acceptance is measured per request and per source. :class:`LookupAcceptance` keeps lookup
acceptance by position (first token per request, the ones after it given the ones before for the
engine): lookup drafts land as runs, which a per-token acceptance (the layer-skip drafts' model,
:func:`vllm_selfspec.control.controller.expected_tokens`) would underprice.

Pure Python: importable without vLLM or torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from vllm_selfspec.control.controller import DraftLengthController, expected_tokens
from vllm_selfspec.control.step_costs import quantise_x

DRAFT_SOURCES = ("layer_skip", "hybrid", "lookup")
"""``layer_skip``: drafts from the layer-skipping forward only. ``lookup``: prompt lookup only (no
draft forward ever runs). ``hybrid`` (the default): per request and step, the better one."""
DEFAULT_DRAFTS = "hybrid"
DEFAULT_PROMPT_LOOKUP_MIN = 2
DEFAULT_PROMPT_LOOKUP_MAX = 4
LOOKUP_MIN_GAIN = 0.05  # a lookup draft must beat plain decoding by this share (see above)


@dataclass
class _Counts:
    accepted: float
    tried: float

    def add(self, landed: bool, decay: float) -> None:
        self.accepted = decay * self.accepted + (1.0 if landed else 0.0)
        self.tried = decay * self.tried + 1.0

    def rate(self) -> float:
        return self.accepted / self.tried if self.tried > 0 else 0.0


class LookupAcceptance:
    """Acceptance of prompt-lookup drafts, by position.

    A lookup draft is a run of repeated text: where its first token lands, the tokens after it
    usually land too (SmolLM2 on HumanEval at T = 0.7, vLLM's ``ngram``, one run at batch 8: 68%
    of first tokens landed, then 95%, 89% and 84% of the next ones given the ones before). A
    per-token acceptance (the geometric model of layer-skip drafts) fitted to those drafts is
    0.82: it overstates the first token (0.82 against 0.68) and understates the run after it,
    so it favours short lookups. So:

    * the first draft token's acceptance is kept per request (discounted counts, ``decay``; a new
      request starts from the engine's, weighted ``prior_weight``);
    * the acceptance of position ``i >= 2`` given that positions ``1 .. i-1`` landed is kept for
      the engine (``engine_decay``), from ``continuation_prior``.

    The probability that the first ``i`` tokens land is the first token's acceptance times the
    continuations up to ``i``; the expected tokens of a step verifying ``j`` of them are one plus
    the sum of those probabilities."""

    def __init__(self, prior: float = 0.5, prior_weight: float = 2.0, decay: float = 0.9,
                 engine_decay: float = 0.99, continuation_prior: float = 0.7) -> None:
        self.prior, self.prior_weight = prior, prior_weight
        self.decay, self.engine_decay = decay, engine_decay
        self.continuation_prior = continuation_prior
        self._requests: dict[str, _Counts] = {}
        self._engine = _Counts(prior * prior_weight, prior_weight)
        self._continuations: list[_Counts] = []  # positions 2, 3, ...

    def engine_acceptance(self) -> float:
        """The first draft token's acceptance over the engine's recent lookups."""
        return self._engine.rate()

    def acceptance(self, req_id: str) -> float:
        """The first draft token's acceptance for ``req_id``."""
        counts = self._requests.get(req_id)
        return self.engine_acceptance() if counts is None else counts.rate()

    def continuation(self, position: int) -> float:
        """The acceptance of draft position ``position`` (2, 3, ...) given that the ones before
        it landed."""
        i = position - 2
        if i < 0:
            raise ValueError("continuations start at position 2")
        if i < len(self._continuations):
            return self._continuations[i].rate()
        return self.continuation_prior

    def landing(self, req_id: str, n: int) -> list[float]:
        """For ``i = 1 .. n``: the probability that the first ``i`` lookup drafts of ``req_id``
        land (non-increasing)."""
        out: list[float] = []
        p = self.acceptance(req_id)
        for i in range(1, n + 1):
            if i > 1:
                p *= self.continuation(i)
            out.append(p)
        return out

    def expected(self, req_id: str, n: int) -> float:
        """Tokens a step yields for ``req_id`` verifying ``n`` lookup drafts (bonus included)."""
        return 1.0 + sum(self.landing(req_id, n))

    def observe(self, req_id: str, drafted: int, accepted: int) -> None:
        """``accepted`` of ``drafted`` lookup drafts of ``req_id`` passed verification."""
        if drafted <= 0:
            return
        accepted = min(max(int(accepted), 0), int(drafted))
        counts = self._requests.get(req_id)
        if counts is None:
            a = self.engine_acceptance()
            counts = self._requests[req_id] = _Counts(a * self.prior_weight, self.prior_weight)
        counts.add(accepted >= 1, self.decay)
        self._engine.add(accepted >= 1, self.engine_decay)
        # position i was tried when the i - 1 before it landed
        for position in range(2, min(int(drafted), accepted + 1) + 1):
            i = position - 2
            while len(self._continuations) <= i:
                w = self.prior_weight
                self._continuations.append(_Counts(self.continuation_prior * w, w))
            self._continuations[i].add(accepted >= position, self.engine_decay)

    def retain(self, active_req_ids: Iterable[str]) -> None:
        keep = set(active_req_ids)
        for req_id in [r for r in self._requests if r not in keep]:
            del self._requests[req_id]


def lookup_length(
    *,
    lookup_landing: Sequence[float],
    skip_acceptance: float,
    skip_budget: int,
    verify_cost: Callable[[int], float],
    draft_cost: float,
    min_gain: float,
) -> int:
    """How many of a request's lookup drafts to verify (in place of its layer-skip budget, if
    any). ``lookup_landing[i - 1]`` is the probability that its first ``i`` lookup drafts land
    (:meth:`LookupAcceptance.landing`), so verifying the first ``j`` yields
    ``E(j) = 1 + sum(lookup_landing[:j])`` tokens: the length ``j`` that maximises
    ``E(j) / v(j)``, when that pays at least as well as the layer-skip budget (plain decoding
    without one) and beats plain decoding by ``min_gain`` (see the module docstring); 0: draft
    by layer skipping (or not at all). ``verify_cost(k)`` and ``draft_cost`` in plain steps."""
    best_rate, best_len = 0.0, 0
    expected = 1.0
    for j, p in enumerate(lookup_landing, start=1):
        expected += p
        rate = expected / verify_cost(j)
        if rate > best_rate * (1.0 + 1e-12):  # ties go to the shorter draft
            best_rate, best_len = rate, j
    if best_len == 0:
        return 0
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


def lookup_lengths_for_the_step(
    *,
    batch_size: int,
    lookups: list[list[float]],
    others: StepDrafts,
    verify_cost: Callable[[float], float],
    draft_cost: float,
    min_gain: float,
) -> list[int]:
    """How many draft tokens of each lookup the step verifies. ``lookups`` holds, per request
    that would not draft otherwise, the probability that its first ``i`` lookup drafts land
    (:meth:`LookupAcceptance.landing`, non-increasing in ``i``); each draft token adds that much
    to the batch's expected tokens. Draft tokens are taken best first (a request's in order),
    keeping the prefix that maximises the batch's expected tokens per unit of step time,
    ``(B + others.tokens + sum of the probabilities taken) / (v(x) + pass_len * r)`` with ``x``
    the draft tokens per request of the whole step
    (:func:`~vllm_selfspec.control.step_costs.quantise_x`), when that beats the step without
    them by ``min_gain`` (or costs no more by the table); else none. The margin is the step's,
    not each lookup's: what it guards against is the noise of the measured step costs, which
    every request of the step shares.
    ``verify_cost(x)`` and ``draft_cost`` in plain steps of the batch."""
    b = max(int(batch_size), 1)
    forwards = others.pass_len * draft_cost

    def cost(drafts: int) -> float:
        # priced as the cost table measured it: per request, in quarters, any drafting >= 1/4
        return verify_cost(quantise_x(drafts, b)) + forwards

    # best first; the sort is stable, so a request's tokens keep their order where they tie
    tokens = sorted(
        ((p, row) for row, probs in enumerate(lookups) for p in probs), key=lambda t: -t[0]
    )
    base_cost = cost(others.drafts)
    base = (b + others.tokens) / base_cost
    best_rate, best_n = base, 0
    gain, drafts = others.tokens, others.drafts
    for n, (p, _) in enumerate(tokens, start=1):
        gain += p
        drafts += 1
        c = cost(drafts)
        r = (b + gain) / c
        # tokens the table prices at nothing more need no margin
        if r > best_rate and (r > base * (1.0 + min_gain) or c == base_cost):
            best_rate, best_n = r, n
    lengths = [0] * len(lookups)
    for _, row in tokens[:best_n]:
        lengths[row] += 1
    return lengths


@dataclass
class LookupChoice:
    """A step's lookup drafts by request, and how many lookups that paid alone were declined
    because they did not pay for the step's switch to verification."""

    drafts: dict[str, list[int]]
    declined: int = 0


def choose_lookups(
    controller: DraftLengthController,
    acceptance: LookupAcceptance,
    *,
    hybrid: bool,
    req_ids: Sequence[str],
    budgets: Sequence[int],
    found: Mapping[str, list[int]],
    k_limit: int,
) -> LookupChoice:
    """The requests that draft by prompt lookup this step, with their drafts.

    ``hybrid`` False (``"drafts": "lookup"``): every request with a lookup draft, cut to its cap.
    Hybrid: each request's lookup draft cut to the length that pays best priced as if every
    request of the batch verified as many (:func:`lookup_length`: against the layer-skip budget
    ``budgets`` planned, or plain decoding), a bound whatever the rest of the batch does; then the
    lookups of requests without a budget are weighed for the step as a whole
    (:func:`lookup_lengths_for_the_step`). None on the controller's plain-step measurements."""
    if not found or controller.explored_last_plan:
        return LookupChoice({})
    batch = len(req_ids)
    draft_cost = controller.cost_ratio(batch) if hybrid else 0.0
    verify = (
        [controller.verify_cost_ratio(batch, k) for k in range(controller.config.k_max + 1)]
        if hybrid
        else []
    )
    chosen: dict[str, list[int]] = {}
    landing: dict[str, list[float]] = {}  # hybrid: each chosen lookup's landing probabilities
    for req_id, budget in zip(req_ids, budgets, strict=True):
        tokens = found.get(req_id)
        cap = min(controller.request_cap(req_id), k_limit, controller.config.k_max)
        if not tokens or cap <= 0:
            continue
        tokens = tokens[:cap]
        if hybrid:
            probs = acceptance.landing(req_id, len(tokens))
            n = lookup_length(
                lookup_landing=probs,
                skip_acceptance=controller.request_acceptance(req_id),
                skip_budget=budget,
                verify_cost=verify.__getitem__,
                draft_cost=draft_cost,
                min_gain=LOOKUP_MIN_GAIN,
            )
            tokens, landing[req_id] = tokens[:n], probs[:n]
        if tokens:
            chosen[req_id] = tokens
    if not (hybrid and chosen):
        return LookupChoice(chosen)
    return _lookups_paying_the_step(controller, req_ids, budgets, chosen, landing, draft_cost)


def verify_price(controller: DraftLengthController, batch: int, x: float) -> float:
    """A step verifying ``x`` draft tokens per request, in plain steps; beyond the controller's
    ramp (:meth:`~vllm_selfspec.control.controller.DraftLengthController.draft_limit`) infinite,
    so that the lookups weighed for the step are bounded as layer-skip plans are. The bound is on
    the step's draft tokens per request, not on each lookup: where few requests find a lookup,
    the step's ``x`` (and so the ramp) stays small, and a per-lookup cap of the ramp's 1 token
    would never have grown."""
    if x > controller.draft_limit(batch) + 1e-9:
        return math.inf
    return controller.verify_cost_ratio(batch, x)


def _lookups_paying_the_step(
    controller: DraftLengthController,
    req_ids: Sequence[str],
    budgets: Sequence[int],
    chosen: dict[str, list[int]],
    landing: dict[str, list[float]],
    draft_cost: float,
) -> LookupChoice:
    """The chosen lookups cut to what pays for the step as a whole
    (:func:`lookup_lengths_for_the_step`). A lookup taken in place of a layer-skip budget stays
    (that request drafts either way); the lookups of requests that would otherwise not draft are
    weighed token by token. ``landing``: each chosen lookup's landing probabilities, one per
    draft token."""
    others = StepDrafts()
    weighed: list[str] = []
    for req_id, budget in zip(req_ids, budgets, strict=True):
        tokens = chosen.get(req_id)
        if tokens is not None:
            if budget <= 0:
                weighed.append(req_id)
                continue
            expected = 1.0 + sum(landing[req_id])
            drafts, pass_len = len(tokens), 0
        elif budget > 0:
            expected = expected_tokens(controller.request_acceptance(req_id), budget)
            drafts, pass_len = budget, budget
        else:
            continue
        others = StepDrafts(others.tokens + expected - 1.0, others.drafts + drafts,
                            max(others.pass_len, pass_len))
    if not weighed:
        return LookupChoice(chosen)
    batch = len(req_ids)
    lengths = lookup_lengths_for_the_step(
        batch_size=batch,
        lookups=[landing[r] for r in weighed],
        others=others,
        verify_cost=lambda x: verify_price(controller, batch, x),
        draft_cost=draft_cost,
        min_gain=LOOKUP_MIN_GAIN,
    )
    out = dict(chosen)
    declined = 0
    for req_id, n in zip(weighed, lengths, strict=True):
        if n > 0:
            out[req_id] = chosen[req_id][:n]
        else:
            del out[req_id]
            declined += 1
    return LookupChoice(out, declined)
