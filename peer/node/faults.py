"""Lies, for the swarm tests: ``SWARMSTREAM_FAULT=lie:KIND[+KIND...]`` makes this node a validly
signed peer that lies in the ways docs/THREAT_MODEL.md lists, so that a test can run real
honest nodes beside it and check what they land. Nothing a volunteer runs sets it.

- ``push1000``: its pseudo-gradient x1000 in every push (finite, validly encoded);
- ``push1e30``: values near 1e30 in every push;
- ``aim``: a constant direction (every element alike) at twice its pseudo-gradient's norm in
  every push: within a clip of 2 it counts whole and pushes every weight the same way each
  round (at the default clip of 1, brought down to the lower median);
- ``pushneg``: its pseudo-gradient x -2 in every push (likewise);
- ``mean1000``: as a reducer, its mean x1000 to everyone (and so held itself: one lie, no two
  means to compare);
- ``negate``: as a reducer, its mean negated, to everyone: a lie of plausible size, which only
  an audit of its inputs shows (``peer.audit``);
- ``equivocate``: as a reducer, its mean x1000 to one member, the true one to the others;
- ``withhold``: as a reducer, its mean to every contributor but one;
- ``replay``: with every push, its push of the previous round to that peer again (signed for
  the old group);
- ``short``: every push 256 elements short of its slice (validly signed, well-formed, its last
  chunk off the grid of chunks: refused at once);
- ``mute``: never answers an audit of its means (honest ones): what a peer killed right after
  a round looks like to its auditors;
- ``disown``: as a reducer, sends its witnesses its own slice negated (validly signed) while
  its mean commits to, and averages, the true one (``peer.round_witness``);
- ``blind``: as a reducer, sends its witnesses nothing, so that none can vouch for its own
  slice and the screen must take it as anything up to the clip;
- ``hush``: pushes its slices, then sends nothing more: no reduced part, no report, no
  forward, nor its own slice to its witnesses, nor an audit's answer (a member that took part
  and fell silent);
- ``ghost``: joins every round another peer joins (a valid ``JoinGroup``; it follows the group
  record, or writes it as a leader) and then sends nothing at all, nor answers an audit; it
  averages its own rounds alone, at the others' pace (``make_ghost``);
- ``misreport``: its report (``PartsHeld``) to one member says its pushes had norms 1000 times
  smaller, and the others get the true one: different words to different members. The member
  lied to may screen out an honest reducer's mean that the others land; it audits that part
  before landing, lands it, and its audit's pushes prove the lie (THREAT_MODEL.md, "Different
  words to different members"); so does any audit of a part the liar pushed to;
- ``finals``: its final (``PartsHeld`` with ``final``) to one member says it fell back on every
  part, and the others get the true one: two finals it signed for one round that contradict
  each other, which the members' relays bring together (``protocol.evidence.contradicting_finals``);
- ``nolead``: with ``ghost``, writes no record of a group it leads (ranked first in its batch):
  its followers find none by their deadline and go on without it
  (``peer.matchmaking.Matchmaker._without_leader``).

The member lied to or withheld from is the one after it in the group's order.

And a slow member, for the same tests: ``SWARMSTREAM_FAULT=stall:F:R:AT`` blocks this node's network
thread once, in fragment F's round R (or the first later one it averages in a group), from right
after its pushes went out and it reduced its part (before its sends of that part go out) until
AT x the all-reduce deadline after it entered the round: what a member starved of CPU does to
its group (its part reaches the others after their deadline, it reads theirs after its own,
and it answers nobody meanwhile). The stall ends at a fixed point of the round's deadlines, not after a fixed time
from a moment that the machine's load moves, so a test knows how long the agreement has left.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

import torch

from peer.allreduce import AGREE_GRACE, RESULT_GRACE
from protocol.codecs import get_codec
from protocol.envelope import seal, verify
from protocol.messages_swarm import PartsHeld

LIES = frozenset({"push1000", "push1e30", "aim", "pushneg", "mean1000", "negate", "equivocate", "withhold", "replay", "short", "mute",
                  "disown", "blind", "ghost", "hush", "nolead", "misreport", "finals"})


def parse_lies(fault: str) -> frozenset[str]:
    """The lies a ``SWARMSTREAM_FAULT`` value asks for (none unless it starts with ``lie:``)."""
    kind, _, what = fault.partition(":")
    if kind != "lie":
        return frozenset()
    lies = frozenset(what.split("+"))
    if not lies or not lies <= LIES:
        raise ValueError(f"SWARMSTREAM_FAULT lie:{what}: each lie is one of {', '.join(sorted(LIES))}")
    return lies


def make_liar(averager: Any, lies: frozenset[str]) -> None:
    """Wrap ``averager``'s methods so that it tells ``lies`` (it signs them all validly)."""
    allreduce, encode, deliver = averager.allreduce, averager._encode, averager._deliver

    async def lying_allreduce(group, vector: torch.Tensor, weight: float, **kw: Any):
        if "push1000" in lies:
            vector = vector * 1000.0
        if "push1e30" in lies:
            vector = torch.full_like(vector, 1e30)
        if "aim" in lies:  # the norm of the whole vector, spread alike over its elements
            vector = torch.full_like(vector, 2.0 * float(vector.double().norm()) / max(1, vector.numel()) ** 0.5)
        if "pushneg" in lies:
            vector = vector * -2.0
        return await allreduce(group, vector, weight, **kw)

    def lying_encode(rnd, part: int, values: torch.Tensor):
        if part == rnd.me and "mean1000" in lies:
            values = values * 1000.0
        if part == rnd.me and "negate" in lies:
            values = -values
        chunks = encode(rnd, part, values)
        if part != rnd.me and "short" in lies and chunks and chunks[-1][1] - chunks[-1][0] > 256:
            a, b, _ = chunks[-1]
            s = rnd.bounds[part][0]
            chunks[-1] = (a, b - 256, rnd.codec.encode(values[a - s:b - 256 - s]))
        return chunks

    pushed: dict[str, list] = {}  # peer ID -> the frames we last pushed to it

    async def lying_deliver(rnd, j: int, frames, deadline, sent, drop_on_failure):
        if "hush" in lies and not drop_on_failure:  # anything but a push
            return True  # as if sent: its own round goes on as before
        ours = frames is rnd.frames.get(rnd.me)  # our reduced part, not a push or a forward
        if frames is rnd.own_frames and "blind" in lies:  # our own slice, to a witness
            return True
        if frames is rnd.own_frames and "disown" in lies:
            frames = [[_scaled(averager, b"".join(bytes(x) for x in f), -1.0)] for f in frames]
        if drop_on_failure and "replay" in lies:  # a push
            old, pushed[rnd.peer_ids[j]] = pushed.get(rnd.peer_ids[j], []), frames
            frames = old + frames
        if "finals" in lies and not drop_on_failure and j == (rnd.me + 1) % rnd.n and frames:
            frames = [_blanked_final(averager, frames[0]), *frames[1:]]
        if ours and j == (rnd.me + 1) % rnd.n:
            if "withhold" in lies:
                return True
            if "equivocate" in lies:
                frames = [[_scaled(averager, b"".join(bytes(x) for x in f), 1000.0)] for f in frames]
        return await deliver(rnd, j, frames, deadline, sent, drop_on_failure)

    averager.allreduce, averager._encode, averager._deliver = lying_allreduce, lying_encode, lying_deliver
    if "hush" in lies:
        async def no_report(rnd, i, frames):
            return None
        averager._report = no_report
    if "misreport" in lies:
        report = averager._report

        async def misreporting(rnd, i, frames):
            if i == (rnd.me + 1) % rnd.n:
                msg = verify(b"".join(bytes(x) for x in frames[0])).message
                frames = [[seal(dataclasses.replace(msg, norms=tuple(x * 1e-3 for x in msg.norms)),
                                averager.identity)]]
            return await report(rnd, i, frames)
        averager._report = misreporting
    if "mute" in lies or "hush" in lies:
        averager.audits.answer = lambda peer_id, msg: None


