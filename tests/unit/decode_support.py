"""Shared pieces of the decode tests: the tiny model, an engine over a loopback transfer agent, and the
prefill side of a request done the way the prefill worker does it (encode chunks, store their records
into its own blocks, send them into the decode worker's reserved blocks, replay the decoder over the
prompt's tail for the first token)."""

from __future__ import annotations

import copy
import functools
import itertools
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from cedserve.decode_workers.config import DecodeConfig
from cedserve.decode_workers.drafting import DSparkProposer, Proposer
from cedserve.decode_workers.engine import DecodeEngine
from cedserve.decode_workers.messages import (
    AttachCommand,
    Failed,
    Finished,
    Output,
    ReserveCommand,
    Reserved,
    Sampling,
    Tokens,
)
from cedserve.kv_transfer.loopback import LoopbackAgent, LoopbackHub
from cedserve.kv_transfer.region import KVLayout, KVRegion
from cedserve.kv_transfer.wire import reservation_from_pb
from cedserve.model.cache.block_pool import BlockPool
from cedserve.model.cache.config import KVCacheConfig
from cedserve.model.cache.layout import BlockLayout
from cedserve.model.cache.manager import KVCacheManager
from cedserve.model.checkpoint import cast_weights
from cedserve.model.checkpoint_writer import fit_config_to_tokenizer, random_model
from cedserve.model.config import ModelConfig
from cedserve.model.dspark import Drafter
from cedserve.model.network import BoundaryHidden, CEDModel
from cedserve.model.paged_kv import store_bytes, store_records
from cedserve.model.presets import preset
from cedserve.model.sampling import SamplingParams, probabilities
from cedserve.model.state_format import BoundedState, encode_state
from cedserve.model.tokenizer import tiny_tokenizer_path
from cedserve.proto import kv_transfer_pb2
from cedserve.serving.worker_model import torch_dtype

BLOCK = 32
_ids = itertools.count()


@functools.lru_cache(maxsize=2)
def tiny(seed: int = 7) -> tuple[CEDModel, Drafter]:
    """The tiny random model and drafter; `CEDSERVE_TEST_DTYPE=bfloat16` serves them in bfloat16
    (`checkpoint.cast_weights`), to run a decode test module's paths with bf16 weights (its exact token
    comparisons against the reference then meet bf16's near-ties on the flat random logits)."""
    torch.set_num_threads(1)  # the tiny model's ops are too small for intra-op threads
    config = fit_config_to_tokenizer(preset("tiny"), tiny_tokenizer_path())
    model, drafter = random_model(config, tiny_tokenizer_path(), seed=seed)
    dtype = os.environ.get("CEDSERVE_TEST_DTYPE", "float32")
    if dtype != "float32":
        weights = torch_dtype(dtype)
        model, drafter = cast_weights(model, weights), cast_weights(drafter, weights)
    return model, drafter


@functools.lru_cache(maxsize=2)
def tiny_bf16(seed: int = 7) -> tuple[CEDModel, Drafter]:
    """`tiny(seed)`'s weights in bfloat16 (the reference's float32 parameters float32)."""
    model, drafter = tiny(seed)
    return cast_weights(copy.deepcopy(model), torch.bfloat16), cast_weights(copy.deepcopy(drafter), torch.bfloat16)


def store_tables_as_fp8(folder: Path, config: ModelConfig) -> None:
    """Rewrite the checkpoint's Engram tables as the released model stores them: FP8 E4M3 values and
    one float32 scale per 32 channels (`<module>.scale`)."""
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    for layer_id in config.engram_layer_ids:
        name = next(n for n in tensors if n.endswith(f"layers.{layer_id}.engram.embed.weight"))
        blocks = tensors[name].float().unflatten(-1, (-1, 32))
        scale = blocks.abs().amax(-1).clamp_min(1e-12) / 448
        tensors[name] = (blocks / scale.unsqueeze(-1)).flatten(-2).to(torch.float8_e4m3fn)
        tensors[name.removesuffix("weight") + "scale"] = scale
    save_file(tensors, str(path), metadata={"format": "pt"})


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def reference_greedy(model: CEDModel, tokens: Sequence[int], n: int) -> list[int]:
    """The single-process reference: prefill, then one decode step per token, argmax each time."""
    state = model.new_state()
    out = [int(model.prefill(list(tokens), state)[-1].argmax())]
    while len(out) < n:
        out.append(int(model.decode_step([out[-1]], [state])[0].argmax()))
    return out


