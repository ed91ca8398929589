"""scheduler-daemon: replicated scheduling where the database elects one worker per loop."""

__version__ = "0.1.0"
