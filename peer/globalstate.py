"""The run's global state as data: what a joiner downloads, and its byte layout.

``GlobalState`` holds every fragment's global fp32 copy and outer momentum, with the round
counters and step. ``snapshot`` / ``apply`` move it out of and into a ``peer.worker.Worker``;
``encode_state`` / ``decode_state`` give the deterministic byte layout and its ``StateIndex``
(layout described in ``peer.statesync``), whose digest heartbeats vouch for; ``choose_digest``
picks the digest most peers vouch for. No I/O here; ``peer.statesync`` moves the bytes.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import torch

from protocol.messages import MAX_FRAGMENTS, MAX_HEAD_BYTES, MAX_STATE_CHUNKS, encode
from protocol.messages import digest as sha256
from protocol.messages_swarm import StateIndex

FORMAT = "swarmstream-tensors/1"
"""``StateIndex.format`` of the blob layout described in peer/statesync.py's docstring."""
MAX_CHUNK_BYTES = 64 << 20
"""Largest chunk a donor sends (a chunk is one message in memory on both sides)."""
_ALIGN = 8
_NAME = re.compile(r"(global|outer_momentum)/(0|[1-9][0-9]{0,3})")
_MAX_NUMEL = 1 << 40


class StateSyncError(Exception):
    """The global state could not be fetched, decoded or applied; the message says why."""



# ---------------------------------------------------------------------------------------
# The state and the worker.


@dataclass(frozen=True, slots=True)
class GlobalState:
    tensors: dict[str, torch.Tensor]
    """``global/<p>`` and ``outer_momentum/<p>``: (N_p,) fp32 CPU tensors."""
    rounds: tuple[int, ...]
    """Completed outer rounds per fragment."""
    step: int
    """Inner steps of the run at this state."""


def snapshot(worker: Any, rounds: Sequence[int] | None = None, *, copy: bool = True) -> GlobalState:
    """A copy of ``worker``'s global state (call from the thread that trains it).

    ``rounds`` defaults to ``worker.rounds``; a Worker without that attribute must be given it.
    ``copy=False``: views of the worker's tensors instead, valid until it next trains (to
    ``pack_state`` them at once, on the same thread: one copy of the state, not two)."""
    if not worker.outer:
        raise StateSyncError("state sync needs sync.method='diloco' (a ddp worker has no global copy)")
    if rounds is None:
        rounds = getattr(worker, "rounds", None)
        if rounds is None:
            raise StateSyncError("snapshot needs the rounds per fragment (pass rounds=...)")
    rounds = tuple(int(r) for r in rounds)
    if len(rounds) != len(worker.outer):
        raise StateSyncError(f"{len(rounds)} round counters for {len(worker.outer)} fragments")
    tensors: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for p, frag in enumerate(worker.outer):
            g = frag.global_flat.detach()
            tensors[f"global/{p}"] = g.clone() if copy else g
            buf = frag.opt.state.get(frag.global_flat, {}).get("momentum_buffer")
            if buf is not None:
                m = buf.detach().float().cpu()
                tensors[f"outer_momentum/{p}"] = m.clone() if copy and m.data_ptr() == buf.data_ptr() else m
    return GlobalState(tensors=tensors, rounds=rounds, step=int(worker.step))


