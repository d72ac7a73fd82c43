"""Test-only shim: let vLLM's Ray executor run on the CPU platform.

vLLM's CPU build refuses Ray (``current platform cpu does not support ray``) only because
``CpuPlatform.ray_device_key`` is empty: the Ray executor asks Ray for one "device" per worker under
that resource name, and reads the device ids Ray assigned to each worker. Ray can declare logical
GPUs on any node (``ray.init(num_gpus=N)``) without any hardware behind them, so a CPU platform
whose ``ray_device_key`` is ``"GPU"`` gets one placement-group slot per worker, exactly as on a GPU
cluster. Nothing else in vLLM's Ray path is changed.

How it gets into every vLLM process: it is a ``vllm.platform_plugins`` entry point (vLLM resolves
its platform through that group in every process that touches ``current_platform``: the front end,
the engine core, and each Ray worker before it runs anything). The tests write a throw-away
distribution (``.dist-info`` with the entry point) into a temporary folder and put it on
``PYTHONPATH`` of the processes they start; the plugin is active only where
``SELFSPEC_RAY_CPU_SHIM=1``, so nothing else is affected even if it is found.
"""

from __future__ import annotations

import os
from pathlib import Path

ENV = "SELFSPEC_RAY_CPU_SHIM"
RAY_DEVICE_KEY = "GPU"
_QUALNAME = "tests.ray_cpu_shim.RayCpuPlatform"


def activate() -> str | None:
    """``vllm.platform_plugins`` entry point."""
    if os.environ.get(ENV) != "1":
        return None
    return _QUALNAME


def __getattr__(name: str):  # the class is built lazily: importing vLLM's platform costs time
    if name == "RayCpuPlatform":
        from vllm.platforms.cpu import CpuPlatform

        class RayCpuPlatform(CpuPlatform):
            ray_device_key = RAY_DEVICE_KEY

        RayCpuPlatform.__module__ = __name__
        globals()[name] = RayCpuPlatform
        return RayCpuPlatform
    raise AttributeError(name)


def write_distribution(folder: os.PathLike | str) -> Path:
    """Write a distribution that registers :func:`activate`; put ``folder`` on PYTHONPATH."""
    folder = Path(folder)
    info = folder / "selfspec_ray_cpu_shim-0.0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: selfspec-ray-cpu-shim\nVersion: 0.0\n"
    )
    (info / "entry_points.txt").write_text(
        "[vllm.platform_plugins]\nselfspec_ray_cpu = tests.ray_cpu_shim:activate\n"
    )
    return folder


def shim_env(folder: os.PathLike | str, repo_root: os.PathLike | str) -> dict[str, str]:
    """Environment for a process that should see the shim (and can import ``tests``)."""
    path = os.pathsep.join(
        p for p in (str(folder), str(repo_root), os.environ.get("PYTHONPATH", "")) if p
    )
    return {"PYTHONPATH": path, ENV: "1"}
