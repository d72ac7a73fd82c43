"""The main demo: plain vLLM decoding vs selfspec on the embedded model, side by side.

    python -m vllm_selfspec.tools.demo    # SmolLM2-135M-Instruct, real MT-bench + HumanEval prompts
    python -m vllm_selfspec.tools.demo --model qwen2.5-coder-0.5b    # the larger embedded model

It runs the same greedy requests through a plain vLLM engine and a selfspec engine of the same
model (fp32, so greedy outputs are comparable token for token), then prints tokens/s of both, the
ratio, vLLM's own acceptance metrics and how many outputs were identical. Options choose another
model folder, the speculative config, prompt count and length, and a model with known redundancy
(``--insert-zero-layers N``: N layers with zero output projections are inserted and skipped, so
acceptance is 1.0 and the speedup is what the implementation makes of a free draft).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass


@dataclass
class RunResult:
    outputs: list[list[int]]
    tokens_per_s: list[float]
    acceptance: float | None = None
    mean_accepted_length: float | None = None
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    # {source: {"num_drafts", "num_draft_tokens", "num_accepted_tokens"}} over the timed passes
    by_source: dict[str, dict[str, float]] | None = None


def run_engine(
    model: str,
    prompts: list[str],
    max_tokens: int,
    repeats: int,
    spec: dict | None,
    batch: int,
    compile_model: bool = True,
    max_model_len: int = 2048,
) -> RunResult:
    from vllm import LLM, SamplingParams

    from vllm_selfspec.tools.spec_decode_counters import (
        acceptance_rate,
        counter_delta,
        mean_accepted_length,
        read_source_counters,
        read_spec_decode_counters,
    )

    llm = LLM(
        model=model,
        dtype="float32",
        max_model_len=max_model_len,
        kv_cache_memory_bytes=1 << 30,
        disable_log_stats=False,
        speculative_config=spec,
        seed=0,
        enforce_eager=not compile_model,
    )
    try:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=False)
        llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
        before = read_spec_decode_counters(llm)
        sources_before = read_source_counters(llm) if spec is not None else {}
        speeds: list[float] = []
        outputs: list[list[int]] = []
        for _ in range(repeats):
            start = time.perf_counter()
            results = []
            for i in range(0, len(prompts), batch):
                results += llm.generate(prompts[i : i + batch], params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            outputs = [list(r.outputs[0].token_ids) for r in results]
            speeds.append(sum(len(o) for o in outputs) / elapsed)
        after = read_spec_decode_counters(llm)
        result = RunResult(outputs=outputs, tokens_per_s=speeds)
        delta = counter_delta(before, after)
        if spec is not None:
            result.acceptance = acceptance_rate(delta)
            result.mean_accepted_length = mean_accepted_length(delta)
            result.drafts = int(delta.get("num_drafts", 0))
            result.draft_tokens = int(delta.get("num_draft_tokens", 0))
            result.accepted_tokens = int(delta.get("num_accepted_tokens", 0))
            result.by_source = {
                source: counter_delta(sources_before.get(source, {}), counts)
                for source, counts in read_source_counters(llm).items()
            }
        return result
    finally:
        llm.llm_engine.engine_core.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model",
        default="smollm2-135m",
        help="an embedded model (smollm2-135m, qwen2.5-coder-0.5b: downloaded and converted on "
        "first use) or a Hugging Face model folder (default: smollm2-135m)",
    )
    parser.add_argument(
        "--speculative-config",
        default='{"method": "selfspec"}',
        help="selfspec speculative config JSON (as for vllm serve; default: selfspec's defaults, "
        "hybrid drafts with the model's shipped profile)",
    )
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2, help="timed passes per engine")
    parser.add_argument(
        "--enforce-eager",
        action="store_true",
        help="run both engines eager (vLLM's enforce_eager; by default both run in vLLM's "
        "default, compiled mode, as users run them)",
    )
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="show vLLM's log (by default only errors, so that the result is not buried)",
    )
    parser.add_argument(
        "--insert-zero-layers",
        type=int,
        default=0,
        metavar="N",
        help="insert N zero-output layers into the model and skip exactly those",
    )
    parser.add_argument(
        "--json",
        metavar="PATH",
        help="also write the result (speeds, spec-decode counters, identical outputs) as JSON",
    )
    args = parser.parse_args(argv)
    quiet(verbose=args.verbose)

    from transformers import AutoTokenizer

    from vllm_selfspec.tools import assets

    try:
        model = str(assets.model_folder(args.model))
    except ValueError as e:
        parser.error(str(e))
    spec = json.loads(args.speculative_config)
    if args.insert_zero_layers:
        model, zero = _with_zero_layers(model, args.insert_zero_layers)
        spec.update({"skip_attention": zero, "skip_mlp": zero})
        spec.pop("profile", None)
    tokenizer = AutoTokenizer.from_pretrained(model)
    half = max(1, args.num_prompts // 2)
    texts = assets.load_prompts("mtbench", half) + assets.load_prompts(
        "humaneval", args.num_prompts - half
    )
    prompts = assets.chat_prompts(tokenizer, texts)

    print(
        f"model: {model}\nprompts: {len(prompts)} real prompts (MT-bench + HumanEval), "
        f"{args.max_tokens} greedy tokens each, batch size {args.batch_size}",
        flush=True,
    )
    print("running plain vLLM decoding ...", flush=True)
    plain = run_engine(
        model,
        prompts,
        args.max_tokens,
        args.repeats,
        None,
        args.batch_size,
        not args.enforce_eager,
        args.max_model_len,
    )
    print(f"running selfspec {json.dumps(spec)} ...", flush=True)
    fast = run_engine(
        model,
        prompts,
        args.max_tokens,
        args.repeats,
        spec,
        args.batch_size,
        not args.enforce_eager,
        args.max_model_len,
    )

    identical = sum(a == b for a, b in zip(plain.outputs, fast.outputs, strict=True))
    plain_tps = statistics.median(plain.tokens_per_s)
    fast_tps = statistics.median(fast.tokens_per_s)
    mode = "eager (--enforce-eager)" if args.enforce_eager else "vLLM's default (compiled)"
    print()
    print(f"=== result: {len(prompts)} prompts, both engines in {mode} mode ===")
    print(f"plain vLLM decoding : {plain_tps:8.1f} tokens/s")
    print(f"selfspec            : {fast_tps:8.1f} tokens/s")
    print(f"speedup             : {fast_tps / plain_tps:8.2f}x")
    if fast.acceptance is None:
        print("acceptance rate     :      n/a (the controller drafted nothing)")
    else:
        print(f"acceptance rate     : {fast.acceptance:8.2f}")
        print(f"mean accepted length: {fast.mean_accepted_length:8.2f} tokens per verification")
    if fast.by_source and fast.draft_tokens:
        print(f"drafts by source    : {source_split(fast.by_source, fast.draft_tokens)}")
    print(f"outputs identical   : {identical}/{len(prompts)}")
    if args.json:
        result = {
            "model": model,
            "speculative_config": spec,
            "num_prompts": len(prompts),
            "max_tokens": args.max_tokens,
            "batch_size": args.batch_size,
            "plain_tokens_per_s": plain_tps,
            "selfspec_tokens_per_s": fast_tps,
            "speedup": fast_tps / plain_tps,
            # vLLM's spec-decode counters over the timed passes
            "num_drafts": fast.drafts,
            "num_draft_tokens": fast.draft_tokens,
            "num_accepted_tokens": fast.accepted_tokens,
            "acceptance_rate": fast.acceptance,
            "mean_accepted_length": fast.mean_accepted_length,
            "by_source": fast.by_source,
            "output_tokens": [len(o) for o in plain.outputs],
            "outputs_identical": identical,
        }
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if identical == len(prompts) else 1


def quiet(verbose: bool = False) -> None:
    """Engine logs and library warnings off (errors stay), for this process and the engine
    processes it starts, unless ``verbose`` or the user set ``VLLM_LOGGING_LEVEL``."""
    if verbose:
        return
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import warnings

    warnings.simplefilter("ignore")


def source_split(by_source: dict[str, dict[str, float]], draft_tokens: int) -> str:
    """``lookup 62% of draft tokens (0.61 accepted), layer_skip 38% (0.97 accepted)``: each
    source that drafted, its share of the draft tokens and its acceptance."""
    parts = []
    for source, counts in by_source.items():
        tokens = counts.get("num_draft_tokens", 0)
        if tokens > 0:
            share = tokens / draft_tokens
            accepted = counts.get("num_accepted_tokens", 0) / tokens
            parts.append(f"{source} {share:.0%} ({accepted:.2f} accepted)")
    return ", ".join(parts) + (" of the draft tokens" if parts else "")


def _with_zero_layers(model: str, count: int) -> tuple[str, list[int]]:
    import json as _json
    from pathlib import Path

    from vllm_selfspec.tools import assets

    layers = _json.loads((Path(model) / "config.json").read_text())["num_hidden_layers"]
    positions = [round((i + 1) * layers / (count + 1)) for i in range(count)]
    out = assets.cache_root() / "models" / f"{Path(model).name}-zero{count}"
    marker = out / "zero_layers.json"
    if marker.is_file():
        return str(out), _json.loads(marker.read_text())
    zero = assets.insert_zero_layers(model, out, positions)
    marker.write_text(_json.dumps(zero))
    return str(out), zero


if __name__ == "__main__":
    sys.exit(main())
