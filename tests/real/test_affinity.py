"""Cache-aware routing measured on real engines (issue #26, acceptance 2): three
``llama-server`` processes (one thread, two slots each) behind three ``dispatcher node``
processes and one edge; six conversations of eight turns, each with its own ~1,500-token
system prompt, all six at once, run with affinity off and on, the rounds interleaved (off, on,
off, on ...: the edge's ``[models.smol] affinity`` switched by a reload between rounds, so both
share the machine's load alike).

Each round's conversations are new (their system prompts name the round), so no round finds
the last one's prompts cached. A turn resends the whole conversation, as agents do: on the
node that served the turn before, the engine serves its prefix from the slot that kept it; on
another node it evaluates the whole prompt again.

It prints TTFT p50/p99 per turn and the prompt tokens the engines reported cached
(``usage.prompt_tokens_details.cached_tokens``, from llama.cpp's answers through the node),
and asserts that affinity lowers the TTFT p50 of turns 2-8 -- the one timing this suite
asserts, since lowering it is the feature (the figure is in docs/real-engine.md; the target
is 3x) -- and, the mechanism behind it, that with affinity on at least 90 % of the later
turns find their system prompt cached. ``nox -s real -- -k affinity`` runs it alone.

The engines run with ``--cache-ram 64`` (``DISPATCHER_REAL_CACHE_RAM`` overrides): besides
its two slots an engine keeps one evicted prompt (~33 MiB here) in host memory -- about a
node's share of the conversations, as a GPU's memory holds the KV of a few conversations, not
of all. (At llama-server's default, 8 GiB, every node would in the end keep a copy of every
conversation of a 135M model.) The keys, and so which node each conversation prefers, are the
same from run to run: the system prompts and the node ids are fixed.
"""

from __future__ import annotations

import os
import random
import statistics
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import attrs
import httpx
import orjson
import pytest

from .answers import REPORT
from .stack import Stack, start_edge, start_engine, start_node

MODEL = "smol"
NODES = 3
SLOTS = 2
CONVERSATIONS = 6
TURNS = 8
MAX_TOKENS = 8
CONTEXT = 4096
"""Per slot: the ~1,500-token system prompt and eight turns fit with room to spare."""

PAIRS = int(os.environ.get("DISPATCHER_REAL_AFFINITY_PAIRS", "2"))
"""Off/on pairs of rounds."""

CACHE_RAM = os.environ.get("DISPATCHER_REAL_CACHE_RAM", "64")

THINK = (1.0, 6.0)
"""Seconds a conversation waits between an answer and its next turn (drawn per turn, seeded):
a user reading, an agent running a tool. Without it the six conversations would each resend
the moment their answer ended, into the slot that answer just freed -- the least loaded node
is then always the one that served the turn before, and load-based routing would look like
affinity by accident."""

NODE_TOML = """\
[node]
id = "{node_id}"
edge_url = "ws://127.0.0.1:{edge_port}/v1/nodes/connect"
reconnect_min_backoff = 0.2
reconnect_max_backoff = 1

[[providers]]
id = "engine"
type = "openai"
base_url = "{engine}/v1"
options = {{ cache_prompt = true }}

  [[providers.models]]
  name = "{model}"
  served_name = "smollm2"
  slots = {slots}
"""

EDGE_TOML = """\
host = "127.0.0.1"
port = 0
local_node = false
data_dir = "{data}"
expose_node_ids = true

[admission]
request_timeout_s = 600.0
first_token_timeout_s = 300.0
stall_timeout_s = 300.0
"""

AFFINITY_SETTINGS = os.environ.get(
    "DISPATCHER_REAL_AFFINITY_SETTINGS", "affinity_load_factor = 3.0\naffinity_wait_ms = 5000"
)
"""The rest of ``[models.smol]`` with affinity on. By default tuned for this case (docs/
real-engine.md): a node is passed over only when full (the load factor is the number of
nodes), and a turn waits up to 5 s for its node's slot -- a cached turn takes about one, a
turn evaluated whole elsewhere tens of seconds. The admission defaults (1.25, 50 ms) spill
more; ``DISPATCHER_REAL_AFFINITY_SETTINGS=""`` measures them."""

AFFINITY_ON = f"""
[models.{MODEL}]
affinity = true
{AFFINITY_SETTINGS}
"""


def system_prompt(round_id: str, conversation: int) -> str:
    """About 1,500 tokens, its own from the first word on (no two share a prefix)."""
    head = (
        f"Session {round_id}-{conversation}. You are the archivist of reading room {conversation}."
    )
    rules = " ".join(
        f"Rule {n} of room {conversation}: answer politely, cite shelf {n * 7 + conversation}."
        for n in range(1, 79)
    )
    return f"{head} {rules}"


