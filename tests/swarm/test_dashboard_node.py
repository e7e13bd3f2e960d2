"""The dashboard against real nodes: a 2-peer demo swarm on 127.0.0.1 and a third node that
the dashboard itself starts by joining the run from its Runs screen; and the dashboard that
`swarmstream demo` opens, on a one-peer demo."""

import math
import asyncio
import json
import os
import re
import subprocess
import tempfile
from pathlib import Path

import pytest
from textual.widgets import Button

from peer.demo import Demo
from peer.launch import child_cwd, child_env, module_command
from protocol.manifest import open_manifest
from protocol.settings import parse_settings
from tui.cli import main as cli_main
from tui.dashboard.app import SwarmstreamApp
from tui.node_commands import start_background_node
from tui.swarm_commands import demo_dashboard, runs_lister

pytestmark = [pytest.mark.swarm, pytest.mark.slow]

HELDOUT_ROUNDS = 3
"""Full rounds between the two held-out losses the test compares (20 inner steps each)."""


async def until(pilot, cond, what: str, timeout: float = 120.0, log=None):
    """Wait for ``cond()`` with a deadline, letting the app run; the failure says what the
    dashboard last showed (its last refused command, the settings note, the node's log)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        if loop.time() >= deadline:
            app = pilot.app
            note = app.screen.query("#settings-error")
            st = app.model.status
            why = [f"timed out after {timeout:.0f} s waiting for {what}",
                   f"screen={app.screen.id} node_up={app.model.node_up} node_error={app.model.node_error!r}",
                   f"state={st.state if st else None} reason={st.pause_reason if st else None!r}",
                   f"last refused command: {app.last_error!r}"]
            if note:
                why.append(f"settings says {note.first().render()}")
            if log is not None and log.exists():
                why.append("node log tail:\n" + "\n".join(log.read_text(errors="replace").splitlines()[-30:]))
            raise AssertionError("; ".join(why[:4]) + "".join("\n" + w for w in why[4:]))
        await pilot.pause(0.1)  # lets the app's workers poll the node; the deadline bounds the wait


@pytest.mark.timeout(900)  # its own bounded waits allow more than 300 s; beside two busy loops it took 236 s
def test_join_from_the_runs_screen_then_pause_resume_settings_and_finish(demos, short_tmp, background_nodes,
                                                                        monkeypatch):
    # (short_tmp before background_nodes: fixtures end in reverse, and the node to end is found
    # through the lock file in short_tmp, so that folder must outlive the node's teardown)
    work = short_tmp
    monkeypatch.setenv("SWARMSTREAM_HOME", str(work / "home"))  # the joined node's logs go here
    node_log = work / "home" / "data" / "logs" / "node.log"
    demo = Demo(2, rounds=None, workdir=work / "demo")
    demos.append(demo)
    demo.start()
    bootstrap = demo.address.split("@", 1)[1]
    inner_steps = open_manifest((work / "demo" / "demo.swarmrun").read_bytes()).manifest.train.sync.inner_steps
    me = work / "me.sock"
    settings = work / "me.toml"
    background_nodes.append(work / "me.key")  # the node the dashboard starts is ended even if we fail

    async def start_node(address: str) -> None:
        await asyncio.to_thread(start_background_node, address, control=me, identity=work / "me.key",
                                data_dir=work / "me", settings=settings, listen="/ip4/127.0.0.1/tcp/0")

    async def go():
        app = SwarmstreamApp(me, list_runs=runs_lister([bootstrap]), start_node=start_node, poll_s=0.5)
        async with app.run_test(size=(130, 48)) as pilot:
            # the Runs screen lists the demo's run (advertised in the DHT); selecting it joins
            assert app.current_mode == "runs"
            table = app.screen.query_one("#runs")
            for _ in range(30):  # the run is advertised at the peers' first heartbeats
                if table.row_count:
                    break
                app.screen.refresh_runs()
                await until(pilot, lambda: "looking" not in str(app.screen.query_one("#runs-note").render()),
                            "the listing")
            assert "local demo" in [str(c) for c in table.get_row_at(0)]
            table.focus()
            await pilot.press("enter")
            await until(pilot, lambda: app.model.node_up, "the joined node", timeout=180, log=node_log)
            # first run: the node waits, paused, until the volunteer confirms; the dialog shows
            # once the node reports that (its status says paused, for the confirmation)
            await until(pilot, lambda: app.screen.id == "first-run" and app.screen.query("Button"), "first run",
                        log=node_log)
            app.screen.query_one("#start", Button).press()  # a click at its place missed under load
            # the confirmation is saved by the node, then it resumes and trains
            await until(pilot, lambda: parse_settings(settings.read_text()).client.confirmed,
                        "the node to save the confirmation", timeout=30, log=node_log)
            await until(pilot, lambda: app.model.status.state in ("training", "averaging"),
                        "the node to leave the first-run pause", timeout=60, log=node_log)

            # it learns: the held-out loss of the global model (the node measures it on the
            # manifest's fixed held-out batches at every full round) is shown, round after round
            await until(pilot, lambda: len(app.model.heldout) >= 1, "a held-out loss", timeout=240, log=node_log)
            first_step, first = app.model.heldout[0]
            await until(pilot, lambda: app.model.heldout[-1][0] >= first_step + HELDOUT_ROUNDS * inner_steps,
                        f"a held-out loss {HELDOUT_ROUNDS} rounds later", timeout=300, log=node_log)
            later_step, later = app.model.heldout[-1]
            # a model that learned, not a falling curve: the node joins a run already hundreds of
            # steps in, where three rounds move the loss less than its noise (2.6566 -> 2.6637)
            assert math.isfinite(later) and later < math.log(256) - 1.0, \
                f"held-out loss {first:.4f} at step {first_step}, {later:.4f} at step {later_step}"

            # p pauses: the node reports paused and its step stands still
            await pilot.press("p")
            await until(pilot, lambda: app.model.paused, "paused", log=node_log)
            step, since = app.model.status.step, app.model.status.at
            # watch the node's own status reports for 3 s of its clock: no inner step happens
            await until(pilot, lambda: app.model.status.at >= since + 3.0, "3 s of status while paused")
            assert app.model.status.step == step and app.model.status.device == "released (paused)"
            await pilot.press("p")
            await until(pilot, lambda: not app.model.paused and app.model.status.step > step, "resumed training",
                        log=node_log)

            # `swarmstream pause` from another terminal pauses the node this dashboard shows
            assert await asyncio.to_thread(cli_main, ["pause", "--control", str(me)]) == 0
            await until(pilot, lambda: app.model.paused, "paused from the command line")
            await until(pilot, lambda: "PAUSED" in str(app.screen.query_one("#state").render()), "PAUSED shown")
            await pilot.press("p")
            await until(pilot, lambda: not app.model.paused, "resumed")

            # settings: a bad value is refused and the file keeps the old one; a good one is saved
            await pilot.press("s")
            await until(pilot, lambda: app.current_mode == "settings" and
                        app.screen.query_one("#network-max_upload_mbps").value != "", "the settings form")
            app.screen.query_one("#compute-gpu_memory_fraction").value = "7"
            await pilot.pause()
            # Save as a press of the button: on a loaded machine a click at its position missed it
            # (a toast of an earlier command over it, or the form still laying out)
            app.screen.query_one("#save", Button).press()
            await until(pilot, lambda: "gpu_memory_fraction" in str(app.screen.query_one("#settings-error").render()),
                        "the refusal")
            assert parse_settings(settings.read_text()).compute.gpu_memory_fraction == 1.0
            app.screen.query_one("#compute-gpu_memory_fraction").value = "1.0"
            app.screen.query_one("#network-max_upload_mbps").value = "80"
            await pilot.pause()  # the inputs' change messages are handled before the save
            app.screen.query_one("#save", Button).press()
            await until(pilot, lambda: parse_settings(settings.read_text()).network.max_upload_mbps == 80.0,
                        "the saved cap", timeout=20)

            # f: finish the round, contribute it, stop
            await pilot.press("d")
            contributed = app.model.status.fragments_contributed
            await pilot.press("f")
            await until(pilot, lambda: app.screen.id == "confirm-finish" and app.screen.query("Button"), "confirm")
            await pilot.click("#finish")
            await until(pilot, lambda: not app.model.node_up, "the node to stop", timeout=180, log=node_log)
        log = node_log.read_text()
        summary = json.loads([line for line in log.splitlines() if '"event": "summary"' in line][-1])
        assert summary["syncs"] - summary["syncs_alone"] > contributed - 1  # it averaged to the end
        assert not me.exists()

    asyncio.run(go())
    assert os.path.exists(settings)


def test_the_demo_dashboard_shows_the_nodes_log_its_progress_and_its_run(demos):
    """Issue 11, found on a real dashboard: the Log screen stayed empty (the node's INFO lines
    were never created), the demo's Runs screen knew no bootstrap peers, and the run's step
    target showed nowhere."""
    work = Path(tempfile.mkdtemp(prefix="ss-dd-", dir="/tmp"))
    demo = Demo(1, rounds=None, workdir=work)
    demos.append(demo)
    demo.start()

    async def go():
        app = demo_dashboard(demo)  # what `swarmstream demo` opens
        async with app.run_test(size=(130, 44)) as pilot:
            await until(pilot, lambda: app.model.node_up and app.model.status.inner_step_s > 0, "a timed step")
            # the step target of the demo's manifest, with an ETA, on the dashboard and in `status`
            assert app.model.status.total_steps == 2000
            label = app.screen.query_one("#target-label")
            await until(pilot, lambda: re.search(r"step [\d,]+ of 2,000 \(\d+%\) · ETA \d", str(label.render())),
                        "the progress row")
            assert 0 < app.screen.query_one("#target-bar").progress < 1
            status = await asyncio.to_thread(  # `swarmstream status` from another terminal
                subprocess.run, module_command("tui.cli", "status", "--control", str(demo.control_path(0))),
                capture_output=True, text=True, env=child_env(), cwd=child_cwd())
            assert re.search(r"^target    step [\d,]+ of 2,000 \(\d+%\) · ETA \d", status.stdout, re.M), status

            # the node's INFO lines reach the Log screen
            await pilot.press("l")
            await until(pilot, lambda: any(r.level == "INFO" and r.text.startswith("fragment synced")
                                           for r in app.model.log), "an INFO line from the node")
            log = app.screen.query_one("#log")
            await until(pilot, lambda: any("INFO" in str(line) and "fragment synced" in str(line)
                                           for line in log.lines), "the line on the Log screen")

            # the Runs screen lists the demo's run through its own peers
            await pilot.press("r")
            await until(pilot, lambda: app.current_mode == "runs", "the runs screen")
            table = app.screen.query_one("#runs")
            for _ in range(30):  # the run is advertised at the peer's first heartbeats
                await until(pilot, lambda: "looking" not in str(app.screen.query_one("#runs-note").render()),
                            "the listing")
                if table.row_count:
                    break
                app.screen.refresh_runs()
            assert "local demo" in [str(c) for c in table.get_row_at(0)]

    asyncio.run(go())
    demo.stop()
    # while the dashboard got INFO, the node's console (stderr, peer0.log) kept to warnings
    assert not [line for line in (work / "peer0.log").read_text().splitlines() if " INFO " in line]
