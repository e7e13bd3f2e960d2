"""One fragment sync of a node, from its group to its landing: form a group and all-reduce
(on the network thread), then apply the average, or the node's own update when it averaged
alone, and count what happened."""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import logging
import os
import signal
import statistics
import time
from typing import Any

import torch

from peer.node.config import (
    _fault_alone,
    _fault_due,
)
from peer.allreduce import ROUND_SPAN
from peer.pace import straggle_steps
from peer.sync_pipeline import Forming, InFlight
from protocol.butterfly import slice_bounds
from protocol.identity import peer_id_from_public_key
from protocol.messages_control import (
    FragmentSynced,
    FragmentSyncFailed,
)

log = logging.getLogger("peer.node")  # one logger name for the whole node, also under python -m

MAX_ANCHORS = 1024  # peers whose last round with us we remember (peer.node.catchup: claims to be far ahead)
PACE_STEPS = 20  # timed inner steps before a node compares its pace with the swarm's (peer.pace)


class SyncMixin:
    """Averaging and landing of ``peer.node.Node`` (a part of it)."""

    def _lead_steps(self) -> int:
        """How many inner steps before a sync's start its group should start forming: as early
        as the schedule allows (``SyncPipeline.joins`` caps it: right after the fragment's
        previous round landed). Peers in step land a round together, at the end of one
        all-reduce, so they join the next one together, whatever pace each measures. A lead of
        "the time a group takes to form, in steps at our own pace" put equal peers' joins
        seconds apart whenever their step times differed (warm-up, a shared core) and split
        them into batches of their own; at the swarm's pace it still did, less often. A slow
        peer is then in its groups from the start and they wait for its part, until it finds
        itself the straggler and follows (``peer.pace``). Resumed mid-run with no step timed
        yet: 0, join at the start (joining far ahead of the others would put us in a batch of
        our own)."""
        if not self.stats.cycle_times and self.worker.step > 0:
            return 0
        return self.worker.schedule.inner_steps

    def _own_pace(self, timed: int = PACE_STEPS) -> float | None:
        """Inner steps per second we train at (compute and the volunteer's rest; waits on the
        network left out), once ``timed`` steps are timed (``PACE_STEPS`` to compare with the
        swarm: the first steps warm up, slower, and with 5 timed a peer as fast as the others
        took itself for slow at step 6, moved its counter a whole round on, and trained alone
        out of step; 1 to plan a follower's join, which may come before that)."""
        cycles = self.stats.cycle_times
        return 1.0 / max(statistics.median(cycles), 1e-3) if len(cycles) >= max(1, timed) else None

    def _following(self) -> bool:
        """Slower than the swarm: we join our rounds when the others do and start them when
        their group has formed (``peer.pace``)."""
        return self.signed.manifest.train.sync.follow and self._clock.is_slow(self._own_pace())

    def _keep_pace(self, worker, pipeline, following: bool, slack: int = 0) -> list[int]:
        """After an inner step: the steps of the schedule it passed. That step and, up to the
        start step of a sync whose group has formed and whose other members have started it
        (half of them have sent us frames): they have handed over their pseudo-gradients, so
        we hand over ours, with the steps we managed. A follower (``peer.pace``) does so from
        any distance (also when matchmaking left it alone, or failed: nothing is to be waited
        for, and landing now readies it for the fragment's next round). Groups form right after
        the previous round lands, most of a round before they start: a follower that moved on
        when its group had formed trained nothing.

        Any other node (with ``sync.follow`` and tau >= 1) does so only behind its group's
        median start: the group formed with other members, more than half of them started it
        (``PushSlice.stopping`` frames and banned members' not counted), its start step is at
        most ``slack`` steps on (tau plus the late allowance: what a member ahead trains past
        its landing step before it waits for us), and no sync of ours is in flight (skipping
        could take us past its landing deadline and block on it). Equal peers drift apart by
        seconds per round on shared cores, and the members ahead of the last one waited for it
        every round: now the one behind skips its last few steps instead, and nobody idles.
        Its groups carry the weights they were joined with, so a skip makes them claim up to
        ``slack`` steps per skip more than were trained. A lone node has no group to start with
        and skips nothing. A liar in a group of two can make us skip up to ``slack`` steps at
        each start by pushing early; it could already make us a follower, which skips from any
        distance, by pushing a fifth of a round early (``peer.pace``)."""
        passed = [worker.step]
        if not following and (slack <= 0 or not self.signed.manifest.train.sync.follow):
            return passed
        target = worker.step
        for f in pipeline.forming():
            if f.starts_after <= worker.step or not f.handle[0].done():
                continue
            if following:
                started = self._others_started(f.handle[0])
            else:
                started = (f.starts_after - worker.step <= slack and not pipeline.in_flight()
                           and self._others_started(f.handle[0], majority=True))
            if started:
                target = max(target, f.starts_after)
                if not following:
                    log.info("behind our group's start: starting fragment %d round %d with the others step=%d "
                             "to=%d", f.fragment, f.round, worker.step, f.starts_after)
        if target > worker.step and following and not self.stats.steps_skipped:
            log.info("slower than the swarm: starting our syncs when the others do step=%d to=%d",
                     worker.step, target)
        while worker.step < target:
            worker.step += 1
            self.stats.steps_skipped += 1
            passed.append(worker.step)
        return passed

    def _check_straggling(self, worker, pipeline) -> None:
        """Before an inner step, while our pace is not known yet (fewer than ``PACE_STEPS``
        steps timed: a run's first sync, or the first after a restart): if half the other
        members of a group formed with us have started its round while we are still more than
        ``straggle_steps`` short of its start step, we are the straggler, now: we follow
        (``peer.pace``), so ``_keep_pace`` moves us on to the start and hands over what we
        trained. Waiting to be told by ``kept_waiting`` after the sync held every fast member of
        the group for as long as we took to get there (about 2 s at the first sync of a peer
        half as fast, H = 40). Later the pace test and ``kept_waiting`` decide, from many steps
        rather than one moment. Pushes that a member pausing or finishing sent before its step
        (``PushSlice.stopping``) do not count as started here or in ``kept_waiting``.
        """
        if self._own_pace() is not None or not self.signed.manifest.train.sync.follow:
            return
        behind = straggle_steps(worker.schedule.inner_steps, self.signed.manifest.train.sync.late_share)
        for f in pipeline.forming():
            fut = f.handle[0]
            if f.starts_after - worker.step <= behind or not fut.done() or fut.cancelled() or fut.exception():
                continue
            group = fut.result()
            if group is None:
                continue
            others = [peer_id_from_public_key(k) for k in group.members if k != self.identity.public_key]
            if self.averager.pending.started(bytes(group.group_id), others) and self._clock.straggling():
                log.info("the others started fragment %d round %d while we were %d steps short of it: slower "
                         "than the swarm, following its rounds", f.fragment, f.round, f.starts_after - worker.step)

    def _others_started(self, group_future, majority: bool = False) -> bool:
        """Whether half the other members of a formed group have sent us frames for it (they
        started its all-reduce); True for no group, or a failed formation: nothing to wait for.
        ``majority``: more than half, and False for no group, a failed formation, or a group
        with no other member."""
        try:
            group = group_future.result()
        except Exception:
            return not majority
        if group is None:
            return not majority
        others = [peer_id_from_public_key(k) for k in group.members if k != self.identity.public_key]
        return self.averager.pending.started(bytes(group.group_id), others, majority=majority)

    def _submit_forming(self, fragment: int, round_: int, weight: float, follow: tuple[float, float] | None = None
                        ) -> tuple[Any, float]:
        """Join (fragment, round)'s matchmaking now, ahead of its start: -> (the group's future,
        weight). With ``follow = (seconds, tokens per second)``, join when another peer has
        joined it, or after that long, with the weight grown by what we train meanwhile."""
        numel = self.worker.outer[fragment].global_flat.numel()
        return self.net.submit(self._form_group(fragment, round_, float(weight), numel, follow)), float(weight)

    def _submit_sync(self, fragment: int, round_: int, delta: torch.Tensor, weight: int,
                     forming: Forming | None, stopping: bool = False) -> tuple[Any, torch.Tensor, int]:
        """Hand the pseudo-gradient to the network thread: into the group formed ahead if there
        is one (the weight it joined with is the one the group carries), else form it now.
        ``stopping``: a pause or finish starts it before its landing step."""
        if forming is None:
            fut = self.net.submit(self._average(fragment, round_, delta, float(weight)))
        else:
            group_fut, planned = forming.handle
            fut = self.net.submit(self._average(fragment, round_, delta, planned, group=group_fut,
                                                stopping=stopping))
        return fut, delta, weight

    def _start_forming_now(self, pipeline) -> None:
        """Pause or finish with groups forming: they count on our part, so the syncs start now
        with what we trained so far (their rounds are not started again later). Our pushes say
        so (``PushSlice.stopping``): the others must not take themselves for late."""
        for f in pipeline.take_forming():
            delta, weight = self.worker.begin_sync(f.fragment)
            self._sync_started_at[f.fragment] = self.worker.step
            pipeline.start(f.fragment, f.round, self.worker.step,
                           self._submit_sync(f.fragment, f.round, delta, weight, f, stopping=True))
            log.info("started fragment %d round %d early (pause or finish): its group was forming",
                     f.fragment, f.round)

    async def _form_group(self, fragment: int, round_: int, weight: float, numel: int,
                          follow: tuple[float, float] | None = None):
        codec = self.signed.manifest.train.sync.codec
        if _fault_alone(fragment, round_):  # tests: cut off from this round's group
            log.info("fault injected: averaging fragment=%d round=%d alone", fragment, round_)
            return None
        if follow is not None:  # slower than the swarm: join when the others do (peer.pace)
            t0 = time.monotonic()
            seen = await self.matchmaker.wait_for_others(fragment, round_, numel, follow[0])
            if seen == "late":  # averaging alone now, we are ready when they join the next round
                log.info("the others' group of fragment=%d round=%d closed before we came: averaging alone, "
                         "to meet them at the next round", fragment, round_)
                return None
            weight = min(weight + follow[1] * (time.monotonic() - t0), self.matchmaker.max_weight)
        # a follower timed its join to the others' already; anyone else that averaged alone
        # last round and was ahead then waits for those it missed
        delay = 0.0 if follow is not None else await self.matchmaker.align_delay(fragment, round_, numel)
        if delay > 0:  # we are ahead of peers we missed last round: meet them this time
            log.info("waiting to meet peers that reach this round later fragment=%d round=%d delay_s=%.2f",
                     fragment, round_, delay)
            await asyncio.sleep(delay)
        return await self.matchmaker.form_group(fragment, round_, weight, numel, codec)

    async def _average(self, fragment: int, round_: int, delta: torch.Tensor, weight: float, *,
                       group: Any = None, stopping: bool = False):
        """All-reduce in our group for (fragment, round): the one formed ahead (a future), or
        one formed now; None means average alone. ``stopping``: see ``Averager.allreduce``."""
        if group is None:
            group = await self._form_group(fragment, round_, float(weight), delta.numel())
        else:  # formed ahead: we carry the weight we joined with
            group = await asyncio.wrap_future(group)
            if group is not None:
                weight = group.weights[group.members.index(self.identity.public_key)]
        if group is None:
            return None
        if _fault_due(fragment, round_):  # tests: vanish mid-round, as with kill -9
            os.kill(os.getpid(), signal.SIGKILL)
        outcome = await self.averager.allreduce(group, delta, float(weight), stopping=stopping)
        # A slice whose reducer failed has no agreed mean. The *global* copy takes a zero averaged
        # delta there (only the outer momentum moves it): every surviving member does the same, so
        # they still hold bit-identical global copies. (Using each member's own delta there would
        # make them diverge, with no majority to repair from.) The local weights keep their values
        # there (``kept``; not where the last sync fell back too, ``OuterFragment.carry``): the inner
        # steps' progress goes into the next sync, not lost.
        bounds = slice_bounds(delta.numel(), len(group.members), group.idle)
        kept = tuple(bounds[part] for part in outcome.fallback_parts)
        for start, end in kept:
            outcome.average[start:end] = 0.0
        return outcome, len(group.members), bytes(group.group_id), tuple(group.members), kept

    def _judge(self, offences, refused=()) -> None:
        """Proven lies (banned, evidence saved; here, on the training thread, which writes it to
        disk) and reducers whose part was too large for its contributions (refused without proof,
        but no honest reducer sends one): from our next round on, we group with none of them.
        (A reducer that did not answer an audit was suspended by ``peer.audit`` already.)"""
        for key, why, evidence in offences:
            if self.bans is not None and self.bans.add(key, why, evidence):
                self.on_event({"event": "banned", "peer": peer_id_from_public_key(key), "reason": why})
            self.matchmaker.distrusted.ban(key)
        for key in refused:
            if key != self.identity.public_key and self.matchmaker.distrusted.ban(key):
                log.warning("not grouping with peer=%s any more: its reduced part was too large for its "
                            "contributions", peer_id_from_public_key(key))

    def _take_verdicts(self) -> None:
        """The audits' verdicts on earlier rounds, and proofs other peers handed us
        (``peer.audit``): bans saved with their evidence, suspensions told. At every landing,
        every heartbeat and the run's end (a proof can come between rounds)."""
        if (audits := getattr(self.averager, "audits", None)) is not None:
            self._judge(_drain(audits.offences))
            for key, syncs in _drain(audits.suspended):  # already out of our groups (peer.distrust)
                self.on_event({"event": "suspended", "peer": peer_id_from_public_key(key), "syncs": syncs})
        for fragment, round_, _ in _drain(getattr(self.averager, "apart", ())):
            # a round we took for agreed, belied by a member's final after it (Averager._found_apart):
            # compare our state with the peers' at the next check, as after a round not agreed. Our
            # copy is still the one our digests describe (no new lineage: compare at this round's
            # too), and we landed with our group: not a straggler (catch-up's lag stays)
            log.warning("fragment=%d round=%d was not agreed after all: comparing our state with the peers'",
                        fragment, round_)
            if not self._repair_due:
                self._repair_due, self._compare_only = True, True

    def _await_beating(self, fut, swarm, timeout_s: float):
        """``fut.result(timeout_s)``, beating every heartbeat interval meanwhile. A landing can
        wait up to 3.5 all-reduce deadlines (a part late under load, then an audit before landing:
        ``peer.allreduce.ROUND_SPAN``), longer than a heartbeat
        lives: our heartbeat expired, and a partner that finished the run meanwhile saw nobody
        on the way to its final rounds, left, and the two ended on different copies (CI)."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            done, _ = concurrent.futures.wait([fut], timeout=max(0.0, min(left, swarm.heartbeat_interval_s)))
            if done or left <= swarm.heartbeat_interval_s:
                return fut.result(timeout=0)  # its result, its error, or TimeoutError at the deadline
            self._beat(swarm)

    def _land(self, sync: InFlight, swarm) -> None:
        worker = self.worker
        fragment, round_ = sync.fragment, sync.round
        fut, delta, weight = sync.handle
        t0 = time.perf_counter()
        reason = ""
        try:
            result = self._await_beating(fut, swarm, swarm.matchmaking_timeout_s + self.matchmaker.leaderless_s()
                                         + ROUND_SPAN * swarm.allreduce_timeout_s + 30)
            if result is None:
                reason = "no group formed: averaged alone"
        except Exception as e:  # a failed round must not stop training: average alone
            fut.cancel()  # timed out: it must not go on and average later, with what we no longer hold
            log.warning("sync failed fragment=%d round=%d reason=%r; applying own update", fragment, round_, e)
            result, reason = None, f"all-reduce failed: {e!r}"
            self.stats.syncs_failed += 1
        waited = time.perf_counter() - t0
        self.stats.waited_s += waited
        late = worker.step - sync.lands_after
        if late >= 0:  # not one a pause or a finish landed early
            self.stats.late_steps.append(late)
        self.stats.waits.append((fragment, round_, waited))
        self.stats.syncs += 1
        self.matchmaker.distrusted.tick()  # suspensions count our syncs (peer.distrust)
        outcome = None if result is None else result[0]
        if outcome is None:
            self.stats.syncs_alone += 1
            self._alone_this_round = True
            self._new_lineage()
            avg = delta
            self._remember(FragmentSyncFailed(at=time.time(), fragment=fragment, round=round_, reason=reason[:256]))
        else:
            avg = outcome.average
            self._judge(outcome.offences, outcome.refused)
            if not outcome.agreed:  # a member that took part never reported, or a reducer sent two
                self._alone_this_round = True  # means: the members may land different averages: compare after
                self._new_lineage()
            self.stats.bytes_sent += outcome.bytes_sent
            self.stats.bytes_received += outcome.bytes_received
            self.stats.dropped_peers += len(outcome.dropped)
            self.stats.allreduce_s.append(outcome.elapsed_s)
            round_s = self._round_s()
            sync = self.signed.manifest.train.sync
            if sync.follow and self._clock.kept_waiting(outcome.kept_waiting_s, round_s, late_share=sync.late_share):
                log.info("our group waited %.1f s for our part: slower than the swarm, following its rounds",
                         outcome.kept_waiting_s)
            size = result[1]
            now, wall = time.monotonic(), time.time()  # the members that averaged with us: the run's end waits for them (peer.node.settle)
            self._partners = {k: t for k, t in self._partners.items() if now - t <= swarm.heartbeat_ttl_s}
            for i, key in enumerate(result[3]):
                if key == self.identity.public_key:
                    continue
                self._partners[key] = now  # dropped too: one late to us may be in its last round still
                if i not in outcome.dropped:
                    self._anchors[key] = (wall, sum(self.stats.rounds))  # where it was (wall time: catchup)
                    self._in_step_at = wall  # we averaged this round with a peer: in step
            if len(self._anchors) > MAX_ANCHORS:  # the ones we met longest ago go first
                for key, _ in sorted(self._anchors.items(), key=lambda kv: kv[1][0])[:len(self._anchors) - MAX_ANCHORS]:
                    del self._anchors[key]
            self._remember(FragmentSynced(
                at=time.time(), fragment=fragment, round=round_, group_size=size,
                contributors=max(1, size - len(outcome.dropped)), weight=float(weight),
                duration_s=outcome.elapsed_s, waited_s=waited, bytes_sent=outcome.bytes_sent,
                bytes_received=outcome.bytes_received))
        self._take_verdicts()
        self.stats.traffic.append((time.monotonic(), self.stats.bytes_sent, self.stats.bytes_received))
        # a fragment's weight counts every token since its last sync, and each of the P fragments
        # carries those same tokens for its 1/P of the model: credit 1/P of them per fragment
        self.ledger.record_sync(int(weight) // len(worker.outer), acknowledged=outcome is not None)
        worker.apply_outer(fragment, avg, () if result is None else result[4])
        self.stats.rounds[fragment] = round_ + 1
        last_loss = self.stats.losses[-1][1] if self.stats.losses else float("nan")
        self.on_event({"event": "synced", "fragment": fragment, "round": round_, "step": worker.step,
                       "late": max(0, late),
                       "alone": outcome is None, "dropped": 0 if outcome is None else len(outcome.dropped),
                       "fallback": 0 if outcome is None else len(outcome.fallback_parts),  # slices with no agreed mean
                       "group_size": 1 if result is None else result[1],
                       "group": "" if result is None else result[2].hex()[:16],
                       "digest": hashlib.sha256(worker.outer[fragment].global_flat.numpy().tobytes()).hexdigest()[:16],
                       "train_loss": round(last_loss, 4)})
        log.info("fragment synced fragment=%d round=%d alone=%s", fragment, round_, outcome is None)


def _drain(queue: Any) -> list[Any]:
    out = []
    while queue:
        out.append(queue.popleft())
    return out
