"""A swarm peer: trains with the engine and averages fragments with other peers.

One process, two threads. The main thread runs the plain training loop of ``peer.worker``;
the network thread (``peer.network``) runs hivemind's P2P and DHT, the matchmaker and the
averager. When fragment p's sync starts after step s, its pseudo-gradient is handed to the
network thread and training goes on; after step s + tau the node waits for the average only
if it is late, and measures that wait (``waited_s``). A sync whose group never formed or
whose all-reduce failed lands the node's *own* pseudo-gradient, so a lone or cut-off peer
keeps training on its own outer steps (and is counted in ``syncs_alone``).

Rounds are counted per fragment from the schedule: round r of fragment p starts after step
``offset_p + r*H``. Peers meet in matchmaking by (fragment, round), so peers that train at
similar speed average together; a much slower peer finds no group and averages alone.
"""

from __future__ import annotations

import hashlib
from collections import deque
import json
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from peer.allreduce import Averager
from peer.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from peer.data import ShardSampler, heldout_batches, load_corpus
from peer.identity_store import load_or_create_identity
from peer.matchmaking import Matchmaker
from peer.model import Transformer
from peer.network import Network, NetworkConfig, NetworkError
from peer.presence import Presence
from peer.globalstate import StateSyncError, apply, choose_digest, snapshot
from peer.statesync import StateServer, current_indexes, fetch_state
from peer.worker import Worker, evaluate, pick_device
from protocol.butterfly import slice_bounds
from protocol.identity import peer_id_from_public_key
from protocol.manifest import SignedManifest, open_manifest
from protocol.messages_swarm import Heartbeat, RunAdvertised
from protocol import __version__

log = logging.getLogger(__name__)

# Fault injection for the swarm tests, e.g. "die-after-group:0:1": SIGKILL ourselves right after
# joining the group of fragment 0, round 1, so the others see a member vanish mid all-reduce.
_FAULT = os.environ.get("SWARMSTREAM_FAULT", "")
STATE_INDEX_ATTEMPTS = 4  # asks of the donors' current index before giving up on a state download


@dataclass(kw_only=True, slots=True)
class NodeConfig:
    identity_path: Path
    """The volunteer's key file (libp2p format); its peer ID is the node's."""
    data_dir: Path
    """Where checkpoints go (one folder per run)."""
    host_maddrs: tuple[str, ...] = ("/ip4/0.0.0.0/tcp/0",)
    initial_peers: tuple[str, ...] = ()
    announce_maddrs: tuple[str, ...] = ()
    device: str = "auto"
    max_rounds: int | None = None
    """Stop after this many rounds of every fragment (None: train until stopped)."""
    checkpoint_every_s: float = 120.0
    """Write a checkpoint at the first full round after this many seconds (0: every full round)."""
    eval_batches: int = 8
    min_peers: int = 1
    """Wait (announced, not training) until this many peers of the run are live, so a swarm
    that starts together averages from its first round. Gives up after ``min_peers_wait_s``."""
    min_peers_wait_s: float = 120.0


@dataclass(slots=True)
class NodeStats:
    rounds: list[int] = field(default_factory=list)
    bytes_sent: int = 0
    bytes_received: int = 0
    syncs: int = 0
    syncs_alone: int = 0
    dropped_peers: int = 0
    waited_s: float = 0.0
    inner_s: float = 0.0
    allreduce_s: deque[float] = field(default_factory=lambda: deque(maxlen=1000))
    """Latency of the latest all-reduces (bounded: a node runs for weeks)."""
    losses: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=1000))


def global_digest(worker: Worker) -> str:
    """SHA-256 over the global copy of every fragment: equal on peers that agree bit for bit."""
    h = hashlib.sha256()
    for frag in worker.outer:
        h.update(frag.global_flat.numpy().tobytes())
    return h.hexdigest()


