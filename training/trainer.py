"""Training the demo model: the backbone by next-token prediction, then the DSpark drafter by
distillation from the frozen backbone. Everything runs through the serving model's own layers
(`CEDModel.forward_train`, `Drafter.block_states` / `Drafter.heads`), so what is trained is what serves.

Backbone (`train_backbone`):

* loss: cross-entropy of the next token, plus the indexers' distillation loss (each index source's
  distribution over the visible compressed entries is pulled towards its layer's attention over
  all of them; the indexer's inputs are detached, so that loss trains the indexers only);
* KV: the record formats (FP8 windows, FP4 main KV and index keys) in the forward pass, gradients
  straight through (`kv_format.py`);
* weights: for the last `qat_fraction` of the steps, the weights the checkpoint stores as FP8 or FP4
  are those formats' round trip of float masters, gradients straight through (`WeightQAT`);
* sparse attention starts dense (`dense_fraction` of the steps attend to every visible compressed
  entry, while the indexers learn), then uses the indexers' top-k as serving does;
* MoE balance: the routers' selection biases move towards under-loaded experts after every step
  (`noaux_tc`, as DeepSeek-V3 trains; `ExpertBalancer`).

Drafter (`train_drafter`): for anchors at random positions of training rows, the draft block
(anchor + noise tokens) runs over the context vectors of the window before the anchor; the
Markov-adjusted draft distribution of block position j is pulled towards the backbone's next-token
distribution at position anchor + j (KL), and the confidence head learns whether the draft's argmax
equals the backbone's (binary cross-entropy). The previous token the Markov head reads is the
text's, i.e. every earlier draft accepted.

Drafter only (`train_drafter_cached`, docs/training.md "Drafter-only training"): the frozen backbone's
work is done once into a `DistillSet` (its greedy continuations of training prompts, as DSpark meets
them when serving, and corpus rows: every position's taps and top-K next tokens), then the drafter
trains many epochs over it on an argmax-aware loss (`cached_draft_loss`; the Markov head reads the
backbone's greedy tokens), measured by replaying greedy speculative decoding on held-out prompts
(`speculative_acceptance`) and written beside the unchanged backbone (`write_drafter_checkpoint`).

Step budget: a phase runs `max_steps`, or as many steps as fit in `seconds` at the step time
measured over its first `probe_steps` steps (the LR schedule is set then; warm-up covers the probe).
"""

from __future__ import annotations

import json
import math
import shutil
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cedserve.kernels.reference import E2M1_MAX, E4M3_MAX, e2m1_decode, e2m1_encode
from cedserve.kernels.weight_formats import FP4_WEIGHT_BLOCK, FP8_WEIGHT_BLOCK
from cedserve.model.checkpoint_writer import StoredFormat, encode_tensors, stored_format
from cedserve.model.config import ModelConfig
from cedserve.model.dspark import Drafter, DraftRequest, DraftState
from cedserve.model.moe import Router
from cedserve.model.network import BatchItem, CEDModel
from cedserve.training.data import consecutive_rows, random_rows

LogFn = Callable[[dict[str, Any]], None]


