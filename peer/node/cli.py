"""``python -m peer.node``: one headless node, its flags, and its one-line errors."""

from __future__ import annotations

import gc
import json
import logging
import os
import signal
import sys
from pathlib import Path

from peer import paths
from peer.checkpoint import CheckpointError
from peer.control import ControlError
from peer.data import DataError
from peer.network import NetworkError
from peer.node.config import NodeAlreadyRunning, NodeConfig
from peer.node.loop import Node
from peer.presence import RunNotFound
from protocol.errors import ConfigError, ProtocolError

log = logging.getLogger("peer.node")  # one logger name for the whole node, also under python -m


def install_signal_handlers(node: Node) -> None:
    """First Ctrl+C (or SIGTERM): finish the current step, contribute, checkpoint, exit.
    A second one exits at once."""
    def handler(signum, frame):
        if node.stop_event.is_set():
            raise KeyboardInterrupt
        print("swarmstream: stopping after this step (Ctrl+C again to quit now)", file=sys.stderr, flush=True)
        node.stop()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)


def main(argv: list[str] | None = None) -> int:
    """``python -m peer.node``: one headless node (used by ``swarmstream join`` and ``demo``)."""
    import argparse

    from peer.logs import init_logging

    ap = argparse.ArgumentParser(prog="python -m peer.node")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--manifest", type=Path, help="a signed .swarmrun file (starts or joins its run)")
    src.add_argument("--address", help="a run address swarmstream:RUN_ID@MULTIADDR")
    ap.add_argument("--identity", type=Path, required=True)
    ap.add_argument("--data-dir", type=Path, required=True)
    ap.add_argument("--listen", default="/ip4/0.0.0.0/tcp/0")
    ap.add_argument("--initial-peers", nargs="*", default=[])
    ap.add_argument("--device", help="cpu, cuda, cuda:N, mps, auto (default: the settings file's)")
    ap.add_argument("--rounds", type=int)
    ap.add_argument("--min-peers", type=int, default=1, help="wait until this many peers are live")
    ap.add_argument("--checkpoint-every", type=float, default=120.0, help="seconds (0: every full round)")
    ap.add_argument("--control", type=Path, default=None,
                    help=f"the control socket to serve (default {paths.control_path()}; 'none' for none)")
    ap.add_argument("--settings", type=Path, default=None, help=f"settings file (default {paths.settings_path()})")
    ap.add_argument("--reachability", choices=("auto", "public", "private"), default="auto",
                    help="auto: libp2p finds out; public: this machine has a dialable address (bootstrap "
                         "and relay peers); private: behind a NAT with no inbound connections (reached "
                         "through relays on the bootstrap peers)")
    ap.add_argument("--wait-for-confirm", action="store_true",
                    help="start paused until the volunteer confirms in the dashboard (first run)")
    ap.add_argument("--eval-every", type=int, default=1, help="held-out loss every N full rounds (0: never)")
    ap.add_argument("--gpus", type=int, help="processes to train on, one per GPU (on CPU, gloo processes); "
                                             "default: the settings file's compute.gpus (1)")
    ap.add_argument("--sharding", choices=("auto", "ddp", "fsdp"), default="auto",
                    help="with --gpus N > 1: ddp keeps the whole model on each GPU; fsdp shards weights, "
                         "gradients and AdamW state over them (for a model too big for one); auto: fsdp "
                         "where ddp would not fit a GPU")
    ap.add_argument("--shard-target", type=int, default=None,
                    help="heartbeats per DHT shard of the run's presence (default 32; for tests and benchmarks)")
    ap.add_argument("--log-level")
    args = ap.parse_args(argv)
    init_logging(args.log_level)
    try:
        settings = _settings(args)
        device = args.device or (settings.compute.device if settings else "auto")
        processes = args.gpus if args.gpus is not None else (settings.compute.gpus if settings else 1)
        if not 1 <= processes <= 64:
            raise ConfigError(f"--gpus must be in 1..64, got {processes}")
        if args.sharding == "fsdp" and processes == 1:
            raise ConfigError("--sharding fsdp splits the model over several processes; add --gpus N (N >= 2), "
                              "or leave --sharding out")
        if args.shard_target is not None and not 1 <= args.shard_target <= 4096:
            raise ConfigError(f"--shard-target must be in 1..4096 peers, got {args.shard_target}")
        from peer.node import replicas

        if processes > 1 and not replicas.under_torchrun():
            # the same node as a torch.distributed group, started the standard way (torchrun)
            sys.stdout.flush()
            sys.stderr.flush()
            cmd = replicas.torchrun_command(processes, list(sys.argv[1:] if argv is None else argv))
            os.execv(cmd[0], cmd)
        if replicas.under_torchrun() and replicas.rank() > 0:
            return replicas.follow(device)
        return _run_node(args, replicas.start(_device(device), args.sharding) if replicas.under_torchrun() else None)
    except KeyboardInterrupt:  # a second Ctrl+C: out at once; the last checkpoint stays as it was
        print("swarmstream: stopped at once (second Ctrl+C); the round in flight is not contributed, "
              "the last checkpoint is kept", file=sys.stderr)
        return 130
    except USER_ERRORS as e:
        print(f"swarmstream: error: {one_line(e)}", file=sys.stderr)
        return 2


