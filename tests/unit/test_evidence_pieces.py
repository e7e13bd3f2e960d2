"""Proof handed on in pieces (peer.proofs: ``EvidencePiece``): an audit's proof of a large
part does not fit one frame, and used to be kept by the member that found it alone. Real
``Averager``s without a network: the holder seals its saved proof as it sends it, and the
receiver takes each frame through its inbound handler (``_on_frame``), as from a stream."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import msgpack
import pytest
import torch

from peer import proof_pieces
from peer.allreduce import Averager
from peer.proof_pieces import MAX_PROOF_BYTES, PieceStore, seal_proof
from protocol.butterfly import HEAD_ROOM, chunk_elements
from protocol.codecs import get_codec
from protocol.envelope import seal, verify
from protocol.evidence import false_norm, proof_digest
from protocol.identity import Identity
from protocol.messages_swarm import Evidence, EvidencePiece, PartsHeld, PushSlice
from tests.unit.test_audit import KEYS, RUN, _negate, _vectors, reduce_and_audit

FRAME = 4 * HEAD_ROOM  # 16 KiB frames: an fp32 chunk of 3,072 elements, a proof of 4 parts' frames in pieces
LIAR = KEYS[0]


def _averager(key: Identity) -> Averager:
    return Averager(p2p=None, identity=key, run_id=RUN, clip=2.0, max_frame_bytes=FRAME)


def _big_proof() -> tuple[bytes, ...]:
    """An audit's proof that member 0 negated its mean: its mean frames and every input, fp32,
    far more than one frame."""
    means, shown, _ = reduce_and_audit(_vectors(3, 3 * 9000, seed=21), "fp32", (1.0, 1.0, 1.0), 2.0,
                                       chunk_elements(FRAME), _negate)
    return tuple(means + shown)


def _pieces_of(proof: tuple[bytes, ...], holder: Averager) -> list[bytes]:
    holder.audits.proof_of = {LIAR.public_key: proof}.get
    sealed = asyncio.run(holder.audits._read_proof(LIAR.public_key))
    return [b"".join(bytes(x) for x in f) for f in sealed]


def _deliver(receiver: Averager, sender: Averager, frames: list[bytes]) -> None:
    for frame in frames:
        receiver._on_frame(sender.identity.peer_id, frame)


async def _checks_done(av: Averager) -> None:
    while av._side_tasks:
        await asyncio.gather(*list(av._side_tasks))


def test_a_proof_larger_than_a_frame_goes_in_pieces_and_convicts_once_every_piece_is_in():
    """Each piece fits a frame and is signed by the holder; the receiver holds pieces, in any
    order, until the last, then checks the whole and bans the liar; nothing is held after."""
    proof = _big_proof()
    assert sum(map(len, proof)) > 4 * FRAME
    holder, receiver = _averager(KEYS[3]), _averager(KEYS[4])
    frames = _pieces_of(proof, holder)
    assert len(frames) > 4 and all(len(f) <= FRAME for f in frames)
    pieces = [verify(f, expect=EvidencePiece, run_id=RUN, sender=KEYS[3].public_key).message for f in frames]
    assert [p.piece for p in pieces] == list(range(len(frames))) and {p.pieces for p in pieces} == {len(frames)}
    assert [f for p in pieces for f in msgpack.unpackb(p.payload)] == list(proof)
    random.Random(3).shuffle(frames)

    async def hand_on() -> None:
        _deliver(receiver, holder, frames[:-1] + frames[:2])  # all but one (and two again): nothing to check yet
        assert not receiver.audits._checking and receiver.audits.pieces.nbytes > 0
        _deliver(receiver, holder, frames[-1:])
        await _checks_done(receiver)

    asyncio.run(hand_on())
    assert [key for key, _, _ in receiver.audits.offences] == [LIAR.public_key]
    assert receiver.audits.pieces.nbytes == 0 and not receiver.audits.pieces.held
    assert receiver.audits._checked == {KEYS[3].peer_id: 1}


def test_pieces_whose_frames_do_not_hash_to_their_whole_prove_nothing():
    """A sender that swaps a frame of a true proof for another (or leaves one out) under the
    proof's digest is refused at the end, and its check counts against it."""
    proof = list(_big_proof())
    holder, receiver = _averager(KEYS[3]), _averager(KEYS[4])
    frames = _pieces_of(tuple(proof), holder)
    first = verify(frames[0], expect=EvidencePiece).message
    forged = seal(EvidencePiece(run_id=RUN, whole=first.whole, piece=0, pieces=first.pieces,
                                payload=msgpack.packb(msgpack.unpackb(first.payload)[1:], use_bin_type=True)), KEYS[3])

    async def hand_on() -> None:
        _deliver(receiver, holder, [forged, *frames[1:]])
        await _checks_done(receiver)

    asyncio.run(hand_on())
    assert not receiver.audits.offences and receiver.audits._refused[KEYS[3].peer_id] == 1
    assert proof_digest(proof) == first.whole


