"""A GGUF vocabulary (`tokenizer.ggml.*` metadata) -> the tokenizer.json / tokenizer_config.json
a store carries, so the engine's Tokenizer reads GGUF-derived stores unchanged.

Two kinds (`tokenizer.ggml.model`), each encoding and decoding as llama.cpp's tokenizer of it:
- `gpt2`: byte-level BPE. `tokenizer.ggml.pre` names the pre-tokenizer; each name maps to what the
  Hugging Face tokenizer.json of that family holds (the regexes are those tokenizer.json files',
  which llama.cpp copies into llama-vocab.cpp).
- `llama`: SentencePiece BPE (Mixtral, Mistral, Llama 2): no merges, a score per token. llama.cpp
  joins the adjacent pair whose join is the best-scored token until none is; BPE merges ranked by
  the joined token's score do the same (`_merges_by_score`). Spaces are U+2581, one prepended to
  every run of text (at the start and after each special token: `add_space_prefix`), characters
  without a token fall back to their `<0xXX>` byte tokens.
"""

from __future__ import annotations

import json
from collections import Counter
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
# llama.cpp token types (llama_token_type: 0 undefined ... 5 unused, 6 byte): control and unknown
# tokens are special, user-defined ones added but not special (llama.cpp matches all three whole
# in the text before tokenizing the rest); unused and byte tokens keep their id, never match text.
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED = 1, 2, 3, 4
_TYPES = range(7)
SPACE = "\u2581"  # SentencePiece's space
# llama.cpp's special ids of a SentencePiece vocabulary whose metadata does not name them
_SPM_DEFAULT_IDS = {"bos": 1, "eos": 2, "unknown": 0}


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
    if kind not in _KINDS:
        raise TokenizerError(
            f"{where}: tokenizer.ggml.model {kind!r} is not supported (supported: 'gpt2', "
            "byte-level BPE; 'llama', SentencePiece)"
        )
    tokens: list[str] = meta.get("tokenizer.ggml.tokens") or []
    if len(tokens) != vocab_size:
        raise CheckpointError(
            f"{where}: tokenizer.ggml.tokens has {len(tokens)} tokens but token_embd.weight has "
            f"{vocab_size} rows; the vocabulary does not belong to these weights"
        )
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise CheckpointError(f"{where}: tokenizer.ggml.tokens holds duplicate tokens")
    types = _token_types(meta, tokens, where, required=kind == "llama")
    tk = _KINDS[kind](meta, tokens, vocab, where)
    tk.add_tokens(
        [
            AddedToken(tokens[i], special=t != _USER_DEFINED, normalized=False)
            for i, t in enumerate(types)
            if t in (_UNKNOWN, _CONTROL, _USER_DEFINED)
        ]
    )
    bos, eos = special_token(meta, tokens, "bos"), special_token(meta, tokens, "eos")
    add_bos = bos is not None and meta.get("tokenizer.ggml.add_bos_token", kind == "llama")
    add_eos = eos is not None and meta.get("tokenizer.ggml.add_eos_token", False)
    if add_bos or add_eos:
        tk.post_processor = _add_ends(bos if add_bos else None, eos if add_eos else None, vocab)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos}
    for name, which in (("unk_token", "unknown"), ("pad_token", "padding")):
        if (tok := special_token(meta, tokens, which)) is not None:
            config[name] = tok
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = meta["tokenizer.chat_template"]
    return json.dumps(json.loads(tk.to_str()), ensure_ascii=False), config


def _byte_level(meta: dict[str, Any], tokens: list[str], vocab: dict, where: str) -> Tokenizer:
    pre_name = meta.get("tokenizer.ggml.pre", "default")
    if pre_name not in _PRE:
        raise TokenizerError(
            f"{where}: tokenizer.ggml.pre {pre_name!r} is not supported yet "
            f"(supported: {', '.join(sorted(_PRE))})"
        )
    pre_tok, nfc, ignore_merges = _PRE[pre_name]()
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
    if nfc:
        tk.normalizer = normalizers.NFC()
    tk.pre_tokenizer = pre_tok
    tk.decoder = decoders.ByteLevel()
    return tk


def _sentencepiece(meta: dict[str, Any], tokens: list[str], vocab: dict, where: str) -> Tokenizer:
    """llama.cpp's SPM tokenizer as a BPE model: merges from the scores, byte fallback; no
    pre-tokenizer, so the merges run over each whole run of text, as llama.cpp's do."""
    scores = [float(s) for s in _per_token(meta, "scores", tokens, where, required=True)]
    unk = special_token(meta, tokens, "unknown")
    bpe = models.BPE(
        vocab=vocab,
        merges=_merges_by_score(tokens, scores),
        unk_token=unk,
        byte_fallback=True,
        fuse_unk=True,
    )
    tk = Tokenizer(bpe)
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    spaces = normalizers.Replace(" ", SPACE)
    # The normalizer runs on each run of text between special tokens: llama.cpp's space prefix.
    tk.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), spaces]) if prefix else spaces
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:  # llama.cpp's detokenizer drops the first piece's leading space
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tk.decoder = decoders.Sequence(steps)
    return tk


