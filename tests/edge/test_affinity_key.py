"""The affinity key per request (issue #26, dispatcher/api/affinity.py): the client's own,
else a hash of the conversation's stable prefix, the same whichever front end the client
speaks; and, end to end through a real edge, the key reaching admission (``Needs``)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from dispatcher.admission import Needs, needs_from_body
from dispatcher.api import anthropic as anthropic_front
from dispatcher.api import openai as openai_front
from dispatcher.api import responses as responses_front
from dispatcher.api.affinity import (
    RAW_PREFIX_CHARS,
    affinity_key,
    client_affinity_key,
    prefix_affinity_key,
    stable_prefix,
)
from dispatcher.api.anthropic._request import parse_messages_request, to_chat_body
from dispatcher.api.openai._request import parse_chat_request
from dispatcher.api.responses._request import chat_body, parse_responses_request
from dispatcher.config import EdgeConfig, HTTPSettings, NodeSettings, QueuePolicySettings
from dispatcher.edge import open_dispatcher
from dispatcher.gate import pool
from dispatcher.shared.transport import ConnectionClosed

from .fakes import ScriptedNode, connect, hello

# --------------------------------------------------------------------------- one conversation
# as each front end's client sends it

TEXT = st.text(alphabet="abcdefghijklmnopqrstuvwxyz ,.!?0123456789\n", min_size=1).filter(
    lambda text: bool(text.strip())
)


@st.composite
def conversations(draw: st.DrawFn) -> tuple[str, list[str], list[str]]:
    """A system prompt, the user turns, and the assistant's answers between them."""
    system = draw(TEXT)
    users = draw(st.lists(TEXT, min_size=1, max_size=5))
    answers = draw(st.lists(TEXT, min_size=len(users) - 1, max_size=len(users) - 1))
    return system, users, answers


def as_chat(system: str, users: list[str], answers: list[str]) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
    for number, user in enumerate(users):
        if number:
            messages.append({"role": "assistant", "content": answers[number - 1]})
        messages.append({"role": "user", "content": user})
    raw = orjson.dumps({"model": "m", "messages": messages})
    return parse_chat_request(raw).body


def as_responses(system: str, users: list[str], answers: list[str]) -> dict[str, Any]:
    items: list[dict[str, Any]] = []
    for number, user in enumerate(users):
        if number:
            items.append(
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": answers[number - 1]}],
                }
            )
        items.append({"type": "message", "role": "user", "content": user})
    raw = orjson.dumps({"model": "m", "instructions": system, "input": items})
    return chat_body(parse_responses_request(raw), [])


def as_messages(system: str, users: list[str], answers: list[str]) -> dict[str, Any]:
    messages: list[dict[str, Any]] = []
    for number, user in enumerate(users):
        if number:
            messages.append(
                {"role": "assistant", "content": [{"type": "text", "text": answers[number - 1]}]}
            )
        messages.append({"role": "user", "content": [{"type": "text", "text": user}]})
    raw = orjson.dumps({"model": "m", "max_tokens": 8, "system": system, "messages": messages})
    return to_chat_body(parse_messages_request(raw).body)


FRONT_ENDS = (as_chat, as_responses, as_messages)


@given(conversations())
def test_the_same_conversation_has_one_key_on_every_front_end(
    conversation: tuple[str, list[str], list[str]],
) -> None:
    keys = {affinity_key((), front(*conversation)) for front in FRONT_ENDS}
    assert len(keys) == 1
    (key,) = keys
    assert key is not None
    assert key == affinity_key((), as_chat(*conversation))  # deterministic


@given(conversations(), st.lists(TEXT, min_size=1, max_size=4), st.sampled_from(FRONT_ENDS))
def test_later_turns_keep_the_key(
    conversation: tuple[str, list[str], list[str]],
    more: list[str],
    front: Any,
) -> None:
    system, users, answers = conversation
    later = (system, [*users, *more], [*answers, *(f"answer {n}" for n in range(len(more)))])
    first: tuple[str, list[str], list[str]] = (system, users[:1], [])
    assert affinity_key((), front(*later)) == affinity_key((), front(*first))


