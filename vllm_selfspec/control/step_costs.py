"""Measured step costs of the engine: what a verification of ``T`` tokens and a draft forward cost.

Speculation pays only when the tokens it adds outrun the time it adds, and both halves of that time
are measured here rather than assumed:

* **verification**: the target forward of a step that verifies ``B`` requests with ``D`` draft
  tokens in all. On a GPU at small batches the extra ``D`` tokens are nearly free; on a CPU (or a
  GPU at large batches) the step grows with ``B + D``: at batch 8, SmolLM2-135M on 2 CPU cores
  takes ~3.5x as long to verify 4 drafts per request as to decode one token. Samples are kept per
  batch-size bucket (powers of two) and per *draft tokens per request* ``x = D / B`` (quantised to
  quarters); ``x = 0`` is a plain decoding step, the baseline every plan is compared with.
* **draft forward**: one layer-skip forward over ``n`` rows, kept per power-of-two bucket of ``n``.
* **scoring round**: online layer selection's scoring passes of one engine step (one key); it
  decides how often the search may score, and rides in the same table so that one broadcast
  gives every tensor-parallel rank every cost it plans with.

Each key keeps its last few samples and answers with their lower quartile
(:data:`COST_QUANTILE`): a single outlier (a step that also ran a prefill, a scheduler hiccup,
another process) moves nothing, and neither does a slow spell. A CPU engine's step times come in
spells (SmolLM2 at batch 1: plain steps of 22-23 ms for a few hundred steps, then 29-31 ms, every
kind of step alike), and the keys are sampled at different times: plain steps only on the
controller's occasional plain steps, draft forwards only on drafting steps. Their medians mixed
the spells differently, and the draft/plain ratio the controller plans with swung between 0.69
and 1.19 within one run while both costs were fixed (an engine drafting layer skips that cost
about 0.9 of a plain step, drafting on the low readings); the lower quartiles read the fast
spell of each key (0.84-0.85 in the same samples). A plain-step key also
forgets samples older than ``max_plain_age`` measured steps of its bucket: it is the baseline of
every plan, and an engine that drafts measures it only on the controller's occasional plain
steps, so a window of samples alone could hold a baseline many hundreds of steps old (15 samples
at one plain step in 64 were ~1000 steps). :class:`StepCostRecorder`
collects samples on one worker; :meth:`StepCostRecorder.snapshot` turns them into a
:class:`StepCosts`, the immutable table the controller plans with. A snapshot flattens to a list of
floats (:meth:`StepCosts.to_flat` / :meth:`StepCosts.from_flat`) so that tensor-parallel ranks can
broadcast rank 0's and all take identical decisions.

Pure Python plus numpy: no vLLM, no torch.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

_VERIFY, _DRAFT, _SCORING = 0.0, 1.0, 2.0
COST_QUANTILE = 0.25  # of a key's samples, the cost it answers with (see the module docstring)
X_QUANTUM = 0.25  # draft tokens per request are kept in quarters


def bucket(n: int) -> int:
    """Power-of-two bucket of a batch size or row count (1, 2, 4, 8, ...)."""
    return 1 << max(0, int(n) - 1).bit_length()


def quantise_x(draft_tokens: int, batch_size: int) -> float:
    """Draft tokens per request, in quarters; any drafting at all is at least one quarter."""
    if draft_tokens <= 0:
        return 0.0
    x = draft_tokens / max(batch_size, 1)
    return max(X_QUANTUM, round(x / X_QUANTUM) * X_QUANTUM)


def _valid(seconds: float) -> bool:
    return math.isfinite(seconds) and seconds > 0


@dataclass(frozen=True)
class StepCosts:
    """A table of step costs in seconds (lower quartiles of recent samples); see the module
    docstring.

    ``verify[(b, x)]``: verification step of a batch in bucket ``b`` with ``x`` draft tokens per
    request; ``draft[b]``: one draft forward over a row count in bucket ``b``; ``scoring``: one
    engine step's scoring passes of online layer selection (None: not measured). ``scoring`` is
    not a cost of decoding: it takes no part in :meth:`__bool__` nor in the plans.
    """

    verify: dict[tuple[int, float], float] = field(default_factory=dict)
    draft: dict[int, float] = field(default_factory=dict)
    scoring: float | None = None
    # per batch-size bucket, the curves verify_cost and draft_cost interpolate on: a table
    # serves many steps' plans (the planners call these a few dozen times a step), and is
    # never changed once built
    _curves: dict[tuple[str, int], Any] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def __bool__(self) -> bool:
        return bool(self.verify) or bool(self.draft)

    def comparable(self) -> StepCosts:
        """This table where its costs can be combined with one another, else an empty one.

        With no verification measured, :meth:`verify_cost` answers the unit 1.0 (one plain step)
        while measured draft forwards are in seconds: added together, a 50 ms draft forward
        would read as 5% of a plain step whatever the plain step costs. Such a table (draft
        forwards only) is replaced by the empty table, which prices everything in plain steps:
        verification free, a draft forward ``prior_ratio`` plain steps (:meth:`draft_cost`)."""
        return self if self.verify or not self.draft else StepCosts()

    # ---- lookup -----------------------------------------------------------------------------
    def _verify_bucket(self, batch_size: int) -> int | None:
        """The bucket whose verification table answers for ``batch_size``: its own if it has a
        plain-step (``x = 0``) entry, else the nearest bucket that has one, else the nearest with
        any entry."""
        if not self.verify:
            return None
        b = bucket(batch_size)
        buckets = {bb for bb, _ in self.verify}
        with_plain = {bb for bb, x in self.verify if x == 0.0}
        pool = with_plain or buckets
        if b in pool:
            return b
        return min(pool, key=lambda bb: (abs(bb.bit_length() - b.bit_length()), bb))

    def has_plain(self, batch_size: int) -> bool:
        """Whether a plain step of this batch size's own bucket has been measured."""
        return (bucket(batch_size), 0.0) in self.verify

    def _curve(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """Bucket ``b``'s measured ``(x, seconds)`` points, sorted by ``x``, the seconds made
        non-decreasing in ``x``: a step that verifies more draft tokens runs the same weights
        over more tokens, so a median that reads cheaper than one with fewer (measured: a
        3-draft verification below the plain step at batch 1 on a busy CPU) is noise, and
        believing it makes drafting look free exactly where it costs most."""
        points = sorted((xx, c) for (bb, xx), c in self.verify.items() if bb == b)
        seconds = np.maximum.accumulate(np.array([p[1] for p in points]))
        return np.array([p[0] for p in points]), seconds

    @staticmethod
    def _along(px: np.ndarray, py: np.ndarray, xs: np.ndarray) -> np.ndarray:
        """Linear interpolation; above the largest ``x``, linear extrapolation along the line
        through the first point and the last (never decreasing)."""
        out = np.interp(xs, px, py)
        if len(px) > 1:
            slope = max((py[-1] - py[0]) / (px[-1] - px[0]), 0.0)
            out = np.where(xs > px[-1], py[-1] + slope * (xs - px[-1]), out)
        return out

    def _reference_bucket(self, b: int) -> int | None:
        """The nearest other bucket (larger first on ties) with a plain step and a measured
        verification of drafts: the shape of its cost curve stands in where ``b`` has none."""
        refs = {bb for bb, x in self.verify if x > 0.0 and bb != b
                and (bb, 0.0) in self.verify}
        if not refs:
            return None
        return min(refs, key=lambda bb: (abs(bb.bit_length() - b.bit_length()), -bb))

    def verify_cost(self, batch_size: int, x: float | np.ndarray) -> float | np.ndarray:
        """Verification cost for ``x`` draft tokens per request (array-valued for an array).

        Linear interpolation between the bucket's measured ``x``; above the largest, linear
        extrapolation along the line through the plain step and the largest measured ``x``.
        Where that extrapolation (or a bucket with only its plain step) would price drafts below
        what the nearest bucket with measured verifications says, that bucket's curve, scaled by
        the plain steps' ratio, is used instead: verification is never assumed free at one batch
        size because it has only been measured at another. With nothing measured the cost is 1.0
        everywhere (unit time, verification free: the paper's assumption until a measurement
        says otherwise)."""
        xs_in = np.asarray(x, dtype=np.float64)
        curves = self._verify_curves(batch_size)
        if curves is None:
            out = np.ones_like(xs_in)
            return float(out) if np.ndim(x) == 0 else out
        px, py, reference = curves
        out = self._along(px, py, xs_in)
        if reference is not None:
            rx, ry, scale = reference
            scaled = self._along(rx, ry, xs_in) * scale
            out = np.where(xs_in > px[-1], np.maximum(out, scaled), out)
        return float(out) if np.ndim(x) == 0 else out

    def _verify_curves(self, batch_size: int) -> Any:
        """``(px, py, reference)`` that :meth:`verify_cost` interpolates for ``batch_size``'s
        bucket (``reference``: the nearest other bucket's curve and the plain steps' ratio, or
        None); None with nothing measured. Built once per bucket and table."""
        key = ("verify", bucket(batch_size))
        if key in self._curves:
            return self._curves[key]
        b = self._verify_bucket(batch_size)
        curves = None
        if b is not None:
            px, py = self._curve(b)
            if px[0] > 0.0:  # no plain step measured: assume verification free below the first x
                px = np.concatenate([[0.0], px])
                py = np.concatenate([[py[0]], py])
            ref = self._reference_bucket(b) if (b, 0.0) in self.verify else None
            reference = None
            if ref is not None:
                rx, ry = self._curve(ref)
                reference = (rx, ry, py[0] / ry[0])
            curves = (px, py, reference)
        self._curves[key] = curves
        return curves

    def measured_x(self, batch_size: int) -> float:
        """The most draft tokens per request whose verification has been measured in
        ``batch_size``'s own bucket (0.0: none)."""
        b = bucket(batch_size)
        return max((x for bb, x in self.verify if bb == b), default=0.0)

    def plain_cost(self, batch_size: int) -> float:
        return float(self.verify_cost(batch_size, 0.0))

    def draft_cost(self, rows: int | np.ndarray, batch_size: int,
                   prior_ratio: float = 0.5) -> float | np.ndarray:
        """One draft forward over ``rows`` rows: interpolated over measured buckets (log scale),
        constant beyond them; with nothing measured, ``prior_ratio`` plain steps of
        ``batch_size``. Zero rows cost nothing.

        Measured costs are in seconds; combine them with :meth:`verify_cost` only on a
        :meth:`comparable` table (with no verification measured that one is a unit)."""
        rows_in = np.asarray(rows, dtype=np.float64)
        if not self.draft:
            out = np.full_like(rows_in, prior_ratio * self.plain_cost(batch_size))
        else:
            curve = self._curves.get(("draft", 0))
            if curve is None:
                points = sorted(self.draft.items())
                curve = self._curves[("draft", 0)] = (
                    np.log2([p[0] for p in points]), np.array([p[1] for p in points]))
            out = np.interp(np.log2(np.maximum(rows_in, 1.0)), *curve)
        out = np.where(rows_in > 0, out, 0.0)
        return float(out) if np.ndim(rows) == 0 else out

    def of_bucket(self, batch_size: int) -> StepCosts:
        """Only the entries of ``batch_size``'s own bucket (no fallback to other buckets)."""
        b = bucket(batch_size)
        return StepCosts(verify={k: c for k, c in self.verify.items() if k[0] == b},
                         draft={bb: c for bb, c in self.draft.items() if bb == b},
                         scoring=self.scoring)

    # ---- transport --------------------------------------------------------------------------
    def to_flat(self) -> list[float]:
        """``[kind, bucket, x, seconds] * n`` (kind 0: verification, 1: draft forward, 2: scoring
        round with bucket 1; draft forwards first, scoring last)."""
        flat: list[float] = []
        for b, c in sorted(self.draft.items()):
            flat += [_DRAFT, float(b), 0.0, c]
        for (b, x), c in sorted(self.verify.items()):
            flat += [_VERIFY, float(b), x, c]
        if self.scoring is not None:
            flat += [_SCORING, 1.0, 0.0, self.scoring]
        return flat

    @classmethod
    def from_flat(cls, flat: Sequence[float]) -> StepCosts:
        verify: dict[tuple[int, float], float] = {}
        draft: dict[int, float] = {}
        scoring = None
        for i in range(0, len(flat) - len(flat) % 4, 4):
            kind, b, x, c = (float(v) for v in flat[i:i + 4])
            if not _valid(c) or b < 1:
                continue
            if kind == _VERIFY:
                verify[(int(b), x)] = c
            elif kind == _DRAFT:
                draft[int(b)] = c
            elif kind == _SCORING:
                scoring = c
        return cls(verify=verify, draft=draft, scoring=scoring)


class StepCostRecorder:
    """Collects step-cost samples on one worker; :meth:`snapshot` gives their ``quantile``
    (default :data:`COST_QUANTILE`).

    Every key keeps its last ``window`` samples. A plain-step key (``x = 0``) of a bucket also
    drops samples older than ``max_plain_age`` of that bucket's measured verification steps
    (:meth:`observe_verify` calls, plain or not): its estimate is never older than that. With the
    controller's default of one plain step in 33 at a bucket that always drafts, the age bound
    keeps the last ~8 of them (more than the 3 a key needs, so a few unmeasured plain steps,
    e.g. ones whose batch changed, do not make the key vanish); a key that does fall below
    ``min_samples`` leaves the snapshot, and the controller then explores that bucket's plain step
    every few steps until it is measured again. Steps that are not measured (the drafter measures
    only steps whose batch did not change) do not advance the age."""

    def __init__(self, window: int = 15, min_samples: int = 3,
                 max_plain_age: int = 256, quantile: float = COST_QUANTILE) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        if not 1 <= min_samples <= window:
            raise ValueError(f"min_samples must be in [1, window], got {min_samples}")
        if max_plain_age < 1:
            raise ValueError(f"max_plain_age must be >= 1, got {max_plain_age}")
        if not 0.0 <= quantile <= 1.0:
            raise ValueError(f"quantile must be in [0, 1], got {quantile}")
        self.quantile = quantile
        self.window = window
        self.min_samples = min_samples
        self.max_plain_age = max_plain_age
        self._verify: dict[tuple[int, float], deque[float]] = {}
        self._draft: dict[int, deque[float]] = {}
        self._scoring: deque[float] = deque(maxlen=window)
        # per bucket: measured verification steps so far, and the step of each plain sample
        self._steps: dict[int, int] = {}
        self._plain_steps: dict[int, deque[int]] = {}
        #: how many times a key has reached ``min_samples`` samples: grows exactly when a
        #: snapshot would gain an entry (a plain-step key that aged out counts again when it is
        #: back), the same on every tensor-parallel rank (all observe the same steps)
        self.ready_keys = 0

    def _append(self, samples: deque[float], seconds: float) -> None:
        before = len(samples)
        samples.append(seconds)
        if before < self.min_samples <= len(samples):
            self.ready_keys += 1

    def observe_verify(self, batch_size: int, draft_tokens: int, seconds: float) -> None:
        """A verification step of ``batch_size`` requests and ``draft_tokens`` drafts took
        ``seconds`` (non-finite or non-positive times are ignored)."""
        if batch_size < 1 or draft_tokens < 0 or not _valid(seconds):
            return
        b = bucket(batch_size)
        step = self._steps[b] = self._steps.get(b, 0) + 1
        key = (b, quantise_x(draft_tokens, batch_size))
        samples = self._verify.setdefault(key, deque(maxlen=self.window))
        before = len(samples)
        samples.append(seconds)
        if key[1] == 0.0:
            self._plain_steps.setdefault(b, deque(maxlen=self.window)).append(step)
        self._age_plain(b, step)  # only ever drops samples: no key gains an entry by it
        if before < self.min_samples <= len(samples):
            self.ready_keys += 1

    def _age_plain(self, b: int, step: int) -> None:
        """Drop bucket ``b``'s plain-step samples taken ``max_plain_age`` or more steps ago."""
        steps = self._plain_steps.get(b)
        samples = self._verify.get((b, 0.0))
        while steps and samples and step - steps[0] >= self.max_plain_age:
            steps.popleft()
            samples.popleft()

    def plain_ages(self, batch_size: int) -> list[int]:
        """Ages, in measured steps of ``batch_size``'s bucket, of the plain-step samples its
        estimate is taken from (oldest first; 0: the latest measured step)."""
        b = bucket(batch_size)
        now = self._steps.get(b, 0)
        return [now - s for s in self._plain_steps.get(b, ())]

    def observe_draft(self, rows: int, seconds: float) -> None:
        """One draft forward over ``rows`` rows took ``seconds``."""
        if rows < 1 or not _valid(seconds):
            return
        self._append(self._draft.setdefault(bucket(rows), deque(maxlen=self.window)), seconds)

    def observe_scoring(self, seconds: float) -> None:
        """Online layer selection's scoring passes of one engine step took ``seconds``."""
        if _valid(seconds):
            self._append(self._scoring, seconds)

    def snapshot(self, min_samples: int | None = None) -> StepCosts:
        """The recorder's ``quantile`` of each key with at least ``min_samples`` (default: the
        recorder's) samples (a key's first samples can all be slow: a new input shape's first
        run builds kernels and buffers)."""
        if min_samples is None:
            min_samples = self.min_samples
        q = self.quantile
        return StepCosts(
            verify={k: float(np.quantile(v, q)) for k, v in self._verify.items()
                    if len(v) >= min_samples},
            draft={k: float(np.quantile(v, q)) for k, v in self._draft.items()
                   if len(v) >= min_samples},
            # the median, not the quantile: a round's cost varies with its window, and the
            # overhead bound it sets is about the typical round
            scoring=(float(np.median(self._scoring))
                     if len(self._scoring) >= min_samples else None),
        )
