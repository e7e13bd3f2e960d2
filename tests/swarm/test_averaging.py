"""Butterfly all-reduce and matchmaking between real peers: one process and one p2pd each.

Peers are driven over queues: the test sends commands, each peer answers with results. Every
peer reports its p2pd's PID so that cleanup can end the daemon even when the peer was killed
(a SIGKILLed Python process leaves its daemon behind).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing as mp
import os
import queue
import signal
import time

import pytest
import torch

from peer.allreduce import RESULT_GRACE
from peer.simulation import allreduce as simulated_allreduce
from protocol.butterfly import clip_scales, slice_bounds, slice_norm
from peer.identity_store import load_or_create_identity
from protocol.codecs import get_codec
from protocol.envelope import seal
from protocol.messages import digest
from protocol.messages_swarm import PushSlice, SliceAveraged
from swarm_util import TIMED, kill_process_group

pytestmark = pytest.mark.swarm
CTX = mp.get_context("spawn")
RUN_ID = bytes(range(20))
NUMEL = 10_001  # not divisible by the group sizes: slices of unequal length
REPLY_TIMEOUT = 45.0
STARTUP_TIMEOUT = 180.0  # a peer process's start (spawn, imports, its p2p daemon), several at once on a busy machine
CLIP = 2.0  # the averagers' sync.clip (the default is 1; at 2 no honest slice here is clipped, so a
# round's `clipped` names only a liar): the references below use it too


def make_vector(seed: int, numel: int = NUMEL) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed))


def shared_vector(seed: int, common: int, factor: float, numel: int = NUMEL) -> torch.Tensor:
    """A member's vector that agrees some with the others' (a component of seed ``common``
    shared by all, as pseudo-gradients of one round agree), times ``factor``."""
    return (make_vector(seed, numel) + make_vector(common, numel)) * factor


# ---------------------------------------------------------------------------------------
# The peer process.


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def peer_main(key_path: str, initial_peers: list[str], max_frame_bytes: int, cmd_q, out_q) -> None:
    """Start a network and an averager, then run commands until told to stop."""
    from swarm_util import own_process_group

    own_process_group()
    from peer.allreduce import Averager, Group
    from peer.identity_store import load_or_create_identity
    from peer.matchmaking import Matchmaker
    from peer.network import Network, NetworkConfig
    from protocol.manifest import SwarmConfig

    logs = _Collect()
    for name in ("peer.allreduce", "peer.matchmaking"):
        logging.getLogger(name).addHandler(logs)
        logging.getLogger(name).setLevel(logging.INFO)
    ident = load_or_create_identity(key_path)
    with Network(NetworkConfig(identity_path=key_path, host_maddrs=("/ip4/127.0.0.1/tcp/0",),
                               initial_peers=tuple(initial_peers))) as net:
        av = Averager(net.p2p, ident, RUN_ID, max_frame_bytes=max_frame_bytes, clip=CLIP)
        net.call(av.start(), 30)
        out_q.put(("ready", net.visible_maddrs(), ident.public_key, net.p2p._child.pid))
        while True:
            cmd, *args = cmd_q.get()
            if cmd == "stop":
                break
            logs.lines.clear()
            if cmd == "ban":  # peer IDs this member banned for a proven lie (peer.bans keeps them in a node)
                av.banned = set(args[0])
                proofs = args[1] if len(args) > 1 else {}  # key -> the frames that prove it
                av.audits.proof_of = proofs.get
                out_q.put(("banned",))
            elif cmd == "convicted":  # wait (up to args[0] s) for proof handed to us, as the node would take it
                out_q.put(("convicted", net.call(_convicted(av, args[0]), args[0] + 5)))
            elif cmd == "gate":  # the run's sync.gate, as a node's manifest sets it
                av.direction_gate = av.audits.gate = args[0]
                out_q.put(("gated",))
            elif cmd == "cap":  # the volunteer's bandwidth caps, bytes per second
                av.upload.set_rate(args[0])
                av.download.set_rate(args[1])
                out_q.put(("capped",))
            elif cmd == "allreduce":
                fields, seed, behaviour = args
                group = Group(**fields)
                vec = make_vector(seed, group.numel)
                me = group.members.index(ident.public_key)
                if behaviour.startswith("scale:"):  # a liar: valid frames, values scaled
                    vec, behaviour = vec * float(behaviour[6:]), "honest"
                if behaviour.startswith("shared:"):  # with a component shared by the group (seed C), times F
                    _, common, factor = behaviour.split(":")
                    vec, behaviour = shared_vector(seed, int(common), float(factor), group.numel), "honest"
                if behaviour.startswith("start:"):  # honest, but busy (starved) for that long before its round
                    time.sleep(float(behaviour[6:]))
                    behaviour = "honest"
                if behaviour != "bad":
                    fault(av, behaviour)
                    out = net.call(av.allreduce(group, vec, group.weights[me]), 60)
                    out_q.put(("done", out.average.numpy().tobytes(), out.dropped, out.fallback_parts,
                               out.bytes_sent, out.elapsed_s, list(logs.lines),
                               {"repaired": out.repaired_parts, "agreed": out.agreed, "partial": out.partial_parts,
                                "clipped": out.clipped, "gated": out.gated, "offences": [(k, why) for k, why, _ in out.offences],
                                "followed": out.followed}))
                else:
                    net.call(send_bad_slices(av, group, vec, me), 30)
                    out_q.put(("sent",))
            elif cmd == "match":
                round_, group_size, timeout_s, seed, weight, max_weight = args
                swarm = SwarmConfig(group_size=group_size, matchmaking_timeout_s=timeout_s, allreduce_timeout_s=10.0)
                mm = Matchmaker(net.dht, ident, RUN_ID, swarm, poll_s=0.25, max_weight=max_weight)
                group = net.call(mm.form_group(0, round_, weight, NUMEL, "fp32"), 60)
                if group is None:
                    out_q.put(("matched", None, None))
                    continue
                out = net.call(av.allreduce(group, make_vector(seed), weight), 60)
                out_q.put(("matched", dataclasses.asdict(group), out.average.numpy().tobytes()))
        net.call(av.shutdown(), 10)


async def _convicted(av, timeout: float) -> list[bytes]:
    """The keys of the liars proven to ``av`` (``Audits.offences``), once there is one."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not av.audits.offences and loop.time() < end:
        await asyncio.sleep(0.05)
    return [key for key, _why, _proof in av.audits.offences]


