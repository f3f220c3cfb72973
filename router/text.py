"""Incremental detokenization with stop strings, for streaming.

Text is emitted only once it is final: a trailing incomplete UTF-8 sequence (decoded as U+FFFD)
is held back, and so is any tail that could still grow into a stop string. When a stop string
appears, the text before it is emitted and the stream ends.
"""

from __future__ import annotations

from collections.abc import Sequence

from cedserve.model.tokenizer import TextCodec


class StreamingText:
    def __init__(self, codec: TextCodec, stop: Sequence[str]) -> None:
        self.codec = codec
        self.stop = tuple(stop)
        self.token_ids: list[int] = []
        self.emitted = 0  # characters of the final text already sent
        self.stopped = False

    def push(self, token_ids: Sequence[int]) -> str:
        """Add tokens; return the newly final text (maybe empty). Sets `stopped` on a stop string."""
        self.token_ids.extend(token_ids)
        text = self.codec.decode(self.token_ids)
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
        return self._emit(self.codec.decode(self.token_ids))

    def _emit(self, final: str) -> str:
        new = final[self.emitted :]
        self.emitted = max(self.emitted, len(final))
        return new
