"""Pure numbers and tables for the benchmarks (no vLLM, no torch; matplotlib only for plots).

* :func:`ideal_speedup` (the controller's :func:`~vllm_selfspec.control.controller.best_speedup`
  with interpolated verification costs): the speedup that a per-token acceptance ``a`` and a
  draft/verify step cost ratio ``r`` allow: ``max_k E(k) / (k*r + 1)`` with
  ``E(k) = (1 - a**(k+1)) / (1 - a)`` (``k + 1`` when ``a == 1``), ``k`` in ``0..k_max``
  (``k = 0`` is plain decoding, speedup 1).
* :func:`per_token_acceptance`: the per-token acceptance ``a`` of the geometric model, estimated
  from vLLM's spec-decode counters (accepted tokens, drafts, per-position accepted counts).
* :func:`summarize`: per (cell, method) aggregates over repeated runs: tokens/s ratio to plain
  (median, min, max of the per-run ratios), acceptance, mean accepted length, ...
* :func:`markdown_table`, :func:`write_plots`.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from vllm_selfspec.control.controller import best_speedup
from vllm_selfspec.control.step_costs import bucket


def ideal_speedup(a: float, r: float, k_max: int,
                  verify_ratio: float = 1.0) -> tuple[float, int]:
    """``(max_k E(k) / (v(k) + k*r), best k)`` over ``k = 0..k_max``; ties go to the smaller k.

    ``a``: per-token acceptance; ``r``: cost of one draft forward over the cost of one plain
    decoding step; ``verify_ratio``: cost of a step verifying ``k_max`` drafts per request over a
    plain step, ``v(k)`` its linear interpolation (``v(0) = 1``; 1.0 everywhere: verification
    free). ``k = 0`` (no drafting) scores 1.0, so the result is never below 1.
    """
    if r < 0 or not math.isfinite(r):
        raise ValueError(f"cost ratio must be finite and >= 0, got {r}")
    if verify_ratio <= 0 or not math.isfinite(verify_ratio):
        raise ValueError(f"verify ratio must be finite and > 0, got {verify_ratio}")
    k_max = int(k_max)
    return best_speedup(
        a, k_max, draft_cost=r, verify_cost=lambda k: 1.0 + (verify_ratio - 1.0) * k / k_max
    )


def per_token_acceptance(
    num_accepted: float, num_drafts: float, accepted_per_pos: Sequence[float] | None, k: int
) -> float | None:
    """Per-token acceptance ``a`` of the geometric model, from vLLM's spec-decode counters.

    Each draft round verifies up to ``k`` tokens and accepts a prefix. A round that accepted all
    of its ``k`` drafts ended without a rejection; every other round ended with exactly one.
    With ``A`` accepted tokens and ``R`` rejections the maximum-likelihood estimate is
    ``A / (A + R)``; ``R = num_drafts - accepted_per_pos[k-1]`` (rounds whose last position was
    accepted). Exact for fixed-length drafts; with shorter (adaptive) drafts it counts a round
    that stopped early without a rejection as rejected, so it is a lower bound there.
    ``None`` without drafts.
    """
    if num_drafts <= 0:
        return None
    full = 0.0
    if accepted_per_pos is not None and len(accepted_per_pos) >= k >= 1:
        full = float(accepted_per_pos[k - 1])
    rejections = max(float(num_drafts) - full, 0.0)
    total = float(num_accepted) + rejections
    return float(num_accepted) / total if total > 0 else 1.0


def wall_cost_ratio(seconds: float, steps: int, draft_forwards: int,
                    plain_step_s: float) -> float:
    """Draft-step cost over a plain decoding step, inferred from wall time.

    A speculative run of ``steps`` engine steps with ``draft_forwards`` draft forwards took
    ``seconds``; a plain step of the same cell took ``plain_step_s``. Assuming a verification step
    costs a plain step, ``seconds = steps * plain_step_s + draft_forwards * c_draft``, so
    ``r = c_draft / plain_step_s``. The extra cost of verifying k + 1 tokens instead of one (and
    every other per-step overhead of speculation) is charged to the draft, so this ``r`` is an
    upper bound of the draft forward's own cost; it is never below 0.
    """
    if draft_forwards <= 0 or plain_step_s <= 0:
        raise ValueError("need draft_forwards > 0 and plain_step_s > 0")
    return max(seconds - steps * plain_step_s, 0.0) / draft_forwards / plain_step_s


def _median(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def summarize(runs: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Aggregate raw run records into one row per (cell, method).

    A run record has ``cell`` (a dict: dataset, temperature, batch), ``method``, ``rep``,
    ``tokens``, ``seconds``, ``tokens_per_s``, ``group`` (the method group it ran in) and
    optionally ``spec`` (counter deltas:
    num_drafts, num_draft_tokens, num_accepted_tokens, num_accepted_tokens_per_pos), ``k``,
    ``drafter`` (draft_cost_s, step_cost_s, ...), ``identical`` / ``compared`` (greedy outputs
    equal to plain's), ``error``. The baseline's method name is ``"plain"``; every other run is
    paired with the plain run of the same cell, group and rep (``ratio`` = its tokens/s over
    plain's).
    """
    runs = list(runs)
    plain: dict[tuple, float] = {}
    plain_step: dict[tuple, float] = {}  # seconds per plain decoding step
    plain_wall_step: dict[tuple, float] = {}  # wall seconds per step, prefills included
    for rr in runs:
        if rr["method"] == "plain" and rr.get("tokens_per_s"):
            key = (_cell_key(rr["cell"]), rr.get("group", 0), rr["rep"])
            plain[key] = rr["tokens_per_s"]
            if rr.get("plain_steps"):
                plain_wall_step[key] = rr["seconds"] / rr["plain_steps"]
            # vLLM's mean inter-token latency (prefills excluded); older records: wall per step
            step = rr.get("decode_step_s") or plain_wall_step.get(key)
            if step:
                plain_step[key] = step
    groups: dict[tuple, list[Mapping[str, Any]]] = {}
    order: list[tuple] = []
    for rr in runs:
        key = (_cell_key(rr["cell"]), rr["method"])
        if key not in groups:
            groups[key] = []
            order.append(key)
        groups[key].append(rr)
    rows = []
    for key in order:
        group = groups[key]
        first = group[0]
        row: dict[str, Any] = {**first["cell"], "method": first["method"]}
        if first.get("ideal_source"):
            row["ideal_source"] = first["ideal_source"]
        errors = [g["error"] for g in group if g.get("error")]
        if errors:
            row["error"] = errors[0]
        ok = [g for g in group if g.get("tokens_per_s")]
        tps = [g["tokens_per_s"] for g in ok]
        row["runs"] = len(ok)
        row["tokens_per_s"] = _median(tps)
        ratios = []
        for g in ok:
            base = plain.get((_cell_key(g["cell"]), g.get("group", 0), g["rep"]))
            if base:
                ratios.append(g["tokens_per_s"] / base)
        if first["method"] == "plain":
            ratios = [1.0] * len(ok)
        row["ratio_median"] = _median(ratios)
        row["ratio_min"] = min(ratios) if ratios else None
        row["ratio_max"] = max(ratios) if ratios else None
        row["ratios"] = ratios
        # spec-decode counters, summed over runs
        spec = _sum_spec([g["spec"] for g in ok if g.get("spec")])
        k = max((int(g.get("k") or 0) for g in ok), default=0)
        row["k"] = k or None
        if spec and spec.get("num_draft_tokens", 0) > 0:
            drafts = spec["num_drafts"]
            row["acceptance"] = spec["num_accepted_tokens"] / spec["num_draft_tokens"]
            row["mean_accepted_length"] = 1.0 + spec["num_accepted_tokens"] / drafts
            row["mean_draft_length"] = spec["num_draft_tokens"] / drafts
            per_pos = spec.get("num_accepted_tokens_per_pos") or []
            row["per_position_acceptance"] = [c / drafts for c in per_pos]
            row["per_token_acceptance"] = per_token_acceptance(
                spec["num_accepted_tokens"], drafts, per_pos, k or len(per_pos)
            )
        elif spec is not None and k:
            row["acceptance"] = None
            row["mean_draft_length"] = 0.0
        costs, verify_ratios = [], []
        for g in ok:
            d = g.get("drafter") or {}
            c_p = plain_step.get((_cell_key(g["cell"]), g.get("group", 0), g["rep"]))
            base = c_p or d.get("plain_step_s") or d.get("step_cost_s")
            draft_s, verify_k = drafter_costs(d, int(g["cell"].get("batch") or 1), k)
            if draft_s and base:
                costs.append((draft_s, base))
            if verify_k and base:
                verify_ratios.append(verify_k / base)
        if costs:
            row["cost_ratio"] = _median([d / s for d, s in costs])
            row["draft_step_ms"] = _median([1e3 * d for d, _ in costs])
            row["plain_step_ms"] = _median([1e3 * s for _, s in costs])
        if verify_ratios:
            row["verify_cost_ratio"] = _median(verify_ratios)
        walls = []
        for g in ok:
            d = g.get("drafter") or {}
            # wall time against wall time: the prefills are in both
            c_p = plain_wall_step.get((_cell_key(g["cell"]), g.get("group", 0), g["rep"]))
            if c_p and d.get("steps") and d.get("draft_forwards"):
                walls.append(wall_cost_ratio(g["seconds"], d["steps"], d["draft_forwards"], c_p))
        if walls:
            row["cost_ratio_wall"] = _median(walls)
        off = [g["drafter"].get("drafting_off_share") for g in ok if g.get("drafter")]
        off = [x for x in off if x is not None]
        if off:
            row["drafting_off_share"] = _median(off)
        lookup = [g["drafter"]["lookup_tokens"] / g["drafter"]["draft_tokens"] for g in ok
                  if (g.get("drafter") or {}).get("draft_tokens")
                  and g["drafter"].get("lookup_tokens") is not None]
        if lookup:
            row["lookup_share"] = _median(lookup)
        rss = [g["peak_rss_bytes"] for g in group if g.get("peak_rss_bytes")]
        if rss:
            row["peak_rss_mb"] = max(rss) / 2**20
        compared = sum(int(g.get("compared") or 0) for g in ok)
        if compared:
            row["identical"] = f"{sum(int(g.get('identical') or 0) for g in ok)}/{compared}"
        loads = [g["load"][0] for g in group if g.get("load")]
        if loads:
            row["load1_median"] = _median(loads)
        rows.append(row)
    add_ideal(rows)
    return rows


