"""Fixtures of the swarm tests."""

import os
import signal

import pytest


@pytest.fixture
def demos():
    started: list = []  # peer.demo.Demo objects
    yield started
    for d in started:
        for p in d.procs.values():
            try:
                os.killpg(p.pid, signal.SIGKILL)  # the node and its libp2p daemon
            except ProcessLookupError:
                pass
            p.wait()
