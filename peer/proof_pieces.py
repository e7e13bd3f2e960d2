"""Proof larger than one frame, in pieces (``protocol.messages_swarm.EvidencePiece``): an audit's
proof of a large part (its mean and every input: k + 1 times the part's pushed bytes in a group
of k) does not fit one ``Evidence`` frame. ``seal_proof`` seals a proof as one ``Evidence`` frame
when it fits (by its sealed size), else as pieces, each a run of its frames that fits one frame,
all naming the digest of the whole (``protocol.evidence.proof_digest``). ``PieceStore`` holds the
pieces a receiver got until a proof is whole, within bounds that no crowd of keys can push
past (THREAT_MODEL.md, "Evidence reaches the swarm in a few heartbeats, at a bounded rate")."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import msgpack

from peer.bans import MAX_EVIDENCE_FRAMES
from protocol.envelope import seal, seal_parts
from protocol.errors import LocalProtocolError
from protocol.evidence import proof_digest
from protocol.identity import Identity
from protocol.messages_swarm import MAX_EVIDENCE_PIECES, Evidence, EvidencePiece

__all__ = ["MAX_PROOF_BYTES", "PieceStore", "seal_proof"]

log = logging.getLogger("peer.allreduce")

MAX_PROOF_BYTES = 128 << 20
"""The largest proof handed on, and checked (a check recomputes a part's mean: larger is kept
by the member that found it, which bans the liar itself)."""
MAX_PIECES_BYTES = 2 * MAX_PROOF_BYTES
"""Pieces held for proofs not whole yet, in all; one sender's at most half."""
PIECES_TTL = 600.0
"""Seconds a proof's pieces are held for the rest, from its first."""
PER_SENDER = 2
"""Proofs in pieces held per sender at once (one holder may hand us two proofs at once)."""
FRAME_COST = 64
"""Bytes a frame of a piece counts beyond its length: what holding it costs us."""
PARTNERS = 1024
"""Peers that were in our groups, remembered (their pieces are held before strangers')."""
MEMORY = 4096
"""Proofs dropped remembered, by sender, for ``PIECES_TTL`` (the rest of their pieces is ignored)."""


def seal_proof(proof: tuple[bytes, ...], run_id: bytes, identity: Identity, limit: int) -> list[list[Any]] | None:
    """``proof`` sealed as one ``Evidence`` frame of at most ``limit`` bytes, or as
    ``EvidencePiece`` frames (runs of its frames, in order, each within ``limit``); None (and
    logged) when a receiver could not take it: larger than ``MAX_PROOF_BYTES``, more than
    ``MAX_EVIDENCE_FRAMES`` frames, or a frame that no piece can hold."""
    nbytes = sum(len(f) for f in proof)
    if nbytes + FRAME_COST * len(proof) > MAX_PROOF_BYTES or len(proof) > MAX_EVIDENCE_FRAMES:
        log.info("proof too large to hand on: %d frames, %d bytes", len(proof), nbytes)
        return None
    if nbytes + 5 * len(proof) + 5 < limit:
        try:
            single = seal_parts(Evidence(run_id=run_id, payload=msgpack.packb(list(proof), use_bin_type=True)), identity)
        except LocalProtocolError:  # over what any frame may carry
            single = None
        if single is not None and sum(len(x) for x in single) <= limit:  # (its sealed size: a margin kept
            return [single]                                              # a full fp32 chunk's proof out)
    whole = proof_digest(proof)
    empty = seal(EvidencePiece(run_id=run_id, whole=whole, piece=MAX_EVIDENCE_PIECES - 1, pieces=MAX_EVIDENCE_PIECES,
                               payload=b""), identity)
    room = limit - len(empty) - 64 - 5  # (the payload's length in the head) a msgpack array's head; each frame a bin
    runs: list[list[bytes]] = [[]]
    used = 0
    for frame in proof:
        size = len(frame) + 5
        if size > room:
            log.info("proof too large to hand on: a frame of %d bytes does not fit a piece of %d", len(frame), limit)
            return None
        if used + size > room:
            runs.append([])
            used = 0
        runs[-1].append(frame)
        used += size
    return [seal_parts(EvidencePiece(run_id=run_id, whole=whole, piece=i, pieces=len(runs),
                                     payload=msgpack.packb(run, use_bin_type=True)), identity)
            for i, run in enumerate(runs)]


