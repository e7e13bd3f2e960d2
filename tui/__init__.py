"""The volunteer's side: the ``swarmstream`` command line and the Textual dashboard.

Never imports torch at module level; commands that run the engine import ``peer`` lazily.
"""

__version__ = "0.1.0"
