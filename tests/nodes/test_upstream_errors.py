"""How an upstream's failure becomes a run.failed: the status mapping and error-body parsing
(pure, no I/O), the redaction of the provider's address and the node's credentials, and the
runner carrying ``status`` onto the wire. The adapters' own tests cover the same through the
fake providers."""

from __future__ import annotations

import orjson
import pytest

from dispatcher import wire
from nodes.adapters import AdapterError, RunOutput
from nodes.adapters._upstream_errors import (
    UpstreamError,
    error_event_failure,
    parse_error,
    status_failure,
)
from nodes.runner import open_runner
from nodes.upstream.redact import Redactor
from tests.nodes._helpers import Recorder, request


def openai_body(message: str, code: str | None = None) -> str:
    error = {"message": message, "type": "invalid_request_error", "param": None, "code": code}
    return orjson.dumps({"error": error}).decode()


@pytest.mark.parametrize("status", [400, 413, 415, 422])
def test_the_clients_errors_keep_status_code_and_message(status: int) -> None:
    failure = status_failure(status, openai_body("too long", "context_length_exceeded"))
    assert (failure.code, failure.message, failure.retryable, failure.status) == (
        "context_length_exceeded",
        "too long",
        False,
        status,
    )
    failure = status_failure(status, orjson.dumps({"error": "bad options"}).decode())
    assert (failure.code, failure.message, failure.status) == (
        "invalid_request",
        "bad options",
        status,
    )


@pytest.mark.parametrize(
    ("status", "code"),
    [
        (401, "upstream_unauthorized"),
        (403, "upstream_unauthorized"),
        (404, "upstream_not_found"),
        (402, "upstream_4xx"),
        (405, "upstream_4xx"),
        (408, "upstream_4xx"),
        (409, "upstream_4xx"),
        (410, "upstream_4xx"),
        (429, "upstream_rate_limited"),
        (500, "upstream_5xx"),
        (529, "upstream_5xx"),
        (302, "upstream_bad_response"),
    ],
)
def test_everything_else_is_retryable_elsewhere_without_a_status(status: int, code: str) -> None:
    failure = status_failure(status, openai_body("nope", "some_code"))
    assert (failure.code, failure.retryable, failure.status) == (code, True, None)
    assert failure.message == f"the provider answered HTTP {status}: nope"


def test_429_retry_after_seconds_are_named_dates_are_not() -> None:
    assert status_failure(429, "slow down", retry_after="7").message == (
        "the provider answered HTTP 429: slow down (retry after 7 s)"
    )
    date = "Wed, 21 Oct 2015 07:28:00 GMT"
    assert status_failure(429, "slow down", retry_after=date).message == (
        "the provider answered HTTP 429: slow down"
    )


def test_bodies_without_a_json_message() -> None:
    html = "<html><head><title>413 Request Entity Too Large</title></head><body>nginx</body>"
    failure = status_failure(413, html, reason="Payload Too Large")
    assert (failure.code, failure.message, failure.status) == (
        "invalid_request",
        "Payload Too Large",
        413,
    )
    assert status_failure(400, "  model  is\nrequired ").message == "model is required"
    assert status_failure(400, "", reason="Bad Request").message == "Bad Request"
    assert status_failure(400, "").message == "no message"
    long = status_failure(400, openai_body("x" * 5000))
    assert len(long.message) == 1000
    assert long.message.endswith("…")


def test_the_upstream_text_is_redacted_before_it_is_cut() -> None:
    url = "http://10.1.2.3:8000/team-a/v1/chat/completions"
    redact = Redactor.for_request(url, {})
    # the address straddles the cut: cut first, its start would survive
    message = "x" * 990 + f" {url} " + "y" * 100
    failure = status_failure(400, openai_body(message), redact=redact)
    assert len(failure.message) == 1000
    assert "10.1" not in failure.message
    # JSON may escape slashes: the message is read from the JSON before it is redacted
    escaped = '{"error": {"message": "no such route http:\\/\\/10.1.2.3:8000\\/team-a"}}'
    assert "\\/" in escaped
    failure = status_failure(404, escaped, redact=redact)
    assert failure.message == "the provider answered HTTP 404: no such route <provider>"


