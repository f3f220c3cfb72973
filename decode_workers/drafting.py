"""Where drafts come from: the `Proposer` contract and its DSpark implementation.

A proposer owns each sequence's drafter memory (`DecodeSequence.draft`). Per step the engine asks it
for drafts after every running sequence's anchor (`propose`), verifies them in the target pass, and
then shows it the pass's taps (`observe`) so it can extend its memory with the kept positions and
roll the rejected ones back. A sequence whose drafter memory is not at its anchor yet (it joined in
this step) gets no drafts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch import Tensor

from cedserve.decode_workers.sequence import DecodeSequence
from cedserve.model.dspark import Draft, Drafter, DraftState
from cedserve.model.network import CEDModel


class Proposer(Protocol):
    """Drafts for the running batch (see the module docstring)."""

    @property
    def max_tokens(self) -> int:
        """Drafts one call proposes per sequence (K)."""
        ...

    def propose(self, seqs: Sequence[DecodeSequence]) -> list[Draft | None]:
        """K drafts after each sequence's anchor (None: none this step). Reads the sequences and
        their target state, mutates neither (a proposer may run and roll back the target)."""
        ...

    def observe(self, seq: DecodeSequence, first_position: int, taps: Tensor, keep_end: int) -> None:
        """A pass computed `taps [n, n_taps, hc, hidden]` for positions `first_position ...`; only
        positions before `keep_end` (the new anchor's) stay. Mutates `seq.draft`."""
        ...


class DSparkProposer:
    """The checkpoint's DSpark drafter: one draft pass per sequence from its context vectors."""

    def __init__(self, drafter: Drafter, model: CEDModel, num_tokens: int = 0) -> None:
        block = drafter.config.dspark_block_size
        if not 0 <= num_tokens <= block:
            raise ValueError(f"config field `decode.draft_tokens`: must be in [0, {block}], got {num_tokens}")
        self.drafter = drafter
        self.model = model
        self._k = num_tokens or block

    @property
    def max_tokens(self) -> int:
        return self._k

    def propose(self, seqs: Sequence[DecodeSequence]) -> list[Draft | None]:
        return [self._one(seq) for seq in seqs]

    def _one(self, seq: DecodeSequence) -> Draft | None:
        anchor_position = len(seq.tokens) - 1
        if seq.draft is None or seq.draft.end_position != anchor_position or seq.draft.vectors.shape[0] == 0:
            return None
        draft = self.drafter.draft(seq.anchor, seq.draft, self.model.embed, self.model.lm_head,
                                   seq.params.temperature, seq.generator)
        k = self._k
        return Draft(draft.tokens[:k], draft.probs[:k], draft.confidences[:k])

    # The drafter's weights require grad: without no_grad each step's vectors would keep an autograd
    # graph chaining every earlier step's taps alive.
    @torch.no_grad()
    def observe(self, seq: DecodeSequence, first_position: int, taps: Tensor, keep_end: int) -> None:
        state = seq.draft
        if state is None or state.end_position < first_position or state.end_position - first_position > state.rollback:
            state = DraftState.new(self.drafter.config, taps.device)
            state.end_position = first_position
        else:
            state.truncate(first_position)
        state.extend(self.drafter.context_vectors(taps))
        state.truncate(keep_end)
        seq.draft = state
