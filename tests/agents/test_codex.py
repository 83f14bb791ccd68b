"""Codex CLI (``@openai/codex``, ``codex exec``) against a real edge on ``/v1/responses``,
with its default settings: a plain turn, a tool round trip through its own shell tool, and a
run that fails after the commit point. What it sends the edge whatever its settings --
``reasoning``, ``include``, ``prompt_cache_key``, ``client_metadata``, tools in a
``namespace``, a ``web_search`` tool -- is in every request here."""

from __future__ import annotations

from .stack import MARKER_TEXT, AgentStack

RESPONSES = "/v1/responses"


def test_a_plain_turn_ends_cleanly_with_the_answer(agents: AgentStack) -> None:
    run = agents.codex("echo", "codex plain turn seven words here")
    assert run.status == 0, run.output
    assert "codex plain turn seven words here" in run.output.split("codex\n", 1)[-1]
    (row,) = agents.usage_rows("echo", RESPONSES)[:1]
    assert (row["route"], row["outcome"], row["billable_to"]) == (
        "/v1/responses",
        "completed",
        "client",
    )
    assert row["prompt_tokens"] > 0
    assert row["completion_tokens"] > 0


def test_a_tool_call_and_its_result_go_round(agents: AgentStack) -> None:
    """echo-codex-tool calls ``exec_command`` (``cat`` the marker): Codex runs it in its
    sandbox and sends the output back; the model's answer is that output."""
    run = agents.codex("echo-codex-tool", "show me the marker file")
    assert run.status == 0, run.output
    answer = run.output.split("\ncodex\n")[-1]
    assert MARKER_TEXT in answer, run.output
    rows = agents.usage_rows("echo-codex-tool", RESPONSES)
    assert len(rows) == 2, rows  # the call, then the answer to its result
    assert {row["outcome"] for row in rows} == {"completed"}
    assert {row["route"] for row in rows} == {"/v1/responses"}


def test_a_failure_after_the_commit_ends_the_turn_with_an_error(agents: AgentStack) -> None:
    """echo-fail streams two words, then its run fails: ``response.failed``. Codex retries
    the stream (5 times by default) and then ends the turn with the error, exit status 1."""
    run = agents.codex("echo-fail", "one two three four five")
    assert run.status != 0, run.output
    assert "injected failure after 2 tokens" in run.output
    rows = agents.usage_rows("echo-fail", RESPONSES)
    assert rows
    assert {row["outcome"] for row in rows} == {"failed"}
    assert all(row["completion_tokens"] == 2 for row in rows)
