"""Fast tests of the benchmark harness (no engines, no timing assertions)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks import analysis, gpu_step_cost, run
from vllm_selfspec.control.controller import expected_tokens

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------- ideal-speedup math

def test_expected_tokens():
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens(0.9, 0) == 1.0


def test_ideal_speedup_known_values():
    # free-layer model: a = 1, a draft step costs half a verification step
    assert analysis.ideal_speedup(1.0, 0.5, 4) == (pytest.approx(5 / 3), 4)
    # drafts that never land: no drafting is best
    assert analysis.ideal_speedup(0.0, 0.1, 8) == (1.0, 0)
    # free drafts: the longest draft wins
    assert analysis.ideal_speedup(0.8, 0.0, 6) == (pytest.approx(expected_tokens(0.8, 6)),
                                                   6)
    s, k = analysis.ideal_speedup(0.8, 0.2, 8)
    brute = max(expected_tokens(0.8, j) / (j * 0.2 + 1) for j in range(9))
    assert s == pytest.approx(brute) and 1 <= k <= 8
    with pytest.raises(ValueError):
        analysis.ideal_speedup(0.5, -1.0, 4)


@pytest.mark.parametrize("a,r", [(0.3, 0.5), (0.6, 0.3), (0.85, 0.5), (0.95, 0.1), (1.0, 0.7)])
def test_ideal_k_agrees_with_controller_model(a, r):
    """The analysis' best k is the controller's expected tokens per unit of time, maximised
    (free verification, a draft forward costing r plain steps; ties to the smaller k)."""
    rates = [expected_tokens(a, k) / (k * r + 1.0) for k in range(9)]
    assert analysis.ideal_speedup(a, r, 8)[1] == max(range(9), key=lambda k: (rates[k], -k))


def test_per_token_acceptance():
    # fixed k = 4, 10 rounds, all accepted: a = 1
    assert analysis.per_token_acceptance(40, 10, [10, 10, 10, 10], 4) == 1.0
    # nothing accepted: a = 0
    assert analysis.per_token_acceptance(0, 10, [0, 0, 0, 0], 4) == 0.0
    # geometric rounds with a = 0.5, k = 2, in expectation: per 4 rounds 2 reject at 0,
    # 1 accepts one then rejects, 1 accepts both -> A = 3, R = 3
    assert analysis.per_token_acceptance(3, 4, [2, 1], 2) == pytest.approx(0.5)
    assert analysis.per_token_acceptance(0, 0, [], 4) is None


# ----------------------------------------------------------------------------- summary, table

def _records():
    cell = {"model_label": None, "dataset": "mixed", "temperature": 0.0, "batch": 1}
    recs = []
    for rep, (p, s, f) in enumerate([(10.0, 12.0, 11.0), (10.0, 11.0, 9.0), (8.0, 10.0, 8.0)]):
        recs.append({"cell": cell, "method": "plain", "rep": rep, "tokens": 100, "seconds": 1,
                     "tokens_per_s": p, "load": [1.0, 1.0, 1.0], "peak_rss_bytes": 2 << 30})
        recs.append({"cell": cell, "method": "selfspec", "rep": rep, "tokens": 100,
                     "seconds": 1, "tokens_per_s": s, "k": 4, "ideal_source": "fixed",
                     "spec": {"num_drafts": 10, "num_draft_tokens": 30,
                              "num_accepted_tokens": 15,
                              "num_accepted_tokens_per_pos": [8, 4, 2, 1]},
                     "drafter": {"draft_cost_s": 0.01, "step_cost_s": 0.05,
                                 "drafting_off_share": 0.25},
                     "compared": 2, "identical": 2})
        recs.append({"cell": cell, "method": "fixed", "rep": rep, "tokens": 100, "seconds": 1,
                     "tokens_per_s": f, "k": 4, "ideal_source": "fixed",
                     "spec": {"num_drafts": 10, "num_draft_tokens": 40,
                              "num_accepted_tokens": 20,
                              "num_accepted_tokens_per_pos": [8, 6, 4, 2]},
                     "drafter": {"draft_cost_s": 0.01, "step_cost_s": 0.05}})
    recs.append({"cell": cell, "method": "suffix", "rep": 0,
                 "error": "ValueError: Arctic Inference is required for suffix decoding"})
    return recs


def test_summarize_ratios_acceptance_ideal():
    rows = {r["method"]: r for r in analysis.summarize(_records())}
    s = rows["selfspec"]
    assert s["ratios"] == pytest.approx([1.2, 1.1, 1.25])
    assert s["ratio_median"] == pytest.approx(1.2)
    assert (s["ratio_min"], s["ratio_max"]) == (pytest.approx(1.1), pytest.approx(1.25))
    assert s["acceptance"] == pytest.approx(45 / 90)
    assert s["mean_accepted_length"] == pytest.approx(1 + 45 / 30)
    assert s["per_position_acceptance"] == pytest.approx([24 / 30, 12 / 30, 6 / 30, 3 / 30])
    assert s["cost_ratio"] == pytest.approx(0.2)
    assert s["identical"] == "6/6"
    assert s["drafting_off_share"] == pytest.approx(0.25)
    # the ideal comes from the fixed-k row: a = 60 / (60 + 30 - 6), r = 0.2, k <= 4
    f = rows["fixed"]
    a = 60 / (60 + (30 - 6))
    assert f["per_token_acceptance"] == pytest.approx(a)
    ideal, k = analysis.ideal_speedup(a, 0.2, 4)
    assert s["ideal_speedup"] == pytest.approx(ideal) and s["ideal_k"] == k
    assert s["efficiency"] == pytest.approx(1.2 / ideal)
    assert rows["plain"]["ratio_median"] == 1.0
    assert rows["plain"]["peak_rss_mb"] == pytest.approx(2048)
    assert rows["suffix"]["runs"] == 0 and "Arctic" in rows["suffix"]["error"]


def test_markdown_table():
    rows = analysis.summarize(_records())
    text = analysis.markdown_table(rows)
    lines = text.strip().splitlines()
    assert lines[0].startswith("| ") and "x plain" in lines[0] and "note" in lines[0]
    assert set(lines[1].replace("|", "")) == {"-"}
    assert len(lines) == 2 + 4
    assert all(line.count("|") == lines[0].count("|") for line in lines)
    selfspec = next(line for line in lines if "| selfspec |" in line)
    assert "1.20 [1.10, 1.25]" in selfspec and "0.80 0.40 0.20 0.10" in selfspec
    assert "Arctic Inference" in next(line for line in lines if "suffix" in line)
    # columns empty in every row are dropped
    plain_only = analysis.markdown_table([r for r in rows if r["method"] == "plain"])
    assert "accept" not in plain_only and "tok/s" in plain_only


def test_render_markdown_and_plots(tmp_path):
    rows = analysis.summarize(_records())
    result = {"suite": "unit", "partial": False, "started_utc": "s", "finished_utc": "f",
              "duration_s": 1.0, "plan": run.plan(run.build_suite("smoke")),
              "host": {"cpus": 2}, "loadavg_1min": {"min": 1.0, "median": 2.0, "max": 3.0},
              "summary": rows}
    md = run.render_markdown(result)
    assert md.startswith("# Benchmark `unit`") and "median 2.00" in md and "| selfspec |" in md
    written = analysis.write_plots(rows, tmp_path / "unit")
    assert {p.name for p in written} == {"unit_ratio.png", "unit_acceptance.png",
                                         "unit_ideal.png"}
    assert all(p.stat().st_size > 1000 for p in written)


# -------------------------------------------------------------------------------- CLI / plan

def test_smoke_suite_arguments():
    args = run.parse_args(["--suite", "smoke"])
    suite = run.configure(args)
    assert suite.name == "smoke" and suite.reps == 1 and suite.batches == [1, 4]
    names = [m.name for g in suite.groups for m in g.methods]
    assert {"selfspec", "selfspec fixed k", "ngram"} <= set(names)
    args = run.parse_args(["--suite", "smoke", "--reps", "2", "--batches", "1,2",
                           "--temperatures", "0,0.7", "--methods", "ngram",
                           "--max-tokens", "4", "--time-budget-min", "1"])
    suite = run.configure(args)
    assert (suite.reps, suite.batches, suite.temperatures, suite.max_tokens) == (
        2, [1, 2], [0.0, 0.7], 4)
    assert [m.name for g in suite.groups for m in g.methods] == ["ngram"]
    assert suite.time_budget_s == 60
    assert suite.batch1_prompts == 1  # the smoke suite's own
    suite = run.configure(run.parse_args(["--suite", "smoke", "--batch1-prompts", "8"]))
    assert suite.batch1_prompts == 8 and run.prompts_for(suite, 1) == 8
    assert run.plan(suite)["batch1_prompts"] == 8
    with pytest.raises(SystemExit):
        run.parse_args(["--suite", "smoke", "--batch1-prompts", "0"])
    with pytest.raises(SystemExit):
        run.parse_args(["--suite", "nope"])
    with pytest.raises(SystemExit):
        run.parse_args(["--suite", "smoke", "--reps", "0"])


def test_methods_option_takes_names_with_commas_and_refuses_unknown_ones():
    floor = "selfspec, every request capped at 0"
    suite = run.configure(run.parse_args(["--suite", "overhead-floor", "--methods", floor]))
    assert [m.name for g in suite.groups for m in g.methods] == [floor]
    suite = run.configure(run.parse_args(
        ["--suite", "hybrid", "--methods", "ngram,selfspec hybrid"]))
    assert {m.name for g in suite.groups for m in g.methods} == {"ngram", "selfspec hybrid"}
    with pytest.raises(SystemExit, match="'ngarm' is not a method of this suite"):
        run.configure(run.parse_args(["--suite", "hybrid", "--methods", "ngarm"]))


@pytest.mark.parametrize("name", run.SUITES)
def test_every_suite_has_a_plan(name):
    suite = run.build_suite(name)
    p = run.plan(suite)
    assert p["cells"] and p["groups"] and p["reps"] >= 1
    for g in suite.groups:
        for m in g.methods:
            assert m.kind in ("vllm", "hf")
            if m.ideal_source:
                assert any(x.name == m.ideal_source for x in g.methods)


def test_no_harm_suite_shape():
    suite = run.build_suite("no-harm")
    assert suite.batches == [1, 8, 32] and suite.temperatures == [0.0]
    assert [g.label[:3] for g in suite.groups] == ["(a)", "(b)", "(c)"]
    for g in suite.groups:
        assert [m.spec["adaptive"] for m in g.methods] == [True, False]
    bad = suite.groups[0].methods[0].spec
    assert len(bad["skip_attention"]) >= 12


def test_dry_run_prints_json(capsys):
    assert run.main(["--suite", "cpu-smollm2", "--dry-run"]) == 0
    p = json.loads(capsys.readouterr().out)
    assert p["suite"] == "cpu-smollm2" and len(p["cells"]) == 2 * 2 * 2
    methods = [m["name"] for g in p["groups"] for m in g["methods"]]
    assert {"selfspec", "selfspec fixed k", "ngram", "suffix", "hf generate",
            "hf early exit"} <= set(methods)


def test_second_model_suite_compile_and_model_choice(capsys):
    assert run.main(["--suite", "cpu-qwen-coder", "--compile", "--dry-run"]) == 0
    p = json.loads(capsys.readouterr().out)
    assert p["suite"] == "cpu-qwen-coder" and p["compile"] is True
    assert {g["model"] for g in p["groups"]} == {"qwen2.5-coder-0.5b"}
    online = [m for g in p["groups"] for m in g["methods"] if m["name"] == "selfspec online"]
    assert online and online[0]["online_cold_start"]
    assert online[0]["spec"]["layer_selection"] == "online"
    # --model swaps a model-agnostic suite's model and names its results after it
    suite = run.configure(run.parse_args(["--suite", "cpu-smollm2", "--model",
                                          "qwen2.5-coder-0.5b"]))
    assert suite.name == "cpu-smollm2-qwen2.5-coder-0.5b" and not suite.compile
    assert {g.model for g in suite.groups} == {"qwen2.5-coder-0.5b"}
    assert not any("SmolLM2" in (g.label or "") for g in suite.groups)
    hybrid = run.configure(run.parse_args(["--suite", "hybrid", "--model", "qwen2.5-coder-0.5b"]))
    assert {g.label for g in hybrid.groups} == {"qwen2.5-coder-0.5b, its shipped profile"}
    with pytest.raises(SystemExit, match="skip sets are SmolLM2's"):
        run.configure(run.parse_args(["--suite", "no-harm", "--model", "qwen2.5-coder-0.5b"]))
    with pytest.raises(SystemExit):
        run.parse_args(["--suite", "cpu-smollm2", "--model", "nope"])


def test_cold_start_spec_and_early_exit_layers():
    from tests.tiny_models import tiny_model_dir
    from vllm_selfspec.config import default_skip_set

    model = str(tiny_model_dir("bench-smoke", num_layers=4, hidden_size=128))
    groups = run._real_model_groups("tiny", online=True)
    methods = {m.name: m for g in groups for m in g.methods}
    spec = run.engine_spec(methods["selfspec online"], model, "tiny")
    attention, mlp = default_skip_set(4)
    assert spec["skip_attention"] == list(attention) and spec["skip_mlp"] == list(mlp)
    assert "skip_attention" not in methods["selfspec online"].spec  # the method is not mutated
    assert "skip_attention" not in run.engine_spec(methods["selfspec"], model, "tiny")
    assert run.hf_exit_layers(methods["hf early exit"], model) == 2
    assert run.hf_exit_layers(methods["hf generate"], model) is None


# ----------------------------------------------------------------------------- GPU cost script

def test_gpu_script_dry_run_tiny(tmp_path):
    rc = gpu_step_cost.main(["--tiny", "--device", "cpu", "--dtype", "float32",
                             "--batches", "1,2", "--context", "8", "--iters", "1",
                             "--out", str(tmp_path)])
    assert rc == 0
    result = json.loads((tmp_path / "gpu_step_cost.json").read_text())
    (model,) = result["models"]
    assert [r["batch"] for r in model["rows"]] == [1, 2]
    eager = model["rows"][0]["eager"]
    assert eager["full_s"] > 0 and eager["draft_s"] > 0
    assert set(eager["verify_s"]) == {"1", "2", "4", "8"}  # JSON keys
    assert set(eager["speedup"]) == {"0.7", "0.8", "0.9", "0.95"}
    assert "| everything eager | 1 |" in (tmp_path / "gpu_step_cost.md").read_text()
    # the draft pass: one per pass length, and the host drafter's (a host read per draft token)
    assert set(eager["pass_s"]) == set(eager["pass_per_token"]) == {"1", "4", "8"}
    assert set(model["rows"][0]["host_pass_s"]) == {"1", "4", "8"}
    assert set(eager["speedup_pass"]) == set(eager["speedup"])
    assert "Draft pass of 4 tokens per row, tiny" in (tmp_path / "gpu_step_cost.md").read_text()


def test_gpu_script_model_is_a_decoder():
    import torch

    model = gpu_step_cost.RandomLlama(gpu_step_cost.TINY, 4, 2, 8, torch.device("cpu"),
                                      torch.float32)
    ids = torch.randint(0, gpu_step_cost.TINY.vocab, (2, 3))
    with torch.inference_mode():
        out = model.step(ids)
        skipped = model.step(ids[:, :1], frozenset({1}), frozenset({2}))
    assert out.shape == (2, 3) and skipped.shape == (2, 1)


def test_gpu_script_projection_math():
    verify = {1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0}
    # free drafts, full acceptance: the longest draft
    assert gpu_step_cost.project(1.0, 0.0, verify, 1.0) == (pytest.approx(9.0), 8)
    assert gpu_step_cost.interp_verify({1: 1.0, 4: 4.0}, 2) == pytest.approx(2.0)
    lin = gpu_step_cost.linear_costs(full=10.0, no_attn=6.0, no_mlp=5.0, n_layers=4)
    assert lin == {"c_attn": 1.0, "c_mlp": 1.25, "base": pytest.approx(1.0)}
    assert gpu_step_cost.scaled(lin, 8, 2, 0) == pytest.approx(1.0 + 6 * 1.0 + 8 * 1.25)


def test_gpu_script_profiles_and_no_vllm():
    shape = gpu_step_cost.SHAPES["llama-2-13b"]
    attn, mlp, src = gpu_step_cost.skip_sets(shape)
    assert (len(attn), len(mlp)) == (24, 10) and "draft-verify" in src
    attn70, mlp70, _ = gpu_step_cost.skip_sets(gpu_step_cost.SHAPES["llama-2-70b"])
    assert (len(attn70), len(mlp70)) == (47, 37)
    attn8, mlp8, _ = gpu_step_cost.skip_sets(gpu_step_cost.SHAPES["llama-3-8b"])
    assert len(attn8) == 8 and mlp8 == []
    code = ("import sys, benchmarks.gpu_step_cost as g; g.skip_sets(g.SHAPES['llama-2-70b']); "
            "bad = [m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


# ------------------------------------------- controller changes made for the no-harm benchmark

def _ctl(**kw):
    from vllm_selfspec.control.controller import ControllerConfig, DraftLengthController

    kw.setdefault("explore_interval", 0)  # plain-step exploration has its own tests
    return DraftLengthController(ControllerConfig(k_max=4, probe_interval=4,
                                                  max_probe_interval=16, **kw))


def test_new_requests_start_from_the_engine_wide_acceptance():
    ctl = _ctl()
    assert ctl.engine_acceptance() == ctl.config.prior_acceptance
    assert ctl.plan(["a"])[0] > 0  # optimistic before anything was verified
    for _ in range(10):
        ctl.observe_verification("a", drafted=2, accepted=0)
    assert ctl.engine_acceptance() < 0.05
    ctl.retain([])
    # a new request of the same engine does not pay for drafts that never land
    assert ctl.plan(["b"]) == [0]
    # ... and the engine-wide estimate follows good drafts again
    ctl2 = _ctl()
    for _ in range(10):
        ctl2.observe_verification("a", drafted=4, accepted=4)
    assert ctl2.engine_acceptance() > 0.95
    assert ctl2.plan(["fresh"]) == [1]  # the ramp: nothing measured yet
    from vllm_selfspec.control.step_costs import StepCosts

    ctl2.set_step_costs(StepCosts(verify={(1, float(x)): 1.0 for x in range(5)}, draft={1: 0.5}))
    assert ctl2.plan(["fresh"]) == [4]
    # switched off, the old behaviour: every new request starts from prior_acceptance
    ctl3 = _ctl(engine_prior=False)
    for _ in range(10):
        ctl3.observe_verification("a", drafted=2, accepted=0)
    assert ctl3.plan(["b"])[0] > 0


def test_new_off_requests_inherit_the_probe_back_off():
    ctl = _ctl()
    budgets = []
    for _ in range(60):  # one request whose drafts and probes never land
        (k,) = ctl.plan(["a"])
        budgets.append(k)
        ctl.observe_verification("a", drafted=k, accepted=0)
    assert ctl._inherited_interval == 16  # backed off to the maximum
    ctl.retain([])
    plans = [ctl.plan(["b"])[0] for _ in range(16)]
    assert plans == [0] * 15 + [2]  # the first probe only after the inherited interval
    # a probe that lands brings the request back and resets the inherited interval
    ctl.observe_verification("b", drafted=2, accepted=2)
    assert ctl.plan(["b"])[0] > 0
    assert ctl._inherited_interval == 4


def test_pivot_table():
    rows = analysis.summarize(_records())
    text = analysis.pivot_table(rows, row_keys=("method",), col_keys=("batch",))
    lines = text.strip().splitlines()
    assert lines[0] == "| method | B=1 |"
    assert "| selfspec | 1.20 [1.10-1.25], a=0.50 |" in lines
    assert "| suffix | n/a |" in lines
    assert not any("plain" in line for line in lines)


def test_wall_cost_ratio():
    # 10 steps of 0.1 s plus 20 draft forwards of 0.05 s: r = 0.5
    assert analysis.wall_cost_ratio(2.0, 10, 20, 0.1) == pytest.approx(0.5)
    assert analysis.wall_cost_ratio(0.5, 10, 20, 0.1) == 0.0  # faster than plain: clipped
    recs = _records()
    for r in recs:
        if r["method"] == "plain":
            r["plain_steps"] = 50  # 1 s / 50 = 20 ms per plain step
        elif r["method"] == "fixed":
            r["drafter"].update(steps=20, draft_forwards=40)
    rows = {r["method"]: r for r in analysis.summarize(recs)}
    # 1 s = 20 * 0.02 + 40 * c  ->  c = 0.015  ->  r = 0.75
    assert rows["fixed"]["cost_ratio_wall"] == pytest.approx(0.75)
    assert "cost_ratio_wall" not in rows["selfspec"]


def test_batch_aware_budget():
    from vllm_selfspec.control.controller import ControllerConfig, DraftLengthController
    from vllm_selfspec.control.step_costs import StepCosts

    # batch 32: a draft forward costs 0.2 plain steps, verification is free
    c = DraftLengthController(ControllerConfig(k_max=4, explore_interval=0))
    c.set_step_costs(StepCosts(verify={(1, 0.0): 1.0, (32, 0.0): 1.0, (32, 4.0): 1.0},
                               draft={1: 0.2, 32: 0.2}))
    # one request with a = 0.35 and 31 that do not draft: alone it would draft (a > r = 0.2),
    # but its gain does not pay for 32 requests waiting
    ids = [f"r{i}" for i in range(32)]
    c.plan(ids)
    for i, rid in enumerate(ids):
        st = c._states[rid]
        st.acc_count, st.try_count = (0.35, 1.0) if i == 0 else (0.0, 1.0)
    assert max(expected_tokens(0.35, k) / (0.2 * k + 1.0) for k in range(1, 5)) > 1.0
    assert c.plan(["r0"])[0] >= 1
    assert c.plan(ids) == [0] * 32
    assert not c._states["r0"].off  # left out of the batch's plan, not switched off
    # drafts that land for everyone: the batch drafts
    for rid in ids:
        c._states[rid].acc_count = c._states[rid].try_count = 1.0
    assert c.plan(ids) == [4] * 32


def test_probe_interval_is_cost_aware():
    from vllm_selfspec.control.controller import ControllerConfig, DraftLengthController
    from vllm_selfspec.control.step_costs import StepCosts

    c = DraftLengthController(ControllerConfig(k_max=4, probe_interval=4,
                                               max_probe_interval=256, explore_interval=0))
    assert c._min_probe_interval() == 0  # nothing measured: the configured schedule
    # a probe of 2 drafts: 2 draft forwards of 0.3 plus 0.1 of extra verification = 0.7
    c.set_step_costs(StepCosts(verify={(1, 0.0): 1.0, (1, 2.0): 1.1}, draft={1: 0.3}))
    assert c._min_probe_interval() == 35  # 0.7 / 0.02
    c.set_step_costs(StepCosts(verify={(1, 0.0): 1.0}, draft={1: 100.0}))
    assert c._min_probe_interval() == 4096  # the cost bound is capped, far above the schedule
    # in a batch of 32, the probes of 32 off requests share one budget; a one-row draft
    # forward of 0.3 is 0.1 of a plain step of 32 (3.0): 32 * 0.2 / 0.02 = 320
    c.set_step_costs(StepCosts(verify={(32, 0.0): 3.0}, draft={1: 0.3}))
    assert c._min_probe_interval(32, 32) == 320
    assert c._min_probe_interval(32, 1) == 10
    c.set_step_costs(StepCosts(verify={(1, 0.0): 1.0, (1, 2.0): 1.1}, draft={1: 0.3}))
    plans = []
    for _ in range(80):  # drafts never land
        (k,) = c.plan(["r"])
        plans.append(k)
        c.observe_verification("r", drafted=k, accepted=0)
    off = plans.index(0)
    probes = [i for i, k in enumerate(plans) if i > off and k]
    assert probes and probes[0] - off >= 34


# a server's /metrics text: two engines' counters add up, position 2 is missing (0)
_METRICS = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 6.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 4.0
# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens.
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 40.0
# HELP vllm:spec_decode_num_accepted_tokens_total Number of accepted tokens.
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 30.0
# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per position.
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 10.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 9.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="3"} 5.0
# HELP vllm:prompt_tokens_total Prompt tokens.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="m"} 99.0
"""


