"""A normalized embeddings run's answer in OpenAI's shape (:func:`embeddings_body`): ``{"object":
"list", "data": [{"object": "embedding", "index": i, "embedding": ...}], "model": <the
client's model name>, "usage": {"prompt_tokens": n, "total_tokens": n}}``, each embedding a
list of floats, or with ``encoding_format: "base64"`` the base64 of its little-endian float32
values as the node sent it (``wire.RunEmbeddings``). The route (``api/openai/__init__.py``)
sends what :func:`render_embeddings` renders: a large answer in a worker thread.

A node's answer is not trusted: vectors that are not base64 of float32 values, or not one per
input, are a :class:`~dispatcher.errors.RunError` (502, ``upstream_bad_response``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Final

import orjson
import trio

from ... import wire
from ...errors import RunError
from ...shared.tokens import estimate_prompt_tokens

__all__ = ["IN_A_THREAD", "embeddings_body", "render_embeddings"]

IN_A_THREAD: Final = 256 * 1024
"""Characters of base64 vectors (about 48,000 values) from which the answer is rendered in a
worker thread: a large batch's floats (2,048 vectors of 1,536 values take ~0.6 s of CPU to
decode and write as JSON) would otherwise hold the edge's event loop for as long."""


async def render_embeddings(
    body: wire.JSONObject, events: Sequence[wire.RunEvent], usage: wire.Usage | None
) -> bytes:
    """:func:`embeddings_body` as JSON bytes; past :data:`IN_A_THREAD`, rendered in a worker
    thread, so that the event loop serves the edge's other requests meanwhile."""
    size = sum(
        len(vector)
        for event in events
        if isinstance(event, wire.RunEmbeddings)
        for vector in event.vectors
    )
    if size < IN_A_THREAD:
        return _render(body, events, usage)
    return await trio.to_thread.run_sync(_render, body, events, usage)


def _render(
    body: wire.JSONObject, events: Sequence[wire.RunEvent], usage: wire.Usage | None
) -> bytes:
    return orjson.dumps(embeddings_body(body, events, usage))


def embeddings_body(
    body: wire.JSONObject, events: Iterable[wire.RunEvent], usage: wire.Usage | None
) -> dict[str, Any]:
    """The answer to the embeddings request ``body`` (as the client sent it) from its run's
    ``events`` and the run's last ``usage`` (None: estimated from the inputs)."""
    vectors = [
        vector
        for event in events
        if isinstance(event, wire.RunEmbeddings)
        for vector in event.vectors
    ]
    inputs = len(wire.embedding_inputs(body))
    if len(vectors) != inputs:
        raise RunError(
            f"the node answered {len(vectors)} embeddings for {inputs} inputs",
            code="upstream_bad_response",
        )
    as_base64 = body.get("encoding_format") == "base64"
    data = []
    for index, vector in enumerate(vectors):
        try:
            values = wire.decode_vector(vector)
        except ValueError:  # binascii.Error is one
            raise RunError(
                f"the node's embedding {index} is not base64 of float32 values",
                code="upstream_bad_response",
            ) from None
        data.append(
            {"object": "embedding", "index": index, "embedding": vector if as_base64 else values}
        )
    # A node's counts are not trusted to be sane: never relay a negative count.
    prompt = estimate_prompt_tokens(body) if usage is None else max(0, usage.prompt_tokens)
    return {
        "object": "list",
        "data": data,
        "model": body["model"],
        "usage": {"prompt_tokens": prompt, "total_tokens": prompt},
    }
