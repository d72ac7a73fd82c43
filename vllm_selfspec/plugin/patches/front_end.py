"""Front-end patches: the plugin's metrics and per-request overrides checked on arrival.

5. ``StatLoggerManager.__init__`` (front-end process only; installed by
   :func:`install_metrics` when a selfspec config is built, or at plugin load
   when vLLM's metrics loggers are already imported): appends the plugin's own Prometheus logger
   (``vllm:selfspec_*`` metrics) to the stat loggers of selfspec engines only. Can go once vLLM
   loads stat loggers from plugins (an offline ``LLM`` takes none from its caller).
   ``AsyncLLM.do_log_stats``, ``LLMEngine.do_log_stats`` and ``LLMEngine.get_metrics`` (same
   installation): on selfspec engines with stats on, the wrapper first pulls the drafters'
   per-source totals from the workers (``collective_rpc`` of patch 10's method) into that logger,
   then delegates. Only the drafter knows whether a draft came from prompt lookup or from layer
   skipping, and vLLM carries nothing per source from the workers to its front end. Can go with
   patch 10.
7. ``InputProcessor._validate_params`` and ``AsyncLLM.generate`` (front-end process only;
   installed when a selfspec config is built, or at plugin load for the modules already
   imported): per-request overrides (``SamplingParams.extra_args["selfspec"]``, or flat
   ``selfspec_<key>`` entries, which the OpenAI server fills from ``vllm_xargs``) reach vLLM as
   opaque ``extra_args``, so an invalid one used to be ignored by the worker with a log line. The
   input processor is where vLLM validates every other sampling parameter of a request before it
   becomes an ``EngineCoreRequest``; the wrapper delegates, then checks the overrides against the
   engine's ``k_max`` and raises :func:`request_error_type` (a ``ValueError`` for ``LLM.generate``
   callers and a ``VLLMValidationError``, which vLLM's servers answer with 400), naming the key and
   the reason. ``AsyncLLM.generate`` is an async generator: it reaches the input processor only when
   first iterated, and a streamed response has sent its 200 by then. Its wrapper runs the same check
   when it is called (the servers call it before they start the response), then returns vLLM's
   generator. Engines without the selfspec method are not touched. Can go once vLLM validates
   ``extra_args`` through a plugin hook.
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Mapping
from typing import Any

from vllm_selfspec.plugin.engine_markers import is_selfspec_engine
from vllm_selfspec.plugin.patches._shared import already_wrapped, install

logger = logging.getLogger("vllm.selfspec.patches")


# --- 5. the plugin's own metrics (front end) --------------------------------------------------


def install_metrics(only_if_imported: bool = False) -> None:
    """Wrap ``StatLoggerManager.__init__`` once per process (idempotent). Lazy on purpose:
    importing vLLM's metrics loggers costs about a second, and only front ends that build a
    selfspec engine (or imported them already) need the wrapper."""
    if only_if_imported and "vllm.v1.metrics.loggers" not in sys.modules:
        return
    try:
        from vllm.v1.metrics.loggers import StatLoggerManager

        from vllm_selfspec.plugin.metrics import SelfSpecStatLogger
    except ImportError as exc:  # pragma: no cover - a vLLM without that module
        logger.warning("selfspec metrics unavailable: %s", exc)
        return
    original = StatLoggerManager.__init__
    if already_wrapped(original):
        return

    def __init__(self, vllm_config, *args, **kwargs):
        original(self, vllm_config, *args, **kwargs)

        if not is_selfspec_engine(vllm_config):
            return
        try:
            self.stat_loggers.append(SelfSpecStatLogger(vllm_config, self.engine_indexes))
        except Exception:  # metrics must never stop an engine from starting
            logger.exception("selfspec: could not set up the selfspec metrics")

    install(StatLoggerManager, "__init__", __init__, original)
    _install_source_totals_pull()


_PULL_TIMEOUT_S = 5.0
_pull_failed_warned = False


def _source_logger(engine: Any) -> Any:
    from vllm_selfspec.plugin.metrics import selfspec_stat_logger

    stat_logger = selfspec_stat_logger(getattr(engine, "logger_manager", None))
    if stat_logger is None or getattr(stat_logger, "pull_disabled", False):
        return None
    return stat_logger


def _pull_failed(stat_logger: Any, exc: BaseException) -> None:
    """A failed pull never reaches the caller: the metrics stay where they were. An engine that
    has no such worker method stops asking."""
    global _pull_failed_warned
    if isinstance(exc, NotImplementedError) or "not implemented" in str(exc):
        stat_logger.pull_disabled = True
    if not _pull_failed_warned:
        _pull_failed_warned = True
        logger.warning("selfspec: could not read the per-source draft counters: %s", exc)


def _install_source_totals_pull() -> None:
    """Wrap the stats entry points of both front ends (see patch 5 above)."""
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.llm_engine import LLMEngine

    from vllm_selfspec.plugin.metrics import SOURCE_TOTALS_METHOD

    def pull(engine: Any) -> None:
        stat_logger = _source_logger(engine)
        if stat_logger is None:
            return
        try:
            results = engine.collective_rpc(SOURCE_TOTALS_METHOD, timeout=_PULL_TIMEOUT_S)
            stat_logger.observe_source_totals(results)
        except Exception as exc:  # noqa: BLE001 - metrics must never break the engine
            _pull_failed(stat_logger, exc)

    for name in ("do_log_stats", "get_metrics"):
        original = getattr(LLMEngine, name)
        if already_wrapped(original):
            continue

        def wrapper(self: Any, *args: Any, _original: Any = original, **kwargs: Any) -> Any:
            pull(self)
            return _original(self, *args, **kwargs)

        functools.update_wrapper(wrapper, original)
        install(LLMEngine, name, wrapper, original)

    original_async = AsyncLLM.do_log_stats
    if already_wrapped(original_async):
        return

    @functools.wraps(original_async)
    async def do_log_stats(self: Any) -> None:
        stat_logger = _source_logger(self)
        if stat_logger is not None:
            try:
                results = await self.collective_rpc(SOURCE_TOTALS_METHOD, timeout=_PULL_TIMEOUT_S)
                stat_logger.observe_source_totals(results)
            except Exception as exc:  # noqa: BLE001 - metrics must never break the engine
                _pull_failed(stat_logger, exc)
        await original_async(self)

    install(AsyncLLM, "do_log_stats", do_log_stats, original_async)


# --- 7. per-request overrides refused when the request arrives (front end) ----------------------


@functools.cache
def request_error_type() -> type[ValueError]:
    """The error of a refused per-request override: a ``ValueError`` (what ``LLM.generate``
    callers catch) and vLLM's ``VLLMValidationError`` (its servers answer 400 and name the
    ``parameter``). Built on first use: this module imports nothing from vLLM when it loads."""
    from vllm.exceptions import VLLMValidationError

    class SelfSpecRequestError(VLLMValidationError, ValueError):
        """A per-request selfspec override is invalid for this engine."""

        def __str__(self) -> str:  # the message names the key already: no "(parameter=...)"
            return Exception.__str__(self)

    SelfSpecRequestError.__module__ = __name__
    SelfSpecRequestError.__qualname__ = SelfSpecRequestError.__name__
    return SelfSpecRequestError


def selfspec_k_max(vllm_config: Any) -> int | None:
    """The engine's maximum draft length (what the drafter uses), None for other engines."""
    if not is_selfspec_engine(vllm_config):
        return None
    return int(vllm_config.speculative_config.num_speculative_tokens)


