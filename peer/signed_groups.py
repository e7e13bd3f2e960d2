"""The groups this peer has signed messages in, kept on disk across restarts, so that it never
signs two sets of messages for one group.

Two frames one key signed for one group that contradict each other are proof that it lied
(``protocol.evidence``: two means of one part, two finals naming different parts). An honest
peer signs each once; but a peer killed after it sent its mean or its final, and restarted
with the same key and data dir, may meet the same group again (a group's ID follows from the
run, fragment, round and members: ``peer.batches.group_id_of``), recompute, and sign other
frames, which the members that kept the round would take for a lie and ban it for. As a
validator's slashing-protection record does, the averager notes a group's ID here (in memory
at once, then written to disk and synced) before it signs anything for it, and takes no part in
a group it finds here, nor in one it could not write down: the round fails, the node averages
it alone and compares states after it.

One line of hex per group, appended; the file is cut to the newest ``KEEP`` IDs when it grows
past twice that (a round far in the past is not averaged again). A line that is not a group ID
(a torn write) is skipped; an append after a torn last line starts a line of its own."""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from pathlib import Path

from peer.identity_store import _fsync_dir  # (the same durable-rename step as the key file's)
from protocol.messages import GROUP_ID_BYTES

log = logging.getLogger(__name__)

KEEP = 4096


class SignedGroups:
    def __init__(self, path: Path, keep: int = KEEP):
        self.path, self.keep = Path(path), keep
        self._ids: OrderedDict[bytes, None] = OrderedDict()
        self._lines = 0
        self._torn = False  # the file does not end with a newline
        self._lock = threading.Lock()  # writes come from worker threads, several rounds at once
        try:
            text = self.path.read_text(encoding="ascii", errors="replace")
        except FileNotFoundError:
            return
        except OSError as e:  # (a directory in its place, no permission): writes will fail too, and then no
            # group is averaged in (``write``)
            log.error("the record of groups signed in could not be read (%s): %s", e, self.path)
            return
        self._torn = bool(text) and not text.endswith("\n")
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

    def reserve(self, group_id: bytes) -> bool:
        """Note ``group_id`` in memory (on the event loop, before any await: two calls for one
        group cannot both pass). -> False if it was noted already (signed in, or under way)."""
        gid = bytes(group_id)
        with self._lock:
            if gid in self._ids:
                return False
            self._ids[gid] = None
            while len(self._ids) > self.keep:
                self._ids.popitem(last=False)
            return True

    def write(self, group_id: bytes) -> bool:
        """Write a reserved ``group_id`` to disk, flushed and synced (in a worker thread).
        -> False if it could not be written (then nothing may be signed for it)."""
        gid = bytes(group_id)
        with self._lock:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                if self._lines >= 2 * self.keep:
                    self._rewrite()
                    return True
                new = not self.path.exists()
                with open(self.path, "a", encoding="ascii") as f:
                    f.write(("\n" if self._torn else "") + gid.hex() + "\n")
                    f.flush()
                    os.fsync(f.fileno())
                self._torn = False
                self._lines += 1
                if new:
                    _fsync_dir(self.path.parent)
                return True
            except OSError as e:  # (a full disk)
                log.error("could not record group=%s as signed in (%s): taking no part in it", gid.hex(), e)
                return False

    def add(self, group_id: bytes) -> bool:
        """``reserve`` and ``write``. -> False if noted already, or not written."""
        return self.reserve(group_id) and self.write(group_id)

    def _rewrite(self) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "w", encoding="ascii") as f:
            f.write("".join(g.hex() + "\n" for g in self._ids))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        _fsync_dir(self.path.parent)
        self._lines, self._torn = len(self._ids), False

