"""``swarmstream run new`` and ``swarmstream run show``: create and inspect run manifests.

``run new`` builds a manifest from a model preset plus flags, validates all of it at once
(a bad value fails here, not an hour into the run), signs it with the volunteer's identity and
writes the signed bytes to ``<run id>.swarmrun``. It prints the run ID and the address others
paste to join. ``tui.cli`` wires ``add_run_parser`` into the main command line.

Never imports torch: only ``protocol`` (which has no torch outside its codecs) and, lazily, the
key-file loader.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

from protocol.config import CODEC_NAMES, PRESETS, SYNC_MODES, DataConfig, InnerConfig, OuterConfig, TrainConfig
from protocol.errors import ConfigError, ProtocolError
from protocol.manifest import (
    MANIFEST_SUFFIX, RunAddress, RunManifest, SwarmConfig, format_run_id, open_manifest, sign_manifest,
)
from protocol.messages import MAX_HEAD_BYTES

# flag dest -> (config section, field); None values are left at the config's default.
_FIELDS = {
    "seq_len": ("model", "seq_len"),
    "data": ("data", "source"), "seed": ("data", "seed"), "heldout_fraction": ("data", "heldout_fraction"),
    "tokenizer": ("data", "tokenizer"), "shards": ("data", "shards"), "text_field": ("data", "text_field"),
    "lr": ("inner", "lr"), "warmup_steps": ("inner", "warmup_steps"), "total_steps": ("inner", "total_steps"),
    "batch_size": ("inner", "batch_size"), "grad_accum": ("inner", "grad_accum"),
    "weight_decay": ("inner", "weight_decay"),
    "outer_lr": ("outer", "lr"), "outer_momentum": ("outer", "momentum"), "nesterov": ("outer", "nesterov"),
    "inner_steps": ("sync", "inner_steps"), "fragments": ("sync", "fragments"),
    "overlap": ("sync", "overlap"), "alpha": ("sync", "alpha"), "codec": ("sync", "codec"), "late_share": ("sync", "late_share"),
    "follow": ("sync", "follow"), "clip": ("sync", "clip"), "audit": ("sync", "audit"),
    "gate": ("sync", "gate"),
    "group_size": ("swarm", "group_size"), "matchmaking_timeout": ("swarm", "matchmaking_timeout_s"),
    "allreduce_timeout": ("swarm", "allreduce_timeout_s"), "state_chunk_timeout": ("swarm", "state_chunk_timeout_s"),
    "heartbeat_interval": ("swarm", "heartbeat_interval_s"), "heartbeat_ttl": ("swarm", "heartbeat_ttl_s"),
}


def add_run_parser(subparsers: argparse._SubParsersAction) -> None:
    """Add ``run new`` and ``run show`` to the main parser's subcommands."""
    run = subparsers.add_parser("run", help="create and inspect run manifests",
                                description="Create and inspect run manifests.")
    commands = run.add_subparsers(dest="run_command", metavar="{new,show}")
    commands.required = True

    new = commands.add_parser("new", help="write a signed manifest for a new run",
                              description="Write a signed manifest for a new run from a preset and flags.")
    new.add_argument("--name", required=True, help="short human name shown in run lists")
    new.add_argument("--description", default="", help="what the run trains, and why")
    new.add_argument("--preset", default="tiny", choices=list(PRESETS), help="model size (default: tiny)")
    new.add_argument("--seq-len", type=int, help="context length (default: the preset's)")
    g = new.add_argument_group("data")
    g.add_argument("--data", "--dataset", dest="data",
                   help="'stdlib' (default); a file, folder or glob of text or .jsonl files every volunteer has; "
                        "hf:NAME[:CONFIG] (a Hugging Face dataset, streamed) or hf:FOLDER (one saved with "
                        "save_to_disk). Its fingerprint goes into the manifest")
    g.add_argument("--shards", type=int, help="deal the training documents into this many shards, one per "
                                               "worker by its identity (default 1: all to everyone)")
    g.add_argument("--max-shard-mb", type=float, help="most MB of text a worker reads from its shard (default: all)")
    g.add_argument("--text-field", help="field of a .jsonl line or dataset row holding the text (default 'text')")
    g.add_argument("--seed", type=int, help="seeds the held-out split and the shards")
    g.add_argument("--heldout-fraction", type=float, help="share of documents held out (default 0.02)")
    g.add_argument("--tokenizer", help="a tokenizers JSON file (default: raw bytes)")
    g = new.add_argument_group("inner optimizer (AdamW)")
    g.add_argument("--lr", type=float, help="peak learning rate")
    g.add_argument("--warmup-steps", type=int)
    g.add_argument("--total-steps", type=int, help="inner steps each worker plans to run")
    g.add_argument("--batch-size", type=int, help="sequences per micro-batch")
    g.add_argument("--grad-accum", type=int, help="micro-batches per inner step")
    g.add_argument("--weight-decay", type=float)
    g = new.add_argument_group("outer optimizer (SGD, Nesterov)")
    g.add_argument("--outer-lr", type=float, help="default 0.7")
    g.add_argument("--outer-momentum", type=float, help="default 0.9")
    g.add_argument("--no-nesterov", dest="nesterov", action="store_const", const=False, help="plain momentum")
    g = new.add_argument_group("sync (Streaming DiLoCo)")
    g.add_argument("--mode", choices=sorted(SYNC_MODES), default="streaming",
                   help="streaming (default: P=2, tau=1, alpha=0.5, fp4), diloco (P=1, tau=0, fp32) or ddp; "
                        "the flags below override its fields")
    g.add_argument("-H", "--inner-steps", type=int, help="H: inner steps between syncs of a fragment")
    g.add_argument("-P", "--fragments", type=int, help="P: fragments, synced H/P steps apart")
    g.add_argument("--overlap", "--tau", dest="overlap", type=int, help="tau: steps an all-reduce overlaps")
    g.add_argument("--alpha", type=float, help="merge weight of the local copy (0.5 with overlap)")
    g.add_argument("--codec", choices=CODEC_NAMES, help="wire format of outer gradients")
    g.add_argument("--late-share", type=float, help="with overlap, a late result may land up to this share of H "
                                                    "after its sync started while the node trains on (default "
                                                    "0.1; 0: always after tau steps)")
    g.add_argument("--lockstep", dest="follow", action="store_const", const=False,
                   help="every node trains all H steps of every round and its groups wait for the slowest member "
                        "(default: a node slower than the swarm follows its rounds with the steps it managed)")
    g.add_argument("--clip", type=float, help="robust mean: a slice is scaled to at most this x the lower median "
                                              "norm (default 1; 0: plain mean)")
    g.add_argument("--no-gate", dest="gate", action="store_const", const=False,
                   help="robust mean without the direction gate (default: a slice pointing against the others' "
                        "sum counts for nothing; see docs/THREAT_MODEL.md)")
    g.add_argument("--audit", type=float, help="chance a member audits each other reducer's mean after a round "
                                               "(default 0.1; 0: never; see docs/THREAT_MODEL.md)")
    g = new.add_argument_group("swarm")
    g.add_argument("--group-size", type=int, help="most peers in one averaging group (default 8)")
    g.add_argument("--matchmaking-timeout", type=float, metavar="SECONDS")
    g.add_argument("--allreduce-timeout", type=float, metavar="SECONDS")
    g.add_argument("--state-chunk-timeout", type=float, metavar="SECONDS")
    g.add_argument("--heartbeat-interval", type=float, metavar="SECONDS")
    g.add_argument("--heartbeat-ttl", type=float, metavar="SECONDS")
    g = new.add_argument_group("output")
    g.add_argument("--out", type=Path, help=f"manifest file (default: ./<run id>{MANIFEST_SUFFIX})")
    g.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    g.add_argument("--identity", type=Path, help="key file to sign with (default: your swarmstream identity)")
    g.add_argument("--bootstrap", action="append", default=[], metavar="MULTIADDR",
                   help="a peer serving the run, /ip4/.../tcp/PORT/p2p/PEER_ID (repeatable); prints a full address")
    g.add_argument("--created-at", type=float, help=argparse.SUPPRESS)  # fixed times for reproducible files
    new.set_defaults(func=run_new)

    show = commands.add_parser("show", help="verify a manifest file and print it",
                               description="Verify a signed manifest file and print what it holds.")
    show.add_argument("path", type=Path)
    show.add_argument("--run-id", help="also check that the file is this run")
    show.set_defaults(func=run_show)


