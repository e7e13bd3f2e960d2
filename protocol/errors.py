"""Errors of the protocol layer.

Following h11, an error says which side broke the rules:

- ``LocalProtocolError``: we were asked to build or send something invalid (a bad
  config value, a flag out of range). Fix the caller.
- ``RemoteProtocolError``: bytes from outside (a peer's message, a DHT record, a
  manifest or checkpoint file) do not follow the protocol. Reject them and count it
  against the sender; never crash on them.

Every message is one line a user can act on.
"""


class ProtocolError(Exception):
    """Base class of every error raised by ``protocol``."""


class LocalProtocolError(ProtocolError, ValueError):
    """We tried to build something the protocol does not allow."""


class RemoteProtocolError(ProtocolError, ValueError):
    """Input from outside (peer, DHT, file) broke the protocol."""


class ConfigError(LocalProtocolError):
    """A configuration value is invalid; the message names the field and the fix."""
