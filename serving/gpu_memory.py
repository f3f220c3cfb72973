"""A worker's share of its GPU: the memory cap it runs under and the start-up check that the model
and its caches fit in it.

Workers of one `cedserve serve` share a GPU when the host has fewer GPUs than worker ranks (the
launcher hands the ranks out round-robin). Each worker then runs under a fraction of its GPU's
memory (`[prefill] gpu_memory_fraction`, `[decode] gpu_memory_fraction`: vLLM's
`gpu_memory_utilization`, per process), applied to PyTorch's caching allocator by `claim_share`
(`torch.cuda.set_per_process_memory_fraction`): an allocation past it fails in this process instead
of starving its neighbour. At start, once the weights are loaded and before the block pool exists,
`check_fits` compares what the worker will hold (`MemoryNeed`) with its share and with what the
device has free, and fails naming the fields to change.

Not counted: the CUDA context and the NCCL/UCX buffers outside PyTorch's allocator (about 0.5 GiB
per process on an H200); that is why the shares the launcher gives sum to 0.9, not 1.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from prometheus_client import CollectorRegistry, Gauge

from cedserve.kv_transfer.config import KVTransferConfig
from cedserve.model.config import ModelConfig

GIB = 1 << 30
ALLOCATOR_ALLOWANCE_BYTES = 1 << 30
"""Beyond the activations' estimate: Triton and cuBLAS workspaces, CUDA graph pools, the caching
allocator's fragmentation."""
ACTIVATION_COPIES = 8
"""Residual-stream-sized float32 tensors alive at once per row in one layer's pass (the streams,
the attention's and the MoE's inputs and outputs): a rough bound, not a profile."""


@dataclass(frozen=True)
class GpuShare:
    """The memory one worker process may use on its device."""

    device: str
    """The torch device, e.g. `cuda:0` (the process's own numbering, after CUDA_VISIBLE_DEVICES)."""
    total_bytes: int
    fraction: float
    """0: no cap (the worker has the device to itself)."""
    free_bytes: int
    """Free on the device when the share was claimed (other processes' memory excluded)."""

    @property
    def budget_bytes(self) -> int:
        return int(self.total_bytes * self.fraction) if self.fraction > 0 else self.total_bytes


@dataclass(frozen=True)
class MemoryNeed:
    """What a worker will hold on its device, by part (bytes), and which config field sizes each."""

    parts: tuple[tuple[str, int, str], ...]
    """(part, bytes, the field that sizes it), e.g. ("block pool", 233_308_160, "[cache] num_blocks")."""

    @property
    def total_bytes(self) -> int:
        return sum(nbytes for _, nbytes, _ in self.parts)

    def describe(self) -> str:
        return ", ".join(f"{name} {_size(nbytes)}" for name, nbytes, _ in self.parts)


def _size(nbytes: int) -> str:
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB // 10 else f"{nbytes / (1 << 20):.1f} MiB"


def claim_share(device: str, fraction: float) -> GpuShare | None:
    """Cap this process's allocations on `device` at `fraction` of its memory (0: no cap); None on a
    CPU. Call it before the model loads."""
    if not device.startswith("cuda"):
        return None
    index = torch.device(device).index or 0
    free, total = torch.cuda.mem_get_info(index)
    if fraction > 0:
        torch.cuda.set_per_process_memory_fraction(fraction, index)
    return GpuShare(f"cuda:{index}", int(total), fraction, int(free))


def module_bytes(modules: Iterable[torch.nn.Module | None]) -> int:
    """Bytes of every parameter and buffer of `modules` (None skipped)."""
    return sum(t.numel() * t.element_size() for m in modules if m is not None
               for t in (*m.parameters(), *m.buffers()))


def activation_bytes(config: ModelConfig, rows: int) -> int:
    """A rough bound on one pass's transient device memory over `rows` token rows: a layer's
    residual-stream-sized tensors, its routed experts' hidden activations and the logits (float32),
    plus `ALLOCATOR_ALLOWANCE_BYTES`."""
    per_row = (ACTIVATION_COPIES * config.hc_mult * config.hidden_size
               + 3 * config.num_experts_per_tok * config.moe_intermediate_size + config.vocab_size)
    return rows * per_row * 4 + ALLOCATOR_ALLOWANCE_BYTES


def staging_bytes(kv: KVTransferConfig) -> int:
    """The KV transfer's staging buffer on a device (`[kv_transfer] staging_slots x staging_slot_bytes`),
    0 when packing is off."""
    resolved = kv.resolved(device_memory=True)
    if not resolved.staging_slots or resolved.pack_threshold(device_memory=True) == 0:
        return 0
    return resolved.staging_slots * (resolved.staging_slot_bytes or 0)


def check_fits(role: str, share: GpuShare, need: MemoryNeed) -> None:
    """`ValueError` naming the fields to change when `need` exceeds the share, or exceeds what the
    device had free when the share was claimed (other processes hold the rest)."""
    if need.total_bytes > share.budget_bytes:
        fields = [f"[{role}] gpu_memory_fraction (now {share.fraction or 'unset: the whole GPU'})"]
        fields += [name for _, _, name in sorted(need.parts, key=lambda p: -p[1])]
        raise ValueError(
            f"{role} worker does not fit its share of {share.device}: it needs {need.total_bytes / GIB:.2f} GiB "
            f"({need.describe()}), its share is {share.budget_bytes / GIB:.2f} GiB of {share.total_bytes / GIB:.2f}. "
            f"Raise the share or lower the rest, in the serve config: {'; '.join(fields)}")
    if need.total_bytes > share.free_bytes:
        raise ValueError(
            f"{role} worker: {share.device} had {share.free_bytes / GIB:.2f} GiB free at start, the worker needs "
            f"{need.total_bytes / GIB:.2f} GiB ({need.describe()}): other processes hold the rest (nvidia-smi). "
            f"Stop them, or lower [{role}] gpu_memory_fraction and [cache] num_blocks")


def register_memory_gauges(registry: CollectorRegistry, share: GpuShare | None) -> None:
    """On a GPU, the worker's memory as gauges read at each scrape: its share, what PyTorch's
    allocator holds (reserved) and the most it held (peak), in bytes."""
    if share is None:
        return
    index = torch.device(share.device).index or 0
    Gauge("cedserve_gpu_memory_share_bytes", "This worker's share of its GPU (gpu_memory_fraction x total; "
          "the whole GPU when unset)", registry=registry).set(share.budget_bytes)
    Gauge("cedserve_gpu_memory_reserved_bytes", "GPU memory PyTorch's allocator holds in this process",
          registry=registry).set_function(lambda: torch.cuda.memory_reserved(index))
    Gauge("cedserve_gpu_memory_peak_bytes", "Most GPU memory PyTorch's allocator has held in this process",
          registry=registry).set_function(lambda: torch.cuda.max_memory_reserved(index))
