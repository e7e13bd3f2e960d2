"""What the volunteer sees of a node and asks of it: its status, its events for the dashboard,
and the commands of the control socket (pause, resume and the first-run go-ahead, finish,
leave, settings)."""

from __future__ import annotations

import logging
import statistics
import time
from typing import TYPE_CHECKING, Any

import torch

from peer.control import CommandError
from peer.node.config import CONFIRM_REASON, global_digest
from peer.ratelimit import mbps_to_bytes_per_s
from peer.settings_store import save_settings
from protocol.errors import ConfigError
from protocol.identity import peer_id_from_public_key
from protocol.manifest import RunAddress
from protocol.messages import Message
from protocol.messages_control import (
    MAX_BANS_SHOWN,
    FinishAndStop,
    LeaveRun,
    LogRecorded,
    PauseTraining,
    PeerUpdated,
    ResumeTraining,
    UpdateSettings,
)
from protocol.messages_swarm import Heartbeat
from protocol.settings import parse_settings, render_settings

if TYPE_CHECKING:
    from peer.node.loop import Node

log = logging.getLogger("peer.node")  # one logger name for the whole node, also under python -m


class _LogToControl(logging.Handler):
    """Forwards the node's INFO and louder log records to the dashboard as LogRecorded."""

    def __init__(self, node: Node):
        super().__init__(logging.INFO)
        self.node = node

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = "".join(c if c.isprintable() or c == "\n" else "?" for c in record.getMessage())[:4096]
            msg = LogRecorded(at=record.created, level=record.levelname, logger=record.name[:128], text=text)
            self.node._log_history.append(msg)  # a dashboard that attaches later sees it too
            self.node._emit(msg)
        except Exception:  # a log line must never break the node
            pass


