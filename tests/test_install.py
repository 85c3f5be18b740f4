"""What users install: the wheel, installed non-editable in a fresh venv, used from a folder of theirs.

One wheel and one venv per session. The wheel is built from a copy of the working tree's files
(tracked and new, not ignored), as a fresh checkout would build it: built in place, setuptools
reuses ``build/lib`` and would ship a module left there by an earlier build. The venv gets the
wheel's real dependencies (``[proxy]`` extra) from the package index, which also shows every
import the package makes is declared.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

import rollout_capture

from .conftest import ROOT, SAMPLE

# A wheel built and installed with its dependencies from the package index: slow and networked
# (the first test pays for it: more than pytest's 300 s on a loaded machine, so its own bound).
pytestmark = [pytest.mark.integration, pytest.mark.timeout(3 * 300)]

MAPPED = ("flows", "tasks", "deployments", "cli")  # repository folders shipped as rollout_capture.<name>
TIMEOUT_S = 600


@dataclass(frozen=True)
class Installed:
    """The fresh venv, the installed package in it, and a user's folder with its own flows/tasks."""

    python: Path
    cli: Path
    package: Path  # <site-packages>/rollout_capture
    user_dir: Path
    env: dict[str, str]  # a user's environment: no dev venv, no PYTHONPATH, a Prefect home of its own


def run(
    command: Sequence[str | Path], env: dict[str, str], cwd: Path, check: bool = True
) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [str(part) for part in command],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    if check:
        assert done.returncode == 0, f"{command} exited {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done


def tree_files() -> list[str]:
    """The files a checkout holds: tracked and new ones, not ignored, that exist now."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    return sorted(name for name in set(listed.split("\0")) if name and (ROOT / name).is_file())


def tracked(*folders: str) -> list[str]:
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--", *folders], cwd=ROOT, capture_output=True, check=True
    ).stdout.decode()
    return sorted(name for name in listed.split("\0") if name and (ROOT / name).is_file())


def in_wheel(name: str) -> str:
    """Where a repository file lands in the wheel (flows/x.py -> rollout_capture/flows/x.py)."""
    return f"rollout_capture/{name}" if name.split("/")[0] in MAPPED else name


def user_environment(prefect_home: Path, venv_bin: Path) -> dict[str, str]:
    """This process's environment as a user's shell would have it: no test settings, no dev venv."""
    dev_bin = str(Path(sys.prefix) / "bin")
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("PREFECT_", "ROLLOUT_CAPTURE_", "PYTHON", "VIRTUAL_ENV"))
    }
    path = [part for part in env.get("PATH", "").split(os.pathsep) if part and part != dev_bin]
    env["PATH"] = os.pathsep.join([str(venv_bin), *path])
    env["PREFECT_HOME"] = str(prefect_home)
    env["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    env["DO_NOT_TRACK"] = "1"
    return env


@pytest.fixture(scope="session")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel, built from a clean copy of the working tree (``pip wheel --no-deps``)."""
    source = tmp_path_factory.mktemp("source")
    for name in tree_files():
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, source / name)
    dist = tmp_path_factory.mktemp("dist")
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-input", "-q", "-w", dist, source]
    run(build, dict(os.environ), cwd=dist)
    (built,) = dist.glob("rollout_capture-*.whl")
    return built


@pytest.fixture(scope="session")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Installed:
    """A fresh venv outside the tree with the wheel and its declared dependencies installed."""
    base = tmp_path_factory.mktemp("user")
    assert not base.resolve().is_relative_to(ROOT)
    venv = base / "venv"
    run([sys.executable, "-m", "venv", venv], dict(os.environ), cwd=base)
    env = user_environment(base / "prefect-home", venv / "bin")
    python = venv / "bin" / "python"
    # uv, as a user may: the same packages pip resolves, in seconds rather than minutes (the dev
    # venv's uv; the user's environment has no other)
    uv = Path(sys.executable).parent / "uv"
    run([uv, "pip", "install", "-q", "--python", python, f"{wheel}[proxy]"], env, cwd=base)
    user_dir = base / "project"  # a user's project with packages named like our repository folders
    for name in ("flows", "tasks"):
        (user_dir / name).mkdir(parents=True)
        (user_dir / name / "__init__.py").write_text(f'USER = "mine"\nNAME = "{name}"\n')
    located = run([python, "-c", "import rollout_capture; print(rollout_capture.__file__)"], env, base)
    package = Path(located.stdout.strip()).parent
    return Installed(python, venv / "bin" / "rollout-capture", package, user_dir, env)


