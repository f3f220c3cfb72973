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

Step budget: a phase runs `max_steps`, or as many steps as fit in `seconds` at the step time
measured over its first `probe_steps` steps (the LR schedule is set then; warm-up covers the probe).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cedserve.kernels.reference import E2M1_MAX, E4M3_MAX, e2m1_decode, e2m1_encode
from cedserve.kernels.weight_formats import FP4_WEIGHT_BLOCK, FP8_WEIGHT_BLOCK
from cedserve.model.checkpoint_writer import StoredFormat, stored_format
from cedserve.model.dspark import Drafter
from cedserve.model.moe import Router
from cedserve.model.network import CEDModel
from cedserve.model.train_data import consecutive_rows, random_rows

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
    batches = _batches(train, cfg.batch_size, cfg.seq_len + 1, generator)
    step = 0
    while not budget.done(step):
        frac = budget.fraction(step)
        qat.enabled = budget.total is not None and frac >= 1 - cfg.qat_fraction
        qat.load()
        dense = budget.total is None or frac < cfg.dense_fraction
        ce, aux = lm_loss(model, next(batches), dense, indexer_loss=True)
        (ce + aux).backward()  # type: ignore[no-untyped-call]
        qat.pass_grads()
        grad_norm = _optimizer_step(opt, budget.lr(step), cfg.grad_clip)
        imbalance = balancer.update()
        ce, aux = ce.detach(), aux.detach()
        step += 1
        budget.observe(step)
        if bar.total is None and budget.total is not None:
            bar.total = budget.total
        bar.update(1)
        if step % 10 == 0:
            bar.set_postfix(loss=f"{float(ce):.3f}", idx=f"{float(aux):.3f}")
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


def draft_loss(model: CEDModel, drafter: Drafter, batch: DraftBatch) -> tuple[Tensor, dict[str, float]]:
    """KL(backbone || draft) per block position plus the confidence head's cross-entropy; also the
    mean number of leading drafts equal to the backbone's argmax (greedy acceptance on the text)."""
    h = drafter.block_states(batch.block, batch.context, batch.positions, batch.ctx_positions, model.embed)
    logits, confidence = drafter.heads(h, model.lm_head(h).float(), batch.previous)
    target = torch.log_softmax(batch.teacher, dim=-1)
    kl = (target.exp() * (target - torch.log_softmax(logits, dim=-1))).sum(dim=-1).mean()
    match = (logits.argmax(dim=-1) == batch.teacher.argmax(dim=-1)).float()
    conf = F.binary_cross_entropy(confidence.squeeze(-1).clamp(1e-6, 1 - 1e-6), match)
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
        loss.backward()  # type: ignore[no-untyped-call]
        qat.pass_grads()
        grad_norm = _optimizer_step(opt, budget.lr(step), cfg.grad_clip)
        balancer.update()
        step += 1
        budget.observe(step)
        if bar.total is None and budget.total is not None:
            bar.total = budget.total
        bar.update(1)
        if step % 10 == 0:
            bar.set_postfix(kl=f"{stats['kl']:.3f}", acc=f"{stats['accepted']:.2f}")
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
