"""Validation of request bodies (issue #10, hostile input): the parse functions of the three
routes, table-driven with no event loop, then a few requests over real HTTP.

Every bad body is a 400 whose ``param`` is the path of the field at fault and whose message
names it; every good body comes back as the client's own dict, unknown fields and all; JSON
nested past the depth limit is a 400, never a 500; and no JSON value makes the parsers raise
anything but :class:`BadRequest`.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import Any

import httpx
import orjson
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from dispatcher.api import validation
from dispatcher.api.openai import _request as openai_request
from dispatcher.api.openai._request import parse_chat_request, parse_tunnel_body
from dispatcher.config import EdgeConfig, HTTPSettings
from dispatcher.edge import open_dispatcher
from dispatcher.errors import BadRequest, PayloadTooLarge, error_status_and_body

Parse = Callable[[bytes], object]

CHAT: Parse = parse_chat_request
COMPLETIONS: Parse = partial(parse_tunnel_body, route="/v1/completions")
EMBEDDINGS: Parse = partial(parse_tunnel_body, route="/v1/embeddings")
TUNNEL: Parse = parse_tunnel_body  # the route told by the body

USER = {"role": "user", "content": "hello"}


def chat(*messages: object, **fields: object) -> dict[str, object]:
    return {"model": "m", "messages": list(messages) or [USER], **fields}


def part(kind: str, **fields: object) -> dict[str, object]:
    return {"type": kind, **fields}


def user(*parts: object) -> dict[str, object]:
    return {"role": "user", "content": list(parts)}


def calls(*tool_calls: object) -> dict[str, object]:
    """A conversation whose assistant turn (``messages[1]``) made ``tool_calls``."""
    return chat(USER, {"role": "assistant", "content": None, "tool_calls": list(tool_calls)})


CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


def tool(**function: object) -> dict[str, object]:
    return chat(tools=[{"type": "function", "function": {"name": "f", **function}}])


def completion(**fields: object) -> dict[str, object]:
    return {"model": "m", "prompt": "once upon", **fields}


def embedding(**fields: object) -> dict[str, object]:
    return {"model": "m", "input": "some text", **fields}


def case(parse: Parse, body: object, param: str, code: str, label: str = "") -> Any:
    return pytest.param(parse, body, param, code, id=f"{param}:{code}{label}")


MISSING, TYPE, VALUE = "missing_required_parameter", "invalid_type", "invalid_value"

BAD_BODIES = [
    # --- chat: model and messages
    case(CHAT, {"messages": [USER]}, "model", MISSING),
    case(CHAT, chat(model=""), "model", VALUE),
    case(CHAT, chat(model=5), "model", TYPE),
    case(CHAT, chat(model=None), "model", TYPE),
    case(CHAT, {"model": "m"}, "messages", MISSING),
    case(CHAT, {"model": "m", "messages": []}, "messages", VALUE),
    case(CHAT, {"model": "m", "messages": "hi"}, "messages", TYPE),
    case(CHAT, chat("hi"), "messages[0]", TYPE),
    case(CHAT, chat({"content": "x"}), "messages[0].role", MISSING),
    case(CHAT, chat({"role": "robot", "content": "x"}), "messages[0].role", VALUE),
    case(CHAT, chat({"role": 3, "content": "x"}), "messages[0].role", TYPE),
    case(CHAT, chat(USER, {"role": "user"}), "messages[1].content", MISSING),
    case(CHAT, chat({"role": "user", "content": None}), "messages[0].content", TYPE, "-null"),
    case(CHAT, chat({"role": "user", "content": 7}), "messages[0].content", TYPE),
    case(CHAT, chat({"role": "user", "name": 5, "content": "x"}), "messages[0].name", TYPE),
    # --- chat: content parts
    case(CHAT, chat(user("x")), "messages[0].content[0]", TYPE),
    case(CHAT, chat(user({"text": "a"})), "messages[0].content[0].type", MISSING),
    case(CHAT, chat(user(part("video"))), "messages[0].content[0].type", VALUE),
    case(
        CHAT,
        chat(user(part("text", text="a"), part("text"))),
        "messages[0].content[1].text",
        MISSING,
    ),
    case(CHAT, chat(user(part("text", text=5))), "messages[0].content[0].text", TYPE),
    case(CHAT, chat(user(part("image_url"))), "messages[0].content[0].image_url", MISSING),
    case(
        CHAT, chat(user(part("image_url", image_url="u"))), "messages[0].content[0].image_url", TYPE
    ),
    case(
        CHAT,
        chat(user(part("image_url", image_url={"detail": "low"}))),
        "messages[0].content[0].image_url.url",
        MISSING,
    ),
    case(
        CHAT,
        chat(user(part("image_url", image_url={"url": "u", "detail": "ultra"}))),
        "messages[0].content[0].image_url.detail",
        VALUE,
    ),
    case(
        CHAT,
        chat(user(part("input_audio", input_audio={"data": "AAAA", "format": "ogg"}))),
        "messages[0].content[0].input_audio.format",
        VALUE,
    ),
    case(
        CHAT,
        chat(user(part("input_audio", input_audio={"format": "wav"}))),
        "messages[0].content[0].input_audio.data",
        MISSING,
    ),
    case(CHAT, chat(user(part("file", file="f"))), "messages[0].content[0].file", TYPE),
    case(
        CHAT,
        chat(user(part("file", file={"filename": 3}))),
        "messages[0].content[0].file.filename",
        TYPE,
    ),
    case(
        CHAT,
        chat({"role": "system", "content": [part("image_url", image_url={"url": "u"})]}),
        "messages[0].content[0].type",
        VALUE,
        "-image-in-system",
    ),
    case(
        CHAT,
        chat(user(part("refusal", refusal="no"))),
        "messages[0].content[0].type",
        VALUE,
        "-refusal-from-user",
    ),
    case(
        CHAT,
        chat(USER, {"role": "assistant", "content": [part("image_url", image_url={"url": "u"})]}),
        "messages[1].content[0].type",
        VALUE,
        "-image-from-assistant",
    ),
    case(
        CHAT,
        chat(USER, {"role": "assistant", "content": [part("refusal")]}),
        "messages[1].content[0].refusal",
        MISSING,
    ),
    # --- chat: tool calls and tool messages
    case(
        CHAT, chat(USER, {"role": "assistant", "tool_calls": "f"}), "messages[1].tool_calls", TYPE
    ),
    case(CHAT, calls({**CALL, "id": None}), "messages[1].tool_calls[0].id", TYPE),
    case(
        CHAT,
        calls({k: v for k, v in CALL.items() if k != "id"}),
        "messages[1].tool_calls[0].id",
        MISSING,
    ),
    case(CHAT, calls({**CALL, "type": "code"}), "messages[1].tool_calls[0].type", VALUE),
    case(
        CHAT,
        calls({**CALL, "function": {"name": "f", "arguments": {"a": 1}}}),
        "messages[1].tool_calls[0].function.arguments",
        TYPE,
    ),
    case(
        CHAT,
        calls(CALL, {**CALL, "function": {"arguments": "{}"}}),
        "messages[1].tool_calls[1].function.name",
        MISSING,
    ),
    case(CHAT, chat(USER, {"role": "assistant", "audio": {}}), "messages[1].audio.id", MISSING),
    case(
        CHAT,
        chat(USER, {"role": "assistant", "function_call": {"name": "f"}}),
        "messages[1].function_call.arguments",
        MISSING,
    ),
    case(
        CHAT,
        chat(USER, USER, {"role": "tool", "content": "42"}),
        "messages[2].tool_call_id",
        MISSING,
    ),
    case(
        CHAT,
        chat({"role": "tool", "content": "42", "tool_call_id": 5}),
        "messages[0].tool_call_id",
        TYPE,
    ),
    case(CHAT, chat({"role": "function", "content": None}), "messages[0].name", MISSING),
    # --- chat: sampling and output options
    case(CHAT, chat(stream="yes"), "stream", TYPE),
    case(CHAT, chat(stream=True, stream_options="x"), "stream_options", TYPE),
    case(
        CHAT,
        chat(stream=True, stream_options={"include_usage": "yes"}),
        "stream_options.include_usage",
        TYPE,
    ),
    case(
        CHAT,
        chat(stream_options={"include_usage": True}),
        "stream_options",
        VALUE,
        "-without-stream",
    ),
    case(CHAT, chat(max_tokens=0), "max_tokens", VALUE),
    case(CHAT, chat(max_tokens=True), "max_tokens", TYPE),
    case(CHAT, chat(max_tokens=1.5), "max_tokens", TYPE, "-fraction"),
    case(CHAT, chat(max_completion_tokens=-1), "max_completion_tokens", VALUE),
    case(CHAT, chat(temperature=2.5), "temperature", VALUE),
    case(CHAT, chat(temperature=-0.1), "temperature", VALUE, "-negative"),
    case(CHAT, chat(temperature="hot"), "temperature", TYPE),
    case(CHAT, chat(temperature=True), "temperature", TYPE, "-bool"),
    case(CHAT, chat(top_p=1.1), "top_p", VALUE),
    case(CHAT, chat(n=True), "n", TYPE),
    case(CHAT, chat(n=1.0), "n", TYPE, "-float"),
    case(CHAT, chat(n=3), "n", "unsupported_value"),
    case(CHAT, chat(presence_penalty=-3), "presence_penalty", VALUE),
    case(CHAT, chat(frequency_penalty="0"), "frequency_penalty", TYPE),
    case(CHAT, chat(stop=5), "stop", TYPE),
    case(CHAT, chat(stop=["a", "b", "c", "d", "e"]), "stop", VALUE),
    case(CHAT, chat(stop=[1]), "stop[0]", TYPE),
    case(CHAT, chat(seed=1.5), "seed", TYPE),
    case(CHAT, orjson.dumps(chat())[:-1] + b',"seed":' + b"9" * 30 + b"}", "seed", TYPE, "-huge"),
    case(CHAT, chat(logprobs=1), "logprobs", TYPE),
    case(CHAT, chat(logprobs=True, top_logprobs=21), "top_logprobs", VALUE),
    case(CHAT, chat(top_logprobs=2), "top_logprobs", VALUE, "-without-logprobs"),
    case(CHAT, chat(logit_bias=[]), "logit_bias", TYPE),
    case(CHAT, chat(logit_bias={"50256": 101}), "logit_bias.50256", VALUE),
    case(CHAT, chat(logit_bias={"abc": 1}), "logit_bias.abc", VALUE, "-key"),
    case(CHAT, chat(logit_bias={"1": "x"}), "logit_bias.1", TYPE),
    case(CHAT, chat(user=5), "user", TYPE),
    case(CHAT, chat(store="no"), "store", TYPE),
    case(CHAT, chat(parallel_tool_calls="true"), "parallel_tool_calls", TYPE),
    case(CHAT, chat(reasoning_effort="extreme"), "reasoning_effort", VALUE),
    case(CHAT, chat(verbosity="loud"), "verbosity", VALUE),
    case(CHAT, chat(service_tier="gold"), "service_tier", VALUE),
    case(CHAT, chat(modalities=["video"]), "modalities[0]", VALUE),
    case(CHAT, chat(audio={"format": "wav"}), "audio.voice", MISSING),
    case(CHAT, chat(prediction={"type": "content", "content": 5}), "prediction.content", TYPE),
    case(
        CHAT,
        chat(web_search_options={"search_context_size": "huge"}),
        "web_search_options.search_context_size",
        VALUE,
    ),
    case(CHAT, chat(metadata={"k": 1}), "metadata.k", TYPE),
    case(CHAT, chat(metadata={f"k{i}": "v" for i in range(17)}), "metadata", VALUE),
    case(CHAT, chat(metadata={"k" * 65: "v"}), "metadata." + "k" * 65, VALUE, "-long-key"),
    case(CHAT, chat(metadata={"k": "v" * 513}), "metadata.k", VALUE, "-long-value"),
    # --- chat: tools, tool_choice, response_format, functions
    case(CHAT, chat(tools={}), "tools", TYPE),
    case(CHAT, chat(tools=["f"]), "tools[0]", TYPE),
    case(CHAT, chat(tools=[{"function": {"name": "f"}}]), "tools[0].type", MISSING),
    case(CHAT, chat(tools=[{"type": "retrieval"}]), "tools[0].type", VALUE),
    case(CHAT, chat(tools=[{"type": "function"}]), "tools[0].function", MISSING),
    case(
        CHAT, chat(tools=[{"type": "function", "function": {}}]), "tools[0].function.name", MISSING
    ),
    case(CHAT, tool(name="get weather"), "tools[0].function.name", VALUE),
    case(CHAT, tool(name="f" * 65), "tools[0].function.name", VALUE, "-too-long"),
    case(CHAT, tool(description=5), "tools[0].function.description", TYPE),
    case(CHAT, tool(parameters="x"), "tools[0].function.parameters", TYPE),
    case(CHAT, tool(parameters=[]), "tools[0].function.parameters", TYPE, "-array"),
    case(CHAT, tool(strict="yes"), "tools[0].function.strict", TYPE),
    case(CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}] * 129), "tools", VALUE),
    case(CHAT, chat(tools=[{"type": "custom", "custom": {}}]), "tools[0].custom.name", MISSING),
    case(
        CHAT,
        chat(tools=[{"type": "custom", "custom": {"name": "c", "format": {"type": "xml"}}}]),
        "tools[0].custom.format.type",
        VALUE,
    ),
    case(CHAT, chat(tool_choice="always"), "tool_choice", VALUE),
    case(CHAT, chat(tool_choice=1), "tool_choice", TYPE),
    case(CHAT, chat(tool_choice={"type": "function"}), "tool_choice.function", MISSING),
    case(
        CHAT,
        chat(tool_choice={"type": "function", "function": {}}),
        "tool_choice.function.name",
        MISSING,
    ),
    case(
        CHAT,
        chat(tool_choice={"type": "allowed_tools", "allowed_tools": {"mode": "any", "tools": []}}),
        "tool_choice.allowed_tools.mode",
        VALUE,
    ),
    case(CHAT, chat(response_format="json"), "response_format", TYPE),
    case(CHAT, chat(response_format={"type": "yaml"}), "response_format.type", VALUE),
    case(
        CHAT, chat(response_format={"type": "json_schema"}), "response_format.json_schema", MISSING
    ),
    case(
        CHAT,
        chat(response_format={"type": "json_schema", "json_schema": {"name": "my schema"}}),
        "response_format.json_schema.name",
        VALUE,
    ),
    case(
        CHAT,
        chat(response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": []}}),
        "response_format.json_schema.schema",
        TYPE,
    ),
    case(
        CHAT,
        chat(response_format={"type": "json_schema", "json_schema": {"name": "s", "strict": 1}}),
        "response_format.json_schema.strict",
        TYPE,
    ),
    case(CHAT, chat(functions=[{"name": "bad name"}]), "functions[0].name", VALUE),
    case(CHAT, chat(function_call="sometimes"), "function_call", VALUE),
    # --- completions
    case(COMPLETIONS, {"prompt": "x"}, "model", MISSING),
    case(COMPLETIONS, {"model": "m"}, "prompt", MISSING),
    case(COMPLETIONS, completion(prompt=5), "prompt", TYPE),
    case(COMPLETIONS, completion(prompt=[]), "prompt", VALUE),
    case(COMPLETIONS, completion(prompt=[{}]), "prompt[0]", TYPE),
    case(COMPLETIONS, completion(prompt=[1, "a"]), "prompt[1]", TYPE),
    case(COMPLETIONS, completion(prompt=["a", 1]), "prompt[1]", TYPE, "-mixed-strings"),
    case(COMPLETIONS, completion(prompt=[-1]), "prompt[0]", VALUE),
    case(COMPLETIONS, completion(prompt=[[1], []]), "prompt[1]", VALUE),
    case(COMPLETIONS, completion(prompt=[["a"]]), "prompt[0][0]", TYPE),
    case(COMPLETIONS, completion(max_tokens=-1), "max_tokens", VALUE),
    case(COMPLETIONS, completion(logprobs=6), "logprobs", VALUE),
    case(COMPLETIONS, completion(logprobs=True), "logprobs", TYPE),
    case(COMPLETIONS, completion(echo="yes"), "echo", TYPE),
    case(COMPLETIONS, completion(suffix=5), "suffix", TYPE),
    case(COMPLETIONS, completion(best_of=21), "best_of", VALUE),
    case(COMPLETIONS, completion(best_of=1, n=2), "best_of", VALUE, "-below-n"),
    case(COMPLETIONS, completion(n=0), "n", VALUE),
    case(COMPLETIONS, completion(n=True), "n", TYPE),
    case(COMPLETIONS, completion(temperature=3), "temperature", VALUE),
    case(COMPLETIONS, completion(top_p=-1), "top_p", VALUE),
    case(COMPLETIONS, completion(presence_penalty=2.5), "presence_penalty", VALUE),
    case(COMPLETIONS, completion(frequency_penalty=[]), "frequency_penalty", TYPE),
    case(COMPLETIONS, completion(stop=["a"] * 5), "stop", VALUE),
    case(COMPLETIONS, completion(seed="1"), "seed", TYPE),
    case(COMPLETIONS, completion(user=1), "user", TYPE),
    case(COMPLETIONS, completion(logit_bias={"1": 200}), "logit_bias.1", VALUE),
    case(COMPLETIONS, completion(stream="no"), "stream", TYPE),
    case(COMPLETIONS, completion(stream_options={"include_usage": True}), "stream_options", VALUE),
    # --- embeddings
    case(EMBEDDINGS, {"model": "m"}, "input", MISSING),
    case(EMBEDDINGS, embedding(model=""), "model", VALUE),
    case(EMBEDDINGS, embedding(input=""), "input", VALUE),
    case(EMBEDDINGS, embedding(input=[]), "input", VALUE, "-empty-array"),
    case(EMBEDDINGS, embedding(input=["a", ""]), "input[1]", VALUE),
    case(EMBEDDINGS, embedding(input=["a"] * 2049), "input", VALUE, "-too-many"),
    case(EMBEDDINGS, embedding(input=[1.5]), "input[0]", TYPE),
    case(EMBEDDINGS, embedding(input=[[1, "x"]]), "input[0][1]", TYPE),
    case(EMBEDDINGS, embedding(input=[[]]), "input[0]", VALUE, "-empty-tokens"),
    case(EMBEDDINGS, embedding(input={"text": "a"}), "input", TYPE),
    case(EMBEDDINGS, embedding(encoding_format="int8"), "encoding_format", VALUE),
    case(EMBEDDINGS, embedding(dimensions=0), "dimensions", VALUE),
    case(EMBEDDINGS, embedding(dimensions="3"), "dimensions", TYPE),
    case(EMBEDDINGS, embedding(user=1), "user", TYPE),
    case(EMBEDDINGS, embedding(stream="no"), "stream", TYPE),
    # --- a tunnel body that does not say what it is
    case(TUNNEL, {"model": "m"}, "prompt", MISSING, "-neither-prompt-nor-input"),
    case(TUNNEL, {"input": "x"}, "model", MISSING, "-embedding"),
    case(TUNNEL, {"model": "m", "input": 5}, "input", TYPE, "-embedding"),
    case(TUNNEL, {"model": "m", "prompt": 5}, "prompt", TYPE, "-completion"),
]


@pytest.mark.parametrize(("parse", "body", "param", "code"), BAD_BODIES)
def test_a_bad_field_is_a_400_naming_it(parse: Parse, body: object, param: str, code: str) -> None:
    with pytest.raises(BadRequest) as info:
        parse(body if isinstance(body, bytes) else orjson.dumps(body))
    error = info.value
    assert (error.status, error.param, error.code) == (400, param, code)
    assert error.message.startswith(f"'{param}': ")
    status, raw, _ = error_status_and_body(error)
    assert status == 400
    assert orjson.loads(raw) == {
        "error": {
            "message": error.message,
            "type": "invalid_request_error",
            "param": param,
            "code": code,
        }
    }


def test_the_table_is_wide() -> None:
    assert len(BAD_BODIES) >= 60
    assert {p.values[0] for p in BAD_BODIES} == {CHAT, COMPLETIONS, EMBEDDINGS, TUNNEL}


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (chat(n=3), "'n': only n=1 is supported"),
        (chat(temperature=2.5), "'temperature': must be a number from 0 to 2, got 2.5"),
        (chat(n=True), "'n': must be an integer, got a boolean"),
        (chat(max_tokens=0), "'max_tokens': must be a positive integer, got 0"),
        (chat(stream="yes"), "'stream': must be a boolean, got a string"),
        ({"messages": [USER]}, "'model': a non-empty string is required"),
        ({"model": "m", "messages": []}, "'messages': must be a non-empty array of messages"),
        ({"model": "m"}, "'messages': a non-empty array of messages is required"),
        (
            chat({"role": "robot", "content": "x"}),
            "'messages[0].role': must be one of 'system', 'developer', 'user', 'assistant', "
            "'tool', 'function', got \"robot\"",
        ),
        (
            chat({"role": "system", "content": [part("image_url", image_url={"url": "u"})]}),
            "'messages[0].content[0].type': must be 'text' in a system message, got \"image_url\"",
        ),
        (
            tool(name="get weather"),
            "'tools[0].function.name': must be a name of 1 to 64 letters, digits, underscores or "
            'dashes, got "get weather"',
        ),
        (chat(stop=[1]), "'stop[0]': must be a string, got an integer"),
        (chat(top_logprobs=2), "'top_logprobs': needs 'logprobs' to be true"),
        (chat(model="m" * 100, temperature="x" * 100), "'temperature': must be a number"),
    ],
)
def test_messages_say_what_is_wanted_and_what_came(body: object, needle: str) -> None:
    with pytest.raises(BadRequest) as info:
        parse_chat_request(orjson.dumps(body))
    assert needle in info.value.message
    assert len(info.value.message) < 200


def test_a_shown_value_is_cut_short() -> None:
    with pytest.raises(BadRequest) as info:
        parse_chat_request(orjson.dumps(chat(reasoning_effort="x" * 10_000)))
    assert len(info.value.message) < 200
    assert info.value.message.endswith('got "' + "x" * 36 + "...")


# --------------------------------------------------------------------------- good bodies

GOOD_CHAT = [
    chat(),
    # Every documented field, with unknown ones at every level a provider might read them.
    {
        "model": "llama3",
        "messages": [
            {"role": "system", "content": "be brief", "name": "sys", "cache_control": {"x": 1}},
            {"role": "developer", "content": [part("text", text="rules")]},
            user(
                part("text", text="look", prompt_cache_breakpoint={"mode": "explicit"}),
                part("image_url", image_url={"url": "data:image/png;base64,AAAA", "detail": "low"}),
                part("input_audio", input_audio={"data": "UklGR", "format": "wav"}),
                part("file", file={"file_id": "file-1", "filename": "a.pdf"}),
            ),
            {
                "role": "assistant",
                "content": None,
                "refusal": None,
                "tool_calls": [
                    CALL,
                    {"id": "c2", "type": "custom", "custom": {"name": "g", "input": "x"}},
                ],
                "reasoning_content": "an extension",
            },
            {"role": "tool", "content": "42", "tool_call_id": "call_1"},
            {
                "role": "assistant",
                "content": [part("text", text="a"), part("refusal", refusal="no")],
            },
            {"role": "assistant", "function_call": {"name": "f", "arguments": "{}"}},
            {"role": "function", "name": "f", "content": None},
            {"role": "user", "content": "", "name": "bob"},
        ],
        "stream": True,
        "stream_options": {"include_usage": True, "include_obfuscation": False},
        "max_tokens": 100,
        "max_completion_tokens": 1,
        "temperature": 0,
        "top_p": 1,
        "n": 1,
        "presence_penalty": -2,
        "frequency_penalty": 2.0,
        "stop": ["\n", "END", "", "x"],
        "seed": -(2**63),
        "logprobs": True,
        "top_logprobs": 20,
        "logit_bias": {"50256": -100, "1": 0.5},
        "user": "u-1",
        "safety_identifier": "s",
        "prompt_cache_key": "k",
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "get_weather-2",
                    "description": "the weather",
                    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
                    "strict": True,
                },
            },
            {"type": "function", "function": {"name": "f" * 64}},
            {
                "type": "custom",
                "custom": {
                    "name": "grammar",
                    "format": {"type": "grammar", "grammar": {"definition": "x", "syntax": "lark"}},
                },
            },
        ],
        "tool_choice": {"type": "function", "function": {"name": "get_weather-2"}},
        "parallel_tool_calls": False,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "answer", "schema": {"type": "object"}, "strict": True},
        },
        "metadata": {"team": "a", "k" * 64: "v" * 512},
        "store": False,
        "reasoning_effort": "low",
        "verbosity": "high",
        "service_tier": "auto",
        "modalities": ["text", "audio"],
        "audio": {"format": "mp3", "voice": {"id": "voice_1"}},
        "prediction": {"type": "content", "content": "guess"},
        "web_search_options": {"user_location": {"type": "approximate", "approximate": {}}},
        # Not OpenAI's: passed through as they are.
        "top_k": 40,
        "min_p": 0.1,
        "echo": {"token_delay": 0.02},
        "chat_template_kwargs": {"enable_thinking": False},
    },
    chat(tool_choice="required", response_format={"type": "json_object"}, stop="\n"),
    chat(
        tool_choice={"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [{}]}},
        function_call={"name": "f"},
        functions=[{"name": "f", "parameters": {}}],
    ),
    # null is an absent field
    chat(temperature=None, n=None, stream=None, stream_options=None, tools=None, stop=None),
    chat(logprobs=True, top_logprobs=0, metadata={}, logit_bias={}, tools=[]),
]

GOOD_TUNNEL = [
    (COMPLETIONS, completion()),
    (COMPLETIONS, completion(prompt="", max_tokens=0, echo=True, logprobs=5, suffix="")),
    (COMPLETIONS, completion(prompt=["a", ""], n=2, best_of=2, stop="x", seed=1, top_k=5)),
    (
        COMPLETIONS,
        completion(prompt=[1, 2, 3], stream=True, stream_options={"include_usage": True}),
    ),
    (COMPLETIONS, completion(prompt=[[1], [2, 3]], logit_bias={"7": 1}, user="u")),
    (EMBEDDINGS, embedding()),
    (EMBEDDINGS, embedding(input=["a", "b"] * 1024, encoding_format="base64", dimensions=3)),
    (EMBEDDINGS, embedding(input=[1, 2], user="u", truncate_prompt_tokens=5)),
    (EMBEDDINGS, embedding(input=[[1], [0]], stream=True, extra={"a": [1]})),
    (TUNNEL, completion(stream=False)),
    (TUNNEL, embedding(encoding_format="float")),
]


@pytest.mark.parametrize("body", GOOD_CHAT)
def test_a_good_chat_body_is_kept_as_sent(body: dict[str, Any]) -> None:
    raw = orjson.dumps(body)
    parsed = parse_chat_request(raw)
    assert parsed.body == body
    assert orjson.dumps(parsed.body) == raw  # same keys, same order, same values
    assert parsed.model == body["model"]
    assert parsed.stream is (body.get("stream") is True)
    options = body.get("stream_options") or {}
    assert parsed.include_usage is (options.get("include_usage") is True)


@pytest.mark.parametrize(("parse", "body"), GOOD_TUNNEL)
def test_a_good_tunnel_body_is_kept_as_sent(parse: Parse, body: dict[str, Any]) -> None:
    raw = orjson.dumps(body)
    parsed = parse(raw)
    assert parsed == body
    assert orjson.dumps(parsed) == raw


def test_a_chat_body_is_a_completion_body_neither() -> None:
    """The tunnel routes have schemas of their own: a chat body is not a completion."""
    with pytest.raises(BadRequest) as info:
        COMPLETIONS(orjson.dumps(chat()))
    assert info.value.param == "prompt"


# --------------------------------------------------------------------------- JSON itself


@pytest.mark.parametrize("parse", [CHAT, COMPLETIONS, EMBEDDINGS, TUNNEL])
@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        (b"", "not valid JSON"),
        (b"{not json", "not valid JSON"),
        (b'{"model": "m",}', "not valid JSON"),
        (b"[1, 2]", "must be a JSON object"),
        (b'"a string"', "must be a JSON object"),
        (b"null", "must be a JSON object"),
        (b'{"model": 1e400}', "not valid JSON"),
        (b'{"model": "\xff"}', "not valid JSON"),
        (b"[" * 300 + b"]" * 300, "must be a JSON object"),
    ],
)
def test_not_a_json_object(parse: Parse, raw: bytes, needle: str) -> None:
    with pytest.raises(BadRequest) as info:
        parse(raw)
    assert (info.value.code, info.value.param) == ("invalid_json", None)
    assert needle in info.value.message


def nested(depth: int) -> bytes:
    """``depth`` levels of arrays."""
    return b"[" * depth + b"]" * depth


def _into(body: dict[str, Any], depth: int) -> bytes:
    """``body`` with a ``"deep"`` field of ``depth`` levels, so the whole is ``depth + 1``."""
    return orjson.dumps({**body, "deep": None})[:-5] + nested(depth) + b"}"


DEEP = [
    (CHAT, chat()),
    (COMPLETIONS, completion()),
    (EMBEDDINGS, embedding()),
    (TUNNEL, embedding()),
]


@pytest.mark.parametrize("levels", [300, 2000])
@pytest.mark.parametrize(("parse", "body"), DEEP)
def test_deep_json_is_a_400(parse: Parse, body: dict[str, Any], levels: int) -> None:
    with pytest.raises(BadRequest) as info:
        parse(_into(body, levels))
    assert info.value.code == "invalid_json"
    assert f"limit of {validation.MAX_JSON_DEPTH} levels" in info.value.message


def test_only_the_start_of_a_bad_text_is_scanned_for_depth() -> None:
    """Past orjson's own limit (1024 levels) the body is not JSON to orjson at all: the edge
    looks for the nesting in its first 4 KiB only, so that no bad body costs more than a
    millisecond or so to answer; past that the error is orjson's. A 400 either way."""
    late = b'{"pad": "' + b"x" * 5000 + b'", "a": ' + nested(2000) + b"}"
    with pytest.raises(BadRequest) as info:
        parse_chat_request(late)
    assert info.value.code == "invalid_json"
    assert "not valid JSON" in info.value.message


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        (
            b'{"model":"m","messages":[{"role":"user","content":"x","x":' + nested(300) + b"}]}",
            "messages[0].x",
        ),
        (
            b'{"model":"m","messages":[{"role":"user","content":"x"}],"tools":[{"type":"function",'
            b'"function":{"name":"f","parameters":{"p":' + nested(300) + b"}}}]}",
            "tools[0].function.parameters",
        ),
        (
            b'{"model":"m","messages":[{"role":"user","content":"x"}],"response_format":{"type":'
            b'"json_schema","json_schema":{"name":"s","schema":{"s":' + nested(300) + b"}}}}",
            "response_format.json_schema.schema",
        ),
    ],
)
def test_deep_json_is_found_where_the_schema_is_free_form(raw: bytes, param: str) -> None:
    with pytest.raises(BadRequest) as info:
        parse_chat_request(raw)
    assert (info.value.code, info.value.param) == ("invalid_json", param)


