"""moestream: run MoE language models larger than memory by streaming only the routed experts."""

__version__ = "0.1.0"