class Node:
    def __init__(self, cfg: NodeConfig, *, manifest_bytes: bytes | None = None, run_id: bytes | None = None,
                 on_event: Callable[[dict], None] | None = None):
        if manifest_bytes is None and run_id is None:
            raise ValueError("a node needs a manifest or a run ID")
        self.cfg = cfg
        self.on_event = on_event or (lambda event: None)
        self.identity = load_or_create_identity(cfg.identity_path)
        self.stop_event = threading.Event()
        self.stats = NodeStats()
        self.state = "joining"
        self.net = Network(NetworkConfig(identity_path=str(cfg.identity_path), host_maddrs=cfg.host_maddrs,
                                         initial_peers=cfg.initial_peers, announce_maddrs=cfg.announce_maddrs))
        try:
            assert self.net.dht is not None and self.net.p2p is not None
            self.presence = Presence(self.net.dht, self.identity)
            if manifest_bytes is not None:
                self.signed: SignedManifest = open_manifest(manifest_bytes, run_id=run_id)
                self.manifest_bytes = manifest_bytes
            else:
                self.signed, self.manifest_bytes = self.net.call(self.presence.fetch_manifest(run_id), timeout=60)
            self.run_id = self.signed.run_id
            self.net.call(self.presence.publish_manifest(self.manifest_bytes, self.run_id), timeout=30)
            swarm = self.signed.manifest.swarm
            self.averager = Averager(self.net.p2p, self.identity, self.run_id)
            self.net.call(self.averager.start(), timeout=30)
            self.matchmaker = Matchmaker(self.net.dht, self.identity, self.run_id, swarm)
            self.state_server = StateServer(self.net.p2p, self.identity, self.run_id,
                                            chunk_bytes=swarm.state_chunk_bytes)
            self.net.call(self.state_server.start(), timeout=30)
            self.state_digest = b""
            self._publishing = None
            self._alone_this_round = False  # averaged alone since our last full round
            self._repair_due = False  # the last full round had a lone sync: compare with the majority
            self._caught_up = False  # joined the swarm's state (or found nobody ahead); until then lag 1
        except BaseException:
            self.net.close()
            raise

    # --- the loop --------------------------------------------------------------------------

    def run(self) -> dict:
        """Train until stopped (``stop()``, Ctrl+C, or ``max_rounds``); returns the summary."""
        train = self.signed.manifest.train
        swarm = self.signed.manifest.swarm
        device = pick_device(self.cfg.device)
        corpus = load_corpus(train.data, train.model.vocab_size)
        worker = Worker(train, device=device)
        sampler = ShardSampler(corpus.train, train.model.seq_len, train.inner.batch_size, train.data.seed,
                               self.identity.public_key)
        ckpt = self.cfg.data_dir / self.signed.run_id_text / "checkpoint"
        rounds = [0] * len(worker.outer)
        if ckpt.exists():
            try:
                rounds = load_checkpoint(ckpt, worker, sampler, run_id=self.run_id)
                log.info("resumed from checkpoint path=%s step=%d rounds=%s", ckpt, worker.step, rounds)
                self.on_event({"event": "resumed", "step": worker.step, "rounds": rounds})
            except CheckpointError as e:
                raise SystemExit(f"swarmstream: error: {e}") from None
        self.stats.rounds = rounds
        self._wait_for_peers(worker, swarm)
        self._check_agreement(worker, swarm, joining=True)  # late join, restart: catch up first
        schedule = worker.schedule
        pending: dict[int, tuple[int, object, torch.Tensor]] = {}
        last_beat = last_ckpt = 0.0
        t_start = time.perf_counter()
        self.state = "training"
        while not self.stop_event.is_set():
            t0 = time.perf_counter()
            loss = worker.forward_backward([sampler.next_batch() for _ in range(train.inner.grad_accum)])
            worker.optimizer_step()
            self.stats.inner_s += time.perf_counter() - t0
            step = worker.step
            if step % 10 == 0:
                self.stats.losses.append((step, loss))
            for p in schedule.starts_after(step):
                r = schedule.round_of(p, step)
                delta, weight = worker.begin_sync(p)
                pending[p] = (r, self.net.submit(self._average(p, r, delta, weight)), delta)
            for p in schedule.lands_after(step):
                self._land(worker, p, pending.pop(p), swarm)
                self._publish_state(worker)
                if p == len(worker.outer) - 1:  # the last fragment landed: a full round
                    self._repair_due, self._alone_this_round = self._alone_this_round, False
                    if time.monotonic() - last_ckpt >= self.cfg.checkpoint_every_s:
                        last_ckpt = time.monotonic()
                        save_checkpoint(ckpt, worker, sampler, run_id=self.run_id, rounds=self.stats.rounds)
            now = time.monotonic()
            if now - last_beat >= swarm.heartbeat_interval_s:
                last_beat = now
                self._beat(worker, swarm)
                if not pending:  # between rounds: nothing of ours is in flight
                    self._check_agreement(worker, swarm)
            if self.cfg.max_rounds is not None and min(self.stats.rounds) >= self.cfg.max_rounds:
                break
        self.state = "finishing"
        for p in sorted(pending):  # contribute what was started; never drop it silently
            self._land(worker, p, pending.pop(p), swarm)
        save_checkpoint(ckpt, worker, sampler, run_id=self.run_id, rounds=self.stats.rounds)
        wall = time.perf_counter() - t_start
        eval_model = Transformer(train.model).to(device)
        eval_model.load_state_dict(worker.global_state())
        held = heldout_batches(corpus.heldout, train.model.seq_len, train.inner.batch_size, self.cfg.eval_batches)
        return {
            "peer": self.identity.peer_id, "steps": worker.step, "tokens": worker.tokens,
            "rounds": min(self.stats.rounds) if self.stats.rounds else 0,
            "heldout_loss": evaluate(eval_model, held, device), "bytes_sent": self.stats.bytes_sent,
            "bytes_received": self.stats.bytes_received, "syncs": self.stats.syncs,
            "syncs_alone": self.stats.syncs_alone, "dropped_peers": self.stats.dropped_peers,
            "waited_s": round(self.stats.waited_s, 3), "inner_s": round(self.stats.inner_s, 3),
            "wall_s": round(wall, 3), "global_digest": global_digest(worker),
            "allreduce_s": [round(x, 3) for x in list(self.stats.allreduce_s)[-50:]],
        }

    async def _average(self, fragment: int, round_: int, delta: torch.Tensor, weight: float):
        """Form a group for (fragment, round) and all-reduce; None means average alone."""
        codec = self.signed.manifest.train.sync.codec
        group = await self.matchmaker.form_group(fragment, round_, float(weight), delta.numel(), codec)
        if group is None:
            return None
        if _FAULT == f"die-after-group:{fragment}:{round_}":  # tests: vanish mid-round, as with kill -9
            os.kill(os.getpid(), signal.SIGKILL)
        outcome = await self.averager.allreduce(group, delta, float(weight))
        # A slice whose reducer failed has no agreed mean. Keep that slice of the *global* copy
        # where it was (a zero averaged delta): every surviving member does the same, so they
        # still hold bit-identical global copies. (Using each member's own delta there would
        # make them diverge, with no majority to repair from.)
        bounds = slice_bounds(delta.numel(), len(group.members))
        for part in outcome.fallback_parts:
            start, end = bounds[part]
            outcome.average[start:end] = 0.0
        return outcome

    def _land(self, worker: Worker, fragment: int, item: tuple, swarm) -> None:
        round_, fut, delta = item
        t0 = time.perf_counter()
        try:
            outcome = fut.result(timeout=swarm.matchmaking_timeout_s + swarm.allreduce_timeout_s + 30)
        except Exception as e:  # a failed round must not stop training: average alone
            log.warning("sync failed fragment=%d round=%d reason=%r; applying own update", fragment, round_, e)
            outcome = None
        self.stats.waited_s += time.perf_counter() - t0
        self.stats.syncs += 1
        if outcome is None:
            self.stats.syncs_alone += 1
            self._alone_this_round = True
            avg = delta
        else:
            avg = outcome.average
            self.stats.bytes_sent += outcome.bytes_sent
            self.stats.bytes_received += outcome.bytes_received
            self.stats.dropped_peers += len(outcome.dropped)
            self.stats.allreduce_s.append(outcome.elapsed_s)
        worker.apply_outer(fragment, avg)
        self.stats.rounds[fragment] = round_ + 1
        last_loss = self.stats.losses[-1][1] if self.stats.losses else float("nan")
        self.on_event({"event": "synced", "fragment": fragment, "round": round_, "step": worker.step,
                       "alone": outcome is None, "dropped": 0 if outcome is None else len(outcome.dropped),
                       "digest": hashlib.sha256(worker.outer[fragment].global_flat.numpy().tobytes()).hexdigest()[:16],
                       "train_loss": round(last_loss, 4)})
        log.info("fragment synced fragment=%d round=%d alone=%s", fragment, round_, outcome is None)

    def _wait_for_peers(self, worker: Worker, swarm) -> None:
        if self.cfg.min_peers <= 1:
            return
        deadline = time.monotonic() + self.cfg.min_peers_wait_s
        self._beat(worker, swarm)
        last_beat = time.monotonic()
        while not self.stop_event.is_set() and time.monotonic() < deadline:
            live = self.net.call(self.presence.peers(self.run_id, swarm.heartbeat_ttl_s), timeout=30)
            if len(live) >= self.cfg.min_peers:
                return
            if time.monotonic() - last_beat >= swarm.heartbeat_interval_s:
                self._beat(worker, swarm)
                last_beat = time.monotonic()
            self.stop_event.wait(0.5)  # poll the DHT; Ctrl+C ends the wait at once
        log.warning("started with fewer peers than min_peers=%d after %.0f s", self.cfg.min_peers,
                    self.cfg.min_peers_wait_s)

    def _check_agreement(self, worker: Worker, swarm, *, joining: bool = False) -> None:
        """Catch up or repair. Download the state that peers vouch for if it is ahead of ours
        (when joining, by any round; while training, by two or more, since peers in lockstep
        differ by one for a moment after each round), then start our schedule where they are.
        Or, if at our rounds more peers vouch for another state than for ours (we averaged
        alone or with a minority), download theirs and keep our step. Nobody diverges silently."""
        peers = self.net.call(self.presence.peers(self.run_id, swarm.heartbeat_ttl_s), timeout=30)
        peers.pop(self.identity.public_key, None)
        mine = min(self.stats.rounds, default=0)
        # behind by one round counts when joining, before our first download, or after we
        # averaged alone (we are the straggler); in lockstep, peers differ by one for a moment
        lag = 1 if joining or not self._caught_up or self._repair_due else 2
        ahead = {k: hb.state_digest for k, hb in peers.items()
                 if hb.state_digest and min(hb.rounds, default=0) >= mine + lag}
        choice = choose_digest(ahead)
        if choice is not None:
            log.info("peers are ahead of round %d; downloading their state", mine)
            self._download(worker, swarm, choice[1], peers, fast_forward=True)
            return
        if joining and not ahead:
            self._caught_up = True  # nobody is ahead of us: we start in step with the swarm
        if not (self.state_digest and self._repair_due):
            return  # peers in other groups differ from us by design; their averages mix next rounds
        same = {k: hb.state_digest for k, hb in peers.items()
                if hb.state_digest and tuple(hb.rounds) == tuple(self.stats.rounds)}
        same[self.identity.public_key] = self.state_digest
        choice = choose_digest(same)
        if choice is None or choice[0] == self.state_digest:
            return
        ours = sum(1 for d in same.values() if d == self.state_digest)
        self._repair_due = False
        if len(choice[1]) > ours:
            log.warning("global state differs from %d peers at rounds %s; downloading theirs",
                        len(choice[1]), self.stats.rounds)
            self._download(worker, swarm, choice[1], peers, fast_forward=False)

    def _current_state(self, swarm, donors: list[str], newer_than: tuple[int, ...] | None = None,
                       wait_s: float = 0.0) -> tuple[bytes, list[str], tuple[int, ...]]:
        """The digest of the state that the most of ``donors`` serve now (two or more of them when
        two or more answer), the donors serving it, and its rounds. With ``newer_than``, poll up to
        ``wait_s`` seconds for a state past those rounds (the swarm's next landing)."""
        deadline = time.monotonic() + wait_s
        attempt = 0
        while True:
            served = self.net.call(current_indexes(self.net.p2p, self.identity, self.run_id, donors,
                                                   timeout_s=swarm.state_chunk_timeout_s),
                                   timeout=swarm.state_chunk_timeout_s + 10)
            by_digest: dict[bytes, list[str]] = {}
            for donor, (digest, _) in served.items():
                by_digest.setdefault(digest, []).append(donor)
            if not by_digest:
                raise StateSyncError(f"none of {len(donors)} donors answered with a state index")
            digest, serving = max(by_digest.items(), key=lambda kv: (len(kv[1]), sum(served[kv[1][0]][1].rounds)))
            rounds = tuple(served[serving[0]][1].rounds)
            agreed = len(serving) >= min(2, len(served))
            if agreed and (newer_than is None or sum(rounds) > sum(newer_than)):
                return digest, serving, rounds
            attempt += 1
            # donors caught mid-landing serve two consecutive states for a moment; or we wait
            # for the round in flight to land
            if attempt >= STATE_INDEX_ATTEMPTS and time.monotonic() >= deadline:
                raise StateSyncError(f"donors disagree on the state ({len(by_digest)} different ones)"
                                     if not agreed else "the swarm did not land a new round in time")
            if self.stop_event.wait(0.25):
                raise StateSyncError("stopped")

    def _download(self, worker: Worker, swarm, vouchers: list[bytes], peers: dict, *, fast_forward: bool) -> None:
        """Download the global state that the most of ``vouchers`` serve now and load it. To catch
        up (``fast_forward``), take the state of the swarm's *next* landing: the swarm is already
        matching peers for the round in flight, and a state from before it would always leave us
        one round late. We idle for at most one round, then start in step with everyone."""
        previous = self.state
        self.state = "syncing"
        t0 = time.perf_counter()
        try:
            donors = [peer_id_from_public_key(v) for v in vouchers]
            digest, serving, rounds = self._current_state(swarm, donors)
            if fast_forward:
                digest, serving, rounds = self._current_state(
                    swarm, serving, newer_than=rounds, wait_s=swarm.matchmaking_timeout_s + swarm.allreduce_timeout_s)
            self.on_event({"event": "syncing_state", "donors": len(serving)})
            state = self.net.call(fetch_state(self.net.p2p, self.identity, self.run_id, serving, digest,
                                              chunk_timeout_s=swarm.state_chunk_timeout_s),
                                  timeout=swarm.state_chunk_timeout_s * 8 + 60)
        except (StateSyncError, NetworkError) as e:
            log.warning("state sync failed reason=%s; training from round %s", e, self.stats.rounds)
            self.state = previous if previous != "joining" else "training"
            return
        apply(worker, state)
        self.stats.rounds = list(state.rounds)
        self.state_digest = digest
        self._caught_up, self._repair_due = True, False
        if fast_forward:
            # the donors just landed this state and train toward the next sync its rounds imply:
            # start right before it, so our next step meets them in that round's matchmaking
            sched = worker.schedule
            next_sync = min(sched.offset(p) + r * sched.inner_steps for p, r in enumerate(state.rounds))
            worker.step = max(state.step, next_sync - 1)
        else:
            worker.step = max(worker.step, state.step)
        self.state = previous if previous != "joining" else "training"
        self.on_event({"event": "state_synced", "rounds": list(state.rounds), "step": worker.step,
                       "seconds": round(time.perf_counter() - t0, 3)})

    def _publish_state(self, worker: Worker) -> None:
        """Serve the global state as of this landing and vouch for it. Peers that averaged in the
        same groups land the same fragments in the same order, so they serve identical states
        (and digests) at each landing; a joiner gets the swarm's newest state, not the last
        full round's."""
        state = snapshot(worker, self.stats.rounds)
        self._publishing = self.net.submit(self.state_server.publish(state))

    def _beat(self, worker: Worker, swarm) -> None:
        if self._publishing is not None and self._publishing.done():
            try:
                self.state_digest = self._publishing.result()
            except Exception as e:
                log.warning("could not serve the global state reason=%r", e)
            self._publishing = None
        now = time.time()
        tput = worker.tokens / max(self.stats.inner_s, 1e-9)
        hb = Heartbeat(run_id=self.run_id, sent_at=now, state=self.state, step=worker.step, tokens=worker.tokens,
                       tokens_per_s=tput, rounds=tuple(self.stats.rounds), state_digest=self.state_digest, reachable=True,
                       maddrs=tuple(self.net.visible_maddrs())[:8], client=f"swarmstream/{__version__}",
                       device=str(worker.device))
        self.net.submit(self.presence.announce(hb, swarm.heartbeat_ttl_s))
        ad = RunAdvertised(run_id=self.run_id, sent_at=now, name=self.signed.manifest.name,
                           num_params=self.signed.manifest.train.model.num_params(), peers=1, step=worker.step)
        self.net.submit(self.presence.advertise(ad, swarm.heartbeat_ttl_s))

    def stop(self) -> None:
        self.stop_event.set()

    def close(self) -> None:
        for part in (self.averager, self.state_server):
            try:
                self.net.call(part.shutdown(), timeout=5)
            except Exception as e:
                log.warning("shutdown was not clean part=%s reason=%r", type(part).__name__, e)
        self.net.close()


