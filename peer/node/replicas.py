"""A node's training on several devices of one machine: a torch.distributed group.

``python -m peer.node --gpus N`` starts itself again under ``torch.distributed.run`` (torchrun)
as N processes, one per device (on CPU, N processes with the gloo backend; on CUDA, nccl and
``cuda:LOCAL_RANK``). Rank 0 is the node: it alone talks to the swarm, samples the data,
computes the pseudo-gradients, the codec and the outer step, checkpoints and serves the state.
Ranks 1..N-1 are replicas: each holds the same model and inner AdamW, trains on its rows of
every micro-batch (DistributedDataParallel averages the gradients), and follows rank 0's
commands, broadcast before each collective:

    BUILD    build the model (the run's manifest with it): at start and on resume
    STATE    take rank 0's weights and AdamW state (after a checkpoint load or a download)
    STEP     one inner step: the batch (every rank takes its rows), forward, backward, AdamW
    PARAMS p take rank 0's weights of fragment p (a landing merged the global copy into them)
    RELEASE  drop the model (a pause gives the devices back)
    STOP     exit

So the node's inner step covers N times the rows at the cost of one, and everything the swarm
sees (weights, tokens, pseudo-gradients) is what a single process training the same batch would
produce, up to the order of floating-point sums.

That is DDP (``ReplicatedWorker``): every process holds the whole model. A model that does not
fit one device is sharded instead (``--sharding fsdp``, or ``auto``): ``peer.node.sharded``,
the same commands and a few more (``GroupWorker`` is what the two share).
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
import signal
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from peer.worker import Worker, device_options
from protocol.config import TrainConfig
from protocol.errors import ConfigError

BUILD, STATE, STEP, PARAMS, RELEASE, STOP = range(6)


def under_torchrun() -> bool:
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def torchrun_command(processes: int, argv: list[str]) -> list[str]:
    """This node's command line again, as ``processes`` processes under torchrun."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}",
            "-m", "peer.node", *argv]


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def local_device(device: torch.device) -> torch.device:
    """This process's device: ``cuda:LOCAL_RANK`` on CUDA, the CPU otherwise."""
    if device.type == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if local >= torch.cuda.device_count():
            raise ConfigError(f"--gpus asks for more processes than the {torch.cuda.device_count()} CUDA GPU(s) "
                              "torch sees; use fewer")
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return device


_CONTROL: Any = None
"""The group the commands travel on: gloo, so a replica waiting for one (a pause may last
hours) waits on a socket, not in a GPU kernel, and does not time out."""
_WAIT_FOR_COMMANDS = datetime.timedelta(days=365)


def init_group(device: torch.device) -> None:
    global _CONTROL
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        _CONTROL = dist.new_group(backend="gloo", timeout=_WAIT_FOR_COMMANDS)


def _send(op: int, *args: Any) -> None:
    dist.broadcast_object_list([(op, args)], src=0, group=_CONTROL)


def _receive() -> tuple[int, tuple]:
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0, group=_CONTROL)
    return box[0]


def _leave_group() -> None:
    """Destroy the process groups now, with nothing holding them (the DDP worker dropped
    first, our handle on the control group here): a gloo group left for the interpreter's
    exit to destroy can abort the process there ("terminate called without an active
    exception", seen once under load, after a clean run)."""
    global _CONTROL
    with contextlib.suppress(Exception):
        dist.destroy_process_group()
    _CONTROL = None
    gc.collect()