# What a volunteer can fix (a key file, an address, a run ID, a checkpoint, a port in use):
# said in one line, exit code 2, no traceback.
USER_ERRORS = (NodeAlreadyRunning, ControlError, ProtocolError, RunNotFound, NetworkError, CheckpointError,
               DataError, OSError)


def one_line(e: BaseException) -> str:
    if isinstance(e, OSError) and e.filename is not None:
        return f"{e.strerror or type(e).__name__}: {e.filename}"
    text = " ".join(str(e).split())
    return text or type(e).__name__


def _settings(args):
    """The volunteer's settings (None if the file is bad: the node says so when it starts)."""
    from peer.settings_store import load_settings

    try:
        return load_settings(args.settings or paths.settings_path(), create=False)
    except (ConfigError, OSError):
        return None


def _device(name: str):
    from peer.worker import pick_device

    return pick_device(name)


def _run_node(args, replicas=None) -> int:
    from protocol.manifest import parse_run_address

    initial = list(args.initial_peers)
    manifest_bytes = run_id = None
    if args.manifest:
        manifest_bytes = read_manifest_file(args.manifest)
    else:
        addr = parse_run_address(args.address)
        run_id, initial = addr.run_id, initial + list(addr.bootstrap)
    control = None if str(args.control) == "none" else (args.control or paths.control_path())
    cfg = NodeConfig(identity_path=args.identity, data_dir=args.data_dir, host_maddrs=(args.listen,),
                     initial_peers=tuple(initial), device=args.device, max_rounds=args.rounds,
                     checkpoint_every_s=args.checkpoint_every, min_peers=args.min_peers, control_path=control,
                     settings_path=args.settings or paths.settings_path(), wait_for_confirm=args.wait_for_confirm,
                     reachability=args.reachability, eval_every_rounds=args.eval_every, replicas=replicas,
                     **({"shard_target": args.shard_target} if args.shard_target is not None else {}))

    def print_event(ev: dict) -> None:
        try:
            print(json.dumps(ev), flush=True)
        except BrokenPipeError:  # whoever read our events is gone; the node trains on
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())

    node = Node(cfg, manifest_bytes=manifest_bytes, run_id=run_id, on_event=print_event)
    try:
        install_signal_handlers(node)
        print_event({"event": "listening", "peer": node.identity.peer_id, "maddrs": node.net.visible_maddrs(),
                     "run_id": node.signed.run_id_text, "address": node.join_address(),
                     "processes": replicas.world if replicas else 1})
        summary = node.run()
        print_event({"event": "summary", **summary})
    finally:
        node.close()
        if replicas is not None:
            node.worker = node.sampler = None  # the DDP/FSDP model goes before its process group
            gc.collect()
            replicas.stop()
    return 0


def read_manifest_file(path: Path) -> bytes:
    """A run manifest file's bytes (a signed ``.swarmrun``), refusing what cannot be one."""
    from protocol.messages import MAX_HEAD_BYTES

    if not path.is_file():
        raise ConfigError(f"{path} is not a manifest file; create one with `swarmstream run new`")
    if path.stat().st_size > MAX_HEAD_BYTES:
        raise ConfigError(f"{path} is {path.stat().st_size:,} bytes, too large for a run manifest")
    return path.read_bytes()
