"""The ``openai`` adapter against a fake OpenAI-compatible server, driven by the real runner."""

from __future__ import annotations

import logging
from typing import Any, cast

import httpx
import orjson
import pytest
import trio

from dispatcher import wire
from nodes.adapters import Adapter, build_adapters, validate_options
from nodes.adapters.base import AdapterError, RunOutput
from nodes.adapters.openai import (
    OpenAIAdapter,
    OpenAIOptions,
    StreamUsage,
    _take_events,
    completions_url,
)
from nodes.config import ModelConfig, NodeConfigError, OptionsError, ProviderConfig
from nodes.runner import open_runner
from tests.nodes._helpers import Recorder, assert_no_address, assert_well_formed
from tests.nodes.fake_providers import FakeOpenAI, refused_base_url, serve_fake_openai

MESSAGES = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "say hello"},
]


def req(run_id: str = "r1", **body: Any) -> wire.RunRequest:
    return wire.RunRequest(
        run_id=run_id,
        provider_id="oa",
        model="gpt",
        served_model="served-gpt",
        body={"model": "served-gpt", "messages": MESSAGES, **body},
    )


def adapter_for(base_url: str, *, api_key: str | None = None, **options: Any) -> OpenAIAdapter:
    provider = ProviderConfig(
        id="oa",
        type="openai",
        base_url=base_url,
        api_key_env="FAKE_KEY" if api_key is not None else None,
        options=options,
        models=(ModelConfig(name="gpt", served_name="served-gpt"),),
    )
    environ = {"FAKE_KEY": api_key} if api_key is not None else {}
    return OpenAIAdapter.from_provider(provider, environ=environ)


async def run(adapter: Adapter, request: wire.RunRequest | None = None) -> Recorder:
    request = request or req()
    rec = Recorder()
    with trio.fail_after(10):
        async with open_runner(rec.send, adapters={"oa": adapter}) as runner:
            runner.start(request)
            await rec.wait_terminal(request.run_id)
    assert_well_formed(rec.events(request.run_id))
    return rec


def usage_of(rec: Recorder, run_id: str = "r1") -> wire.Usage:
    usages = [e.usage for e in rec.events(run_id) if isinstance(e, wire.RunUsage)]
    assert len(usages) == 1
    usage: wire.Usage = usages[0]
    return usage


@pytest.fixture
async def fake(nursery: trio.Nursery) -> FakeOpenAI:
    started: FakeOpenAI = await nursery.start(serve_fake_openai)
    return started


async def test_streams_text_usage_and_finish(fake: FakeOpenAI) -> None:
    fake.api_key = "sk-test-123"
    rec = await run(adapter_for(fake.base_url, api_key="sk-test-123"), req(temperature=0.2))
    assert rec.text("r1") == fake.expected_text == "Hello from the fake provider!"
    assert usage_of(rec) == wire.Usage(prompt_tokens=7, completion_tokens=5)
    terminal = rec.terminal("r1")
    assert isinstance(terminal, wire.RunCompleted)
    assert terminal.finish_reason == "stop"

    (seen,) = fake.requests
    assert (seen.method, seen.path) == ("POST", "/v1/chat/completions")
    assert seen.authorization == "Bearer sk-test-123"
    assert seen.header("content-type") == "application/json"
    assert seen.json == {
        "model": "served-gpt",
        "messages": MESSAGES,
        "temperature": 0.2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


@pytest.mark.parametrize("suffix", ["", "/", "/v1", "/v1/"])
async def test_base_url_with_or_without_v1(fake: FakeOpenAI, suffix: str) -> None:
    rec = await run(adapter_for(fake.base_url + suffix))
    assert rec.text("r1") == fake.expected_text
    assert [r.path for r in fake.requests] == ["/v1/chat/completions"]


def test_completions_url() -> None:
    assert (
        completions_url("https://api.openai.com/v1") == "https://api.openai.com/v1/chat/completions"
    )
    assert completions_url("http://h:8000") == "http://h:8000/v1/chat/completions"
    assert completions_url("http://h/openai/v1/") == "http://h/openai/v1/chat/completions"


@pytest.mark.parametrize("reason", ["length", "content_filter", "stop"])
async def test_finish_reason_passes_through(fake: FakeOpenAI, reason: str) -> None:
    fake.finish_reason = reason
    fake.chunk_count = 40
    rec = await run(adapter_for(fake.base_url))
    assert rec.text("r1") == fake.expected_text
    assert rec.terminal("r1").finish_reason == reason
    assert usage_of(rec) == wire.Usage(prompt_tokens=7, completion_tokens=40)


async def test_without_include_usage_the_runner_estimates(fake: FakeOpenAI) -> None:
    rec = await run(
        adapter_for(fake.base_url, include_usage=False),
        req(stream_options={"include_usage": False}),
    )
    assert fake.requests[0].json["stream_options"] == {"include_usage": False}
    assert "authorization" not in dict(fake.requests[0].headers)
    # estimate: words vs characters / 4 of each message; the 5 words of the reply
    assert usage_of(rec) == wire.Usage(prompt_tokens=2 + 3, completion_tokens=8, estimated=True)


CONVERSATION_WITH_SYSTEMS: list[dict[str, Any]] = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "hi"},
    {"role": "system", "content": [{"type": "text", "text": "agents: claude"}]},
    {"role": "user", "content": "go"},
]


