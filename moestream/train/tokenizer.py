"""Byte-level BPE tokenizer (trained with `tokenizers`) and corpus tokenization."""

from __future__ import annotations

import json
import lzma
import os
from collections.abc import Iterator

import numpy as np

EOT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [EOT, IM_START, IM_END]

# A minimal ChatML template: enough for a chat mode to format turns; the model is not chat-tuned.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def iter_documents(path: str, chunk_chars: int = 1 << 20) -> Iterator[str]:
    """Yield the documents of a corpus file (documents end with a line holding EOT)."""
    buf = ""
    opener = lzma.open if path.endswith(".xz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        while True:
            block = f.read(chunk_chars)
            if not block:
                break
            buf += block
            parts = buf.split(EOT + "\n")
            buf = parts.pop()
            yield from (p for p in parts if p)
    if buf.strip():
        yield buf


def train_tokenizer(files: list[str], vocab_size: int = 8192, min_frequency: int = 2):
    """Train a byte-level BPE tokenizer. The EOT token is prepended to every encoded text when
    special tokens are added (so prompts look like the start of a document)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )

    def texts():
        for f in files:
            yield from iter_documents(f)

    tok.train_from_iterator(texts(), trainer=trainer)
    eot_id = tok.token_to_id(EOT)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{EOT} $A", pair=f"{EOT} $A {EOT} $B", special_tokens=[(EOT, eot_id)]
    )
    return tok


def save_tokenizer(tok, out_dir: str, model_max_length: int = 2048) -> None:
    """Write tokenizer.json and a tokenizer_config.json that transformers' AutoTokenizer reads."""
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    added = {}
    for t in SPECIAL_TOKENS:
        added[str(tok.token_to_id(t))] = {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": EOT,
        "eos_token": EOT,
        "pad_token": EOT,
        "unk_token": None,
        "add_bos_token": False,  # the tokenizer.json post-processor already prepends EOT
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    with open(os.path.join(out_dir, "special_tokens_map.json"), "w") as f:
        json.dump({"bos_token": EOT, "eos_token": EOT, "pad_token": EOT}, f, indent=2)


def load_tokenizer(path: str):
    from tokenizers import Tokenizer

    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    return Tokenizer.from_file(path)


def tokenize_file(tok, path: str, batch_docs: int = 256) -> np.ndarray:
    """Encode a corpus file to one uint16 stream: each document followed by EOT."""
    eot_id = tok.token_to_id(EOT)
    assert tok.get_vocab_size() <= 65535
    out: list[np.ndarray] = []
    batch: list[str] = []

    def flush():
        for enc in tok.encode_batch(batch, add_special_tokens=False):
            out.append(np.asarray(enc.ids + [eot_id], dtype=np.uint16))
        batch.clear()

    for doc in iter_documents(path):
        batch.append(doc)
        if len(batch) >= batch_docs:
            flush()
    if batch:
        flush()
    return np.concatenate(out) if out else np.zeros(0, dtype=np.uint16)