def drafter_costs(drafter: Mapping[str, Any], batch: int,
                  k: int | None) -> tuple[float | None, float | None]:
    """``(one draft forward over the batch, a step verifying k drafts per request)`` in seconds,
    from the drafter's cost table at the cell's batch-size bucket; records without the table (or
    without that bucket) fall back to the figures the drafter gave for its latest step."""
    table = drafter.get("cost_table_s") or drafter.get("cost_table") or {}  # the latter: older
    b = bucket(batch)  # as the drafter keys its cost table
    draft_s = (table.get("draft") or {}).get(str(b))
    verify_s = (table.get("verify") or {}).get(f"{b}:{k:g}") if k else None
    if draft_s is None:
        draft_s = drafter.get("draft_cost_s")
    if verify_s is None and k:
        verify_s = (drafter.get("verify_cost_s") or {}).get(f"{k:g}")
    return draft_s, verify_s


def add_ideal(rows: list[dict[str, Any]]) -> None:
    """Fill ``ideal_speedup`` / ``best_k`` / ``efficiency`` of selfspec rows.

    The ideal of a skip set in a cell comes from the fixed-k run of the same skip set (its
    ``ideal_source``, a method name; rows without one get no ideal): ``a`` = its per-token
    acceptance, ``r`` = its measured draft-forward / plain-step cost ratio, ``verify_ratio`` =
    its measured cost of verifying ``k`` drafts per request over a plain step (1.0 when not
    measured), ``k_max`` = its k. Efficiency = achieved ratio (median) / ideal.
    """
    by_key = {(_cell_key(r), r["method"]): r for r in rows}
    for row in rows:
        src_name = row.get("ideal_source")
        if src_name is None:
            continue
        src = by_key.get((_cell_key(row), src_name))
        if src is None:
            continue
        a, r, k = src.get("per_token_acceptance"), src.get("cost_ratio"), src.get("k")
        if a is None or r is None or not k:
            continue
        ideal, best_k = ideal_speedup(a, r, k, src.get("verify_cost_ratio") or 1.0)
        row["ideal_speedup"] = ideal
        row["ideal_k"] = best_k
        if row.get("ratio_median"):
            row["efficiency"] = row["ratio_median"] / ideal


