"""The sample plugin (tests/sample_plugin), visible to the test suite only.

It used to be installed into the venv, which put its ``sample`` publisher and tasks into
every daemon `make run` started. Now the suite puts it on ``PYTHONPATH`` instead: the
package from its source directory, and a ``*.dist-info`` written from its pyproject.toml,
which is all importlib.metadata needs to find its entry points. Test processes inherit
the variable (``rig.processes.daemon_env`` keeps it even when a test sets its own).
"""

from __future__ import annotations

import tomllib
from pathlib import Path

SOURCE = Path(__file__).resolve().parent.parent / "sample_plugin"


def write_distribution(site: Path) -> list[Path]:
    """Write the plugin's metadata into `site`; return the path entries to add."""
    project = tomllib.loads((SOURCE / "pyproject.toml").read_text())["project"]
    name, version = project["name"], project["version"]
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    groups = project.get("entry-points", {})
    (info / "entry_points.txt").write_text(
        "".join(
            f"[{group}]\n" + "".join(f"{key} = {value}\n" for key, value in points.items())
            for group, points in groups.items()
        )
    )
    return [site, SOURCE]
