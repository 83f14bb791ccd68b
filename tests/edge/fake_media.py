"""A fake provider of OpenAI's images, audio and moderations APIs and of the Cohere / Jina
rerank API (as vLLM and llama.cpp serve it), on a real HTTP server (``serve_http`` on
127.0.0.1, port 0), written from the API references:

- ``POST /v1/images/generations`` (JSON) and ``POST /v1/images/edits`` (multipart: ``image``
  files, ``prompt``, ``model``): ``{"created", "data": [{"b64_json"}], "usage":
  {"total_tokens", "input_tokens", "output_tokens", "input_tokens_details"}}``, as gpt-image
  answers (``image_bytes`` of image, base64-encoded: a large body, ``usage`` last);
- ``POST /v1/audio/transcriptions`` and ``/v1/audio/translations`` (multipart: ``file``,
  ``model``, ...): ``{"text", "usage": {"type": "tokens", "input_tokens",
  "input_token_details", "output_tokens", "total_tokens"}}`` as gpt-4o-transcribe answers
  (``transcription_usage = "duration"``: whisper-1's ``{"type": "duration", "seconds"}``);
- ``POST /v1/audio/speech`` (JSON): ``audio/mpeg`` bytes (:attr:`FakeMedia.speech`), in
  ``speech_chunks`` pieces ``speech_delay`` seconds apart (``None``: forever, until the client
  leaves);
- ``POST /v1/moderations`` (JSON): ``{"id", "model", "results": [{"flagged", "categories",
  "category_scores"}]}`` (no usage);
- ``POST /v1/rerank`` (JSON ``{"model", "query", "documents", "top_n"}``): ``{"id", "model",
  "usage": {"total_tokens"}, "results": [{"index", "relevance_score", "document":
  {"text"}}]}``.

A form is parsed with the standard library's MIME parser (not the edge's), so that what the
edge forwards is checked by another reader: :attr:`forms` keeps each request's fields.
"""

from __future__ import annotations

import base64
import email.parser
import email.policy
from collections.abc import Awaitable, Callable
from typing import Any, Literal

import attrs
import orjson
import trio

from dispatcher.http import Responder

from ..nodes.fake_providers import FakeProvider, SeenRequest

Handler = Callable[[SeenRequest, Responder], Awaitable[None]]


@attrs.frozen
class FormField:
    value: bytes
    filename: str | None
    content_type: str


def parse_form(seen: SeenRequest) -> dict[str, list[FormField]]:
    """A ``multipart/form-data`` request's fields, by name, read by ``email``'s parser."""
    content_type = seen.header("content-type") or ""
    head = f"Content-Type: {content_type}\r\nMIME-Version: 1.0\r\n\r\n".encode("latin-1")
    message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(head + seen.body)
    assert message.is_multipart(), "not a multipart body"
    out: dict[str, list[FormField]] = {}
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        assert isinstance(name, str), "a part without a name"
        payload = part.get_payload(decode=True)
        assert isinstance(payload, bytes)
        out.setdefault(name, []).append(
            FormField(payload, part.get_filename(), part.get_content_type())
        )
    return out


