"""``python -m peer.node``: see ``peer.node.cli``."""

from peer.node.cli import main

raise SystemExit(main())
