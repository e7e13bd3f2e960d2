"""State sync without a network: snapshot/apply, the deterministic encoding, choose_digest."""

import dataclasses

import pytest
import torch

from peer.statesync import (
    GlobalState, StateSyncError, apply, choose_digest, decode_state, encode_state, index_digest, snapshot,
)
from peer.globalstate import check_distance, max_state_bytes, repair_vote, vouchers_needed
from peer.worker import Worker
from protocol.config import DataConfig, InnerConfig, ModelConfig, SyncConfig, TrainConfig

CFG = TrainConfig(model=ModelConfig(n_layers=2, d_model=32, n_heads=2, d_ff=64, seq_len=16), data=DataConfig(seed=1),
                  inner=InnerConfig(warmup_steps=2, total_steps=20, batch_size=4),
                  sync=SyncConfig(inner_steps=4, fragments=2, overlap=1, alpha=0.5, codec="fp4"))
RUN = b"r" * 20


def trained_worker(seed: int) -> Worker:
    """A worker whose global copies and momentum differ from a fresh one's (two outer steps)."""
    w = Worker(CFG)
    gen = torch.Generator().manual_seed(seed)
    for frag in w.outer:
        for _ in range(2):
            frag.step(torch.randn(frag.numel, generator=gen) * 0.01)
    w.step = 8
    return w


def test_snapshot_then_apply_reproduces_the_global_state_and_sets_local_weights():
    a = trained_worker(0)
    state = snapshot(a, rounds=[2, 2])
    assert state.rounds == (2, 2) and state.step == 8
    assert sorted(state.tensors) == ["global/0", "global/1", "outer_momentum/0", "outer_momentum/1"]
    a.outer[0].global_flat.add_(1.0)  # the snapshot is a copy, not a view
    assert not torch.equal(state.tensors["global/0"], a.outer[0].global_flat)

    b = Worker(CFG)
    b.tokens_since_sync = [5, 7]
    apply(b, state)
    assert b.step == 8 and b.tokens_since_sync == [0, 0]
    for p, frag in enumerate(b.outer):
        assert torch.equal(frag.global_flat, state.tensors[f"global/{p}"])
        assert torch.equal(frag.opt.state[frag.global_flat]["momentum_buffer"], state.tensors[f"outer_momentum/{p}"])
        assert torch.equal(frag.local_flat(), frag.global_flat)  # merged with alpha = 0
    again = snapshot(b, rounds=[2, 2])
    assert index_digest(encode_state(again, RUN, 4096)[0]) == index_digest(encode_state(state, RUN, 4096)[0])


def test_apply_without_momentum_clears_it():
    b = trained_worker(1)
    fresh = snapshot(Worker(CFG), rounds=[0, 0])
    assert not any(k.startswith("outer_momentum/") for k in fresh.tensors)
    apply(b, fresh)
    assert all(frag.global_flat not in frag.opt.state for frag in b.outer)


