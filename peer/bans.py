"""Peers banned from a run for a proven lie, each with its signed evidence on disk.

A ban needs signed proof (``protocol.evidence``): a frame its signer signed that no honest
client sends (values that are NaN or infinite, block scales or a layout the codec refuses, a
shape that is not a flat float32 slice), or two different means of one part signed by the same
reducer (equivocation). Being slow, late, short or unreachable never bans anyone. A banned
peer's pushes are averaged by none of our rounds (``peer.allreduce``); the groups it is in are
unchanged (every peer forms the same groups from the same joins), and its reduced parts are
checked like anyone's, so honest peers that have not seen the evidence still land what we land.

Files: ``<data dir>/<run>/bans/<peer ID>.frame``, the signed frame itself, or ``<peer
ID>.frames``, a msgpack list of the signed frames that together prove the lie; written
atomically.
At start every file is checked again; one that proves nothing (edited, truncated, another
run's) is ignored with a warning and left where it is, so nothing is banned on a file's word.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import msgpack

from protocol.evidence import proves
from protocol.identity import peer_id_from_public_key

log = logging.getLogger(__name__)

MAX_BANS = 256
MAX_EVIDENCE_FRAMES = 4096  # an audit's proof: a part's mean and its inputs, in frames
"""Evidence files kept per run. Past it a new offender is still banned, for this session only."""
MAX_EVIDENCE_BYTES = 256 << 20
"""Bytes of evidence kept per run (a frame is at most 64 MiB; a lie can be far smaller), so
many keys that lie cannot fill the disk. Past it, as past ``MAX_BANS``."""


@dataclass(frozen=True, slots=True)
class Ban:
    peer_id: str
    reason: str
    since: float
    """Unix time the evidence was saved."""


class Bans:
    """The bans of one run (see the module docstring)."""

    def __init__(self, directory: Path, run_id: bytes, clip: float = 0.0, gate: bool = False):
        self.directory, self.run_id = Path(directory), bytes(run_id)
        self.clip = clip  # the run's sync.clip: an audit's proof is checked with it
        self.gate = gate  # and its sync.gate
        self._bans: dict[bytes, Ban] = {}
        self._saved = 0  # bytes of evidence on disk
        self.peer_ids: set[str] = set()
        """The banned peer IDs; the averager reads this set (it is updated in place)."""

    def load(self) -> None:
        """Read and check every evidence file; a file that proves nothing is ignored (logged)."""
        if not self.directory.is_dir():
            return
        for path in sorted([*self.directory.glob("*.frame"), *self.directory.glob("*.frames")]):
            try:
                data = path.read_bytes()
                since = path.stat().st_mtime
                self._saved += len(data)
            except OSError as e:
                log.warning("could not read ban evidence path=%s reason=%s", path, e.strerror)
                continue
            proven = proves(_frames(path, data), self.run_id, self.clip, self.gate)
            if proven is None or peer_id_from_public_key(proven[0]) != path.stem:
                log.warning("ban evidence proves nothing and is ignored path=%s (delete it, or restore the "
                            "original file)", path)
                continue
            self._ban(proven[0], proven[1], since)

    def add(self, key: bytes, reason: str, evidence: bytes | tuple[bytes, ...]) -> bool:
        """Ban ``key`` with ``evidence`` (one signed frame, or the frames that together prove
        the lie; checked again here). -> False when it proves nothing against ``key`` or the
        key is banned already."""
        frames = ((bytes(evidence),) if isinstance(evidence, (bytes, bytearray, memoryview))
                  else tuple(bytes(f) for f in evidence))
        proven = proves(frames, self.run_id, self.clip, self.gate)
        if proven is None or proven[0] != key or key in self._bans:
            return False
        peer_id = peer_id_from_public_key(key)
        name, data = ((f"{peer_id}.frame", bytes(frames[0])) if len(frames) == 1 else
                      (f"{peer_id}.frames", msgpack.packb([bytes(f) for f in frames], use_bin_type=True)))
        if len(self._bans) < MAX_BANS and self._saved + len(data) <= MAX_EVIDENCE_BYTES:
            try:
                self._write(self.directory / name, data)
                self._saved += len(data)
            except OSError as e:
                log.warning("could not save ban evidence peer=%s reason=%s; banned for this session only",
                            peer_id, e.strerror)
        else:
            log.warning("%d bans (%d MiB of evidence) saved already; peer=%s is banned for this session only",
                        len(self._bans), self._saved >> 20, peer_id)
        self._ban(key, proven[1], time.time())
        log.warning("banned peer=%s reason=%s evidence=%s", peer_id, proven[1], self.directory / name)
        return True

    def evidence(self, key: bytes) -> tuple[bytes, ...] | None:
        """The signed frames on disk that prove ``key`` lied, or None (not banned, banned for
        this session only, or the file is gone or unreadable). Reads only: safe from any thread."""
        if bytes(key) not in self._bans:
            return None
        peer_id = peer_id_from_public_key(key)
        for path in (self.directory / f"{peer_id}.frame", self.directory / f"{peer_id}.frames"):
            try:
                data = path.read_bytes()
            except FileNotFoundError:
                continue
            except OSError as e:
                log.info("could not read ban evidence path=%s reason=%s", path, e.strerror)
                return None
            return _frames(path, data) or None
        return None

    def reason(self, key: bytes) -> str | None:
        ban = self._bans.get(bytes(key))
        return ban.reason if ban else None

    def items(self) -> list[Ban]:
        return sorted(self._bans.values(), key=lambda b: b.since)

    def __len__(self) -> int:
        return len(self._bans)

    def _ban(self, key: bytes, reason: str, since: float) -> None:
        ban = Ban(peer_id_from_public_key(key), reason, since)
        self._bans[bytes(key)] = ban
        self.peer_ids.add(ban.peer_id)

    @staticmethod
    def _write(path: Path, data: bytes) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)


def _frames(path: Path, data: bytes) -> tuple[bytes, ...]:
    """The frames of an evidence file: a ``.frame`` is one; a ``.frames`` a msgpack list (an
    unreadable one yields nothing, which proves nothing)."""
    if path.suffix == ".frame":
        return (data,)
    try:
        frames = msgpack.unpackb(data, raw=False, max_bin_len=len(data), max_array_len=MAX_EVIDENCE_FRAMES)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError):
        return ()
    if not isinstance(frames, list) or not all(isinstance(f, bytes) for f in frames):
        return ()
    return tuple(frames)
