"""``swarmstream status | pause | resume | stop``: the running node, from any terminal.

They talk to the node's control socket (``peer.control``; default ``peer.paths.control_path()``),
so they work the same for a node started by ``swarmstream join``, by the service unit, or by
hand. Also here: starting a node in the background for the dashboard (``start_background_node``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from peer import paths
from protocol.messages_control import (
    FinishAndStop, GetStatus, LeaveRun, PauseTraining, ResumeTraining, StatusReported,
)
from protocol.settings import parse_settings
from tui.control_client import ControlConnection, ControlError, call
from tui.run_progress import run_progress

START_TIMEOUT_S = 120.0  # a first start loads torch and the corpus, and meets the swarm


def _fail(msg: str) -> int:
    print(f"swarmstream: error: {msg}", file=sys.stderr)
    return 1


def _rate(bps: float) -> str:
    return f"{bps / 1e6:.2f} Mbit/s" if bps >= 1e4 else f"{bps / 1e3:.1f} kbit/s"


def format_status(st: StatusReported) -> str:
    """The human form of a status snapshot (what ``swarmstream status`` prints)."""
    try:
        net = parse_settings(st.settings_toml).network
        caps = (f"{net.max_upload_mbps:g} Mbit/s" if net.max_upload_mbps else "no cap",
                f"{net.max_download_mbps:g} Mbit/s" if net.max_download_mbps else "no cap")
    except Exception:  # an old or foreign node: show what we have
        caps = ("?", "?")
    state = st.state + (f" ({st.pause_reason})" if st.pause_reason else "")
    loss = " · ".join(f"{name} {v:.4f}" for name, v in (("train", st.loss), ("held-out", st.heldout_loss))
                      if v is not None) or "not measured yet"
    target = run_progress(st)
    lines = [
        f"node      {st.peer_id}",
        f"state     {state}" + (f" · {st.progress_label} {st.progress:.0%}" if st.progress is not None else ""),
        f"run       {st.run_name or '-'} ({st.run_id.hex()[:16] or 'none'})",
        f"progress  step {st.step:,} · {st.rounds_done} rounds · {st.tokens_per_s:,.0f} tokens/s · "
        f"inner step {st.inner_step_s * 1e3:.0f} ms · device {st.device or '-'}",
        *([f"target    {target.text(paused=st.state == 'paused')}"] if target else []),
        f"loss      {loss}",
        f"swarm     {st.peers} live peers · reachability {st.reachability}",
        f"traffic   up {_rate(st.upload_bps)} (cap {caps[0]}) · down {_rate(st.download_bps)} (cap {caps[1]})",
        f"credit    {st.tokens:,} tokens trained · {st.tokens_contributed:,} contributed in "
        f"{st.fragments_contributed} acknowledged syncs · {st.fragments_alone} alone · {st.rounds_joined} rounds"
        + (f" · {st.steps_dropped} steps dropped" if st.steps_dropped else ""),
        f"settings  {st.settings_path or '(defaults, not saved)'}",
        f"uptime    {st.uptime_s / 3600:.1f} h",
        *(f"banned    {line}" for line in st.banned),
    ]
    return "\n".join(lines)


def status_dict(st: StatusReported) -> dict:
    d = {name: getattr(st, name) for name in st.__dataclass_fields__ if name != "request_id"}
    d["run_id"] = st.run_id.hex()
    return d


def cmd_status(args: argparse.Namespace) -> int:
    import asyncio

    async def get() -> StatusReported:
        conn = await ControlConnection.open(args.control)
        try:
            return await conn.status()
        finally:
            await conn.close()
    try:
        st = asyncio.run(get())
    except ControlError as e:
        return _fail(str(e))
    print(json.dumps(status_dict(st)) if args.json else format_status(st))
    return 0


PAUSE_WAIT_S = 120.0  # landing what is in flight takes at most a matchmaking and an all-reduce deadline


def cmd_pause(args: argparse.Namespace) -> int:
    """Returns once the node has paused (it lands its syncs in flight first), or says it is
    still pausing."""
    try:
        call(args.control, PauseTraining)
        print("pausing: the node contributes what it has in flight, then releases the accelerator ...",
              file=sys.stderr, flush=True)
        deadline = time.monotonic() + args.wait_s
        while (st := call(args.control, GetStatus)).state != "paused":
            if time.monotonic() > deadline:
                print(f"still pausing after {args.wait_s:.0f} s (state {st.state}); `swarmstream status` shows when "
                      "it has paused")
                return 0
            time.sleep(0.25)
    except ControlError as e:
        return _fail(str(e))
    print("paused (`swarmstream resume` to go on)")
    return 0


def cmd_resume(args: argparse.Namespace) -> int:
    try:
        before = call(args.control, GetStatus)
        call(args.control, ResumeTraining)
    except ControlError as e:
        return _fail(str(e))
    if before.awaiting_confirm:
        print(f"starting: this node had been waiting for your go-ahead to contribute (first run); resuming gives it, "
              f"and it is saved as client.confirmed = true in {before.settings_path or 'the settings'}")
    else:
        print("resuming: the node catches up with the swarm if it moved on, then trains")
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    try:
        call(args.control, LeaveRun if args.now else FinishAndStop)
    except ControlError as e:
        return _fail(str(e))
    print("leaving now (rounds in flight are abandoned)" if args.now else
          "finishing: the node contributes the current round, then stops")
    if args.wait:
        from peer.control import node_answers

        while node_answers(args.control):
            time.sleep(0.5)
        print("stopped")
    return 0


def start_background_node(address: str | None, *, manifest: Path | None = None, control: Path | None = None,
                          identity: Path | None = None, data_dir: Path | None = None, settings: Path | None = None,
                          listen: str = "/ip4/0.0.0.0/tcp/0", extra: list[str] | None = None,
                          timeout: float = START_TIMEOUT_S) -> Path:
    """Start a node detached from this terminal (it keeps contributing after the dashboard
    closes), wait until its control socket answers, and return the socket's path. It joins the
    run at ``address``, or hosts the run of the ``manifest`` file. First runs start paused until
    the volunteer confirms in the dashboard."""
    from peer.control import node_answers
    from peer.launch import child_cwd, child_env, module_command

    control = control or paths.control_path()
    if node_answers(control):
        return control  # one node per volunteer: attach to the one that runs
    log_dir = paths.data_dir() / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / "node.log"
    source = ["--address", address] if manifest is None else ["--manifest", str(Path(manifest).resolve())]
    cmd = module_command("peer.node", *source,
                         "--identity", str(Path(identity or paths.identity_path()).resolve()),
                         "--data-dir", str(Path(data_dir or paths.data_dir() / "runs").resolve()),
                         "--control", str(Path(control).resolve()),
                         "--settings", str(Path(settings or paths.settings_path()).resolve()), "--listen", listen,
                         "--wait-for-confirm", *(extra or []))
    with open(log_path, "ab") as log:
        log.write(f"\n--- {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(cmd)}\n".encode())
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True,
                                env=child_env(), cwd=child_cwd(log_dir))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if node_answers(control, timeout=0.5):
            return control
        if proc.poll() is not None:
            raise ControlError(f"the node exited with code {proc.returncode}: {last_error(log_path)} (log: {log_path})")
        time.sleep(0.2)
    raise ControlError(f"the node did not open its control socket within {timeout:.0f} s; see {log_path}")


def running_run(control: Path) -> bytes:
    """The run ID the node at ``control`` serves (b"" while it has not joined one yet)."""
    return call(control, GetStatus).run_id


def wait_for_address(control: Path, timeout: float = START_TIMEOUT_S) -> str:
    """The address others join through, once the node at ``control`` is on the network."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            st = call(control, GetStatus)
        except ControlError as e:
            raise ControlError(f"the node stopped before it was on the network ({e}); see "
                               f"{paths.data_dir() / 'logs' / 'node.log'}") from None
        if st.join_address:
            return st.join_address
        if time.monotonic() > deadline:
            raise ControlError(f"the node was not on the network within {timeout:.0f} s; see "
                               f"{paths.data_dir() / 'logs' / 'node.log'}")
        time.sleep(0.5)


