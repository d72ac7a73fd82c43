"""``selfspec-profile``: search, show and validate layer-skip profiles.

    selfspec-profile search MODEL_DIR --prompts mtbench+humaneval --budget 200 --out NAME.json
    selfspec-profile show NAME.json
    selfspec-profile validate NAME.json --model MODEL_DIR [--score] [--confirm]

(also ``python -m vllm_selfspec.tools.profile_cli``). See docs/search.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _quiet_libraries() -> None:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        import transformers

        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
    except Exception:  # noqa: BLE001 - cosmetic only
        pass


def default_threads() -> int:
    return max(1, (os.cpu_count() or 2) // 2)


def _set_threads(args: argparse.Namespace) -> None:
    if getattr(args, "threads", None):
        import torch

        torch.set_num_threads(args.threads)


def _add_scoring_args(p: argparse.ArgumentParser, defaults_note: str = "") -> None:
    g = p.add_argument_group("scoring" + defaults_note)
    g.add_argument("--prompts", default="mtbench+humaneval",
                   help="humaneval | mtbench | mtbench+humaneval | FILE.jsonl "
                        "(default: %(default)s)")
    g.add_argument("--num-prompts", type=int, default=16, help="prompts used (default: 16)")
    g.add_argument("--max-new-tokens", type=int, default=64,
                   help="greedy tokens generated per prompt (default: 64)")
    g.add_argument("--chat", choices=("auto", "yes", "no"), default="auto",
                   help="render prompts with the chat template (auto: built-in sets when the "
                        "tokenizer has one)")
    g.add_argument("--context", choices=("target", "draft"), default="target",
                   help="target: draft queries read the full model's K/V of earlier positions, "
                        "as in vLLM (default); draft: SWIFT's all-draft forward")
    g.add_argument("--cost", choices=("measured", "params"), default="measured",
                   help="step costs timed on this machine (default) or a parameter-count model")
    g.add_argument("--overhead", type=float, default=0.1,
                   help="params cost model: fixed share of a step (default: 0.1)")
    g.add_argument("--verify-slope", type=float, default=0.0,
                   help="params cost model: extra verify cost per draft token (default: 0)")
    g.add_argument("--step-overhead", type=float, default=0.0,
                   help="share of a serving step outside the model forward (scheduler, "
                        "sampling), paid by verification steps only (default: 0)")
    g.add_argument("--k-max", type=int, default=8, help="largest draft length considered")
    g.add_argument("--dtype", default="float32", help="model dtype (default: float32)")
    g.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    g.add_argument("--threads", type=int, default=default_threads(),
                   help="torch CPU threads (default: half the cores, %(default)s here: "
                        "oversubscribed cores make CPU timings and throughput erratic)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="selfspec-profile",
        description="Find the attention / MLP sub-layers a self-speculative draft should skip.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    s = sub.add_parser("search", help="search a model's skip set and write a profile")
    s.add_argument("model_dir", help="Hugging Face model folder, or an embedded model's name "
                   "(smollm2-135m, qwen2.5-coder-0.5b: downloaded and converted on first use)")
    s.add_argument("--out", required=True, help="profile to write (NAME.json)")
    s.add_argument("--budget", type=int, default=200,
                   help="total trials of the study, seeds included (default: 200)")
    s.add_argument("--study", help="study database (default: OUT with .study.db)")
    s.add_argument("--plot", help="PNG to write (default: OUT with .png)")
    s.add_argument("--fresh", action="store_true", help="discard an existing study")
    s.add_argument("--timeout", type=float, help="stop searching after this many seconds")
    s.add_argument("--sampler", choices=("tpe", "gp"), default="tpe",
                   help="Optuna sampler after the seeds (default: tpe)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--protect-first", type=int, default=1,
                   help="leading layers never skipped (default: 1)")
    s.add_argument("--protect-last", type=int, default=1,
                   help="trailing layers never skipped (default: 1)")
    s.add_argument("--no-probes", action="store_true",
                   help="skip the single-sub-layer scan and its greedy seeds")
    s.add_argument("--model-name", help="model.name in the profile (default: the folder name)")
    s.add_argument("--confirm", type=int, default=0, metavar="N",
                   help="measure the top N candidates end to end with vLLM vs plain decoding")
    s.add_argument("--confirm-batch-size", type=int, default=1)
    s.add_argument("--enforce-eager", action="store_true", help="vLLM engines of --confirm")
    s.add_argument("--json", help="also write a JSON report here")
    s.add_argument("--no-progress", action="store_true")
    _add_scoring_args(s)

    sh = sub.add_parser("show", help="print a profile as a table")
    sh.add_argument("profile", help="profile .json path or shipped profile name")

    v = sub.add_parser("validate", help="check a profile against a model")
    v.add_argument("profile", help="profile .json path or shipped profile name")
    v.add_argument("--model", required=True,
                   help="Hugging Face model folder, or an embedded model's name")
    v.add_argument("--score", action="store_true",
                   help="also estimate its acceptance and speedup on the model (transformers)")
    v.add_argument("--confirm", action="store_true",
                   help="also measure it end to end with vLLM vs plain decoding")
    v.add_argument("--enforce-eager", action="store_true")
    _add_scoring_args(v, " (--score / --confirm)")
    return parser


# ----------------------------------------------------------------------------------- commands


def _estimate_report(search: Any, cand: Any, confirmed: dict[str, Any]) -> dict[str, Any]:
    from vllm_selfspec.layers.search.matchness import simulate_chain_acceptance

    hits = search.scorer.score(cand.skip, keep_hits=True).hits
    sim = simulate_chain_acceptance(hits, confirmed["k"])
    return {
        "estimated_acceptance": cand.acceptance,
        "measured_acceptance": confirmed.get("per_token_acceptance"),
        "estimated_acceptance_rate": sim["acceptance_rate"],
        "measured_acceptance_rate": confirmed.get("acceptance_rate"),
        "estimated_speedup": cand.speedup,
        "measured_speedup": confirmed.get("speedup"),
        "measured_fixed_k_speedup": confirmed.get("fixed_speedup"),
    }


def cmd_search(args: argparse.Namespace) -> int:
    from vllm_selfspec.layers.search.optimize import LayerSearch, SearchConfig, result_summary
    from vllm_selfspec.layers.search.output import make_profile, show_profile

    out = Path(args.out)
    if out.suffix != ".json":
        _say(f"--out must end in .json, got {out}")
        return 2
    study = Path(args.study) if args.study else out.with_suffix(".study.db")
    plot = Path(args.plot) if args.plot else out.with_suffix(".png")
    config = SearchConfig(
        model_dir=str(args.model_dir), prompts=args.prompts, num_prompts=args.num_prompts,
        max_new_tokens=args.max_new_tokens, chat=args.chat, budget=args.budget, k_max=args.k_max,
        context=args.context, cost=args.cost, overhead=args.overhead,
        verify_slope=args.verify_slope, step_overhead=args.step_overhead,
        protect_first=args.protect_first,
        protect_last=args.protect_last, sampler=args.sampler, seed=args.seed, dtype=args.dtype,
        device=args.device, probes=not args.no_probes,
    )
    search = LayerSearch(config, study, fresh=args.fresh, progress=not args.no_progress,
                         timeout_s=args.timeout, log=_say)
    result = search.run()
    best = result.best
    total = result.info.get("total_wall_s", result.wall_s)
    _say(f"\n{len(result.trials)} skip sets scored, {result.wall_s:.0f} s (all sessions: "
         f"{total:.0f} s); best estimated speedup "
         f"{best.speedup:.3f}x: skip {best.skip.describe()}, acceptance {best.acceptance:.3f}, "
         f"draft cost {best.c_draft:.3f}, k={best.k}")
    if best.speedup <= 1.0:
        _say("no skip set is estimated to beat plain decoding on this model and machine; the "
             "profile holds the best one found (the serving controller switches drafting off "
             "where it does not pay)")
    if result.interrupted:
        _say(f"interrupted: the study is saved in {study}; run the same command to resume")
        return 130
    from vllm_selfspec.layers.search.plot import plot_search

    plot.parent.mkdir(parents=True, exist_ok=True)
    plot_search(result.trials, best, result.top, result.info["num_layers"], plot,
                title=f"{Path(args.model_dir).name}: {len(result.trials)} trials, "
                      f"{result.prompt_source}",
                searchable=result.info["searchable"])
    _say(f"plot: {plot}")
    summary = result_summary(result)
    confirmed_best: dict[str, Any] | None = None
    if args.confirm > 0:
        from vllm_selfspec.layers.search.confirm import confirm_candidates
        from vllm_selfspec.layers.search.optimize import stored_prompt_texts

        chosen = result.top[: args.confirm]
        report = confirm_candidates(
            config.model_dir, stored_prompt_texts(study), [(c.skip, c.k) for c in chosen],
            max_tokens=config.max_new_tokens, batch_size=args.confirm_batch_size,
            dtype=config.dtype, enforce_eager=args.enforce_eager, log=_say,
        )
        report.pop("plain_outputs", None)
        for cand, entry in zip(chosen, report["candidates"], strict=False):
            entry["estimate"] = _estimate_report(search, cand, entry)
            e = entry["estimate"]
            _say(f"  {cand.skip.describe()}: acceptance estimated {e['estimated_acceptance']:.3f}"
                 f" vs measured {e['measured_acceptance'] or float('nan'):.3f}; vLLM acceptance"
                 f" rate predicted {e['estimated_acceptance_rate']:.3f} vs measured "
                 f"{e['measured_acceptance_rate'] or float('nan'):.3f}; speedup estimated "
                 f"{e['estimated_speedup']:.3f}x vs measured {e['measured_speedup']:.3f}x")
        summary["confirm"] = report
        first = report["candidates"][0]
        confirmed_best = {
            "per_token_acceptance": first.get("per_token_acceptance"),
            "acceptance_rate": first.get("acceptance_rate"),
            "speedup": first.get("speedup"),
            "fixed_k_speedup": first.get("fixed_speedup"),
            "plain_tokens_per_s": report["plain_tokens_per_s"],
            "drafting_off_tokens_per_s": first.get("off_tokens_per_s"),
            "selfspec_tokens_per_s": first.get("adaptive_tokens_per_s"),
            "vllm_draft_cost_ratio": first.get("vllm_draft_cost_ratio"),
            "identical_outputs": f"{first['identical_outputs']}/{report['prompts']}",
        }
    profile = make_profile(result, out, model_name=args.model_name, confirmed=confirmed_best)
    out.parent.mkdir(parents=True, exist_ok=True)
    profile.save(out)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(out, 0o666 & ~umask)  # save() writes through mkstemp (0600)
    _say(f"profile: {out}")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2, default=str) + "\n")
    print(show_profile(profile))
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    from vllm_selfspec.layers.profiles import load_profile
    from vllm_selfspec.layers.search.output import show_profile

    print(show_profile(load_profile(args.profile)))
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    from vllm_selfspec.errors import SelfSpecConfigError
    from vllm_selfspec.layers.search.output import validate_profile

    try:
        profile, notes = validate_profile(args.profile, args.model)
    except SelfSpecConfigError as e:
        print(f"INVALID: {e}")
        return 1
    print(f"OK: {profile.label}")
    for note in notes:
        print(f"  {note}")
    if not (args.score or args.confirm):
        return 0
    from vllm_selfspec.layers.skip_set import SkipSet

    skip = SkipSet.of(profile.skip_attention, profile.skip_mlp)
    k = int(profile.draft.get("num_speculative_tokens", 4))
    texts: list[str] = []
    if args.score:
        from vllm_selfspec.layers.search import prompts as prompt_sets
        from vllm_selfspec.layers.search.cost import LinearCostModel, estimate_speedup
        from vllm_selfspec.layers.search.matchness import (
            HFMatchnessScorer,
            generate_references,
            load_model,
            simulate_chain_acceptance,
        )
        from vllm_selfspec.layers.search.optimize import searchable_layers

        model, tok = load_model(args.model, args.dtype, args.device)
        texts, _ = prompt_sets.load_prompt_texts(args.prompts, args.num_prompts, tok, args.chat)
        refs = generate_references(model, tok, texts, args.max_new_tokens)
        scorer = HFMatchnessScorer(model, refs, context=args.context)
        res = scorer.score(skip, keep_hits=True)
        if args.cost == "params":
            cost = LinearCostModel.from_parameters(model, args.overhead, args.verify_slope)
        else:
            n = profile.model.num_hidden_layers
            cost = LinearCostModel.measure(model, searchable_layers(n), k_max=args.k_max)
        cost = cost.with_step_overhead(args.step_overhead)
        est = estimate_speedup(res.matchness, cost.c_draft(skip), cost, args.k_max)
        sim = simulate_chain_acceptance(res.hits, k)
        print(f"  estimated per-token acceptance {res.matchness:.3f} over {res.positions} "
              f"positions ({args.context} context); draft cost {est.c_draft:.3f}; estimated "
              f"speedup {est.speedup:.3f}x at k={est.k} ({cost.kind} costs); predicted vLLM "
              f"acceptance rate at k={k}: {sim['acceptance_rate']:.3f}")
    if args.confirm:
        from vllm_selfspec.layers.search.confirm import confirm_candidates

        if not texts:
            from transformers import AutoTokenizer

            from vllm_selfspec.layers.search import prompts as prompt_sets

            tok = AutoTokenizer.from_pretrained(args.model)
            texts, _ = prompt_sets.load_prompt_texts(args.prompts, args.num_prompts, tok,
                                                     args.chat)
        report = confirm_candidates(args.model, texts, [(skip, k)],
                                    max_tokens=args.max_new_tokens, dtype=args.dtype,
                                    enforce_eager=args.enforce_eager, log=_say)
        entry = report["candidates"][0]
        print(f"  measured per-token acceptance {entry.get('per_token_acceptance', 0):.3f}, "
              f"vLLM acceptance rate {entry.get('acceptance_rate', 0):.3f}, speedup over "
              f"drafting off {entry['speedup']:.3f}x (adaptive), {entry['fixed_speedup']:.3f}x "
              f"(fixed k={k}); identical outputs {entry['identical_outputs']}/{report['prompts']}"
              f"; vLLM draft/step time {entry['vllm_draft_cost_ratio'] or float('nan'):.3f}")
    return 0


def _resolve_embedded_model(args: argparse.Namespace) -> None:
    """An embedded model's name (``qwen2.5-coder-0.5b``) stands for its cached folder."""
    from vllm_selfspec.tools import assets

    for attr in ("model_dir", "model"):
        value = getattr(args, attr, None)
        if value in assets.EMBEDDED_MODELS:
            setattr(args, attr, str(assets.model_folder(value)))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _resolve_embedded_model(args)
    _quiet_libraries()
    _set_threads(args)
    handler = {"search": cmd_search, "show": cmd_show, "validate": cmd_validate}[args.command]
    try:
        return handler(args)
    except KeyboardInterrupt:
        _say("interrupted")
        return 130
    except (ValueError, FileNotFoundError) as e:
        _say(f"error: {e}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
