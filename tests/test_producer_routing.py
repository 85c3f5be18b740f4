"""``rollout_capture.producer.routing``: NeMo Gym's ``/ng-rollout/<id>/`` prefix read from the raw
path, what is captured, and the paths refused before anything is written or forwarded."""

from __future__ import annotations

import pytest

from rollout_capture.producer.routing import (
    BadPath,
    BadRolloutId,
    Route,
    check_forward_path,
    header,
    route,
)


@pytest.mark.parametrize(
    ("path", "dialect"),
    [("/v1/chat/completions", "chat"), ("/v1/responses", "responses"), ("/v1/messages", "messages")],
)
def test_a_model_call_under_the_prefix_is_captured_for_its_rollout(path: str, dialect: str) -> None:
    routed = route("POST", f"/ng-rollout/12-3{path}", None)
    assert routed == Route(path, path.encode(), "12-3", dialect)  # type: ignore[arg-type]
    assert routed.captured and not routed.verify


def test_only_a_post_to_a_model_endpoint_is_captured() -> None:
    got = route("GET", "/ng-rollout/12-3/v1/chat/completions", None)
    assert got.rollout_id == "12-3" and got.dialect is None and not got.captured
    other = route("POST", "/ng-rollout/12-3/v1/embeddings", None)
    assert other.path == "/v1/embeddings" and not other.captured


def test_a_path_without_the_prefix_passes_as_it_is() -> None:
    routed = route("POST", "/v1/chat/completions", None)
    assert routed == Route("/v1/chat/completions", b"/v1/chat/completions")
    assert not routed.captured and routed.rollout_id is None


def test_a_verify_call_is_marked_with_or_without_the_prefix() -> None:
    assert route("POST", "/verify", None, verify_paths=("/verify",)).verify
    assert not route("GET", "/verify", None, verify_paths=("/verify",)).verify
    assert not route("POST", "/verify", None).verify  # not a verifier server's path here
    prefixed = route("POST", "/ng-rollout/4-0/verify", None, verify_paths=("/verify",))
    assert prefixed.verify and prefixed.rollout_id == "4-0" and not prefixed.captured


def test_doubled_slashes_of_a_base_url_and_the_token_capture_segment_are_dropped() -> None:
    routed = route("POST", "//ng-rollout/1-0//v1//chat/completions", None)
    assert (routed.path, routed.rollout_id, routed.dialect) == ("/v1/chat/completions", "1-0", "chat")
    token = route("POST", "/ng-rollout/1-0/training-token-capture/v1/responses", None)
    assert (token.path, token.dialect) == ("/v1/responses", "responses")
    assert route("GET", "/ng-rollout/1-0", None).path == "/"


def test_the_id_is_read_from_the_raw_path_so_an_encoded_slash_cannot_split_it() -> None:
    with pytest.raises(BadRolloutId) as caught:
        route("POST", "/ng-rollout/a/b/v1/chat/completions", b"/ng-rollout/a%2Fb/v1/chat/completions")
    assert caught.value.rollout_id == "a/b"
    with pytest.raises(BadRolloutId):
        route("POST", "/ng-rollout/../v1/chat/completions", None)


@pytest.mark.parametrize(
    "raw",
    [
        b"/ng-rollout/1-0/v1/../admin",
        b"/ng-rollout/1-0/v1/%2e%2e/admin",
        b"/ng-rollout/1-0/./v1/chat/completions",
        b"/ng-rollout/1-0/v1%2Fchat/completions",
        b"/ng-rollout/1-0/v1\\chat",
    ],
)
def test_dot_segments_and_encoded_slashes_after_the_prefix_are_refused(raw: bytes) -> None:
    with pytest.raises(BadPath) as caught:
        route("POST", raw.decode(), raw)
    assert caught.value.path == raw.decode()  # named as the client sent it


def test_check_forward_path_passes_ordinary_paths_and_names_the_shown_one() -> None:
    check_forward_path(b"/v1/chat/completions")
    check_forward_path(b"/v1/files/a%20b.json")  # an encoded space is no escape
    with pytest.raises(BadPath, match="dot segments"):
        check_forward_path(b"/a/%2E%2E/b", shown=b"/shown/path")
    with pytest.raises(BadPath, match="'/shown/path'"):
        check_forward_path(b"/a/%2f/b", shown=b"/shown/path")


def test_header_finds_the_first_value_in_any_case() -> None:
    headers = [(b"Content-Type", b"application/json"), (b"content-type", b"text/plain")]
    assert header(headers, b"content-type") == b"application/json"
    assert header(headers, b"x-missing") is None