@dataclass(frozen=True)
class PhaseConfig:
    """One training phase (backbone or drafter)."""

    seconds: float = 240.0
    """Wall-clock budget; the step count follows from the probe (ignored when `max_steps` > 0)."""
    max_steps: int = 0
    """Exact number of steps (> 0), for reproducible or quick runs."""
    batch_size: int = 64
    """Rows per step."""
    seq_len: int = 512
    """Tokens per row."""
    lr: float = 3e-3
    """Peak learning rate (AdamW), reached after `warmup_steps`, cosine decay to `min_lr_ratio` x."""
    min_lr_ratio: float = 0.1
    warmup_steps: int = 40
    weight_decay: float = 0.1
    """On matrices only."""
    grad_clip: float = 1.0
    probe_steps: int = 8
    """Steps timed (after two warm-up steps) to size a time-budgeted phase; < warmup_steps."""
    qat_fraction: float = 0.4
    """Last fraction of the steps that run FP8/FP4 weights (straight-through)."""
    dense_fraction: float = 0.1
    """First fraction of the steps that attend to every visible compressed entry (backbone)."""
    balance_rate: float = 1e-3
    """Selection-bias step of the experts' load balancing."""
    anchors_per_row: int = 64
    """Draft anchors per row (drafter)."""
    eval_every: int = 100
    eval_rows: int = 16
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.probe_steps + 2 < self.warmup_steps:
            raise ValueError(f"probe_steps + 2 must be in (0, warmup_steps={self.warmup_steps}), got {self.probe_steps}")
        for name in ("batch_size", "seq_len", "eval_every", "eval_rows", "anchors_per_row"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("qat_fraction", "dense_fraction", "min_lr_ratio"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")


@dataclass
class PhaseReport:
    """What a phase did; `history` holds the periodic log records."""

    steps: int = 0
    seconds: float = 0.0
    tokens: int = 0
    step_s: float = 0.0
    final: dict[str, float] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)


# ------------------------------------------------------------------ initialisation


_UNIT = ("hc_attn_scale", "hc_ffn_scale", "q_weight", "k_weight", "scale")
_ZERO = ("attn_sink", "bias", "bias_vl", "hc_attn_base", "hc_ffn_base")
_OUTPUT = ("wo_b.weight", "w2.weight")


def init_for_training_(module: nn.Module, num_layers: int, generator: torch.Generator, std: float = 0.02) -> None:
    """In-place init: matrices N(0, std) (output projections scaled by 1/sqrt(2 x layers)), norms and
    scales 1, sinks, biases and mHC bases 0, mHC projections small (so every site starts near a
    uniform mix)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            noise = torch.randn(p.shape, generator=generator)
            if leaf in _UNIT or (leaf == "weight" and "norm" in name.rsplit(".", 2)[-2]):
                p.fill_(1.0)
            elif leaf in _ZERO:
                p.zero_()
            elif leaf in ("hc_attn_fn", "hc_ffn_fn"):
                p.copy_(0.1 * std * noise)
            elif name.endswith(_OUTPUT):
                p.copy_(std / math.sqrt(2 * num_layers) * noise)
            else:
                p.copy_(std * noise)


# ------------------------------------------------------------------ weight QAT


def fp8_weight_round_trip(w: Tensor, block: int = FP8_WEIGHT_BLOCK) -> Tensor:
    """`dequantize_fp8_weight(*quantize_fp8_weight(w))` for `w [..., out, in]`, batched."""
    out_dim, in_dim = w.shape[-2:]
    ot, it = -(-out_dim // block), -(-in_dim // block)
    padded = F.pad(w.float(), (0, it * block - in_dim, 0, ot * block - out_dim))
    tiles = padded.view(*w.shape[:-2], ot, block, it, block)
    amax = tiles.abs().amax(dim=(-3, -1)).clamp_min(1e-12)  # [..., ot, it]
    scale = torch.exp2(torch.ceil(torch.log2(amax / E4M3_MAX)))[..., :, None, :, None]
    q = (tiles / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() * scale
    return q.view(*w.shape[:-2], ot * block, it * block)[..., :out_dim, :in_dim]


def fp4_weight_round_trip(w: Tensor, block: int = FP4_WEIGHT_BLOCK) -> Tensor:
    """`dequantize_fp4_weight(*quantize_fp4_weight(w))` for `w [..., out, in]`, batched."""
    blocks = w.float().view(*w.shape[:-1], -1, block)
    amax = blocks.abs().amax(dim=-1).clamp_min(E2M1_MAX * 2.0**-126)
    scale = torch.exp2(torch.ceil(torch.log2(amax / E2M1_MAX)).clamp(-126, 127))[..., None]
    codes = e2m1_encode((blocks / scale).clamp(-E2M1_MAX, E2M1_MAX))
    return (e2m1_decode(codes) * scale).flatten(-2)


_ROUND_TRIPS = {StoredFormat.FP8: fp8_weight_round_trip, StoredFormat.FP4: fp4_weight_round_trip}


class WeightQAT:
    """Float masters for the weights the checkpoint stores as FP8 or FP4. The optimizer updates the
    masters; `load` sets the model's weights to them (their format's round trip once `enabled`),
    `pass_grads` hands the weights' gradients to the masters (straight-through). Weights of one
    format and shape are rounded together, in one batched call."""

    def __init__(self, module: nn.Module) -> None:
        self.params: list[nn.Parameter] = []
        self.masters: list[nn.Parameter] = []
        self.groups: dict[tuple[StoredFormat, tuple[int, ...]], list[int]] = {}
        for name, p in module.named_parameters():
            fmt = stored_format(name, p.shape)
            if p.requires_grad and fmt in _ROUND_TRIPS:
                self.groups.setdefault((fmt, tuple(p.shape)), []).append(len(self.params))
                self.params.append(p)
                self.masters.append(nn.Parameter(p.detach().clone()))
        self.managed = {id(p) for p in self.params}
        self.enabled = False

    @torch.no_grad()
    def load(self) -> None:
        for (fmt, _), index in self.groups.items():
            stacked = torch.stack([self.masters[i] for i in index])
            values = _ROUND_TRIPS[fmt](stacked) if self.enabled else stacked
            torch._foreach_copy_([self.params[i] for i in index], list(values.unbind(0)))

    def pass_grads(self) -> None:
        for p, m in zip(self.params, self.masters):
            m.grad, p.grad = p.grad, None


class ExpertBalancer:
    """`noaux_tc` load balancing: counts every router's picks in training passes and, after each
    step, moves each expert's selection bias by `rate` up when it got fewer than the mean, down when
    more (the bias steers selection only, never the weights)."""

    def __init__(self, module: nn.Module, rate: float) -> None:
        self.rate = rate
        self.routers = [m for m in module.modules() if isinstance(m, Router)]
        self.counts = [torch.zeros(r.bias.shape[0], device=r.bias.device) for r in self.routers]
        self.hooks = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(self.routers)]

    def _hook(self, i: int) -> Callable[[nn.Module, Any, Any], None]:
        def count(module: nn.Module, inputs: Any, output: Any) -> None:
            if module.training:
                indices = output[1]
                self.counts[i].add_(torch.bincount(indices.flatten(), minlength=self.counts[i].shape[0]))
        return count

    @torch.no_grad()
    def update(self) -> float:
        """Apply one bias step; returns the worst max/mean load ratio over the routers."""
        worst = 0.0
        for router, load in zip(self.routers, self.counts):
            if load.sum() > 0:
                router.bias.add_(self.rate * torch.sign(load.mean() - load))
                worst = max(worst, float(load.max() / load.mean()))
            load.zero_()
        return worst

    def close(self) -> None:
        for hook in self.hooks:
            hook.remove()


# ------------------------------------------------------------------ shared loop pieces


class StepBudget:
    """How many steps a phase runs and its learning rate at each."""

    def __init__(self, cfg: PhaseConfig) -> None:
        self.cfg = cfg
        self.total: int | None = cfg.max_steps or None
        self.started = time.perf_counter()
        self._probe_start = 0.0
        self.step_s = 0.0

    def observe(self, step: int) -> None:
        """Call after each step (1-based count): times the probe and sizes the phase."""
        if self.cfg.max_steps:
            return
        if step == 2:
            _sync()
            self._probe_start = time.perf_counter()
        elif step == self.cfg.probe_steps + 2:
            _sync()
            now = time.perf_counter()
            self.step_s = (now - self._probe_start) / self.cfg.probe_steps
            left = self.cfg.seconds - (now - self.started)
            self.total = step + max(0, int(0.97 * left / self.step_s))

    def done(self, step: int) -> bool:
        if self.total is not None:
            return step >= self.total
        return time.perf_counter() - self.started > self.cfg.seconds  # the probe itself ran out

    def fraction(self, step: int) -> float:
        return step / self.total if self.total else 0.0

    def lr(self, step: int) -> float:
        cfg = self.cfg
        if step < cfg.warmup_steps or self.total is None:
            return cfg.lr * (step + 1) / cfg.warmup_steps
        span = max(1, self.total - cfg.warmup_steps)
        progress = min(1.0, (step - cfg.warmup_steps) / span)
        return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _optimizer(named: Iterable[tuple[str, nn.Parameter]], qat: WeightQAT, cfg: PhaseConfig) -> torch.optim.AdamW:
    """AdamW over the trainable parameters (QAT masters in place of their weights); decay on matrices."""
    masters = dict(zip((id(p) for p in qat.params), qat.masters))
    decay: list[Tensor] = []
    plain: list[Tensor] = []
    for _, p in named:
        if not p.requires_grad:
            continue
        target = masters.get(id(p), p)
        (decay if target.dim() >= 2 else plain).append(target)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": plain, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)


def _optimizer_step(opt: torch.optim.AdamW, lr: float, clip: float) -> float:
    """Clip, then step at `lr`; a step whose gradient is not finite is skipped (returns its norm)."""
    params = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
    norm = float(nn.utils.clip_grad_norm_(params, clip))
    if math.isfinite(norm):
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()
    opt.zero_grad(set_to_none=True)
    return norm


def _progress(total: int | None, desc: str) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, mininterval=5.0, ncols=100)


@dataclass
class _StepLoop:
    """One phase's optimisation state, which every step's tail (`_finish_step`) updates."""

    cfg: PhaseConfig
    qat: WeightQAT
    opt: torch.optim.AdamW
    balancer: ExpertBalancer
    budget: StepBudget
    bar: Any  # tqdm


def _finish_step(loop: _StepLoop, loss: Tensor, step: int,
                 postfix: dict[str, tuple[Tensor | float, str]]) -> tuple[int, float, float]:
    """The tail of a step after its forward pass: backward, QAT gradients to the masters, the
    optimizer step at the schedule's LR, the expert balancer, the budget and the progress bar
    (`postfix`: name -> (value, format spec), shown every 10 steps; only then is a tensor read back).
    Returns (the new 1-based step count, the gradient norm, the balancer's max expert load)."""
    loss.backward()  # type: ignore[no-untyped-call]
    loop.qat.pass_grads()
    grad_norm = _optimizer_step(loop.opt, loop.budget.lr(step), loop.cfg.grad_clip)
    imbalance = loop.balancer.update()
    step += 1
    loop.budget.observe(step)
    if loop.bar.total is None and loop.budget.total is not None:
        loop.bar.total = loop.budget.total
    loop.bar.update(1)
    if step % 10 == 0:
        loop.bar.set_postfix({name: format(float(value), spec) for name, (value, spec) in postfix.items()})
    return step, grad_norm, imbalance


def _batches(stream: Tensor, rows: int, length: int, generator: torch.Generator) -> Iterator[Tensor]:
    while True:
        yield random_rows(stream, rows, length, generator)


# ------------------------------------------------------------------ backbone


def lm_loss(model: CEDModel, rows: Tensor, dense: bool = False, indexer_loss: bool = False) -> tuple[Tensor, Tensor]:
    """(next-token cross-entropy, indexer loss) of `rows [B, S + 1]`."""
    out = model.forward_train(rows[:, :-1], dense_selection=dense, indexer_loss=indexer_loss)
    ce = F.cross_entropy(out.logits.flatten(0, 1), rows[:, 1:].flatten())
    return ce, out.indexer_loss


@torch.no_grad()
def heldout_loss(model: CEDModel, stream: Tensor, seq_len: int, max_rows: int, batch_size: int = 16) -> float:
    """Mean next-token cross-entropy (nats) over consecutive held-out windows, in eval mode."""
    was_training = model.training
    model.eval()
    rows = consecutive_rows(stream, seq_len + 1, max_rows)
    total, count = 0.0, 0
    for start in range(0, rows.shape[0], batch_size):
        chunk = rows[start : start + batch_size]
        ce, _ = lm_loss(model, chunk)
        total += float(ce) * chunk.shape[0]
        count += chunk.shape[0]
    model.train(was_training)
    return total / count


def train_backbone(model: CEDModel, train: Tensor, heldout: Tensor, cfg: PhaseConfig, log: LogFn) -> PhaseReport:
    """Train `model` in place (see the module docstring); `train`/`heldout` are token streams on
    the model's device. Ends with the QAT masters' final values in the model."""
    generator = torch.Generator().manual_seed(cfg.seed)
    model.train()
    qat = WeightQAT(model)
    opt = _optimizer(model.named_parameters(), qat, cfg)
    balancer = ExpertBalancer(model, cfg.balance_rate)
    budget = StepBudget(cfg)
    report = PhaseReport()
    bar = _progress(budget.total, "backbone")
    loop = _StepLoop(cfg, qat, opt, balancer, budget, bar)
    batches = _batches(train, cfg.batch_size, cfg.seq_len + 1, generator)
    step = 0
    while not budget.done(step):
        frac = budget.fraction(step)
        qat.enabled = budget.total is not None and frac >= 1 - cfg.qat_fraction
        qat.load()
        dense = budget.total is None or frac < cfg.dense_fraction
        ce, aux = lm_loss(model, next(batches), dense, indexer_loss=True)
        step, grad_norm, imbalance = _finish_step(
            loop, ce + aux, step, {"loss": (ce, ".3f"), "idx": (aux, ".3f")})
        ce, aux = ce.detach(), aux.detach()
        if step % cfg.eval_every == 0 or budget.done(step):
            record = {"phase": "backbone", "step": step, "seconds": round(time.perf_counter() - budget.started, 1),
                      "loss": float(ce), "indexer_kl": float(aux), "grad_norm": grad_norm,
                      "max_expert_load": imbalance, "lr": budget.lr(step - 1), "dense": dense, "qat": qat.enabled,
                      "heldout_loss": heldout_loss(model, heldout, cfg.seq_len, cfg.eval_rows)}
            report.history.append(record)
            log(record)
    bar.close()
    qat.enabled = budget.total is not None and cfg.qat_fraction > 0
    qat.load()
    balancer.close()
    model.eval()
    _sync()
    report.steps, report.seconds = step, time.perf_counter() - budget.started
    report.tokens, report.step_s = step * cfg.batch_size * cfg.seq_len, budget.step_s
    return report


# ------------------------------------------------------------------ drafter


@dataclass(frozen=True)
class DraftBatch:
    """Draft blocks for anchors of a batch of rows, gathered for one drafter pass."""

    block: Tensor  # int64 [A, k]: anchor, then noise tokens
    positions: Tensor  # int64 [A, k]
    context: Tensor  # [A, W, D]: context vectors of the W positions before the anchor
    ctx_positions: Tensor  # int64 [A, W] (negative: before the row's start, masked)
    previous: Tensor  # int64 [A, k]: the token before each block position's prediction
    teacher: Tensor  # float32 [A, k, V]: backbone logits at the same positions


def draft_batch(drafter: Drafter, tokens: Tensor, logits: Tensor, taps: Tensor, anchors: Tensor) -> DraftBatch:
    """`tokens [B, S]`, backbone `logits [B, S, V]` and `taps [B, S, n_taps, hc, D]` of the rows,
    `anchors [B, a]` positions (at most S - k) -> the anchors' draft blocks (row-major)."""
    c = drafter.config
    k, window = c.dspark_block_size, c.sliding_window
    rows = torch.arange(tokens.shape[0], device=tokens.device).repeat_interleave(anchors.shape[1])[:, None]
    anchor = anchors.flatten()[:, None]  # [A, 1]
    positions = anchor + torch.arange(k, device=tokens.device)  # [A, k]
    ctx_positions = anchor - window + torch.arange(window, device=tokens.device)  # [A, W]
    context = drafter.context_vectors(taps)  # [B, S, D]
    block = torch.full_like(positions, c.dspark_noise_token_id)
    block[:, 0] = tokens[rows[:, 0], anchor[:, 0]]
    return DraftBatch(block, positions, context[rows, ctx_positions.clamp_min(0)], ctx_positions,
                      tokens[rows, positions], logits[rows, positions].float())


def confidence_loss(confidence: Tensor, match: Tensor) -> Tensor:
    """The confidence head's loss: `confidence [A, k, 1]` against `match [A, k]` (draft k equals the
    backbone's argmax), counted only where drafts 1..k-1 all matched. Serving multiplies c_1 ... c_j
    into the survival of a j-prefix (`choose_verify_lengths`), so c_k must be the probability that
    draft k is right *given* the earlier ones were; a plain per-position target learns the marginal,
    which errors' correlation makes far lower at k > 1, and the product then undercounts survival."""
    reached = torch.cat([torch.ones_like(match[:, :1]), match[:, :-1].cumprod(dim=-1)], dim=-1)  # [A, k]
    bce = F.binary_cross_entropy(confidence.squeeze(-1).clamp(1e-6, 1 - 1e-6), match, reduction="none")
    return (bce * reached).sum() / reached.sum().clamp_min(1.0)


def draft_loss(model: CEDModel, drafter: Drafter, batch: DraftBatch) -> tuple[Tensor, dict[str, float]]:
    """KL(backbone || draft) per block position plus the confidence head's cross-entropy; also the
    mean number of leading drafts equal to the backbone's argmax (greedy acceptance on the text)."""
    h = drafter.block_states(batch.block, batch.context, batch.positions, batch.ctx_positions, model.embed)
    logits, confidence = drafter.heads(h, model.lm_head(h).float(), batch.previous)
    target = torch.log_softmax(batch.teacher, dim=-1)
    kl = (target.exp() * (target - torch.log_softmax(logits, dim=-1))).sum(dim=-1).mean()
    match = (logits.argmax(dim=-1) == batch.teacher.argmax(dim=-1)).float()
    conf = confidence_loss(confidence, match)
    accepted = match.cumprod(dim=-1).sum(dim=-1).mean()
    stats = {"kl": float(kl.detach()), "confidence_bce": float(conf.detach()), "accepted": float(accepted)}
    return kl + conf, stats


def _anchors(batch: int, seq_len: int, k: int, count: int, generator: torch.Generator, device: torch.device) -> Tensor:
    choices = seq_len - k + 1
    picks = torch.rand(batch, choices, generator=generator).argsort(dim=-1)[:, : min(count, choices)]
    return picks.sort(dim=-1).values.to(device)


@torch.no_grad()
def heldout_acceptance(model: CEDModel, drafter: Drafter, stream: Tensor, seq_len: int, max_rows: int,
                       anchors_per_row: int, seed: int) -> dict[str, float]:
    """`draft_loss`'s statistics on held-out rows (fixed anchors)."""
    was_training = drafter.training
    drafter.eval()
    rows = consecutive_rows(stream, seq_len, max_rows)
    generator = torch.Generator().manual_seed(seed)
    sums: dict[str, float] = {}
    for start in range(0, rows.shape[0], 16):
        chunk = rows[start : start + 16]
        out = model.forward_train(chunk, taps=True)
        assert out.taps is not None
        anchors = _anchors(chunk.shape[0], seq_len, drafter.config.dspark_block_size, anchors_per_row, generator,
                           chunk.device)
        _, stats = draft_loss(model, drafter, draft_batch(drafter, chunk, out.logits, out.taps, anchors))
        for key, value in stats.items():
            sums[key] = sums.get(key, 0.0) + value * chunk.shape[0]
    drafter.train(was_training)
    return {key: value / rows.shape[0] for key, value in sums.items()}


def train_drafter(model: CEDModel, drafter: Drafter, train: Tensor, heldout: Tensor, cfg: PhaseConfig,
                  log: LogFn) -> PhaseReport:
    """Train `drafter` in place by distillation from the frozen `model` (module docstring)."""
    generator = torch.Generator().manual_seed(cfg.seed + 1)
    model.eval().requires_grad_(False)
    drafter.train()
    qat = WeightQAT(drafter)
    opt = _optimizer(drafter.named_parameters(), qat, cfg)
    balancer = ExpertBalancer(drafter, cfg.balance_rate)
    budget = StepBudget(cfg)
    report = PhaseReport()
    bar = _progress(budget.total, "drafter")
    loop = _StepLoop(cfg, qat, opt, balancer, budget, bar)
    batches = _batches(train, cfg.batch_size, cfg.seq_len, generator)
    k = drafter.config.dspark_block_size
    step = 0
    while not budget.done(step):
        qat.enabled = budget.total is not None and budget.fraction(step) >= 1 - cfg.qat_fraction
        qat.load()
        rows = next(batches)
        with torch.no_grad():
            out = model.forward_train(rows, taps=True)
        assert out.taps is not None
        anchors = _anchors(rows.shape[0], cfg.seq_len, k, cfg.anchors_per_row, generator, rows.device)
        loss, stats = draft_loss(model, drafter, draft_batch(drafter, rows, out.logits, out.taps, anchors))
        step, grad_norm, _ = _finish_step(
            loop, loss, step, {"kl": (stats["kl"], ".3f"), "acc": (stats["accepted"], ".2f")})
        if step % cfg.eval_every == 0 or budget.done(step):
            record: dict[str, Any] = {"phase": "drafter", "step": step,
                                      "seconds": round(time.perf_counter() - budget.started, 1),
                                      **stats, "grad_norm": grad_norm, "lr": budget.lr(step - 1), "qat": qat.enabled}
            held = heldout_acceptance(model, drafter, heldout, cfg.seq_len, cfg.eval_rows, cfg.anchors_per_row, cfg.seed)
            record.update({f"heldout_{key}": value for key, value in held.items()})
            report.history.append(record)
            log(record)
    bar.close()
    qat.enabled = budget.total is not None and cfg.qat_fraction > 0
    qat.load()
    balancer.close()
    drafter.eval()
    _sync()
    report.steps, report.seconds = step, time.perf_counter() - budget.started
    report.tokens, report.step_s = step * cfg.batch_size * cfg.seq_len, budget.step_s
    return report


# ------------------------------------------------------------------ drafter: self-distillation over a cache


@dataclass(frozen=True)
class DistillSet:
    """The frozen backbone's work for drafter training, done once (`distill_set`) and reused for
    many epochs: rows of text, the DSpark taps of every position (averaged over the mHC streams, as
    `Drafter.context_vectors` does first), and the backbone's top-K next-token distribution there."""

    tokens: Tensor  # int64 [N, S]
    taps: Tensor  # float32 [N, S, n_taps, D]: stream-mean taps
    top_ids: Tensor  # int64 [N, S, K]: the backbone's K likeliest next tokens, its argmax first
    top_logp: Tensor  # float32 [N, S, K]: their log-probabilities (of the full softmax)
    first_anchor: Tensor  # int64 [N]: anchors are drawn from [first_anchor, S - block]

    @property
    def num_rows(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.tokens.shape[1])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.tokens, self.taps, self.top_ids, self.top_logp))

    @property
    def greedy(self) -> Tensor:
        """int64 `[N, S]`: the backbone's argmax next token at every position."""
        return self.top_ids[..., 0]

    def select(self, index: Tensor) -> DistillSet:
        return DistillSet(self.tokens[index], self.taps[index], self.top_ids[index], self.top_logp[index],
                          self.first_anchor[index])

    @staticmethod
    def cat(parts: list[DistillSet]) -> DistillSet:
        if len({p.seq_len for p in parts}) != 1:
            raise ValueError(f"DistillSet.cat: rows of different lengths {[p.seq_len for p in parts]}")
        return DistillSet(*(torch.cat([getattr(p, f) for p in parts])
                            for f in ("tokens", "taps", "top_ids", "top_logp", "first_anchor")))


