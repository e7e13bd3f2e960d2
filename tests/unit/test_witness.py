"""Witnesses of a reducer's own slice (``protocol.butterfly.witnesses_of``, ``peer.round_witness``,
``protocol.evidence.own_contradiction``): who witnesses whom; a witness vouches for an own
slice that its reducer's mean commits to, and holds proof against one that contradicts it."""

from __future__ import annotations

import torch

from peer.allreduce import Group
from peer.allreduce_round import Round
from protocol.butterfly import slice_norm, witnessed, witnesses_of
from protocol.codecs import get_codec
from protocol.envelope import seal, verify
from protocol.evidence import own_contradiction, proves
from protocol.identity import Identity
from protocol.messages import digest
from protocol.messages_swarm import PushSlice, SliceAveraged

RUN = b"\x09" * 20
N = 4
KEYS = [Identity.from_seed(bytes([0x70 + i]) * 32) for i in range(N)]
NUMEL = 10 * N  # parts of 10
FP32 = get_codec("fp32")


def test_each_part_has_two_distinct_witnesses_and_each_member_witnesses_two_parts():
    for n in range(3, 9):
        for g in range(20):
            gid = bytes([g]) * 16
            w = [witnesses_of(j, n, gid) for j in range(n)]
            assert all(len(set(ws)) == 2 and j not in ws and all(0 <= x < n for x in ws) for j, ws in enumerate(w))
            assert all(sum(i in ws for ws in w) == 2 for i in range(n))
            assert w == [witnesses_of(j, n, gid) for j in range(n)]  # every member computes the same
    assert witnesses_of(0, 2, b"g" * 16) == () and not witnessed(2, 2.0)
    assert not witnessed(4, 0.0) and witnessed(3, 2.0)  # no clip, no screen: nothing to vouch for


def own_push(values: torch.Tensor, offset: int = 0, signer: Identity = KEYS[0], part: int = 0) -> bytes:
    return seal(PushSlice(run_id=RUN, fragment=0, round=1, group_id=GID, part=part, offset=offset,
                          numel=values.numel(), shape=(values.numel(),), dtype="float32", codec="fp32", weight=1.0,
                          stopping=False, payload=FP32.encode(values)), signer)


def mean_frame(values: torch.Tensor, own: torch.Tensor, offset: int = 0, signer: Identity = KEYS[0]) -> bytes:
    return seal(SliceAveraged(run_id=RUN, fragment=0, round=1, group_id=GID, part=0, offset=offset,
                              numel=values.numel(), shape=(values.numel(),), dtype="float32", codec="fp32",
                              weight=float(N), contributors=tuple(range(N)), inputs=b"i" * 32,
                              own=digest(FP32.encode(own)), payload=FP32.encode(values)), signer)


# a group ID whose part 0 is witnessed by member 1
GID = next(bytes([g]) * 16 for g in range(256) if 1 in witnesses_of(0, N, bytes([g]) * 16))
OWN, MEAN = torch.arange(10.0), torch.full((10,), 0.5)


def test_an_own_slice_that_contradicts_its_mean_is_proof():
    assert own_contradiction(mean_frame(MEAN, OWN), own_push(OWN), RUN) is None  # the one it committed to
    key, why = own_contradiction(mean_frame(MEAN, OWN), own_push(-OWN), RUN)
    assert key == KEYS[0].public_key and "not the one its mean commits to" in why
    assert proves([mean_frame(MEAN, OWN), own_push(-OWN)], RUN)[0] == KEYS[0].public_key
    # other offsets over the same elements: an honest reducer cuts both alike
    assert own_contradiction(mean_frame(MEAN, OWN), own_push(OWN[:5]), RUN) is not None
    # other elements, another signer, another part: nothing
    assert own_contradiction(mean_frame(MEAN[:5], OWN[:5]), own_push(-OWN[5:], offset=5), RUN) is None
    assert own_contradiction(mean_frame(MEAN, OWN), own_push(-OWN, signer=KEYS[1]), RUN) is None
    assert own_contradiction(mean_frame(MEAN, OWN), own_push(-OWN, part=1, offset=10), RUN) is None


def witness() -> Round:
    """Member 1's round, with a clip: it witnesses part 0 (and one other part)."""
    group = Group(run_id=RUN, fragment=0, round=1, group_id=GID, members=tuple(k.public_key for k in KEYS),
                  weights=(1.0,) * N, numel=NUMEL, codec="fp32", deadline_s=5.0)
    rnd = Round(group, 1, torch.zeros(NUMEL), FP32, clip=2.0)
    assert 0 in rnd.witnessing and len(rnd.witnessing) == 2
    return rnd


def deliver(rnd: Round, frame: bytes) -> None:
    v = verify(frame)
    rnd.accept(v.peer_id, v, len(frame), frame)


def test_a_witness_vouches_for_the_own_slice_its_mean_commits_to():
    rnd = witness()
    deliver(rnd, own_push(OWN))
    deliver(rnd, mean_frame(MEAN, OWN))
    report = rnd.witness_report()
    at = 2 * rnd.witnessing.index(0)
    assert report[at:at + 2] == (slice_norm(OWN), float(torch.dot(MEAN.double(), OWN.double())))
    assert -1.0 in report  # the other part it witnesses: nothing received
    assert rnd.vouched(0) == [(1, *report[at:at + 2])] and not rnd.offences


def test_a_witness_keeps_proof_against_an_own_slice_that_contradicts_the_mean():
    rnd = witness()
    deliver(rnd, own_push(-OWN))
    deliver(rnd, mean_frame(MEAN, OWN))
    at = 2 * rnd.witnessing.index(0)
    assert rnd.witness_report()[at:at + 2] == (-1.0, 0.0) and rnd.vouched(0) == []
    (key, why, frames), = rnd.offences.values()
    assert key == KEYS[0].public_key and proves(list(frames), RUN)[0] == key


def test_an_own_slice_sent_to_a_member_that_is_not_its_witness_drops_the_sender():
    rnd = witness()
    j = next(j for j in range(1, N) if j != 1 and j not in rnd.witnessing)
    deliver(rnd, own_push(OWN, offset=10 * j, signer=KEYS[j], part=j))
    assert j in rnd.dropped


def test_a_witnessed_part_landed_without_our_vouch_is_audited():
    """Its own slice never came, or its mean came after our report: the screen had one witness
    fewer, so we audit the part (``Audits.after``'s suspects); a vouched or proven part, not."""
    rnd = witness()
    deliver(rnd, mean_frame(MEAN, OWN))
    rnd.witness_report()
    assert rnd.unwitnessed() == [0]
    vouched = witness()
    deliver(vouched, own_push(OWN))
    deliver(vouched, mean_frame(MEAN, OWN))
    vouched.witness_report()
    assert vouched.unwitnessed() == []
    proven = witness()
    deliver(proven, own_push(-OWN))
    deliver(proven, mean_frame(MEAN, OWN))
    proven.witness_report()
    assert proven.unwitnessed() == []
