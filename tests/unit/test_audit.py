"""Audits of a reducer's mean (protocol.audit, peer.audit.inputs_frames): an honest reducer's
mean always follows from the inputs it committed to; a lie of plausible size (negated, another
member's, a heavier own weight) is proven by the frames alone; and nobody can frame an honest
reducer by showing other inputs than the ones it committed to."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from types import SimpleNamespace

import msgpack
import pytest
import torch
from hypothesis import example, given, settings, strategies as st

from peer.allreduce import Group
from peer.allreduce_round import Round
from peer import proofs as proofs_module
from peer.audit import Audits, inputs_frames
from peer.bans import Bans
from peer.distrust import Distrust
from protocol.audit import NOT_COMMITTED, OK, UNPROVEN, WRONG, check, wrong_mean
from protocol.codecs import get_codec
from protocol.envelope import seal, verify
from protocol.evidence import proves
from protocol.identity import Identity, peer_id_from_public_key
from protocol.messages_swarm import Evidence, PushSlice, SliceAveraged

RUN = b"\x07" * 20
KEYS = [Identity.from_seed(bytes([0x40 + i]) * 32) for i in range(5)]


def _group(n: int, numel: int, codec: str, weights: tuple[float, ...]) -> Group:
    return Group(run_id=RUN, fragment=1, round=3, group_id=b"a" * 16, members=tuple(k.public_key for k in KEYS[:n]),
                 weights=weights, numel=numel, codec=codec, deadline_s=5.0)


def _push(g: Group, sender: int, part: int, values: torch.Tensor, step: int) -> list[bytes]:
    s, e = Round(g, sender, values, get_codec(g.codec)).bounds[part]
    frames = []
    for a in range(s, e, step):
        b = min(a + step, e)
        frames.append(seal(PushSlice(run_id=RUN, fragment=g.fragment, round=g.round, group_id=g.group_id, part=part,
                                     offset=a, numel=b - a, shape=(b - a,), dtype="float32", codec=g.codec,
                                     weight=g.weights[sender], stopping=False, payload=get_codec(g.codec).encode(values[a:b])),
                           KEYS[sender]))
    return frames


def reduce_and_audit(vectors: list[torch.Tensor], codec: str, weights: tuple[float, ...], clip: float,
                     step: int, lie=None, gate: bool = False) -> tuple[list[bytes], list[bytes], Round]:
    """Member 0 reduces part 0 of a group of len(vectors), as peer.allreduce does it, and shows
    its inputs to an auditor. ``lie`` changes the mean it signs. -> (mean frames, inputs, round)."""
    n, numel = len(vectors), vectors[0].numel()
    g = _group(n, numel, codec, weights)
    rnd = Round(g, 0, vectors[0], get_codec(codec), clip, chunk=step, gate=gate)
    for i in range(1, n):
        for f in _push(g, i, 0, vectors[i], step):
            rnd.accept(peer_id_from_public_key(KEYS[i].public_key), verify(f), len(f), f)
    s0, e0 = rnd.bounds[0]
    own = [(a, min(a + step, e0), get_codec(codec).encode(vectors[0][a:min(a + step, e0)])) for a in range(s0, e0, step)]
    rnd.own(own, [[f] for f in _push(g, 0, 0, vectors[0], step)])  # as it seals them for its witness
    mean, contrib, total = rnd.reduce()
    inputs = rnd.commit(contrib)
    if lie is not None:
        mean = lie(mean, vectors)
    s, e = rnd.bounds[0]
    c = get_codec(codec)
    means = [seal(SliceAveraged(run_id=RUN, fragment=g.fragment, round=g.round, group_id=g.group_id, part=0,
                                offset=a, numel=min(a + step, e) - a, shape=(min(a + step, e) - a,), dtype="float32",
                                codec=codec, weight=total, contributors=contrib, inputs=inputs,
                                own=rnd.own_digests()[a], payload=c.encode(mean[a - s:min(a + step, e) - s])), KEYS[0])
             for a in range(s, e, step)]
    shown = [b"".join(bytes(x) for x in f) for f in inputs_frames(rnd)]
    return means, shown, rnd


def _vectors(n: int, numel: int, seed: int = 0, spread: float = 1.0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(numel, generator=gen) * spread ** (i / max(1, n - 1)) for i in range(n)]


@pytest.mark.parametrize("codec", ["fp32", "int8", "fp4"])
@pytest.mark.parametrize("clip", [0.0, 2.0])
def test_an_honest_reducers_mean_follows_from_its_inputs(codec, clip):
    vectors = _vectors(4, 4 * 1000)
    vectors[2] = vectors[2] * 1000  # one contribution clipped
    means, shown, _ = reduce_and_audit(vectors, codec, (1.0, 2.0, 3.0, 1.5), clip, step=256)
    assert check(means, shown, RUN, clip)[0] == OK
    assert wrong_mean(means + shown, RUN, clip) is None
    assert proves(means + shown, RUN, clip) is None


@settings(max_examples=40, deadline=None)
@given(n=st.integers(2, 5), per=st.integers(1, 700), codec=st.sampled_from(["fp32", "fp16", "bf16", "int8", "fp4"]),
       clip=st.sampled_from([0.0, 1.0, 2.0, 5.0]), spread=st.floats(1e-3, 1e3), seed=st.integers(0, 2**16),
       step=st.sampled_from([256, 512]), gate=st.booleans(), against=st.booleans())
@example(n=2, per=378, codec="fp4", clip=0.0, spread=1.84375, seed=378, step=256, gate=False, against=False)
# (one block's scale a step apart from the re-encoded recomputed mean's: an honest reducer convicted)
def test_honest_means_always_pass(n, per, codec, clip, spread, seed, step, gate, against):
    """Over codecs, clips, sizes and weights, with the direction gate (``gate``) too, and with
    the last member pushing against the others (``against``: gated where the gate acts)."""
    weights = tuple(float(1 + (seed + i) % 7) for i in range(n))
    vectors = _vectors(n, n * per, seed, spread)
    if against:
        vectors[-1] = -2.0 * sum(vectors[:-1])
    means, shown, _ = reduce_and_audit(vectors, codec, weights, clip, step, gate=gate)
    assert check(means, shown, RUN, clip, gate)[0] == OK


def _negate(mean, _vectors):
    return -mean


def _another_members(mean, vectors):
    return vectors[1][: mean.numel()].clone()


def _shifted(mean, _vectors):
    return mean + 0.3 * mean.norm() / mean.numel() ** 0.5


def _scaled(mean, _vectors):
    return mean * 1.1


def _largest_negated(mean, _vectors):
    out = mean.clone()
    top = mean.abs().topk(4).indices
    out[top] = -out[top]
    return out


def _negated_one_saturated(mean, _vectors):
    out = -mean
    out[0] = torch.finfo(torch.float32).max  # clamped to the codec's range when encoded
    return out


@pytest.mark.parametrize("lie", [_scaled, _largest_negated, _negated_one_saturated])
@pytest.mark.parametrize("codec", ["fp16", "bf16", "int8", "fp4"])
def test_a_lie_cannot_hide_in_the_codecs_rounding(lie, codec):
    """Each value of the mean is allowed its own code's rounding, and each block scale its own,
    not one budget for the whole part: with that budget (the codec's error bound) an fp4 mean
    x1.1 or with its 4 largest values negated passed, and with fp16 or bf16 any mean with one
    saturated value (its bound is infinite)."""
    means, shown, _ = reduce_and_audit(_vectors(4, 4 * 1000, seed=3), codec, (1.0,) * 4, 2.0, 256, lie)
    verdict, _, why = check(means, shown, RUN, 2.0)
    assert verdict == WRONG, why


@pytest.mark.parametrize("lie", [_negate, _another_members, _shifted])
@pytest.mark.parametrize("codec", ["fp32", "fp4"])
def test_a_plausible_wrong_mean_is_proven_by_its_frames(lie, codec, tmp_path):
    means, shown, _ = reduce_and_audit(_vectors(4, 4 * 1000, seed=3), codec, (1.0, 1.0, 1.0, 1.0), 2.0, 256, lie)
    verdict, key, why = check(means, shown, RUN, 2.0)
    assert (verdict, key) == (WRONG, KEYS[0].public_key), why
    bans = Bans(tmp_path, RUN, 2.0)
    assert bans.add(KEYS[0].public_key, why, tuple(means + shown))
    again = Bans(tmp_path, RUN, 2.0)  # the evidence on disk proves it at the next start
    again.load()
    assert again.reason(KEYS[0].public_key) is not None


def _on_the_line(n: int, per: int, colluders: int) -> list[torch.Tensor]:
    """Members 0 .. n - colluders - 1 push correlated values on the first half of each part; each
    colluder on a block of the second half of its own (every dot with the others exactly 0)."""
    gen = torch.Generator().manual_seed(11)
    honest, half = n - colluders, per // 2
    block = (per - half) // colluders // 32 * 32
    out = []
    for i in range(n):
        v = torch.zeros(n * per)
        for p in range(n):
            if i < honest:
                v[p * per:p * per + half] = 1.0 + torch.randn(half, generator=gen)
            else:
                a = p * per + half + (i - honest) * block
                v[a:a + block] = torch.randn(block, generator=gen)
        out.append(v)
    return out


@pytest.mark.parametrize("codec", ["fp32", "int8", "fp4"])
@pytest.mark.parametrize("lie", [None, _negate, _shifted, _another_members])
def test_under_the_gate_pushes_on_its_line_leave_several_sets_and_the_audit_still_decides(codec, lie):
    """Three colluders of five push where nobody else does: each may have been gated or not, and
    the audit tries every such set (nearest first, and a set whose mean is twice as far as any
    that could pass is skipped without recomputing it, where the codec does not clamp): the
    honest mean passes, and a negated, shifted or another member's one is proven wrong (a first version
    recomputed every set: 13.6x an honest audit's time for a negated mean with nine colluders
    of eleven, ``bench/audit_cost.py``)."""
    vectors = _on_the_line(5, 1024, 3)
    means, shown, _ = reduce_and_audit(vectors, codec, (1.0,) * 5, 1.0, 256, lie, gate=True)
    verdict, _, why = check(means, shown, RUN, 1.0, gate=True)
    assert verdict == (OK if lie is None else WRONG), why


def test_inputs_other_than_the_committed_ones_prove_nothing():
    vectors = _vectors(3, 3 * 600, seed=5)
    means, shown, _ = reduce_and_audit(vectors, "fp4", (1.0, 1.0, 1.0), 2.0, 256)
    # a contributor signs a second, different push and hands it on: it does not match the commitment
    g = _group(3, vectors[0].numel(), "fp4", (1.0, 1.0, 1.0))
    other = _push(g, 1, 0, -vectors[1], 256)
    swapped = [f for f in shown if verify(f).signer != KEYS[1].public_key] + other
    # other inputs than committed (when they cover the whole part, no crash does that: peer.audit
    # then shuts the reducer out for good; a cut answer is only incomplete, and suspends it)
    assert check(means, swapped, RUN, 2.0)[::2] == (UNPROVEN, NOT_COMMITTED)
    assert check(means, shown[:-1], RUN, 2.0)[0] == UNPROVEN  # incomplete
    assert check(means, [], RUN, 2.0)[0] == UNPROVEN
    assert wrong_mean(means + swapped, RUN, 2.0) is None


def test_a_reducer_that_shows_a_heavier_own_weight_than_it_signed_is_proven():
    vectors = _vectors(3, 3 * 300, seed=9)
    means, shown, rnd = reduce_and_audit(vectors, "fp32", (1.0, 1.0, 1.0), 2.0, 256)
    heavier = []
    for f in shown:
        v = verify(f)
        if v.signer == KEYS[0].public_key:  # its own slice, now claimed at weight 5
            f = seal(dataclasses.replace(v.message, weight=5.0), KEYS[0])
        heavier.append(f)
    # the weight is part of the commitment: a reducer that shows another one did not show its inputs
    assert check(means, heavier, RUN, 2.0)[::2] == (UNPROVEN, NOT_COMMITTED)


def test_proof_handed_on_by_another_member_is_checked_here_and_convicts_only_when_it_proves():
    means, shown, _ = reduce_and_audit(_vectors(3, 3 * 500, seed=11), "fp4", (1.0, 1.0, 1.0), 2.0, 256, _negate)
    honest_means, honest_shown, _ = reduce_and_audit(_vectors(3, 3 * 500, seed=11), "fp4", (1.0, 1.0, 1.0), 2.0, 256)
    distrusted = Distrust()
    audits = Audits(SimpleNamespace(run_id=RUN, identity=KEYS[4], banned=set(), _side_tasks=set()), rate=0.0,
                    clip=2.0)
    audits.distrust = distrusted

    def hand_on(sender: str, frames: list[bytes] | bytes) -> None:
        payload = frames if isinstance(frames, bytes) else msgpack.packb(frames, use_bin_type=True)

        async def check() -> None:  # checked off the event loop: wait for the check's verdict
            task = audits.evidence(sender, Evidence(run_id=RUN, payload=payload))
            if task is not None:
                await task

        asyncio.run(check())

    hand_on("a", honest_means + honest_shown)  # an honest mean: proves nothing
    hand_on("a", b"\x93not frames")
    hand_on("a", means + shown[:-1])  # incomplete
    assert not audits.offences and not distrusted.active()
    hand_on("b", means + shown)
    assert [key for key, _, _ in audits.offences] == [KEYS[0].public_key]
    assert distrusted.banned(KEYS[0].public_key) and distrusted.active() == {KEYS[0].public_key}
    hand_on("c", means + shown)  # the same liar again: already convicted
    assert len(audits.offences) == 1
    for _ in range(20):  # a sender whose evidence proves nothing gets a bounded number of checks
        hand_on("d", [b"not a frame", b"nor this"])
    assert audits._refused["d"] == audits._checked["d"] == 16


def test_proof_handed_on_is_checked_one_at_a_time_off_the_event_loop_and_a_flood_is_dropped(monkeypatch):
    """Checks run in a worker thread, one at a time (one that waited for a liar proven
    meanwhile is not run); past 8 waiting, more proof is dropped unread, so a burst cannot
    hold unbounded frames."""
    means, shown, _ = reduce_and_audit(_vectors(3, 3 * 500, seed=12), "fp4", (1.0, 1.0, 1.0), 2.0, 256, _negate)
    audits = Audits(SimpleNamespace(run_id=RUN, identity=KEYS[4], banned=set(), _side_tasks=set()), rate=0.0,
                    clip=2.0)
    payload = msgpack.packb(means + shown, use_bin_type=True)
    threads, real = [], proofs_module.proves

    def proves(*a, **kw):  # the real check, noting the thread it runs on
        threads.append(threading.get_ident())
        return real(*a, **kw)

    monkeypatch.setattr(proofs_module, "proves", proves)

    async def burst() -> list:
        loop_thread = threading.get_ident()
        tasks = [audits.evidence(f"sender{i}", Evidence(run_id=RUN, payload=payload)) for i in range(12)]
        await asyncio.gather(*[t for t in tasks if t is not None])
        assert len(threads) == 1 and loop_thread not in threads  # one check: the others waited, then knew
        return tasks

    tasks = asyncio.run(burst())
    assert [t is not None for t in tasks] == [True] * 8 + [False] * 4
    assert [key for key, _, _ in audits.offences] == [KEYS[0].public_key]  # convicted once
    assert audits._checking_bytes == 0 and not audits._checking


def test_a_proof_we_hold_costs_the_sender_no_check():
    """Proof against a liar we convicted already returns at once and uses none of the
    sender's checks (members that hold one proof hand it to each other, routinely)."""
    means, shown, _ = reduce_and_audit(_vectors(3, 3 * 500, seed=13), "fp4", (1.0, 1.0, 1.0), 2.0, 256, _negate)
    audits = Audits(SimpleNamespace(run_id=RUN, identity=KEYS[4], banned=set(), _side_tasks=set()), rate=0.0,
                    clip=2.0)
    payload = msgpack.packb(means + shown, use_bin_type=True)

    async def hand_on() -> None:
        task = audits.evidence("a", Evidence(run_id=RUN, payload=payload))
        await task
        for _ in range(300):
            assert audits.evidence("b", Evidence(run_id=RUN, payload=payload)) is None

    asyncio.run(hand_on())
    assert audits._checked == {"a": 1} and len(audits.offences) == 1


