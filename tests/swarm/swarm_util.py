"""Helpers for the swarm tests: the JSON-line events of a demo's peers, and ending the
processes a test started (with their libp2p daemons) even when the test failed."""

import fcntl
import os
import queue
import signal
import time
from pathlib import Path

import pytest

# Tests that assert how long something took, and test_load (whose busy loops would starve
# them): one xdist group, so they never run side by side on the two workers.
TIMED = pytest.mark.xdist_group("cpu_timing")


class Events:
    """Every JSON line the demo's peers print, as (peer index, event) on a queue."""

    def __init__(self):
        self.q: queue.Queue = queue.Queue()
        self.seen: list[tuple[int, dict]] = []

    def __call__(self, i: int, ev: dict) -> None:
        self.q.put((i, ev))

    def wait_for(self, pred, timeout: float = 120.0) -> tuple[int, dict]:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no matching event within {timeout} s; saw {self.seen[-5:]}")
            try:
                item = self.q.get(timeout=left)
            except queue.Empty:
                continue
            self.seen.append(item)
            if pred(*item):
                return item

    def drain(self) -> list[tuple[int, dict]]:
        while True:
            try:
                self.seen.append(self.q.get_nowait())
            except queue.Empty:
                return self.seen


def own_process_group() -> None:
    """Call first thing in a spawned peer process: it leads a process group of its own, so
    the p2pd it starts is in that group and ``kill_process_group`` ends both (a SIGKILLed
    Python process leaves its daemon behind otherwise)."""
    os.setpgid(0, 0)


def kill_process_group(pid: int | None) -> None:
    """SIGKILL the process group that ``pid`` leads (a node started in a session of its own,
    or a peer after ``own_process_group``, and its p2pd); nothing if it is gone."""
    if not pid:
        return
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def identity_holder(identity_path: Path) -> int | None:
    """The PID of the node that holds ``identity_path`` (it keeps an exclusive lock on the file
    next to the key, with its PID written in it); None if no process holds it."""
    lock_path = Path(str(identity_path) + ".lock")
    try:
        fd = os.open(lock_path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:  # held: read who holds it
            pid = os.pread(fd, 32, 0).decode(errors="replace").strip()
            return int(pid) if pid.isdigit() else None
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def start_process(procs: list, target, *args):
    """Start ``target(*args, out_q, stop_event)`` in a spawned process, kept in ``procs`` (the
    ``procs`` fixture ends it); -> its output queue."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q, stop = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=target, args=(*args, q, stop), daemon=True)
    p.start()
    procs.append((p, stop))
    return q


def landings(events, peers: tuple[int, ...]):
    """(peer, the fragment's digest it held before, the ``synced`` event) for every landing of
    ``peers``, in order. The digest held is None before a peer's first landing (the common
    initial model), and "?" after a state download."""
    held: dict[tuple[int, int], str | None] = {}
    for i, ev in events:
        if i not in peers:
            continue
        if ev.get("event") == "state_synced":
            for f in range(len(ev["rounds"])):
                held[(i, f)] = "?"
        elif ev.get("event") == "synced":
            key = (i, ev["fragment"])
            yield i, held.get(key), ev
            held[key] = ev["digest"]


def shared_landings(events, peers: tuple[int, ...]) -> dict[tuple[int, int, str], set[str]]:
    """For every group landing that all of ``peers`` were in, entering it with the same copy of
    the fragment (the digest each landed last, or the common initial model): the digests they
    landed. Honest members of one group who held one copy must land one result."""
    landed: dict[tuple[int, int, str], dict[int, tuple[str | None, str]]] = {}
    for i, before, ev in landings(events, peers):
        if not ev["alone"]:
            landed.setdefault((ev["fragment"], ev["round"], ev["group"]), {})[i] = (before, ev["digest"])
    return {k: {d for _, d in by_peer.values()} for k, by_peer in landed.items()
            if len(by_peer) == len(peers) and len({b for b, _ in by_peer.values()}) == 1
            and "?" not in {b for b, _ in by_peer.values()}}


def last_landings_shared(events, peers: tuple[int, ...]) -> bool:
    """Whether ``peers`` landed the last round of every fragment in one group, from one copy:
    then their final global copies must be identical. (Two peers that end at the same rounds
    also compare final copies before they go, ``Node._settle_final``; but told to finish at
    once, each stops after its own current round, and they may end a round apart.)"""
    last: dict[tuple[int, int], tuple[str | None, dict]] = {}
    for i, before, ev in landings(events, peers):
        last[(i, ev["fragment"])] = (before, ev)
    for f in {f for _, f in last}:
        mine = [last.get((i, f)) for i in peers]
        if any(m is None or m[1]["alone"] or m[0] == "?" for m in mine):
            return False
        if len({(m[0], m[1]["round"], m[1]["group"]) for m in mine}) != 1:
            return False
    return True
