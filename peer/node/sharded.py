"""FSDP: a node's training sharded over the processes of its torch.distributed group.

DDP (``peer.node.replicas``) keeps the whole model, its gradients and AdamW's two moments on
every device: 16 bytes a parameter before activations. A model that does not fit one device
is sharded instead (PyTorch's ``fully_shard``, one unit a transformer block): each process
holds 1/N of the weights, gradients and AdamW state, and gathers a block's weights only while
it runs that block (the gradients are reduce-scattered at every micro-batch, so no device
ever holds the whole model's). Needs torch 2.6 or later (FSDP2's public API).

Rank 0 alone still talks to the swarm and keeps the fragments' fp32 global copies and outer
momentum on its host, as a one-process node does. What the swarm code reads and writes of the
local weights goes through the fragments (``ShardedFragment``), so it is the same code as on
one process:

    pseudo_gradient, local_flat   GATHER p    every process gathers fragment p's weights;
                                              rank 0 keeps them (fp32, on the host)
    merge_into_local, set_local   SCATTER p   rank 0 scatters fp32 values of fragment p; each
                                              process merges (alpha) or copies its shard
    a checkpoint                  LOCAL       every process gathers weights and AdamW state
    loading a checkpoint          LOAD        rank 0 scatters weights and AdamW state
    held-out loss                 EVAL        every process runs its rows of the batches

Each command is broadcast on the control group before its collectives, as the inner step's
is. The merge is the same element-wise arithmetic on each shard as on the whole tensor, so a
sharded node lands what a one-process node lands.
"""

from __future__ import annotations

import contextlib
import logging

import torch
import torch.distributed as dist

try:  # FSDP2's public API: torch 2.6 and later
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, distribute_tensor
except ImportError:  # an older torch: DDP only
    fully_shard = None

from peer.model import Transformer
from peer.node.replicas import GroupWorker, _send
from peer.outer import OuterFragment
from protocol.config import OuterConfig, TrainConfig
from protocol.errors import ConfigError

log = logging.getLogger("peer.node")

GATHER, SCATTER, LOCAL, LOAD, EVAL = range(10, 15)

SHARDINGS = ("auto", "ddp", "fsdp")

DDP_BYTES_PER_PARAM = 16
"""What DDP keeps on each device for one parameter: fp32 weight and gradient, AdamW's two moments."""
ACTIVATION_HEADROOM = 1.25
"""A quarter more for activations and the allocator: DDP fits when 16 B x parameters x this does."""


def use_fsdp(sharding: str, train: TrainConfig, device: torch.device, memory_fraction: float = 1.0) -> bool:
    """``auto``: FSDP on a CUDA device too small for DDP's copy of the model (the memory cap
    ``memory_fraction`` counted); DDP otherwise (on CPU always: the host holds it either way)."""
    if sharding not in SHARDINGS:
        raise ConfigError(f"--sharding must be one of {', '.join(SHARDINGS)}, got {sharding!r}")
    if sharding == "fsdp" and fully_shard is None:
        raise ConfigError(f"--sharding fsdp needs torch 2.6 or later (this is {torch.__version__}); "
                          "upgrade torch, or use --sharding ddp")
    if sharding != "auto":
        return sharding == "fsdp"
    if device.type != "cuda":
        return False
    budget = torch.cuda.get_device_properties(device).total_memory * memory_fraction
    need = train.model.num_params() * DDP_BYTES_PER_PARAM * ACTIVATION_HEADROOM
    if need <= budget:
        return False
    if fully_shard is None:
        log.warning("DDP would need %.1f GB a GPU, %.1f GB there, and FSDP needs torch 2.6 or later (this is %s): "
                    "training with DDP; upgrade torch if it runs out of memory", need / 1e9, budget / 1e9,
                    torch.__version__)
        return False
    log.info("sharding the model over the node's GPUs (FSDP): DDP would need %.1f GB a GPU, %.1f GB there",
             need / 1e9, budget / 1e9)
    return True