def _piece(whole: bytes, i: int, n: int, frames: list[bytes]) -> tuple[EvidencePiece, list[bytes]]:
    return EvidencePiece(run_id=RUN, whole=whole, piece=i, pieces=n, payload=b""), frames


def _store(monkeypatch, room: int) -> tuple[PieceStore, Counter]:
    monkeypatch.setattr(proof_pieces, "MAX_PIECES_BYTES", room)
    refused: Counter = Counter()
    return PieceStore(refused), refused


def _cost(frames: list[bytes]) -> int:
    return sum(len(f) + proof_pieces.FRAME_COST for f in frames)


def test_one_holder_can_hand_us_two_proofs_at_once_and_several_holders_the_same_one(monkeypatch):
    """A holder's proofs go on streams of their own, so their pieces interleave (a review's
    repro: each dropped the other's, and neither was ever whole); and every member that proved
    a lie hands it on, so copies of one proof come from several senders when there is room for
    one: the copy further along is kept, and the proof is whole once."""
    store, _ = _store(monkeypatch, 20 * 1000)  # (one sender's: at most half)
    a, b = [bytes([1]) * 900] * 4, [bytes([2]) * 900] * 4
    for i in range(4):
        assert store.add("holder", *_piece(b"A" * 32, i, 4, a[i:i + 1])) == (a if i == 3 else None)
        assert store.add("holder", *_piece(b"B" * 32, i, 4, b[i:i + 1])) == (b if i == 3 else None)
    assert store.nbytes == 0 and not store.held
    store, _ = _store(monkeypatch, 8 * 1000)  # room for two copies (one sender's: half), not three
    whole = []
    for i in range(4):
        for sender in ("m1", "m2", "m3"):
            whole.append(store.add(sender, *_piece(b"A" * 32, i, 4, a[i:i + 1])))
    assert [w for w in whole if w is not None] in ([a], [a, a])
    assert store.nbytes == sum(h.nbytes for h in store.held.values()) <= 8 * 1000


def test_a_strangers_pieces_never_push_out_a_partners_proof(monkeypatch):
    """One key (or many) that never averaged with us, starting proofs it never finishes, can
    take the room partners leave, and no more: a partner's proof further along stays, and the
    stranger's pieces are dropped (a review's repro: one key evicted every honest proof)."""
    store, _ = _store(monkeypatch, 8 * 1000)
    store.partners(["partner"])
    frames = [bytes([1]) * 900] * 4
    for i in range(3):
        store.add("partner", *_piece(b"P" * 32, i, 4, frames[i:i + 1]))
    for k in range(20):
        store.add(f"stranger{k}", *_piece(bytes([k]) * 32, 0, 2, [b"\0" * 1900]))
        assert store.nbytes <= 8 * 1000 and ("partner", b"P" * 32) in store.held
    assert store.add("partner", *_piece(b"P" * 32, 3, 4, frames[3:])) == frames
    for k in range(4):  # strangers' pieces fill the room the partner's proof left
        store.add(f"later{k}", *_piece(bytes([k]) * 32, 0, 2, [b"\0" * 1900]))
    assert store.nbytes > 7000
    store.add("partner", *_piece(b"Q" * 32, 0, 2, [b"\0" * 3000]))  # a partner's piece pushes strangers' out
    assert ("partner", b"Q" * 32) in store.held and store.nbytes <= 8 * 1000 and len(store.held) == 3