def test_the_depth_limit_is_exact() -> None:
    limit = validation.MAX_JSON_DEPTH
    parse_chat_request(_into(chat(), limit - 1))  # the body is level 1
    with pytest.raises(BadRequest):
        parse_chat_request(_into(chat(), limit))
    free_form: dict[str, object] = {"type": "object"}
    for _ in range(limit - 5):  # parameters is level 5: the body, tools, [0], function above
        free_form = {"nested": free_form}
    parse_chat_request(orjson.dumps(tool(parameters=free_form)))
    with pytest.raises(BadRequest):
        parse_chat_request(orjson.dumps(tool(parameters={"one more": free_form})))


def test_the_size_limit() -> None:
    raw = orjson.dumps(chat({"role": "user", "content": "x" * 1000}))
    assert parse_chat_request(raw, max_size=len(raw)).model == "m"
    with pytest.raises(PayloadTooLarge, match=f"size limit of {len(raw) - 1} bytes"):
        parse_chat_request(raw, max_size=len(raw) - 1)
    with pytest.raises(PayloadTooLarge):
        parse_tunnel_body(raw, max_size=10)


# --------------------------------------------------------------------------- any input at all

JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=20,
)
ROLES = st.sampled_from(["system", "developer", "user", "assistant", "tool", "function"])
PARTS = st.sampled_from(["text", "image_url", "input_audio", "file", "refusal"])
CHAT_FIELDS = sorted(
    f for f in openai_request.CHAT_COMPLETIONS.fields if f not in ("model", "messages")
)
TUNNEL_FIELDS = sorted(
    {*openai_request.COMPLETIONS.fields, *openai_request.EMBEDDINGS.fields} - {"model"}
)

