"""Self-check on your own hardware: is selfspec lossless for this model, and how fast is it?

    python -m vllm_selfspec.check --model PATH [--speculative-config JSON]
    selfspec-check --model PATH --speculative-config '{"num_speculative_tokens": 4}'

A few built-in prompts (code, a repetitive list, questions, prose) run greedily through a plain vLLM
engine, which is then shut down, and through a selfspec engine of the same model, both in vLLM's
default mode (compiled; ``--enforce-eager`` is for debugging only). Each engine warms up, runs one
pass with every prompt in one batch, then ``--repeats`` timed passes at ``--batch-size``. Printed:
how many outputs are identical to plain decoding (both passes), tokens/s of both and their ratio,
acceptance rate, mean accepted length, the drafter's measured cost of a draft forward relative to a
plain step, the split of drafts by source, and one verdict line, always the last line printed.

The speculative config defaults to ``{"method": "selfspec"}``; a JSON given is merged into it. Exit
code 0 when every output is identical, 1 on any mismatch (selfspec slower than plain decoding is a
warning in the verdict, not a failure). ``--dtype`` defaults to vLLM's "auto" (the model's own
dtype, bf16 for most GPU checkpoints), where a mismatch can also come from rounding: verifying
several tokens in one forward reorders floating-point sums, which can flip a near tie; rerun with
``--dtype float32`` to tell such a flip from a bug.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import time
from typing import Any

from vllm_selfspec.tools.demo import RunResult, source_split

EXTENSION = "vllm_selfspec.plugin.worker_ext.SelfSpecWorkerExtension"
PROMPTS = (
    "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
    "List the numbers from 1 to 30, one per line, each followed by its square.",
    "What is the capital of France, and what is it famous for?",
    "Repeat the sentence 'the quick brown fox jumps over the lazy dog' five times.",
    "Explain in three sentences how a hash table works.",
    "Write a short story about a robot who learns to paint.",
)


def run_engine(model: str, prompts: list[str], spec: dict | None, args: argparse.Namespace
               ) -> tuple[RunResult, list[list[int]], dict[str, Any], str]:
    """One engine: ``(timed passes, outputs of the batched pass, drafter stats, model dtype)``."""
    from vllm import LLM, SamplingParams
    from vllm.platforms import current_platform

    from vllm_selfspec.tools.spec_decode_counters import (
        acceptance_rate,
        counter_delta,
        mean_accepted_length,
        read_source_counters,
        read_spec_decode_counters,
    )

    llm = LLM(
        model=model, dtype=args.dtype, max_model_len=args.max_model_len, seed=0,
        speculative_config=spec, enforce_eager=args.enforce_eager, disable_log_stats=False,
        worker_extension_cls=EXTENSION,
        **({"kv_cache_memory_bytes": 1 << 30} if current_platform.is_cpu() else {}),
    )  # fmt: skip
    try:
        tokenizer = llm.get_tokenizer()
        if getattr(tokenizer, "chat_template", None):
            prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}],
                                                     tokenize=False, add_generation_prompt=True)
                       for p in prompts]  # fmt: skip
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)

        def generate(batch: list[str]) -> list[list[int]]:
            return [list(r.outputs[0].token_ids) for r in llm.generate(batch, params,
                                                                       use_tqdm=False)]

        llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
        batched = generate(prompts)
        before, sources_before = read_spec_decode_counters(llm), read_source_counters(llm)
        result = RunResult(outputs=[], tokens_per_s=[])
        for _ in range(args.repeats):
            start = time.perf_counter()
            outputs = [o for i in range(0, len(prompts), args.batch_size)
                       for o in generate(prompts[i : i + args.batch_size])]  # fmt: skip
            result.tokens_per_s.append(sum(map(len, outputs)) / (time.perf_counter() - start))
            result.outputs = outputs
        delta = counter_delta(before, read_spec_decode_counters(llm))
        result.acceptance, result.mean_accepted_length = (acceptance_rate(delta),
                                                          mean_accepted_length(delta))
        result.drafts = int(delta.get("num_drafts", 0))
        result.draft_tokens = int(delta.get("num_draft_tokens", 0))
        result.accepted_tokens = int(delta.get("num_accepted_tokens", 0))
        result.by_source = {source: counter_delta(sources_before.get(source, {}), counts)
                            for source, counts in read_source_counters(llm).items()}
        stats = next((s for s in llm.collective_rpc("selfspec_stats") if s), {}) if spec else {}
        dtype = str(llm.llm_engine.model_config.dtype).removeprefix("torch.")
        return result, batched, stats, dtype
    finally:
        llm.llm_engine.engine_core.shutdown()


def _stop_resource_tracker() -> None:
    """Python's multiprocessing resource tracker warns about the shared memory that vLLM's engines
    left registered when it stops, by default at exit, after the verdict: stop it now."""
    from multiprocessing import resource_tracker

    gc.collect()
    sys.stdout.flush()
    with contextlib.suppress(Exception):
        resource_tracker._resource_tracker._stop()


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="model folder or Hugging Face name")
    parser.add_argument("--speculative-config", default="{}", metavar="JSON",
                        help='merged into {"method": "selfspec"}')
    parser.add_argument("--num-prompts", type=int, default=len(PROMPTS),
                        help=f"built-in prompts to run (at most {len(PROMPTS)})")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="auto", help='as for vLLM (default "auto")')
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=1, help="of the timed passes")
    parser.add_argument("--repeats", type=int, default=3, help="timed passes per engine")
    parser.add_argument("--enforce-eager", action="store_true", help="debugging only")
    parser.add_argument("--json", metavar="PATH", help="also write the numbers as JSON")
    args = parser.parse_args(argv)
    try:
        spec = {"method": "selfspec", **json.loads(args.speculative_config)}
    except (json.JSONDecodeError, TypeError) as e:
        parser.error(f"--speculative-config is not a JSON object: {e}")
    if spec["method"] != "selfspec":
        parser.error(f"this checks selfspec, not method {spec['method']!r}")
    if not 1 <= args.num_prompts <= len(PROMPTS) or args.batch_size < 1 or args.repeats < 1:
        parser.error(f"--num-prompts must be 1..{len(PROMPTS)}, --batch-size and --repeats >= 1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

    prompts = list(PROMPTS[: args.num_prompts])
    print(f"model: {args.model} (dtype {args.dtype})\n{len(prompts)} built-in prompts, "
          f"{args.max_tokens} greedy tokens each: one pass with all of them in one batch, then "
          f"{args.repeats} timed at batch size {args.batch_size}", flush=True)  # fmt: skip
    print("running plain vLLM decoding ...", flush=True)
    plain, plain_batched, _, dtype = run_engine(args.model, prompts, None, args)
    print(f"running selfspec {json.dumps(spec)} ...", flush=True)
    fast, fast_batched, stats, _ = run_engine(args.model, prompts, spec, args)
    _stop_resource_tracker()

    pairs = list(zip(plain.outputs + plain_batched, fast.outputs + fast_batched, strict=True))
    differ = [i for i, (a, b) in enumerate(pairs) if a != b]
    plain_tps = statistics.median(plain.tokens_per_s)
    fast_tps = statistics.median(fast.tokens_per_s)
    speedup = fast_tps / plain_tps
    draft_s, plain_s = stats.get("draft_cost_s"), stats.get("plain_step_s")
    cost_ratio = draft_s / plain_s if draft_s is not None and plain_s else None
    print()
    print(f"outputs identical   : {len(pairs) - len(differ)}/{len(pairs)} "
          f"({len(prompts)} at batch size {args.batch_size}, {len(prompts)} in one batch)")
    for i in differ:
        a, b = pairs[i]
        same = [x == y for x, y in zip(a, b, strict=False)]
        at = same.index(False) if False in same else len(same)
        where = f"batch size {args.batch_size}" if i < len(prompts) else "one batch"
        print(f"  prompt {i % len(prompts)} ({where}): first differs at output token {at}")
    print(f"dtype               : {dtype:>8}")
    print(f"plain vLLM decoding : {plain_tps:8.1f} tokens/s")
    print(f"selfspec            : {fast_tps:8.1f} tokens/s")
    print(f"tokens/s ratio      : {speedup:8.2f}x")
    print(f"acceptance rate     : {_fmt(fast.acceptance):>8}")
    print(f"mean accepted length: {_fmt(fast.mean_accepted_length):>8} tokens per verification")
    ms = [None if s is None else s * 1e3 for s in (draft_s, plain_s)]
    print(f"draft cost ratio    : {_fmt(cost_ratio):>8} (a draft forward {_fmt(ms[0])} ms over "
          f"a plain step {_fmt(ms[1])} ms, as the drafter measured them)")
    if fast.by_source and fast.draft_tokens:
        print(f"drafts by source    : {source_split(fast.by_source, fast.draft_tokens)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({
                "model": args.model, "speculative_config": spec, "dtype": dtype,
                "num_prompts": len(prompts), "max_tokens": args.max_tokens,
                "batch_size": args.batch_size, "outputs_compared": len(pairs),
                "outputs_identical": len(pairs) - len(differ), "differing": differ,
                "plain_tokens_per_s": plain_tps, "selfspec_tokens_per_s": fast_tps,
                "speedup": speedup, "acceptance_rate": fast.acceptance,
                "mean_accepted_length": fast.mean_accepted_length, "num_drafts": fast.drafts,
                "num_draft_tokens": fast.draft_tokens,
                "num_accepted_tokens": fast.accepted_tokens, "by_source": fast.by_source,
                "draft_cost_s": draft_s, "plain_step_s": plain_s, "draft_cost_ratio": cost_ratio,
            }, f, indent=1)  # fmt: skip
    if differ:
        if dtype != "float32":
            print(f"hint: in {dtype} a mismatch can come from rounding (verification reorders "
                  f"floating-point sums, which can flip a near tie); rerun with --dtype float32: "
                  f"a mismatch there is a bug")  # fmt: skip
        print(f"selfspec check: FAIL ({len(differ)}/{len(pairs)} outputs differ from plain "
              f"decoding)", flush=True)  # fmt: skip
        return 1
    slow = "; WARNING: slower than plain decoding" if speedup < 1.0 else ""
    print(f"selfspec check: PASS (outputs identical {len(pairs)}/{len(pairs)}; {speedup:.2f}x "
          f"plain{slow})", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
