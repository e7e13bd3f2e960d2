"""The ``swarmstream`` command line.

Each subcommand is a handler ``(args) -> exit code``. Errors the user can fix are printed as
one line on stderr (exit 2), never as a traceback. Commands that run the engine import
``peer`` (and so torch) only when they run, so the dashboard and ``--help`` stay light.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from protocol.config import PRESETS, SYNC_MODES, CODEC_NAMES, DataConfig, InnerConfig, OuterConfig, TrainConfig, model_preset
from protocol.errors import ProtocolError
from tui import __version__
from tui.run_command import add_run_parser
from tui.swarm_commands import add_swarm_parsers
from tui.node_commands import add_node_parsers
from tui import doctor


class UsageError(Exception):
    """A mistake on the command line or in the environment that the user can fix."""


def _fail(msg: str) -> int:
    print(f"swarmstream: error: {msg}", file=sys.stderr)
    return 2


# --- presets -------------------------------------------------------------------------


def cmd_presets(args: argparse.Namespace) -> int:
    rows = [(name, cfg.num_params(), cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.d_ff, cfg.seq_len)
            for name, cfg in PRESETS.items()]
    if args.json:
        print(json.dumps([dict(zip(("preset", "params", "layers", "d_model", "heads", "kv_heads", "d_ff", "seq_len"), r))
                          for r in rows]))
        return 0
    print(f"{'preset':<8} {'params':>15} {'layers':>6} {'d_model':>7} {'heads':>5} {'kv':>3} {'d_ff':>5} {'seq':>5}")
    for name, n, L, d, h, kv, f, T in rows:
        print(f"{name:<8} {n:>15,} {L:>6} {d:>7} {h:>5} {kv:>3} {f:>5} {T:>5}")
    return 0


# --- simulate ------------------------------------------------------------------------


def add_train_flags(p: argparse.ArgumentParser) -> None:
    """Flags that build a TrainConfig; shared by ``simulate`` and the benchmarks."""
    inner, outer = InnerConfig(), OuterConfig()  # slots dataclasses: defaults live on instances
    p.add_argument("--mode", choices=sorted(SYNC_MODES), default="streaming",
                   help="ddp: gradients averaged every step; diloco: P=1, tau=0, fp32; "
                        "streaming: P=2, tau=1, alpha=0.5, fp4 (default). Flags below override.")
    p.add_argument("--preset", default="tiny", help=f"model size: {', '.join(PRESETS)} (default tiny)")
    p.add_argument("-H", "--inner-steps", type=int, help="H: inner steps between syncs of a fragment")
    p.add_argument("-P", "--fragments", type=int, help="P: number of fragments")
    p.add_argument("--tau", "--overlap", dest="overlap", type=int, help="tau: inner steps overlapped with a sync")
    p.add_argument("--alpha", type=float, help="merge weight of the local copy after an outer step")
    p.add_argument("--codec", choices=CODEC_NAMES, help="wire format of pseudo-gradients")
    p.add_argument("--lr", type=float, default=inner.lr, help="inner AdamW peak learning rate")
    p.add_argument("--warmup", type=int, default=inner.warmup_steps, help="inner warmup steps")
    p.add_argument("--batch-size", type=int, default=inner.batch_size, help="sequences per micro-batch")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per inner step")
    p.add_argument("--outer-lr", type=float, default=outer.lr)
    p.add_argument("--outer-momentum", type=float, default=outer.momentum)
    p.add_argument("--no-nesterov", action="store_true", help="plain momentum SGD as the outer optimizer")
    p.add_argument("--data", default="stdlib", help="'stdlib', a file, a folder or a glob (default stdlib)")
    p.add_argument("--seed", type=int, default=0)


def train_config_from_args(args: argparse.Namespace, total_steps: int) -> TrainConfig:
    sync = SYNC_MODES[args.mode]
    overrides = {k: getattr(args, k) for k in ("inner_steps", "fragments", "overlap", "alpha", "codec")
                 if getattr(args, k) is not None}
    if sync.method == "ddp" and overrides:
        raise UsageError(f"--mode ddp averages gradients every step; {', '.join(overrides)} do not apply to it")
    if "overlap" in overrides and "alpha" not in overrides and overrides["overlap"] == 0 and sync.alpha:
        overrides["alpha"] = 0.0  # with no overlap the local copy is simply replaced, as in DiLoCo
    return TrainConfig(
        model=model_preset(args.preset),
        data=DataConfig(source=args.data, seed=args.seed),
        inner=InnerConfig(lr=args.lr, warmup_steps=args.warmup, total_steps=total_steps,
                          batch_size=args.batch_size, grad_accum=args.grad_accum),
        outer=OuterConfig(lr=args.outer_lr, momentum=args.outer_momentum,
                          nesterov=not args.no_nesterov and args.outer_momentum > 0),
        sync=dataclasses.replace(sync, **overrides),
    )


def cmd_simulate(args: argparse.Namespace) -> int:
    from peer.data import DataError
    from peer.simulation import SimulationConfig, run_simulation

    try:
        train = train_config_from_args(args, total_steps=args.steps)
        sim = SimulationConfig(train=train, workers=args.workers, steps=args.steps, eval_every=args.eval_every,
                               eval_batches=args.eval_batches, device=args.device, bf16=args.bf16)
    except (UsageError, ProtocolError) as e:
        return _fail(str(e))
    s = train.sync
    desc = ("ddp (fp32 gradients every step)" if s.method == "ddp" else
            f"H={s.inner_steps} P={s.fragments} tau={s.overlap} alpha={s.alpha} codec={s.codec}")
    print(f"simulating {args.workers} workers x {args.steps} steps, preset {args.preset} "
          f"({train.model.num_params():,} params), {desc}", file=sys.stderr, flush=True)

    def progress(rec: dict) -> None:
        print(f"step {rec['step']:>6}  train_loss {rec['train_loss']:.4f}  heldout_loss {rec['heldout_loss']:.4f}",
              file=sys.stderr, flush=True)

    try:
        result = run_simulation(sim, progress=progress)
    except (DataError, ValueError) as e:
        return _fail(str(e))
    summary = {k: v for k, v in result.to_dict().items() if k != "history"}
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"held-out loss {result.heldout_loss:.4f} | sent per worker {result.bytes_sent_per_worker / 1e6:.2f} MB "
              f"| peak per sync {result.peak_bytes_per_sync / 1e6:.3f} MB | {result.sync_events} sync events "
              f"| {result.wall_s:.1f} s")
    return 0


# --- main ----------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="swarmstream",
        description="Train language models together over the internet with Streaming DiLoCo.")
    parser.add_argument("--version", action="version", version=f"swarmstream {__version__}")
    parser.add_argument("--log-level", default=None, help="DEBUG, INFO, WARNING (default; or $SWARMSTREAM_LOG)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("presets", help="list model presets and their parameter counts")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=cmd_presets)

    p = sub.add_parser("simulate", help="run M workers in this process and report loss and bytes sent",
                       description="Run the real training engine with M workers in one process and an in-memory "
                                   "all-reduce that uses the real codecs and overlap timing.")
    add_train_flags(p)
    p.add_argument("--workers", "-M", type=int, default=4, help="M: workers (default 4)")
    p.add_argument("--steps", type=int, default=300, help="inner steps per worker (default 300)")
    p.add_argument("--eval-every", type=int, default=50, help="evaluate held-out loss every N steps (0: at the end)")
    p.add_argument("--eval-batches", type=int, default=8, help="held-out batches per evaluation")
    p.add_argument("--device", default="cpu", help="auto, cpu, cuda, cuda:N, mps (default cpu)")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast for the inner steps")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON line")
    p.set_defaults(func=cmd_simulate)

    add_run_parser(sub)
    add_swarm_parsers(sub)
    add_node_parsers(sub)
    doctor.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from peer.logs import init_logging

    init_logging(args.log_level)
    if not getattr(args, "func", None):
        from tui.swarm_commands import open_dashboard

        return open_dashboard()  # the running node's dashboard, or the Runs screen
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("swarmstream: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
