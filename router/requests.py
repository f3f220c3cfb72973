"""Turn a public `GenerateRequest` into a validated, tokenized `PreparedRequest`.

Every refusal is a `RequestError` with INVALID_ARGUMENT naming the field, raised before any worker
is touched, so a bad request leaves no state anywhere.

This is where a request's values are decided, once: its effort level, its output budget (the
client's `max_tokens`, else the router's default, else the effort's `token_budget`, within the
context), its sampling (top_p 0 or 1 becomes 1, off). The `PreparedRequest` travels as such to the
workers (`frontend.py` copies it onto the wire), which take these values as given.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from cedserve.common.request_limits import (
    ID_FIELDS,
    RequestLimits,
    id_violation,
    prompt_violation,
    request_limits,
)
from cedserve.model.cache.hashing import hash_blocks
from cedserve.model.chat_format import ChatFormat
from cedserve.model.effort import ChatMessage, parse_effort, token_budget
from cedserve.model.tokenizer import TextCodec
from cedserve.proto import generation_pb2
from cedserve.router.errors import invalid

_EFFORT_NAMES = {generation_pb2.EFFORT_NAME_LOW: "low", generation_pb2.EFFORT_NAME_HIGH: "high",
                 generation_pb2.EFFORT_NAME_MAX: "max"}
MAX_STOP_STRINGS = 16
MAX_STOP_LEN = 256


@dataclass(frozen=True)
class ModelLimits:
    model_id: str
    vocab_size: int
    max_context_tokens: int
    block_size: int
    default_max_tokens: int
    """0: the effort level's budget."""
    chat_format: ChatFormat | None = None
    """How the checkpoint encodes a conversation (model/chat_format.py); None: chat prompts are refused."""
    eos_token_ids: frozenset[int] = frozenset()
    """The model's end-of-sequence ids (`eos_token_id`, one or several): a first token from prefill
    that is one of them ends the request, as the decode worker's own check does for later tokens."""


def eos_ids(eos_token_id: int | tuple[int, ...] | list[int] | None) -> frozenset[int]:
    """`eos_token_id` as the checkpoint's config gives it (an id, several, or none) as a set."""
    if eos_token_id is None:
        return frozenset()
    return frozenset([eos_token_id] if isinstance(eos_token_id, int) else eos_token_id)


def message_limit(limits: ModelLimits, configured: int) -> int:
    """The largest request worth reading: `configured`, but no more than a prompt that can fit the
    context (`cedserve.common.request_limits.request_limits`)."""
    return request_limits(limits.max_context_tokens, configured).max_request_bytes


@dataclass(frozen=True)
class PreparedRequest:
    """A request as decided by the router: every value checked and resolved."""

    request_id: str
    token_ids: tuple[int, ...]
    effort: int
    """1-100."""
    temperature: float
    top_p: float
    """In (0, 1]; 1: off."""
    top_k: int
    seed: int | None
    logprobs: int
    max_tokens: int
    """Output budget, >= 1 and within the context."""
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    cache_salt: str
    session_id: str
    block_hashes: tuple[bytes, ...]


def resolve_effort(effort: generation_pb2.Effort) -> int:
    kind = effort.WhichOneof("value")
    if kind is None:
        return parse_effort(None)
    try:
        if kind == "name":
            if effort.name not in _EFFORT_NAMES:
                raise ValueError("field `effort`: unknown name")
            return parse_effort(_EFFORT_NAMES[effort.name])
        return parse_effort(int(effort.level))
    except ValueError as exc:
        raise invalid("effort", str(exc).replace("field `effort`: ", "")) from None


def _check_sizes(request: generation_pb2.GenerateRequest, limits: ModelLimits) -> None:
    """Bounds checked before any work: id lengths, and the prompt's size against the context (in
    bytes for text, which is not tokenized when it cannot fit; in ids for token ids). The wording is
    common/request_limits.py's, which `cedserve.client` applies before sending."""
    for name in ID_FIELDS:
        found = id_violation(name, len(getattr(request, name)))
        if found is not None:
            raise invalid(*found)
    prompt = request.prompt
    kind = prompt.WhichOneof("kind")
    if kind == "text":
        size = len(prompt.text.encode("utf-8", "surrogatepass"))
    elif kind == "chat":
        size = sum(len(m.content.encode("utf-8", "surrogatepass")) for m in prompt.chat.messages)
    else:
        size = len(prompt.token_ids.ids)
    found = prompt_violation(kind, size, _prompt_limits(limits))
    if found is not None:
        raise invalid(*found)


