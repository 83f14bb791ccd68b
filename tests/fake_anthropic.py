"""A fake Anthropic Messages API on a real HTTP server (our ``dispatcher.http.serve_http`` on
127.0.0.1, port 0), written from Anthropic's API reference (the ``anthropic`` SDK's types):
``POST /v1/messages``, streamed (SSE) or not, with a deterministic script. For the
``anthropic`` adapter's tests and end-to-end ones.

::

    fake = await nursery.start(serve_fake_anthropic)                    # default knobs
    fake = await nursery.start(serve_fake_anthropic, FakeAnthropic(api_key="sk-ant"))
    fake.base_url                  # "http://127.0.0.1:<port>" (add "/v1" if you like)
    fake.fail_statuses = [529]     # the next request answers 529 overloaded_error, then as usual
    seen = fake.requests[0]        # method, path, headers, body, json (tests.nodes.fake_providers)
    await seen.disconnected.wait() # the client closed the connection mid-answer
    fake.answers[0]                # the message object the first request was answered with

What it checks, as Anthropic does (a 400 ``invalid_request_error`` otherwise): the
``anthropic-version`` header; ``x-api-key`` when :attr:`~FakeProvider.api_key` is set (401
``authentication_error``); ``model``, a positive ``max_tokens`` and non-empty ``messages``;
roles ``user`` / ``assistant`` only, no empty text block; a user turn's ``tool_result`` blocks
first, each answering a ``tool_use`` of the assistant turn just before, and every such
``tool_use`` answered; ``temperature`` in [0, 1]; ``thinking.budget_tokens`` >= 1024 and below
``max_tokens``; a forced ``tool_choice`` not with thinking; ``tool_choice`` naming a tool of
``tools``.

The script (the last user turn decides):

* it carries ``tool_result`` blocks -> text ``The tool said: <their text joined by "; ">.``;
* else ``tools`` are given, ``tool_choice`` is not ``none``, and ``tool_choice`` forces a call
  (``any``: the first tool; ``tool``: that one) or the turn's text names a tool -> a ``text``
  block ``Calling <name>.`` and a ``tool_use`` block (``id`` ``toolu_fake_<n>``, ``input``
  :attr:`FakeAnthropic.tool_input`), stop reason ``tool_use``;
* else :attr:`~FakeProvider.reply` (or ``chunk_count`` tokens), one ``text_delta`` per token.

A reply is cut where a ``stop_sequences`` entry first occurs (stop reason ``stop_sequence``,
``stop_sequence`` that entry) or after ``max_tokens`` tokens (``max_tokens``). With
``thinking`` enabled a ``thinking`` block (``thinking_delta``, ``signature_delta``) comes first.

Usage: one token per word (``\\w+``) of each block's JSON; output tokens, one per streamed
token (and the tool call's words; the thinking's also in
``output_tokens_details.thinking_tokens``). Prompt caching as Anthropic's works: the prefix
(tools, system, messages, in that order) up to each ``cache_control`` breakpoint is written to the
cache (``cache_creation_input_tokens``); a later request whose prefix, at a block boundary up
to its last breakpoint, was written reads the longest such from the cache
(``cache_read_input_tokens``); ``input_tokens`` is the rest. :attr:`FakeAnthropic.min_cache_tokens`
is the shortest prefix cached (Anthropic's is 1024 or more; 0 here by default).

The stream: ``message_start`` (the usage), ``ping``, per block ``content_block_start``,
``content_block_delta``..., ``content_block_stop``, then ``message_delta`` (stop reason, stop
sequence, ``output_tokens``) and ``message_stop``. The fault knobs of
:class:`~tests.nodes.fake_providers.FakeProvider` apply to the text tokens: ``chunk_delay``,
``fail_after_chunks`` (``fail_mode="error"``: an ``error`` event of type
:attr:`FakeAnthropic.error_type`), ``stall_after_chunks``. ``fail_statuses`` (popped, one per
request) and ``status`` answer with an error in Anthropic's shape (429: ``retry-after: 1``).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import orjson
import trio

from dispatcher.http import HTTPStream, MalformedBody, Responder
from tests.nodes.fake_providers import FakeProvider, SeenRequest, _serve

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}
_WORD = re.compile(r"\w+")


class Refused(Exception):
    """A request Anthropic would refuse with 400 ``invalid_request_error``."""


def count_tokens(value: Any) -> int:
    """The fake's token count of a block (its JSON without ``cache_control``)."""
    if isinstance(value, dict):
        value = {k: v for k, v in value.items() if k != "cache_control"}
    return max(1, len(_WORD.findall(orjson.dumps(value).decode())))


def _key(blocks: list[Any]) -> str:
    stripped = [
        {k: v for k, v in b.items() if k != "cache_control"} if isinstance(b, dict) else b
        for b in blocks
    ]
    return hashlib.sha256(orjson.dumps(stripped, option=orjson.OPT_SORT_KEYS)).hexdigest()