@given(TEXT, TEXT, TEXT)
def test_different_system_prompts_or_first_questions_differ(
    system: str, other: str, user: str
) -> None:
    if system != other:
        assert prefix_affinity_key(as_chat(system, [user], [])) != prefix_affinity_key(
            as_chat(other, [user], [])
        )
        assert prefix_affinity_key(as_chat(user, [system], [])) != prefix_affinity_key(
            as_chat(user, [other], [])
        )


@given(TEXT, conversations(), conversations())
def test_the_clients_own_key_wins(
    own: str,
    one: tuple[str, list[str], list[str]],
    another: tuple[str, list[str], list[str]],
) -> None:
    header = ((b"x-session-affinity", own.encode()),)
    by_header = {affinity_key(header, as_chat(*c)) for c in (one, another)}
    by_body = {affinity_key((), {**as_chat(*c), "prompt_cache_key": own}) for c in (one, another)}
    by_user = {
        affinity_key((), {"metadata": {"user_id": own}}, as_messages(*c)) for c in (one, another)
    }
    assert len(by_header) == len(by_body) == len(by_user) == 1
    assert by_header == by_body == by_user  # one client key, one value, wherever it came
    assert by_header != {prefix_affinity_key(as_chat(*one))}


def test_the_order_of_the_client_keys() -> None:
    body = {"prompt_cache_key": "body", "metadata": {"user_id": "user"}}
    session = (b"x-session-id", b"session")
    affinity = (b"x-session-affinity", b"header")
    assert client_affinity_key((session, affinity), body) == client_affinity_key((affinity,), {})
    assert client_affinity_key((session,), body) == client_affinity_key(
        (), {"prompt_cache_key": "body"}
    )
    assert client_affinity_key((session,), {"metadata": {"user_id": "user"}}) == (
        client_affinity_key((), {"prompt_cache_key": "user"})
    )
    assert client_affinity_key((session,), {}) == client_affinity_key(
        (), {"prompt_cache_key": "session"}
    )
    # empty values are no key
    assert client_affinity_key(((b"x-session-affinity", b" "),), {"prompt_cache_key": ""}) is None


@given(conversations(), TEXT)
def test_nothing_secret_nor_readable_in_the_key(
    conversation: tuple[str, list[str], list[str]], secret: str
) -> None:
    body = as_chat(*conversation)
    key = affinity_key((), body)
    with_auth = affinity_key(
        ((b"authorization", f"Bearer {secret}".encode()), (b"x-api-key", secret.encode())), body
    )
    assert key == with_auth  # the credentials are no part of it
    assert key is not None
    assert len(key) == 32  # 128 bits, hex
    assert int(key, 16) >= 0
    own = client_affinity_key(((b"x-session-affinity", secret.encode()),), {})
    assert own is not None
    assert len(own) == 32  # hashed too
    assert own != secret.strip()


def test_the_stable_prefix() -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "be brief"},
        {"role": "developer", "content": [{"type": "text", "text": "and kind"}]},
        {
            "role": "user",
            "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "you"}],
        },
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "more"},
    ]
    assert stable_prefix(messages) == [
        ("system", "be brief"),
        ("system", "and kind"),
        ("user", "hi you"),
    ]
    assert stable_prefix([{"role": "assistant", "content": "first"}]) == []
    assert prefix_affinity_key({"messages": [{"role": "assistant", "content": "x"}]}) is None


def test_a_raw_prompt_keys_by_its_head() -> None:
    head = "x" * RAW_PREFIX_CHARS
    assert prefix_affinity_key({"prompt": head + "one"}) == prefix_affinity_key(
        {"prompt": [head + "two"]}
    )
    assert prefix_affinity_key({"prompt": "a" + head}) != prefix_affinity_key({"prompt": head})
    assert prefix_affinity_key({"prompt": ""}) is None
    # a prompt is never taken for the same conversation as chat messages of the same text
    assert prefix_affinity_key({"prompt": "hi"}) != prefix_affinity_key(
        {"messages": [{"role": "user", "content": "hi"}]}
    )


