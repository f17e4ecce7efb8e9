"""Router observation: traces (record/load), routing statistics, plots, the cache simulator and the
memory-pressure guard (the warm-up experiment is benchmarks/bench_warmup.py)."""
