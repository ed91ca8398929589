"""`make bench`: every benchmark, each writing its results under bench/results/."""

from bench import publish, worker_overhead

publish.main()
worker_overhead.main(["--write"])
