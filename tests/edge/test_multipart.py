"""The edge's multipart/form-data reader (``dispatcher.api.openai._multipart``) and the media
routes' body and usage readers (``dispatcher.api.openai._media``), on their own: forms as
real clients encode them (httpx's encoder), read back by the standard library's MIME parser
after the model is replaced, and hostile bodies refused with a 400 -- never another
exception."""

from __future__ import annotations

import email.parser
import email.policy
from typing import Any

import httpx
import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dispatcher import wire
from dispatcher.api.openai._media import media_usage, parse_media_request
from dispatcher.api.openai._multipart import (
    MAX_PART_HEAD,
    MAX_PARTS,
    boundary_of,
    parse_form,
    replace_field,
    text_field,
)
from dispatcher.errors import BadRequest


def encoded(data: dict[str, str], files: dict[str, tuple[str, bytes, str]]) -> tuple[bytes, bytes]:
    """A form as httpx (the OpenAI SDK's transport) encodes it: body and Content-Type."""
    request = httpx.Request("POST", "http://x/", data=data, files=files)
    return request.read(), request.headers["content-type"].encode()


def stdlib_fields(body: bytes, content_type: bytes) -> dict[str, bytes]:
    head = b"Content-Type: " + content_type + b"\r\nMIME-Version: 1.0\r\n\r\n"
    message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(head + body)
    out: dict[str, bytes] = {}
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        payload = part.get_payload(decode=True)
        assert isinstance(name, str)
        assert isinstance(payload, bytes)
        out[name] = payload
    return out


def test_a_client_form_is_read_and_its_model_replaced_in_place() -> None:
    audio = bytes(range(256)) * 300
    body, content_type = encoded(
        {"model": "whisper", "language": "en"}, {"file": ("a.wav", audio, "audio/wav")}
    )
    boundary = boundary_of(content_type)
    parts = parse_form(body, boundary)
    assert [(p.name, p.filename) for p in parts] == [
        ("model", None),
        ("language", None),
        ("file", "a.wav"),
    ]
    assert body[parts[2].start : parts[2].end] == audio
    assert text_field(body, parts, "model") == "whisper"
    assert text_field(body, parts, "stream") is None

    renamed = replace_field(body, boundary, parts[0], "openai/whisper-large-v3")
    assert stdlib_fields(renamed, content_type) == {
        "model": b"openai/whisper-large-v3",
        "language": b"en",
        "file": audio,
    }
    # Every byte but the value's is the client's.
    assert renamed.replace(b"openai/whisper-large-v3", b"whisper", 1) == body


@given(
    values=st.dictionaries(
        st.sampled_from(["prompt", "language", "n", "size"]),
        st.text(st.characters(codec="utf-8"), max_size=40),
        max_size=4,
    ),
    upload=st.binary(max_size=2000),
    served=st.text(st.characters(blacklist_categories=("Cs", "Cc")), min_size=1, max_size=30),
)
def test_replacing_the_model_keeps_every_other_field(
    values: dict[str, str], upload: bytes, served: str
) -> None:
    body, content_type = encoded(
        {"model": "m", **values}, {"image": ("in.png", upload, "image/png")}
    )
    boundary = boundary_of(content_type)
    parts = parse_form(body, boundary)
    (model,) = [p for p in parts if p.name == "model"]
    renamed = replace_field(body, boundary, model, served)
    again = parse_form(renamed, boundary)
    assert text_field(renamed, again, "model") == served
    for name, value in values.items():
        assert text_field(renamed, again, name) == value
    assert [renamed[p.start : p.end] for p in again if p.name == "image"] == [upload]


def form(*parts: bytes, boundary: bytes = b"XyZ") -> bytes:
    return b"".join(b"--" + boundary + b"\r\n" + part + b"\r\n" for part in parts) + (
        b"--" + boundary + b"--\r\n"
    )


def field(name: str, value: bytes) -> bytes:
    return f'Content-Disposition: form-data; name="{name}"\r\n\r\n'.encode() + value


