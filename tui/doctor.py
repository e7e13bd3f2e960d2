"""``swarmstream doctor``: is this machine ready to contribute? A short report, one line a check.

Checks Python, torch and the accelerator, the libp2p daemon that hivemind bundles, free disk in
the data dir, the identity key and the settings file, reachability (direct, behind NAT and so
reached through relays, or not reachable), and whether a node is running. Each line says ok,
warn or FAIL and, where needed, what to do. Exit code 1 if any check FAILs.

torch and hivemind are probed in subprocesses with a timeout: a broken CUDA install or a hung
daemon must not hang the doctor (and the ``tui`` package never imports torch itself).
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import shutil
import stat
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from peer import paths

MIN_FREE_GB = 5.0

_TORCH_PROBE = """
import json, torch
info = {"version": torch.__version__, "cuda": torch.version.cuda, "devices": []}
if torch.cuda.is_available():
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        info["devices"].append(f"cuda:{i} {p.name} {p.total_memory / 2**30:.0f} GiB")
elif getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
    info["devices"].append("mps (Apple GPU)")
if torch.version.cuda and not info["devices"]:  # what a CUDA build without a GPU costs on disk
    import importlib.metadata as md, os, re
    total = 0
    for d in md.distributions():
        name = re.sub(r"[-_.]+", "-", d.metadata["Name"] or "").lower()
        if name in ("torch", "triton") or name.startswith(("nvidia-", "cuda-")):
            for f in d.files or ():
                try:
                    total += os.path.getsize(d.locate_file(f))
                except OSError:
                    pass
    info["cuda_bytes"] = total
print(json.dumps(info))
"""

_P2P_PROBE = """
import asyncio, json, os, tempfile
from peer.identity_store import load_or_create_identity
from hivemind.p2p import P2P
async def main():
    key = os.path.join(tempfile.mkdtemp(), "probe.key")
    load_or_create_identity(key)
    p2p = await P2P.create(host_maddrs=["/ip4/0.0.0.0/tcp/0", "/ip6/::/tcp/0"], identity_path=key,
                           check_if_identity_free=False, use_relay=True)
    try:
        print(json.dumps([str(m) for m in await p2p.get_visible_maddrs()]))
    finally:
        await p2p.shutdown()
asyncio.run(main())
"""


@dataclass(slots=True)
class Check:
    name: str
    level: str  # ok, warn, FAIL
    detail: str
    hint: str = ""


def _probe(code: str, timeout: float) -> tuple[bool, str]:
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, f"did not answer within {timeout:.0f} s"
    if out.returncode != 0:
        lines = out.stderr.strip().splitlines()
        return False, lines[-1] if lines else f"exit code {out.returncode}"
    return True, out.stdout.strip().splitlines()[-1]


def check_python() -> Check:
    v = sys.version_info
    text = f"{v.major}.{v.minor}.{v.micro} ({sys.executable})"
    if v < (3, 10):
        return Check("python", "FAIL", text, "swarmstream needs Python 3.10 or newer")
    return Check("python", "ok", text)


def has_nvidia_driver() -> bool:
    """nvidia-smi on PATH, or NVIDIA's driver inside WSL2 (the places install.sh looks)."""
    return bool(shutil.which("nvidia-smi")) or os.access("/usr/lib/wsl/lib/nvidia-smi", os.X_OK)


def torch_checks(info: dict, nvidia_driver: bool) -> list[Check]:
    """The torch and accelerator lines from what the torch probe found (``info``: version,
    cuda, devices, and cuda_bytes where a CUDA build sees no GPU) and whether an NVIDIA
    driver is installed. Pure, so each machine's case is testable on any machine."""
    build = f"CUDA {info['cuda']} build" if info["cuda"] else "CPU build"
    torch_line = f"{info['version']} ({build})"
    if info["devices"]:
        return [Check("torch", "ok", torch_line), Check("accelerator", "ok", "; ".join(info["devices"]))]
    if info["cuda"] and not nvidia_driver:
        size = info.get("cuda_bytes", 0)
        size_text = f"{size / 1e9:.1f} GB" if size >= 1e9 else f"{size / 1e6:.0f} MB"
        torch_check = Check(
            "torch", "warn",
            f"{torch_line} on a machine without an NVIDIA GPU: {size_text} of torch and CUDA libraries, "
            "where the CPU build is about 0.2 GB to download and under 1 GB installed",
            "reinstall with the CPU build: bash installers/install.sh --uninstall, then "
            "bash installers/install.sh --torch cpu (docs/INSTALL.md: without access to "
            "download.pytorch.org, --wheels or --torch-index)")
        return [torch_check, Check("accelerator", "warn", "no GPU usable by torch", "training runs on the CPU (slow but useful)")]
    if info["cuda"]:
        hint = (f"an NVIDIA driver is installed but torch (CUDA {info['cuda']}) sees no GPU: the driver may be "
                "older than that CUDA needs (nvidia-smi shows the newest CUDA it supports); update the driver")
    elif nvidia_driver:
        hint = "an NVIDIA driver is present but this torch is a CPU build: reinstall with --torch cuda"
    else:
        hint = "training runs on the CPU (slow but useful)"
    return [Check("torch", "ok", torch_line), Check("accelerator", "warn", "no GPU usable by torch", hint)]


