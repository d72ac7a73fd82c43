"""Fast tests of the bf16-agreement benchmark's arithmetic and output (no engines)."""

from __future__ import annotations

import json

import pytest

from benchmarks import bf16_agreement as bf


def test_first_divergence():
    assert bf.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert bf.first_divergence([], []) is None
    assert bf.first_divergence([9, 2, 3], [1, 2, 3]) == 0
    assert bf.first_divergence([1, 2, 4], [1, 2, 3]) == 2
    # one stopped earlier (EOS): they diverge where the shorter one ends
    assert bf.first_divergence([1, 2], [1, 2, 3]) == 2
    assert bf.first_divergence([1, 2, 3, 4], [1, 2, 3]) == 3


def test_compare_known_values():
    reference = [[1, 2, 3, 4], [5, 6, 7, 8], [1, 1, 1, 1], [2, 2]]
    outputs = [
        [1, 2, 3, 4],  # identical
        [5, 6, 0, 8],  # diverges at 2; position 3 matches again by accident
        [0, 1, 1, 1],  # diverges at 0
        [2, 2, 2],  # extends the reference: diverges at 2, reproduces all of it
    ]
    c = bf.compare(outputs, reference)
    assert c["n"] == 4 and c["identical"] == 1 and c["diverged"] == 3
    assert c["identical_share"] == pytest.approx(0.25)
    assert c["first_divergences"] == [2, 0, 2]
    assert c["mean_first_divergence"] == pytest.approx(4 / 3)
    assert c["median_first_divergence"] == 2
    assert c["reference_tokens"] == 14
    # prefix tokens: 4 + 2 + 0 + 2 = 8 of 14
    assert c["token_agreement"] == pytest.approx(8 / 14)
    # positional matches: 4 + 3 + 3 + 2 = 12 over the longer lengths 4 + 4 + 4 + 3 = 15
    assert c["positional_agreement"] == pytest.approx(12 / 15)


def test_compare_all_identical_and_errors():
    c = bf.compare([[1, 2], [3]], [[1, 2], [3]])
    assert c["identical_share"] == 1.0 and c["token_agreement"] == 1.0
    assert c["mean_first_divergence"] is None and c["diverged"] == 0
    with pytest.raises(ValueError):
        bf.compare([[1]], [[1], [2]])


def _runs() -> list[dict]:
    ref1 = [[1, 2, 3], [4, 5, 6]]
    ref8 = [[1, 2, 3], [4, 5, 0]]  # plain itself moves with the batch shape
    return [
        {"dtype": "bfloat16", "batch": 1, "method": "plain", "outputs": ref1},
        {"dtype": "bfloat16", "batch": 1, "method": "selfspec fixed k",
         "outputs": [[1, 2, 3], [4, 9, 9]],
         "spec": {"num_draft_tokens": 8, "num_accepted_tokens": 6}},
        {"dtype": "bfloat16", "batch": 8, "method": "plain", "outputs": ref8},
        {"dtype": "bfloat16", "batch": 8, "method": "selfspec fixed k", "outputs": ref8,
         "spec": {"num_draft_tokens": 0, "num_accepted_tokens": 0}},
        {"dtype": "float32", "batch": 1, "method": "ngram", "outputs": ref1},
        {"dtype": "float32", "batch": 1, "method": "selfspec", "error": "failed to start"},
    ]


def test_summarize_references_and_rows():
    rows = bf.summarize(_runs(), ["humaneval", "mtbench"])
    by = {(r["dtype"], r["batch"], r["method"]): r for r in rows}
    # a method against plain of the same dtype and batch size
    r = by[("bfloat16", 1, "selfspec fixed k")]
    assert r["identical"] == 1 and r["first_divergences"] == [1]
    assert r["acceptance"] == pytest.approx(0.75) and r["drafted"] == 8
    assert r["identical_by_dataset"] == {"humaneval": [1, 1], "mtbench": [0, 1]}
    # at batch 8 it equals plain at batch 8 (not plain at batch 1)
    assert by[("bfloat16", 8, "selfspec fixed k")]["identical"] == 2
    assert by[("bfloat16", 8, "selfspec fixed k")]["acceptance"] is None
    # plain at batch 8 against plain at batch 1
    pp = by[("bfloat16", 8, "plain vs plain B=1")]
    assert pp["identical"] == 1 and pp["first_divergences"] == [2]
    assert "acceptance" not in pp
    # no plain run of that dtype: an error row, not a comparison with the wrong reference
    assert "no plain run" in by[("float32", 1, "ngram")]["error"]
    assert by[("float32", 1, "selfspec")]["error"] == "failed to start"
    assert ("bfloat16", 1, "plain") not in by and ("bfloat16", 1, "plain vs plain B=1") not in by
    assert [r["dtype"] for r in rows] == sorted((r["dtype"] for r in rows),
                                                 key=bf.DTYPES.index)