def build_configs(args: argparse.Namespace) -> tuple[TrainConfig, SwarmConfig]:
    """TrainConfig and SwarmConfig from the preset and the flags given; raises ConfigError."""
    given: dict[str, dict[str, object]] = {s: {} for s in ("model", "data", "inner", "outer", "sync", "swarm")}
    for dest, (section, name) in _FIELDS.items():
        value = getattr(args, dest, None)
        if value is not None:
            given[section][name] = value
    mb = getattr(args, "max_shard_mb", None)
    if mb is not None:
        if not (mb >= 0 and mb < 1 << 30):
            raise ConfigError(f"--max-shard-mb must be a number of MB >= 0 (0: all), got {mb}")
        given["data"]["max_shard_bytes"] = int(mb * (1 << 20))
    model = dataclasses.replace(PRESETS[args.preset], **given["model"])
    train = TrainConfig(model=model, data=DataConfig(**given["data"]), inner=InnerConfig(**given["inner"]),
                        outer=OuterConfig(**given["outer"]), sync=dataclasses.replace(SYNC_MODES[args.mode], **given["sync"]))
    return train, SwarmConfig(**given["swarm"])


def fingerprint_data(train: TrainConfig) -> TrainConfig:
    """``train`` with the fingerprint of its data and the hash of its tokenizer, as found here
    (``peer.sources``): what every worker checks its own against before it trains."""
    from peer.sources import DataError, Source, file_sha256  # lazy: no torch, but reads files

    data = train.data
    try:
        source = Source(data.source, data.text_field)
        if source.kind != "stdlib":
            print(f"reading {data.source} to fingerprint it...", file=sys.stderr, flush=True)
        fingerprint = source.fingerprint()
        tok = file_sha256(data.tokenizer) if data.tokenizer is not None else ""
    except OSError as e:
        raise ProtocolError(f"cannot read tokenizer {data.tokenizer!r}: {e.strerror or e}") from None
    except DataError as e:
        raise ProtocolError(str(e)) from None
    return dataclasses.replace(train, data=dataclasses.replace(data, fingerprint=fingerprint, tokenizer_sha256=tok))


