"""The screen of one member's round (``peer.allreduce_round.Round``): reduced parts whose mean
its contributions cannot give, by the norms and dots the members reported
(``protocol.butterfly``: ``mean_norm_bound``, ``screen_mean``), and what our own report says
of our pushes. Every member holding the same frames and reports decides alike; a member
that a liar told other reports than the rest may refuse a part they land, so a refused part is
audited before we land it or fall back (``peer.audit.Audits.before_landing``)."""

from __future__ import annotations

import logging
import math

import torch

from protocol.butterfly import mean_norm_bound, screen_mean, slice_norm

log = logging.getLogger("peer.allreduce")


class ScreenMixin:
    """``Round``'s screen. Reads the parts we hold, the reports' norms and dots, and the
    codec's error bound of each mean (``mean_errors``)."""

    def screen(self) -> tuple[list[int], list[int]]:
        """(``implausible``, ``inconsistent`` and not implausible): the parts of other reducers
        that the screens refuse, judged once, when the agreement is over (a report that comes
        later, while we audit them, changes nothing). Our own part is never screened: we
        computed its mean, so it is honest whatever a report says of it, and a member's false
        report to us alone would otherwise make us fall back on the mean the others land."""
        if self.screened is None:
            implausible = self.implausible()
            self.screened = (implausible, [j for j in self.inconsistent() if j not in implausible])
        return self.screened

    def implausible(self) -> list[int]:
        """Parts we hold whose mean is larger than its contributors' reported norms allow
        (``protocol.butterfly.mean_norm_bound``): a reducer that scaled its mean up, or sent
        another, by much. Every member that holds the same frames and reports decides alike.
        A refusal is not proof (a contributor's report may understate its push: to us alone,
        in a group of three, it makes an honest mean look too large), so the part is audited
        before we land (``screen``); without a verdict we fall back on it (the audit goes on,
        and suspends a reducer that never shows its inputs), and one we could not audit at all
        makes us stop grouping with its reducer (``AllReduceOutcome.refused``)."""
        norms = {**self.report_norms, self.me: self.norms}
        out = []
        for j in range(self.n):
            if j == self.me or not self.holds(j) or self.thrown_out(j):
                continue
            others = [i for i in self.contributors[j] if i != j] or [i for i in range(self.n) if i != j]
            if any(i not in norms for i in others):
                continue  # a contributor whose norms we lack (no report, or one without norms) may be anything
                # up to the clip, as in ``inconsistent``: a bound without it refused honest means, and a
                # liar that withheld its report from us alone (or its norms) made us audit one every round
            bound = mean_norm_bound([norms[i][j] for i in others], self.clip)
            s, e = self.bounds[j]
            if bound is not None and (norm := slice_norm(self.result[s:e])) > bound:
                log.warning("reduced part too large to be a mean of its contributions norm=%.3g bound=%.3g "
                            "part=%d reducer=%s group=%s: auditing it before we land", norm, bound, j, self.peer_ids[j],
                            self.group.group_id.hex())
                out.append(j)
        return out

    def pushing(self, j: int, encoded: list[tuple[int, int, bytes]]) -> None:
        """Our push of part j, encoded in chunks [(start, end, bytes)]: what its reducer will
        average, decoded, for our report's norm and dot of it."""
        s, e = self.bounds[j]
        out = torch.empty(e - s, dtype=torch.float32)
        for a, b, payload in encoded:
            out[a - s:b - s] = self.codec.decode(payload, b - a)
        self.pushed_out[j] = out
        self.norms[j] = slice_norm(out)

    def my_dots(self) -> tuple[float, ...]:
        """Our report's dots (``PartsHeld.dots``): for each part we hold and contributed to,
        ``<its mean, our push of it>`` in float64; 0.0 where we cannot say."""
        out = []
        for j in range(self.n):
            s, e = self.bounds[j]
            mine = self.pushed_out.get(j)
            known = (j != self.me and mine is not None and self.holds(j) and self.me in self.contributors[j])
            out.append(float(torch.dot(self.result[s:e].double(), mine.double())) if known else 0.0)
        self.dots = tuple(out)
        return self.dots

    def inconsistent(self) -> list[int]:
        """Parts we hold whose mean its contributions cannot give, by the members' reported
        norms and dots (``protocol.butterfly.mean_consistent``): negated, another vector, or
        scaled up beyond what the reducer's own slice allows. Every member that holds the same
        frames and reports decides alike; the part is audited before we land (``screen``):
        landed after all if the audit passes, fallen back on if not (a wrong mean proves the
        lie against its reducer, and bans it). One
        member's false report (a dot, a norm) cannot make an honest part fail: the screen
        refuses a mean only if it fits no world with one liar (``screen_mean``). Where the
        part's witnesses vouched for the reducer's own slice (``peer.round_witness``), its term
        is reported like the others' rather than its word: a negated mean, or another part's, no
        longer hides in it, in groups of 3-5 too (``bench/witness.py``). Two colluding
        members can, so a refusal alone proves nothing: it distrusts and bans nobody (the audit
        decides)."""
        norms = {**self.report_norms, self.me: tuple(self.norms)}
        dots = {**self.report_dots, self.me: self.dots}
        out = []
        for j in range(self.n):
            if j == self.me or not self.holds(j) or self.thrown_out(j):
                continue
            others = [i for i in self.contributors[j] if i != j]
            # a contributor that did not report (or reported no norms) may be anything up to the clip
            said = {i: dots[i][j] if len(dots.get(i, ())) == self.n and dots[i][j] != 0.0 else None for i in others}
            s, e = self.bounds[j]
            # summed in offset order, so every member gets the same float whatever order the chunks came in
            error = math.sqrt(math.fsum(v for _, v in sorted(self.mean_errors[j].items()))) if j in self.mean_errors \
                else math.inf
            said_by = [(self.group.weights[i], norms[i][j] if i in norms else None, said[i]) for i in others]
            if not screen_mean(slice_norm(self.result[s:e]), error, self.clip, self.group.weights[j], said_by,
                               reporters=others, vouched=self.vouched(j), gate=self.gate, numel=e - s):
                log.warning("reduced part its contributions cannot give (by their reported dots) part=%d reducer=%s "
                            "group=%s: auditing it before we land", j, self.peer_ids[j], self.group.group_id.hex())
                out.append(j)
        return out
