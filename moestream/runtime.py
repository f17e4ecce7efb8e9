"""Open a model folder for generation: weights, tokenizer, EOS ids, generator. The one entry point
the CLI, the server and benchmarks use."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from moestream.config import ModelArgs
from moestream.engine.generate import Generator
from moestream.engine.tokenizer import Tokenizer
from moestream.loader import load_hf


@dataclass
class Runtime:
    args: ModelArgs
    tokenizer: Tokenizer
    generator: Generator
    folder: Path

    def encode_prompt(self, prompt: str, chat: bool = False) -> list[int]:
        if chat:
            return self.tokenizer.encode_chat([{"role": "user", "content": prompt}])
        return self.tokenizer.encode(prompt)


def eos_ids(folder: Path, args: ModelArgs, tokenizer: Tokenizer) -> tuple[int, ...]:
    """generation_config.json's eos_token_id wins (it lists chat end tokens), then config, then tokenizer."""
    gen_cfg = folder / "generation_config.json"
    if gen_cfg.is_file():
        eos = json.loads(gen_cfg.read_text()).get("eos_token_id")
        if eos is not None:
            return tuple(eos) if isinstance(eos, list) else (int(eos),)
    if args.eos_token_ids:
        return args.eos_token_ids
    tid = tokenizer.token_id(tokenizer.eos_token)
    return () if tid is None else (tid,)


def open_model(path: str | Path, dtype: str = "float32", progress: bool = False) -> Runtime:
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(
            f"model folder {folder} does not exist; pass -m a checkpoint folder"
        )
    tokenizer = Tokenizer(folder)
    loaded = load_hf(folder, dtype, progress)
    gen = Generator(loaded.model, loaded.args, tokenizer, eos_ids(folder, loaded.args, tokenizer))
    return Runtime(loaded.args, tokenizer, gen, folder)
