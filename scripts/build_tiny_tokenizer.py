"""Build the byte-level BPE tokenizer shipped for the tiny presets (cedserve/assets/tiny_tokenizer.json).

Deterministic: trained on a fixed text held in this script (prose about serving, a little Python,
the effort lines of the chat template), so rebuilding on any machine gives the same file. Usage:
    python scripts/build_tiny_tokenizer.py [--vocab-size 512] [--out cedserve/assets/tiny_tokenizer.json]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

REPO = Path(__file__).resolve().parents[1]
SPECIALS = ["<|bos|>", "<|eos|>", "<|pad|>"]


_PROSE = """\
The router places each request on a prefill worker and a decode worker. The prefill worker runs
the encoder over the prompt, writes compact records into its blocks and sends them to the decode
worker, which replays the last tokens, joins the batch and streams the answer back to the client.
A serving engineer reads the metrics: time to first token, time per output token, the prefix hit
rate, the bytes moved between workers and the errors by status. Hello, world! How are you today?
The quick brown fox jumps over the lazy dog. One, two, three, four, five, six, seven, eight.
"""


def corpus() -> list[str]:
    texts = [_PROSE] * 3
    texts.append("def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n")
    texts.append("Reasoning Effort: 50\nReasoning Effort: 75\nReasoning Effort: 100\n")
    return texts


def build(vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), trainer=trainer)
    return tok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--vocab-size", type=int, default=512)
    parser.add_argument("--out", type=Path, default=REPO / "cedserve" / "assets" / "tiny_tokenizer.json")
    args = parser.parse_args()
    tok = build(args.vocab_size)
    args.out.write_text(tok.to_str(pretty=False))
    print(f"wrote {args.out} ({tok.get_vocab_size()} tokens)")


if __name__ == "__main__":
    main()