@dataclass
class _Held:
    """The pieces of one proof a sender has handed us so far."""

    pieces: int
    since: float
    got: dict[int, list[bytes]] = field(default_factory=dict)
    frames: int = 0
    nbytes: int = 0


class PieceStore:
    """Pieces of proofs handed to us, by (sender, whole), until a proof is whole. Bounds: at
    most ``PER_SENDER`` proofs per sender (another drops its oldest) and half of
    ``MAX_PIECES_BYTES``; each held at most ``PIECES_TTL`` seconds from its first piece (one
    that expires counts in ``refused`` against its sender, as a proof that proved nothing); a
    frame counts ``FRAME_COST`` bytes beyond its length. A proof we dropped is dropped for
    good from that sender (the rest of its pieces is ignored, not held until it expires).
    Past ``MAX_PIECES_BYTES`` in all, a piece makes room by dropping pieces of peers that
    never were in a group with us (strangers: not ``partners``): spare copies first (copies of
    a proof a partner holds too, or all but the largest of one proof's copies), the fewest
    bytes first, then the oldest; a stranger's piece never drops a copy of its own proof. Only
    a partner's piece goes on to other partners' (spare copies, then the oldest; not its own
    proof's); else the piece is dropped itself. So strangers' pieces, also ones that name an
    honest proof's digest, never push out a partner's, and a partner's pushes out strangers'
    copies of its own proof (a liar knows the digest of the proof against it); one holder
    can hand us two proofs at once (together within its half), several members the same one.
    A key that was once in a group with us is a partner: it can push other partners' pieces
    out, oldest first, within its half."""

    def __init__(self, refused: Counter[str]):
        self.refused = refused
        self.held: dict[tuple[str, bytes], _Held] = {}  # (sender, whole), oldest first
        self.nbytes = 0
        self._partners: dict[str, None] = {}  # least recent first
        self._timer: asyncio.TimerHandle | None = None
        self._gone: dict[Any, float] = {}  # (sender, whole) we dropped: the rest of its pieces is ignored

    @staticmethod
    def _remember(memory: dict[Any, float], what: Any) -> None:
        """Note ``what`` for ``PIECES_TTL`` seconds (at most ``MEMORY`` entries, oldest out first)."""
        now = time.monotonic()
        memory.pop(what, None)
        memory[what] = now
        while memory and (len(memory) > MEMORY or now - next(iter(memory.values())) > PIECES_TTL):
            memory.pop(next(iter(memory)))

    def partners(self, peer_ids: list[str]) -> None:
        """Peers that were in a group with us now."""
        for p in peer_ids:
            self._partners.pop(p, None)
            self._partners[p] = None
        while len(self._partners) > PARTNERS:
            self._partners.pop(next(iter(self._partners)))

    def add(self, peer_id: str, msg: EvidencePiece, frames: list[bytes]) -> list[bytes] | None:
        """Take a piece (its frames, unpacked). -> the proof's frames, in order, once it is whole."""
        self.expire()
        key = (peer_id, bytes(msg.whole))
        if self._gone.get(key, -PIECES_TTL) > time.monotonic() - PIECES_TTL:
            return None  # the rest of a proof we dropped: no use holding it (nor charging its sender for it)
        held = self.held.get(key)
        if held is not None and held.pieces != msg.pieces:
            self.drop(key, "its count of pieces changed", gone=False)
            held = None
        if held is None:
            mine = [k for k in self.held if k[0] == peer_id]
            if len(mine) >= PER_SENDER:
                self.drop(mine[0], "another proof began")
            held = self.held[key] = _Held(msg.pieces, time.monotonic())
            self._arm()
        if msg.piece in held.got:
            return None
        size = sum(len(f) for f in frames) + FRAME_COST * len(frames)
        if held.frames + len(frames) > MAX_EVIDENCE_FRAMES:
            self.refused[peer_id] += 1
            self.drop(key, f"over {MAX_EVIDENCE_FRAMES} frames")
            return None
        if sum(h.nbytes for k, h in self.held.items() if k[0] == peer_id) + size > MAX_PIECES_BYTES // 2:
            self.drop(key, "more than one sender may have us hold")
            return None
        if not self._room(key, size):
            self.drop(key, "no room")
            return None
        held.got[msg.piece] = frames
        held.frames += len(frames)
        held.nbytes += size
        self.nbytes += size
        if len(held.got) < held.pieces:
            return None
        self.drop(key, "", gone=False)
        return [f for i in range(held.pieces) for f in held.got[i]]

    def _room(self, key: tuple[str, bytes], size: int) -> bool:
        """Make room for ``size`` more bytes of proof ``key`` (see the class docstring). -> whether it fits."""
        def fits() -> bool:
            return self.nbytes + size <= MAX_PIECES_BYTES

        if fits():  # (the usual case: no order to work out)
            return True
        partner = key[0] in self._partners
        order = self._droppable([k for k in self.held if k[0] not in self._partners], key, own=partner)
        if partner:
            order += self._droppable([k for k in self.held if k[0] in self._partners], key, own=False)
        for k in order:
            if fits():
                break
            if k in self.held:
                self.drop(k, "out of room")
        return fits()

    def _droppable(self, keys: list[tuple[str, bytes]], key: tuple[str, bytes], own: bool) -> list[tuple[str, bytes]]:
        """``keys`` (one class of sender, oldest first) in the order they make room for ``key``:
        spare copies first (a copy of a proof that a partner holds too, when ``keys`` are
        strangers'; else all but the largest of a proof's copies in ``keys``), the fewest bytes
        first; then the rest, oldest first. Copies of ``key``'s own proof only if ``own``."""
        keys = [k for k in keys if k != key and (own or k[1] != key[1])]
        by_partner = {k[1] for k in self.held if k[0] in self._partners}
        of: dict[bytes, list[tuple[str, bytes]]] = {}  # whole -> its copies in keys (one pass, not one per proof)
        for k in keys:
            of.setdefault(k[1], []).append(k)
        spare: list[tuple[str, bytes]] = []
        for whole, copies in of.items():
            copies.sort(key=lambda k: self.held[k].nbytes)
            strangers = all(k[0] not in self._partners for k in copies)
            spare += copies if strangers and whole in by_partner else copies[:-1]
        spare.sort(key=lambda k: self.held[k].nbytes)
        first = set(spare)
        return spare + [k for k in keys if k not in first]

    def expire(self) -> None:
        now = time.monotonic()
        for k in [k for k, h in self.held.items() if now - h.since > PIECES_TTL]:
            self.refused[k[0]] += 1  # it never finished what it began
            self.drop(k, "held too long")

    def _arm(self) -> None:
        """A timer while pieces are held: they expire even when no other piece comes."""
        if self._timer is not None or not self.held:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # (outside an event loop: they expire at the next piece)
            return

        def fire() -> None:
            self._timer = None
            self.expire()
            self._arm()

        oldest = min(h.since for h in self.held.values())
        self._timer = loop.call_later(max(0.0, oldest + PIECES_TTL - time.monotonic()) + 0.01, fire)

    def drop(self, key: tuple[str, bytes], why: str, gone: bool = True) -> None:
        """Drop a proof's pieces; ``gone``: and ignore the rest of its pieces from that sender."""
        held = self.held.pop(key)
        self.nbytes -= held.nbytes
        if gone:
            self._remember(self._gone, key)
        if why:
            log.info("pieces of evidence dropped unread peer=%s: %s (%d of %d pieces, %d bytes)", key[0], why,
                     len(held.got), held.pieces, held.nbytes)