def _cell_key(cell: Mapping[str, Any]) -> tuple:
    return (cell.get("model_label"), cell.get("dataset"), cell.get("temperature"),
            cell.get("batch"))


def _sum_spec(items: list[Mapping[str, Any]]) -> dict[str, Any] | None:
    if not items:
        return None
    out: dict[str, Any] = {}
    for it in items:
        for key, v in it.items():
            if isinstance(v, list):
                prev = out.get(key) or []
                n = max(len(prev), len(v))
                out[key] = [(prev[i] if i < len(prev) else 0) + (v[i] if i < len(v) else 0)
                            for i in range(n)]
            else:
                out[key] = out.get(key, 0) + v
    return out


# ------------------------------------------------------------------------------------ tables

COLUMNS: list[tuple[str, str]] = [
    ("model_label", "model"),
    ("dataset", "data"),
    ("temperature", "T"),
    ("batch", "batch"),
    ("method", "method"),
    ("tokens_per_s", "tok/s"),
    ("ratio", "x plain (median [min, max])"),
    ("acceptance", "accept"),
    ("mean_accepted_length", "mean acc. len"),
    ("per_position_acceptance", "per-position acceptance"),
    ("cost_ratio", "draft/plain cost"),
    ("verify_cost_ratio", "verify k/plain cost"),
    ("cost_ratio_wall", "r (wall)"),
    ("ideal_speedup", "ideal"),
    ("efficiency", "efficiency"),
    ("drafting_off_share", "drafting off"),
    ("lookup_share", "lookup share"),
    ("peak_rss_mb", "peak RSS MB"),
    ("identical", "greedy identical"),
    ("runs", "runs"),
]


