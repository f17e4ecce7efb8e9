"""SentencePiece GGUF vocabularies (`tokenizer.ggml.model` = llama: Mixtral's, Mistral's, Llama 2's
as downloaded) -> the store's tokenizer. It encodes and decodes as llama.cpp's SPM tokenizer
(tests/spm_models writes that one out in Python: the spec), agrees with transformers' own GGUF
tokenizer where transformers follows llama.cpp, runs a tiny Mixtral GGUF end to end, and a bad
vocabulary is named (exit code 2). test_gguf_llama_cpp.py compares with llama.cpp itself."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from gguf_models import rewrite_gguf, write_gguf
from spm_models import CONTROL, UNKNOWN, llama_cpp_decode, llama_cpp_encode, spm_vocab
from test_gguf import hf_checkpoint

from moestream.cli import main
from moestream.convert.gguf import GGUFCheckpoint
from moestream.convert.gguf_vocab import build_tokenizer
from moestream.engine.tokenizer import Tokenizer

VOCAB = 512
TEXTS = [
    "",
    "Hello world",
    "hello there, the quick brown fox",
    " leading space",
    "   three leading spaces",
    "trailing spaces   ",
    "multiple   spaces\tand a tab",
    "line one\nline two\n\n",
    "\n starts with a newline",
    "unicode: café naïve 東京 🙂 e\u0301",
    "[INST] What is fibonacci? [/INST] def fibonacci(n):",
    "<s>[INST]hi[/INST]</s>",
    "a<think>b <think> c",
    "an <unk> token",
    "aaaaaaaaa abababab bbbbb",
    "U+2581 itself: a\u2581b \u2581\u2581c",
    " ",
    "\u2581",
    "12345 3.14",
]
# where transformers' GGUF tokenizer (Metaspace, prepend_scheme "first") differs from llama.cpp:
# a text starting with a space or U+2581, and a run of text after a special token (llama.cpp,
# SentencePiece and Mixtral's own tokenizer.json prepend a space to each)
SPECIALS = ("<s>", "</s>", "<unk>", "[INST]", "[/INST]", "<think>")
PLAIN = [
    t for t in TEXTS if not t.startswith((" ", "\u2581")) and not any(s in t for s in SPECIALS)
]


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    """(HF folder, SentencePiece vocabulary, its tiny Mixtral GGUF, values stored), built once."""
    root = tmp_path_factory.mktemp("spm")
    hf = hf_checkpoint("mixtral", root / "hf", vocab_size=VOCAB, bos_token_id=1, eos_token_id=2)
    v = spm_vocab(VOCAB)
    stored = write_gguf(hf, root / "m.gguf", {i: ("Q8_0",) * 3 for i in range(3)}, spm=v)
    return hf, v, root / "m.gguf", stored


def _tokenizer(meta: dict, folder) -> Tokenizer:
    """The engine's tokenizer from build_tokenizer's files for `meta`."""
    folder.mkdir()
    text, config = build_tokenizer(meta, VOCAB, str(folder))
    (folder / "tokenizer.json").write_text(text)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return Tokenizer(folder)


FLAGS = {
    "default": {},
    "no_space_prefix": {"add_space_prefix": False},
    "eos_no_bos": {"add_bos": False, "add_eos": True},
}


@pytest.mark.parametrize("flags", FLAGS)
def test_spm_encodes_and_decodes_as_llama_cpp(mixtral, flags, tmp_path):
    """Every text, with and without the special tokens added, gives llama.cpp's ids; the ids
    decode to llama.cpp's text. One difference, on decode only: ids that start with a control
    token (BOS) lose the next piece's leading space here (Hugging Face's decoder skips special
    tokens first, then strips), as Mixtral's own tokenizer.json does, where llama.cpp keeps it."""
    path = mixtral[2]
    meta = dict(GGUFCheckpoint(path).meta)
    v = spm_vocab(VOCAB, **FLAGS[flags])  # the file's tokens and scores, these flags
    meta.update(
        {"tokenizer.ggml.add_bos_token": v.add_bos, "tokenizer.ggml.add_eos_token": v.add_eos}
    )
    if not v.add_space_prefix:
        meta["tokenizer.ggml.add_space_prefix"] = False
    ours = _tokenizer(meta, tmp_path / "tok")
    for text in TEXTS:
        assert ours.encode(text) == llama_cpp_encode(v, text), text
        ids = llama_cpp_encode(v, text, add_special=False)
        assert ours.encode(text, add_special_tokens=False) == ids, text
        # (llama.cpp's text once the leading special tokens, which decode to nothing, are gone)
        lead = next((k for k, i in enumerate(ids) if v.types[i] not in (CONTROL, UNKNOWN)), 0)
        assert ours.decode(ids) == llama_cpp_decode(v, ids[lead:]), text
    if v.add_bos and v.add_space_prefix:
        assert ours.decode(llama_cpp_encode(v, "hi")) == "hi"  # llama.cpp: " hi"