def _recording_holder(liar: Identity, monkeypatch) -> tuple[Audits, list[str]]:
    """``_holder_of_proof``, and the peers it sends to, in order (nothing goes out)."""
    audits, sent = _holder_of_proof(liar), []

    async def send(peer_id, frames, timeout):
        sent.append(peer_id)

    monkeypatch.setattr(audits, "_send", send)
    return audits, sent


def _holder_of_proof(liar: Identity, banned: set[str] | None = None) -> Audits:
    """An ``Audits`` that holds proof against ``liar`` (a NaN slice it signed)."""
    nan = torch.full((10,), float("nan")).numpy().tobytes()
    proof = (seal(PushSlice(run_id=RUN, fragment=1, round=2, group_id=b"e" * 16, part=0, offset=0, numel=10,
                            shape=(10,), dtype="float32", codec="fp32", weight=1.0, stopping=False, payload=nan),
                  liar),)
    audits = Audits(SimpleNamespace(run_id=RUN, identity=KEYS[0], banned=banned or set(), _side_tasks=set(),
                                    max_frame_bytes=1 << 20), rate=0.0, clip=2.0)
    audits.proof_of = {liar.public_key: proof}.get
    return audits


def test_spread_hands_a_saved_proof_on_after_the_round_within_the_bytes_it_sent(monkeypatch):
    """A banned member in our group: our proof goes to the others not told yet, at most as
    many bytes as we sent in the round, once per member."""
    n, banned = 6, 5
    g = Group(run_id=RUN, fragment=1, round=3, group_id=b"s" * 16, members=tuple(k.public_key for k in KEYS[:4])
              + tuple(Identity.from_seed(bytes([0x90 + i]) * 32).public_key for i in range(2)),
              weights=(1.0,) * n, numel=60, codec="fp32", deadline_s=5.0)
    rnd = Round(g, 0, torch.zeros(60), get_codec("fp32"), 2.0, excluded=frozenset({banned}))
    liar = Identity.from_seed(bytes([0x91]) * 32)
    audits, sent = _recording_holder(liar, monkeypatch)
    size = sum(len(x) for frame in audits._sealed_proof(RUN, liar.public_key) for x in frame)

    async def rounds() -> None:
        rnd.sent[0] = 2 * size + 1  # room for two of the four members
        audits.spread(rnd)
        await asyncio.gather(*audits.averager._side_tasks)
        assert sorted(sent) == sorted(rnd.peer_ids[1:3])
        audits.spread(rnd)  # the next round beside it: the two not told yet
        await asyncio.gather(*audits.averager._side_tasks)
        assert sorted(sent) == sorted(rnd.peer_ids[1:5])
        audits.spread(rnd)  # everyone told: nothing more
        await asyncio.gather(*audits.averager._side_tasks)
        assert len(sent) == 4

    asyncio.run(rounds())


