"""The things a benchmark times: an offline vLLM engine and Hugging Face ``generate``.

Both expose ``generate(prompts, temperature, max_tokens, batch) -> (token_ids, seconds)``, plus
``spec_counters()`` / ``drafter_stats()`` (vLLM only) and ``close()``. Memory is the resident
set size of the engine's own processes (the engine-core process vLLM starts for the engine, and
its children), sampled in a background thread while it runs.
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import psutil

from vllm_selfspec.tools.spec_decode_counters import counter_delta, read_spec_decode_counters

__all__ = ["counter_delta", "read_spec_decode_counters"]

WORKER_EXTENSION = "vllm_selfspec.plugin.worker_ext.SelfSpecWorkerExtension"


class RssSampler:
    """Peak RSS of a set of process trees, sampled every ``interval`` seconds while active."""

    def __init__(self, interval: float = 0.25) -> None:
        self.interval = interval
        self._targets: dict[str, list[int]] = {}
        self.peak: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="rss-sampler")
        self._thread.start()

    def track(self, name: str, pids: Sequence[int]) -> None:
        self._targets[name] = list(pids)
        self.peak.setdefault(name, 0)
        self.sample()

    def untrack(self, name: str) -> None:
        self._targets.pop(name, None)

    def sample(self) -> None:
        for name, pids in list(self._targets.items()):
            total = 0
            for pid in pids:
                with contextlib.suppress(psutil.Error):
                    proc = psutil.Process(pid)
                    total += proc.memory_info().rss
                    for child in proc.children(recursive=True):
                        with contextlib.suppress(psutil.Error):
                            total += child.memory_info().rss
            if total > self.peak.get(name, 0):
                self.peak[name] = total

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def stop(self) -> None:
        self._stop.set()


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=False)}


def _spec_counters(llm: Any) -> dict[str, Any]:
    """vLLM's spec-decode counters of *this* engine.

    ``LLM.get_metrics()`` reads the process-wide Prometheus registry, and every new engine's
    ``PrometheusStatLogger`` unregisters the ``vllm:`` collectors of the engines before it: with
    several engines in one process only the newest one's counters are visible there. So the
    counters are read from the engine's own stat logger (``logger_manager``), falling back to the
    registry when vLLM's layout differs.
    """
    manager = getattr(llm.llm_engine, "logger_manager", None)
    for stat_logger in getattr(manager, "stat_loggers", []) or []:
        prom = getattr(stat_logger, "spec_decoding_prom", None)
        if prom is None:
            continue
        if not getattr(prom, "spec_decoding_enabled", False):
            return {}
        try:
            def total(children: Any) -> float:
                return float(sum(c._value.get() for c in children.values()))

            per_pos: list[float] = []
            for counters in prom.counter_spec_decode_num_accepted_tokens_per_pos.values():
                vals = [float(c._value.get()) for c in counters]
                per_pos = vals if not per_pos else [
                    a + b for a, b in zip(per_pos, vals, strict=False)]
            return {
                "num_drafts": total(prom.counter_spec_decode_num_drafts),
                "num_draft_tokens": total(prom.counter_spec_decode_num_draft_tokens),
                "num_accepted_tokens": total(prom.counter_spec_decode_num_accepted_tokens),
                "num_accepted_tokens_per_pos": per_pos,
            }
        except (AttributeError, TypeError):  # pragma: no cover - other vLLM versions
            break
    return read_spec_decode_counters(llm)


def _inter_token_latency(llm: Any) -> tuple[float, float] | None:
    """``(sum of seconds, count)`` of this engine's inter-token-latency histogram (vLLM's
    ``vllm:inter_token_latency_seconds``), read from its own stat logger (see
    :func:`_spec_counters`); ``None`` where vLLM's layout differs.

    For plain decoding every decode step gives each running request one token, so the mean
    inter-token latency over a run is the mean decode-step time, prefills excluded (the first
    token of a request is its time to first token, not an inter-token latency)."""
    manager = getattr(llm.llm_engine, "logger_manager", None)
    for stat_logger in getattr(manager, "stat_loggers", []) or []:
        hist = getattr(stat_logger, "histogram_inter_token_latency", None)
        if not hist:
            continue
        try:
            total = sum(float(h._sum.get()) for h in hist.values())
            count = sum(float(b.get()) for h in hist.values() for b in h._buckets)
        except (AttributeError, TypeError):  # pragma: no cover - other vLLM versions
            return None
        return total, count
    return None


class VllmEngine:
    """An offline ``vllm.LLM`` (multiprocess engine core, eager) with the selfspec worker
    extension, so ``drafter_stats()`` works on selfspec engines (``{}`` on others)."""

    kind = "vllm"

    def __init__(self, name: str, model: str, speculative_config: dict | None, *,
                 dtype: str = "float32", max_model_len: int = 512,
                 kv_cache_bytes: int = 512 << 20, sampler: RssSampler | None = None,
                 enforce_eager: bool = True, engine_args: dict | None = None,
                 request_args: dict | None = None) -> None:
        from vllm import LLM

        self.name = name
        self.spec = speculative_config
        self.request_args = request_args  # every request's SamplingParams.extra_args
        before = _children()
        t0 = time.perf_counter()
        self.llm = LLM(
            model=model,
            speculative_config=speculative_config,
            dtype=dtype,
            enforce_eager=enforce_eager,
            max_model_len=max_model_len,
            kv_cache_memory_bytes=kv_cache_bytes,
            disable_log_stats=False,
            seed=0,
            worker_extension_cls=WORKER_EXTENSION,
            **(engine_args or {}),
        )
        self.start_s = time.perf_counter() - t0
        self.pids = sorted(_children() - before)
        self.sampler = sampler
        if sampler is not None:
            sampler.track(name, self.pids)

    @property
    def k(self) -> int | None:
        cfg = self.llm.llm_engine.vllm_config.speculative_config
        return None if cfg is None else int(cfg.num_speculative_tokens)

    def generate(self, prompts: Sequence[str], temperature: float, max_tokens: int,
                 batch: int, top_k: int = 0, top_p: float = 1.0) -> tuple[list[list[int]], float]:
        from vllm import SamplingParams

        params = SamplingParams(temperature=temperature, max_tokens=max_tokens, top_k=top_k,
                                top_p=top_p, extra_args=self.request_args)
        outputs: list[list[int]] = []
        t0 = time.perf_counter()
        for i in range(0, len(prompts), batch):
            res = self.llm.generate(list(prompts[i:i + batch]), params, use_tqdm=False)
            outputs += [list(r.outputs[0].token_ids) for r in res]
        return outputs, time.perf_counter() - t0

    def spec_counters(self) -> dict[str, Any]:
        return _spec_counters(self.llm)

    def inter_token_latency(self) -> tuple[float, float] | None:
        return _inter_token_latency(self.llm)

    def drafter_stats(self) -> dict[str, Any] | None:
        try:
            stats = self.llm.collective_rpc("selfspec_stats")
        except Exception:  # pragma: no cover - extension missing
            return None
        return stats[0] if stats and stats[0] else None

    def close(self) -> None:
        if self.sampler is not None:
            self.sampler.sample()
            self.sampler.untrack(self.name)
        with contextlib.suppress(Exception):
            self.llm.llm_engine.engine_core.shutdown()
        del self.llm
        gc.collect()


class HfEngine:
    """Hugging Face transformers ``generate`` at batch 1 (assisted generation is batch-1 only),
    optionally with ``assistant_early_exit`` (HF's self-speculative early exit: the first N layers
    plus the LM head draft, the full model verifies). Runs in this process with
    ``torch_threads`` threads (vLLM's worker uses one core here)."""

    kind = "hf"

    def __init__(self, name: str, model: str, *, early_exit: int | None = None,
                 dtype: str = "float32", torch_threads: int = 1,
                 num_assistant_tokens: int | None = None,
                 sampler: RssSampler | None = None) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.name = name
        self.early_exit = early_exit
        self.num_assistant_tokens = num_assistant_tokens
        torch.set_num_threads(torch_threads)
        t0 = time.perf_counter()
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype))
        self.model.eval()
        self.start_s = time.perf_counter() - t0
        self.pids = [os.getpid()]
        self.sampler = None  # HF runs in the driver: its RSS is not separable from vLLM's client
        self._torch = torch

    k = None

    def generate(self, prompts: Sequence[str], temperature: float, max_tokens: int,
                 batch: int, top_k: int = 0, top_p: float = 1.0) -> tuple[list[list[int]], float]:
        if batch != 1:
            raise ValueError("HF assisted generation runs at batch 1 only")
        torch = self._torch
        outputs: list[list[int]] = []
        kw: dict[str, Any] = {"max_new_tokens": max_tokens}
        if temperature > 0:
            kw.update(do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k)
        else:
            kw.update(do_sample=False)
        if self.early_exit:
            kw["assistant_early_exit"] = self.early_exit
            if self.num_assistant_tokens:
                kw["num_assistant_tokens"] = self.num_assistant_tokens
        eos = self.tokenizer.eos_token_id
        t0 = time.perf_counter()
        with torch.inference_mode():
            for p in prompts:
                enc = self.tokenizer(p, return_tensors="pt", add_special_tokens=False)
                out = self.model.generate(**enc, pad_token_id=eos, **kw)
                outputs.append(out[0, enc["input_ids"].shape[1]:].tolist())
        return outputs, time.perf_counter() - t0

    def spec_counters(self) -> dict[str, Any]:
        return {}

    def drafter_stats(self) -> None:
        return None

    def close(self) -> None:
        del self.model
        gc.collect()
