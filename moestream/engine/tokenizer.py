"""Tokenizer from a checkpoint folder's tokenizer.json (via `tokenizers`) and its jinja2 chat template."""

from __future__ import annotations

import json
from pathlib import Path

from jinja2.exceptions import TemplateError
from tokenizers import Tokenizer as _HFTokenizer

from moestream.engine.chat_template import RENDER_SECONDS, render
from moestream.errors import TokenizerError


def _token_str(tok) -> str | None:
    if isinstance(tok, dict):  # AddedToken serialised as a dict
        return tok.get("content")
    return tok


# A UTF-8 character is at most 4 byte tokens: the longest context `context_of` takes.
CONTEXT_TOKENS = 4


def context_of(tok, before: list[int]) -> list[int]:
    """The context generated ids are decoded after (`decode_after`): the last token before
    them, or the last few where it alone is part of a character (a byte token; a SentencePiece
    decoder turns a run of byte tokens that does not form UTF-8 into U+FFFD, the next
    character's bytes too)."""
    for n in range(1, min(len(before), CONTEXT_TOKENS) + 1):
        if "\ufffd" not in tok.decode(before[-n:]):
            return before[-n:]
    return before[-1:]


def decode_after(tok, context: list[int], ids: list[int]) -> str:
    """The text `ids` add after `context` (`context_of` the tokens before them): decoded
    together, the context's own text cut off. A SentencePiece decoder strips the leading space
    of a text's first piece, so `ids` alone lose it ("Paris" for "▁Paris"); after the context
    they keep it (" Paris", as llama.cpp prints). A special context decodes to nothing
    (skipped), so `ids` then read as at the start of a text. Byte-level BPE gives decode(ids).
    Where the context ends inside a character (`ids` may complete it: inside a generated
    character, or a prompt given as ids), `ids` alone."""
    if not context:
        return tok.decode(ids)
    head, text = tok.decode(context), tok.decode(context + ids)
    if head.endswith("\ufffd") or not text.startswith(head):
        return tok.decode(ids)
    return text[len(head) :]


class Tokenizer:
    render_seconds = RENDER_SECONDS  # the chat template's time bound (engine/chat_template.py)

    def __init__(self, folder: str | Path):
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(
                f"{path} not found: moestream needs the checkpoint's tokenizer.json (fast tokenizer); "
                "copy it from the original model folder"
            )
        try:
            self.tk = _HFTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a plain Exception on malformed files
            raise TokenizerError(f"{path}: cannot be read ({e})") from e
        cfg_path = folder / "tokenizer_config.json"
        self.config = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        template = self.config.get("chat_template")
        if (folder / "chat_template.jinja").is_file():
            template = (folder / "chat_template.jinja").read_text()
        self.chat_template = template
        self.bos_token = _token_str(self.config.get("bos_token"))
        self.eos_token = _token_str(self.config.get("eos_token"))

    @property
    def vocab_size(self) -> int:
        return self.tk.get_vocab_size()

    def token_id(self, token: str | None) -> int | None:
        return None if token is None else self.tk.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch releases the GIL (encode does not: a 4 MB prompt froze every other
        # thread, the server's event loop included, for seconds); the ids are the same.
        return self.tk.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int]) -> str:
        return self.tk.decode(ids, skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise TokenizerError(
                "this checkpoint has no chat template (tokenizer_config.json 'chat_template' or "
                "chat_template.jinja); run without --chat to use the prompt as is"
            )
        try:
            return render(
                self.chat_template,
                self.render_seconds,
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except TemplateError as e:
            raise TokenizerError(f"chat template failed: {e}") from e

    def encode_chat(self, messages: list[dict]) -> list[int]:
        # The template already contains the special tokens it wants (as transformers does).
        return self.encode(self.apply_chat_template(messages), add_special_tokens=False)