@torch.no_grad()
def greedy_continuations(model: CEDModel, prompts: Tensor, new_tokens: int, batch_size: int = 64,
                         seconds: float = 0.0) -> Tensor:
    """`prompts [B, P]` followed by the backbone's own greedy continuation of `new_tokens` tokens
    (what DSpark drafts against at serving time), `[B', P + n]`. Decoding runs through the serving
    path (`CEDModel.forward_batch`: every row's state in one pass per token), `batch_size` rows at a
    time. With `seconds` > 0 the budget bounds it: no new group starts once it is spent (B' < B), and
    if the first group runs out, its rows end there (n < new_tokens)."""
    started = time.perf_counter()
    out: list[Tensor] = []
    for start in range(0, prompts.shape[0], batch_size):
        if out and seconds > 0 and time.perf_counter() - started > seconds:
            break
        chunk = prompts[start : start + batch_size]
        states = [model.new_state() for _ in range(chunk.shape[0])]
        outs = model.forward_batch([BatchItem(row, state) for row, state in zip(chunk, states)])
        token = torch.stack([o.logits[-1] for o in outs]).argmax(-1)  # [b]
        generated = [token]
        for _ in range(new_tokens - 1):
            if not out and seconds > 0 and time.perf_counter() - started > seconds:
                break  # the first group is all there is: keep what it has
            outs = model.forward_batch([BatchItem([t], s) for t, s in zip(token.tolist(), states)])
            token = torch.stack([o.logits[-1] for o in outs]).argmax(-1)
            generated.append(token)
        rows = torch.cat([chunk, torch.stack(generated, 1).to(chunk.device)], 1)
        if out and rows.shape[1] != out[0].shape[1]:
            break
        out.append(rows)
        if rows.shape[1] < prompts.shape[1] + new_tokens:
            break
    return torch.cat(out)