def greedy_ties(model: CEDModel, tokens: Sequence[int], output: Sequence[int],
                margin: float = 0.0) -> list[tuple[int, str]]:
    """Check `output` against the single-process reference (prefill, then one `decode_step` per token),
    step by step. A token that is not the reference's argmax must be a numerical tie: the argmax of
    the same prefix under another legitimate computation of the same model (one prefill chunk, chunks
    of 3 like verification, or each step batched with an unrelated sequence). Windows and global KV
    are FP8/FP4 records, so a 1e-7 matmul difference (another batch shape) can round a record the
    other way and move logits by up to ~0.2 on the random tiny model. The reference then follows
    `output`. A token within `margin` of the reference's best logit is a tie as well (for a caller
    whose server computes in another precision than the reference, e.g. bf16 attention kernels on a
    GPU against the dense float32 path). Returns the ties as (step, witness); AssertionError when no
    computation agrees."""
    state = model.new_state()
    logits = model.prefill(list(tokens), state)[-1]
    ties = []
    for i, token in enumerate(output):
        if token != int(logits.argmax()):
            gap = float(logits.max() - logits[token])
            witness = f"within {gap:.4f} of the best" if gap <= margin else \
                _tie_witness(model, list(tokens), list(output[:i]), token)
            assert witness, (f"step {i}: got {token}, the reference says {int(logits.argmax())} "
                             f"(by {float(logits.max() - logits[token]):.4f}) under every computation tried")
            ties.append((i, witness))
        logits = model.decode_step([token], [state])[0]
    return ties


def _tie_witness(model: CEDModel, tokens: list[int], done: list[int], token: int, tries: int = 12) -> str:
    """The name of a computation of the logits after `tokens + done` whose argmax is `token`, or "":
    one prefill chunk; each step batched with an unrelated sequence; `tries` random chunkings of the
    output into pieces of 1-6 tokens (the shapes verification passes have)."""
    from cedserve.model.network import BatchItem

    def run(cuts: list[int], neighbour: int) -> torch.Tensor:
        state, rows, start = model.new_state(), tokens + done, 0
        logits = torch.zeros(0)
        for end in cuts:
            items = [BatchItem(rows[start:end], state)]
            if neighbour:
                items.append(BatchItem(prompt(neighbour, end), model.new_state()))
            logits, start = model.forward_batch(items)[0].logits[-1], end
        return logits

    n = len(tokens) + len(done)
    candidates = [("one chunk", [n], 0), ("steps batched", [*range(len(tokens), n), n], 5)]
    rng = torch.Generator().manual_seed(len(done))
    for t in range(tries):
        cuts, at = [len(tokens) + int(torch.randint(0, 2, (1,), generator=rng))], 0
        at = cuts[0]
        while at < n:
            at = min(n, at + int(torch.randint(1, 7, (1,), generator=rng)))
            cuts.append(at)
        candidates.append((f"random chunking {cuts}", cuts, 5 * (t % 2)))
    for name, cuts, neighbour in candidates:
        if int(run([c for c in cuts if c > 0], neighbour).argmax()) == token:
            return name
    return ""


def layouts(model: CEDModel) -> tuple[BlockLayout, KVLayout]:
    return BlockLayout.from_config(model.config, BLOCK), KVLayout.from_config(model.config, BLOCK)


