"""Agreement and repair: a node compares its global state with what its peers vouch for, and
downloads the swarm's state when it is behind (joining, after a pause) or holds a minority
copy (averaged alone or cut off), and serves its own state to others."""

from __future__ import annotations

import logging
import time

from peer.globalstate import (
    StateSyncError, apply, check_distance, check_finite, choose_digest, snapshot, vouchers_needed,
)
from peer.network import NetworkError
from peer.node.config import STATE_INDEX_ATTEMPTS
from peer.statesync import current_indexes, fetch_state
from peer.worker import Worker
from protocol.identity import peer_id_from_public_key

log = logging.getLogger("peer.node")  # one logger name for the whole node, also under python -m

REPAIR_TRIES = 5  # checks at which a repair looks for donors at our rounds before it takes their next landing
DIGEST_HISTORY = 16  # of our latest landings whose digests a repair compares peers' heartbeats with


class CatchUpMixin:
    """Catch-up, repair and state download of ``peer.node.Node`` (a part of it)."""

    def _check_agreement(self, swarm, *, joining: bool = False) -> None:
        """Catch up or repair. Download the state that peers vouch for if it is ahead of ours
        (when joining, by any round; while training, by two or more, since peers in lockstep
        differ by one for a moment after each round), then start our schedule where they are.
        Or, if at our rounds more peers vouch for another state than for ours (we averaged
        alone or with a minority), download theirs and keep our step. Nobody diverges silently."""
        peers = self.net.call(self.presence.peers(self.run_id, swarm.heartbeat_ttl_s), timeout=30)
        self._update_peers(peers)
        peers.pop(self.identity.public_key, None)
        mine = min(self.stats.rounds, default=0)
        # behind by one round counts when joining, before our first download, or after we
        # averaged alone (we are the straggler); in lockstep, peers differ by one for a moment
        lag = 1 if joining or not self._caught_up or self._repair_due else 2
        ahead = {k: hb.state_digest for k, hb in peers.items()
                 if hb.state_digest and min(hb.rounds, default=0) >= mine + lag}
        # any key can claim to be ahead: believe two peers vouching for one state, or the run's
        # creator; one peer alone only in a swarm of two (globalstate.vouchers_needed). The
        # view counts peers whose heartbeat is still fresh: a short DHT read under load must not
        # shrink the swarm to two and let a lone liar be believed
        need = vouchers_needed(len(self._peers.keys() | peers.keys()))
        choice = choose_digest(ahead, min_vouchers=need, trusted=self._trusted)
        claims = set(ahead.values()) - self._refused_claims
        if claims and choice is None:
            self._refused_claims |= claims  # said once per claimed state, not at every check
            log.warning("%d peer(s) claim to be ahead of round %d but no two vouch for one state; not downloading "
                        "(peers %s)", len(ahead), mine, ", ".join(peer_id_from_public_key(k) for k in ahead))
        if choice is not None:
            log.info("peers are ahead of round %d; downloading their state", mine)
            self._download(swarm, choice[1], peers, fast_forward=True, min_donors=need)
            return
        if joining and not ahead:
            self._caught_up = True  # nobody is ahead of us: we start in step with the swarm
        self._harvest_published()
        if not (self._digests and self._repair_due):
            return  # peers in other groups differ from us by design; their averages mix next rounds
        # compare at rounds that peers' heartbeats show and that we passed since we went our own
        # way (our digest then is in _digests): in a fast swarm two peers rarely show the same
        # rounds at the same moment. The rounds most peers show win, then the latest
        at: dict[tuple[int, ...], dict[bytes, bytes]] = {}
        for k, hb in peers.items():
            if hb.state_digest and tuple(hb.rounds) in self._digests:
                at.setdefault(tuple(hb.rounds), {})[k] = hb.state_digest
        if not at:
            return  # nobody's heartbeat shows rounds we passed yet: compare at a later check
        rounds = max(at, key=lambda r: (len(at[r]), sum(r)))
        mine = self._digests[rounds]
        same = {**at[rounds], self.identity.public_key: mine}
        # the most vouched-for state wins; a tie goes to the state of the smallest key, the same
        # choice on every peer whichever rounds each compares at, so two peers that each
        # averaged alone converge on one of their states
        choice = choose_digest(same, min_vouchers=1, tie_by_key=True)
        self._repair_due = False
        if choice is None or choice[0] == mine:
            return  # ours is the state to keep
        ours = sum(1 for d in same.values() if d == mine)
        if len(choice[1]) < ours:
            return
        if self._repair_tries == 0:
            log.warning("global state differs from %d peers at rounds %s; downloading theirs",
                        len(choice[1]), list(rounds))
        # take their state as it is at our rounds and keep our step and our groups forming: a
        # repair that waited for their next landing would miss the groups they form meanwhile
        # (pipelined matchmaking), average alone and need the next repair. One voucher (two
        # peers that each averaged alone) is enough here only because the state must then be
        # near ours (globalstate.check_distance): a liar cannot move us far
        if self._download(swarm, choice[1], peers, fast_forward=False, min_donors=1,
                          at_rounds=tuple(self.stats.rounds)):
            self._repair_tries = 0
            return
        self._repair_tries += 1
        if self._repair_tries < REPAIR_TRIES:
            self._repair_due = True  # they serve other rounds than ours at this moment: at the next check
            return
        # out of step with them for that long: take their next landing, start before their next sync
        self._repair_tries = 0
        self._download(swarm, choice[1], peers, fast_forward=True, min_donors=1)

    def _current_state(self, swarm, donors: list[str], newer_than: tuple[int, ...] | None = None,
                       wait_s: float = 0.0, min_donors: int = 2) -> tuple[bytes, list[str], tuple[int, ...]]:
        """The digest of the state that the most of ``donors`` serve now (``min_donors`` or more
        of them, or the run's creator), the donors serving it, and its rounds. With
        ``newer_than``, poll up to ``wait_s`` seconds for a state past those rounds (the swarm's
        next landing)."""
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
            agreed = len(serving) >= min_donors or any(peer_id_from_public_key(k) in serving for k in self._trusted)
            if agreed and (newer_than is None or sum(rounds) > sum(newer_than)):
                return digest, serving, rounds
            attempt += 1
            # donors caught mid-landing serve two consecutive states for a moment; or we wait
            # for the round in flight to land
            if attempt >= STATE_INDEX_ATTEMPTS and time.monotonic() >= deadline:
                raise StateSyncError(f"no {min_donors} donors serve one state ({len(served)} answered, "
                                     f"{len(by_digest)} different states)" if not agreed
                                     else "the swarm did not land a new round in time")
            if self.stop_event.wait(0.25):
                raise StateSyncError("stopped")

    def _download(self, swarm, vouchers: list[bytes], peers: dict, *, fast_forward: bool,
                  min_donors: int = 2, at_rounds: tuple[int, ...] | None = None) -> bool:
        """Download the global state that the most of ``vouchers`` serve now and load it. To catch
        up (``fast_forward``), take the state of the swarm's *next* landing: the swarm is already
        matching peers for the round in flight, and a state from before it would always leave us
        one round late. We idle for at most one round, then start in step with everyone. With
        ``at_rounds`` (a repair), only a state at those rounds is taken; False (nothing changed)
        if the donors serve other rounds at this moment, or the download failed."""
        if fast_forward and self._pipeline is not None and self._pipeline.forming():
            # we wait below for the swarm's next landing, and a group formed ahead with us in
            # it cannot land without our part: contribute it now (as a pause does), then wait
            self._start_forming_now(self._pipeline)
            for sync in self._pipeline.drain():
                self._land(sync, swarm)
        worker = self.worker
        previous = self.state
        self.state = "syncing"
        t0 = time.perf_counter()
        try:
            donors = [peer_id_from_public_key(v) for v in vouchers]
            digest, serving, rounds = self._current_state(swarm, donors, min_donors=min_donors)
            if at_rounds is not None and rounds != at_rounds:
                log.info("donors serve rounds %s, not ours (%s): not downloading now", list(rounds), list(at_rounds))
                self.state = previous
                return False
            if fast_forward:
                digest, serving, rounds = self._current_state(
                    swarm, serving, newer_than=rounds, wait_s=swarm.matchmaking_timeout_s + swarm.allreduce_timeout_s,
                    min_donors=min_donors)
            self.on_event({"event": "syncing_state", "donors": len(serving)})
            label = f"downloading the global state from {len(serving)} peers"
            self._progress = (0.0, label)

            def progress(done: int, total: int) -> None:  # on the network thread; the dashboard polls it
                self._progress = (done / total if total else 1.0, label)

            state = self.net.call(fetch_state(self.net.p2p, self.identity, self.run_id, serving, digest,
                                              chunk_timeout_s=swarm.state_chunk_timeout_s, progress=progress),
                                  timeout=swarm.state_chunk_timeout_s * 8 + 60)
            check_finite(state)  # here, before anything changes; apply() checks it again
            check_distance(worker, state, self.stats.rounds)
        except (StateSyncError, NetworkError) as e:
            log.warning("state sync failed reason=%s; training from round %s", e, self.stats.rounds)
            self.state = previous if previous != "joining" else "training"
            return False
        finally:
            self._progress = None
        if fast_forward:
            # what we trained since our latest contribution is replaced by the swarm's state:
            # say so, and count it in the ledger (nothing is dropped silently)
            dropped = worker.step - min(self._sync_started_at, default=worker.step)
            if dropped > 0:
                log.warning("dropped %d local inner steps trained since our last contribution: the run moved on "
                            "to rounds %s while we were away", dropped, list(state.rounds))
                self.ledger.record_dropped(dropped)
        if self._pipeline is not None:  # refuses with syncs in flight: a landing would apply to the replaced copy
            for f in self._pipeline.rebase(keep_forming=not fast_forward):
                f.handle[0].cancel()  # a round we are past now; its group drops us at its deadline
                log.info("left the forming group of fragment %d round %d: the download moved us past it",
                         f.fragment, f.round)
        apply(worker, state)
        self.stats.rounds = list(state.rounds)
        self._new_lineage()
        self.state_digest, self.state_rounds = digest, tuple(state.rounds)
        self._digests[self.state_rounds] = digest
        self._caught_up, self._repair_due = True, False
        if fast_forward:
            # the donors just landed this state and train toward the next sync its rounds imply:
            # start right before it, so our next step meets them in that round's matchmaking
            sched = worker.schedule
            next_sync = min(sched.offset(p) + r * sched.inner_steps for p, r in enumerate(state.rounds))
            worker.step = max(state.step, next_sync - 1)
            self._sync_started_at = [worker.step] * len(worker.outer)
        else:
            worker.step = max(worker.step, state.step)
        self.state = previous if previous != "joining" else "training"
        self.on_event({"event": "state_synced", "rounds": list(state.rounds), "step": worker.step,
                       "seconds": round(time.perf_counter() - t0, 3)})
        return True

    def _publish_state(self, worker: Worker) -> None:
        """Serve the global state as of this landing and vouch for it. Peers that averaged in the
        same groups land the same fragments in the same order, so they serve identical states
        (and digests) at each landing; a joiner gets the swarm's newest state, not the last
        full round's."""
        state = snapshot(worker, self.stats.rounds)
        self._publishing = (tuple(self.stats.rounds), self._lineage, self.net.submit(self.state_server.publish(state)))

    def _new_lineage(self) -> None:
        """Our copy left the one our past digests describe (a lone landing, a download):
        forget them, also those of a publish still under way."""
        self._lineage += 1
        self._digests.clear()

    def _harvest_published(self) -> None:
        """Take the digest of the state we published last, once it is served."""
        if self._publishing is None or not self._publishing[2].done():
            return
        rounds, lineage, fut = self._publishing
        self._publishing = None
        try:
            digest = fut.result()
        except Exception as e:
            log.warning("could not serve the global state reason=%r", e)
            return
        self.state_digest, self.state_rounds = digest, rounds
        if lineage == self._lineage:
            self._digests[rounds] = digest
            while len(self._digests) > DIGEST_HISTORY:
                del self._digests[next(iter(self._digests))]