def test_parse_error_shapes() -> None:
    openai = {"error": {"message": "m", "type": "invalid_request_error", "code": "c", "param": "p"}}
    assert parse_error(openai) == UpstreamError(message="m", code="c")
    assert parse_error({"error": "ollama says"}) == UpstreamError(message="ollama says")
    vllm = {"object": "error", "message": "m", "type": "BadRequestError", "code": 400}
    assert parse_error(vllm) == UpstreamError(message="m", status=400)
    llama_cpp = {"error": {"code": 400, "message": "m", "type": "exceed_context_size_error"}}
    assert parse_error(llama_cpp) == UpstreamError(
        message="m", code="context_length_exceeded", status=400
    )
    assert parse_error({"detail": "fastapi"}) == UpstreamError(message="fastapi")
    # junk codes are not passed on
    junk = {"error": {"message": "m", "code": "has spaces <b>"}}
    assert parse_error(junk) == UpstreamError(message="m")
    assert parse_error(["not", "an", "object"]) == UpstreamError()


def test_error_events_in_a_2xx_stream() -> None:
    vllm = {"error": {"message": "too long", "type": "BadRequestError", "code": 400}}
    failure = error_event_failure(vllm, "event")
    assert (failure.code, failure.message, failure.retryable, failure.status) == (
        "invalid_request",
        "too long",
        False,
        400,
    )
    openai = {"error": {"message": "too long", "code": "context_length_exceeded"}}
    failure = error_event_failure(openai, "event")
    assert (failure.code, failure.status) == ("context_length_exceeded", 400)
    failure = error_event_failure({"error": "model runner has unexpectedly stopped"}, "line")
    assert (failure.code, failure.retryable, failure.status) == ("upstream_error", True, None)
    assert failure.message == (
        "the provider sent an error line: model runner has unexpectedly stopped"
    )


def test_redactor_removes_url_host_port_base_path_and_credentials() -> None:
    redact = Redactor.for_request(
        "https://user:p%40ss@LLM.internal.example:8443/tenant-42/llm/v1/chat/completions",
        {"authorization": "Bearer sk-live-abc", "accept": "text/event-stream"},
    )
    text = (
        "POST https://llm.internal.example:8443/tenant-42/llm/v1/chat/completions failed; "
        "llm.internal.example:8443 is llm.internal.example, see /tenant-42/llm/v1/models and "
        "/tenant-42/x; key sk-live-abc (Bearer sk-live-abc), auth user:p%40ss / p@ss"
    )
    assert redact(text) == (
        "POST <provider> failed; <provider> is <provider>, see <provider>/models and "
        "<provider>/x; key <redacted> (<redacted>), auth <redacted> / <redacted>"
    )


def test_redactor_leaves_the_standard_paths_and_lookalike_names() -> None:
    redact = Redactor.for_request("http://10.0.0.5:8000/v1/chat/completions", {})
    assert redact("use /v1/chat/completions or /v1/models") == (
        "use /v1/chat/completions or /v1/models"
    )
    assert redact("10.0.0.55 and 10.0.0.5.") == "10.0.0.55 and <provider>."
    # a bare port is not a name: numbers in messages stay
    assert redact("context of 8000 tokens") == "context of 8000 tokens"
    ollama = Redactor.for_request("http://ollama-box:11434/api/chat", {})
    assert ollama("POST /api/chat on ollama-box:11434") == "POST /api/chat on <provider>"


def test_redactor_implicit_port_and_ipv6() -> None:
    redact = Redactor.for_request("https://api.example.com/v1/chat/completions", {})
    assert redact("api.example.com:443 refused") == "<provider> refused"
    v6 = Redactor.for_request("http://[fd00::1]:8000/v1/chat/completions", {})
    assert v6("at [fd00::1]:8000 and http://[fd00::1]:8000/v1") == "at <provider> and <provider>"


async def test_the_runner_puts_the_status_on_the_wire() -> None:
    class Refusing:
        async def run(self, req: wire.RunRequest, out: RunOutput) -> None:
            raise AdapterError("context_length_exceeded", "too long", status=400)

    rec = Recorder()
    async with open_runner(rec.send, adapters={"p": Refusing()}) as runner:
        runner.start(request("r1", provider_id="p"))
        failed = await rec.wait_terminal("r1")
    assert failed == wire.RunFailed(
        run_id="r1",
        seq=1,
        code="context_length_exceeded",
        message="too long",
        retryable=False,
        status=400,
    )
    assert orjson.loads(wire.encode(failed))["status"] == 400


async def test_failures_without_a_status_send_none() -> None:
    class Failing:
        async def run(self, req: wire.RunRequest, out: RunOutput) -> None:
            raise AdapterError("upstream_5xx", "down", retryable=True)

    rec = Recorder()
    async with open_runner(rec.send, adapters={"p": Failing()}) as runner:
        runner.start(request("r1", provider_id="p"))
        failed = await rec.wait_terminal("r1")
    assert failed.status is None
