"""``GET /v1/models`` and ``GET /v1/models/{id}`` (issue #13) against a real edge on 127.0.0.1
port 0: served groups and the configured aliases of served groups, one model by its name
(percent-decoded, as the OpenAI SDK sends a ``/``), 404 ``model_not_found`` otherwise; an
alias answered under the name the client asked for."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import openai
import pytest
import trio

from dispatcher.config import EdgeConfig, QueuePolicySettings
from dispatcher.edge import open_dispatcher

ALIASES = ("gpt-4o-mini", "org/echo-large")


@asynccontextmanager
async def open_edge(nursery: trio.Nursery) -> AsyncIterator[str]:
    config = EdgeConfig(
        port=0,
        api_keys=("sk-test",),
        models={
            "echo": QueuePolicySettings(aliases=ALIASES),
            "absent": QueuePolicySettings(aliases=("nobody-serves-this",)),
        },
    )
    async with open_dispatcher(config) as dispatcher:
        await dispatcher.attach_local_node()
        server = await nursery.start(dispatcher.serve)
        yield f"http://127.0.0.1:{server.address.port}"
        server.shutdown()


def sdk(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="sk-test", max_retries=0)


async def test_the_list_has_served_groups_and_their_aliases(nursery: trio.Nursery) -> None:
    async with open_edge(nursery) as url, sdk(url) as client:
        listed = [model.id async for model in client.models.list()]
    # "absent" is configured but not served: neither it nor its alias is listed.
    assert listed == sorted(["echo", *ALIASES])


@pytest.mark.parametrize("name", ["echo", *ALIASES])
async def test_one_model_by_name_or_alias(nursery: trio.Nursery, name: str) -> None:
    async with open_edge(nursery) as url, sdk(url) as client:
        model = await client.models.retrieve(name)
        listed = {m.id: m async for m in client.models.list()}
    assert (model.id, model.object, model.owned_by) == (name, "model", "trio-dispatcher")
    assert model == listed[name]


@pytest.mark.parametrize("name", ["gpt-nope", "absent", "nobody-serves-this"])
async def test_an_unknown_model_is_404_model_not_found(nursery: trio.Nursery, name: str) -> None:
    async with open_edge(nursery) as url, sdk(url) as client:
        with pytest.raises(openai.NotFoundError) as missing:
            await client.models.retrieve(name)
    assert missing.value.code == "model_not_found"
    assert name in missing.value.message


async def test_the_route_needs_a_key_and_takes_no_query(nursery: trio.Nursery) -> None:
    async with open_edge(nursery) as url, httpx.AsyncClient(base_url=url) as client:
        anonymous = await client.get("/v1/models/echo")
        assert anonymous.status_code == 401
        headers = {"authorization": "Bearer sk-test"}
        query = await client.get("/v1/models/echo", params={"x": "1"}, headers=headers)
        assert query.status_code == 400
        post = await client.post("/v1/models/echo", headers=headers)
        assert post.status_code == 405
        assert post.headers["allow"] == "GET, HEAD, OPTIONS"
        head = await client.head("/v1/models/echo", headers=headers)
        assert head.status_code == 200


async def test_an_alias_is_answered_under_its_own_name(nursery: trio.Nursery) -> None:
    async with open_edge(nursery) as url, sdk(url) as client:
        chat = await client.chat.completions.create(
            model="gpt-4o-mini", messages=[{"role": "user", "content": "hi there"}]
        )
        response = await client.responses.create(model="org/echo-large", input="hello")
    assert chat.model == "gpt-4o-mini"
    assert chat.choices[0].message.content == "hi there"
    assert response.model == "org/echo-large"
