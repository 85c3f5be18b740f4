"""``rollout_capture.producer.asgi``: the ASGI plumbing the middleware and the proxy share, driven
with real ASGI messages (no server)."""

from __future__ import annotations

from typing import Any

import orjson

from rollout_capture.producer.asgi import (
    Message,
    error_body,
    read_body,
    replace_header,
    route_or_refuse,
    scope_headers,
    scope_method,
)


def receiving(*messages: Message) -> Any:
    queue = list(messages)

    async def receive() -> Message:
        return queue.pop(0)

    return receive


class Sent:
    def __init__(self) -> None:
        self.messages: list[Message] = []

    async def __call__(self, message: Message) -> None:
        self.messages.append(message)

    @property
    def status(self) -> int:
        return int(self.messages[0]["status"])

    @property
    def error(self) -> dict[str, Any]:
        body: dict[str, Any] = orjson.loads(self.messages[1]["body"])
        return body


async def test_a_body_is_read_whole_across_chunks() -> None:
    receive = receiving(
        {"type": "http.request", "body": b"ab", "more_body": True},
        {"type": "http.request", "body": b"", "more_body": True},
        {"type": "http.request", "body": b"cd", "more_body": False},
    )
    assert await read_body(receive, limit=10) == (b"abcd", True, False)


async def test_a_body_over_the_limit_stops_with_the_rest_still_to_receive() -> None:
    receive = receiving(
        {"type": "http.request", "body": b"abc", "more_body": True},
        {"type": "http.request", "body": b"def", "more_body": True},
        {"type": "http.request", "body": b"never read", "more_body": False},
    )
    assert await read_body(receive, limit=4) == (b"abcdef", False, False)


async def test_a_client_that_leaves_mid_body_is_told_apart() -> None:
    receive = receiving(
        {"type": "http.request", "body": b"ab", "more_body": True}, {"type": "http.disconnect"}
    )
    assert await read_body(receive, limit=10) == (b"ab", False, True)


def test_the_error_body_speaks_both_sdks() -> None:
    assert orjson.loads(error_body(400, "bad id", "invalid_rollout_id")) == {
        "type": "error",
        "error": {"message": "bad id", "type": "invalid_rollout_id", "code": 400},
    }


async def test_a_bad_rollout_id_is_answered_400_and_not_routed() -> None:
    sent = Sent()
    scope = {"type": "http", "method": "POST", "path": "/ng-rollout/../v1/chat/completions"}
    assert await route_or_refuse(scope, sent) is None
    assert sent.status == 400 and sent.error["error"]["type"] == "invalid_rollout_id"
    headers = dict(sent.messages[0]["headers"])
    assert headers[b"content-type"] == b"application/json"
    assert int(headers[b"content-length"]) == len(sent.messages[1]["body"])


async def test_paths_without_the_prefix_are_checked_only_when_every_path_is_asked() -> None:
    scope = {"type": "http", "method": "GET", "path": "/a/../b", "raw_path": b"/a/../b"}
    passed = await route_or_refuse(scope, Sent())  # the middleware's app gets it untouched
    assert passed is not None and passed.rollout_id is None
    sent = Sent()
    assert await route_or_refuse(scope, sent, every_path=True) is None  # the proxy would forward it
    assert sent.status == 400 and sent.error["error"]["type"] == "invalid_path"


async def test_a_good_path_is_routed_with_its_verify_paths() -> None:
    scope = {"type": "http", "method": "POST", "path": "/ng-rollout/3-1/verify"}
    found = await route_or_refuse(scope, Sent(), verify_paths=("/verify",))
    assert found is not None and found.verify and found.rollout_id == "3-1"


def test_a_scope_without_a_method_or_headers_is_a_post_with_none() -> None:
    assert scope_method({"path": "/v1/chat/completions"}) == "POST"
    assert scope_method({"method": "GET"}) == "GET"
    assert scope_headers({}) == [] and scope_headers({"headers": [(b"a", b"1")]}) == [(b"a", b"1")]


def test_replace_header_drops_every_copy_in_any_case_then_adds_one() -> None:
    headers = [(b"Content-Length", b"1"), (b"x-other", b"y"), (b"content-length", b"2")]
    assert replace_header(headers, b"content-length", b"9") == [(b"x-other", b"y"), (b"content-length", b"9")]
    assert replace_header(headers, b"content-length", None) == [(b"x-other", b"y")]