def fault(av, behaviour: str) -> None:
    """Asymmetric faults of an honest-looking member, made by wrapping its averager's sends:
    ``withhold:K`` sends its reduced part to every contributor but member K (and does not
    resend it when K reports lacking it: the others must forward it); ``late:K`` pushes
    its slice to reducer K only after the push deadline (K drops it as late); ``equivocate:K``
    sends member K its reduced part x1000, validly signed, and everyone else the true one;
    ``lateequiv:K`` sends everyone the true one and, once K's report (holding it) is in, K
    the x1000 one, before our own report to K (a proof the reports do not show);
    ``lose:first`` loses the first stream each peer opens to it, as the libp2p daemon can
    (the frame is never read, so never acknowledged: ``peer.outbox``); ``inflate:F`` reduces
    its part as it should, then multiplies the mean by F before it encodes, signs, sends and
    keeps it: one consistent lie, the same bytes for everyone; ``hush`` pushes its slices and
    then sends nothing more; ``slowmean`` (honest, on a slow uplink) gets its reduced part, and
    its forwards of it, to nobody before the agreement's deadline; ``honest`` none."""
    import asyncio

    av._deliver = type(av)._deliver.__get__(av)  # undo a fault of the previous command
    av._on_frame = type(av)._on_frame.__get__(av)
    av._encode = type(av)._encode.__get__(av)
    av._report = type(av)._report.__get__(av)
    if behaviour == "honest":
        return
    if behaviour == "hush":  # it pushes, and then sends nothing: no part, no report, no forward
        deliver = av._deliver

        async def pushes_only(rnd, j, frames, deadline, sent, drop_on_failure):
            return await deliver(rnd, j, frames, deadline, sent, drop_on_failure) if drop_on_failure else True

        async def no_report(rnd, i, frames):
            return None

        av._deliver, av._report = pushes_only, no_report
        return
    if behaviour == "slowmean":  # a slow uplink: our reduced part, and each forward of it, reach nobody in time
        deliver = av._deliver

        async def slow(rnd, j, frames, deadline, sent, drop_on_failure):
            if frames is rnd.frames.get(rnd.me):
                await asyncio.sleep(max(0.0, rnd.agree_deadline - asyncio.get_running_loop().time()) + 0.5)
            return await deliver(rnd, j, frames, deadline, sent, drop_on_failure)

        av._deliver = slow
        return
    kind, k = behaviour.split(":")
    if kind == "inflate":  # as a reducer, our mean times k to everyone (and held so ourselves)
        encode = av._encode
        av._encode = lambda rnd, part, values: encode(rnd, part, values * float(k))
        return
    if kind == "lose":
        lost: set[str] = set()
        on_frame = av._on_frame

        def lossy(peer_id, data):
            if peer_id not in lost:
                lost.add(peer_id)
                raise ConnectionResetError("lost in transit (a test's fault)")
            return on_frame(peer_id, data)

        av._on_frame = lossy
        return
    target, deliver = int(k), av._deliver
    if kind == "lateequiv":  # the true mean to everyone; once K reported holding it, another x1000 to K
        report = av._report

        async def late_second_mean(rnd, i, frames):
            if i == target:  # our own report to K waits until K has reported, then the second mean goes first
                loop = asyncio.get_running_loop()
                while target not in rnd.reports and loop.time() < rnd.agree_deadline:
                    await asyncio.sleep(0.01)  # (the liar looks; ``rnd.changed`` is the averager's to clear)
                second = [other_mean(av, b"".join(bytes(x) for x in f), 1000.0) for f in rnd.frames.get(rnd.me, [])]
                await av._send_frames(rnd.peer_ids[i], second)
            await report(rnd, i, frames)

        av._report = late_second_mean
        return

    async def faulty(rnd, j, frames, deadline, sent, drop_on_failure):
        if j == target and kind == "withhold" and frames is rnd.frames.get(rnd.me):
            return True  # our mean, withheld from one contributor, also when it reports lacking it
        if j == target and kind == "equivocate" and frames is rnd.frames.get(rnd.me):
            frames = [other_mean(av, b"".join(bytes(x) for x in f), 1000.0) for f in frames]
        if j == target and kind == "late" and drop_on_failure:
            loop = asyncio.get_running_loop()
            await asyncio.sleep(max(0.0, deadline - loop.time()) + 0.3)
            deadline = loop.time() + 5.0
        return await deliver(rnd, j, frames, deadline, sent, drop_on_failure)

    av._deliver = faulty


def other_mean(av, frame: bytes, factor: float) -> list[bytes]:
    """Our signed reduced part ``frame``, its values times ``factor``, signed again."""
    from peer.node.faults import _scaled

    return [_scaled(av, frame, factor)]


