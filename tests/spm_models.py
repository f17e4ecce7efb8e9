"""A small SentencePiece-style vocabulary, as a Llama-family GGUF holds it (`tokenizer.ggml.model`
= llama: tokens, scores, token types; Mixtral, Mistral, Llama 2), and llama.cpp's SPM tokenizer
written out in Python from what llama-vocab.cpp does: the spec moestream's GGUF tokenizer is
tested against where llama.cpp itself is absent.

The vocabulary is laid out as llama.cpp's converter writes a SentencePiece model: <unk> <s> </s>,
control tokens ([INST] [/INST], as Mistral's later vocabularies hold), the 256 byte tokens, a
user-defined token, learned pieces best first (score -rank), single characters last, unused
[PADn] rows up to the embedding's size."""

from __future__ import annotations

from dataclasses import dataclass, field

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = range(1, 7)
SPACE = "\u2581"
CORPUS = [
    "def fibonacci(n): return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
    "The quick brown fox jumps over the lazy dog while the other dogs sleep.",
    "Hello world, hello there! Say hello to the world of tokens and tokenizers.",
    "In the beginning the tokenizer merged the pieces that were seen the most.",
    "Numbers like 12345 and 3.14 appear, as do words such as café and naïve.",
    "aaaa bbbb aaaaaaaa abab abababab: repeated letters test the leftmost rule.",
]
CONTROLS = ("[INST]", "[/INST]")
USER_DEFINED_TOKENS = ("<think>",)
# Mixtral-8x7B-Instruct's chat template (tokenizer_config.json), as its GGUFs carry it
MIXTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != "
    "(loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate "
    "user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ message['content'] + eos_token}}{% else %}{{ raise_exception('Only user and assistant "
    "roles are supported!') }}{% endif %}{% endfor %}"
)


@dataclass
class SpmVocab:
    tokens: list[str]
    scores: list[float]
    types: list[int]
    add_bos: bool = True
    add_eos: bool = False
    add_space_prefix: bool = True
    bos: int = 1
    eos: int = 2
    unk: int = 0
    ids: dict[str, int] = field(init=False)

    def __post_init__(self):
        self.ids = {t: i for i, t in enumerate(self.tokens)}


