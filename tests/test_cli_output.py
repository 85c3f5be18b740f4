"""``cli/output.py``: one summary as text or JSON, and every error as one line and an exit code."""

from __future__ import annotations

import json

import pytest
import typer

from rollout_capture.cli.output import InputError, Output


def test_a_result_is_json_or_text(capsys: pytest.CaptureFixture[str]) -> None:
    Output(json=True).result({"n": 0.1 + 0.2}, text="n is small")
    assert json.loads(capsys.readouterr().out) == {"ok": True, "n": 0.3}  # floats rounded
    Output().result({"n": 1}, text="n is 1")
    assert capsys.readouterr().out == "n is 1\n"
    Output().result(lambda: pytest.fail("JSON built for text"), text=lambda: typer.echo("by a function"))
    assert capsys.readouterr().out == "by a function\n"
    Output(json=True).result({"quiescent": False}, text="unused", ok=False)
    assert json.loads(capsys.readouterr().out) == {"ok": False, "quiescent": False}


@pytest.mark.parametrize(
    ("error", "code", "message"),
    [
        (InputError("bad id"), 2, "bad id"),
        (FileNotFoundError("no such file"), 2, "no such file"),
        (RuntimeError("boom"), 1, "RuntimeError: boom"),
    ],
)
def test_errors_become_one_line_and_an_exit_code(
    capsys: pytest.CaptureFixture[str], error: Exception, code: int, message: str
) -> None:
    for as_json in (False, True):
        with pytest.raises(typer.Exit) as exited, Output(json=as_json).exits():
            raise error
        assert exited.value.exit_code == code
        shown = capsys.readouterr()
        assert shown.err == f"error: {message}\n"
        if as_json:
            assert json.loads(shown.out) == {"ok": False, "exit_code": code, "error": message}
        else:
            assert shown.out == ""
