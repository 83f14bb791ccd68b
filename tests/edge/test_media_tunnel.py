"""Images, audio, moderations and rerank through a tunnel, end to end: the official ``openai``
SDK (and httpx for rerank) -> a real edge on 127.0.0.1 -> a real ``dispatcher node`` process
-> fake providers on loopback written from the OpenAI and Cohere / Jina rerank references
(``tests/edge/fake_media.py``), and back.

One model group, ``studio``, is served by two tunnel providers of the node: ``media``
declares ``routes = ["images", "audio", "moderations", "rerank"]``, ``plain`` declares none
(an OpenAI-compatible server's default: chat, completions, embeddings). So every media
request goes to ``media`` and every chat request to ``plain`` -- never an attempt on the
other one.
"""

from __future__ import annotations

import base64
import functools
import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import httpx
import openai
import orjson
import trio

from dispatcher import wire
from dispatcher.config import EdgeConfig, HTTPSettings, NodeSettings
from dispatcher.edge import Dispatcher, open_dispatcher
from dispatcher.http import Server
from dispatcher.store.usage import UsageRow

from ..nodes.fake_providers import FakeOpenAI, _serve
from .fake_media import FakeMedia
from .fakes import wait_until

CLIENT_KEY = "client-key-media-5e1f"
NODE_TOKEN = "node-token-media-93aa"
KEY_ENV = "TRIO_DISPATCHER_TEST_MEDIA_KEY"
MEDIA_KEY = "sk-media-provider-0b7d"
MODEL = "studio"
SERVED = "gpt-image-1"
"""What the ``media`` provider calls the group (the edge renames it both ways)."""
CHAT_ONLY = "chatty"
"""A group only ``plain`` serves."""
MAX_BODY = 2 * 1024 * 1024


def node_toml(edge_port: int, media_url: str, plain_url: str) -> str:
    return f"""
[node]
id = "media-node"
edge_url = "ws://127.0.0.1:{edge_port}/v1/nodes/connect"
token_env = "TRIO_DISPATCHER_TEST_NODE_TOKEN"
drain_grace = 1

[[providers]]
id = "media"
type = "openai"
path = "tunnel"
base_url = "{media_url}/v1"
api_key_env = "{KEY_ENV}"
routes = ["images", "audio", "moderations", "rerank"]

  [[providers.models]]
  name = "{MODEL}"
  served_name = "{SERVED}"
  slots = 4

[[providers]]
id = "plain"
type = "openai"
path = "tunnel"
base_url = "{plain_url}/v1"

  [[providers.models]]
  name = "{MODEL}"
  served_name = "fake-model"
  slots = 4

  [[providers.models]]
  name = "{CHAT_ONLY}"
  served_name = "fake-model"
  slots = 4
"""


@attrs.define(eq=False)
class Env:
    dispatcher: Dispatcher
    server: Server
    media: FakeMedia
    plain: FakeOpenAI

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.address.port}"

    def http(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            base_url=self.url, headers={"authorization": f"Bearer {CLIENT_KEY}"}, timeout=30
        )

    def sdk(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=CLIENT_KEY, max_retries=0)

    async def rows(self, request_id: str, count: int = 1) -> list[UsageRow]:
        """The usage rows of the request sent with ``x-request-id: request_id``, once there
        are ``count`` -- and no more a moment later."""
        ledger = self.dispatcher.ledger

        async def mine() -> list[UsageRow]:
            report = await ledger.query()
            return sorted(
                (r for r in report.rows if r.client_request_id == request_id),
                key=lambda r: r.attempt,
            )

        with trio.fail_after(10):
            while len(await mine()) < count:
                await trio.sleep(0.01)
        await trio.sleep(0.05)
        rows = await mine()
        assert len(rows) == count, rows
        return rows

    async def all_rows(self) -> list[UsageRow]:
        return list((await self.dispatcher.ledger.query()).rows)

    async def slots_free(self) -> None:
        admission = self.dispatcher.admission
        await wait_until(
            lambda: (admission.statistics().in_use, admission.statistics().draining) == (0, 0)
        )
        assert admission.statistics().drains_expired == 0


