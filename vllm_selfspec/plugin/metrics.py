"""The plugin's own Prometheus metrics, next to vLLM's ``vllm:spec_decode_*`` counters.

vLLM already exports drafts, draft tokens and accepted tokens (per position) for every speculative
method. Two things a selfspec operator also wants are not there:

``vllm:selfspec_mean_draft_length`` (gauge)
    draft tokens per drafting request and step, over the last ``window_s`` seconds
    (``VLLM_LOG_STATS_INTERVAL``, 10 s by default); it keeps its last value while the engine is
    idle. With ``adaptive`` on this is the draft length the controller actually chooses (at most
    ``num_speculative_tokens``).
``vllm:selfspec_requests_drafting_off`` (gauge)
    running requests that were verified without any draft in the latest engine step: requests the
    adaptive controller switched off (drafts not accepted, or not worth their cost), requests that
    asked for ``num_speculative_tokens: 0``, and requests clipped to zero drafts at
    ``max_model_len``. Requests in prefill are not counted.
``vllm:selfspec_decode_request_steps_total`` / ``vllm:selfspec_request_steps_drafting_off_total``
    (counters) the same per-step counts summed: their ratio over a time range is the share of decode
    work done without drafting.

``vllm:selfspec_num_drafts_total`` / ``vllm:selfspec_num_draft_tokens_total`` /
``vllm:selfspec_num_accepted_tokens_total`` (counters, label ``source``: ``lookup`` or
``layer_skip``)
    vLLM's ``vllm:spec_decode_num_drafts`` / ``num_draft_tokens`` / ``num_accepted_tokens``
    split by the source of the drafts (prompt lookup or layer skipping, ``"drafts": "hybrid"``):
    request-steps verified with drafts, draft tokens verified, draft tokens accepted. Summed over
    ``source`` they equal vLLM's counters once the next pull has run (see below), but for the
    drafts of requests that ended while their step ran (an abort, a stop string) or that
    structured outputs refused: vLLM's scheduler does not count those, the drafter does.

Where the numbers come from: every engine step the scheduler sends :class:`SchedulerStats` (with
``SpecDecodingStats``: requests verified with drafts, draft tokens) and the front end builds
:class:`IterationStats` (one inter-token latency per request that decoded in the step). So
``decode requests - requests with drafts`` is the number of decoding requests without drafts; no
extra traffic between the workers and the front end is needed for those. The source of a draft
is known only to the drafter, in the workers: the per-source counters are pulled, one
``collective_rpc("selfspec_source_totals")`` (patch 10) per ``VLLM_LOG_STATS_INTERVAL``, when the
front end logs its stats (patch 5: ``AsyncLLM.do_log_stats``, ``LLMEngine.do_log_stats``) and
when an offline engine's metrics are read (``LLM.get_metrics()``). On a server they lag the
engine by up to one interval.

How the logger gets in: :func:`~vllm_selfspec.plugin.patches.front_end.install_metrics` (patch 5,
run in the
front-end process when a selfspec engine config is built) wraps ``StatLoggerManager.__init__`` and
appends :class:`SelfSpecStatLogger` to the managers of engines whose speculative config is
selfspec. vLLM's ``vllm.stat_logger_plugins`` entry-point
group was not used on purpose: vLLM loads such plugins for *every* ``AsyncLLM`` and, when one is
present, switches stats collection on even for engines started with ``--disable-log-stats``
(``AsyncLLM.__init__``: ``log_stats or has_custom_loggers``); an installed vllm-selfspec must not
change engines that do not ask for it. The wrapper also covers the offline ``LLM`` engine
(``LLM.get_metrics()`` lists the metrics) which the entry-point group does not. Engines started
with stats disabled have no ``StatLoggerManager`` and so none of these metrics.

The metric names start with ``vllm:`` on purpose: vLLM's ``PrometheusStatLogger`` unregisters all
``vllm:`` collectors when a new engine's loggers are built (tests and restarts in one process),
and ``LLM.get_metrics()`` only lists ``vllm:`` metrics. The wrapper appends our logger after vLLM's
own loggers are built, so that clean-up never removes the metrics of the engine being built.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Iterable
from typing import Any

from prometheus_client import REGISTRY, Counter, Gauge
from vllm.v1.metrics.loggers import AggregateStatLoggerBase

from vllm_selfspec.control.observation import COUNTED_SOURCES

logger = logging.getLogger("vllm.selfspec.metrics")

PREFIX = "vllm:selfspec_"
MEAN_DRAFT_LENGTH = PREFIX + "mean_draft_length"
REQUESTS_DRAFTING_OFF = PREFIX + "requests_drafting_off"
DECODE_REQUEST_STEPS = PREFIX + "decode_request_steps"
REQUEST_STEPS_DRAFTING_OFF = PREFIX + "request_steps_drafting_off"
SOURCE_DRAFTS = PREFIX + "num_drafts"
SOURCE_DRAFT_TOKENS = PREFIX + "num_draft_tokens"
SOURCE_ACCEPTED_TOKENS = PREFIX + "num_accepted_tokens"
SOURCE_TOTALS_METHOD = "selfspec_source_totals"
"""The worker method (patch 10) that returns a drafter's per-source totals."""
_TOTALS_KEYS = (
    ("request_steps", SOURCE_DRAFTS),
    ("draft_tokens", SOURCE_DRAFT_TOKENS),
    ("accepted_tokens", SOURCE_ACCEPTED_TOKENS),
)


