"""The package's layering: the algorithm core imports no vLLM, and module imports form no cycle.

The core (settings and profile schema, draft-length control, step costs, source choice, the
online and offline layer-set searches) must stay unit-testable without an engine: it may not
import vLLM (nor torch), not even inside a function. The import graph of the package's modules
must be acyclic, counting imports inside functions too (the plugin defers vLLM's import cost that
way, and a deferred import hides a cycle rather than removing it). ``from package import module``
counts as an import of the module only. Both checks read the sources (``ast``), so they cost
milliseconds, and each has a negative control on a synthetic graph.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "vllm_selfspec"
CORE_PACKAGES = ("vllm_selfspec.control",)  # every module in them
CORE_MODULES = (
    "vllm_selfspec.config",
    "vllm_selfspec.drafting.model_cache",
    "vllm_selfspec.errors",
    "vllm_selfspec.layers.matchness",
    "vllm_selfspec.layers.online_search",
    "vllm_selfspec.layers.profiles",
    "vllm_selfspec.layers.search.optimize",
    "vllm_selfspec.layers.search.output",
    "vllm_selfspec.layers.skip_set",
    "vllm_selfspec.plugin.engine_markers",
    "vllm_selfspec.schema",
    "vllm_selfspec.tools.spec_decode_counters",
)
FORBIDDEN_IN_CORE = ("vllm", "torch")
# The only modules that import vLLM (anywhere in the file): what touches vLLM stays in one place.
VLLM_IMPORTERS_PACKAGES = ("vllm_selfspec.plugin", "vllm_selfspec.drafting")
VLLM_IMPORTERS_MODULES = (
    "vllm_selfspec.layers.search.confirm",  # vLLM's public LLM API
    "vllm_selfspec.tools.demo",  # vLLM's public LLM API
    "vllm_selfspec.check",  # vLLM's public LLM API
)


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imported(tree: ast.Module, module_level_only: bool) -> set[str]:
    """Dotted names a module imports (``from a import b`` gives ``a`` and ``a.b``)."""
    nodes = tree.body if module_level_only else list(ast.walk(tree))
    names: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def import_graph(modules: dict[str, Path], module_level_only: bool = False) -> dict[str, set[str]]:
    """Imports between the package's own modules (those inside functions too, by default)."""
    graph = {}
    for name, path in modules.items():
        edges = {
            n
            for n in _imported(ast.parse(path.read_text()), module_level_only)
            if n in modules and n != name
        }
        # "from pkg import mod" names pkg and pkg.mod: it is an import of the module
        graph[name] = {n for n in edges if not any(m.startswith(n + ".") for m in edges)}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (its modules in order, the first repeated), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


def forbidden_imports(source: str) -> set[str]:
    """The top-level packages of FORBIDDEN_IN_CORE that ``source`` imports anywhere."""
    tops = {name.split(".")[0] for name in _imported(ast.parse(source), False)}
    return tops & set(FORBIDDEN_IN_CORE)


def _core() -> list[str]:
    return sorted(
        {m for m in _modules() if any(m.startswith(p + ".") for p in CORE_PACKAGES)}
        | set(CORE_MODULES)
    )


CORE = _core()


def test_core_modules_exist() -> None:
    assert set(CORE_MODULES) <= set(_modules()), set(CORE_MODULES) - set(_modules())
    for package in CORE_PACKAGES:  # the package and at least one module in it
        assert package in _modules() and any(m.startswith(package + ".") for m in CORE)


@pytest.mark.parametrize("module", CORE)
def test_core_imports_no_vllm(module: str) -> None:
    assert forbidden_imports(_modules()[module].read_text()) == set()


def test_package_imports_have_no_cycle() -> None:
    assert find_cycle(import_graph(_modules())) is None


def test_imports_inside_functions_count(tmp_path: Path) -> None:
    """Negative control on files: a cycle closed by a deferred import is found, and only when
    function-level imports are counted."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg import b\n")
    (pkg / "b.py").write_text("def f():\n    from pkg.a import g\n")
    modules = {"pkg": pkg / "__init__.py", "pkg.a": pkg / "a.py", "pkg.b": pkg / "b.py"}
    assert find_cycle(import_graph(modules)) == ["pkg.a", "pkg.b", "pkg.a"]
    assert find_cycle(import_graph(modules, module_level_only=True)) is None


def test_checks_catch_what_they_guard() -> None:
    """Negative controls: a lazy vLLM import in a core module and a three-module cycle."""
    lazy = "def f():\n    from vllm.config import VllmConfig\n    import torch.nn\n"
    assert forbidden_imports(lazy) == {"vllm", "torch"}
    assert forbidden_imports("import numpy\nfrom vllm_selfspec import errors\n") == set()
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_vllm_is_imported_only_where_listed() -> None:
    importers = {
        name
        for name, path in _modules().items()
        if "vllm" in {n.split(".")[0] for n in _imported(ast.parse(path.read_text()), False)}
    }
    allowed = {
        m for m in importers if any(m.startswith(p + ".") for p in VLLM_IMPORTERS_PACKAGES)
    } | set(VLLM_IMPORTERS_MODULES)
    assert importers - allowed == set()
    assert set(VLLM_IMPORTERS_MODULES) <= importers  # the list names no module that stopped


# vLLM model-runner fields: read only through plugin.runner_view (and, for the runner methods they
# wrap, by the patches)
RUNNER_FIELDS = frozenset({
    "input_batch", "attn_groups", "discard_request_mask", "requests", "_draft_probs",
    "_draft_prob_req_ids", "block_table",
})
RUNNER_READERS = ("vllm_selfspec.plugin.runner_view", "vllm_selfspec.plugin.patches")


def runner_field_reads(source: str) -> set[str]:
    """The :data:`RUNNER_FIELDS` that ``source`` reads or writes as attributes."""
    return {
        node.attr
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Attribute) and node.attr in RUNNER_FIELDS
    }


def test_runner_internals_are_read_in_one_place() -> None:
    readers = {
        name: fields
        for name, path in _modules().items()
        if (fields := runner_field_reads(path.read_text()))
        and not any(name == r or name.startswith(r + ".") for r in RUNNER_READERS)
    }
    assert readers == {}
    # negative control
    assert runner_field_reads("x = self.runner.input_batch.req_ids\n") == {"input_batch"}
