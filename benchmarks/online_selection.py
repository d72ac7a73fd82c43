"""Online layer selection from a cold start, against the offline profile and plain decoding.

    python -m benchmarks.online_selection              # SmolLM2-135M-Instruct, ~10 min on 2 cores
    python -m benchmarks.online_selection --dry-run    # print the plan, run nothing
    python -m benchmarks.online_selection --smoke      # tiny random model, seconds (tests)
    python -m benchmarks.online_selection --compile    # every engine in vLLM's default mode

Three engines run the same sequence of request rounds (real prompts, HumanEval and MT-bench
alternating, chat-templated; greedy; ``--batch`` prompts of up to ``--max-tokens`` tokens per
round), one engine at a time:

* ``plain``: vLLM without speculative decoding;
* ``profile``: selfspec with the offline-searched shipped profile (``smollm2-135m-instruct``);
* ``online``: selfspec with ``layer_selection="online"`` from a cold start: the depth-based
  default skip set (:func:`vllm_selfspec.config.default_skip_set`), no profile.

Per round it records generated tokens, wall time, tokens/s, vLLM's spec-decode counters
(acceptance = accepted / drafted) and, for ``online``, the search state (passes, skip set,
matchness, time spent in the search). Reported: tokens until convergence, final acceptance of
online vs profile (last third of the rounds), the search's share of wall time, tokens/s vs plain,
and a plot of acceptance vs generated tokens.

Writes ``benchmarks/results/online-selection.{json,md,png}`` (``--out-dir``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"
NAME = "online-selection"
SMOLLM2_PROFILE = "smollm2-135m-instruct"

# The search knobs of the benchmark run: a run of a few thousand tokens cannot wait for the
# defaults (300 passes without improvement at <= 10% of the time), so it searches harder (up to
# half of the step time) and gives up sooner; after convergence the search costs nothing.
BENCH_ONLINE = {
    "seed": 0,
    "overhead_share": 0.5,
    "patience": 30,
    "max_steps": 200,
    "budget_trials": 8,
    "min_tokens": 16,
}
SMOKE_ONLINE = {**BENCH_ONLINE, "overhead_share": 1.0, "min_tokens": 4, "candidates_per_step": 2}


def plan(args: argparse.Namespace) -> dict[str, Any]:
    from vllm_selfspec.config import default_skip_set

    layers = 4 if args.smoke else 30
    start_attention, start_mlp = default_skip_set(layers)
    online = {**(SMOKE_ONLINE if args.smoke else BENCH_ONLINE), **(args.online_search or {})}
    # layer-skip drafts only: the search is what this benchmark measures
    drafter = {"drafts": "layer_skip"}
    methods: dict[str, dict[str, Any] | None] = {
        "plain": None,
        "online": {
            "method": "selfspec",
            **drafter,
            "layer_selection": "online",
            "skip_attention": list(start_attention),
            "skip_mlp": list(start_mlp),
            "num_speculative_tokens": args.k,
            "online_search": online,
        },
    }
    if not args.smoke:
        methods["profile"] = {
            "method": "selfspec",
            **drafter,
            "profile": SMOLLM2_PROFILE,
            "num_speculative_tokens": args.k,
        }
    return {
        "model": "tiny" if args.smoke else "SmolLM2-135M-Instruct",
        "rounds": args.rounds,
        "batch": args.batch,
        "max_tokens": args.max_tokens,
        "temperature": 0.0,
        "k": args.k,
        "compiled": args.compile,
        "methods": methods,
        "prompts": "tiny-model token ids" if args.smoke else "humaneval + mtbench, alternating",
    }


def _model_and_prompts(p: dict[str, Any]) -> tuple[str, list[Any]]:
    n = p["rounds"] * p["batch"]
    if p["model"] == "tiny":
        from vllm.inputs import TokensPrompt

        from tests.tiny_models import tiny_model_dir

        model = str(tiny_model_dir("bench-online", arch="llama", num_layers=4))
        prompts: list[Any] = [
            TokensPrompt(prompt_token_ids=[5 + i, 77, 301, 12 + i]) for i in range(n)
        ]
        return model, prompts
    from vllm_selfspec.tools import assets

    model = str(assets.smollm2_dir())
    he = assets.load_prompts("humaneval", (n + 1) // 2)
    mt = assets.load_prompts("mtbench", n // 2)
    texts = [t for pair in zip(he, mt, strict=False) for t in pair]
    if len(texts) < n:
        texts += he[len(texts) // 2 :][: n - len(texts)]
    return model, list(assets.chat_prompts(model, texts[:n]))


def run_method(name: str, spec: dict[str, Any] | None, model: str, prompts: Sequence[Any],
               p: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams

    from benchmarks.engines import VllmEngine
    from vllm_selfspec.tools.spec_decode_counters import counter_delta

    engine = VllmEngine(name, model, spec, max_model_len=1024 if p["model"] != "tiny" else 192,
                        kv_cache_bytes=(512 << 20) if p["model"] != "tiny" else (1 << 27),
                        enforce_eager=not p.get("compiled", False))
    params = SamplingParams(temperature=0.0, max_tokens=p["max_tokens"])
    rounds: list[dict[str, Any]] = []
    total_tokens = 0
    total_s = 0.0
    try:
        for r in range(p["rounds"]):
            batch = list(prompts[r * p["batch"] : (r + 1) * p["batch"]])
            before = engine.spec_counters()
            t0 = time.perf_counter()
            outs = engine.llm.generate(batch, params, use_tqdm=False)
            wall = time.perf_counter() - t0
            delta = counter_delta(before, engine.spec_counters())
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            total_tokens += tokens
            total_s += wall
            row: dict[str, Any] = {
                "round": r,
                "tokens": tokens,
                "cum_tokens": total_tokens,
                "wall_s": round(wall, 3),
                "cum_wall_s": round(total_s, 3),
                "tokens_per_s": round(tokens / wall, 2),
                "drafted": delta.get("num_draft_tokens", 0),
                "accepted": delta.get("num_accepted_tokens", 0),
                "acceptance": (round(delta["num_accepted_tokens"] / delta["num_draft_tokens"], 4)
                               if delta.get("num_draft_tokens") else None),
                "output_ids": [list(o.outputs[0].token_ids) for o in outs],
            }
            stats = engine.drafter_stats() if spec is not None else None
            online = (stats or {}).get("online")
            if online:
                row["online"] = {k: online.get(k) for k in (
                    "state", "passes", "steps", "budget", "skip_attention", "skip_mlp",
                    "matchness", "estimated_speedup", "overhead_s", "score_interval",
                    "converged_at_step", "converged_reason", "restarts", "pass_s",
                    "verify_step_s", "draft_step_s", "scored_positions")}
                row["online"]["overhead_s"] = round(float(online.get("overhead_s") or 0.0), 3)
            if stats:
                row["skip_attention"] = stats.get("skip_attention")
                row["skip_mlp"] = stats.get("skip_mlp")
            rounds.append(row)
            print(f"[{name}] round {r}: {tokens} tok, {row['tokens_per_s']} tok/s, "
                  f"acceptance {row['acceptance']}"
                  + (f", search {online['state']} passes={online['passes']} "
                     f"skip a{online['skip_attention']} m{online['skip_mlp']}" if online else ""),
                  flush=True)
    finally:
        engine.close()
    return {"name": name, "spec": spec, "start_s": round(engine.start_s, 1), "rounds": rounds,
            "tokens": total_tokens, "wall_s": round(total_s, 2),
            "tokens_per_s": round(total_tokens / total_s, 2) if total_s else None}


def summarize(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    def tail_acceptance(res: dict[str, Any]) -> float | None:
        rows = res["rounds"][-max(1, len(res["rounds"]) // 3):]
        drafted = sum(r["drafted"] for r in rows)
        return round(sum(r["accepted"] for r in rows) / drafted, 4) if drafted else None

    def acceptance(rows: list[dict[str, Any]]) -> float | None:
        drafted = sum(r["drafted"] for r in rows)
        return round(sum(r["accepted"] for r in rows) / drafted, 4) if drafted else None

    out: dict[str, Any] = {}
    plain = results.get("plain")
    for name, res in results.items():
        out[name] = {
            "tokens": res["tokens"],
            "tokens_per_s": res["tokens_per_s"],
            "speed_vs_plain": (round(res["tokens_per_s"] / plain["tokens_per_s"], 3)
                               if plain and plain["tokens_per_s"] else None),
            "final_acceptance": tail_acceptance(res),
            "acceptance": acceptance(res["rounds"]),
            "drafted": sum(r["drafted"] for r in res["rounds"]),
            "outputs_equal_plain": (
                [r["output_ids"] for r in res["rounds"]]
                == [r["output_ids"] for r in plain["rounds"]] if plain else None
            ),
        }
    online = results.get("online")
    if online:
        rows = online["rounds"]
        last = rows[-1].get("online") or {}
        converged = next((r for r in rows if (r.get("online") or {}).get("state") == "converged"),
                         None)
        out["online"].update({
            "converged": converged is not None,
            "tokens_until_convergence": converged["cum_tokens"] if converged else None,
            "converged_reason": last.get("converged_reason"),
            "acceptance_after_convergence": (
                acceptance(rows[rows.index(converged):]) if converged else None
            ),
            "search_passes": last.get("passes"),
            "overhead_s": last.get("overhead_s"),
            "overhead_share": (round(last["overhead_s"] / online["wall_s"], 4)
                               if last.get("overhead_s") is not None and online["wall_s"]
                               else None),
            "final_skip_attention": last.get("skip_attention"),
            "final_skip_mlp": last.get("skip_mlp"),
            "final_matchness": last.get("matchness"),
            "start_skip_attention": online["spec"]["skip_attention"],
            "start_skip_mlp": online["spec"]["skip_mlp"],
        })
    return out


def render_markdown(doc: dict[str, Any], stem: str = NAME) -> str:
    s = doc["summary"]
    p = doc["plan"]
    lines = [
        f"# Online layer selection vs offline profile vs plain ({p['model']})",
        "",
        f"{p['rounds']} rounds x {p['batch']} prompts ({p['prompts']}), greedy, up to "
        f"{p['max_tokens']} new tokens each, k={p['k']}; layer-skip drafts; "
        f"{'compiled' if p.get('compiled') else 'eager'} engines, one at a time on "
        f"{doc['host']['cpus']} CPUs. Online search knobs: "
        f"`{json.dumps(p['methods']['online']['online_search'])}`.",
        "",
        "| method | tokens | tokens/s | vs plain | drafted | acceptance (all) | "
        "final acceptance | outputs == plain |",
        "|---|---:|---:|---:|---:|---:|---:|:---:|",
    ]
    for name, row in s.items():
        lines.append(
            f"| {name} | {row['tokens']} | {row['tokens_per_s']} | {row['speed_vs_plain']} | "
            f"{row.get('drafted')} | {row.get('acceptance')} | {row['final_acceptance']} | "
            f"{row['outputs_equal_plain']} |"
        )
    o = s.get("online", {})
    if o:
        lines += [
            "",
            f"* online start set (cold): attention {o['start_skip_attention']}, "
            f"MLP {o['start_skip_mlp']}",
            f"* converged: {o['converged']} ({o['converged_reason']}); tokens until convergence: "
            f"{o['tokens_until_convergence']}",
            f"* final set: attention {o['final_skip_attention']}, MLP {o['final_skip_mlp']} "
            f"(scored matchness {o['final_matchness']}); {o['search_passes']} scoring passes; "
            f"live acceptance after convergence: {o.get('acceptance_after_convergence')}",
            f"* search overhead: {o['overhead_s']} s = {o['overhead_share']} of the online "
            f"engine's generation wall time",
            "",
            "Final acceptance = accepted / drafted tokens over the last third of the rounds "
            "(None: the draft-length controller had switched drafting off, no draft was "
            "verified).",
        ]
    lines += ["", f"![acceptance vs generated tokens]({stem}.png)", ""]
    return "\n".join(lines)


def plot(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    colors = {"plain": "tab:blue", "online": "tab:orange", "profile": "tab:green"}
    for name, res in doc["results"].items():
        color = colors.get(name)
        xs = [r["cum_tokens"] for r in res["rounds"]]
        acc = [r["acceptance"] for r in res["rounds"]]
        if any(a is not None for a in acc):
            ax1.plot(xs, [a if a is not None else float("nan") for a in acc], marker="o",
                     label=name, color=color)
        ax2.plot(xs, [r["tokens_per_s"] for r in res["rounds"]], marker=".", label=name,
                 color=color)
    conv = doc["summary"].get("online", {}).get("tokens_until_convergence")
    if conv:
        for ax in (ax1, ax2):
            ax.axvline(conv, color="grey", linestyle="--", linewidth=1)
        ax1.text(conv, 0.02, " online converged", color="grey", fontsize=8)
    ax1.set_xlabel("generated tokens")
    ax1.set_ylabel("acceptance (accepted / drafted, per round)")
    ax1.set_ylim(0, 1.05)
    ax1.legend()
    ax2.set_xlabel("generated tokens")
    ax2.set_ylabel("tokens/s (per round)")
    ax2.legend()
    fig.suptitle(f"Online layer selection from a cold start ({doc['plan']['model']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.online_selection",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--online-search", type=json.loads, default=None,
                    help="JSON object of online_search knobs (merged over the benchmark's)")
    ap.add_argument("--methods", type=lambda s: s.split(","), default=None)
    ap.add_argument("--compile", action="store_true",
                    help="every engine in vLLM's default mode (compiled) instead of eager")
    ap.add_argument("--smoke", action="store_true", help="tiny random model, a few rounds")
    ap.add_argument("--dry-run", action="store_true", help="print the plan as JSON and exit")
    ap.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = ap.parse_args(argv)
    if args.rounds is None:
        args.rounds = 3 if args.smoke else 16
    if args.max_tokens is None:
        args.max_tokens = 24 if args.smoke else 96
    for key in ("rounds", "batch", "max_tokens", "k"):
        if getattr(args, key) < 1:
            ap.error(f"--{key.replace('_', '-')} must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    p = plan(args)
    if args.methods:
        p["methods"] = {k: v for k, v in p["methods"].items() if k in args.methods or k == "plain"}
    if args.dry_run:
        print(json.dumps(p, indent=2))
        return 0
    model, prompts = _model_and_prompts(p)
    t0 = time.time()
    results = {name: run_method(name, spec, model, prompts, p)
               for name, spec in p["methods"].items()}
    doc = {
        "plan": p,
        "host": {"cpus": os.cpu_count(), "platform": platform.platform(),
                 "python": sys.version.split()[0],
                 "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None},
        "duration_s": round(time.time() - t0, 1),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "results": results,
        "summary": summarize(results),
    }
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{NAME}-smoke" if args.smoke else NAME
    if args.compile:
        stem += "-compiled"
    (out / f"{stem}.json").write_text(json.dumps(doc, indent=1) + "\n")
    (out / f"{stem}.md").write_text(render_markdown(doc, stem))
    plot(doc, out / f"{stem}.png")
    print(json.dumps(doc["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
