"""Capture rows synthesized from real rollout records, for the demo, tests and benchmarks.

Each corpus record carries a real Responses-API request and response; this module turns
it into the rows a NeMo Gym model server would have captured for that rollout, in any of
the three dialects, deterministically (same seed, same bytes).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import orjson

Dialect = Literal["responses", "chat", "messages"]
DIALECTS: tuple[Dialect, ...] = ("responses", "chat", "messages")
MODEL_SERVER = {"type": "responses_api_models", "name": "policy_model"}
BASE_TIME = 1_780_000_000.0


def iter_corpus(corpus_dir: str | Path) -> Iterator[tuple[str, int, bytes]]:
    """``(file name, line number, raw line)`` for every line of every corpus file, sorted."""
    for path in sorted(Path(corpus_dir).glob("*.jsonl")):
        with path.open("rb") as handle:
            for number, line in enumerate(handle, start=1):
                yield path.name, number, line.rstrip(b"\n")


def corpus_records(corpus_dir: str | Path) -> list[dict[str, Any]]:
    """The corpus records that are JSON objects with a response (bad lines skipped)."""
    out = []
    for _, _, line in iter_corpus(corpus_dir):
        try:
            record = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue
        if isinstance(record, dict) and isinstance(record.get("response"), dict):
            out.append(record)
    return out


def _hex_id(*parts: object) -> str:
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:32]


def _text_of(item: dict[str, Any]) -> str:
    parts = item.get("content") or []
    if isinstance(parts, str):
        return parts
    return "".join(p.get("text", "") for p in parts if isinstance(p, dict))


def _turns(output: list[Any]) -> list[list[dict[str, Any]]]:
    """Split a final response's output into the model turns that produced it."""
    turns: list[list[dict[str, Any]]] = []
    current: list[dict[str, Any]] = []
    for item in output:
        if not isinstance(item, dict):
            continue
        if item.get("type") in ("function_call_output",) or item.get("role") == "user":
            continue  # tool results and user turns are not model output
        current.append(item)
        if item.get("type") in ("function_call", "message"):
            turns.append(current)
            current = []
    if current:
        turns.append(current)
    return turns or [[]]


def _split(total: Any, parts: int, index: int) -> Any:
    if type(total) is not int:
        return total
    share = total // parts
    return share + (total - share * parts if index == parts - 1 else 0)


def _responses_usage(usage: dict[str, Any], parts: int, index: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in usage.items():
        if isinstance(value, dict):
            out[key] = {k: _split(v, parts, index) for k, v in value.items()}
        else:
            out[key] = _split(value, parts, index)
    return out


def _counts(usage: dict[str, Any]) -> tuple[Any, Any, Any]:
    """(prompt, completion, total) from usage of either OpenAI shape."""
    prompt = usage.get("input_tokens", usage.get("prompt_tokens"))
    completion = usage.get("output_tokens", usage.get("completion_tokens"))
    return prompt, completion, usage.get("total_tokens")


def _as_chat(response: dict[str, Any], items: list[dict[str, Any]], usage: dict[str, Any]) -> dict[str, Any]:
    text = "".join(_text_of(i) for i in items if i.get("type") == "message")
    reasoning = "\n".join(
        s.get("text", "") for i in items if i.get("type") == "reasoning" for s in i.get("summary") or []
    )
    tool_calls = [
        {
            "id": i.get("call_id"),
            "type": "function",
            "function": {"name": i.get("name"), "arguments": i.get("arguments")},
        }
        for i in items
        if i.get("type") == "function_call"
    ]
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    if reasoning:
        message["reasoning_content"] = reasoning
    if tool_calls:
        message["tool_calls"] = tool_calls
    details_in = usage.get("input_tokens_details") or usage.get("prompt_tokens_details") or {}
    details_out = usage.get("output_tokens_details") or usage.get("completion_tokens_details") or {}
    prompt, completion, total = _counts(usage)
    return {
        "id": "chatcmpl-" + str(response.get("id", ""))[5:],
        "object": "chat.completion",
        "model": response.get("model"),
        "choices": [
            {"index": 0, "message": message, "finish_reason": "tool_calls" if tool_calls else "stop"}
        ],
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": total,
            "prompt_tokens_details": {"cached_tokens": details_in.get("cached_tokens", 0)},
            "completion_tokens_details": {"reasoning_tokens": details_out.get("reasoning_tokens", 0)},
        },
    }


def _as_messages(
    response: dict[str, Any], items: list[dict[str, Any]], usage: dict[str, Any], rng: random.Random
) -> dict[str, Any]:
    content: list[dict[str, Any]] = []
    for item in items:
        kind = item.get("type")
        if kind == "reasoning":
            text = "\n".join(s.get("text", "") for s in item.get("summary") or [])
            content.append({"type": "thinking", "thinking": text, "signature": "sig"})
        elif kind == "message":
            content.append({"type": "text", "text": _text_of(item)})
        elif kind == "function_call":
            try:
                arguments = orjson.loads(item.get("arguments") or "{}")
            except orjson.JSONDecodeError:
                arguments = {"_raw": item.get("arguments")}
            content.append(
                {"type": "tool_use", "id": item.get("call_id"), "name": item.get("name"), "input": arguments}
            )
    prompt, completion, _ = _counts(usage)
    cache_read = rng.choice([0, 0, 128]) if type(prompt) is int and prompt > 256 else 0
    return {
        "id": "msg_" + str(response.get("id", ""))[5:],
        "type": "message",
        "role": "assistant",
        "model": response.get("model"),
        "content": content,
        "stop_reason": "tool_use" if any(c["type"] == "tool_use" for c in content) else "end_turn",
        "usage": {
            "input_tokens": prompt - cache_read if type(prompt) is int else prompt,
            "output_tokens": completion,
            "cache_read_input_tokens": cache_read,
            "cache_creation_input_tokens": 0,
        },
    }