async def test_system_messages_are_kept_in_place_by_default(fake: FakeOpenAI) -> None:
    await run(adapter_for(fake.base_url), req(messages=CONVERSATION_WITH_SYSTEMS))
    assert fake.requests[0].json["messages"] == CONVERSATION_WITH_SYSTEMS


async def test_merge_system_messages_makes_one_leading_system_message(fake: FakeOpenAI) -> None:
    adapter = adapter_for(fake.base_url, merge_system_messages=True)
    await run(adapter, req(messages=CONVERSATION_WITH_SYSTEMS))
    assert fake.requests[0].json["messages"] == [
        {"role": "system", "content": "be brief\n\nagents: claude"},
        {"role": "user", "content": "hi"},
        {"role": "user", "content": "go"},
    ]
    # a conversation with one leading system message (or none) goes as it is
    plain = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    await run(adapter, req(messages=plain))
    assert fake.requests[1].json["messages"] == plain


async def test_cache_prompt_is_sent_only_when_the_option_says_so(fake: FakeOpenAI) -> None:
    await run(adapter_for(fake.base_url), req())
    assert "cache_prompt" not in fake.requests[0].json  # OpenAI's API refuses unknown fields
    await run(adapter_for(fake.base_url, cache_prompt=True), req())
    assert fake.requests[1].json["cache_prompt"] is True
    # the client's own value is kept
    await run(adapter_for(fake.base_url, cache_prompt=True), req(cache_prompt=False))
    assert fake.requests[2].json["cache_prompt"] is False


def test_cache_prompt_option_is_a_flag() -> None:
    assert OpenAIOptions.from_mapping({"cache_prompt": True}).cache_prompt is True
    assert OpenAIOptions.from_mapping({}).cache_prompt is False
    with pytest.raises(OptionsError, match="cache_prompt"):
        OpenAIOptions.from_mapping({"cache_prompt": "yes"})


async def test_client_stream_options_are_kept(fake: FakeOpenAI) -> None:
    await run(adapter_for(fake.base_url), req(stream_options={"other": 1}))
    assert fake.requests[0].json["stream_options"] == {"other": 1, "include_usage": True}


async def test_cancel_closes_the_upstream_connection(fake: FakeOpenAI) -> None:
    fake.chunk_count = 10_000
    fake.chunk_delay = 0.01
    rec = Recorder()
    with trio.fail_after(10):
        async with open_runner(rec.send, adapters={"oa": adapter_for(fake.base_url)}) as runner:
            runner.start(req())
            await rec.wait_for(lambda: len(rec.text("r1")) > 10)
            runner.cancel("r1", "client gone")
            terminal = await rec.wait_terminal("r1")
            (seen,) = fake.requests
            await seen.disconnected.wait()
            await fake.wait_idle()
    assert isinstance(terminal, wire.RunCancelled)
    assert_well_formed(rec.events("r1"))
    assert seen.chunks_sent < 10_000
    assert fake.disconnects == [seen]