def last_error(log_path: Path) -> str:
    """The node's own one-line reason from the end of its log (``swarmstream: error: ...``), or
    its last line."""
    lines = log_path.read_text(errors="replace").strip().splitlines()[-50:] or ["(no output)"]
    for line in reversed(lines):
        if line.startswith("swarmstream: error: "):
            return line.removeprefix("swarmstream: error: ")
    return lines[-1]


def add_node_parsers(sub: argparse._SubParsersAction) -> None:
    def control_flag(p: argparse.ArgumentParser) -> None:
        p.add_argument("--control", type=Path, default=paths.control_path(),
                       help="the node's control socket (default: %(default)s)")

    p = sub.add_parser("status", help="show the running node: state, progress, peers, credit")
    control_flag(p)
    p.add_argument("--json", action="store_true", help="one JSON object instead of text")
    p.set_defaults(func=cmd_status)
    p = sub.add_parser("pause", help="pause the running node (it contributes what is in flight first)")
    control_flag(p)
    p.add_argument("--wait-s", type=float, default=PAUSE_WAIT_S, metavar="SECONDS",
                   help="how long to wait for the pause to take effect (default %(default)g)")
    p.set_defaults(func=cmd_pause)
    p = sub.add_parser("resume", help="resume a paused node")
    control_flag(p)
    p.set_defaults(func=cmd_resume)
    p = sub.add_parser("stop", help="stop the running node after it contributes the current round")
    control_flag(p)
    p.add_argument("--now", action="store_true", help="leave at once, abandoning the round in flight")
    p.add_argument("--wait", action="store_true", help="return only when the node has exited")
    p.set_defaults(func=cmd_stop)