def _bench_json(tok_s: float, tpot: float) -> dict:
    # the fields of a `vllm bench serve --save-result` file, plus per-request lists
    return {"duration": 10.0, "completed": 16, "failed": 0, "output_throughput": tok_s,
            "median_tpot_ms": tpot, "p99_tpot_ms": 2 * tpot, "median_ttft_ms": 100.0,
            "p99_ttft_ms": 300.0, "median_itl_ms": tpot, "p99_itl_ms": 3 * tpot,
            "request_rate": "inf", "ttfts": [0.1] * 16, "generated_texts": ["x"] * 16}


def test_online_parsing_summary_table_and_plot(tmp_path):
    from benchmarks import online

    counters = online.parse_server_spec_counters(_METRICS)
    assert counters == {"num_drafts": 10.0, "num_draft_tokens": 40.0,
                        "num_accepted_tokens": 30.0,
                        "num_accepted_tokens_per_pos": [10.0, 9.0, 0.0, 5.0]}
    assert online.parse_server_spec_counters("# nothing\n") == {}
    # selfspec's controller counters: drafting-off share = off / request-steps (deltas)
    ss = online.parse_server_spec_counters(
        _METRICS + "# TYPE vllm:selfspec_decode_request_steps_total counter\n"
        'vllm:selfspec_decode_request_steps_total{engine="0"} 100.0\n'
        "# TYPE vllm:selfspec_request_steps_drafting_off_total counter\n"
        'vllm:selfspec_request_steps_drafting_off_total{engine="0"} 90.0\n')
    assert ss["selfspec_decode_request_steps"] == 100.0
    assert ss["selfspec_request_steps_drafting_off"] == 90.0
    (off_row,) = online.summarize([{"method": "selfspec", "rate": "1", "load": [1.0],
                                    "bench": online.parse_bench_result(_bench_json(9.0, 9.0)),
                                    "spec": online.counter_delta(
                                        {"selfspec_decode_request_steps": 60.0,
                                         "selfspec_request_steps_drafting_off": 60.0}, ss)}])
    assert off_row["drafting_off"] == pytest.approx(0.75) and off_row["ratio"] is None
    assert "| 0.75 | 16/16 |" in online.markdown_table([off_row])
    before = {"num_drafts": 2.0, "num_draft_tokens": 8.0, "num_accepted_tokens": 6.0}
    bench = online.parse_bench_result(_bench_json(50.0, 20.0))
    assert "ttfts" not in bench and bench["output_throughput"] == 50.0
    with pytest.raises(ValueError):
        online.parse_bench_result({"duration": 1.0})
    runs = [
        {"method": "plain", "rate": "0.5", "bench": online.parse_bench_result(
            _bench_json(20.0, 40.0)), "load": [2.0, 1.0, 1.0]},
        {"method": "plain", "rate": "inf", "bench": online.parse_bench_result(
            _bench_json(100.0, 30.0)), "load": [3.0, 1.0, 1.0]},
        {"method": "selfspec", "rate": "inf", "bench": online.parse_bench_result(
            _bench_json(80.0, 35.0)), "load": [3.0, 1.0, 1.0],
         "spec": online.counter_delta(before, counters)},
        {"method": "selfspec", "rate": "0.5", "bench": bench, "load": [2.5, 1.0, 1.0],
         "spec": counters},
        {"method": "ngram", "rate": "0.5", "error": "bench serve exited 1: boom | x"},
    ]
    rows = online.summarize(runs)
    assert [(r["method"], r["rate"]) for r in rows] == [
        ("plain", "0.5"), ("plain", "inf"), ("selfspec", "0.5"), ("selfspec", "inf"),
        ("ngram", "0.5")]
    by = {(r["method"], r["rate"]): r for r in rows}
    assert by["plain", "inf"]["ratio"] == 1.0 and by["plain", "inf"]["acceptance"] is None
    assert by["selfspec", "inf"]["ratio"] == pytest.approx(0.8)
    assert by["selfspec", "0.5"]["ratio"] == pytest.approx(2.5)
    # (30 - 6) / (40 - 8) accepted per drafted; 1 + 24 / 8 tokens per verification
    assert by["selfspec", "inf"]["acceptance"] == pytest.approx(0.75)
    assert by["selfspec", "inf"]["mean_accepted_length"] == pytest.approx(4.0)
    assert by["ngram", "0.5"]["error"].startswith("bench serve")
    table = online.markdown_table(rows)
    lines = table.splitlines()
    assert len(lines) == 2 + len(rows)
    assert len({line.count("|") for line in lines}) == 1  # every row has every column
    assert "| selfspec | inf | 80.0 | 0.80 | 35.0 | 70.0 | 100 | 300 | 0.75 | 4.00 | - | 16/16 |" \
        in table
    assert "| plain | 0.5 | 20.0 | 1.00 | 40.0 | 80.0 | 100 | 300 | - | - |" in table
    result = {"suite": "online", "partial": False, "started_utc": "s", "finished_utc": "f",
              "duration_s": 1.0, "plan": online.online_plan(online.build_online_suite()),
              "host": {"cpus": 2}, "loadavg_1min": {"min": 1.0, "median": 2.5, "max": 3.0},
              "summary": rows}
    md = online.render_markdown(result)
    assert md.startswith("# Benchmark `online`") and "median 2.50" in md and table in md
    path = online.write_plot(rows, tmp_path / "online")
    assert path is not None and path.name == "online.png" and path.stat().st_size > 1000