async def test_cancel_while_waiting_for_the_first_byte(fake: FakeOpenAI) -> None:
    fake.stall_after_chunks = 0
    rec = Recorder()
    with trio.fail_after(10):
        async with open_runner(rec.send, adapters={"oa": adapter_for(fake.base_url)}) as runner:
            runner.start(req())
            (seen,) = await fake.wait_requests(1)
            runner.cancel("r1")
            terminal = await rec.wait_terminal("r1")
            await seen.disconnected.wait()
    assert isinstance(terminal, wire.RunCancelled)


async def test_a_provider_lingering_after_done_does_not_hold_the_run(fake: FakeOpenAI) -> None:
    """After ``[DONE]`` the node reads the rest of the body only briefly (to reuse the
    connection); a provider that keeps the stream open gets its connection closed instead,
    and the run completes long before the provider would have ended."""
    fake.linger_after_end = 60
    rec = Recorder()
    with trio.fail_after(10):
        async with open_runner(rec.send, adapters={"oa": adapter_for(fake.base_url)}) as runner:
            runner.start(req())
            terminal = await rec.wait_terminal("r1")
            (seen,) = fake.requests
            await seen.disconnected.wait()
            runner.start(req("r2"))
            second = await rec.wait_terminal("r2")
            await fake.requests[1].disconnected.wait()
    assert isinstance(terminal, wire.RunCompleted)
    assert isinstance(second, wire.RunCompleted)
    assert rec.text("r1") == rec.text("r2") == fake.expected_text
    assert fake.disconnects == fake.requests  # each lingering stream closed by the node


@pytest.mark.parametrize(
    ("status", "code", "retryable"),
    [
        (500, "upstream_5xx", True),
        (503, "upstream_5xx", True),
        (429, "upstream_rate_limited", True),
        # the node's problem (its key, the served model name, its base URL): another
        # candidate may succeed; the client's request was fine, so no status
        (401, "upstream_unauthorized", True),
        (403, "upstream_unauthorized", True),
        (404, "upstream_not_found", True),
        (405, "upstream_4xx", True),
        (408, "upstream_4xx", True),
        (409, "upstream_4xx", True),
    ],
)
async def test_http_errors(fake: FakeOpenAI, status: int, code: str, retryable: bool) -> None:
    fake.status = status
    fake.error_message = f"the model said no ({status})"
    rec = await run(adapter_for(fake.base_url))
    failed = rec.terminal("r1")
    assert isinstance(failed, wire.RunFailed)
    assert (failed.code, failed.retryable, failed.status) == (code, retryable, None)
    assert f"HTTP {status}" in failed.message
    assert f"the model said no ({status})" in failed.message
    assert rec.types("r1") == ["run.started", "run.failed"]
    assert_no_address(failed.message, fake.base_url)


async def test_429_names_retry_after(fake: FakeOpenAI) -> None:
    fake.status = 429
    fake.error_message = "Rate limit reached for requests"
    failed = (await run(adapter_for(fake.base_url))).terminal("r1")
    assert failed.message == (
        "the provider answered HTTP 429: Rate limit reached for requests (retry after 1 s)"
    )


@pytest.mark.parametrize(
    ("status", "upstream_code", "code"),
    [
        (400, "context_length_exceeded", "context_length_exceeded"),
        (400, None, "invalid_request"),
        (413, None, "invalid_request"),
        (415, "unsupported_media", "unsupported_media"),
        (422, "invalid_value", "invalid_value"),
    ],
)
async def test_client_errors_carry_the_upstream_status_code_and_message(
    fake: FakeOpenAI, status: int, upstream_code: str | None, code: str
) -> None:
    fake.status = status
    fake.error_code = upstream_code
    fake.error_message = (
        "This model's maximum context length is 4096 tokens. However, your messages "
        "resulted in 5000 tokens. Please reduce the length of the messages."
    )
    rec = await run(adapter_for(fake.base_url, api_key="sk-node-secret"))
    failed = rec.terminal("r1")
    assert failed == wire.RunFailed(
        run_id="r1",
        seq=1,
        code=code,
        message=fake.error_message,
        retryable=False,
        status=status,
    )
    assert rec.types("r1") == ["run.started", "run.failed"]
    assert len(fake.requests) == 1