def _merges_by_score(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Every split of a token into two tokens, the best-scored token's first: BPE applying them in
    this order joins the pair llama.cpp's SPM session joins (the adjacent pair whose join is the
    best-scored token, the leftmost of equals). Joins of equal score rank by id and split point
    here, where llama.cpp takes the leftmost: two tokens of one score (SentencePiece's differ;
    `score_ties_note` says so) or two overlapping splits of one token (`ab|a`, `a|ba` in
    `[ab][a][ba]`)."""
    found = sorted(_splits(tokens), key=lambda s: (-scores[s[0]], s))
    return [(tokens[i][:k], tokens[i][k:]) for i, k in found]


def _splits(tokens: list[str]) -> list[tuple[int, int]]:
    """(id, k) for each token id that splits into the tokens [:k] and [k:]."""
    known = set(tokens)
    return [
        (i, k)
        for i, t in enumerate(tokens)
        for k in range(1, len(t))
        if t[:k] in known and t[k:] in known
    ]


def score_ties_note(meta: dict[str, Any]) -> str | None:
    """A line for convert to say when tokens formed by joins share scores (llama.cpp's converter
    writes -1000 for every token of a vocabulary read from tokenizer.json alone): llama.cpp then
    joins leftmost first, the store's tokenizer in token order. None for distinct scores."""
    if meta.get("tokenizer.ggml.model") != "llama":
        return None
    tokens, scores = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.scores"]
    joined = {i for i, _ in _splits(tokens)}
    tied = sum(n for n in Counter(scores[i] for i in joined).values() if n > 1)
    if not tied:
        return None
    return (
        f"tokenizer.ggml.scores: {tied} of the {len(joined)} tokens formed by joining two others "
        "share their score with another; llama.cpp joins equal scores leftmost first, this "
        "tokenizer in token order, so some texts may encode differently from llama.cpp"
    )


def _add_ends(bos: str | None, eos: str | None, vocab: dict):
    """BOS before and / or EOS after each sequence, as add_bos_token / add_eos_token say."""
    head, tail = [bos] if bos else [], [eos] if eos else []
    return processors.TemplateProcessing(
        single=[*head, "$A", *tail],
        pair=[*head, "$A", *tail, *head, "$B", *tail],
        special_tokens=[(t, vocab[t]) for t in dict.fromkeys(head + tail)],
    )


def _per_token(meta: dict[str, Any], key: str, tokens: list[str], where: str, required: bool):
    """`tokenizer.ggml.{key}`, one value per token (None where absent and not required)."""
    values = meta.get(f"tokenizer.ggml.{key}")
    if values is None:
        if not required:
            return None
        raise CheckpointError(
            f"{where}: metadata key 'tokenizer.ggml.{key}' is missing; a SentencePiece ('llama') "
            "vocabulary needs it (llama.cpp's converter writes tokens, scores and token_type)"
        )
    if not isinstance(values, list) or len(values) != len(tokens):
        n = len(values) if isinstance(values, list) else "not an array of"
        raise CheckpointError(
            f"{where}: tokenizer.ggml.{key} has {n} entries but tokenizer.ggml.tokens has "
            f"{len(tokens)}; one per token is needed"
        )
    return values


def _token_types(meta: dict[str, Any], tokens: list[str], where: str, required: bool) -> list:
    types = _per_token(meta, "token_type", tokens, where, required)
    if types is None:  # llama.cpp takes every token as normal
        return [_NORMAL] * len(tokens)
    for i, t in enumerate(types):
        if t not in _TYPES:
            raise CheckpointError(
                f"{where}: tokenizer.ggml.token_type of token {i} ({tokens[i]!r}) is {t!r}; "
                "llama.cpp's token types are 0-6 (undefined, normal, unknown, control, "
                "user-defined, unused, byte)"
            )
    return types


def special_token_id(meta: dict[str, Any], which: str, n_tokens: int) -> int | None:
    """The id of tokenizer.ggml.{which}_token_id (bos, eos, unknown, padding, eot, ...), or
    llama.cpp's default for a SentencePiece vocabulary that names none (bos 1, eos 2, unknown 0)."""
    tid = meta.get(f"tokenizer.ggml.{which}_token_id")
    if tid is None and meta.get("tokenizer.ggml.model") == "llama":
        tid = _SPM_DEFAULT_IDS.get(which)
        return tid if tid is not None and tid < n_tokens else None
    if tid is None:
        return None
    if not 0 <= int(tid) < n_tokens:
        raise CheckpointError(
            f"tokenizer.ggml.{which}_token_id {tid} is outside the vocabulary ({n_tokens} tokens)"
        )
    return int(tid)


def special_token(meta: dict[str, Any], tokens: list[str], which: str) -> str | None:
    tid = special_token_id(meta, which, len(tokens))
    return None if tid is None else tokens[tid]


_KINDS = {"gpt2": _byte_level, "llama": _sentencepiece}
