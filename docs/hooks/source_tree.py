"""mkdocs hook: the package as it installs, as a tree of links griffe can read.

The repository's ``flows/``, ``tasks/`` and ``deployments/`` folders install as
``rollout_capture.flows`` and so on (setup.py maps them); griffe reads sources, not
setuptools' editable finder, so the API reference reads ``build/docs-src/rollout_capture``:
links to the core's entries and to those three folders (as ``make lint`` does for mypy),
except ``__init__.py``, copied, since griffe finds a package's submodules beside the real
file of its ``__init__.py``.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

MAPPED = ("flows", "tasks", "deployments", "cli")
TREE = Path("build") / "docs-src" / "rollout_capture"
SKIPPED = ("__pycache__", "__init__.py")


def build_tree(repo: Path) -> Path:
    """Create or refresh the link tree under ``repo``; safe to run while another build does."""
    tree = repo / TREE
    tree.mkdir(parents=True, exist_ok=True)
    core = repo / "rollout_capture"
    wanted = {entry.name: entry for entry in core.iterdir() if entry.name not in SKIPPED}
    wanted.update({name: repo / name for name in MAPPED})
    staged = tree / f".__init__.py.{os.getpid()}"
    staged.write_bytes((core / "__init__.py").read_bytes())
    staged.replace(tree / "__init__.py")
    for link in tree.iterdir():
        if link.name not in wanted and link.is_symlink():
            link.unlink()
    for name, target in wanted.items():
        link = tree / name
        relative = os.path.relpath(target, tree)
        if link.is_symlink() and os.readlink(link) == relative:
            continue
        if link.is_symlink():
            link.unlink()
        with contextlib.suppress(FileExistsError):  # a concurrent build made the same link
            link.symlink_to(relative)
    return tree


def on_startup(command: str, dirty: bool, **kwargs: Any) -> None:
    """Before the config is run: mkdocstrings resolves its ``paths`` as it starts."""
    build_tree(Path(__file__).resolve().parents[2])
