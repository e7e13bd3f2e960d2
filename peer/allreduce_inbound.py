"""The averager's inbound side (``peer.allreduce.Averager``): the stream handler reads each
frame under the per-peer limits (``peer.inbox``), verifies it, and hands it to the round it
belongs to, to a finished round still answering late reports, to the buffer of groups not
started yet, or to the audits; a peer whose frame fails is dropped from its rounds."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from peer.inbox import HEADER_LEN, FrameTooLarge, StreamEnded, TooManyStreams, peek_group, read_body, read_header
from peer.outbox import ACK, MAX_UNREAD_ACKS
from protocol.envelope import verify
from protocol.errors import RemoteProtocolError
from protocol.messages_swarm import AuditRequest, Evidence, EvidencePiece, PartsHeld, PushSlice, SliceAveraged

log = logging.getLogger("peer.allreduce")


class InboundMixin:
    """``Averager``'s stream handler. Uses the averager's rounds (``_active``, ``_recent``,
    ``_finished``), its buffer (``_pending``), gate, audits and limits."""

    async def _handle_stream(self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer_id = info.peer_id.to_base58()
        carried: set[tuple[bytes, type, int]] = set()  # (group, PushSlice or SliceAveraged, part) it carried
        try:
            async with self._gate.stream(peer_id):
                while True:
                    size = await read_header(reader, self.max_frame_bytes, self.read_timeout_s)
                    if size is None:
                        self._stream_ended(peer_id, carried)
                        break
                    async with self._gate.body(peer_id):  # one of a peer's frames being read at a time
                        data = await read_body(reader, size, self.read_timeout_s)
                        await self.download.take(HEADER_LEN + size)  # holds back the sender under a cap
                        key = self._on_frame(peer_id, data)
                        del data  # or this stream holds its last frame while it waits for the next
                    writer.write(ACK)  # read and handled: the sender closes once all are (peer.outbox)
                    if writer.transport.get_write_buffer_size() > MAX_UNREAD_ACKS:
                        log.info("averaging stream closed reason=acks_not_read peer=%s", peer_id)
                        break  # it does not read what we answer: no buffer of ours grows for it
                    if key is not None:
                        carried.add(key)
        except TooManyStreams as e:
            log.warning("averaging stream refused reason=too_many_streams peer=%s detail=%s", peer_id, e)
        except FrameTooLarge as e:
            self._blame(peer_id, None, f"frame_too_large:{e}")
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError) as e:
            log.info("averaging stream ended early reason=%s peer=%s", type(e).__name__, peer_id)
        finally:
            writer.close()

    def _on_frame(self, peer_id: str, data: bytes) -> tuple[bytes, type, int] | None:
        """Handle one frame; -> (group ID, message type, part) of a slice or part the stream's peer
        sent for itself (what its stream's end says something about), else None."""
        try:
            v = verify(data, expect=(PushSlice, SliceAveraged, PartsHeld, AuditRequest, Evidence, EvidencePiece), run_id=self.run_id,
                       max_size=self.max_frame_bytes)
            if self.audits.take(peer_id, v, data):  # the inputs of a mean we audit, shown by its reducer
                return None
            forwarded = v.peer_id != peer_id
            relayed = isinstance(v.message, PartsHeld) and v.message.final
            if forwarded and not (isinstance(v.message, SliceAveraged) or relayed):  # only reduced parts and
                # finals are handed on
                verify(data, run_id=self.run_id, sender=peer_id, max_size=self.max_frame_bytes)  # raises
        except RemoteProtocolError as e:
            self._blame(peer_id, peek_group(data), f"{type(e).__name__}:{e}")
            return None
        if isinstance(v.message, AuditRequest):
            self.audits.answer(peer_id, v.message)
            return None
        if isinstance(v.message, Evidence):
            self.audits.evidence(peer_id, v.message)
            return None
        if isinstance(v.message, EvidencePiece):
            self.audits.evidence_piece(peer_id, v.message)
            return None
        gid = bytes(v.message.group_id)  # type: ignore[attr-defined]
        nbytes = HEADER_LEN + len(data)
        rnd = self._active.get(gid)
        if forwarded and isinstance(v.message, PartsHeld):  # a member's final, relayed by another
            if rnd is not None:
                rnd.accept_relayed_final(peer_id, v, data)
                self._after_final(rnd, rnd.index.get(v.peer_id))
            elif (rnd := self._recent.get(gid)) is not None:
                rnd.accept_relayed_final(peer_id, v, data)
                self._after_final(rnd, rnd.index.get(v.peer_id))
                self._check_apart(rnd)
            elif gid not in self._finished:  # a group we have not started: buffered as the relayer's frame
                self._pending.add(gid, peer_id, v, nbytes, data, waits=False)
            return None
        if forwarded:  # a part we reported lacking; unasked for outside a round, so not buffered
            if rnd is not None:
                rnd.accept_forwarded(peer_id, v, nbytes, data)
                if rnd.agreeing:  # it may have completed a part others lack, or proven an equivocation
                    self._forward(rnd, rnd.tasks)
            return None
        if rnd is not None:
            rnd.accept(peer_id, v, nbytes, data)
            if isinstance(v.message, PartsHeld) and v.message.final:
                self._after_final(rnd, rnd.index.get(peer_id))
            if isinstance(v.message, (PartsHeld, SliceAveraged)) and rnd.agreeing:  # a part may have come
                self._forward(rnd, rnd.tasks)  # whole from its reducer after a member reported lacking it
            elif isinstance(v.message, PushSlice):
                self._send_mean_late(rnd, peer_id)
        elif gid in self._recent and isinstance(v.message, PartsHeld):
            rnd = self._recent[gid]
            rnd.accept(peer_id, v, nbytes, data)  # a member late to the agreement: it may lack a part
            if v.message.final:
                self._after_final(rnd, rnd.index.get(peer_id))
            self._forward(rnd, self._side_tasks)
            self._check_apart(rnd)
            if not v.message.final and peer_id in rnd.index:  # and it should know what we landed, again if
                self._tell_landed(rnd, [rnd.index[peer_id]], again=True)  # it reports (our final may be lost)
        elif gid in self._finished:
            done = self._recent.get(gid)  # a push that would have passed its checks: late, not gone (peer.quiet)
            if isinstance(v.message, PushSlice) and done is not None and done.valid_late_push(
                    done.index.get(peer_id), v.message):
                self.quiet.late(gid, peer_id)
            log.debug("frame for a finished group dropped peer=%s group=%s", peer_id, gid.hex())
            return None
        elif not self._pending.add(gid, peer_id, v, nbytes, data,  # a banned member's earliness decides nothing
                                   waits=isinstance(v.message, PushSlice) and not v.message.stopping
                                   and peer_id not in self.banned):
            return None  # dropped at a limit of ours: its stream's end says nothing about the sender
        return None if isinstance(v.message, PartsHeld) else (gid, type(v.message), v.message.part)

    def _after_final(self, rnd: Any, k: int | None) -> None:
        """After member k's final came (from it, or relayed): act on proof that a member signed
        two different finals (``Round.final_proofs``: banned, the proof handed to the group), and
        relay k's final to the others if it names other parts than we landed (``_relay_final``;
        the finals that came before we landed are relayed as we land)."""
        proofs, rnd.final_proofs = rnd.final_proofs, []
        for j, why, proof in proofs:
            self.audits.found(rnd, j, why, proof)
        if k is not None and rnd.landed and k in rnd.finals and rnd.finals[k] != rnd.landed and k not in rnd.proven:
            self._relay_final(rnd, k)

    def _check_apart(self, rnd: Any) -> None:
        """A finished round that said agreed, after a final came (from its member, or relayed)."""
        if rnd.said_agreed and (apart := [i for i in rnd.apart() if i not in rnd.convicted]):  # (not a proven liar's)
            self._found_apart(rnd, apart)

    def _found_apart(self, rnd: Any, apart: list[int]) -> None:
        """A round we said agreed, and a believed member's final came after it saying it landed
        other parts (``Round.apart``): our agreement was wrong (its reports to us and to the others
        differed, or a part reached it after we finished). Say so once; the node compares its state
        with the peers' and takes the majority's copy (a repair), as after a round not agreed.
        Finals are what each member landed: every member's reaches every other, in the round or
        after it, so two members that both said agreed and landed apart both find out."""
        rnd.said_agreed = False
        g = rnd.group
        self.apart.append((g.fragment, g.round, bytes(g.group_id)))
        log.warning("a member's final says it landed other parts than we did after we said agreed: comparing "
                    "states peers=%s group=%s", ",".join(rnd.peer_ids[i] for i in apart), g.group_id.hex())

    def _stream_ended(self, peer_id: str, carried: set[tuple[bytes, type, int]]) -> None:
        """The peer closed a stream that carried its slices or parts: any it left short stay so."""
        for gid, kind, part in carried:
            rnd = self._active.get(gid)
            if rnd is not None:
                rnd.stream_ended(peer_id, kind, part)
            else:
                self._pending.note(gid, peer_id, StreamEnded(kind, part))


    def _blame(self, peer_id: str, gid: bytes | None, reason: str) -> None:
        """A frame from ``peer_id`` (authenticated by libp2p) was bad: drop it from the round
        the frame claims, or from every round it is in if the frame names no group at all (one
        that names a finished group is only logged: a late resend must not cost a live round)."""
        log.warning("rejected slice reason=%s peer=%s", reason, peer_id)
        if gid is not None and gid in self._active:
            rounds = [self._active[gid]]
        elif gid is not None and gid in self._finished:
            return
        elif gid is not None:
            self._pending.add(gid, peer_id, reason)
            return
        else:
            rounds = [r for r in self._active.values() if peer_id in r.index]
        for r in rounds:
            if peer_id in r.index:
                r.drop(r.index[peer_id], reason)
