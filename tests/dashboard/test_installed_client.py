"""The ``swarmstream`` console script as a volunteer starts it: in a pseudo-terminal, from the
installed package (CI installs the wheel; see conftest.py). A wheel without the dashboard's
stylesheet crashed here at every start while every Pilot test of the source tree passed."""

from __future__ import annotations

import os
import pty
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest


def console_script() -> str:
    script = shutil.which("swarmstream", path=str(Path(sys.executable).parent))
    if script is None:
        pytest.fail(f"no swarmstream console script beside {sys.executable}: install the package "
                    "(pip install dist/swarmstream-*.whl, or pip install -e .)")
    return script


class Terminal:
    """A process on a pseudo-terminal; everything it wrote, with its escape codes."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: Path):
        self.master, slave = pty.openpty()
        self.proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=env, cwd=cwd,
                                     start_new_session=True, close_fds=True)
        os.close(slave)
        self.output = b""

    def read_until(self, needle: bytes, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while needle not in self.output:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            ready, _, _ = select.select([self.master], [], [], left)
            if ready:
                try:
                    chunk = os.read(self.master, 65536)
                except OSError:  # the process closed the terminal
                    return needle in self.output
                if not chunk:
                    return needle in self.output
                self.output += chunk
        return True

    def type(self, text: str) -> None:
        os.write(self.master, text.encode())

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        os.close(self.master)


@pytest.fixture
def terminal(tmp_path):
    opened: list[Terminal] = []

    def start(*args: str) -> Terminal:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SWARMSTREAM_", "XDG_"))}
        env.update(SWARMSTREAM_HOME=str(tmp_path / "home"), TERM="xterm-256color", COLUMNS="120", LINES="40")
        t = Terminal([console_script(), *args], env, tmp_path)
        opened.append(t)
        return t

    yield start
    for t in opened:
        t.close()


def test_the_installed_dashboard_opens_and_quits(terminal):
    """No node runs: the dashboard opens on the Runs screen; q quits it with exit code 0."""
    t = terminal()
    assert t.read_until(b"paste a run address", timeout=60), t.output[-2000:].decode(errors="replace")
    t.type("q")
    try:
        code = t.proc.wait(30)
    except subprocess.TimeoutExpired:
        pytest.fail("the dashboard did not quit on q")
    t.read_until(b"\0", timeout=1)  # whatever it wrote on the way out
    text = t.output.decode(errors="replace")
    assert code == 0, text[-2000:]
    assert "Traceback" not in text and "Error" not in text


def test_python_m_swarmstream_is_the_same_command(tmp_path):
    env = dict(os.environ, SWARMSTREAM_HOME=str(tmp_path))
    out = subprocess.run([sys.executable, "-m", "swarmstream", "--version"], capture_output=True, text=True,
                         env=env, cwd=tmp_path, timeout=60)
    script = subprocess.run([console_script(), "--version"], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0 and out.stdout == script.stdout and out.stdout.startswith("swarmstream ")