def test_strangers_copies_of_a_partners_proof_never_push_it_out_and_the_partner_pushes_theirs_out(monkeypatch):
    """A second review's repros: the copies rule ran first and ignored who sent a copy, so
    strangers' junk dropped a partner's copy of a proof (the less complete one) and then the
    stranger's; and strangers holding pieces that name an honest proof's digest (a liar knows
    it) blocked the partner's pieces of it, since a piece never dropped a copy of its own proof."""
    store, _ = _store(monkeypatch, 40_000)
    store.partners(["partner"])
    w = b"W" * 32
    for i in range(6):
        store.add("partner", *_piece(w, i, 10, [bytes([i]) * 900]))
    for i in range(8):
        store.add("honest stranger", *_piece(w, i, 10, [bytes([i]) * 900]))
    for k in range(30):
        store.add(f"junk{k}", *_piece(bytes([k]) * 32, 0, 2, [b"\0" * 4000]))
        assert ("partner", w) in store.held
    store, _ = _store(monkeypatch, 40_000)
    store.partners(["partner"])
    for f in ("fake1", "fake2"):  # half the room each, all naming the partner's proof
        for i in range(4):
            store.add(f, *_piece(w, i, 10, [b"\0" * 4900]))
    assert store.nbytes > 39_000
    frames = [bytes([i]) * 900 for i in range(10)]
    got = [store.add("partner", *_piece(w, i, 10, frames[i:i + 1])) for i in range(10)]
    assert got[-1] == frames and store.nbytes <= 40_000


def test_the_rest_of_a_proof_we_dropped_is_ignored_and_costs_its_sender_nothing(monkeypatch):
    """One holder's two proofs at once, together over its half: the second is dropped, and
    its later pieces are not held again until they expire and count against the honest
    holder (a second review's repro), nor is a copy we dropped for room."""
    store, refused = _store(monkeypatch, 20_000)
    a, b = [bytes([1]) * 1900] * 4, [bytes([2]) * 1900] * 4
    whole = []
    for i in range(4):
        whole.append(store.add("holder", *_piece(b"A" * 32, i, 4, a[i:i + 1])))
        whole.append(store.add("holder", *_piece(b"B" * 32, i, 4, b[i:i + 1])))
    assert [w for w in whole if w is not None] == [a]
    assert not store.held and not refused  # B's later pieces were not held again (to expire against it)


def test_what_a_sender_seals_a_receiver_takes_whole(monkeypatch):
    """``seal_proof``'s limit counts a frame as the receiver does (its bytes and 64 more): a
    proof just under it goes in pieces that a receiver's half holds, one just over it is kept."""
    monkeypatch.setattr(proof_pieces, "MAX_PROOF_BYTES", 10_000)
    store, _ = _store(monkeypatch, 20_000)
    fits = tuple(bytes([i]) * 900 for i in range(10))  # 9,000 bytes + 640
    assert seal_proof(tuple(bytes([i]) * 990 for i in range(10)), RUN, KEYS[3], 4 * HEAD_ROOM) is None  # 9,900 + 640
    sealed = seal_proof(fits, RUN, KEYS[3], 2 * HEAD_ROOM)
    assert sealed is not None and len(sealed) > 1
    out = None
    for parts in sealed:
        msg = verify(b"".join(bytes(x) for x in parts), expect=EvidencePiece).message
        out = store.add("holder", msg, msgpack.unpackb(msg.payload))
    assert out == list(fits)


