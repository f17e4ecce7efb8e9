"""Open a model folder for generation: weights, tokenizer, EOS ids, generator. The one entry point
the CLI, the server and benchmarks use."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from moestream.config import ConfigError, ModelArgs
from moestream.convert.cache import cached_store
from moestream.engine.generate import Generator, small_decode_threads
from moestream.engine.tokenizer import Tokenizer
from moestream.loader import load_hf
from moestream.quant import make_scheme
from moestream.store.format import is_store
from moestream.store.load import load_store
from moestream.store.stream import StreamConfig


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


def _check_predict_options(name: str, routing: str, min_score: float, ahead: int) -> None:
    """Before anything loads: the prediction flags make sense together."""
    if name == "none" and routing != "exact":
        raise ConfigError("--routing predicted needs a --predictor (e.g. prerouter)")
    if not 0.0 <= min_score < 1.0:
        raise ConfigError(f"--min-score {min_score} must be in [0, 1): a router probability")
    if ahead not in (1, 2):
        raise ConfigError(f"--predict-ahead {ahead}: the stale gate names 1 or 2 layers ahead")
    if ahead != 1 and name != "stale-gate":
        raise ConfigError(f"--predict-ahead applies to --predictor stale-gate, not {name}")


def _attach_predictor(
    model, name: str, routing: str, trace, folders, min_score: float = 0.0, ahead: int = 1
) -> None:
    from moestream.obs.trace import load_trace
    from moestream.predict.pipeline import attach, make_predictor
    from moestream.predict.prerouter import PrerouterHeads, find_heads

    heads = None
    if name == "prerouter":
        found = find_heads(*folders)
        heads = PrerouterHeads.load(found) if found is not None else None
    tr = load_trace(trace) if trace is not None else None
    predictor = make_predictor(name, model, heads=heads, trace=tr, ahead=ahead)
    attach(model, predictor, routing, min_score=min_score)


def open_model(
    path: str | Path,
    dtype: str = "float32",
    progress: bool = False,
    stream: StreamConfig | None = None,
    quant: str | None = None,
    predictor: str = "none",
    routing: str = "exact",
    trace: str | Path | None = None,
    min_score: float = 0.0,
    predict_ahead: int = 1,
    device: str = "cpu",
    gpu=None,
    threads: int | None = None,
) -> Runtime:
    """A store opens with `stream` (default: all experts resident). A Hugging Face folder loads
    directly, unless `stream` or `quant` is given: then it is converted once into the cache.
    `device="cuda"` (a store, converted if needed): `gpu` is a store.gpu.GpuConfig (default: every
    expert in VRAM).
    `predictor`/`routing`/`trace`/`min_score`/`predict_ahead`: routing prediction and prefetch
    (moestream/predict/). `threads`: the torch threads the caller set; None (the default) lets a
    small model decode on one thread (engine.generate.small_decode_threads)."""
    _check_predict_options(predictor, routing, min_score, predict_ahead)
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(
            f"model folder {folder} does not exist; pass -m a checkpoint folder"
        )
    on_gpu = device != "cpu"
    if not is_store(folder) and (stream is not None or quant is not None or on_gpu):
        folder = cached_store(folder, make_scheme(quant or "bf16"), progress)
    tokenizer = Tokenizer(folder)
    if on_gpu:  # dense weights, KV cache and an expert slot pool on the GPU (store/gpu.py)
        from moestream.store.gpu import GpuConfig, load_store_gpu

        loaded = load_store_gpu(folder, gpu or GpuConfig(resident=True), dtype, device, progress)
    elif is_store(folder):
        loaded = load_store(folder, stream or StreamConfig(resident=True), dtype, progress)
        if quant is not None and quant != loaded.model.moe_blocks[0].provider.store.scheme.name:
            raise ConfigError(
                f"{folder} is stored as {loaded.model.moe_blocks[0].provider.store.scheme.name}; "
                f"--quant {quant} needs a convert from the Hugging Face folder"
            )
    else:
        loaded = load_hf(folder, dtype, progress)
    if predictor != "none" or routing != "exact":
        folders = (Path(path), folder)
        _attach_predictor(
            loaded.model, predictor, routing, trace, folders, min_score, predict_ahead
        )
    gen = Generator(loaded.model, loaded.args, tokenizer, eos_ids(folder, loaded.args, tokenizer))
    if threads is None and not on_gpu:
        gen.decode_threads = small_decode_threads(loaded.args)
    return Runtime(loaded.args, tokenizer, gen, folder)
