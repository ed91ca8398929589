"""Keep docs/performance.md showing the committed results: each block between
``<!-- bench:NAME -->`` and ``<!-- /bench:NAME -->`` is bench/results/NAME.md (without
its title line, its headings one level down) followed by the plots NAME_*.png. The prose
around the blocks is written by hand. `make bench` refreshes the blocks after a full run;
tests/test_readme.py checks they match the results files.

    python -m bench.docs        # refresh from bench/results/ as they are
"""

from __future__ import annotations

import re
from pathlib import Path

from bench.common import RESULTS, ROOT

DOC = ROOT / "docs" / "performance.md"
BLOCK = re.compile(r"(<!-- bench:(\w+) -->\n)(.*?)(<!-- /bench:\2 -->)", re.DOTALL)


def block(name: str, results: Path = RESULTS) -> str:
    """What the block for bench/results/NAME.md holds."""
    text = (results / f"{name}.md").read_text()
    lines = text.rstrip("\n").splitlines()
    title, body = lines[0], lines[1:]
    stamped = re.search(r"\(([^()]*)\)\s*$", title)
    stamp = stamped[1] if stamped else ""
    out = [f"_Run {stamp}._" if stamp else "", *body]
    out = [("#" + line) if line.startswith("#") else line for line in out]
    for plot in sorted(results.glob(f"{name}_*.png")):
        out += ["", f"![{plot.stem}](../bench/results/{plot.name})"]
    return "\n".join(out).strip("\n") + "\n"


def render(doc: str, results: Path = RESULTS) -> str:
    return BLOCK.sub(lambda m: m[1] + block(m[2], results) + m[4], doc)


def update(path: Path = DOC) -> None:
    path.write_text(render(path.read_text()))


if __name__ == "__main__":
    update()
