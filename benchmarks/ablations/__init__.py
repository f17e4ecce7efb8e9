"""Experiments measured slower than the product path and kept off it (STYLE item 7): each module
runs its variant beside the product kernels for the benchmark scripts and their tests."""