def test_written_json_round_trips_and_markdown(tmp_path):
    args = bf.parse_args(["--dtypes", "bfloat16", "--batches", "8", "--prompts", "2"])
    assert args.batches == [1, 8]  # batch 1 is always run: the batch-shape reference
    doc = {"plan": bf.plan(args), "runs": _runs(), "partial": False,
           "started_utc": "x", "finished_utc": "y", "duration_s": 1.0, "host": {"cpus": 2},
           "datasets_per_prompt": ["humaneval", "mtbench"],
           "engines": [{"dtype": "bfloat16", "method": "plain", "start_s": 1.0,
                        "enforce_eager": False, "compilation_mode": "VLLM_COMPILE",
                        "async_scheduling": True}]}
    doc["summary"] = bf.summarize(doc["runs"], doc["datasets_per_prompt"])
    bf.write(doc, tmp_path)
    text = (tmp_path / "bf16-agreement.json").read_text()
    assert json.loads(text) == json.loads(json.dumps(doc))
    assert "[4, 9, 9]" in text  # a token-id list on one line
    md = (tmp_path / "bf16-agreement.md").read_text()
    assert "| bf16 | 1 | selfspec fixed k | 1/2 (50.0%) | 1.0 | 66.7% |" in md
    assert "| bf16 | 8 | plain vs plain B=1 | 1/2 (50.0%) | 2.0 | 83.3% |" in md
    assert "error: no plain run" in md


def test_plan_methods_and_cli_dry_run(capsys):
    assert bf.main(["--dry-run", "--methods", "ngram"]) == 0
    p = json.loads(capsys.readouterr().out)
    assert list(p["methods"]) == ["plain", "ngram"] and p["compiled"] is True
    ms = bf.methods(4)
    assert ms["selfspec fixed k"]["adaptive"] is False and ms["selfspec"]["adaptive"] is True
    assert ms["selfspec fixed k"]["profile"] == bf.SMOLLM2_PROFILE
    with pytest.raises(SystemExit):
        bf.parse_args(["--prompts", "0"])


def test_merge_of_runs_done_per_dtype():
    args = bf.parse_args(["--dtypes", "bfloat16", "--prompts", "2"])

    def doc(dtype: str, runs: list[dict], start: str) -> dict:
        plan = {**bf.plan(args), "dtypes": [dtype]}
        return {"plan": plan, "runs": runs, "engines": [], "partial": False,
                "started_utc": start, "finished_utc": start, "duration_s": 1.0,
                "datasets_per_prompt": ["humaneval", "mtbench"]}

    bf16 = doc("bfloat16", [r for r in _runs() if r["dtype"] == "bfloat16"], "a")
    fp32_runs = [{"dtype": "float32", "batch": 1, "method": "plain", "outputs": [[1], [2]]},
                 {"dtype": "float32", "batch": 1, "method": "ngram", "outputs": [[1], [3]]}]
    merged = bf.merge([bf16, doc("float32", fp32_runs, "b")])
    assert merged["plan"]["dtypes"] == ["bfloat16", "float32"]
    by = {(r["dtype"], r["batch"], r["method"]): r for r in merged["summary"]}
    assert by[("float32", 1, "ngram")]["identical"] == 1  # compared with fp32 plain only
    assert by[("bfloat16", 1, "selfspec fixed k")]["identical"] == 1
    other = doc("float32", fp32_runs, "b")
    other["plan"]["max_tokens"] += 1
    with pytest.raises(ValueError, match="max_tokens"):
        bf.merge([bf16, other])


def test_merge_of_runs_with_their_own_plain_reference():
    """Two runs of the same dtype (e.g. a later run adding methods) each compare with their own
    plain decoding, and rows both runs hold name the later run."""
    args = bf.parse_args(["--dtypes", "bfloat16", "--prompts", "2"])

    def doc(runs: list[dict], start: str) -> dict:
        return {"plan": bf.plan(args), "runs": runs, "engines": [], "partial": False,
                "started_utc": start, "finished_utc": start, "duration_s": 1.0,
                "datasets_per_prompt": ["humaneval", "mtbench"]}

    def run(batch: int, method: str, outputs: list[list[int]]) -> dict:
        return {"dtype": "bfloat16", "batch": batch, "method": method, "outputs": outputs}

    first = doc([run(1, "plain", [[1], [2]]), run(8, "plain", [[1], [2]]),
                 run(1, "selfspec fixed k", [[1], [2]])], "a")
    # the second run's plain differs from the first's at prompt 2; its ngram equals its own plain
    second = doc([run(1, "plain", [[1], [5]]), run(8, "plain", [[1], [5]]),
                  run(1, "ngram", [[1], [5]])], "b")
    rows = bf.merge([first, second])["summary"]
    by = {(r["batch"], r["method"]): r for r in rows}
    assert by[(1, "ngram")]["identical"] == 2 and by[(1, "ngram")]["source"] == 1
    own = by[(1, "selfspec fixed k")]
    assert own["identical"] == 2 and "source" not in own
    assert by[(8, "plain vs plain B=1")]["identical"] == 2
    assert by[(8, "plain vs plain B=1 (run 2)")]["identical"] == 2
    assert len(rows) == 4
