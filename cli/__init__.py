"""The ``rollout-capture`` command: ``app`` (the typer app), ``options``, ``prefect_env`` (Prefect's
start-up and the pre-flight check), ``output`` (text or JSON) and ``commands/`` (one module a group)."""

from rollout_capture.cli.app import main

__all__ = ["main"]