@asynccontextmanager
async def open_env(tmp_path: Path) -> AsyncIterator[Env]:
    config = EdgeConfig(
        port=0,
        local_node=False,
        expose_node_ids=True,
        api_keys=(CLIENT_KEY,),
        http=HTTPSettings(max_body_size=MAX_BODY),
        nodes=NodeSettings(tokens=(NODE_TOKEN,), heartbeat_interval=1, heartbeat_timeout=5),
    )
    async with open_dispatcher(config) as dispatcher, trio.open_nursery() as nursery:
        media: FakeMedia = await nursery.start(_serve, FakeMedia(api_key=MEDIA_KEY))
        plain: FakeOpenAI = await nursery.start(_serve, FakeOpenAI())
        server: Server = await nursery.start(dispatcher.serve)
        path = tmp_path / "node.toml"
        path.write_text(node_toml(server.address.port, media.base_url, plain.base_url))
        env = {
            **os.environ,
            KEY_ENV: MEDIA_KEY,
            "TRIO_DISPATCHER_TEST_NODE_TOKEN": NODE_TOKEN,
        }
        command = [sys.executable, "-m", "dispatcher", "node", "--config", str(path)]
        run = functools.partial(trio.run_process, command, env=env, check=False)
        node = await nursery.start(run)
        try:
            with trio.fail_after(30):
                while "media-node" not in dispatcher.registry.sessions:
                    await dispatcher.registry.wait_changed()
            yield Env(dispatcher, server, media, plain)
        finally:
            node.terminate()
            with trio.move_on_after(10):
                await node.wait()
            nursery.cancel_scope.cancel()


def wav(size: int) -> bytes:
    """A RIFF/WAVE header and ``size`` bytes of 16-bit PCM (a sawtooth)."""
    data = bytes(i % 256 for i in range(size))
    header = (
        b"RIFF"
        + (36 + size).to_bytes(4, "little")
        + b"WAVEfmt "
        + (16).to_bytes(4, "little")
        + (1).to_bytes(2, "little")  # PCM
        + (1).to_bytes(2, "little")  # mono
        + (16000).to_bytes(4, "little")
        + (32000).to_bytes(4, "little")
        + (2).to_bytes(2, "little")
        + (16).to_bytes(2, "little")
        + b"data"
        + size.to_bytes(4, "little")
    )
    return header + data


def counts(row: UsageRow) -> tuple[int, int, str]:
    return row.prompt_tokens, row.completion_tokens, row.usage_source


# --------------------------------------------------------------------------- the routes


