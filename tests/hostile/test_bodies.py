"""Request bodies: what is not JSON, not an object, nested too deep or over the limit, and
fields of the wrong type or out of range. Each is a 400 (413 for size) with the OpenAI error
body, ``param`` naming the field at fault, and no slot taken."""

from __future__ import annotations

from typing import Any

import attrs
import orjson

from ._support import MAX_BODY, MODEL, Edge, assert_error, chat, params

CHAT = "/v1/chat/completions"
USER = {"role": "user", "content": "hi"}


def deep(levels: int) -> bytes:
    """A valid chat body with ``levels`` of arrays nested in a field nobody knows."""
    nested = b"[" * levels + b"]" * levels
    return (
        b'{"model": "echo", "messages": [{"role": "user", "content": "hi"}], "x": ' + nested + b"}"
    )


@attrs.frozen
class Body:
    body: Any
    status: int = 400
    param: str | None = None
    code: str | None = None
    path: str = CHAT
    message: str | None = None


JSON: dict[str, Body] = {
    "not-json": Body(b"{not json", code="invalid_json"),
    "empty": Body(b"", code="invalid_json"),
    "only-whitespace": Body(b" \r\n\t ", code="invalid_json"),
    "truncated": Body(b'{"model": "echo", "messages": [', code="invalid_json"),
    "an-array": Body(b"[1, 2]", code="invalid_json", message="JSON object"),
    "a-string": Body(b'"hello"', code="invalid_json", message="JSON object"),
    "a-number": Body(b"42", code="invalid_json", message="JSON object"),
    "null": Body(b"null", code="invalid_json", message="JSON object"),
    "nan": Body(b'{"model": NaN}', code="invalid_json"),
    "invalid-utf-8": Body(
        b'{"model": "echo", "messages": [{"role": "user", "content": "\xff\xfe"}]}',
        code="invalid_json",
    ),
    "lone-surrogate": Body(
        b'{"model": "echo", "messages": [{"role": "user", "content": "\\ud800"}]}',
        code="invalid_json",
    ),
    "trailing-garbage": Body(b'{"model": "echo"} trailing', code="invalid_json"),
    "nested-300-levels": Body(deep(300), code="invalid_json", message="nested deeper"),
    "nested-2000-levels": Body(deep(2000), code="invalid_json", message="nested deeper"),
    "top-level-array-2000-levels": Body(b"[" * 2000 + b"]" * 2000, code="invalid_json"),
    "over-the-size-limit": Body(chat("x" * MAX_BODY), status=413, code="payload_too_large"),
}

FIELDS: dict[str, Body] = {
    "n-true": Body(chat(n=True), param="n"),
    "n-3": Body(chat(n=3), param="n"),
    "n-string": Body(chat(n="1"), param="n"),
    "tools-garbage": Body(chat(tools="garbage"), param="tools"),
    "tools-entry-without-function": Body(
        chat(tools=[{"type": "function"}]), param="tools[0].function"
    ),
    "tools-entry-a-number": Body(chat(tools=[7]), param="tools[0]"),
    "tool-choice-a-number": Body(chat(tool_choice=5), param="tool_choice"),
    "negative-max-tokens": Body(chat(max_tokens=-1), param="max_tokens"),
    "fractional-max-tokens": Body(chat(max_tokens=1.5), param="max_tokens"),
    "huge-max-tokens": Body(
        orjson.dumps(chat(max_tokens=0)).replace(b":0", b":1" + b"0" * 30), param="max_tokens"
    ),
    "max-tokens-true": Body(chat(max_tokens=True), param="max_tokens"),
    "bad-role": Body(chat(messages=[{"role": "wizard", "content": "x"}]), param="messages[0].role"),
    "role-missing": Body(chat(messages=[{"content": "x"}]), param="messages[0].role"),
    "no-messages": Body(chat(messages=[]), param="messages"),
    "messages-a-string": Body(chat(messages="hi"), param="messages"),
    "message-a-string": Body(chat(messages=["hi"]), param="messages[0]"),
    "content-a-number": Body(
        chat(messages=[{"role": "user", "content": 7}]), param="messages[0].content"
    ),
    "second-message-bad": Body(
        chat(messages=[USER, {"role": "user", "content": {"x": 1}}]), param="messages[1].content"
    ),
    "no-model": Body({"messages": [USER]}, param="model"),
    "model-a-number": Body(chat(model=5), param="model"),
    "model-empty": Body(chat(model=""), param="model"),
    "stream-a-string": Body(chat(stream="yes"), param="stream"),
    "stream-options-bad": Body(
        chat(stream=True, stream_options={"include_usage": "yes"}),
        param="stream_options.include_usage",
    ),
    "temperature-a-string": Body(chat(temperature="hot"), param="temperature"),
    "temperature-out-of-range": Body(chat(temperature=5), param="temperature"),
    "top-p-out-of-range": Body(chat(top_p=2), param="top_p"),
    "stop-a-number": Body(chat(stop=5), param="stop"),
    "response-format-unknown": Body(
        chat(response_format={"type": "nope"}), param="response_format.type"
    ),
    "unknown-model": Body(chat(model="no-such-model"), status=404, code="model_not_found"),
    "completions-without-prompt": Body({"model": MODEL}, param="prompt", path="/v1/completions"),
    "embeddings-input-a-number": Body(
        {"model": MODEL, "input": 5}, param="input", path="/v1/embeddings"
    ),
}


def _raw(body: Any) -> bytes:
    return body if isinstance(body, bytes) else orjson.dumps(body)


@params({**JSON, **FIELDS})
async def test_bad_bodies(edge: Edge, case: Body) -> None:
    async with edge.case():
        response = await edge.post(case.path, _raw(case.body))
        error = assert_error(response, case.status, code=case.code, message=case.message)
        if case.param is not None:
            assert error["param"] == case.param, error
            assert case.param.split("[")[0].split(".")[0] in error["message"], error
        assert response.header("x-dispatcher-node") is None
    # No request was dispatched: not one usage row.
    assert (await edge.dispatcher.ledger.query(model=MODEL)).totals.requests == 2  # guard, serve
