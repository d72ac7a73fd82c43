"""The hybrid drafter's acceptance grid, from the stored ``hybrid`` suite results.

``python -m benchmarks.grid`` reads every ``hybrid*.json`` under ``benchmarks/results`` (or the
files and folders given), keeps for each cell (model, dataset, temperature, batch) and method the
newest run that measured it, and checks the selfspec hybrid drafter against the targets:

* at least ``PLAIN_FLOOR`` x plain vLLM (median tokens/s ratio over repetitions);
* at least ``RIVAL_SHARE`` x the better of vLLM's ``ngram`` and selfspec layer skip alone;
* above ``BATCH1_CODE_TARGET`` x plain on HumanEval at batch 1;
* greedy outputs identical to plain vLLM in every compared request.

A cell whose rivals were measured in another run than its hybrid row is compared across runs
(each ratio is to the plain engine of its own run); the table names the run of each number.
Writes ``<out>.md`` (the grid, one line per cell, with the verdicts) and ``<out>.png`` (hybrid
over plain per cell, one panel per model, failed targets marked). No vLLM needed.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PLAIN_FLOOR = 0.98
RIVAL_SHARE = 0.97
BATCH1_CODE_TARGET = 1.3
HYBRID, NGRAM, LAYER_SKIP = "selfspec hybrid", "ngram", "selfspec layer skip"
RIVALS = (NGRAM, LAYER_SKIP)
RESULTS = Path(__file__).parent / "results"

CellKey = tuple[str, str, float, int]  # model, dataset, temperature, batch


@dataclass
class Measured:
    """One method's summary row in one cell of one run."""

    row: Mapping[str, Any]
    run: str  # the result file's folder, relative to the results folder
    started: str  # the run's start, UTC
    max_tokens: int | None
    commit: str | None = None  # the code's commit (results since it was recorded)

    def source(self) -> str:
        """Where the number comes from: run folder, start, code."""
        code = f", code {self.commit}" if self.commit else ""
        return f"{self.run} ({self.started[:16]}{code})"

    @property
    def ratio(self) -> float | None:
        return self.row.get("ratio_median")


@dataclass
class Cell:
    key: CellKey
    methods: dict[str, Measured] = field(default_factory=dict)

    @property
    def hybrid(self) -> Measured | None:
        return self.methods.get(HYBRID)

    def rival(self) -> tuple[str, Measured] | None:
        """The better of ``ngram`` and layer skip alone, by median ratio."""
        known = [(m, self.methods[m]) for m in RIVALS
                 if m in self.methods and self.methods[m].ratio is not None]
        return max(known, key=lambda mm: mm[1].ratio, default=None)

    def verdicts(self) -> dict[str, bool | None]:
        """Each target: True met, False missed, None not measured / not applicable."""
        h = self.hybrid
        hr = h.ratio if h else None
        rival = self.rival()
        model, dataset, _, batch = self.key
        out: dict[str, bool | None] = {
            "plain": None if hr is None else hr >= PLAIN_FLOOR - 1e-9,
            "rivals": None if hr is None or rival is None
            else hr >= RIVAL_SHARE * rival[1].ratio - 1e-9,
            "batch1": None,
            "identical": None,
        }
        if dataset == "humaneval" and batch == 1:
            out["batch1"] = None if hr is None else hr > BATCH1_CODE_TARGET
        compared = [_identical(m.row) for m in self.methods.values()]
        compared = [c for c in compared if c is not None]
        if compared:
            out["identical"] = all(same == total for same, total in compared)
        return out


def _identical(row: Mapping[str, Any]) -> tuple[int, int] | None:
    """``(identical, compared)`` from a summary row's ``identical`` ("9/10"), None if absent."""
    text = row.get("identical")
    if not text or "/" not in str(text):
        return None
    same, total = str(text).split("/", 1)
    return int(same), int(total)