class ShardedFragment(OuterFragment):
    """An outer fragment whose local weights are sharded over the group: reading them gathers,
    writing them scatters (the global copy and momentum are rank 0's, as on one process)."""

    def __init__(self, owner: ShardedWorker, fragment: int, params: list[torch.nn.Parameter], cfg: OuterConfig,
                 global_flat: torch.Tensor):
        self.owner, self.fragment = owner, fragment
        super().__init__(params, cfg, global_flat=global_flat)

    def local_flat(self) -> torch.Tensor:
        return self.owner.gather(self.fragment)

    def set_local(self, flat: torch.Tensor) -> None:
        self.owner.scatter(self.fragment, flat, 0.0)

    def merge_into_local(self, alpha: float, keep=()) -> None:
        if keep:  # gathers the local values, then scatters the merged ones
            self._merge_keeping(alpha, keep)
            return
        self.owner.scatter(self.fragment, self.global_flat, alpha)


class ShardedWorker(GroupWorker):
    """FSDP (see the module docstring): the same class on rank 0 and on the replicas."""

    sharded = True

    def _from_rank0(self) -> bool:
        """Whether this replica takes its initial shards from rank 0 rather than building the
        whole model (which holds them all in its fragments' initial global copies)."""
        return self.rank > 0 and self.cfg.sync.method == "diloco"

    def _build_model(self) -> Transformer:
        if not self._from_rank0():
            return super()._build_model()
        with torch.device("meta"):  # no memory: a replica of a model too big for one device
            return Transformer(self.cfg.model)  # need not fit its host N times over

    def _place(self, model: Transformer, initial: list[torch.Tensor]) -> Transformer:
        mesh = init_device_mesh(self.device.type, (self.world,))
        for block in model.layers:  # one all-gather a block: the weights of one block at a time
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        if self.cfg.sync.method != "diloco":
            return model.to(self.device)  # every process built the whole model
        if self.rank > 0:
            model.to_empty(device=self.device)
            model.init_buffers()
        else:
            model.to(self.device)
        # each process's shards of the initial weights, from rank 0's initial global copies
        params = dict(model.named_parameters())
        assert sorted(n for names in self.fragment_names for n in names) == sorted(params), \
            "a weight in no fragment would keep the garbage to_empty left"
        with torch.no_grad():
            for f, names in enumerate(self.fragment_names):
                offset = 0
                for n in names:
                    p = params[n]
                    whole = initial[f][offset: offset + p.numel()].view(p.shape) if self.rank == 0 else None
                    p.to_local().copy_(self._shard_of(p, whole).to_local())
                    offset += p.numel()
        return model

    def _outer_fragment(self, fragment: int, params: list[torch.nn.Parameter], global_flat: torch.Tensor
                        ) -> OuterFragment:
        return ShardedFragment(self, fragment, params, self.cfg.outer, global_flat)

    def _grad_sync(self, last: bool):
        # reduce-scatter at every micro-batch: skipping it would keep every block's whole
        # gradient on each device until the last one, the memory FSDP is there to save
        return contextlib.nullcontext()

    def _clip_gradients(self, max_norm: float) -> float:
        # over DTensors the norm is the whole model's (a collective); an infinite bound scales by 1
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm if max_norm > 0 else float("inf"))
        return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)

    def sync_replicas(self) -> None:
        """Nothing to do: every change to the weights was scattered when it was made."""

    # -- rank 0: what the node calls ------------------------------------------------------

    def gather(self, fragment: int) -> torch.Tensor:
        _send(GATHER, fragment)
        out = self._gather(fragment)
        assert out is not None
        return out

    def scatter(self, fragment: int, flat: torch.Tensor, alpha: float) -> None:
        _send(SCATTER, fragment, alpha)
        self._scatter(fragment, flat, alpha)

    def local_state(self):
        _send(LOCAL)
        return self._local_state()

    def load_local_state(self, weights, adam) -> None:
        steps = {i: step for i, (step, _, _) in adam.items()}
        _send(LOAD, steps)
        self._load(weights, adam, steps)

    def evaluate_global(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        with self.global_weights():
            whole = torch.stack([torch.stack([x, y]) for x, y in batches])
            _send(EVAL, tuple(whole.shape))
            return self._evaluate(whole)

    # -- every process --------------------------------------------------------------------

    def _full(self, t: torch.Tensor) -> torch.Tensor | None:
        """The whole of a sharded tensor, fp32 on rank 0's host (None elsewhere)."""
        whole = t.full_tensor()
        return whole.detach().float().cpu() if self.rank == 0 else None

    def _shard_of(self, p: torch.Tensor, whole: torch.Tensor | None) -> DTensor:
        """Rank 0's ``whole`` (a tensor of ``p``'s shape) split as ``p`` is: each process gets its shard."""
        src = (whole.to(device=self.device, dtype=p.dtype) if self.rank == 0
               else torch.empty(p.shape, dtype=p.dtype, device=self.device))
        return distribute_tensor(src, p.device_mesh, p.placements, src_data_rank=0)

    @torch.no_grad()
    def _gather(self, fragment: int) -> torch.Tensor | None:
        parts = [self._full(p) for p in self._fragment_params(fragment)]  # one parameter at a time
        return torch.cat([t.reshape(-1) for t in parts]) if self.rank == 0 else None

    @torch.no_grad()
    def _scatter(self, fragment: int, flat: torch.Tensor | None, alpha: float) -> None:
        offset = 0
        for p in self._fragment_params(fragment):
            whole = flat[offset: offset + p.numel()].view(p.shape) if self.rank == 0 else None
            shard, local = self._shard_of(p, whole).to_local(), p.to_local()
            if alpha == 0.0:
                local.copy_(shard)
            else:  # what OuterFragment.merge_into_local does to the whole tensor, on our shard
                local.mul_(alpha).add_(shard, alpha=1.0 - alpha)
            offset += p.numel()

    @torch.no_grad()
    def _local_state(self):
        weights, adam = {}, {}
        for i, (name, p) in enumerate(self.model.named_parameters()):
            weights[name] = self._full(p)
            st = self.opt.state.get(p, {})
            if "exp_avg" in st:  # every process stepped together: the same parameters have state
                adam[i] = (float(st["step"]), self._full(st["exp_avg"]), self._full(st["exp_avg_sq"]))
        return weights, adam

    @torch.no_grad()
    def _load(self, weights, adam, steps: dict[int, float]) -> None:
        fused = bool(self.opt.defaults.get("fused"))
        for i, (name, p) in enumerate(self.model.named_parameters()):
            p.to_local().copy_(self._shard_of(p, weights[name] if self.rank == 0 else None).to_local())
            if i not in steps:
                self.opt.state.pop(p, None)
                continue
            m, v = (adam[i][1], adam[i][2]) if self.rank == 0 else (None, None)
            self.opt.state[p] = {"step": torch.tensor(float(steps[i]), device=p.device if fused else "cpu"),
                                 "exp_avg": self._shard_of(p, m), "exp_avg_sq": self._shard_of(p, v)}

    @torch.no_grad()
    def _evaluate(self, whole: torch.Tensor) -> float:
        """Mean held-out loss over every token of ``whole`` (n, 2, batch, seq): each process
        runs its rows."""
        whole = whole.to(self.device)
        dist.broadcast(whole, 0)
        rows = self._rows(whole.shape[2])
        self.model.eval()
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        try:
            for i in range(whole.shape[0]):
                x, y = whole[i, 0, rows], whole[i, 1, rows]
                _, loss = self.model(x, y)
                total += loss.double() * y.numel()
        finally:
            self.model.train()
            self.model.reshard()  # the root keeps its weights gathered after a forward pass (for the backward)
        dist.all_reduce(total)
        return float(total) / whole[:, 1].numel()

    def follow(self, op: int, args: tuple) -> None:
        if op == GATHER:
            self._gather(args[0])
        elif op == SCATTER:
            self._scatter(args[0], None, args[1])
        elif op == LOCAL:
            self._local_state()
        elif op == LOAD:
            self._load(None, None, args[0])
        elif op == EVAL:
            self._evaluate(torch.empty(args[0], dtype=torch.int64))
        else:
            super().follow(op, args)
