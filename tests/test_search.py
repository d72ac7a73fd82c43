"""Tests of the layer-selection search (``selfspec-profile``) on tiny random-weight models.

No vLLM engine is started here (see tests/test_search_confirm.py for the end-to-end check).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
optuna = pytest.importorskip("optuna")

from tests.tiny_models import tiny_model_dir  # noqa: E402
from vllm_selfspec.config import resolve_settings  # noqa: E402
from vllm_selfspec.layers.profiles import ModelFingerprint, load_profile  # noqa: E402
from vllm_selfspec.layers.search.cost import LinearCostModel, estimate_speedup  # noqa: E402
from vllm_selfspec.layers.search.matchness import (  # noqa: E402
    HFMatchnessScorer,
    LayerSkipper,
    generate_references,
    load_model,
    simulate_chain_acceptance,
)
from vllm_selfspec.layers.search.optimize import (  # noqa: E402
    LayerSearch,
    SearchConfig,
    searchable_layers,
    seed_sets,
)
from vllm_selfspec.layers.skip_set import SkipSet  # noqa: E402

ZERO = [2, 5]
PROMPTS = [
    "Write a function that returns the sum of two numbers.",
    "The quick brown fox jumps over",
    "Hello world! This is a small test",
    "What is the capital of France?",
]


@pytest.fixture(autouse=True)
def _one_thread():
    # tiny matmuls on a shared, oversubscribed CPU are much faster single-threaded
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def zero_model_dir() -> Path:
    return tiny_model_dir("search-zero", arch="llama", num_layers=8, zero_output_layers=ZERO)


@pytest.fixture(scope="module")
def loaded(zero_model_dir: Path):
    return load_model(zero_model_dir)


@pytest.fixture(scope="module")
def references(loaded):
    model, tok = loaded
    return generate_references(model, tok, PROMPTS, max_new_tokens=24)


@pytest.fixture
def prompt_file(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return path


def _config(model_dir: Path, prompts: Path, budget: int, **kw) -> SearchConfig:
    return SearchConfig(model_dir=str(model_dir), prompts=str(prompts), num_prompts=4,
                        max_new_tokens=24, budget=budget, cost="params", overhead=0.0, **kw)


# ----------------------------------------------------------------------------------- matchness


def test_skipping_zero_output_layers_is_exact(loaded, references) -> None:
    model, _ = loaded
    scorer = HFMatchnessScorer(model, references)
    assert scorer.reference_disagreements == 0
    assert scorer.score(SkipSet()).matchness == 1.0
    assert scorer.score(SkipSet.of(ZERO, ZERO)).matchness == 1.0
    assert scorer.score(SkipSet.of([3])).matchness < 1.0
    assert scorer.score(SkipSet.of([], [4])).matchness < 1.0


@pytest.mark.parametrize("context", ["target", "draft"])
def test_fast_layer_slice_equals_full_forward(loaded, references, context: str) -> None:
    """Starting the draft at its first skipped layer (cached inputs) changes nothing."""
    model, _ = loaded
    fast = HFMatchnessScorer(model, references, context=context)
    slow = HFMatchnessScorer(model, references, context=context)
    slow._fast = False
    for skip in (SkipSet.of([3, 6], [1]), SkipSet.of([], [4, 6]), SkipSet.of([1])):
        assert fast.score(skip, keep_hits=True).hits == slow.score(skip, keep_hits=True).hits


def test_target_context_is_what_the_drafter_computes(loaded, references) -> None:
    """target context == a real draft step: full-model KV cache for earlier positions, the
    skip-draft for the newest position only (brute force with a transformers cache)."""
    from transformers import DynamicCache

    model, _ = loaded
    skip = SkipSet.of([3, 4], [6])
    hits = HFMatchnessScorer(model, references[:2]).score(skip, keep_hits=True).hits
    skipper = LayerSkipper(model)
    checked = 0
    with torch.inference_mode():
        for ref, row in zip(references[:2], hits, strict=False):
            seq = ref.prompt + ref.continuation
            for j in range(0, len(ref.continuation), 3):
                p = len(ref.prompt) - 1 + j
                cache = DynamicCache(config=model.config)
                with skipper.skipping(SkipSet()):
                    model(input_ids=torch.tensor([seq[:p]]), past_key_values=cache)
                    full = model(input_ids=torch.tensor([seq[: p + 1]])).logits[0, -1].argmax()
                with skipper.skipping(skip):
                    draft = model(input_ids=torch.tensor([[seq[p]]]),
                                  position_ids=torch.tensor([[p]]),
                                  past_key_values=cache).logits[0, -1].argmax()
                assert bool(draft == full) == row[j]
                checked += 1
    assert checked >= 8


def test_simulate_chain_acceptance() -> None:
    # k=2 over [T T F T T T]: round 1 accepts 2 (bonus at 2), round 2 at 3: accepts 2 (bonus
    # at 5); 4 accepted of 4 drafted, no rejection
    sim = simulate_chain_acceptance([[True, True, False, True, True, True]], 2)
    assert sim["acceptance_rate"] == 1.0 and sim["rounds"] == 2
    # [F T]: round 1 rejects at 0, round 2 at 1 drafts 1 and accepts it
    sim = simulate_chain_acceptance([[False, True]], 3)
    assert sim["acceptance_rate"] == pytest.approx(1 / 3)
    assert sim["per_token_acceptance"] == pytest.approx(1 / 2)
    assert sim["mean_accepted_length"] == pytest.approx(1.5)


# ---------------------------------------------------------------------------------------- cost


def test_params_cost_model_and_speedup(loaded) -> None:
    model, _ = loaded
    cost = LinearCostModel.from_parameters(model, overhead=0.0)
    assert cost.c_draft(SkipSet()) == 1.0
    assert cost.attention[2] > 0 and cost.mlp[2] > cost.attention[2]  # llama: MLP is bigger
    c = cost.c_draft(SkipSet.of(ZERO, ZERO))
    assert 0.6 < c < 0.9
    est = estimate_speedup(1.0, c, cost, k_max=8)
    assert est.k == 8 and est.speedup == pytest.approx(9 / (8 * c + 1))
    assert estimate_speedup(0.0, c, cost, k_max=8).k == 1  # at least one draft
    round_trip = LinearCostModel.from_dict(json.loads(json.dumps(cost.to_dict())))
    assert round_trip.c_draft(SkipSet.of([1], [3])) == cost.c_draft(SkipSet.of([1], [3]))
    more = LinearCostModel.from_parameters(model, overhead=0.5)
    assert more.c_draft(SkipSet.of(ZERO, ZERO)) > c
    # engine overhead: paid by verification steps only
    engine = cost.with_step_overhead(0.25)
    assert engine.c_draft(SkipSet()) == 0.75 and engine.c_verify(3) == 1.0
    assert engine.c_draft(SkipSet.of(ZERO, ZERO)) == pytest.approx(0.75 * c)
    with pytest.raises(ValueError, match="step_overhead"):
        cost.with_step_overhead(1.0)


def test_measured_cost_model(loaded) -> None:
    model, _ = loaded
    cost = LinearCostModel.measure(model, searchable_layers(8), k_max=4, context_tokens=16,
                                   repeats=3, warmup=1)
    assert cost.kind == "measured" and cost.details["step_s"] > 0
    assert 0 < cost.c_draft(SkipSet.of(ZERO, ZERO)) < 1
    assert cost.verify_slope >= 0


# -------------------------------------------------------------------------------------- search


def test_seed_sets_and_searchable_layers() -> None:
    assert searchable_layers(8) == [1, 2, 3, 4, 5, 6]
    assert searchable_layers(8, 2, 2) == [2, 3, 4, 5]
    seeds = seed_sets(30, searchable_layers(30))
    assert seeds and all(not s.mlp and min(s.attention) >= 15 and 29 not in s.attention
                         for s in seeds)


def test_search_finds_exactly_the_zero_output_layers(zero_model_dir, prompt_file, tmp_path):
    search = LayerSearch(_config(zero_model_dir, prompt_file, budget=30), tmp_path / "s.db",
                         progress=False)
    result = search.run()
    assert result.best.skip == SkipSet.of(ZERO, ZERO)
    assert result.best.acceptance == 1.0 and result.best.k == 8
    assert len(result.trials) == 30
    phases = [t.phase for t in result.trials]
    assert phases[:3] == ["seed"] * 3 and "probe" in phases and "greedy" in phases
    assert "tpe" in phases and set(phases) <= {"seed", "probe", "greedy", "tpe", "local"}
    assert len({t.skip for t in result.trials}) == 30  # the budget counts distinct sets
    # never a protected layer
    assert all(0 not in t.skip.attention + t.skip.mlp and 7 not in t.skip.attention + t.skip.mlp
               for t in result.trials)


def test_search_resumes_and_refuses_other_settings(zero_model_dir, prompt_file, tmp_path, loaded):
    model, tok = loaded
    db = tmp_path / "study.db"
    first = LayerSearch(_config(zero_model_dir, prompt_file, budget=8), db, progress=False,
                        model=model, tokenizer=tok).run()
    assert len(first.trials) == 8

    # an interruption (Ctrl-C) during the 3rd new trial: completed trials stay in the study
    search = LayerSearch(_config(zero_model_dir, prompt_file, budget=30), db, progress=False,
                         model=model, tokenizer=tok)
    original = HFMatchnessScorer.score
    calls = {"n": 0}

    def flaky(self, skip, keep_hits=False):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return original(self, skip, keep_hits)

    HFMatchnessScorer.score = flaky
    try:
        interrupted = search.run()
    finally:
        HFMatchnessScorer.score = original
    assert interrupted.interrupted and len(interrupted.trials) == 10

    resumed = LayerSearch(_config(zero_model_dir, prompt_file, budget=30), db, progress=False,
                          model=model, tokenizer=tok).run()
    assert not resumed.interrupted and len(resumed.trials) == 30
    assert len(resumed.info["session_wall_s"]) == 3
    assert resumed.info["total_wall_s"] >= resumed.wall_s
    assert [t.skip for t in resumed.trials[:8]] == [t.skip for t in first.trials]
    assert resumed.best.skip == SkipSet.of(ZERO, ZERO)
    study = optuna.load_study(study_name="selfspec-profile", storage=f"sqlite:///{db}")
    states = [t.state for t in study.trials]
    assert states.count(optuna.trial.TrialState.FAIL) == 1
    # every skip set was scored once; repeats proposed by the sampler are marked duplicates
    complete = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    scored = [t for t in complete if not t.user_attrs["score"]["duplicate"]]
    assert len(scored) == 30 and len(complete) == 30 + resumed.info["duplicates"]
    assert len({tuple(sorted(t.params.items())) for t in scored}) == 30

    with pytest.raises(ValueError, match="other settings.*k_max"):
        LayerSearch(_config(zero_model_dir, prompt_file, budget=30, k_max=4), db,
                    progress=False, model=model, tokenizer=tok).run()


# ----------------------------------------------------------------------------------------- CLI


def test_cli_search_show_validate(zero_model_dir, prompt_file, tmp_path, capsys) -> None:
    from vllm_selfspec.tools.profile_cli import main

    out = tmp_path / "tiny-zero.json"
    rc = main(["search", str(zero_model_dir), "--prompts", str(prompt_file), "--num-prompts",
               "4", "--max-new-tokens", "24", "--budget", "24", "--cost", "params",
               "--overhead", "0", "--out", str(out), "--no-progress", "--threads", "1",
               "--json", str(tmp_path / "report.json")])
    assert rc == 0
    assert (tmp_path / "tiny-zero.study.db").is_file()
    png = (tmp_path / "tiny-zero.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["best"]["skip_attention"] == ZERO and report["trials"] == 24

    profile = load_profile(str(out))
    assert profile.name == "tiny-zero"
    assert profile.skip_attention == tuple(ZERO) and profile.skip_mlp == tuple(ZERO)
    assert profile.draft == {"num_speculative_tokens": 8}
    prov = profile.provenance
    assert prov["estimated_acceptance"] == 1.0 and prov["budget"] == 24
    assert prov["measured_acceptance"] is None and prov["date"]
    assert "TPE" in prov["method"] and "prompts.jsonl" in prov["source"]
    fp = ModelFingerprint.from_model_dir(zero_model_dir)
    settings = resolve_settings({"profile": str(out)}, fp)
    assert settings.skip_attention == tuple(ZERO) and settings.num_speculative_tokens == 8

    capsys.readouterr()
    assert main(["show", str(out)]) == 0
    shown = capsys.readouterr().out
    assert "     2 |   skip    | skip" in shown and "     3 |     .     |  ." in shown
    assert "estimated_acceptance: 1.0" in shown

    assert main(["validate", str(out), "--model", str(zero_model_dir)]) == 0
    assert capsys.readouterr().out.startswith("OK: profile 'tiny-zero'")
    assert main(["validate", str(out), "--model", str(zero_model_dir), "--score", "--prompts",
                 str(prompt_file), "--num-prompts", "2", "--max-new-tokens", "8", "--cost",
                 "params", "--threads", "1"]) == 0
    assert "estimated per-token acceptance 1.000" in capsys.readouterr().out

    other = tiny_model_dir("search-other", arch="llama", num_layers=4)
    assert main(["validate", str(out), "--model", str(other)]) == 1
    text = capsys.readouterr().out
    assert text.startswith("INVALID") and "num_hidden_layers: profile 8, model 4" in text


def test_cli_help_and_module_entry_points(capsys) -> None:
    from vllm_selfspec.tools.profile_cli import build_parser, main

    for command in ("search", "show", "validate"):
        with pytest.raises(SystemExit) as exc:
            build_parser().parse_args([command, "--help"])
        assert exc.value.code == 0
    out = capsys.readouterr().out  # each --help prints its command's usage, search's --budget
    assert [ln.split()[2] for ln in out.splitlines() if ln.startswith("usage: selfspec-profile ")
            ] == ["search", "show", "validate"] and "--budget BUDGET" in out
    import importlib.metadata

    scripts = {ep.name: ep for ep in importlib.metadata.entry_points(group="console_scripts")}
    assert scripts["selfspec-profile"].value == "vllm_selfspec.tools.profile_cli:main"
    assert scripts["selfspec-profile"].load() is main


def test_prompt_files(tmp_path, loaded) -> None:
    from vllm_selfspec.layers.search.prompts import load_prompt_texts

    _, tok = loaded
    path = tmp_path / "p.jsonl"
    path.write_text(
        json.dumps({"prompt": "raw text"}) + "\n\n"
        + json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n"
        + json.dumps({"turns": ["first turn", "second"]}) + "\n"
        + json.dumps("a bare string") + "\n"
    )
    texts, chat = load_prompt_texts(str(path), 10, tok)
    assert chat and texts[0] == "raw text" and texts[3] == "a bare string"
    assert "<|im_start|>user\nhi<|im_end|>" in texts[1] and texts[1].endswith("assistant\n")
    assert "first turn" in texts[2] and "second" not in texts[2]
    assert load_prompt_texts(str(path), 1, tok)[0] == ["raw text"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"nothing": 1}\n')
    with pytest.raises(ValueError, match="no prompt found"):
        load_prompt_texts(str(bad), 1, tok)
    with pytest.raises(ValueError, match="not a built-in set"):
        load_prompt_texts(str(tmp_path / "missing.jsonl"), 1, tok)
