"""Make docs/dashboard.svg: the dashboard of a real 3-peer demo swarm, mid-training.

    python docs/screenshot.py [OUT.svg]
"""

import asyncio
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from peer.demo import Demo  # noqa: E402
from tui.dashboard.app import SwarmstreamApp  # noqa: E402


async def shoot(out: Path) -> None:
    demo = Demo(3, rounds=None, workdir=Path(tempfile.mkdtemp(prefix="ss-shot-", dir="/tmp")))
    demo.start()
    try:
        app = SwarmstreamApp(demo.control_path(0), start_screen="dashboard", quit_asks=False)
        async with app.run_test(size=(130, 44)) as pilot:
            for _ in range(3000):
                m = app.model
                if len(m.train) >= 25 and len(m.heldout) >= 3 and len(m.syncs) >= 6 and len(m.peers) >= 2:
                    break
                await pilot.pause(0.1)
            await pilot.pause(1.0)
            app.save_screenshot(str(out.name), str(out.parent))
    finally:
        demo.stop()


if __name__ == "__main__":
    target = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parent / "dashboard.svg")
    asyncio.run(shoot(target.resolve()))
    print(f"wrote {target}")
