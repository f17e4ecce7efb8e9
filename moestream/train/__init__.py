"""Training the project's reference MoE model (Hugging Face `qwen3_moe` architecture).

`tokenizer`: byte-level BPE tokenizer and corpus tokenization; `trainer`: model config, token
packing, the training loop with resume, and export to an HF folder. CLI: `python -m moestream.train`.
"""
