"""The witnesses of one member's round (``peer.allreduce_round.Round``): a reducer sends its own
slice, encoded as it averages it and signed (``PushSlice`` frames of its own part), to two
members drawn from the group's ID (``protocol.butterfly.witnesses_of``), and commits to it in
its mean (``SliceAveraged.own``: each own chunk's payload digest). A witness that holds both
vouches for the slice in its report (``PartsHeld.witness``: its norm and its dot with the
mean), so the screen counts the reducer's term as reported instead of as anything up to the
clip (``protocol.butterfly.screen_mean``). A slice that does not match the mean's commitment
is proof, signed by the reducer twice (``protocol.evidence.own_contradiction``)."""

from __future__ import annotations

import logging
import math

import torch

from protocol.butterfly import slice_norm
from protocol.errors import RemoteProtocolError
from protocol.evidence import own_contradiction
from protocol.messages_swarm import PushSlice

from peer.round_intake import MAX_OFFENCES

log = logging.getLogger("peer.allreduce")


class WitnessMixin:
    """``Round``'s witnessing. Reads and writes ``witnessed``, ``mean_own`` and ``vouches``
    (``Round.__init__`` defines them)."""

    def _accept_witnessed(self, j: int, msg: PushSlice, payload_digest: bytes, data: bytes) -> None:
        """A chunk of reducer j's own slice, sent to us as one of its witnesses."""
        if self.reported:
            log.info("late witnessed slice ignored peer=%s group=%s", self.peer_ids[j], self.group.group_id.hex())
            return
        chunks = self.witnessed[j]
        self._check_slice(msg, j, sum(c[1] for c in chunks))
        if msg.weight != self.group.weights[j]:
            raise RemoteProtocolError(f"weight {msg.weight} is not the group's {self.group.weights[j]}")
        for off, cnt, *_ in chunks:
            if msg.offset < off + cnt and off < msg.offset + msg.numel:
                raise RemoteProtocolError(f"chunk [{msg.offset}, {msg.offset + msg.numel}) overlaps one already received")
        self.codec.decode(msg.payload, msg.numel)  # layout, scales and finiteness; raises
        chunks.append((msg.offset, msg.numel, msg.payload, bytes(payload_digest), bytes(data)))

    def witness_report(self) -> tuple[float, ...]:
        """Our report's ``PartsHeld.witness``: for each part we witness, (norm, dot with its
        mean) of its reducer's own slice, or (-1.0, 0.0) where we cannot vouch for it."""
        out: list[float] = []
        for j in self.witnessing:
            vouch = self._vouch(j)
            if vouch is not None:
                self.vouches.setdefault(j, {})[self.me] = vouch
            out.extend(vouch if vouch is not None else (-1.0, 0.0))
        return tuple(out)

    def _vouch(self, j: int) -> tuple[float, float] | None:
        """(norm, dot) of reducer j's own slice as it sent it to us, if we hold all of it and
        its mean, and the mean commits to it chunk by chunk; a chunk that contradicts the mean
        is kept as proof (``offences``)."""
        chunks = self.witnessed[j]
        if not self.size(j) or not self.holds(j) or sum(c[1] for c in chunks) != self.size(j):
            return None
        means = list(zip(self.mean_chunks[j], self.frames[j]))
        own = self.mean_own.get(j, {})
        for off, cnt, _, pd, frame in chunks:
            for (o, n, _), mean_frame in means:
                if (o < off + cnt and off < o + n) and ((o, n) != (off, cnt) or own.get(o) != pd):
                    self._contradicted(j, bytes(mean_frame[0]), frame)
                    return None
        s, e = self.bounds[j]
        x = torch.empty(e - s, dtype=torch.float32)
        for off, cnt, payload, *_ in chunks:
            x[off - s:off - s + cnt] = self.codec.decode(payload, cnt)
        return slice_norm(x), float(torch.dot(self.result[s:e].double(), x.double()))

    def _contradicted(self, j: int, mean_frame: bytes, own_frame: bytes) -> None:
        proven = own_contradiction(mean_frame, own_frame, self.group.run_id)
        if proven is None:  # cannot be, for frames that passed our checks; say so rather than accuse
            log.warning("witnessed slice does not match its mean, without proof part=%d peer=%s group=%s", j,
                        self.peer_ids[j], self.group.group_id.hex())
            return
        log.warning("reducer's own slice contradicts its mean part=%d peer=%s group=%s: not vouched for, proven",
                    j, self.peer_ids[j], self.group.group_id.hex())
        if len(self.offences) < MAX_OFFENCES and proven[0] not in self.offences:
            self.offences[proven[0]] = (proven[0], proven[1], (mean_frame, own_frame))

    def unwitnessed(self) -> list[int]:
        """Parts we witness, hold as the round ends, and did not vouch for: their mean came
        without the own slice, or after our report (withheld from us, sent late, or we were
        left out of its contributors), so the screen had one witness fewer. We audit them
        whatever the rate (``peer.audit``): a reducer that keeps a witness out of the screen has
        its mean checked anyway. A part its own slice proved wrong needs no audit."""
        out = [j for j in self.witnessing if self.holds(j) and self.me not in self.vouches.get(j, {})
               and bytes(self.group.members[j]) not in self.offences and j not in self.convicted]
        for j in out:
            log.info("witnessed part not vouched for part=%d peer=%s group=%s: auditing its mean", j,
                     self.peer_ids[j], self.group.group_id.hex())
        return out

    def _take_vouches(self, i: int, witness: tuple[float, ...]) -> None:
        """Member i's report's ``PartsHeld.witness``: its vouches for the parts it witnesses."""
        parts = [j for j in range(self.n) if i in self.witnesses[j]]
        if len(witness) != 2 * len(parts):
            return  # tells us nothing
        for t, j in enumerate(parts):
            norm, dot = float(witness[2 * t]), float(witness[2 * t + 1])
            if norm >= 0.0 and math.isfinite(norm) and math.isfinite(dot):
                self.vouches.setdefault(j, {})[i] = (norm, dot)

    def vouched(self, j: int) -> list[tuple[int, float, float]]:
        """Part j's witnesses' vouches, as ``screen_mean`` takes them: [(witness, norm, dot)]."""
        return [(w, n, d) for w, (n, d) in sorted(self.vouches.get(j, {}).items())]
