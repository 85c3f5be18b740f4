"""NeMo Gym's own model servers with our capture: the ``rollout_capture_model`` server NeMo Gym starts.

NeMo Gym (0.7) starts each server its config names as ``python <entrypoint>`` in the server's
folder, looked up under ``gym --search-dir`` / ``NEMO_GYM_EXTRA_ROOTS`` before its built-ins; with
``num_workers`` > 1, uvicorn's workers import it again as
``responses_api_models.<folder>.<entrypoint>:app``. :func:`search_dir` is a root holding such a
folder, ``responses_api_models/rollout_capture_model``: its server is the NeMo Gym model server
the config names (``serves: vllm_model``), the same class on the same settings, with our
:class:`~rollout_capture.producer.CaptureMiddleware` around it in every worker, writing to any
store we write (S3, GCS, Azure, a local disk). NeMo Gym's own capture stays in place inside ours
(it strips the prefix, keeps the rollout context its telemetry and token capture read, and
records what its handlers say about calls they answer themselves), its store off: the rows are
ours alone, and its ``model_call_capture_dir`` stays empty (docs/nemo-gym.md).

Imported only inside a NeMo Gym server process (it imports ``nemo_gym``); nothing else imports it.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from rollout_capture.printable import printable
from rollout_capture.producer.middleware import CaptureMiddleware
from rollout_capture.producer.settings import ProducerSettings

logger = logging.getLogger("rollout_capture.producer")

SERVER_FOLDER = "rollout_capture_model"
"""The folder (NeMo Gym's server name) our server has under ``responses_api_models``."""
SERVES_KEY = "serves"
"""Its config's key naming the NeMo Gym model server it runs (``vllm_model``, or ``module:Class``)."""
SETTINGS_KEY = "rollout_capture"
"""Its config's block of capture settings (``capture_dir``, ``storage_options``, ``layout``...)."""
_NEMO_GYM_CAPTURE = "_CaptureMiddleware"  # NeMo Gym 0.7's capture middleware, by class name


class NemoGymConfigError(ValueError):
    """The server's NeMo Gym config cannot run a captured model server; the message says which key."""


def search_dir() -> Path:
    """The root to give NeMo Gym (``gym --search-dir DIR`` or ``NEMO_GYM_EXTRA_ROOTS=DIR``)."""
    return Path(__file__).with_name("nemo_gym_servers")


def _server_config(global_config: Mapping[str, Any], instance: str) -> Mapping[str, Any]:
    try:
        section = global_config[instance]["responses_api_models"]
    except (KeyError, TypeError):
        raise NemoGymConfigError(
            f"{instance}: no responses_api_models section in NeMo Gym's config "
            f"(NEMO_GYM_CONFIG_PATH={instance!r})"
        ) from None
    if SERVER_FOLDER not in section:
        raise NemoGymConfigError(f"{instance}: responses_api_models has no {SERVER_FOLDER}")
    config: Mapping[str, Any] = section[SERVER_FOLDER]
    return config


def wrapped_class(serves: Any, instance: str) -> type[Any]:
    """The NeMo Gym model server class ``serves`` names: a built-in's folder (``vllm_model``: the
    one model server its ``app.py`` defines) or ``module:Class``."""
    from nemo_gym.base_responses_api_model import SimpleResponsesAPIModel

    where = f"{instance}.responses_api_models.{SERVER_FOLDER}.{SERVES_KEY}"
    if not isinstance(serves, str) or not serves:
        raise NemoGymConfigError(
            f"{where}: name the NeMo Gym model server to run, e.g. {SERVES_KEY}: vllm_model"
        )
    module_name, _, class_name = serves.partition(":")
    if not class_name:
        module_name = f"responses_api_models.{serves}.app"
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise NemoGymConfigError(f"{where}: {serves!r} cannot be imported ({exc})") from None
    if class_name:
        found = getattr(module, class_name, None)
        if not (isinstance(found, type) and issubclass(found, SimpleResponsesAPIModel)):
            raise NemoGymConfigError(f"{where}: {serves!r} is not a NeMo Gym model server class")
        return found
    defined = [
        value
        for value in vars(module).values()
        if isinstance(value, type)
        and issubclass(value, SimpleResponsesAPIModel)
        and value.__module__ == module.__name__
    ]
    leaves = [c for c in defined if not any(other is not c and issubclass(other, c) for other in defined)]
    if len(leaves) != 1:
        names = ", ".join(sorted(c.__name__ for c in leaves)) or "none"
        raise NemoGymConfigError(
            f"{where}: {module_name} defines {len(leaves)} model servers ({names}); "
            f"name one as {SERVES_KEY}: {module_name}:<Class>"
        )
    return leaves[0]


def capture_settings(config: Mapping[str, Any], server_name: str, instance: str) -> ProducerSettings:
    """The capture settings of the server: its ``rollout_capture`` block over the environment's
    ``ROLLOUT_CAPTURE_*`` (a refused value is named by its key, never shown)."""
    block = config.get(SETTINGS_KEY) or {}
    given = dict(block.items()) if isinstance(block, Mapping) else None
    if given is None:
        raise NemoGymConfigError(
            f"{instance}.responses_api_models.{SERVER_FOLDER}.{SETTINGS_KEY} must be a mapping"
        )
    given = {key: (dict(value) if isinstance(value, Mapping) else value) for key, value in given.items()}
    try:
        settings = ProducerSettings.from_env(server_name=server_name, **given)
    except ValidationError as exc:
        where = f"{instance}.responses_api_models.{SERVER_FOLDER}.{SETTINGS_KEY}"
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or where}: {e['msg']}" for e in exc.errors())
        raise NemoGymConfigError(f"{where}: {problems}") from None
    if settings.enabled and settings.capture_dir is None:
        raise NemoGymConfigError(
            f"{instance}.responses_api_models.{SERVER_FOLDER}.{SETTINGS_KEY}.capture_dir: where the "
            "captures go (s3://..., gs://..., az://... or an absolute path); or ROLLOUT_CAPTURE_DIR"
        )
    return settings