def check_request_overrides(extra_args: Mapping[str, Any] | None, k_max: int) -> None:
    """Raise :func:`request_error_type` for the first invalid selfspec override in
    ``extra_args`` (a ``SamplingParams.extra_args``), with the key as the client wrote it and the
    reason. Reads the overrides as the drafter does (nested dict first, else flat entries)."""
    if not extra_args:
        return
    from vllm_selfspec.control.controller import (
        FLAT_PREFIX,
        OVERRIDES_KEY,
        flat_overrides,
        validate_request_overrides,
    )

    error = request_error_type()
    nested = extra_args.get(OVERRIDES_KEY)
    flat_keys = sorted(k for k in extra_args if isinstance(k, str) and k.startswith(FLAT_PREFIX))
    if nested is not None and flat_keys:
        raise error(
            f"per-request selfspec overrides: give either {OVERRIDES_KEY!r} (a dict) or flat "
            f"{FLAT_PREFIX}<key> entries, not both (got {OVERRIDES_KEY!r} and {flat_keys[0]!r})",
            parameter=OVERRIDES_KEY,
        )
    if nested is not None:
        if not isinstance(nested, Mapping):
            raise error(
                f"per-request selfspec override {OVERRIDES_KEY!r} must be a dict of overrides, "
                f"got {type(nested).__name__}",
                parameter=OVERRIDES_KEY,
            )
        items = [(f"{OVERRIDES_KEY}.{key}", key, value) for key, value in nested.items()]
    else:
        flat = flat_overrides(dict(extra_args)) or {}
        items = [(FLAT_PREFIX + key, key, value) for key, value in flat.items()]
    for name, key, value in items:
        try:
            validate_request_overrides({key: value}, k_max=k_max)
        except ValueError as exc:
            raise error(f"per-request selfspec override {name!r} refused: {exc}",
                        parameter=name) from None


def check_sampling_params(vllm_config: Any, params: Any) -> None:
    """:func:`check_request_overrides` for a request's params on a selfspec engine; nothing for
    other engines or for pooling params."""
    k_max = selfspec_k_max(vllm_config)
    if k_max is None:
        return
    check_request_overrides(getattr(params, "extra_args", None), k_max)


def install_request_validation(only_if_imported: bool = False) -> None:
    """Lazy like :func:`install_metrics`: the two vLLM modules cost seconds to import, and only
    front ends that build an engine (which imports them) need the wrappers."""
    if not only_if_imported or "vllm.v1.engine.input_processor" in sys.modules:
        _patch_input_processor_validation()
    if not only_if_imported or "vllm.v1.engine.async_llm" in sys.modules:
        _patch_async_generate_validation()


def _patch_input_processor_validation() -> None:
    from vllm.v1.engine.input_processor import InputProcessor

    original = getattr(InputProcessor, "_validate_params", None)
    if original is None:  # pragma: no cover - a vLLM that renamed the hook
        logger.warning("vLLM's InputProcessor has no _validate_params: per-request selfspec "
                       "overrides are checked by the drafter only (invalid ones are ignored)")
        return
    if already_wrapped(original):
        return

    @functools.wraps(original)
    def _validate_params(self, params, *args, **kwargs):
        result = original(self, params, *args, **kwargs)
        check_sampling_params(self.vllm_config, params)
        return result

    install(InputProcessor, "_validate_params", _validate_params, original)


def _patch_async_generate_validation() -> None:
    from vllm.v1.engine.async_llm import AsyncLLM

    original = AsyncLLM.generate
    if already_wrapped(original):
        return

    @functools.wraps(original)
    def generate(self, prompt, sampling_params, *args, **kwargs):
        # Eager on purpose (a plain function returning vLLM's async generator): the error is
        # raised by the call, before a server has started a streamed 200 response.
        check_sampling_params(self.vllm_config, sampling_params)
        return original(self, prompt, sampling_params, *args, **kwargs)

    install(AsyncLLM, "generate", generate, original)
