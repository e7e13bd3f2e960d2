"""Audits of other reducers' means, and answers to audits of ours (``protocol.audit`` checks).

After each round, this member audits each part it holds from another reducer with
probability ``rate`` (the run's ``sync.audit``; drawn from the OS's randomness, so a reducer
cannot know which of its means will be audited); before it lands, every part its screen
refused (``before_landing``: landed after all if the audit passes). Every audit also sets
each contributor's report against the signed pushes the reducer shows
(``protocol.evidence.false_norm``). It sends the reducer an ``AuditRequest``;
the reducer answers on a stream of its own with the inputs of its mean: the contributors'
signed pushes (forwarded unchanged) and its own slice as the signed ``PushSlice``
frames. The auditor recomputes the mean off the training path (the round has landed):

- a mean that does not follow from the inputs the reducer committed to is proof
  (``protocol.audit.WRONG``): the frames go to ``offences``, and the node bans the reducer
  with them as evidence (``peer.bans``) and stops grouping with it;
- a reducer that does not show inputs matching its commitment within ``2 x`` the round's
  deadline (``UNPROVEN``) proves nothing (a peer killed right after the round cannot answer),
  so this member only suspends it from its groups for a while (``peer.distrust``); one whose
  answer covered the whole part with inputs other than those it committed to
  (``NOT_COMMITTED``) did what no crash does, and this member never groups with it again
  (there is no proof to hand on).

An honest round's members all hold the reducer's one signed mean (``peer.allreduce_round``
agreement), so a lie caught this way was landed alike by every honest member: they stay
identical, and the liar is out of this member's groups from its next round on.

A reducer answers each member's request for one of its parts once, for the finished rounds
it keeps (``peer.inbox.keep_recent``), so requests cannot make it send more than ``n - 1``
answers per round.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
from collections import Counter, deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgpack

from peer.bans import MAX_EVIDENCE_FRAMES
from peer.distrust import Distrust
from protocol.audit import NOT_COMMITTED, OK, UNPROVEN, WRONG, check
from protocol.butterfly import HEAD_ROOM, on_grid
from protocol.envelope import Verified, seal_parts, verify
from protocol.errors import ProtocolError, RemoteProtocolError
from protocol.evidence import NORM_ROOM, false_norm, floor_squares, proves
from protocol.identity import peer_id_from_public_key
from protocol.messages_swarm import AuditRequest, Evidence, PushSlice

if TYPE_CHECKING:
    from peer.allreduce import Averager
    from peer.allreduce_round import Round

__all__ = ["Audits", "inputs_frames"]

log = logging.getLogger("peer.allreduce")

_ANSWERED_MEMORY = 1024  # (group, member) pairs answered: each member is answered once per group
_WAIT = 2.0  # x the round's deadline: how long an auditor waits for the inputs
_MAX_CHECKED = 256  # pieces of evidence we check per sender (each may cost a recomputation)
_GOSSIP_PER_LIAR = 16  # peers we hand one proof to by gossip (each that checks it hands it on in turn)
_SPREAD_MEMORY = 4096  # (member, liar) pairs we handed a proof to after a round (spread)
_MAX_REFUSED = 16  # and that prove nothing: past either, its evidence is dropped unread
_MAX_CHECKING = 8  # proofs handed to us waiting to be checked (one at a time); past it, or
_MAX_CHECKING_BYTES = 128 << 20  # past their bytes, dropped unread


def _side_task(averager: Any, coro: Any) -> asyncio.Task[None]:
    """Run ``coro`` as one of the averager's side tasks (cancelled at its shutdown)."""
    task = asyncio.create_task(coro)
    averager._side_tasks.add(task)
    task.add_done_callback(averager._side_tasks.discard)
    return task


