"""`make bench`: every benchmark, each writing its results under bench/results/."""

from bench import publish, short_notice, worker_overhead

publish.main()
short_notice.main([])
worker_overhead.main(["--write"])