async def test_images_audio_moderations_and_rerank_through_a_node_process(
    tmp_path: Path,
) -> None:
    async with open_env(tmp_path) as env, env.sdk() as client, env.http() as http:
        models = (await http.get("/v1/models")).json()
        assert sorted(m["id"] for m in models["data"]) == [CHAT_ONLY, MODEL]  # unchanged

        # An image (gpt-image's answer: a base64 PNG past the edge's whole-body buffer, its
        # usage after it).
        image = await client.images.generate(
            model=MODEL, prompt="a fox in the snow", extra_headers={"x-request-id": "img-1"}
        )
        assert image.data is not None
        png = base64.b64decode(image.data[0].b64_json or "")
        assert png.startswith(b"\x89PNG")
        assert len(png) == 8 + env.media.image_bytes
        assert image.usage is not None
        assert image.usage.output_tokens == 4160
        (row,) = await env.rows("img-1")
        assert (row.provider_id, row.route, row.path) == (
            "media",
            "/v1/images/generations",
            "tunnel",
        )
        assert (row.model_group, row.served_model, row.outcome) == (MODEL, SERVED, "completed")
        assert counts(row) == (50, 4160, "reported")
        (seen,) = env.media.requests
        assert (seen.json["model"], seen.json["prompt"]) == (SERVED, "a fox in the snow")
        assert seen.authorization == f"Bearer {MEDIA_KEY}"

        # A transcription: a multipart upload of 300 KiB, several frames on the wire.
        audio = wav(300 * 1024)
        assert len(audio) > 4 * wire.MAX_TUNNEL_CHUNK
        transcription = await client.audio.transcriptions.create(
            model=MODEL,
            file=("fox.wav", audio, "audio/wav"),
            language="en",
            extra_headers={"x-request-id": "stt-1"},
        )
        assert transcription.text == env.media.transcript
        (form,) = env.media.forms
        assert [f.value for f in form["model"]] == [SERVED.encode()]  # renamed in place
        assert form["language"][0].value == b"en"
        (upload,) = form["file"]
        assert (upload.filename, upload.content_type) == ("fox.wav", "audio/wav")
        assert upload.value == audio  # every byte as the client sent it
        (row,) = await env.rows("stt-1")
        assert (row.provider_id, row.route) == ("media", "/v1/audio/transcriptions")
        assert counts(row) == (14, 45, "reported")

        # Speech: JSON in, audio bytes out, unchanged, with their content type.
        speech = await client.audio.speech.create(
            model=MODEL,
            voice="alloy",
            input="Hello there",
            extra_headers={"x-request-id": "tts-1"},
        )
        assert speech.response.headers["content-type"] == "audio/mpeg"
        assert speech.content == env.media.speech * 4
        (row,) = await env.rows("tts-1")
        assert counts(row) == (0, 0, "estimated")  # the answer says nothing: nothing invented

        # A moderation: the answer's model is the client's name again; no usage in it.
        moderation = await client.moderations.create(
            model=MODEL, input="hello", extra_headers={"x-request-id": "mod-1"}
        )
        assert moderation.model == MODEL
        assert moderation.results[0].flagged is False
        (row,) = await env.rows("mod-1")
        assert (row.route, counts(row)) == ("/v1/moderations", (0, 0, "estimated"))

        # A rerank, the Cohere / Jina shape vLLM serves: usage.total_tokens.
        documents = ["a fox", "a dog", "the snow"]
        response = await http.post(
            "/v1/rerank",
            json={"model": MODEL, "query": "fox", "documents": documents, "top_n": 2},
            headers={"x-request-id": "rr-1"},
        )
        assert response.status_code == 200, response.text
        rerank = response.json()
        assert rerank["model"] == MODEL
        assert [r["index"] for r in rerank["results"]] == [0, 1]
        assert rerank["results"][0]["document"] == {"text": "a fox"}
        (row,) = await env.rows("rr-1")
        assert (row.route, counts(row)) == ("/v1/rerank", (31, 0, "reported"))

        # Chat on the same group goes to the provider that serves chat: the other one.
        chat = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            extra_headers={"x-request-id": "chat-1"},
        )
        assert chat.choices[0].message.content == env.plain.expected_text
        (row,) = await env.rows("chat-1")
        assert row.provider_id == "plain"

        # Every media request went to the provider that declares its route: no attempt on
        # the other, ever (one row per request, each the media provider's).
        assert [r.path for r in env.plain.requests] == ["/v1/chat/completions"]
        rows = await env.all_rows()
        assert len(rows) == 6
        assert {r.provider_id for r in rows if r.route != "/v1/chat/completions"} == {"media"}
        await env.slots_free()


