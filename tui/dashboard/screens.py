"""The dashboard's screens: Dashboard, Runs, Settings, Log, and the small dialogs.

Every screen reads the app's ``DashboardModel`` (``refresh_view`` runs twice a second) and
asks the app to send commands; none talks to the socket itself.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, ClassVar

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Grid, Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen, Screen
from textual.widgets import (
    Button,
    DataTable,
    Footer,
    Header,
    Input,
    Label,
    ProgressBar,
    RichLog,
    Sparkline,
    Static,
    Switch,
)

from protocol.errors import ConfigError
from protocol.manifest import InvalidAddress, parse_run_address
from protocol.settings import Settings, render_settings
from tui.dashboard.model import DashboardModel, ago, human_bytes, human_rate, short_peer
from tui.run_progress import run_progress

if TYPE_CHECKING:
    from tui.dashboard.app import SwarmstreamApp

log = logging.getLogger(__name__)

STATE_STYLE = {"training": "bold green", "averaging": "bold cyan", "syncing": "bold yellow",
               "paused": "bold magenta", "pausing": "magenta", "finishing": "bold yellow", "finished": "green",
               "leaving": "bold red", "joining": "yellow"}


class ViewScreen(Screen):
    """A screen that redraws from the model."""

    @property
    def ss(self) -> SwarmstreamApp:
        return self.app  # type: ignore[return-value]

    def refresh_view(self, model: DashboardModel) -> None:  # pragma: no cover - overridden
        pass


# --- Dashboard ---------------------------------------------------------------------------


class DashboardScreen(ViewScreen):
    def compose(self) -> ComposeResult:
        yield Header()
        with Grid(id="top"):
            yield Static(id="state", classes="panel")
            yield Static(id="credit", classes="panel")
        with Horizontal(id="target"):
            yield Label("", id="target-label")
            yield ProgressBar(total=1.0, id="target-bar", show_percentage=False, show_eta=False)
        with Horizontal(id="middle"):
            with Vertical(id="losses", classes="panel"):
                yield Label("train loss", id="train-label")
                yield Sparkline([], id="train-plot")
                yield Label("held-out loss", id="heldout-label")
                yield Sparkline([], id="heldout-plot")
            yield Static(id="speed", classes="panel")
        with Horizontal(id="work"):
            yield Label("", id="progress-label")
            yield ProgressBar(total=1.0, id="progress", show_eta=False)
        with Horizontal(id="tables"):
            yield DataTable(id="syncs", cursor_type="none", zebra_stripes=True)
            yield DataTable(id="peers", cursor_type="none", zebra_stripes=True)
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#syncs", DataTable).add_columns("time", "frag", "round", "group", "drop", "bytes",
                                                        "took", "waited")
        self.query_one("#peers", DataTable).add_columns("peer", "state", "tok/s", "tokens", "rounds",
                                                        "seen")
        self.query_one("#syncs", DataTable).border_title = "fragment syncs"
        self.query_one("#peers", DataTable).border_title = "peers"
        self.refresh_view(self.ss.model)

    def refresh_view(self, model: DashboardModel) -> None:
        st, now = model.status, self.ss.clock()
        state = self.query_one("#state", Static)
        if st is None or not model.node_up:
            why = model.node_error or "connecting to the node ..."
            state.update(f"[bold red]no node[/]\n{why}\n\npress [b]r[/] for runs, [b]q[/] to quit")
            self.query_one("#target", Horizontal).display = False
            self.sub_title = "not connected"
            return
        self.sub_title = f"{st.run_name} · {st.state}"
        reason = f" ({st.pause_reason})" if st.pause_reason else ""
        style = STATE_STYLE.get(st.state, "bold")
        state.update(
            f"[{style}]{st.state.upper()}[/]{reason}\n"
            f"run      {st.run_name}  [dim]{st.run_id.hex()[:16]}[/]\n"
            f"peer     {short_peer(st.peer_id)}  ·  {st.reachability}\n"
            f"device   {st.device or '-'}\n"
            f"swarm    {st.peers} live peers  ·  round {st.rounds_done}  ·  step {st.step:,}")
        self.query_one("#credit", Static).update(
            "[b]your credit[/]\n"
            f"tokens trained      {st.tokens:,}\n"
            f"tokens contributed  {st.tokens_contributed:,}\n"
            f"syncs acknowledged  {st.fragments_contributed:,}   alone {st.fragments_alone:,}\n"
            f"rounds joined       {st.rounds_joined:,}"
            + (f"\nsteps dropped       {st.steps_dropped:,}" if st.steps_dropped else ""))
        settings = model.settings or Settings()
        up_cap = settings.network.max_upload_mbps
        down_cap = settings.network.max_download_mbps
        self.query_one("#speed", Static).update(
            f"tokens/s    {st.tokens_per_s:,.0f}\n"
            f"inner step  {st.inner_step_s * 1e3:,.0f} ms\n"
            f"upload      {human_rate(st.upload_bps)} / {f'{up_cap:g} Mbit/s' if up_cap else 'no cap'}\n"
            f"download    {human_rate(st.download_bps)} / {f'{down_cap:g} Mbit/s' if down_cap else 'no cap'}\n"
            f"uptime      {st.uptime_s / 3600:.1f} h")
        target = run_progress(st)
        row = self.query_one("#target", Horizontal)
        row.display = target is not None  # a node that reports no step target (older, or not in a run)
        if target is not None:
            self.query_one("#target-label", Label).update(f"[b]target[/]  {target.text(paused=model.paused)}")
            self.query_one("#target-bar", ProgressBar).update(progress=target.fraction)
        self._plot("train", model.train, st.loss)
        self._plot("heldout", model.heldout, st.heldout_loss)
        bar = self.query_one("#progress", ProgressBar)
        label = self.query_one("#progress-label", Label)
        working = st.progress is not None
        bar.display = label.display = working
        if working:
            bar.update(progress=st.progress)
            label.update(st.progress_label)
        syncs = self.query_one("#syncs", DataTable)
        syncs.clear()
        for row in list(model.syncs)[:50]:
            if row.failed:
                syncs.add_row(time.strftime("%H:%M:%S", time.localtime(row.at)), row.fragment, row.round, "alone",
                              "-", "-", "-", "-")
            else:
                syncs.add_row(time.strftime("%H:%M:%S", time.localtime(row.at)), row.fragment, row.round,
                              row.group_size, row.group_size - row.contributors, human_bytes(row.bytes),
                              f"{row.latency_s:.2f} s", f"{row.waited_s:.2f} s")
        peers = self.query_one("#peers", DataTable)
        peers.clear()
        for p, stale in model.peer_rows(now):
            state = f"banned: {p.banned}" if p.banned else p.state
            cells = [short_peer(p.peer_id), state, f"{p.tokens_per_s:,.0f}", f"{p.tokens:,}", str(p.rounds_done),
                     ago(now - p.last_seen_at) + (" · stale" if stale else "")]
            # a stale row is dimmed: its peer missed heartbeats and may be gone (PeerLeft removes it)
            peers.add_row(*(Text(c, style="dim") if stale else c for c in cells))

    def _plot(self, name: str, series, latest: float | None) -> None:
        values = [v for _, v in series]
        plot = self.query_one(f"#{name}-plot", Sparkline)
        plot.display = bool(values)  # nothing to draw yet: no flat placeholder bar
        plot.data = values
        title = "train loss" if name == "train" else "held-out loss"
        if values:
            text = f"{title}  {values[-1]:.4f}  (first {values[0]:.4f}, min {min(values):.4f}, {len(values)} points)"
        else:
            text = f"{title}  {'-' if latest is None else f'{latest:.4f}'}  (waiting for measurements)"
        self.query_one(f"#{name}-label", Label).update(text)


# --- Runs --------------------------------------------------------------------------------


class RunsScreen(ViewScreen):
    # on this screen r lists the runs again (elsewhere it switches here)
    BINDINGS: ClassVar[list[BindingType]] = [Binding("r", "refresh_runs", "Refresh")]

    def __init__(self) -> None:
        super().__init__()
        self.addresses: list[str] = []  # of the listed runs, by row

    def compose(self) -> ComposeResult:
        yield Header()
        with Vertical(id="runs-box"):
            yield Label("Public runs (select one to join)", id="runs-title")
            yield DataTable(id="runs", cursor_type="row", zebra_stripes=True)
            with Horizontal(id="runs-row"):
                yield Label("", id="runs-note")
                yield Button("Refresh", id="refresh")
            yield Label("or paste a run address:")
            with Horizontal(id="address-row"):
                yield Input(placeholder="swarmstream:RUN_ID@/ip4/HOST/tcp/PORT/p2p/PEER_ID", id="address")
                yield Button("Join", id="join", variant="primary")
            yield Label("", id="address-error")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#runs", DataTable).add_columns("name", "parameters", "peers", "step", "run ID")
        self.refresh_runs()

    @on(Button.Pressed, "#refresh")
    def action_refresh_runs(self) -> None:
        self.refresh_runs()

    def refresh_runs(self) -> None:
        if self.ss.list_runs is None:
            self.query_one("#runs-note", Label).update(
                "listing runs is unavailable: no bootstrap peers known; set SWARMSTREAM_BOOTSTRAP to a peer's "
                "multiaddr, or paste a run address below")
            return
        self.query_one("#runs-note", Label).update("looking for runs ...")
        self.run_worker(self._load(), exclusive=True, group="runs")

    async def _load(self) -> None:
        try:
            runs = await self.ss.list_runs()
        except Exception as e:  # noqa: BLE001 - list_runs is injected: whatever it raises is shown, on one line
            log.warning("listing runs failed error=%s", e)
            self.query_one("#runs-note", Label).update(f"could not list runs: {e}")
            return
        table = self.query_one("#runs", DataTable)
        table.clear()
        self.addresses = []
        for r in runs:
            table.add_row(r["name"], f"{r['num_params']:,}", r.get("peers", 0), r.get("step", 0), r["run_id"])
            self.addresses.append(r["address"])
        note = f"{len(runs)} run{'s' if len(runs) > 1 else ''}" if runs else "no runs advertised right now"
        self.query_one("#runs-note", Label).update(note)

    @on(DataTable.RowSelected, "#runs")
    def _picked(self, event: DataTable.RowSelected) -> None:
        if 0 <= event.cursor_row < len(self.addresses):
            self._join(self.addresses[event.cursor_row])

    @on(Button.Pressed, "#join")
    @on(Input.Submitted, "#address")
    def _join_pasted(self) -> None:
        self._join(self.query_one("#address", Input).value.strip())

    def _join(self, address: str) -> None:
        err = self.query_one("#address-error", Label)
        try:
            parse_run_address(address)
        except InvalidAddress as e:
            err.update(f"[red]{e}[/]")
            return
        if self.ss.start_node is None:
            err.update("[red]joining is not available here; run `swarmstream join ADDRESS`[/]")
            return
        err.update("starting a node for this run ...")
        self.run_worker(self._start(address), exclusive=True, group="join")

    async def _start(self, address: str) -> None:
        try:
            await self.ss.start_node(address)
        except Exception as e:  # noqa: BLE001 - start_node is injected: whatever it raises is shown, on one line
            log.warning("starting a node failed address=%s error=%s", address, e)
            self.query_one("#address-error", Label).update(f"[red]{e}[/]")
            return
        self.query_one("#address-error", Label).update("")
        self.ss.switch_mode("dashboard")


# --- Settings ----------------------------------------------------------------------------

# (section, key, label, kind) for every setting in protocol/settings.py
FIELDS = [
    ("compute", "device", "device (auto, cpu, cuda, cuda:N, mps)", "text"),
    ("compute", "gpu_memory_fraction", "GPU memory fraction (0.05-1)", "float"),
    ("compute", "max_batch_size", "max sequences per forward pass (0 = the run's)", "int"),
    ("compute", "cpu_threads", "CPU threads (0 = default)", "int"),
    ("compute", "duty_cycle", "share of the time training (0.05-1)", "float"),
    ("compute", "gpus", "GPUs to train on (1-64; at the next start)", "int"),
    ("network", "max_upload_mbps", "upload cap, Mbit/s (0 = none)", "float"),
    ("network", "max_download_mbps", "download cap, Mbit/s (0 = none)", "float"),
    ("schedule", "only_when_idle", "only when the machine is idle", "bool"),
    ("schedule", "only_on_ac_power", "only on mains power", "bool"),
    ("schedule", "window", "daily window, e.g. 22:00-07:00 (empty = any time)", "text"),
    ("client", "confirmed", "confirmed (off: ask again before contributing)", "bool"),
    ("metrics", "port", "Prometheus metrics port (0 = off; at next start)", "int"),
    ("metrics", "address", "metrics address (127.0.0.1 = this machine only)", "text"),
]


class SettingsScreen(ViewScreen):
    _loaded = False  # the form was filled from the node's settings (refresh_view may run before on_mount)

    def compose(self) -> ComposeResult:
        yield Header()
        with VerticalScroll(id="settings-box"):
            yield Label("", id="settings-path")
            for section, key, label, kind in FIELDS:
                with Horizontal(classes="setting"):
                    yield Label(label, classes="setting-label")
                    if kind == "bool":
                        yield Switch(id=f"{section}-{key}")
                    else:
                        yield Input(id=f"{section}-{key}", classes="setting-input")
            with Horizontal(id="settings-buttons"):
                yield Button("Save", id="save", variant="primary")
                yield Button("Revert", id="revert")
            yield Label("", id="settings-error")
        yield Footer()

    def on_mount(self) -> None:
        self.refresh_view(self.ss.model)

    def refresh_view(self, model: DashboardModel) -> None:
        st = model.status
        self.query_one("#settings-path", Label).update(
            f"settings file: {st.settings_path}" if st and st.settings_path else "settings file: (no node connected)")
        if not self._loaded and model.settings is not None:
            self._fill(model.settings)
            self._loaded = True

    def _fill(self, s: Settings) -> None:
        for section, key, _, kind in FIELDS:
            value = getattr(getattr(s, section), key)
            if kind == "bool":
                self.query_one(f"#{section}-{key}", Switch).value = bool(value)
            else:
                self.query_one(f"#{section}-{key}", Input).value = str(value)

    def _read(self) -> Settings:
        """The form as Settings; raises ConfigError naming the first bad field."""
        base = self.ss.model.settings or Settings()
        changes = {}
        for section, key, _label, kind in FIELDS:
            if kind == "bool":
                changes[f"{section}_{key}"] = self.query_one(f"#{section}-{key}", Switch).value
                continue
            text = self.query_one(f"#{section}-{key}", Input).value.strip()
            try:
                changes[f"{section}_{key}"] = int(text) if kind == "int" else float(text) if kind == "float" else text
            except ValueError:
                raise ConfigError(f"{section}.{key} must be {'an integer' if kind == 'int' else 'a number'}, "
                                  f"got {text!r}") from None
        return base.replace(**changes)

    @on(Button.Pressed, "#save")
    def _save(self) -> None:
        err = self.query_one("#settings-error", Label)
        try:
            new = self._read()
        except ConfigError as e:
            err.update(f"[red]{e}[/]")  # nothing is sent: the node keeps what it has
            return
        err.update("saving ...")
        self.run_worker(self._send(new), exclusive=True, group="settings")

    async def _send(self, new: Settings) -> None:
        from protocol.messages_control import UpdateSettings

        err = self.query_one("#settings-error", Label)
        if await self.ss.command(UpdateSettings, settings_toml=render_settings(new)):
            err.update("[green]saved[/]")
        else:
            err.update(f"[red]{self.ss.last_error}[/]")

    @on(Button.Pressed, "#revert")
    def _revert(self) -> None:
        if self.ss.model.settings is not None:
            self._fill(self.ss.model.settings)
        self.query_one("#settings-error", Label).update("")


# --- Log ---------------------------------------------------------------------------------


class LogScreen(ViewScreen):
    _written = 0  # log lines already shown

    def compose(self) -> ComposeResult:
        yield Header()
        yield RichLog(id="log", wrap=True, markup=False)
        yield Footer()

    def on_mount(self) -> None:
        self.refresh_view(self.ss.model)

    def refresh_view(self, model: DashboardModel) -> None:
        log = self.query_one("#log", RichLog)
        new = min(model.log_total - self._written, len(model.log))  # the model keeps the newest lines
        for rec in list(model.log)[len(model.log) - new:] if new > 0 else []:
            log.write(f"{time.strftime('%H:%M:%S', time.localtime(rec.at))} {rec.level:<7} {rec.logger}: {rec.text}")
        self._written = model.log_total


# --- dialogs -----------------------------------------------------------------------------


class Choice(ModalScreen[str]):
    """A question with buttons; dismisses with the pressed button's id."""

    BINDINGS: ClassVar[list[BindingType]] = [("escape", "dismiss('cancel')", "Cancel")]

    def __init__(self, question: str, choices: list[tuple[str, str]], dialog_id: str = "choice"):
        super().__init__(id=dialog_id)
        self.question, self.choices = question, choices

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Static(self.question, classes="question")
            with Horizontal(classes="buttons"):
                for i, (key, label) in enumerate(self.choices):
                    yield Button(label, id=key, variant="primary" if i == 0 else "default")

    @on(Button.Pressed)
    def _pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id or "cancel")


