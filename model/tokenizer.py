"""Tokenizer path: `tokenizer.json` from a checkpoint folder through `tokenizers`; nothing is downloaded.

The tiny presets use the byte-level BPE shipped in `cedserve/assets/tiny_tokenizer.json` (built by
`scripts/build_tiny_tokenizer.py`, 512 tokens: 0 bos, 1 eos, 2 pad).
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from tokenizers import Tokenizer


def tiny_tokenizer_path() -> Path:
    """The shipped tokenizer of the tiny presets."""
    return Path(str(resources.files("cedserve") / "assets" / "tiny_tokenizer.json"))


@dataclass(frozen=True)
class TextCodec:
    """Text <-> token ids for one model; checks ids against the model's vocabulary."""

    tokenizer: Tokenizer
    model_vocab_size: int

    @classmethod
    def from_file(cls, path: str | Path, model_vocab_size: int) -> TextCodec:
        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"tokenizer not found: {path} (a checkpoint folder needs tokenizer.json)")
        tok = Tokenizer.from_file(str(path))
        if tok.get_vocab_size() > model_vocab_size:
            raise ValueError(f"tokenizer {path} has {tok.get_vocab_size()} tokens, more than the model's "
                             f"vocab_size {model_vocab_size}")
        return cls(tok, model_vocab_size)

    def encode(self, text: str) -> list[int]:
        # encode_batch, not encode: it releases the GIL while it runs (encode holds it throughout), so a
        # long prompt tokenized on a thread leaves the caller's event loop running (router/tokenize_pool.py)
        return list(self.tokenizer.encode_batch([text], add_special_tokens=False)[0].ids)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        bad = [t for t in token_ids if not 0 <= t < self.model_vocab_size]
        if bad:
            raise ValueError(f"token ids out of range [0, {self.model_vocab_size}): {bad[:5]}")
        return str(self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens))

    def token_id(self, token: str) -> int | None:
        found = self.tokenizer.token_to_id(token)
        return None if found is None else int(found)

    @property
    def vocab(self) -> dict[str, int]:
        return dict(self.tokenizer.get_vocab(with_added_tokens=True))
