#!/usr/bin/env python
"""Offline generation with selfspec through vLLM's ``LLM`` API.

    python examples/offline_llm.py --model /path/to/model   # matching profile or default skip set
    python examples/offline_llm.py --model meta-llama/Llama-2-13b-hf \
        --profile llama-2-13b.draft-verify
    python examples/offline_llm.py --embedded    # SmolLM2-135M-Instruct from PyPI, on CPU

Nothing else to import from vllm_selfspec: vLLM loads the plugin through its entry point. The script
prints the outputs and vLLM's spec-decode counters (drafts, accepted tokens).
"""

from __future__ import annotations

import argparse


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", help="model folder or hub name")
    ap.add_argument("--embedded", action="store_true",
                    help="the embedded SmolLM2-135M-Instruct (a PyPI wheel; no model hub)")
    ap.add_argument("--profile", default=None, help="shipped profile name or profile JSON path")
    ap.add_argument("-k", "--num-speculative-tokens", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    args = ap.parse_args()

    from vllm import LLM, SamplingParams

    model, extra = args.model, {}
    if args.embedded:
        from vllm_selfspec.tools.assets import smollm2_dir

        model = str(smollm2_dir())
        extra = {"max_model_len": 2048, "kv_cache_memory_bytes": 1 << 28}  # on CPU: else 92% of RAM
    if model is None:
        ap.error("give --model or --embedded")

    speculative_config = {"method": "selfspec",
                          "num_speculative_tokens": args.num_speculative_tokens}
    if args.profile:
        speculative_config["profile"] = args.profile
    llm = LLM(model=model, speculative_config=speculative_config,
              tensor_parallel_size=args.tensor_parallel_size, disable_log_stats=False, **extra)

    prompts = [
        "The capital of France is",
        "def fibonacci(n):",
        "Explain speculative decoding in one paragraph:",
    ]
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    # Per request: cap the draft length (0 switches drafting off for this request; a cap above
    # the engine's num_speculative_tokens is refused when the request arrives).
    cap = min(2, args.num_speculative_tokens)
    capped = SamplingParams(temperature=0.7, max_tokens=args.max_tokens,
                            extra_args={"selfspec": {"num_speculative_tokens": cap}})
    outputs = llm.generate(prompts + prompts[:1], [greedy] * len(prompts) + [capped])
    for out in outputs:
        print(repr(out.prompt), "->", repr(out.outputs[0].text))

    counters = {m.name: getattr(m, "value", None) for m in llm.get_metrics()
                if m.name.startswith(("vllm:spec_decode_num", "vllm:selfspec_"))}
    for name, value in sorted(counters.items()):
        print(f"{name} = {value}")


if __name__ == "__main__":
    main()
