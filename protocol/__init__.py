"""swarmstream's sans-IO layer: configs, codecs, fragments, messages, identities.

No sockets, no asyncio, no clocks (time is an argument). ``peer`` and ``tui`` build on it.
"""

__version__ = "0.1.0"
"""The client's version (also in heartbeats as ``swarmstream/<version>``)."""