def _fmt(key: str, row: Mapping[str, Any]) -> str:
    if key == "ratio":
        med = row.get("ratio_median")
        if med is None:
            return "-"
        if row.get("method") == "plain":
            return "1.00"
        return f"{med:.2f} [{row['ratio_min']:.2f}, {row['ratio_max']:.2f}]"
    v = row.get(key)
    if v is None or v == "":
        return "-"
    if key == "per_position_acceptance":
        return " ".join(f"{x:.2f}" for x in v) if v else "-"
    if key in ("peak_rss_mb", "tokens_per_s"):
        return f"{v:.0f}" if key == "peak_rss_mb" else f"{v:.1f}"
    if key == "temperature":
        return f"{v:g}"
    if isinstance(v, float):
        return f"{v:.3f}" if "cost_ratio" in key else f"{v:.2f}"
    return str(v).replace("|", "\\|")


def markdown_preamble(result: Mapping[str, Any], title: str, setup: str,
                      load_context: str) -> list[str]:
    """The lines every suite's Markdown starts with: title, partial-run banner, when / where it
    ran, ``setup`` (what was run), and the machine's load during the run."""
    host = result["host"]
    lines = [f"# Benchmark `{result['suite']}`{title}", ""]
    if result.get("partial"):
        lines += ["**Partial results (the run was still going or was interrupted).**", ""]
    lines += [
        f"Run {result['started_utc']} .. {result['finished_utc']} ({result['duration_s']:.0f} s) "
        f"on {host['cpus']} CPUs" + (f" of {host['cpu']}" if host.get("cpu") else "")
        + f" ({host.get('vllm', '?')}, torch {host.get('torch', '?')}"
        + (f", code {host['commit']}" if host.get("commit") else "") + "). "
        + setup,
        "",
    ]
    la = result.get("loadavg_1min")
    if la:
        lines += [f"Machine load (1-min load average, {load_context}): "
                  f"min {la['min']:.2f}, median {la['median']:.2f}, max {la['max']:.2f}.", ""]
    return lines


