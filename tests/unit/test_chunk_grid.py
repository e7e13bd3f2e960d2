"""Every slice travels in chunks on one grid (``protocol.butterfly.chunk_elements``): a frame
off it is refused at once, so no member can make another check thousands of tiny chunks
(quadratic work on the network thread), nor make an honest reducer's answer to an audit
outgrow the auditor's budget; and the tail of an answer that comes after its audit closed
costs the reducer nothing."""

import asyncio

import torch
from hypothesis import given, settings, strategies as st

from peer.allreduce import Averager, Group
from peer.allreduce_round import Round
from peer.audit import _Open, inputs_frames
from protocol.audit import OK, check
from protocol.butterfly import chunk_spans, on_grid
from protocol.codecs import get_codec
from protocol.envelope import seal, verify
from protocol.identity import Identity
from protocol.messages_swarm import PushSlice, SliceAveraged

RUN = b"\x09" * 20
KEYS = [Identity.from_seed(bytes([0x70 + i]) * 32) for i in range(4)]


@given(st.integers(0, 10_000), st.integers(0, 5000), st.integers(1, 700), st.integers(0, 6000), st.integers(1, 900))
@settings(max_examples=300, deadline=None)
def test_the_grid_is_exactly_the_senders_chunks(start, length, step, offset, numel):
    end = start + length
    spans = chunk_spans(start, end, step)
    assert all(on_grid(start, end, step, a, b - a) for a, b in spans)
    assert on_grid(start, end, step, start + offset, numel) == ((start + offset, start + offset + numel) in spans)


def _group(n: int, numel: int, codec: str = "fp4") -> Group:
    return Group(run_id=RUN, fragment=1, round=3, group_id=b"c" * 16, members=tuple(k.public_key for k in KEYS[:n]),
                 weights=(1.0,) * n, numel=numel, codec=codec, deadline_s=5.0)


def _push(g: Group, sender: int, part: int, values: torch.Tensor, spans) -> list[bytes]:
    c = get_codec(g.codec)
    return [seal(PushSlice(run_id=RUN, fragment=g.fragment, round=g.round, group_id=g.group_id, part=part, offset=a,
                           numel=b - a, shape=(b - a,), dtype="float32", codec=g.codec, weight=g.weights[sender],
                           stopping=False, payload=c.encode(values[a:b])), KEYS[sender]) for a, b in spans]


def test_a_push_in_tiny_chunks_drops_its_sender_at_its_first_frame():
    g = _group(3, 3 * 4096)
    rnd = Round(g, 0, torch.zeros(g.numel), get_codec("fp4"), 2.0, chunk=1024)
    s, e = rnd.bounds[0]
    tiny = _push(g, 1, 0, torch.randn(g.numel), [(a, a + 8) for a in range(s, e, 8)])
    for f in tiny:
        rnd.accept(KEYS[1].peer_id, verify(f), len(f), f)
    assert rnd.dropped[1].startswith("PushSlice:") and "grid" in rnd.dropped[1] and rnd.pushed[1] == 0
    honest = _push(g, 2, 0, torch.randn(g.numel), chunk_spans(s, e, 1024))
    for f in honest:
        rnd.accept(KEYS[2].peer_id, verify(f), len(f), f)
    assert 2 not in rnd.dropped and rnd.pushed[2] == e - s


def test_an_honest_reducers_answer_on_a_fine_grid_fits_the_auditors_budget():
    """Each contributor's slice in 16 chunks: the answer (their frames as they came, and the
    reducer's own) is whole within the budget, and checks."""
    n, numel, chunk = 4, 4 * 4096, 256
    g = _group(n, numel)
    gen = torch.Generator().manual_seed(3)
    vectors = [torch.randn(numel, generator=gen) for _ in range(n)]
    rnd = Round(g, 0, vectors[0], get_codec("fp4"), 2.0, chunk=chunk)
    s, e = rnd.bounds[0]
    for i in range(1, n):
        for f in _push(g, i, 0, vectors[i], chunk_spans(s, e, chunk)):
            rnd.accept(KEYS[i].peer_id, verify(f), len(f), f)
    c = get_codec("fp4")
    rnd.own([(a, b, c.encode(vectors[0][a:b])) for a, b in chunk_spans(s, e, chunk)],
            [[f] for f in _push(g, 0, 0, vectors[0], chunk_spans(s, e, chunk))])
    mean, contrib, total = rnd.reduce()
    inputs = rnd.commit(contrib)
    means = [seal(SliceAveraged(run_id=RUN, fragment=g.fragment, round=g.round, group_id=g.group_id, part=0, offset=a,
                                numel=b - a, shape=(b - a,), dtype="float32", codec="fp4", weight=total,
                                contributors=contrib, inputs=inputs, own=rnd.own_digests()[a],
                                payload=c.encode(mean[a - s:b - s])), KEYS[0]) for a, b in chunk_spans(s, e, chunk)]
    enc = [(a, b, c.encode(mean[a - s:b - s])) for a, b in chunk_spans(s, e, chunk)]
    rnd.reduced(contrib, enc, [[m] for m in means])
    shown = [b"".join(bytes(x) for x in f) for f in inputs_frames(rnd)]

    async def audit() -> _Open:
        pending = _Open(rnd, 0)
        for f in shown:
            pending.take(verify(f), f)
        off_grid = _push(g, 1, 0, vectors[1], [(s + 8, s + 16)])[0]  # a frame off the grid: not taken
        pending.take(verify(off_grid), off_grid)
        return pending

    pending = asyncio.run(audit())
    assert pending.done.is_set() and len(pending.frames) == len(shown) == n * (e - s) // chunk
    assert check(means, pending.frames, RUN, 2.0)[0] == OK


def test_the_tail_of_an_answer_after_its_audit_closed_costs_the_reducer_nothing():
    """A frame of an audit's answer that comes after the audit closed (a resend, or a slow
    answer's tail) is a contributor's push sent by the reducer: not a forged forward, so the
    reducer stays in the rounds we share with it now; and any bad frame naming a finished
    group costs no live round."""
    av = Averager(p2p=None, identity=KEYS[0], run_id=RUN)
    old = b"o" * 16
    av._finished.append(old)
    av.audits._closed.append((old, 1, KEYS[1].peer_id))  # we audited member 1's part 1 of the old group
    now = Group(run_id=RUN, fragment=1, round=8, group_id=b"n" * 16, members=tuple(k.public_key for k in KEYS[:3]),
                weights=(1.0,) * 3, numel=30, codec="fp32", deadline_s=5.0)
    rnd = Round(now, 0, torch.zeros(30), get_codec("fp32"), 2.0)
    av._active[now.group_id] = rnd
    late = seal(PushSlice(run_id=RUN, fragment=1, round=7, group_id=old, part=1, offset=10, numel=10, shape=(10,),
                          dtype="float32", codec="fp32", weight=1.0, stopping=False,
                          payload=get_codec("fp32").encode(torch.ones(10))), KEYS[2])
    av._on_frame(KEYS[1].peer_id, late)
    assert not rnd.dropped
    av._on_frame(KEYS[1].peer_id, seal(PushSlice(run_id=RUN, fragment=1, round=7, group_id=old, part=2, offset=20,
                                                 numel=10, shape=(10,), dtype="float32", codec="fp32", weight=1.0,
                                                 stopping=False, payload=get_codec("fp32").encode(torch.ones(10))),
                                       KEYS[2]))  # a forward of a finished group that no audit asked for
    assert not rnd.dropped