# --------------------------------------------------------------------------- end to end


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> list[Needs]:
    """Every ``Needs`` the gate's pool builds, recorded in process."""
    seen: list[Needs] = []
    real = needs_from_body

    def recording(*args: Any, **kwargs: Any) -> Needs:
        needs = real(*args, **kwargs)
        seen.append(needs)
        return needs

    monkeypatch.setattr(pool, "needs_from_body", recording)
    return seen


async def _edge_url(nursery: trio.Nursery, config: EdgeConfig) -> AsyncIterator[str]:
    async with open_dispatcher(config) as dispatcher:
        await dispatcher.attach_local_node()
        server = await nursery.start(dispatcher.serve)
        yield f"http://127.0.0.1:{server.address.port}"
        server.shutdown()


def _config(**fields: Any) -> EdgeConfig:
    return EdgeConfig(
        port=0,
        http=HTTPSettings(max_body_size=64 * 1024, shutdown_grace=5),
        nodes=NodeSettings(heartbeat_interval=1, heartbeat_timeout=5),
        **fields,
    )


@pytest.fixture
async def edge_url(nursery: trio.Nursery) -> AsyncIterator[str]:
    """An edge with affinity on (``[admission] affinity``): every request's key is made."""
    async for url in _edge_url(nursery, _config(admission=QueuePolicySettings(affinity=True))):
        yield url


KEYED = {
    "model": "echo",
    "prompt_cache_key": "conversation-7",
    "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
}


