"""The groups this peer has signed messages in, kept on disk across restarts, so that it never
signs two sets of messages for one group.

Two frames one key signed for one group that contradict each other are proof that it lied
(``protocol.evidence``: two means of one part, two finals naming different parts). An honest
peer signs each once; but a peer killed after it sent its mean or its final, and restarted
with the same key and data dir, may meet the same group again (a group's ID follows from the
run, fragment, round and members: ``peer.batches.group_id_of``), recompute, and sign other
frames, which the members that kept the round would take for a lie and ban it for. As a
validator's slashing-protection record does, the averager writes a group's ID here (flushed to
disk) before it signs anything for it, and takes no part in a group it finds here: that round
falls back, as one averaged alone does, and the node compares states after it.

One line of hex per group, appended; the file is cut to the newest ``KEEP`` IDs when it grows
past twice that (a round far in the past is not averaged again). A line that is not a group ID
(a torn write) is skipped."""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from pathlib import Path

from protocol.messages import GROUP_ID_BYTES

log = logging.getLogger(__name__)

KEEP = 4096


class SignedGroups:
    def __init__(self, path: Path, keep: int = KEEP):
        self.path, self.keep = Path(path), keep
        self._ids: OrderedDict[bytes, None] = OrderedDict()
        self._lines = 0
        try:
            text = self.path.read_text(encoding="ascii", errors="replace")
        except FileNotFoundError:
            return
        except OSError as e:  # (a directory in its place, no permission): the record starts empty
            log.warning("the record of groups signed in could not be read (%s); starting a new one at %s", e, self.path)
            return
        for line in text.splitlines():
            self._lines += 1
            try:
                gid = bytes.fromhex(line.strip())
            except ValueError:
                continue
            if len(gid) == GROUP_ID_BYTES:
                self._ids[gid] = None
                self._ids.move_to_end(gid)
        while len(self._ids) > self.keep:
            self._ids.popitem(last=False)

    def __contains__(self, group_id: bytes) -> bool:
        return bytes(group_id) in self._ids

    def __len__(self) -> int:
        return len(self._ids)

    def add(self, group_id: bytes) -> None:
        """Record ``group_id`` on disk (flushed and synced) before anything is signed for it."""
        gid = bytes(group_id)
        if gid in self._ids:
            return
        self._ids[gid] = None
        while len(self._ids) > self.keep:
            self._ids.popitem(last=False)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if self._lines >= 2 * self.keep:
                self._rewrite()
                return
            with open(self.path, "a", encoding="ascii") as f:
                f.write(gid.hex() + "\n")
                f.flush()
                os.fsync(f.fileno())
            self._lines += 1
        except OSError as e:  # (a full disk): held in memory, so this process still never signs twice
            log.warning("could not record group=%s as signed in (%s): a restart may average it again", gid.hex(), e)

    def _rewrite(self) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "w", encoding="ascii") as f:
            f.write("".join(g.hex() + "\n" for g in self._ids))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        self._lines = len(self._ids)