def apply(worker: Any, state: GlobalState, *, keep_progress: bool = False) -> None:
    """Load ``state`` into ``worker``: global copies, outer momentum (cleared where the state has
    none), local weights := global copy, ``step``, and ``rounds`` if the worker keeps them.
    Everything is checked first; on a mismatch StateSyncError is raised and nothing changed.

    ``keep_progress`` (a repair: the same rounds, another copy): what the worker trained since
    its last syncs is moved onto the new global copies (local := new global - its pseudo-
    gradient), and its step and tokens since each sync stay, so its next contributions carry
    that work at the weight they were announced with."""
    n = len(worker.outer)
    expected = {f"global/{p}": frag.numel for p, frag in enumerate(worker.outer)}
    missing = sorted(k for k in expected if k not in state.tensors)
    allowed = set(expected) | {f"outer_momentum/{p}" for p in range(n)}
    extra = sorted(k for k in state.tensors if k not in allowed)
    if missing or extra:
        raise StateSyncError(f"the fetched state does not fit this model (missing {missing[:3]}, "
                             f"unexpected {extra[:3]}); is the run's model config the same?")
    for name, t in state.tensors.items():
        numel = expected[name.replace("outer_momentum/", "global/")]
        if t.dtype != torch.float32 or tuple(t.shape) != (numel,):
            raise StateSyncError(f"the fetched state's {name} is {t.dtype} {tuple(t.shape)}, this model needs "
                                 f"torch.float32 ({numel},); is the run's model config the same?")
    if len(state.rounds) != n:
        raise StateSyncError(f"the fetched state has {len(state.rounds)} round counters for {n} fragments")
    check_finite(state)
    # everything checked: now change the worker
    progress = [frag.pseudo_gradient() for frag in worker.outer] if keep_progress else None
    with torch.no_grad():
        for p, frag in enumerate(worker.outer):
            frag.global_flat.copy_(state.tensors[f"global/{p}"])
            mom = state.tensors.get(f"outer_momentum/{p}")
            if mom is None:
                frag.opt.state.pop(frag.global_flat, None)
            else:
                frag.opt.state[frag.global_flat] = {"momentum_buffer": mom.detach().clone()}
            frag.merge_into_local(0.0)
            if progress is not None:
                frag.set_local(frag.global_flat - progress[p])
    if progress is not None:
        return  # step, tokens since each sync and rounds (the same) stay
    worker.step = int(state.step)
    # the local weights are now the global copy: nothing trained since is in them
    worker.tokens_since_sync = [0] * n
    if hasattr(worker, "rounds"):
        worker.rounds = list(state.rounds)


# ---------------------------------------------------------------------------------------
# Serialization (pure).


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


@dataclass(frozen=True, slots=True)
class PackedState:
    """A state's blob, its index not computed yet (``pack_state``, then ``index_packed``)."""

    blob: bytearray | memoryview
    rounds: tuple[int, ...]
    step: int


def pack_state(state: GlobalState) -> PackedState:
    """Copy ``state`` into its blob (see the module docstring): one copy, no hashing. Call it
    where the tensors cannot change meanwhile (the training thread, for a snapshot's views).
    The blob's memory comes from torch and is filled by torch, which both leave the GIL free:
    the event loop goes on meanwhile (a ``bytearray`` of a 1.2 GB state is zeroed holding the
    GIL for about a second)."""
    return _pack(state, lambda n: memoryview(torch.empty(n, dtype=torch.uint8).numpy()))


def _pack(state: GlobalState, alloc: Any) -> PackedState:
    names = sorted(state.tensors)
    arrays = []
    for name in names:
        t = state.tensors[name]
        if not _NAME.fullmatch(name) or t.dtype != torch.float32 or t.dim() != 1:
            raise StateSyncError(f"cannot serialize {name!r} ({t.dtype}, {t.dim()}-D): state tensors are "
                                 "global/<p> or outer_momentum/<p>, 1-D fp32")
        arrays.append(t.detach().cpu().contiguous())
    header = msgpack.packb([[name, int(a.numel())] for name, a in zip(names, arrays)], use_bin_type=True)
    start = _aligned(4 + len(header))
    total = start + sum(4 * a.numel() for a in arrays)
    blob = alloc(total)
    out = torch.frombuffer(blob, dtype=torch.uint8)
    out[:start].zero_()  # the padding after the header: part of the digest
    blob[:4] = len(header).to_bytes(4, "big")
    blob[4:4 + len(header)] = header
    pos = start
    for a in arrays:
        n = 4 * a.numel()
        if sys.byteorder == "little":  # torch copies without the GIL
            out[pos:pos + n].copy_(a.view(torch.uint8))
        else:
            blob[pos:pos + n] = memoryview(a.numpy().astype("<f4")).cast("B")
        pos += n
    return PackedState(blob, tuple(int(r) for r in state.rounds), int(state.step))