class VolunteerMixin:
    """Status, events and commands of ``peer.node.Node`` (a part of it: it reads the node's
    state, settings, stats and peers view, and sets only what a volunteer asks for)."""

    def _emit(self, msg: Message) -> None:
        if self.control is not None:
            self.control.publish(msg)

    def _remember(self, msg: Message) -> None:
        self._recent.append(msg)
        self._emit(msg)

    def join_address(self) -> str:
        """The address others paste into ``swarmstream join``: the run ID and our dialable
        addresses (others' loopback is not ours, so loopback only when there is nothing else)."""
        maddrs = [m for m in self._maddrs if "/p2p-circuit" not in m] or list(self._maddrs)
        outside = [m for m in maddrs if not m.startswith(("/ip4/127.", "/ip6/::1/"))]
        return str(RunAddress(self.run_id, tuple((outside or maddrs)[:4])))

    def reachability(self) -> str:
        if not self._maddrs:
            return "unreachable"
        return "relayed" if any("/p2p-circuit" in m for m in self._maddrs) else "direct"

    def status(self) -> dict[str, Any]:
        """The fields of the control socket's StatusReported (called from its thread)."""
        w, st = self.worker, self.stats
        c = self.ledger.credit if self.ledger else None
        now = time.monotonic()
        up = down = 0.0
        recent = [t for t in st.traffic if now - t[0] <= 60.0]
        if len(recent) >= 2:
            (t0, s0, r0), (t1, s1, r1) = recent[0], recent[-1]
            if t1 > t0:
                up, down = (s1 - s0) / (t1 - t0), (r1 - r0) / (t1 - t0)
        progress = self._progress
        return dict(
            at=time.time(), run_id=self.signed.run_id if self.signed else b"",
            run_name=self.signed.manifest.name if self.signed else "", peer_id=self.identity.peer_id,
            state=self._reported_state(),
            pause_reason=self._pause_reason if self._reported_state() in ("paused", "pausing") else "",
            step=w.step if w else self._last_step(), tokens=c.tokens_trained if c else 0,
            tokens_per_s=self._tokens_per_s(),
            loss=st.losses[-1][1] if st.losses else None, heldout_loss=st.heldout[-1][1] if st.heldout else None,
            peers=self._run_size(), rounds_done=min(st.rounds, default=0), upload_bps=up * 8,
            download_bps=down * 8, uptime_s=time.time() - self.started_at, device=self._device_name(),
            reachability=self.reachability(),
            inner_step_s=sum(st.step_times) / len(st.step_times) if st.step_times else 0.0,
            progress=progress[0] if progress else None, progress_label=progress[1] if progress else "",
            settings_path=str(self.cfg.settings_path or ""), settings_toml=render_settings(self.settings),
            tokens_contributed=c.tokens_contributed if c else 0,
            fragments_contributed=c.fragments_contributed if c else 0,
            fragments_alone=c.fragments_alone if c else 0, rounds_joined=c.rounds_joined if c else 0,
            steps_dropped=c.steps_dropped if c else 0,
            join_address=self.join_address() if self._maddrs else "",
            total_steps=self.signed.manifest.train.inner.total_steps if self.signed else 0,
            awaiting_confirm=self._awaiting_confirm(),
            banned=tuple(f"{b.peer_id} {b.reason}"[:400] for b in self.bans.items()[-MAX_BANS_SHOWN:])
            if self.bans else ())

    def _tokens_per_s(self) -> float:
        """Tokens per second of training time (time blocked on the network included, pauses
        not), not per second of compute: a step slowed by a shared core or a wait lowers it."""
        if self.worker is None or self.state == "paused" or not self._loop_t0:
            return 0.0
        training_s = time.perf_counter() - self._loop_t0 - self.stats.paused_s
        return self.stats.tokens / training_s if training_s > 0 else 0.0

    def _last_step(self) -> int:
        return self._paused_step if hasattr(self, "_paused_step") else 0

    def _device_name(self) -> str:
        w = self.worker
        if w is None:
            return "released (paused)" if self.state == "paused" else ""
        if w.device.type == "cuda":
            return f"cuda {torch.cuda.get_device_name(w.device)}"[:64]
        return str(w.device)

    def command(self, msg: Message) -> None:
        """A volunteer's command from the control socket (runs on its thread)."""
        if isinstance(msg, PauseTraining):
            if self._user_paused:
                raise CommandError("already paused; resume with `swarmstream resume` or p in the dashboard")
            if self._finish_requested or self.stop_event.is_set():
                raise CommandError("the node is finishing; it will stop after this round")
            self._user_paused, self._pause_reason = True, "paused by you"  # status says pausing until it lands
        elif isinstance(msg, ResumeTraining):
            if self._awaiting_confirm():
                self._confirm()  # resuming a node that never started is the volunteer's go-ahead
            elif not self._user_paused:
                why = f" (it waits: {self._pause_reason})" if self.state == "paused" else ""
                raise CommandError(f"not paused by you{why}")
            self._user_paused, self._pause_reason = False, ""
        elif isinstance(msg, FinishAndStop):
            self._finish_requested = True
        elif isinstance(msg, LeaveRun):
            self._leave_requested = True
            self.stop_event.set()
        elif isinstance(msg, UpdateSettings):
            try:
                new = parse_settings(msg.settings_toml, where="the new settings")
                if self.cfg.settings_path is not None:
                    save_settings(self.cfg.settings_path, new)
            except (ConfigError, OSError) as e:
                raise CommandError(str(e)) from None
            self.settings = new
            if not self._awaiting_confirm() and self._pause_reason == CONFIRM_REASON:
                self._pause_reason = ""  # confirmed through the settings (the dashboard's first-run dialog)
            self._apply_caps()
            self._settings_changed = True
            log.info("settings updated path=%s", self.cfg.settings_path)
        else:
            raise CommandError(f"{type(msg).__name__} is not a command this node takes")
        self._wake.set()

    def _reported_state(self) -> str:
        """The state the volunteer sees: ``pausing`` from the pause command until the loop has
        landed what was in flight. Derived, never stored: only the training thread sets state."""
        if self._user_paused and self._state in ("training", "averaging", "syncing"):
            return "pausing"
        return self._state

    def _awaiting_confirm(self) -> bool:
        """A first run started with --wait-for-confirm trains only once the volunteer agreed.
        The settings file is the one record of that agreement, shared by node and dashboard."""
        return self.cfg.wait_for_confirm and not self.settings.client.confirmed

    def _confirm(self) -> None:
        new = self.settings.replace(client_confirmed=True)
        if self.cfg.settings_path is not None:
            try:
                save_settings(self.cfg.settings_path, new)
            except OSError as e:
                raise CommandError(f"could not save the confirmation to {self.cfg.settings_path}: {e.strerror}") from None
        self.settings = new
        log.info("the volunteer confirmed contributing; saved client.confirmed=true path=%s", self.cfg.settings_path)

    def snapshot_events(self) -> list[Message]:
        now = time.time()
        rows = [self._peer_row(k, hb, now) for k, hb in list(self._peers.items())]
        return list(self._loss_history) + list(self._log_history) + list(self._recent) + rows

    def _peer_row(self, key: bytes, hb: Heartbeat, now: float) -> PeerUpdated:
        return PeerUpdated(at=now, peer_id=peer_id_from_public_key(key), state=hb.state, device=hb.device,
                           tokens=hb.tokens, tokens_per_s=hb.tokens_per_s, rounds_done=min(hb.rounds, default=0),
                           last_seen_at=hb.sent_at, banned=(self.bans.reason(key) or "")[:256] if self.bans else "")

    def _apply_caps(self) -> None:
        net = self.settings.network
        self.upload_limiter.set_rate(mbps_to_bytes_per_s(net.max_upload_mbps))
        self.download_limiter.set_rate(mbps_to_bytes_per_s(net.max_download_mbps))

    def _summary(self, worker, wall: float, heldout: float) -> dict:
        """What ``run`` returns when the node stops: steps, rounds, held-out loss, bytes, syncs and
        how they went, time trained, waited and paused, and the global copy's digest."""
        return {
            "peer": self.identity.peer_id, "steps": worker.step, "steps_trained": self.stats.inner_steps, "tokens": worker.tokens,
            "rounds": min(self.stats.rounds) if self.stats.rounds else 0,
            "heldout_loss": heldout, "bytes_sent": self.stats.bytes_sent,
            "bytes_received": self.stats.bytes_received, "syncs": self.stats.syncs,
            "syncs_alone": self.stats.syncs_alone, "syncs_failed": self.stats.syncs_failed,
            "dropped_peers": self.stats.dropped_peers,
            "landed_late_steps": round(statistics.mean(self.stats.late_steps), 2) if self.stats.late_steps else 0.0,
            "waited_s": round(self.stats.waited_s, 3), "checks_s": round(self.stats.checks_s, 3),
            "blocked_s": round(self.stats.waited_s + self.stats.checks_s, 3),
            "paused_s": round(self.stats.paused_s, 3), "settle_s": round(self.stats.settle_s, 3),
            "inner_s": round(self.stats.inner_s, 3),
            "wall_s": round(wall, 3), "global_digest": global_digest(worker),
            "allreduce_s": [round(x, 3) for x in list(self.stats.allreduce_s)[-50:]],
            "steps_skipped": self.stats.steps_skipped,
            "waits_s": [[p, r, round(w, 3)] for p, r, w in list(self.stats.waits)[-50:]],
        }
