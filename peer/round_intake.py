"""The intake of one member's round (``peer.allreduce_round.Round``): every verified frame the
averager's stream handler hands it (a push of our slice, another reducer's part, a forwarded
part, a report or a final), checked against the group before it is taken, and the proof kept
when a signed frame fails a check (``protocol.evidence``) or a reducer signed two means."""

from __future__ import annotations

import logging
import math
import time

from protocol.envelope import Verified
from protocol.errors import RemoteProtocolError
from protocol.butterfly import on_grid
from protocol.evidence import contradicting_finals, equivocation, offence
from protocol.messages_swarm import PartsHeld, PushSlice, SliceAveraged

from peer.round_agreement import LATE

log = logging.getLogger("peer.allreduce")

MAX_OFFENCES = 4  # proven lies kept per round (one per signer), for peer.bans


def _check_disjoint(chunks: list[tuple[int, int]], offset: int, numel: int) -> None:
    """A new chunk may not overlap one already received: every element comes exactly once,
    so "as many elements as the slice" means "all of the slice"."""
    for off, cnt in chunks:
        if offset < off + cnt and off < offset + numel:
            raise RemoteProtocolError(f"chunk [{offset}, {offset + numel}) overlaps one already received")


class IntakeMixin:
    """``Round``'s intake. Writes the round's state (``Round.__init__`` defines it) and sets
    ``changed`` whenever something arrives; a member whose frame fails a check is dropped
    (``Round.drop``)."""

    def accept(self, peer_id: str, v: Verified, nbytes: int, data: bytes) -> None:
        """A verified frame whose signer is ``peer_id``, the stream's remote peer."""
        i = self.index.get(peer_id)
        if i is None:
            log.warning("rejected slice reason=not_a_member peer=%s group=%s", peer_id, self.group.group_id.hex())
            return
        if i == self.me:
            return
        self.heard.add(i)  # it is in this round (peer.quiet)
        msg = v.message
        if isinstance(msg, PartsHeld):  # also from a member we dropped: it may need our parts
            if self._accept_report(i, msg, data):
                self.report_frames[i] = bytes(data)  # as signed: proof, if an audit shows it lied (peer.audit)
            return
        late = self.dropped.get(i, "").startswith(LATE)
        if isinstance(msg, PushSlice) and late and self.valid_late_push(i, msg):
            self.pushers.add(i)  # after our deadline: it pushed, it is late, not gone (peer.quiet)
        if i in self.dropped and not (isinstance(msg, SliceAveraged) and (late or not self.reported)):
            # a dropped member's reduced part is judged on its own frames, whatever we dropped it
            # for, until we report: another member that took it forwards it to us anyway, and a
            # liar's means, taken, show in the reports if it signed two (refused, a liar whose bad
            # push reached every member first was never proven: CI, the equivocating liar with
            # off-grid pushes). After our report only a late member's: a liar's part, completed
            # then for us alone, was landed by us while members that reported lacking it fell
            # back (a review's repro)
            return
        self.bytes_received += nbytes
        seen = (i, type(msg).__name__, msg.part, msg.offset, bytes(v.payload_digest))
        if seen in self._seen:
            return  # sent again because its acknowledgement did not come in time (peer.outbox)
        try:
            if isinstance(msg, PushSlice):
                self._accept_push(i, msg, v.payload_digest, data)
            else:
                self._accept_mean(i, msg, v.payload_digest, data)  # type: ignore[arg-type]
        except RemoteProtocolError as e:
            self.drop(i, f"{type(msg).__name__}:{e}", lie=True)
            self._keep_evidence(data)
            return
        if isinstance(msg, PushSlice):
            self.pushers.add(i)  # a push that passed the checks: it is in this round (peer.quiet)
        self._seen.add(seen)
        self.changed.set()

    def _keep_evidence(self, data: bytes) -> None:
        """Keep a frame that failed a check if it proves its signer lied: one per signer, a few
        per round (a frame wrong only for this round, or a resend, proves nothing and is not kept)."""
        if len(self.offences) >= MAX_OFFENCES:
            return
        proven = offence(data, self.group.run_id)
        if proven is not None and proven[0] not in self.offences:
            self.offences[proven[0]] = (proven[0], proven[1], bytes(data))

    def stream_ended(self, peer_id: str, kind: type, part: int) -> None:
        """A stream on which member ``peer_id`` sent its slice of ours (``PushSlice``) or its
        reduced part (``SliceAveraged``) ended. A sender writes all of it on one stream, so one
        still short now never completes: drop the sender at once rather than at the deadline.
        (Its own slice, sent to us as its witness, travels on a stream of its own: one left
        short means only that we cannot vouch for it.)"""
        i = self.index.get(peer_id)
        if i is None or i == self.me or i in self.dropped:
            return
        if kind is PushSlice and part == self.me and self.collecting_pushes and self.pushed[i] != self.size(self.me):
            self.drop(i, f"short:its stream ended after {self.pushed[i]} of the slice's {self.size(self.me)} elements")
        elif kind is SliceAveraged and self.collecting_means and not self.holds(i) and self.size(i):
            self.drop(i, f"short:its stream ended after {self.got[i]} of its part's {self.size(i)} elements")

    def accept_forwarded(self, forwarder: str, v: Verified, nbytes: int, data: bytes) -> None:
        """A ``SliceAveraged`` signed by its reducer, forwarded by another member because we
        reported lacking that part. Taken once one forwarder has sent all of the part."""
        f = self.index.get(forwarder)
        msg = v.message
        j = self.index.get(v.peer_id)
        if f is None or j is None or not isinstance(msg, SliceAveraged) or j == self.me:
            log.warning("rejected forwarded part reason=not_a_member peer=%s group=%s", forwarder,
                        self.group.group_id.hex())
            return
        self.heard.add(f)
        if not self.agreeing:
            return  # unasked for
        if self.holds(j) or j in self.convicted:  # here already: the same mean, or proof of another
            self._check_equivocation(j, msg, v.payload_digest, data, self._taken(j) if self.holds(j) else [])
            if not self.replaceable(j):
                return
            # proven, and we lack the one mean the reports showed: each forwarder's frames are
            # collected apart, and a whole set taken in place of ours (``_take_repair``)
        elif self._check_equivocation(j, msg, v.payload_digest, data,
                                      [(c[0], c[1], c[4], c[3], c[2]) for (p, _), cs in self.repairs.items()
                                       if p == j for c in cs]):
            if not self.replaceable(j):
                return
        seen = (f, "forwarded", j, msg.offset, bytes(v.payload_digest))
        if seen in self._seen:
            return  # sent again because its acknowledgement did not come in time (peer.outbox)
        self._seen.add(seen)
        self.bytes_received += nbytes
        chunks = self.repairs.setdefault((j, f), [])
        try:
            self._check_mean(j, msg, sum(c[1] for c in chunks))
            _check_disjoint([(o, n) for o, n, *_ in chunks], msg.offset, msg.numel)
            if chunks and tuple(msg.contributors) != tuple(chunks[0][4]):
                raise RemoteProtocolError("contributors differ between chunks of one part")
            self.codec.decode(msg.payload, msg.numel)  # layout, scales and finiteness; raises
        except RemoteProtocolError as e:  # signed by the reducer: its fault, but we need not use it
            log.warning("rejected forwarded part reason=%s reducer=%s forwarder=%s group=%s", e,
                        self.peer_ids[j], forwarder, self.group.group_id.hex())
            self.repairs.pop((j, f), None)
            self._keep_evidence(data)  # evidence against its signer, the reducer
            return
        chunks.append((msg.offset, msg.numel, data, v.payload_digest, tuple(msg.contributors), bytes(msg.own),
                       msg.payload))
        if sum(c[1] for c in chunks) == self.size(j):
            self._take_repair(j, f)
        self.changed.set()

    def _taken(self, j: int) -> list[tuple[int, int, tuple[int, ...], bytes, bytes]]:
        """The chunks of part j we took from its reducer or a forwarder: (offset, numel,
        contributors, payload digest, frame), as ``_check_equivocation`` compares them."""
        return [(o, n, self.contributors.get(j, ()), d, f[0])
                for (o, n, d), f in zip(self.mean_chunks.get(j, []), self.frames.get(j, []))]

    def _check_equivocation(self, j: int, msg: SliceAveraged, payload_digest: bytes, data: bytes,
                            ours: list[tuple[int, int, tuple[int, ...], bytes, bytes]]) -> bool:
        """Whether ``data`` (``msg``), a frame of part j, and one of ``ours`` (offset, numel,
        contributors, payload digest, frame: each checked when it came) prove that j's reducer
        signed two different means; if so the part is convicted and the proof kept. Frames are
        compared by what ``part_digest`` covers first: the signatures are checked again only
        for a pair that overlaps and differs."""
        if j in self.convicted:
            return True
        what = (tuple(msg.contributors), payload_digest)
        for offset, numel, contributors, pd, frame in ours:
            if not (offset < msg.offset + msg.numel and msg.offset < offset + numel):
                continue
            if (offset, numel) == (msg.offset, msg.numel) and (tuple(contributors), pd) == what \
                    and bytes(frame) == bytes(data):
                continue  # the same mean (another field, such as ``own``, may differ: ``equivocation`` says)
            proven = equivocation(bytes(frame), bytes(data), self.group.run_id)
            if proven is None:
                continue
            self.convicted[j] = (bytes(frame), bytes(data))
            log.warning("reducer equivocated part=%d peer=%s group=%s: two different means, signed; the part "
                        "falls back unless the reports showed one mean of it", j, self.peer_ids[j], self.group.group_id.hex())
            if len(self.offences) < MAX_OFFENCES and proven[0] not in self.offences:
                self.offences[proven[0]] = (proven[0], proven[1], self.convicted[j])
            self.changed.set()
            return True
        return False

    def _take_repair(self, j: int, f: int) -> None:
        chunks = self.repairs.pop((j, f))
        self.mean_errors[j] = {}
        for offset, numel, *_, payload in chunks:  # the whole part, from one forwarder's frames
            self.result[offset:offset + numel] = self.codec.decode(payload, numel)
            self.mean_errors[j][offset] = self.codec.error_bound(payload, numel) ** 2
        self.contributors[j] = tuple(chunks[0][4])
        self.mean_chunks[j] = [(c[0], c[1], c[3]) for c in chunks]
        self.mean_own[j] = {c[0]: c[5] for c in chunks}
        self.frames[j] = [[c[2]] for c in chunks]
        self.got[j] = self.size(j)
        self.repaired.add(j)
        log.info("reduced part repaired part=%d from=%s group=%s", j, self.peer_ids[f], self.group.group_id.hex())

    def accept_relayed_final(self, relayer: str, v: Verified, data: bytes) -> None:
        """A final report signed by a member, relayed by another (``peer.allreduce_send``: each
        member hands on the finals it got, so that two different ones from one key meet). Taken
        as the signer's word, as if it had sent it to us."""
        f, j, msg = self.index.get(relayer), self.index.get(v.peer_id), v.message
        if f is None or j is None or j == self.me or not isinstance(msg, PartsHeld) or not msg.final:
            log.warning("rejected relayed final reason=not_a_member peer=%s group=%s", relayer,
                        self.group.group_id.hex())
            return
        self.heard.add(f)
        self._accept_report(j, msg, data)

    def _accept_report(self, i: int, msg: PartsHeld, data: bytes) -> bool:
        """-> True if ``msg`` (signed as ``data``) is member i's report (not a final), taken now."""
        if len(msg.digests) != self.n:
            log.warning("rejected report reason=%d_parts_for_%d_members peer=%s", len(msg.digests), self.n,
                        self.peer_ids[i])
            return False
        if (msg.fragment, msg.round) != (self.group.fragment, self.group.round):  # (a final so taken first
            # would stand, and a second one, of the group's round, would not prove the lie)
            log.warning("rejected report reason=fragment_%d_round_%d_not_the_groups peer=%s", msg.fragment, msg.round,
                        self.peer_ids[i])
            return False
        digests = tuple(bytes(d) for d in msg.digests)
        if msg.final:
            self._take_final(i, digests, bytes(data))
            return False
        if i in self.reports:
            return False  # one report per member and round
        self.reports[i] = digests
        if len(msg.norms) == self.n:  # else it told us nothing about its slices: it bounds no part
            self.report_norms[i] = tuple(msg.norms)
        if len(msg.dots) == self.n:
            self.report_dots[i] = tuple(msg.dots)
        self._take_vouches(i, msg.witness)
        for j, d in enumerate(self.reports[i]):
            if d and j != i:  # held by two members (not its reducer) alike: it is out, not one's word
                holders = self.holders.setdefault((j, d), set())
                holders.add(i)
                if len(holders) >= 2:
                    self.held_since.setdefault(j, time.monotonic())  # the event loop's clock
        self.changed.set()
        return True

    def _take_final(self, i: int, digests: tuple[bytes, ...], data: bytes) -> None:
        """Member i's final: the first is taken. A member lands once and tells every member the
        same, so a second naming other parts proves that it told members different things
        (``protocol.evidence.contradicting_finals``): it is ``proven`` (its finals count for
        nothing, ``AgreementMixin._believed``), and the proof waits in ``final_proofs``."""
        if i not in self.finals:
            self.finals[i] = digests
            self.final_frames[i] = data
            if self.landed and digests != self.landed:
                log.warning("a member landed other parts than we did peer=%s group=%s", self.peer_ids[i],
                            self.group.group_id.hex())
            self.changed.set()
            return
        first = self.final_frames.get(i)
        if digests == self.finals[i] or first is None or i in self.proven:
            return
        proven = contradicting_finals(first, data, self.group.run_id)
        if proven is None:
            return
        log.warning("a member signed two different finals for this round: proof that it lied peer=%s group=%s",
                    self.peer_ids[i], self.group.group_id.hex())
        self.proven.add(i)
        self.final_proofs.append((i, proven[1], (first, data)))
        self.changed.set()

    def _check_slice(self, msg: PushSlice | SliceAveraged, part: int, covered: int) -> None:
        g = self.group
        s, e = self.bounds[part]
        if msg.codec != g.codec:
            raise RemoteProtocolError(f"codec {msg.codec} is not the group's {g.codec}")
        if msg.dtype != "float32" or tuple(msg.shape) != (msg.numel,):
            raise RemoteProtocolError(f"shape {tuple(msg.shape)} / dtype {msg.dtype} is not a flat float32 slice")
        if msg.numel == 0 or not (s <= msg.offset and msg.offset + msg.numel <= e):
            raise RemoteProtocolError(f"elements [{msg.offset}, {msg.offset + msg.numel}) are outside "
                                      f"slice {part} [{s}, {e})")
        if covered + msg.numel > e - s:
            raise RemoteProtocolError(f"more than the {e - s} elements of slice {part}")
        if not on_grid(s, e, self.chunk, msg.offset, msg.numel):
            raise RemoteProtocolError(f"chunk [{msg.offset}, {msg.offset + msg.numel}) of slice {part} is not on "
                                      f"the run's grid of {self.chunk} elements")

    def _accept_push(self, i: int, msg: PushSlice, payload_digest: bytes, data: bytes) -> None:
        if msg.part == i and i in self.witnessed:  # its own slice: we are one of its witnesses
            self._accept_witnessed(i, msg, payload_digest, data)
            return
        if msg.part != self.me:
            raise RemoteProtocolError(f"part {msg.part} sent to the reducer of part {self.me}")
        if not self.collecting_pushes:
            log.info("late slice ignored peer=%s group=%s", self.peer_ids[i], self.group.group_id.hex())
            self._check_late_push(i, msg, self.pushed[i])  # it counts as a sign of life (peer.quiet) only if it would have passed
            return
        self._check_slice(msg, self.me, self.pushed[i])
        if msg.weight != self.group.weights[i]:
            raise RemoteProtocolError(f"weight {msg.weight} is not the group's {self.group.weights[i]}")
        chunks = self.pushes.setdefault(i, [])
        _check_disjoint([(off, cnt) for off, cnt, _ in chunks], msg.offset, msg.numel)
        if i in self.excluded:  # banned: counted (it came, on time or not), never averaged nor kept
            chunks.append((msg.offset, msg.numel, None))
            self.pushed[i] += msg.numel
            return
        self.codec.decode(msg.payload, msg.numel)  # layout, scales and finiteness; raises
        chunks.append((msg.offset, msg.numel, msg.payload))
        self.push_frames.setdefault(i, []).append((msg.offset, msg.numel, bytes(payload_digest), bytes(data)))
        self.pushed[i] += msg.numel

    def valid_late_push(self, i: int | None, msg: PushSlice) -> bool:
        """Whether a push of member ``i`` that came after we stopped collecting (also after the
        round finished) completes its slice to us, every chunk of it (on time or late) having
        passed the checks: only a whole slice shows the member was late, not gone
        (``peer.quiet``), and earns it our reduced part (``Round.late_to_us``). A bogus chunk
        clears nothing, nor does one valid chunk of many (a ghost's cheap sign of life)."""
        if i is None or i == self.me:
            return False
        chunks = self.late_chunks.setdefault(i, set())
        if (msg.offset, msg.numel) in chunks:
            return False  # sent again: its acknowledgement did not come in time (peer.outbox)
        try:
            self._check_late_push(i, msg, self.pushed[i] + sum(n for _, n in chunks))
            _check_disjoint([(off, cnt) for off, cnt, _ in self.pushes.get(i, [])] + sorted(chunks),
                            msg.offset, msg.numel)
        except RemoteProtocolError as e:
            log.info("late slice fails a check peer=%s reason=%s group=%s", self.peer_ids[i], e,
                     self.group.group_id.hex())
            return False
        chunks.add((msg.offset, msg.numel))
        return self.pushed[i] + sum(n for _, n in chunks) == self.size(self.me)

    def _check_late_push(self, i: int, msg: PushSlice, covered: int) -> None:
        if msg.part != self.me:
            raise RemoteProtocolError(f"part {msg.part} sent to the reducer of part {self.me}")
        self._check_slice(msg, self.me, covered)
        if msg.weight != self.group.weights[i]:
            raise RemoteProtocolError(f"weight {msg.weight} is not the group's {self.group.weights[i]}")
        self.codec.decode(msg.payload, msg.numel)  # layout, scales and finiteness; raises

    def _check_mean(self, j: int, msg: SliceAveraged, covered: int) -> None:
        if msg.part != j:
            raise RemoteProtocolError(f"reduced part {msg.part} sent by the reducer of part {j}")
        self._check_slice(msg, j, covered)
        contrib = tuple(msg.contributors)
        if j not in contrib or contrib[-1] >= self.n:
            raise RemoteProtocolError(f"contributors {contrib} must include the reducer and be members")
        total = math.fsum(self.group.weights[c] for c in contrib)
        if not math.isclose(msg.weight, total, rel_tol=1e-9, abs_tol=1e-12):
            raise RemoteProtocolError(f"weight {msg.weight} is not the contributors' total {total}")

    def _accept_mean(self, j: int, msg: SliceAveraged, payload_digest: bytes, data: bytes) -> None:
        if self._check_equivocation(j, msg, payload_digest, data, self._taken(j)):
            return  # another mean over elements we took, signed by the same reducer: proven (was only refused)
        if self.holds(j):
            return  # forwarded to us already
        if not self.collecting_means:
            log.info("late reduced part ignored peer=%s group=%s", self.peer_ids[j], self.group.group_id.hex())
            return
        self._check_mean(j, msg, self.got[j])
        contrib = tuple(msg.contributors)
        if self.contributors.setdefault(j, contrib) != contrib:
            raise RemoteProtocolError("contributors differ between chunks of one part")
        _check_disjoint([(o, n) for o, n, _ in self.mean_chunks.setdefault(j, [])], msg.offset, msg.numel)
        decoded = self.codec.decode(msg.payload, msg.numel)  # raises on bad bytes or non-finite values
        self.mean_own.setdefault(j, {})[msg.offset] = bytes(msg.own)
        self.result[msg.offset:msg.offset + msg.numel] = decoded
        self.mean_errors.setdefault(j, {})[msg.offset] = self.codec.error_bound(msg.payload, msg.numel) ** 2
        self.mean_chunks[j].append((msg.offset, msg.numel, payload_digest))
        self.frames.setdefault(j, []).append([bytes(data)])
        self.got[j] += msg.numel
        if self.agreeing and self.got[j] == self.size(j):
            self.repaired.add(j)  # resent by its reducer after our report said we lacked it
