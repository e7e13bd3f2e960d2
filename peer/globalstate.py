"""The run's global state as data: what a joiner downloads, and its byte layout.

``GlobalState`` holds every fragment's global fp32 copy and outer momentum, with the round
counters and step. ``snapshot`` / ``apply`` move it out of and into a ``peer.worker.Worker``;
``encode_state`` / ``decode_state`` give the deterministic byte layout and its ``StateIndex``
(layout described in ``peer.statesync``), whose digest heartbeats vouch for; ``choose_digest``
picks the digest most peers vouch for. No I/O here; ``peer.statesync`` moves the bytes.
"""

from __future__ import annotations

import bisect
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
    ``copy=False``: the worker's tensors themselves, shared (``OuterFragment.share``): they
    never change, the fragments take fresh ones at their next change (to serve them with
    ``pack_state``: no copy of the state at all)."""
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
            g, m = frag.share() if not copy else (frag.global_flat.detach().clone(), frag.momentum())
            tensors[f"global/{p}"] = g
            if m is not None:
                tensors[f"outer_momentum/{p}"] = m.clone() if copy else m
    return GlobalState(tensors=tensors, rounds=rounds, step=int(worker.step))


def max_state_bytes(worker: Any) -> int:
    """The most bytes a state that fits ``worker``'s model can take as a blob (header, every
    fragment's global copy and outer momentum): a donor's index that declares more is refused
    before a byte is allocated for it."""
    return _aligned(4 + MAX_HEAD_BYTES) + 8 * sum(frag.numel for frag in worker.outer)


def check_fits(worker: Any, state: GlobalState) -> None:
    """Raise StateSyncError unless ``state`` has exactly the tensors (names, fp32, sizes) and
    round counters of ``worker``'s fragments: a state from a peer is checked before anything
    computes with it."""
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


def apply(worker: Any, state: GlobalState, *, keep_progress: bool = False) -> None:
    """Load ``state`` into ``worker``: global copies, outer momentum (cleared where the state has
    none), local weights := global copy, ``step``, and ``rounds`` if the worker keeps them.
    Everything is checked first; on a mismatch StateSyncError is raised and nothing changed.

    ``keep_progress`` (a repair: the same rounds, another copy): what the worker trained since
    its last syncs is moved onto the new global copies (local := new global - its pseudo-
    gradient), and its step and tokens since each sync stay, so its next contributions carry
    that work at the weight they were announced with."""
    check_fits(worker, state)
    check_finite(state)
    n = len(worker.outer)
    # everything checked: now change the worker
    progress = [frag.pseudo_gradient() for frag in worker.outer] if keep_progress else None
    with torch.no_grad():
        for p, frag in enumerate(worker.outer):
            frag.load(state.tensors[f"global/{p}"], state.tensors.get(f"outer_momentum/{p}"))
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
    """A state's blob as it is served (``pack_state``): its header, then each tensor's bytes,
    read where they lie; its index is computed by ``index_packed``."""

    parts: tuple[memoryview, ...]
    """The header (padded), then each tensor's bytes in header order. Never changed while the
    state is served: a fragment's tensors are copied on write (``OuterFragment.share``)."""
    keys: tuple[Any, ...]
    """Per part, what identifies its bytes: equal keys, equal bytes (the header's own bytes;
    a tensor's storage address and in-place version, kept alive by the part's view)."""
    rounds: tuple[int, ...]
    step: int
    offsets: tuple[int, ...] = ()
    """Where each part starts in the blob, and where the blob ends."""

    def __post_init__(self) -> None:
        ends, pos = [0], 0
        for part in self.parts:
            pos += len(part)
            ends.append(pos)
        object.__setattr__(self, "offsets", tuple(ends))

    def __len__(self) -> int:
        return self.offsets[-1]

    def pieces(self, lo: int, hi: int) -> list[tuple[int, memoryview]]:
        """(part number, view) for the bytes [lo, hi) of the blob, in order."""
        out = []
        k = max(0, bisect.bisect_right(self.offsets, lo) - 1)
        while k < len(self.parts) and self.offsets[k] < hi:
            a, b = max(lo, self.offsets[k]), min(hi, self.offsets[k + 1])
            if b > a:
                out.append((k, self.parts[k][a - self.offsets[k]:b - self.offsets[k]]))
            k += 1
        return out

    def read(self, lo: int, hi: int) -> memoryview | bytes:
        """The bytes [lo, hi) of the blob: a view where they lie in one part, else a copy."""
        got = self.pieces(lo, min(hi, len(self)))
        if len(got) == 1:
            return got[0][1]
        return b"".join(view for _, view in got)

    def blob(self) -> bytearray:
        """The whole blob as one copy (what a joiner assembles)."""
        out = bytearray(len(self))
        view = memoryview(out)
        for k, part in enumerate(self.parts):
            view[self.offsets[k]:self.offsets[k + 1]] = part
        return out


