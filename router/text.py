"""Incremental detokenization with stop strings, for streaming.

Text is emitted only once it is final: a trailing incomplete UTF-8 sequence (decoded as U+FFFD)
is held back, and so is any tail that could still grow into a stop string. When a stop string
appears, the text before it is emitted and the stream ends.

Two ways to the text, the same text: for a byte-level tokenizer (`TextCodec.byte_pieces`), each new
token's bytes go through an incremental UTF-8 decoder, with no tokenizer call per push (on a router
busy with gRPC, a call into the tokenizer cost ~8 us with its caches cold); for any other, a window of
recent tokens is decoded by the tokenizer per push (`StreamingText.decoded`).
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence

from cedserve.model.tokenizer import TextCodec

_WINDOW_TOKENS = 8
"""How many tokens a decode window may span before it moves up to the last complete piece (a
longer window is one decode of more tokens per push; a move costs one decode more)."""


class StreamingText:
    """Keeps the text decoded so far and decodes only a window of recent tokens per push: the window
    starts a few complete pieces back, and the decode of its part already final (`_window_text`) is
    kept, so each push decodes once and the new text is the difference. Both sides of the difference
    start at the same token (a decoder that treats a sequence's first token specially, as
    SentencePiece does with a leading space, does so on both). Decoding the whole output at every
    push cost O(n) per token, O(n^2) per stream; decoding both sides afresh, two decodes per push."""

    def __init__(self, codec: TextCodec, stop: Sequence[str]) -> None:
        self.codec = codec
        self.stop = tuple(stop)
        self.token_ids: list[int] = []
        self.emitted = 0  # characters of the final text already sent
        self.stopped = False
        self._text = ""  # the decode of token_ids[: self._read]
        self._start = 0  # the window the next decode starts from, at a complete piece's first token
        self._read = 0
        self._window_text = ""  # the decode of token_ids[self._start : self._read]
        self._pieces = codec.byte_pieces
        self._undecoded = b""  # byte-level: an incomplete character's first bytes, waiting for the rest

    def decoded(self) -> str:
        """`codec.decode(token_ids)`, from the kept text plus the tokens since its last complete piece."""
        if self._pieces is not None:
            return self._decoded_bytes()
        ids = self.token_ids
        if self._read == len(ids):
            return self._text
        before = self._window_text
        after = self.codec.decode(ids[self._start :])
        if not after.startswith(before):  # the window does not decode as the sum of its parts
            full = self.codec.decode(ids)
            if not full.endswith("\ufffd"):
                self._text, self._start, self._read, self._window_text = full, len(ids), len(ids), ""
            return full
        piece = after[len(before) :]
        if piece.endswith("\ufffd"):  # an incomplete character: its tokens wait for the one completing it
            return self._text + piece
        self._text += piece
        if len(ids) - self._start > _WINDOW_TOKENS:  # move up: the window starts at this piece
            self._start = self._read
            self._window_text = self.codec.decode(ids[self._start :])
        else:
            self._window_text = after
        self._read = len(ids)
        return self._text

    def _decoded_bytes(self) -> str:
        """`decoded` for a byte-level tokenizer: the new tokens' bytes decoded after those of an
        incomplete character (`utf_8_decode` leaves a character's bytes undecoded until it is
        complete, as an incremental decoder does); the incomplete tail decodes as the whole decode
        ends it (one U+FFFD)."""
        ids = self.token_ids
        if self._read < len(ids):
            data = self._undecoded + self._bytes(ids[self._read :])
            text, used = codecs.utf_8_decode(data, "replace", False)
            self._text += text
            self._undecoded = data[used:]
            self._read = len(ids)
        tail = self._undecoded
        return self._text + tail.decode("utf-8", "replace") if tail else self._text

    def _bytes(self, token_ids: list[int]) -> bytes:
        pieces = self._pieces
        assert pieces is not None
        try:
            return b"".join([pieces[t] for t in token_ids])
        except IndexError:  # past the tokenizer's ids: nothing within the model's vocabulary, an error beyond
            self.codec.decode(token_ids)  # raises for an id outside the model's vocabulary
            return b"".join([pieces[t] if t < len(pieces) else b"" for t in token_ids])

    def push(self, token_ids: Sequence[int]) -> str:
        """Add tokens; return the newly final text (maybe empty). Sets `stopped` on a stop string."""
        self.token_ids.extend(token_ids)
        text = self.decoded()
        for s in self.stop:
            at = text.find(s, max(0, self.emitted - len(s) + 1))
            if at >= 0:
                self.stopped = True
                return self._emit(text[:at])
        safe = len(text)
        if text.endswith("\ufffd"):
            safe = len(text.rstrip("\ufffd"))
        for s in self.stop:  # hold back a tail that is a prefix of a stop string
            for k in range(min(len(s) - 1, safe), 0, -1):
                if text[safe - k : safe] == s[:k]:
                    safe -= k
                    break
        return self._emit(text[: max(safe, self.emitted)])

    def finish(self) -> str:
        """The rest of the text once no more tokens come (held-back tails included)."""
        if self.stopped:
            return ""
        return self._emit(self.decoded() if self._pieces is not None else self.codec.decode(self.token_ids))

    def _emit(self, final: str) -> str:
        new = final[self.emitted :]
        self.emitted = max(self.emitted, len(final))
        return new