async def test_an_image_edit_and_a_whisper_transcription_record_what_their_answers_say(
    tmp_path: Path,
) -> None:
    async with open_env(tmp_path) as env, env.sdk() as client, env.http() as http:
        env.media.transcription_usage = "duration"
        picture = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 400
        edited = await client.images.edit(
            model=MODEL,
            image=("in.png", picture, "image/png"),
            prompt="add a hat",
            extra_headers={"x-request-id": "edit-1"},
        )
        assert edited.data is not None
        assert edited.data[0].b64_json
        (form,) = env.media.forms
        assert [f.value for f in form["model"]] == [SERVED.encode()]
        assert [f.value for f in form.get("image", form.get("image[]", []))] == [picture]
        (row,) = await env.rows("edit-1")
        assert (row.route, counts(row)) == ("/v1/images/edits", (50, 4160, "reported"))

        # (The SDK deprecates translations: httpx's own multipart encoder this time.)
        translation = await http.post(
            "/v1/audio/translations",
            data={"model": MODEL, "response_format": "json"},
            files={"file": ("hola.wav", wav(1000), "audio/wav")},
            headers={"x-request-id": "tr-1"},
        )
        assert translation.status_code == 200, translation.text
        assert translation.json()["text"] == env.media.transcript
        assert [f.value for f in env.media.forms[1]["model"]] == [SERVED.encode()]

        # A streamed transcription: relayed as the provider's events (committed at its end:
        # its events carry no chat content); its usage event is not read.
        streamed = await http.post(
            "/v1/audio/transcriptions",
            data={"model": MODEL, "stream": "true"},
            files={"file": ("a.wav", wav(1000), "audio/wav")},
            headers={"x-request-id": "stt-stream"},
        )
        assert streamed.status_code == 200, streamed.text
        assert streamed.headers["content-type"] == "text/event-stream"
        events = [e for e in streamed.text.split("\n\n") if e]
        assert len(events) == len(env.media.transcript.split(" ")) + 1
        assert '"transcript.text.done"' in events[-1]
        (row,) = await env.rows("stt-stream")
        assert (row.outcome, counts(row)) == ("completed", (0, 0, "estimated"))
        # whisper-1's usage is in seconds, not tokens: nothing to count.
        (row,) = await env.rows("tr-1")
        assert (row.route, counts(row)) == ("/v1/audio/translations", (0, 0, "estimated"))
        assert not env.plain.requests


# --------------------------------------------------------------------------- cancellation


async def test_a_client_leaving_speech_closes_the_upstream_request(tmp_path: Path) -> None:
    async with open_env(tmp_path) as env:
        env.media.speech = bytes(range(256)) * 64  # 16 KiB a piece, forever
        env.media.speech_chunks = None
        env.media.speech_delay = 0.005
        body = orjson.dumps({"model": MODEL, "voice": "alloy", "input": "a very long story"})
        head = (
            "POST /v1/audio/speech HTTP/1.1\r\nhost: edge\r\n"
            f"authorization: Bearer {CLIENT_KEY}\r\nx-request-id: tts-gone\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
        )
        with trio.fail_after(20):
            stream = await trio.open_tcp_stream("127.0.0.1", env.server.address.port)
            async with stream:
                await stream.send_all(head.encode() + body)
                received = b""
                while len(received) < 512 * 1024:
                    received += await stream.receive_some(65536)
                assert received.startswith(b"HTTP/1.1 200 ")
                assert b"\r\ncontent-type: audio/mpeg\r\n" in received.lower()
            # The client left mid-answer.
            (seen,) = env.media.requests
            await seen.disconnected.wait()  # the node closed its upstream request
            await seen.finished.wait()
        assert seen.chunks_sent >= 32  # what the client read (512 KiB), and it stopped there
        sent = seen.chunks_sent
        await trio.sleep(0.05)
        assert seen.chunks_sent == sent
        (row,) = await env.rows("tts-gone")
        assert (row.route, row.outcome, row.provider_id) == (
            "/v1/audio/speech",
            "cancelled",
            "media",
        )
        await env.slots_free()
        stats = env.dispatcher.tunnels.statistics()
        assert stats.ended == {"cancelled": 1}
        assert stats.open_tunnels == 0