def test_pieces_held_are_bounded_per_sender_per_frame_and_in_time(monkeypatch):
    """At most two proofs in pieces per sender (a third drops its oldest) and half the room;
    each frame counts beyond its bytes (4,096 empty frames once held 647 KiB counted as 0);
    a proof not whole ``PIECES_TTL`` after its first piece is dropped by a timer, with no other
    piece coming, and counts against its sender."""
    store, refused = _store(monkeypatch, 100_000)
    for w in (b"a", b"b", b"c"):
        store.add("k", *_piece(w * 32, 0, 2, [b"x"]))
    assert [k[1][:1] for k in store.held] == [b"b", b"c"]
    assert store.add("k", *_piece(b"d" * 32, 0, 2, [b"\0" * 60_000])) is None  # over half the room: not held
    assert [k[1][:1] for k in store.held] == [b"c"]
    store.add("e", *_piece(b"e" * 32, 0, 2, [b""] * 100))
    assert store.held[("e", b"e" * 32)].nbytes == 100 * proof_pieces.FRAME_COST
    assert store.nbytes == sum(h.nbytes for h in store.held.values())
    monkeypatch.setattr(proof_pieces, "PIECES_TTL", 0.05)

    async def wait() -> None:
        store.add("late", *_piece(b"f" * 32, 0, 2, [b"y"]))  # arms the timer
        for _ in range(200):
            if not store.held:
                break
            await asyncio.sleep(0.01)  # the event loop runs the store's timer meanwhile

    asyncio.run(wait())
    assert not store.held and store.nbytes == 0
    assert refused == {"k": 1, "e": 1, "late": 1}


def test_a_proof_no_receiver_could_take_is_not_sealed():
    """Larger than a receiver checks, or more frames than it reads: kept by its holder."""
    big = tuple([b"\0" * (1 << 20)] * (MAX_PROOF_BYTES // (1 << 20) + 1))
    assert seal_proof(big, RUN, KEYS[3], 64 << 20) is None
    assert seal_proof((b"\0",) * 4097, RUN, KEYS[3], 64 << 20) is None
    assert seal_proof((b"\0",) * 4096, RUN, KEYS[3], 64 << 20) is not None


@pytest.mark.parametrize("codec", ["fp32", "fp16"])
def test_a_false_norm_proof_with_a_full_size_chunk_fits_one_evidence_frame(codec):
    """A report and one full-size chunk of the push it understates (the shortest proof of a
    tiny norm, in fp32 as large as a frame's payload can be): one ``Evidence`` frame within the
    frame size; a margin taken instead of the sealed size kept it from being handed on."""
    chunk = chunk_elements(FRAME)
    x = torch.randn(chunk, generator=torch.Generator().manual_seed(4))
    push = seal(PushSlice(run_id=RUN, fragment=0, round=3, group_id=b"g" * 16, part=1, offset=0, numel=chunk,
                          shape=(chunk,), dtype="float32", codec=codec, weight=1.0, stopping=False,
                          payload=get_codec(codec).encode(x)), LIAR)
    report = seal(PartsHeld(run_id=RUN, fragment=0, round=3, group_id=b"g" * 16, digests=(b"",) * 3,
                            norms=(0.0, 1e-3, 0.0)), LIAR)
    assert false_norm([report, push], RUN) is not None
    sealed = seal_proof((report, push), RUN, KEYS[3], FRAME)
    assert sealed is not None and len(sealed) == 1
    frame = b"".join(bytes(x) for x in sealed[0])
    assert len(frame) <= FRAME and msgpack.unpackb(verify(frame, expect=Evidence).message.payload) == [report, push]


def test_a_proof_with_a_frame_no_piece_can_hold_is_not_handed_on():
    """Nothing to split a signed frame into: a frame larger than a piece's room keeps the proof
    with its holder (it still bans the liar itself)."""
    assert seal_proof((b"\0" * FRAME, b"\0" * 10), RUN, KEYS[3], FRAME) is None
