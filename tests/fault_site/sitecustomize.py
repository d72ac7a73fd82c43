"""Faults for the negative controls of ``tests/test_serve.py``: run pytest with this folder on
``PYTHONPATH`` and ``SELFSPEC_INJECT_FAULT`` set, and every process the tests start (API servers,
engine cores, workers) injects the fault when the patched module is first imported:

* ``leak``: the selfspec drafter keeps 4 MiB of touched memory for every request it sees, about
  a quarter GiB per load burst; ``test_load_burst`` must fail.
* ``no_abort``: the API server never aborts a request, so the streams a client closes run to the
  end; ``test_disconnected_streams_are_aborted`` must fail.

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

    cls = module.SelfSpecProposer
    original = cls.propose

    def propose(self: Any, *args: Any, **kwargs: Any) -> Any:
        seen = self.__dict__.setdefault("_fault_seen", set())
        held = self.__dict__.setdefault("_fault_held", [])
        for req_id in self.runner_view.req_ids:
            if req_id not in seen:
                seen.add(req_id)
                held.append(np.ones(LEAK_BYTES // 8))  # touched pages: resident memory
        return original(self, *args, **kwargs)

    cls.propose = propose


def _no_abort(module: Any) -> None:
    async def abort(self: Any, request_id: Any, internal: bool = False) -> None:
        return None

    module.AsyncLLM.abort = abort


PATCHES = {"leak": ("vllm_selfspec.drafting.host_drafter", _leak),
           "no_abort": ("vllm.v1.engine.async_llm", _no_abort)}


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