def test_encoding_is_deterministic_and_round_trips():
    s1, s2 = snapshot(trained_worker(0), rounds=[3, 2]), snapshot(trained_worker(0), rounds=[3, 2])
    i1, b1 = encode_state(s1, RUN, 1000)
    i2, b2 = encode_state(s2, RUN, 1000)
    assert b1 == b2 and index_digest(i1) == index_digest(i2)
    assert len(i1.chunk_digests) == -(-len(b1) // 1000)

    back = decode_state(i1, b1)
    assert back.rounds == (3, 2) and back.step == 8 and back.tensors.keys() == s1.tensors.keys()
    for k, t in s1.tensors.items():
        assert torch.equal(back.tensors[k], t)

    flipped = dict(s2.tensors)
    t = flipped["outer_momentum/1"].clone()
    t.view(torch.int32)[123] ^= 1  # one bit of one element
    flipped["outer_momentum/1"] = t
    i3, _ = encode_state(GlobalState(flipped, s2.rounds, s2.step), RUN, 1000)
    assert index_digest(i3) != index_digest(i1)
    # the counters are vouched for too
    assert index_digest(encode_state(dataclasses.replace(s1, step=9), RUN, 1000)[0]) != index_digest(i1)
    assert index_digest(encode_state(dataclasses.replace(s1, rounds=(3, 3)), RUN, 1000)[0]) != index_digest(i1)


def test_a_state_of_the_model_never_takes_more_than_max_state_bytes():
    """What a joiner allows a donor's index to declare (``max_state_bytes``) holds the largest
    state of its model: every fragment's global copy and outer momentum."""
    worker = trained_worker(0)
    index, blob = encode_state(snapshot(worker, rounds=[3, 2]), RUN, 1000)
    assert any(k.startswith("outer_momentum/") for k in snapshot(worker, rounds=[3, 2]).tensors)
    assert index.total_bytes == len(blob) <= max_state_bytes(worker) < len(blob) + (1 << 20)


def test_decode_refuses_a_malformed_blob():
    index, blob = encode_state(snapshot(trained_worker(0), rounds=[1, 1]), RUN, 4096)
    with pytest.raises(StateSyncError, match="bytes, its index says"):
        decode_state(index, blob[:-4])
    bad = bytearray(blob)
    bad[0:4] = (1 << 30).to_bytes(4, "big")
    with pytest.raises(StateSyncError, match="header"):
        decode_state(index, bad)
    with pytest.raises(StateSyncError, match="format"):
        decode_state(dataclasses.replace(index, format="other/1"), blob)
    with pytest.raises(StateSyncError, match="fragments"):
        decode_state(dataclasses.replace(index, rounds=(1, 1, 1)), blob)


def test_apply_refuses_a_mismatched_shape_and_leaves_the_worker_unchanged():
    b = trained_worker(2)
    before = [frag.global_flat.clone() for frag in b.outer]
    local = [p.detach().clone() for p in b.model.parameters()]
    state = snapshot(trained_worker(3), rounds=[1, 1])
    tensors = dict(state.tensors)
    tensors["outer_momentum/1"] = tensors["outer_momentum/1"][:-1]
    with pytest.raises(StateSyncError, match="outer_momentum/1"):
        apply(b, GlobalState(tensors, state.rounds, 99))
    with pytest.raises(StateSyncError, match="unexpected"):
        apply(b, GlobalState({**state.tensors, "global/2": torch.zeros(3)}, state.rounds, 99))
    with pytest.raises(StateSyncError, match="round counters"):
        apply(b, GlobalState(state.tensors, (1,), 99))
    assert b.step == 8
    assert all(torch.equal(f.global_flat, x) for f, x in zip(b.outer, before))
    assert all(torch.equal(p, x) for p, x in zip(b.model.parameters(), local))


def test_snapshot_needs_round_counters():
    with pytest.raises(StateSyncError, match="rounds"):
        snapshot(Worker(CFG))


A, B, C, D, E = (bytes([i]) * 32 for i in range(1, 6))
X, Y, Z = (bytes([0xA0 + i]) * 32 for i in range(3))


@pytest.mark.parametrize(("vouches", "min_vouchers", "expected"), [
    ({}, 2, None),
    ({A: b"", B: b""}, 2, None),  # nobody holds a state yet
    ({A: X}, 2, None),  # a lone peer's word is not enough: any key can claim to be ahead
    ({A: X, B: b""}, 2, None),
    ({A: X}, 1, (X, [A])),
    ({A: X, B: Y}, 2, None),  # two peers disagree: nobody to trust
    ({A: X, B: X, C: Y}, 2, (X, [A, B])),
    ({C: Y, B: X, A: X, D: Y, E: Z}, 2, (X, [A, B])),  # a tie goes to the smaller digest
    ({A: Y, B: X, C: Y}, 3, None),
    ({A: Y, B: Y, C: Y, D: X}, 3, (Y, [A, B, C])),
])
def test_choose_digest(vouches, min_vouchers, expected):
    assert choose_digest(vouches, min_vouchers) == expected


def test_the_run_creator_alone_is_enough_and_nobody_else_alone_is():
    assert choose_digest({A: X}, trusted=frozenset({A})) == (X, [A])
    assert choose_digest({A: X}, trusted=frozenset({B})) is None
    assert choose_digest({A: X, B: Y, C: Y}, trusted=frozenset({A})) == (Y, [B, C])  # the most vouched-for first


def test_one_voucher_is_enough_only_in_a_swarm_of_two():
    assert [vouchers_needed(n) for n in range(5)] == [1, 1, 2, 2, 2]


def test_a_state_with_nan_or_inf_is_refused_and_changes_nothing():
    w = trained_worker(3)
    state = snapshot(w, rounds=[1] * len(w.outer))
    before = [f.global_flat.clone() for f in w.outer]
    for bad in (float("nan"), float("inf")):
        tensors = dict(state.tensors)
        tensors["global/0"] = tensors["global/0"].clone()
        tensors["global/0"][3] = bad
        with pytest.raises(StateSyncError, match="NaN or infinite"):
            apply(w, dataclasses.replace(state, tensors=tensors))
    assert all(torch.equal(f.global_flat, x) for f, x in zip(w.outer, before))


def test_a_state_near_ours_passes_the_distance_check_and_a_far_one_does_not():
    w = Worker(CFG)
    gen = torch.Generator().manual_seed(4)
    for frag in w.outer:  # outer steps of a size training takes, so the worker knows its step size
        for _ in range(2):
            frag.step(torch.randn(frag.numel, generator=gen) * 1e-4)
    assert all(f.largest_update_norm > 0 for f in w.outer)
    rounds = [1] * len(w.outer)
    near = snapshot(w, rounds=[2] * len(w.outer))  # one round ahead, the same values
    check_distance(w, near, rounds)
    zeros = dataclasses.replace(near, tensors={k: torch.zeros_like(v) for k, v in near.tensors.items()})
    with pytest.raises(StateSyncError, match="away from ours"):
        check_distance(w, zeros, rounds)  # a model of zeros is nowhere near one round of training away
    # our own copy with a poisoned outer momentum (finite, so check_finite passes): it would
    # turn the copy NaN a few outer steps later (found by an adversarial review)
    assert "outer_momentum/0" in near.tensors
    poisoned = dataclasses.replace(near, tensors={**near.tensors, "outer_momentum/0": near.tensors["outer_momentum/0"]
                                                  .clone().fill_(3e38)})
    with pytest.raises(StateSyncError, match="outer momentum of fragment 0"):
        check_distance(w, poisoned, rounds)
    doubled = dataclasses.replace(near, tensors={**near.tensors, "outer_momentum/0": 2 * near.tensors["outer_momentum/0"]})
    check_distance(w, doubled, rounds)  # another peer's momentum, a round apart: plausible
    far_ahead = dataclasses.replace(zeros, rounds=tuple(r + 50 for r in rounds))
    check_distance(w, far_ahead, rounds)  # 50 rounds ahead: only two vouching donors can tell
    fresh = Worker(CFG)  # never stepped: nothing to judge against
    check_distance(fresh, zeros, rounds)
    # a state that does not fit the model is refused as such, before any arithmetic with it (a
    # peer's state of another size must not crash the node with a shape error)
    short = dataclasses.replace(near, tensors={**near.tensors, "global/0": near.tensors["global/0"][:-1]})
    with pytest.raises(StateSyncError, match="this model needs"):
        check_distance(w, short, rounds)


def test_a_repair_tie_goes_to_the_smallest_keys_state_whatever_the_digests():
    """Two peers that each averaged alone compare their digests at whichever rounds the other's
    heartbeat shows; a tie by digest could pick A's state at one rounds and B's at the next, so
    that both (or neither) download. By key, both pick A's, at any rounds."""
    assert choose_digest({A: Y, B: X}, 1, tie_by_key=True) == (Y, [A])
    assert choose_digest({A: X, B: Y}, 1, tie_by_key=True) == (X, [A])
    assert choose_digest({A: Y, B: X}, 1) == (X, [B])  # a joiner's choice: by digest
    assert choose_digest({A: Y, B: X, C: X}, 1, tie_by_key=True) == (X, [B, C])  # the most vouched-for first


def test_a_repair_counts_each_peer_at_the_rounds_it_shows_and_breaks_ties_by_the_smallest_key():
    mine = {(3, 3): X, (4, 3): Y}  # our digests since we averaged alone
    # B agrees with us at (3, 3), C holds another copy at (4, 3), D shows rounds we did not pass
    take, agree, differ = repair_vote(B, mine, {A: ((4, 3), Z), C: ((3, 3), X), D: ((5, 5), Z)})
    assert (agree, differ) == ([B, C], [A]) and not take  # two hold ours, one another
    take, agree, differ = repair_vote(B, mine, {A: ((4, 3), Z), C: ((3, 3), Z)})
    assert take and differ == [A, C]  # two against one, at different rounds
    # one against one: the side of the smallest key wins, on both sides alike
    assert repair_vote(B, mine, {A: ((3, 3), Z)})[0] is True
    assert repair_vote(A, {(3, 3): Z}, {B: ((3, 3), X)})[0] is False
    assert repair_vote(A, mine, {B: ((9, 9), X), C: ((3, 3), b"")}) == (False, [A], [])  # nothing to compare


def test_a_tie_goes_to_the_run_creators_copy_first_then_to_the_smallest_key():
    """The run's creator's word on the state is enough alone everywhere: in a tie its copy wins,
    on both sides alike (by key alone, a joiner whose first sync after its download was alone,
    with the smaller key, replaced the host's model in a swarm of two). Without the creator in
    the tie, the smallest key's side, as before."""
    host = frozenset({B})
    assert repair_vote(A, {(3, 3): X}, {B: ((3, 3), Y)}, host)[0] is True  # A (smaller key) takes the host's
    assert repair_vote(B, {(3, 3): Y}, {A: ((3, 3), X)}, host)[0] is False  # the host keeps its own
    assert repair_vote(A, {(3, 3): X}, {B: ((3, 3), Y)}, frozenset({C}))[0] is False  # the creator is elsewhere
    assert repair_vote(C, {(3, 3): X}, {A: ((3, 3), Y), B: ((3, 3), Y)}, frozenset({C}))[0] is True  # 2-1 wins over it
    assert choose_digest({A: X, B: Y}, 1, trusted=host, tie_by_key=True) == (Y, [B])
    assert choose_digest({A: X, B: Y, C: Y, D: X}, 1, trusted=host, tie_by_key=True) == (Y, [B, C])
    assert choose_digest({A: X, B: Y, C: X}, 1, trusted=host, tie_by_key=True) == (X, [A, C])  # the most first
    assert choose_digest({A: Y, B: X, C: Y, D: X}, 2, trusted=frozenset({C})) == (Y, [A, C])  # a joiner's, by digest X


def test_apply_keeping_progress_moves_what_was_trained_onto_the_new_copy_and_keeps_the_step():
    w = trained_worker(0)
    with torch.no_grad():
        for frag in w.outer:
            for p in frag.params:
                p.add_(0.01)  # inner steps since the last sync
    w.tokens_since_sync = [64, 32]
    before = [frag.pseudo_gradient() for frag in w.outer]
    state = dataclasses.replace(snapshot(trained_worker(1), rounds=[2, 2]), step=3)  # the majority's copy
    apply(w, state, keep_progress=True)
    assert w.step == 8 and w.tokens_since_sync == [64, 32]
    for p, frag in enumerate(w.outer):
        assert torch.equal(frag.global_flat, state.tensors[f"global/{p}"])
        assert torch.allclose(frag.pseudo_gradient(), before[p], atol=1e-6)


def test_a_shared_state_is_published_off_the_loop_in_order_with_the_digest_of_a_copy():
    """The node publishes the worker's own tensors (no copy) and the server hashes them in a
    thread: the same digest as a copy's, while the worker trains on (its fragments copy on
    write), and publishes land in the order they were asked for."""
    import asyncio

    from peer.globalstate import pack_state
    from peer.statesync import StateServer
    from protocol.identity import Identity

    w = trained_worker(0)
    expected = index_digest(encode_state(snapshot(w, rounds=[2, 2]), RUN, 1000)[0])
    packed = pack_state(snapshot(w, rounds=[2, 2], copy=False))
    w.apply_outer(0, torch.full((w.outer[0].numel,), 0.5))  # the worker trains on: the shared tensors stay
    small = pack_state(snapshot(Worker(CFG), rounds=[0, 0]))

    async def go() -> tuple[bytes, bytes, bytes]:
        server = StateServer(None, Identity.generate(), RUN, chunk_bytes=1000)
        first, second = await asyncio.gather(server.publish_packed(packed), server.publish_packed(small))
        return first, second, server.digest

    first, second, current = asyncio.run(go())
    assert first == expected and current == second != first


def test_fragments_copy_on_write_only_what_is_shared():
    w = trained_worker(0)
    frag = w.outer[0]
    address = frag.global_flat.data_ptr()
    frag.step(torch.full((frag.numel,), 0.1))
    assert frag.global_flat.data_ptr() == address  # nothing shared: stepped in place
    g, m = frag.share()
    before_g, before_m = g.clone(), m.clone()
    frag.step(torch.full((frag.numel,), 0.1))
    assert frag.global_flat.data_ptr() != address and not torch.equal(frag.global_flat, before_g)
    assert torch.equal(g, before_g) and torch.equal(m, before_m)  # the shared ones never change
    assert frag.momentum() is not m
    again = frag.global_flat.data_ptr()
    frag.step(torch.full((frag.numel,), 0.1))  # owned again: in place
    assert frag.global_flat.data_ptr() == again
    g2, _ = frag.share()
    kept = g2.clone()
    apply(w, snapshot(trained_worker(1), rounds=[1, 1]))  # a download copies on write too
    assert torch.equal(g2, kept) and not torch.equal(frag.global_flat, kept)


def test_a_landing_rehashes_only_the_chunks_of_the_fragment_that_changed():
    from peer.globalstate import index_packed, pack_state

    w = trained_worker(0)
    first = pack_state(snapshot(w, rounds=[2, 2], copy=False))
    index = index_packed(first, RUN, 1000)
    w.apply_outer(1, torch.full((w.outer[1].numel,), 0.5))
    second = pack_state(snapshot(w, rounds=[2, 3], copy=False))
    reused = index_packed(second, RUN, 1000, reuse=(first, index))
    fresh = index_packed(second, RUN, 1000)
    assert reused == fresh  # the same index as hashing everything
    size = index.chunk_bytes
    same = sum(a == b for a, b in zip(index.chunk_digests, reused.chunk_digests))
    changed = {k for k in range(1, len(second.parts)) if first.keys[k] != second.keys[k]}
    assert changed == {2, 4}  # global/1 and outer_momentum/1 (part 0 is the header)
    touched = {o // size for k in changed for o in range(second.offsets[k] // size * size, second.offsets[k + 1], size)}
    assert same == len(index.chunk_digests) - len(touched) > 0
    # served chunks are the blob's bytes, also where a chunk spans two tensors
    blob = second.blob()
    assert all(bytes(second.read(o, o + size)) == blob[o:o + size] for o in range(0, len(blob), size))
    assert decode_state(fresh, blob).tensors["global/1"].equal(w.outer[1].global_flat)


def test_the_previous_state_is_served_only_while_downloads_are_under_way():
    import asyncio

    from protocol.identity import Identity
    from protocol.messages_swarm import Rejected, RequestStateChunk, RequestStateIndex, StateChunk
    from protocol.envelope import verify

    from peer.statesync import StateServer

    def ask(server, digest: bytes):
        parts = server._answer(RequestStateChunk(run_id=RUN, index_digest=digest, chunk=0))
        return type(verify(b"".join(bytes(p) for p in parts)).message)

    async def go():
        server = StateServer(None, Identity.generate(), RUN, chunk_bytes=1000)
        old = await server.publish(snapshot(trained_worker(0), rounds=[1, 1]))
        server._active = 1  # a download is under way (a session is open)
        new = await server.publish(snapshot(trained_worker(1), rounds=[2, 2]))
        kept = ask(server, old), ask(server, new)
        server._active = 0
        server._answer(RequestStateIndex(run_id=RUN))  # a joiner read the index: it will ask for chunks
        latest = await server.publish(snapshot(trained_worker(2), rounds=[3, 3]))
        asked = ask(server, new)
        server._current.asked_at -= 2 * server.idle_timeout_s  # nobody asked for a while: let go
        await server.publish(snapshot(trained_worker(3), rounds=[4, 4]))
        return kept, asked, ask(server, latest)

    kept, asked, dropped = asyncio.run(go())
    assert kept == (StateChunk, StateChunk) and asked is StateChunk and dropped is Rejected
