"""`PrefillWorkerConfig`: every knob of the prefill engine and its scheduler, frozen and validated.

It is read from the `[prefill]` table of the worker's `--config` file (the rest of that file is the
`ServeConfig`: `[model]`, `[cache]`) through `from_mapping` (`cedserve.model.config_table.decode_table`,
as every table), which names an unknown or mistyped field and its value.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from cedserve.model.config_table import decode_table, fail

PAGED_ATTENTION = ("auto", "kernels", "reference", "off")
RUNNER = ("auto", "on", "off")
"""`runner`'s values."""
"""`paged_attention`'s values (`cedserve.model.paged_attention.MODES`)."""


class PrefillWorkerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The prefill engine, its scheduler, and its request limits."""

    worker_id: str = ""
    """Names this worker in load reports, KV events and as its NIXL agent name; unique in the cluster.
    Empty: `prefill-<hostname>-<pid>` (the `--worker-id` flag overrides)."""
    chunk_tokens: int = 8192
    """Most prompt tokens one request computes per engine step (chunked prefill). A multiple of the
    block size, so every chunk but a prompt's last ends on a block boundary and its blocks can ship.
    An eager chunk (`runner` off) costs ~10K kernel launches (20 encoder layers of ~500) whatever its
    length, ~150 ms on an H200 with mini-40: at 2,048 a 32K prompt paid 16 of them (2.5 s;
    docs/prefill.md, *Findings: 32K prompts on one GPU*). Through the runner a chunk is one graph
    replay and ~36 launches around it."""
    step_token_budget: int = 16384
    """Most tokens computed per engine step across all requests: a long prompt takes at most
    `chunk_tokens` of it, so short prompts behind it start in the same step."""
    max_running_requests: int = 16
    """Requests holding blocks and a sequence state at once; the others wait in FIFO order."""
    replay_span: int = 128
    """Default decoder replay span (tokens) for the first output token: the decoder layers run over
    the boundary states of the prompt's last `replay_span` tokens (the report's bounded replay;
    exact once it covers `num_decoder_layers * (sliding_window - 1)` tokens or the whole prompt).
    A request may ask for another span."""
    ship_state: bool = True
    """Ship the bounded decode state (SWA windows, compressor partial groups, Engram history and, when
    asked, DSpark taps) produced by the decoder replay, when the decode target reserved room for it
    (`DecodeTarget.state_room`; the router asks per request through `ReserveRequest.ship_state`); the
    decode worker then skips its replay. False refuses such targets (INVALID_ARGUMENT)."""
    prefix_replay_span: int = 128
    """After a prefix-cache hit, the encoder's bounded state (windows, Engram history) is rebuilt by
    `CEDModel.replay` over this many tokens before the cached end. Exact once it covers the
    receptive field (`num_hidden_layers * (sliding_window - 1) + engram_max_ngram_size - 1`
    tokens); shorter spans are the bounded approximation (docs/prefill.md)."""
    max_prompt_tokens: int = 0
    """Longest accepted prompt; 0: the model's `max_position_embeddings`."""
    max_queued_tokens: int = 1 << 22
    """Uncomputed prompt tokens accepted at once; beyond it new requests get RESOURCE_EXHAUSTED."""
    retry_after_ms: int = 500
    """Retry hint sent with RESOURCE_EXHAUSTED and with requests handed back on drain."""
    drain_timeout_s: float = 30.0
    """Longest a drain (SIGTERM or `cedserve drain`) waits for in-flight requests before handing
    them back (UNAVAILABLE, so the router retries them elsewhere)."""
    handshake_timeout_s: float = 5.0
    """Handshake with a decode worker's transfer agent never seen before."""
    transfer_timeout_s: float = 0.0
    """Bound on one request's transfer; 0: the reservation's lease."""
    load_window_s: float = 30.0
    """Window of the measured prefill rate in load reports."""
    device: str = "cpu"
    """Where the model, the block pool and the states live (`cuda:0` on a GPU host)."""
    gpu_memory_fraction: float = 0.0
    """On CUDA, the share of the GPU's memory this worker process may allocate (PyTorch's caching
    allocator is capped at it: vLLM's `gpu_memory_utilization`, per process), checked at start
    against the weights, the block pool, the transfer's staging buffer and a pass's activations (a
    clear error names the fields to change). 0: no cap, the worker has its GPU to itself.
    `cedserve serve` sets it when workers share a GPU (docs/deploy.md); a value here wins."""
    paged_attention: str = "auto"
    """How prompt chunks attend (`cedserve.model.paged_attention`): "kernels" through the
    compact-cache kernels (each token's window and top-k picks over a paged copy of the records:
    the attention no longer grows with the context, only the index scan does), "reference" the
    same path on the kernels' torch references (a CPU check, slower than dense), "off" the dense
    path (every compressed entry dequantized and masked for every token of a chunk). "auto":
    "kernels" on a CUDA device, "off" elsewhere or when the model's widths do not suit the kernels."""
    kernel_warmup: bool = True
    """With the kernels on CUDA (`paged_attention`), compile their variants before serving: the
    paged path's kernel calls of a chunk and of the decoder replay over synthetic sequences at each
    power of two of the context up to the prompt limit (`cedserve.model.kernel_warmup`). Readiness
    waits for it. False: each variant compiles on its first launch, stalling that chunk (up to 5 s
    on an H200)."""
    matmul_tf32: bool = False
    """On CUDA, float32 matrix products on TF32 tensor cores for the worker process (as
    `decode.matmul_tf32`): a prefill chunk is GEMM-bound and the model is held in float32. Off by
    default until its effect on outputs is measured (benchmarks/tf32_agreement.py)."""
    runner: str = "off"
    """Chunks through the prefill runner (`cedserve.model.prefill_runner`): the encoder's pass over
    static buffers at token-count buckets (`runner_buckets`, a chunk padded to its bucket), on CUDA one
    captured graph per bucket, with no host sync. "auto": on a CUDA device when the model suits it
    (in-memory Engram tables, the kernels' widths); "on" wherever it can run (a CPU runs the pass
    eagerly: tests); "off" the eager `encode_chunk` per chunk (~10K launches whatever its length).
    The default stays "off" until the runner's GPU tests and timings have run
    (`PART=prefill-runner bash scripts/gpu.sh`); then "auto"."""
    runner_buckets: tuple[int, ...] = (512, 1024, 2048, 4096, 8192)
    """The runner's chunk sizes (tokens), increasing; the largest must hold `chunk_tokens`."""
    runner_slots: int = 1
    """Requests whose chunks run in the runner at once (a slot each, from the first chunk to the
    last; the others run eagerly). A slot holds `max_prompt_tokens` of global KV and, per layer, a
    window ring of `sliding_window + largest bucket` records."""
    runner_cuda_graphs: bool = True
    """With the runner on CUDA: capture each bucket's pass at start (False: run it eagerly)."""
    effort_queue_slack_s: float = 2.0
    """Queue order by effort: a waiting request falls due at its arrival plus this many seconds times
    effort / 100 (`cedserve.model.effort.queue_due_s`), and requests are admitted and given chunk
    budget earliest-due first. With 2 s a `max` (100) request yields to `low` (50) ones that arrive
    up to 1 s after it, never longer. 0: arrival order."""
    idle_poll_s: float = 0.02
    """Engine loop wait when it has nothing to compute."""

    def __post_init__(self) -> None:
        positive = ("chunk_tokens", "step_token_budget", "max_running_requests", "replay_span",
                    "max_queued_tokens", "drain_timeout_s", "handshake_timeout_s", "load_window_s", "idle_poll_s")
        for name in positive:
            if getattr(self, name) <= 0:
                fail("prefill", name, f"must be positive, got {getattr(self, name)}")
        for name in ("prefix_replay_span", "max_prompt_tokens", "retry_after_ms", "transfer_timeout_s",
                     "effort_queue_slack_s"):
            if getattr(self, name) < 0:
                fail("prefill", name, f"must be >= 0, got {getattr(self, name)}")
        if not 0.0 <= self.gpu_memory_fraction <= 1.0:
            fail("prefill", "gpu_memory_fraction", f"must be in [0, 1], got {self.gpu_memory_fraction}")
        if self.paged_attention not in PAGED_ATTENTION:
            fail("prefill", "paged_attention", f"must be one of {list(PAGED_ATTENTION)}, got {self.paged_attention!r}")
        if self.runner not in RUNNER:
            fail("prefill", "runner", f"must be one of {list(RUNNER)}, got {self.runner!r}")
        buckets = list(self.runner_buckets)
        if not buckets or sorted(set(buckets)) != buckets or buckets[0] < 1:
            fail("prefill", "runner_buckets", f"must be increasing positive sizes, got {buckets}")
        if self.runner != "off" and buckets[-1] < self.chunk_tokens:
            fail("prefill", "runner_buckets", f"the largest ({buckets[-1]}) must hold chunk_tokens {self.chunk_tokens}")
        if self.runner_slots < 1:
            fail("prefill", "runner_slots", f"must be >= 1, got {self.runner_slots}")
        if self.step_token_budget < self.chunk_tokens:
            fail("prefill", "step_token_budget", f"{self.step_token_budget} is below chunk_tokens {self.chunk_tokens}")

    def check_block_size(self, block_size: int) -> None:
        """Chunks must end on block boundaries (see `chunk_tokens`)."""
        if self.chunk_tokens % block_size:
            fail("prefill", "chunk_tokens", f"{self.chunk_tokens} is not a multiple of the block size {block_size}")

    def prompt_limit(self, max_position_embeddings: int) -> int:
        return self.max_prompt_tokens or max_position_embeddings

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> PrefillWorkerConfig:
        """From the `[prefill]` TOML/JSON table; `ValueError` names an unknown or mistyped field."""
        return decode_table(cls, values, "prefill")
