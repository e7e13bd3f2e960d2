"""The reduction of one member's round (``peer.allreduce_round.Round``): our part's robust mean
of the contributions we have (``protocol.butterfly`` clip, ``protocol.gate`` direction gate),
our own slice as its witnesses and auditors get it, and the commitment to the mean's inputs
(``protocol.audit``)."""

from __future__ import annotations

import logging
from typing import Any

import torch

from protocol.audit import contribution_digest, inputs_digest
from protocol.butterfly import clip_scales, lower_median, slice_norm
from protocol.gate import gram, robust_factors
from protocol.messages import digest

log = logging.getLogger("peer.allreduce")


class ReduceMixin:
    """``Round``'s reduction. Reads the pushes of our part, our own slice's chunks, the group's
    weights, and the run's ``clip`` and ``gate``."""

    def reduce(self) -> tuple[torch.Tensor, tuple[int, ...], float]:
        """Our slice's weighted mean over the members we have all of, in member order, each
        contribution scaled down to ``clip`` x the lower median norm first, and under the
        direction gate (``gate``) one that points against the others' sum counting for nothing
        (``protocol.gate.robust_factors``), as peer.simulation.allreduce does it.
        -> (fp32 mean, contributors, their total weight)."""
        me, (s, e) = self.me, self.bounds[self.me]
        if sum(n for _, n, _ in self.own_chunks) != e - s:
            raise RuntimeError("Round.own() gives our own slice before reduce()")
        contrib = tuple(i for i in range(self.n)
                        if i == me or (i not in self.dropped and i not in self.excluded and self.pushed[i] == e - s))
        total_w = float(sum(self.group.weights[i] for i in contrib))
        own = self.own_chunks
        norms = [slice_norm(self._decoded(i, own if i == me else None)) for i in contrib]
        factors, gated = robust_factors(norms, [self.group.weights[i] / total_w for i in contrib], self.clip,
                                        self.gate, lambda: self._gram(contrib))
        median = lower_median(norms)
        acc = torch.zeros(e - s, dtype=torch.float32)
        for k, (i, norm, scale, factor) in enumerate(zip(contrib, norms, clip_scales(norms, self.clip), factors)):
            if k in gated:
                self.gated.append(i)
                log.warning("gated slice (it points against the others' sum: counts for nothing) peer=%s group=%s",
                            self.peer_ids[i], self.group.group_id.hex())
            elif scale < 1.0:
                self.clipped.append(i)
                # at clip 1 half of an honest group is brought down a few percent every round:
                # a warning for a slice beyond twice the lower median only (as at clip 2)
                log.log(logging.WARNING if norm > 2.0 * median else logging.DEBUG,
                        "clipped slice norm=%.3g bound=%.3g peer=%s group=%s%s", norm, scale * norm,
                        self.peer_ids[i], self.group.group_id.hex(),
                        "" if scale else ": far beyond the group's norms, it counts for nothing")
            w = self.group.weights[i] / total_w * factor
            for off, cnt, payload in sorted(own if i == me else self.pushes.get(i, ()), key=lambda c: c[0]):
                self.codec.decode_add_(acc[off - s:off - s + cnt], payload, w)
        self.pushes.clear()  # the payloads are no longer needed
        return acc, contrib, total_w

    def _gram(self, contrib: tuple[int, ...]) -> torch.Tensor:
        """The Gram matrix of the contributions' slices as decoded (``protocol.gate.gram``),
        chunk by chunk: every slice is cut on one grid, so each is decoded once."""
        chunks = [sorted(self.own_chunks if i == self.me else self.pushes[i], key=lambda c: c[0]) for i in contrib]
        if any([(o, n) for o, n, _ in c] != [(o, n) for o, n, _ in chunks[0]] for c in chunks):
            return gram([[self._decoded(i, self.own_chunks if i == self.me else None) for i in contrib]])
        return gram([self.codec.decode(c[k][2], c[k][1]) for c in chunks] for k in range(len(chunks[0])))

    def own(self, encoded: list[tuple[int, int, bytes]], frames: list[list[Any]]) -> None:
        """Our own slice of our part, encoded in chunks [(start, end, bytes)] as we average it
        (``reduce``), and sealed as the ``PushSlice`` frames our witnesses get."""
        self.own_chunks, self.own_frames = [(a, b - a, payload) for a, b, payload in encoded], frames

    def own_digests(self) -> dict[int, bytes]:
        """Offset -> payload digest of each chunk of our own slice (``SliceAveraged.own`` of our
        mean's chunk at that offset: we chunk both alike)."""
        return {a: digest(payload) for a, _, payload in self.own_chunks}

    def commit(self, contrib: tuple[int, ...]) -> bytes:
        """Our commitment to the inputs of our mean (``protocol.audit.inputs_digest``), our own
        slice as we encoded it (``own``); the inputs are kept to show a member that audits it."""
        me = self.me
        self.committed = True
        self.push_frames = {i: f for i, f in self.push_frames.items() if i in contrib}
        shares = []
        for i in contrib:
            key, w = bytes(self.group.members[i]), self.group.weights[i]
            chunks = ([(o, n, digest(p)) for o, n, p in self.own_chunks] if i == me
                      else [(o, n, d) for o, n, d, _ in self.push_frames[i]])
            shares.append(contribution_digest(key, w, chunks))
        return inputs_digest(shares)

    def _decoded(self, i: int, chunks: list[tuple[int, int, Any]] | None = None) -> torch.Tensor:
        """Member i's push of our slice (or ``chunks`` [(offset, numel, payload)]), decoded whole
        (for its norm)."""
        s, e = self.bounds[self.me]
        out = torch.empty(e - s, dtype=torch.float32)
        for off, cnt, payload in self.pushes[i] if chunks is None else chunks:
            out[off - s:off - s + cnt] = self.codec.decode(payload, cnt)
        return out