async def send_bad_slices(av, group, vec: torch.Tensor, me: int) -> None:
    """To member 0 a slice with a broken signature, to member 1 one of the wrong shape, to
    member 2 one holding a NaN, to member 3 one 256 elements short (off the grid of chunks):
    each is signed (or nearly) by us and otherwise well-formed."""
    from protocol.envelope import seal
    from protocol.identity import peer_id_from_public_key
    from protocol.messages_swarm import PushSlice

    bounds = slice_bounds(group.numel, len(group.members))
    for j, kind in enumerate(("forged", "shape", "nan", "short")):
        s, e = bounds[j]
        if kind == "short":
            e -= 256
        values = vec[s:e].clone()
        shape = (e - s,)
        if kind == "shape":
            shape = (1, e - s)
        if kind == "nan":
            values[7] = float("nan")
        payload = values.numpy().tobytes()  # fp32 by hand: the codec refuses to encode a NaN
        msg = PushSlice(run_id=group.run_id, fragment=group.fragment, round=group.round, group_id=group.group_id,
                        part=j, offset=s, numel=e - s, shape=shape, dtype="float32", codec=group.codec,
                        weight=group.weights[me], stopping=False, payload=payload)
        frame = bytearray(seal(msg, av.identity))
        if kind == "forged":
            frame[-1] ^= 0x01  # the payload no longer matches the signature
        await av._send_frames(peer_id_from_public_key(group.members[j]), [[bytes(frame)]])


# ---------------------------------------------------------------------------------------
# The test side.


@dataclasses.dataclass
class Peer:
    proc: mp.Process
    cmd: object
    out: object
    public_key: bytes = b""
    daemon_pid: int = 0
    maddrs: list = dataclasses.field(default_factory=list)

    def reply(self, timeout: float = REPLY_TIMEOUT):
        try:
            return self.out.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"peer pid={self.proc.pid} did not answer within {timeout} s") from None


@pytest.fixture
def swarm(tmp_path):
    """``start(n)`` -> n ready peers, all bootstrapped from the first; all ended afterwards."""
    peers: list[Peer] = []

    def start(n: int, max_frame_bytes: int = 64 << 20) -> list[Peer]:
        new = []
        for _i in range(n):
            cmd, out = CTX.Queue(), CTX.Queue()
            initial = peers[0].maddrs if peers else []
            proc = CTX.Process(target=peer_main, args=(str(tmp_path / f"peer{len(peers)}.key"), initial,
                                                       max_frame_bytes, cmd, out), daemon=True)
            proc.start()
            peer = Peer(proc, cmd, out)
            peers.append(peer)
            new.append(peer)
            if len(peers) == 1:  # the others need its address
                _, peer.maddrs, peer.public_key, peer.daemon_pid = peer.reply(STARTUP_TIMEOUT)
        for peer in new:
            if not peer.public_key:
                kind, peer.maddrs, peer.public_key, peer.daemon_pid = peer.reply(STARTUP_TIMEOUT)
                assert kind == "ready"
        return new

    yield start
    for p in peers:
        if p.proc.is_alive():
            p.cmd.put(("stop",))
    for p in peers:
        p.proc.join(15)
        if p.proc.is_alive():
            p.proc.kill()
            p.proc.join(5)
        kill_process_group(p.proc.pid)  # its p2pd, also if it was killed before it told us the daemon's PID
        _kill(p.daemon_pid)


def _kill(pid: int) -> None:
    if pid:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def group_fields(peers: list[Peer], weights: list[float], codec: str, group_id: bytes, deadline_s: float = 8.0,
                 numel: int = NUMEL) -> dict:
    return {"run_id": RUN_ID, "fragment": 3, "round": 11, "group_id": group_id,
            "members": tuple(p.public_key for p in peers), "weights": tuple(weights), "numel": numel, "codec": codec,
            "deadline_s": deadline_s}


def partial_reference(vectors: list[torch.Tensor], weights: list[float], alive: list[int], codec_name: str,
                      idle: tuple[int, ...] = ()):
    """What member j of a group of len(vectors) holds for its part when only ``alive`` took
    part (peer.simulation.allreduce's arithmetic, with the dead left out of the mean), the
    members ``idle`` reducing nothing."""
    codec, n = get_codec(codec_name), len(vectors)
    out = {}
    total = float(sum(weights[i] for i in alive))
    for j, (s, e) in enumerate(slice_bounds(vectors[0].numel(), n, idle)):
        if j not in alive:
            continue
        # every contribution as encoded, the reducer's own too (as its witnesses get it)
        norms = [slice_norm(codec.decode(codec.encode(vectors[i][s:e]), e - s)) for i in alive]
        acc = torch.zeros(e - s)
        for i, scale in zip(alive, clip_scales(norms, CLIP)):
            codec.decode_add_(acc, codec.encode(vectors[i][s:e]), weights[i] / total * scale)
        out[j] = codec.decode(codec.encode(acc), e - s)
    return out


def as_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.float32)


@TIMED
def test_four_peers_get_the_bit_identical_weighted_mean_in_fp32_and_fp4(swarm):
    # 8 KiB frames: every slice of ~2500 elements goes as three messages per direction
    peers = swarm(4, max_frame_bytes=8192)
    weights = [1.0, 2.0, 3.0, 4.5]
    vectors = [make_vector(100 + i) for i in range(4)]
    exact_mean = sum(w * v.double() for w, v in zip(weights, vectors)) / sum(weights)
    for codec, tol in (("fp32", 1e-6), ("fp4", 0.35)):
        fields = group_fields(peers, weights, codec, group_id=codec.encode().ljust(16, b"\0"))
        for i, p in enumerate(peers):
            p.cmd.put(("allreduce", fields, 100 + i, "honest"))
        replies = [p.reply() for p in peers]
        ref, ref_sent = simulated_allreduce(vectors, weights, get_codec(codec), CLIP)
        for kind, avg, dropped, fallback, sent, _elapsed, _, _ in replies:
            assert kind == "done" and dropped == () and fallback == ()
            assert avg == replies[0][1]  # bit-identical on every member
            got = as_tensor(avg)
            assert torch.equal(got, ref)  # and the same bytes as the in-process reference
            assert float((got.double() - exact_mean).abs().max()) < tol * float(exact_mean.abs().max())
            assert sent >= ref_sent[0] * 0.9  # the encoded slices, plus envelopes