def run_new(args: argparse.Namespace) -> int:
    try:
        train, swarm = build_configs(args)
        train = fingerprint_data(train)
        for maddr in args.bootstrap:  # check them before anything is written
            RunAddress(bytes(20), (maddr,))
        from peer.identity_store import load_or_create_identity  # lazy: the CLI starts fast

        identity = load_or_create_identity(args.identity)
        created_at = args.created_at if args.created_at is not None else time.time()
        manifest = RunManifest(name=args.name, description=args.description, train=train, swarm=swarm,
                               creator=identity.public_key, created_at=created_at)
        data = sign_manifest(manifest, identity)
        run_id = open_manifest(data).run_id  # the same check a volunteer's client will make
        path = args.out or Path(f"{format_run_id(run_id)}{MANIFEST_SUFFIX}")
        _write_file(path, data, overwrite=args.force)
    except (ProtocolError, OSError) as e:
        return _fail("run new", e)
    address = RunAddress(run_id, tuple(args.bootstrap))
    print(f"run ID    {format_run_id(run_id)}")
    print(f"manifest  {path}  ({len(data)} bytes, signed by {identity.peer_id})")
    print(f"model     {args.preset}, {train.model.num_params():,} parameters; "
          f"H={train.sync.inner_steps} P={train.sync.fragments} tau={train.sync.overlap} "
          f"alpha={train.sync.alpha} codec={train.sync.codec} group={swarm.group_size}")
    print(f"data      {_data_line(train)}")
    print(f"host with swarmstream host {path}")
    print("          (it starts your node for this run and prints the address others paste into "
          "`swarmstream join`)")
    if args.bootstrap:
        print(f"join with swarmstream join {address}")
    return 0


def run_show(args: argparse.Namespace) -> int:
    try:
        with open(args.path, "rb") as f:
            data = f.read(MAX_HEAD_BYTES + 1)
        signed = open_manifest(data, run_id=args.run_id)
    except (ProtocolError, OSError) as e:
        return _fail("run show", e)
    m = signed.manifest
    from protocol.identity import peer_id_from_public_key

    print(f"run ID       {signed.run_id_text}")
    print(f"name         {m.name}")
    if m.description:
        print(f"description  {m.description.splitlines()[0]}")
    print(f"creator      {peer_id_from_public_key(m.creator)}")
    print(f"created      {time.strftime('%Y-%m-%d %H:%M:%S %Z', time.localtime(m.created_at))}")
    print(f"model        {m.train.model.num_params():,} parameters, {m.train.model.n_layers} layers, "
          f"d_model {m.train.model.d_model}")
    s = m.train.sync
    print(f"sync         {s.method} H={s.inner_steps} P={s.fragments} tau={s.overlap} alpha={s.alpha} codec={s.codec} "
          f"clip={s.clip} gate={'on' if s.gate else 'off'} audit={s.audit} late_share={s.late_share} "
          f"{'follow' if s.follow else 'lockstep'}")
    print(f"data         {_data_line(m.train)}")
    print(f"swarm        group of {m.swarm.group_size}, matchmaking {m.swarm.matchmaking_timeout_s:g} s, "
          f"all-reduce {m.swarm.allreduce_timeout_s:g} s")
    return 0


def _data_line(train: TrainConfig) -> str:
    d = train.data
    shards = "all to every worker" if d.shards == 1 else f"{d.shards} shards"
    cap = f", at most {d.max_shard_bytes / (1 << 20):g} MB each" if d.max_shard_bytes else ""
    fp = f"fingerprint {d.fingerprint[:40]}" if d.fingerprint else "not fingerprinted"
    return f"{d.source} ({shards}{cap}; {fp})"


def _write_file(path: Path, data: bytes, *, overwrite: bool) -> None:
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} exists; pass --force to overwrite it or --out to choose another file")
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _fail(command: str, error: Exception) -> int:
    reason = error.args[0] if isinstance(error, FileExistsError) and error.args else error
    if isinstance(error, OSError) and error.strerror and error.filename:
        reason = f"{error.filename}: {error.strerror}"
    print(f"swarmstream {command}: error: {reason}", file=sys.stderr)
    return 2
