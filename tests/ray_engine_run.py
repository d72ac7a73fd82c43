"""Run one vLLM engine in a fresh process and write its greedy outputs as JSON (for the Ray tests).

``python -m tests.ray_engine_run --model DIR --out FILE [--spec JSON] [--tp N] [--backend ray|mp]
[--start-ray]``. With ``--start-ray`` the script starts a local Ray instance first, declaring
``--tp`` logical GPUs (one placement-group slot per tensor-parallel rank; see
``tests/ray_cpu_shim.py``), exports its address so vLLM's engine core joins it, and stops it at the
end. Run it in its own process group: a timeout then stops everything with one signal.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from vllm_selfspec.plugin.worker_ext import SelfSpecWorkerExtension

PROMPTS = [[5, 77, 301, 12], [9, 8, 7, 6, 5, 4, 3, 2, 1, 400, 401], [33] * 20, [100, 200, 300]]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--spec", default=None, help="speculative config JSON (default: plain)")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--backend", default="mp")
    ap.add_argument("--start-ray", action="store_true")
    ap.add_argument("--max-tokens", type=int, default=40)
    args = ap.parse_args(argv)

    ray = None
    if args.start_ray:
        import ray

        ctx = ray.init(num_cpus=2, num_gpus=args.tp, include_dashboard=False,
                       log_to_driver=True)
        os.environ["RAY_ADDRESS"] = ctx.address_info["address"]
    result: dict = {"platform_ray_device_key": None}
    llm = None
    try:
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        start = time.monotonic()
        llm = LLM(
            model=args.model,
            speculative_config=json.loads(args.spec) if args.spec else None,
            tensor_parallel_size=args.tp,
            distributed_executor_backend=args.backend,
            dtype="float32",
            enforce_eager=True,
            max_model_len=192,
            kv_cache_memory_bytes=1 << 27,
            disable_log_stats=False,
            seed=0,
            worker_extension_cls="tests.ray_engine_run.ProbeExtension",
        )
        result["start_s"] = time.monotonic() - start
        prompts = [TokensPrompt(prompt_token_ids=p) for p in PROMPTS]
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        start = time.monotonic()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        result["generate_s"] = time.monotonic() - start
        result["token_ids"] = [list(o.outputs[0].token_ids) for o in outputs]
        result["drafter_stats"] = llm.collective_rpc("selfspec_stats")
        result["executor"] = type(llm.llm_engine.vllm_config.parallel_config).__name__
        result["backend"] = llm.llm_engine.vllm_config.parallel_config.distributed_executor_backend
        if not isinstance(result["backend"], str):
            result["backend"] = getattr(result["backend"], "__name__", str(result["backend"]))
        result["workers"] = llm.collective_rpc("probe")
        metrics = {}
        for m in llm.get_metrics():
            if m.name.startswith("vllm:spec_decode_num") and hasattr(m, "value"):
                metrics[m.name] = metrics.get(m.name, 0) + m.value
        result["spec_metrics"] = metrics
    finally:
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
        if ray is not None:
            ray.shutdown()
    with open(args.out, "w") as f:
        json.dump(result, f, default=str)
    return 0


class ProbeExtension(SelfSpecWorkerExtension):
    """Worker extension: the selfspec counters plus where and on which platform the worker runs."""

    def probe(self) -> dict:
        from vllm.platforms import current_platform

        return {
            "pid": os.getpid(),
            "platform": type(current_platform).__name__,
            "ray_device_key": current_platform.ray_device_key,
            "in_ray_actor": _in_ray_actor(),
            # the rank the drafter's TP-synchronised cost feed runs as (both drafters have one)
            "tp_rank": getattr(
                getattr(getattr(self.model_runner, "drafter", None), "_cost_feed", None),
                "rank",
                None,
            ),
        }


def _in_ray_actor() -> bool:
    try:
        import ray

        return ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None
    except Exception:
        return False


if __name__ == "__main__":
    sys.exit(main())
