"""A swarm peer, in parts (each its own concern):

- ``loop``: the training loop: inner steps, the fragment syncs it starts and lands (through
  ``peer.sync_pipeline``), pause and resume, finish and leave;
- ``syncs``: one fragment sync: its group and all-reduce, then its landing;
- ``worker_state``: the model on its device: build, release, checkpoint, evaluate;
- ``catchup``: agreement, repair and state download;
- ``settle``: the run's end: the finishers end on one final copy;
- ``peers``: heartbeats, the live peers view, reconnecting, relays;
- ``volunteer``: status, events and commands of the control socket;
- ``config``: configuration, counters, the identity lock;
- ``cli``: ``python -m peer.node``.
"""

from peer.node.cli import USER_ERRORS, main, one_line, read_manifest_file
from peer.node.config import (
    CONFIRM_REASON,
    NodeAlreadyRunning,
    NodeConfig,
    NodeStats,
    global_digest,
    lock_identity,
)
from peer.node.loop import Node
from peer.node.volunteer import _LogToControl

__all__ = ["CONFIRM_REASON", "USER_ERRORS", "Node", "NodeAlreadyRunning", "NodeConfig", "NodeStats", "_LogToControl",
           "global_digest", "lock_identity", "main", "one_line", "read_manifest_file"]
