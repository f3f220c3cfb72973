"""Tokenizer path: `tokenizer.json` from a checkpoint folder through `tokenizers`; nothing is downloaded.

The tiny presets use the byte-level BPE shipped in `cedserve/assets/tiny_tokenizer.json` (built by
`scripts/build_tiny_tokenizer.py`, 512 tokens: 0 bos, 1 eos, 2 pad).

The Engram layers' compressed token map (`build_compressed_token_map`) and the config fitted to a
tokenizer (`fit_config_to_tokenizer`) live here, away from torch: the router fits a preset's config
to the shipped tokenizer and must not import torch to do it.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

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
