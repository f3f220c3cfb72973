"""Tokenizer path: `tokenizer.json` from a checkpoint folder through `tokenizers`; nothing is downloaded.

The tiny presets use the byte-level BPE shipped in `cedserve/assets/tiny_tokenizer.json` (built by
`scripts/build_tiny_tokenizer.py`, 512 tokens: 0 bos, 1 eos, 2 pad).

The Engram layers' compressed token map (`build_compressed_token_map`) and the config fitted to a
tokenizer (`fit_config_to_tokenizer`) live here, away from torch: the router fits a preset's config
to the shipped tokenizer and must not import torch to do it.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders

from cedserve.model.config import ModelConfig


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

    @functools.cached_property
    def byte_pieces(self) -> tuple[bytes, ...] | None:
        """Each token id's bytes, where decoding is byte-level (`decode(ids)` is the UTF-8 decode, U+FFFD
        for each invalid or incomplete part, of the ids' bytes joined; special tokens are skipped, so
        theirs are empty): indexed by id up to the tokenizer's largest (ids above it, within the model's
        vocabulary, decode to nothing). None for any other tokenizer. Built once, on first use, and
        checked against `decode` for every id alone and for random sequences; None if any differs."""
        return _byte_pieces(self.tokenizer)


def _byte_level_alphabet() -> dict[str, int]:
    """The character that stands for each byte in a byte-level BPE's vocabulary (GPT-2's scheme, which
    `tokenizers`' ByteLevel uses): the printable Latin-1 bytes stand for themselves, the other 68 take
    the code points from 256 up, in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + n): b for n, b in enumerate(others)}}


def _byte_pieces(tokenizer: Tokenizer, checks: int = 256) -> tuple[bytes, ...] | None:
    """`TextCodec.byte_pieces`. A token's bytes, as the ByteLevel decoder finds them: its characters'
    bytes when all are of the byte-level alphabet, else its text's UTF-8 (an added token such as
    `<tool>`)."""
    if not isinstance(tokenizer.decoder, decoders.ByteLevel):
        return None
    alphabet = _byte_level_alphabet()
    special = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
    size = max(tokenizer.get_vocab(with_added_tokens=True).values(), default=-1) + 1
    pieces: list[bytes] = []
    for i in range(size):
        token = None if i in special else tokenizer.id_to_token(i)
        if token is None:
            pieces.append(b"")
            continue
        try:
            pieces.append(bytes(alphabet[c] for c in token))
        except KeyError:
            pieces.append(token.encode("utf-8"))
    alone = tokenizer.decode_batch([[i] for i in range(size + 1)], skip_special_tokens=True)
    if alone[size] or any(text != piece.decode("utf-8", "replace") for text, piece in zip(alone, pieces)):
        return None
    rng = random.Random(0)
    sequences = [[rng.randrange(size) for _ in range(rng.randrange(2, 12))] for _ in range(checks)]
    joined = tokenizer.decode_batch(sequences, skip_special_tokens=True)
    if any(text != b"".join(pieces[i] for i in ids).decode("utf-8", "replace") for text, ids in zip(joined, sequences)):
        return None
    return tuple(pieces)


def build_compressed_token_map(tokenizer: Any) -> tuple[list[int], int]:
    """Map each id of a `tokenizers.Tokenizer` to its normalised-vocabulary id (first-seen
    order). A token that decodes to a partial UTF-8 sequence keeps its raw token string as key."""
    from tokenizers import Regex, normalizers

    sentinel = "\ue000"  # keeps a lone-space token distinct from the empty string
    normalizer = normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), sentinel),
            normalizers.Strip(),
            normalizers.Replace(sentinel, " "),
        ]
    )
    ids: dict[str, int] = {}
    mapping = []
    for token_id in range(tokenizer.get_vocab_size(with_added_tokens=True)):
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        key = tokenizer.id_to_token(token_id) if "\ufffd" in text else (normalizer.normalize_str(text) or text)
        mapping.append(ids.setdefault(key, len(ids)))
    return mapping, len(ids)


def fit_config_to_tokenizer(config: ModelConfig, tokenizer_json: Path) -> ModelConfig:
    """The config with `engram_compressed_vocab_size` set to what this tokenizer gives."""
    _, size = build_compressed_token_map(Tokenizer.from_file(str(tokenizer_json)))
    return config.replace(engram_compressed_vocab_size=size)