@TIMED
def test_under_the_direction_gate_a_push_against_the_others_counts_for_nothing_at_every_reducer(swarm):
    """Member 3 pushes its vector x -2 (validly signed, within what the clip brings down to an
    honest norm). Under the direction gate (a run's ``sync.gate``) every reducer, the liar's
    own part too, leaves it out of its mean: each member lands the same bytes, those of the
    simulation under the gate, and not those of the clip alone."""
    peers = swarm(4)
    for p in peers:
        p.cmd.put(("gate", True))
        assert p.reply()[0] == "gated"
    weights = [1.0, 2.0, 1.5, 1.0]
    fields = group_fields(peers, weights, "fp4", group_id=b"gate".ljust(16, b"\0"))
    for i, p in enumerate(peers):
        p.cmd.put(("allreduce", fields, 700 + i, "shared:777:-2" if i == 3 else "shared:777:1"))
    replies = [p.reply() for p in peers]
    vectors = [shared_vector(700 + i, 777, -2.0 if i == 3 else 1.0) for i in range(4)]
    gated, _ = simulated_allreduce(vectors, weights, get_codec("fp4"), CLIP, gate=True)
    clipped, _ = simulated_allreduce(vectors, weights, get_codec("fp4"), CLIP)
    for kind, avg, dropped, fallback, _, _, _, extra in replies:
        assert kind == "done" and dropped == () and fallback == ()
        assert avg == replies[0][1]  # bit-identical on every member
        assert torch.equal(as_tensor(avg), gated) and not torch.equal(as_tensor(avg), clipped)
        assert extra["gated"] == (3,) and extra["agreed"]  # every reducer took out the liar's push, and it alone


@TIMED
def test_a_killed_member_and_a_stalled_one_are_dropped_and_the_others_finish(swarm):
    peers = swarm(5)
    weights = [1.0, 1.0, 2.0, 2.0, 3.0]
    victim, stalled = 2, 4  # stalled: alive, its averager receives, but it never sends a thing
    deadline = 4.0
    fields = group_fields(peers, weights, "fp32", group_id=b"killed".ljust(16, b"\0"), deadline_s=deadline)
    # it joined the group (it is a member), then its machine died: the process and its daemon
    peers[victim].proc.kill()
    peers[victim].proc.join(5)
    _kill(peers[victim].daemon_pid)
    alive = [0, 1, 3]
    for i in alive:
        peers[i].cmd.put(("allreduce", fields, 200 + i, "honest"))
    vectors = [make_vector(200 + i) for i in range(5)]
    ref = partial_reference(vectors, weights, alive, "fp32")
    bounds = slice_bounds(NUMEL, 5)
    for i in alive:
        kind, avg, dropped, fallback, _, elapsed, lines, _ = peers[i].reply()
        got = as_tensor(avg)
        assert kind == "done" and dropped == (victim, stalled) and fallback == (victim, stalled)
        assert bool(torch.isfinite(got).all())
        # the dead one is unreachable at once; the stalled one is dropped at the slice deadline
        # (it sent nothing: its report is not waited for)
        assert deadline - 0.5 < elapsed < (1 + RESULT_GRACE) * deadline + 1.0
        assert any("reason=timeout" in ln and f"peer={_peer_id(peers[stalled].public_key)}" in ln for ln in lines)
        for j in alive:
            s, e = bounds[j]
            assert torch.equal(got[s:e], ref[j])  # re-weighted over the three that took part
        for j in (victim, stalled):
            s, e = bounds[j]
            assert torch.equal(got[s:e], vectors[i][s:e])  # a dropped reducer's part: our own values


def test_forged_misshapen_nan_and_short_slices_drop_their_sender(swarm):
    peers = swarm(5)
    weights = [1.0, 2.0, 3.0, 4.0, 5.0]
    bad = 4
    fields = group_fields(peers, weights, "fp32", group_id=b"bad".ljust(16, b"\0"), deadline_s=6.0)
    honest = [0, 1, 2, 3]
    peers[bad].cmd.put(("allreduce", fields, 303, "bad"))
    assert peers[bad].reply()[0] == "sent"  # usually buffered by the others, who have not started yet
    for i in honest:
        peers[i].cmd.put(("allreduce", fields, 300 + i, "honest"))
    vectors = [make_vector(300 + i) for i in range(5)]
    ref = partial_reference(vectors, weights, honest, "fp32")
    bounds = slice_bounds(NUMEL, 5)
    bad_id = _peer_id(peers[bad].public_key)
    # the short slice is off the run's grid of chunks: refused at its frame, not at the deadline
    # (reason=timeout); a stream that ends with a slice short of chunks on the grid drops its
    # sender when it ends (tests/unit/test_banned_member.py)
    reasons = {0: "VerificationError", 1: "shape", 2: "NaN", 3: "not on the run's grid"}
    results = []
    for i in honest:
        kind, avg, dropped, fallback, _, _, lines, info = peers[i].reply()
        assert kind == "done" and dropped == (bad,) and fallback == (bad,)
        assert any(f"peer={bad_id}" in ln and reasons[i] in ln and "reason=" in ln for ln in lines), lines
        # the misshapen and the NaN slice are signed proof of a lie (protocol.evidence); a broken
        # signature proves nothing about anyone, and a short slice could be a slow sender's
        assert [k for k, _ in info["offences"]] == ([peers[bad].public_key] if i in (1, 2) else [])
        got = as_tensor(avg)
        results.append(got)
        for j in honest:
            s, e = bounds[j]
            assert torch.equal(got[s:e], ref[j])  # the honest members' mean, without the bad one
    s, e = bounds[bad]
    assert all(torch.equal(a[:s], results[0][:s]) for a in results)  # identical outside the fallback part