def index_packed(packed: PackedState, run_id: bytes, chunk_bytes: int) -> StateIndex:
    """The index of a packed state: one SHA-256 pass over the blob (hashlib releases the GIL,
    so another thread may run it while the event loop goes on)."""
    total = len(packed.blob)
    # more chunks than an index may list: grow them, the same way on every peer
    size = max(chunk_bytes, -(-total // MAX_STATE_CHUNKS))
    if size > MAX_CHUNK_BYTES:
        raise StateSyncError(f"a state of {total} bytes is too large to sync (over {MAX_STATE_CHUNKS} chunks "
                             f"of {MAX_CHUNK_BYTES} bytes)")
    view = memoryview(packed.blob)
    digests = tuple(sha256(view[o:o + size]) for o in range(0, total, size))
    return StateIndex(run_id=run_id, step=packed.step, rounds=packed.rounds, format=FORMAT,
                      total_bytes=total, chunk_bytes=size, chunk_digests=digests)


def encode_state(state: GlobalState, run_id: bytes, chunk_bytes: int) -> tuple[StateIndex, bytearray]:
    """The state's index and blob (see the module docstring); deterministic. Costs about one
    SHA-256 pass and one copy of the state (~1 s per GB)."""
    packed = _pack(state, bytearray)
    return index_packed(packed, run_id, chunk_bytes), packed.blob  # type: ignore[return-value]


def index_digest(index: StateIndex) -> bytes:
    """The digest heartbeats vouch for: SHA-256 of the encoded index."""
    return sha256(encode(index))


def decode_state(index: StateIndex, blob: bytes | bytearray) -> GlobalState:
    """Parse a blob that matches ``index``; raises StateSyncError on anything malformed.
    The tensors are views into ``blob`` when it is a bytearray (no copy)."""
    if not isinstance(blob, bytearray):
        blob = bytearray(blob)  # the tensors are views into it, and torch wants writable memory
    view = memoryview(blob)
    if index.format != FORMAT:
        raise StateSyncError(f"the state is in format {index.format!r}; this client reads {FORMAT!r} "
                             "(upgrade swarmstream)")
    if len(view) != index.total_bytes or len(view) < 4:
        raise StateSyncError(f"the state blob is {len(view)} bytes, its index says {index.total_bytes}")
    head_len = int.from_bytes(view[:4], "big")
    if 4 + head_len > len(view) or head_len > MAX_HEAD_BYTES:
        raise StateSyncError(f"the state header of {head_len} bytes does not fit the blob")
    try:
        header = msgpack.unpackb(view[4:4 + head_len], raw=False, use_list=False, max_str_len=64,
                                 max_bin_len=0, max_array_len=2 * MAX_FRAGMENTS, max_map_len=0, max_ext_len=0)
    except Exception as e:  # noqa: BLE001  (msgpack raises many types on junk)
        raise StateSyncError(f"the state header is not valid msgpack ({type(e).__name__})") from None
    if type(header) is not tuple:
        raise StateSyncError("the state header is not a list")
    entries: list[tuple[str, int]] = []
    for item in header:
        if not (type(item) is tuple and len(item) == 2 and type(item[0]) is str and type(item[1]) is int
                and _NAME.fullmatch(item[0]) and 0 <= item[1] <= _MAX_NUMEL):
            raise StateSyncError("the state header has a malformed entry")
        entries.append(item)
    names = [name for name, _ in entries]
    if names != sorted(set(names)):
        raise StateSyncError("the state header's names are not sorted and distinct")
    start = _aligned(4 + head_len)
    if start + 4 * sum(numel for _, numel in entries) != len(view) or any(view[4 + head_len:start]):
        raise StateSyncError("the state blob's size or padding does not match its header")
    sizes = dict(entries)
    fragments = len(index.rounds)
    if {k for k in names if k.startswith("global/")} != {f"global/{p}" for p in range(fragments)}:
        raise StateSyncError(f"the state does not hold global/0..{fragments - 1} for its {fragments} fragments")
    for name, numel in entries:
        if name.startswith("outer_momentum/") and sizes.get(name.replace("outer_momentum/", "global/")) != numel:
            raise StateSyncError(f"the state's {name} does not match its global copy")
    tensors = {}
    pos = start
    for name, numel in entries:
        arr = np.frombuffer(blob, dtype="<f4", count=numel, offset=pos) if numel else np.empty(0, "<f4")
        tensors[name] = torch.from_numpy(arr.astype(np.float32, copy=False))
        pos += 4 * numel
    return GlobalState(tensors=tensors, rounds=tuple(index.rounds), step=int(index.step))



def check_finite(state: GlobalState) -> None:
    """Raise StateSyncError if any tensor of ``state`` holds NaN or infinite values."""
    for name, t in state.tensors.items():
        if not bool(torch.isfinite(t).all()):
            raise StateSyncError(f"the fetched state's {name} holds NaN or infinite values; not loading it")


PLAUSIBLE_ROUNDS_AHEAD = 2
"""A state at most this many rounds ahead of ours must also be near ours (``check_distance``)."""
PLAUSIBLE_FACTOR = 8.0
"""How many of our largest outer steps one round of difference may account for."""


def check_distance(worker: Any, state: GlobalState, rounds: Sequence[int]) -> None:
    """Raise StateSyncError unless every fragment of ``state`` is as near ours as the rounds it
    claims allow: within PLAUSIBLE_FACTOR x (rounds ahead + 2) x the largest outer step this
    worker has taken of that fragment. Checked for states up to PLAUSIBLE_ROUNDS_AHEAD rounds
    ahead (a repair, a catch-up after a short pause); for a fragment this worker never stepped,
    or a state further ahead, nothing here can judge the distance, and the two or more donors
    that vouch for it (peer.node.catchup) are what is trusted."""
    for p, frag in enumerate(worker.outer):
        ahead = max(0, int(state.rounds[p]) - int(rounds[p]))
        scale = frag.largest_update_norm
        if not scale or ahead > PLAUSIBLE_ROUNDS_AHEAD:
            continue
        limit = PLAUSIBLE_FACTOR * (ahead + 2) * scale
        dist = float(torch.linalg.vector_norm(state.tensors[f"global/{p}"] - frag.global_flat, dtype=torch.float64))
        if not dist <= limit:
            raise StateSyncError(f"the fetched state's fragment {p} is {dist:.3g} away from ours, more than the "
                                 f"{limit:.3g} that {ahead} round(s) ahead can explain; not loading it")


def vouchers_needed(others: int) -> int:
    """How many peers must vouch for one state before a node downloads it to catch up, with
    ``others`` other live peers in the run: 2, or 1 in a swarm of two, where nothing could tell
    a liar from an honest peer. Every live peer counts, also one that is joining or has not
    landed a round yet: otherwise one liar could outrun a young swarm, or a swarm whose peers
    start at once. The run's creator is believed alone (``choose_digest``'s ``trusted``); a run
    whose creator left needs two peers with its state before a newcomer can catch up."""
    return 2 if others >= 2 else 1


def repair_vote(me: bytes, mine: dict[tuple[int, ...], bytes], peers: dict[bytes, tuple[tuple[int, ...], bytes]]
                ) -> tuple[bool, list[bytes], list[bytes]]:
    """Whether a node that went its own way should take the others' copy: -> (take, the keys
    that hold our copy (``me`` first), the keys that hold another).

    ``mine`` is our digest at each landing since we went our own way; ``peers`` each peer's
    heartbeat (rounds, digest). A peer counts at the rounds it shows, if we passed them (in a
    fast swarm two peers rarely show the same rounds at one moment); others do not count.
    More peers hold our copy: keep it; more hold others: take theirs; a tie goes to the side
    of the smallest key, the same choice on every peer whichever rounds each compared at, so
    two peers that each averaged alone converge on one of their copies."""
    agree, differ = [me], []
    for key, (rounds, digest) in peers.items():
        ours = mine.get(tuple(rounds))
        if digest and ours is not None:
            (agree if digest == ours else differ).append(key)
    take = len(differ) > len(agree) or (len(differ) == len(agree) and min(differ) < min(agree))
    return take, agree, differ


def choose_digest(vouches: dict[bytes, bytes], min_vouchers: int = 2, trusted: frozenset[bytes] = frozenset(),
                  tie_by_key: bool = False) -> tuple[bytes, list[bytes]] | None:
    """The state digest most peers vouch for, and its vouchers (public keys, sorted).

    ``vouches`` maps a peer's public key to the digest in its live heartbeat; empty digests are
    ignored. Ties go to the smallest digest, so every joiner picks the same one; with
    ``tie_by_key``, to the digest that the smallest key vouches for (the same winner among the
    same peers whichever rounds their digests are compared at). None unless at
    least ``min_vouchers`` peers vouch for the winner, or one of them is ``trusted`` (the run's
    creator): one peer's word alone, which any key can give, never picks a state."""
    by_digest: dict[bytes, list[bytes]] = {}
    for key, d in vouches.items():
        if d:
            by_digest.setdefault(bytes(d), []).append(bytes(key))
    if not by_digest:
        return None
    best = min(by_digest, key=lambda d: (-len(by_digest[d]), min(by_digest[d]) if tie_by_key else d))
    vouchers = sorted(by_digest[best])
    if len(vouchers) < min_vouchers and not trusted.intersection(vouchers):
        return None
    return best, vouchers

