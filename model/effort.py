"""Reasoning effort: a scalar 1-100 rendered into the system prompt.

The model was trained with "Reasoning Effort: N" at the start of the system prompt (the chat
template adds it; the reference model does not). DeepSeek's API names low/high/max map to
50/75/100; integers 1-100 are accepted directly. Because the effort line is part of the prompt,
requests with different effort never share prefix-cache blocks: effort partitions the cache.

An effort level is decided once, at the router (`parse_effort`, `parse_openai_effort`), and travels
to the workers as a checked integer 1-100 (`check_level` is the workers' one check of what a direct
caller of their port could send). Everything else here takes a level as given: the output budget
(`token_budget`, the one effort budget rule), the prior output length, the queue order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

EFFORT_NAMES: Mapping[str, int] = {"low": 50, "high": 75, "max": 100}
OPENAI_EFFORT_NAMES: Mapping[str, int] = {"none": 1, "minimal": 25, "low": 50, "medium": 62, "high": 75,
                                          "xhigh": 90, "max": 100}
"""`reasoning_effort` names of the OpenAI API on this scale: low and high keep DeepSeek's values,
medium falls between them, minimal and none below low (none: the scale's floor, as little reasoning
as the model knows), xhigh between high and max; DeepSeek's `max` is accepted too."""
DEFAULT_EFFORT = 75
MIN_EFFORT, MAX_EFFORT = 1, 100

# Expected output tokens by effort: the report says effort 25 -> 100 roughly doubles output length
# (2.5x on DeepSWE). Linear in effort between those anchors; workers may report measured values.
_OUTPUT_AT_EFFORT_25 = 1024.0
_OUTPUT_AT_EFFORT_100 = 2560.0
BUDGET_PER_EXPECTED_OUTPUT = 4
"""A request's default output budget, in multiples of its effort's expected output length."""

BOS = "<｜begin▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
EOS = "<｜end▁of▁sentence｜>"


def parse_effort(value: int | str | None) -> int:
    """An effort level from an integer 1-100 (or its decimal string) or a name (low/high/max).

    `None` gives the default (high = 75). Anything else raises `ValueError` naming the field.
    """
    if value is None:
        return DEFAULT_EFFORT
    if isinstance(value, bool):
        raise ValueError(f"field `effort`: expected 1-100 or one of {sorted(EFFORT_NAMES)}, got {value!r}")
    if isinstance(value, str):
        key = value.strip().lower()
        if key in EFFORT_NAMES:
            return EFFORT_NAMES[key]
        if not key.isdigit():
            raise ValueError(f"field `effort`: expected 1-100 or one of {sorted(EFFORT_NAMES)}, got {value!r}")
        value = int(key)
    if not MIN_EFFORT <= value <= MAX_EFFORT:
        raise ValueError(f"field `effort`: must be in [{MIN_EFFORT}, {MAX_EFFORT}], got {value}")
    return value


def check_level(effort: int) -> int:
    """`effort` when it is a level 1-100; `ValueError` naming the field otherwise (0 included: the
    internal plane has no "unset", the router always decides a level)."""
    if not MIN_EFFORT <= effort <= MAX_EFFORT:
        raise ValueError(f"field `effort`: must be in [{MIN_EFFORT}, {MAX_EFFORT}], got {effort}")
    return effort


def expected_output_tokens(effort: int) -> float:
    """Prior for a request's output length at an effort level (1-100)."""
    slope = (_OUTPUT_AT_EFFORT_100 - _OUTPUT_AT_EFFORT_25) / 75.0
    return max(64.0, _OUTPUT_AT_EFFORT_25 + slope * (effort - 25))


def token_budget(effort: int) -> int:
    """The output budget of a request that names none: `BUDGET_PER_EXPECTED_OUTPUT` times its
    effort's expected output length (8,192 tokens at 75, 10,240 at 100). The one effort budget rule:
    the router applies it when it resolves a request's `max_tokens`; workers take what it decided."""
    return int(BUDGET_PER_EXPECTED_OUTPUT * expected_output_tokens(effort))


def effort_class(effort: int) -> str:
    """The admission and reporting class of an effort level: low (< 60), high (60-89), max (>= 90)."""
    if effort >= 90:
        return "max"
    return "high" if effort >= 60 else "low"


def queue_due_s(arrival_s: float, effort: int, slack_at_max_s: float) -> float:
    """When a waiting request falls due: its arrival plus a slack that grows with its effort.

    Workers serve waiting requests earliest-due first. Effort scales the token budget linearly
    (`token_budget`), so a request's expected service time grows with it; letting it
    wait proportionally longer behind cheaper requests is shortest-expected-job-first, and the slack
    is bounded, so nothing starves: a request waits only for those due before it, and every later
    arrival falls due after `arrival_s + slack_at_max_s`. `effort` is a level 1-100 (checked where the
    request entered); `slack_at_max_s = 0` gives arrival order (FIFO).
    """
    if slack_at_max_s < 0:
        raise ValueError(f"queue slack must be >= 0 seconds, got {slack_at_max_s}")
    return arrival_s + slack_at_max_s * effort / MAX_EFFORT


def effort_line(effort: int) -> str:
    """The line the chat template puts first in the system prompt (`effort`: a level 1-100)."""
    return f"Reasoning Effort: {effort}"


@dataclass(frozen=True)
class ChatMessage:
    role: str
    """`system`, `user` or `assistant`."""
    content: str


def render_chat(messages: Sequence[ChatMessage], effort: int = DEFAULT_EFFORT) -> str:
    """The prompt text for a conversation, with the effort line (`effort`: a level 1-100, as
    `parse_effort` decided it) leading the system prompt.

    A system message is created when the conversation has none, so the effort line is always the
    first thing after BOS. The result ends with the assistant tag, ready for generation.
    """
    system = [m.content for m in messages if m.role == "system"]
    parts = [BOS, effort_line(effort) + ("\n" + "\n".join(system) if system else "")]
    for m in messages:
        if m.role == "system":
            continue
        if m.role == "user":
            parts.append(USER + m.content)
        elif m.role == "assistant":
            parts.append(ASSISTANT + m.content + EOS)
        else:
            raise ValueError(f"field `messages.role`: unknown role {m.role!r} (system, user, assistant)")
    parts.append(ASSISTANT)
    return "".join(parts)


def parse_openai_effort(value: object) -> int:
    """An effort level from an OpenAI `reasoning_effort`: a name of `OPENAI_EFFORT_NAMES`, or the
    numeric extension, an integer 1-100 (or its decimal string). `ValueError` otherwise."""
    if isinstance(value, str) and value.strip().lower() in OPENAI_EFFORT_NAMES:
        return OPENAI_EFFORT_NAMES[value.strip().lower()]
    if isinstance(value, (int, str)) and not isinstance(value, bool):
        try:
            return parse_effort(value)
        except ValueError:
            pass
    raise ValueError(f"expected one of {', '.join(OPENAI_EFFORT_NAMES)} or an integer 1-100, got {value!r}")
