"""The size limits of a public request and the words of their refusals, in one place for the router,
which enforces them, and `cedserve.client`, which applies them before it builds a request the router
would refuse.

Two limits, checked in this order by the router:

- the message: a request whose serialized bytes exceed `max_request_bytes` is refused by gRPC from
  its 5-byte length prefix, unread (RESOURCE_EXHAUSTED, worded by gRPC: `over_receive_limit`);
- the prompt: a text or chat prompt of more than `max_prompt_bytes` UTF-8 bytes is refused without
  being tokenized, token ids by their count against the context (INVALID_ARGUMENT naming the field:
  `prompt_violation`); so are ids (`request_id`...) longer than `MAX_ID_LEN` (`id_violation`).

The router publishes both limits in its `ModelCard` (ListModels). A client that sends a 15 MB prompt
through `cedserve.client` otherwise spends ~65 ms of CPU building, serializing and copying it before
the router's refusal can reach it. This module imports nothing of gRPC or protobuf.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_ID_LEN = 256
"""Characters of a request id, session id, cache salt or model name (an id is echoed in every
streamed message and logged: a megabyte one would be copied into each)."""
ID_FIELDS = ("request_id", "session_id", "cache_salt", "model")
"""The request's fields bounded by `MAX_ID_LEN`, in the order the router checks them."""
BYTES_PER_TOKEN_BOUND = 16
"""A text prompt of more than this many UTF-8 bytes per token of the context cannot fit it (a token
of the shipped tokenizers covers a few bytes): refused before it is tokenized."""
MESSAGE_SLACK_BYTES = 64 << 10
"""What a request carries besides its prompt (ids, sampling, stop strings, chat roles) at most."""


@dataclass(frozen=True)
class RequestLimits:
    """What the router accepts, as its `ModelCard` publishes it."""

    max_request_bytes: int
    """The largest serialized request the router reads (gRPC's receive limit)."""
    max_prompt_bytes: int
    """The largest text or chat prompt, in UTF-8 bytes, the router tokenizes."""
    max_context_tokens: int
    """Token ids: a prompt of this many or more leaves no room in the context."""


def request_limits(max_context_tokens: int, max_message_bytes: int) -> RequestLimits:
    """The router's limits for a model's context and its configured `max_message_bytes`: no request
    is read that is larger than a prompt that can fit the context (`BYTES_PER_TOKEN_BOUND` bytes per
    token) plus `MESSAGE_SLACK_BYTES`. Three concurrent 15 MB prompts against a 4K-token demo model
    were read, parsed and held whole before the prompt's own check refused them (0.26-0.32 s each,
    the router's memory 255 -> 366 MB)."""
    max_prompt_bytes = max_context_tokens * BYTES_PER_TOKEN_BOUND
    return RequestLimits(
        min(max_message_bytes, max_prompt_bytes + MESSAGE_SLACK_BYTES), max_prompt_bytes, max_context_tokens
    )


def over_receive_limit(size: int, limit: int) -> str:
    """gRPC's own words (its server-side message size check) for a request of `size` bytes over the
    router's receive limit: the router's handler never sees such a request, so it cannot word it."""
    return f"SERVER: Received message larger than max ({size} vs. {limit})"


def id_violation(name: str, length: int) -> tuple[str, str] | None:
    """(field, message) of the INVALID_ARGUMENT for an id field of `length` characters; None: fine."""
    if length > MAX_ID_LEN:
        return name, f"at most {MAX_ID_LEN} characters, got {length}"
    return None


def prompt_violation(kind: str | None, size: int, limits: RequestLimits) -> tuple[str, str] | None:
    """(field, message) of the INVALID_ARGUMENT for a prompt that cannot fit the context, decided
    without tokenizing it; None: it may. `kind`: the `Prompt` oneof's case; `size`: a text or chat
    prompt's UTF-8 bytes (a chat's contents summed), the count of token ids."""
    context = limits.max_context_tokens
    if kind in ("text", "chat") and size > limits.max_prompt_bytes:
        name = "prompt.text" if kind == "text" else "prompt.chat.messages"
        return name, (
            f"{size} bytes cannot fit the {context}-token context "
            f"(at most {limits.max_prompt_bytes} bytes are tokenized)"
        )
    if kind == "token_ids" and size >= context:
        return "prompt.token_ids", f"{size} ids leave no room in the {context}-token context"
    return None