def test_a_banned_members_pushes_are_left_out_by_the_reducer_that_banned_it_and_all_still_agree(swarm, tmp_path):
    """Member 0 banned member 2 (a proven lie in an earlier round; the others have not seen
    it). Member 0's part is the mean of 0 and 1 only; every other part counts all three; and
    since each reducer decides its own contributors, all three land the same average. Member
    0 hands its proof to member 1 as the round starts, so member 1 bans member 2 as well."""
    peers = swarm(3)
    weights = [1.0, 2.0, 3.0]
    liar = load_or_create_identity(str(tmp_path / "peer2.key"))
    assert liar.public_key == peers[2].public_key
    nan = torch.full((16,), float("nan")).numpy().tobytes()
    proof = seal(PushSlice(run_id=RUN_ID, fragment=3, round=2, group_id=b"earlier".ljust(16, b"\0"), part=0,
                           offset=0, numel=16, shape=(16,), dtype="float32", codec="fp32", weight=1.0,
                           stopping=False, payload=nan), liar)  # what it pushed an earlier round
    peers[0].cmd.put(("ban", [_peer_id(peers[2].public_key)], {peers[2].public_key: (proof,)}))
    assert peers[0].reply()[0] == "banned"
    fields = group_fields(peers, weights, "fp4", group_id=b"banned".ljust(16, b"\0"))
    for i, p in enumerate(peers):
        p.cmd.put(("allreduce", fields, 500 + i, "honest"))
    replies = [p.reply() for p in peers]
    vectors = [make_vector(500 + i) for i in range(3)]
    ref_all = partial_reference(vectors, weights, [0, 1, 2], "fp4")
    ref_without = partial_reference(vectors, weights, [0, 1], "fp4")
    bounds = slice_bounds(NUMEL, 3)
    for kind, avg, dropped, fallback, *_ in replies:
        assert kind == "done" and dropped == () and fallback == () and avg == replies[0][1]
    got = as_tensor(replies[0][1])
    assert torch.equal(got[bounds[0][0]:bounds[0][1]], ref_without[0])
    for j in (1, 2):
        assert torch.equal(got[bounds[j][0]:bounds[j][1]], ref_all[j])
    peers[1].cmd.put(("convicted", 20.0))
    assert peers[1].reply() == ("convicted", [peers[2].public_key])
    peers[2].cmd.put(("convicted", 0.5))
    assert peers[2].reply() == ("convicted", [])  # nobody hands the liar its own proof


def test_a_proof_larger_than_a_frame_reaches_the_group_in_pieces(swarm, tmp_path):
    """Peers whose frames are 16 KiB: member 0's proof against member 2 (two different means
    it signed for one part, 12 KiB each) fits no frame, so it goes to member 1 as
    ``EvidencePiece`` frames over the real streams, and member 1 bans member 2 on it (before
    pieces, a proof larger than a frame stayed with the member that found it)."""
    frame = 16 << 10
    peers = swarm(3, max_frame_bytes=frame)
    liar = load_or_create_identity(str(tmp_path / "peer2.key"))
    assert liar.public_key == peers[2].public_key

    def mean(value: float) -> bytes:
        payload = get_codec("fp32").encode(torch.full((3000,), value))
        return seal(SliceAveraged(run_id=RUN_ID, fragment=3, round=2, group_id=b"earlier".ljust(16, b"\0"), part=2,
                                  offset=0, numel=3000, shape=(3000,), dtype="float32", codec="fp32", weight=3.0,
                                  contributors=(0, 1, 2), inputs=b"i" * 32, own=digest(payload), payload=payload), liar)

    proof = (mean(1.0), mean(2.0))
    assert sum(map(len, proof)) > frame
    peers[0].cmd.put(("ban", [_peer_id(peers[2].public_key)], {peers[2].public_key: proof}))
    assert peers[0].reply()[0] == "banned"
    fields = group_fields(peers, [1.0, 1.0, 1.0], "fp32", group_id=b"pieces".ljust(16, b"\0"), numel=30_000)
    # (fp32, 30,000 elements: member 0 sends more in the round than the proof, which it may hand on after it)
    for i, p in enumerate(peers):
        p.cmd.put(("allreduce", fields, 700 + i, "honest"))
    assert all(p.reply()[0] == "done" for p in peers)
    peers[1].cmd.put(("convicted", 20.0))
    assert peers[1].reply() == ("convicted", [peers[2].public_key])


@TIMED
def test_asymmetric_drops_are_repaired_within_the_round_so_every_member_lands_the_same_average(swarm):
    """Member 1 withholds its reduced part from member 3; member 2 pushes its slice to
    reducer 0 after the deadline, so 0 averages without it. Before the agreement, 3 lacked
    part 1 and 2 lacked part 0 (sent to 0's contributors only), and each used its own values
    there. Now the others forward part 1 to 3 (signed by its reducer; the withholder does not
    resend), 0 sends 2 its part once 2's late push shows it is in the round (or another member
    forwards it on 2's report), and all four members end the round with the same bytes."""
    peers = swarm(4)
    weights = [1.0, 2.0, 3.0, 4.0]
    deadline = 3.0
    fields = group_fields(peers, weights, "fp32", group_id=b"asymmetric".ljust(16, b"\0"), deadline_s=deadline)
    faults = {0: "honest", 1: "withhold:3", 2: "late:0", 3: "honest"}
    for i, p in enumerate(peers):
        p.cmd.put(("allreduce", fields, 400 + i, faults[i]))
    replies = [p.reply() for p in peers]
    vectors = [make_vector(400 + i) for i in range(4)]
    bounds = slice_bounds(NUMEL, 4)
    without_2 = partial_reference(vectors, weights, [0, 1, 3], "fp32")
    full = partial_reference(vectors, weights, [0, 1, 2, 3], "fp32")
    for i, (kind, avg, dropped, fallback, _, elapsed, lines, more) in enumerate(replies):
        assert kind == "done" and fallback == (), (i, dropped, fallback, lines)
        assert more["agreed"], (i, lines)
        assert avg == replies[0][1], f"member {i} landed another average: {lines}"
        got = as_tensor(avg)
        assert torch.equal(got[slice(*bounds[0])], without_2[0])  # reducer 0 dropped the late slice
        for j in (1, 2, 3):
            assert torch.equal(got[slice(*bounds[j])], full[j])
        assert elapsed < (1 + RESULT_GRACE) * deadline + 2.0, "the agreement did not wait for the deadline"
    assert 1 in replies[3][7]["repaired"]  # (2 gets part 0 from 0 or, on its report, forwarded: either comes first)
    assert any("forwarding reduced part" in ln for r in replies for ln in r[6])