def _log_interval() -> float:
    try:
        import vllm.envs as envs

        return float(envs.VLLM_LOG_STATS_INTERVAL)
    except Exception:  # pragma: no cover - older/newer vLLM
        return 10.0


def unregister_selfspec_metrics() -> None:
    """Remove our collectors from the default registry (a new engine registers them again)."""
    for collector in list(REGISTRY._collector_to_names):
        name = getattr(collector, "_name", "")
        if isinstance(name, str) and name.startswith(PREFIX):
            REGISTRY.unregister(collector)


class _EngineWindow:
    """(time, drafts, draft tokens) of the recent steps of one engine."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.steps: collections.deque[tuple[float, int, int]] = collections.deque()
        self.drafts = 0
        self.tokens = 0

    def add(self, now: float, drafts: int, tokens: int) -> None:
        self.steps.append((now, drafts, tokens))
        self.drafts += drafts
        self.tokens += tokens
        while self.steps and self.steps[0][0] < now - self.window_s:
            _, d, t = self.steps.popleft()
            self.drafts -= d
            self.tokens -= t

    def mean(self) -> float | None:
        return self.tokens / self.drafts if self.drafts > 0 else None


class SelfSpecStatLogger(AggregateStatLoggerBase):
    """Exports the selfspec metrics for the engines of one ``AsyncLLM`` / ``LLMEngine``."""

    pull_disabled = False
    """Set when the workers cannot answer :data:`SOURCE_TOTALS_METHOD` (the front end stops
    asking)."""

    def __init__(self, vllm_config: Any, engine_indexes: list[int] | None = None) -> None:
        engine_indexes = list(engine_indexes) if engine_indexes else [0]
        self.engine_indexes = engine_indexes
        self.window_s = _log_interval()
        unregister_selfspec_metrics()
        labelnames = ["model_name", "engine"]
        model_name = vllm_config.model_config.served_model_name
        mean = Gauge(
            MEAN_DRAFT_LENGTH,
            "selfspec: mean draft tokens per drafting request and step over the last "
            f"{self.window_s:g} s",
            labelnames,
            multiprocess_mode="mostrecent",
        )
        off = Gauge(
            REQUESTS_DRAFTING_OFF,
            "selfspec: running requests verified without drafts in the latest step "
            "(adaptive controller off, per-request cap 0, or no room before max_model_len)",
            labelnames,
            multiprocess_mode="mostrecent",
        )
        steps = Counter(
            DECODE_REQUEST_STEPS,
            "selfspec: decode steps summed over requests (prefill excluded)",
            labelnames,
        )
        off_steps = Counter(
            REQUEST_STEPS_DRAFTING_OFF,
            "selfspec: decode steps summed over requests that were verified without drafts",
            labelnames,
        )
        by_source = {
            SOURCE_DRAFTS: Counter(
                SOURCE_DRAFTS,
                "selfspec: requests verified with drafts, summed over steps, by draft source",
                [*labelnames, "source"],
            ),
            SOURCE_DRAFT_TOKENS: Counter(
                SOURCE_DRAFT_TOKENS,
                "selfspec: draft tokens verified, by draft source",
                [*labelnames, "source"],
            ),
            SOURCE_ACCEPTED_TOKENS: Counter(
                SOURCE_ACCEPTED_TOKENS,
                "selfspec: draft tokens accepted, by draft source",
                [*labelnames, "source"],
            ),
        }
        self._mean, self._off, self._steps, self._off_steps = {}, {}, {}, {}
        self._windows: dict[int, _EngineWindow] = {}
        # per engine: {(totals key, source): counter child}, the totals last pulled and logged
        self._by_source: dict[int, dict[tuple[str, str], Any]] = {}
        self._pulled: dict[int, dict[str, dict[str, int]]] = {}
        self._logged: dict[int, dict[str, dict[str, int]]] = {}
        for idx in engine_indexes:
            labels = (model_name, str(idx))
            self._mean[idx] = mean.labels(*labels)
            self._off[idx] = off.labels(*labels)
            self._steps[idx] = steps.labels(*labels)
            self._off_steps[idx] = off_steps.labels(*labels)
            self._windows[idx] = _EngineWindow(self.window_s)
            self._by_source[idx] = {
                (key, source): by_source[name].labels(*labels, source)
                for key, name in _TOTALS_KEYS
                for source in COUNTED_SOURCES
            }

    def record(
        self,
        scheduler_stats: Any,
        iteration_stats: Any,
        mm_cache_stats: Any = None,
        engine_idx: int = 0,
    ) -> None:
        if scheduler_stats is None or engine_idx not in self._windows:
            return
        spec = getattr(scheduler_stats, "spec_decoding_stats", None)
        drafts = int(spec.num_drafts) if spec is not None else 0
        tokens = int(spec.num_draft_tokens) if spec is not None else 0
        window = self._windows[engine_idx]
        if drafts:
            window.add(time.monotonic(), drafts, tokens)
            mean = window.mean()
            if mean is not None:
                self._mean[engine_idx].set(mean)
        running = int(getattr(scheduler_stats, "num_running_reqs", 0))
        if iteration_stats is None:
            if running == 0:
                self._off[engine_idx].set(0)
            return
        # One inter-token latency per request that decoded (not prefilled) in this step.
        decoding = len(getattr(iteration_stats, "inter_token_latencies_iter", ()))
        off = max(decoding - drafts, 0)
        if decoding:
            self._steps[engine_idx].inc(decoding)
        if off:
            self._off_steps[engine_idx].inc(off)
        # Requests that finished in this step are no longer running.
        self._off[engine_idx].set(min(off, running))

    def observe_source_totals(self, results: Iterable[Any]) -> None:
        """The workers' answers to :data:`SOURCE_TOTALS_METHOD`: ``(data-parallel rank, totals)``
        from the first TP rank of each engine, None from the others. The counters advance by what
        the totals grew since the last pull."""
        for result in results:
            if not result:
                continue
            dp_rank, totals = result
            idx = dp_rank if dp_rank in self._by_source else self.engine_indexes[0]
            last = self._pulled.get(idx, {})
            for source, counts in totals.items():
                for key, _ in _TOTALS_KEYS:
                    grown = int(counts.get(key, 0)) - int(last.get(source, {}).get(key, 0))
                    child = self._by_source[idx].get((key, source))
                    if grown > 0 and child is not None:
                        child.inc(grown)
            self._pulled[idx] = totals

    def log(self) -> None:
        """One line per engine with the drafts of each source since the previous line (only when
        something was verified)."""
        for idx, totals in self._pulled.items():
            last = self._logged.get(idx, {})
            parts = []
            for source in COUNTED_SOURCES:
                now, before = totals.get(source, {}), last.get(source, {})
                drafts, tokens, accepted = (
                    int(now.get(key, 0)) - int(before.get(key, 0)) for key, _ in _TOTALS_KEYS
                )
                if drafts > 0:
                    parts.append(
                        f"{source} {tokens} draft tokens in {drafts} drafts, "
                        f"{accepted / tokens if tokens else 0.0:.2f} accepted"
                    )
            self._logged[idx] = totals
            if parts:
                logger.info("selfspec drafts by source (engine %d): %s", idx, "; ".join(parts))

    def log_engine_initialized(self) -> None:
        logger.info(
            "selfspec metrics: %s, %s (gauges), %s_total, %s_total, %s_total, %s_total, %s_total "
            "(counters)",
            MEAN_DRAFT_LENGTH,
            REQUESTS_DRAFTING_OFF,
            DECODE_REQUEST_STEPS,
            REQUEST_STEPS_DRAFTING_OFF,
            SOURCE_DRAFTS,
            SOURCE_DRAFT_TOKENS,
            SOURCE_ACCEPTED_TOKENS,
        )


def selfspec_stat_logger(logger_manager: Any) -> SelfSpecStatLogger | None:
    """The selfspec logger among a ``StatLoggerManager``'s loggers (None: not a selfspec engine,
    or stats disabled)."""
    for stat_logger in getattr(logger_manager, "stat_loggers", ()) or ():
        if isinstance(stat_logger, SelfSpecStatLogger):
            return stat_logger
    return None
