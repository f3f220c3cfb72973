"""Synthetic agent sessions, written as a Mooncake-format trace (`trace.py`).

An agent session is a conversation whose context only grows: a system prompt (instructions and
tool definitions) shared by every session of the same effort level (the chat template puts the
effort line first, so effort partitions the prefix cache), a first user turn (the task and the
context the agent gathered), then turns that each append the previous answer (a short tool call)
and the tool's result, after a tool-call gap. Prompts are long and outputs short, as in coding
agents. Every turn is one request whose hash ids repeat the previous turn's whole blocks, so the
trace states exactly which prefix each turn could reuse.

Sessions start at Poisson times of `session_rate` in the written trace; the bench may replay them
at other rates or as a closed loop (`driver.py`).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from dataclasses import dataclass

from cedserve.bench.serve.trace import TraceRecord
from cedserve.model.effort import EFFORT_NAMES, parse_effort

Range = tuple[int, int]


def parse_range(text: str, name: str) -> Range:
    """`"128,512"` -> (128, 512); `"64"` -> (64, 64). `ValueError` naming the flag."""
    parts = [p for p in text.split(",") if p.strip()]
    try:
        low, high = (int(parts[0]), int(parts[-1])) if parts else (-1, -1)
    except ValueError:
        low, high = -1, -1
    if len(parts) not in (1, 2) or low < 0 or high < low:
        raise ValueError(f"--{name}: expected N or MIN,MAX with 0 <= MIN <= MAX, got {text!r}")
    return low, high


def parse_effort_mix(text: str) -> tuple[tuple[int, float], ...]:
    """`"low:0.3,high:0.5,max:0.2"` (names or levels 1-100) -> ((50, 0.3), (75, 0.5), (100, 0.2))."""
    mix = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, sep, weight = item.partition(":")
        try:
            level, share = parse_effort(name), float(weight) if sep else 1.0
        except ValueError:
            raise ValueError(f"--effort-mix: {item!r} is not LEVEL:WEIGHT (LEVEL 1-100 or one of "
                             f"{sorted(EFFORT_NAMES)})") from None
        if share < 0:
            raise ValueError(f"--effort-mix: weight of {name!r} must be >= 0")
        mix.append((level, share))
    if not mix or sum(w for _, w in mix) <= 0:
        raise ValueError(f"--effort-mix: needs at least one positive weight, got {text!r}")
    return tuple(mix)


@dataclass(frozen=True)
class AgentWorkload:
    """The shape of the synthetic sessions; token counts are drawn uniformly from each range."""

    sessions: int = 6
    turns: Range = (2, 3)
    """Requests per session (fewer when the context would pass `max_prompt_tokens`)."""
    system_prompt_tokens: int = 256
    """Shared by every session of one effort level."""
    user_tokens: Range = (128, 384)
    """The first turn's own content: the task and the context gathered for it."""
    tool_result_tokens: Range = (64, 192)
    """What each later turn appends besides the previous answer."""
    output_tokens: Range = (8, 16)
    """Asked per turn (`max_tokens`); the answer is appended to the next turn's prompt."""
    tool_gap_s: float = 0.5
    """Mean of the exponential gap between a turn's completion and the next turn."""
    session_rate: float = 0.5
    """Session starts per second in the written trace (Poisson)."""
    effort_mix: tuple[tuple[int, float], ...] = ((50, 0.3), (75, 0.5), (100, 0.2))
    """(effort level, weight): a session keeps one level."""
    max_prompt_tokens: int = 2048
    """A session ends before a turn whose prompt plus output would pass this."""
    block_size: int = 64
    """Tokens per hash id."""
    seed: int = 0

    def __post_init__(self) -> None:
        if self.sessions < 1 or self.turns[0] < 1 or self.block_size < 1:
            raise ValueError("agent workload: sessions, turns and block_size must be >= 1")
        if self.tool_gap_s < 0 or self.session_rate <= 0:
            raise ValueError("agent workload: tool_gap_s must be >= 0 and session_rate > 0")
        if self.output_tokens[0] < 1:
            raise ValueError("agent workload: output_tokens must be >= 1")
        first = self.system_prompt_tokens + self.user_tokens[1] + self.output_tokens[1]
        if first > self.max_prompt_tokens:
            raise ValueError(f"agent workload: a first turn may need {first} tokens (system prompt + user + output), "
                             f"more than max_prompt_tokens {self.max_prompt_tokens}")


class _Context:
    """A growing prompt as hash ids: whole blocks keep their ids, a trailing partial block gets a new id
    whenever content is appended to it (its content, and so its id, changes)."""

    def __init__(self, ids: list[int], length: int, block_size: int, counter: itertools.count[int]) -> None:
        self.ids, self.length, self.block_size, self.counter = ids, length, block_size, counter

    def extend(self, tokens: int) -> None:
        keep = self.length // self.block_size
        self.length += tokens
        self.ids = self.ids[:keep] + [next(self.counter) for _ in range(keep, -(-self.length // self.block_size))]


def generate_sessions(w: AgentWorkload) -> list[TraceRecord]:
    """The workload as trace records, sessions in start order, each session's turns in order."""
    rng = random.Random(w.seed)
    counter = itertools.count()
    system: dict[int, _Context] = {}  # effort level -> its system prompt (whole blocks shared)
    levels, weights = [lvl for lvl, _ in w.effort_mix], [wt for _, wt in w.effort_mix]
    records: list[TraceRecord] = []
    start_s = 0.0
    for s in range(w.sessions):
        effort = rng.choices(levels, weights)[0]
        if effort not in system:
            system[effort] = _Context([], 0, w.block_size, counter)
            system[effort].extend(w.system_prompt_tokens)
        base = system[effort]
        ctx = _Context(list(base.ids), base.length, w.block_size, counter)
        ctx.extend(rng.randint(*w.user_tokens))
        clock_s = start_s
        for turn in range(rng.randint(*w.turns)):
            output = rng.randint(*w.output_tokens)
            if ctx.length + output > w.max_prompt_tokens:
                break
            gap_s = rng.expovariate(1 / w.tool_gap_s) if turn and w.tool_gap_s > 0 else 0.0
            clock_s += gap_s
            records.append(TraceRecord(round(clock_s * 1000, 3), ctx.length, output, tuple(ctx.ids), f"s{s}",
                                       round(gap_s * 1000, 3), effort))
            ctx.extend(output + rng.randint(*w.tool_result_tokens))  # the answer, then the tool's result
        start_s += rng.expovariate(w.session_rate)
    return records


def trace_stats(records: Sequence[TraceRecord], oracle_tokens: Sequence[int]) -> dict[str, float]:
    """Counts and means of a trace, with its oracle hit rate in trace order."""
    prompt = sum(r.input_length for r in records)
    return {"requests": len(records), "sessions": len({r.session_id or f"#{i}" for i, r in enumerate(records)}),
            "mean_input_tokens": round(prompt / len(records), 1),
            "mean_output_tokens": round(sum(r.output_length for r in records) / len(records), 1),
            "max_input_tokens": max(r.input_length for r in records),
            "oracle_hit_rate_trace_order": round(sum(oracle_tokens) / prompt, 4) if prompt else 0.0}
