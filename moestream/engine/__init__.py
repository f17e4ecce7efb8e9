"""Prefill/decode loop, KV cache, sampling and the generation API."""
