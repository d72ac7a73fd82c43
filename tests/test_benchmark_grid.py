"""The acceptance grid over stored hybrid results (``benchmarks.grid``): no engines."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import grid


def _row(method: str, ratio: float, *, dataset: str = "humaneval", temperature: float = 0.0,
         batch: int = 1, identical: str | None = None) -> dict:
    row = {"model_label": "SmolLM2, its shipped profile", "dataset": dataset,
           "temperature": temperature, "batch": batch, "method": method,
           "ratio_median": ratio, "ratio_min": ratio - 0.05, "ratio_max": ratio + 0.05}
    if identical:
        row["identical"] = identical
    return row


def _write(folder: Path, started: str, rows: list[dict], commit: str | None = None) -> Path:
    folder.mkdir(parents=True)
    plain = [{**r, "method": "plain", "ratio_median": 1.0} for r in rows[:1]]
    result = {"suite": "hybrid", "started_utc": started,
              "plan": {"max_tokens": 48, "groups": [
                  {"model": "smollm2", "label": "SmolLM2, its shipped profile"}]},
              "host": {"commit": commit} if commit else {},
              "summary": plain + rows}
    path = folder / "hybrid.json"
    path.write_text(json.dumps(result))
    return path


@pytest.fixture
def results(tmp_path: Path) -> Path:
    _write(tmp_path / "old", "2026-12-05 10:00:00 UTC", [
        _row(grid.HYBRID, 1.10, identical="10/10"),
        _row(grid.NGRAM, 1.50, identical="10/10"),
        _row(grid.HYBRID, 0.95, dataset="mtbench", batch=8),
        _row(grid.LAYER_SKIP, 0.96, dataset="mtbench", batch=8),
    ])
    _write(tmp_path / "new", "2026-12-06 10:00:00 UTC", [
        _row(grid.HYBRID, 1.45, identical="9/10"),
        _row(grid.LAYER_SKIP, 1.00, identical="10/10"),
    ], commit="abc123")
    return tmp_path


def test_newest_run_per_method_and_the_verdicts(results: Path):
    cells = grid.collect(grid.result_files([results]), root=results)
    he = cells[("smollm2", "humaneval", 0.0, 1)]
    assert he.hybrid.ratio == 1.45 and he.hybrid.run == "new"  # the newer run wins
    assert he.methods[grid.NGRAM].run == "old"  # a rival measured only in the older run stays
    assert he.rival()[0] == grid.NGRAM  # 1.50 beats layer skip's 1.00
    v = he.verdicts()
    assert v["plain"] is True
    assert v["rivals"] is False  # 1.45 < 0.97 * 1.50
    assert v["batch1"] is True  # HumanEval at batch 1: > 1.3
    assert v["identical"] is False  # 9/10
    mt = cells[("smollm2", "mtbench", 0.0, 8)].verdicts()
    assert mt["plain"] is False  # 0.95 < 0.98
    assert mt["rivals"] is True  # 0.95 >= 0.97 * 0.96
    assert mt["batch1"] is None and mt["identical"] is None  # not that cell / not compared


def test_markdown_and_plot(results: Path, tmp_path: Path, capsys):
    out = tmp_path / "grid"
    assert grid.main([str(results), "--out", str(out)]) == 0
    text = out.with_suffix(".md").read_text()
    assert "| smollm2 | humaneval | 0 | 1 | 1.45 [1.40-1.50] | 1.50 [1.45-1.55] |" in text
    assert "new (2026-12-06 10:00, code abc123), 48 tokens" in text  # the hybrid number's source
    assert "old (2026-12-05 10:00)" in text  # the rival's, another run
    assert "Cells missing a target: plain 1, rivals 1, batch1 0, identical 1." in text
    assert out.with_suffix(".png").stat().st_size > 0
    assert "wrote" in capsys.readouterr().out
    # an excluded folder's rows are gone: the HumanEval cell's ngram came only from "old"
    assert grid.main([str(results), "--exclude", str(results / "old"), "--out", str(out)]) == 0
    assert "rivals 0" in out.with_suffix(".md").read_text()
