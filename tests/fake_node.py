"""A fake node behind a real control socket, for dashboard and CLI tests.

It answers like ``peer.node.Node`` (status, commands, events) without torch or a swarm, so the
client side can be tested fast and deterministically; tests drive it with ``emit``.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from peer.control import CommandError, ControlServer
from protocol.messages import Message
from protocol.messages_control import (
    FinishAndStop, LeaveRun, PauseTraining, ResumeTraining, StateChanged, UpdateSettings,
)
from protocol.settings import ClientSettings, Settings, parse_settings, render_settings

PEER_ID = "12D3KooWD3eckifWpRn9wQpMG9R9hX3sD158z7EqHWmweQAJU5SA"


class FakeNode:
    def __init__(self, socket_path: Path, **status: Any):
        self.lock = threading.Lock()
        self.commands: list[Message] = []
        self.refuse_once: dict[type, str] = {}  # command class -> the one-line refusal it gets next time
        self.settings = Settings(client=ClientSettings(confirmed=True))  # a volunteer past the first run
        self.fields: dict[str, Any] = dict(
            at=time.time(), run_id=b"\x01" * 20, run_name="fake run", peer_id=PEER_ID, state="training",
            pause_reason="", step=120, tokens=122880, tokens_per_s=4096.0, loss=3.25, heldout_loss=3.4, peers=3,
            rounds_done=6, upload_bps=1e5, download_bps=2e5, uptime_s=60.0, device="cpu", reachability="direct",
            inner_step_s=0.25, progress=None, progress_label="", settings_path="/tmp/settings.toml",
            settings_toml=render_settings(self.settings), tokens_contributed=100000, fragments_contributed=12,
            fragments_alone=0, rounds_joined=6, steps_dropped=0, total_steps=2000)
        self.fields.update(status)
        self.snapshot: list[Message] = []
        self.statuses = 0  # status requests answered (tests wait for polls with it)
        self.server = ControlServer(socket_path, self)

    def __enter__(self) -> FakeNode:
        self.server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.close()

    # ControlTarget
    def status(self) -> dict[str, Any]:
        with self.lock:
            self.statuses += 1
            return dict(self.fields, at=time.time())

    def command(self, msg: Message) -> None:
        with self.lock:
            self.commands.append(msg)
            old = self.fields["state"]
            if type(msg) in self.refuse_once:
                raise CommandError(self.refuse_once.pop(type(msg)))
            if isinstance(msg, PauseTraining):
                if old == "paused":
                    raise CommandError("already paused")
                self.fields.update(state="paused", pause_reason="paused by you")
            elif isinstance(msg, ResumeTraining):
                if old != "paused":
                    raise CommandError("not paused")
                if self.fields.get("awaiting_confirm"):  # as the real node: resuming is the go-ahead
                    self.settings = self.settings.replace(client_confirmed=True)
                    self.fields.update(settings_toml=render_settings(self.settings), awaiting_confirm=False)
                self.fields.update(state="training", pause_reason="")
            elif isinstance(msg, (FinishAndStop, LeaveRun)):
                self.fields.update(state="finishing")
            elif isinstance(msg, UpdateSettings):
                try:
                    self.settings = parse_settings(msg.settings_toml)
                except Exception as e:
                    raise CommandError(str(e)) from None
                self.fields["settings_toml"] = render_settings(self.settings)
                return
            new = self.fields["state"]
        self.emit(StateChanged(at=time.time(), old=old, new=new, reason=type(msg).__name__))

    def snapshot_events(self) -> list[Message]:
        return list(self.snapshot)

    def emit(self, msg: Message) -> None:
        self.server.publish(msg)
