"""The pure part of matchmaking (``peer.matchmaking``): the DHT keys of a round's records, the
seed that shuffles its groups, batches of joins and the groups dealt from a batch. Every peer
computes the same groups from the same joins with these."""

from __future__ import annotations

import hashlib
import math

from peer.presence import PREFIX
from protocol.errors import LocalProtocolError
from protocol.messages import GROUP_ID_BYTES

__all__ = ["assign_groups", "batch_of", "busiest_batch", "group_id_of", "groups_key", "joins_key", "rank",
           "round_seed"]


def joins_key(run_id: bytes, fragment: int, round: int) -> str:
    return f"{PREFIX}/run/{run_id.hex()}/avg/{fragment}/{round}/joins"


def groups_key(run_id: bytes, fragment: int, round: int) -> str:
    return f"{PREFIX}/run/{run_id.hex()}/avg/{fragment}/{round}/groups"


def round_seed(run_id: bytes, fragment: int, round: int) -> bytes:
    """The seed that shuffles the groups of one (run, fragment, round)."""
    return hashlib.sha256(b"swarmstream/groups/v1\0" + run_id + fragment.to_bytes(4, "big")
                          + round.to_bytes(8, "big")).digest()


def rank(seed: bytes, key: bytes) -> bytes:
    return hashlib.sha256(seed + key).digest()


def assign_groups(seed: bytes, keys: list[bytes] | set[bytes], group_size: int) -> list[tuple[bytes, ...]]:
    """Partition ``keys`` into ceil(n / group_size) groups of near-equal size, each in rank
    order (its first member leads). Deterministic: the same keys and seed, the same groups."""
    if group_size < 1:
        raise LocalProtocolError("group_size must be >= 1")
    order = sorted(set(keys), key=lambda k: rank(seed, k))
    count = math.ceil(len(order) / group_size)
    return [tuple(order[g::count]) for g in range(count)]


def batch_of(join_times: dict[bytes, float], me: bytes, gap_s: float, span_s: float) -> tuple[list[bytes], float]:
    """The batch of joins that ``me`` belongs to, and the time it closes.

    Batches are chained greedily from the earliest join: each next join extends the batch if
    it comes at most ``gap_s`` after the previous one and at most ``span_s`` after the batch's
    first; otherwise it starts the next batch. A batch closes ``gap_s`` after its last join
    (no later join can extend it), or at ``first + span_s``. ``me`` must be in ``join_times``."""
    order = sorted(join_times, key=lambda k: (join_times[k], k))
    batches: list[list[bytes]] = []
    first = last = 0.0
    for k in order:
        t = join_times[k]
        if not batches or t > last + gap_s or t > first + span_s:
            if batches and me in batches[-1]:
                break
            batches.append([])
            first = t
        batches[-1].append(k)
        last = t
    batch = batches[-1]
    assert me in batch
    return batch, min(last + gap_s, first + span_s)


def busiest_batch(times: list[float], gap_s: float, span_s: float) -> float:
    """The first join time of the batch (chained as ``batch_of`` chains them) that holds the
    most of ``times``, the earliest of those on a tie."""
    batches: list[list[float]] = []
    for t in sorted(times):
        if not batches or t > batches[-1][-1] + gap_s or t > batches[-1][0] + span_s:
            batches.append([])
        batches[-1].append(t)
    return max(batches, key=len)[0]  # max keeps the first of equals: the earliest


def group_id_of(seed: bytes, members: tuple[bytes, ...], idle: tuple[int, ...] = ()) -> bytes:
    """A group's ID: its members, in order, and those of them that reduce nothing (``idle``), so
    two records that cut the fragment differently are two groups (a leader writing both could
    otherwise make honest members refuse each other's frames as off their slices)."""
    if not idle:
        return hashlib.sha256(b"swarmstream/group-id/v1\0" + seed + b"".join(members)).digest()[:GROUP_ID_BYTES]
    return hashlib.sha256(b"swarmstream/group-id/v2\0" + seed + len(members).to_bytes(2, "big") + b"".join(members)
                          + bytes(idle)).digest()[:GROUP_ID_BYTES]