def test_a_reducer_whose_part_reached_nobody_in_time_does_not_say_agreed_where_the_others_fell_back(swarm):
    """Member 3's reduced part, and its forwards of it to the members that reported lacking
    it, come too late: the others fall back on part 3. Member 3 holds its own part and every
    report, so its agreement completes; but a forward it made was not acknowledged by the
    round's end, so it cannot know the others landed part 3 and must not say agreed (it lands
    apart from them, and only a round that is not agreed has the nodes compare states)."""
    peers = swarm(4)
    weights = [1.0, 2.0, 3.0, 4.0]
    fields = group_fields(peers, weights, "fp32", group_id=b"slow-uplink".ljust(16, b"\0"), deadline_s=2.0)
    for i, p in enumerate(peers):
        p.cmd.put(("allreduce", fields, 480 + i, "slowmean" if i == 3 else "honest"))
    replies = [p.reply() for p in peers]
    for i, (kind, avg, dropped, fallback, _, _, lines, more) in enumerate(replies[:3]):
        assert kind == "done" and fallback == (3,) and not more["agreed"], (i, dropped, fallback, lines)
        end = slice_bounds(NUMEL, 4)[2][1]  # parts 0-2 alike (on part 3 each keeps its own values)
        assert torch.equal(as_tensor(avg)[:end], as_tensor(replies[0][1])[:end]), f"member {i}: {lines}"
    kind, _, _, fallback, _, _, lines, more = replies[3]
    assert kind == "done" and fallback == () and not more["agreed"], lines
    assert any("not acknowledged in time" in ln for ln in lines), lines


def test_a_member_that_starts_after_the_others_landed_lands_what_they_landed(swarm):
    """Members 0 and 1 average while member 2 has not started (starved, or busy with its
    previous round): they drop it at the push deadline and land without it, falling back on
    its part. Member 2 then starts, with their pushes, reports and finals waiting for it. It
    reduces its part over all three slices, but the others' finals say they landed without
    it: it falls back on its part as they did, takes their parts from their finished rounds,
    and lands the same bytes."""
    peers = swarm(3)
    weights = [1.0, 2.0, 3.0]
    deadline = 2.0
    fields = group_fields(peers, weights, "fp32", group_id=b"late-starter".ljust(16, b"\0"), deadline_s=deadline)
    for i in (0, 1):
        peers[i].cmd.put(("allreduce", fields, 500 + i, "honest"))
    early = [peers[i].reply() for i in (0, 1)]
    peers[2].cmd.put(("allreduce", fields, 502, "honest"))
    late = peers[2].reply()
    vectors = [make_vector(500 + i) for i in range(3)]
    without_2 = partial_reference(vectors, weights, [0, 1], "fp32")
    bounds = slice_bounds(NUMEL, 3)
    for i, (kind, avg, dropped, fallback, *_, lines, _) in enumerate([*early, late]):
        # a part fallen back on holds each member's own values (a node lands zeros there)
        assert kind == "done" and fallback == (2,), (i, dropped, fallback, lines)
        got = as_tensor(avg)
        for j in (0, 1):
            assert torch.equal(got[slice(*bounds[j])], without_2[j]), f"member {i} landed another part {j}: {lines}"
        assert torch.equal(got[slice(*bounds[2])], vectors[i][slice(*bounds[2])])
    assert late[7]["followed"] == (2,) and set(late[7]["repaired"]) == {0, 1}, late[6]
    # it saw the others' finals agree with what it landed; they could not tell whether it
    # would (it never reported in their rounds), so they will compare states after the round
    assert late[7]["agreed"] and not early[0][7]["agreed"], late[6]


@TIMED
def test_a_stream_lost_in_transit_is_sent_again_and_the_round_completes_long_before_its_deadline(swarm):
    """Member 2 loses the first stream every other member opens to it (pushes for its part, or
    its reduced parts), as the bundled libp2p daemon does now and then with a stream written and
    closed at once. Unacknowledged, each is sent again: nobody is dropped, every member lands
    the full average, and the round takes seconds, not the deadline."""
    peers = swarm(4)
    weights = [1.0, 2.0, 3.0, 4.0]
    deadline = 12.0
    fields = group_fields(peers, weights, "fp32", group_id=b"lost-stream".ljust(16, b"\0"), deadline_s=deadline)
    for i, p in enumerate(peers):
        p.cmd.put(("allreduce", fields, 450 + i, "lose:first" if i == 2 else "honest"))
    replies = [p.reply() for p in peers]
    ref, _ = simulated_allreduce([make_vector(450 + i) for i in range(4)], weights, get_codec("fp32"), CLIP)
    for i, (kind, avg, dropped, fallback, _, elapsed, lines, more) in enumerate(replies):
        assert kind == "done" and dropped == () and fallback == (), (i, dropped, fallback, lines)
        assert torch.equal(as_tensor(avg), ref), f"member {i} landed another average: {lines}"
        assert more["agreed"] and elapsed < deadline / 2, (i, elapsed, lines)
    resent = [ln for r in replies for ln in r[6] if "sending them again" in ln]
    assert len(resent) >= 3, resent  # each of the three others had a stream to 2 lost