HELP = """[b]swarmstream dashboard[/]

[b]p[/]  pause / resume training (a pause contributes what is in flight, then frees the GPU)
[b]f[/]  finish the current round, contribute it, then stop the node
[b]q[/]  quit the dashboard (you choose whether the node keeps contributing)
[b]d[/]  dashboard   [b]r[/]  runs (on Runs: list again)   [b]s[/]  settings   [b]l[/]  log
[b]?[/]  this help

From another terminal: swarmstream status | pause | resume | stop"""


class HelpScreen(ModalScreen[None]):
    BINDINGS: ClassVar[list[BindingType]] = [("escape,question_mark,q", "dismiss", "Close")]

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Static(HELP)
            yield Button("Close", id="close")

    @on(Button.Pressed, "#close")
    def _close(self) -> None:
        self.dismiss(None)


def first_run_text(model: DashboardModel, data_dir: str) -> str:
    st = model.status
    s = model.settings or Settings()
    up, down = s.network.max_upload_mbps, s.network.max_download_mbps
    caps = "no cap (set one in Settings)" if not (up or down) else (
        f"upload {f'{up:g} Mbit/s' if up else 'no cap'}, download {f'{down:g} Mbit/s' if down else 'no cap'}")
    return (
        "[b]Welcome to swarmstream[/]\n\n"
        f"This node will train [b]{st.run_name if st else 'a run'}[/] with other volunteers over the internet.\n\n"
        f"  GPU / device   {s.compute.device if s.compute.device != 'auto' else 'chosen automatically'}"
        f" (now: {st.device if st and st.device else 'not started'})\n"
        f"  bandwidth      {caps}\n"
        "                 (only compressed updates and the model's state are exchanged)\n"
        f"  files          settings {st.settings_path if st else '-'}\n"
        f"                 data, checkpoints and your key {data_dir}\n"
        f"  schedule       {s.schedule.window or 'any time'}"
        f"{', only when idle' if s.schedule.only_when_idle else ''}"
        f"{', only on mains power' if s.schedule.only_on_ac_power else ''}\n\n"
        "The node is paused until you say so. You can pause, change the settings or stop at any time.")