@pytest.fixture(scope="session")
def source_tree_output(
    installed: Installed, prefect_api: str, tmp_path_factory: pytest.TempPathFactory
) -> bytes:
    """The sample enriched by the source tree (this dev venv's CLI), from the user's folder."""
    env = {**installed.env, "PREFECT_API_URL": prefect_api}
    dev = [sys.executable, "-c", "import rollout_capture; print(rollout_capture.__file__)"]
    assert Path(run(dev, env, installed.user_dir).stdout.strip()).is_relative_to(ROOT)
    output = tmp_path_factory.mktemp("reference") / "sample.enriched.jsonl"
    rollouts, captures = SAMPLE / "rollouts.jsonl", SAMPLE / "captures"
    enrich = ["enrich", rollouts, "--capture-dir", captures, "--output", output]
    run([sys.executable, "-m", "rollout_capture.cli", *enrich], env, installed.user_dir)
    return output.read_bytes()


def test_the_wheel_is_one_package_with_the_license_the_sample_and_every_module(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        read = archive.read
        dist_info = {name.split("/")[0] for name in names if ".dist-info/" in name}
        assert {name.split("/")[0] for name in names} == {"rollout_capture", *dist_info}
        (info,) = dist_info
        assert read(f"{info}/top_level.txt").split() == [b"rollout_capture"]
        assert read(f"{info}/licenses/LICENSE") == (ROOT / "LICENSE").read_bytes()
        for name in tracked("rollout_capture/sample"):
            assert read(name) == (ROOT / name).read_bytes(), name
        modules = {name for name in names if name.endswith(".py")}
        sources = [name for name in tracked("rollout_capture", *MAPPED) if name.endswith(".py")]
        assert {in_wheel(name) for name in sources} <= modules
        # Nothing else: no module left over from an earlier build, no test or benchmark.
        copied = {
            in_wheel(name)
            for name in tree_files()
            if name.endswith(".py") and name.split("/")[0] in ("rollout_capture", *MAPPED)
        }
        assert modules == copied
        assert b"rollout-capture = rollout_capture.cli:main" in read(f"{info}/entry_points.txt")


def test_installed_outside_the_tree_and_a_users_flows_and_tasks_stay_theirs(installed: Installed) -> None:
    probe = """if True:
        import json, sys
        import flows, tasks, rollout_capture, rollout_capture.flows, rollout_capture.tasks
        from rollout_capture.flows import enrich_rollouts, enrich_completed_runs, prepare_dispatch
        from prefect import Flow
        public = (enrich_rollouts, enrich_completed_runs, prepare_dispatch)
        ours = (rollout_capture, rollout_capture.flows, rollout_capture.tasks)
        print(json.dumps({
            "user": [flows.USER, flows.NAME, flows.__file__, tasks.USER, tasks.NAME, tasks.__file__],
            "ours": [module.__file__ for module in ours],
            "flows": [isinstance(flow, Flow) for flow in public],
            "still_theirs": [sys.modules[name].USER for name in ("flows", "tasks")],
        }))
    """
    shown = json.loads(run([installed.python, "-c", probe], installed.env, installed.user_dir).stdout)
    user = installed.user_dir
    assert shown["user"] == [
        *("mine", "flows", str(user / "flows" / "__init__.py")),
        *("mine", "tasks", str(user / "tasks" / "__init__.py")),
    ]
    package = installed.package
    assert shown["ours"] == [
        str(package / "__init__.py"),
        str(package / "flows" / "__init__.py"),
        str(package / "tasks" / "__init__.py"),
    ]
    assert shown["flows"] == [True, True, True]
    assert shown["still_theirs"] == ["mine", "mine"]  # importing our flows did not rebind theirs
    assert not package.resolve().is_relative_to(ROOT)
    assert not list(package.parent.glob("__editable__*")), "the wheel installed as an editable"


def test_every_module_imports_with_the_declared_dependencies(installed: Installed) -> None:
    """Each installed module imports in the fresh venv ([proxy] extra), from the user's folder."""
    probe = """if True:
        import importlib, json, pkgutil, rollout_capture
        names = [m.name for m in pkgutil.walk_packages(rollout_capture.__path__, "rollout_capture.")]
        failed = {}
        for name in names:
            try:
                importlib.import_module(name)
            except Exception as exc:
                failed[name] = repr(exc)
        print(json.dumps({"names": names, "failed": failed}))
    """
    shown = json.loads(run([installed.python, "-c", probe], installed.env, installed.user_dir).stdout)
    assert shown["failed"] == {}
    assert {
        "rollout_capture.cli",
        "rollout_capture.flows.enrich",
        "rollout_capture.deployments.serve",
    } <= set(shown["names"])


def test_importing_the_core_loads_no_prefect_typer_or_rich(installed: Installed) -> None:
    probe = """if True:
        import json, sys, rollout_capture
        print(json.dumps(sorted({m.split(".")[0] for m in sys.modules} & {"prefect", "typer", "rich"})))
    """
    assert json.loads(run([installed.python, "-c", probe], installed.env, installed.user_dir).stdout) == []


def test_the_installed_cli_prints_its_version(installed: Installed) -> None:
    done = run([installed.cli, "--version"], installed.env, installed.user_dir)
    assert done.stdout.strip() == f"rollout-capture {rollout_capture.__version__}"


def test_the_version_has_one_source_the_wheel_and_the_metadata_say(wheel: Path, installed: Installed) -> None:
    """``rollout_capture.__version__`` is the version: pyproject reads it, the wheel and the
    installed metadata carry it (no second copy to forget)."""
    assert wheel.name.startswith(f"rollout_capture-{rollout_capture.__version__}-")
    probe = "import importlib.metadata as m, rollout_capture as r; print(m.version('rollout-capture'))"
    probe += "; print(r.__version__)"
    shown = run([installed.python, "-c", probe], installed.env, installed.user_dir).stdout.split()
    assert shown == [rollout_capture.__version__] * 2


def test_the_installed_cli_enriches_the_installed_sample_as_the_source_tree_does(
    installed: Installed, prefect_api: str, source_tree_output: bytes
) -> None:
    env = {**installed.env, "PREFECT_API_URL": prefect_api}
    output = installed.user_dir / "out" / "enrich.enriched.jsonl"
    sample = installed.package / "sample"
    enrich = ["enrich", sample / "rollouts.jsonl", "--capture-dir", sample / "captures", "--output", output]
    done = run([installed.cli, *enrich], env, installed.user_dir)
    assert done.stdout.splitlines()[0].split() == ["output", str(output)]
    assert_same_lines(output.read_bytes(), source_tree_output)


def test_the_installed_demo_enriches_the_bundled_sample(
    installed: Installed, prefect_api: str, source_tree_output: bytes
) -> None:
    """The sample shipped in site-packages, enriched from any folder (the output's folder is made)."""
    env = {**installed.env, "PREFECT_API_URL": prefect_api}
    output = installed.user_dir / "demo" / "nested" / "sample.enriched.jsonl"
    done = run([installed.cli, "demo", "--output", output], env, installed.user_dir)
    assert done.stdout.splitlines()[0].split() == ["output", str(output)]
    assert_same_lines(output.read_bytes(), source_tree_output)


def assert_same_lines(got: bytes, expected: bytes) -> None:
    """Line for line equal; the first differing line is shown (the output holds no machine paths)."""
    got_lines, expected_lines = got.splitlines(), expected.splitlines()
    for number, (line, want) in enumerate(zip(got_lines, expected_lines, strict=False), start=1):
        assert line == want, f"line {number} differs:\n{line[:400]!r}\n{want[:400]!r}"
    assert len(got_lines) == len(expected_lines)
    assert got == expected
