"""Greedy agreement with plain vLLM decoding in bf16 (and fp32, the control).

    python -m benchmarks.bf16_agreement              # SmolLM2-135M-Instruct, bf16 + fp32
    python -m benchmarks.bf16_agreement --dtypes bfloat16 --prompts 16   # a shorter run
    python -m benchmarks.bf16_agreement --dry-run    # print the plan, run nothing
    python -m benchmarks.bf16_agreement --rerender A.json B.json   # merge stored runs

Speculative decoding verifies a draft of k tokens in one forward over k + 1 positions; plain
decoding runs one position per step. The two compute the same logits in exact arithmetic, but
not bit for bit: the kernels see other shapes (matmul blocking, attention over a query block), so
the logits differ by rounding. Greedy decoding turns a rounding difference into a different token
only where the top two logits are closer than the rounding error; in fp32 that practically never
happens within a few hundred tokens, in bf16 (8 bits of mantissa) it does. So "token-identical" is
a property of the arithmetic precision, and this benchmark measures it: for each dtype and batch
size, every method's greedy outputs against plain vLLM's outputs of the same prompts at the same
dtype and batch size.

Methods: ``plain`` (the reference), ``selfspec`` (the shipped SmolLM2 profile, controller on),
``selfspec fixed k`` (the same skip set, ``adaptive`` off: k drafts verified at every step), and
vLLM's own ``ngram`` (prompt lookup). Also reported: ``plain`` at batch B against ``plain`` at
batch 1 -- how far plain decoding itself moves when only the batch shape changes.

Per method: the share of outputs identical to plain, the mean first-divergence position (over the
outputs that diverge), and the token-level agreement (see :func:`compare`). One engine at a time
(vLLM's default compiled mode unless ``--eager``); the result is written after every engine.

Writes ``benchmarks/results/bf16-agreement.{json,md}`` (``--out-dir``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
import traceback
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks.run import _utc, host_info

RESULTS_DIR = Path(__file__).resolve().parent / "results"
NAME = "bf16-agreement"
SMOLLM2_PROFILE = "smollm2-135m-instruct"
K = 4  # draft length of the speculative methods (as in benchmarks/run.py)
PLAIN = "plain"
DTYPES = ("bfloat16", "float32")
SHORT_DTYPE = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}
# vLLM's CompilationMode values (runs recorded before the name was stored hold the number)
COMPILATION_MODES = {"0": "NONE", "1": "STOCK_TORCH_COMPILE", "2": "DYNAMO_TRACE_ONCE",
                     "3": "VLLM_COMPILE"}


# ------------------------------------------------------------------------- agreement arithmetic

def first_divergence(output: Sequence[int], reference: Sequence[int]) -> int | None:
    """Index of the first generated token where ``output`` and ``reference`` differ; ``None``
    when they are identical. When one is a strict prefix of the other (one stopped earlier),
    they diverge at the shorter one's length."""
    n = min(len(output), len(reference))
    for i in range(n):
        if output[i] != reference[i]:
            return i
    return None if len(output) == len(reference) else n


def compare(outputs: Sequence[Sequence[int]],
            reference: Sequence[Sequence[int]]) -> dict[str, Any]:
    """Agreement of a method's outputs with the reference outputs of the same prompts.

    * ``identical`` / ``identical_share``: outputs equal to the reference token for token;
    * ``mean_first_divergence``: mean index (0-based, in generated tokens) of the first differing
      token, over the outputs that differ (``None`` when none does);
    * ``token_agreement``: reference tokens reproduced before the first divergence, over all
      reference tokens (1.0 iff every output is identical or extends its reference). After a
      divergence the two continuations condition on different text, so later positional
      matches are not agreement;
    * ``positional_agreement``: positions holding the same token in both, over the longer
      length (includes accidental matches after a divergence; for comparison only).
    """
    if len(outputs) != len(reference):
        raise ValueError(f"{len(outputs)} outputs against {len(reference)} reference outputs")
    divergences: list[int] = []
    prefix = ref_tokens = same = longest = identical = 0
    for out, ref in zip(outputs, reference, strict=True):
        d = first_divergence(out, ref)
        ref_tokens += len(ref)
        longest += max(len(out), len(ref))
        same += sum(a == b for a, b in zip(out, ref, strict=False))
        if d is None:
            identical += 1
            prefix += len(ref)
        else:
            divergences.append(d)
            prefix += min(d, len(ref))
    n = len(outputs)
    return {
        "n": n,
        "identical": identical,
        "identical_share": identical / n if n else None,
        "diverged": len(divergences),
        "first_divergences": divergences,
        "mean_first_divergence": statistics.fmean(divergences) if divergences else None,
        "median_first_divergence": statistics.median(divergences) if divergences else None,
        "reference_tokens": ref_tokens,
        "token_agreement": prefix / ref_tokens if ref_tokens else None,
        "positional_agreement": same / longest if longest else None,
    }