def test_preamble_epilogue_padding_quoted_boundaries_and_empty_parts() -> None:
    boundary = boundary_of(b'multipart/form-data; charset=utf-8; boundary="a b:c"')
    assert boundary == b"a b:c"
    body = (
        b"a preamble\r\n--a b:c \t\r\n"
        + field("model", b"m")
        + b"\r\n--a b:c\r\n"
        + field("empty", b"")
        + b"\r\n--a b:c\r\n"
        + b'Content-Disposition: form-data; name="bare"\r\n'  # no content at all
        + b"\r\n--a b:c--\r\nan epilogue"
    )
    parts = parse_form(body, boundary)
    assert [p.name for p in parts] == ["model", "empty", "bare"]
    assert text_field(body, parts, "model") == "m"
    assert text_field(body, parts, "empty") == ""
    assert text_field(body, parts, "bare") == ""
    assert parse_form(b"--XyZ--\r\n", b"XyZ") == []


@pytest.mark.parametrize(
    ("content_type", "fault"),
    [
        (b"multipart/form-data", "no boundary"),
        (b"multipart/form-data; boundary=", "boundary is not"),
        (b"multipart/form-data; boundary=" + b"x" * 71, "boundary is not"),
        (b'multipart/form-data; boundary="ends in a space "', "boundary is not"),
        (b"multipart/form-data; boundary=a\x00b", "boundary is not"),
        (b"multipart/form-data; =x", "parameters"),
    ],
)
def test_bad_boundaries_are_refused(content_type: bytes, fault: str) -> None:
    with pytest.raises(BadRequest) as caught:
        boundary_of(content_type)
    assert caught.value.code == "invalid_multipart"
    assert fault in caught.value.message


@pytest.mark.parametrize(
    ("body", "fault"),
    [
        (b"", "no part starts"),
        (b"no delimiter here", "no part starts"),
        (form(field("model", b"m"))[:-9], "not closed"),
        (b"--XyZ\r\n" + field("model", b"m"), "not closed"),
        (b"--XyZ\r\nContent-Disposition: form-data", "never end"),
        (b"--XyZ\r\n" + b"X-Pad: " + b"x" * MAX_PART_HEAD + b"\r\n\r\nv\r\n--XyZ--", "over"),
        (b"--XyZjunk\r\n" + field("model", b"m") + b"\r\n--XyZ--", "line break"),
        (form(b"Content-Type: text/plain\r\n\r\nv"), "no Content-Disposition"),
        (form(b"Content-Disposition: attachment; name=x\r\n\r\nv"), "not form-data"),
        (form(b"Content-Disposition: form-data; filename=x\r\n\r\nv"), "no name"),
        (form(b"Content-Disposition: form-data; name=\xff\r\n\r\nv"), "not UTF-8"),
        (form(*[field("n", b"1")] * (MAX_PARTS + 1)), f"more than {MAX_PARTS}"),
    ],
)
def test_malformed_forms_are_refused(body: bytes, fault: str) -> None:
    with pytest.raises(BadRequest) as caught:
        parse_form(body, b"XyZ")
    assert caught.value.code == "invalid_multipart"
    assert fault in caught.value.message


@given(body=st.binary(max_size=300) | st.builds(lambda t: form(t), st.binary(max_size=200)))
def test_any_bytes_are_a_form_or_a_400(body: bytes) -> None:
    try:
        parts = parse_form(body, b"XyZ")
    except BadRequest as exc:
        assert exc.code == "invalid_multipart"
        return
    for part in parts:
        assert 0 <= part.start <= part.end <= len(body)


def test_a_field_value_that_would_end_its_part_is_never_written() -> None:
    body = form(field("model", b"m"))
    (part,) = parse_form(body, b"XyZ")
    for value in ("a\r\n--XyZ", "two\nlines", "x--XyZ"):
        with pytest.raises(ValueError, match="cannot be a field"):
            replace_field(body, b"XyZ", part, value)


# --------------------------------------------------------------------------- the media body


