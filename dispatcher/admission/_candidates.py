"""Candidates (one model on one provider on one node generation) and a request's needs.

A candidate has two names: its :class:`CandidateKey` names one node *session* (it holds the
generation, so a reconnect makes a new key), its :class:`CandidateIdentity` names the
provider's model on the node whatever the session (what exclusions and health are about).

Sans-IO: no Trio, no clock. :func:`needs_from_body` derives :class:`Needs` from an OpenAI
chat-completions body; :meth:`Needs.unfit` says, as a readable reason, why a candidate cannot
serve the request (or ``None`` when it can).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, Final, Literal, TypeAlias

import attrs

from ..shared.tokens import tokens_for_chars
from ..wire import (
    DEFAULT_TUNNEL_ROUTES,
    NORMALIZED_ROUTES,
    ExecutionPath,
    ModelInfo,
    ProviderInfo,
)

RequestClass: TypeAlias = Literal["short", "long"]
"""``"long"`` for requests of at least the group's ``long_context_tokens`` estimated tokens."""

CAPABILITIES: Final = ("tools", "json", "vision")
"""The capability names :class:`Needs` can ask for, in the order reasons name them."""


@attrs.frozen(order=True)
class CandidateIdentity:
    """A candidate across node sessions: ``(node_id, provider_id, model)``, no generation.
    A node that reconnects keeps it; ``model`` is the public model group name."""

    node_id: str
    provider_id: str
    model: str


@attrs.frozen(order=True)
class CandidateKey:
    """Identifies a candidate in one node session; ``model`` is the public model group name."""

    node_id: str
    generation: int
    provider_id: str
    model: str

    @property
    def identity(self) -> CandidateIdentity:
        """The same candidate in any generation of the node."""
        return CandidateIdentity(self.node_id, self.provider_id, self.model)


def _frozenset(value: Iterable[str]) -> frozenset[str]:
    return frozenset(value)


def _default_routes(path: ExecutionPath) -> frozenset[str]:
    return frozenset(DEFAULT_TUNNEL_ROUTES if path == "tunnel" else NORMALIZED_ROUTES)


@attrs.frozen(kw_only=True)
class Candidate:
    """One public model group served by one provider of one node session (generation).

    ``slots`` is its total concurrency; ``long_context_slots`` how many of them long requests
    may hold (see ``docs/admission.md`` for the exact rule).
    """

    node_id: str
    generation: int
    provider_id: str
    provider_type: str
    adapter: str
    model: str
    served_model: str
    path: ExecutionPath = "normalized"
    capabilities: frozenset[str] = attrs.field(default=frozenset(), converter=_frozenset)
    slots: int = 1
    long_context_slots: int = 0
    context_window: int | None = None
    node_label: str = ""
    routes: frozenset[str] = attrs.field(
        default=attrs.Factory(lambda self: _default_routes(self.path), takes_self=True),
        converter=_frozenset,
    )
    """The APIs it serves (``wire.RouteName``): a route's admission offers it only these; by
    default, its path's (``wire.DEFAULT_TUNNEL_ROUTES``, ``wire.NORMALIZED_ROUTES``)."""

    @property
    def key(self) -> CandidateKey:
        return CandidateKey(self.node_id, self.generation, self.provider_id, self.model)

    @property
    def identity(self) -> CandidateIdentity:
        return CandidateIdentity(self.node_id, self.provider_id, self.model)

    @property
    def label(self) -> str:
        """``node/provider``, the prefix of every reason about this candidate."""
        return f"{self.node_id}/{self.provider_id}"

    @property
    def node_name(self) -> str:
        """What a person is shown of the node: its label, or its id when it has none."""
        return self.node_label or self.node_id

    @classmethod
    def from_info(
        cls,
        *,
        node_id: str,
        generation: int,
        provider: ProviderInfo,
        model: ModelInfo,
        node_label: str = "",
    ) -> Candidate:
        """The candidate a node's ``hello`` announces for ``model`` on ``provider``."""
        return cls(
            node_id=node_id,
            generation=generation,
            provider_id=provider.id,
            provider_type=provider.type,
            adapter=provider.adapter,
            model=model.name,
            served_model=model.served_name,
            path=provider.path,
            capabilities=model.capabilities,
            slots=model.slots,
            long_context_slots=model.long_context_slots,
            context_window=model.context_window,
            node_label=node_label,
            routes=provider.served_routes,
        )


Predicate: TypeAlias = Callable[[Candidate], str | None]
"""An extra test of a candidate: a rejection reason, or ``None`` when it may serve. It must be
pure (same answer for the same candidate), because the core applies it again while queued."""


def _identities(exclude: frozenset[CandidateKey]) -> frozenset[CandidateIdentity]:
    return frozenset(key.identity for key in exclude)


