"""Effort parsing and rendering into the system prompt."""

from __future__ import annotations

import pytest

from cedserve.model.effort import BOS, ChatMessage, parse_effort, render_chat


@pytest.mark.parametrize(("value", "expected"), [
    (None, 75), ("low", 50), ("high", 75), ("max", 100), ("MAX", 100), (1, 1), (100, 100), ("37", 37)])
def test_parse_effort(value: int | str | None, expected: int) -> None:
    assert parse_effort(value) == expected


@pytest.mark.parametrize("value", [0, 101, -5, "medium", "xhigh", "", "7.5", True])
def test_bad_effort_names_the_field(value: object) -> None:
    with pytest.raises(ValueError, match="effort"):
        parse_effort(value)  # type: ignore[arg-type]


def test_effort_leads_the_system_prompt() -> None:
    text = render_chat([ChatMessage("system", "Be brief."), ChatMessage("user", "hi")], "low")
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