async def test_llama_cpp_and_vllm_error_shapes(fake: FakeOpenAI) -> None:
    fake.status = 400
    fake.error_body = {
        "error": {
            "code": 400,
            "message": "request (4476 tokens) exceeds the available context size (4096 tokens)",
            "type": "exceed_context_size_error",
            "n_prompt_tokens": 4476,
            "n_ctx": 4096,
        }
    }
    failed = (await run(adapter_for(fake.base_url))).terminal("r1")
    assert (failed.code, failed.status, failed.retryable) == ("context_length_exceeded", 400, False)
    assert failed.message == fake.error_body["error"]["message"]

    fake.error_body = {
        "object": "error",
        "message": "max_tokens must be at least 1, got -3.",
        "type": "BadRequestError",
        "param": None,
        "code": 400,
    }
    failed = (await run(adapter_for(fake.base_url))).terminal("r1")
    assert (failed.code, failed.status, failed.retryable) == ("invalid_request", 400, False)
    assert failed.message == "max_tokens must be at least 1, got -3."


@pytest.mark.parametrize("status", [400, 404, 503])
async def test_an_upstream_that_quotes_its_address_and_the_key_is_redacted(
    fake: FakeOpenAI, status: int
) -> None:
    fake.status = status
    fake.api_key = "sk-node-secret"
    url = httpx.URL(fake.base_url)
    fake.error_message = (
        f"model not served at {fake.base_url}/v1/chat/completions (host {url.host}, "
        f"{url.host}:{url.port}) for key sk-node-secret"
    )
    failed = (await run(adapter_for(fake.base_url, api_key="sk-node-secret"))).terminal("r1")
    assert_no_address(failed.message, fake.base_url)
    assert "sk-node-secret" not in failed.message
    assert "model not served at <provider> (host <provider>, <provider>)" in failed.message
    assert "for key <redacted>" in failed.message


async def test_wrong_key_is_the_nodes_problem_with_the_upstream_message(fake: FakeOpenAI) -> None:
    fake.api_key = "right"
    rec = await run(adapter_for(fake.base_url, api_key="wrong"))
    failed = rec.terminal("r1")
    assert (failed.code, failed.retryable, failed.status) == ("upstream_unauthorized", True, None)
    assert "HTTP 401: invalid API key" in failed.message
    assert "wrong" not in failed.message


async def test_404_from_a_wrong_base_url(fake: FakeOpenAI) -> None:
    rec = await run(adapter_for(fake.base_url + "/nowhere"))  # fake: 404 OpenAI-shaped
    failed = rec.terminal("r1")
    assert (failed.code, failed.retryable, failed.status) == ("upstream_not_found", True, None)
    # the upstream's message quotes the path: the base path is redacted from it
    assert "HTTP 404: no route for POST <provider>" in failed.message
    assert "/nowhere" not in failed.message
    assert_no_address(failed.message, fake.base_url)


async def test_connection_refused(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="nodes.adapters.http")
    base_url = refused_base_url()
    rec = await run(adapter_for(base_url))
    failed = rec.terminal("r1")
    assert (failed.code, failed.retryable, failed.status) == ("upstream_unreachable", True, None)
    assert "cannot connect" in failed.message
    assert_no_address(failed.message, base_url)
    # the node's own log keeps where it was
    assert any(base_url in r.getMessage() for r in caplog.records)


