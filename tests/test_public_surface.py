"""The package's public surface, checked against the package itself (httpx's
``test_exported_members`` idea, with no copied list to keep in step).

``__all__`` names exactly the public names ``rollout_capture/__init__.py`` imports and defines,
once each and sorted: a name added to the root without being declared public, or declared
without being there, fails here instead of slipping into (or out of) what users may import.
"""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import rollout_capture
import rollout_capture.producer


def offered(module: ModuleType) -> list[str]:
    """The public names a module's namespace holds, its submodules aside."""
    return sorted(
        (
            name
            for name, value in vars(module).items()
            if not name.startswith("_") and not isinstance(value, ModuleType) and name != "annotations"
        ),
        key=str.casefold,
    )


def test_the_root_exports_exactly_what_it_offers() -> None:
    assert sorted(rollout_capture.__all__, key=str.casefold) == offered(rollout_capture)
    assert len(set(rollout_capture.__all__)) == len(rollout_capture.__all__)


def declared(path: Path) -> list[str]:
    """The public names a module's source binds at its top level: what it imports, defines and
    assigns (``__all__`` and the dunders aside), read from the file, not from the import."""
    names: list[str] = []
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.ImportFrom | ast.Import):
            names += [(alias.asname or alias.name).split(".")[0] for alias in node.names]
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.append(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names += [target.id for target in targets if isinstance(target, ast.Name)]
    return [name for name in names if not name.startswith("_")]


def test_all_is_exactly_what_the_package_root_imports_and_defines() -> None:
    """A change here is a change of the API: ``__all__`` names each public name the root's
    source binds, once, in the order the file keeps (sorted), and each of them exists."""
    exported = rollout_capture.__all__
    assert exported == sorted(exported), "keep __all__ sorted"
    assert len(set(exported)) == len(exported), "a name twice in __all__"
    assert [name for name in exported if not hasattr(rollout_capture, name)] == []
    source = declared(Path(rollout_capture.__file__))
    assert sorted(set(source)) == sorted(exported)


def test_the_api_reference_renders_the_root_from_all() -> None:
    """docs/api/core.md lists no names of its own: mkdocstrings renders the root's ``__all__``,
    so the reference cannot fall behind it."""
    from .conftest import ROOT

    page = (ROOT / "docs" / "api" / "core.md").read_text()
    assert "::: rollout_capture\n" in page
    listed = set(re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)`", page))
    assert sorted(listed & set(rollout_capture.__all__)) == []


def test_every_exported_member_comes_from_the_package_and_says_why() -> None:
    for name in rollout_capture.__all__:
        value = getattr(rollout_capture, name)
        module = getattr(value, "__module__", None)
        if callable(value) and module is not None and not module.startswith("typing"):
            assert module.startswith("rollout_capture."), f"{name} comes from {module}"
            assert (value.__doc__ or "").strip(), f"{name} has no docstring"


def test_the_producer_exports_exist_and_load_neither_the_proxys_stack_nor_prefect() -> None:
    for name in rollout_capture.producer.__all__:
        assert getattr(rollout_capture.producer, name) is not None
    probe = (
        "import sys, rollout_capture.producer as p; [getattr(p, n) for n in p.__all__]; "
        "print(sorted({'httpx', 'uvicorn', 'prefect', 'typer'} & set(sys.modules)))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip() == "[]"


def test_the_flows_package_exports_its_five_flows_lazily() -> None:
    flows = importlib.import_module("rollout_capture.flows")
    assert sorted(flows.__all__) == [
        "compact_capture_dirs",
        "enrich_completed_runs",
        "enrich_rollouts",
        "follow_run",
        "prepare_dispatch",
    ]


INTERNAL = ["call_records", "claims", "merge", "ownership", "read_calls", "rows", "snapshot"]
"""Core modules nothing outside the core imports (what they offer users is re-exported at the
root): the flows, tasks, deployments and CLI stay off them, so they can change freely."""


def test_nothing_outside_the_core_imports_its_internal_modules() -> None:
    import ast

    from .conftest import ROOT

    outside = [
        path for top in ("flows", "tasks", "deployments", "cli") for path in (ROOT / top).rglob("*.py")
    ]
    found = []
    for path in outside:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            names += [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            found += [
                f"{path.relative_to(ROOT)}:{node.lineno} {name}"
                for name in names
                if name.split(".")[:2] in (["rollout_capture", module] for module in INTERNAL)
            ]
    assert found == []


def test_the_layout_page_names_every_module() -> None:
    """docs/code-layout.md stays true to the tree: a module added or moved must be placed there."""
    import re

    from .conftest import ROOT

    page = (ROOT / "docs" / "code-layout.md").read_text()
    named = set(re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)(?:[./][^`]*)?`", page))
    tops = ("rollout_capture", "flows", "tasks", "deployments", "cli")
    found = [path for top in tops for path in (ROOT / top).rglob("*.py")]
    modules = {p.stem for p in found if p.stem != "__init__"}
    modules |= {p.parent.name for p in found if p.stem == "__init__" and p.parent.name not in tops}
    assert sorted(modules - named) == []