class Rig:
    """A decode engine whose transfer agent is a loopback fake, and a prefill side that sends to it."""

    def __init__(self, model: CEDModel, drafter: Drafter | None, proposer: Proposer | None = None,
                 num_blocks: int = 128, device: str = "cpu", ep: Any = None, **config: Any) -> None:
        self.model = model
        layout, kv_layout = layouts(model)
        self.hub = LoopbackHub()
        self.cache = KVCacheManager(layout, KVCacheConfig(block_size=BLOCK, num_blocks=num_blocks), "decode-test",
                                    device=device)
        region = KVRegion(self.cache.pool.storage, layout.block_bytes)
        self.agent = LoopbackAgent(self.hub, region, kv_layout, "decode")
        # the replay join unless a test asks for the shipped state (the worker's default ships it)
        self.config = DecodeConfig(**{"ship_state": False, **config})
        if proposer is None and drafter is not None:
            proposer = DSparkProposer(drafter, model, self.config.draft_tokens)
        self.engine = DecodeEngine(self.config, model, self.cache, proposer=proposer, endpoint=self.agent, ep=ep)
        self.prefill_pool = BlockPool(256, layout.block_bytes)
        self.prefill_agent = LoopbackAgent(self.hub, KVRegion(self.prefill_pool.storage, layout.block_bytes),
                                           kv_layout, "prefill")
        self.prefill_agent.handshake("decode")
        self.layout = layout
        self.outputs: list[Output] = []

    # -------------------------------------------------------------- the router's part

    def reserve(self, tokens: Sequence[int], sender: bool = True, request_id: str | None = None,
                lease_ms: int = 30_000, ship_state: bool | None = None, lease_id: str = "") -> Reserved | Failed:
        rid = request_id or f"req-{next(_ids)}"
        cmd = ReserveCommand(0, rid, lease_id or f"lease-{rid}", len(tokens), tuple(tokens), lease_ms,
                             sender_agent="prefill" if sender else "", ship_state=ship_state)
        out = self.engine.handle(cmd)[0]
        assert isinstance(out, Reserved | Failed)
        return out

    def attach(self, reserved: Reserved, tokens: Sequence[int], first: int | None, max_tokens: int,
               effort: int = 100, **sampling: Any) -> None:
        cmd = AttachCommand(0, reserved.request_id, reserved.lease_id, tuple(tokens), first, effort,
                            Sampling(max_tokens=max_tokens, **sampling))
        self.outputs += self.engine.handle(cmd)

    def prefill(self, reserved: Reserved, tokens: Sequence[int], chunk: int = 24, last: bool = True,
                state_hook: Callable[[bytearray], None] | None = None) -> int:
        """Encode, store, send (as the prefill worker does); returns the greedy first token. When the
        lease holds room for the bounded state, it is shipped there after the KV (as the prefill
        engine's `_ship_state` does); `state_hook` may tamper with its bytes first."""
        model = self.model
        state = model.new_state()
        num_blocks = -(-len(tokens) // BLOCK)
        local = self.prefill_pool.allocate(num_blocks, reserved.request_id)
        reservation = reservation_from_pb(kv_transfer_pb2.Reservation.FromString(reserved.reservation))
        sender = self.prefill_agent.sender()
        sender.open(reservation)
        spans = []
        for start in range(0, len(tokens), chunk):
            encoded = model.encode_chunk(tokens[start : start + chunk], state)
            store_records(self.layout, self.prefill_pool.storage, local, encoded.global_kv)
            spans.append(encoded.boundary)
        if not reserved.state_blocks:
            sender.write_blocks(reservation.request_id, local[reserved.num_cached_blocks :], last=last)
            logits = model.replay_decoder(BoundaryHidden.concat(spans), state)
        else:
            sender.write_blocks(reservation.request_id, local[reserved.num_cached_blocks :])
            out = model.replay_decoder_with_taps(BoundaryHidden.concat(spans), state)
            logits, window = out.logits, model.config.sliding_window
            taps = out.taps[-window:].mean(dim=2) if reserved.state_taps else None
            data = bytearray(encode_state(BoundedState.capture(state, taps), model.config))
            if state_hook is not None:
                state_hook(data)
            scratch = self.prefill_pool.allocate(reserved.state_blocks, f"{reserved.request_id}#state")
            store_bytes(self.prefill_pool.storage, scratch, bytes(data))
            sender.write_blocks(reservation.request_id, scratch, last=last)
            self.prefill_pool.decref(scratch)
            self.prefill_pool.free(scratch)
        self.prefill_pool.decref(local)
        self.prefill_pool.free(local)
        return int(logits[-1].argmax())

    # -------------------------------------------------------------- driving the engine

    def run(self, max_steps: int = 400) -> None:
        """Step until nothing runs or waits."""
        for _ in range(max_steps):
            self.outputs += self.engine.poll()
            if not self.engine.has_work():
                return
            self.outputs += self.engine.step()
        raise AssertionError("the engine did not finish")

    def tokens(self, request_id: str) -> list[int]:
        return [t for o in self.outputs if isinstance(o, Tokens) and o.request_id == request_id for t in o.token_ids]

    def finished(self, request_id: str) -> Finished | Failed | None:
        for o in self.outputs:
            if isinstance(o, Finished | Failed) and o.request_id == request_id:
                return o
        return None

    def assert_all_free(self) -> None:
        self.engine.poll()
        self.cache.check_invariants()
        held = self.cache.pool.num_blocks - self.cache.pool.num_free - self.cache.prefix.num_evictable()
        assert held == 0, f"{held} blocks still held"
        assert not self.engine.sequences and not self.engine.leases.leases
        assert self.agent.active_transfers() == 0


def greedy_rounds(rig: Rig, prompts: Iterable[list[int]], max_tokens: int) -> dict[str, list[int]]:
    """Reserve, prefill, decode every prompt together; returns request id -> all output tokens."""
    firsts = {}
    for tokens in prompts:
        reserved = rig.reserve(tokens)
        assert isinstance(reserved, Reserved), reserved
        first = rig.prefill(reserved, tokens)
        rig.attach(reserved, tokens, first, max_tokens)
        firsts[reserved.request_id] = first
    rig.run()
    return {rid: [first, *rig.tokens(rid)] for rid, first in firsts.items()}


class TargetProposer:
    """A test double for the drafter whose drafts are the target's own continuation: greedy, or sampled
    from the target's logits processed by `q` (a proposal distribution unlike the request's p unless
    `q` equals its sampling parameters). It runs the target on the sequence's state and rolls it
    back, so the state is untouched. `corrupt(step) -> position or None` replaces one draft."""

    def __init__(self, model: CEDModel, k: int, q: SamplingParams | None = None, corrupt: Any = None) -> None:
        self.model, self.k, self.q, self.corrupt = model, k, q or SamplingParams(), corrupt
        self.steps = 0

    @property
    def max_tokens(self) -> int:
        return self.k

    def attach_profile(self, profile: Any, verify_all: bool) -> None:
        pass  # drafts are the target's own: no cost check

    def propose(self, seqs: Sequence[Any]) -> list[Any]:
        from cedserve.model.dspark import Draft
        from cedserve.model.network import BatchItem

        ready = [s for s in seqs if s.state is not None]
        snaps = [s.state.snapshot() for s in ready]
        feed = [list(s.pending) for s in ready]
        tokens: list[list[int]] = [[] for _ in ready]
        probs: list[list[torch.Tensor]] = [[] for _ in ready]
        for _ in range(self.k):
            outs = self.model.forward_batch([BatchItem(f, s.state) for f, s in zip(feed, ready)])
            for i, (out, seq) in enumerate(zip(outs, ready)):
                q = probabilities(out.logits[-1], self.q)
                token = int(q.argmax()) if self.q.greedy else int(torch.multinomial(q, 1, generator=seq.generator))
                tokens[i].append(token)
                probs[i].append(q)
                feed[i] = [token]
        for seq, snap in zip(ready, snaps):
            seq.state.restore(snap)
        drafts = {}
        for i, seq in enumerate(ready):
            where = self.corrupt(self.steps) if self.corrupt is not None else None
            if where is not None and where < self.k:
                tokens[i][where] = (tokens[i][where] + 1) % self.model.config.vocab_size
            drafts[seq.request_id] = Draft(tokens[i], torch.stack(probs[i]), torch.ones(self.k))
        self.steps += 1
        return [drafts.get(s.request_id) for s in seqs]

    def observe(self, seq: Any, first_position: int, taps: torch.Tensor, keep_end: int) -> None:
        pass

    def observe_many(self, observations: Sequence[Any]) -> None:
        pass

    def release(self, seq: Any, keep: bool) -> None:
        pass


# ---------------------------------------------------------------------- expert-parallel groups


def group_items(model: CEDModel, rank: int) -> list[Any]:
    """Rank 0 decodes two sequences, rank 1 one: the same chunks whichever process runs them."""
    from cedserve.model.network import BatchItem

    specs = {0: [(prompt(19, 40), [5, 9]), (prompt(26, 41), [7])], 1: [(prompt(23, 42), [11, 3, 8])]}[rank]
    items = []
    for tokens, chunk in specs:
        state = model.new_state()
        model.prefill(tokens, state)
        items.append(BatchItem(chunk, state))
    return items


def ep_forward_worker(rank: int, world: int, port: int, out: Any, device: str = "cpu") -> None:
    """One rank of a group (gloo on CPU, NCCL with `device="cuda"`: rank r on GPU r): experts sharded,
    its own sequences' chunks through `ep_moe`; then a pass where it has nothing while its peer has
    work (it must still take part in every exchange)."""
    import torch.distributed as dist

    from cedserve.decode_workers.expert_parallel import TorchDistributedEP, ep_moe, shard_experts

    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    model, _ = tiny()
    model = model.to(f"cuda:{rank}") if device == "cuda" else model
    ep = TorchDistributedEP(model.config.n_routed_experts)
    items = group_items(model, rank)
    again = group_items(model, 0)[:1] if rank == 0 else []
    shard_experts(model, rank, world)
    logits = [o.logits for o in model.forward_batch(items, lambda ffn, x: ep_moe(ep, ffn, x))]
    extra = [o.logits for o in model.forward_batch(again, lambda ffn, x: ep_moe(ep, ffn, x))]
    out.put((rank, [t.cpu().tolist() for t in logits], [t.cpu().tolist() for t in extra]))
    dist.destroy_process_group()


GROUP_JOBS = [(0, prompt(19, 40), 7), (0, prompt(26, 41), 6), (1, prompt(23, 42), 3)]
"""(rank, prompt, tokens) of the group engine tests: two requests on the leader, a shorter one on rank 1."""


class AlwaysDrafts(DSparkProposer):
    """The DSpark proposer without the engine's cost check: it drafts whenever a sequence is at its
    anchor, so what a step verifies does not depend on measured step times."""

    def attach_profile(self, profile: Any, verify_all: bool) -> None:
        pass


def group_engine_tokens(rank: int, channel: Any, ep: Any, runner: str = "off", world: int = 2,
                        ) -> tuple[dict[str, list[int]], DecodeEngine]:
    """Run `GROUP_JOBS` through one rank's real engine loop (`channel`, `ep`: the group's; a group of
    one takes every job) until the leader has seen them all finish. With the runner on, the proposer
    always drafts and every draft is verified (deterministic rows). Returns the leader's tokens by
    request ({} elsewhere) and the engine."""
    from cedserve.decode_workers.expert_parallel import shard_experts
    from cedserve.decode_workers.loop import EngineLoop

    model, drafter = tiny()
    if world > 1:  # a spawned rank's own model: sharded in place
        shard_experts(model, rank, world)
    layout, _ = layouts(model)
    cache = KVCacheManager(layout, KVCacheConfig(block_size=BLOCK, num_blocks=64), f"decode-r{rank}")
    if runner == "off":
        config, proposer = DecodeConfig(), DSparkProposer(drafter, model)
    else:
        config = DecodeConfig(runner=runner, adaptive_verify=False)
        proposer = AlwaysDrafts(drafter, model, config.draft_tokens)
    engine = DecodeEngine(config, model, cache, proposer=proposer, ep=ep, rank=rank)
    outputs: list[Output] = []
    loop = EngineLoop(engine, channel, on_report=lambda reports: outputs.extend(o for r in reports for o in r.outputs))
    if rank == 0:
        for i, (where, tokens, n) in enumerate(GROUP_JOBS):
            rid, where = f"g{i}", where if world > 1 else 0
            loop.inbox.put(ReserveCommand(where, rid, f"lease-{rid}", len(tokens), tuple(tokens), 30_000))
            loop.inbox.put(AttachCommand(where, rid, f"lease-{rid}", tuple(tokens), None, 100, Sampling(max_tokens=n)))
    while loop.tick():
        if rank == 0 and sum(isinstance(o, Finished) for o in outputs) == len(GROUP_JOBS):
            loop.stop_requested = True
    tokens = {f"g{i}": [t for o in outputs if isinstance(o, Tokens) and o.request_id == f"g{i}" for t in o.token_ids]
              for i in range(len(GROUP_JOBS))} if rank == 0 else {}
    return tokens, engine


def group_engine_worker(rank: int, world: int, port: int, out: Any, runner: str = "off") -> None:
    """One rank of a decode group running the real loop (gloo): rank 0 (the leader) places two
    decode-only requests on itself and one, shorter, on rank 1, then stops the group when all have
    finished. Every rank reports (rank, the leader's tokens, passes, runner steps)."""
    import torch.distributed as dist

    from cedserve.decode_workers.expert_parallel import TorchDistributedEP
    from cedserve.decode_workers.loop import TorchChannel

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    ep = TorchDistributedEP(tiny()[0].config.n_routed_experts)
    tokens, engine = group_engine_tokens(rank, TorchChannel(), ep, runner, world)
    runner_steps = engine.slots.runner.steps if engine.slots is not None else 0
    out.put((rank, tokens, engine.passes, runner_steps))
    dist.destroy_process_group()


def fixed_capacity_worker(rank: int, world: int, port: int, out: Any) -> None:
    """One rank of a gloo group: every MoE layer's routed experts sharded, this rank's rows through
    `fixed_capacity_moe` and through `ep_moe` (`TorchDistributedEP`), for a full batch, a padded one
    and an empty one on rank 1 (it must still take part in every exchange)."""
    import torch.distributed as dist

    from cedserve.decode_workers.expert_parallel import (
        FixedCapacityEP,
        TorchDistributedEP,
        ep_moe,
        fixed_capacity_moe,
        shard_experts,
    )

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    model, _ = tiny()
    shard_experts(model, rank, world)
    config = model.config
    fixed = FixedCapacityEP(config.n_routed_experts, max_tokens=16, top_k=config.num_experts_per_tok,
                            hidden=config.hidden_size)
    dynamic = TorchDistributedEP(config.n_routed_experts)
    gen = torch.Generator().manual_seed(100 + rank)
    results = []
    for n in (16, 5, 0 if rank == 1 else 3):
        x = torch.randn(n, config.hidden_size, generator=gen)
        for layer in (0, len(model.layers) - 1):
            ffn = model.layers[layer].ffn
            results.append((n, fixed_capacity_moe(fixed, ffn, x).tolist(), ep_moe(dynamic, ffn, x).tolist()))
    out.put((rank, results))
    dist.destroy_process_group()


# ---------------------------------------------------------------------- the runner's expert parallelism

EXCHANGE_CASES = [("random", 8, None), ("one row", 1, None), ("all to rank 0", 8, 0), ("all to rank 1", 5, 1)]
"""(name, rows per rank, the rank whose experts take every pair or None): the last two are the worst
case the capacity is sized for on one rank and an empty receiver on the other."""


def steer(ffn: Any, owner: int | None, world: int) -> Any:
    """A copy of MoE layer `ffn` whose router picks only rank `owner`'s experts (the selection bias of
    every other expert at -1e4: the weights, from the unbiased scores, keep their values)."""
    import copy

    from cedserve.decode_workers.expert_parallel import experts_of

    ffn = copy.deepcopy(ffn)
    if owner is not None:
        keep = experts_of(owner, world, len(ffn.experts))
        with torch.no_grad():
            for e in range(len(ffn.experts)):
                if e not in keep:
                    ffn.gate.bias[e] = -1e4
    return ffn


def exchange_worker(rank: int, world: int, port: int, out: Any) -> None:
    """One rank of a gloo group: the fixed-capacity exchange's round trip (rank 1 sends nothing) and the
    runner's expert-parallel MoE (`DeviceMoE` with an exchange, dense and grouped) against one rank
    holding every expert, over `EXCHANGE_CASES` on fresh random rows per rank and case. Reports
    (rank, round trip, [(case, rows received, dense error, grouped error, output scale)])."""
    import copy

    import torch.distributed as dist

    from cedserve.decode_workers.expert_parallel import shard_experts
    from cedserve.model.device_moe import DeviceMoE
    from cedserve.model.expert_exchange import FixedCapacityEP, fixed_capacity_bytes
    from cedserve.model.fused import FusedOps

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    model, _ = tiny()
    c = model.config
    exchange = FixedCapacityEP(c.n_routed_experts, 8, c.num_experts_per_tok, c.hidden_size)
    gen = torch.Generator().manual_seed(300 + rank)
    # round trip: rank 0 sends 5 tokens, rank 1 none (capacity basis 5 on both); every pair's row
    # comes back as sent, and each rank receives exactly the pairs routed to its experts
    n = 5 if rank == 0 else 0
    x = torch.randn(n, c.hidden_size, generator=gen)
    indices = torch.randint(0, c.n_routed_experts, (n, c.num_experts_per_tok), generator=gen)
    weights = torch.rand(n, c.num_experts_per_tok, generator=gen)
    got = exchange.dispatch(x, indices, weights, rows=5)
    real = got.expert_ids >= 0
    received = sorted(zip(got.expert_ids[real].tolist(), got.weights[real, 0].tolist()))
    back = exchange.combine(got.x.clone(), got)
    trip = (torch.equal(back, x.unsqueeze(1).expand_as(back)), received, indices.tolist(), weights.tolist(),
            exchange.buffer_bytes == fixed_capacity_bytes(world, 8, c.num_experts_per_tok, c.hidden_size, 4))
    ops, results = FusedOps(compiled=False), []
    torch.set_grad_enabled(False)
    for case, rows, owner in EXCHANGE_CASES:
        full = steer(model.layers[len(model.layers) - 1].ffn, owner, world)
        x = torch.randn(rows, c.hidden_size, generator=gen)
        want = full(x)  # MoE.forward: one rank, every expert
        sharded = copy.deepcopy(full)
        shard_experts(sharded, rank, world)
        dense = DeviceMoE(copy.deepcopy(sharded), "dense", exchange)
        got_dense = dense(x, ops)
        weights, indices = ops.route_topk(x, dense.gate, dense.bias, c.scoring_func, c.gate_temp,
                                          c.num_experts_per_tok, c.norm_topk_prob, c.routed_scaling_factor)
        seen = int((exchange.dispatch(x, indices, weights, rows=rows).expert_ids >= 0).sum())  # rows received
        got_grouped = DeviceMoE(copy.deepcopy(sharded), "grouped", exchange)(x, ops)
        want_grouped = DeviceMoE(copy.deepcopy(full), "grouped")(x, ops)
        results.append((case, seen, float((got_dense - want).abs().max()),
                        float((got_grouped - want_grouped).abs().max()), float(want.abs().max())))
    out.put((rank, trip, results))
    dist.destroy_process_group()


RUNNER_SCHEDULE = {
    0: [[(0, 1), (1, 1), (2, 1)], [(0, 2), (1, 1)], [(0, 1), (1, 1), (2, 3)], [(2, 1)], [(0, 1), (1, 1), (2, 1)]],
    1: [[(0, 1)], [], [(0, 3)], [(0, 1)], []],
}
"""Per rank, per step, the (slot, rows) it feeds: single rows, several rows of one slot (carried
tokens and drafts), and steps where rank 1 feeds nothing (it still runs the group's bucket)."""
RUNNER_PROMPTS = {0: [5, 40, 101], 1: [60]}


def runner_states(model: CEDModel, rank: int) -> list[tuple[Any, int]]:
    """Rank `rank`'s sequences of the runner tests, prefilled (with every expert), and each first token."""
    gen = torch.Generator().manual_seed(500 + rank)
    out = []
    for length in RUNNER_PROMPTS[rank]:
        state = model.new_state()
        tokens = torch.randint(3, 500, (length,), generator=gen).tolist()
        out.append((state, int(model.prefill(tokens, state)[-1].argmax())))
    return out


def run_schedule(runner: Any, states: list[tuple[Any, int]], schedule: list[list[tuple[int, int]]],
                 agree: Callable[[int], int] = lambda rows: 0) -> list[tuple[list[int], torch.Tensor]]:
    """Load `states` into slots 0.. and step through `schedule`: a slot's first row feeds its next token
    (the argmax of its last row so far), further rows fixed stand-ins for drafts. `agree(rows)`: the
    group's most rows this step. Returns each step's (greedy tokens, logits)."""
    nxt = {}
    for slot, (state, token) in enumerate(states):
        runner.load(slot, state)
        nxt[slot] = token
    steps = []
    for step in schedule:
        slots = [slot for slot, n in step for _ in range(n)]
        tokens = [t for slot, n in step for t in [nxt[slot], *[(nxt[slot] * 7 + i) % 500 for i in range(1, n)]]]
        logits = runner.step_logits(slots, tokens, agree(len(slots)))
        greedy = logits.argmax(-1).tolist()
        at = 0
        for slot, n in step:
            at += n
            nxt[slot] = greedy[at - 1]
        steps.append((greedy, logits))
    return steps


RUNNER_CONFIG = {"max_slots": 4, "max_context": 256, "max_rows_per_slot": 3}


def runner_ep_worker(rank: int, world: int, port: int, out: Any, device: str = "cpu") -> None:
    """One rank of a group (gloo on CPU, the runner stepping eagerly; NCCL with `device="cuda"`, rank r on
    GPU r, the paged kernels and every bucket captured): its sequences prefilled with every expert, then
    the experts sharded and `RUNNER_SCHEDULE` stepped through a model runner with the fixed-capacity
    exchange (its own group), each step on the group's most rows (an all-reduce on a gloo group).
    Reports (rank, [(tokens, logits)] per step)."""
    import copy

    import torch.distributed as dist

    from cedserve.decode_workers.expert_parallel import TorchDistributedEP, shard_experts
    from cedserve.model.runner import ModelRunner, RunnerConfig

    cuda = device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    model, _ = tiny()
    if cuda:
        model = copy.deepcopy(model).to(f"cuda:{rank}")
    model.use_paged_attention("kernels" if cuda else "reference")
    states = runner_states(model, rank)
    shard_experts(model, rank, world)
    config = RunnerConfig(**RUNNER_CONFIG)
    ep = TorchDistributedEP(model.config.n_routed_experts, None, dist.new_group(backend="gloo") if cuda else None)
    exchange = ep.runner_exchange(config.bucket_sizes[-1], model.config.num_experts_per_tok,
                                  model.config.hidden_size, model.embed.weight.dtype, model.embed.weight.device)
    runner = ModelRunner(model, config, exchange=exchange)
    runner.capture()  # CUDA: every bucket, on both ranks in the same order (collectives inside)
    steps = run_schedule(runner, states, RUNNER_SCHEDULE[rank], ep.agree)
    out.put((rank, [(tokens, logits.cpu().tolist()) for tokens, logits in steps]))
    dist.destroy_process_group()