def test_a_form_request_names_its_model_and_stream_and_renames_for_the_provider() -> None:
    body, content_type = encoded(
        {"model": "group", "stream": "True"}, {"file": ("a.mp3", b"ID3" * 100, "audio/mpeg")}
    )
    media = parse_media_request(body, content_type)
    assert (media.model, media.stream) == ("group", True)
    assert media.raw_body("group") is body  # the same name: the client's bytes
    assert stdlib_fields(media.raw_body("served"), content_type)["model"] == b"served"


def test_a_json_request_is_renamed_by_reserializing() -> None:
    raw = b'{"model": "group", "prompt": "a fox", "n": 1}'
    media = parse_media_request(raw, b"application/json")
    assert (media.model, media.stream) == ("group", False)
    assert media.raw_body("group") is raw
    assert orjson.loads(media.raw_body("dall-e-3")) == {
        "model": "dall-e-3",
        "prompt": "a fox",
        "n": 1,
    }


@pytest.mark.parametrize(
    ("raw", "content_type", "code", "param"),
    [
        (b'{"prompt": "x"}', b"application/json", "missing_required_parameter", "model"),
        (b'{"model": ""}', b"application/json", None, "model"),
        (b'{"model": 7}', b"application/json", "invalid_type", "model"),
        (b"[]", None, "invalid_json", None),
        (
            form(field("prompt", b"x")),
            b"multipart/form-data; boundary=XyZ",
            "missing_required_parameter",
            "model",
        ),
        (form(field("model", b"")), b"multipart/form-data; boundary=XyZ", "invalid_value", "model"),
        (
            form(field("model", b"\xff")),
            b"multipart/form-data; boundary=XyZ",
            "invalid_multipart",
            "model",
        ),
    ],
)
def test_bad_media_bodies_name_the_fault(
    raw: bytes, content_type: bytes | None, code: str | None, param: str | None
) -> None:
    with pytest.raises(BadRequest) as caught:
        parse_media_request(raw, content_type)
    if code is not None:
        assert caught.value.code == code
    assert caught.value.param == param


# --------------------------------------------------------------------------- usage


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        # llama.cpp's rerank, and anything in OpenAI's own shape
        ({"usage": {"prompt_tokens": 9, "total_tokens": 9}}, (9, 0)),
        # gpt-image
        (
            {
                "data": [],
                "usage": {"input_tokens": 50, "output_tokens": 4160, "total_tokens": 4210},
            },
            (50, 4160),
        ),
        # gpt-4o-transcribe
        (
            {"text": "x", "usage": {"type": "tokens", "input_tokens": 14, "output_tokens": 45}},
            (14, 45),
        ),
        # vLLM's and Jina's rerank
        ({"results": [], "usage": {"total_tokens": 31}}, (31, 0)),
        # Cohere
        (
            {"results": [], "meta": {"billed_units": {"input_tokens": 12, "output_tokens": 3}}},
            (12, 3),
        ),
    ],
)
def test_media_usage_reads_each_shape(answer: dict[str, Any], expected: tuple[int, int]) -> None:
    usage = media_usage(answer)
    assert usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens, usage.estimated) == (*expected, False)


@pytest.mark.parametrize(
    "answer",
    [
        {"data": [{"url": "https://x"}]},  # DALL-E: no usage
        {"text": "x", "usage": {"type": "duration", "seconds": 9}},  # whisper-1: seconds
        {"results": [], "meta": {"billed_units": {"search_units": 1}}},  # Cohere search units
        {"id": "modr-1", "results": []},  # moderations
        {"usage": {"input_tokens": -1}},
        {"usage": {"input_tokens": 3, "output_tokens": "4"}},
        {"usage": {"total_tokens": 1.5}},
        [1, 2],
        "text",
    ],
)
def test_media_usage_invents_nothing(answer: object) -> None:
    assert media_usage(answer) is None


def test_media_usage_is_a_wire_usage() -> None:
    assert media_usage({"usage": {"total_tokens": 2}}) == wire.Usage(
        prompt_tokens=2, completion_tokens=0
    )
