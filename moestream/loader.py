"""The one loader: a folder (Hugging Face checkpoint or expert store) plus an experts config ->
the native model and its expert provider.

    HF folder            -> dense weights + every expert in RAM (ResidentExperts)
    store + StreamConfig -> dense weights + StreamingExperts (resident / slot cache) or MmapExperts
    store + GpuConfig    -> dense weights on the GPU + GpuExperts
    StreamConfig.shard   -> the above restricted to one rank's experts, in ExpertParallel

A store's budget is checked against its manifest before any dense weight is read."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from moestream.config import ConfigError, ModelArgs
from moestream.convert.hf import HFCheckpoint
from moestream.errors import CheckpointError
from moestream.experts.base import ExpertProvider
from moestream.experts.config import ExpertsConfig, GpuConfig, StreamConfig, slot_count
from moestream.experts.resident import ResidentExperts
from moestream.kernels.dense import QuantEmbedding, QuantLinear, QuantWeight, triton_form
from moestream.kernels.ref import ExpertActivation
from moestream.models import checkpoint_renamer, model_module
from moestream.models.base import MoeCausalLM
from moestream.store.format import Store, is_store

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; use one of {', '.join(DTYPES)}")
    return DTYPES[name]


def build_model(args: ModelArgs, dtype: torch.dtype) -> MoeCausalLM:
    with torch.device("meta"):
        model = model_module(args.model_type).build(args)
    model = model.to_empty(device="cpu").to(dtype).eval()
    for m in model.modules():
        if getattr(m, "keep_fp32", False):  # e.g. sigmoid routers: fp32 as in transformers
            m.float()
        for name in getattr(m, "keep_fp32_params", ()):  # single tensors (lfm2_moe expert_bias)
            p = getattr(m, name)
            if p is not None:
                p.data = p.data.float()
        if hasattr(m, "fuse_qkv"):  # while the weights are still empty: no transient copy
            m.fuse_qkv()
    return model


def load_dense(
    ckpt: HFCheckpoint | Store,
    model: MoeCausalLM,
    dtype: torch.dtype,
    progress: bool = False,
    kernel: str = "native",
) -> None:
    """Copy every non-expert tensor into the model; strict both ways. A store's quantized dense
    weights replace their nn.Linear / nn.Embedding with kernels/dense.py modules on `kernel`."""
    ours = checkpoint_renamer(ckpt.args.model_type)
    params = dict(model.named_parameters())
    by_ours = {ours(n): n for n in ckpt.dense_names}
    optional = set()
    if ckpt.args.tie_word_embeddings:
        params.pop("lm_head.weight")
        optional.add("lm_head.weight")
    expected = {n: list(p.shape) for n, p in params.items()}
    # Check names in our naming, report in the checkpoint's.
    present = set(by_ours)
    unknown = sorted(present - set(expected) - optional)
    if unknown:
        raise CheckpointError(
            f"unknown tensor(s) in {ckpt.folder} for model_type {ckpt.args.model_type!r}: "
            f"{', '.join(by_ours[u] for u in unknown[:5])}{' ...' if len(unknown) > 5 else ''}"
        )
    missing = sorted(set(expected) - present)
    if missing:
        raise CheckpointError(
            f"tensor(s) missing from {ckpt.folder}: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}"
        )
    quantized = {}
    with torch.no_grad():
        for name in tqdm(sorted(expected), desc="dense weights", disable=not progress, leave=False):
            theirs = by_ours[name]
            scheme = ckpt.dense_scheme(theirs)
            if scheme is not None:  # only a store's
                shape = ckpt.dense_formats[theirs][1]
                w = QuantWeight(scheme, shape, ckpt.dense_sections(theirs))
                _check_shape(theirs, list(w.shape), params[name])
                quantized[name] = w
                continue
            t = ckpt.tensor(by_ours[name])
            _check_tensor(ckpt, by_ours[name], t, params[name])
            params[name].copy_(t.to(params[name].dtype))
        if ckpt.args.tie_word_embeddings and "model.embed_tokens.weight" not in quantized:
            model.lm_head.weight = model.model.embed_tokens.weight
    if quantized:
        _place_quantized(model, quantized, dtype, kernel)


def _place_quantized(
    model: MoeCausalLM, weights: dict[str, QuantWeight], dtype: torch.dtype, kernel: str
) -> None:
    """Swap each quantized weight's module for its quantized twin (in the form its kernel holds,
    kernels/dense.py: triton_form), then fuse q/k/v again."""
    modules = dict(model.named_modules())
    for name, w in weights.items():
        w = triton_form(w) if kernel == "triton" else w
        path = name.removesuffix(".weight")
        parent, _, child = path.rpartition(".")
        old = modules[path]
        if isinstance(old, nn.Embedding):
            new: nn.Module = QuantEmbedding(w, dtype, kernel)
            if model.args.tie_word_embeddings:  # one quantized table for both ends
                model.lm_head = QuantLinear(w, None, kernel)
        else:
            bias = None if old.bias is None else old.bias.detach()
            # int16 activations for an int8 SwiGLU down projection, as the experts' (native.py)
            new = QuantLinear(w, bias, kernel, wide=child == "down_proj")
        setattr(modules[parent], child, new)
    for m in list(model.modules()):
        if hasattr(m, "fuse_qkv"):
            m.fuse_qkv()
    for m in model.modules():  # once fused: a weight read from its row repack is held once
        if isinstance(m, QuantLinear):
            m.release_sections()


def _check_shape(name: str, shape: list[int], param: torch.Tensor) -> None:
    if shape != list(param.shape):
        raise CheckpointError(f"tensor {name!r} has shape {shape}, expected {list(param.shape)}")


def _check_tensor(ckpt, name: str, t: torch.Tensor, param: torch.Tensor) -> None:
    _check_shape(name, list(t.shape), param)
    # .to() would turn a header relabelled BF16 -> I16 into large integers without a word.
    if param.is_floating_point() and not t.is_floating_point():
        raise CheckpointError(
            f"{ckpt.folder}: tensor {name!r} has dtype {t.dtype}, a float weight needs a float "
            "dtype (its safetensors header is damaged); re-download or convert the model again"
        )


def load_resident_experts(
    ckpt: HFCheckpoint, dtype: torch.dtype, progress: bool = False
) -> ResidentExperts:
    a = ckpt.args
    w13, w2 = {}, {}
    b13, b2 = ({}, {}) if a.expert_bias else (None, None)
    layers = a.moe_layer_ids
    bar = tqdm(total=len(layers) * a.num_experts, desc="experts", disable=not progress, leave=False)
    for layer in layers:
        E, I, D = a.num_experts, a.moe_intermediate_size, a.hidden_size
        w13[layer] = torch.empty(E, 2 * I, D, dtype=dtype)
        w2[layer] = torch.empty(E, D, I, dtype=dtype)
        if b13 is not None:
            b13[layer] = torch.empty(E, 2 * I, dtype=dtype)
            b2[layer] = torch.empty(E, D, dtype=dtype)
        for e in range(E):
            gate, up, down = ckpt.expert(layer, e)
            w13[layer][e, :I].copy_(gate)
            w13[layer][e, I:].copy_(up)
            w2[layer][e].copy_(down)
            if b13 is not None:
                b_gate, b_up, b_down = ckpt.expert_biases(layer, e)
                b13[layer][e].copy_(torch.cat([b_gate, b_up]))
                b2[layer][e].copy_(b_down)
            bar.update()
    bar.close()
    return ResidentExperts(w13, w2, b13, b2, ExpertActivation.from_args(a))


@dataclass
class Loaded:
    args: ModelArgs
    model: MoeCausalLM
    provider: ExpertProvider
    folder: Path


def load_model(
    folder: str | Path,
    experts: ExpertsConfig | None = None,
    *,
    dtype: str | torch.dtype = "float32",
    progress: bool = False,
) -> Loaded:
    """A runnable model from a folder. A store opens with `experts` (default: every expert
    resident in RAM); a Hugging Face folder loads resident and takes no experts config (the
    runtime converts it to a store first)."""
    folder = Path(folder)
    dtype = resolve_dtype(dtype)
    if is_store(folder):
        return _load_store(folder, experts or StreamConfig(resident=True), dtype, progress)
    if experts is not None:
        raise ConfigError(f"{folder} is a Hugging Face folder: convert it to a store to stream it")
    ckpt = HFCheckpoint(folder)
    model = build_model(ckpt.args, dtype)
    load_dense(ckpt, model, dtype, progress)
    provider = load_resident_experts(ckpt, dtype, progress)
    model.set_provider(provider)
    return Loaded(ckpt.args, model, provider, folder)


def _load_store(folder: Path, cfg: ExpertsConfig, dtype: torch.dtype, progress: bool) -> Loaded:
    store = Store(folder)
    slot_count(store, cfg)  # a budget too small fails here, from the manifest alone
    if isinstance(cfg, GpuConfig):  # so does a scheme the GPU kernels do not read
        from moestream.experts.gpu import check_scheme

        check_scheme(store)
    model = build_model(store.args, dtype)
    # GpuConfig's kernel ("triton" or "ref") is the dense layers' too (kernels/dense.py)
    load_dense(store, model, dtype, progress, cfg.kernel)
    store.release_dense()
    # The native kernels' run also takes the fused one-token ops for its dense math (fp32 CPU).
    model.set_fused_decode(
        isinstance(cfg, StreamConfig) and cfg.kernel == "native" and dtype == torch.float32
    )
    if isinstance(cfg, GpuConfig):
        from moestream.experts.gpu import GpuExperts

        model = model.to(cfg.device)
        model.set_gpu_decode(cfg.kernel == "triton" and torch.device(cfg.device).type == "cuda")
        provider: ExpertProvider = GpuExperts(store, cfg)
    elif cfg.mmap:
        from moestream.experts.mmap import MmapExperts

        provider = MmapExperts(store, cfg)
    else:
        from moestream.experts.streaming import StreamingExperts

        provider = StreamingExperts(store, cfg)
    if isinstance(cfg, StreamConfig) and cfg.shard is not None:
        from moestream.experts.parallel import ExpertParallel

        provider = ExpertParallel(provider, cfg.shard)
    model.set_provider(provider)
    return Loaded(store.args, model, provider, folder)
