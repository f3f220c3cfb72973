"""One decode step's pass: which rows each sequence feeds, and what its logits decide.

Rows of a sequence in the pass, in order (all are `BatchItem`s of one `CEDModel.forward_batch`):

* a join's rows: REPLAY the last prompt tokens (bounded state), or PREFILL from `prefix_start`;
* the carry: tokens accepted in the previous step that the state has not consumed (the previous pass
  also held rejected drafts, so its state was rolled back to before them);
* the verify chunk: the anchor and the drafts chosen for verification, with a snapshot of the state
  before it, so that rejected drafts roll back exactly (SWA windows, compressors' partial groups,
  global KV entries, the Engram tail), by reference, with no copy.

A PREFILL joiner has no verify chunk: its prompt's last row samples the first token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from cedserve.decode_workers.messages import Tokens
from cedserve.decode_workers.sequence import DecodeSequence, JoinKind
from cedserve.decode_workers.speculative import Verdict, accept_greedy, accept_rejection
from cedserve.model.dspark import Draft
from cedserve.model.network import BatchItem, BatchOutput
from cedserve.model.sampling import probabilities, top_logprobs


@dataclass
class SeqPlan:
    """One sequence's share of the pass."""

    seq: DecodeSequence
    first_item: int  # index of its first item in the pass
    num_items: int
    first_position: int  # position of its first row
    draft: Draft | None  # the drafts verified (already cut to the chosen length)
    verify: bool  # the last item is a verify chunk (else: a prefill's last row samples)
    picked: bool = False  # one plain row whose token was sampled on the device (its output's `argmax`)

    @property
    def num_drafts(self) -> int:
        return 0 if self.draft is None else len(self.draft.tokens)


def plan_rows(seq: DecodeSequence, draft: Draft | None, first_item: int, replay_rows: int,
              taps: bool) -> tuple[SeqPlan, list[BatchItem]]:
    """The items of `seq` for this pass (its state is ready: joins were prepared)."""
    state = seq.state
    assert state is not None
    items: list[BatchItem] = []
    first_position = state.position
    if seq.join is JoinKind.REPLAY:
        first_position = state.position - replay_rows
        items.append(BatchItem(seq.tokens[first_position : state.position], state, taps=taps, replay=True))
    elif seq.join is JoinKind.PREFILL:
        items.append(BatchItem(seq.tokens[state.position : seq.num_prompt_tokens], state, taps=taps))
        return SeqPlan(seq, first_item, 1, first_position, None, verify=False), items
    pending = seq.tokens[state.position :]
    if len(pending) > 1:
        items.append(BatchItem(pending[:-1], state, taps=taps))
    drafts = [] if draft is None else list(draft.tokens)
    items.append(BatchItem([pending[-1], *drafts], state, taps=taps, snapshot=bool(drafts)))
    return SeqPlan(seq, first_item, len(items), first_position, draft, verify=True), items


def decide(plan: SeqPlan, outputs: list[BatchOutput]) -> tuple[Verdict, Tensor]:
    """Accept or reject the drafts; returns the verdict and the logits rows of the emitted tokens.
    Rolls the state back to before the verify chunk when a draft was rejected."""
    seq, last = plan.seq, outputs[plan.first_item + plan.num_items - 1]
    rows = last.logits if plan.verify else last.logits[-1:]
    argmax = None if last.argmax is None else last.argmax if plan.verify else last.argmax[-1:]
    drafts = [] if plan.draft is None else plan.draft.tokens
    if plan.picked:  # an overlapped step's row: sampled on the device already (greedy: its argmax)
        assert not drafts and argmax is not None and len(argmax) == 1
        return Verdict(0, [int(argmax[0])]), rows
    if seq.params.greedy:
        verdict = accept_greedy(drafts, rows, argmax)
    else:
        q = plan.draft.probs if plan.draft is not None else rows.new_zeros(0, rows.shape[-1])
        verdict = accept_rejection(drafts, q, probabilities(rows, seq.params), seq.generator)
    if verdict.num_accepted < len(drafts):
        assert seq.state is not None and last.snapshot is not None
        seq.state.restore(last.snapshot)
    return verdict, rows


def plan_taps(plan: SeqPlan, outputs: list[BatchOutput]) -> Tensor:
    """The taps of all of the sequence's rows, in position order."""
    return torch.cat([outputs[i].taps for i in range(plan.first_item, plan.first_item + plan.num_items)])


def emit(seq: DecodeSequence, verdict: Verdict, rows: Tensor, accepted_drafts: int,
         stopped: StopCheck | None = None, drafts: int = 0) -> tuple[Tokens, str]:
    """Append the verdict's tokens to `seq` up to a stop or its budget; returns the chunk to stream
    and the finish reason ("" while it continues)."""
    kept: list[int] = []
    reason = ""
    for token in verdict.tokens:
        seq.tokens.append(token)
        seq.num_emitted += 1
        kept.append(token)
        if token in seq.stop_ids or (stopped is not None and stopped(seq)):
            reason = "stop"
        elif seq.num_emitted >= seq.max_tokens:
            reason = "length"
        if reason:
            break
    return _chunk(seq, kept, rows, min(accepted_drafts, len(kept)), drafts), reason


def _chunk(seq: DecodeSequence, kept: list[int], rows: Tensor, accepted: int, drafts: int) -> Tokens:
    n = seq.params.logprobs
    if n == 0:
        return Tokens(seq.request_id, tuple(kept), accepted_drafts=accepted, draft_tokens=drafts)
    logp = torch.log_softmax(rows[: len(kept)].float(), dim=-1)
    chosen = tuple(float(logp[i, t]) for i, t in enumerate(kept))
    tops = tuple(tuple(top_logprobs(rows[i], n)) for i in range(len(kept)))
    return Tokens(seq.request_id, tuple(kept), chosen, tops, accepted, drafts)


class StopCheck:
    """Stop strings, matched on the detokenized tail of the output (the router trims the text)."""

    def __init__(self, decode: Callable[[list[int]], str], window_tokens: int = 16) -> None:
        self._decode = decode
        self._window = window_tokens

    def __call__(self, seq: DecodeSequence) -> bool:
        if not seq.stop_strings:
            return False
        output = seq.tokens[seq.num_prompt_tokens :]
        longest = max(len(s) for s in seq.stop_strings)
        tail = output[-(self._window + longest) :]
        text = self._decode(tail)
        return any(s in text for s in seq.stop_strings)
