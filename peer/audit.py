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
from typing import TYPE_CHECKING, Any


from peer.distrust import Distrust
from peer.proofs import WAIT as _WAIT
from peer.proofs import ProofsMixin, side_task as _side_task
from protocol.audit import NOT_COMMITTED, OK, UNPROVEN, WRONG, check
from protocol.butterfly import HEAD_ROOM, on_grid
from protocol.envelope import Verified, seal_parts, verify
from protocol.errors import ProtocolError
from protocol.evidence import NORM_ROOM, false_norm, floor_squares
from protocol.messages_swarm import AuditRequest, PushSlice

if TYPE_CHECKING:
    from peer.allreduce import Averager
    from peer.allreduce_round import Round

__all__ = ["Audits", "inputs_frames"]

log = logging.getLogger("peer.allreduce")

_ANSWERED_MEMORY = 1024  # (group, member) pairs answered: each member is answered once per group



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


class Audits(ProofsMixin):
    """One averager's audits (see the module docstring); the proofs they produce, and those
    handed to us, go on by ``peer.proofs.ProofsMixin``."""

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
        self._init_proofs()
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
        _side_task(av, self._false_norms(rnd, pending))  # not awaited: the verdict does not wait for it
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
    ``said``, the norm its report gave: largest first, so the proof handed on is small (a tiny
    norm is beaten by one chunk, which fits one ``Evidence`` frame beside the report).
    None if even all of them are within it."""
    sized = []
    for frame in pushes:
        try:
            msg = verify(frame, expect=(PushSlice,), max_size=len(frame)).message
            sized.append((floor_squares(msg), frame))  # type: ignore[arg-type]
        except ProtocolError:
            return None
    beyond = said * (1 + NORM_ROOM)
    alone = [frame for squares, frame in sized if math.sqrt(squares) > beyond]
    if alone:  # one chunk is enough: the shortest (the part's last chunk may fit a frame where a full one does not)
        return (report, min(alone, key=len))
    sized.sort(key=lambda t: -t[0])
    picked: list[bytes] = []
    for i, (_, frame) in enumerate(sized):
        picked.append(frame)
        if math.sqrt(math.fsum(sq for sq, _ in sized[:i + 1])) > beyond:  # summed as false_norm sums
            return (report, *picked)
    return None


def inputs_frames(rnd: Round) -> list[list[Any]]:
    """The inputs of our mean of our part, as an auditor gets them: the contributors' signed
    pushes as they came, and our own slice as we sealed it for our witness (``Round.own``)."""
    return [[data] for i in sorted(rnd.push_frames) for *_, data in rnd.push_frames[i]] + list(rnd.own_frames)
