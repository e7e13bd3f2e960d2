"""The multi-process workers' arithmetic (peer.node.replicas: DDP; peer.node.sharded: FSDP):
two gloo processes training their halves of each batch take the same steps as one process
training the whole batch."""

import multiprocessing
import os
import socket

import torch

from protocol.config import DataConfig, InnerConfig, ModelConfig, SyncConfig, TrainConfig

CFG = TrainConfig(model=ModelConfig(n_layers=2, d_model=32, n_heads=2, d_ff=64, seq_len=16), data=DataConfig(seed=3),
                  inner=InnerConfig(lr=1e-2, warmup_steps=2, total_steps=20, batch_size=4, grad_accum=2),
                  sync=SyncConfig(inner_steps=3, fragments=2, overlap=0, alpha=0.5))


def batches(step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(step)
    out = []
    for _ in range(CFG.inner.grad_accum):
        w = torch.randint(0, 256, (CFG.inner.batch_size, CFG.model.seq_len + 1), generator=g)
        out.append((w[:, :-1], w[:, 1:]))
    return out


def _follow_until_stop(replicas, worker) -> None:
    """A replica's loop: rank 0's commands until STOP."""
    while True:
        op, args = replicas._receive()
        if op == replicas.STOP:
            return
        worker.follow(op, args)


def _train_both(worker, alone) -> list[tuple[float, float]]:
    """Seven inner steps of the group's worker and of one process, with an outer step and a
    merge (alpha 0.5) after each sync, as a landing does: the pairs of losses."""
    losses = []
    for step in range(7):
        pair = worker.forward_backward(batches(step)), alone.forward_backward(batches(step))
        worker.optimizer_step()
        alone.optimizer_step()
        losses.append(pair)
        for p in worker.schedule.starts_after(worker.step):
            for w in (worker, alone):
                delta, _ = w.begin_sync(p)
                w.apply_outer(p, delta * 0.5)
    return losses


def _rank(rank: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    from peer.node import replicas
    from peer.worker import Worker

    replicas.init_group(torch.device("cpu"))
    worker = replicas.ReplicatedWorker(CFG, device=torch.device("cpu"))
    if rank == 1:
        _follow_until_stop(replicas, worker)
        results.put(("replica", {n: p.detach().clone() for n, p in worker.model.named_parameters()}))
        return
    alone = Worker(CFG)  # one process, the whole batch
    losses = _train_both(worker, alone)
    replicas._send(replicas.STOP)
    results.put(("node", losses, worker.tokens == alone.tokens, worker.tokens_since_sync == alone.tokens_since_sync,
                 {n: p.detach().clone() for n, p in worker.model.named_parameters()},
                 {n: p.detach().clone() for n, p in alone.model.named_parameters()}))


def _run_two(target) -> dict:
    """``target(rank, port, results)`` in two forked processes: what each put, by its first item."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, port, results)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        got = dict((item[0], item[1:]) for item in (results.get(timeout=120), results.get(timeout=120)))
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs)
    return got


def test_two_processes_train_the_whole_batch_as_one_process_does():
    got = _run_two(_rank)
    losses, same_tokens, same_since_sync, node, alone = got["node"]
    (replica,) = got["replica"]
    assert same_tokens and same_since_sync  # the node counts the whole batch, as one process would
    for a, b in losses:
        assert abs(a - b) < 1e-5, losses
    for n in alone:
        # sums in another order; AdamW turns a gradient near 0 into a full step, so allow a little
        torch.testing.assert_close(node[n], alone[n], rtol=1e-3, atol=1e-4)
        assert torch.equal(node[n], replica[n])  # the replica holds exactly the node's weights


def _sharded_rank(rank: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    from peer.node import replicas
    from peer.node.sharded import ShardedWorker
    from peer.worker import Worker

    replicas.init_group(torch.device("cpu"))
    worker = ShardedWorker(CFG, device=torch.device("cpu"))
    shards = {n: p.to_local().detach().clone() for n, p in worker.model.named_parameters()}
    if rank == 1:
        _follow_until_stop(replicas, worker)
        results.put(("replica", {n: p.to_local().detach().clone() for n, p in worker.model.named_parameters()},
                     shards))
        return
    alone = Worker(CFG)
    losses = _train_both(worker, alone)
    held = batches(100)
    before_eval = worker.local_state()
    evals = worker.evaluate_global(held), alone.evaluate_global(held)
    # a checkpoint's round trip: what was gathered, scattered back after another step, gathers again
    saved = worker.local_state()
    worker.forward_backward(batches(7))
    worker.optimizer_step()
    worker.load_local_state(*saved)
    again = worker.local_state()
    replicas._send(replicas.STOP)
    weights, adam = saved
    results.put(("node", losses, evals, weights, alone.local_state()[0], adam, alone.local_state()[1], again,
                 before_eval, [f.global_flat.clone() for f in worker.outer], [f.global_flat.clone() for f in alone.outer]))


def test_two_fsdp_processes_hold_half_the_model_each_and_train_as_one_process_does():
    got = _run_two(_sharded_rank)
    losses, evals, node, alone, adam, alone_adam, again, before_eval, node_global, alone_global = got["node"]
    replica, replica_at_start = got["replica"]
    for a, b in losses:
        assert abs(a - b) < 1e-5, losses
    assert abs(evals[0] - evals[1]) < 1e-4, evals
    for n in alone:
        torch.testing.assert_close(node[n], alone[n], rtol=1e-3, atol=1e-4)
        # each process holds its half of each weight, and the halves are the node's weights
        assert replica_at_start[n].shape[0] == (node[n].shape[0] + 1) // 2 or node[n].shape[0] == 1
        torch.testing.assert_close(replica[n], node[n].chunk(2, dim=0)[1], rtol=0, atol=0)
        assert torch.equal(before_eval[0][n], node[n])  # the evaluation put the local weights back
    assert set(adam) == set(alone_adam)
    for i in adam:
        assert adam[i][0] == alone_adam[i][0]
        torch.testing.assert_close(adam[i][1], alone_adam[i][1], rtol=1e-3, atol=1e-5)
    weights_again, adam_again = again
    assert all(torch.equal(weights_again[n], node[n]) for n in node)
    assert all(a[0] == b[0] and torch.equal(a[1], b[1]) and torch.equal(a[2], b[2])
               for a, b in zip(adam_again.values(), adam.values()))
    for a, b in zip(node_global, alone_global):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)


def test_sharding_is_chosen_by_the_flag_and_auto_keeps_ddp_where_the_host_holds_the_model():
    from peer.node.sharded import use_fsdp
    from protocol.errors import ConfigError

    cpu = torch.device("cpu")
    assert use_fsdp("fsdp", CFG, cpu) and not use_fsdp("ddp", CFG, cpu)
    assert not use_fsdp("auto", CFG, cpu)
    try:
        use_fsdp("zero3", CFG, cpu)
    except ConfigError as e:
        assert "auto, ddp, fsdp" in str(e)
    else:
        raise AssertionError("an unknown sharding was accepted")


def test_fsdp_on_one_process_is_refused_in_one_line(tmp_path, capsys):
    from peer.node.cli import main

    code = main(["--settings", str(tmp_path / "none.toml"), "--sharding", "fsdp", "--manifest", str(tmp_path / "x"),
                 "--identity", str(tmp_path / "key"), "--data-dir", str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0 and "--gpus N" in err, err
