"""A node's model on its device: built from the latest checkpoint (or the run's initial
model), released on pause, checkpointed, evaluated on the held-out batches, and fed its
micro-batches."""

from __future__ import annotations

import gc
import logging
import time

import torch

from peer.checkpoint import CheckpointError, NonFiniteState, checkpoint_exists, load_checkpoint, save_checkpoint
from peer.data import ShardSampler, heldout_batches, load_corpus
from peer.worker import Worker, device_options, pick_device
from protocol.messages_control import (
    LossMeasured,
)

log = logging.getLogger("peer.node")  # one logger name for the whole node, also under python -m


class WorkerStateMixin:
    """The model lifecycle of ``peer.node.Node`` (a part of it)."""

    def _build_worker(self) -> None:
        """The model, optimizers and sample stream on the chosen device, from the checkpoint if
        there is one (at start, and on resume after a pause released the accelerator)."""
        train = self.signed.manifest.train
        compute = self.settings.compute
        device = pick_device(self.cfg.device or compute.device)
        if device.type == "cuda" and compute.gpu_memory_fraction < 1.0:
            torch.cuda.set_per_process_memory_fraction(compute.gpu_memory_fraction, device)
        if self._corpus is None:
            self._corpus = load_corpus(train.data, train.model.vocab_size, self.identity.public_key)
        replicas = self.cfg.replicas
        if replicas is not None:  # the other processes build theirs with us (DDP or FSDP)
            worker = replicas.build(self.manifest_bytes, train, device, compute.gpu_memory_fraction)
            sharding = "fsdp" if getattr(worker, "sharded", False) else "ddp"
            log.info("built the model on %d processes sharding=%s", replicas.world, sharding)
            self.on_event({"event": "built", "processes": replicas.world, "sharding": sharding})
        else:
            worker = Worker(train, device=device, **device_options(train, device))
        sampler = ShardSampler(self._corpus.train, train.model.seq_len, train.inner.batch_size, train.data.seed,
                               self.identity.public_key)
        rounds = [0] * len(worker.outer)
        if checkpoint_exists(self._ckpt):
            try:
                rounds = load_checkpoint(self._ckpt, worker, sampler, run_id=self.run_id)
                log.info("resumed from checkpoint path=%s step=%d rounds=%s", self._ckpt, worker.step, rounds)
                self.on_event({"event": "resumed", "step": worker.step, "rounds": rounds})
            except CheckpointError:
                raise  # main() says it in one line; nothing was changed
        if replicas is not None:
            worker.sync_replicas()  # the checkpoint's weights and AdamW state, on every process
        self.worker, self.sampler = worker, sampler
        self.stats.rounds = rounds
        self._sync_started_at = [worker.step] * len(worker.outer)

    def _release_worker(self) -> None:
        """Write a checkpoint and drop the model: the accelerator's memory goes back to the OS."""
        assert self.worker is not None
        self._save()
        self._paused_step = self.worker.step
        device = self.worker.device
        self.worker = self.sampler = None
        if self.cfg.replicas is not None:
            self.cfg.replicas.release()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()

    def _save(self) -> None:
        self._progress = (0.0, "writing a checkpoint")
        try:
            save_checkpoint(self._ckpt, self.worker, self.sampler, run_id=self.run_id, rounds=self.stats.rounds)
        except NonFiniteState as e:
            # never over a good checkpoint: keep it, and take the swarm's state at the next
            # chance (a repair compares our digest with what the other peers vouch for)
            log.error("not saving a checkpoint: %s; the last good one is kept", e)
            self._repair_due, self._compare_only = True, False
        finally:
            self._progress = None

    def _micro_batches(self) -> list:
        """The run's batches for one inner step, split under the volunteer's max_batch_size
        into equal micro-batches (same mean loss and gradient, less memory)."""
        train = self.signed.manifest.train
        batches = [self.sampler.next_batch() for _ in range(train.inner.grad_accum)]
        cap = self.settings.compute.max_batch_size
        b = train.inner.batch_size
        if not cap or cap >= b:
            return batches
        size = max(d for d in range(1, cap + 1) if b % d == 0)
        return [(x[i:i + size], y[i:i + size]) for x, y in batches for i in range(0, b, size)]

    def _apply_settings(self) -> None:
        self._settings_changed = False
        threads = self.settings.compute.cpu_threads
        if threads:
            torch.set_num_threads(threads)

    def _evaluate(self, worker: Worker) -> float:
        """Held-out loss of the global model (in the worker's own model: no second copy)."""
        train = self.signed.manifest.train
        held = heldout_batches(self._corpus.heldout, train.model.seq_len, train.inner.batch_size,
                               self.cfg.eval_batches)
        return worker.evaluate_global(held)

    def _full_round(self, worker: Worker, last_ckpt: float) -> None:
        # a repair still due is kept until a peer at our rounds was compared with (at the first
        # check after a round, the others' heartbeats may not show that round yet)
        if self._alone_this_round:
            self._compare_only = False
        self._repair_due, self._alone_this_round = self._repair_due or self._alone_this_round, False
        self.ledger.record_round()
        every = self.cfg.eval_every_rounds
        if every and min(self.stats.rounds) % every == 0:
            loss = self._evaluate(worker)
            self.stats.heldout.append((worker.step, loss))
            ev = LossMeasured(at=time.time(), step=worker.step, split="heldout", loss=max(0.0, min(loss, 1e9)))
            self._loss_history.append(ev)
            self._emit(ev)
