"""The numbers (printed at the end of the run, never asserted: tests do not assert speed):
time to first token and tokens/s of a 64-token streamed generation, the engine answered
directly and through the edge on each path, the rounds interleaved so that all three share
the machine's load alike."""

from __future__ import annotations

import os

import openai

from .answers import ENGINE_MODEL, NUMBERS, timed_stream
from .stack import NORMALIZED, TUNNEL, Stack

ROUNDS = int(os.environ.get("DISPATCHER_REAL_ROUNDS", "7"))
TOKENS = 64


def test_numbers(idle_engine: Stack, direct: openai.OpenAI, edge: openai.OpenAI) -> None:
    routes = [
        ("direct (llama-server)", direct, ENGINE_MODEL),
        ("edge: tunnel", edge, TUNNEL),
        ("edge: normalized", edge, NORMALIZED),
    ]
    for _, sdk, model in routes:  # warm: connections, the engine's prompt cache
        timed_stream(sdk, model, TOKENS)
    for _ in range(ROUNDS):
        for label, sdk, model in routes:
            timing = timed_stream(sdk, model, TOKENS)
            assert timing.tokens == TOKENS
            samples = NUMBERS.setdefault(label, {})
            samples.setdefault("ttft_ms", []).append(timing.ttft * 1000)
            samples.setdefault("total_ms", []).append(timing.total * 1000)
            samples.setdefault("decode_tps", []).append(timing.decode_tps)
            samples.setdefault("e2e_tps", []).append(timing.e2e_tps)
