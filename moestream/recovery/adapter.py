"""The recovery adapter (Edge0 stages 2-3): unmerged LoRA deltas on the attention projections
(q/k/v/o_proj of every `Attention`) and the shared-expert projections (gate/up/down_proj of a
MoE block's shared expert(s)); never on the streamed experts, whose bytes stay as stored.

File `recovery.lora` beside the model or store (safetensors bytes, not *.safetensors: checkpoint
loaders scan those), found like the prerouter heads. Tensors `<target>.A` [r, in] and
`<target>.B` [out, r] (fp32); metadata `moestream_lora` = JSON {format, rank, alpha, targets,
base, heads}: `base` is `base_fingerprint` of the model it was trained on, `heads` the sha256 of
the prerouter heads file it was trained with (recorded, not enforced: retrained heads still run).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from moestream.errors import CheckpointError
from moestream.models.layers import MLP, Attention
from moestream.models.lowrank import LowRank

ADAPTER_FILE = "recovery.lora"
FORMAT = 1
META_KEY = "moestream_lora"


class AdapterError(CheckpointError):
    """A recovery adapter file that is missing, unreadable or made for another model."""


@dataclass(frozen=True, slots=True)
class AdapterInfo:
    path: Path | None  # None: made in memory (training)
    rank: int
    alpha: float
    targets: tuple[str, ...]
    base: str
    heads: str | None = None

    def describe(self) -> dict:
        return {"path": None if self.path is None else str(self.path), "rank": self.rank,
                "alpha": self.alpha, "targets": len(self.targets)}  # fmt: skip


def lora_sites(model) -> dict[str, tuple[nn.Module, str]]:
    """Every projection an adapter may target: its full name -> (owner module, projection name).
    Owners are the attention layers and the MoE blocks' shared experts (ours and HF's names)."""
    shared = set()
    for block in model.moe_blocks:
        for name in ("shared_expert", "shared_experts"):
            m = getattr(block, name, None)
            if isinstance(m, MLP):
                shared.add(id(m))
    sites = {}
    for name, m in model.named_modules():
        if isinstance(m, Attention) or id(m) in shared:
            for proj in m.LORA_TARGETS:
                sites[f"{name}.{proj}"] = (m, proj)
    return sites


def _dims(owner: nn.Module, proj: str) -> tuple[int, int]:
    p = getattr(owner, proj)
    return p.in_features, p.out_features


def base_fingerprint(model) -> str:
    """sha256 of the model's shape and its routers' weights (fp32). Routers are never quantized,
    so a Hugging Face folder and every store converted from it share this, on any clone (file
    dates play no part), while another checkpoint of the same shape does not."""
    a = model.args
    h = hashlib.sha256(
        f"{a.model_type}:{a.num_hidden_layers}:{a.hidden_size}:{a.num_experts}".encode()
    )
    for block in model.moe_blocks:
        h.update(block.gate.weight.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def file_sha256(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def add_adapter(
    model, rank: int, alpha: float, targets: list[str] | None = None, seed: int = 0
) -> AdapterInfo:
    """Fresh adapters on `targets` (default: every site), A as PEFT initialises it (Kaiming
    uniform), B zero: the delta starts at 0, so training starts from the unadapted model. Drawn
    on the CPU and moved to the model's device: the same start on every device."""
    sites = lora_sites(model)
    names = sorted(sites) if targets is None else list(targets)
    unknown = [n for n in names if n not in sites]
    if unknown:
        raise AdapterError(f"no adapter site {unknown[0]!r} in this model")
    g = torch.Generator().manual_seed(seed)
    for n in names:
        owner, proj = sites[n]
        lr = LowRank(*_dims(owner, proj), rank, alpha)
        bound = 1.0 / lr.A.shape[1] ** 0.5  # kaiming_uniform_(a=sqrt(5)) on [r, in]
        with torch.no_grad():
            lr.A.uniform_(-bound, bound, generator=g)
        owner.lora[proj] = lr.to(model.device)
    model.modules_changed()
    return AdapterInfo(None, rank, float(alpha), tuple(names), base_fingerprint(model))