# Bodies near the schema, so the search reaches deep into it: known keys, arbitrary values.
MESSAGES = st.lists(
    st.fixed_dictionaries(
        {"role": ROLES | JSON},
        optional={
            "content": JSON
            | st.lists(
                st.fixed_dictionaries(
                    {"type": PARTS},
                    optional={
                        k: JSON for k in ("text", "image_url", "input_audio", "file", "refusal")
                    },
                )
            ),
            "tool_call_id": JSON,
            "name": JSON,
            "tool_calls": JSON,
        },
    ),
    max_size=3,
)
CHAT_BODIES = st.fixed_dictionaries(
    {"model": st.just("m") | JSON, "messages": MESSAGES | JSON},
    optional={name: JSON for name in CHAT_FIELDS},
)
TUNNEL_BODIES = st.fixed_dictionaries(
    {"model": st.just("m") | JSON},
    optional={name: JSON for name in TUNNEL_FIELDS},
)


def _only_bad_requests(parse: Parse, value: object) -> None:
    kept = copy.deepcopy(value)
    raw = orjson.dumps(value)
    try:
        parsed = parse(raw)
    except BadRequest as exc:
        assert exc.status == 400
        assert exc.param is None or exc.message.startswith(f"'{exc.param}': ")
        error_status_and_body(exc)
    else:
        body = getattr(parsed, "body", parsed)
        assert body == kept
        orjson.dumps(body)  # what the edge forwards can be serialized
    assert value == kept  # nothing was rewritten