def make_ghost(matchmaker: Any, averager: Any, lead: bool = True) -> None:
    """The ``ghost`` lie: ``matchmaker.form_group`` returns None (our own rounds are averaged
    alone) once another peer has joined that round, so we keep the others' pace; from its first
    call on, a task joins every round of our fragments that another peer has joined, through
    the real ``form_group``, whose group is then never averaged: the honest members wait for a
    member that sends nothing. ``lead`` False (``nolead``): as a group's leader it writes no
    record (its ``form_group`` of that round ends there)."""
    form, formats, nxt, tasks = matchmaker.form_group, {}, {}, set()
    if not lead:
        async def no_record(*args: Any) -> None:
            raise asyncio.CancelledError  # the haunting task's form_group ends: nothing stored
        matchmaker._lead = no_record

    async def haunt() -> None:
        from hivemind.utils import get_dht_time

        me = matchmaker.identity.public_key
        while True:
            for fragment, (weight, numel, codec) in list(formats.items()):
                r = nxt.get(fragment, 0)
                for q in (r, r + 1, r + 2):
                    if any(k != me for k in await matchmaker._read_joins(fragment, q, numel, get_dht_time())):
                        t = asyncio.get_running_loop().create_task(form(fragment, q, weight, numel, codec))
                        tasks.add(t)
                        t.add_done_callback(tasks.discard)
                        nxt[fragment] = q + 1
                        break
            await asyncio.sleep(0.2)

    async def ghost_form(fragment: int, round_: int, weight: float, numel: int, codec: str, **kw: Any) -> None:
        formats[fragment] = (weight, numel, codec)
        if not tasks:
            t = asyncio.get_running_loop().create_task(haunt())
            tasks.add(t)
        loop = asyncio.get_running_loop()
        end = loop.time() + 4 * matchmaker.swarm.matchmaking_timeout_s
        while nxt.get(fragment, 0) <= round_ and loop.time() < end:  # at the others' pace, not ahead of them
            await asyncio.sleep(0.2)
        return None

    matchmaker.form_group = ghost_form
    averager.audits.answer = lambda peer_id, msg: None


