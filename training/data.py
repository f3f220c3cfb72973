"""The demo model's training text: the Python standard library of the running interpreter.

* Files: every `*.py` under `sysconfig.get_paths()["stdlib"]` (site-packages and `__pycache__`
  excluded) that reads as UTF-8, in sorted order of their path relative to that folder.
* Held-out split, by file: a file is held out when `crc32(relative path) % heldout_every == 0`, so
  the split does not depend on which other files exist (another Python version moves no file).
* Tokenizer: byte-level BPE trained with `tokenizers` on the training files only; ids 0-3 are the
  special tokens `SPECIAL_TOKENS` (bos, eos, pad, and the DSpark noise token).
* Token stream: each file's ids followed by eos, files concatenated in order. Training rows are
  windows of it at offsets drawn from a seeded generator; held-out rows are its consecutive windows,
  or windows spread evenly over it (`spread_rows`).
* Code: the generated charmap tables under `encodings/` (`cp1256.py`, `mac_greek.py`, ...: a
  256-entry table each, nearly identical from file to file) and `pydoc_data/` are data, not code.
  `code_files` leaves them out; the drafter's acceptance is measured on held-out code only, where a
  table would make any drafter look good (DSpark copies the next table row almost perfectly).
"""

from __future__ import annotations

import sysconfig
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from torch import Tensor

SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>", "<|draft|>")
"""ids 0-3; `<|draft|>` fills the non-anchor positions of a DSpark draft block."""
EOS_ID = 1


@dataclass(frozen=True)
class SourceFile:
    relative: str  # posix path under the corpus root
    text: str


@dataclass(frozen=True)
class Corpus:
    root: Path
    train: tuple[SourceFile, ...]
    heldout: tuple[SourceFile, ...]

    @property
    def train_chars(self) -> int:
        return sum(len(f.text) for f in self.train)


def stdlib_root() -> Path:
    """The running interpreter's standard library folder."""
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(relative: str, heldout_every: int) -> bool:
    return zlib.crc32(relative.encode()) % heldout_every == 0


def is_generated_data(f: SourceFile) -> bool:
    """A generated table or data blob rather than code (module docstring)."""
    return (f.relative.startswith("encodings/") and "decoding_table" in f.text) or f.relative.startswith("pydoc_data/")


def code_files(files: Sequence[SourceFile]) -> tuple[SourceFile, ...]:
    """`files` without the generated tables and data blobs (`is_generated_data`)."""
    return tuple(f for f in files if not is_generated_data(f))


def read_tree(root: Path, max_files: int = 0) -> tuple[SourceFile, ...]:
    """Every non-empty `*.py` file under `root` that reads as UTF-8 (site-packages, dist-packages
    and `__pycache__` excluded), in sorted order of its relative path; `max_files` (> 0): the first
    ones only."""
    skip = {"site-packages", "dist-packages", "__pycache__"}
    paths = sorted((p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts)),
                   key=lambda p: p.relative_to(root).as_posix())
    files = []
    for path in paths:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # a few test files are deliberately in other encodings
        if text.strip():
            files.append(SourceFile(path.relative_to(root).as_posix(), text))
        if max_files and len(files) >= max_files:
            break
    if not files:
        raise ValueError(f"no readable *.py files under {root}")
    return tuple(files)


def load_corpus(root: Path | None = None, heldout_every: int = 50, max_files: int = 0) -> Corpus:
    """The split corpus under `root` (default: the standard library). `max_files` (> 0) keeps the
    first files only, in sorted order (for quick runs)."""
    root = root or stdlib_root()
    files = read_tree(root, max_files)
    train = tuple(f for f in files if not is_heldout(f.relative, heldout_every))
    heldout = tuple(f for f in files if is_heldout(f.relative, heldout_every))
    if not train or not heldout:
        raise ValueError(f"{root}: {len(train)} training and {len(heldout)} held-out files; need both "
                         f"(lower heldout_every or use more files)")
    return Corpus(root, train, heldout)


def train_tokenizer(texts: Sequence[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE tokenizer of `vocab_size` ids (specials first) trained on `texts`."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    for i, special in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(special) != i:
            raise RuntimeError(f"special token {special} got id {tok.token_to_id(special)}, expected {i}")
    return tok


def token_stream(tokenizer: Tokenizer, files: Sequence[SourceFile]) -> Tensor:
    """int64 `[n]`: every file's ids then eos, in order."""
    encodings = tokenizer.encode_batch([f.text for f in files], add_special_tokens=False)
    ids: list[int] = []
    for encoding in encodings:
        ids.extend(encoding.ids)
        ids.append(EOS_ID)
    return torch.tensor(ids, dtype=torch.long)


def random_rows(stream: Tensor, batch: int, length: int, generator: torch.Generator) -> Tensor:
    """`[batch, length]` windows of `stream` at random offsets drawn from `generator` (on the CPU;
    the rows are on `stream`'s device)."""
    if stream.shape[0] < length:
        raise ValueError(f"the token stream has {stream.shape[0]} tokens, fewer than one row of {length}")
    starts = torch.randint(0, stream.shape[0] - length + 1, (batch,), generator=generator)
    index = starts.unsqueeze(1) + torch.arange(length).unsqueeze(0)
    return stream[index.to(stream.device)]


def spread_rows(stream: Tensor, length: int, rows: int) -> Tensor:
    """`[rows, length]` windows of `stream` at evenly spaced offsets from its start to its end (the
    first at 0, the last ending at the stream's end); they overlap only when the stream is shorter
    than `rows * length`."""
    if stream.shape[0] < length:
        raise ValueError(f"the token stream has {stream.shape[0]} tokens, fewer than one row of {length}")
    if rows < 1:
        raise ValueError(f"spread_rows: rows must be >= 1, got {rows}")
    starts = torch.linspace(0, stream.shape[0] - length, rows).long()
    index = starts.unsqueeze(1) + torch.arange(length).unsqueeze(0)
    return stream[index.to(stream.device)]


def consecutive_rows(stream: Tensor, length: int, max_rows: int) -> Tensor:
    """Up to `max_rows` non-overlapping `[rows, length]` windows from the start of `stream`."""
    rows = min(max_rows, stream.shape[0] // length)
    if rows == 0:
        raise ValueError(f"the token stream has {stream.shape[0]} tokens, fewer than one row of {length}")
    return stream[: rows * length].view(rows, length)