def _die_with_parent() -> None:
    """Linux: end when torchrun ends (killed, say), rather than wait for commands forever."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class GroupWorker(Worker):
    """What the DDP and FSDP workers share: an inner step on every process of the group (the
    same class on rank 0, which commands, and on the replicas, which follow). Only rank 0 keeps
    the fragments' global copies."""

    def __init__(self, cfg: TrainConfig, *, device: torch.device, bf16: bool = False, checkpointing: bool = False):
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if cfg.inner.batch_size % self.world:
            raise ConfigError(f"the run's batch of {cfg.inner.batch_size} sequences does not split over "
                              f"{self.world} processes; use a --gpus that divides it")
        super().__init__(cfg, device=device, bf16=bf16, checkpointing=checkpointing, keep_outer=self.rank == 0)

    def _module(self) -> torch.nn.Module:
        """What the forward pass calls (DDP's wrapper, or the sharded model itself)."""
        return self.model

    def _grad_sync(self, last: bool):
        """A context for one micro-batch's backward: the gradients are averaged over the group
        at the last one only."""
        raise NotImplementedError

    def forward_backward(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        whole = torch.stack([torch.stack([x, y]) for x, y in batches])  # (micro, 2, batch, seq)
        if whole.shape[2] % self.world:
            raise ConfigError(f"micro-batches of {whole.shape[2]} sequences do not split over {self.world} "
                              "processes; set compute.max_batch_size to a multiple of --gpus (or 0)")
        # our step too: the replicas' learning rate follows it (a catch-up moves it on)
        _send(STEP, tuple(whole.shape), self.step)
        return self._step(whole)

    def _rows(self, batch: int) -> slice:
        return slice(self.rank * batch // self.world, (self.rank + 1) * batch // self.world)

    def _step(self, whole: torch.Tensor) -> float:
        """Forward and backward on our rows of every micro-batch; the gradients are averaged at
        the last backward. Counts the whole batch's tokens (the node's contribution)."""
        whole = whole.to(self.device)
        dist.broadcast(whole, 0)
        micro, _, batch, _ = whole.shape
        rows = self._rows(batch)
        module = self._module()
        self.model.train()
        total = torch.zeros((), device=self.device)
        for i in range(micro):
            x, y = whole[i, 0, rows], whole[i, 1, rows]
            with self._grad_sync(i == micro - 1):
                with self._autocast():
                    _, loss = module(x, y)
                (loss / micro).backward()
            total += loss.detach().float()
        dist.all_reduce(total)
        tokens = int(whole[:, 1].numel())
        self.tokens += tokens
        self.tokens_since_sync = [t + tokens for t in self.tokens_since_sync]
        return float(total) / micro / self.world

    def _fragment_params(self, fragment: int) -> list[torch.Tensor]:
        return [self.params[n] for n in self.fragment_names[fragment]]

    def follow(self, op: int, args: tuple) -> None:
        if op == STEP:
            self._step(torch.empty(args[0], dtype=torch.int64))
            self.step = args[1]
            self.optimizer_step()
        else:
            raise RuntimeError(f"replica: unexpected command {op}")


class ReplicatedWorker(GroupWorker):
    """DDP: every process holds the whole model and its AdamW state (see the module docstring)."""

    def __init__(self, cfg: TrainConfig, *, device: torch.device, bf16: bool = False, checkpointing: bool = False):
        super().__init__(cfg, device=device, bf16=bf16, checkpointing=checkpointing)
        # the module's weights as they are here are broadcast from rank 0 by DDP itself
        self.ddp = DistributedDataParallel(self.model, device_ids=[device.index] if device.type == "cuda" else None)

    def _module(self) -> torch.nn.Module:
        return self.ddp

    def _grad_sync(self, last: bool):
        return contextlib.nullcontext() if last else self.ddp.no_sync()

    # -- rank 0: what the node calls ------------------------------------------------------

    def apply_outer(self, fragment: int, avg_delta: torch.Tensor, keep=()) -> None:
        super().apply_outer(fragment, avg_delta, keep)
        _send(PARAMS, fragment)
        self._broadcast_params(fragment)

    def sync_replicas(self) -> None:
        """The replicas take our weights and AdamW state (after a load or a download)."""
        states = [self.opt.state.get(p) for p in self.model.parameters()]
        steps = [None if st is None else (float(st["step"]), st["step"].device.type) for st in states]
        _send(STATE, steps)
        self._broadcast_state()

    # -- both -----------------------------------------------------------------------------

    @torch.no_grad()
    def _broadcast_params(self, fragment: int) -> None:
        for p in self._fragment_params(fragment):
            dist.broadcast(p.data, 0)

    @torch.no_grad()
    def _broadcast_state(self, steps: list | None = None) -> None:
        for p in self.model.parameters():
            dist.broadcast(p.data, 0)
        for p, step in zip(self.model.parameters(), steps or [None] * len(list(self.model.parameters()))):
            if self.rank == 0:
                st = self.opt.state.get(p)
                if st is not None:
                    dist.broadcast(st["exp_avg"], 0)
                    dist.broadcast(st["exp_avg_sq"], 0)
            elif step is None:
                self.opt.state.pop(p, None)
            else:
                value, where = step
                st = {"step": torch.tensor(value, dtype=torch.float32, device=p.device if where != "cpu" else "cpu"),
                      "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
                dist.broadcast(st["exp_avg"], 0)
                dist.broadcast(st["exp_avg_sq"], 0)
                self.opt.state[p] = st

    # -- the replicas ---------------------------------------------------------------------

    def follow(self, op: int, args: tuple) -> None:
        if op == PARAMS:
            self._broadcast_params(args[0])
        elif op == STATE:
            self._broadcast_state(args[0])
        else:
            super().follow(op, args)


class Replicas:
    """Rank 0's handle on the replicas: what the node tells them besides inner steps.
    ``sharding``: ``ddp``, ``fsdp``, or ``auto`` (FSDP where DDP's copy of the model, its
    gradients and AdamW state would not fit one device; ``peer.node.sharded``)."""

    def __init__(self, world: int, sharding: str = "auto"):
        self.world, self.sharding = world, sharding

    def build(self, signed_manifest: bytes, train: TrainConfig, device: torch.device,
              memory_fraction: float = 1.0) -> GroupWorker:
        """Rank 0's worker; the replicas build theirs with it."""
        from peer.node.sharded import use_fsdp

        device = local_device(device)
        sharded = use_fsdp(self.sharding, train, device, memory_fraction)
        _send(BUILD, signed_manifest, sharded)
        return worker_class(sharded)(train, device=device, **device_options(train, device))

    def release(self) -> None:
        _send(RELEASE)

    def stop(self) -> None:
        """Tell the replicas to go, then leave the group (the node dropped its worker first)."""
        with contextlib.suppress(Exception):  # the group may be broken already (a replica died)
            _send(STOP)
        _leave_group()


def worker_class(sharded: bool) -> type[GroupWorker]:
    if sharded:
        from peer.node.sharded import ShardedWorker

        return ShardedWorker
    return ReplicatedWorker


def start(device: torch.device, sharding: str = "auto") -> Replicas | None:
    """On rank 0 under torchrun: join the group and return the handle on the replicas."""
    if not under_torchrun():
        return None
    init_group(local_device(device))
    return Replicas(dist.get_world_size(), sharding)


def follow(device_name: str) -> int:
    """A replica's whole life (ranks 1..N-1): follow rank 0's commands until STOP."""
    from peer.worker import pick_device
    from protocol.manifest import open_manifest

    # Ctrl+C and SIGTERM reach the whole process group: rank 0 finishes its step, checkpoints,
    # and tells us to stop; if it dies instead, torchrun ends us
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _die_with_parent()
    device = local_device(pick_device(device_name))
    init_group(device)
    worker: GroupWorker | None = None
    while True:
        op, args = _receive()
        if op == BUILD:
            train = open_manifest(args[0]).manifest.train
            worker = worker_class(args[1])(train, device=device, **device_options(train, device))
        elif op == RELEASE:
            worker = None
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        elif op == STOP:
            worker = None
            gc.collect()
            _leave_group()
            return 0
        else:
            assert worker is not None, "a command before BUILD"
            worker.follow(op, args)
