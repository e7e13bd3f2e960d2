"""Helpers for the whole-node tests: the JSON-line events of a demo's peers."""

import queue
import time


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