@TIMED
def test_a_reducer_that_sends_one_member_another_mean_is_proven_to_and_falls_back_on_every_member(swarm):
    """Member 0 sends member 2 its reduced part x1000 (validly signed) and the others the true
    one. The members' reports show two digests of part 0; 2 and the others forward each other
    their frames, so each holds two different means signed by 0: proof. Every honest member
    falls back on part 0 (its own values there; the node turns that into zeros, the same on
    every member), lands the same bytes in the other parts, and keeps the proof against 0."""
    peers = swarm(4)
    fields = group_fields(peers, [1.0] * 4, "fp32", group_id=b"equivocate".ljust(16, b"\0"), deadline_s=3.0)
    faults = {0: "equivocate:2", 1: "honest", 2: "honest", 3: "honest"}
    for i, p in enumerate(peers):
        p.cmd.put(("allreduce", fields, 500 + i, faults[i]))
    replies = [p.reply() for p in peers]
    bounds = slice_bounds(NUMEL, 4)
    honest = [replies[i] for i in (1, 2, 3)]
    for kind, avg, dropped, fallback, _, elapsed, lines, more in honest:
        assert kind == "done" and fallback == (0,), (dropped, fallback, lines)
        assert more["agreed"], lines
        assert [why for _, why in more["offences"]] and all("two different means" in why for _, why in more["offences"])
        assert [k for k, _ in more["offences"]] == [peers[0].public_key]
        assert as_tensor(avg)[bounds[0][1]:].equal(as_tensor(honest[0][1])[bounds[0][1]:])  # parts 1-3 alike
        assert any("reducer equivocated" in ln for ln in lines)
        assert elapsed < (1 + RESULT_GRACE) * 3.0 + 2.0, "the proof did not come before the agreement's deadline"


def test_a_second_mean_sent_to_one_member_after_the_reports_is_proven_but_every_member_lands_the_reported_one(swarm):
    """Member 0 sends everyone its true reduced part; once member 2 has reported holding it,
    0 sends 2 that part x1000 (validly signed) and only then its own report. The reports showed
    one mean of part 0, so only 2 (and whoever it hands the proof to) learns of the second:
    falling back on the part there would leave 2 apart from the others until a repair. Every
    honest member lands the same bytes, part 0 included (the mean they all reported), and 2
    holds the proof against 0 (and says not agreed: with a colluder, a liar could have shown
    members different reports, so its node compares states after the round)."""
    peers = swarm(4)
    fields = group_fields(peers, [1.0] * 4, "fp32", group_id=b"late-equivocate".ljust(16, b"\0"), deadline_s=3.0)
    faults = {0: "lateequiv:2", 1: "honest", 2: "honest", 3: "honest"}
    for i, p in enumerate(peers):
        p.cmd.put(("allreduce", fields, 550 + i, faults[i]))
    replies = [p.reply() for p in peers]
    honest = [replies[i] for i in (1, 2, 3)]
    for kind, avg, dropped, fallback, _, _, lines, _ in honest:
        assert kind == "done" and fallback == () and not dropped, (dropped, fallback, lines)
        assert as_tensor(avg).equal(as_tensor(honest[0][1]))  # every part alike, part 0 included
    _, _, _, _, _, _, lines, more = replies[2]
    assert any("reducer equivocated" in ln for ln in lines) and not more["agreed"], lines
    assert [k for k, _ in more["offences"]] == [peers[0].public_key]


@pytest.mark.parametrize("factor", [1000.0, 1e30])
def test_a_reducer_that_sends_everyone_one_inflated_mean_is_not_believed_by_anyone(swarm, factor):
    """Member 1 returns its reduced part x1000 (or x1e30: finite, validly encoded and signed)
    to every member alike, and holds it so itself: no two means to compare. Each member's
    report carries the norms of its own slices, so every member knows how large a mean of
    part 1 can be, finds it far larger, and audits it before landing: the liar shows its
    inputs, which prove its mean wrong, so every honest member falls back on part 1 and bans
    it; the liar's final (it landed its mean) counts for nothing; the other parts land alike."""
    peers = swarm(4)
    fields = group_fields(peers, [1.0, 2.0, 1.0, 3.0], "fp4", group_id=b"inflate".ljust(16, b"\0"), deadline_s=3.0)
    faults = {0: "honest", 1: f"inflate:{factor:g}", 2: "honest", 3: "honest"}
    for i, p in enumerate(peers):
        p.cmd.put(("allreduce", fields, 700 + i, faults[i]))
    replies = [p.reply() for p in peers]
    bounds = slice_bounds(NUMEL, 4)
    honest = [replies[i] for i in (0, 2, 3)]
    for kind, avg, dropped, fallback, _, _, lines, more in honest:
        assert kind == "done" and fallback == (1,) and not dropped, (dropped, fallback, lines)
        assert any("reduced part too large" in ln for ln in lines), lines
        assert any("audit: reducer signed a wrong mean part=1" in ln for ln in lines), lines
        assert more["agreed"] and not more["offences"]  # one mean for all: no frame fails a check alone
        values = as_tensor(avg)
        assert torch.isfinite(values).all()
        for j in (0, 2, 3):  # the other parts: the same bytes on every honest member
            s, e = bounds[j]
            assert values[s:e].equal(as_tensor(honest[0][1])[s:e])
    # the same round with member 1 honest: nobody falls back (the bound holds for true means)
    for i, p in enumerate(peers):
        p.cmd.put(("allreduce", dict(fields, group_id=b"inflate-no".ljust(16, b"\0")), 700 + i, "honest"))
    for kind, _, dropped, fallback, _, _, lines, _ in (p.reply() for p in peers):
        assert kind == "done" and fallback == () and not dropped, (fallback, lines)


def _peer_id(public_key: bytes) -> str:
    from protocol.identity import peer_id_from_public_key

    return peer_id_from_public_key(public_key)


