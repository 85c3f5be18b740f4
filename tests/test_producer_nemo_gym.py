"""rollout-capture's NeMo Gym model server: its folder and its settings (issue 45).

What needs no NeMo Gym: the folder NeMo Gym finds (``nemo-gym-dir``), the settings read from its
config, and the errors naming their key. The server itself, in NeMo Gym's own processes, is tested
by the NeMo Gym tier (tests/test_nemo_gym_070.py E, tests/test_nemo_gym_070_collection.py D).
"""

from __future__ import annotations

import re

import pytest

import rollout_capture
from rollout_capture.producer.nemo_gym import (
    SERVER_FOLDER,
    NemoGymConfigError,
    capture_settings,
    search_dir,
)


def test_the_folder_nemo_gym_finds_is_a_server_folder_asking_for_this_rollout_capture() -> None:
    """NeMo Gym takes a folder under its search roots as a server when it ships a requirements.txt
    or a pyproject.toml, runs its ``app.py`` and builds its venv from the requirements."""
    folder = search_dir() / "responses_api_models" / SERVER_FOLDER
    assert (folder / "app.py").is_file()
    assert not (search_dir() / "responses_api_models" / "__init__.py").exists()  # a namespace, as NeMo Gym's
    requirements = [
        line for line in (folder / "requirements.txt").read_text().splitlines() if not line.startswith("#")
    ]
    assert requirements == [f"rollout-capture[proxy,gcs,azure]=={rollout_capture.__version__}"]


def test_settings_come_from_the_servers_rollout_capture_block() -> None:
    config = {
        "rollout_capture": {"capture_dir": "s3://b/runs/r1/captures", "storage_options": {"anon": False}}
    }
    settings = capture_settings(config, "policy_model", "policy_model")
    assert settings.capture_dir == "s3://b/runs/r1/captures"
    assert settings.server_name == "policy_model" and settings.storage_options == {"anon": False}


def test_settings_without_a_capture_dir_are_refused_naming_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ROLLOUT_CAPTURE_DIR", raising=False)
    with pytest.raises(
        NemoGymConfigError, match=r"policy_model\.responses_api_models\.rollout_capture_model\."
    ):
        capture_settings({}, "policy_model", "policy_model")


def test_a_bad_setting_is_named_by_its_key_never_its_value() -> None:
    config = {
        "rollout_capture": {"capture_dir": "s3://b/c", "claim_ttl_s": -1, "nonsense": "sk-secret-value"}
    }
    with pytest.raises(NemoGymConfigError) as raised:
        capture_settings(config, "policy_model", "policy_model")
    message = str(raised.value)
    assert re.search(r"claim_ttl_s: .*greater than 0", message) and "nonsense" in message
    assert "sk-secret-value" not in message


def test_a_secret_looking_storage_option_is_refused() -> None:
    config = {"rollout_capture": {"capture_dir": "s3://b/c", "storage_options": {"secret": "hunter2"}}}
    with pytest.raises(NemoGymConfigError) as raised:
        capture_settings(config, "policy_model", "policy_model")
    assert "hunter2" not in str(raised.value)