async def test_read_timeout_is_unreachable(fake: FakeOpenAI) -> None:
    fake.stall_after_chunks = 2
    rec = await run(adapter_for(fake.base_url, read_timeout=0.2))
    failed = rec.terminal("r1")
    assert (failed.code, failed.retryable) == ("upstream_unreachable", True)
    assert "timed out" in failed.message
    assert_no_address(failed.message, fake.base_url)
    assert rec.text("r1") == "".join(fake.tokens[:2])
    await fake.requests[0].disconnected.wait()


async def test_connection_cut_mid_stream(fake: FakeOpenAI) -> None:
    fake.fail_after_chunks = 3
    rec = await run(adapter_for(fake.base_url))
    failed = rec.terminal("r1")
    assert (failed.code, failed.retryable) == ("upstream_disconnected", True)
    assert_no_address(failed.message, fake.base_url)
    assert rec.text("r1") == "".join(fake.tokens[:3])
    # partial usage (estimated) precedes the failure
    assert rec.types("r1")[-2:] == ["run.usage", "run.failed"]


async def test_error_event_mid_stream(fake: FakeOpenAI) -> None:
    fake.fail_after_chunks = 2
    fake.fail_mode = "error"
    fake.error_message = "CUDA out of memory"
    rec = await run(adapter_for(fake.base_url))
    failed = rec.terminal("r1")
    assert (failed.code, failed.retryable, failed.status) == ("upstream_error", True, None)
    assert "CUDA out of memory" in failed.message


async def test_failures_raised_while_reading_the_stream_are_redacted_too(
    fake: FakeOpenAI,
) -> None:
    fake.fail_after_chunks = 1
    fake.fail_mode = "error"
    fake.error_message = f"worker at {fake.base_url} lost its GPU"
    failed = (await run(adapter_for(fake.base_url))).terminal("r1")
    assert failed.code == "upstream_error"
    assert failed.message == "the provider sent an error event: worker at <provider> lost its GPU"


async def test_client_error_event_mid_stream(fake: FakeOpenAI) -> None:
    # vLLM streams a validation error as an error event with the status in ``code``
    fake.fail_after_chunks = 0
    fake.fail_mode = "error"
    fake.error_code = 400
    fake.error_message = "This model's maximum context length is 2048 tokens."
    rec = await run(adapter_for(fake.base_url))
    failed = rec.terminal("r1")
    assert (failed.code, failed.retryable, failed.status) == ("invalid_request", False, 400)
    assert failed.message == "This model's maximum context length is 2048 tokens."

    fake.error_code = "context_length_exceeded"
    failed = (await run(adapter_for(fake.base_url))).terminal("r1")
    assert (failed.code, failed.retryable, failed.status) == ("context_length_exceeded", False, 400)


async def test_tool_call_deltas_pass_through_in_order(fake: FakeOpenAI) -> None:
    fake.reply = "Let me check."
    fake.finish_reason = "tool_calls"
    fake.tool_call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    rec = await run(adapter_for(fake.base_url), req(tools=tools, tool_choice="auto"))
    terminal = rec.terminal("r1")
    assert isinstance(terminal, wire.RunCompleted)
    assert terminal.finish_reason == "tool_calls"
    deltas = [e for e in rec.events("r1") if isinstance(e, wire.RunDelta)]
    # the text (however coalesced) comes first, then one run.delta per upstream tool-call delta
    calls = [d for d in deltas if d.tool_calls]
    first_call = deltas.index(calls[0])
    assert "".join(d.text for d in deltas[:first_call]) == "Let me check."
    assert all(not d.text for d in deltas[first_call:])
    assert [d.tool_calls for d in calls] == [
        (
            {
                "index": 0,
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": ""},
            },
        ),
        ({"index": 0, "function": {"arguments": '{"city":'}},),
        ({"index": 0, "function": {"arguments": ' "Paris"}'}},),
    ]
    (seen,) = fake.requests
    assert seen.json["tools"] == tools
    assert seen.json["tool_choice"] == "auto"


