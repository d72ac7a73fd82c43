"""TP=2 over vLLM's Ray executor, on CPU, through a test-only shim: greedy output equals TP=1.

vLLM's CPU build refuses Ray only because ``CpuPlatform.ray_device_key`` is empty. The shim
(``tests/ray_cpu_shim.py``, a ``vllm.platform_plugins`` entry point active only in the processes
started here) gives the CPU platform the key ``"GPU"``, and the local Ray instance declares two
logical GPUs, one placement-group slot per tensor-parallel rank. Everything else is vLLM's own Ray
path (``RayExecutorV2``, vLLM 0.32's default, and the legacy compiled-graph
``RayDistributedExecutor``): workers are Ray actors that receive the
``VllmConfig`` from Ray, load the plugin with ``load_general_plugins()`` and build the drafter.

Each engine runs in its own process (``tests/ray_engine_run.py``) so that Ray, the shim and the
engine are torn down with the process group.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.api_server import removing_leaked_shm

pytest.importorskip("ray")
pytestmark = pytest.mark.engine

REPO = Path(__file__).resolve().parents[1]
SPEC = {"method": "selfspec", "skip_attention": [3, 5], "skip_mlp": [6],
        "num_speculative_tokens": 4, "adaptive": False}
RUN_TIMEOUT_S = 600


def _run(model_dir, out: Path, *extra: str, env: dict[str, str] | None = None) -> dict:
    cmd = [sys.executable, "-m", "tests.ray_engine_run", "--model", str(model_dir),
           "--out", str(out), *extra]
    log = out.with_suffix(".log")
    with open(log, "wb") as f, removing_leaked_shm():
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT,
                                env={**os.environ, **(env or {})}, start_new_session=True)
        try:
            rc = proc.wait(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            try:  # Ray's processes, the engine core and workers live in the same group
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
    assert rc == 0, f"{cmd} exited with {rc}:\n{tail}"
    return json.loads(out.read_text())


def _run_ray_tp2(model_dir, tmp_path: Path, spec: dict, v2: str) -> dict:
    """A TP=2 engine over Ray through the shim (``v2``: VLLM_USE_RAY_V2_EXECUTOR_BACKEND)."""
    from tests.ray_cpu_shim import shim_env, write_distribution

    shim = write_distribution(tmp_path / "shim")
    env = {**shim_env(shim, REPO), "VLLM_CPU_OMP_THREADS_BIND": "0|1",
           "RAY_USAGE_STATS_ENABLED": "0", "VLLM_USE_RAY_V2_EXECUTOR_BACKEND": v2}
    return _run(model_dir, tmp_path / "ray_tp2.json", "--tp", "2", "--backend", "ray",
                "--start-ray", "--spec", json.dumps(spec), env=env)


@pytest.fixture(scope="module")
def model_dir():
    from tests.tiny_models import tiny_model_dir

    return tiny_model_dir("e2e-llama", arch="llama", num_layers=8)


@pytest.fixture(scope="module")
def reference(model_dir, tmp_path_factory):
    """Plain TP=1 greedy output (multiprocessing executor, no Ray)."""
    out = tmp_path_factory.mktemp("tp1") / "tp1.json"
    return _run(model_dir, out, "--tp", "1", "--backend", "mp")


# The legacy compiled-graph RayDistributedExecutor here; RayExecutorV2 (vLLM 0.32's default) in
# test_ray_tp2_adaptive_matches_tp1 below
@pytest.mark.parametrize("v2", ["0"], ids=["ray_compiled_dag"])
def test_ray_tp2_selfspec_matches_tp1(model_dir, reference, tmp_path, v2):
    from vllm.platforms.cpu import CpuPlatform

    from tests.ray_cpu_shim import RAY_DEVICE_KEY

    # why the shim exists: vLLM's own CPU platform has no Ray resource key (Ray is refused)
    assert CpuPlatform.ray_device_key == ""
    got = _run_ray_tp2(model_dir, tmp_path, SPEC, v2)
    print(f"\nray tp2: start {got['start_s']:.0f} s, generate {got['generate_s']:.1f} s; "
          f"workers {got['workers']}; spec metrics {got['spec_metrics']}")

    assert got["backend"] == "ray"
    assert got["token_ids"] == reference["token_ids"]
    workers = got["workers"]
    assert len(workers) == 2 and all(w["in_ray_actor"] for w in workers), workers
    assert {w["platform"] for w in workers} == {"RayCpuPlatform"}
    assert {w["ray_device_key"] for w in workers} == {RAY_DEVICE_KEY}
    assert sorted(w["tp_rank"] for w in workers) == [0, 1]
    assert all(w["pid"] != os.getpid() for w in workers)
    ranks = got["drafter_stats"]
    lockstep = ("steps", "draft_passes", "draft_forwards", "draft_tokens", "lookup_tokens")
    assert [ranks[0][k] for k in lockstep] == [ranks[1][k] for k in lockstep]
    assert ranks[0]["draft_forwards"] > 0
    assert got["spec_metrics"]["vllm:spec_decode_num_draft_tokens"] > 0


ZERO_LAYERS = [2, 5]


@pytest.fixture(scope="module")
def zero_model_dir():
    """Layers 2 and 5 have zero output projections: a draft skipping them is exact."""
    from tests.tiny_models import tiny_model_dir

    return tiny_model_dir("e2e-zero", arch="llama", num_layers=8, zero_output_layers=ZERO_LAYERS)


def test_ray_tp2_adaptive_matches_tp1(zero_model_dir, tmp_path):
    """The drafter with the adaptive controller over Ray (RayExecutorV2), TP=2: both ranks
    plan the same pass lengths from rank 0's broadcast step costs (a pass is a collective: plans
    that differed would hang the engine) and the output equals plain TP=1's. The skip set is
    exact, so the controller keeps drafting."""
    from tests.ray_cpu_shim import shim_env, write_distribution

    reference = _run(zero_model_dir, tmp_path / "tp1.json", "--tp", "1", "--backend", "mp")

    shim = write_distribution(tmp_path / "shim")
    env = {**shim_env(shim, REPO), "VLLM_CPU_OMP_THREADS_BIND": "0|1",
           "RAY_USAGE_STATS_ENABLED": "0", "VLLM_USE_RAY_V2_EXECUTOR_BACKEND": "1"}
    spec = {"method": "selfspec", "skip_attention": ZERO_LAYERS, "skip_mlp": ZERO_LAYERS,
            "num_speculative_tokens": 4, "adaptive": True}
    got = _run(zero_model_dir, tmp_path / "ray_tp2_device.json", "--tp", "2", "--backend", "ray",
               "--start-ray", "--spec", json.dumps(spec), env=env)
    print(f"\nray tp2 adaptive: start {got['start_s']:.0f} s, generate "
          f"{got['generate_s']:.1f} s; spec metrics {got['spec_metrics']}")
    assert got["backend"] == "ray"
    assert got["token_ids"] == reference["token_ids"]
    assert sorted(w["tp_rank"] for w in got["workers"]) == [0, 1]
    ranks = got["drafter_stats"]
    assert all(r["drafter"] == "device" for r in ranks), ranks
    lockstep = ("steps", "draft_passes", "draft_forwards", "passes_skipped", "trimmed_tokens",
                "confidence_exits")
    assert [ranks[0][k] for k in lockstep] == [ranks[1][k] for k in lockstep], ranks
    assert ranks[0]["controller"] == ranks[1]["controller"], ranks
    assert ranks[0]["draft_forwards"] > 0
    assert got["spec_metrics"]["vllm:spec_decode_num_draft_tokens"] > 0
