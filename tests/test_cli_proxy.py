"""``proxy`` (``cli/commands/proxy.py``): its options from ``ProxySettings``, its extra, its refusals."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from .support.cli import CLI, CREDENTIALED, refused_unechoed, run_cli


def test_the_proxy_names_its_extra_when_its_http_stack_is_missing(tmp_path: Path) -> None:
    """As installed without ``[proxy]`` (httptools absent): one line naming the extra, exit 2."""
    script = (
        "import sys\n"
        "sys.modules['httptools'] = None  # what an install without the extra looks like to find_spec\n"
        "from rollout_capture.cli import main\n"
        "sys.argv = ['rollout-capture', 'proxy', '--upstream', 'http://127.0.0.1:9', '-c', sys.argv[1]]\n"
        "main()\n"
    )
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True)
    assert done.returncode == 2
    assert done.stderr == "error: the proxy needs httptools: pip install 'rollout-capture[proxy]'\n"


def test_the_proxy_command_takes_the_capture_switch(
    scripted_upstream: tuple[str, Any], tmp_path: Path
) -> None:
    """``--no-enabled`` (or ROLLOUT_CAPTURE_ENABLED=false) needs no capture dir and writes nothing;
    capture on without a dir is refused naming the variable and the switch."""
    import httpx

    proxy = ["proxy", "--upstream", scripted_upstream[0]]
    env = {key: value for key, value in os.environ.items() if not key.startswith("ROLLOUT_CAPTURE_")}
    refused = run_cli(*proxy, env=env, timeout=60)
    assert refused.returncode == 2 and "ROLLOUT_CAPTURE_ENABLED=false" in refused.stderr, refused.stderr
    off = subprocess.Popen(
        [*CLI, *proxy, "--port", "0", "--log-level", "warning"],
        env={**env, "ROLLOUT_CAPTURE_ENABLED": "false"},
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
    )
    try:
        assert off.stderr is not None
        line = off.stderr.readline()
        url = line.split(" on ", 1)[1].split(" ", 1)[0]
        answer = httpx.post(
            f"{url}/ng-rollout/off-1/v1/chat/completions",
            json={"model": "scripted", "messages": [{"role": "user", "content": "hi"}]},
            timeout=30,
        )
        assert answer.status_code == 200 and answer.json()["object"] == "chat.completion"
    finally:
        off.terminate()
        off.wait(30)
    assert list(tmp_path.iterdir()) == []


def test_the_proxy_options_come_from_the_settings_model() -> None:
    """Each default, bound and description of the proxy's options lives once, on ProxySettings;
    ``--help`` still shows them, and a value past a bound is refused naming the option."""

    from typer.testing import CliRunner

    from rollout_capture.cli.app import app
    from rollout_capture.cli.commands.proxy import PROXY_OPTIONS
    from rollout_capture.producer.settings import ProxySettings

    runner = CliRunner()
    shown = " ".join(runner.invoke(app, ["proxy", "--help"]).output.split())  # unwrapped
    # Each option's text: from its name to the next option's name.
    texts = dict(
        re.findall(r"(?:^| )((?:-c, )?--[a-z-]+(?: / --[a-z-]+)?) (.*?)(?= (?:-c, )?--[a-z]|$)", shown)
    )
    for field, names in PROXY_OPTIONS.items():
        info = ProxySettings.model_fields[field]
        name = ", ".join(reversed(names)) if len(names) > 1 else names[0].replace("/", " / ")
        text = texts[name]
        assert (info.description or "") in text, (field, text)
        if not info.is_required() and info.default_factory is None and info.default is not None:
            default = "enabled" if info.default is True else str(info.default)
            assert f"default: {default}" in text, (field, text)
    assert "default: 300.0" in texts["--claim-ttl"] and "default: 16777216" in texts["--max-body-bytes"]
    zero = runner.invoke(app, ["proxy", "--upstream", "http://x", "--no-enabled", "--claim-ttl", "0"])
    assert zero.exit_code == 2 and "--claim-ttl" in zero.output, zero.output


@pytest.mark.parametrize("through", ["option", "environment"])
def test_the_proxy_refuses_to_start_on_a_capture_dir_with_credentials(through: str) -> None:
    """A real process: exit 2 before it listens, the secret on neither stream."""
    args = ["proxy", "--upstream", "http://127.0.0.1:9", "--port", "0"]
    env = {**os.environ}
    if through == "option":
        args += ["--capture-dir", CREDENTIALED]
    else:
        env["ROLLOUT_CAPTURE_DIR"] = CREDENTIALED
    done = run_cli(*args, env=env, timeout=120)
    refused_unechoed(done.returncode, done.stdout + done.stderr)
    assert "credentials in the URL are not allowed" in done.stderr and "(s3://bucket)" in done.stderr