def _model_names(result: Mapping[str, Any]) -> dict[str, str]:
    """Summary rows name a group by its label; the plan maps labels to embedded model names."""
    return {g["label"]: g.get("model") or g["label"]
            for g in result.get("plan", {}).get("groups", [])}


def result_files(paths: Sequence[Path]) -> list[Path]:
    """The ``hybrid`` suite results among ``paths`` (files, or folders searched recursively)."""
    out: list[Path] = []
    for p in paths:
        if p.is_dir():
            out.extend(sorted(p.rglob("hybrid*.json")))
        elif p.suffix == ".json":
            out.append(p)
        else:
            raise SystemExit(f"not a result file or folder: {p}")
    return out


def collect(files: Iterable[Path], root: Path = RESULTS) -> dict[CellKey, Cell]:
    """Per cell, each method's newest measurement across ``files`` (runs marked partial count:
    their finished cells are whole)."""
    cells: dict[CellKey, Cell] = {}
    for f in files:
        result = json.loads(Path(f).read_text())
        if not str(result.get("suite", "")).startswith("hybrid"):
            continue
        names = _model_names(result)
        try:
            run = str(Path(f).resolve().parent.relative_to(root.resolve())) or "."
        except ValueError:
            run = str(Path(f).parent)
        started = str(result.get("started_utc", ""))
        max_tokens = result.get("plan", {}).get("max_tokens")
        commit = result.get("host", {}).get("commit")
        for row in result.get("summary", []):
            if row.get("method") == "plain" or row.get("ratio_median") is None:
                continue
            label = str(row.get("model_label", ""))
            key = (names.get(label, label.split(",")[0]).lower(), str(row["dataset"]),
                   float(row.get("temperature", 0.0)), int(row["batch"]))
            cell = cells.setdefault(key, Cell(key))
            old = cell.methods.get(row["method"])
            if old is None or started > old.started:
                cell.methods[row["method"]] = Measured(row, run, started, max_tokens, commit)
    return dict(sorted(cells.items()))


def _mark(ok: bool | None) -> str:
    return "-" if ok is None else "yes" if ok else "**no**"


def _ratio(m: Measured | None) -> str:
    if m is None or m.ratio is None:
        return "-"
    r = m.row
    return f"{m.ratio:.2f} [{r.get('ratio_min', m.ratio):.2f}-{r.get('ratio_max', m.ratio):.2f}]"


