"""Faults for the negative controls of the tests (``tests/test_serve.py``,
``tests/test_check.py``): run pytest with this folder on
``PYTHONPATH`` and ``SELFSPEC_INJECT_FAULT`` set, and every process the tests start (API servers,
engine cores, workers) injects the fault when the patched module is first imported:

* ``leak``: the selfspec drafter keeps 4 MiB of touched memory for every request it sees, about
  a quarter GiB per load burst; ``test_load_burst`` must fail.
* ``no_abort``: the API server never aborts a request, so the streams a client closes run to the
  end; ``test_disconnected_streams_are_aborted`` must fail.
* ``wrong_token``: every runner that builds a selfspec drafter changes the first token it samples
  in each row of every step (``t -> t - 1``, 0 -> 1), plain sampling and rejection sampling
  alike; plain engines are untouched. ``python -m vllm_selfspec.check`` must report FAIL.

Nothing here is part of the package, and production code has no switch for these faults.

    SELFSPEC_INJECT_FAULT=leak PYTHONPATH=tests/fault_site pytest tests/test_serve.py -k load_burst
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from typing import Any

FAULT = os.environ.get("SELFSPEC_INJECT_FAULT", "")
LEAK_BYTES = 4 << 20


def _leak(module: Any) -> None:
    import numpy as np

    cls = module.SelfSpecDeviceProposer
    original = cls._begin_step  # every engine step of the drafter starts here

    def _begin_step(self: Any, *args: Any, **kwargs: Any) -> Any:
        seen = self.__dict__.setdefault("_fault_seen", set())
        held = self.__dict__.setdefault("_fault_held", [])
        for req_id in self.runner_view.req_ids:
            if req_id not in seen:
                seen.add(req_id)
                held.append(np.ones(LEAK_BYTES // 8))  # touched pages: resident memory
        return original(self, *args, **kwargs)

    cls._begin_step = _begin_step


def _no_abort(module: Any) -> None:
    async def abort(self: Any, request_id: Any, internal: bool = False) -> None:
        return None

    module.AsyncLLM.abort = abort


def _wrong_token(module: Any) -> None:
    import torch

    cls = module.SelfSpecDeviceProposer
    original = cls.__init__

    def __init__(self: Any, *args: Any, runner: Any = None, **kwargs: Any) -> None:
        original(self, *args, runner=runner, **kwargs)
        sample = runner._sample

        def _sample(*a: Any, **kw: Any) -> Any:
            out = sample(*a, **kw)
            first = out.sampled_token_ids[:, 0]
            first.copy_(torch.where(first > 0, first - 1, first + 1))
            return out

        runner._sample = _sample  # this runner only: the instance, not the class

    cls.__init__ = __init__


PATCHES = {"leak": ("vllm_selfspec.drafting.device_drafter", _leak),
           "no_abort": ("vllm.v1.engine.async_llm", _no_abort),
           "wrong_token": ("vllm_selfspec.drafting.device_drafter", _wrong_token)}


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Runs ``patch(module)`` right after ``name`` is imported, wherever that happens."""

    def __init__(self, name: str, patch: Any) -> None:
        self.name, self.patch = name, patch

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        loader, patch = spec.loader, self.patch

        class _Loader(importlib.abc.Loader):
            def create_module(self, spec: Any) -> Any:
                return loader.create_module(spec)

            def exec_module(self, module: Any) -> None:
                loader.exec_module(module)
                patch(module)

        spec.loader = _Loader()
        return spec


if FAULT:
    if FAULT not in PATCHES:
        raise SystemExit(f"SELFSPEC_INJECT_FAULT={FAULT!r}: expected one of {sorted(PATCHES)}")
    sys.meta_path.insert(0, _PatchAfterImport(*PATCHES[FAULT]))