@torch.no_grad()
def distill_set(model: CEDModel, rows: Tensor, first_anchor: int, topk: int = 16, batch_size: int = 16) -> DistillSet:
    """One frozen-backbone pass (`forward_train`, taps on) over `rows [N, S]`."""
    taps, ids, logps = [], [], []
    for start in range(0, rows.shape[0], batch_size):
        out = model.forward_train(rows[start : start + batch_size], taps=True)
        assert out.taps is not None
        top_logp, top_ids = torch.log_softmax(out.logits.float(), dim=-1).topk(topk, dim=-1)
        taps.append(out.taps.float().mean(dim=-2))
        ids.append(top_ids)
        logps.append(top_logp)
    first = torch.full((rows.shape[0],), first_anchor, dtype=torch.long, device=rows.device)
    return DistillSet(rows, torch.cat(taps), torch.cat(ids), torch.cat(logps), first)


@dataclass(frozen=True)
class CachedDraftBatch:
    """Draft blocks of anchors drawn from a `DistillSet`."""

    block: Tensor  # int64 [A, k]: anchor, then noise tokens
    positions: Tensor  # int64 [A, k]
    context: Tensor  # [A, W, D]: context vectors of the W positions before the anchor
    ctx_positions: Tensor  # int64 [A, W] (negative: before the row's start, masked)
    previous: Tensor  # int64 [A, k]: the anchor, then the backbone's greedy tokens
    top_ids: Tensor  # int64 [A, k, K]: the backbone's top-K next tokens at each block position
    top_logp: Tensor  # float32 [A, k, K]