@attrs.frozen
class Block:
    """One block of an answer: ``text`` (its tokens), ``tool_use``, or ``thinking``."""

    kind: str
    tokens: tuple[str, ...] = ()
    tool_id: str = ""
    name: str = ""
    arguments: str = ""


@attrs.define(eq=False, kw_only=True)
class FakeAnthropic(FakeProvider):
    """An Anthropic Messages API server (``POST /v1/messages``)."""

    tool_input: dict[str, Any] = attrs.Factory(lambda: {"city": "Paris"})
    """The ``input`` of the tool calls it makes."""
    fail_statuses: list[int] = attrs.Factory(list)
    """Answer the next requests with these statuses, one each (popped), before ``status``."""
    error_type: str = "overloaded_error"
    """The type of the ``error`` event of ``fail_mode="error"``."""
    min_cache_tokens: int = 0
    version: str = "2023-06-01"
    """The ``anthropic-version`` it requires."""

    answers: list[dict[str, Any]] = attrs.field(factory=list, init=False)
    """The message objects answered, in order (streamed ones as the events built them)."""
    _cache: dict[str, int] = attrs.field(factory=dict, init=False)
    """Prefix key -> its tokens, for every prefix written to the cache."""
    _calls: int = attrs.field(default=0, init=False)

    def route(
        self, seen: SeenRequest
    ) -> Callable[[SeenRequest, Responder], Awaitable[None]] | None:
        if (seen.method, seen.path) == ("POST", "/v1/messages"):
            return self._messages
        return None

    def error_body_for(self, message: str) -> Any:
        kind = ERROR_TYPES.get(self.status, "api_error")
        return {"type": "error", "error": {"type": kind, "message": message}}

    def _error(self, status: int, message: str) -> Any:
        kind = ERROR_TYPES.get(status, "api_error")
        return {"type": "error", "error": {"type": kind, "message": message}}

    async def _answer(self, seen: SeenRequest, responder: Responder) -> None:
        route = self.route(seen)
        if route is None:
            body = self._error(404, f"no route for {seen.method} {seen.path}")
            await self.respond_json(responder, 404, body)
            return
        if self.api_key is not None and seen.header("x-api-key") != self.api_key:
            await self.respond_json(responder, 401, self._error(401, "invalid x-api-key"))
            return
        if seen.header("anthropic-version") != self.version:
            message = f"anthropic-version: expected {self.version!r}"
            await self.respond_json(responder, 400, self._error(400, message))
            return
        status = self.fail_statuses.pop(0) if self.fail_statuses else self.status
        if status != 200:
            headers = [(b"retry-after", b"1")] if status == 429 else []
            body = self._error(status, self.error_message)
            if status == 529:
                body = self._error(529, "Overloaded")
            await self.respond_json(responder, status, body, headers)
            return
        await route(seen, responder)

    # ---------------------------------------------------------------- the script

    def _check(self, body: Any) -> None:
        if not isinstance(body, dict):
            raise Refused("expected a JSON object")
        if not isinstance(body.get("model"), str) or not body["model"]:
            raise Refused("model: Field required")
        max_tokens = body.get("max_tokens")
        if type(max_tokens) is not int or max_tokens < 1:
            raise Refused("max_tokens: Field required")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise Refused("messages: at least one message is required")
        temperature = body.get("temperature")
        if temperature is not None and not 0 <= temperature <= 1:
            raise Refused("temperature: Input should be less than or equal to 1")
        names = [tool.get("name") for tool in body.get("tools") or []]
        choice = body.get("tool_choice")
        if (
            isinstance(choice, dict)
            and choice.get("type") == "tool"
            and choice["name"] not in names
        ):
            raise Refused(f"tool_choice.name: no tool named {choice['name']!r}")
        thinking = body.get("thinking")
        if isinstance(thinking, dict) and thinking.get("type") == "enabled":
            budget = thinking.get("budget_tokens")
            if type(budget) is not int or budget < 1024 or budget >= max_tokens:
                raise Refused("thinking.budget_tokens: must be >= 1024 and < max_tokens")
            if isinstance(choice, dict) and choice.get("type") in ("any", "tool"):
                raise Refused("Thinking may not be enabled when tool_choice forces tool use.")
        for block in body.get("system") or []:
            if block.get("type") != "text" or not block.get("text"):
                raise Refused("system: text content blocks must be non-empty")
        pending: set[str] = set()
        for index, message in enumerate(messages):
            role, content = message.get("role"), message.get("content")
            if role not in ("user", "assistant"):
                raise Refused(f"messages.{index}.role: Input should be 'user' or 'assistant'")
            blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
            if not isinstance(blocks, list) or not blocks:
                raise Refused(f"messages.{index}: all messages must have non-empty content")
            results = [b["tool_use_id"] for b in blocks if b.get("type") == "tool_result"]
            if role == "user":
                if set(results) != pending:
                    raise Refused(
                        f"messages.{index}: tool_use ids were found without tool_result blocks "
                        "immediately after (or tool_result blocks answer no tool_use)"
                    )
                firsts = [b.get("type") == "tool_result" for b in blocks]
                if firsts != sorted(firsts, reverse=True):
                    raise Refused(f"messages.{index}: tool_result blocks must come first")
                pending = set()
            else:
                if pending:
                    raise Refused(f"messages.{index}: tool_use without tool_result after it")
                pending = {b["id"] for b in blocks if b.get("type") == "tool_use"}
            for block in blocks:
                if block.get("type") == "text" and not block.get("text"):
                    raise Refused(f"messages.{index}: text content blocks must be non-empty")
        if pending:
            raise Refused("the last assistant turn's tool_use blocks need tool_result blocks")

    def _script(self, body: dict[str, Any]) -> tuple[list[Block], str, str | None]:
        """The answer's blocks, stop reason and stop sequence."""
        last = body["messages"][-1]
        content = last["content"]
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        blocks = blocks if last["role"] == "user" else []
        results = [b for b in blocks if b.get("type") == "tool_result"]
        text = " ".join(b["text"] for b in blocks if b.get("type") == "text")
        answer: list[Block] = []
        thinking = body.get("thinking")
        if isinstance(thinking, dict) and thinking.get("type") == "enabled":
            answer.append(Block("thinking", ("Let me ", "think.")))
        tools = [t["name"] for t in body.get("tools") or []]
        choice = body.get("tool_choice") or {"type": "auto"}
        wanted: str | None = None
        if tools and not results and choice["type"] != "none":
            if choice["type"] == "any":
                wanted = tools[0]
            elif choice["type"] == "tool":
                wanted = choice["name"]
            else:
                wanted = next((name for name in tools if name in text), None)
        if wanted is not None:
            self._calls += 1
            answer.append(Block("text", tuple(_tokens(f"Calling {wanted}."))))
            arguments = orjson.dumps(self.tool_input).decode()
            call = Block("tool_use", tool_id=f"toolu_fake_{self._calls}", name=wanted)
            answer.append(attrs.evolve(call, arguments=arguments))
            return answer, "tool_use", None
        if results:
            said = "; ".join(_result_text(r) for r in results)
            tokens = _tokens(f"The tool said: {said}.")
        else:
            tokens = self.tokens
        reason, sequence = "end_turn", None
        joined = "".join(tokens)
        found = [(joined.find(s), s) for s in body.get("stop_sequences") or [] if s in joined]
        if found:
            at, sequence = min(found)
            tokens = _tokens(joined[:at]) if joined[:at] else []
            reason = "stop_sequence"
        if len(tokens) > body["max_tokens"]:
            tokens, reason, sequence = tokens[: body["max_tokens"]], "max_tokens", None
        answer.append(Block("text", tuple(tokens)))
        return answer, reason, sequence

    def _usage(self, body: dict[str, Any]) -> dict[str, int]:
        """Input usage, the cache read and written (see the module docstring)."""
        blocks: list[Any] = [*(body.get("tools") or []), *(body.get("system") or [])]
        for message in body["messages"]:
            content = message["content"]
            blocks.extend(
                [{"type": "text", "text": content}] if isinstance(content, str) else content
            )
        counts = [count_tokens(block) for block in blocks]
        total = sum(counts)
        breakpoints = [i for i, block in enumerate(blocks) if "cache_control" in block]
        read = written = 0
        if breakpoints:
            last = breakpoints[-1]
            for end in range(last + 1, 0, -1):
                key = _key(blocks[:end])
                if key in self._cache:
                    read = self._cache[key]
                    break
            for point in breakpoints:
                prefix = sum(counts[: point + 1])
                if prefix > read and prefix >= self.min_cache_tokens:
                    self._cache[_key(blocks[: point + 1])] = prefix
            longest = sum(counts[: last + 1])
            if longest > read and longest >= self.min_cache_tokens:
                written = longest - read
        return {
            "input_tokens": total - read - written,
            "cache_read_input_tokens": read,
            "cache_creation_input_tokens": written,
        }

    # ---------------------------------------------------------------- answering

    async def _messages(self, seen: SeenRequest, responder: Responder) -> None:
        body = seen.json
        try:
            self._check(body)
        except Refused as exc:
            await self.respond_json(responder, 400, self._error(400, str(exc)))
            return
        assert isinstance(body, dict)
        blocks, reason, sequence = self._script(body)
        usage: dict[str, Any] = dict(self._usage(body))
        output = sum(
            len(b.tokens) + (count_tokens(b.name + " " + b.arguments) if b.arguments else 0)
            for b in blocks
        )
        thinking = sum(len(b.tokens) for b in blocks if b.kind == "thinking")
        if thinking:
            usage["output_tokens_details"] = {"thinking_tokens": thinking}
        message: dict[str, Any] = {
            "id": f"msg_fake_{len(self.requests)}",
            "type": "message",
            "role": "assistant",
            "model": body["model"],
            "content": [_content(b) for b in blocks],
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": {**usage, "output_tokens": output},
        }
        self.answers.append(message)
        if body.get("stream") is not True:
            await self.respond_json(responder, 200, message, [(b"request-id", b"req_fake")])
            return
        stream = await responder.start_stream(
            200, [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
        )
        await self._stream(seen, stream, message, blocks)

    async def _stream(
        self, seen: SeenRequest, stream: HTTPStream, message: dict[str, Any], blocks: list[Block]
    ) -> None:
        sent_any = False

        async def send(data: dict[str, Any]) -> None:
            nonlocal sent_any
            if sent_any and self.chunk_delay:
                await trio.sleep(self.chunk_delay)
            raw = b"event: " + data["type"].encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"
            await stream.send(raw)
            sent_any = True

        start = {
            **message,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {**message["usage"], "output_tokens": 1},
        }
        await send({"type": "message_start", "message": start})
        await send({"type": "ping"})
        sent = 0
        for index, block in enumerate(blocks):
            head = _content(block)
            if block.kind == "text":
                head["text"] = ""
            elif block.kind == "tool_use":
                head["input"] = {}
            else:
                head.update(thinking="", signature="")
            await send({"type": "content_block_start", "index": index, "content_block": head})
            if block.kind == "tool_use":
                half = len(block.arguments) // 2
                for piece in ("", block.arguments[:half], block.arguments[half:]):
                    delta = {"type": "input_json_delta", "partial_json": piece}
                    await send({"type": "content_block_delta", "index": index, "delta": delta})
            elif block.kind == "thinking":
                for token in block.tokens:
                    delta = {"type": "thinking_delta", "thinking": token}
                    await send({"type": "content_block_delta", "index": index, "delta": delta})
                delta = {"type": "signature_delta", "signature": "c2lnbmF0dXJl"}
                await send({"type": "content_block_delta", "index": index, "delta": delta})
            else:
                for token in block.tokens:
                    if sent == self.stall_after_chunks:
                        await trio.sleep_forever()
                    if sent == self.fail_after_chunks:
                        await self._fail(send)
                        return
                    delta = {"type": "text_delta", "text": token}
                    await send({"type": "content_block_delta", "index": index, "delta": delta})
                    sent += 1
                    seen.chunks_sent += 1
                    self._changed.unpark_all()
            await send({"type": "content_block_stop", "index": index})
        if sent == self.stall_after_chunks:
            await trio.sleep_forever()
        if sent == self.fail_after_chunks:
            await self._fail(send)
            return
        delta = {"stop_reason": message["stop_reason"], "stop_sequence": message["stop_sequence"]}
        usage = {
            key: value
            for key, value in message["usage"].items()
            if key in ("output_tokens", "output_tokens_details")
        }
        await send({"type": "message_delta", "delta": delta, "usage": usage})
        await send({"type": "message_stop"})
        if self.linger_after_end:
            await trio.sleep(self.linger_after_end)

    async def _fail(self, send: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
        if self.fail_mode == "error":
            error = {"type": self.error_type, "message": self.error_message}
            await send({"type": "error", "error": error})
            return
        # Raising after answering makes serve_http cut the connection (no traceback logged).
        raise MalformedBody("fake anthropic: injected mid-stream failure")


def _tokens(text: str) -> list[str]:
    return re.findall(r"\s*\S+\s*", text) or ([text] if text else [])


def _result_text(block: dict[str, Any]) -> str:
    content = block.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(b.get("text", "") for b in content if isinstance(b, dict))
    return ""


def _content(block: Block) -> dict[str, Any]:
    if block.kind == "text":
        return {"type": "text", "text": "".join(block.tokens)}
    if block.kind == "tool_use":
        return {
            "type": "tool_use",
            "id": block.tool_id,
            "name": block.name,
            "input": orjson.loads(block.arguments),
        }
    return {"type": "thinking", "thinking": "".join(block.tokens), "signature": "c2lnbmF0dXJl"}


async def serve_fake_anthropic(
    fake: FakeAnthropic | None = None,
    *,
    task_status: trio.TaskStatus[FakeAnthropic] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``fake`` (default: ``FakeAnthropic()``) until cancelled; ``nursery.start``
    returns it, bound (``fake.base_url``)."""
    await _serve(fake or FakeAnthropic(), task_status)
