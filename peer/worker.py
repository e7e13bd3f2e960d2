"""One worker of a run: the model, its inner AdamW, and the global copies of its fragments.

The worker knows nothing about the network. A driver (``peer.simulation`` in one process,
the swarm peer across machines) runs the same plain loop:

    loss = worker.forward_backward(batches)        # grads of one inner step
    [ddp only: average worker.grad_vector() across workers, worker.set_grad_vector(avg)]
    worker.optimizer_step()                        # clip, AdamW, lr schedule; step += 1
    for p in schedule.starts_after(step):  delta_p = worker.outer[p].pseudo_gradient()  -> all-reduce
    for p in schedule.lands_after(step):   worker.apply_outer(p, averaged delta_p)

so data-parallel, DiLoCo and Streaming DiLoCo are one code path with different settings.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Sequence

import torch

from protocol.errors import ConfigError  # a ValueError too: callers that catch that still do

from peer.model import Transformer
from peer.outer import OuterFragment
from protocol.config import InnerConfig, TrainConfig
from protocol.fragments import SyncSchedule, assign_fragments

log = logging.getLogger(__name__)


def pick_device(name: str = "auto") -> torch.device:
    """``auto`` picks CUDA, then Apple MPS, then CPU; otherwise the named device."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"unknown device {name!r}; use auto, cpu, cuda, cuda:N or mps") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device 'cuda' asked for but torch sees no CUDA GPU; use --device cpu or install a CUDA build of torch")
    if dev.type == "cuda":
        if dev.index is None:  # an index: torch.cuda's per-device calls (the memory cap) want one
            dev = torch.device("cuda", torch.cuda.current_device())
        elif dev.index >= torch.cuda.device_count():
            raise ConfigError(f"device {name!r} asked for but torch sees {torch.cuda.device_count()} CUDA GPU(s); "
                              "use cuda:0 or auto")
    if dev.type == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise ConfigError("device 'mps' asked for but it is not available on this machine; use --device cpu")
    return dev