def test_gossip_hands_a_proof_to_peers_whose_heartbeats_lack_the_ban_a_few_per_interval(monkeypatch):
    """Peers whose heartbeats do not list a ban we hold proof for get the proof: at most
    ``fanout`` per call (one call per heartbeat interval), each (peer, liar) once, none to a
    peer we banned; a call while the last one's sends are under way sends nothing."""
    liar = Identity.from_seed(bytes([0x91]) * 32)
    peers = [f"p{i}" for i in range(7)]
    audits = _holder_of_proof(liar, banned={"p6"})
    sent: list[str] = []
    gate = asyncio.Event()

    async def send(peer_id, frames, timeout):
        (frame,) = frames  # a proof that convicts the liar
        payload = verify(b"".join(frame), run_id=RUN).message.payload
        assert proves(msgpack.unpackb(payload), RUN, 2.0)[0] == liar.public_key
        sent.append(peer_id)
        await gate.wait()

    monkeypatch.setattr(audits, "_send", send)
    lacking = [(p, liar.public_key) for p in peers]

    async def intervals() -> None:
        first = asyncio.ensure_future(audits.gossip(lacking, 2, 1.0))
        await asyncio.sleep(0)
        assert await audits.gossip(lacking, 2, 1.0) == 0  # the first is still sending
        gate.set()
        assert await first == 2
        while await audits.gossip(lacking, 2, 1.0):
            pass

    asyncio.run(intervals())
    assert sorted(sent) == peers[:6] and len(sent) == 6  # everyone once, not the banned one


def test_gossip_goes_to_partners_first_and_hands_one_proof_to_a_bounded_number_of_peers(monkeypatch):
    """Keys that post heartbeats listing no ban cannot make us upload a proof without end: one
    proof goes to at most ``_GOSSIP_PER_LIAR`` peers, those that averaged with us lately first."""
    monkeypatch.setattr(proofs_module, "_GOSSIP_PER_LIAR", 3)
    liar = Identity.from_seed(bytes([0x92]) * 32)
    audits, sent = _recording_holder(liar, monkeypatch)
    sybils = [(f"s{i}", liar.public_key) for i in range(50)]

    async def intervals() -> None:
        assert await audits.gossip(sybils + [("honest", liar.public_key)], 2, 1.0, prefer=frozenset({"honest"})) == 2
        while await audits.gossip(sybils, 2, 1.0):
            pass

    asyncio.run(intervals())
    assert sent[0] == "honest" and len(sent) == 3