@attrs.frozen(kw_only=True)
class Needs:
    """What a request needs of a candidate. ``exclude`` holds candidates that already failed
    for this request (recovery); it matches by :class:`CandidateIdentity`, so a candidate
    stays excluded when its node reconnects as a new generation. ``session_id`` asks for the
    node that served the session last, when it has a free slot."""

    tools: bool = False
    json: bool = False
    vision: bool = False
    estimated_tokens: int = 0
    predicate: Predicate | None = attrs.field(default=None, eq=False)
    exclude: frozenset[CandidateKey] = frozenset()
    session_id: str | None = None
    affinity_key: str | None = None
    """The request's affinity key (issue #26: the client's own, or a hash of its stable
    prefix): the candidate it ranks first is preferred where the group's policy turns
    affinity on."""
    _excluded: frozenset[CandidateIdentity] = attrs.field(
        init=False,
        eq=False,
        repr=False,
        default=attrs.Factory(lambda self: _identities(self.exclude), takes_self=True),
    )

    @property
    def capabilities(self) -> frozenset[str]:
        wanted = (self.tools, self.json, self.vision)
        return frozenset(name for name, want in zip(CAPABILITIES, wanted, strict=True) if want)

    def request_class(self, long_context_tokens: int | None) -> RequestClass:
        if long_context_tokens is not None and self.estimated_tokens >= long_context_tokens:
            return "long"
        return "short"

    def excludes(self, candidate: Candidate) -> bool:
        """The request excluded ``candidate`` (it already failed for this request)."""
        return bool(self._excluded) and candidate.identity in self._excluded

    def unfit(self, candidate: Candidate, request_class: RequestClass = "short") -> str | None:
        """Why ``candidate`` cannot serve this request (``"node/provider: ..."``), or None."""
        if self._excluded and candidate.identity in self._excluded:
            return f"{candidate.label}: already failed for this request"
        if self.tools or self.json or self.vision:
            for name, wanted in zip(
                CAPABILITIES, (self.tools, self.json, self.vision), strict=True
            ):
                if wanted and name not in candidate.capabilities:
                    return f"{candidate.label}: lacks capability {name!r}"
        window = candidate.context_window
        if window is not None and self.estimated_tokens > window:
            return (
                f"{candidate.label}: context window {window} < "
                f"{self.estimated_tokens} estimated tokens"
            )
        if request_class == "long" and candidate.long_context_slots <= 0:
            return (
                f"{candidate.label}: no long-context slots for a long request "
                f"({self.estimated_tokens} estimated tokens)"
            )
        if self.predicate is not None:
            try:
                reason = self.predicate(candidate)
            except Exception as exc:  # user code must not break the core mid-operation
                return f"{candidate.label}: predicate raised {type(exc).__name__}: {exc}"
            if reason is not None:
                return f"{candidate.label}: {reason}"
        return None


_IMAGE_PARTS: Final = frozenset({"image_url", "input_image"})
_JSON_FORMATS: Final = frozenset({"json_object", "json_schema"})


def needs_from_body(
    body: Mapping[str, Any],
    *,
    session_id: str | None = None,
    affinity_key: str | None = None,
    predicate: Predicate | None = None,
    exclude: frozenset[CandidateKey] = frozenset(),
) -> Needs:
    """The needs of an OpenAI chat-completions body (with the request's ``session_id``,
    ``predicate`` and ``exclude``, which the body does not say).

    ``tools`` (or the legacy ``functions``) non-empty -> tools, unless ``tool_choice`` (for
    ``functions``: ``function_call``) is ``"none"``: then the model may not call any, so a
    candidate without the capability can serve it (the body is forwarded as it is, tools
    included); ``response_format.type`` ``json_object`` or
    ``json_schema`` -> json; a content part of type ``image_url`` / ``input_image`` -> vision;
    estimated tokens = characters of all message text / 4 (rounded up) + ``max_tokens``
    (or ``max_completion_tokens``, or 0). Malformed parts are ignored: validating the body is
    the API layer's job, this only has to be cheap and never raise.
    """
    tools = (bool(body.get("tools")) and body.get("tool_choice") != "none") or (
        bool(body.get("functions")) and body.get("function_call") != "none"
    )
    response_format = body.get("response_format")
    json = isinstance(response_format, Mapping) and response_format.get("type") in _JSON_FORMATS
    vision = False
    chars = 0
    messages = body.get("messages")
    if isinstance(messages, list):
        for message in messages:
            if not isinstance(message, Mapping):
                continue
            content = message.get("content")
            if isinstance(content, str):
                chars += len(content)
            elif isinstance(content, list):
                for part in content:
                    if not isinstance(part, Mapping):
                        continue
                    if part.get("type") in _IMAGE_PARTS:
                        vision = True
                    text = part.get("text")
                    if isinstance(text, str):
                        chars += len(text)
    max_tokens = body.get("max_tokens")
    if max_tokens is None:
        max_tokens = body.get("max_completion_tokens")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 0:
        max_tokens = 0
    return Needs(
        tools=tools,
        json=json,
        vision=vision,
        estimated_tokens=tokens_for_chars(chars) + max_tokens,
        predicate=predicate,
        exclude=exclude,
        session_id=session_id,
        affinity_key=affinity_key,
    )