def _tensor_bytes(t: torch.Tensor) -> tuple[memoryview, Any]:
    """A tensor's elements as little-endian fp32 bytes, and the key of those bytes."""
    if sys.byteorder == "little":
        # the view keeps the tensor (its storage) alive, so its address names these bytes
        return memoryview(t.numpy()).cast("B"), ("tensor", t.data_ptr(), t.numel(), t._version)
    return memoryview(t.numpy().astype("<f4")).cast("B"), ("copy", id(t))


def pack_state(state: GlobalState) -> PackedState:
    """The blob of ``state`` (see the module docstring) as views of its tensors: nothing is
    copied or hashed. The tensors must not change while it is served: a snapshot's views are
    shared by their fragments, which copy on their next change (``OuterFragment.share``)."""
    names = sorted(state.tensors)
    arrays = []
    for name in names:
        t = state.tensors[name]
        if not _NAME.fullmatch(name) or t.dtype != torch.float32 or t.dim() != 1:
            raise StateSyncError(f"cannot serialize {name!r} ({t.dtype}, {t.dim()}-D): state tensors are "
                                 "global/<p> or outer_momentum/<p>, 1-D fp32")
        arrays.append(t.detach().cpu().contiguous())
    header = msgpack.packb([[name, int(a.numel())] for name, a in zip(names, arrays)], use_bin_type=True)
    head = bytes(len(header).to_bytes(4, "big") + header).ljust(_aligned(4 + len(header)), b"\0")
    parts, keys = [memoryview(head)], [head]
    for a in arrays:
        view, key = _tensor_bytes(a)
        parts.append(view)
        keys.append(key)
    return PackedState(tuple(parts), tuple(keys), tuple(int(r) for r in state.rounds), int(state.step))


