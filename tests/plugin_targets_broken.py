"""A target module that fails while being imported (tests/test_plugin_tasks.py)."""

raise RuntimeError("this module cannot be imported: its settings are missing")
