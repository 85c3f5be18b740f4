"""The package's public surface, pinned (httpx's ``test_exported_members`` idea).

Everything the package root offers is in ``__all__``, and ``__all__`` holds nothing else:
a name added to the root without being declared public, or dropped from it, fails here
instead of slipping into (or out of) what users may import.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
from types import ModuleType

import rollout_capture
import rollout_capture.producer

CORE = sorted(
    [
        "ATTACHMENT_KEY",
        "CAPTURE_DRAIN_TIMEOUT_S",
        "CaptureDir",
        "CaptureRowError",
        "CaptureStore",
        "Claim",
        "Damage",
        "Evidence",
        "ModelCallCaptureConfig",
        "ModelCallRecord",
        "ModelServerRef",
        "RolloutSnapshot",
        "VerifierInvocation",
        "VerifierRef",
        "aggregate_model_call_metrics",
        "aggregate_model_call_records",
        "attach",
        "await_model_call_capture_quiescence",
        "await_quiescence_many",
        "build_attachment",
        "build_model_call_record",
        "clear_model_call_captures_for_rollouts",
        "extract_token_stats",
        "gather_evidence",
        "is_transient_storage_error",
        "maybe_rollout_id_from_run_body",
        "merge_model_call_capture_into_record",
        "model_call_capture_dirs_from_config",
        "observability_enabled_from_config",
        "read_available_model_call_records",
        "read_model_call_records",
        "rollout_ids_of",
        "validate_rollout_id",
    ],
    key=str.casefold,
)


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


def test_the_public_surface_is_the_declared_one() -> None:
    """A change here is a change of the API: made on purpose, with the docs."""
    assert sorted(rollout_capture.__all__, key=str.casefold) == CORE


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


def test_the_flows_package_exports_its_three_flows_lazily() -> None:
    flows = importlib.import_module("rollout_capture.flows")
    assert sorted(flows.__all__) == ["enrich_completed_runs", "enrich_rollouts", "prepare_dispatch"]


INTERNAL = ["call_records", "claims", "merge", "ownership", "read_calls", "rows", "snapshot"]
"""Core modules nothing outside the core imports (what they offer users is re-exported at the
root): the flows, tasks, deployments and CLI stay off them, so they can change freely."""


def test_nothing_outside_the_core_imports_its_internal_modules() -> None:
    import ast

    from .conftest import ROOT

    outside = [*(ROOT / "flows").glob("*.py"), *(ROOT / "tasks").glob("*.py")]
    outside += [*(ROOT / "deployments").glob("*.py"), *(ROOT / "cli").glob("*.py")]
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
    folders = ["rollout_capture", "rollout_capture/backends", "rollout_capture/producer"]
    folders += ["rollout_capture/producer/streams", "flows", "tasks", "deployments", "cli"]
    modules = {p.stem for folder in folders for p in (ROOT / folder).glob("*.py") if p.stem != "__init__"}
    assert sorted(modules - named) == []
