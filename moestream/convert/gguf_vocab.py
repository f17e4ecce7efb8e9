"""A GGUF vocabulary (`tokenizer.ggml.*` metadata) -> the tokenizer.json / tokenizer_config.json
a store carries, so the engine's Tokenizer reads GGUF-derived stores unchanged.

Only byte-level BPE (`tokenizer.ggml.model` = gpt2) so far. `tokenizer.ggml.pre` names the
pre-tokenizer; each name maps to what the Hugging Face tokenizer.json of that family holds (the
regexes are those tokenizer.json files', which llama.cpp copies into llama-vocab.cpp).
"""

from __future__ import annotations

import json
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, processors
from tokenizers import pre_tokenizers as pre

from moestream.errors import CheckpointError, TokenizerError

_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+"
)
# o200k (GPT-4o, gpt-oss): cased letter runs with optional contractions, digits in threes
_O200K = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+"
    r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+"
    r"[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp token types (llama_token_type): control tokens are special, user-defined ones are
# added but not special; unused ones keep their id and never match text.
_CONTROL, _USER_DEFINED = 3, 4


def _split_then_bytes(regex: str):
    return pre.Sequence(
        [
            pre.Split(Regex(regex), behavior="isolated", invert=False),
            pre.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )


def _gpt2():
    return pre.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)


# tokenizer.ggml.pre -> (pre-tokenizer, NFC normalizer?, BPE ignore_merges), as in the HF files.
_PRE = {
    "gpt-2": lambda: (_gpt2(), False, False),
    "olmo": lambda: (_gpt2(), False, False),
    "qwen2": lambda: (_split_then_bytes(_QWEN2), True, False),
    "llama-bpe": lambda: (_split_then_bytes(_LLAMA3), False, True),
    # llama.cpp's GPT4O pre-type: no normalizer, merges applied (no ignore_merges)
    "gpt-4o": lambda: (_split_then_bytes(_O200K), False, False),
}
# llama.cpp gives these Llama 3's regex and ignore_merges too (llama-vocab.cpp: lfm2 is a LLAMA3
# pre-type; glm4 / glm5 are CHATGLM4, whose regex is Llama 3's)
for _name in ("llama3", "llama-v3", "lfm2", "glm4", "glm5"):
    _PRE[_name] = _PRE["llama-bpe"]


def build_tokenizer(meta: dict[str, Any], vocab_size: int, where: str) -> tuple[str, dict]:
    """(tokenizer.json text, tokenizer_config.json dict) for the GGUF's vocabulary."""
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise TokenizerError(
            f"{where}: tokenizer.ggml.model {kind!r} is not supported yet (only 'gpt2', byte-level "
            "BPE); SentencePiece ('llama') vocabularies are a follow-up"
        )
    tokens: list[str] = meta.get("tokenizer.ggml.tokens") or []
    if len(tokens) != vocab_size:
        raise CheckpointError(
            f"{where}: tokenizer.ggml.tokens has {len(tokens)} tokens but token_embd.weight has "
            f"{vocab_size} rows; the vocabulary does not belong to these weights"
        )
    pre_name = meta.get("tokenizer.ggml.pre", "default")
    if pre_name not in _PRE:
        raise TokenizerError(
            f"{where}: tokenizer.ggml.pre {pre_name!r} is not supported yet "
            f"(supported: {', '.join(sorted(_PRE))})"
        )
    pre_tok, nfc, ignore_merges = _PRE[pre_name]()
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise CheckpointError(f"{where}: tokenizer.ggml.tokens holds duplicate tokens")
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
    if nfc:
        tk.normalizer = normalizers.NFC()
    tk.pre_tokenizer = pre_tok
    tk.decoder = decoders.ByteLevel()
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    added = [
        AddedToken(tokens[i], special=t == _CONTROL, normalized=False)
        for i, t in enumerate(types)
        if t in (_CONTROL, _USER_DEFINED)
    ]
    tk.add_tokens(added)
    bos = _token(meta, tokens, "bos")
    if meta.get("tokenizer.ggml.add_bos_token", False) and bos is not None:
        tk.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])]
        )
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos}
    config["eos_token"] = _token(meta, tokens, "eos")
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = meta["tokenizer.chat_template"]
    return json.dumps(json.loads(tk.to_str()), ensure_ascii=False), config


def _token(meta: dict[str, Any], tokens: list[str], which: str) -> str | None:
    tid = meta.get(f"tokenizer.ggml.{which}_token_id")
    if tid is None:
        return None
    if not 0 <= int(tid) < len(tokens):
        raise CheckpointError(
            f"tokenizer.ggml.{which}_token_id {tid} is outside the vocabulary ({len(tokens)} tokens)"
        )
    return tokens[int(tid)]
