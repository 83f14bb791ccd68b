"""Claude Code (``@anthropic-ai/claude-code``, ``claude -p``) against a real edge on
``/v1/messages``, with its default settings: a plain turn, a tool round trip through its own
``Read`` tool, and a run that fails after the commit point. What it sends whatever its
settings -- a ``system`` message inside ``messages``, ``thinking: adaptive``,
``context_management``, ``output_config.effort``, its ``anthropic-beta`` values -- is in
every request here."""

from __future__ import annotations

from .stack import MARKER_TEXT, AgentStack

MESSAGES = "/v1/messages"


def test_a_plain_turn_ends_cleanly_with_the_answer(agents: AgentStack) -> None:
    run = agents.claude("echo", "claude plain turn seven words here")
    assert run.status == 0, run.output
    # echo answers with the last user message: Claude Code's reminders, then the prompt
    assert run.output.rstrip().endswith("claude plain turn seven words here"), run.output
    (row,) = agents.usage_rows("echo", MESSAGES)[:1]
    assert (row["route"], row["outcome"]) == ("/v1/messages", "completed")


def test_a_tool_call_and_its_result_go_round(agents: AgentStack) -> None:
    """echo-claude-tool calls ``Read`` on the marker: Claude Code reads it and sends the
    result back; the model's answer is that result."""
    run = agents.claude("echo-claude-tool", "show me the marker file")
    assert run.status == 0, run.output
    assert MARKER_TEXT in run.output, run.output
    rows = agents.usage_rows("echo-claude-tool", MESSAGES)
    assert len(rows) == 2, rows
    assert {row["outcome"] for row in rows} == {"completed"}
    assert {row["route"] for row in rows} == {"/v1/messages"}


def test_a_failure_after_the_commit_ends_the_turn_with_an_error(agents: AgentStack) -> None:
    """echo-fail streams two words, then fails: an ``error`` event, no ``message_stop``.

    Claude Code then asks again without streaming (a non-streamed answer commits only
    whole, so that attempt fails before its commit: 529 ``overloaded_error``) and retries a
    529 ten times with backoff -- minutes. Told to do neither (two of its own settings), it
    ends the turn at once with the streamed error, as the user would see it."""
    run = agents.claude(
        "echo-fail",
        "one two three four five",
        CLAUDE_CODE_MAX_RETRIES="0",
        CLAUDE_CODE_DISABLE_NONSTREAMING_FALLBACK="1",
    )
    assert run.status != 0, run.output
    assert "the model run failed: injected failure after 2 tokens" in run.output
    rows = agents.usage_rows("echo-fail", MESSAGES)
    messages = [row for row in rows if row["route"] == "/v1/messages"]
    assert messages
    assert {row["outcome"] for row in messages} == {"failed"}