def markdown(cells: Mapping[CellKey, Cell]) -> str:
    lines = [
        "# Hybrid drafts: the acceptance grid",
        "",
        f"Per cell, each method's newest run (`python -m benchmarks.grid`). Targets: hybrid >= "
        f"{PLAIN_FLOOR:g}x plain; >= {RIVAL_SHARE:g} x max(ngram, layer skip); > "
        f"{BATCH1_CODE_TARGET:g}x plain on HumanEval at batch 1; greedy outputs identical to "
        "plain. Ratios: tokens/s over plain vLLM of the same run and repetition, median "
        "[min-max]. `run`: the folder under `benchmarks/results/` and the start (UTC) of the run "
        "each number comes from.",
        "",
        "| model | data | T | B | hybrid | ngram | layer skip | >= plain floor | >= rivals | "
        "> batch-1 target | greedy identical | hybrid's run | "
        "rivals' runs, where not the hybrid's |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    missed = dict.fromkeys(("plain", "rivals", "batch1", "identical"), 0)
    for (model, dataset, temp, batch), cell in cells.items():
        if cell.hybrid is None:
            continue
        v = cell.verdicts()
        for name, ok in v.items():
            missed[name] += ok is False
        h = cell.hybrid
        rival_runs = sorted({m.source() for name, m in cell.methods.items()
                             if name in RIVALS and m.run != h.run})
        tokens = f", {h.max_tokens} tokens" if h.max_tokens else ""
        lines.append(
            f"| {model} | {dataset} | {temp:g} | {batch} | {_ratio(h)} | "
            f"{_ratio(cell.methods.get(NGRAM))} | {_ratio(cell.methods.get(LAYER_SKIP))} | "
            f"{_mark(v['plain'])} | {_mark(v['rivals'])} | {_mark(v['batch1'])} | "
            f"{_mark(v['identical'])} | {h.source()}{tokens} | "
            f"{'; '.join(rival_runs) or 'same run'} |")
    lines += ["", "Cells missing a target: " + ", ".join(
        f"{name} {n}" for name, n in missed.items()) + "."]
    return "\n".join(lines) + "\n"


def plot(cells: Mapping[CellKey, Cell], path: Path) -> Path:
    """One panel per model: rows dataset x temperature, columns batch size; colour and number
    the hybrid drafter's median ratio to plain; a red frame where a target is missed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import TwoSlopeNorm
    from matplotlib.patches import Rectangle

    with_hybrid = {k: c for k, c in cells.items() if c.hybrid and c.hybrid.ratio is not None}
    models = sorted({k[0] for k in with_hybrid})
    if not models:
        raise SystemExit("no hybrid rows in the results given")
    rows = sorted({(k[1], k[2]) for k in with_hybrid})  # the same rows and columns in
    cols = sorted({k[3] for k in with_hybrid})  # every panel, labelled once
    fig, axes = plt.subplots(1, len(models), figsize=(3.6 * len(models) + 2.4, 4.2),
                             squeeze=False, sharey=True, layout="constrained")
    ratios = [c.hybrid.ratio for c in with_hybrid.values()]
    norm = TwoSlopeNorm(vcenter=1.0, vmin=min(0.8, *ratios), vmax=max(1.6, *ratios))
    image = None
    for ax, model in zip(axes[0], models, strict=True):
        keys = [k for k in with_hybrid if k[0] == model]
        grid = [[float("nan")] * len(cols) for _ in rows]
        for k in keys:
            grid[rows.index((k[1], k[2]))][cols.index(k[3])] = with_hybrid[k].hybrid.ratio
        image = ax.imshow(grid, cmap="RdYlGn", norm=norm, aspect="auto")
        for k in keys:
            cell = with_hybrid[k]
            i, j = rows.index((k[1], k[2])), cols.index(k[3])
            missed = [n for n, ok in cell.verdicts().items() if ok is False]
            rival = cell.rival()
            text = f"{cell.hybrid.ratio:.2f}"
            if rival is not None:
                text += f"\n{rival[0].removeprefix('selfspec ')} {rival[1].ratio:.2f}"
            if missed:
                text += "\nmissed: " + ", ".join(missed)
                ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, ec="red", lw=2))
            ax.text(j, i, text, ha="center", va="center", fontsize=7)
        ax.set_xticks(range(len(cols)), [f"B={b}" for b in cols])
        ax.set_yticks(range(len(rows)), [f"{d} T={t:g}" for d, t in rows])
        ax.set_title(model, fontsize=10)
    fig.colorbar(image, ax=list(axes[0]), label="hybrid tokens/s ÷ plain vLLM (median)")
    fig.suptitle("selfspec hybrid: newest run per cell (red frame: a target missed)", fontsize=10)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.grid",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("paths", nargs="*", type=Path, default=[RESULTS],
                   help="result files or folders (default: benchmarks/results)")
    p.add_argument("--exclude", action="append", default=[], type=Path, metavar="FOLDER",
                   help="skip results under this folder (an experiment on changed code); "
                        "repeatable")
    p.add_argument("--out", type=Path, default=RESULTS / "hybrid-grid",
                   help="output prefix: <out>.md and <out>.png")
    args = p.parse_args(argv)
    excluded = [e.resolve() for e in args.exclude]
    files = [f for f in result_files(args.paths)
             if not any(f.resolve().is_relative_to(e) for e in excluded)]
    cells = collect(files)
    text = markdown(cells)
    args.out.with_suffix(".md").write_text(text)
    png = plot(cells, args.out.with_suffix(".png"))
    print(text)
    print(f"wrote {args.out.with_suffix('.md')} and {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