async def test_through_build_adapters(fake: FakeOpenAI, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OA_TEST_KEY", "sk-from-env")
    fake.api_key = "sk-from-env"
    provider = ProviderConfig(
        id="oa",
        type="openai",
        base_url=fake.base_url + "/v1",
        api_key_env="OA_TEST_KEY",
        models=(ModelConfig(name="gpt"),),
    )
    adapter = build_adapters([provider])["oa"]
    assert "sk-from-env" not in repr(adapter)
    rec = await run(adapter)
    assert rec.text("r1") == fake.expected_text


def test_missing_key_env_fails_at_construction() -> None:
    provider = ProviderConfig(
        id="oa", type="openai", api_key_env="NOT_SET_ANYWHERE", models=(ModelConfig(name="m"),)
    )
    with pytest.raises(NodeConfigError, match="NOT_SET_ANYWHERE is not set") as info:
        OpenAIAdapter.from_provider(provider, environ={})
    assert info.value.key == "api_key_env"
    with pytest.raises(NodeConfigError):
        OpenAIAdapter.from_provider(provider, environ={"NOT_SET_ANYWHERE": ""})


def test_options() -> None:
    options = OpenAIOptions.from_mapping(
        {"connect_timeout": 2, "read_timeout": 0, "include_usage": False}
    )
    assert (options.timeouts.connect, options.timeouts.read) == (2.0, None)
    assert options.include_usage is False
    assert OpenAIOptions().timeouts.read == 600.0
    cases: list[tuple[dict[str, Any], str]] = [
        ({"include_usage": "yes"}, "include_usage"),
        ({"connect_timeout": 0}, "connect_timeout"),
        ({"read_timeout": -1}, "read_timeout"),
        ({"tempo": 1}, "tempo"),
    ]
    for bad, key in cases:
        with pytest.raises(OptionsError) as info:
            validate_options("openai", bad)
        assert info.value.key == key


class _Calls:
    """A RunOutput recording the calls an adapter makes, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    async def delta(self, text: str) -> None:
        self.calls.append(("delta", text))

    async def tool_calls(self, calls: Any) -> None:
        self.calls.append(("tool_calls", calls))

    def usage(self, prompt_tokens: int, completion_tokens: int, **parts: int) -> None:
        self.calls.append(("usage", (prompt_tokens, completion_tokens)))


def _output(calls: _Calls) -> RunOutput:
    return cast(RunOutput, calls)


def _event(content: str | None = None, **more: Any) -> bytes:
    delta = {} if content is None else {"content": content}
    return orjson.dumps({"choices": [{"index": 0, "delta": delta}], **more})


async def test_the_text_of_one_read_is_one_delta_in_order_with_the_rest() -> None:
    """The chunks of one read: consecutive text joined into one delta, which goes out before
    a usage or tool calls that follow it (as chunk by chunk), and at the read's end."""
    out, usage = _Calls(), StreamUsage()
    call = {"index": 0, "id": "c", "function": {"name": "f", "arguments": ""}}
    tool = orjson.dumps(
        {"choices": [{"index": 0, "delta": {"content": "c", "tool_calls": [call]}}]}
    )
    done_usage = {"prompt_tokens": 3, "completion_tokens": 4}
    events = [
        _event("a"),
        _event("b"),
        tool,
        _event("d"),
        _event(usage=done_usage),
        _event("e"),
        orjson.dumps({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}),
        b"[DONE]",
        _event("never"),
    ]
    assert await _take_events(events, _output(out), usage, None) == ("stop", True)
    assert out.calls == [
        ("delta", "abc"),
        ("tool_calls", [call]),
        ("delta", "d"),
        ("usage", (3, 4)),
        ("delta", "e"),
    ]


async def test_the_text_before_a_failure_in_the_same_read_goes_out_first() -> None:
    for failing in (orjson.dumps({"error": {"message": "boom"}}), b"{not json"):
        out = _Calls()
        with pytest.raises(AdapterError) as caught:
            await _take_events(
                [_event("a"), _event("b"), failing, _event("c")], _output(out), StreamUsage(), None
            )
        assert caught.value.code in ("upstream_error", "upstream_bad_response")
        assert out.calls == [("delta", "ab")]
