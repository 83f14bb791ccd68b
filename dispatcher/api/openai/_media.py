"""The OpenAI front end's other tunnel routes: images, audio, moderations and rerank, relayed
to tunnel providers that declare the route (``routes`` in the node's ``[[providers]]``):

============================  ===============  ===========================================
path                          route            body
============================  ===============  ===========================================
``/v1/images/generations``    ``images``       JSON
``/v1/images/edits``          ``images``       multipart (or JSON)
``/v1/images/variations``     ``images``       multipart
``/v1/audio/transcriptions``  ``audio``        multipart
``/v1/audio/translations``    ``audio``        multipart
``/v1/audio/speech``          ``audio``        JSON in, audio bytes out
``/v1/moderations``           ``moderations``  JSON
``/v1/rerank``                ``rerank``       JSON (the Cohere / Jina shape vLLM and
                                               llama.cpp serve)
============================  ===============  ===========================================

The body is read only for its ``model`` (and a form's ``stream``): a JSON body must be an
object with a non-empty string ``model``; a ``multipart/form-data`` body must be well formed
(:mod:`._multipart`) with exactly one text field ``model``. Anything else is the provider's to
judge. A body goes to the provider as the client sent it, but for the ``model``, replaced by
the served name when it differs (a JSON body re-serialized, as the other tunnel routes do; a
form's ``model`` field replaced in place, every other byte kept). It travels to the node as
binary frames after ``tunnel.request`` (``TunnelCall.raw_body``), so its size is bounded only
by the edge's request-body limit (``http.max_body_size``: 413 beyond).

The answer is relayed as the provider sent it, binary ones (speech audio) included, with
their content type; the ``model`` member of a JSON answer is renamed back as on the other
tunnel routes. Usage, one row per attempt: what the answer says (:func:`media_usage`), else
0 tokens, estimated -- never an invented count.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Final

import attrs
import orjson

from ... import wire
from ...errors import BadRequest
from ...gate.attempts import TunnelAnswer
from ...http import Responder
from ...paths.tunnel_http import usage_of
from ..common import ModelCall, both, model_route, serving, tunnel_only
from ..tunnel_relay import relay
from ..validation import BOOLEAN, NON_EMPTY, Object, load_object, validate
from ._multipart import boundary_of, fields, is_multipart, parse_form, replace_field, text_field

MEDIA_ROUTES: Final[Mapping[str, wire.RouteName]] = {
    "/v1/images/generations": "images",
    "/v1/images/edits": "images",
    "/v1/images/variations": "images",
    "/v1/audio/transcriptions": "audio",
    "/v1/audio/translations": "audio",
    "/v1/audio/speech": "audio",
    "/v1/moderations": "moderations",
    "/v1/rerank": "rerank",
}
"""Each path and the route (``wire.RouteName``) a provider must declare to be offered it."""

MEDIA_JSON: Final = Object({"model": NON_EMPTY, "stream": BOOLEAN}, required=("model",))
"""What the edge checks of a JSON body (the provider checks the rest)."""


@attrs.frozen(kw_only=True)
class MediaRequest:
    """What the edge reads of a media request: its model, whether it asked for a stream, and
    the body for the provider given the served name (``TunnelCall.raw_body``)."""

    model: str
    stream: bool
    raw_body: Callable[[str], bytes]


def parse_media_request(raw: bytes, content_type: bytes | None) -> MediaRequest:
    """Read a media request's body (multipart when its ``Content-Type`` says so, JSON
    otherwise); raise :class:`BadRequest` when it is malformed or names no model."""
    if is_multipart(content_type):
        assert content_type is not None
        return _form_request(raw, boundary_of(content_type))
    body = load_object(raw)
    validate(body, MEDIA_JSON)
    model: str = body["model"]

    def for_provider(served: str) -> bytes:
        return raw if served == model else orjson.dumps({**body, "model": served})

    return MediaRequest(model=model, stream=body.get("stream") is True, raw_body=for_provider)


def _form_request(raw: bytes, boundary: bytes) -> MediaRequest:
    parts = parse_form(raw, boundary)
    model = text_field(raw, parts, "model")
    if model is None:
        raise BadRequest(
            "'model': a non-empty string is required (a form field)",
            param="model",
            code="missing_required_parameter",
        )
    if not model:
        raise BadRequest(
            "'model': a non-empty string is required, got ''", param="model", code="invalid_value"
        )
    stream = (text_field(raw, parts, "stream") or "").strip().lower() == "true"
    (model_part,) = fields(parts, "model")

    def for_provider(served: str) -> bytes:
        if served == model:
            return raw
        try:
            return replace_field(raw, boundary, model_part, served)
        except ValueError:
            return raw  # a served name no form can hold: the provider sees the client's

    return MediaRequest(model=model, stream=stream, raw_body=for_provider)


# --------------------------------------------------------------------------- usage


def _count(value: object) -> int | None:
    return value if type(value) is int and value >= 0 else None


def _tokens(usage: Mapping[str, Any], prompt_key: str, completion_key: str) -> wire.Usage | None:
    prompt = _count(usage.get(prompt_key))
    completion = _count(usage.get(completion_key, 0))
    if prompt is None or completion is None:
        return None
    return wire.Usage(prompt_tokens=prompt, completion_tokens=completion)


def media_usage(value: object) -> wire.Usage | None:
    """The usage a media answer reports, in the first shape that fits:

    - OpenAI's ``usage.prompt_tokens`` / ``completion_tokens`` (:func:`usage_of`; llama.cpp's
      rerank);
    - ``usage.input_tokens`` / ``output_tokens`` (gpt-image's images, a ``gpt-4o-transcribe``
      transcription's ``"type": "tokens"`` usage);
    - ``usage.total_tokens`` alone, as input tokens (vLLM's and Jina's rerank);
    - ``meta.billed_units.input_tokens`` / ``output_tokens`` (Cohere).

    None otherwise (DALL-E images, ``whisper-1``'s ``"type": "duration"`` usage in seconds,
    speech audio, moderations, Cohere's ``search_units`` alone): the row then counts 0,
    estimated."""
    reported = usage_of(value)
    if reported is not None or not isinstance(value, dict):
        return reported
    usage = value.get("usage")
    if isinstance(usage, dict):
        if "input_tokens" in usage:
            return _tokens(usage, "input_tokens", "output_tokens")
        total = _count(usage.get("total_tokens"))
        if total is not None:
            return wire.Usage(prompt_tokens=total, completion_tokens=0)
    meta = value.get("meta")
    billed = meta.get("billed_units") if isinstance(meta, dict) else None
    if isinstance(billed, dict) and ("input_tokens" in billed or "output_tokens" in billed):
        return _tokens({"input_tokens": 0, **billed}, "input_tokens", "output_tokens")
    return None


# --------------------------------------------------------------------------- the route


@model_route
async def media_route(call: ModelCall, responder: Responder) -> str:
    """Any path of :data:`MEDIA_ROUTES`: relayed through a tunnel to a provider declaring its
    route."""
    path = call.request.path
    media = parse_media_request(await call.request.body(), call.request.header(b"content-type"))
    # The edge's view of the body is its model: nothing else in it is counted or estimated.
    named = {"model": media.model}
    gated = await call.gate_request(
        named,
        stream=media.stream,
        predicate=both(serving(MEDIA_ROUTES[path]), tunnel_only(path)),
        raw_body=media.raw_body,
    )
    async with call.edge.gate.open(gated) as answer:
        assert isinstance(answer, TunnelAnswer), "the predicate admits tunnels only"
        return await relay(
            call.edge,
            answer,
            named,
            responder,
            call.ctx.headers,
            read_usage=media_usage,
            estimate=False,
        )


__all__ = [
    "MEDIA_JSON",
    "MEDIA_ROUTES",
    "MediaRequest",
    "media_route",
    "media_usage",
    "parse_media_request",
]
