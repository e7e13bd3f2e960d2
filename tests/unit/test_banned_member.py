"""A member banned for a proven lie, in a round that starts after the ban (peer.allreduce_round):
its pushes are not averaged, but they are counted, so its lateness is judged as anyone's. It
used to be waited for until the means' deadline (1.5 x the push deadline a late member gets),
and a member that had not banned it yet when its round began dropped it as late 4 s before the
others; on CI those then ran apart and timed out on each other for rounds. No network: frames
go from the test to a Round by hand."""

import torch

from peer.allreduce import Group
from peer.allreduce_round import Round
from protocol.codecs import get_codec
from protocol.envelope import seal, verify
from protocol.identity import Identity
from protocol.messages import digest
from protocol.messages_swarm import PartsHeld, PushSlice, SliceAveraged

RUN = b"\x07" * 20
GID = b"b" * 16
N = 3
KEYS = [Identity.from_seed(bytes([0x60 + i]) * 32) for i in range(N)]
NUMEL = 10 * N  # parts of 10
BANNED = 2


def member(chunk: int = 10) -> Round:
    """Member 0's round, with member 2 banned before it began (slices sent in chunks of ``chunk``)."""
    group = Group(run_id=RUN, fragment=0, round=1, group_id=GID, members=tuple(k.public_key for k in KEYS),
                  weights=(1.0,) * N, numel=NUMEL, codec="fp32", deadline_s=5.0)
    return Round(group, 0, torch.ones(NUMEL), get_codec("fp32"), excluded=frozenset({BANNED}),
                 banned=frozenset({KEYS[BANNED].peer_id}), chunk=chunk)


def push(rnd: Round, sender: int, value: float, numel: int = 10) -> None:
    """``sender``'s slice of part 0 (ours): ``numel`` of its 10 elements, all ``value``."""
    msg = PushSlice(run_id=RUN, fragment=0, round=1, group_id=GID, part=0, offset=0, numel=numel, shape=(numel,),
                    dtype="float32", codec="fp32", weight=1.0, stopping=False,
                    payload=get_codec("fp32").encode(torch.full((numel,), value)))
    frame = seal(msg, KEYS[sender])
    v = verify(frame)
    rnd.accept(v.peer_id, v, len(frame), frame)


def test_a_banned_members_push_is_waited_for_like_anyones_and_left_out_of_the_mean():
    rnd = member()
    push(rnd, 1, 3.0)
    assert not rnd.pushes_done()  # the banned member's push is due too: it is alive, it may be late
    push(rnd, BANNED, 1000.0)
    assert rnd.pushes_done() and rnd.pushed[BANNED] == 10 and BANNED not in rnd.dropped
    rnd.own([(0, 10, get_codec("fp32").encode(torch.ones(10)))], [])  # our own slice, as we average it
    mean, contrib, total = rnd.reduce()
    assert contrib == (0, 1) and total == 2.0 and torch.equal(mean, torch.full((10,), 2.0))


def test_a_banned_members_short_stream_drops_it_at_once_as_anyones_does():
    rnd = member(chunk=5)
    push(rnd, BANNED, 1.0, numel=5)
    rnd.stream_ended(KEYS[BANNED].peer_id, PushSlice, rnd.me)
    assert rnd.dropped[BANNED].startswith("short:")


def test_a_banned_member_cannot_send_one_element_twice():
    rnd = member(chunk=5)
    push(rnd, BANNED, 1.0, numel=5)
    push(rnd, BANNED, 2.0, numel=5)  # offset 0 again: overlaps the chunk already counted
    assert rnd.dropped[BANNED].startswith("PushSlice:") and rnd.pushed[BANNED] == 5


def test_a_banned_member_dropped_as_late_is_not_waited_for_to_call_the_round_agreed():
    """Member 1 and we hold parts 0 and 1; the banned member pushed nothing and never reports.
    Dropped as late, it is not what keeps the round from being agreed (an unagreed round makes
    the node compare states and start a new lineage)."""
    rnd = member()
    rnd.collecting_pushes = False
    rnd.drop(BANNED, "timeout:slice not received in time")
    for j in (0, 1):
        values = torch.full((10,), 1.0 + j)
        payload = get_codec("fp32").encode(values)
        frame = seal(SliceAveraged(run_id=RUN, fragment=0, round=1, group_id=GID, part=j, offset=10 * j, numel=10,
                                   shape=(10,), dtype="float32", codec="fp32", weight=2.0, contributors=(0, 1),
                                   inputs=b"i" * 32, own=digest(payload), payload=payload), KEYS[j])
        if j == 0:
            rnd.own([(0, 10, payload)], [])  # its own slice as it averaged it: here, its mean's bytes
            rnd.reduced((0, 1), [(0, 10, payload)], [[frame]])
        else:
            v = verify(frame)
            rnd.accept(v.peer_id, v, len(frame), frame)
    report = seal(PartsHeld(run_id=RUN, fragment=0, round=1, group_id=GID, digests=rnd.digests()), KEYS[1])
    v = verify(report)
    rnd.accept(v.peer_id, v, len(report), report)
    assert rnd.agreed() and rnd.settled()
    rnd.banned = frozenset()  # the same member, not banned: its report would be wanted
    assert not rnd.settled()