def test_online_suite_plan_and_client_command(tmp_path):
    import math

    from benchmarks import online

    suite = online.build_online_suite()
    assert [m.name for m in suite.methods] == ["plain", "selfspec", "ngram"]
    assert suite.methods[0].spec is None and suite.methods[1].spec["adaptive"] is True
    assert math.isinf(suite.rates[-1]) and len(suite.rates) >= 3
    data = online.write_dataset(["a \"quoted\"\nprompt", "b"], tmp_path / "p.jsonl")
    assert [json.loads(x)["prompt"] for x in data.read_text().splitlines()] == [
        "a \"quoted\"\nprompt", "b"]
    cmd = online.bench_serve_command("http://h:1", "tiny", "/m", data, math.inf, 16, 32,
                                     tmp_path, "r.json")
    assert cmd[3:5] == ["bench", "serve"]
    flags = dict(zip(cmd[5::2], cmd[6::2], strict=False))
    for flag in ("--skip-chat-template", "--disable-shuffle", "--ignore-eos",
                 "--disable-tqdm", "--save-result"):
        assert flag in cmd
    cmd_s = " ".join(cmd)
    assert "--request-rate inf" in cmd_s and "--dataset-name custom" in cmd_s
    assert "--custom-output-len 32" in cmd_s and "--temperature 0" in cmd_s
    assert flags.get("--backend") == "vllm"
    assert run.main(["--suite", "online", "--dry-run", "--rates", "1,inf"]) == 0
    with pytest.raises(SystemExit):
        run.parse_args(["--suite", "online", "--rates", "0"])


