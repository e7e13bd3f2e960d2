"""``python -m swarmstream``: the same command line as the ``swarmstream`` console script.

The code lives in the three layers ``protocol``, ``peer`` and ``tui``; this package only
names the distribution so that ``python -m swarmstream`` works where the script is not on PATH.
"""

from protocol import __version__  # noqa: F401  (one version, kept in protocol)
