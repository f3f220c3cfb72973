"""`DecodeConfig`: everything one decode rank reads, as one frozen, validated dataclass.

The launcher (`cedserve worker --role decode`) builds it from the serve config's `[decode]` table and
the command line (`from_mapping`: `cedserve.model.config_table.decode_table`, as every table); the
pool's geometry (block size, number of blocks) is the `[cache]` table's (`KVCacheConfig`), read from
the cache manager. Tests build it directly. Nothing here reads the environment.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum
from typing import Any

import msgspec

from cedserve.model.config_table import decode_table, fail
from cedserve.model.effort import MAX_EFFORT


class PreemptionPolicy(str, Enum):
    """What a running request gives up when the block pool runs short."""

    OFFLOAD = "offload"
    """Copy its blocks and bounded state to host memory; resume exactly where it stopped."""
    RECOMPUTE = "recompute"
    """Drop everything; resume by recomputing the prompt and the tokens generated so far."""


PAGED_ATTENTION = ("auto", "kernels", "reference", "off")
RUNNER_MODES = ("auto", "on", "off")


class DecodeConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One decode rank: its pool, its batch, DSpark, preemption and leases."""

    worker_id: str = "decode-0"
    """Name in load reports, KV events and metrics."""
    device: str = "cpu"
    """Where the model, the block pool and the states live (`cuda`, `cuda:1`, `cpu`)."""
    gpu_memory_fraction: float = 0.0
    """On CUDA, the share of the GPU's memory this worker process may allocate (PyTorch's caching
    allocator is capped at it: vLLM's `gpu_memory_utilization`, per process), checked at start
    against the weights, the block pool, the transfer's staging buffer and a pass's activations (a
    clear error names the fields to change). 0: no cap, the worker has its GPU to itself.
    `cedserve serve` sets it when workers share a GPU (docs/deploy.md); a value here wins."""
    drain_timeout_s: float = 30.0
    """Longest drain when SIGTERM arrives without a prior `Lifecycle.Drain`."""
    max_running_requests: int = 64
    """Most requests decoding in one step (the batch)."""
    max_waiting_requests: int = 1024
    """Leased requests waiting for their KV or a batch slot; Reserve fails RESOURCE_EXHAUSTED beyond."""
    max_pass_tokens: int = 8192
    """Most rows one target pass computes (joins by replay and local prefill are capped by it)."""
    reserve_headroom_blocks: int = 0
    """Blocks Reserve keeps free for running requests to grow into (refuses a lease that would eat them)."""
    replay_span: int = 0
    """Tokens replayed to rebuild bounded state when a request joins; 0: the exact receptive field
    (`num_hidden_layers * (sliding_window - 1) + engram n-gram - 1`). Requests may ask for another."""
    dspark: bool = True
    """Speculative decoding with the DSpark drafter (when the checkpoint has one)."""
    draft_tokens: int = 0
    """Drafts per pass; 0: the model's `dspark_block_size`. A request's effort lowers it
    (`draft_limit`)."""
    ship_state: bool = True
    """Leases ask the prefill side for the bounded decode state (SWA windows, compressor partial
    groups, Engram history, DSpark taps when drafting) instead of replaying: Reserve holds room for it
    after the KV blocks and answers `ReserveReply.state_room`. `ReserveRequest.ship_state` overrides it
    per request. On by default: without it a transferred request's join replays `replay_span` tokens
    (0: the exact receptive field, 5,083 tokens at the mini-40 and released geometry) through every
    layer before its second token, ~0.43 s at 32K on an H200, where the state is a few MB
    (docs/decode.md, *Findings: 32K prompts on one GPU*)."""
    adaptive_verify: bool = True
    """Choose each request's verification length from the confidence head (else verify every draft)."""
    step_prior_s: float = 0.05
    """Prior seconds of a target pass (before any is measured): fixed part."""
    step_prior_per_row_s: float = 0.002
    """Prior seconds of a target pass: per row verified."""
    preemption: PreemptionPolicy = PreemptionPolicy.OFFLOAD
    """What a request gives up under memory pressure."""
    max_offload_bytes: int = 8 << 30
    """Host bytes offloaded requests may hold; beyond it preemption recomputes (counted)."""
    lease_ms: int = 4_000
    """Default lease: a reservation whose Decode call has not arrived by then is freed. The router
    renews the leases it still waits on every quarter lease (`Renew`), so this is the backstop for a
    lost router, not a bound on a slow prefill: a dead router's blocks come back within it."""
    transfer_timeout_ms: int = 30_000
    """Longest a lease's KV transfer may run from its Reserve (the reservation's own deadline, which the
    sender also gets): a bound against a stuck transfer while its router is alive and renewing. A
    Reserve asking for a longer lease gets that as its transfer bound."""
    max_output_tokens: int = 32_768
    """Most output tokens one request may produce on this rank: a request's budget (decided by the
    router, `cedserve.model.effort.token_budget` when the client names none) is cut to it."""
    paged_attention: str = "auto"
    """How decode and verify chunks attend (`cedserve.model.paged_attention`): "kernels" through the
    compact-cache kernels over a paged copy of the records (no per-step work over the whole context
    but the index scan), "reference" the same path on the kernels' torch references, "off" the dense
    path (every compressed entry dequantized and masked each step). "auto": "kernels" on a CUDA
    device, "reference" elsewhere (on a 2-core CPU 2.2-4x the dense path's tokens/s at 8K, x0.85-1.1
    at 2K), "off" when the model's widths do not suit the kernels."""
    kernel_warmup: bool = True
    """With the kernels on CUDA (`paged_attention`), compile their variants before serving: the
    paged path's kernel calls over synthetic sequences for every context (each power of two up to
    the block pool's) x pass size (`cedserve.model.kernel_warmup`). Readiness waits for it: on an
    H200 ~100 s with an empty Triton cache, ~10 s on a restart that kept it (the Helm chart's kernel
    cache). False: each variant compiles on its first launch, stalling that step (0.5-15 s)."""
    runner: str = "auto"
    """Decode rows through the model runner (`cedserve.model.runner`): each running request's state
    in a slot of preallocated pools, its records written straight into its blocks, the whole step one
    CUDA graph replay per batch bucket (DSpark verify rows included: a slot takes up to `2 K + 1`
    rows). "auto" (default): on a CUDA device with one rank and in-memory Engram tables; "on"
    wherever the runner can run, expert parallelism included (its MoE layers exchange rows through a
    fixed-capacity all-to-all inside the step; a CPU runs the step eagerly: tests); "off": every row
    through `forward_batch`. "auto" leaves an expert-parallel group on `forward_batch` until the
    captured exchange has run on GPUs (tests/unit/test_runner_gpu.py). Joins, replays and drafts past a
    request's allocated blocks take `forward_batch` in the same step (docs/decode.md)."""
    runner_drafter: str = "auto"
    """The DSpark drafter's pass on slots too (`cedserve.decode_workers.slot_drafting`): each drafting
    request's drafter memory in a slot of preallocated device rings, the pass one CUDA graph replay
    per batch bucket (captured at start-up) with one copy of the drafts to the host, instead of the
    eager `DSparkProposer` (tensors per request, host syncs in its MoE). "auto": with the model runner
    on (`runner`) on a CUDA device (default: its GPU tests, graph replay equal to the eager pass for
    every bucket and the engine's tokens equal with it on and off, passed on an H200 on 2026-12-04,
    docs/benchmarks/gpu-2026-12-04/runner-gpu-tests.log); "on": wherever it can run (a CPU runs the
    pass eagerly: tests); "off": the eager proposer (tensors per request: on an H200 its pass made a
    batch-1 TPOT of 29.9 ms against 7.5 ms without DSpark). Expert parallelism and proposers other
    than the DSpark drafter keep the eager path."""
    cuda_graphs: bool = True
    """With the runner on CUDA: capture its step (and the drafter's, `runner_drafter`) per batch
    bucket at start-up (False: run it eagerly)."""
    compile_fused: bool = True
    """With the runner on CUDA: its chains of small ops (RoPE, mHC expansion, window slots, the
    compressor step, the dense MoE, the Engram hashes, sampling) compiled by Inductor
    (`cedserve.model.fused`) before capture: a mini-40 step of ~1,300-1,500 kernels instead of
    ~4,300 and about half the plain graph's time (H100: 5.1-5.6 ms against 11.3 at 4K x 1, 8.1
    against 14.6-15.0 at 32 rows; docs/benchmarks/gpu-2026-12-06b/). On by default since
    2026-12-06, when `cedserve serve` ran with it on an H100 (TPOT p50 4.0 ms at one stream, 5.9 at
    four, against 5.3 and 7.1 with the plain graph on 12-05) and its graph replays equal their eager
    step (tests/unit/test_runner_gpu.py, every bucket, float32 and bf16, and the engine).
    What it costs is the first start on a host: Inductor compiles each bucket family once (the
    demo checkpoint's 16 buckets: 149 s cold on that H100, the worker ready after 212 s; the
    released 1M limit's build 49.5 s with warm caches), and later starts load the compiled graphs
    from Inductor's cache (`TORCHINDUCTOR_CACHE_DIR`, on the chart's kernel-cache volume). False
    captures the plain ops (a quick first start; twice the step time). A CPU ignores it.
    History: off from session 17 to 2026-12-06, after its replays disagreed with the eager step on
    an H200 (test_graph_replay_equals_eager_every_bucket[inductor] failed, fixed by moving the
    compressor's ring writes out of the compiled graph; benchmarks/step.py's disagreement with
    forward_batch, which the plain graphs shared, was top-k ties in its random-weight states) and
    while its cold start took longer than `cedserve serve` waited (now 600 s on CUDA)."""
    overlap: bool = True
    """With the runner on (`runner`): while the batch only decodes (no join, preemption or drafting
    step: with DSpark, the steps its cost check has promised to decline; greedy or unseeded
    requests; one rank; no Engram store), launch each step
    before the last one's tokens are read: the step's rows take the tokens the step before picked on
    the device (`ModelRunner.remember`, `FED` rows; an unseeded sampled request's pick is the
    runner's draw on the device), and the host streams that step's tokens while the GPU runs this
    one, instead of the GPU waiting for the host between steps. A request that stops has one more row
    computed, which is dropped; any other step first collects the one in flight. On by default since
    2026-12-07: on an H100 the engine's mini-40 step went 4.62 -> 3.92 ms at batch 1 and 8.66 -> 5.91
    at 32 (GPU busy 74 -> 88 % and 62 -> 90 %) with the same tokens, and its GPU test passed
    (docs/decode.md, *Overlapped steps*); greedy tokens are the same either way
    (tests/unit/test_decode_overlap.py). False: every step in series."""
    grouped_attention: bool = False
    """With the runner on CUDA: the sparse attention and the index scan take a request's verify rows
    together (`RunnerConfig.grouped_attention`: its window decoded and its index keys scanned once per
    request instead of once per row; models of up to 64 heads x rows per slot, padded to powers of
    two, else row by row). The same results as row by row (tests/kernels/test_capture_trace.py);
    off: measured on an H100 it moved mini-40's step by -4 % to +4 % at 1 and 32 requests x 1 and 6 rows
    (docs/benchmarks/gpu-2026-12-06e; `benchmarks/step.py --paths graph-fused graph-fused-grouped`)."""
    matmul_tf32: bool = False
    """On CUDA, float32 matrix products on TF32 tensor cores (`torch.backends.cuda.matmul.allow_tf32`,
    set for the worker process when the engine starts): a model held in float32 (`[model] dtype`, the
    default) then multiplies at tensor-core speed with a 10-bit mantissa instead of in fp32 FMA
    kernels; with bf16 weights (`[model] dtype = "bfloat16"`) it only touches the float32 products
    left (router, compressor pooling, mHC mixes). Off by default: its effect on the released
    geometry's step is measured in benchmarks/step.py's graph-fused-tf32 path, on outputs in
    benchmarks/tf32_agreement.py."""
    effort_queue_slack_s: float = 2.0
    """Queue order by effort: a request falls due at its Decode call's arrival plus this many seconds
    times effort / 100 (`cedserve.model.effort.queue_due_s`); joins take the earliest due first and
    preemption the latest. With 2 s a `max` (100) request yields its batch slot to `low` (50) ones
    that arrive up to 1 s after it, never longer. 0: arrival order."""
    idle_wait_s: float = 0.01
    """How long the engine loop waits for a command when idle: bounds how late it notices an expired
    lease, a passed deadline, a drain, or a transfer into another rank of its group. A command, and a
    transfer into the leader's rank that ends, wake it at once (`CommandInbox.wake`)."""

    def __post_init__(self) -> None:
        if not isinstance(self.preemption, PreemptionPolicy):
            fail("decode", "preemption", f"must be one of {[p.value for p in PreemptionPolicy]}, got {self.preemption!r}")
        for name in ("max_running_requests", "max_waiting_requests",
                     "max_pass_tokens", "lease_ms", "transfer_timeout_ms", "max_output_tokens", "max_offload_bytes"):
            if getattr(self, name) <= 0:
                fail("decode", name, f"must be positive, got {getattr(self, name)}")
        for name in ("reserve_headroom_blocks", "replay_span", "draft_tokens", "effort_queue_slack_s"):
            if getattr(self, name) < 0:
                fail("decode", name, f"must be >= 0, got {getattr(self, name)}")
        for name in ("step_prior_s", "step_prior_per_row_s", "idle_wait_s", "drain_timeout_s"):
            if not getattr(self, name) > 0:
                fail("decode", name, f"must be positive, got {getattr(self, name)}")
        if not 0.0 <= self.gpu_memory_fraction <= 1.0:
            fail("decode", "gpu_memory_fraction", f"must be in [0, 1], got {self.gpu_memory_fraction}")
        for name in ("runner", "runner_drafter"):
            if getattr(self, name) not in RUNNER_MODES:
                fail("decode", name, f"must be one of {list(RUNNER_MODES)}, got {getattr(self, name)!r}")
        if self.paged_attention not in PAGED_ATTENTION:
            fail("decode", "paged_attention", f"must be one of {list(PAGED_ATTENTION)}, got {self.paged_attention!r}")

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> DecodeConfig:
        """From the `[decode]` TOML/JSON table; `ValueError` names an unknown or mistyped field (a
        misspelt key would otherwise leave its default in force without a word)."""
        return decode_table(cls, values, "decode")

    @staticmethod
    def draft_limit(effort: int, max_drafts: int) -> int:
        """Most drafts a request of this effort (1-100) verifies per pass: `ceil(max_drafts * effort
        / 100)`, at least 1 when drafting at all. With DSpark's 5 that is 5 at effort 100 (`max`), 4
        at 75 (`high`), 3 at 50 (`low`), 2 at 25, 1 at 1-20. Effort buys target compute as it buys
        output tokens: a longer verify chunk costs rows of every pass, and pays where the output is
        long. The confidence head still chooses the length within it."""
        if max_drafts <= 0:
            return 0
        return max(1, -(-max_drafts * effort // MAX_EFFORT))
