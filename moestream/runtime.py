"""The runtime: one opened model with everything that runs it (model, expert provider, tokenizer,
generator). The CLI, the server, eval and trace open models only through `open_model`, and close
the runtime (its provider's IO threads, pinned buffers and maps) when done."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path

from moestream.config import ConfigError, ModelArgs
from moestream.convert.cache import cached_store
from moestream.convert.gguf import is_gguf
from moestream.convert.mxfp4 import is_mxfp4_checkpoint
from moestream.convert.writer import source_scheme
from moestream.engine.generate import Generator, small_decode_threads
from moestream.engine.tokenizer import Tokenizer
from moestream.experts.base import ExpertProvider
from moestream.experts.config import ExpertsConfig, GpuConfig, PredictConfig
from moestream.loader import load_model
from moestream.models.base import MoeCausalLM
from moestream.store.format import Store, is_store


@dataclass
class Runtime:
    args: ModelArgs
    model: MoeCausalLM
    provider: ExpertProvider  # the model's experts (wrapped by prediction when asked)
    tokenizer: Tokenizer
    generator: Generator
    folder: Path  # what was opened: the store (converted if needed) or the HF folder
    # Where trained files beside a model are looked for (prerouter heads, recovery adapter).
    sources: tuple[Path, ...] = ()
    adapter: object = None  # the recovery adapter's AdapterInfo, when one runs

    def encode_prompt(self, prompt: str, chat: bool = False) -> list[int]:
        if chat:
            return self.tokenizer.encode_chat([{"role": "user", "content": prompt}])
        return self.tokenizer.encode(prompt)

    @property
    def mode(self) -> dict:
        """What runs: device, compute dtype, the provider's description (experts, quant, cache
        size and policy, predictor, routing), whether decode replays CUDA graphs, and whether a CPU
        decode step runs every layer in one native call (models/native_step.py)."""
        from moestream.models.native_step import why_not

        native_step = self.model.fused_decode and why_not(self.model, self.provider) is None
        return {
            "device": self.model.device.type,
            "dtype": str(self.model.dtype).removeprefix("torch."),
            **self.provider.describe(),
            "lora": None if self.adapter is None else self.adapter.describe(),
            "cuda_graph": self.generator.graphs is not None,
            "compiled_step": self.generator.graphs is not None and self.generator.graphs.compiled,
            "native_step": native_step,
        }

    @cached_property
    def store(self) -> Store | None:
        """The expert store the experts come from (None for a Hugging Face folder)."""
        return Store(self.folder) if is_store(self.folder) else None

    def replace_provider(self, provider: ExpertProvider) -> None:
        """Close the current provider and run the model on `provider` (benchmarks start a fresh,
        empty cache this way); the model's blocks and the generator follow."""
        old, self.provider = self.provider, provider
        old.close()
        self.model.set_provider(provider)
        self.generator.provider = provider

    def close(self) -> None:
        self.provider.close()

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


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


def _heads_folders(given: Path, folder: Path) -> tuple[Path, ...]:
    """Where trained prerouter heads may be: the -m folder, the store opened, and the Hugging
    Face folder a store was converted from (heads trained there serve its stores too)."""
    out = [given, folder]
    if is_store(folder):
        src = Store(folder).manifest.get("source", {}).get("path")
        if src:
            out.append(Path(src))
    return tuple(out)


def _gpu_prefetch(experts: GpuConfig, predict: PredictConfig) -> GpuConfig:
    """On a GPU the stale gate's prefetch runs inside the decode step (GpuConfig.prefetch);
    the other predictors and predicted routing run only on the CPU providers."""
    if predict.predictor != "stale-gate" or predict.routing != "exact" or predict.ahead != 1:
        raise ConfigError(
            "with --device cuda only --predictor stale-gate (exact routing, one layer ahead) "
            "is implemented; run other predictors and --routing predicted on the CPU"
        )
    if predict.min_score:
        raise ConfigError(
            "--min-score: the GPU's stale gate prefetches the next layer's top-k as the router "
            "picks it (no ranking to cut); drop --min-score"
        )
    return replace(experts, prefetch="stale-gate")


def _attach_predictor(loaded, cfg: PredictConfig, folders) -> ExpertProvider:
    from moestream.experts.predicting import attach
    from moestream.obs.trace import load_trace
    from moestream.predict.pipeline import make_predictor
    from moestream.predict.prerouter import HEADS_FILE, PrerouterHeads, find_heads

    heads = None
    if cfg.predictor == "prerouter":
        found = find_heads(*folders)
        if found is None:
            raise ConfigError(
                f"--predictor prerouter needs trained heads ({HEADS_FILE}); looked in "
                f"{', '.join(str(f) for f in dict.fromkeys(folders))}; make them with "
                "`moestream train-prerouter -m PATH --traces TRACE`"
            )
        heads = PrerouterHeads.load(found)
    tr = load_trace(cfg.trace) if cfg.trace is not None else None
    predictor = make_predictor(cfg.predictor, loaded.model, heads=heads, trace=tr, ahead=cfg.ahead)
    return attach(loaded.model, loaded.provider, predictor, cfg.routing, cfg.min_score)


