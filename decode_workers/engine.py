"""`DecodeEngine`: one decode rank's requests, from lease to last token.

Single-threaded: the engine loop (`loop.py`) calls `handle` with the commands the gRPC service
queued, `poll` for finished transfers and expired leases, and `step` while there is work; each
returns the outputs to stream. A step:

1. `schedule`: joins, preemptions, growth room (`scheduler.py`, `sched_output.py`);
2. preempt (offload to host or drop) and prepare joins (global KV from the blocks, onload, or the
   prefill side's shipped bounded state installed over it: no replay rows, drafts at once);
3. draft for every running sequence whose drafter memory is at its anchor, and choose each one's
   verification length from the confidence head (maximising expected tokens per second for this
   batch under the measured pass-cost line, `profile.py`), at most its effort's `draft_limit`;
4. one target pass over every sequence's rows (`step.py`), the MoE through expert parallelism;
5. accept (greedy, or lossless rejection sampling), roll rejected drafts back, stream tokens, write
   the new records into the blocks, offer whole blocks to the prefix cache, retire finished requests.

Every rank of a decode group runs a step whenever any rank has work (`agree`), and in it the same
passes: the eager pass where any rank has `forward_batch` rows, the runner's step where any has
runner rows (on the group's largest bucket), empty or padded where a rank has less, so that the MoE
collectives line up.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np
import torch
from torch import Tensor

from cedserve.common.errors import ErrorKind
from cedserve.decode_workers import state_io
from cedserve.decode_workers.config import DecodeConfig, PreemptionPolicy
from cedserve.decode_workers.drafting import DSparkProposer, Observation, Proposer
from cedserve.decode_workers.expert_parallel import ExpertParallel, FixedCapacityEP, SingleRank, ep_moe
from cedserve.decode_workers.leases import LeaseBook, LeaseError, StateRoomPolicy
from cedserve.decode_workers.link_probe import ProbeDigests
from cedserve.decode_workers.messages import (
    AttachCommand,
    CancelCommand,
    Command,
    Failed,
    Finished,
    Output,
    ProbeCheckCommand,
    RankLoad,
    RenewCommand,
    ReserveCommand,
)
from cedserve.decode_workers.metrics import DECODE_PATHS, DecodeMetrics
from cedserve.decode_workers.profile import StepProfile
from cedserve.decode_workers.sched_output import SchedulerOutput
from cedserve.decode_workers.scheduler import BlockBudget, DecodeScheduler
from cedserve.decode_workers.sequence import DecodeSequence, JoinKind, Lease, Status
from cedserve.decode_workers.slot_book import AheadStep, SlotBook, runner_unavailable
from cedserve.decode_workers.slot_drafting import SlotDSparkProposer, slot_drafting_unavailable
from cedserve.decode_workers.speculative import choose_verify_lengths
from cedserve.decode_workers.step import SeqPlan, StopCheck, decide, emit, plan_rows, plan_taps
from cedserve.kv_transfer.protocol import TransferEndpoint
from cedserve.model import kernel_warmup
from cedserve.model.cache.errors import CacheExhaustedError
from cedserve.model.cache.layout import BlockLayout
from cedserve.model.cache.manager import KVCacheManager
from cedserve.model.config_table import config_error
from cedserve.model.draft_runner import DraftRunnerConfig
from cedserve.model.dspark import Draft, DraftState
from cedserve.model.effort import effort_class, queue_due_s
from cedserve.model.moe import MoE
from cedserve.model.network import BatchItem, BatchOutput, CEDModel
from cedserve.model.paged_attention import enable_paged_attention
from cedserve.model.paged_kv import load_bytes
from cedserve.model.sampling import make_generator
from cedserve.model.state import SequenceState
from cedserve.model.state_format import (
    BoundedState,
    StateFormatError,
    decode_state,
    max_state_bytes,
    taps_supported,
)

log = logging.getLogger(__name__)


class DecodeEngine:
    def __init__(self, config: DecodeConfig, model: CEDModel, cache: KVCacheManager, *,
                 proposer: Proposer | None = None, ep: ExpertParallel | None = None,
                 endpoint: TransferEndpoint | None = None, metrics: DecodeMetrics | None = None,
                 detokenize: Callable[[list[int]], str] | None = None, rank: int = 0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if config.reserve_headroom_blocks >= cache.pool.num_blocks:
            raise config_error("decode", "reserve_headroom_blocks", f"{config.reserve_headroom_blocks} leaves no "
                               f"block of the pool's {cache.pool.num_blocks}")
        self.config = config
        self.model = model
        self.paged_attention = enable_paged_attention(model, config.paged_attention, "decode.paged_attention",
                                                      cpu_auto="reference")
        self.cache = cache
        self.layout: BlockLayout = cache.layout
        self.ep = ep or SingleRank(model.config.n_routed_experts)
        self.proposer = self._slot_drafting(proposer) if config.dspark and proposer is not None else None
        self.metrics = metrics or DecodeMetrics()
        self.rank = rank
        self.clock = clock
        self.endpoint = endpoint
        self.on_passes: Callable[[], None] | None = None
        """Called in each step once its schedule and joins are done, before its passes (the drafter's,
        the target's), where this thread mostly waits on torch ops that release the GIL (the engine
        loop hands the last tick's outputs to the streams here)."""
        self._taps_dtype: torch.dtype | None = None
        self.leases = LeaseBook(cache, endpoint, self.metrics, config.reserve_headroom_blocks, clock,
                                self._state_room_policy(), config.transfer_timeout_ms / 1000)
        self.profile = StepProfile(config.step_prior_s, config.step_prior_per_row_s)
        if self.proposer is not None:
            # the proposer may decline a step's drafting when the measured draft pass cannot pay for itself
            self.proposer.attach_profile(self.profile, verify_all=not config.adaptive_verify)
        lookahead = (self.proposer.max_tokens if self.proposer is not None else 0) + 1
        budget = BlockBudget(self.leases.available_blocks, self._table_len)
        self.scheduler = DecodeScheduler(config, cache.block_size, budget, lookahead, self._offload_fits)
        self.sequences: dict[str, DecodeSequence] = {}
        self._probe_checks: dict[str, ProbeCheckCommand] = {}  # lease id -> check waiting for its transfer
        self._probe_digests = ProbeDigests()  # checks whose bytes are hashed off this thread
        self._stop = StopCheck(detokenize) if detokenize is not None else None
        self._arrivals = 0
        if model.embed.weight.device.type == "cuda":  # before any kernel is picked or captured
            torch.backends.cuda.matmul.allow_tf32 = config.matmul_tf32
        self.warmup = self._warm_up(lookahead)
        self.slots = self._slot_book()
        self._ahead: AheadStep | None = None
        """A step launched before the last one's tokens were read (`decode.overlap`), not yet collected."""
        self._ahead_start: float | None = None
        """When the overlapped step now in flight was launched (None: none, or one launched after a
        step in series): the cost check's plain cycle spans one launch to the next."""
        self._plain_ahead = 0
        """Steps the proposer's cost check has promised to decline (`plain_steps_ahead`): these may overlap."""
        self._publish_paths()
        self._offloaded_bytes = 0
        self._eos = self._eos_ids()
        self.draining = False
        self.tokens_emitted = 0
        self._draft_pass_ran = False
        self.busy_s = 0.0
        self.passes = 0
        self.verify_passes = 0
        self.drafted_tokens = 0
        self.accepted_drafts = 0

    # ------------------------------------------------------------------ commands

    def handle(self, cmd: Command) -> list[Output]:
        """Apply one command addressed to this rank; returns what to stream."""
        if isinstance(cmd, ReserveCommand):
            return [self.reserve(cmd)]
        if isinstance(cmd, AttachCommand):
            return self.attach(cmd)
        if isinstance(cmd, ProbeCheckCommand):
            return self.check_probe(cmd)
        if isinstance(cmd, RenewCommand):
            for lease_id in cmd.lease_ids:
                self.leases.renew(lease_id, cmd.lease_ms)
            return []
        return self.cancel(cmd)

    def reserve(self, cmd: ReserveCommand) -> Output:
        if self.draining:
            return self._refuse(Failed(cmd.request_id, ErrorKind.UNAVAILABLE, "draining: no new leases",
                                       retry_after_ms=0))
        if self.leases.num_open + self.scheduler.num_requests >= self.config.max_waiting_requests:
            return self._refuse(Failed(cmd.request_id, ErrorKind.RESOURCE_EXHAUSTED, "too many requests queued",
                                       retry_after_ms=200))
        agent = getattr(self.endpoint, "name", "") if self.endpoint is not None else ""
        control = str(getattr(self.endpoint, "control_address", "")) if self.endpoint is not None else ""
        try:
            return self.leases.reserve(cmd, agent, control)
        except LeaseError as exc:
            return self._refuse(exc.failed(cmd.request_id, cmd.lease_id))

    def attach(self, cmd: AttachCommand) -> list[Output]:
        """A Decode call for a lease: validate, then decode once the KV is in place."""
        lease = self.leases.get(cmd.lease_id)
        if lease is None or lease.request_id != cmd.request_id:
            return [self._refuse(Failed(cmd.request_id, ErrorKind.NOT_FOUND,
                                        f"no lease {cmd.lease_id!r} for request {cmd.request_id!r} (expired, "
                                        "cancelled, or never granted here)", "lease_id"))]
        if cmd.request_id in self.sequences:
            return [self._refuse(Failed(cmd.request_id, ErrorKind.INVALID_ARGUMENT,
                                        f"request {cmd.request_id!r} is already decoding", "request_id"))]
        if lease.transfer_error:
            self.leases.release(lease)
            return [Failed(cmd.request_id, ErrorKind.TRANSFER_FAILED, lease.transfer_error)]
        try:
            seq = self._new_sequence(cmd, lease)
        except ValueError as exc:
            field = str(exc).split("`")[1] if "`" in str(exc) else ""
            self._drop_lease(lease, "invalid Decode call")
            return [self._refuse(Failed(cmd.request_id, ErrorKind.INVALID_ARGUMENT, str(exc), field))]
        self.leases.take(lease)
        self.sequences[seq.request_id] = seq
        seq.attached_s = self.clock()
        if seq.join is JoinKind.PREFILL or lease.transfer_done:
            return self._join_when_ready(seq)
        return []

    def attach_state(self, request_id: str, prompt: Sequence[int], state: SequenceState, first_token: int,
                     params_cmd: AttachCommand, draft: DraftState | None = None) -> None:
        """Accept a shipped state: `state` has consumed `prompt`; decoding starts from `first_token`.
        (In-process callers only: tests, benchmarks, a colocated prefill.)"""
        adm = self.cache.admit(request_id, [0] * len(prompt), f"uncached/{params_cmd.lease_id}")
        lease = Lease(params_cmd.lease_id, request_id, list(adm.block_ids), 0, float("inf"), False, len(prompt),
                      transfer_done=True)
        seq = self._new_sequence(params_cmd, lease)
        seq.state, seq.draft, seq.join = state, draft, JoinKind.SHIPPED
        seq.stored_entries = {}
        self.leases.leases[lease.lease_id] = lease
        self.leases.by_request[request_id] = lease.lease_id
        self.sequences[request_id] = seq
        seq.ready_s = self.clock()
        self.scheduler.add(seq)

    def check_probe(self, cmd: ProbeCheckCommand) -> list[Output]:
        """The link probe's check of a lease no Decode call took: answered once its transfer ended."""
        lease = self.leases.get(cmd.lease_id)
        if lease is None or lease.request_id != cmd.request_id or cmd.request_id in self.sequences or lease.cancelled:
            return [self._refuse(Failed(cmd.request_id, ErrorKind.NOT_FOUND,
                                        f"no probe lease {cmd.lease_id!r} for request {cmd.request_id!r} (expired, "
                                        "cancelled, taken by a Decode call, or never granted here)", "lease_id"))]
        if lease.transfer_open:
            self._probe_checks[lease.lease_id] = cmd  # `poll` answers once the transfer ended
            return []
        return self._finish_probe(lease, cmd)

    def _finish_probe(self, lease: Lease, cmd: ProbeCheckCommand) -> list[Output]:
        """Copy the received blocks out (when the transfer is DONE) for hashing off this thread (its
        `ProbeChecked` comes from a later `poll`), and free the lease either way."""
        if not lease.transfer_done:
            error = lease.transfer_error or "no KV transfer into this lease"
            self._drop_lease(lease, "probe checked")
            return [Failed(cmd.request_id, ErrorKind.TRANSFER_FAILED, f"link probe {cmd.request_id!r}: {error}",
                           lease_id=lease.lease_id)]
        received = lease.block_ids[lease.num_cached_blocks:]
        self._probe_digests.submit(cmd, lease.lease_id, load_bytes(self.cache.pool.storage, received), len(received))
        self._drop_lease(lease, "probe checked")
        return []

    def cancel(self, cmd: CancelCommand) -> list[Output]:
        if cmd.request_id == "*":
            targets = [*self.sequences, *(lease.request_id for lease in list(self.leases.leases.values())
                                          if lease.request_id not in self.sequences)]
            return [o for rid in targets for o in self.cancel(replace(cmd, request_id=rid, lease_id=""))]
        seq = self.sequences.get(cmd.request_id)
        if seq is not None and cmd.lease_id and seq.lease.lease_id != cmd.lease_id:
            # A late Cancel of an earlier attempt (the router retries under the same request id): the
            # sequence running now belongs to the retry's lease, which this Cancel does not name.
            seq = None
        if seq is not None:
            finished = self._finish(seq, "cancelled")
            if cmd.hand_back:
                return [Failed(seq.request_id, ErrorKind.UNAVAILABLE, f"handed back: {cmd.reason}")]
            return [finished]
        lease = self.leases.get(cmd.lease_id) if cmd.lease_id else self.leases.lease_of(cmd.request_id)
        if lease is None:
            return []
        self._drop_lease(lease, cmd.reason)
        code = ErrorKind.UNAVAILABLE if cmd.hand_back else ErrorKind.CANCELLED
        return [Failed(cmd.request_id, code, f"lease cancelled: {cmd.reason}", lease_id=lease.lease_id)]

    # ------------------------------------------------------------------ housekeeping

    def poll(self) -> list[Output]:
        """Finished transfers, expired leases, passed deadlines."""
        out: list[Output] = []
        for lease, _ in self.leases.poll():
            seq = self.sequences.get(lease.request_id)
            if seq is None or seq.lease is not lease or seq.status is not Status.LEASED:
                continue
            if lease.transfer_done:
                out.extend(self._join_when_ready(seq))
            else:
                self.sequences.pop(seq.request_id)
                self.leases.release(lease)
                out.append(Failed(seq.request_id, ErrorKind.TRANSFER_FAILED, lease.transfer_error))
        out.extend(self._answer_probe_checks())
        out.extend(self._probe_digests.poll())
        for lease in self.leases.expired():
            if lease.request_id not in self.sequences:
                self.metrics.lease_expired.inc()
                log.warning("lease %s of request %s expired unattached (neither its Decode call nor a Cancel "
                            "came): its blocks held until now", lease.lease_id, lease.request_id)
                self._drop_lease(lease, "lease expired")
                out.append(Failed(lease.request_id, ErrorKind.DEADLINE_EXCEEDED,
                                  f"lease {lease.lease_id!r} expired before its Decode call", lease_id=lease.lease_id))
        now = self.clock()
        for seq in [s for s in self.sequences.values() if s.deadline_s < now]:
            out.append(self._finish(seq, "deadline"))
        return out

    def _answer_probe_checks(self) -> list[Output]:
        out: list[Output] = []
        for lease_id, cmd in list(self._probe_checks.items()):
            lease = self.leases.get(lease_id)
            if lease is None or lease.cancelled:  # expired or cancelled: its Failed went out already
                del self._probe_checks[lease_id]
            elif not lease.transfer_open:
                del self._probe_checks[lease_id]
                out.extend(self._finish_probe(lease, cmd))
        return out

    def has_work(self) -> bool:
        sched = self.scheduler
        return bool(sched.running or sched.waiting or sched.preempted or self._ahead is not None)

    @property
    def num_in_flight(self) -> int:
        """Requests and leases this rank still holds (drain waits for 0)."""
        return len(self.sequences) + sum(1 for lease in self.leases.leases.values()
                                         if lease.request_id not in self.sequences)

    def load(self) -> RankLoad:
        """This rank's load now (for `LoadReport` and the group leader's placement)."""
        pool, cached = self.cache.pool, self.cache.prefix.num_evictable()
        sched = self.scheduler
        attached_waiting = sum(1 for s in self.sequences.values() if s.status in (Status.LEASED, Status.WAITING))
        unattached = self.num_in_flight - len(self.sequences)
        return RankLoad(
            rank=self.rank, running=len(sched.running), waiting=attached_waiting + unattached,
            preempted=len(sched.preempted), in_flight=self.num_in_flight,
            free_blocks=pool.num_free + cached, total_blocks=pool.num_blocks,
            held_blocks=pool.num_blocks - pool.num_free - cached, cached_blocks=cached,
            queued_tokens=sum(sched.join_rows(s) for s in sched.waiting + sched.preempted),
            tokens_emitted=self.tokens_emitted, busy_s=self.busy_s, draft_tokens=int(self.drafted_tokens),
            accepted_drafts=int(self.accepted_drafts), verify_passes=self.verify_passes,
            step_s=tuple(self.profile.step_s()), agent_name=str(getattr(self.endpoint, "name", "") or ""),
            control_address=str(getattr(self.endpoint, "control_address", "") or ""))

    def publish_load(self) -> RankLoad:
        """`load()`, also set on the block gauges: called every tick, so the gauges follow a Cancel or
        an expired lease on an idle rank too, not only the steps."""
        load = self.load()
        self.metrics.free_blocks.set(load.free_blocks)
        self.metrics.held_blocks.set(load.held_blocks)
        return load

    # ------------------------------------------------------------------ the step

    def step(self) -> list[Output]:
        """One decode step (an empty pass when this rank has nothing, so group peers stay in step):
        plain rows through the model runner when it is on (`slot_book`), every other row through
        `forward_batch`. With `decode.overlap`, a batch that only decodes launches each step before
        the last one's tokens are read (`_step_ahead`); any other step first collects the one in flight."""
        outputs: list[Output] = []
        if self._ahead is not None or self.config.overlap:
            if self._overlappable():
                return self._step_ahead()
            if self._ahead is not None:
                outputs = self._drain_ahead()
        return outputs + self._step()

    def _step(self) -> list[Output]:
        start = time.perf_counter()
        emitted = self.tokens_emitted
        self._draft_pass_ran = False  # a draft pass ran this step (its drafts verified or not)
        phases = self.metrics.phases  # each phase's seconds (docs/decode.md, Where a token's time goes)
        sched = self.scheduler.schedule()
        outputs: list[Output] = []
        for p in sched.preemptions:
            self._preempt(self.sequences[p.request_id], p.policy)
        t = phases.lap("schedule", start)
        join_kinds = {self.sequences[join.request_id].join.value for join in sched.joins}
        for join in sched.joins:
            self._prepare_join(self.sequences[join.request_id])
        t = phases.lap("join", t)
        if self.on_passes is not None:
            self.on_passes()
        running = [self.sequences[rid] for rid in sched.running]
        drafts = self._drafts(running, sched)
        t = phases.lap("propose", t)
        fast = self._runner_rows(running, drafts)
        slow = [i for i in range(len(running)) if i not in fast]
        plans, items = self._plan([running[i] for i in slow], [drafts[i] for i in slow])
        fast_seqs, fast_drafts = [running[i] for i in sorted(fast)], [drafts[i] for i in sorted(fast)]
        eager, group_rows = self._agree_passes(bool(items), SlotBook.rows(fast_seqs, fast_drafts))
        t = phases.lap("plan", t)
        results = self._run(items) if eager else []
        fast_plans, fast_results = self._run_slots(fast_seqs, fast_drafts, group_rows)
        t = phases.lap("model", t)
        observations: list[Observation] = []
        verified: list[tuple[Tensor, int]] = []  # (the drafts' confidences, how many were accepted)
        persist: list[DecodeSequence] = []
        by_seq = {id(plan.seq): (plan, results) for plan in plans}
        by_seq.update({id(plan.seq): (plan, fast_results) for plan in fast_plans})
        for seq in running:  # in the scheduler's order, whichever path ran it
            plan, rows = by_seq[id(seq)]
            outputs.extend(self._conclude(plan, rows, observations, verified, persist))
        t = phases.lap("accept", t)
        for seq in persist:
            self._persist(seq)
        t = phases.lap("persist", t)
        self._calibrate(verified)
        if observations and self.proposer is not None:
            self.proposer.observe_many(observations)  # one batched drafter call for the whole step
        t = phases.lap("observe", t)
        self._account(sched, start, len(running))
        if running and not sched.joins and not sched.preemptions:  # a steady step: what drafting costs and yields
            self.profile.record_cycle(len(running), time.perf_counter() - start, self.tokens_emitted - emitted,
                                      self._draft_pass_ran)
        for kind in join_kinds:
            self.metrics.join_step_seconds.labels(kind).observe(time.perf_counter() - start)
        phases.lap("account", t)
        return outputs

    # ------------------------------------------------------------------ overlapped steps (decode.overlap)

    def _overlappable(self) -> bool:
        """Whether this step can be launched before the last one's tokens are read: overlap on, one
        rank, the runner on without an Engram store, no proposer or one whose cost check has promised
        to decline this step (`DSparkProposer.plain_steps_ahead`), a steady batch (no join, no
        preemption: `DecodeScheduler.steady`) of greedy or unseeded requests (logprobs: from the
        logits copied behind the step), each in its slot, the same requests as the step in flight, and room in each slot for two more
        tokens. (An unseeded sampled request's overlapped tokens are drawn on the device, by the
        runner's sampler: the same distribution as the host's draw, another random stream.)"""
        slots, sched = self.slots, self.scheduler
        if (not self.config.overlap or slots is None or self.ep.world_size > 1 or slots.collective
                or slots.runner.engram is not None or not sched.running or not sched.steady()):
            return False
        if self.proposer is not None and self._plain_ahead <= 0:  # the proposer may draft: a step in series
            return False
        ahead = self._ahead
        if ahead is not None and (len(ahead.seqs) != len(sched.running)
                                  or any(s.request_id not in ahead.request_ids for s in sched.running)):
            return False
        limit = slots.runner.config.max_context - 2
        for seq in sched.running:
            params, state = seq.params, seq.state
            # a seeded request draws from its own generator on the host, step by step (reproducible):
            # only a greedy or unseeded one may take the device's draw
            if ((params.seed is not None and not params.greedy) or state is None or state.position >= limit
                    or not slots.holds(seq) or (ahead is None and len(seq.pending) != 1)):
                return False
        return True

    def _step_ahead(self) -> list[Output]:
        """Launch this step's plain rows (each fed, on the device, the token the step in flight picks),
        then read and conclude the step in flight: the GPU runs this step while the host streams the
        last one's tokens. A request that stops in the step read had one more row launched for it,
        whose pick is dropped; its blocks are freed once that row has run (`AheadStep.after`)."""
        assert self.slots is not None
        start = time.perf_counter()
        phases = self.metrics.phases
        sched = self.scheduler.schedule()
        assert not sched.joins and not sched.preemptions, "steady() promised a batch that stays as it is"
        running = [self.sequences[rid] for rid in sched.running]
        t = phases.lap("schedule", start)
        tables = []
        for seq in running:
            assert seq.state is not None
            try:  # this launch writes the record of `state.position` (steady(): the pool has the blocks)
                self.cache.reserve_tokens(seq.request_id, seq.state.position + 1)
            except CacheExhaustedError:
                return self._drain_ahead() + self._step()
            tables.append(self.cache.block_table(seq.request_id))
        t = phases.lap("plan", t)
        proposer = self.proposer
        launched = self.slots.launch(running, tables, fed=self._ahead is not None, taps=proposer is not None)
        if isinstance(proposer, DSparkProposer):  # a step its check promised to decline: counted as one
            self._plain_ahead -= 1
            proposer.take_plain_steps(1)
            self.metrics.draft_decisions.labels("declined").inc()
        self.metrics.overlapped_steps.inc()
        self.passes += 1
        self.metrics.pass_rows.observe(len(running))
        if self.on_passes is not None:
            self.on_passes()
        previous, self._ahead = self._ahead, launched
        t = phases.lap("model", t)
        emitted = self.tokens_emitted
        outputs = self._conclude_ahead(previous) if previous is not None else []
        t = phases.lap("accept", t)
        self._account(sched, start, len(running))
        if previous is not None and self._ahead_start is not None:
            # a plain step as it runs overlapped, for the cost check's veto (`StepProfile.cycle_rates`):
            # launch to launch, the step's GPU time and whatever the host did beside it, against its tokens
            self.profile.record_cycle(len(running), start - self._ahead_start, self.tokens_emitted - emitted, False)
        self._ahead_start = start
        phases.lap("account", t)
        return outputs

    def _drain_ahead(self) -> list[Output]:
        """Collect and conclude the step in flight (before a step that changes the batch)."""
        previous, self._ahead, self._ahead_start = self._ahead, None, None
        return self._conclude_ahead(previous) if previous is not None else []

    def _conclude_ahead(self, step: AheadStep) -> list[Output]:
        """Wait for a launched step's picks, free what waited for it, and stream its tokens."""
        assert self.slots is not None
        plans, results = self.slots.collect(step)
        for release in step.after:
            release()
        outputs: list[Output] = []
        persist: list[DecodeSequence] = []
        observations: list[Observation] = []  # (a proposer's: the drafter's memory follows every token)
        for plan in plans:
            outputs.extend(self._conclude(plan, results, observations, [], persist))
        for seq in persist:
            self._persist(seq)
        if observations and self.proposer is not None:
            self.proposer.observe_many(observations)
        return outputs

    def _drafts(self, running: list[DecodeSequence], sched: SchedulerOutput) -> list[Draft | None]:
        if self.proposer is None or not running:
            return [None] * len(running)
        steady = [s for s in running if not s.needs_pass_to_join()]
        declined = (getattr(self.proposer, "declined_steps", 0), getattr(self.proposer, "plain_probes", 0))
        proposed = dict(zip((s.request_id for s in steady), self.proposer.propose(steady)))
        self._draft_pass_ran = any(d is not None for d in proposed.values())
        self._count_decision(declined)
        # a declined step: the check's next declines may overlap (`_overlappable`); other proposers promise none
        proposer, self._plain_ahead = self.proposer, 0
        if isinstance(proposer, DSparkProposer) and not self._draft_pass_ran and len(steady) == len(running):
            self._plain_ahead = proposer.plain_steps_ahead()
        drafts = [_cut(proposed.get(s.request_id), s.max_drafts) for s in running]
        with_drafts = [i for i, d in enumerate(drafts) if d is not None]
        if not with_drafts:
            return drafts
        lengths = self._verify_lengths([d for d in drafts if d is not None], running, sched)
        for i, j in zip(with_drafts, lengths):
            d = drafts[i]
            assert d is not None
            drafts[i] = Draft(d.tokens[:j], d.probs[:j], d.confidences[:j]) if j else None
        return drafts

    def _count_decision(self, before: tuple[int, int]) -> None:
        """`cedserve_decode_draft_decisions`: what the proposer's cost check made of this step."""
        declined = getattr(self.proposer, "declined_steps", 0) - before[0]
        probes = getattr(self.proposer, "plain_probes", 0) - before[1]
        if self._draft_pass_ran:
            self.metrics.draft_decisions.labels("drafted").inc()
        elif probes:
            self.metrics.draft_decisions.labels("plain_probe").inc()
        elif declined:
            self.metrics.draft_decisions.labels("declined").inc()

    def _verify_lengths(self, drafts: list[Draft], running: list[DecodeSequence], sched: SchedulerOutput) -> list[int]:
        """Each request's verification length, at most its draft's (already cut to its effort's limit)."""
        limits = [len(d.tokens) for d in drafts]
        if not self.config.adaptive_verify:
            return limits
        other_rows = sched.num_join_rows + sum(len(s.pending) for s in running) - len(drafts)
        # one device-to-host copy for the batch (not a read-back per request)
        host = torch.cat([d.confidences[:n].float() for d, n in zip(drafts, limits)]).cpu().numpy()
        filled = _padded(host, np.asarray(limits, dtype=np.int64), 0.0)  # [batch, K]; past a limit: unused
        confidences = self.profile.survival.calibrated(torch.from_numpy(filled))  # as verification measured it
        lengths = choose_verify_lengths(confidences, lambda n: self.profile.steps_per_s_many(n + other_rows),
                                        torch.tensor(limits))
        return [int(j) for j in lengths]

    def _warm_up(self, lookahead: int) -> kernel_warmup.WarmupReport | None:
        """Compile the kernels' variants before serving (`cedserve.model.kernel_warmup`): on CUDA with
        the kernels on and `decode.kernel_warmup` set (attention calls only: no collective, so each
        expert-parallel rank warms up on its own)."""
        if not self.config.kernel_warmup or not kernel_warmup.wanted(self.model, self.paged_attention):
            return None
        max_context = min(self.model.config.max_position_embeddings, self.cache.pool.num_blocks * self.cache.block_size)
        report = kernel_warmup.warm_up_decode(self.model, max_context, self.config.max_running_requests * lookahead)
        log.info("kernel warm-up: %d cells in %.1f s (contexts %s, up to %d rows)", report.cells, report.seconds,
                 report.contexts, max(report.rows))
        return report

    def _plan(self, running: list[DecodeSequence], drafts: list[Draft | None]) -> tuple[list[SeqPlan], list[BatchItem]]:
        plans: list[SeqPlan] = []
        items: list[BatchItem] = []
        taps = self.proposer is not None
        for seq, draft in zip(running, drafts):
            rows = self._replay_rows(seq)
            plan, seq_items = plan_rows(seq, draft, len(items), rows, taps)
            plans.append(plan)
            items.extend(seq_items)
        return plans, items

    def _slot_book(self) -> SlotBook | None:
        """The model runner over this worker's block pool, its graphs captured (`decode.runner`)."""
        reason = runner_unavailable(self.model, self.config.runner, self.ep.world_size)
        if reason is None:
            max_context = min(self.model.config.max_position_embeddings, self.cache.pool.num_blocks * self.cache.block_size)
            try:
                max_drafts = self.proposer.max_tokens if self.proposer is not None else 0
                book = SlotBook.create(self.model, self.cache.pool.storage, self.layout,
                                       self.config.max_running_requests, max_context, max_drafts,
                                       self.config.cuda_graphs, self.config.compile_fused, self.metrics,
                                       self._runner_exchange, self.config.grouped_attention)
            except ValueError as exc:
                reason = str(exc)
        if reason is not None:
            if self.config.runner == "on":
                raise ValueError(f"config field `decode.runner`: on, but the runner cannot run: {reason}")
            log.info("model runner off: %s", reason)
            return None
        book.capture()
        return book

    def _publish_paths(self) -> None:
        """Which step paths this worker took at start-up, on `cedserve_decode_path_on` (an operator, or
        a benchmark, can tell a worker that fell back to the eager paths from one that did not)."""
        runner = self.slots.runner if self.slots is not None else None
        drafter = self.proposer.runner if isinstance(self.proposer, SlotDSparkProposer) else None
        on = {"runner": runner is not None,
              "runner_graphs": runner is not None and bool(runner.graphs_captured),
              "drafter_slots": drafter is not None,
              "drafter_graphs": drafter is not None and bool(drafter.graphs_captured),
              "compiled": runner is not None and runner.slot_step.ops.compiled}
        assert tuple(on) == DECODE_PATHS
        for path, value in on.items():
            self.metrics.paths.labels(path).set(int(value))

    def _runner_exchange(self, max_rows: int) -> FixedCapacityEP | None:
        """The runner's fixed-capacity exchange for `max_rows` rows per rank (None on one rank)."""
        weight = self.model.embed.weight
        return self.ep.runner_exchange(max_rows, self.model.config.num_experts_per_tok,
                                       self.model.config.hidden_size, weight.dtype, weight.device)

    def _slot_drafting(self, proposer: Proposer) -> Proposer:
        """`proposer`, or the DSpark drafter's pass on slots (`decode.runner_drafter`), its graphs captured."""
        if isinstance(proposer, SlotDSparkProposer):
            return proposer
        mode = self.config.runner_drafter
        runner_on = runner_unavailable(self.model, self.config.runner, self.ep.world_size) is None
        reason = slot_drafting_unavailable(proposer, self.model.embed.weight.device.type, mode, runner_on,
                                           self.ep.world_size)
        if reason is not None:
            if mode == "on":
                raise config_error("decode", "runner_drafter", f"on, but the drafter cannot run on slots: {reason}")
            if mode == "auto":
                log.info("drafter on slots off: %s", reason)
            return proposer
        assert isinstance(proposer, DSparkProposer)
        config = DraftRunnerConfig(max_slots=self.config.max_running_requests, cuda_graphs=self.config.cuda_graphs,
                                   compile_fused=self.config.compile_fused)
        slotted = SlotDSparkProposer.replacing(proposer, config)
        report = slotted.runner.capture(lambda done, total: log.info("drafter: captured %d of %d buckets", done, total))
        if report.buckets:
            log.info("drafter: CUDA graphs for batch buckets %s in %.1f s", report.buckets, report.seconds)
        return slotted

    def _runner_rows(self, running: list[DecodeSequence], drafts: list[Draft | None]) -> set[int]:
        """Indexes of the running requests whose row goes through the runner this step; requests
        that need `forward_batch` leave their slot first."""
        if self.slots is None:
            return set()
        fast: set[int] = set()
        for i, (seq, draft) in enumerate(zip(running, drafts)):
            if self.slots.fits(seq, draft, self._table_for_rows(seq, draft)):
                fast.add(i)
            elif self.slots.holds(seq):
                self.slots.slot_out(seq)
        return fast

    def _table_for_rows(self, seq: DecodeSequence, draft: Draft | None) -> list[int]:
        """`seq`'s block table, grown first to hold this step's rows where its drafts reach past the
        last block (the cache allocates for accepted tokens only). The scheduler counted `lookahead`
        tokens of growth for every running request, so the pool has the blocks; if it has not, the
        table stays and the step takes `forward_batch`. Without this every verify step crossing a
        block boundary left the runner: the request slotted out, ran eagerly and slotted back in. On
        an H100's serving path the verify step averaged 25.2 ms before this and 7.1 ms after
        (plain 2.8; gpu-2026-12-07)."""
        if draft is not None and seq.state is not None:
            with contextlib.suppress(CacheExhaustedError):
                self.cache.reserve_tokens(seq.request_id,
                                          seq.state.position + len(seq.pending) + len(draft.tokens))
        return self.cache.block_table(seq.request_id)

    def _agree_passes(self, eager: bool, runner_rows: int) -> tuple[bool, int]:
        """Which passes this step runs, the same on every rank of an expert-parallel group (each pass's
        MoE layers are collectives): the eager pass where any rank has `forward_batch` rows (an empty
        one here, possibly), and the runner's step over the group's most runner rows (its bucket: a
        rank with fewer pads, one with none runs scratch rows). Alone: only what this rank has. Two
        small all-reduces on the control group per step."""
        if self.ep.world_size == 1:
            return eager, runner_rows
        eager = bool(self.ep.agree(int(eager)))
        if self.slots is None:
            return eager, 0
        return eager, self.ep.agree(runner_rows)

    def _run_slots(self, seqs: list[DecodeSequence], drafts: list[Draft | None], group_rows: int = 0
                   ) -> tuple[list[SeqPlan], list[BatchOutput]]:
        """The runner's step over its requests' rows: plans and outputs as `_plan` / `_run` give.
        `group_rows`: the group's most runner rows (expert parallelism: this rank steps even with none)."""
        if self.slots is None or (not seqs and not (self.slots.collective and group_rows)):
            return [], []
        start = time.perf_counter()
        plans, results = self.slots.step(seqs, [self.cache.block_table(seq.request_id) for seq in seqs], drafts,
                                         group_rows)
        rows = sum(int(r.logits.shape[0]) for r in results)
        if rows:
            self.profile.record_pass(rows, time.perf_counter() - start)
            self.metrics.pass_rows.observe(rows)
        self.passes += 1
        return plans, results

    def _run(self, items: list[BatchItem]) -> list[BatchOutput]:
        """The pass (every rank runs one when any has work: the caller decided that)."""
        start = time.perf_counter()
        moe: Callable[[MoE, torch.Tensor], torch.Tensor] = lambda ffn, x: ep_moe(self.ep, ffn, x)  # noqa: E731
        results = self.model.forward_batch(items, moe)
        rows = sum(len(it.token_ids) for it in items)
        if rows:
            self.profile.record_pass(rows, time.perf_counter() - start)
            self.metrics.pass_rows.observe(rows)
        self.passes += 1
        return results

    def _calibrate(self, verified: list[tuple[Tensor, int]]) -> None:
        """What verification measured against the drafter's predicted survival (one host copy)."""
        if not verified:
            return
        host = torch.cat([c.float() for c, _ in verified]).cpu()
        survival = self.profile.survival
        if len(verified) < survival.BATCH_MIN:  # a few: each in turn (numpy's fixed cost would dominate)
            for c, (_, ok) in zip(torch.split(host, [c.shape[0] for c, _ in verified]), verified):
                survival.record(torch.cumprod(c.double(), 0).tolist(), ok)
            return
        lengths = np.array([c.shape[0] for c, _ in verified], dtype=np.int64)
        confidences = _padded(host.numpy().astype(np.float64), lengths, 1.0)  # past a row's length: unused
        accepted = np.array([a for _, a in verified], dtype=np.int64)
        survival.record_many(np.cumprod(confidences, axis=1), lengths, accepted)

    def _conclude(self, plan: SeqPlan, results: list[BatchOutput], observations: list[Observation],
                  verified: list[tuple[Tensor, int]], persist: list[DecodeSequence]) -> list[Output]:
        """Accept or roll back `plan`'s sequence and stream its tokens; the drafter's share of the pass
        goes to `observations` (the caller shows them to the proposer at once), the sequence to
        `persist` when it goes on (the caller writes its new records once every sequence's tokens are out)."""
        seq = plan.seq
        if seq.status is not Status.RUNNING:
            return []
        verdict, rows = decide(plan, results)
        seq.join = JoinKind.SHIPPED  # joined: from now on it decodes like any running request
        if plan.num_drafts:
            self.verify_passes += 1
            seq.draft_tokens += plan.num_drafts
            seq.accepted_drafts += verdict.num_accepted
            self.drafted_tokens += plan.num_drafts
            self.accepted_drafts += verdict.num_accepted
            self.metrics.draft_tokens.inc(plan.num_drafts)
            self.metrics.accepted_drafts.inc(verdict.num_accepted)
            if plan.draft is not None:
                verified.append((plan.draft.confidences[: plan.num_drafts], verdict.num_accepted))
        self.metrics.accepted_length.observe(len(verdict.tokens))
        before = len(seq.tokens)
        chunk, reason = emit(seq, verdict, rows, verdict.num_accepted, self._stop, plan.num_drafts)
        self.tokens_emitted += len(chunk.token_ids)
        self.metrics.output_tokens.inc(len(chunk.token_ids))
        self._grow(seq, seq.tokens[before:])
        out: list[Output] = [chunk] if chunk.token_ids else []
        if reason:
            out.append(self._finish(seq, reason))
            return out
        if self.proposer is not None:
            observations.append(Observation(seq, plan.first_position, plan_taps(plan, results), len(seq.tokens) - 1))
        persist.append(seq)
        return out

    # ------------------------------------------------------------------ joins and preemption

    def _state_room_policy(self) -> StateRoomPolicy:
        """Scratch blocks for one shipped state (with DSpark taps when this rank drafts)."""
        config = self.model.config
        taps = self.proposer is not None and taps_supported(config)
        self._taps_dtype = self.model.embed.weight.dtype if taps else None
        blocks = -(-max_state_bytes(config, self._taps_dtype) // self.layout.block_bytes)
        return StateRoomPolicy(self.config.ship_state, blocks, taps)

    def _join_when_ready(self, seq: DecodeSequence) -> list[Output]:
        """The KV is in place (or this rank prefills): read and check a shipped state, then queue the join.
        A state that fails its checks fails the request (TRANSFER_FAILED) with every block freed."""
        lease = seq.lease
        if lease.state_block_ids:
            data = load_bytes(self.cache.pool.storage, lease.state_block_ids)
            self.leases.free_state(lease)
            try:
                seq.shipped = self._check_state(seq, data, lease.state_taps)
            except StateFormatError as exc:
                self.metrics.transfer_failures.labels("invalid_state").inc()
                self._finish(seq, "failed")
                return [Failed(seq.request_id, ErrorKind.TRANSFER_FAILED,
                               f"request {seq.request_id!r}: the shipped decode state was rejected: {exc}")]
            seq.join = JoinKind.SHIPPED
        seq.ready_s = self.clock()
        if seq.join is not JoinKind.PREFILL and seq.attached_s >= 0:
            self.metrics.transfer_wait_seconds.observe(seq.ready_s - seq.attached_s)
        seq.attached_s = -1.0
        self.scheduler.add(seq)
        return []

    def _check_state(self, seq: DecodeSequence, data: np.ndarray, taps: bool) -> BoundedState:
        state = decode_state(data, self.model.config, self._taps_dtype if taps else None)
        if state.position != seq.num_prompt_tokens:
            raise StateFormatError(f"the state is at position {state.position}, the prompt has "
                                   f"{seq.num_prompt_tokens} tokens")
        return state

    def _prepare_join(self, seq: DecodeSequence) -> None:
        self.metrics.joins.labels(seq.join.value).inc()
        if seq.ready_s >= 0:  # a first join, not a return from preemption
            self.metrics.queue_seconds.labels(effort_class(seq.effort)).observe(
                self.clock() - seq.ready_s)
            seq.ready_s = -1.0
        kind = seq.join
        if kind is JoinKind.SHIPPED and seq.shipped is not None:
            self._install_shipped(seq, seq.shipped)
        elif kind is JoinKind.REPLAY:
            table = self.cache.block_table(seq.request_id)
            seq.state = state_io.load_from_blocks(self.model, self.layout, self.cache.pool.storage, table,
                                                  seq.num_prompt_tokens)
            seq.stored_entries = state_io.entries(seq.state)
        elif kind is JoinKind.PREFILL:
            self._load_prefix(seq, seq.lease.num_cached_blocks * self.cache.block_size)
        elif kind in (JoinKind.RECOMPUTE, JoinKind.ONLOAD):
            self._readmit(seq)

    def _install_shipped(self, seq: DecodeSequence, shipped: BoundedState) -> None:
        """Global KV from the blocks, the bounded state as shipped, the drafter's memory from its taps."""
        table = self.cache.block_table(seq.request_id)
        state = state_io.load_from_blocks(self.model, self.layout, self.cache.pool.storage, table,
                                          seq.num_prompt_tokens)
        shipped.install(state)
        seq.state, seq.shipped = state, None
        seq.stored_entries = state_io.entries(state)
        if shipped.taps is not None and self.proposer is not None:
            # [n, n_taps, 1, hidden]: one "stream" holding the mean, which the drafter averages again, exactly
            taps = shipped.taps.to(self.model.embed.weight.device).unsqueeze(2)
            self.proposer.observe(seq, shipped.taps_first_position, taps, state.position)

    def _readmit(self, seq: DecodeSequence) -> None:
        """A preempted request gets blocks again (its own cached blocks come back shared)."""
        tokens = seq.tokens if seq.lease.cacheable else [0] * len(seq.tokens)
        salt = "" if seq.lease.cacheable else f"uncached/{seq.lease.lease_id}"
        adm = self.cache.admit(seq.request_id, tokens, salt)
        cached = self.cache.finish_onload(seq.request_id)
        seq.lease.block_ids = list(adm.block_ids)
        if seq.join is JoinKind.ONLOAD:
            assert seq.offloaded is not None
            state_io.onload(seq, seq.offloaded, self.layout, self.cache.pool.storage, seq.lease.block_ids,
                            cached // self.cache.block_size)
            self._offloaded_bytes -= seq.offloaded.nbytes
            seq.offloaded = None
        else:
            self._load_prefix(seq, cached)

    def _load_prefix(self, seq: DecodeSequence, cached_tokens: int) -> None:
        """State for a local prefill: records of the cached blocks up to `prefix_start`, the rest
        (and the bounded state) recomputed by the pass."""
        start = state_io.prefix_start(self.model.config, cached_tokens, seq.replay_span)
        table = self.cache.block_table(seq.request_id)
        seq.state = state_io.load_from_blocks(self.model, self.layout, self.cache.pool.storage, table, start)
        seq.stored_entries = {layer: cached_tokens // kv.ratio for layer, kv in seq.state.global_kv.items()}
        if self.proposer is not None:
            self.proposer.release(seq, keep=False)
        seq.draft = None

    def _replay_rows(self, seq: DecodeSequence) -> int:
        return seq.replay_span if seq.join is JoinKind.REPLAY else 0

    def _preempt(self, seq: DecodeSequence, policy: PreemptionPolicy) -> None:
        self.metrics.preemptions.labels(policy.value).inc()
        if policy is not self.config.preemption:
            self.metrics.offload_fallbacks.inc()
        if self.slots is not None and self.slots.holds(seq):
            self.slots.slot_out(seq)
        offload = policy is PreemptionPolicy.OFFLOAD and seq.state is not None
        if self.proposer is not None:
            self.proposer.release(seq, keep=offload)  # the offload carries the drafter memory
        table = self.cache.block_table(seq.request_id)
        if offload:
            seq.offloaded = state_io.offload(seq, self.cache.pool.storage, table)
            self._offloaded_bytes += seq.offloaded.nbytes
        else:
            seq.join = JoinKind.RECOMPUTE
        seq.state, seq.draft = None, None
        self.cache.free(seq.request_id)

    def _offload_fits(self, seq: DecodeSequence) -> bool:
        need = self._table_len(seq.request_id) * self.layout.block_bytes
        return self._offloaded_bytes + need <= self.config.max_offload_bytes

    # ------------------------------------------------------------------ bookkeeping

    def _grow(self, seq: DecodeSequence, new_tokens: list[int]) -> None:
        if new_tokens and seq.request_id in self.cache:
            self.cache.append_tokens(seq.request_id, new_tokens)

    def _persist(self, seq: DecodeSequence) -> None:
        """Write the records the step added into the blocks; offer whole blocks to the prefix cache."""
        assert seq.state is not None
        table = self.cache.block_table(seq.request_id)
        if self.slots is not None and self.slots.holds(seq):  # the runner wrote them into the blocks
            seq.stored_entries = self.slots.stored_entries(seq)
        else:
            state_io.store_new_records(seq, self.layout, self.cache.pool.storage, table)
        if seq.lease.cacheable:  # the records of concluded steps (an overlapped step's may be in flight)
            self.cache.commit(seq.request_id, min(seq.state.position, len(seq.tokens) - 1))

    def _finish(self, seq: DecodeSequence, reason: str) -> Output:
        """Retire `seq` (any status): free its blocks, state and lease."""
        self.scheduler.remove(seq.request_id)
        self.sequences.pop(seq.request_id, None)
        seq.status = Status.FINISHED
        if self.slots is not None:
            self.slots.release(seq)
        if self.proposer is not None:
            self.proposer.release(seq, keep=False)
        seq.state, seq.draft = None, None
        if seq.offloaded is not None:
            self._offloaded_bytes -= seq.offloaded.nbytes
            seq.offloaded = None
        seq.shipped = None
        if self._ahead is not None and self._ahead.holds(seq):  # a launched step still writes into its blocks
            self._ahead.after.append(lambda: self._release_lease(seq, reason))
        else:
            self._release_lease(seq, reason)
        self.metrics.finished.labels(reason).inc()
        if reason == "deadline":
            return Failed(seq.request_id, ErrorKind.DEADLINE_EXCEEDED, "the request's deadline passed")
        return Finished(seq.request_id, reason, seq.num_emitted, seq.draft_tokens, seq.accepted_drafts)

    def _release_lease(self, seq: DecodeSequence, reason: str) -> None:
        """A retired request's lease and blocks back."""
        lease = seq.lease
        if lease.transfer_open:
            self.leases.cancel(lease, reason)  # blocks freed once the transfer lets go
        else:
            self.leases.release(lease)
            self.leases.free_state(lease)
            if seq.request_id in self.cache:
                self.cache.free(seq.request_id)

    def _drop_lease(self, lease: Lease, detail: str) -> None:
        """End an unattached lease (an open transfer is aborted; `poll` frees its blocks once it let go)."""
        self.leases.cancel(lease, detail)

    def _new_sequence(self, cmd: AttachCommand, lease: Lease) -> DecodeSequence:
        """The request's sequence. Its effort, budget and sampling are the router's (the service checked
        their ranges); the checks here are those only the engine can make, of what a direct caller
        could get wrong: token ids against the vocabulary (an id past it would index outside the
        embedding) and the prompt and join kind against the lease."""
        vocab = self.model.config.vocab_size
        for i, t in enumerate(cmd.token_ids):
            if not 0 <= t < vocab:
                raise ValueError(f"field `token_ids[{i}]`: {t} is not in [0, {vocab})")
        if len(cmd.token_ids) != lease.num_prompt_tokens:
            raise ValueError(f"field `token_ids`: {len(cmd.token_ids)} tokens, but the lease was reserved for "
                             f"{lease.num_prompt_tokens}")
        if cmd.first_token is not None and not 0 <= cmd.first_token < vocab:
            raise ValueError(f"field `first_token`: {cmd.first_token} is not in [0, {vocab})")
        if cmd.first_token is None and lease.transfer_open:
            raise ValueError("field `prefill_locally`: the lease expects a KV transfer; prefill there")
        if cmd.first_token is not None and not lease.transfer_open and not lease.transfer_done and lease.block_ids:
            raise ValueError("field `prefill_locally`: the lease has no KV transfer; set prefill_locally")
        params = cmd.sampling.params(min(cmd.sampling.max_tokens, self.config.max_output_tokens))
        stop = set(params.stop_token_ids) | (set() if params.ignore_eos else self._eos)
        self._arrivals += 1
        tokens = [*cmd.token_ids, *(() if cmd.first_token is None else (cmd.first_token,))]
        join = JoinKind.PREFILL if cmd.first_token is None else JoinKind.REPLAY
        span = state_io.replay_span(self.model.config, cmd.replay_span, self.config.replay_span, len(cmd.token_ids))
        seq = DecodeSequence(cmd.request_id, lease, tokens, len(cmd.token_ids), params, make_generator(params),
                             frozenset(stop), cmd.sampling.stop, join, span, self._arrivals)
        seq.max_drafts = self.config.draft_limit(cmd.effort, self.proposer.max_tokens if self.proposer else 0)
        seq.effort = cmd.effort
        seq.due_s = queue_due_s(self.clock(), cmd.effort, self.config.effort_queue_slack_s)
        if cmd.deadline_unix_ms:
            seq.deadline_s = self.clock() + (cmd.deadline_unix_ms / 1000 - time.time())
        if cmd.first_token is not None and seq.request_id in self.cache:
            self.cache.append_tokens(seq.request_id, [cmd.first_token])
        return seq

    def _eos_ids(self) -> set[int]:
        eos = self.model.config.eos_token_id
        if eos is None:
            return set()
        return {eos} if isinstance(eos, int) else set(eos)

    def _table_len(self, request_id: str) -> int:
        return len(self.cache.block_table(request_id)) if request_id in self.cache else 0

    def _refuse(self, failed: Failed) -> Failed:
        self.metrics.rejected.labels(failed.kind.value).inc()
        return failed

    def _account(self, sched: SchedulerOutput, start: float, batch: int) -> None:
        seconds = time.perf_counter() - start
        self.busy_s += seconds
        if batch:
            self.profile.record_step(batch, seconds)
            self.metrics.step_seconds.observe(seconds)
        self.metrics.running.set(len(self.scheduler.running))
        self.metrics.waiting.set(len(self.scheduler.waiting) + self.leases.num_open - len(self.scheduler.running))
        self.metrics.preempted.set(len(self.scheduler.preempted))
        arena = self.model.paged_arena
        if arena is not None:
            if not self.sequences:
                arena.trim()  # idle: give back what the largest batch grew it to
            self.metrics.paged_blocks.set(arena.num_blocks - arena.num_free)
            self.metrics.paged_copied.set(arena.copied_entries)


def _padded(values: np.ndarray, lengths: np.ndarray, fill: float) -> np.ndarray:
    """Rows of `lengths[i]` values laid end to end in `values` as `[rows, max(lengths)]`, each row's
    tail `fill` (one numpy store, not a torch op a row)."""
    rows = np.repeat(np.arange(lengths.size), lengths)
    cols = np.arange(values.shape[0]) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    out = np.full((lengths.size, int(lengths.max())), fill, dtype=values.dtype)
    out[rows, cols] = values
    return out


def _cut(draft: Draft | None, max_drafts: int) -> Draft | None:
    """`draft` shortened to `max_drafts` (None when that leaves nothing)."""
    if draft is None or len(draft.tokens) <= max_drafts:
        return draft
    if max_drafts <= 0:
        return None
    return Draft(draft.tokens[:max_drafts], draft.probs[:max_drafts], draft.confidences[:max_drafts])
