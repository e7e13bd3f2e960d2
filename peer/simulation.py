"""M workers in one process: the real engine, an in-memory all-reduce, real overlap timing.

Used by ``swarmstream simulate`` and ``bench/quality.py`` to compare data-parallel, DiLoCo
and Streaming DiLoCo on the same data at equal tokens. The all-reduce follows
``protocol.butterfly`` exactly as the swarm does (slices travel encoded with the run's
codec, reducers accumulate them in fp32, their own as encoded too, the mean travels back encoded), and a fragment's average
only becomes visible ``tau`` inner steps after its sync started.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass, field
from collections.abc import Callable

import torch

from peer.data import Corpus, ShardSampler, heldout_batches, load_corpus
from peer.model import Transformer
from peer.worker import Worker, evaluate, pick_device
from protocol.butterfly import slice_bounds, slice_norm, witnessed, witnesses_of
from protocol.gate import gram, robust_factors
from protocol.codecs import Codec, get_codec
from protocol.config import ConfigError, TrainConfig

log = logging.getLogger(__name__)


LIAR_AIMS = {"", "constant", "negated"}
LIAR_AIM_NORM = 2.0
"""An aimed liar's push, in units of its true pseudo-gradient's norm: twice, as much as a clip
of 2 lets through whole."""


@dataclass(kw_only=True, slots=True)
class SimulationConfig:
    train: TrainConfig
    workers: int = 4
    """M: workers simulated in this process."""
    steps: int = 500
    """Inner steps each worker runs; total tokens = workers * steps * batch * accum * seq_len."""
    eval_every: int = 0
    """Evaluate the global model every this many steps (0: only at the end)."""
    eval_batches: int = 8
    """Held-out batches per evaluation (each inner.batch_size x model.seq_len tokens)."""
    device: str = "cpu"
    bf16: bool = False
    liar_scale: float = 0.0
    """If not 0, the last worker lies: it sends its pseudo-gradients multiplied by this (a
    validly signed member pushing x1000); its own copy lands the true average like the others."""
    liar_fill: float = 0.0
    """If not 0, the last worker lies: every element of its pseudo-gradients is this value (1e30:
    a constant vector, which clipped to an honest norm still points everywhere alike)."""
    liar_aim: str = ""
    """If not empty, the last worker lies within the clip: it pushes a direction of its choosing
    at ``LIAR_AIM_NORM`` times the norm of its true pseudo-gradient, round after round:
    ``constant`` (every element alike) or ``negated`` (its pseudo-gradient negated)."""
    fallback_every: int = 0
    """If not 0, every this many syncs one part of the fragment (reducer ``j``, a different one
    each time) gets no agreed mean, as in the swarm when its reducer fails or a ghost leads the
    group: every worker takes a zero delta there and keeps its local weights there, as the node
    does (``OuterFragment.carry``: not where the fragment's last sync fell back too)."""
    fallback_resets_local: bool = False
    """With ``fallback_every``: reset the local weights there to the global copy instead, as the
    node did before (the inner steps' progress on that part is lost): ``bench/fallback.py``."""

    def __post_init__(self) -> None:
        if self.workers < 1 or self.steps < 1:
            raise ConfigError("simulation needs workers >= 1 and steps >= 1")
        if not (math.isfinite(self.liar_scale) and math.isfinite(self.liar_fill)):
            raise ConfigError("liar_scale and liar_fill must be finite")
        if self.liar_aim not in LIAR_AIMS:
            raise ConfigError(f"liar_aim must be one of {sorted(LIAR_AIMS)}, got {self.liar_aim!r}")
        if self.eval_every < 0 or self.eval_batches < 1 or self.fallback_every < 0:
            raise ConfigError("eval_every and fallback_every must be >= 0, eval_batches >= 1")


@dataclass(slots=True)
class SimulationResult:
    method: str
    fragments: int
    tau: int
    alpha: float
    codec: str
    workers: int
    steps: int
    inner_steps: int
    tokens: int
    heldout_loss: float
    train_loss: float
    bytes_sent_per_worker: int
    peak_bytes_per_sync: int
    sync_events: int
    wall_s: float
    history: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def aimed(delta: torch.Tensor, aim: str) -> torch.Tensor:
    """An aimed liar's push (``SimulationConfig.liar_aim``) in place of its pseudo-gradient."""
    if aim == "negated":
        return -LIAR_AIM_NORM * delta
    return torch.full_like(delta, LIAR_AIM_NORM * slice_norm(delta) / max(1, delta.numel()) ** 0.5)


def reduce_part(vectors: list[torch.Tensor], shares: list[float], j: int, codec: Codec,
                clip: float = 0.0, gate: bool = False) -> tuple[bytes, list[torch.Tensor], list[bytes]]:
    """Reducer j's part of a butterfly all-reduce, as ``peer.allreduce_round.Round.reduce``
    computes it (``shares``: weight / total weight). -> (its encoded mean, each member's slice
    as the reducer averaged it (decoded: its own too, as its witnesses get it), each member's
    slice encoded (j's: what it sends its witnesses))."""
    s, e = slice_bounds(vectors[0].numel(), len(vectors))[j]
    data = [codec.encode(v[s:e]) for v in vectors]
    slices = [codec.decode(d, e - s) for d in data]
    scales, _ = robust_factors([slice_norm(x) for x in slices], shares, clip, gate, lambda: gram([slices]))
    acc = torch.zeros(e - s, dtype=torch.float32)  # reducer j's fp32 accumulator
    for i in range(len(vectors)):
        codec.decode_add_(acc, data[i], shares[i] * scales[i])
    return codec.encode(acc), slices, data


def allreduce(vectors: list[torch.Tensor], weights: list[float], codec: Codec,
              clip: float = 0.0, gate: bool = False) -> tuple[torch.Tensor, list[int]]:
    """Weighted mean of ``vectors`` by a butterfly all-reduce through ``codec``, each reducer
    scaling contributions down to ``clip`` times the lower median norm (0: the plain mean), and
    under the direction gate (``gate``) leaving out those that point against the others' sum.

    Returns the mean every member ends up with (bit-identical for all) and the bytes each
    member sent. A group of one sends nothing and keeps its own vector exactly.
    """
    n = len(vectors)
    if n == 1:
        return vectors[0].clone(), [0]
    total_w = float(sum(weights))
    w = [wi / total_w for wi in weights]
    numel = vectors[0].numel()
    result = torch.empty(numel, dtype=torch.float32)
    sent = [0] * n
    for j, (s, e) in enumerate(slice_bounds(numel, n)):
        out, _, data = reduce_part(vectors, w, j, codec, clip, gate)
        for i, d in enumerate(data):
            # j's own slice goes to each of its witnesses (a group with them)
            sent[i] += len(d) if i != j else len(d) * len(witnesses_of(j, n, b"")) if witnessed(n, clip) else 0
        sent[j] += len(out) * (n - 1)
        result[s:e] = codec.decode(out, e - s)
    return result, sent


class Simulation:
    """The workers, their samplers and the in-flight averages; ``step()`` runs one inner step
    on every worker plus whatever syncs start or land after it."""

    def __init__(self, cfg: SimulationConfig, corpus: Corpus | None = None):
        self.cfg = cfg
        tc = cfg.train
        self.device = pick_device(cfg.device)
        corpus = corpus or load_corpus(tc.data, tc.model.vocab_size)
        self.workers = [Worker(tc, device=self.device, bf16=cfg.bf16) for _ in range(cfg.workers)]
        self.samplers = [ShardSampler(corpus.train, tc.model.seq_len, tc.inner.batch_size, tc.data.seed, f"sim-{i}")
                         for i in range(cfg.workers)]
        self.held = heldout_batches(corpus.heldout, tc.model.seq_len, tc.inner.batch_size, cfg.eval_batches)
        self.eval_model = Transformer(tc.model).to(self.device)
        self.codec = get_codec("fp32" if tc.sync.method == "ddp" else tc.sync.codec)
        self.schedule = self.workers[0].schedule
        self.step_count = 0
        self.sent_total = [0] * cfg.workers
        self.peak = 0
        self.events = 0
        self.in_flight: dict[int, tuple[torch.Tensor, tuple]] = {}  # fragment -> (average not yet visible,
        # the element ranges that fell back in it: fallback_every)
        self.train_loss = float("nan")

    def _account(self, sent: list[int]) -> None:
        self.events += 1
        self.peak = max(self.peak, max(sent))
        for i, b in enumerate(sent):
            self.sent_total[i] += b

    def step(self) -> float:
        tc, workers = self.cfg.train, self.workers
        losses = [w.forward_backward([s.next_batch() for _ in range(tc.inner.grad_accum)])
                  for w, s in zip(workers, self.samplers)]
        self.train_loss = sum(losses) / len(losses)
        if tc.sync.method == "ddp":
            avg, sent = allreduce([w.grad_vector() for w in workers], [1.0] * len(workers), self.codec)
            self._account(sent)
            for w in workers:
                w.set_grad_vector(avg)
        for w in workers:
            w.optimizer_step()
        self.step_count += 1
        if self.schedule is not None:
            for p in self.schedule.starts_after(self.step_count):
                deltas, weights = map(list, zip(*(w.begin_sync(p) for w in workers)))
                if self.cfg.liar_scale:
                    deltas[-1] = deltas[-1] * self.cfg.liar_scale
                if self.cfg.liar_fill:
                    deltas[-1] = torch.full_like(deltas[-1], self.cfg.liar_fill)
                if self.cfg.liar_aim:
                    deltas[-1] = aimed(deltas[-1], self.cfg.liar_aim)
                avg, sent = allreduce(deltas, weights, self.codec, tc.sync.clip, tc.sync.gate)
                self._account(sent)
                kept: tuple = ()
                every = self.cfg.fallback_every
                if every and self.events % every == 0 and len(workers) > 1:
                    j = (self.events // every) % len(workers)  # this sync's failed reducer
                    kept = (slice_bounds(avg.numel(), len(workers))[j],)
                    for start, end in kept:
                        avg[start:end] = 0.0
                self.in_flight[p] = (avg, kept)  # visible to the workers only after `tau` more steps
            for p in self.schedule.lands_after(self.step_count):
                self.land(p)
        return self.train_loss

    def land(self, fragment: int) -> None:
        avg, kept = self.in_flight.pop(fragment)
        for w in self.workers:
            w.apply_outer(fragment, avg, () if self.cfg.fallback_resets_local else kept)

    def flush(self) -> None:
        """Apply averages still in flight, as if training had waited tau steps for them."""
        for p in sorted(self.in_flight):
            self.land(p)

    def heldout_loss(self) -> float:
        """Held-out loss of the run's global model (worker 0's copy; all copies are equal)."""
        self.eval_model.load_state_dict(self.workers[0].global_state())
        return evaluate(self.eval_model, self.held, self.device)


def run_simulation(cfg: SimulationConfig, corpus: Corpus | None = None,
                   progress: Callable[[dict], None] | None = None) -> SimulationResult:
    t0 = time.perf_counter()
    sim = Simulation(cfg, corpus)
    history: list[dict] = []
    for step in range(1, cfg.steps + 1):
        sim.step()
        if cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.steps:
            rec = {"step": step, "train_loss": sim.train_loss, "heldout_loss": sim.heldout_loss()}
            history.append(rec)
            if progress:
                progress(rec)
    sim.flush()
    final = {"step": cfg.steps, "train_loss": sim.train_loss, "heldout_loss": sim.heldout_loss()}
    history.append(final)
    if progress:
        progress(final)
    sync = cfg.train.sync
    diloco = sync.method == "diloco"
    return SimulationResult(
        method=sync.method, fragments=sync.fragments if diloco else 1, tau=sync.overlap if diloco else 0,
        alpha=sync.alpha, codec=sim.codec.name, workers=cfg.workers, steps=cfg.steps,
        inner_steps=sync.inner_steps if diloco else 1, tokens=sum(w.tokens for w in sim.workers),
        heldout_loss=final["heldout_loss"], train_loss=sim.train_loss,
        bytes_sent_per_worker=sum(sim.sent_total) // cfg.workers, peak_bytes_per_sync=sim.peak,
        sync_events=sim.events, wall_s=time.perf_counter() - t0, history=history)
