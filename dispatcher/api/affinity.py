"""A request's affinity key (issue #26), sans-IO: what cache-aware routing sends the same
conversation to the same node by (the admission core ranks a model's candidates by it).

The key is, in this order of precedence, the first that is present:

1. the ``x-session-affinity`` header;
2. the body's ``prompt_cache_key`` (OpenAI's chat completions and Responses APIs);
3. the body's ``metadata.user_id`` (Anthropic's Messages API);
4. the ``x-session-id`` header (the dispatcher's own session header);
5. else a hash of the conversation's **stable prefix**: its leading system messages (the
   Responses API's ``instructions``, the Messages API's ``system``, chat's ``system`` and
   ``developer`` messages) and its first user message -- what every later turn of the
   conversation resends unchanged. It is rendered from the chat body each front end builds
   (the Responses and Messages APIs translate theirs to it) as role and text only, so the
   same conversation has the same key whichever of the three APIs the client speaks.

Both kinds are hashed (BLAKE2b, 128 bits, under their own personalization): the key reveals
nothing of the prompt nor of the client's own key, and a client key and a prefix never share
a value. Nothing secret goes in (no API key, no authorization header). The raw prompt of
``/v1/completions`` (a tunnel route) has no structure: its first :data:`RAW_PREFIX_CHARS`
characters stand for its prefix.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final

import orjson

__all__ = [
    "RAW_PREFIX_CHARS",
    "affinity_key",
    "client_affinity_key",
    "prefix_affinity_key",
    "stable_prefix",
]

RAW_PREFIX_CHARS: Final = 2048
"""How much of a raw completions prompt stands for its stable prefix (about 500 tokens: a
system prompt's worth, which a conversation's later turns resend)."""

_CLIENT_HEADERS: Final = (b"x-session-affinity",)
_SESSION_HEADER: Final = b"x-session-id"
_SYSTEM_ROLES: Final = frozenset({"system", "developer"})


def _digest(kind: bytes, data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16, person=b"affinity-" + kind).hexdigest()


def _header(headers: Iterable[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    for key, value in headers:
        if key.lower() == name:
            return value
    return None


def client_affinity_key(
    headers: Iterable[tuple[bytes, bytes]], body: Mapping[str, Any]
) -> str | None:
    """The client's own key, hashed: ``x-session-affinity``, ``prompt_cache_key``,
    ``metadata.user_id``, ``x-session-id`` (the first present and not blank), or None.
    ``body`` is the body as the client sent it (before a front end translates it)."""
    headers = tuple(headers)
    metadata = body.get("metadata")
    candidates = (
        *(_header(headers, name) for name in _CLIENT_HEADERS),
        body.get("prompt_cache_key"),
        metadata.get("user_id") if isinstance(metadata, Mapping) else None,
        _header(headers, _SESSION_HEADER),
    )
    chosen: bytes | None = None
    for candidate in candidates:
        value = candidate.encode() if isinstance(candidate, str) else candidate
        if isinstance(value, bytes) and value.strip():
            chosen = value.strip()  # surrounding blanks are no part of a key
            break
    return None if chosen is None else _digest(b"client", chosen)


def _text(content: Any) -> str:
    """A chat message's text: a string as it is, an array's text parts joined (images and
    other parts carry no text: they are not part of the key)."""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        return "".join(
            part["text"]
            for part in content
            if isinstance(part, Mapping) and isinstance(part.get("text"), str)
        )
    return ""


def stable_prefix(messages: Sequence[Mapping[str, Any]]) -> list[tuple[str, str]]:
    """The part of a chat conversation its later turns resend unchanged, as (role, text)
    pairs: the leading system messages (``developer`` counted as ``system``) and the first
    user message after them. Empty when the conversation starts otherwise (an assistant
    message first: no stable prefix worth a key)."""
    prefix: list[tuple[str, str]] = []
    for message in messages:
        role = message.get("role")
        if role in _SYSTEM_ROLES:
            prefix.append(("system", _text(message.get("content"))))
            continue
        if role == "user":
            prefix.append(("user", _text(message.get("content"))))
        break
    return prefix


def prefix_affinity_key(chat_body: Mapping[str, Any]) -> str | None:
    """The hash of a chat body's :func:`stable_prefix` (or of a completions body's first
    :data:`RAW_PREFIX_CHARS` prompt characters), or None when it has none."""
    messages = chat_body.get("messages")
    if isinstance(messages, Sequence) and not isinstance(messages, str):
        prefix = stable_prefix([m for m in messages if isinstance(m, Mapping)])
        if not prefix:
            return None
        return _digest(b"prefix", orjson.dumps(prefix))
    prompt = chat_body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return _digest(b"raw", prompt[:RAW_PREFIX_CHARS].encode())
    return None


def affinity_key(
    headers: Iterable[tuple[bytes, bytes]],
    client_body: Mapping[str, Any],
    chat_body: Mapping[str, Any] | None = None,
) -> str | None:
    """The request's affinity key: the client's own (:func:`client_affinity_key`, from the
    headers and ``client_body``, the body as sent), else the hash of the stable prefix of
    ``chat_body`` (the chat body the front end dispatches; ``client_body`` when it is None),
    else None."""
    return client_affinity_key(headers, client_body) or prefix_affinity_key(
        client_body if chat_body is None else chat_body
    )