@given(value=JSON | CHAT_BODIES)
def test_any_json_to_the_chat_parser_is_at_worst_a_bad_request(value: object) -> None:
    _only_bad_requests(parse_chat_request, value)


@given(
    value=JSON | TUNNEL_BODIES, route=st.sampled_from([None, "/v1/completions", "/v1/embeddings"])
)
def test_any_json_to_the_tunnel_parser_is_at_worst_a_bad_request(
    value: object, route: str | None
) -> None:
    _only_bad_requests(partial(parse_tunnel_body, route=route), value)


@given(raw=st.binary(max_size=64))
def test_any_bytes_are_at_worst_a_bad_request(raw: bytes) -> None:
    for parse in (CHAT, TUNNEL):
        try:
            parse(raw)
        except BadRequest:
            pass


# --------------------------------------------------------------------------- over HTTP


@pytest.fixture
async def edge_url(nursery: trio.Nursery) -> AsyncIterator[str]:
    config = EdgeConfig(port=0, http=HTTPSettings(max_body_size=1024 * 1024, shutdown_grace=5))
    async with open_dispatcher(config) as dispatcher:
        await dispatcher.attach_local_node()
        server = await nursery.start(dispatcher.serve)
        yield f"http://127.0.0.1:{server.address.port}"
        server.shutdown()