def captured_server_class() -> type[Any]:
    """The model server this process runs: the class ``serves`` names, with our capture around it.

    Read from NeMo Gym's config as its servers read theirs (``NEMO_GYM_CONFIG_DICT`` and
    ``NEMO_GYM_CONFIG_PATH``, set by ``gym env start``); a config that cannot work raises
    :class:`NemoGymConfigError` naming the key, before any port is bound.
    """
    from nemo_gym.global_config import get_global_config_dict

    instance = os.environ.get("NEMO_GYM_CONFIG_PATH")
    if not instance:
        raise NemoGymConfigError(
            "NEMO_GYM_CONFIG_PATH is not set: this server is started by NeMo Gym (gym env start), "
            "which names the server's config"
        )
    global_config = get_global_config_dict()
    config = _server_config(global_config, instance)
    base = wrapped_class(config.get(SERVES_KEY), instance)
    settings = capture_settings(config, instance, instance)
    if settings.enabled and not global_config.get("observability_enabled", False):
        logger.warning(
            "%s: observability_enabled is false in NeMo Gym's config: its agents then send no "
            "/ng-rollout/<id> prefix, so no call can be filed under its rollout and nothing will be "
            "captured. Set observability_enabled: true (NeMo Gym then asks for a local "
            "model_call_capture_dir too; it stays empty: docs/nemo-gym.md)",
            instance,
        )

    def setup_webserver(self: Any) -> Any:
        app = base.setup_webserver(self)
        theirs = [m for m in app.user_middleware if getattr(m.cls, "__name__", "") == _NEMO_GYM_CAPTURE]
        for middleware in theirs:
            middleware.kwargs["store"] = None  # its rows would go to a local folder nobody reads
        # Ours outermost (of what the server sets up): NeMo Gym's own, inside, strips the prefix.
        app.add_middleware(CaptureMiddleware, settings=settings, strip_prefix=not theirs)
        return app

    return type(base.__name__, (base,), {"setup_webserver": setup_webserver, "__module__": __name__})


def run() -> None:
    """The server folder's ``app.py`` run as NeMo Gym starts it: ``run_webserver`` of the captured
    class, as NeMo Gym's own servers' ``app.py`` do (it serves until stopped). A config that
    cannot work ends the process with one line naming the key (exit 2), before any port is bound."""
    try:
        server = captured_server_class()
    except NemoGymConfigError as exc:
        sys.stderr.write(f"error: {printable(str(exc))}\n")
        raise SystemExit(2) from None
    server.run_webserver()


def worker_app(entry_file: str) -> Any:
    """In a uvicorn worker of ``num_workers`` > 1 importing the folder's ``app.py``: the worker's
    app, built as the first process built it (our capture in every worker); else None."""
    from nemo_gym.server_utils import is_nemo_gym_fastapi_entrypoint

    if not is_nemo_gym_fastapi_entrypoint(entry_file):
        return None
    return captured_server_class().run_webserver()