def random_texts(n: int, seed: int = 0) -> list[str]:
    """Texts of corpus words and pieces of them cut anywhere, spaces, newlines, U+2581,
    characters without a token and the special tokens."""
    import random

    from spm_models import CORPUS

    rng = random.Random(seed)
    corpus = " ".join(CORPUS)
    words = corpus.split() + list(SPECIALS) + ["\n", "\u2581", "東", "é", "  "]

    def piece() -> str:
        if rng.random() < 0.5:
            return rng.choice(words)
        i = rng.randrange(len(corpus))
        return corpus[i : i + rng.randint(1, 12)]

    return ["".join(piece() + rng.choice(["", " ", "  "]) for _ in range(8)) for _ in range(n)]


def test_spm_random_texts_encode_as_llama_cpp(mixtral, tmp_path):
    ours = _tokenizer(dict(GGUFCheckpoint(mixtral[2]).meta), tmp_path / "tok")
    v = spm_vocab(VOCAB)
    for text in random_texts(300):
        assert ours.encode(text) == llama_cpp_encode(v, text), text


def test_spm_store_files_and_transformers_gguf_tokenizer(mixtral, tmp_path):
    """The store's tokenizer (GGUFCheckpoint.write_files): llama.cpp's ids on every text, BOS /
    EOS / UNK named; transformers' own GGUF tokenizer gives the same ids and text on the texts
    where it follows llama.cpp (PLAIN)."""
    from transformers import AutoTokenizer

    _, v, path, _ = mixtral
    out = tmp_path / "files"
    out.mkdir()
    GGUFCheckpoint(path).write_files(out)
    ours = Tokenizer(out)
    assert (ours.bos_token, ours.eos_token, ours.config["unk_token"]) == ("<s>", "</s>", "<unk>")
    for text in TEXTS:
        assert ours.encode(text) == llama_cpp_encode(v, text), text
    theirs = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    assert len(PLAIN) >= 8
    for text in PLAIN:
        ids = theirs.encode(text)
        assert ours.encode(text) == ids, text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text


