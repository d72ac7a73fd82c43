"""What a ``pip install`` ships: every subpackage of ``vllm_selfspec`` and the shipped profiles.

pyproject.toml lists the packages (the top-level ``profiles/`` folder installs as the data package
``vllm_selfspec.profiles``, which package discovery cannot find), so a new subpackage left out of
the list would be missing from wheels while every test in a source checkout still passes.
"""

from __future__ import annotations

from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]


def _setuptools() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def _source_packages() -> set[str]:
    return {
        ".".join(init.parent.relative_to(ROOT).parts)
        for init in (ROOT / "vllm_selfspec").rglob("__init__.py")
    }


def test_every_subpackage_is_listed() -> None:
    listed = set(_setuptools()["packages"])
    assert _source_packages() | {"vllm_selfspec.profiles"} == listed


def test_source_walk_finds_nested_subpackages() -> None:
    """The walk the listing check compares with reaches nested folders (else it passes empty)."""
    assert {"vllm_selfspec.control", "vllm_selfspec.layers.search"} <= _source_packages()


def test_profiles_folder_ships_as_data_package() -> None:
    config = _setuptools()
    folder = ROOT / config["package-dir"]["vllm_selfspec.profiles"]
    assert folder == ROOT / "profiles" and (folder / "__init__.py").is_file()
    shipped = sorted(p.stem for p in folder.glob("*.json"))
    assert "smollm2-135m-instruct" in shipped
    assert "*.json" in config["package-data"]["vllm_selfspec.profiles"]

    from vllm_selfspec.layers.profiles import shipped_profile_names

    assert shipped_profile_names() == shipped  # what the installed package finds
