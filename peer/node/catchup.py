"""Agreement and repair: a node compares its global state with what its peers vouch for, and
downloads the swarm's state when it is behind (joining, after a pause) or holds a minority
copy (averaged alone or cut off), and serves its own state to others."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import math
import statistics
import time

from peer.globalstate import (
    PLAUSIBLE_ROUNDS_AHEAD, StateSyncError, apply, check_distance, check_finite, choose_digest, max_state_bytes,
    pack_state, repair_vote, snapshot, vouchers_needed,
)
from peer.network import NetworkError
from peer.node.config import STATE_INDEX_ATTEMPTS
from peer.statesync import current_indexes, fetch_state
from peer.worker import Worker
from protocol.identity import peer_id_from_public_key, public_key_from_peer_id

log = logging.getLogger("peer.node")  # one logger name for the whole node, also under python -m

REPAIR_TRIES = 5  # checks at which a repair looks for donors at our rounds before it takes their next landing
ASKED_AT_JOIN = 8  # peers asked for the state they serve when heartbeats show nobody ahead of us


def download_s(swarm) -> float:
    """The longest a state download may take."""
    return swarm.state_chunk_timeout_s * 8 + 60


DIGEST_HISTORY = 16  # of our latest landings whose digests a repair compares peers' heartbeats with
IN_STEP_ROUNDS = 10  # of our rounds without averaging with a peer after which we judge claims as a joiner
IN_STEP_MIN_S = 120.0
STEADY_ROUNDS = 4  # of our latest rounds whose partners, at rounds near ours, outvote far-ahead claims
PACE_ALLOWANCE = 2.0  # how much faster than our own rounds a peer that averaged with us may have gone on


def plausible_progress(anchor: tuple[float, int] | None, claimed: int, fragments: int, now: float,
                   round_s: float) -> bool:
    """Whether a peer that last averaged with us at ``anchor`` (wall time, our rounds'
    sum then) may be at rounds summing to ``claimed`` now: at most PLAUSIBLE_ROUNDS_AHEAD
    rounds of each fragment beyond where it was, plus PACE_ALLOWANCE x the rounds of ours
    that fit in the time since (``round_s``: our time per round). A peer that never averaged
    with us (no anchor), or before our pace is known, is not believed."""
    if anchor is None or round_s <= 0:
        return False
    at, rounds = anchor
    allowed = fragments * (PLAUSIBLE_ROUNDS_AHEAD + PACE_ALLOWANCE * max(0.0, now - at) / round_s)
    return claimed - rounds <= allowed


class CatchUpMixin:
    """Catch-up, repair and state download of ``peer.node.Node`` (a part of it)."""

    def _check_agreement(self, swarm, *, joining: bool = False) -> None:
        """Catch up or repair. Download the state that peers vouch for if it is ahead of ours
        (when joining, by any round; while training, by two or more, since peers in lockstep
        differ by one for a moment after each round), then start our schedule where they are.
        Or, if at our rounds more peers vouch for another state than for ours (we averaged
        alone or with a minority), download theirs and keep our step. Nobody diverges silently."""
        if joining:  # before training starts or resumes: read the swarm now
            peers = self.net.call(self.presence.peers(self.run_id, swarm.heartbeat_ttl_s), timeout=30)
            self._update_peers(peers)
        else:  # between steps: the view _refresh_peers keeps without blocking (a heartbeat old at most)
            peers = dict(self._peers)
        peers.pop(self.identity.public_key, None)
        # a peer we banned (a proven lie) vouches for nothing; it still counts toward how many
        # vouchers a claim needs (below). One suspended (an audit unanswered, which proves
        # nothing: a peer under load) still does
        live = dict(peers)
        peers = {k: hb for k, hb in peers.items() if not self.matchmaker.distrusted.banned(k)}
        in_step = self._in_step()
        mine = min(self.stats.rounds, default=0)
        # behind by one round counts when joining, before our first download, or after we
        # averaged alone (we are the straggler); in lockstep, peers differ by one for a moment
        lag = 1 if joining or not self._caught_up or (self._repair_due and not self._compare_only) else 2
        ahead = {k: hb.state_digest for k, hb in peers.items()
                 if hb.state_digest and min(hb.rounds, default=0) >= mine + lag}
        claimed = bool(ahead)  # before we doubt any: doubted claims are no sign that nobody is ahead
        if in_step:  # also when we resume from a pause: a pause is no join
            ahead = self._plausibly_ahead(ahead, peers, mine, swarm.heartbeat_ttl_s)
        if joining and not claimed and not in_step:
            # a heartbeat is up to two intervals old, and vouches for the last state its peer had
            # finished publishing: it may be rounds behind its peer (after a pause, the run went
            # on), so ask the peers furthest on what they serve now. Not when we are in step
            # (back from a short pause): their heartbeats show where they are within two
            # intervals, and what a peer serves is not judged by what it showed us before
            latest = sorted((k for k, hb in peers.items() if hb.state_digest),
                            key=lambda k: -min(peers[k].rounds, default=0))[:ASKED_AT_JOIN]
            ahead = self._served_ahead(swarm, latest, mine + lag)
        # any key can claim to be ahead: believe two peers vouching for one state, or the run's
        # creator; one peer alone only in a swarm of two (globalstate.vouchers_needed). The
        # view counts peers whose heartbeat is still fresh: a short DHT read under load must not
        # shrink the swarm to two and let a lone liar be believed
        need = vouchers_needed(max(len(self._peers.keys() | live.keys()), self._run_size() - 1))
        choice = choose_digest(ahead, min_vouchers=need, trusted=self._trusted)
        claims = set(ahead.values()) - self._refused_claims
        if claims and choice is None:
            self._refused_claims |= claims  # said once per claimed state, not at every check
            log.warning("%d peer(s) claim to be ahead of round %d but no two vouch for one state; not downloading "
                        "(peers %s)", len(ahead), mine, ", ".join(peer_id_from_public_key(k) for k in ahead))
        if choice is not None:
            log.info("peers are ahead of round %d; downloading their state", mine)
            self._download(swarm, choice[1], fast_forward=True, min_donors=need)
            return
        if joining and not ahead and not claimed:
            self._caught_up = True  # nobody is ahead of us: we start in step with the swarm
            # in step for far-ahead claims only if the read showed the swarm, or we start the run:
            # a read can come back short under load, and a node resumed from a checkpoint that
            # took an empty one for the swarm would never believe the run it fell behind
            if peers or not any(self.stats.rounds):
                self._in_step_at = time.time()
        # a repair compares the digest of the copy we hold: wait for its publish (a landing
        # hashes one fragment; a lone landing after it would leave that digest behind unread)
        self._harvest_published(wait_s=swarm.state_chunk_timeout_s if self._repair_due else 0.0)
        if not (self._digests and self._repair_due):
            return  # peers in other groups differ from us by design; their averages mix next rounds
        # compare each peer at the rounds its heartbeat shows, if we passed them since we went
        # our own way (our digest then is in _digests): in a fast swarm two peers rarely show the
        # same rounds at one moment
        take, agree, differ = repair_vote(self.identity.public_key, self._digests,
                                          {k: (tuple(hb.rounds), hb.state_digest) for k, hb in peers.items()},
                                          self._trusted)
        if len(agree) + len(differ) == 1:
            return  # nobody's heartbeat shows rounds we passed yet: compare at a later check
        # a tie that a peer on its way to the rounds we passed may break: any one key, a liar's
        # too, ties with a lone peer, and the tie goes to the smaller key (a ghost that averaged
        # alone). Counted apart from the repair's tries, which a wait must not use up
        coming = any(k not in agree and k not in differ
                     and 0 < sum(self.stats.rounds) - sum(hb.rounds) <= 2 * len(hb.rounds) for k, hb in peers.items())
        if take and len(differ) == len(agree) and coming and self._tie_waits < REPAIR_TRIES:
            self._tie_waits += 1
            return
        self._tie_waits = 0
        self._repair_tries += 1
        if not take:
            # final once every live peer was compared (or after REPAIR_TRIES checks): a peer not
            # compared yet may tip it, and a kept minority copy would never be repaired
            if len(agree) + len(differ) > len(peers) or self._repair_tries >= REPAIR_TRIES:
                self._repair_due, self._repair_tries = False, 0
            return
        if self._repair_tries == 1:
            log.warning("global state differs from %d of %d peers compared; downloading theirs",
                        len(differ), len(agree) + len(differ) - 1)
        # take their state as it is at our rounds, and keep what we trained since our last
        # syncs, our step and our groups forming: a repair that waited for their next landing
        # would miss the groups they form meanwhile (pipelined matchmaking), average alone and
        # need the next repair. One voucher (two peers that each averaged alone) is enough here
        # only because the state must then be near ours (globalstate.check_distance): a liar
        # cannot move us far
        if self._download(swarm, sorted(differ), fast_forward=False, min_donors=1,
                          at_rounds=tuple(self.stats.rounds)):
            return
        if self._repair_tries < REPAIR_TRIES:
            return  # they serve other rounds than ours at this moment: at the next check
        # out of step with them for that long: take their next landing, start before their next sync
        self._repair_due, self._repair_tries = False, 0
        self._download(swarm, sorted(differ), fast_forward=True, min_donors=1)

    def _round_s(self) -> float:
        """Our time per round (0 before we know it)."""
        cycles = self.stats.cycle_times
        return self.worker.schedule.inner_steps * statistics.median(cycles) if cycles and self.worker else 0.0

    def _in_step(self) -> bool:
        """Whether we know we are in step with the swarm: we averaged with a peer, took its
        state, or saw peers and nobody ahead at our join (or started the run), within the last
        IN_STEP_ROUNDS of our rounds (at least IN_STEP_MIN_S; wall time, which goes on in a
        pause and in OS suspend). Then a claim to be far ahead must fit what its peer showed us
        before (``_plausibly_ahead``); otherwise it is judged as at a join, by two vouchers: a
        node resumed from a checkpoint has no anchors, and after a long pause the peers may
        all be new, and either would never believe the run it fell behind."""
        if self.identity.public_key in self._trusted and self._in_step_at > -math.inf:
            # the creator, once in step in this process (a restarted one catches up as a joiner
            # does): every peer believes its state alone, so nobody may replace it
            return True
        return time.time() - self._in_step_at <= max(IN_STEP_MIN_S, IN_STEP_ROUNDS * self._round_s())

    def _plausibly_ahead(self, ahead: dict[bytes, bytes], peers: dict, mine: int,
                         ttl_s: float = 0.0) -> dict[bytes, bytes]:
        """Of the peers whose heartbeats say they are ahead of our round ``mine`` (a node
        training in step: ``_in_step``), those whose claim fits what they showed us before. Up to
        PLAUSIBLE_ROUNDS_AHEAD rounds ahead, anyone's (the state must then lie near ours:
        ``check_distance``). Further ahead, where nothing can judge the state, only a peer that
        averaged with us, or served us the state we took (so it was where we were, then:
        ``_anchors``) and has not come further since than twice our pace allows
        (``plausible_progress``; a joiner slower than the swarm in lockstep catches up again
        from its donors): two keys that never averaged
        with us, claiming 50 rounds and serving zeros, used to replace the model of every peer
        that was training in step. And only if more peers claim so (whatever state each vouches
        for: in a swarm larger than a group, groups far on land different copies) than peers that
        averaged with us within the last STEADY_ROUNDS rounds (or a heartbeat's life, ``ttl_s``)
        show rounds near ours: those prove the swarm we average with is here, not far on, and
        keys that averaged with us once and then waited (the allowance grows with time) must
        outnumber them."""
        round_s = self._round_s()
        # wall time: a monotonic clock stops while the OS is suspended, and a laptop that slept an
        # hour would find the swarm far ahead with no time passed, and refuse to catch up
        now, out, doubted = time.time(), {}, []
        for k, digest in ahead.items():
            rounds = tuple(peers[k].rounds)
            if len(rounds) != len(self.worker.outer):  # not this run's fragments: its sums mean nothing
                doubted.append(k)
            elif k in self._trusted or min(rounds, default=0) - mine <= PLAUSIBLE_ROUNDS_AHEAD or \
                    plausible_progress(self._anchors.get(k), sum(rounds), len(rounds), now, round_s):
                out[k] = digest
            else:
                doubted.append(k)
        far = [k for k in out if min(peers[k].rounds, default=0) - mine > PLAUSIBLE_ROUNDS_AHEAD
               and k not in self._trusted]  # the run's creator: its word on the state is enough
        if far:
            window = max(ttl_s, STEADY_ROUNDS * round_s)
            # partners of before our last pause do not count: peers that paused with us would
            # outvote the ones that went on, and we would train apart from them for good
            steady = sum(1 for k, (at, _) in self._anchors.items()
                         if k in peers and now - at <= window and at > self._paused_at
                         and abs(min(peers[k].rounds, default=0) - mine) <= PLAUSIBLE_ROUNDS_AHEAD)
            if len(far) <= steady:  # all of them, not per state: groups far on land different copies
                for k in far:
                    del out[k]
                    doubted.append(k)
        fresh = [k for k in doubted if (k, sum(peers[k].rounds)) not in self._doubted]
        if fresh:
            if len(self._doubted) > 4096:
                self._doubted.clear()  # at worst, a claim is logged again
            self._doubted |= {(k, sum(peers[k].rounds)) for k in fresh}  # said once per claim
            log.warning("not believing %d peer(s) that claim to be more than %d rounds ahead of round %d: none "
                        "averaged with us at a pace that leads there, or more peers that averaged with us lately "
                        "are here (peers %s)", len(fresh),
                        PLAUSIBLE_ROUNDS_AHEAD, mine, ", ".join(peer_id_from_public_key(k) for k in fresh))
        return out

    def _served_ahead(self, swarm, keys: list[bytes], at_least: int) -> dict[bytes, bytes]:
        """Of the peers ``keys``, those that serve a state at round ``at_least`` or later now:
        public key -> the digest of the state (their signed index vouches for it)."""
        if not keys:
            return {}
        by_id = {peer_id_from_public_key(k): k for k in keys}
        try:
            served = self.net.call(current_indexes(self.net.p2p, self.identity, self.run_id, list(by_id),
                                                   timeout_s=swarm.state_chunk_timeout_s),
                                   timeout=swarm.state_chunk_timeout_s + 10)
        except NetworkError as e:
            log.info("could not ask peers for their state reason=%s", e)
            return {}
        return {by_id[donor]: digest for donor, (digest, index) in served.items()
                if donor in by_id and min(index.rounds, default=0) >= at_least}

    def _current_state(self, swarm, donors: list[str], newer_than: tuple[int, ...] | None = None,
                       wait_s: float = 0.0, min_donors: int = 2,
                       want: bytes | None = None) -> tuple[bytes, list[str], tuple[int, ...]]:
        """The digest of the state that the most of ``donors`` serve now (``min_donors`` or more
        of them, or the run's creator), the donors serving it, and its rounds. With
        ``newer_than``, poll up to ``wait_s`` seconds for a state past those rounds (the swarm's
        next landing). With ``want``, only that state counts (a copy a vote chose: a donor that
        serves another one is not asked for it)."""
        deadline = time.monotonic() + wait_s
        attempt = 0
        while True:
            served = self.net.call(current_indexes(self.net.p2p, self.identity, self.run_id, donors,
                                                   timeout_s=swarm.state_chunk_timeout_s),
                                   timeout=swarm.state_chunk_timeout_s + 10)
            by_digest: dict[bytes, list[str]] = {}
            for donor, (digest, _) in served.items():
                if want is None or digest == want:
                    by_digest.setdefault(digest, []).append(donor)
            if not by_digest:
                raise StateSyncError(f"none of {len(donors)} donors answered with a state index"
                                     + ("" if want is None else f" of state {want.hex()[:12]}"))
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

    def _download(self, swarm, vouchers: list[bytes], *, fast_forward: bool,
                  min_donors: int = 2, at_rounds: tuple[int, ...] | None = None, want: bytes | None = None,
                  until: float | None = None) -> bool:
        """Download the global state that the most of ``vouchers`` serve now and load it. To catch
        up (``fast_forward``), take the state of the swarm's *next* landing: the swarm is already
        matching peers for the round in flight, and a state from before it would always leave us
        one round late. We idle for at most one round, then start in step with everyone. With
        ``at_rounds`` (a repair), only a state at those rounds is taken; False (nothing changed)
        if the donors serve other rounds at this moment, or the download failed. ``want``: only
        that state (``_current_state``); ``until``: when (monotonic) the fetch must be done."""
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
            digest, serving, rounds = self._current_state(swarm, donors, min_donors=min_donors, want=want)
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

            fut = self.net.submit(fetch_state(self.net.p2p, self.identity, self.run_id, serving, digest,
                                              chunk_timeout_s=swarm.state_chunk_timeout_s, progress=progress,
                                              max_bytes=max_state_bytes(worker)))
            try:  # beating meanwhile: a download may take longer than a heartbeat lives
                state = self._await_beating(fut, swarm, download_s(swarm) if until is None
                                            else min(download_s(swarm), until - time.monotonic()))
            except TimeoutError:
                fut.cancel()
                raise NetworkError("the state download did not finish in time") from None
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
        apply(worker, state, keep_progress=not fast_forward)
        if hasattr(worker, "sync_replicas"):
            worker.sync_replicas()  # the other processes of a multi-device node take the new weights
        self.stats.rounds = list(state.rounds)
        self._new_lineage()
        self.state_digest, self.state_rounds = digest, tuple(state.rounds)
        self._digests[self.state_rounds] = digest
        self._publish_state(worker)  # serve what we now vouch for (the same bytes: the same digest)
        self._caught_up, self._repair_due, self._repair_tries = True, False, 0
        # the donors were where this state is, as the bytes we checked show (wall time: see _plausibly_ahead)
        now = self._in_step_at = time.time()
        for donor in serving:
            self._anchors[public_key_from_peer_id(donor)] = (now, sum(state.rounds))
        if fast_forward:
            # the donors just landed this state and train toward the next sync its rounds imply:
            # start right before it, so our next step meets them in that round's matchmaking
            worker.step = max(state.step, worker.schedule.step_of(state.rounds))
            self._sync_started_at = [worker.step] * len(worker.outer)
        self.state = previous if previous != "joining" else "training"
        self.on_event({"event": "state_synced", "rounds": list(state.rounds), "step": worker.step,
                       "seconds": round(time.perf_counter() - t0, 3)})
        return True

    def _publish_state(self, worker: Worker) -> None:
        """Serve the global state as of this landing and vouch for it. Peers that averaged in the
        same groups land the same fragments in the same order, so they serve identical states
        (and digests) at each landing; a joiner gets the swarm's newest state, not the last
        full round's."""
        self._harvest_published()
        # the worker's own tensors, shared (its fragments copy on write): no copy of the state;
        # the chunks that changed are hashed off the event loop. Its step is the one its rounds
        # imply, not ours: peers that landed the same rounds a step apart vouch for one digest
        state = snapshot(worker, self.stats.rounds, copy=False)
        packed = pack_state(dataclasses.replace(state, step=worker.schedule.step_of(state.rounds)))
        self._publishing.append((tuple(self.stats.rounds), self._lineage,
                                 self.net.submit(self.state_server.publish_packed(packed))))

    def _new_lineage(self) -> None:
        """Our copy left the one our past digests describe (a lone landing, a download):
        forget them, also those of a publish still under way."""
        self._lineage += 1
        self._digests.clear()
        self._repair_tries = self._tie_waits = 0  # a repair due compares this copy afresh

    def _harvest_published(self, wait_s: float = 0.0) -> None:
        """Take the digests of the states we published, in order, as far as they are served:
        every landing's digest goes into ``_digests`` (a repair compares at any of them).
        ``wait_s``: first wait up to that long for the publishes under way."""
        if wait_s > 0 and self._publishing:
            concurrent.futures.wait([fut for _, _, fut in self._publishing], timeout=wait_s)
        while self._publishing and self._publishing[0][2].done():
            rounds, lineage, fut = self._publishing.pop(0)
            try:
                digest = fut.result()
            except Exception as e:
                log.warning("could not serve the global state reason=%r", e)
                continue
            if lineage != self._lineage:
                continue  # a copy we left (a lone landing or a download came after it)
            self.state_digest, self.state_rounds = digest, rounds
            self._digests[rounds] = digest
            while len(self._digests) > DIGEST_HISTORY:
                del self._digests[next(iter(self._digests))]