def check_torch() -> list[Check]:
    ok, out = _probe(_TORCH_PROBE, 120)
    if not ok:
        return [Check("torch", "FAIL", out, "reinstall: installers/install.sh (or pip install 'torch>=2.3')")]
    return torch_checks(json.loads(out), has_nvidia_driver())


def check_daemon() -> Check:
    try:
        import importlib.util

        spec = importlib.util.find_spec("hivemind")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return Check("libp2p daemon", "FAIL", "hivemind is not installed", "pip install 'hivemind>=1.1.10,<1.2'")
    p2pd = Path(list(spec.submodule_search_locations)[0]) / "hivemind_cli" / "p2pd"
    if not p2pd.exists():
        return Check("libp2p daemon", "FAIL", f"{p2pd} is missing", "reinstall hivemind from its wheel (it bundles p2pd)")
    if not os.access(p2pd, os.X_OK):
        return Check("libp2p daemon", "FAIL", f"{p2pd} is not executable", f"chmod +x {p2pd}")
    return Check("libp2p daemon", "ok", str(p2pd))


def check_disk() -> Check:
    where = paths.data_dir()
    probe = where
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free_gb = shutil.disk_usage(probe).free / 2**30
    text = f"{free_gb:.1f} GiB free for {where}"
    if free_gb < MIN_FREE_GB:
        return Check("disk", "warn", text, "checkpoints of large models need several GiB; free some space "
                                           "(or set SWARMSTREAM_HOME to a bigger disk)")
    return Check("disk", "ok", text)


def check_identity() -> Check:
    key = paths.identity_path()
    if not key.exists():
        return Check("identity", "ok", f"{key} will be created on first start")
    mode = stat.S_IMODE(key.stat().st_mode)
    if mode & 0o077:
        return Check("identity", "FAIL", f"{key} is readable by others (mode {mode:o})", f"chmod 600 {key}")
    return Check("identity", "ok", f"{key} (mode {mode:o})")


def check_settings() -> Check:
    from peer.settings_store import load_settings
    from protocol.errors import ConfigError

    path = paths.settings_path()
    if not path.exists():
        return Check("settings", "ok", f"{path} will be written with the defaults on first start")
    try:
        s = load_settings(path, create=False)
    except ConfigError as e:
        return Check("settings", "FAIL", str(e), "fix that key, or delete the file to start from the defaults")
    caps = [f"{k} {v:g} Mbit/s" for k, v in (("up", s.network.max_upload_mbps), ("down", s.network.max_download_mbps))
            if v]
    return Check("settings", "ok", f"{path}; device {s.compute.device}; {', '.join(caps) or 'no bandwidth cap'}")


def classify(maddrs: list[str]) -> tuple[str, str]:
    """'direct' / 'behind NAT' from the daemon's visible addresses, with the public one."""
    for m in maddrs:
        parts = m.split("/")
        if len(parts) > 2 and parts[1] in ("ip4", "ip6"):
            try:
                ip = ipaddress.ip_address(parts[2])
            except ValueError:
                continue
            if ip.is_global:
                return "direct", str(ip)
    return "behind NAT", ""


def check_reachability() -> Check:
    ok, out = _probe(_P2P_PROBE, 60)
    if not ok:
        return Check("reachability", "FAIL", f"the libp2p daemon did not start: {out}",
                     "check that nothing blocks local TCP ports and that /tmp is writable")
    kind, ip = classify(json.loads(out))
    if kind == "direct":
        return Check("reachability", "ok", f"direct: listening on the public address {ip}")
    return Check("reachability", "warn", "behind NAT: no public address; other peers reach you through relays",
                 "that works, but slower; forward a TCP port to this machine and pass --listen "
                 "/ip4/0.0.0.0/tcp/PORT to be reached directly")


def check_node() -> Check:
    from peer.control import node_answers

    sock = paths.control_path()
    if node_answers(sock):
        return Check("node", "ok", f"a node is running ({sock}); see `swarmstream status`")
    return Check("node", "ok", "no node running (`swarmstream join ADDRESS` starts one)")


def run_checks(*, network: bool = True) -> list[Check]:
    checks = [check_python(), *check_torch(), check_daemon(), check_disk(), check_identity(), check_settings()]
    if network:
        checks.append(check_reachability())
    checks.append(check_node())
    return checks


def cmd_doctor(args: argparse.Namespace) -> int:
    checks = run_checks(network=not args.offline)
    if args.json:
        print(json.dumps([asdict(c) for c in checks]))
    else:
        width = max(len(c.name) for c in checks)
        for c in checks:
            print(f"{c.level:<4}  {c.name:<{width}}  {c.detail}")
            if c.hint:
                print(f"{'':<4}  {'':<{width}}  -> {c.hint}")
    return 1 if any(c.level == "FAIL" for c in checks) else 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("doctor", help="check this machine: Python, torch, GPU, libp2p daemon, disk, reachability")
    p.add_argument("--json", action="store_true", help="one JSON list instead of text")
    p.add_argument("--offline", action="store_true", help="skip the reachability check (starts no daemon)")
    p.set_defaults(func=cmd_doctor)
