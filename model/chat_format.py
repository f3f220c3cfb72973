"""The served checkpoint's chat format: how a conversation becomes the prompt's tokens.

The released model is encoded by rules, not by a Jinja template (as DeepSeek's recent checkpoints
ship an encoding module rather than a `chat_template`): BOS, the system prompt led by the
"Reasoning Effort: N" line, each user turn after `<｜User｜>`, each earlier assistant turn after
`<｜Assistant｜>` and closed by `<｜end▁of▁sentence｜>`, and a final `<｜Assistant｜>` for the model to
answer (`render_chat` in model/effort.py writes the text). Those markers are single special tokens
of the released tokenizer; a tokenizer without them was not trained on conversations in this
format, and rendering the markers as plain text would only feed it noise. So a checkpoint has a
chat format exactly when its tokenizer holds all four markers as tokens. The shipped demo
checkpoint (a byte-level BPE with `<|bos|>` and `<|eos|>` only) has none: chat requests to it are
refused with the field named, and text prompts work as always.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cedserve.model.effort import ASSISTANT, BOS, EOS, USER, ChatMessage, render_chat
from cedserve.model.tokenizer import TextCodec

MARKERS = (BOS, USER, ASSISTANT, EOS)
"""The released format's role and sequence markers, each one token of its tokenizer."""


@dataclass(frozen=True)
class ChatFormat:
    """The released model's conversation encoding, bound to one tokenizer."""

    codec: TextCodec
    eos_token_id: int
    """Id of `<｜end▁of▁sentence｜>`: the end of an assistant turn."""

    @classmethod
    def of(cls, codec: TextCodec) -> ChatFormat | None:
        """The format when `codec`'s tokenizer holds every marker as a token; None otherwise."""
        ids = [codec.token_id(marker) for marker in MARKERS]
        if any(i is None for i in ids):
            return None
        eos = ids[-1]
        assert eos is not None
        return cls(codec, eos)

    def encode(self, messages: Sequence[ChatMessage], effort: int) -> list[int]:
        """Token ids of the conversation (`effort`: a level 1-100), ready for the assistant's answer. `ValueError` names a
        role the format does not have (system, user and assistant only)."""
        return self.codec.encode(render_chat(messages, effort))