def _attach_lora(model, cfg: PredictConfig, folders):
    """The recovery adapter for predicted routing: --lora PATH, else recovery.lora beside the
    model when the prerouter routes (what it is trained for); None with --no-lora or none found."""
    from moestream.recovery.adapter import find_adapter, load_adapter

    if not cfg.wants_lora:
        return None
    path = cfg.lora if cfg.lora is not None else find_adapter(*folders)
    return None if path is None else load_adapter(model, path)


def _decode_graphs(loaded, provider: ExpertProvider, dtype: str):
    """Captured decode steps when the model and its experts allow them; else say why, once."""
    from moestream.engine.graph import DecodeGraphs, graphable
    from moestream.loader import resolve_dtype

    why = graphable(loaded.model, loaded.args, provider)
    if why is not None:
        print(f"moestream: decode runs eagerly (no CUDA graph): {why}", file=sys.stderr)
        return None
    device = loaded.model.device
    compiled = provider.cfg.compile_step  # graphable: a GpuExperts
    return DecodeGraphs(loaded.model, loaded.args, resolve_dtype(dtype), device, compiled)


def _context(asked: int | None, model: int) -> int:
    if asked is None:
        return model
    if not 2 <= asked <= model:
        raise ConfigError(f"--ctx-size {asked} must be in [2, {model}] (the model's context)")
    return asked


def _check_is_model(folder: Path) -> None:
    """A folder that is neither a store nor a Hugging Face checkpoint is named for what it is
    (before the tokenizer would complain about a missing tokenizer.json)."""
    from moestream.errors import CheckpointError
    from moestream.store.format import DENSE_FILE, MANIFEST, StoreError

    if is_store(folder):
        return
    if (folder / DENSE_FILE).is_file() or any(folder.glob("experts-L*.bin")):
        raise StoreError(
            f"{folder} holds a moestream store's files but no {MANIFEST}: the store is damaged "
            "(an interrupted copy?); convert the model again"
        )
    if (folder / "config.json").is_file():
        return  # a Hugging Face folder: the checkpoint reader names what is missing
    raise CheckpointError(
        f"{folder} is not a model folder: neither a Hugging Face checkpoint (config.json + "
        f"*.safetensors) nor a moestream store ({MANIFEST}); pass -m a checkpoint folder"
    )


def _check_store(folder: Path, quant: str | None) -> None:
    """Open a store's manifest before the tokenizer reads its files (their checksums are there)."""
    if not is_store(folder):
        return
    stored = Store(folder).quant_name
    if quant is not None and quant != stored:
        raise ConfigError(
            f"{folder} is stored as {stored}; --quant {quant} needs a convert from the Hugging "
            "Face folder"
        )


def open_model(
    path: str | Path,
    dtype: str = "float32",
    progress: bool = False,
    experts: ExpertsConfig | None = None,
    quant: str | None = None,
    predict: PredictConfig | None = None,
    threads: int | None = None,
    context: int | None = None,
) -> Runtime:
    """Open a folder. A store opens with `experts` (a StreamConfig for the CPU, a GpuConfig for a
    GPU; default: every expert resident in RAM). A Hugging Face folder loads directly, unless
    `experts` or `quant` is given or its experts are MXFP4 (gpt-oss): then it is converted once
    into the cache.
    `predict`: routing prediction and prefetch (moestream/predict/). `threads`: the torch threads
    the caller set; None lets a small model decode on one thread (small_decode_threads).
    `context`: positions a sequence may use (default: the model's whole context)."""
    predict = predict or PredictConfig()
    on_gpu = isinstance(experts, GpuConfig)
    if on_gpu and predict.active:
        experts = _gpu_prefetch(experts, predict)
    folder = Path(path)
    # Always through a store: GGUF weights are converted once, and so are a hub folder's MXFP4
    # experts (gpt-oss: kept in their 4.25 bits; loaded directly they would be fp32, ~19x that)
    if is_gguf(folder) or (is_mxfp4_checkpoint(folder) and not is_store(folder)):
        folder = cached_store(folder, source_scheme(folder, quant), progress)
    if not folder.is_dir():
        raise FileNotFoundError(
            f"model folder {folder} does not exist; pass -m a checkpoint folder or GGUF file"
        )
    _check_is_model(folder)
    if not is_store(folder) and (experts is not None or quant is not None):
        folder = cached_store(folder, source_scheme(folder, quant), progress)
    _check_store(folder, quant)
    tokenizer = Tokenizer(folder)
    loaded = load_model(folder, experts, dtype=dtype, progress=progress)
    provider, sources = loaded.provider, _heads_folders(Path(path), folder)
    if on_gpu and experts.prefetch != "none":  # inside the captured step (experts/gpu.py)
        provider.set_routes([b.route for b in loaded.model.moe_blocks])
    elif predict.active:
        provider = _attach_predictor(loaded, predict, sources)
    adapter = _attach_lora(loaded.model, predict, sources)
    eos = eos_ids(folder, loaded.args, tokenizer)
    gen = Generator(loaded.model, loaded.args, tokenizer, provider, eos)
    gen.context = _context(context, loaded.args.max_position_embeddings)
    if threads is None and not on_gpu:
        gen.decode_threads = small_decode_threads(loaded.args)
    if on_gpu and experts.cuda_graph:
        gen.graphs = _decode_graphs(loaded, provider, dtype)
    return Runtime(loaded.args, loaded.model, provider, tokenizer, gen, folder, sources, adapter)