def _greedy(hf, stored: dict, ids: list[int], n: int, tmp) -> list[int]:
    """transformers' greedy tokens with the GGUF's values as its weights."""
    from safetensors.torch import save_file
    from test_parity import hf_load

    folder = tmp / "dequantized"
    shutil.copytree(hf, folder)
    save_file(stored, str(folder / "model.safetensors"), metadata={"format": "pt"})
    model, out = hf_load(folder), list(ids)
    with torch.no_grad():
        for _ in range(n):
            out.append(int(model(torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(ids) :]


def test_mixtral_spm_gguf_end_to_end(mixtral, tmp_path, capsys):
    """`generate -m x.gguf` on a tiny Mixtral GGUF with a SentencePiece vocabulary: the prompt is
    llama.cpp's ids (BOS first), the tokens transformers' greedy ones on the file's values, the
    text their decoding; `--chat` renders Mixtral's template and encodes it as llama.cpp does."""
    hf, v, path, stored = mixtral
    prompt = "def fibonacci(n):\n  return"
    args = ["generate", "-m", str(path), "-n", "6", "--ignore-eos", "--kernel", "ref", "--json"]
    assert main([*args, "-p", prompt]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["prompt_ids"] == llama_cpp_encode(v, prompt)
    assert res["prompt_ids"][0] == 1 and v.ids["<0x0A>"] in res["prompt_ids"]
    assert res["ids"] == _greedy(hf, stored, res["prompt_ids"], 6, tmp_path)
    assert res["text"] == after(v, res["prompt_ids"], res["ids"])  # llama-cli's pieces
    assert main([*args, "-p", "hi there", "--chat"]) == 0
    chat = json.loads(capsys.readouterr().out)
    assert chat["prompt_ids"] == llama_cpp_encode(v, "<s>[INST] hi there [/INST]", False)
    assert chat["prompt_ids"][:2] == [1, v.ids["[INST]"]]


def after(v, prompt: list[int], ids: list[int]) -> str:
    """llama.cpp's text of `ids` after `prompt`: each generated token's piece as llama-cli prints
    it (U+2581 kept as a space)."""
    return llama_cpp_decode(v, prompt + ids)[len(llama_cpp_decode(v, prompt)) :]


def test_spm_generated_text_keeps_its_leading_space(mixtral, tmp_path):
    """Generated ids decoded after the prompt's last token, as every engine path does (the CLI's
    and the server's TextStream, the server's per-token strings): a piece starting with U+2581
    keeps its space (llama.cpp's text, " quick" where the ids alone decode to "quick"); after a
    control token ([/INST]) the piece reads as a text's start; streamed pieces add up to it, as
    the per-token strings do where no token is a byte."""
    from types import SimpleNamespace

    from moestream.engine.generate import TextStream
    from moestream.engine.tokenizer import context_of, decode_after
    from moestream.serve.protocol import token_strings

    _, v, path, _ = mixtral
    out = tmp_path / "files"
    out.mkdir()
    GGUFCheckpoint(path).write_files(out)
    tok = Tokenizer(out)
    rt = SimpleNamespace(tokenizer=tok)
    spaced = 0
    for text in ("Hello world, the quick brown fox", "def f(n):\n  return n", "a café 東京 🙂"):
        full = llama_cpp_encode(v, text)  # BOS, then the text: every cut is a prompt + its reply
        for k in range(2, len(full)):
            prompt, ids = full[:k], full[k:]
            if llama_cpp_decode(v, prompt).endswith("\ufffd"):
                continue  # a prompt ending inside a character: no text prompt does
            want = after(v, prompt, ids)
            stream = TextStream(tok, (), context_of(tok, prompt))
            assert "".join(stream.push(t) for t in ids) + stream.flush() == want == stream.text
            assert decode_after(tok, context_of(tok, prompt), ids) == want
            if text.isascii():  # (a byte token's string is its byte alone: U+FFFD)
                assert "".join(token_strings(rt, ids, prompt)) == want, (text, k)
            spaced += want.startswith(" ") and not tok.decode(ids).startswith(" ")
    assert spaced >= 8  # the cuts where the ids alone lose the space
    assert tok.decode(llama_cpp_encode(v, "quick", False)) == "quick"  # alone: no space
    reply = llama_cpp_encode(v, "quick fox", False)  # ▁quick ...
    assert decode_after(tok, [v.ids["[/INST]"]], reply) == "quick fox"


def test_equal_scores_are_said(mixtral, tmp_path, capsys):
    """Scores of -1000 for every token (llama.cpp's converter on a vocabulary read from
    tokenizer.json alone): llama.cpp joins equal scores leftmost first, the store's tokenizer in
    token order, and convert says so; distinct scores are not mentioned."""
    path = mixtral[2]
    tied = _rewritten(path, tmp_path / "tied.gguf", "tokenizer.ggml.scores", [-1000.0] * VOCAB)
    for src, said in ((path, False), (tied, True)):
        capsys.readouterr()
        assert main(["convert", str(src), str(tmp_path / src.stem)]) == 0
        assert ("share their score with another" in capsys.readouterr().err) == said


# ---- bad vocabularies: one line naming the key, exit code 2 ------------------------------------
def _rewritten(src, dst, key: str, value):
    """src's GGUF with metadata `key` set to value (None: dropped), tensors as they are."""
    rewrite_gguf(src, dst, "llama", {key: value})
    return dst


BAD = {
    "scores_short": ("tokenizer.ggml.scores", lambda v: v.scores[:-1],
                     "tokenizer.ggml.scores has 511 entries but tokenizer.ggml.tokens has 512"),
    "scores_missing": ("tokenizer.ggml.scores", None, "'tokenizer.ggml.scores' is missing"),
    "types_missing": ("tokenizer.ggml.token_type", None, "'tokenizer.ggml.token_type' is missing"),
    "types_long": ("tokenizer.ggml.token_type", lambda v: v.types + [1],
                   "tokenizer.ggml.token_type has 513 entries"),
    "type_unknown": ("tokenizer.ggml.token_type", lambda v: v.types[:5] + [9] + v.types[6:],
                     "tokenizer.ggml.token_type of token 5 ('<0x00>') is 9"),
    "model_unknown": ("tokenizer.ggml.model", lambda v: "bert",
                      "tokenizer.ggml.model 'bert' is not supported (supported: 'gpt2'"),
}  # fmt: skip


@pytest.mark.parametrize("case", BAD)
def test_bad_spm_vocabulary_is_named(mixtral, case, tmp_path, capsys):
    _, v, path, _ = mixtral
    key, value, message = BAD[case]
    bad = _rewritten(path, tmp_path / "bad.gguf", key, value and value(v))
    capsys.readouterr()
    assert main(["convert", str(bad), str(tmp_path / "s")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moestream: error:") and "Traceback" not in err
    assert message in err and "\n" not in err.strip()