def index_packed(packed: PackedState, run_id: bytes, chunk_bytes: int,
                 reuse: tuple[PackedState, StateIndex] | None = None) -> StateIndex:
    """The index of a packed state: a SHA-256 pass over its chunks (hashlib releases the GIL,
    so another thread may run it while the event loop goes on). ``reuse``: a state published
    before, with its index; a chunk whose parts are the same bytes at the same places keeps its
    digest, so a landing hashes only the fragment that changed."""
    total = len(packed)
    # more chunks than an index may list: grow them, the same way on every peer
    size = max(chunk_bytes, -(-total // MAX_STATE_CHUNKS))
    if size > MAX_CHUNK_BYTES:
        raise StateSyncError(f"a state of {total} bytes is too large to sync (over {MAX_STATE_CHUNKS} chunks "
                             f"of {MAX_CHUNK_BYTES} bytes)")
    old = None
    if reuse is not None:
        was, was_index = reuse
        if (was.offsets == packed.offsets and was_index.chunk_bytes == size and was_index.format == FORMAT
                and was_index.run_id == run_id):
            old = (was, was_index)
    digests = []
    for o in range(0, total, size):
        pieces = packed.pieces(o, o + size)
        if old is not None and all(old[0].keys[k] == packed.keys[k] for k, _ in pieces):
            digests.append(old[1].chunk_digests[o // size])
        else:
            digests.append(sha256(*(view for _, view in pieces)))
    return StateIndex(run_id=run_id, step=packed.step, rounds=packed.rounds, format=FORMAT,
                      total_bytes=total, chunk_bytes=size, chunk_digests=tuple(digests))


def packed_blob(blob: bytes | bytearray | memoryview, rounds: Sequence[int], step: int) -> PackedState:
    """A blob already assembled (``encode_state``), as a ``PackedState`` of one part."""
    view = memoryview(blob).cast("B") if not isinstance(blob, memoryview) else blob
    return PackedState((view,), (("blob", id(blob)),), tuple(int(r) for r in rounds), int(step))


def encode_state(state: GlobalState, run_id: bytes, chunk_bytes: int) -> tuple[StateIndex, bytearray]:
    """The state's index and blob (see the module docstring); deterministic. Costs about one
    SHA-256 pass and one copy of the state (~1 s per GB)."""
    packed = pack_state(state)
    return index_packed(packed, run_id, chunk_bytes), packed.blob()


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
    worker has taken of that fragment, and the outer momentum within as many times its own norm
    (or a step's worth of pseudo-gradient). Checked for states up to PLAUSIBLE_ROUNDS_AHEAD rounds
    ahead (a repair, a catch-up after a short pause); for a fragment this worker never stepped,
    or a state further ahead, nothing here can judge the distance, and the two or more donors
    that vouch for it (peer.node.catchup) are what is trusted. Checks first that the state fits
    the model (``check_fits``)."""
    check_fits(worker, state)
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
        # the outer momentum too: it moves every later step, and a buffer of 3e38 (finite, and
        # passing every check above) made the copy NaN a few rounds after it was loaded
        ours, theirs = frag.momentum(), state.tensors.get(f"outer_momentum/{p}")
        if ours is None or theirs is None:
            continue
        lr = float(frag.opt.param_groups[0]["lr"]) or 1.0
        limit = PLAUSIBLE_FACTOR * (ahead + 2) * max(_norm(ours), scale / lr)  # a step moves it by about g = step / lr
        dist = float(torch.linalg.vector_norm(theirs - ours, dtype=torch.float64))
        if not dist <= limit:
            raise StateSyncError(f"the fetched state's outer momentum of fragment {p} is {dist:.3g} away from ours, "
                                 f"more than the {limit:.3g} that {ahead} round(s) ahead can explain; not loading it")


def _norm(t: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(t, dtype=torch.float64))


def vouchers_needed(others: int) -> int:
    """How many peers must vouch for one state before a node downloads it to catch up, with
    ``others`` other live peers in the run: 2, or 1 in a swarm of two, where nothing could tell
    a liar from an honest peer. Every live peer counts, also one that is joining or has not
    landed a round yet: otherwise one liar could outrun a young swarm, or a swarm whose peers
    start at once. The run's creator is believed alone (``choose_digest``'s ``trusted``); a run
    whose creator left needs two peers with its state before a newcomer can catch up."""
    return 2 if others >= 2 else 1


def repair_vote(me: bytes, mine: dict[tuple[int, ...], bytes], peers: dict[bytes, tuple[tuple[int, ...], bytes]],
                trusted: frozenset[bytes] = frozenset()) -> tuple[bool, list[bytes], list[bytes]]:
    """Whether a node that went its own way should take the others' copy: -> (take, the keys
    that hold our copy (``me`` first), the keys that hold another).

    ``mine`` is our digest at each landing since we went our own way; ``peers`` each peer's
    heartbeat (rounds, digest). A peer counts at the rounds it shows, if we passed them (in a
    fast swarm two peers rarely show the same rounds at one moment); others do not count.
    More peers hold our copy: keep it; more hold others: take theirs; a tie goes to the side
    of the run's creator (``trusted``: its word on the state is enough alone everywhere), then
    to the side of the smallest key, the same choice on every peer whichever rounds each
    compared at, so two peers that each averaged alone converge on one of their copies. (By
    key alone, a joiner whose first sync after its download was alone replaced the model of
    the run's host in a swarm of two.)"""
    agree, differ = [me], []
    for key, (rounds, digest) in peers.items():
        ours = mine.get(tuple(rounds))
        if digest and ours is not None:
            (agree if digest == ours else differ).append(key)
    take = len(differ) > len(agree) or (len(differ) == len(agree) and tie_rank(differ, trusted) < tie_rank(agree, trusted))
    return take, agree, differ


def tie_rank(holders: Sequence[bytes], trusted: frozenset[bytes]) -> tuple[bool, bytes]:
    """How a tie between copies is broken, lowest first: the copy the run's creator holds, then
    the one the smallest key holds."""
    return not trusted.intersection(holders), min(holders)


def choose_digest(vouches: dict[bytes, bytes], min_vouchers: int = 2, trusted: frozenset[bytes] = frozenset(),
                  tie_by_key: bool = False) -> tuple[bytes, list[bytes]] | None:
    """The state digest most peers vouch for, and its vouchers (public keys, sorted).

    ``vouches`` maps a peer's public key to the digest in its live heartbeat; empty digests are
    ignored. Ties go to the digest the run's creator (``trusted``) vouches for, then to the
    smallest digest, so every joiner picks the same one; with ``tie_by_key``, to the creator's,
    then to the one the smallest key vouches for (``tie_rank``: the same winner among the same
    peers whichever rounds their digests are compared at). None unless at
    least ``min_vouchers`` peers vouch for the winner, or one of them is ``trusted`` (the run's
    creator): one peer's word alone, which any key can give, never picks a state."""
    by_digest: dict[bytes, list[bytes]] = {}
    for key, d in vouches.items():
        if d:
            by_digest.setdefault(bytes(d), []).append(bytes(key))
    if not by_digest:
        return None
    best = min(by_digest, key=lambda d: (-len(by_digest[d]), tie_rank(by_digest[d], trusted) if tie_by_key
                                         else (not trusted.intersection(by_digest[d]), d)))
    vouchers = sorted(by_digest[best])
    if len(vouchers) < min_vouchers and not trusted.intersection(vouchers):
        return None
    return best, vouchers

