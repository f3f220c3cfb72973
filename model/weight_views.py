"""Weights that one GEMM reads together, held once: the concatenated tensor owns the storage and the
modules' own weights become views into it.

The captured decode step runs `wq_a | wkv | weights_proj` as one GEMM and a layer's experts (the
shared one last) as stacked tensors (`cedserve.model.slot_step`, `cedserve.model.device_moe`).
Built as copies, those would double the memory of every weight involved: at the released shape the
experts are most of the model. Here the copy is made once and each module parameter is re-pointed
at its rows of it (`param.data = view`), so the eager path and the slot step read one tensor, a
checkpoint loaded in place (`copy_`) updates both, and the old per-module tensors are freed. A
second caller for the same weights (a runner built again) gets the same tensor back.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn


def _is_view_of(weights: Sequence[Tensor], whole: Tensor) -> bool:
    """Whether `weights` already are consecutive row blocks of `whole` (in order, no gaps)."""
    offset = 0
    base, size = whole.data_ptr(), whole.element_size()
    for w in weights:
        if w.dtype != whole.dtype or w.device != whole.device or not w.is_contiguous():
            return False
        if w.data_ptr() != base + offset * size:
            return False
        offset += w.numel()
    return offset == whole.numel()


def concat_rows(params: Sequence[nn.Parameter | Tensor]) -> Tensor:
    """`[out_i, in]` weights as one `[sum out_i, in]` tensor whose row blocks the parameters now are
    (module docstring). Weights of different dtypes or devices cannot share: then a plain copy."""
    if not params:
        raise ValueError("concat_rows: no weights")
    flat = [p.detach() for p in params]
    first = flat[0]
    rows = sum(w.shape[0] for w in flat)
    storage = first.untyped_storage()
    fits = first.storage_offset() + rows * first[0].numel() <= storage.nbytes() // first.element_size()
    if fits and len({(w.dtype, w.device, w.shape[1:]) for w in flat}) == 1:
        # already one tensor's row blocks (a second call): the tensor those views share
        shape = (rows, *first.shape[1:])
        whole = first.as_strided(shape, torch.empty(shape, device="meta").stride(), first.storage_offset())
        if _is_view_of(flat, whole):
            return whole
    whole = torch.cat(flat)
    if len({(w.dtype, w.device) for w in flat}) == 1:
        start = 0
        for p, w in zip(params, flat, strict=True):
            p.data = whole[start : start + w.shape[0]]
            start += w.shape[0]
    return whole


def stack_experts(gate_up: Sequence[tuple[nn.Parameter | Tensor, nn.Parameter | Tensor]],
                  down: Sequence[nn.Parameter | Tensor]) -> tuple[Tensor, Tensor]:
    """Experts' `(w1 [I, D], w3 [I, D])` pairs and `w2 [D, I]` as `w13 [E, 2I, D]` (each expert's w1
    rows, then w3) and `w2 [E, D, I]`, the parameters re-pointed at their slices."""
    w13 = concat_rows([p for pair in gate_up for p in pair]).view(len(gate_up), -1, gate_up[0][0].shape[-1])
    w2 = concat_rows(list(down)).view(len(down), *down[0].shape)
    return w13, w2