async def test_with_affinity_off_no_key_is_made(
    nursery: trio.Nursery, recorded: list[Needs], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Affinity off (the default) for the model and its fallbacks: no key is made for a
    request, whatever key it carries (nothing computed for what cannot route it); on for a
    fallback only, the key is made (the fallback may serve the request)."""
    made: list[str | None] = []
    real = affinity_key

    def counting(*args: Any) -> str | None:
        key = real(*args)
        made.append(key)
        return key

    for module in (openai_front, responses_front, anthropic_front):
        monkeypatch.setattr(module, "affinity_key", counting)
    async for url in _edge_url(nursery, _config()):
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            answer = await client.post(
                "/v1/chat/completions", json=KEYED, headers={"x-session-affinity": "c-7"}
            )
            assert answer.status_code == 200, answer.text
            answer = await client.post(
                "/v1/responses", json={"model": "echo", "input": "hi", "prompt_cache_key": "k"}
            )
            assert answer.status_code == 200, answer.text
    assert made == []
    assert [needs.affinity_key for needs in recorded] == [None, None]
    fallback_on = _config(
        models={
            "echo": QueuePolicySettings(fallbacks=("spare",)),
            "spare": QueuePolicySettings(affinity=True),
        }
    )
    async for url in _edge_url(nursery, fallback_on):
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            answer = await client.post("/v1/chat/completions", json=KEYED)
            assert answer.status_code == 200, answer.text
    expected = client_affinity_key((), {"prompt_cache_key": "conversation-7"})
    assert made == [expected]
    assert recorded[-1].affinity_key == expected


SYSTEM = "You answer in one word."
QUESTIONS = ("what is blue?", "and green?", "and red?")


async def test_the_key_reaches_admission_the_same_from_every_front_end(
    edge_url: str, recorded: list[Needs]
) -> None:
    chat_turns = [
        {
            "model": "echo",
            "messages": [
                {"role": "system", "content": SYSTEM},
                *(
                    m
                    for q in QUESTIONS[:n]
                    for m in ({"role": "user", "content": q}, {"role": "assistant", "content": q})
                ),
                {"role": "user", "content": QUESTIONS[n]},
            ],
        }
        for n in range(len(QUESTIONS))
    ]
    responses_first = {
        "model": "echo",
        "instructions": SYSTEM,
        "input": QUESTIONS[0],
    }
    messages_later = {
        "model": "echo",
        "max_tokens": 16,
        "system": [{"type": "text", "text": SYSTEM}],
        "messages": [
            {"role": "user", "content": QUESTIONS[0]},
            {"role": "assistant", "content": "blue"},
            {"role": "user", "content": QUESTIONS[1]},
        ],
    }
    other = {
        "model": "echo",
        "messages": [
            {"role": "system", "content": "Be loud."},
            {"role": "user", "content": QUESTIONS[0]},
        ],
    }
    async with httpx.AsyncClient(base_url=edge_url, timeout=10) as client:
        for body in chat_turns:
            answer = await client.post("/v1/chat/completions", json=body)
            assert answer.status_code == 200, answer.text
        answer = await client.post("/v1/responses", json=responses_first)
        assert answer.status_code == 200, answer.text
        answer = await client.post(
            "/v1/messages", json=messages_later, headers={"anthropic-version": "2023-06-01"}
        )
        assert answer.status_code == 200, answer.text
        answer = await client.post("/v1/chat/completions", json=other)
        assert answer.status_code == 200, answer.text
        answer = await client.post(
            "/v1/chat/completions",
            json={**other, "prompt_cache_key": "conversation-7"},
        )
        assert answer.status_code == 200, answer.text
        answer = await client.post(
            "/v1/chat/completions", json=other, headers={"x-session-affinity": "conversation-7"}
        )
        assert answer.status_code == 200, answer.text
    keys = [needs.affinity_key for needs in recorded]
    assert len(keys) == 8
    conversation = keys[0]
    assert conversation is not None
    assert keys[:5] == [conversation] * 5  # three chat turns, Responses, Messages
    assert keys[5] is not None
    assert keys[5] != conversation  # another system prompt
    assert keys[6] == keys[7] == client_affinity_key((), {"prompt_cache_key": "conversation-7"})
    assert keys[6] not in (conversation, keys[5])
    assert conversation == prefix_affinity_key(
        {
            "messages": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": QUESTIONS[0]},
            ]
        }
    )


async def _serve(node: ScriptedNode) -> None:
    """Answer every run on ``node`` until its connection closes."""
    try:
        while True:
            request = await node.receive_run()
            await node.emit(request.run_id, ("run.delta", {"text": "ok"}), ("run.completed", {}))
    except ConnectionClosed:
        pass


async def test_with_affinity_on_a_conversation_stays_on_one_node_whatever_it_speaks() -> None:
    """Three nodes, affinity on for the group (issue #26): every turn of a conversation, in
    any of the three APIs, reaches the same node; other conversations reach the others."""
    config = EdgeConfig(
        port=0,
        local_node=False,
        expose_node_ids=True,
        models={"m": QueuePolicySettings(affinity=True)},
    )
    async with open_dispatcher(config) as dispatcher, trio.open_nursery() as nursery:
        server = await nursery.start(dispatcher.serve)
        for name in ("node-a", "node-b", "node-c"):
            node = await connect(dispatcher, hello(name, slots=2))
            nursery.start_soon(_serve, node)
        url = f"http://127.0.0.1:{server.address.port}"

        def chat_turn(system: str, turns: int) -> dict[str, Any]:
            messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
            for n in range(turns):
                if n:
                    messages.append({"role": "assistant", "content": "ok"})
                messages.append({"role": "user", "content": QUESTIONS[n]})
            return {"model": "m", "messages": messages}

        served: list[str] = []
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:

            async def send(route: str, payload: dict[str, Any]) -> str:
                answer = await client.post(
                    route, json=payload, headers={"anthropic-version": "2023-06-01"}
                )
                assert answer.status_code == 200, answer.text
                return answer.headers["x-dispatcher-node"]

            for turns in (1, 2, 3):
                served.append(await send("/v1/chat/completions", chat_turn(SYSTEM, turns)))
            served.append(
                await send(
                    "/v1/responses", {"model": "m", "instructions": SYSTEM, "input": QUESTIONS[0]}
                )
            )
            served.append(
                await send(
                    "/v1/messages",
                    {
                        "model": "m",
                        "max_tokens": 16,
                        "system": SYSTEM,
                        "messages": [
                            {"role": "user", "content": QUESTIONS[0]},
                            {"role": "assistant", "content": "ok"},
                            {"role": "user", "content": QUESTIONS[1]},
                        ],
                    },
                )
            )
            others = {
                await send("/v1/chat/completions", chat_turn(f"System prompt number {n}.", 1))
                for n in range(12)
            }
        nursery.cancel_scope.cancel()
    assert len(set(served)) == 1, served  # one conversation, one node
    assert len(others) > 1  # twelve conversations are not all on one node
    stats = dispatcher.admission.statistics()
    assert stats.in_use == 0
