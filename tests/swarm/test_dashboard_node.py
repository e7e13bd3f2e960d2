"""The dashboard against real nodes: a 2-peer demo swarm on 127.0.0.1 and a third node that
the dashboard itself starts by joining the run from its Runs screen."""

import asyncio
import json
import os
import tempfile
from pathlib import Path

import pytest

from peer.demo import Demo
from protocol.settings import parse_settings
from tui.cli import main as cli_main
from tui.dashboard.app import SwarmstreamApp
from tui.node_commands import start_background_node
from tui.swarm_commands import runs_lister

pytestmark = [pytest.mark.swarm, pytest.mark.slow]


async def until(pilot, cond, what: str, timeout: float = 120.0):
    for _ in range(int(timeout / 0.1)):
        if cond():
            return
        await pilot.pause(0.1)
    note = pilot.app.screen.query("#settings-error")
    raise AssertionError(f"timed out waiting for {what}" + (f"; settings says {note.first().render()}" if note else ""))


def test_join_from_the_runs_screen_then_pause_resume_settings_and_finish(demos, monkeypatch):
    work = Path(tempfile.mkdtemp(prefix="ss-dn-", dir="/tmp"))
    monkeypatch.setenv("SWARMSTREAM_HOME", str(work / "home"))  # the joined node's logs go here
    demo = Demo(2, rounds=None, workdir=work / "demo")
    demos.append(demo)
    demo.start()
    bootstrap = demo.address.split("@", 1)[1]
    me = work / "me.sock"
    settings = work / "me.toml"

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
            await until(pilot, lambda: app.model.node_up, "the joined node", timeout=180)
            # first run: the node waits, paused, until the volunteer confirms
            await until(pilot, lambda: app.screen.id == "first-run" and app.screen.query("Button"), "first run")
            await pilot.click("#start")
            await until(pilot, lambda: app.model.status.state in ("training", "averaging") and len(app.model.train) >= 4,
                        "training with a few loss points", timeout=240)
            losses = [v for _, v in app.model.train]
            assert losses[-1] < losses[0], f"the loss did not fall: {losses}"
            assert parse_settings(settings.read_text()).client.confirmed

            # p pauses: the node reports paused and its step stands still
            await pilot.press("p")
            await until(pilot, lambda: app.model.paused, "paused")
            step = app.model.status.step
            await pilot.pause(3.0)  # watching for inner steps that must not happen
            assert app.model.status.step == step and app.model.status.device == "released (paused)"
            await pilot.press("p")
            await until(pilot, lambda: not app.model.paused and app.model.status.step > step, "resumed training")

            # `swarmstream pause` from another terminal pauses the node this dashboard shows
            assert await asyncio.to_thread(cli_main, ["pause", "--control", str(me)]) == 0
            await until(pilot, lambda: app.model.paused, "paused from the command line")
            await pilot.pause(0.6)
            assert "PAUSED" in str(app.screen.query_one("#state").render())
            await pilot.press("p")
            await until(pilot, lambda: not app.model.paused, "resumed")

            # settings: a bad value is refused and the file keeps the old one; a good one is saved
            await pilot.press("s")
            await until(pilot, lambda: app.current_mode == "settings" and
                        app.screen.query_one("#network-max_upload_mbps").value != "", "the settings form")
            app.screen.query_one("#compute-gpu_memory_fraction").value = "7"
            await pilot.click("#save")
            await until(pilot, lambda: "gpu_memory_fraction" in str(app.screen.query_one("#settings-error").render()),
                        "the refusal")
            assert parse_settings(settings.read_text()).compute.gpu_memory_fraction == 1.0
            app.screen.query_one("#compute-gpu_memory_fraction").value = "1.0"
            app.screen.query_one("#network-max_upload_mbps").value = "80"
            await pilot.pause(0.2)
            await pilot.click("#save")
            await until(pilot, lambda: parse_settings(settings.read_text()).network.max_upload_mbps == 80.0,
                        "the saved cap", timeout=20)

            # f: finish the round, contribute it, stop
            await pilot.press("d")
            contributed = app.model.status.fragments_contributed
            await pilot.press("f")
            await until(pilot, lambda: app.screen.id == "confirm-finish" and app.screen.query("Button"), "confirm")
            await pilot.click("#finish")
            await until(pilot, lambda: not app.model.node_up, "the node to stop", timeout=180)
        log = (work / "home" / "data" / "logs" / "node.log").read_text()
        summary = json.loads([line for line in log.splitlines() if '"event": "summary"' in line][-1])
        assert summary["syncs"] - summary["syncs_alone"] > contributed - 1  # it averaged to the end
        assert not me.exists()

    asyncio.run(go())
    assert os.path.exists(settings)
