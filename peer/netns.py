"""Local test networks: a bridge and N network namespaces with one peer address each, for
``bench/swarm.py`` and the swarm tests that need peers on separate hosts (root, iproute2).

Namespace ``{prefix}{i}`` holds address ``{subnet}.{i+1}/24`` on its end of a veth pair
(``{prefix}{i}p``; the host end ``{prefix}{i}h`` sits on bridge ``{prefix}-br``, which has
``{subnet}.254``). An optional ``tc tbf`` cap on each peer's end limits what it sends."""

from __future__ import annotations

import os
import re
import signal
import subprocess


class NetnsError(Exception):
    """A command of the network setup failed."""


def sh(*cmd: str, check: bool = True) -> str:
    out = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=30)
    if check and out.returncode != 0:
        raise NetnsError(f"{' '.join(cmd)}: {out.stderr.strip() or f'exit {out.returncode}'}")
    return out.stdout


def remove(prefix: str) -> None:
    """Remove the namespaces of ``prefix`` (killing whatever still runs in them), veths and bridge."""
    for ns in re.findall(rf"^({prefix}\d+)\b", sh("ip", "netns", "list", check=False), re.MULTILINE):
        for pid in sh("ip", "netns", "pids", ns, check=False).split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        sh("ip", "netns", "del", ns, check=False)  # takes the veth pair with it
    for veth in re.findall(rf"^\d+: ({prefix}\d+h)[@:]", sh("ip", "-o", "link", "show", check=False), re.MULTILINE):
        sh("ip", "link", "del", veth, check=False)  # a pair created but never moved into its namespace
    sh("ip", "link", "del", f"{prefix}-br", check=False)


def create(prefix: str, subnet: str, n: int, *, tbf: tuple[str, int, str] | None = None) -> None:
    """The bridge and ``n`` namespaces (after removing what a crashed run left). ``tbf``:
    (rate, burst bytes, latency) of the cap on each peer's end, e.g. ("20mbit", 25000, "200ms")."""
    remove(prefix)
    bridge = f"{prefix}-br"
    sh("ip", "link", "add", bridge, "type", "bridge")
    sh("ip", "addr", "add", f"{subnet}.254/24", "dev", bridge)
    sh("ip", "link", "set", bridge, "up")
    for i in range(n):
        ns, host, peer = f"{prefix}{i}", f"{prefix}{i}h", f"{prefix}{i}p"
        sh("ip", "netns", "add", ns)
        sh("ip", "link", "add", host, "type", "veth", "peer", "name", peer)
        sh("ip", "link", "set", peer, "netns", ns)
        sh("ip", "link", "set", host, "master", bridge)
        sh("ip", "link", "set", host, "up")
        sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{subnet}.{i + 1}/24", "dev", peer)
        sh("ip", "netns", "exec", ns, "ip", "link", "set", peer, "up")
        sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        if tbf:
            rate, burst, latency = tbf
            sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", peer, "root", "tbf", "rate", rate,
               "burst", str(burst), "latency", latency)