def test_matchmaking_puts_five_peers_in_consistent_bounded_groups_and_a_lone_peer_gets_none(swarm):
    peers = swarm(5)
    keys = [p.public_key for p in peers]
    weights = [1.0 + i for i in range(5)]
    vectors = {keys[i]: make_vector(500 + i) for i in range(5)}
    for round_, group_size in ((1, 3), (2, 2)):
        for i, p in enumerate(peers):
            p.cmd.put(("match", round_, group_size, 5.0, 500 + i, weights[i], 1e18))
        replies = [p.reply() for p in peers]
        groups: dict[bytes, tuple[bytes, ...]] = {}
        alone = []
        for i, (kind, fields, avg) in enumerate(replies):
            assert kind == "matched"
            if fields is None:
                alone.append(i)
                continue
            assert keys[i] in fields["members"] and 2 <= len(fields["members"]) <= group_size
            assert groups.setdefault(fields["group_id"], fields["members"]) == fields["members"]  # same order
            members = fields["members"]
            ref, _ = simulated_allreduce([vectors[k] for k in members], list(fields["weights"]), get_codec("fp32"), CLIP)
            assert torch.equal(as_tensor(avg), ref)  # and the group really averaged
        in_groups = [k for m in groups.values() for k in m]
        assert len(in_groups) == len(set(in_groups))  # nobody in two groups
        assert sorted(in_groups + [keys[i] for i in alone]) == sorted(keys)  # everybody somewhere
        assert len(alone) == (1 if group_size == 2 else 0)  # only the odd one out of 5 in pairs

    peers[0].cmd.put(("match", 3, 2, 3.0, 500, weights[0], 1e18))  # nobody else is ready for round 3
    kind, fields, _ = peers[0].reply()
    assert kind == "matched" and fields is None


def test_a_validly_signed_liar_moves_the_mean_a_bounded_amount_and_cannot_overweight_itself(swarm):
    """Member 3 follows the protocol but pushes its vector x1e29 (values near 1e29: finite,
    validly fp4-encoded). Every reducer, the liar's own code included, scales its slice down
    to CLIP x the lower median norm, so all four land the reference's clipped mean, close to
    the honest one, instead of ~1e28 (which turned every honest model into NaN). Then a
    member that declares more weight than the run allows for one sync is left out of the
    groups: the honest peers average among themselves."""
    peers = swarm(4)
    weights = [1.0, 1.0, 1.0, 1.0]
    fields = group_fields(peers, weights, "fp4", group_id=b"liar".ljust(16, b"\0"), deadline_s=6.0)
    for i, p in enumerate(peers):
        p.cmd.put(("allreduce", fields, 600 + i, "scale:1e29" if i == 3 else "honest"))
    replies = [p.reply() for p in peers]
    vectors = [make_vector(600 + i) for i in range(4)]
    vectors[3] = vectors[3] * 1e29
    ref, _ = simulated_allreduce(vectors, weights, get_codec("fp4"), CLIP)
    plain, _ = simulated_allreduce(vectors, weights, get_codec("fp4"), 0.0)
    honest = sum(vectors[:3]) / 4
    for i, (kind, avg, dropped, fallback, _, _, lines, more) in enumerate(replies):
        assert kind == "done" and dropped == () and fallback == (), (i, lines)
        assert avg == replies[0][1] and torch.equal(as_tensor(avg), ref)
        assert more["clipped"] == (3,), (i, lines)  # every reducer scaled the liar's slice, and only it
    got = as_tensor(replies[0][1])
    # the liar's share is at most CLIP x an honest slice's norm / 4 (plus the codec's error)
    for s, e in slice_bounds(NUMEL, 4):
        bound = CLIP * max(float(v[s:e].norm()) for v in vectors[:3]) / 4
        assert float((got[s:e] - honest[s:e]).norm()) < 1.2 * bound
    assert float(plain.abs().max()) > 1e27  # what the plain mean would have landed

    heavy = [1.0, 1.0, 1.0, 50.0]  # member 3's join claims 50 tokens; the run allows 10 per sync
    for i, p in enumerate(peers):
        p.cmd.put(("match", 7, 4, 4.0, 700 + i, heavy[i], 1e18 if i == 3 else 10.0))
    replies = [p.reply() for p in peers]
    keys = [p.public_key for p in peers]
    for kind, group, _ in replies[:3]:
        assert kind == "matched" and group is not None and sorted(group["members"]) == sorted(keys[:3])


def test_bandwidth_caps_hold_the_averaging_streams_to_the_volunteers_rate(swarm):
    a, b = swarm(2)
    numel = 1_000_000  # fp32: each peer sends 2 MB of its push and 2 MB of its mean
    rate = 2e6  # bytes per second, upload of peer a only
    a.cmd.put(("cap", rate, 0.0))
    assert a.reply()[0] == "capped"
    fields = group_fields([a, b], [1.0, 1.0], "fp32", b"\x07" * 16, deadline_s=30.0, numel=numel)
    for i, p in enumerate((a, b)):
        p.cmd.put(("allreduce", fields, i, "honest"))
    out_a, out_b = a.reply(60), b.reply(60)
    assert out_a[0] == out_b[0] == "done" and out_a[1] == out_b[1]  # still the same, correct average
    expected = (make_vector(0, numel) + make_vector(1, numel)) / 2
    assert torch.allclose(torch.frombuffer(bytearray(out_a[1]), dtype=torch.float32), expected, atol=1e-6)
    sent, elapsed = out_a[4], out_a[5]
    burst = rate * 0.25  # what the bucket lets through at once
    print(f"capped peer sent {sent / 1e6:.2f} MB in {elapsed:.2f} s (cap {rate / 1e6:.1f} MB/s); "
          f"uncapped peer took {out_b[5]:.2f} s")
    assert sent >= 4e6 and elapsed >= (sent - burst) / rate * 0.9, "the cap was not enforced"
