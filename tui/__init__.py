"""The volunteer's side: the ``swarmstream`` command line and the Textual dashboard.

Never imports torch at module level; commands that run the engine import ``peer`` lazily.
"""

from protocol import __version__  # noqa: F401  (one version, kept in protocol)
