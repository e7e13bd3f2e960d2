"""Proof that a peer lied, handed on (``peer.audit.Audits``' part): to the group it lied to
(``_share``, ``hand_on``), after a round to the members of a group that held a peer we banned
(``spread``), to live peers whose heartbeats do not list a ban we hold proof for (``gossip``),
and proof handed to us, checked one at a time off the event loop (``evidence``). Every bound
on what a crowd of keys can make us send or check lives here (see THREAT_MODEL.md, "Evidence
reaches the swarm in a few heartbeats, at a bounded rate")."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgpack

from peer.bans import MAX_EVIDENCE_FRAMES
from peer.proof_pieces import MAX_PROOF_BYTES, PieceStore, seal_proof
from protocol.envelope import verify
from protocol.errors import RemoteProtocolError
from protocol.evidence import proof_digest, proves
from protocol.identity import peer_id_from_public_key
from protocol.messages_swarm import Evidence, EvidencePiece

if TYPE_CHECKING:
    from peer.allreduce import Averager
    from peer.allreduce_round import Round

__all__ = ["WAIT", "ProofsMixin", "side_task"]

log = logging.getLogger("peer.allreduce")

WAIT = 2.0  # x the round's deadline: how long an auditor waits for the inputs, and a proof's send may take
_MAX_CHECKED = 256  # pieces of evidence we check per sender (each may cost a recomputation)
_GOSSIP_PER_LIAR = 16  # peers we hand one proof to by gossip (each that checks it hands it on in turn)
_SPREAD_MEMORY = 4096  # (member, liar) pairs we handed a proof to after a round (spread)
_MAX_REFUSED = 16  # and that prove nothing: past either, its evidence is dropped unread
_MAX_CHECKING = 8  # proofs handed to us waiting to be checked (one at a time); past it, or
_MAX_CHECKING_BYTES = MAX_PROOF_BYTES  # past their bytes, dropped unread


def side_task(averager: Any, coro: Any) -> asyncio.Task[None]:
    """Run ``coro`` as one of the averager's side tasks (cancelled at its shutdown)."""
    task = asyncio.create_task(coro)
    averager._side_tasks.add(task)
    task.add_done_callback(averager._side_tasks.discard)
    return task


