"""``swarmstream demo``, ``host``, ``join`` and ``runs``: the commands that put a node on the network.

Nodes run as their own processes (``python -m peer.node``) and the dashboard attaches to one
over its control socket. ``host`` and ``join`` start the node in the background (it keeps
contributing when the dashboard closes) and open the dashboard; ``demo`` starts a local swarm
and opens the dashboard of its first peer. With ``--headless`` they run the node in the
foreground and print progress lines instead.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path



HOST_PORT = 31337  # a host's default TCP port: the address it prints stays valid across restarts


def _fail(msg: str) -> int:
    print(f"swarmstream: error: {msg}", file=sys.stderr)
    return 2


def _progress(prefix: str, ev: dict) -> None:
    if ev.get("event") == "synced":
        how = "alone (no group formed)" if ev["alone"] else f"dropped {ev['dropped']}" if ev["dropped"] else "ok"
        loss = ev["train_loss"]  # NaN until a step of ours was measured (a joiner that synced at once)
        print(f"{prefix}step {ev['step']:>5}  fragment {ev['fragment']} round {ev['round']:>3}  "
              f"train_loss {'-' if math.isnan(loss) else f'{loss:.4f}':>6}  {how}", file=sys.stderr, flush=True)
    elif ev.get("event") == "banned":
        print(f"{prefix}banned peer {ev['peer'][:16]}... for a proven lie: {ev['reason']}", file=sys.stderr,
              flush=True)
    elif ev.get("event") == "listening":
        print(f"{prefix}peer {ev['peer'][:16]}... listening on {', '.join(ev['maddrs'][:1])}", file=sys.stderr,
              flush=True)


# --- demo ----------------------------------------------------------------------------


def cmd_demo(args: argparse.Namespace) -> int:
    from peer.demo import Demo, DemoError

    if not 1 <= args.peers <= 16:
        return _fail("--peers must be between 1 and 16 on one machine")
    if not args.headless:
        return _demo_dashboard(args)
    demo = Demo(args.peers, args.rounds, workdir=args.workdir,
                on_event=lambda i, ev: _progress(f"[peer {i}] ", ev))
    print(f"starting {args.peers} peers on 127.0.0.1 (tiny model, stdlib corpus, Streaming DiLoCo); "
          f"files in {demo.dir}" + ("" if args.rounds else "; Ctrl+C to stop"), file=sys.stderr, flush=True)
    try:
        demo.start()
        summary = demo.wait()
    except DemoError as e:
        demo.stop()
        return _fail(str(e))
    except KeyboardInterrupt:
        print("swarmstream: stopping the demo peers ...", file=sys.stderr, flush=True)
        demo.stop()
        summary = demo.wait()
    print(json.dumps(summary))
    return 0 if not summary["errors"] else 1


def _demo_dashboard(args: argparse.Namespace) -> int:
    """The demo with the dashboard of peer 0; quitting the dashboard stops the local swarm."""
    from peer.demo import Demo, DemoError

    demo = Demo(args.peers, args.rounds, workdir=args.workdir)
    print(f"starting {args.peers} peers on 127.0.0.1 (files in {demo.dir}); the dashboard opens when the first "
          "one is up ...", file=sys.stderr, flush=True)
    try:
        demo.start()
        code = run_app(demo_dashboard(demo))
    except DemoError as e:
        demo.stop()
        return _fail(str(e))
    except KeyboardInterrupt:
        code = 130
    print("swarmstream: stopping the demo peers ...", file=sys.stderr, flush=True)
    demo.stop()
    summary = demo.wait()
    print(json.dumps(summary))
    return code or (0 if not summary["errors"] else 1)


def demo_dashboard(demo):
    """The dashboard of a started demo's peer 0. Its Runs screen lists the runs of the demo's
    own swarm (through peer 0's multiaddrs), not of the one $SWARMSTREAM_BOOTSTRAP leads to;
    quitting it asks nothing, since the demo stops its peers when the dashboard closes."""
    return dashboard_app(demo.control_path(0), bootstrap=demo.bootstrap, start_screen="dashboard",
                         quit_asks=False)


def dashboard_app(control: Path | None = None, *, bootstrap: list[str] | None = None, **kwargs):
    """The dashboard (a ``SwarmstreamApp``) for the node at ``control`` (default: the
    volunteer's node). Its Runs screen lists the runs of the swarm that ``bootstrap`` leads
    to (default: the multiaddrs in $SWARMSTREAM_BOOTSTRAP; none: listing is unavailable), and
    joining one there starts a node in the background."""
    from peer import paths
    from tui.dashboard import SwarmstreamApp

    if bootstrap is None:
        bootstrap = os.environ.get("SWARMSTREAM_BOOTSTRAP", "").split()

    async def start_node(address: str) -> None:
        import asyncio

        from tui.node_commands import start_background_node

        await asyncio.to_thread(start_background_node, address, control=control)

    control = control or paths.control_path()
    return SwarmstreamApp(control, list_runs=runs_lister(bootstrap) if bootstrap else None, start_node=start_node,
                          data_dir=str(paths.data_dir()), **kwargs)


def open_dashboard(control: Path | None = None, **kwargs) -> int:
    """Run the dashboard (``dashboard_app``) in this terminal until the volunteer quits. With
    no node at ``control``, it opens on the Runs screen, from which joining starts one."""
    return run_app(dashboard_app(control, **kwargs))


def run_app(app) -> int:
    """Run a Textual app; its exit code, non-zero also when it failed to start (a stylesheet
    it could not load, say), which ``App.run()`` returns as None."""
    code = app.run()
    return int(code if code is not None else (app.return_code or 0))


def runs_lister(bootstrap: list[str]):
    """For the Runs screen: an async function listing the runs advertised in the swarm that
    ``bootstrap`` (multiaddrs) leads to, each with a joinable address. It runs ``swarmstream
    runs --json`` in a subprocess, so the dashboard's process never imports torch or hivemind."""
    async def list_runs() -> list[dict]:
        import asyncio

        from protocol.manifest import RunAddress, parse_run_id

        from peer.launch import child_cwd, child_env, module_command

        proc = await asyncio.create_subprocess_exec(
            *module_command("tui.cli", "runs", "--json", "--initial-peers", *bootstrap),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=child_env(), cwd=child_cwd())
        out, err = await proc.communicate()
        if proc.returncode != 0:
            lines = err.decode(errors="replace").strip().splitlines()
            raise RuntimeError(lines[-1] if lines else f"swarmstream runs exited with {proc.returncode}")
        rows = json.loads(out)
        for r in rows:
            r["address"] = str(RunAddress(parse_run_id(r["run_id"]), tuple(bootstrap[:1])))
            r["num_params"] = r.pop("params")
        return rows

    return list_runs


# --- join ----------------------------------------------------------------------------


def cmd_join(args: argparse.Namespace) -> int:
    from protocol.manifest import InvalidAddress, format_run_id, parse_run_address

    try:
        address = parse_run_address(args.address)
    except InvalidAddress as e:
        return _fail(str(e))
    if not address.bootstrap and not args.initial_peers:
        return _fail("no peer to join through: paste a full address RUN_ID@MULTIADDR or add --initial-peers")
    return _start_node(args, f"run {format_run_id(address.run_id)}", address.run_id, address=str(address))


def cmd_host(args: argparse.Namespace) -> int:
    """Host a run from its manifest file: this node is the first peer and others join through it."""
    from peer.node import read_manifest_file
    from protocol.errors import ProtocolError
    from protocol.manifest import open_manifest

    try:
        signed = open_manifest(read_manifest_file(args.manifest))
    except (ProtocolError, OSError) as e:
        return _fail(f"{args.manifest}: {e}")
    return _start_node(args, f"run {signed.manifest.name!r} ({signed.run_id_text})", signed.run_id,
                       manifest=args.manifest.resolve())


def _say_address(address: str) -> None:
    print(f"others join this run with:\n\n    swarmstream join '{address}'\n\n(share that line; it holds the run ID and "
          "this machine's addresses. A joiner outside your network needs the port forwarded, or a public host.)",
          file=sys.stderr, flush=True)


def _start_node(args: argparse.Namespace, what: str, run_id: bytes, *, address: str | None = None,
                manifest: Path | None = None) -> int:
    """``join`` and ``host``: a node for ``address`` or ``manifest``, in the background with the
    dashboard, or in the foreground with ``--headless``."""
    from peer import paths
    from peer.launch import child_cwd, child_env, module_command

    identity = args.identity or paths.identity_path()
    data_dir = args.data_dir or paths.data_dir() / "runs"  # beside the key, in the data dir
    extra = ["--initial-peers", *args.initial_peers] + (["--device", args.device] if args.device else [])
    if args.gpus is not None:
        extra += ["--gpus", str(args.gpus)]
    if args.sharding is not None:
        extra += ["--sharding", args.sharding]
    if args.rounds is not None:
        extra += ["--rounds", str(args.rounds)]
    verb = "hosting" if manifest is not None else "joining"
    if not args.headless:  # in the background, with the dashboard attached
        from tui.control_client import ControlError
        from tui.node_commands import running_run, start_background_node, wait_for_address

        print(f"starting a node {verb} {what} in the background ...", file=sys.stderr, flush=True)
        try:
            control = start_background_node(address, manifest=manifest, identity=identity, data_dir=data_dir,
                                            listen=args.listen, extra=extra)
            other = running_run(control)
            if other and other != run_id:  # one node per volunteer, and it serves another run
                from protocol.manifest import format_run_id

                return _fail(f"your node already runs run {format_run_id(other)}; stop it first (`swarmstream stop "
                             "--wait`), then start this one")
            if manifest is not None:
                _say_address(wait_for_address(control))
        except ControlError as e:
            return _fail(str(e))
        return open_dashboard(control, start_screen="dashboard")
    source = ["--manifest", str(manifest)] if manifest is not None else ["--address", address]
    cmd = module_command("peer.node", *source, "--identity", str(Path(identity).resolve()),
                         "--data-dir", str(Path(data_dir).resolve()), "--listen", args.listen, *extra)
    if args.log_level:
        cmd += ["--log-level", args.log_level]
    print(f"{verb} {what}; checkpoints in {data_dir}", file=sys.stderr, flush=True)
    # The node gets a session of its own, so a terminal's Ctrl+C reaches it only through us: it
    # would also reach the node's libp2p daemon, which dies at once and leaves the node's network
    # thread failing while it finishes its step. We pass Ctrl+C (and SIGTERM) on to the node.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, env=child_env(),
                            cwd=child_cwd(), start_new_session=True)
    assert proc.stdout is not None
    # a service manager's SIGTERM, or a closed terminal's SIGHUP: the node finishes its round
    passed_on = {sig: signal.signal(sig, lambda signum, frame: proc.send_signal(signal.SIGTERM))
                 for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        return _follow_node(proc, manifest is not None)
    finally:
        for sig, previous in passed_on.items():
            signal.signal(sig, previous)


def _follow_node(proc: subprocess.Popen, hosting: bool) -> int:
    """Print a foreground node's events until it exits; Ctrl+C asks it to finish its round, a
    second Ctrl+C to stop at once."""
    try:
        for line in proc.stdout:
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            if ev.get("event") == "summary":
                ev.pop("event")
                print(json.dumps(ev), flush=True)
                continue
            _progress("", ev)
            if ev.get("event") == "listening" and hosting:
                _say_address(ev["address"])
        return proc.wait()
    except KeyboardInterrupt:
        proc.send_signal(signal.SIGINT)
        print("swarmstream: stopping the node (Ctrl+C again to quit at once) ...", file=sys.stderr, flush=True)
        try:
            return proc.wait(120)
        except KeyboardInterrupt:  # it exits at once: it closes its network and goes
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                _kill_session(proc)
            return 130
        except subprocess.TimeoutExpired:
            _kill_session(proc)
            return 130


def _kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL the node and its libp2p daemon (the session it leads)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


# --- runs ----------------------------------------------------------------------------


def cmd_runs(args: argparse.Namespace) -> int:
    import tempfile

    from peer.identity_store import load_or_create_identity
    from peer.network import Network, NetworkConfig, NetworkError
    from peer.presence import Presence
    from protocol.manifest import format_run_id

    if not args.initial_peers:
        return _fail("give --initial-peers MULTIADDR of any peer in the swarm to read its list of runs")
    with tempfile.TemporaryDirectory() as tmp:
        key = Path(tmp) / "browse.key"  # a throwaway identity: browsing is not contributing
        ident = load_or_create_identity(key)
        try:
            with Network(NetworkConfig(identity_path=str(key), host_maddrs=("/ip4/127.0.0.1/tcp/0",),
                                       initial_peers=tuple(args.initial_peers), client_mode=True)) as net:
                runs = net.call(Presence(net.dht, ident).list_runs(), timeout=30)
        except NetworkError as e:
            return _fail(str(e))
    if args.json:
        print(json.dumps([{"run_id": format_run_id(r.run_id), "name": r.name, "params": r.num_params,
                           "peers": r.peers, "step": r.step} for r in runs]))
        return 0
    if not runs:
        print("no runs advertised right now")
        return 0
    print(f"{'run ID':<32}  {'name':<24} {'params':>12} {'step':>8}")
    for r in runs:
        print(f"{format_run_id(r.run_id):<32}  {r.name[:24]:<24} {r.num_params:>12,} {r.step:>8}")
    return 0


def add_swarm_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="start a small local swarm on 127.0.0.1 and train the tiny model",
                       description="Start N peers on this machine (each its own process and libp2p daemon), "
                                   "training the tiny model on the stdlib corpus with Streaming DiLoCo.")
    p.add_argument("--peers", type=int, default=3, help="number of local peers (default 3)")
    p.add_argument("--rounds", type=int, help="stop after R rounds of every fragment and print a JSON summary")
    p.add_argument("--headless", action="store_true", help="no dashboard, progress lines only")
    p.add_argument("--workdir", type=Path, help="where keys, logs and checkpoints go (default: a temp dir)")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("join", help="join a run by its address and contribute",
                       description="Join a run: fetch and verify its manifest from the swarm, then train "
                                   "and average with the other peers until stopped (Ctrl+C finishes cleanly).")
    p.add_argument("address", help="swarmstream:RUN_ID@/ip4/HOST/tcp/PORT/p2p/PEER_ID (or a bare run ID "
                                   "with --initial-peers)")
    p.add_argument("--headless", action="store_true", help="no dashboard, progress lines only")
    p.add_argument("--rounds", type=int, help="stop after R rounds of every fragment")
    p.add_argument("--initial-peers", nargs="*", default=[], metavar="MULTIADDR")
    p.add_argument("--listen", default="/ip4/0.0.0.0/tcp/0", help="listen multiaddr (default all interfaces)")
    p.add_argument("--device", help="auto, cpu, cuda, cuda:N, mps (default: your settings)")
    p.add_argument("--gpus", type=int, help="train on N GPUs of this machine (default: your settings' "
                                            "compute.gpus, 1)")
    p.add_argument("--sharding", choices=("auto", "ddp", "fsdp"),
                   help="with --gpus: ddp (a whole model a GPU) or fsdp (the model split over them); "
                        "default auto: fsdp where a GPU cannot hold the model for ddp")
    p.add_argument("--identity", type=Path, help="key file (default: your swarmstream identity)")
    p.add_argument("--data-dir", type=Path, help="checkpoint folder (default: your swarmstream data dir)")
    p.set_defaults(func=cmd_join)

    p = sub.add_parser("host", help="host a run from its manifest file; prints the address others join with",
                       description="Host a run: start a node for the run in MANIFEST (from `swarmstream run new`), "
                                   "print the address others paste into `swarmstream join`, and train with "
                                   "whoever joins. The node runs in the background with the dashboard "
                                   "attached, or in the foreground with --headless (Ctrl+C finishes cleanly).")
    p.add_argument("manifest", type=Path, help="the run's signed manifest file (.swarmrun)")
    p.add_argument("--headless", action="store_true", help="no dashboard, progress lines only")
    p.add_argument("--rounds", type=int, help="stop after R rounds of every fragment")
    p.add_argument("--initial-peers", nargs="*", default=[], metavar="MULTIADDR",
                   help="peers of the run to connect to as well (other hosts)")
    p.add_argument("--listen", default=f"/ip4/0.0.0.0/tcp/{HOST_PORT}",
                   help="listen multiaddr; a fixed port keeps the address valid across restarts "
                        "(default %(default)s)")
    p.add_argument("--device", help="auto, cpu, cuda, cuda:N, mps (default: your settings)")
    p.add_argument("--gpus", type=int, help="train on N GPUs of this machine (default: your settings' "
                                            "compute.gpus, 1)")
    p.add_argument("--sharding", choices=("auto", "ddp", "fsdp"),
                   help="with --gpus: ddp (a whole model a GPU) or fsdp (the model split over them); "
                        "default auto: fsdp where a GPU cannot hold the model for ddp")
    p.add_argument("--identity", type=Path, help="key file (default: your swarmstream identity)")
    p.add_argument("--data-dir", type=Path, help="checkpoint folder (default: your swarmstream data dir)")
    p.set_defaults(func=cmd_host)

    p = sub.add_parser("runs", help="list the runs advertised in the swarm")
    p.add_argument("--initial-peers", nargs="*", default=[], metavar="MULTIADDR")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_runs)

