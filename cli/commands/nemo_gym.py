"""``nemo-gym-dir``: the folder NeMo Gym finds rollout-capture's model server in."""

from __future__ import annotations

import typer


def nemo_gym_dir() -> None:
    """Print the folder to give NeMo Gym: gym env start --search-dir DIR (or NEMO_GYM_EXTRA_ROOTS=DIR).
    Its rollout_capture_model server runs NeMo Gym's own model server (serves: vllm_model) with
    rollout-capture's capture, to any store (docs/nemo-gym.md)."""
    from rollout_capture.producer.nemo_gym import search_dir

    typer.echo(str(search_dir()))