def remove_adapter(model) -> None:
    for owner, _ in lora_sites(model).values():
        owner.lora.clear()
    model.modules_changed()


def adapter_modules(model) -> dict[str, LowRank]:
    """The attached adapters by target name."""
    return {n: o.lora[p] for n, (o, p) in lora_sites(model).items() if p in o.lora}


def save_adapter(model, info: AdapterInfo, path: str | Path) -> Path:
    from safetensors.torch import save_file

    mods = adapter_modules(model)
    sd = {}
    for n, m in mods.items():
        sd[f"{n}.A"] = m.A.detach().float().cpu().contiguous()
        sd[f"{n}.B"] = m.B.detach().float().cpu().contiguous()
    meta = {"format": FORMAT, "rank": info.rank, "alpha": info.alpha,
            "targets": sorted(mods), "base": info.base, "heads": info.heads}  # fmt: skip
    save_file(sd, str(path), metadata={META_KEY: json.dumps(meta)})
    return Path(path)


def _read(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    from safetensors import safe_open

    fix = "train it again with `moestream train-recovery` or pass --no-lora"
    if not path.is_file():
        raise AdapterError(f"recovery adapter {path} does not exist; {fix}")
    try:
        with safe_open(str(path), "pt") as f:
            meta = json.loads((f.metadata() or {})[META_KEY])
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # a truncated or foreign file: any parse failure means "unreadable"
        raise AdapterError(
            f"recovery adapter {path} is not a readable adapter file ({type(e).__name__}: {e}); "
            f"{fix}"
        ) from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise AdapterError(
            f"recovery adapter {path} has format {meta.get('format') if isinstance(meta, dict) else meta!r}, "
            f"this moestream reads format {FORMAT}; {fix}"
        )
    return meta, tensors


def load_adapter(model, path: str | Path) -> AdapterInfo:
    """Attach the adapter in `path` to `model`; everything checked before anything is attached."""
    path = Path(path)
    meta, tensors = _read(path)
    fix = "train one for this model with `moestream train-recovery` or pass --no-lora"
    if meta.get("base") != base_fingerprint(model):
        raise AdapterError(
            f"recovery adapter {path} was trained for another model (base fingerprint "
            f"{str(meta.get('base'))[:12]}..., this model's {base_fingerprint(model)[:12]}...); "
            f"{fix}"
        )
    sites, rank, alpha = lora_sites(model), int(meta["rank"]), float(meta["alpha"])
    for n in meta["targets"]:
        if n not in sites:
            raise AdapterError(f"recovery adapter {path} targets {n!r}, not in this model; {fix}")
        n_in, n_out = _dims(*sites[n])
        a, b = tensors.get(f"{n}.A"), tensors.get(f"{n}.B")
        if a is None or b is None or a.shape != (rank, n_in) or b.shape != (n_out, rank):
            raise AdapterError(
                f"recovery adapter {path}: tensors of {n!r} are missing or not [{rank}, {n_in}] "
                f"and [{n_out}, {rank}]; {fix}"
            )
    for n in meta["targets"]:
        owner, proj = sites[n]
        lr = LowRank(*_dims(owner, proj), rank, alpha).to(model.device)
        with torch.no_grad():
            lr.A.copy_(tensors[f"{n}.A"])
            lr.B.copy_(tensors[f"{n}.B"])
        lr.requires_grad_(False)
        owner.lora[proj] = lr
    model.modules_changed()
    return AdapterInfo(path, rank, alpha, tuple(meta["targets"]), meta["base"], meta.get("heads"))


def find_adapter(*folders: str | Path) -> Path | None:
    """The first recovery.lora among the folders (the -m folder, the store, the store's source)."""
    for folder in folders:
        p = Path(folder) / ADAPTER_FILE
        if p.is_file():
            return p
    return None