def test_online_client_entry_point_parses():
    # vLLM's own CLI, reached through the shim, knows `bench serve` and every flag we pass
    import math

    from benchmarks import online

    cmd = online.bench_serve_command("http://127.0.0.1:1", "tiny", "/m", Path("/p.jsonl"),
                                     math.inf, 4, 8, Path("/tmp"), "r.json")
    out = subprocess.run([*cmd[:5], "--help=all"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    for flag in cmd[5:]:
        if flag.startswith("--"):
            assert flag in out.stdout, flag


def test_ideal_uses_decode_steps_and_the_cells_cost_table():
    """The plain step is vLLM's mean inter-token latency (prefills excluded) when the plain run
    recorded it, and the drafter's costs come from its table at the cell's batch bucket, not
    from whatever batch size its latest step had."""
    recs = _records()
    for r in recs:
        if r["method"] == "plain":
            r["plain_steps"] = 50  # wall time per step: 20 ms (a prefill included)
            r["decode_step_s"] = 0.016  # decode steps only
        elif r["method"] == "fixed":
            # latest step's figures (a smaller batch) vs the table's entry for bucket 1
            r["drafter"] = {"draft_cost_s": 0.5, "verify_cost_s": {"4": 0.9},
                            "cost_table": {"draft": {"1": 0.008, "8": 0.5},
                                           "verify": {"1:0": 0.015, "1:4": 0.024}}}
    rows = {r["method"]: r for r in analysis.summarize(recs)}
    f = rows["fixed"]
    assert f["plain_step_ms"] == pytest.approx(16.0)
    assert f["cost_ratio"] == pytest.approx(0.5)  # 8 ms / 16 ms
    assert f["verify_cost_ratio"] == pytest.approx(1.5)  # 24 ms / 16 ms
    ideal, best_k = analysis.ideal_speedup(f["per_token_acceptance"], 0.5, 4, 1.5)
    assert f["ideal_speedup"] == pytest.approx(ideal)
    # without the table the latest step's figures are used
    assert analysis.drafter_costs({"draft_cost_s": 0.5, "verify_cost_s": {"4": 0.9}}, 1, 4) == (
        0.5, 0.9)
    assert analysis.drafter_costs({"cost_table": {"draft": {"8": 0.1}, "verify": {}}}, 5, 4) == (
        0.1, None)


def test_rerender_recomputes_the_summary(tmp_path):
    """`--rerender` rewrites a stored run's summary, Markdown and plots with the current
    analysis and runs nothing."""
    suite = run.build_suite("smoke")
    stored = {"suite": "smoke", "partial": False, "started_utc": "x", "finished_utc": "y",
              "duration_s": 1.0, "plan": run.plan(suite), "host": {"cpus": 2},
              "loadavg_samples": [], "loadavg_1min": None, "engines": {},
              "summary": [{"method": "stale"}],
              "runs": _records()}
    path = tmp_path / "smoke.json"
    path.write_text(json.dumps(stored))
    assert run.main(["--rerender", str(path)]) == 0
    result = json.loads(path.read_text())
    methods = {r["method"] for r in result["summary"]}
    assert methods == {"plain", "selfspec", "fixed", "suffix"}
    assert result["runs"] == json.loads(json.dumps(_records()))
    assert "| selfspec |" in (tmp_path / "smoke.md").read_text()
    assert (tmp_path / "smoke_ratio.png").stat().st_size > 0
    with pytest.raises(SystemExit):  # a suite or a stored run, not both
        run.parse_args(["--suite", "smoke", "--rerender", str(path)])
    # a suite named after a model keeps the dots of its name in every file
    dotted = tmp_path / "smoke-qwen2.5-coder-0.5b.json"
    dotted.write_text(json.dumps(stored))
    assert run.main(["--rerender", str(dotted)]) == 0
    assert "| selfspec |" in (tmp_path / "smoke-qwen2.5-coder-0.5b.md").read_text()
    assert (tmp_path / "smoke-qwen2.5-coder-0.5b_ratio.png").stat().st_size > 0
    assert not list(tmp_path.glob("smoke-qwen2.5-coder-0.md"))


def test_gpu_script_draft_pass_is_the_chained_draft():
    """The device pass feeds each step's top-1 token to the next step; the host pass is the same
    chain read back token by token."""
    import torch

    model = gpu_step_cost.RandomLlama(gpu_step_cost.TINY, 4, 2, 8, torch.device("cpu"),
                                      torch.float32)
    first = torch.randint(0, gpu_step_cost.TINY.vocab, (2, 1))
    skip = frozenset({1})
    with torch.inference_mode():
        drafts, probs = model.draft_pass(first, 3, skip, frozenset())
        host = model.host_pass(first, 3, skip, frozenset())
        tok, chained = first, []
        for j in range(3):
            tok = model.logits(tok, skip, frozenset(), model.context + j).argmax(-1)
            chained.append(tok)
    assert torch.equal(drafts, torch.cat(chained, 1))
    assert drafts.tolist() == [list(col) for col in zip(*host, strict=True)]
    assert ((probs > 0) & (probs <= 1)).all()


@pytest.mark.parametrize("zeroed", [True, False])
def test_gpu_script_free_drafts_are_exact(zeroed):
    """With the inserted layers zeroed the draft's logits equal the full model's bit for bit;
    the negative control (the same skip set over layers that are not zero) must differ."""
    import dataclasses

    import torch

    shape = dataclasses.replace(gpu_step_cost.TINY, layers=6, zero_inserted=True)
    attention, mlp, _ = gpu_step_cost.skip_sets(shape)
    assert attention == mlp == [1, 3, 5]
    model = gpu_step_cost.RandomLlama(shape, 6, 2, 8, torch.device("cpu"), torch.float32)
    if not zeroed:
        for i in (1, 3, 5):
            model.layers[i]["wo"].normal_(0.0, 0.02)
            model.layers[i]["wd"].normal_(0.0, 0.02)
    first = torch.randint(0, shape.vocab, (2, 1))
    exact = gpu_step_cost._free_draft_exactness(model, first, frozenset(attention),
                                                frozenset(mlp))
    assert exact["control_logits_equal"] and exact["control_tokens_equal"]
    assert exact["logits_equal"] is zeroed
    assert (exact["logits_max_abs_diff"] == 0) is zeroed


# ------------------------------------------------------------------- interrupted runs

class _FakeEngine:
    """Stands in for a vLLM engine in the runner: decodes nothing, records ``close``."""

    def __init__(self, name: str, fail_on_generate: int | None = None) -> None:
        self.name, self.k, self.start_s, self.pids = name, 0, 0.0, []
        self.closed = False
        self.calls = 0
        self.fail_on_generate = fail_on_generate
        self.sampling: list[tuple[float, dict]] = []  # (temperature, top-k / top-p) per call

    def generate(self, prompts, temperature, max_tokens, batch, **truncation):
        self.calls += 1
        self.sampling.append((temperature, truncation))
        if self.calls == self.fail_on_generate:
            raise KeyboardInterrupt("signal 15")
        return [[1, 2, 3] for _ in prompts], 0.5

    def spec_counters(self):
        return {}

    def drafter_stats(self):
        return None

    def inter_token_latency(self):
        return None

    def close(self) -> None:
        self.closed = True


def test_an_interrupted_run_closes_every_engine_and_keeps_what_ran(tmp_path, monkeypatch):
    import signal

    started: list[_FakeEngine] = []

    def fake_start(self, method, model_dir, kind, sampler):
        # the hybrid is interrupted on its 3rd generate: warm-up, repetition 0, repetition 1
        eng = _FakeEngine(method.name, 3 if method.name == "selfspec hybrid" else None)
        started.append(eng)
        return eng

    monkeypatch.setattr(run.Runner, "_start", fake_start)
    monkeypatch.setattr(run, "resolve_model", lambda kind: f"/models/{kind}")
    monkeypatch.setattr(run, "prompt_sets",
                        lambda model_dir, datasets, n: {d: ["p"] * n for d in datasets})
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "WARNING")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    before = signal.getsignal(signal.SIGTERM)
    try:
        rc = run.main(["--suite", "hybrid", "--methods", "selfspec hybrid,ngram",
                       "--batches", "1", "--datasets", "humaneval", "--temperatures", "0",
                       "--reps", "3", "--out-dir", str(tmp_path)])
    finally:
        signal.signal(signal.SIGTERM, before)
    assert rc == 130
    # the hybrid's group was interrupted; ngram's group never started; plain and the hybrid
    # were both closed (before, only plain's engine was closed on the way out)
    assert [(e.name, e.closed) for e in started] == [("plain", True), ("selfspec hybrid", True)]
    result = json.loads((tmp_path / "hybrid.json").read_text())
    assert result["partial"] is True
    assert [(r["rep"], r["method"]) for r in result["runs"]] == [(0, "plain"),
                                                                 (0, "selfspec hybrid")]


def test_sampled_cells_take_the_runs_top_k_and_top_p(tmp_path, monkeypatch):
    """--top-k / --top-p reach every engine's requests in the sampled cells (plain's too), not
    the greedy ones', and the result says so."""
    started: list[_FakeEngine] = []

    def fake_start(self, method, model_dir, kind, sampler):
        started.append(_FakeEngine(method.name))
        return started[-1]

    monkeypatch.setattr(run.Runner, "_start", fake_start)
    monkeypatch.setattr(run, "resolve_model", lambda kind: f"/models/{kind}")
    monkeypatch.setattr(run, "prompt_sets",
                        lambda model_dir, datasets, n: {d: ["p"] * n for d in datasets})
    rc = run.main(["--suite", "hybrid", "--methods", "selfspec hybrid", "--batches", "1",
                   "--datasets", "humaneval", "--temperatures", "0,0.7", "--reps", "1",
                   "--top-k", "20", "--top-p", "0.9", "--out-dir", str(tmp_path)])
    assert rc == 0
    for eng in started:
        assert {(t, tuple(sorted(kw.items()))) for t, kw in eng.sampling if t > 0} == {
            (0.7, (("top_k", 20), ("top_p", 0.9)))}, eng.name
        assert all(not kw for t, kw in eng.sampling if t == 0), eng.name
    result = json.loads((tmp_path / "hybrid.json").read_text())
    assert (result["plan"]["top_k"], result["plan"]["top_p"]) == (20, 0.9)
    assert "sampled cells with top-k 20 and top-p 0.9" in (tmp_path / "hybrid.md").read_text()
    with pytest.raises(SystemExit):
        run.parse_args(["--suite", "hybrid", "--top-p", "0"])


def test_sigterm_unwinds_like_ctrl_c():
    import os
    import signal

    before = signal.getsignal(signal.SIGTERM)
    try:
        run._exit_on_sigterm()
        with pytest.raises(KeyboardInterrupt, match="signal 15"):
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(100):  # delivered at the next bytecode boundary
                pass
    finally:
        signal.signal(signal.SIGTERM, before)


def test_results_name_the_cpu_they_ran_on():
    info = ("processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse avx avx2 fma\n\n"
            "processor\t: 1\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse avx avx2 fma\n")
    assert run.cpu_description(info) == "AMD EPYC (avx2)"
    info = "model name : Intel Xeon\nflags : avx2 avx512f avx512_bf16 amx_tile\n"
    assert run.cpu_description(info) == "Intel Xeon (avx2, avx512f, avx512_bf16, amx_tile)"
    assert run.cpu_description("flags : avx2\n") is None  # no model name: say nothing
    result = {"suite": "s", "started_utc": "a", "finished_utc": "b", "duration_s": 1.0,
              "host": {"cpus": 2, "cpu": "AMD EPYC (avx2)", "vllm": "0.32.0", "torch": "t"}}
    assert "on 2 CPUs of AMD EPYC (avx2) (0.32.0" in analysis.markdown_preamble(
        result, "", "", "")[2]
    del result["host"]["cpu"]  # results written before the field existed
    assert "on 2 CPUs (0.32.0" in analysis.markdown_preamble(result, "", "", "")[2]


def test_results_name_the_code_they_ran(tmp_path):
    assert run.code_commit(tmp_path) is None  # not a git checkout: say nothing
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "f.txt").write_text("a")
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "add", "f.txt"], check=True)
    subprocess.run([*git, "commit", "-qm", "c"], check=True)
    head = subprocess.run([*git, "rev-parse", "--short=12", "HEAD"], check=True,
                          capture_output=True, text=True).stdout.strip()
    assert run.code_commit(tmp_path) == head
    (tmp_path / "f.txt").write_text("b")  # a tracked file changed: not that commit's code
    assert run.code_commit(tmp_path) == head + "+"
    (tmp_path / "new.txt").write_text("c")  # untracked files do not count
    (tmp_path / "f.txt").write_text("a")
    assert run.code_commit(tmp_path) == head
    assert "commit" in run.host_info()


