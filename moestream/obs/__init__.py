"""Router observation: traces (record/load), routing statistics, plots, the cache simulator, the
memory-pressure guard and the warm-up experiment."""