def acceptance(spec: Mapping[str, Any] | None) -> float | None:
    """Accepted over drafted tokens of vLLM's spec-decode counters (``None``: nothing drafted)."""
    if not spec or not spec.get("num_draft_tokens"):
        return None
    return spec["num_accepted_tokens"] / spec["num_draft_tokens"]


def summarize(runs: Sequence[Mapping[str, Any]],
              datasets: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Summary rows from run records (``dtype``, ``batch``, ``method``, ``outputs``, optional
    ``spec`` counters): every method against ``plain`` of the same dtype and batch size, and
    ``plain`` at each batch size > 1 against ``plain`` at batch 1 (method ``plain vs plain B=1``).
    ``datasets`` (one name per prompt) adds per-dataset identical counts."""
    # A merged result holds several runs' records (``source``: which run): a method is compared
    # with plain of its own run, so that two plain references never mix.
    by_key = {(r.get("source", 0), r["dtype"], r["batch"], r["method"]): r
              for r in runs if "outputs" in r}
    rows: list[dict[str, Any]] = []
    for r in runs:
        key = (r["dtype"], r["batch"], r["method"])
        source = r.get("source", 0)
        if "outputs" not in r:
            rows.append({"dtype": r["dtype"], "batch": r["batch"], "method": r["method"],
                         "error": r.get("error", "no outputs")})
            continue
        if r["method"] == PLAIN:
            ref = by_key.get((source, r["dtype"], 1, PLAIN))
            if r["batch"] == 1 or ref is None:
                continue
            method = f"{PLAIN} vs {PLAIN} B=1"
        else:
            ref = by_key.get((source, key[0], key[1], PLAIN))
            method = r["method"]
            if ref is None:
                rows.append({"dtype": key[0], "batch": key[1], "method": method,
                             "error": "no plain run of this dtype and batch size"})
                continue
        row: dict[str, Any] = {"dtype": key[0], "batch": key[1], "method": method,
                               **compare(r["outputs"], ref["outputs"])}
        if datasets:
            per: dict[str, list[int]] = {}
            for ds, out, rf in zip(datasets, r["outputs"], ref["outputs"], strict=False):
                cnt = per.setdefault(ds, [0, 0])
                cnt[0] += out == rf
                cnt[1] += 1
            row["identical_by_dataset"] = per
        if r["method"] != PLAIN:
            row["acceptance"] = acceptance(r.get("spec"))
            row["drafted"] = (r.get("spec") or {}).get("num_draft_tokens")
        if source:
            row["source"] = source
        rows.append(row)
    # rows a merged result holds twice (e.g. plain vs plain of two runs) name the later run
    seen = Counter((x["dtype"], x["batch"], x["method"]) for x in rows)
    for x in rows:
        if x.get("source") and seen[(x["dtype"], x["batch"], x["method"])] > 1:
            x["method"] = f"{x['method']} (run {x['source'] + 1})"
    order = {d: i for i, d in enumerate(DTYPES)}
    rows.sort(key=lambda x: (order.get(x["dtype"], 9), x["batch"]))
    return rows


# ------------------------------------------------------------------------------------- plan

def methods(k: int = K) -> dict[str, dict[str, Any] | None]:
    """Method name -> speculative config (``None``: plain decoding)."""
    return {
        PLAIN: None,
        "selfspec fixed k": {"method": "selfspec", "profile": SMOLLM2_PROFILE,
                             "num_speculative_tokens": k, "adaptive": False},
        "ngram": {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4,
                  "prompt_lookup_min": 2},
        "selfspec": {"method": "selfspec", "profile": SMOLLM2_PROFILE,
                     "num_speculative_tokens": k, "adaptive": True},
    }


def plan(args: argparse.Namespace) -> dict[str, Any]:
    ms = methods(args.k)
    if args.methods:
        ms = {n: s for n, s in ms.items() if n == PLAIN or n in args.methods}
    return {
        "suite": NAME,
        "model": "tiny" if args.smoke else "SmolLM2-135M-Instruct",
        "dtypes": args.dtypes,
        "batches": args.batches,
        "prompts": args.prompts,
        "datasets": ["humaneval", "mtbench"],
        "max_tokens": args.max_tokens,
        "k": args.k,
        "compiled": not args.eager,
        "max_model_len": args.max_model_len,
        "methods": ms,
    }


def _model_and_prompts(p: dict[str, Any]) -> tuple[str, list[str], list[str]]:
    """Model folder, chat-templated prompts (HumanEval and MT-bench alternating) and each
    prompt's dataset."""
    from vllm_selfspec.tools import assets

    if p["model"] == "tiny":
        from tests.tiny_models import tiny_model_dir

        model = str(tiny_model_dir("bench-smoke", num_layers=4, hidden_size=128))
        texts = [f"Count from {i} to {i + 9}:" for i in range(p["prompts"])]
        return model, texts, ["synthetic"] * len(texts)
    model = str(assets.smollm2_dir())
    n = p["prompts"]
    he = assets.load_prompts("humaneval", (n + 1) // 2)
    mt = assets.load_prompts("mtbench", n // 2)
    texts: list[str] = []
    names: list[str] = []
    for i in range(max(len(he), len(mt))):
        for ds, src in (("humaneval", he), ("mtbench", mt)):
            if i < len(src):
                texts.append(src[i])
                names.append(ds)
    return model, assets.chat_prompts(model, texts), names


def _engine_facts(llm: Any) -> dict[str, Any]:
    """Compilation mode and scheduling of a started engine, as vLLM resolved them."""
    cfg = llm.llm_engine.vllm_config
    comp = cfg.compilation_config
    mode = getattr(comp, "mode", getattr(comp, "level", None))
    return {
        "enforce_eager": bool(cfg.model_config.enforce_eager),
        "compilation_mode": str(getattr(mode, "name", mode)),
        "compile_backend": str(getattr(comp, "backend", "")),
        "cudagraph_mode": str(getattr(comp, "cudagraph_mode", None)),
        "async_scheduling": getattr(cfg.scheduler_config, "async_scheduling", None),
        "model_dtype": str(cfg.model_config.dtype),
    }


# ------------------------------------------------------------------------------------- run

def run(p: dict[str, Any], out_dir: Path, log=print) -> dict[str, Any]:
    from benchmarks.engines import VllmEngine, counter_delta

    model, prompts, datasets = _model_and_prompts(p)
    doc: dict[str, Any] = {
        "suite": NAME, "plan": p, "partial": True,
        "started_utc": _utc(time.time()), "host": host_info(),
        "datasets_per_prompt": datasets, "engines": [], "runs": [], "loadavg_samples": [],
    }
    t0 = time.time()
    for dtype in p["dtypes"]:
        for name, spec in p["methods"].items():
            log(f"[{NAME}] {dtype}: starting {name}")
            try:
                eng = VllmEngine(name, model, spec, dtype=dtype,
                                 max_model_len=p["max_model_len"], kv_cache_bytes=1 << 30,
                                 enforce_eager=not p["compiled"])
            except Exception as exc:  # recorded, the other methods still run
                msg = " ".join(f"{type(exc).__name__}: {exc}".split())[:600]
                log(f"[{NAME}]   {name} failed to start: {msg}")
                for b in p["batches"]:
                    doc["runs"].append({"dtype": dtype, "batch": b, "method": name,
                                        "error": msg})
                continue
            try:
                doc["engines"].append({"dtype": dtype, "method": name, "spec": spec,
                                       "start_s": round(eng.start_s, 1),
                                       **_engine_facts(eng.llm)})
                eng.generate(prompts[:1], 0.0, 4, 1)  # warm-up
                for b in p["batches"]:
                    before = eng.spec_counters() if spec else {}
                    try:
                        outputs, seconds = eng.generate(prompts, 0.0, p["max_tokens"], b)
                    except Exception as exc:
                        doc["runs"].append({"dtype": dtype, "batch": b, "method": name,
                                            "error": f"{type(exc).__name__}: {exc}"[:600]})
                        continue
                    rec: dict[str, Any] = {
                        "dtype": dtype, "batch": b, "method": name, "seconds": round(seconds, 2),
                        "tokens": sum(len(o) for o in outputs), "outputs": outputs,
                        "loadavg": list(os.getloadavg()),
                    }
                    if spec:
                        rec["spec"] = counter_delta(before, eng.spec_counters())
                    doc["runs"].append(rec)
                    log(f"[{NAME}]   {dtype} {name} B={b}: {rec['tokens']} tokens in "
                        f"{seconds:.0f} s, load {os.getloadavg()[0]:.1f}")
            finally:
                eng.close()
            doc["loadavg_samples"].append(list(os.getloadavg()))
            _finish(doc, t0, partial=True)
            write(doc, out_dir)
    _finish(doc, t0, partial=False)
    write(doc, out_dir)
    return doc


def _finish(doc: dict[str, Any], t0: float, partial: bool) -> None:
    doc["partial"] = partial
    doc["finished_utc"] = _utc(time.time())
    doc["duration_s"] = round(time.time() - t0, 1)
    doc["summary"] = summarize(doc["runs"], doc.get("datasets_per_prompt"))


def write(doc: dict[str, Any], out_dir: Path) -> None:
    """``<out_dir>/bf16-agreement.json`` and ``.md``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{NAME}-smoke" if doc["plan"]["model"] == "tiny" else NAME
    (out_dir / f"{stem}.json").write_text(dumps(doc) + "\n")
    (out_dir / f"{stem}.md").write_text(render_markdown(doc))


def dumps(doc: Mapping[str, Any]) -> str:
    """Indented JSON with every token-id list (``outputs``) and divergence list on one line."""
    flat: list[str] = []

    def placeholder(value: list) -> str:
        flat.append(json.dumps(value))
        return f"@@{len(flat) - 1}@@"

    copy = json.loads(json.dumps(doc, default=str))
    for r in copy.get("runs", []):
        if "outputs" in r:
            r["outputs"] = [placeholder(o) for o in r["outputs"]]
    for row in copy.get("summary", []):
        if "first_divergences" in row:
            row["first_divergences"] = placeholder(row["first_divergences"])
    text = json.dumps(copy, indent=1)
    return re.sub(r'"@@(\d+)@@"', lambda m: flat[int(m.group(1))], text)


def load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def merge(docs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One result from stored runs of the same prompts (e.g. one process per dtype): the first
    document with the others' engines and runs added, its summary recomputed."""
    doc = json.loads(json.dumps(docs[0]))
    for source, other in enumerate(docs[1:], start=1):
        for key in ("prompts", "max_tokens", "k", "compiled", "batches"):
            if other["plan"][key] != doc["plan"][key]:
                raise ValueError(f"cannot merge runs with different {key!r}: "
                                 f"{doc['plan'][key]!r} and {other['plan'][key]!r}")
        if other.get("datasets_per_prompt") != doc.get("datasets_per_prompt"):
            raise ValueError("cannot merge runs of different prompts")
        doc["plan"]["dtypes"] += [d for d in other["plan"]["dtypes"]
                                  if d not in doc["plan"]["dtypes"]]
        doc["engines"] += other.get("engines", [])
        doc["runs"] += [{**r, "source": source} for r in other.get("runs", [])]
        doc["loadavg_samples"] = doc.get("loadavg_samples", []) + other.get("loadavg_samples", [])
        doc["partial"] = bool(doc.get("partial") or other.get("partial"))
        doc["started_utc"] = min(doc["started_utc"], other["started_utc"])
        doc["finished_utc"] = max(doc["finished_utc"], other["finished_utc"])
        doc["duration_s"] = max(doc["duration_s"], other["duration_s"])
        doc.setdefault("merged_from", []).append(other["started_utc"])
    doc["summary"] = summarize(doc["runs"], doc.get("datasets_per_prompt"))
    return doc


# -------------------------------------------------------------------------------- markdown

def _pct(x: float | None) -> str:
    return "" if x is None else f"{100 * x:.1f}%"


def _num(x: float | None, fmt: str = "{:.1f}") -> str:
    return "" if x is None else fmt.format(x)


def render_markdown(doc: Mapping[str, Any]) -> str:
    p = doc["plan"]
    mode = "compiled (vLLM's default mode)" if p["compiled"] else "eager"
    lines = [f"# Benchmark `{NAME}`: greedy agreement with plain vLLM decoding", ""]
    if doc.get("partial"):
        lines += ["**Partial results (the run was still going or was interrupted).**", ""]
    host = doc.get("host", {})
    lines += [
        f"Run {doc.get('started_utc')} .. {doc.get('finished_utc')} "
        f"({doc.get('duration_s', 0):.0f} s) on {host.get('cpus', '?')} CPUs "
        f"(vLLM {host.get('vllm', '?')}, torch {host.get('torch', '?')}). "
        f"{p['model']}, {p['prompts']} chat-templated prompts (HumanEval and MT-bench "
        f"alternating), greedy, up to {p['max_tokens']} new tokens, k = {p['k']}; engines "
        f"{mode}, one at a time; batch B = prompts in groups of B per `generate` call.", "",
        "Every method is compared with `plain` of the same dtype and batch size; "
        "`plain vs plain B=1` compares plain at batch B with plain at batch 1.", "",
        "| dtype | B | method | identical | mean first divergence | token agreement "
        "| positional agreement | acceptance | identical per dataset |",
        "|---|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in doc.get("summary", []):
        dtype = SHORT_DTYPE.get(r["dtype"], r["dtype"])
        if r.get("error"):
            lines.append(f"| {dtype} | {r['batch']} | {r['method']} | error: {r['error'][:200]} "
                         "| | | | | |")
            continue
        per = ", ".join(f"{ds} {a}/{n}" for ds, (a, n) in
                        (r.get("identical_by_dataset") or {}).items())
        lines.append(
            f"| {dtype} | {r['batch']} | {r['method']} | {r['identical']}/{r['n']} "
            f"({_pct(r['identical_share'])}) | {_num(r['mean_first_divergence'])} "
            f"| {_pct(r['token_agreement'])} | {_pct(r['positional_agreement'])} "
            f"| {_num(r.get('acceptance'), '{:.2f}')} | {per} |")
    lines += [
        "",
        "Columns: `identical` = outputs equal to the reference token for token; `mean first "
        "divergence` = mean 0-based index of the first differing generated token, over the "
        "outputs that differ; `token agreement` = reference tokens reproduced before the first "
        "divergence over all reference tokens; `positional agreement` = positions with the same "
        "token over the longer output's length (counts accidental matches after a divergence); "
        "`acceptance` = accepted / drafted tokens (vLLM's spec-decode counters).", "",
    ]
    engines = doc.get("engines") or []
    if engines:
        lines += ["Engines:", "", "| dtype | method | start s | enforce_eager | compilation "
                  "| async scheduling |", "|---|---|---:|---|---|---|"]
        for e in engines:
            mode = str(e["compilation_mode"])
            mode = COMPILATION_MODES.get(mode, mode)
            if e.get("compile_backend"):
                mode += f" ({e['compile_backend']})"
            dtype = str(e["dtype"]).removeprefix("torch.")
            lines.append(f"| {SHORT_DTYPE.get(dtype, dtype)} | {e['method']} "
                         f"| {e['start_s']} | {e['enforce_eager']} | {mode} "
                         f"| {e['async_scheduling']} |")
        lines.append("")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------- misc

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bf16_agreement",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtypes", type=lambda s: s.split(","), default=list(DTYPES),
                    help="comma-separated vLLM dtypes (default: bfloat16,float32)")
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")],
                    default=[1, 16], help="comma-separated batch sizes (default: 1,16)")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--k", type=int, default=K)
    ap.add_argument("--methods", type=lambda s: s.split(","), default=None,
                    help="only these methods (plain always runs)")
    ap.add_argument("--eager", action="store_true", help="enforce_eager=True engines")
    ap.add_argument("--smoke", action="store_true", help="tiny random model (harness check)")
    ap.add_argument("--dry-run", action="store_true", help="print the plan as JSON and exit")
    ap.add_argument("--rerender", type=Path, nargs="+", metavar="RESULT.json",
                    help="recompute the summary of stored runs (several: merged, e.g. one "
                         "process per dtype) and write JSON and Markdown to --out-dir (runs "
                         "nothing)")
    ap.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = ap.parse_args(argv)
    for key in ("prompts", "max_tokens", "max_model_len", "k"):
        if getattr(args, key) < 1:
            ap.error(f"--{key.replace('_', '-')} must be >= 1")
    if any(b < 1 for b in args.batches):
        ap.error("--batches must be >= 1")
    if 1 not in args.batches:
        args.batches = [1, *args.batches]  # plain at batch 1 is the batch-shape reference
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.rerender:
        doc = merge([load(path) for path in args.rerender])
        write(doc, args.out_dir)
        print(render_markdown(doc))
        return 0
    p = plan(args)
    if args.dry_run:
        print(json.dumps(p, indent=1))
        return 0
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    def log(msg: str) -> None:
        print(f"{time.strftime('%H:%M:%S')} {msg}", flush=True)

    try:
        doc = run(p, args.out_dir, log=log)
    except Exception:
        traceback.print_exc()
        return 1
    print(render_markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
