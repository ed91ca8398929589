"""`make bench` / `make bench-quick`: every benchmark, one after the other (never side by
side: the machine has two cores), each writing its results under bench/results/ (with
--quick under bench/results/quick/, so a smoke run never replaces the committed numbers).

    python -m bench [--quick] [--only NAME ...]
"""

import argparse
import importlib
import time

from bench import docs
from bench.common import RESULTS

# Each module has main(argv) taking --quick and --out.
BENCHMARKS = [
    "publish",
    "short_notice",
    "worker_overhead",
    "failover",
    "latency",
    "idle",
    "peers",
    "latency_peers",  # after latency (reads its latency.json) and peers (its venvs)
    "growth",
    "scale",
    "shards",
    "sustained",
    "runs_migration",
    "publications_steady",
    "million",
    "dashboard",
]

parser = argparse.ArgumentParser(prog="python -m bench")
parser.add_argument("--quick", action="store_true", help="a smoke run, about a minute")
parser.add_argument("--only", nargs="+", choices=BENCHMARKS, default=BENCHMARKS)
args = parser.parse_args()
out = RESULTS / "quick" if args.quick else RESULTS
for name in args.only:
    started = time.monotonic()
    argv = ["--out", str(out), *(["--quick"] if args.quick else [])]
    if name == "worker_overhead":
        argv.append("--write")
    importlib.import_module(f"bench.{name}").main(argv)
    print(f"bench: {name} took {time.monotonic() - started:.0f} s", flush=True)
if not args.quick:
    docs.update()  # docs/performance.md shows what was just measured
