"""Effort parsing and rendering into the system prompt."""

from __future__ import annotations

import pytest

from cedserve.model.effort import (
    BOS,
    ChatMessage,
    check_level,
    effort_class,
    expected_output_tokens,
    parse_effort,
    queue_due_s,
    render_chat,
    token_budget,
)


@pytest.mark.parametrize(("value", "expected"), [
    (None, 75), ("low", 50), ("high", 75), ("max", 100), ("MAX", 100), (1, 1), (100, 100), ("37", 37)])
def test_parse_effort(value: int | str | None, expected: int) -> None:
    assert parse_effort(value) == expected


@pytest.mark.parametrize("value", [0, 101, -5, "medium", "xhigh", "", "7.5", True])
def test_bad_effort_names_the_field(value: object) -> None:
    with pytest.raises(ValueError, match="effort"):
        parse_effort(value)  # type: ignore[arg-type]


def test_effort_leads_the_system_prompt() -> None:
    text = render_chat([ChatMessage("system", "Be brief."), ChatMessage("user", "hi")], parse_effort("low"))
    assert text.startswith(BOS + "Reasoning Effort: 50\nBe brief.")
    no_system = render_chat([ChatMessage("user", "hi")], 90)
    assert no_system.startswith(BOS + "Reasoning Effort: 90<")


def test_effort_partitions_the_prefix() -> None:
    convo = [ChatMessage("user", "same question")]
    a, b = render_chat(convo, 50), render_chat(convo, 51)
    # The texts differ right after BOS, so no prefix-cache block beyond BOS can be shared.
    common = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    assert common < len(BOS) + len("Reasoning Effort: 5") + 1


def test_unknown_role() -> None:
    with pytest.raises(ValueError, match=r"messages\.role"):
        render_chat([ChatMessage("tool", "x")])


@pytest.mark.parametrize(("effort", "klass"), [(1, "low"), (59, "low"), (60, "high"), (89, "high"), (90, "max"),
                                               (100, "max")])
def test_effort_class_bounds(effort: int, klass: str) -> None:
    assert effort_class(effort) == klass


def test_queue_due_grows_with_effort_and_is_bounded() -> None:
    assert queue_due_s(10.0, 50, 2.0) == 11.0 and queue_due_s(10.0, 100, 2.0) == 12.0
    assert queue_due_s(10.0, 1, 2.0) == pytest.approx(10.02)
    assert queue_due_s(10.0, 100, 0.0) == 10.0  # no slack: arrival order
    with pytest.raises(ValueError, match="slack"):
        queue_due_s(0.0, 50, -1.0)


@pytest.mark.parametrize("value", [0, 101])
def test_check_level_refuses_what_a_direct_caller_could_send(value: int) -> None:
    with pytest.raises(ValueError, match=r"field `effort`: must be in \[1, 100\]"):
        check_level(value)
    assert check_level(1) == 1 and check_level(100) == 100


def test_one_budget_rule() -> None:
    """The default output budget is four times the effort's expected output, growing with effort."""
    assert token_budget(75) == 4 * expected_output_tokens(75) == 8192
    assert token_budget(25) == 4096 and token_budget(100) == 10240
    assert token_budget(1) < token_budget(50) < token_budget(100)