def sample_anchors(data: DistillSet, rows: Tensor, per_row: int, block: int, generator: torch.Generator) -> Tensor:
    """`[len(rows), per_row]` anchor positions, uniform in each row's `[first_anchor, S - block]`."""
    low = data.first_anchor.cpu()[rows.cpu()]  # [B]
    span = (data.seq_len - block + 1 - low).clamp_min(1)
    u = torch.rand(rows.shape[0], per_row, generator=generator)
    return (low[:, None] + (u * span[:, None]).long()).to(data.tokens.device)


def cached_draft_batch(drafter: Drafter, data: DistillSet, rows: Tensor, anchors: Tensor) -> CachedDraftBatch:
    """The draft blocks at `anchors [B, a]` of data rows `rows [B]` (row-major). The Markov head's
    previous token at block position j > 0 is the backbone's greedy token there (what a draft
    accepted so far holds), not the text's."""
    c = drafter.config
    k, window = c.dspark_block_size, c.sliding_window
    device = data.tokens.device
    row = rows.to(device).repeat_interleave(anchors.shape[1])[:, None]  # [A, 1]
    anchor = anchors.flatten()[:, None]  # [A, 1]
    positions = anchor + torch.arange(k, device=device)  # [A, k]
    ctx_positions = anchor - window + torch.arange(window, device=device)  # [A, W]
    taps = data.taps[row, ctx_positions.clamp_min(0)]  # [A, W, n_taps, D]
    context = drafter.context_vectors(taps.unsqueeze(-2))  # a stream axis of one: the mean is the value
    anchor_token = data.tokens[row[:, 0], anchor[:, 0]]  # [A]
    greedy = data.top_ids[row, positions, 0]  # [A, k]
    previous = torch.cat([anchor_token[:, None], greedy[:, :-1]], dim=1)
    block = torch.full_like(positions, c.dspark_noise_token_id)
    block[:, 0] = anchor_token
    return CachedDraftBatch(block, positions, context, ctx_positions, previous, data.top_ids[row, positions],
                            data.top_logp[row, positions])


