"""The plugin and the selfspec settings reach Ray workers the way vLLM's Ray executor ships them.

vLLM's CPU build refuses the Ray executor (see tests/test_ray_tp.py for a shim that runs it), so
this module proves the parts that do not need it, on a local Ray instance:

* a *fresh* Ray worker process has not imported vllm_selfspec; vLLM's own
  ``load_general_plugins()`` (what every vLLM worker runs in ``init_worker``) finds the entry point
  and installs the patches there;
* the ``VllmConfig`` vLLM builds for a selfspec engine, shipped as a Ray actor constructor argument
  (how ``RayExecutorV2`` ships it) and as a cloudpickled task argument (the legacy executor's
  ``collective_rpc``), carries ``additional_config["selfspec"]``, ``SelfSpecSettings.from_dict``
  accepts it there, and the patched ``num_lookahead_tokens`` reserves the K slots in that process;
* ``examples/check_cluster.py`` passes against the running instance.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

REPO = Path(__file__).resolve().parents[1]
K = 3
SPEC = {"method": "selfspec", "skip_attention": [1, 3], "skip_mlp": [4],
        "num_speculative_tokens": K}


@pytest.fixture(scope="module")
def model_dir():
    from tests.tiny_models import tiny_model_dir

    return tiny_model_dir("errors-llama", arch="llama", num_layers=6)


@pytest.fixture(scope="module")
def vllm_config(model_dir):
    """The VllmConfig vLLM's front end builds for a selfspec engine (no engine is started)."""
    from vllm.engine.arg_utils import EngineArgs

    from vllm_selfspec import register

    register()
    args = EngineArgs(model=str(model_dir), speculative_config=dict(SPEC), dtype="float32",
                      enforce_eager=True, max_model_len=128, kv_cache_memory_bytes=1 << 26)
    return args.create_engine_config()


@pytest.fixture(scope="module")
def local_ray():
    from tests.engine_utils import env

    # Ray workers inherit the raylet's environment: make this repository importable there.
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    with env(PYTHONPATH=path, RAY_USAGE_STATS_ENABLED="0"):
        ctx = ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield ctx
    finally:
        ray.shutdown()


def _worker_view(cfg, shipped_as: str) -> dict:
    """Runs in a Ray worker: what a vLLM worker would see before and after loading plugins."""
    import sys

    before = sorted(m for m in sys.modules if m.startswith("vllm_selfspec"))
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # what WorkerWrapperBase.init_worker does in every vLLM worker
    from vllm.config import VllmConfig
    from vllm.engine.arg_utils import EngineArgs

    import vllm_selfspec
    from vllm_selfspec.config import SelfSpecSettings
    from vllm_selfspec.plugin.engine_markers import ADDITIONAL_CONFIG_KEY, is_selfspec_engine

    raw = cfg.additional_config[ADDITIONAL_CONFIG_KEY]
    settings = SelfSpecSettings.from_dict(raw)
    return {
        "pid": os.getpid(),
        "shipped_as": shipped_as,
        "selfspec_modules_before_plugin_load": before,
        "plugin_version": vllm_selfspec.__version__,
        "alias_patched": getattr(EngineArgs.create_speculative_config,
                                 "_vllm_selfspec_patched", False),
        "v1_runner_patched": getattr(VllmConfig.use_v2_model_runner.fget,
                                     "_vllm_selfspec_patched", False),
        "num_lookahead_tokens": cfg.num_lookahead_tokens,
        "is_selfspec_engine": is_selfspec_engine(cfg),
        "settings": settings.to_dict(),
    }


class _ConfigHolder:
    """A Ray actor that, like vLLM's RayWorkerProc, receives the VllmConfig in its constructor."""

    def __init__(self, vllm_config) -> None:
        self.vllm_config = vllm_config

    def view(self) -> dict:
        return _worker_view(self.vllm_config, "actor constructor argument")


def _task_view(blob: bytes) -> dict:
    import cloudpickle

    return _worker_view(cloudpickle.loads(blob), "cloudpickled task argument")


def test_fresh_ray_workers_load_the_plugin_and_get_the_settings(local_ray, vllm_config):
    import cloudpickle

    from vllm_selfspec import __version__
    from vllm_selfspec.config import SelfSpecSettings

    expected = SelfSpecSettings.from_dict(vllm_config.additional_config["selfspec"]).to_dict()
    assert expected["skip_attention"] == [1, 3] and expected["num_speculative_tokens"] == K

    actor = ray.remote(num_cpus=0)(_ConfigHolder).remote(vllm_config=vllm_config)
    task = ray.remote(num_cpus=0, max_retries=0)(_task_view)
    views = ray.get([actor.view.remote(), task.remote(cloudpickle.dumps(vllm_config))],
                    timeout=300)
    ray.kill(actor)
    for view in views:
        assert view["pid"] != os.getpid()
        assert view["selfspec_modules_before_plugin_load"] == [], view
        assert view["plugin_version"] == __version__
        assert view["alias_patched"] and view["v1_runner_patched"], view
        assert view["is_selfspec_engine"], view
        assert view["num_lookahead_tokens"] == K, view
        assert view["settings"] == expected, view


def test_check_cluster_example_passes(local_ray):
    address = local_ray.address_info["address"]
    cmd = [sys.executable, str(REPO / "examples" / "check_cluster.py"), "--address", address,
           "--profile", "llama-2-70b.draft-verify", "--load-plugin", "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO,
                         start_new_session=True)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = json.loads(out.stdout[out.stdout.index("{"):])
    assert report["ok"] and len(report["nodes"]) == 1, report
    node = report["nodes"][0]
    from vllm_selfspec import __version__

    assert node["vllm_selfspec"] == __version__
    assert node["entry_point_visible"] and node["vllm_supported"] and node["plugin_loaded"]
    assert node["profile"]["name"] == "llama-2-70b.draft-verify"


def test_check_cluster_reports_a_missing_plugin():
    """The node check itself, with the entry point hidden: the problem is named."""
    sys.path.insert(0, str(REPO / "examples"))
    try:
        import check_cluster
    finally:
        sys.path.pop(0)
    report = check_cluster.node_report(profile="no-such-profile")
    assert any("no-such-profile" in p for p in report["problems"])
    from unittest import mock

    with mock.patch("importlib.metadata.entry_points", return_value=[]):
        report = check_cluster.node_report()
    assert any("entry point vllm_selfspec:register" in p for p in report["problems"])
