"""The shape of the code: a core without Prefect or a CLI toolkit, and no import cycles."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from .conftest import ROOT

PACKAGES = ("rollout_capture", "tasks", "flows", "deployments", "cli")
MAPPED = {"tasks", "flows", "deployments", "cli"}  # repository folders installed as rollout_capture.<name>


_WALK = (
    "import importlib, pkgutil, sys, rollout_capture\n"
    "skip = {skip!r}\n"
    "names = [m.name for m in pkgutil.walk_packages(rollout_capture.__path__, 'rollout_capture.')\n"
    "         if m.name.startswith({within!r}) and '.sample' not in m.name\n"
    "         and not any(m.name == s or m.name.startswith(s + '.') for s in skip)]\n"
    "for name in names:\n"
    "    importlib.import_module(name)\n"
    "loaded = {{m.split('.')[0] for m in sys.modules}} | set(sys.modules)\n"
    "print(len(names), sorted(loaded & {banned!r}))"
)
_APART = sorted(f"rollout_capture.{name}" for name in MAPPED)  # installed under it, not the core
_FLOWS = {"prefect", "typer", *_APART}


def _walk(within: str, skip: list[str], banned: set[str]) -> tuple[int, str]:
    probe = _WALK.format(within=within, skip=skip, banned=banned)
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    count, leaked = done.stdout.strip().split(" ", 1)
    return int(count), leaked


def test_the_core_imports_no_prefect_and_no_cli_toolkit() -> None:
    """Every module of the core, found by walking the package (so a module added later is
    checked too), imported in a fresh interpreter: none loads Prefect, typer, rich or the flows."""
    count, leaked = _walk("rollout_capture.", [*_APART, "rollout_capture.producer"], {*_FLOWS, "rich"})
    assert count >= 40, f"only {count} core modules found: the walk missed the package"
    assert leaked == "[]", f"the core loaded {leaked}"


def test_the_producer_imports_no_prefect() -> None:
    """The producer's modules likewise; its HTTP stack may bring what it brings (httpx loads rich
    for its own command line), but never Prefect, typer or the flows."""
    count, leaked = _walk("rollout_capture.producer", [], _FLOWS)
    assert count >= 15, f"only {count} producer modules found"
    assert leaked == "[]", f"the producer loaded {leaked}"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] in MAPPED:
        parts.insert(0, "rollout_capture")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, module: str, is_package: bool, known: set[str]) -> set[str]:
    """Project modules a module imports anywhere (functions included), except for type checking."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in known)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module if is_package else module.rpartition(".")[0]
                for _ in range(node.level - 1):
                    anchor = anchor.rpartition(".")[0]
                base = f"{anchor}.{base}".strip(".")
            for alias in node.names:
                target = f"{base}.{alias.name}"
                if target in known:
                    found.add(target)  # a submodule
                elif base in known:
                    found.add(base)  # a name defined in the module (or package __init__)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    found.discard(module)
    return found


def test_no_import_cycles() -> None:
    files = {
        _module_name(path): path
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        if "sample" not in path.parts
    }
    known = set(files)
    graph = {
        name: _imports(ast.parse(path.read_text()), name, path.name == "__init__.py", known)
        for name, path in files.items()
    }
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def walk(node: str) -> None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                cycles.append([*path[path.index(target) :], target])
            elif target not in state:
                walk(target)
        path.pop()
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            walk(name)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_a_local_enrichment_loads_no_s3_client_stack() -> None:
    """The core's fault classification names aiohttp's and botocore's errors without importing
    either (about 0.2 s of every flow command's start): only S3 work loads them."""
    probe = (
        "import sys, rollout_capture.faults, rollout_capture.attachment, rollout_capture.rollout_files\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'aiohttp', 'botocore'}))"
    )
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_the_s3_client_errors_are_still_classified() -> None:
    import aiohttp
    from botocore.exceptions import ClientError, HTTPClientError

    from rollout_capture.faults import is_transient_storage_error

    def answered(status: int, code: str = "") -> ClientError:
        return ClientError(
            {"ResponseMetadata": {"HTTPStatusCode": status}, "Error": {"Code": code}}, "GetObject"
        )

    assert is_transient_storage_error(aiohttp.ClientConnectionError("reset"))
    assert is_transient_storage_error(aiohttp.ClientPayloadError("cut"))
    assert is_transient_storage_error(HTTPClientError(error="eof"))
    assert is_transient_storage_error(answered(503)) and is_transient_storage_error(answered(400, "SlowDown"))
    assert not is_transient_storage_error(answered(403, "AccessDenied"))