@dataclass(frozen=True)
class DraftLossConfig:
    """Weights of the drafter's distillation loss (`cached_draft_loss`)."""

    soft: float = 1.0
    """Cross-entropy to the backbone's top-K distribution (renormalised): calibration, sampling."""
    argmax: float = 1.0
    """Cross-entropy to the backbone's argmax: what greedy acceptance checks."""
    prefix: bool = False
    """Weight block position j by the drafter's probability (detached) of drafting the backbone's
    greedy tokens at positions < j: a position counts as much as it is reached."""
    confidence: float = 1.0


def cached_draft_loss(model: CEDModel, drafter: Drafter, batch: CachedDraftBatch,
                      weights: DraftLossConfig = DraftLossConfig()) -> tuple[Tensor, dict[str, float]]:
    """The drafter's loss on a cached batch, and statistics: `kl` (to the top-K teacher),
    `argmax_ce`, `top1` (share of block positions whose argmax is the backbone's) and `accepted`
    (mean leading drafts equal to the backbone's greedy tokens: greedy acceptance on these rows)."""
    h = drafter.block_states(batch.block, batch.context, batch.positions, batch.ctx_positions, model.embed)
    logits, confidence = drafter.heads(h, model.lm_head(h).float(), batch.previous)
    logq = torch.log_softmax(logits, dim=-1)  # [A, k, V]
    top_logq = logq.gather(-1, batch.top_ids)  # [A, k, K]
    teacher = torch.log_softmax(batch.top_logp, dim=-1)  # renormalised over the top K
    soft = -(teacher.exp() * top_logq).sum(-1)  # [A, k]
    hard = -top_logq[..., 0]
    per_position = weights.soft * soft + weights.argmax * hard
    if weights.prefix:
        reach = torch.cat([torch.ones_like(hard[:, :1]), (-hard[:, :-1]).detach().exp().cumprod(-1)], dim=-1)
        distill = (per_position * reach).sum() / reach.sum()
    else:
        distill = per_position.mean()
    match = (logits.argmax(dim=-1) == batch.top_ids[..., 0]).float()
    conf = confidence_loss(confidence, match)
    kl = ((teacher.exp() * teacher).sum(-1) + soft).mean()
    stats = {"kl": float(kl.detach()), "argmax_ce": float(hard.detach().mean()), "top1": float(match.mean()),
             "accepted": float(match.cumprod(dim=-1).sum(dim=-1).mean()), "confidence_bce": float(conf.detach())}
    return distill + weights.confidence * conf, stats


