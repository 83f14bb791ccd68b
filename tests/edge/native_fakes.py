"""A fake of Anthropic's Messages API and of OpenAI's Responses API on one real HTTP server
(our ``serve_http`` on 127.0.0.1, port 0), written from the two API references, for the native
tunnel tests (``test_tunnel_native.py``).

``POST /v1/messages`` (Anthropic): the key in ``x-api-key`` (else 401 ``authentication_error``),
``anthropic-version`` required (else 400); a ``message`` body, or with ``"stream": true`` the
events ``message_start`` (usage with cache tokens), ``content_block_start``, ``ping``, one
``content_block_delta`` per token, ``content_block_stop``, ``message_delta`` (stop reason,
output tokens), ``message_stop`` -- each ``event: <type>`` + ``data: <json>``.

``POST /v1/responses`` (OpenAI): ``Authorization: Bearer <key>``; a ``response`` object, or the
events ``response.created``, ``response.in_progress``, ``response.output_item.added``,
``response.content_part.added``, one ``response.output_text.delta`` per token,
``response.output_text.done``, ``response.content_part.done``, ``response.output_item.done``,
``response.completed`` (usage with cached and reasoning tokens), numbered by
``sequence_number``.

Knobs: ``fail_next`` (the next N requests fail: ``fail_status`` -- Anthropic's 529
``overloaded_error`` by default, in the route's error shape -- or, with ``fail_with_event``, a
2xx stream whose first event after the preamble is the API's error event), ``break_after``
(a stream is cut, the connection closed, after that many events), ``tokens`` /
``chunk_delay``. Every byte sent is recorded (:attr:`NativeFake.sent`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import orjson
import trio

from dispatcher.http import MalformedBody, Responder

from ..nodes.fake_providers import FakeProvider, SeenRequest

INPUT_TOKENS = 25
CACHE_READ = 11
CACHE_WRITE = 3
CACHED_TOKENS = 9
REASONING_TOKENS = 2


def anthropic_event(kind: str, data: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def responses_event(data: dict[str, Any]) -> bytes:
    kind: str = data["type"]
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def anthropic_usage_object(output_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": INPUT_TOKENS,
        "cache_creation_input_tokens": CACHE_WRITE,
        "cache_read_input_tokens": CACHE_READ,
        "output_tokens": output_tokens,
    }


def responses_usage_object(output_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": INPUT_TOKENS,
        "input_tokens_details": {"cached_tokens": CACHED_TOKENS},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": REASONING_TOKENS},
        "total_tokens": INPUT_TOKENS + output_tokens,
    }


@attrs.define(eq=False, kw_only=True)
class NativeFake(FakeProvider):
    anthropic_key: str | None = None
    openai_key: str | None = None
    fail_next: int = 0
    fail_status: int = 529
    fail_with_event: bool = False
    break_after: int | None = None
    sent: dict[int, list[bytes]] = attrs.field(factory=dict, init=False)
    """The events (or the body) sent for each request, by its index in :attr:`requests`."""

    def route(
        self, seen: SeenRequest
    ) -> Callable[[SeenRequest, Responder], Awaitable[None]] | None:
        if (seen.method, seen.path) == ("POST", "/v1/messages"):
            return self._messages
        if (seen.method, seen.path) == ("POST", "/v1/responses"):
            return self._responses
        return None

    def error_body_for(self, message: str) -> Any:
        return {"type": "error", "error": {"type": "not_found_error", "message": message}}

    def sent_bytes(self, index: int = -1) -> bytes:
        return b"".join(self.sent[index % len(self.requests)])

    def _failing(self) -> bool:
        if self.fail_next <= 0:
            return False
        self.fail_next -= 1
        return True

    # ---------------------------------------------------------------- Anthropic

    async def _messages(self, seen: SeenRequest, responder: Responder) -> None:
        def error(status: int, kind: str, message: str) -> Awaitable[None]:
            body = {"type": "error", "error": {"type": kind, "message": message}}
            return self.respond_json(responder, status, body)

        if self.anthropic_key is not None and seen.header("x-api-key") != self.anthropic_key:
            await error(401, "authentication_error", "invalid x-api-key")
            return
        if not seen.header("anthropic-version"):
            await error(400, "invalid_request_error", "anthropic-version: header is required")
            return
        body = seen.json if isinstance(seen.json, dict) else {}
        failing = self._failing()
        if failing and not self.fail_with_event:
            await error(self.fail_status, "overloaded_error", "Overloaded")
            return
        model = body.get("model")
        tokens = self.tokens
        message: dict[str, Any] = {
            "id": "msg_01FakeNative",
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": anthropic_usage_object(1),
        }
        if body.get("stream") is not True:
            whole = {
                **message,
                "content": [{"type": "text", "text": "".join(tokens)}],
                "stop_reason": "end_turn",
                "usage": anthropic_usage_object(len(tokens)),
            }
            raw = orjson.dumps(whole)
            self.sent[len(self.requests) - 1] = [raw]
            await responder.respond(200, [(b"content-type", b"application/json")], raw)
            return
        events = [anthropic_event("message_start", {"type": "message_start", "message": message})]
        if failing:
            error_event = {
                "type": "error",
                "error": {"type": "overloaded_error", "message": "Overloaded"},
            }
            events.append(anthropic_event("error", error_event))
        else:
            events += [
                anthropic_event(
                    "content_block_start",
                    {
                        "type": "content_block_start",
                        "index": 0,
                        "content_block": {"type": "text", "text": ""},
                    },
                ),
                anthropic_event("ping", {"type": "ping"}),
                *(
                    anthropic_event(
                        "content_block_delta",
                        {
                            "type": "content_block_delta",
                            "index": 0,
                            "delta": {"type": "text_delta", "text": token},
                        },
                    )
                    for token in tokens
                ),
                anthropic_event("content_block_stop", {"type": "content_block_stop", "index": 0}),
                anthropic_event(
                    "message_delta",
                    {
                        "type": "message_delta",
                        "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                        "usage": {"output_tokens": len(tokens)},
                    },
                ),
                anthropic_event("message_stop", {"type": "message_stop"}),
            ]
        await self._stream(seen, responder, events)

    # ---------------------------------------------------------------- Responses

    async def _responses(self, seen: SeenRequest, responder: Responder) -> None:
        if self.openai_key is not None and seen.authorization != f"Bearer {self.openai_key}":
            error = {"error": {"message": "Incorrect API key", "type": "invalid_request_error"}}
            await self.respond_json(responder, 401, error)
            return
        body = seen.json if isinstance(seen.json, dict) else {}
        failing = self._failing()
        if failing and not self.fail_with_event:
            error = {"error": {"message": "The server had an error", "type": "server_error"}}
            await self.respond_json(responder, self.fail_status, error)
            return
        tokens = self.tokens
        text = "".join(tokens)
        response: dict[str, Any] = {
            "id": "resp_fake_native",
            "object": "response",
            "created_at": 1_760_000_000,
            "status": "in_progress",
            "error": None,
            "incomplete_details": None,
            "instructions": None,
            "model": body.get("model"),
            "output": [],
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": [],
            "usage": None,
        }
        item: dict[str, Any] = {
            "id": "msg_fake_native",
            "type": "message",
            "status": "in_progress",
            "role": "assistant",
            "content": [],
        }
        part_done = {"type": "output_text", "text": text, "annotations": []}
        item_done = {**item, "status": "completed", "content": [part_done]}
        completed = {
            **response,
            "status": "completed",
            "output": [item_done],
            "usage": responses_usage_object(len(tokens)),
        }
        if body.get("stream") is not True:
            raw = orjson.dumps(completed)
            self.sent[len(self.requests) - 1] = [raw]
            await responder.respond(200, [(b"content-type", b"application/json")], raw)
            return
        sequence = iter(range(1_000_000))

        def event(data: dict[str, Any]) -> bytes:
            return responses_event(
                {"type": data.pop("type"), "sequence_number": next(sequence), **data}
            )

        where = {"item_id": item["id"], "output_index": 0, "content_index": 0}
        events = [
            event({"type": "response.created", "response": response}),
            event({"type": "response.in_progress", "response": response}),
        ]
        if failing:
            failed = {
                **response,
                "status": "failed",
                "error": {"code": "server_error", "message": "The model failed"},
            }
            events.append(event({"type": "response.failed", "response": failed}))
        else:
            events += [
                event({"type": "response.output_item.added", "output_index": 0, "item": item}),
                event(
                    {
                        "type": "response.content_part.added",
                        **where,
                        "part": {"type": "output_text", "text": "", "annotations": []},
                    }
                ),
                *(
                    event(
                        {
                            "type": "response.output_text.delta",
                            **where,
                            "delta": token,
                            "logprobs": [],
                        }
                    )
                    for token in tokens
                ),
                event({"type": "response.output_text.done", **where, "text": text, "logprobs": []}),
                event({"type": "response.content_part.done", **where, "part": part_done}),
                event({"type": "response.output_item.done", "output_index": 0, "item": item_done}),
                event({"type": "response.completed", "response": completed}),
            ]
        await self._stream(seen, responder, events)

    # ---------------------------------------------------------------- streaming

    async def _stream(self, seen: SeenRequest, responder: Responder, events: list[bytes]) -> None:
        record = self.sent[len(self.requests) - 1] = []
        stream = await responder.start_stream(
            200, [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
        )
        for index, data in enumerate(events):
            if index == self.break_after:
                # serve_http cuts the connection of a handler that raises after answering
                raise MalformedBody("native fake: injected mid-stream failure")
            if index and self.chunk_delay:
                await trio.sleep(self.chunk_delay)
            await stream.send(data)
            record.append(data)
            seen.chunks_sent += 1
            self._changed.unpark_all()
