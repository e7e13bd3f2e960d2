"""swarmstream's sans-IO layer: configs, codecs, fragments, messages, identities.

No sockets, no asyncio, no clocks (time is an argument). ``peer`` and ``tui`` build on it.
"""
