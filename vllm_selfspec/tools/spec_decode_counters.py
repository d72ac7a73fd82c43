"""Read vLLM's own spec-decode counters from an offline ``LLM`` (``vllm:spec_decode_*``).

Used by the demo, the benchmarks, the search's end-to-end confirmation and the tests, so that
acceptance is computed one way everywhere: accepted draft tokens / draft tokens verified, and mean
accepted length = 1 + accepted / drafts (vLLM's definition; rows without drafts do not count).
"""

from __future__ import annotations

from typing import Any


def read_spec_decode_counters(llm: Any) -> dict[str, Any]:
    """``{"num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos"}``
    summed over engines (requires an engine started with ``disable_log_stats=False``)."""
    found: dict[str, Any] = {}
    for metric in llm.get_metrics():
        if not metric.name.startswith("vllm:spec_decode"):
            continue
        name = metric.name.removeprefix("vllm:spec_decode_")
        if hasattr(metric, "values"):
            values = list(metric.values)
            previous = found.get(name)
            found[name] = (
                values
                if previous is None
                else [a + b for a, b in zip(previous, values, strict=False)]
            )
        elif hasattr(metric, "value"):
            found[name] = found.get(name, 0) + metric.value
    return found


def read_source_counters(llm: Any) -> dict[str, dict[str, float]]:
    """The selfspec counters split by draft source (``vllm:selfspec_num_drafts`` /
    ``num_draft_tokens`` / ``num_accepted_tokens``, label ``source``), summed over engines:
    ``{source: {"num_drafts", "num_draft_tokens", "num_accepted_tokens"}}``; empty for an engine
    that is not selfspec. ``LLM.get_metrics()`` pulls the drafters' totals first, so they are
    current."""
    found: dict[str, dict[str, float]] = {}
    for metric in llm.get_metrics():
        name = metric.name.removeprefix("vllm:selfspec_")
        source = getattr(metric, "labels", {}).get("source")
        if source is None or name == metric.name or not hasattr(metric, "value"):
            continue
        counts = found.setdefault(source, {})
        counts[name] = counts.get(name, 0) + metric.value
    return found


def counter_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """``after - before`` for every counter (per-position lists element-wise, missing as 0)."""
    out: dict[str, Any] = {}
    for key, value in after.items():
        previous = before.get(key)
        if isinstance(value, list):
            previous = previous or []
            out[key] = [x - (previous[i] if i < len(previous) else 0) for i, x in enumerate(value)]
        else:
            out[key] = value - (previous or 0)
    return out


def acceptance_rate(counters: dict[str, Any]) -> float | None:
    drafted = counters.get("num_draft_tokens", 0)
    return counters.get("num_accepted_tokens", 0) / drafted if drafted else None


def mean_accepted_length(counters: dict[str, Any]) -> float | None:
    drafts = counters.get("num_drafts", 0)
    return 1 + counters.get("num_accepted_tokens", 0) / drafts if drafts else None