def _request_for(record: dict[str, Any], dialect: Dialect) -> dict[str, Any]:
    params = dict(record.get("responses_create_params") or {})
    model = params.get("model") or (record.get("response") or {}).get("model")
    if dialect == "responses":
        return {**params, "model": model}
    raw_input = params.get("input")
    messages = [
        {
            "role": m.get("role", "user"),
            "content": _text_of(m) if not isinstance(m.get("content"), str) else m["content"],
        }
        for m in (raw_input if isinstance(raw_input, list) else [{"role": "user", "content": str(raw_input)}])
        if isinstance(m, dict) and m.get("role")
    ]
    request: dict[str, Any] = {"model": model, "messages": messages}
    if dialect == "messages":
        request["max_tokens"] = params.get("max_output_tokens") or 1024
    return request


def capture_rows(
    record: dict[str, Any],
    rollout_id: str,
    *,
    dialect: Dialect,
    seed: int = 0,
    repeat: int = 1,
    verifier: bool = False,
) -> list[dict[str, Any]]:
    """The rows a model server would capture for this rollout, one per model turn.

    ``repeat`` multiplies the turns (for benchmarks needing several calls per rollout);
    ``verifier`` adds a verifier invocation and the judge call it made.
    """
    rng = random.Random(f"{seed}:{rollout_id}")
    response = record.get("response") or {}
    turns = _turns(response.get("output") or []) * max(1, repeat)
    raw_usage = response.get("usage")
    usage: dict[str, Any] = raw_usage if isinstance(raw_usage, dict) else {}
    request = _request_for(record, dialect)
    clock = BASE_TIME + rng.uniform(0, 86_400)
    rows: list[dict[str, Any]] = []
    for index, items in enumerate(turns):
        part_usage = _responses_usage(usage, len(turns), index)
        if dialect == "responses":
            body: dict[str, Any] = {**response, "output": items, "usage": part_usage}
        elif dialect == "chat":
            body = _as_chat(response, items, part_usage)
        else:
            body = _as_messages(response, items, part_usage, rng)
        latency = round(rng.uniform(150, 4000), 2)
        rows.append(
            {
                "model_call_id": _hex_id(seed, rollout_id, index),
                "dialect": dialect,
                "model_ref": MODEL_SERVER,
                "started_at": round(clock, 6),
                "completed_at": round(clock + latency / 1000, 6),
                "latency_ms": latency,
                "latency_ttft_ms": round(latency * rng.uniform(0.05, 0.3), 2),
                "status_code": 200,
                "error_category": None,
                "request": request,
                "response": body,
            }
        )
        clock += latency / 1000 + rng.uniform(0.01, 2)
    if verifier:
        rows.extend(_verifier_rows(record, rollout_id, seed, clock, rng))
    return rows


def _verifier_rows(
    record: dict[str, Any], rollout_id: str, seed: int, clock: float, rng: random.Random
) -> list[dict[str, Any]]:
    invocation_id = "v" + _hex_id(seed, rollout_id, "verify")[:15]
    judge_latency = round(rng.uniform(100, 900), 2)
    judge = {
        "model_call_id": _hex_id(seed, rollout_id, "judge"),
        "dialect": "chat",
        "model_ref": {"type": "responses_api_models", "name": "judge_model"},
        "started_at": round(clock, 6),
        "completed_at": round(clock + judge_latency / 1000, 6),
        "latency_ms": judge_latency,
        "latency_ttft_ms": None,
        "status_code": 200,
        "error_category": None,
        "verifier_invocation_id": invocation_id,
        "request": {"model": "judge", "messages": [{"role": "user", "content": "Is the answer correct?"}]},
        "response": {
            "id": "chatcmpl-judge-" + rollout_id,
            "model": "judge",
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": "yes"}, "finish_reason": "stop"}
            ],
            "usage": {"prompt_tokens": 40, "completion_tokens": 2, "total_tokens": 42},
        },
    }
    reward = record.get("reward")
    verify = {
        "kind": "verifier_invocation",
        "verifier_invocation_id": invocation_id,
        "verifier_ref": {"type": "resources_servers", "name": "verifier"},
        "started_at": round(clock - 0.01, 6),
        "completed_at": round(clock + judge_latency / 1000 + 0.02, 6),
        "latency_ms": round(judge_latency + 30, 2),
        "status_code": 200,
        "error_category": None,
        "reward": reward if isinstance(reward, (int, float)) else None,
        "request": {"rollout_id": rollout_id},
        "response": {"reward": reward if isinstance(reward, (int, float)) else None},
    }
    return [judge, verify]


def jsonl_bytes(rows: list[dict[str, Any]]) -> bytes:
    """Rows as a JSONL capture file, written the way the local writer writes them."""
    return b"".join(orjson.dumps(r, default=str, option=orjson.OPT_APPEND_NEWLINE) for r in rows)
