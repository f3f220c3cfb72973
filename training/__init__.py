"""Training the demo checkpoint, outside the serving model (docs/training.md).

* `data`: the corpus (the running interpreter's standard library), its held-out split, tokenizer
  and token rows;
* `trainer`: the backbone and DSpark drafter training phases, run through the serving model's own
  layers (`cedserve.model`), and the drafter-only self-distillation;
* `demo`: the command that trains and writes the shipped checkpoint
  (`python -m cedserve.training.demo`).

Nothing in serving imports this package.
"""
