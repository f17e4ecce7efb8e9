"""Build the stand-in demo model: a small random qwen3_moe checkpoint with a byte-level tokenizer.

Used by `make demo` until the trained reference model ships under models/. Random weights produce
random text; the demo shows the pipeline (load, route, generate, stats), not quality.
"""

import sys
from pathlib import Path

import torch
import transformers as T
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers


def main(out: str) -> None:
    folder = Path(out)
    torch.manual_seed(0)
    cfg = T.Qwen3MoeConfig(
        vocab_size=512,
        hidden_size=128,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        moe_intermediate_size=64,
        num_experts=32,
        num_experts_per_tok=4,
        norm_topk_prob=True,
        max_position_embeddings=2048,
    )
    T.Qwen3MoeForCausalLM(cfg).save_pretrained(folder)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train([str(p) for p in sorted(Path(T.__file__).parent.glob("*.py"))[:40]], trainer)
    tok.save(str(folder / "tokenizer.json"))
    print(f"demo model (random weights) written to {folder}")


if __name__ == "__main__":
    main(sys.argv[1])