def markdown_table(rows: Sequence[Mapping[str, Any]],
                   columns: Sequence[tuple[str, str]] | None = None) -> str:
    """A GitHub Markdown table of summary rows. Columns that are empty in every row are dropped
    (so a suite without speculative methods has no acceptance columns); errors go in a
    ``note`` column."""
    columns = list(columns or COLUMNS)
    if any(r.get("error") for r in rows):
        columns.append(("error", "note"))
    keep = []
    for key, title in columns:
        if key in ("method",) or any(_fmt(key, r) != "-" for r in rows):
            keep.append((key, title))
    lines = ["| " + " | ".join(t for _, t in keep) + " |",
             "|" + "|".join("---" for _ in keep) + "|"]
    for r in rows:
        cells = []
        for key, _ in keep:
            text = _fmt(key, r)
            if key == "error" and text != "-":
                text = text.splitlines()[0][:160]
            cells.append(text)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------- plots

def write_plots(rows: Sequence[Mapping[str, Any]], out_prefix: str | Path) -> list[Path]:
    """PNG plots next to the results: ``<prefix>_ratio.png`` (tokens/s ratio to plain, median
    with min-max bars, per cell and method), ``<prefix>_acceptance.png`` (per-position
    acceptance of the speculative methods) and ``<prefix>_ideal.png`` (achieved vs ideal speedup
    of selfspec rows). Returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_prefix = Path(out_prefix)
    written: list[Path] = []
    spec_rows = [r for r in rows if r["method"] != "plain" and r.get("ratio_median")]
    if spec_rows:
        cells = _unique([_cell_label(r) for r in spec_rows])
        methods = _unique([r["method"] for r in spec_rows])
        width_in = max(6.0, 0.55 * len(cells) * max(1, len(methods)) + 2)
        fig, ax = plt.subplots(figsize=(width_in, 4.5))
        width = 0.8 / len(methods)
        for mi, m in enumerate(methods):
            xs, ys, lo, hi = [], [], [], []
            for ci, c in enumerate(cells):
                r = next((r for r in spec_rows if r["method"] == m and _cell_label(r) == c), None)
                if r is None:
                    continue
                xs.append(ci + (mi - (len(methods) - 1) / 2) * width)
                ys.append(r["ratio_median"])
                lo.append(r["ratio_median"] - r["ratio_min"])
                hi.append(r["ratio_max"] - r["ratio_median"])
            ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, label=m)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(range(len(cells)))
        ax.set_xticklabels(cells, rotation=45, ha="right", fontsize=7)
        ax.set_ylabel("tokens/s ÷ plain vLLM (median, min–max)")
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = out_prefix.with_name(out_prefix.name + "_ratio.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    acc_rows = [r for r in rows if r.get("per_position_acceptance")]
    if acc_rows:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for r in acc_rows:
            pp = r["per_position_acceptance"]
            ax.plot(range(1, len(pp) + 1), pp, marker="o", ms=3,
                    label=f"{r['method']} {_cell_label(r)}")
        ax.set_xlabel("draft position")
        ax.set_ylabel("accepted / draft rounds")
        ax.set_ylim(0, 1.05)
        if len(acc_rows) <= 16:
            ax.legend(fontsize=6)
        fig.tight_layout()
        path = out_prefix.with_name(out_prefix.name + "_acceptance.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    ideal_rows = [r for r in rows if r.get("ideal_speedup") and r.get("ratio_median")]
    if ideal_rows:
        fig, ax = plt.subplots(figsize=(6, 5))
        for m in _unique([r["method"] for r in ideal_rows]):
            pts = [r for r in ideal_rows if r["method"] == m]
            ax.scatter([r["ideal_speedup"] for r in pts], [r["ratio_median"] for r in pts],
                       label=m, s=18)
        top = max(max(r["ideal_speedup"] for r in ideal_rows),
                  max(r["ratio_median"] for r in ideal_rows)) * 1.05
        ax.plot([0, top], [0, top], "k--", lw=0.8, label="achieved = ideal")
        ax.plot([0, top], [0, 0.9 * top], "k:", lw=0.8, label="90% of ideal")
        ax.set_xlabel("ideal speedup (measured acceptance and cost ratio)")
        ax.set_ylabel("achieved speedup (median)")
        ax.set_xlim(0, top)
        ax.set_ylim(0, top)
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = out_prefix.with_name(out_prefix.name + "_ideal.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def _cell_label(r: Mapping[str, Any]) -> str:
    parts = []
    if r.get("model_label"):
        parts.append(str(r["model_label"]))
    if r.get("dataset"):
        parts.append(str(r["dataset"]))
    parts.append(f"T={r.get('temperature', 0):g}")
    parts.append(f"B={r.get('batch')}")
    return " ".join(parts)


def _unique(xs: Iterable[Any]) -> list[Any]:
    out: list[Any] = []
    for x in xs:
        if x not in out:
            out.append(x)
    return out


def pivot_table(rows: Sequence[Mapping[str, Any]], *, row_keys: Sequence[str] = ("method",),
                col_keys: Sequence[str] = ("batch",), where: Mapping[str, Any] | None = None,
                with_acceptance: bool = True) -> str:
    """A compact Markdown table: one line per ``row_keys`` value, one column per ``col_keys``
    value, cells ``median ratio [min-max]`` (and ``a=acceptance`` when known). ``where`` filters
    rows by equal values. For headlines (README)."""
    sel = [r for r in rows if all(r.get(k) == v for k, v in (where or {}).items())
           and r.get("method") != "plain"]
    cols = _unique([tuple(r.get(k) for k in col_keys) for r in sel])
    lines_keys = _unique([tuple(r.get(k) for k in row_keys) for r in sel])
    if "method" in row_keys:  # group by the other keys, methods in order of appearance
        mi = list(row_keys).index("method")

        def others(lk: tuple) -> tuple:
            return tuple(x for j, x in enumerate(lk) if j != mi)

        groups = _unique([others(lk) for lk in lines_keys])
        methods = _unique([lk[mi] for lk in lines_keys])
        lines_keys = sorted(lines_keys,
                            key=lambda lk: (groups.index(others(lk)), methods.index(lk[mi])))

    def col_title(c: tuple) -> str:
        return " ".join(f"B={v}" if k == "batch" else f"T={v:g}" if k == "temperature"
                        else str(v) for k, v in zip(col_keys, c, strict=True))

    out = ["| " + " | ".join(list(row_keys) + [col_title(c) for c in cols]) + " |",
           "|" + "|".join("---" for _ in range(len(row_keys) + len(cols))) + "|"]
    for lk in lines_keys:
        cells = [str(x) for x in lk]
        for c in cols:
            r = next((r for r in sel if tuple(r.get(k) for k in row_keys) == lk
                      and tuple(r.get(k) for k in col_keys) == c), None)
            if r is None or r.get("ratio_median") is None:
                cells.append("-" if r is None or not r.get("error") else "n/a")
                continue
            text = (f"{r['ratio_median']:.2f} [{r['ratio_min']:.2f}-{r['ratio_max']:.2f}]")
            if with_acceptance and r.get("acceptance") is not None:
                text += f", a={r['acceptance']:.2f}"
            cells.append(text)
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"