# --------------------------------------------------------------------------- hostile requests


def form(*parts: tuple[str, bytes, str | None], boundary: str = "b0undary") -> bytes:
    out = b""
    for name, value, filename in parts:
        disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
        out += f"--{boundary}\r\nContent-Disposition: {disposition}\r\n\r\n".encode() + value
        out += b"\r\n"
    return out + f"--{boundary}--\r\n".encode()


FORM_TYPE = "multipart/form-data; boundary=b0undary"


async def post(
    http: httpx.AsyncClient, path: str, content: bytes, content_type: str
) -> tuple[int, dict[str, Any]]:
    response = await http.post(path, content=content, headers={"content-type": content_type})
    return response.status_code, response.json()


async def test_hostile_media_requests_are_refused_before_any_attempt(tmp_path: Path) -> None:
    async with open_env(tmp_path) as env, env.http() as http:
        path = "/v1/audio/transcriptions"
        upload = ("file", wav(100), "a.wav")

        # A form that never closes its last part.
        truncated = form(("model", MODEL.encode(), None), upload)[:-20]
        status, error = await post(http, path, truncated, FORM_TYPE)
        assert status == 400
        assert error["error"]["code"] == "invalid_multipart"
        assert "not closed by the boundary" in error["error"]["message"]

        # A multipart Content-Type without a boundary; a part without a disposition.
        status, error = await post(http, path, form(upload), "multipart/form-data")
        assert (status, error["error"]["code"]) == (400, "invalid_multipart")
        headless = b"--b0undary\r\nContent-Type: text/plain\r\n\r\nx\r\n--b0undary--\r\n"
        status, error = await post(http, path, headless, FORM_TYPE)
        assert (status, error["error"]["code"]) == (400, "invalid_multipart")

        # No model field, a model given as a file, two models.
        status, error = await post(http, path, form(upload), FORM_TYPE)
        assert status == 400
        assert (error["error"]["code"], error["error"]["param"]) == (
            "missing_required_parameter",
            "model",
        )
        as_file = form(("model", MODEL.encode(), "model.txt"), upload)
        status, error = await post(http, path, as_file, FORM_TYPE)
        assert (status, error["error"]["param"]) == (400, "model")
        twice = form(("model", MODEL.encode(), None), ("model", b"x", None), upload)
        status, error = await post(http, path, twice, FORM_TYPE)
        assert (status, error["error"]["param"]) == (400, "model")

        # JSON without a model; not JSON at all.
        status, error = await post(
            http, "/v1/images/generations", b'{"prompt": "x"}', "application/json"
        )
        assert (status, error["error"]["param"]) == (400, "model")
        status, error = await post(http, "/v1/rerank", b"query=fox", "text/plain")
        assert (status, error["error"]["code"]) == (400, "invalid_json")

        # An unknown model: 404, as the other routes answer.
        unknown = form(("model", b"no-such-model", None), upload)
        status, error = await post(http, path, unknown, FORM_TYPE)
        assert (status, error["error"]["code"]) == (404, "model_not_found")

        # A model whose only provider does not declare the route: refused, no attempt.
        response = await http.post(
            "/v1/images/generations", json={"model": CHAT_ONLY, "prompt": "a fox"}
        )
        assert response.status_code == 400
        refusal = response.json()["error"]
        assert refusal["code"] == "no_capable_candidate"
        assert "not 'images'" in refusal["message"]

        # Over the edge's request-body limit: 413, in OpenAI's shape.
        huge = form(("model", MODEL.encode(), None), ("file", b"\0" * (MAX_BODY + 1), "big.wav"))
        status, error = await post(http, path, huge, FORM_TYPE)
        assert status == 413
        assert error["error"]["code"] == "payload_too_large"

        assert (env.media.requests, env.plain.requests) == ([], [])
        assert await env.all_rows() == []
        await env.slots_free()
