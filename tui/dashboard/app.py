"""The swarmstream dashboard: a Textual app attached to a node's control socket.

Two workers talk to the node: one polls ``GetStatus`` once a second on a command connection
(which also carries the volunteer's commands), one follows the event stream on a second
connection. Both reconnect on their own when the node restarts; while no node answers, the
dashboard says so and offers the Runs screen. Screens redraw from ``self.model`` on a timer,
so the UI never blocks on the socket.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import ClassVar

from textual.app import App, ScreenStackError
from textual.binding import Binding, BindingType
from textual.css.query import NoMatches
from textual.worker import Worker

from protocol.messages import Message
from protocol.messages_control import FinishAndStop, PauseTraining, ResumeTraining
from tui.control_client import ControlConnection, ControlError
from tui.dashboard.model import DashboardModel
from tui.dashboard.screens import (
    Choice,
    DashboardScreen,
    HelpScreen,
    LogScreen,
    RunsScreen,
    SettingsScreen,
    first_run_text,
)

log = logging.getLogger(__name__)

ListRuns = Callable[[], Awaitable[list[dict]]]
StartNode = Callable[[str], Awaitable[None]]


class SwarmstreamApp(App):
    TITLE = "swarmstream"
    CSS_PATH = "dashboard.tcss"
    MODES: ClassVar[dict] = {"dashboard": DashboardScreen, "runs": RunsScreen, "settings": SettingsScreen, "log": LogScreen}
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("p", "pause_resume", "Pause/Resume"),
        Binding("f", "finish", "Finish & stop"),
        Binding("q", "quit_dashboard", "Quit"),
        Binding("question_mark", "help", "Help", key_display="?"),
        Binding("d", "switch_mode('dashboard')", "Dashboard"),
        Binding("r", "switch_mode('runs')", "Runs"),
        Binding("s", "switch_mode('settings')", "Settings"),
        Binding("l", "switch_mode('log')", "Log"),
    ]

    def __init__(self, control_path: Path | str, *, list_runs: ListRuns | None = None,
                 start_node: StartNode | None = None, start_screen: str = "auto", quit_asks: bool = True,
                 data_dir: str = "", poll_s: float = 1.0, clock: Callable[[], float] = time.time):
        super().__init__()
        self.control_path = Path(control_path)
        self.list_runs, self.start_node = list_runs, start_node
        self.start_screen, self.quit_asks, self.data_dir = start_screen, quit_asks, data_dir
        self.poll_s, self.clock = poll_s, clock
        self.model = DashboardModel()
        self.last_error = ""
        self.sent: list[Message] = []  # commands the node accepted (tests and the log read it)
        self.redraws = 0
        """Screens drawn from the model so far: one that begins after a change shows it (tests wait on it)."""
        self._conn: ControlConnection | None = None
        self._lock = asyncio.Lock()
        self._first_run_declined = False  # "not now": p starts it later
        self._first_run_answer: Worker | None = None  # the go-ahead on its way to the node
        self._first_run_dialog: Choice | None = None

    async def on_mount(self) -> None:
        start = self.start_screen
        if start == "auto":
            start = "dashboard" if await self._connect_once() else "runs"
        self.switch_mode(start)
        self.run_worker(self._poll(), group="node", exit_on_error=False)
        self.run_worker(self._follow(), group="node", exit_on_error=False)
        self.set_interval(0.5, self._redraw)

    # --- talking to the node --------------------------------------------------------------

    async def _connect_once(self) -> bool:
        try:
            async with self._lock:
                await self._status()
            return True
        except ControlError as e:
            self.model.node_gone(str(e))
            return False

    async def _status(self) -> None:
        """One status poll (holding the lock); reconnects if needed."""
        if self._conn is None:
            self._conn = await ControlConnection.open(self.control_path, timeout=2.0)
        try:
            st = await self._conn.status(timeout=5.0)
        except (ControlError, asyncio.TimeoutError) as e:
            await self._drop_conn()
            raise ControlError(str(e) or "the node did not answer in time") from None
        self.model.set_status(st)

    async def _drop_conn(self) -> None:
        if self._conn is not None:
            try:
                await self._conn.close()
            except OSError as e:  # the connection is being dropped anyway
                log.debug("closing the control connection failed error=%s", e)
            self._conn = None

    async def _poll(self) -> None:
        while True:
            try:
                async with self._lock:
                    await self._status()
                self._maybe_first_run()
            except ControlError as e:
                self.model.node_gone(str(e))
            except Exception:  # a bug in one tick must not freeze the dashboard for good
                log.exception("the status poller failed once; it goes on")
            await asyncio.sleep(self.poll_s)

    async def _follow(self) -> None:
        while True:
            conn = None
            try:
                conn = await ControlConnection.open(self.control_path, timeout=2.0)
                async for ev in conn.events():
                    self.model.apply(ev)
            except (ControlError, asyncio.TimeoutError, OSError):
                pass  # the poller reports the node as gone; we reconnect below
            finally:
                if conn is not None:
                    await conn.close()
            await asyncio.sleep(max(self.poll_s, 1.0))

    async def command(self, cls: type[Message], **fields) -> bool:
        """Send a command; on refusal, show the node's one-line reason. -> accepted?"""
        async with self._lock:
            try:
                if self._conn is None:
                    self._conn = await ControlConnection.open(self.control_path, timeout=2.0)
                msg = await self._conn.request(cls, **fields)
                self.sent.append(msg)
                await self._status()  # show the effect at once
                return True
            except (ControlError, asyncio.TimeoutError) as e:
                self.last_error = str(e) or "the node did not answer in time"
                if not isinstance(e, ControlError) or "closed the connection" in str(e):
                    await self._drop_conn()
                self.notify(self.last_error, title=cls.__name__, severity="error")
                return False

    def _redraw(self) -> None:
        try:
            screen = self.screen
        except ScreenStackError:  # the app is exiting: its screens go before its timers stop
            return
        if hasattr(screen, "refresh_view") and screen.is_mounted:
            try:
                screen.refresh_view(self.model)
            except NoMatches:  # the screen is still composing; the next tick draws it
                return
            self.redraws += 1

    # --- first run --------------------------------------------------------------------------

    def _maybe_first_run(self) -> None:
        """Ask for the go-ahead while the node waits for it: at every status, unless the dialog
        is up, the volunteer said "not now", or the answer is on its way. Nothing here is asked
        only once, so a refused or lost answer leads to the question again."""
        st = self.model.status
        if st is None or not st.awaiting_confirm or self._first_run_declined:
            return
        if self.current_mode != "dashboard":
            # asked on the dashboard only: each mode has its own screen stack, so a dialog pushed
            # while the Runs screen was starting the node would stay hidden behind that mode
            return
        if self._first_run_answer is not None and not self._first_run_answer.is_finished:
            return
        if self._first_run_dialog is not None and self._first_run_dialog.is_attached:
            return  # on screen, or a dismissed one not removed yet (its ID is still taken)
        text = first_run_text(self.model, self.data_dir or "(the node's data dir)")

        async def start() -> None:
            await self.command(ResumeTraining)  # one command: the node saves client.confirmed and starts

        def answer(choice: str | None) -> None:
            if choice != "start":
                self._first_run_declined = True
                self.notify("the node stays paused; press p when you are ready", title="not now")
                return
            self._first_run_answer = self.run_worker(start(), group="first-run")  # after the dialog has gone

        self._first_run_dialog = Choice(text, [("start", "Start contributing"), ("later", "Not now")], "first-run")
        self.push_screen(self._first_run_dialog, answer)

    # --- actions ----------------------------------------------------------------------------

    async def action_pause_resume(self) -> None:
        if not self.model.node_up:
            self.notify(self.model.node_error or "no node", severity="warning")
            return
        await self.command(ResumeTraining if self.model.paused else PauseTraining)

    def action_finish(self) -> None:
        if not self.model.node_up:
            self.notify(self.model.node_error or "no node", severity="warning")
            return

        async def answer(choice: str | None) -> None:
            if choice == "finish":
                await self.command(FinishAndStop)

        self.push_screen(Choice("Finish the current round, contribute it, then stop the node?",
                                [("finish", "Finish and stop"), ("cancel", "Cancel")], "confirm-finish"), answer)

    def action_quit_dashboard(self) -> None:
        if not self.quit_asks or not self.model.node_up:
            self.exit(0)
            return

        async def answer(choice: str | None) -> None:
            if choice == "keep":
                self.exit(0)
            elif choice == "stop" and await self.command(FinishAndStop):
                self.exit(0)  # (a refused stop leaves the dashboard open, showing why)

        self.push_screen(Choice("Quit the dashboard. Keep contributing in the background?",
                                [("keep", "Keep running"), ("stop", "Stop the node"), ("cancel", "Cancel")],
                                "quit"), answer)

    def action_help(self) -> None:
        self.push_screen(HelpScreen())