@torch.no_grad()
def speculative_acceptance(model: CEDModel, drafter: Drafter, data: DistillSet, max_verifications: int = 0) -> dict[str, float]:
    """Greedy speculative decoding replayed on `data`, whose rows from `first_anchor` on are the
    backbone's greedy continuation of their prompt (`greedy_continuations`): from the first anchor
    on, each verification drafts `dspark_block_size` tokens through the serving draft pass
    (`Drafter.draft_batch`, all rows at once, each with the memory a decode worker holds: the
    context vectors before its anchor), accepts the leading drafts equal to the backbone's greedy
    tokens, and moves the anchor past them and the target's own token, as `DecodeEngine` does.
    Returns the mean accepted drafts per verification (benchmarks/demo_eval.py's figure) and the
    share of verifications whose first draft is accepted. `max_verifications` (> 0) caps each row."""
    was_training = drafter.training
    drafter.eval()
    c = drafter.config
    k, keep = c.dspark_block_size, c.sliding_window + c.dspark_block_size + 1
    vectors = torch.cat([drafter.context_vectors(data.taps[i : i + 16].unsqueeze(-2))
                         for i in range(0, data.num_rows, 16)])  # [N, S, D]
    greedy = data.greedy.tolist()
    tokens = data.tokens.tolist()
    anchors = data.first_anchor.tolist()
    counts = [0] * data.num_rows
    accepted = verifications = first = 0
    histogram = [0] * (k + 1)
    while True:
        active = [i for i, a in enumerate(anchors) if a + k <= data.seq_len and a > 0
                  and (max_verifications <= 0 or counts[i] < max_verifications)]
        if not active:
            break
        requests = []
        for i in active:
            a = anchors[i]
            state = DraftState.new(c, vectors.device)  # what a decode worker holds at this anchor
            state.vectors, state.end_position = vectors[i, max(0, a - keep) : a], a
            requests.append(DraftRequest(tokens[i][a], state))
        for i, draft in zip(active, drafter.draft_batch(requests, model.embed, model.lm_head)):
            a = anchors[i]
            n = 0
            while n < k and draft.tokens[n] == greedy[i][a + n]:
                n += 1
            accepted += n
            verifications += 1
            first += n > 0
            histogram[n] += 1
            counts[i] += 1
            anchors[i] = a + n + 1
    drafter.train(was_training)
    return {"accepted_per_verify": accepted / max(1, verifications), "first_accepted": first / max(1, verifications),
            "verifications": float(verifications), **{f"share_{n}": h / max(1, verifications) for n, h in enumerate(histogram)}}