def install_signal_handlers(node: Node) -> None:
    """First Ctrl+C (or SIGTERM): finish the current step, contribute, checkpoint, exit.
    A second one exits at once."""
    def handler(signum, frame):
        if node.stop_event.is_set():
            raise KeyboardInterrupt
        print("swarmstream: stopping after this step (Ctrl+C again to quit now)", file=sys.stderr, flush=True)
        node.stop()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)


def main(argv: list[str] | None = None) -> int:
    """``python -m peer.node``: one headless node (used by ``swarmstream join`` and ``demo``)."""
    import argparse

    from peer.logs import init_logging
    from protocol.manifest import parse_run_address

    ap = argparse.ArgumentParser(prog="python -m peer.node")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--manifest", type=Path, help="a signed .swarmrun file (starts or joins its run)")
    src.add_argument("--address", help="a run address swarmstream:RUN_ID@MULTIADDR")
    ap.add_argument("--identity", type=Path, required=True)
    ap.add_argument("--data-dir", type=Path, required=True)
    ap.add_argument("--listen", default="/ip4/0.0.0.0/tcp/0")
    ap.add_argument("--initial-peers", nargs="*", default=[])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--rounds", type=int)
    ap.add_argument("--min-peers", type=int, default=1, help="wait until this many peers are live")
    ap.add_argument("--checkpoint-every", type=float, default=120.0, help="seconds (0: every full round)")
    ap.add_argument("--log-level")
    args = ap.parse_args(argv)
    init_logging(args.log_level)
    initial = list(args.initial_peers)
    manifest_bytes = run_id = None
    if args.manifest:
        manifest_bytes = args.manifest.read_bytes()
    else:
        addr = parse_run_address(args.address)
        run_id, initial = addr.run_id, initial + list(addr.bootstrap)
    cfg = NodeConfig(identity_path=args.identity, data_dir=args.data_dir, host_maddrs=(args.listen,),
                     initial_peers=tuple(initial), device=args.device, max_rounds=args.rounds,
                     checkpoint_every_s=args.checkpoint_every, min_peers=args.min_peers)
    node = Node(cfg, manifest_bytes=manifest_bytes, run_id=run_id,
                on_event=lambda ev: print(json.dumps(ev), flush=True))
    try:
        install_signal_handlers(node)
        print(json.dumps({"event": "listening", "peer": node.identity.peer_id,
                          "maddrs": node.net.visible_maddrs(), "run_id": node.signed.run_id_text}), flush=True)
        summary = node.run()
        print(json.dumps({"event": "summary", **summary}), flush=True)
    finally:
        node.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