def lr_at(step: int, cfg: InnerConfig) -> float:
    """Linear warmup to ``lr`` over ``warmup_steps``, then cosine to ``lr * min_lr_ratio`` at
    ``total_steps`` (``step`` counts completed steps, so the first step uses lr_at(0))."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.total_steps - cfg.warmup_steps))
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + 0.5 * (cfg.lr - floor) * (1.0 + math.cos(math.pi * progress))


CHECKPOINT_FROM_PARAMS = 500_000_000
"""Activation checkpointing from this many parameters on an accelerator, where memory, not
compute, bounds the model (the 1b preset on a 24 GB GPU)."""


def device_options(cfg: TrainConfig, device: torch.device) -> dict[str, bool]:
    """How a node trains ``cfg`` on ``device``: bf16 autocast where the GPU supports it (the
    inner steps are ~2x faster; the outer state stays fp32 either way), and activation
    checkpointing on CUDA from CHECKPOINT_FROM_PARAMS parameters."""
    cuda = device.type == "cuda"
    return {"bf16": cuda and torch.cuda.is_bf16_supported(),
            "checkpointing": cuda and cfg.model.num_params() >= CHECKPOINT_FROM_PARAMS}


class Worker:
    def __init__(self, cfg: TrainConfig, *, device: torch.device | str = "cpu", bf16: bool = False,
                 checkpointing: bool = False, keep_outer: bool = True):
        """``keep_outer=False``: no global copies (a replica of a multi-device node, whose rank 0
        keeps them for the whole node)."""
        self.cfg = cfg
        self.device = torch.device(device)
        if bf16 and self.device.type == "cpu":
            log.info("bf16 autocast asked for on CPU; it is slower than fp32 there but supported")
        self.bf16 = bf16
        model = self._build_model()
        model.checkpointing = checkpointing
        sync = cfg.sync
        built = dict(model.named_parameters())
        if sync.method == "diloco":
            self.fragment_names = assign_fragments(built, cfg.model.n_layers, sync.fragments)
            self.schedule = SyncSchedule(sync.inner_steps, sync.fragments, sync.overlap)
        else:  # ddp: no outer optimizer, gradients are averaged every step
            self.fragment_names, self.schedule = [], None
        with torch.no_grad():  # (N,) fp32 CPU copies of the initial weights: the fragments' global copies
            initial = [torch.cat([built[n].detach().reshape(-1).float() for n in group])
                       for group in self.fragment_names] if keep_outer else []
        self.model = self._place(model, initial)
        self.params = dict(self.model.named_parameters())
        assert list(self.params) == list(built), "placing the model renamed its parameters"
        inner = cfg.inner
        decay = [p for n, p in self.model.named_parameters() if p.dim() >= 2]
        no_decay = [p for n, p in self.model.named_parameters() if p.dim() < 2]
        self.opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": inner.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=lr_at(0, inner), betas=(inner.beta1, inner.beta2),
            # one fused kernel per step on CUDA; the multi-tensor path elsewhere off the CPU
            **({"fused": True} if self.device.type == "cuda" else {"foreach": self.device.type != "cpu" or None}))
        self.step = 0  # completed inner steps
        self.tokens = 0  # tokens trained, all time
        self.outer = [self._outer_fragment(f, [self.params[n] for n in group], flat)
                      for f, (group, flat) in enumerate(zip(self.fragment_names, initial))]
        # tokens trained since each fragment's last sync started: its contribution's weight
        self.tokens_since_sync = [0] * len(self.outer)

    def _build_model(self) -> Transformer:
        """The run's initial model on the CPU: every worker of a run starts from the same
        weights, the init being seeded by the run seed."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.cfg.data.seed)
            return Transformer(self.cfg.model)

    def _place(self, model: Transformer, initial: list[torch.Tensor]) -> Transformer:
        """The model on this worker's device (a sharded worker shards it first). ``initial``:
        the fragments' initial global copies (those of the model's weights), if kept."""
        return model.to(self.device)

    def _outer_fragment(self, fragment: int, params: list[torch.nn.Parameter], global_flat: torch.Tensor
                        ) -> OuterFragment:
        return OuterFragment(params, self.cfg.outer, global_flat=global_flat)

    def _autocast(self):
        if not self.bf16:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)

    def forward_backward(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Accumulate the gradient of one inner step over micro-batches; returns the mean loss."""
        self.model.train()
        total = 0.0
        for x, y in batches:
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            with self._autocast():
                _, loss = self.model(x, y)
            (loss / len(batches)).backward()
            total += loss.item()
            self.tokens += y.numel()
            for p in range(len(self.tokens_since_sync)):
                self.tokens_since_sync[p] += y.numel()
        return total / len(batches)

    def grad_vector(self) -> torch.Tensor:
        """All gradients as one (N,) fp32 CPU vector (for data-parallel averaging)."""
        return torch.cat([p.grad.reshape(-1).float().cpu() for p in self.model.parameters()])

    @torch.no_grad()
    def set_grad_vector(self, vec: torch.Tensor) -> None:
        offset = 0
        for p in self.model.parameters():
            p.grad.copy_(vec[offset: offset + p.numel()].view_as(p))
            offset += p.numel()

    def optimizer_step(self) -> float:
        """Clip, AdamW step at the scheduled lr, clear grads; returns the gradient norm."""
        inner = self.cfg.inner
        norm = self._clip_gradients(inner.grad_clip)
        lr = lr_at(self.step, inner)
        for g in self.opt.param_groups:
            g["lr"] = lr
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.step += 1
        return norm

    def _clip_gradients(self, max_norm: float) -> float:
        """Scale the gradients to at most ``max_norm`` (0: no clipping); returns their norm."""
        if max_norm > 0:
            return torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm).item()
        return math.sqrt(sum(float(p.grad.float().pow(2).sum()) for p in self.model.parameters()))

    def begin_sync(self, fragment: int) -> tuple[torch.Tensor, int]:
        """This worker's pseudo-gradient for ``fragment`` and its weight (tokens it covers)."""
        # more than H steps' worth only after a skipped sync: peers refuse weights above the cap
        weight = min(self.tokens_since_sync[fragment], self.cfg.max_sync_tokens())
        self.tokens_since_sync[fragment] = 0
        return self.outer[fragment].pseudo_gradient(), weight

    def apply_outer(self, fragment: int, avg_delta: torch.Tensor, keep: Sequence[tuple[int, int]] = ()) -> None:
        """Outer step on the fragment's global copy, then merge it into the local weights, except
        in the element ranges ``keep`` where the averaging fell back, as ``OuterFragment.carry``
        allows (not two syncs in a row)."""
        frag = self.outer[fragment]
        frag.step(avg_delta)
        frag.merge_into_local(self.cfg.sync.alpha, frag.carry(keep))

    @contextlib.contextmanager
    def global_weights(self):
        """The model holds the run's global weights inside the block, its own (bit for bit)
        after it: evaluation needs no second model on the device (4.4 GB at the 1b preset).
        The local weights wait on the host meanwhile. Call from the thread that trains."""
        if not self.outer:  # ddp: the local weights are the global model
            yield self.model
            return
        stash = [frag.local_flat() for frag in self.outer]
        try:
            for frag in self.outer:
                frag.merge_into_local(0.0)
            yield self.model
        finally:
            for frag, flat in zip(self.outer, stash):
                frag.set_local(flat)

    def evaluate_global(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Mean held-out loss of the run's global model (see ``evaluate``)."""
        with self.global_weights() as model:
            return evaluate(model, batches, self.device)

    def global_state(self) -> dict[str, torch.Tensor]:
        """The run's global model (fp32 CPU), assembled from the fragments' global copies.
        In ddp there is no separate global copy: the local weights are the global model."""
        if not self.outer:
            return {n: p.detach().float().cpu().clone() for n, p in self.params.items()}
        out = {}
        for names, frag in zip(self.fragment_names, self.outer):
            offset = 0
            for n in names:
                p = self.params[n]
                out[n] = frag.global_flat[offset: offset + p.numel()].view(p.shape).clone()
                offset += p.numel()
        return out

    # -- the local state as plain CPU tensors: what a checkpoint holds ---------------------

    def local_state(self) -> tuple[dict[str, torch.Tensor], dict[int, tuple[float, torch.Tensor, torch.Tensor]]]:
        """The local weights by name, and AdamW's state by parameter index (its step count,
        exp_avg, exp_avg_sq; absent before the first step), on the CPU."""
        weights = {n: p.detach().cpu() for n, p in self.model.named_parameters()}
        adam = {}
        for i, p in enumerate(self.model.parameters()):
            st = self.opt.state.get(p, {})
            if "exp_avg" in st:
                adam[i] = (float(st["step"]), st["exp_avg"].detach().cpu(), st["exp_avg_sq"].detach().cpu())
        return weights, adam

    @torch.no_grad()
    def load_local_state(self, weights: dict[str, torch.Tensor],
                         adam: dict[int, tuple[float, torch.Tensor, torch.Tensor]]) -> None:
        """local weights and AdamW state <- what ``local_state`` returned (checked by the caller)."""
        for name, p in self.model.named_parameters():
            p.copy_(weights[name])
        fused = bool(self.opt.defaults.get("fused"))  # a fused AdamW keeps its step counts on the device
        for i, p in enumerate(self.model.parameters()):
            if i in adam:
                step, exp_avg, exp_avg_sq = adam[i]
                self.opt.state[p] = {"step": torch.tensor(float(step), device=p.device if fused else "cpu"),
                                     "exp_avg": exp_avg.to(p.device),
                                     "exp_avg_sq": exp_avg_sq.to(p.device)}
            else:
                self.opt.state.pop(p, None)


@torch.no_grad()
def evaluate(model: Transformer, batches: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device) -> float:
    """Mean loss of ``model`` over ``batches`` (each batch weighted equally by its tokens)."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for x, y in batches:
        _, loss = model(x.to(device), y.to(device))
        total += loss.item() * y.numel()
        count += y.numel()
    model.train(was_training)
    return total / count