class _Open:
    """An audit waiting for the reducer's inputs."""

    def __init__(self, rnd: Round, part: int):
        self.reducer = rnd.peer_ids[part]
        self.contributors = len(rnd.contributors[part])
        self.bounds, self.chunk = rnd.bounds[part], rnd.chunk
        s, e = self.bounds
        self.size = e - s
        # bytes we take: each contributor's slice, on the round's grid of chunks, each in a frame
        self.budget = self.contributors * (4 * self.size + HEAD_ROOM * -(-self.size // self.chunk))
        self.frames: list[bytes] = []
        self.signed: dict[bytes, list[bytes]] = {}  # signer -> its frames of the answer
        self.covered: Counter[bytes] = Counter()  # signer -> elements
        self.seen: set[tuple[bytes, int]] = set()  # (signer, offset) taken
        self.done = asyncio.Event()

    def take(self, v: Verified, data: bytes) -> None:
        """A frame of the answer: one per signer and offset (a frame sent again because its
        acknowledgement was late, or the reducer's own slice reaching us late as its witness,
        is the same frame: counted twice, it would make an honest answer look wrong)."""
        msg = v.message
        where = (bytes(v.signer), msg.offset)  # type: ignore[attr-defined]
        if self.done.is_set() or len(data) > self.budget or where in self.seen \
                or not on_grid(*self.bounds, self.chunk, msg.offset, msg.numel):  # type: ignore[attr-defined]
            return
        self.seen.add(where)
        self.budget -= len(data)
        self.frames.append(bytes(data))
        self.signed.setdefault(bytes(v.signer), []).append(self.frames[-1])
        self.covered[v.signer] += msg.numel  # type: ignore[attr-defined]
        if len(self.covered) >= self.contributors and all(c >= self.size for c in self.covered.values()):
            self.done.set()


class Audits:
    """One averager's audits (see the module docstring)."""

    def __init__(self, averager: Averager, rate: float, clip: float, gate: bool = False):
        self.averager, self.rate, self.clip, self.gate = averager, rate, clip, gate
        self._open: dict[tuple[bytes, int], _Open] = {}
        self._answered: deque[tuple[bytes, str]] = deque(maxlen=_ANSWERED_MEMORY)
        self._closed: deque[tuple[bytes, int, str]] = deque(maxlen=_ANSWERED_MEMORY)  # (group, part, reducer)
        self._random = random.SystemRandom()
        self.offences: deque[tuple[bytes, str, tuple[bytes, ...]]] = deque(maxlen=64)
        """Proven wrong means: (reducer's key, what, the frames that prove it); the node takes them."""
        self.suspended: deque[tuple[bytes, int]] = deque(maxlen=256)
        """(key, for how many syncs) of reducers suspended for not showing their inputs; the node takes them."""
        self.counts: Counter[str] = Counter()  # verdicts so far
        self._convicted: set[bytes] = set()  # keys we hold proof against (ours, or handed on)
        self._checked: Counter[str] = Counter()  # peer ID -> evidence of theirs we checked
        self._refused: Counter[str] = Counter()  # peer ID -> evidence of theirs that proved nothing
        self._checking: set[asyncio.Task[None]] = set()  # checks of proof handed to us, under way or waiting
        self._checking_bytes = 0
        self._one_check = asyncio.Semaphore(1)
        self._spread: set[tuple[str, bytes]] = set()  # (peer ID, liar's key): proofs we handed on (spread, gossip)
        self._gossiping = False
        self._gossiped: Counter[bytes] = Counter()  # liar's key -> peers we handed its proof to by gossip
        self.proof_of: Callable[[bytes], tuple[bytes, ...] | None] = lambda key: None
        """The signed frames that prove a key lied, if we keep them (the node's ``peer.bans``);
        called off the event loop."""
        self.distrust: Distrust | None = None
        """The matchmaking's ``peer.distrust.Distrust`` (the node sets it): a convicted reducer is
        banned from it, one that did not show its inputs suspended, as soon as the verdict is in
        (the ban on disk comes at the node's next landing)."""

    # --- auditing others ------------------------------------------------------------------

    def after(self, rnd: Round, fallback: tuple[int, ...], suspect: list[int] = ()) -> None:
        """The round is over: audit each part we hold from another reducer with probability
        ``rate``, and every ``suspect`` one (its mean did not fit its contributors' reports, so
        we fell back on it; an audit proves the lie against its reducer), whatever the rate."""
        for j in range(rnd.n):
            if j == rnd.me or not rnd.size(j) or not rnd.holds(j) or j in rnd.convicted or j in rnd.audited:
                continue
            if j not in suspect and (j in fallback or self.rate <= 0 or self._random.random() >= self.rate):
                continue
            _side_task(self.averager, self._audit(rnd, j))

    async def before_landing(self, rnd: Round, parts: list[int], wait: float) -> None:
        """Parts the screen refused (``Round.screen``), audited now, whatever the rate, before we
        land: a member's false report to us alone (a tiny norm of its push, told to one member
        of three) makes an honest mean fail our screen while the others land it. We wait up to
        ``wait`` seconds for the verdicts: a part whose mean follows from its reducer's inputs
        is landed after all (``Round.cleared``), so we land what the others do; a wrong one
        falls back, its reducer convicted and the proof handed to the group (as after a round);
        one without a verdict by then, or with none to give (``UNPROVEN``: the reducer did not
        show its inputs), falls back and makes the round unsure (not agreed: another member may
        land it), and its audit goes on (it suspends a reducer that never answers). A member proven a liar (the
        reducer, or a contributor whose report understated its push) is ``Round.proven``: its
        final, which says it landed its wrong mean, counts for nothing. A lying reducer gains nothing: a
        mean that passes an audit is one its inputs give."""
        tasks = {j: _side_task(self.averager, self._audit(rnd, j)) for j in parts
                 if j != rnd.me and rnd.size(j) and rnd.holds(j) and j not in rnd.convicted}
        rnd.audited.update(tasks)
        if not tasks:
            return
        done, _ = await asyncio.wait(tasks.values(), timeout=wait)
        rnd.proven.update(i for i, key in enumerate(rnd.group.members) if bytes(key) in self._convicted)
        for j, task in tasks.items():
            verdict = task.result() if task in done and not task.cancelled() and task.exception() is None else None
            if verdict == OK:
                rnd.cleared.add(j)
                log.info("a part our screen refused passed its audit: landing it part=%d reducer=%s group=%s", j,
                         rnd.peer_ids[j], rnd.group.group_id.hex())
            elif verdict != WRONG:  # no verdict yet, or none to give (no answer, not all of it): another
                rnd.unsure = True  # member may have landed the part

    async def _audit(self, rnd: Round, j: int) -> str | None:
        """Audit part j of ``rnd`` (see the module docstring). -> the verdict; None if one of
        it is under way already."""
        g, av = rnd.group, self.averager
        key = (bytes(g.group_id), j)
        if key in self._open:
            return None
        pending = self._open[key] = _Open(rnd, j)
        mean_frames = [b"".join(bytes(x) for x in f) for f in rnd.frames[j]]
        request = AuditRequest(run_id=g.run_id, fragment=g.fragment, round=g.round, group_id=g.group_id, part=j)
        wait = _WAIT * g.deadline_s
        try:
            await asyncio.wait_for(av._send_frames(pending.reducer, [seal_parts(request, av.identity)]), wait)
            await asyncio.wait_for(pending.done.wait(), wait)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001  (unreachable or silent: judged on what came)
            log.info("audit got no full answer part=%d reducer=%s detail=%r", j, pending.reducer, e)
        finally:
            del self._open[key]
            self._closed.append((bytes(g.group_id), j, pending.reducer))
        verdict, reducer, why = await asyncio.to_thread(check, mean_frames, pending.frames, g.run_id, self.clip, self.gate)
        await self._false_norms(rnd, pending)
        self.counts[verdict] += 1
        suspended, lied = 0, False
        if verdict == UNPROVEN and self.distrust is not None:
            lied = why == NOT_COMMITTED and pending.done.is_set()  # a whole answer, other inputs than committed
            if lied:  # no crash, no cut link does that
                self.distrust.ban(bytes(g.members[j]))
            else:  # no answer, or not all of it: a crash or a cut link does that too
                suspended = self.distrust.suspend(bytes(g.members[j]), g.formed_at)
        if verdict == WRONG and reducer is not None:
            log.warning("audit: reducer signed a wrong mean part=%d reducer=%s group=%s: %s", j, pending.reducer,
                        g.group_id.hex(), why)
            proof = tuple(mean_frames) + tuple(pending.frames)
            self._convict(reducer, why, proof)
            self._share(rnd, j, proof)
        elif verdict == UNPROVEN:
            log.warning("audit: reducer's mean not checked (its inputs not shown, or not checkable) part=%d "
                        "reducer=%s group=%s: %s; %s",
                        j, pending.reducer, g.group_id.hex(), why,
                        "not grouping with it any more" if lied else
                        f"not grouping with it for {suspended} syncs" if suspended else "judged already")
            if suspended:
                self.suspended.append((bytes(g.members[j]), suspended))
        else:
            log.info("audit passed part=%d reducer=%s group=%s %s", j, pending.reducer, g.group_id.hex(), why)
        return verdict

    async def _false_norms(self, rnd: Round, pending: _Open) -> None:
        """The contributors' signed pushes the reducer showed us, against the norms their reports
        to us gave of them (``protocol.evidence.false_norm``): a report that made a push look
        smaller than it was (a tiny norm told to us alone makes our screen refuse an honest
        mean) is proof; its sender is convicted, and the proof goes to the group."""
        j = rnd.index[pending.reducer]
        for i, report in sorted(rnd.report_frames.items()):
            key = bytes(rnd.group.members[i])
            pushes = pending.signed.get(key)
            if not pushes or key in self._convicted or i not in rnd.report_norms:
                continue
            proof = await asyncio.to_thread(_least_proof, report, pushes, rnd.report_norms[i][j])
            proven = await asyncio.to_thread(false_norm, proof, rnd.group.run_id) if proof else None
            if proven is not None:
                log.warning("audit: a member's report understated its push peer=%s group=%s: %s", rnd.peer_ids[i],
                            rnd.group.group_id.hex(), proven[1])
                self._convict(key, proven[1], proof)
                self._share(rnd, i, proof)

    def _convict(self, key: bytes, why: str, proof: tuple[bytes, ...]) -> None:
        self._convicted.add(bytes(key))
        self.offences.append((bytes(key), why, proof))
        if self.distrust is not None:
            self.distrust.ban(bytes(key))

    def _share(self, rnd: Round, j: int, proof: tuple[bytes, ...]) -> None:
        """Hand the proof on to the group's other members: each checks it and bans the liar too,
        without auditing it itself."""
        frame = self._evidence_frame(rnd.group.run_id, proof)
        for i, peer_id in enumerate(rnd.peer_ids):
            if frame is not None and i not in (rnd.me, j):
                _side_task(self.averager, self._send(peer_id, [frame], _WAIT * rnd.group.deadline_s))

    def _evidence_frame(self, run_id: bytes, proof: tuple[bytes, ...]) -> list[Any] | None:
        """``proof`` sealed as our ``Evidence`` frame, or None if it would not fit one."""
        payload = msgpack.packb(list(proof), use_bin_type=True)
        if len(payload) + HEAD_ROOM > self.averager.max_frame_bytes:
            log.info("proof too large to hand on bytes=%d", len(payload))
            return None
        return seal_parts(Evidence(run_id=run_id, payload=payload), self.averager.identity)

    def spread(self, rnd: Round) -> None:
        """Members we banned were in this round's group (a leader that had not seen the proof
        named them): hand our proof against each to the group's other members, once per member
        and liar, so that a ban follows the liar into every group it joins beside a member that
        holds the proof, not only the group it lied to. Called once the round is over (the
        round's own sends go first), and at most as many bytes as we sent in the round: a
        leader that keeps naming fresh keys beside a liar we banned cannot make us send more."""
        pending = []
        for i in sorted(rnd.excluded):
            key = bytes(rnd.group.members[i])
            to = [p for j, p in enumerate(rnd.peer_ids)
                  if j != rnd.me and j not in rnd.excluded and (p, key) not in self._spread]
            if to:
                pending.append((key, to))
        if pending:
            _side_task(self.averager, self._spread_proofs(rnd, pending, rnd.sent[0]))

    async def _spread_proofs(self, rnd: Round, pending: list[tuple[bytes, list[str]]], budget: int) -> None:
        g = rnd.group
        for key, to in pending:
            frame = await self._read_proof(key)
            if frame is None:
                continue
            size = sum(len(x) for x in frame)
            to = to[:budget // size]
            if not to:
                log.info("proof against peer=%s not handed on this round: %d bytes, over what we sent",
                         peer_id_from_public_key(key), size)
                continue
            budget -= size * len(to)
            if len(self._spread) + len(to) > _SPREAD_MEMORY:
                self._spread.clear()  # at worst, a proof is sent again
            self._spread.update((p, key) for p in to)
            log.info("handing on our proof against peer=%s to peers=%s group=%s", peer_id_from_public_key(key),
                     to, g.group_id.hex())
            for peer_id in to:
                _side_task(self.averager, self._send(peer_id, [frame], _WAIT * g.deadline_s))

    async def gossip(self, lacking: list[tuple[str, bytes]], fanout: int, timeout: float,
                     prefer: frozenset[str] = frozenset()) -> int:
        """Peers whose heartbeats do not list a ban we hold proof for (``lacking``: (peer ID,
        liar's key), from the node's view of the run): hand the proof to at most ``fanout`` of
        them that we have not handed it to, one after the other, drawn at random, peers that
        averaged with us lately (``prefer``) first. So a ban reaches the whole run within a
        few heartbeat intervals (each peer that checks the proof hands it on in turn), not only
        the groups the liar joins beside a holder. The node calls this once per heartbeat
        interval, so we send at most ``fanout`` proofs per interval however many keys the run
        has, and each proof to at most ``_GOSSIP_PER_LIAR`` peers: keys that post heartbeats
        listing no ban cannot make us upload a large proof (an audit's) without end.
        -> how many proofs were sent."""
        if self._gossiping:  # the last interval's sends are still under way
            return 0
        fresh = [(p, k) for p, k in sorted({(p, bytes(k)) for p, k in lacking} - self._spread)
                 if p not in self.averager.banned]
        self._random.shuffle(fresh)
        fresh.sort(key=lambda pk: pk[0] not in prefer)  # stable: partners first, each side shuffled
        picked: list[tuple[str, bytes]] = []
        for p, k in fresh:
            if len(picked) < fanout and self._gossiped[k] < _GOSSIP_PER_LIAR:
                picked.append((p, k))
                self._gossiped[k] += 1
        if len(self._spread) + len(picked) > _SPREAD_MEMORY:
            self._spread.clear()  # at worst, a proof is sent again
        self._spread.update(picked)
        self._gossiping, sent = True, 0
        try:
            for peer_id, key in picked:
                sent += await self._hand_over(peer_id, key, timeout)
        finally:
            self._gossiping = False
        return sent

    async def _hand_over(self, peer_id: str, key: bytes, timeout: float) -> bool:
        frame = await self._read_proof(key)
        if frame is None:
            return False
        log.info("handing our proof against peer=%s to peer=%s (its heartbeat does not list the ban)",
                 peer_id_from_public_key(key), peer_id)
        await self._send(peer_id, [frame], timeout)
        return True

    async def _read_proof(self, key: bytes) -> list[Any] | None:
        """Our saved proof against ``key`` as an ``Evidence`` frame, read from disk and sealed
        off the event loop (an audit's proof can be large); None if we keep none (banned for
        this session only), it would not fit a frame, or it cannot be read."""
        try:
            return await asyncio.to_thread(self._sealed_proof, self.averager.run_id, key)
        except Exception as e:  # noqa: BLE001  (a proof we cannot read: nothing to hand on)
            log.info("could not read our proof against peer=%s detail=%r", peer_id_from_public_key(key), e)
            return None

    def _sealed_proof(self, run_id: bytes, key: bytes) -> list[Any] | None:
        """Our saved proof against ``key`` as an ``Evidence`` frame, or None."""
        proof = self.proof_of(key)
        return self._evidence_frame(run_id, tuple(proof)) if proof else None

    def hand_on(self, rnd: Round, offences) -> None:
        """Proven lies seen in a round (``AllReduceOutcome.offences``): hand each proof on to the
        group's other members, who may not have seen it (a bad push reaches one reducer only)."""
        for key, _why, evidence in offences:
            if key not in self._convicted:
                self._convicted.add(bytes(key))
                self._share(rnd, rnd.index.get(peer_id_from_public_key(key), rnd.me),
                            (evidence,) if isinstance(evidence, bytes) else tuple(evidence))

    def evidence(self, peer_id: str, msg: Evidence) -> asyncio.Task[None] | None:
        """Proof handed on by ``peer_id``: checked here (it vouches for nothing), at most
        ``_MAX_CHECKED`` times per sender (and ``_MAX_REFUSED`` unreadable or proving nothing),
        one at a time off the event loop (an audit's proof is a recomputation); past
        ``_MAX_CHECKING`` waiting (or their bytes), dropped unread. -> the check's task, if one
        was started."""
        if self._refused[peer_id] >= _MAX_REFUSED or self._checked[peer_id] >= _MAX_CHECKED:
            return None
        try:
            frames = msgpack.unpackb(msg.payload, raw=False, max_array_len=MAX_EVIDENCE_FRAMES,
                                     max_bin_len=len(msg.payload))
        except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError):
            frames = None
        if not isinstance(frames, list) or not frames or not all(isinstance(f, bytes) for f in frames):
            self._refused[peer_id] += 1
            log.warning("evidence refused reason=unreadable peer=%s", peer_id)
            return None
        try:  # whom it accuses (the signer of its first frame): no need to check proof we hold
            accused = verify(frames[0], run_id=self.averager.run_id, max_size=len(frames[0])).signer
        except RemoteProtocolError:
            accused = b""
        if accused in self._convicted or peer_id_from_public_key(accused or b"\0" * 32) in self.averager.banned:
            return None
        nbytes = sum(len(f) for f in frames)
        if len(self._checking) >= _MAX_CHECKING or self._checking_bytes + nbytes > _MAX_CHECKING_BYTES:
            log.info("evidence dropped unread peer=%s: %d proofs wait to be checked already", peer_id,
                     len(self._checking))
            return None
        self._checked[peer_id] += 1  # checks that run: a proof we hold already, or dropped unread, costs none
        self._checking_bytes += nbytes
        task = _side_task(self.averager, self._check_evidence(peer_id, frames, nbytes, accused))
        self._checking.add(task)
        task.add_done_callback(self._checking.discard)
        return task

    async def _check_evidence(self, peer_id: str, frames: list[bytes], nbytes: int, accused: bytes) -> None:
        try:
            async with self._one_check:
                if accused in self._convicted:
                    return  # proven by a check that ran while this one waited
                proven = await asyncio.to_thread(proves, frames, self.averager.run_id, self.clip, self.gate)
        finally:
            self._checking_bytes -= nbytes
        if proven is None:
            self._refused[peer_id] += 1
            log.warning("evidence refused reason=proves_nothing peer=%s", peer_id)
            return
        key, why = proven
        if key in self._convicted or key == self.averager.identity.public_key:
            return
        log.warning("evidence from peer=%s proves that peer=%s lied: %s", peer_id, peer_id_from_public_key(key), why)
        self._convict(key, why, tuple(frames))

    def take(self, peer_id: str, v: Verified, data: bytes) -> bool:
        """A frame of an answer to one of our audits? (a push, forwarded or its own, sent to us
        by the reducer we audit) -> True if taken here."""
        msg = v.message
        if not isinstance(msg, PushSlice):
            return False
        pending = self._open.get((bytes(msg.group_id), msg.part))
        if pending is None or pending.reducer != peer_id:
            # the tail of an answer to an audit we closed (judged on what came by then), or a
            # resend of one: taken, and nothing more
            return (bytes(msg.group_id), msg.part, peer_id) in self._closed
        pending.take(v, data)
        return True

    # --- answering audits of ours ---------------------------------------------------------

    def answer(self, peer_id: str, msg: AuditRequest) -> None:
        """A member asks for the inputs of our mean of ``msg.part``: send them, once."""
        av = self.averager
        gid = bytes(msg.group_id)
        rnd = av._active.get(gid) or av._recent.get(gid)
        if rnd is None or msg.part != rnd.me or not rnd.committed or peer_id not in rnd.index \
                or (gid, peer_id) in self._answered:
            log.info("audit request not answered peer=%s group=%s part=%d", peer_id, gid.hex(), msg.part)
            return
        self._answered.append((gid, peer_id))
        frames = inputs_frames(rnd)
        _side_task(av, self._send(peer_id, frames, _WAIT * rnd.group.deadline_s))

    async def _send(self, peer_id: str, frames: list[list[Any]], timeout: float) -> None:
        try:
            await asyncio.wait_for(self.averager._send_frames(peer_id, frames), timeout)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001  (an auditor we cannot reach: its problem)
            log.info("audit answer not delivered peer=%s detail=%r", peer_id, e)


def _least_proof(report: bytes, pushes: list[bytes], said: float) -> tuple[bytes, ...] | None:
    """The report and the fewest of ``pushes`` (one member's chunks of one part, verified as
    the audit took them) whose least norm (``protocol.evidence.floor_squares``) is beyond
    ``said``, the norm its report gave: largest first, so the proof usually fits one
    ``Evidence`` frame (a tiny norm is beaten by one chunk; all of a part's chunks would not fit).
    None if even all of them are within it."""
    sized = []
    for frame in pushes:
        try:
            msg = verify(frame, expect=(PushSlice,), max_size=len(frame)).message
            sized.append((floor_squares(msg), frame))  # type: ignore[arg-type]
        except ProtocolError:
            return None
    sized.sort(key=lambda t: -t[0])
    total, picked = 0.0, []
    for squares, frame in sized:
        total += squares
        picked.append(frame)
        if math.sqrt(total) > said * (1 + NORM_ROOM):
            return (report, *picked)
    return None


def inputs_frames(rnd: Round) -> list[list[Any]]:
    """The inputs of our mean of our part, as an auditor gets them: the contributors' signed
    pushes as they came, and our own slice as we sealed it for our witness (``Round.own``)."""
    return [[data] for i in sorted(rnd.push_frames) for *_, data in rnd.push_frames[i]] + list(rnd.own_frames)