@attrs.frozen
class Turn:
    conversation: int
    turn: int
    ttft: float
    cached: int
    prompt: int
    node: str


def converse(edge_url: str, round_id: str, conversation: int) -> list[Turn]:
    """One conversation's turns, each streamed; the answer joins the conversation."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": system_prompt(round_id, conversation)}
    ]
    turns: list[Turn] = []
    think = random.Random(f"{round_id}-{conversation}")
    with httpx.Client(base_url=edge_url, timeout=600) as client:
        for turn in range(1, TURNS + 1):
            time.sleep(think.uniform(*THINK))
            messages.append(
                {"role": "user", "content": f"Question {turn}: where is book {turn * 13}?"}
            )
            body = {
                "model": MODEL,
                "messages": messages,
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            started = time.monotonic()
            ttft: float | None = None
            text: list[str] = []
            usage: dict[str, Any] = {}
            with client.stream("POST", "/v1/chat/completions", json=body) as answer:
                assert answer.status_code == 200, answer.read()
                node = answer.headers.get("x-dispatcher-node", "?")
                for line in answer.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = orjson.loads(line[6:])
                    for choice in chunk.get("choices") or ():
                        content = choice.get("delta", {}).get("content")
                        if content:
                            if ttft is None:
                                ttft = time.monotonic() - started
                            text.append(content)
                    if chunk.get("usage"):
                        usage = chunk["usage"]
            if ttft is None:  # an empty answer: its end is its first token
                ttft = time.monotonic() - started
            details = usage.get("prompt_tokens_details") or {}
            turns.append(
                Turn(
                    conversation=conversation,
                    turn=turn,
                    ttft=ttft,
                    cached=int(details.get("cached_tokens", 0)),
                    prompt=int(usage.get("prompt_tokens", 0)),
                    node=node,
                )
            )
            messages.append({"role": "assistant", "content": "".join(text) or "..."})
    return turns


def run_round(edge_url: str, round_id: str) -> list[Turn]:
    with ThreadPoolExecutor(CONVERSATIONS) as pool:
        futures = [
            pool.submit(converse, edge_url, round_id, conversation)
            for conversation in range(CONVERSATIONS)
        ]
        return [turn for future in futures for turn in future.result()]


@attrs.define(eq=False)
class AffinityStack:
    stack: Stack
    edge_toml: str

    def switch(self, affinity: bool) -> bool:
        """Reload the edge with affinity on or off; False when the edge refuses the
        setting (an edge without cache-aware routing)."""
        path = self.stack.workdir / "edge.toml"
        path.write_text(self.edge_toml + (AFFINITY_ON if affinity else ""))
        answer = httpx.post(f"{self.stack.edge_url}/admin/reload", timeout=30)
        if answer.status_code == 400 and "affinity" in answer.text:
            path.write_text(self.edge_toml)
            return False
        assert answer.status_code == 200, answer.text
        return True


@pytest.fixture(scope="module")
def affinity_stack(
    real_engine: tuple[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[AffinityStack]:
    engine, model = real_engine
    stack = Stack(tmp_path_factory.mktemp("affinity"))
    try:
        template = os.environ.get("DISPATCHER_REAL_TEMPLATE") or None
        engines = []
        for number in range(1, NODES + 1):
            start_engine(
                stack,
                engine,
                model,
                template,
                cache_prompt=True,
                parallel=SLOTS,
                context=CONTEXT,
                threads=1,
                extra=["--cache-ram", CACHE_RAM],
                name=f"llama-server-{number}",
            )
            engines.append(stack.engine_url)
        data = stack.workdir / "edge-data"
        data.mkdir()
        edge_toml = EDGE_TOML.format(data=data)
        start_edge(stack, edge_toml)
        port = stack.edge_url.rpartition(":")[2]
        for number, engine_url in enumerate(engines, start=1):
            node_id = f"affinity-node-{number}"

            def connected(node_id: str = node_id) -> bool:
                status = httpx.get(f"{stack.edge_url}/admin/status", timeout=2).json()
                return node_id in {node["id"] for node in status["nodes"]}

            start_node(
                stack,
                NODE_TOML.format(
                    node_id=node_id, edge_port=port, engine=engine_url, model=MODEL, slots=SLOTS
                ),
                [MODEL],
                name=node_id,
                ready=connected,
            )
        yield AffinityStack(stack, edge_toml)
    finally:
        stack.close()


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(share * (len(ordered) - 1)))]


def report(results: dict[bool, list[Turn]], system_tokens: int) -> list[str]:
    lines = [
        f"{CONVERSATIONS} conversations x {TURNS} turns, {NODES} nodes x {SLOTS} slots, "
        f"system prompt ~{system_tokens} tokens, max_tokens {MAX_TOKENS}, {PAIRS} rounds each "
        f"(interleaved), think time {THINK[0]}-{THINK[1]} s, --cache-ram {CACHE_RAM}",
        f"affinity on: {' '.join(AFFINITY_SETTINGS.split()) or 'the admission defaults'}",
        "turn  off p50 ms  off p99 ms  off cached  on p50 ms  on p99 ms  on cached",
    ]
    for turn in range(1, TURNS + 1):
        cells = []
        for on in (False, True):
            of_turn = [t for t in results[on] if t.turn == turn]
            if not of_turn:
                cells.append(f"{'-':>10}  {'-':>10}  {'-':>10}")
                continue
            ttfts = [t.ttft * 1000 for t in of_turn]
            cached = statistics.mean(t.cached for t in of_turn)
            cells.append(
                f"{statistics.median(ttfts):10.0f}  {percentile(ttfts, 0.99):10.0f}  {cached:10.0f}"
            )
        lines.append(f"{turn:4d}  {'  '.join(cells)}")
    for on in (False, True):
        for pair in range(PAIRS):
            paths = [
                "".join(
                    t.node.rpartition("-")[2]
                    for t in sorted(results[on], key=lambda t: t.turn)
                    if t.conversation == pair * CONVERSATIONS + c
                )
                for c in range(CONVERSATIONS)
            ]
            if any(paths):
                lines.append(
                    f"affinity {'on ' if on else 'off'}, round {pair}: each conversation's "
                    f"nodes turn by turn: {' '.join(paths)}"
                )
    for on in (False, True):
        later = results[on]
        nodes = {
            c: len({t.node for t in later if t.conversation == c})
            for c in {t.conversation for t in later}
        }
        if later:
            lines.append(
                f"affinity {'on ' if on else 'off'}: nodes a conversation's turns went to, mean "
                f"{statistics.mean(nodes.values()):.1f} of {NODES}"
            )
    return lines


@pytest.mark.timeout(600 + 900 * PAIRS)
def test_affinity_lowers_the_time_to_first_token_of_later_turns(
    affinity_stack: AffinityStack,
) -> None:
    edge_url = affinity_stack.stack.edge_url
    results: dict[bool, list[Turn]] = {False: [], True: []}
    available = True
    for pair in range(PAIRS):
        for on in (False, True):
            if on and not available:
                continue
            if not affinity_stack.switch(on):
                available = False
                continue
            began = time.monotonic()
            turns = run_round(edge_url, f"{pair}{'on' if on else 'off'}")
            print(
                f"round {pair} affinity {'on' if on else 'off'}: {time.monotonic() - began:.0f} s"
            )
            # each round's conversations are new: a round's own conversation numbers, kept
            # apart from the other rounds' for the per-conversation counts
            offset = pair * CONVERSATIONS
            results[on].extend(attrs.evolve(t, conversation=t.conversation + offset) for t in turns)
    first = [t for t in results[False] if t.turn == 1]
    system_tokens = round(statistics.median(t.prompt for t in first)) if first else 0
    lines = report(results, system_tokens)
    off_later = [t.ttft for t in results[False] if t.turn > 1]
    assert len(off_later) == PAIRS * CONVERSATIONS * (TURNS - 1)
    if not available:
        REPORT.extend(
            [*lines, "affinity on: not measured (this edge has no [models.NAME] affinity)"]
        )
        pytest.skip("the edge has no `[models.NAME] affinity` yet: the baseline alone measured")
    on_later = [t.ttft for t in results[True] if t.turn > 1]
    off_p50, on_p50 = statistics.median(off_later), statistics.median(on_later)
    lines.append(
        f"turns 2-{TURNS}: TTFT p50 off {off_p50 * 1000:.0f} ms, on {on_p50 * 1000:.0f} ms: "
        f"{off_p50 / on_p50:.1f}x lower with affinity"
    )
    # the mechanism: with affinity on, a later turn finds (at least) its system prompt cached
    # on the node that served the turn before, nearly always
    hits = {
        on: sum(1 for t in results[on] if t.turn > 1 and t.cached >= system_tokens * 0.9)
        for on in (False, True)
    }
    lines.append(
        f"turns 2-{TURNS} that found their system prompt cached: off {hits[False]}, "
        f"on {hits[True]} of {len(on_later)}"
    )
    REPORT.extend(lines)
    # the mechanism: with affinity on, more later turns find their system prompt cached on
    # the node they reach; and so the time to their first token is lower
    assert hits[True] > hits[False], "\n".join(lines)
    # a conversation stays where its prefix is (its placement, once it has spilled), so
    # nearly every later turn finds it there
    assert hits[True] >= 0.9 * len(on_later), "\n".join(lines)
    assert on_p50 < off_p50, "\n".join(lines)