def train_drafter_cached(model: CEDModel, drafter: Drafter, data: DistillSet, cfg: PhaseConfig, log: LogFn,
                         weights: DraftLossConfig = DraftLossConfig(),
                         evaluate: Callable[[], dict[str, float]] | None = None, evaluations: int = 0,
                         greedy_share: float = 0.0, keep_best: str = "") -> PhaseReport:
    """Train `drafter` in place on a `DistillSet` (the frozen backbone is not run again): every
    step draws `batch_size` rows and `anchors_per_row` anchors per row, AdamW on
    `cached_draft_loss`, QAT for the last `qat_fraction` of the steps, the draft experts' balancing.
    Every `eval_every` steps (`evaluations` > 0: that many times over the phase, once its length is
    known) and at the end, a log record; `evaluate` (e.g. `speculative_acceptance` on held-out rows)
    adds its figures to it. Rows are drawn uniformly, or with `greedy_share` in (0, 1) that share of
    them from the greedy rows (`first_anchor` > 1) when there are both kinds. `keep_best` (a key of
    `evaluate`'s figures): the drafter ends as it was at the evaluation that maximised it
    (`PhaseReport.final["best_step"]`)."""
    generator = torch.Generator().manual_seed(cfg.seed + 2)
    model.eval().requires_grad_(False)
    drafter.train()
    qat = WeightQAT(drafter)
    opt = _optimizer(drafter.named_parameters(), qat, cfg)
    balancer = ExpertBalancer(drafter, cfg.balance_rate)
    budget = StepBudget(cfg)
    report = PhaseReport()
    bar = _progress(budget.total, "drafter")
    loop = _StepLoop(cfg, qat, opt, balancer, budget, bar)
    k = drafter.config.dspark_block_size
    is_greedy = (data.first_anchor > 1).cpu()
    weights_per_row = torch.ones(data.num_rows)
    if 0 < greedy_share < 1 and 0 < int(is_greedy.sum()) < data.num_rows:
        weights_per_row = torch.where(is_greedy, greedy_share / is_greedy.sum(), (1 - greedy_share) / (~is_greedy).sum())
    best: tuple[float, int, dict[str, Tensor]] | None = None
    if keep_best and evaluate is not None:  # the starting drafter is a candidate too
        figures = evaluate()
        best = (figures[keep_best], 0, {k: v.detach().clone() for k, v in drafter.state_dict().items()})
        report.history.append({"phase": "drafter", "step": 0, **{f"heldout_{k}": v for k, v in figures.items()}})
        log(report.history[-1])
    step = 0
    while not budget.done(step):
        qat.enabled = budget.total is not None and budget.fraction(step) >= 1 - cfg.qat_fraction
        qat.load()
        rows = torch.multinomial(weights_per_row, cfg.batch_size, replacement=True, generator=generator)
        anchors = sample_anchors(data, rows, cfg.anchors_per_row, k, generator)
        loss, stats = cached_draft_loss(model, drafter, cached_draft_batch(drafter, data, rows, anchors), weights)
        step, grad_norm, _ = _finish_step(
            loop, loss, step, {"kl": (stats["kl"], ".3f"), "acc": (stats["accepted"], ".2f")})
        every = cfg.eval_every
        if evaluations > 0:
            every = max(1, budget.total // evaluations) if budget.total else 0
        if (every and step % every == 0) or budget.done(step):
            record: dict[str, Any] = {"phase": "drafter", "step": step,
                                      "seconds": round(time.perf_counter() - budget.started, 1),
                                      **stats, "grad_norm": grad_norm, "lr": budget.lr(step - 1), "qat": qat.enabled}
            if evaluate is not None:
                qat.load()
                figures = evaluate()
                record.update({f"heldout_{key}": value for key, value in figures.items()})
                if keep_best and (best is None or figures[keep_best] > best[0]):
                    best = (figures[keep_best], step, {k: v.detach().clone() for k, v in drafter.state_dict().items()})
            report.history.append(record)
            log(record)
    bar.close()
    qat.enabled = budget.total is not None and cfg.qat_fraction > 0
    qat.load()
    if best is not None:
        drafter.load_state_dict(best[2])
        report.final = {"best_step": float(best[1]), f"best_{keep_best}": best[0]}
    balancer.close()
    drafter.eval()
    _sync()
    report.steps, report.seconds = step, time.perf_counter() - budget.started
    report.tokens, report.step_s = step * cfg.batch_size * cfg.anchors_per_row, budget.step_s
    return report


def write_drafter_checkpoint(source: Path, drafter: Drafter, out: Path, metadata: dict[str, str] | None = None) -> None:
    """Write `out` as the checkpoint folder `source` with its drafter (`dspark.*`) replaced by
    `drafter`: every other tensor is copied as stored (its bytes unchanged), `config.json` is
    `drafter.config` (which may change only the drafter's fields), tokenizer and generation config
    are copied. `out` may equal `source` (the weights are replaced atomically)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    source, out = Path(source), Path(out)
    old = ModelConfig.from_hf_json(source)
    drafter_fields = {"num_nextn_predict_layers", "dspark_markov_rank", "dspark_n_routed_experts",
                      "dspark_num_experts_per_tok", "compress_ratios"}
    changed = {f for f in old.__dataclass_fields__ if getattr(old, f) != getattr(drafter.config, f)}
    if changed - drafter_fields:
        raise ValueError(f"write_drafter_checkpoint: the drafter's config changes backbone fields {sorted(changed - drafter_fields)}")
    shards = sorted(source.glob("*.safetensors"))
    if len(shards) != 1:
        raise ValueError(f"write_drafter_checkpoint: expected one *.safetensors in {source}, found {len(shards)}")
    tensors: dict[str, Tensor] = {}
    with safe_open(str(shards[0]), framework="pt") as handle:
        stored_metadata = dict(handle.metadata() or {})
        for name in handle.keys():  # noqa: SIM118 - a safetensors handle is not iterable
            if not name.startswith("dspark."):
                tensors[name] = handle.get_tensor(name)
    named = {f"dspark.{k}": v for k, v in drafter.state_dict().items()}  # as checkpoint_tensors names them
    tensors.update({k: v.cpu() for k, v in encode_tensors(named, True, half_floats=True).items()})
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / (shards[0].name + ".tmp")
    save_file(tensors, str(tmp), metadata={**stored_metadata, **(metadata or {})})
    tmp.replace(out / shards[0].name)
    if changed:
        (out / "config.json").write_text(json.dumps(drafter.config.to_hf_dict(), indent=1))
    names = ("tokenizer.json", "generation_config.json") + (() if changed else ("config.json",))
    for name in names:
        if (source / name).exists() and (source / name).resolve() != (out / name).resolve():
            shutil.copyfile(source / name, out / name)


def backbone_identical(source: Path, out: Path) -> dict[str, Any]:
    """Compare every tensor but the drafter's (`dspark.*`) of two checkpoint folders byte for byte:
    `identical`, the names that differ (missing on one side, other dtype, shape or bytes), and the
    count and bytes compared."""
    from safetensors import safe_open

    def tensors(folder: Path) -> dict[str, torch.Tensor]:
        found: dict[str, torch.Tensor] = {}
        for shard in sorted(folder.glob("*.safetensors")):
            with safe_open(str(shard), framework="pt") as handle:
                found.update({n: handle.get_tensor(n) for n in handle.keys() if not n.startswith("dspark.")})  # noqa: SIM118
        return found

    a, b = tensors(source), tensors(out)
    differ = sorted(n for n in a.keys() | b.keys()
                    if n not in a or n not in b or a[n].dtype != b[n].dtype or a[n].shape != b[n].shape
                    or not torch.equal(a[n].contiguous().view(torch.uint8), b[n].contiguous().view(torch.uint8)))
    return {"tensors": len(a), "bytes": sum(t.numel() * t.element_size() for t in a.values()), "differ": differ,
            "identical": not differ}