def _prompt_limits(limits: ModelLimits) -> RequestLimits:
    """The prompt's bounds (the message limit plays no part once the message is read)."""
    return request_limits(limits.max_context_tokens, 0)


def _tokens(request: generation_pb2.GenerateRequest, effort: int, codec: TextCodec, limits: ModelLimits) -> list[int]:
    kind = request.prompt.WhichOneof("kind")
    if kind == "text":
        return codec.encode(request.prompt.text)
    if kind == "chat":
        messages = [ChatMessage(m.role, m.content) for m in request.prompt.chat.messages]
        if not messages:
            raise invalid("prompt.chat.messages", "must not be empty")
        if limits.chat_format is None:
            raise invalid("prompt.chat.messages", f"model {limits.model_id!r} has no chat format (its tokenizer "
                                                  "lacks the chat markers and it has no template): send a text "
                                                  "prompt or token ids")
        try:
            return limits.chat_format.encode(messages, effort)
        except ValueError as exc:
            raise invalid("prompt.chat.messages", str(exc)) from None
    if kind == "token_ids":
        ids = list(request.prompt.token_ids.ids)
        if ids and max(ids) >= limits.vocab_size:  # in C; the loop only to name the first bad one
            for i, t in enumerate(ids):
                if t >= limits.vocab_size:
                    raise invalid(f"prompt.token_ids[{i}]", f"token id {t} is outside the vocabulary "
                                                        f"[0, {limits.vocab_size})")
        return ids
    raise invalid("prompt", "set one of text, token_ids or chat")


def prepare(request: generation_pb2.GenerateRequest, codec: TextCodec, limits: ModelLimits) -> PreparedRequest:
    """Validate and tokenize; `RequestError` (INVALID_ARGUMENT, field named) on bad input."""
    _check_sizes(request, limits)
    if request.model and request.model != limits.model_id:
        raise invalid("model", f"unknown model {request.model!r}; this server serves {limits.model_id!r}")
    effort = resolve_effort(request.effort)
    tokens = _tokens(request, effort, codec, limits)
    if not tokens:
        raise invalid("prompt", "is empty")
    s = request.sampling
    if not 0.0 <= s.temperature <= 100.0:
        raise invalid("sampling.temperature", f"must be in [0, 100], got {s.temperature}")
    if not 0.0 <= s.top_p <= 1.0:
        raise invalid("sampling.top_p", f"must be in [0, 1], got {s.top_p}")
    if s.logprobs > 20:
        raise invalid("sampling.logprobs", f"must be at most 20, got {s.logprobs}")
    if len(request.stop) > MAX_STOP_STRINGS or any(not x or len(x) > MAX_STOP_LEN for x in request.stop):
        raise invalid("stop", f"at most {MAX_STOP_STRINGS} non-empty strings of up to {MAX_STOP_LEN} characters")
    for i, t in enumerate(request.stop_token_ids):
        if t >= limits.vocab_size:
            raise invalid(f"stop_token_ids[{i}]", f"token id {t} is outside the vocabulary")
    budget = request.max_tokens or limits.default_max_tokens or token_budget(effort)
    room = limits.max_context_tokens - len(tokens)
    if room < 1:
        raise invalid("prompt", f"{len(tokens)} tokens leave no room in the {limits.max_context_tokens}-token context")
    if request.max_tokens and request.max_tokens > room:
        raise invalid("max_tokens", f"{request.max_tokens} exceeds the {room} tokens left in the context")
    salt = request.cache_salt
    return PreparedRequest(
        request_id=request.request_id or uuid.uuid4().hex,
        token_ids=tuple(tokens), effort=effort, temperature=float(s.temperature),
        top_p=float(s.top_p) if 0.0 < s.top_p < 1.0 else 1.0, top_k=int(s.top_k),
        seed=int(s.seed) if s.HasField("seed") else None, logprobs=int(s.logprobs),
        max_tokens=min(budget, room), stop=tuple(request.stop), stop_token_ids=tuple(request.stop_token_ids),
        cache_salt=salt, session_id=request.session_id,
        block_hashes=tuple(hash_blocks(tokens, salt, limits.block_size)),
    )