def spm_vocab(size: int = 512, **flags) -> SpmVocab:
    """The vocabulary of `size` tokens; pieces learned by `tokenizers`' BPE trainer on CORPUS over
    SentencePiece's space marker (no newline or tab tokens: those fall back to bytes, as in
    Llama's). flags: SpmVocab's add_bos / add_eos / add_space_prefix."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokens = ["<unk>", "<s>", "</s>", *CONTROLS]
    types = [UNKNOWN, CONTROL, CONTROL] + [CONTROL] * len(CONTROLS)
    tokens += [f"<0x{b:02X}>" for b in range(256)] + list(USER_DEFINED_TOKENS)
    types += [BYTE] * 256 + [USER_DEFINED] * len(USER_DEFINED_TOKENS)
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="always")
    trainer = trainers.BpeTrainer(vocab_size=size - len(tokens) - 4, show_progress=False)
    tk.train_from_iterator(CORPUS, trainer)
    by_id = sorted((i, t) for t, i in tk.get_vocab().items())  # the alphabet, then merge order
    merged, chars = [t for _, t in by_id if len(t) > 1], [t for _, t in by_id if len(t) == 1]
    scores = [0.0] * len(tokens)  # as SentencePiece scores them (the converter: -1000 user-defined)
    pieces = [t for t in merged + chars if t not in tokens]
    assert len(tokens) + len(pieces) <= size, (len(tokens), len(pieces))
    tokens += pieces
    types += [NORMAL] * len(pieces)
    scores += [-float(k + 1) for k in range(len(pieces))]  # distinct, best first, below 0
    pad = size - len(tokens)
    tokens += [f"[PAD{i}]" for i in range(pad)]
    types += [UNUSED] * pad
    scores += [-1000.0] * pad
    return SpmVocab(tokens, scores, types, **flags)


def write_spm_vocab(writer, v: SpmVocab, chat_template: str | None = MIXTRAL_TEMPLATE) -> None:
    """The vocabulary as llama.cpp's converter writes a SentencePiece model's."""
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(v.tokens)
    writer.add_token_scores(v.scores)
    writer.add_token_types(v.types)
    writer.add_bos_token_id(v.bos)
    writer.add_eos_token_id(v.eos)
    writer.add_unk_token_id(v.unk)
    writer.add_add_bos_token(v.add_bos)
    writer.add_add_eos_token(v.add_eos)
    if not v.add_space_prefix:  # absent means on (llama.cpp's SPM default)
        writer.add_add_space_prefix(False)
    if chat_template is not None:
        writer.add_chat_template(chat_template)


# ---- llama.cpp's SPM tokenizer (llama-vocab.cpp), the spec --------------------------------------
def llama_cpp_encode(v: SpmVocab, text: str, add_special: bool = True) -> list[int]:
    """llama_tokenize(text, add_special, parse_special=true) on an SPM vocabulary: control,
    unknown and user-defined tokens cut the text (longest first); each run of text left gets
    a space in front where it starts the text or follows such a token, spaces become U+2581,
    and the run is merged pair by pair, best-scored join first (the leftmost of equals);
    characters left without a token become their byte tokens."""
    out = [v.bos] if add_special and v.add_bos else []
    prev_special = True
    for part in _fragments(v, text):
        if isinstance(part, int):
            out.append(part)
            prev_special = True
            continue
        run = (" " if v.add_space_prefix and prev_special else "") + part
        out += _merge(v, run.replace(" ", SPACE))
        prev_special = False
    if add_special and v.add_eos:
        out.append(v.eos)
    return out


def _fragments(v: SpmVocab, text: str) -> list:
    specials = [i for i, t in enumerate(v.types) if t in (CONTROL, UNKNOWN, USER_DEFINED)]
    parts: list = [text] if text else []
    for sid in sorted(specials, key=lambda i: -len(v.tokens[i])):
        cut: list = []
        for p in parts:
            if isinstance(p, int):
                cut.append(p)
                continue
            for k, s in enumerate(p.split(v.tokens[sid])):
                cut += ([sid] if k else []) + ([s] if s else [])
        parts = cut
    return parts


def _merge(v: SpmVocab, run: str) -> list[int]:
    syms = list(run)  # UTF-8 characters
    while True:
        best = None  # (score, -left)
        for i in range(len(syms) - 1):
            tid = v.ids.get(syms[i] + syms[i + 1])
            if tid is not None and (best is None or (v.scores[tid], -i) > best):
                best = (v.scores[tid], -i)
        if best is None:
            break
        i = -best[1]
        syms[i : i + 2] = [syms[i] + syms[i + 1]]
    out = []
    for s in syms:
        if s in v.ids:
            out.append(v.ids[s])
        else:
            out += [v.ids[f"<0x{b:02X}>"] for b in s.encode()]
    return out


def llama_cpp_decode(v: SpmVocab, ids: list[int]) -> str:
    """llama_detokenize(ids, remove_special=false, unparse_special=false): control, unknown and
    unused tokens give nothing, byte tokens their byte, normal tokens their text with U+2581 as a
    space; with add_space_prefix the first token loses one leading space."""
    out, strip = b"", v.add_space_prefix
    for i in ids:
        t, text = v.types[i], v.tokens[i]
        piece = b""
        if t == NORMAL:
            piece = text.replace(SPACE, " ").encode()
        elif t == USER_DEFINED:
            piece = text.encode()
        elif t == BYTE:
            piece = bytes([int(text[3:5], 16)])
        if strip and piece.startswith(b" "):
            piece = piece[1:]
        strip = False
        out += piece
    return out.decode(errors="replace")