class ProofsMixin:
    """``peer.audit.Audits``' handing on of proof. Uses its ``averager``, ``clip``, ``gate``,
    ``_random`` and ``_convict``."""

    averager: Averager

    def _init_proofs(self) -> None:
        self._convicted: set[bytes] = set()  # keys we hold proof against (ours, or handed on)
        self._checked: Counter[str] = Counter()  # peer ID -> evidence of theirs we checked
        self._refused: Counter[str] = Counter()  # peer ID -> evidence of theirs that proved nothing
        self._checking: set[asyncio.Task[None]] = set()  # checks of proof handed to us, under way or waiting
        self._checking_bytes = 0
        self.pieces = PieceStore(self._refused)  # proofs handed to us in pieces, until whole
        self._one_check = asyncio.Semaphore(1)
        self._spread: set[tuple[str, bytes]] = set()  # (peer ID, liar's key): proofs we handed on (spread, gossip)
        self._gossiping = False
        self._gossiped: Counter[bytes] = Counter()  # liar's key -> peers we handed its proof to by gossip
        self.proof_of: Callable[[bytes], tuple[bytes, ...] | None] = lambda key: None
        """The signed frames that prove a key lied, if we keep them (the node's ``peer.bans``);
        called off the event loop."""

    def _proven(self, frames: list[bytes], whole: bytes | None) -> tuple[bytes, str] | None:
        """``proves``, for a proof whose frames hash to ``whole`` (if given)."""
        if whole is not None and proof_digest(frames) != whole:
            return None
        return proves(frames, self.averager.run_id, self.clip, self.gate)

    def _share(self, rnd: Round, j: int, proof: tuple[bytes, ...]) -> None:
        """Hand the proof on to the group's other members: each checks it and bans the liar too,
        without auditing it itself."""
        to = [p for i, p in enumerate(rnd.peer_ids) if i not in (rnd.me, j)]
        if to:
            side_task(self.averager, self._share_sealed(rnd.group.run_id, proof, to, WAIT * rnd.group.deadline_s))

    async def _share_sealed(self, run_id: bytes, proof: tuple[bytes, ...], to: list[str], timeout: float) -> None:
        frames = await asyncio.to_thread(self._evidence_frames, run_id, proof)  # (an audit's proof can be large)
        for peer_id in to if frames is not None else ():
            side_task(self.averager, self._send(peer_id, frames, timeout))

    def _evidence_frames(self, run_id: bytes, proof: tuple[bytes, ...]) -> list[list[Any]] | None:
        """``proof`` sealed as frames to hand on (``peer.proof_pieces.seal_proof``)."""
        return seal_proof(proof, run_id, self.averager.identity, self.averager.max_frame_bytes)

    def spread(self, rnd: Round) -> None:
        """Members we banned were in this round's group (a leader that had not seen the proof
        named them): hand our proof against each to the group's other members, once per member
        and liar, so that a ban follows the liar into every group it joins beside a member that
        holds the proof, not only the group it lied to. Called once the round is over (the
        round's own sends go first), and at most as many bytes as we sent in the round: a
        leader that keeps naming fresh keys beside a liar we banned cannot make us send more.
        The group's members are partners now (their proofs in pieces are held first)."""
        self.pieces.partners([p for j, p in enumerate(rnd.peer_ids) if j != rnd.me])
        pending = []
        for i in sorted(rnd.excluded):
            key = bytes(rnd.group.members[i])
            to = [p for j, p in enumerate(rnd.peer_ids)
                  if j != rnd.me and j not in rnd.excluded and (p, key) not in self._spread]
            if to:
                pending.append((key, to))
        if pending:
            side_task(self.averager, self._spread_proofs(rnd, pending, rnd.sent[0]))

    async def _spread_proofs(self, rnd: Round, pending: list[tuple[bytes, list[str]]], budget: int) -> None:
        g = rnd.group
        for key, to in pending:
            frames = await self._read_proof(key)
            if frames is None:
                continue
            size = sum(len(x) for f in frames for x in f)
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
                side_task(self.averager, self._send(peer_id, frames, WAIT * g.deadline_s))

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
        frames = await self._read_proof(key)
        if frames is None:
            return False
        log.info("handing our proof against peer=%s to peer=%s (its heartbeat does not list the ban)",
                 peer_id_from_public_key(key), peer_id)
        await self._send(peer_id, frames, timeout)
        return True

    async def _read_proof(self, key: bytes) -> list[list[Any]] | None:
        """Our saved proof against ``key`` as frames to send (``_evidence_frames``), read from
        disk and sealed off the event loop (an audit's proof can be large); None if we keep
        none (banned for this session only), it cannot be handed on, or it cannot be read."""
        try:
            return await asyncio.to_thread(self._sealed_proof, self.averager.run_id, key)
        except Exception as e:  # noqa: BLE001  (a proof we cannot read: nothing to hand on)
            log.info("could not read our proof against peer=%s detail=%r", peer_id_from_public_key(key), e)
            return None

    def _sealed_proof(self, run_id: bytes, key: bytes) -> list[list[Any]] | None:
        """Our saved proof against ``key`` as frames to send, or None."""
        proof = self.proof_of(key)
        return self._evidence_frames(run_id, tuple(proof)) if proof else None

    def found(self, rnd: Round, j: int, why: str, proof: tuple[bytes, ...]) -> None:
        """Proof that member j lied, found by the round's intake after it ended or while it runs
        (two finals it signed that differ): ban it now (the node drains ``offences``) and hand
        the proof to the group's other members."""
        key = bytes(rnd.group.members[j])
        if key in self._convicted or key == self.averager.identity.public_key:
            return
        log.warning("peer=%s proven to have lied in group=%s: %s", rnd.peer_ids[j], rnd.group.group_id.hex(), why)
        self._convict(key, why, proof)
        self._share(rnd, j, proof)

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
        frames = self._unpack(peer_id, msg.payload)
        return None if frames is None else self._take(peer_id, frames, None)

    def evidence_piece(self, peer_id: str, msg: EvidencePiece) -> asyncio.Task[None] | None:
        """A piece of a proof handed on in pieces (too large for one frame): held
        (``peer.proof_pieces.PieceStore``, bounded) until every piece of it from ``peer_id`` is
        in, then the whole is checked as ``evidence`` checks one (it proves nothing unless its
        frames hash to ``msg.whole``). -> the check's task, if one was started."""
        if self._refused[peer_id] >= _MAX_REFUSED or self._checked[peer_id] >= _MAX_CHECKED:
            return None
        frames = self._unpack(peer_id, msg.payload)
        whole = None if frames is None else self.pieces.add(peer_id, msg, frames)
        return None if whole is None else self._take(peer_id, whole, bytes(msg.whole))

    def _unpack(self, peer_id: str, payload: bytes) -> list[bytes] | None:
        """The frames in an ``Evidence`` (or piece) payload; None (and counted as refused) if it
        is not a non-empty msgpack list of bytes."""
        try:
            frames = msgpack.unpackb(payload, raw=False, max_array_len=MAX_EVIDENCE_FRAMES, max_bin_len=len(payload))
        except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError):
            frames = None
        if not isinstance(frames, list) or not frames or not all(isinstance(f, bytes) for f in frames):
            self._refused[peer_id] += 1
            log.warning("evidence refused reason=unreadable peer=%s", peer_id)
            return None
        return frames

    def _take(self, peer_id: str, frames: list[bytes], whole: bytes | None) -> asyncio.Task[None] | None:
        """Start the check of a proof's ``frames`` (which must hash to ``whole``, if given)."""
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
        task = side_task(self.averager, self._check_evidence(peer_id, frames, nbytes, accused, whole))
        self._checking.add(task)
        task.add_done_callback(self._checking.discard)
        return task

    async def _check_evidence(self, peer_id: str, frames: list[bytes], nbytes: int, accused: bytes,
                              whole: bytes | None) -> None:
        try:
            async with self._one_check:
                if accused in self._convicted:
                    return  # proven by a check that ran while this one waited
                proven = await asyncio.to_thread(self._proven, frames, whole)
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
