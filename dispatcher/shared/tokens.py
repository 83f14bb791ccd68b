"""The one token estimator, for text whose real count nobody reported.

Both sides use it: a node's adapter when its engine reports no usage (``Usage.estimated``),
the edge when a run or tunnel ended without any usage at all. It lives in the protocol leaf
because ``nodes/`` may import nothing else of the edge.

The estimate is the larger of the word count and a quarter of the length in characters,
rounded up (English averages ~4 characters and ~0.75 words per token).
"""

from __future__ import annotations

import math
import re
from typing import Any

_WORD_START = re.compile(r"\s\S")


def tokens_for_chars(chars: int) -> int:
    """The character half of the estimate: a quarter of ``chars``, rounded up (what is left
    when only a length is known)."""
    return math.ceil(chars / 4)


def estimate_tokens(text: str) -> int:
    """A rough token count of ``text`` (see the module docstring)."""
    return max(len(text.split()), tokens_for_chars(len(text)))


class TokenEstimator:
    """:func:`estimate_tokens` computed incrementally over a stream of pieces, without keeping
    the text (a word split across two pieces counts once)."""

    __slots__ = ("_after_space", "chars", "words")

    def __init__(self) -> None:
        self.chars = 0
        self.words = 0
        self._after_space = True

    def add(self, text: str) -> None:
        if not text:
            return
        self.chars += len(text)
        self.words += len(_WORD_START.findall((" " if self._after_space else "x") + text))
        self._after_space = text[-1].isspace()

    @property
    def tokens(self) -> int:
        return max(self.words, tokens_for_chars(self.chars))


def message_text(message: Any) -> str:
    """The text of one chat message: its string ``content``, or the ``text`` parts of a list
    ``content`` joined by newlines. Anything else (images, tool calls, junk) counts as no
    text."""
    if not isinstance(message, dict):
        return ""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(
            part["text"]
            for part in content
            if isinstance(part, dict)
            and part.get("type") == "text"
            and isinstance(part.get("text"), str)
        )
    return ""


def estimate_prompt_tokens(body: dict[str, Any]) -> int:
    """:func:`estimate_tokens` over a request body's text: every chat message, and for the
    routes that take them (completions, embeddings), ``prompt`` and ``input`` as a string or
    a list of strings; token ids (a list of them, or of lists of them) count one each."""
    tokens = 0
    messages = body.get("messages")
    if isinstance(messages, list):
        tokens += sum(estimate_tokens(message_text(m)) for m in messages)
    for key in ("prompt", "input"):
        value = body.get(key)
        if isinstance(value, str):
            tokens += estimate_tokens(value)
        elif isinstance(value, list):
            for item in value:
                if isinstance(item, str):
                    tokens += estimate_tokens(item)
                elif isinstance(item, list):
                    tokens += len(item)
                elif type(item) is int:
                    tokens += 1
    return tokens


__all__ = [
    "TokenEstimator",
    "estimate_prompt_tokens",
    "estimate_tokens",
    "message_text",
    "tokens_for_chars",
]