@pytest.mark.parametrize(
    ("path", "body", "param", "code"),
    [
        ("/v1/chat/completions", {**chat(), "model": "echo", "n": True}, "n", TYPE),
        (
            "/v1/chat/completions",
            {**tool(name="a b"), "model": "echo"},
            "tools[0].function.name",
            VALUE,
        ),
        ("/v1/completions", {"model": "echo", "prompt": [1, "a"]}, "prompt[1]", TYPE),
        ("/v1/embeddings", {"model": "echo", "input": ""}, "input", VALUE),
    ],
)
async def test_the_openai_error_body_over_http(
    edge_url: str, path: str, body: object, param: str, code: str
) -> None:
    async with httpx.AsyncClient(base_url=edge_url) as client:
        response = await client.post(path, json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, code)
    assert error["message"].startswith(f"'{param}': ")


@pytest.mark.parametrize("levels", [300, 2000])
async def test_deep_json_over_http_is_a_400_and_logs_no_error(
    edge_url: str, levels: int, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    body = _into({**chat(), "model": "echo"}, levels)
    async with httpx.AsyncClient(base_url=edge_url) as client:
        response = await client.post(
            "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
        )
        after = await client.post("/v1/chat/completions", json={**chat(), "model": "echo"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "invalid_json"
    assert f"limit of {validation.MAX_JSON_DEPTH} levels" in error["message"]
    assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []
    assert after.status_code == 200  # the edge keeps serving


async def test_unknown_fields_reach_the_node_over_http(edge_url: str) -> None:
    body = {
        **chat({"role": "user", "content": "hi there"}),
        "model": "echo",
        "top_k": 3,
        "echo": {"token_delay": 0},
    }
    async with httpx.AsyncClient(base_url=edge_url) as client:
        response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200
    assert response.json()["choices"][0]["message"]["content"] == "hi there"