def _blanked_final(averager: Any, parts: list) -> list:
    """``parts`` (a sealed frame), or, if it is our final, one that says we fell back on every part."""
    v = verify(b"".join(bytes(x) for x in parts))
    if not (isinstance(v.message, PartsHeld) and v.message.final and v.signer == averager.identity.public_key):
        return parts
    return [seal(dataclasses.replace(v.message, digests=(b"",) * len(v.message.digests)), averager.identity)]


def _scaled(averager: Any, frame: bytes, factor: float) -> bytes:
    """Our signed frame ``frame`` (a reduced part, or our own slice) with its values times
    ``factor``, signed again."""
    msg = verify(frame).message
    codec = get_codec(msg.codec)
    payload = codec.encode(codec.decode(msg.payload, msg.numel) * factor)
    return seal(dataclasses.replace(msg, payload=payload), averager.identity)


def parse_stall(fault: str) -> tuple[int, int, float] | None:
    """(fragment, round, at) of a ``stall:F:R:AT`` fault, else None."""
    kind, _, what = fault.partition(":")
    if kind != "stall":
        return None
    try:
        f, r, at = what.split(":")
        out = int(f), int(r), float(at)
    except ValueError:
        raise ValueError(f"SWARMSTREAM_FAULT stall:{what}: expected stall:FRAGMENT:ROUND:AT") from None
    if not 0 < out[2] < 1 + RESULT_GRACE + AGREE_GRACE:
        raise ValueError(f"SWARMSTREAM_FAULT stall:{what}: AT is a multiple of the all-reduce deadline, "
                         f"above 0 and below {1 + RESULT_GRACE + AGREE_GRACE:g} (the agreement's end)")
    return out


def make_staller(averager: Any, fragment: int, round_: int, at: float) -> None:
    """Wrap ``averager`` so that it blocks its event loop once, until ``at`` x the deadline
    after the round started (see the module docstring). Its pushes go out first (a starved
    member is slow, not silent: the others know it took part); its reduced part's sends are
    held until the stall ends."""
    wait_means, deliver = averager._wait_means, averager._deliver
    state: dict[str, Any] = {"round": None, "over": None}

    def target(g) -> bool:
        if state["round"] is None and g.fragment == fragment and g.round >= round_ and len(g.members) > 1:
            state["round"], state["over"] = g.round, asyncio.Event()
        return g.fragment == fragment and g.round == state["round"]

    async def stalling_deliver(rnd, j, frames, deadline, sent, drop_on_failure):
        if target(rnd.group) and not drop_on_failure:  # our reduced part: after the stall
            await state["over"].wait()
        return await deliver(rnd, j, frames, deadline, sent, drop_on_failure)

    async def stalling_wait_means(rnd, deadline):
        g = rnd.group
        if target(g) and not state["over"].is_set():
            pushes = rnd.tasks[:sum(1 for j in range(rnd.n) if j != rnd.me and rnd.size(j))]
            if pushes:
                await asyncio.wait(pushes, timeout=g.deadline_s)
            started = rnd.agree_deadline - (1 + RESULT_GRACE + AGREE_GRACE) * g.deadline_s
            # blocks the whole network thread, as a starved CPU would
            time.sleep(max(0.0, started + at * g.deadline_s - asyncio.get_running_loop().time()))
            state["over"].set()
        return await wait_means(rnd, deadline)

    averager._deliver = stalling_deliver
    averager._wait_means = stalling_wait_means
