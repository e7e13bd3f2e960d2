"""The averager's outbound side (``peer.allreduce.Averager``): a round's slices and parts
encoded in chunks and sealed, sent until acknowledged (``peer.outbox``) by a deadline, and the
agreement's sends (reports, forwarded parts, proofs, finals)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection
from typing import Any

import torch

from peer.allreduce_round import Round
from peer.outbox import send_frames
from protocol.butterfly import chunk_spans
from protocol.envelope import seal_parts
from protocol.messages_swarm import PartsHeld, PushSlice, SliceAveraged

SIDE_RESENDS = 2  # a member's failed side sends (finals, relays) that go again in one round

log = logging.getLogger("peer.allreduce")


def encode_chunks(rnd: Round, part: int, values: torch.Tensor) -> list[tuple[int, int, bytes]]:
    """``values`` (the elements of slice ``part``) encoded in chunks on the round's grid
    (``protocol.butterfly.chunk_elements``): [(start, end, bytes)]."""
    s, e = rnd.bounds[part]
    return [(a, b, rnd.codec.encode(values[a - s:b - s])) for a, b in chunk_spans(s, e, rnd.chunk)]


class SendMixin:
    """``Averager``'s sends. Uses its identity, handler name, rate limiter and side tasks."""

    def _forward(self, rnd: Round, tasks: Any) -> None:
        """Send members that reported lacking a part we hold (or holding another mean of it)
        its signed frames, and members that reported holding a part we proved equivocated the
        proof (see ``peer.allreduce_round``), each part to each member once, within the
        agreement's time."""
        loop = asyncio.get_running_loop()
        deadline = rnd.agree_deadline if rnd.agree_deadline > loop.time() else loop.time() + rnd.group.deadline_s
        sends = []
        for i, j in rnd.forward_wanted():
            rnd.forwarded.add((i, j))
            log.info("forwarding reduced part part=%d to=%s group=%s", j, rnd.peer_ids[i], rnd.group.group_id.hex())
            sends.append((i, j, rnd.frames[j]))
        for i, j in rnd.proof_wanted():
            rnd.proved.add((i, j))
            log.info("forwarding proof of equivocation part=%d to=%s group=%s", j, rnd.peer_ids[i],
                     rnd.group.group_id.hex())
            sends.append((i, j, [[frame] for frame in rnd.convicted[j]]))
        for i, j, frames in sends:
            task = asyncio.create_task(self._deliver(rnd, i, frames, deadline, rnd.sent, False))
            if isinstance(tasks, set):  # a finished round's: its outcome is out
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            else:
                tasks.append(task)
                rnd.forwards.append((i, j, task))  # undelivered by the round's end: not agreed (Round.forwards)

    def _send_mean(self, rnd: Round, members: set[int]) -> None:
        """Send ``members`` our reduced part (once each), by the means' deadline."""
        for i in sorted(members - rnd.mean_to - {rnd.me}):
            rnd.mean_to.add(i)
            rnd.tasks.append(asyncio.create_task(
                self._deliver(rnd, i, rnd.frames[rnd.me], rnd.end_deadline, rnd.sent, False)))

    def _send_mean_late(self, rnd: Round, peer_id: str) -> None:
        """After a frame from ``peer_id``: if it is a member we dropped as late whose push came
        after all (``Round.late_to_us``) and we reduced our part already, send it our part now.
        It is in the round and waits for the part, which it would otherwise get only after its
        means' deadline (in a pair: 1.5 D), forwarded on its report."""
        i = rnd.index.get(peer_id)
        if i is not None and rnd.me in rnd.frames and rnd.collecting_means and i in rnd.late_to_us():
            self._send_mean(rnd, {i})

    def _tell_landed(self, rnd: Round, members: list[int], again: bool = False) -> None:
        """Send ``members`` our final report: the parts we landed (``Round.landed``), each once
        (``again``: also to one told already, in answer to its report: one frame per report),
        and with it the finals we got from the others, as they signed them (relayed, each once
        to each member): a member that told two members different things about what it landed
        is proven by the pair (``protocol.evidence.contradicting_finals``), which only a relay
        brings together."""
        members = [i for i in members if (again or i not in rnd.told) and i != rnd.me]
        if not rnd.landed or not members:
            return
        g = rnd.group
        final = PartsHeld(run_id=g.run_id, fragment=g.fragment, round=g.round, group_id=g.group_id,
                          digests=rnd.landed, final=True)
        ours = seal_parts(final, self.identity)
        deadline = asyncio.get_running_loop().time() + g.deadline_s
        for i in members:
            rnd.told.add(i)
            relays = self._relays(rnd, i, sorted(rnd.final_frames))
            self._side_send(rnd, i, [ours, *([f] for _, f in relays)], deadline, told=True,
                            relayed=[(i, k) for k, _ in relays])

    @staticmethod
    def _relays(rnd: Round, i: int, whose: list[int]) -> list[tuple[int, bytes]]:
        """(k, frame): the finals of members k in ``whose`` that member i has not had from us (nor
        its own), marked sent (``_side_send`` unmarks them if the send fails)."""
        out = []
        for k in whose:
            if k != i and k in rnd.final_frames and (i, k) not in rnd.relayed_to:
                rnd.relayed_to.add((i, k))
                out.append((k, rnd.final_frames[k]))
        return out

    def _relay_final(self, rnd: Round, k: int) -> None:
        """Member k's final names other parts than we landed (it came before we landed, or
        after): relay it, as signed, to the other members (once), which may hold another final
        of k's."""
        if k in rnd.relayed or k not in rnd.final_frames:
            return
        rnd.relayed.add(k)
        deadline = asyncio.get_running_loop().time() + rnd.group.deadline_s
        for i in range(rnd.n):
            if i != rnd.me and i not in rnd.gone and (relays := self._relays(rnd, i, [k])):
                self._side_send(rnd, i, [[f] for _, f in relays], deadline, relayed=[(i, k) for k, _ in relays])

    def _side_send(self, rnd: Round, i: int, frames: list[list[Any]], deadline: float, *, told: bool = False,
                   relayed: Collection[tuple[int, int]] = ()) -> None:
        """Send frames to member i beside the round (our final, relayed finals). If they are not all
        acknowledged, member i is no longer marked as told our final (``told``) nor as having had
        the finals relayed (``relayed``), and they go again with our final (after D/2, then D),
        at most ``SIDE_RESENDS`` times a member and round: a lost relay would otherwise keep a
        liar's two finals apart for good."""
        task = asyncio.create_task(self._deliver(rnd, i, frames, deadline, rnd.sent, False))
        self._side_tasks.add(task)
        task.add_done_callback(self._side_tasks.discard)
        if told or relayed:
            def failed(t: asyncio.Task[bool]) -> None:
                if t.cancelled() or (t.exception() is None and t.result()) or rnd.resent.get(i, 0) >= SIDE_RESENDS:
                    return  # delivered, cancelled (we stop), or it had its resends (a member that never
                    # acknowledges would otherwise get every relay again with each answer to its reports)
                rnd.resent[i] = k = rnd.resent.get(i, 0) + 1
                if told:
                    rnd.told.discard(i)
                rnd.relayed_to.difference_update(relayed)
                # after D/2, then D: a member down for a moment (its stream reset, a reconnect) gets
                # them; at once, every try could fail within milliseconds and use the resends up
                asyncio.get_running_loop().call_later(rnd.group.deadline_s * 2 ** (k - 2), resend)

            def resend() -> None:
                if self._started and rnd.landed:
                    self._tell_landed(rnd, [i], again=True)
            task.add_done_callback(failed)

    async def _send_frames(self, peer_id: str, frames: list[list[Any]]) -> int:
        """Send frames (sealed parts) to ``peer_id`` until each is acknowledged (``peer.outbox``).
        -> bytes sent."""
        return await send_frames(self.p2p, peer_id, self.handler_name, frames, upload=self.upload,
                                 reconnect=self.reconnect)

    def _encode(self, rnd: Round, part: int, values: torch.Tensor) -> list[tuple[int, int, bytes]]:
        """A push or our mean (``values``, the elements of slice ``part``), encoded in chunks."""
        return encode_chunks(rnd, part, values)

    def _frames(self, rnd: Round, part: int, encoded: list[tuple[int, int, bytes]], weight: float,
                contributors: tuple[int, ...] | None, inputs: bytes = b"",
                own: dict[int, bytes] | None = None) -> list[list[Any]]:
        """Sealed PushSlices (or SliceAverageds, with ``contributors``, ``inputs`` and the digest
        of our own slice's chunk at each offset, ``own``) carrying ``encoded``."""
        g = rnd.group
        frames = []
        for a, b, payload in encoded:
            common: dict[str, Any] = {
                "run_id": g.run_id, "fragment": g.fragment, "round": g.round, "group_id": g.group_id, "part": part,
                "offset": a, "numel": b - a, "shape": (b - a,), "dtype": "float32", "codec": g.codec,
                "weight": weight, "payload": payload}
            msg = (PushSlice(stopping=rnd.stopping, **common) if contributors is None
                   else SliceAveraged(contributors=contributors, inputs=inputs, own=(own or {}).get(a, b""), **common))
            frames.append(seal_parts(msg, self.identity))
        return frames

    async def _report(self, rnd: Round, i: int, frames: list[list[Any]]) -> None:
        """Send our report to member i; one we cannot reach is not waited for."""
        loop = asyncio.get_running_loop()
        try:
            left = rnd.agree_deadline - loop.time()
            nbytes = await asyncio.wait_for(self._send_frames(rnd.peer_ids[i], frames), max(left, 0.001))
            rnd.sent[0] += nbytes
            rnd.acked.add(i)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001  (as in _deliver: failing to reach a peer is its problem)
            log.info("report not delivered peer=%s detail=%r", rnd.peer_ids[i], e)
            rnd.gone.add(i)
            rnd.changed.set()

    async def _deliver(self, rnd: Round, j: int, frames: list[list[Any]], deadline: float, sent: list[int],
                       drop_on_failure: bool) -> bool:
        """Send frames to member j by ``deadline``. A reducer we cannot reach will not reduce
        our slice nor send us its part: drop it at once rather than wait for it. -> whether
        every frame was acknowledged."""
        remaining = deadline - asyncio.get_running_loop().time()
        try:
            if remaining <= 0:
                raise asyncio.TimeoutError
            nbytes = await asyncio.wait_for(self._send_frames(rnd.peer_ids[j], frames), remaining)
            sent[0] += nbytes  # not ``sent[0] += await ...``: that reads sent[0] before the await
            rnd.acked.add(j)
            return True
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001  (any failure to reach a peer is that peer's problem)
            reason = "timeout" if isinstance(e, asyncio.TimeoutError) else f"unreachable:{type(e).__name__}"
            log.info("send failed reason=%s peer=%s detail=%s", reason, rnd.peer_ids[j], e)
            if drop_on_failure:
                rnd.drop(j, reason)
            return False
