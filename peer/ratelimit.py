"""Bandwidth caps on the averaging streams: a token bucket per direction.

The volunteer's ``network.max_upload_mbps`` / ``max_download_mbps`` (``protocol.settings``)
become one ``RateLimiter`` each, shared by every stream of the node. Senders ``take`` the
bytes of each chunk before writing it; readers take what they read, which holds back the
reads and so, through TCP flow control, the sender. A rate of 0 means no cap and costs
nothing. The bucket runs into debt instead of refusing: a chunk bigger than the burst waits
for its whole time, and the next caller waits behind it, so the mean rate holds.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

CHUNK_BYTES = 64 << 10  # write size under a cap: small enough to keep the rate smooth


class RateLimiter:
    def __init__(self, bytes_per_s: float = 0.0, *, burst_s: float = 0.25,
                 clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.burst_s = burst_s
        self.rate = 0.0
        self.tokens = 0.0
        self.last = clock()
        self.set_rate(bytes_per_s)

    def set_rate(self, bytes_per_s: float) -> None:
        """Change the cap (0: none); takes effect for the next chunk."""
        if not bytes_per_s >= 0:
            raise ValueError(f"a rate must be >= 0 bytes/s, got {bytes_per_s}")
        self.rate = float(bytes_per_s)
        self.tokens = self.rate * self.burst_s  # a new cap starts with a full burst
        self.last = self.clock()

    @property
    def limited(self) -> bool:
        return self.rate > 0

    def reserve(self, nbytes: int) -> float:
        """Account for ``nbytes``; return how long to wait before sending them (seconds)."""
        if self.rate <= 0:
            return 0.0
        now = self.clock()
        self.tokens = min(self.rate * self.burst_s, self.tokens + (now - self.last) * self.rate)
        self.last = now
        self.tokens -= nbytes
        return 0.0 if self.tokens >= 0 else -self.tokens / self.rate

    async def take(self, nbytes: int) -> None:
        delay = self.reserve(nbytes)
        if delay > 0:
            await asyncio.sleep(delay)


def mbps_to_bytes_per_s(mbps: float) -> float:
    return mbps * 1e6 / 8