@attrs.define(eq=False, kw_only=True)
class FakeMedia(FakeProvider):
    image_bytes: int = 300 * 1024
    """The generated image's size (its base64 is a third larger)."""
    image_tokens: tuple[int, int] = (50, 4160)
    """gpt-image's ``usage``: input and output tokens."""
    transcript: str = "The quick brown fox jumped over the lazy dog."
    transcription_usage: Literal["tokens", "duration"] = "tokens"
    speech: bytes = attrs.Factory(lambda: b"ID3\x04\x00" + bytes(range(256)) * 64)
    speech_chunks: int | None = 4
    speech_delay: float = 0.0
    rerank_tokens: int = 31
    forms: list[dict[str, list[FormField]]] = attrs.field(factory=list, init=False)

    def route(self, seen: SeenRequest) -> Handler | None:
        if seen.method != "POST":
            return None
        return {
            "/v1/images/generations": self._image,
            "/v1/images/edits": self._image_edit,
            "/v1/audio/transcriptions": self._transcription,
            "/v1/audio/translations": self._transcription,
            "/v1/audio/speech": self._speech,
            "/v1/moderations": self._moderation,
            "/v1/rerank": self._rerank,
        }.get(seen.path)

    def error_body_for(self, message: str) -> Any:
        return {"error": {"message": message, "type": "invalid_request_error", "code": None}}

    def image_answer(self) -> dict[str, Any]:
        image = b"\x89PNG\r\n\x1a\n" + bytes(i % 251 for i in range(self.image_bytes))
        tokens_in, tokens_out = self.image_tokens
        return {
            "created": 1713833628,
            "data": [{"b64_json": base64.b64encode(image).decode()}],
            "usage": {
                "total_tokens": tokens_in + tokens_out,
                "input_tokens": tokens_in,
                "output_tokens": tokens_out,
                "input_tokens_details": {"text_tokens": tokens_in, "image_tokens": 0},
            },
        }

    async def _image(self, seen: SeenRequest, responder: Responder) -> None:
        await self.respond_json(responder, 200, self.image_answer())

    async def _image_edit(self, seen: SeenRequest, responder: Responder) -> None:
        form = parse_form(seen)
        self.forms.append(form)
        if "image" not in form and "image[]" not in form:
            await self.respond_json(responder, 400, self.error_body_for("image is required"))
            return
        await self.respond_json(responder, 200, self.image_answer())

    async def _transcription(self, seen: SeenRequest, responder: Responder) -> None:
        form = parse_form(seen)
        self.forms.append(form)
        if "file" not in form:
            await self.respond_json(responder, 400, self.error_body_for("file is required"))
            return
        if [f.value for f in form.get("stream", [])] == [b"true"]:
            await self._transcription_stream(responder)
            return
        usage: dict[str, Any]
        if self.transcription_usage == "tokens":
            usage = {
                "type": "tokens",
                "input_tokens": 14,
                "input_token_details": {"text_tokens": 0, "audio_tokens": 14},
                "output_tokens": 45,
                "total_tokens": 59,
            }
        else:
            usage = {"type": "duration", "seconds": 9}
        await self.respond_json(responder, 200, {"text": self.transcript, "usage": usage})

    async def _transcription_stream(self, responder: Responder) -> None:
        """``stream=true``: ``transcript.text.delta`` events, then ``transcript.text.done``
        with the text and its usage (gpt-4o-transcribe's stream)."""
        stream = await responder.start_stream(200, [(b"content-type", b"text/event-stream")])
        for word in self.transcript.split(" "):
            delta = {"type": "transcript.text.delta", "delta": word + " "}
            await stream.send(b"data: " + orjson.dumps(delta) + b"\n\n")
        done = {
            "type": "transcript.text.done",
            "text": self.transcript,
            "usage": {"type": "tokens", "input_tokens": 14, "output_tokens": 45},
        }
        await stream.send(b"data: " + orjson.dumps(done) + b"\n\n")

    async def _speech(self, seen: SeenRequest, responder: Responder) -> None:
        headers = [(b"content-type", b"audio/mpeg")]
        if self.speech_chunks is not None and self.speech_delay == 0:
            await responder.respond(200, headers, self.speech * self.speech_chunks)
            return
        stream = await responder.start_stream(200, headers)
        sent = 0
        while self.speech_chunks is None or sent < self.speech_chunks:
            await stream.send(self.speech)
            sent += 1
            seen.chunks_sent = sent
            await trio.sleep(self.speech_delay)

    async def _moderation(self, seen: SeenRequest, responder: Responder) -> None:
        model = seen.json.get("model") if isinstance(seen.json, dict) else None
        await self.respond_json(
            responder,
            200,
            {
                "id": "modr-5558",
                "model": model,
                "results": [
                    {
                        "flagged": False,
                        "categories": {"violence": False, "harassment": False},
                        "category_scores": {"violence": 0.0001, "harassment": 0.0002},
                    }
                ],
            },
        )

    async def _rerank(self, seen: SeenRequest, responder: Responder) -> None:
        body = seen.json if isinstance(seen.json, dict) else {}
        documents = body.get("documents")
        if not isinstance(documents, list) or not isinstance(body.get("query"), str):
            await self.respond_json(
                responder, 400, self.error_body_for("query and documents are required")
            )
            return
        scored = sorted(
            ((index, 1.0 / (index + 1)) for index in range(len(documents))),
            key=lambda pair: -pair[1],
        )[: body.get("top_n") or len(documents)]
        await self.respond_json(
            responder,
            200,
            {
                "id": "rerank-1",
                "model": body.get("model"),
                "usage": {"total_tokens": self.rerank_tokens},
                "results": [
                    {
                        "index": index,
                        "relevance_score": score,
                        "document": {"text": documents[index]},
                    }
                    for index, score in scored
                ],
            },
        )