@pytest.mark.parametrize("reps, elapsed, rep_s, share", [
    (9, 120.0, 100.0, 600.0), (9, 120.0, 100.0, 2000.0), (5, 700.0, 50.0, 600.0),
    (3, 10.0, 30.0, 80.0), (1, 5.0, 5.0, 1.0), (7, 0.0, 0.0, 10.0),
])
def test_repetitions_in_budget_follow_the_runners_stop_rule(reps, elapsed, rep_s, share):
    # the rule of Runner.run: repetition r > 0 starts while the time since the group started
    # plus the last repetition's time stays within BUDGET_OVERRUN x the group's share
    ran, now = 1, elapsed
    while ran < reps and now + rep_s <= share * run.BUDGET_OVERRUN:
        ran, now = ran + 1, now + rep_s
    assert run.repetitions_in_budget(reps, elapsed, rep_s, share) == ran
    warning = run.budget_warning(reps, elapsed, rep_s, share)
    assert (warning is None) == (ran == reps)
    if warning:
        assert f"fits about {ran} of the {reps} repetitions" in warning


def test_a_budget_that_cuts_repetitions_is_reported_after_the_first(tmp_path, monkeypatch,
                                                                     capsys):
    import signal

    class SlowEngine(_FakeEngine):
        def generate(self, *args, **kwargs):
            time.sleep(0.02)
            return super().generate(*args, **kwargs)

    monkeypatch.setattr(run.Runner, "_start", lambda self, m, *a: SlowEngine(m.name))
    monkeypatch.setattr(run, "resolve_model", lambda kind: f"/models/{kind}")
    monkeypatch.setattr(run, "prompt_sets",
                        lambda model_dir, datasets, n: {d: ["p"] * n for d in datasets})
    argv = ["--suite", "hybrid", "--methods", "selfspec hybrid", "--batches", "1",
            "--datasets", "humaneval", "--temperatures", "0", "--reps", "4"]
    before = signal.getsignal(signal.SIGTERM)
    try:
        # 0.06 s for the group; warm-up and repetition 0 alone take 4 x 0.02 s
        assert run.main([*argv, "--time-budget-min", "0.001",
                         "--out-dir", str(tmp_path / "a")]) == 0
        out = capsys.readouterr()
        text = out.out + out.err
        assert "WARNING the time budget fits about 1 of the 4 repetitions" in text
        assert "time budget reached after 1 repetition(s)" in text
        assert run.main([*argv, "--time-budget-min", "10", "--out-dir", str(tmp_path / "b")]) == 0
        out = capsys.readouterr()
    finally:
        signal.signal(signal.SIGTERM, before)
    assert "WARNING" not in out.out + out.err
    runs = json.loads((tmp_path / "b" / "hybrid.json").read_text())["runs"]
    assert sorted({r["rep"] for r in runs}) == [0, 1, 2, 3]
