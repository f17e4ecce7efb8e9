"""Strict reading of a Hugging Face checkpoint folder: config, (sharded) safetensors, expert layouts.

Every tensor in the folder is classified as a dense weight, an expert weight or explicitly ignored;
anything else is an error that names it. Expert tensors are read lazily, one expert at a time, so a
converter never holds more than a few experts. FP8 weights (`*.weight_scale_inv` block scales) are
dequantized as they are read, and so are gpt_oss's MXFP4 experts (`*_blocks` + `*_scales`);
multi-token-prediction layers past the last layer are ignored.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from moestream.config import ModelArgs
from moestream.convert.fp8 import Fp8Error, dequantize_fp8, fp8_block_size
from moestream.convert.mxfp4 import Mxfp4Error, dequantize_mxfp4
from moestream.errors import CheckpointError
from moestream.models import load_model_args, model_module

# Per-expert layouts: Qwen/OLMoE `mlp.experts.{e}.gate_proj`, Mixtral `block_sparse_moe.experts.{e}.w1`,
# LFM2 `feed_forward.experts.{e}.w1`.
# Multimodal checkpoints (Qwen3.5) prefix the language model's layers with `model.language_model.`.
_PER_EXPERT = re.compile(
    r"^model\.(?:language_model\.)?layers\.(\d+)\.(?:mlp|block_sparse_moe|feed_forward)\.experts\.(\d+)\."
    r"(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$"
)
# Fused layout written by transformers 5 (`save_original_format=False`) and some hub models.
_FUSED = re.compile(
    r"^model\.(?:language_model\.)?layers\.(\d+)\.(?:mlp|feed_forward)\.experts\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?(?:\.weight)?$"
)
_ROLE = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
# gpt_oss stores fused experts as [E, in, out] (x @ W) with gate/up interleaved along out
# (gate = [..., ::2], up = [..., 1::2]), biases `*_bias`, and on the hub as MXFP4
# `*_blocks` [E, out, in/32, 16] + `*_scales` [E, out, in/32]; it has no per-expert layout.
_INTERLEAVED = ("gpt_oss",)
# Buffers some exporters save that carry no learned state.
_IGNORED = re.compile(r"(\.rotary_emb\.inv_freq$)")
_LAYER = re.compile(r"^model\.(?:language_model\.)?layers\.(\d+)\.")
# FP8 block scales: `X.weight_scale_inv` (or `X_scale_inv` for fused experts) belongs to `X(.weight)`.
_SCALE_INV = "_scale_inv"


def _shard_header(path: Path) -> dict:
    """Parse a safetensors header and check the file holds every byte it promises."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointError(
                f"{path}: file is truncated (no safetensors header); re-download it"
            )
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8:
            raise CheckpointError(
                f"{path}: header length {n} exceeds the file size; the file is corrupt"
            )
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(
                f"{path}: safetensors header is not valid JSON ({e}); re-download it"
            ) from e
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end > size:
        raise CheckpointError(
            f"{path}: file is truncated ({size} bytes, tensors need {8 + n + end}); re-download it"
        )
    header.pop("__metadata__", None)
    return header


_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass(frozen=True, slots=True)
class ExpertRef:
    """Where one expert's gate/up/down live: per-expert tensor names or slices of fused tensors."""

    layer: int
    expert: int
    fused: bool
    gate: str  # tensor name (fused: the gate_up_proj tensor)
    up: str
    down: str
    interleaved: bool = False  # gpt_oss layout (see _INTERLEAVED); names may be MXFP4 `*_blocks`
    gate_up_bias: str | None = None
    down_bias: str | None = None


class HFCheckpoint:
    """A Hugging Face folder: `args`, dense tensor names, expert refs; tensors read on demand."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise CheckpointError(f"{self.folder}: no such folder")
        self.args: ModelArgs = load_model_args(self.folder)
        self.config = json.loads((self.folder / "config.json").read_text())
        self._shard_of: dict[str, Path] = {}
        self._shapes: dict[str, list[int]] = {}
        self._handles: dict[Path, object] = {}
        self._index_shards()
        self.dense_names: list[str] = []
        self.experts: dict[tuple[int, int], ExpertRef] = {}
        self.ignored: list[str] = []
        self._scale_of: dict[str, str] = {}  # FP8 weight name -> its scale_inv tensor
        self._fp8_block: tuple[int, int] | None = None
        self._classify()

    # ---- files -------------------------------------------------------------------------------
    def _index_shards(self) -> None:
        index = self.folder / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from e
            shards = sorted(set(weight_map.values()))
            missing = [s for s in shards if not (self.folder / s).is_file()]
            if missing:
                raise CheckpointError(
                    f"{self.folder}: shard(s) listed in model.safetensors.index.json are missing: "
                    f"{', '.join(missing)}; download them again"
                )
        else:
            shards = sorted(p.name for p in self.folder.glob("*.safetensors"))
            if not shards:
                raise CheckpointError(
                    f"{self.folder}: no *.safetensors files (PyTorch .bin checkpoints are not supported; "
                    "convert them with transformers' save_pretrained)"
                )
            weight_map = None
        for shard in shards:
            path = self.folder / shard
            for name, info in _shard_header(path).items():
                if weight_map is not None and weight_map.get(name) != shard:
                    raise CheckpointError(
                        f"{path}: holds tensor {name!r} that the index assigns to "
                        f"{weight_map.get(name, 'no shard')}; the index and shards disagree"
                    )
                if name in self._shard_of:
                    raise CheckpointError(f"tensor {name!r} appears in two shards")
                self._shard_of[name] = path
                self._shapes[name] = info["shape"]
        if weight_map is not None:
            absent = [n for n in weight_map if n not in self._shard_of]
            if absent:
                raise CheckpointError(
                    f"tensor(s) listed in the index are missing from their shard: {', '.join(absent[:5])}"
                )

    def _handle(self, path: Path):
        h = self._handles.get(path)
        if h is None:
            h = self._handles[path] = safe_open(str(path), framework="pt")
        return h

    def dense_scheme(self, name: str) -> None:
        """A checkpoint's dense weights are float (only a store holds quantized ones)."""
        return None

    def tensor(self, name: str) -> torch.Tensor:
        """A tensor as stored, except FP8 weights, which come back dequantized to fp32."""
        if name not in self._shard_of:
            raise CheckpointError(f"{self.folder}: tensor {name!r} not found")
        t = self._handle(self._shard_of[name]).get_tensor(name)
        scale = self._scale_of.get(name)
        if scale is None:
            return self._not_fp8(name, t)
        return self._dequantize(name, t, self._handle(self._shard_of[scale]).get_tensor(scale))

    @staticmethod
    def _not_fp8(name: str, t: torch.Tensor) -> torch.Tensor:
        # An FP8 tensor without its scale would load off by the scale factor, silently.
        if t.dtype in _FP8:
            raise CheckpointError(f"tensor {name!r} is FP8 but has no {name}_scale_inv")
        # A header relabelled to a same-size integer dtype would load as garbage numbers.
        if not t.is_floating_point():
            raise CheckpointError(
                f"tensor {name!r} has dtype {t.dtype}, but weights are floating point: the "
                "safetensors header is damaged or the format is not one moestream reads; "
                "re-download the checkpoint"
            )
        return t

    def _dequantize(self, name: str, t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        if t.dtype not in _FP8:
            raise CheckpointError(
                f"tensor {name!r} has a scale_inv but dtype {t.dtype}, not FP8; re-download it"
            )
        try:
            return dequantize_fp8(t, scale, self._fp8_block)
        except Fp8Error as e:
            raise CheckpointError(f"tensor {name!r}: {e}") from e

    def shape(self, name: str) -> list[int]:
        return self._shapes[name]

    def _slice(self, name: str, index: int) -> torch.Tensor:
        t = self._handle(self._shard_of[name]).get_slice(name)[index]
        scale = self._scale_of.get(name)
        if scale is None:
            return self._not_fp8(name, t)
        return self._dequantize(
            name, t, self._handle(self._shard_of[scale]).get_slice(scale)[index]
        )

    # ---- classification ----------------------------------------------------------------------
    def _classify(self) -> None:
        a = self.args
        per: dict[tuple[int, int], dict[str, str]] = {}
        fused: dict[int, dict[str, str]] = {}
        self._pair_fp8_scales()
        # Tensors a model file declares unused (e.g. a vision tower, separate MTP heads).
        skip = [re.compile(p) for p in getattr(model_module(a.model_type), "IGNORED", ())]
        for name in self._shard_of:
            if self._is_mtp(name) or any(p.search(name) for p in skip):
                self.ignored.append(name)
            elif name.endswith(_SCALE_INV):
                continue  # paired with its weight by _pair_fp8_scales
            elif m := _PER_EXPERT.match(name):
                layer, e, role = int(m[1]), int(m[2]), _ROLE.get(m[3], m[3])
                per.setdefault((layer, e), {})[role] = name
            elif m := _FUSED.match(name):
                fused.setdefault(int(m[1]), {})[m[2] + (m[3] or "")] = name
            elif _IGNORED.search(name):
                self.ignored.append(name)
            else:
                self.dense_names.append(name)
        for layer in a.moe_layer_ids:
            if layer in fused and a.model_type in _INTERLEAVED:
                self._interleaved_experts(layer, fused[layer])
            elif layer in fused:
                f = fused[layer]
                for key in ("gate_up_proj", "down_proj"):
                    if key not in f:
                        raise CheckpointError(
                            f"layer {layer}: fused experts tensor '{key}' is missing"
                        )
                E, I, D = a.num_experts, a.moe_intermediate_size, a.hidden_size
                self._check_shape(f["gate_up_proj"], [E, 2 * I, D])
                self._check_shape(f["down_proj"], [E, D, I])
                for e in range(E):
                    self.experts[(layer, e)] = ExpertRef(
                        layer, e, True, f["gate_up_proj"], f["gate_up_proj"], f["down_proj"]
                    )
            for e in range(a.num_experts):
                roles = per.pop((layer, e), None)
                if roles is None:
                    if (layer, e) not in self.experts:
                        raise CheckpointError(
                            f"layer {layer} expert {e}: no weights found (neither per-expert "
                            f"'model.layers.{layer}.mlp.experts.{e}.*' nor fused 'experts.gate_up_proj')"
                        )
                    continue
                if (layer, e) in self.experts:
                    raise CheckpointError(
                        f"layer {layer} expert {e}: stored both per-expert and fused"
                    )
                lost = [r for r in ("gate_proj", "up_proj", "down_proj") if r not in roles]
                if lost:
                    raise CheckpointError(f"layer {layer} expert {e}: missing {', '.join(lost)}")
                I, D = a.moe_intermediate_size, a.hidden_size
                self._check_shape(roles["gate_proj"], [I, D])
                self._check_shape(roles["up_proj"], [I, D])
                self._check_shape(roles["down_proj"], [D, I])
                self.experts[(layer, e)] = ExpertRef(
                    layer, e, False, roles["gate_proj"], roles["up_proj"], roles["down_proj"]
                )
        stray = [n for roles in per.values() for n in roles.values()]
        stray += [
            n for layer, f in fused.items() if layer not in a.moe_layer_ids for n in f.values()
        ]
        if stray:
            raise CheckpointError(
                f"unexpected expert tensor(s) for a layer/expert the config does not have: {', '.join(sorted(stray)[:5])}"
            )

    def _interleaved_experts(self, layer: int, f: dict[str, str]) -> None:
        """gpt_oss: gate_up_proj [E, D, 2I] + down_proj [E, I, D] (or their MXFP4 blocks/scales)
        and the biases gate_up_proj_bias [E, 2I], down_proj_bias [E, D]."""
        E, I, D = self.args.num_experts, self.args.moe_intermediate_size, self.args.hidden_size
        names = {}
        for key, (n_out, n_in) in (("gate_up_proj", (2 * I, D)), ("down_proj", (D, I))):
            if key in f:
                self._check_shape(f[key], [E, n_in, n_out])
                names[key] = f[key]
            elif f"{key}_blocks" in f and f"{key}_scales" in f:
                self._check_shape(f[f"{key}_blocks"], [E, n_out, n_in // 32, 16])
                self._check_shape(f[f"{key}_scales"], [E, n_out, n_in // 32])
                names[key] = f[f"{key}_blocks"]
            else:
                raise CheckpointError(
                    f"layer {layer}: fused experts tensor '{key}' (or '{key}_blocks' + "
                    f"'{key}_scales') is missing"
                )
            if f"{key}_bias" not in f:
                raise CheckpointError(f"layer {layer}: experts tensor '{key}_bias' is missing")
            self._check_shape(f[f"{key}_bias"], [E, n_out])
        for e in range(E):
            self.experts[(layer, e)] = ExpertRef(
                layer,
                e,
                True,
                names["gate_up_proj"],
                names["gate_up_proj"],
                names["down_proj"],
                interleaved=True,
                gate_up_bias=f["gate_up_proj_bias"],
                down_bias=f["down_proj_bias"],
            )

    def _is_mtp(self, name: str) -> bool:
        """Multi-token-prediction layers (GLM-4.5 / DeepSeek-V3 store them as the layers after the
        last one): the engine decodes one token per step and does not use them."""
        m = _LAYER.match(name)
        n = self.args.num_hidden_layers
        return m is not None and n <= int(m[1]) < n + self.args.num_mtp_layers

    def _pair_fp8_scales(self) -> None:
        scales = [n for n in self._shard_of if n.endswith(_SCALE_INV) and not self._is_mtp(n)]
        if not scales:
            return
        try:
            self._fp8_block = fp8_block_size(self.config)
        except Fp8Error as e:
            raise CheckpointError(f"{self.folder}: {e}") from e
        for scale in scales:
            weight = scale[: -len(_SCALE_INV)]
            if weight not in self._shard_of:
                raise CheckpointError(f"scale tensor {scale!r} has no weight {weight!r} to scale")
            self._scale_of[weight] = scale

    def _check_shape(self, name: str, want: list[int]) -> None:
        got = self._shapes[name]
        if list(got) != want:
            raise CheckpointError(f"tensor {name!r} has shape {got}, config.json implies {want}")

    def expert(self, layer: int, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(gate [I, D], up [I, D], down [D, I]) of one expert, reading only its bytes."""
        ref = self.experts[(layer, e)]
        if ref.interleaved:
            gate_up = self._out_in(ref.gate, e)  # [2I, D], gate and up rows interleaved
            return gate_up[0::2], gate_up[1::2], self._out_in(ref.down, e)
        if ref.fused:
            gate_up = self._slice(ref.gate, e)  # [2I, D]
            I = gate_up.shape[0] // 2
            return gate_up[:I], gate_up[I:], self._slice(ref.down, e)
        return self.tensor(ref.gate), self.tensor(ref.up), self.tensor(ref.down)

    def expert_biases(
        self, layer: int, e: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(gate [I], up [I], down [D]) biases of one expert, or None when experts have none."""
        ref = self.experts[(layer, e)]
        if ref.gate_up_bias is None:
            return None
        gate_up = self._slice(ref.gate_up_bias, e)  # [2I], interleaved like the weight
        return gate_up[0::2], gate_up[1::2], self._slice(ref.down_bias, e)

    def _out_in(self, name: str, e: int) -> torch.Tensor:
        """Expert e of a gpt_oss fused tensor as [out, in]: MXFP4 blocks are stored [out, in/32,
        16] and dequantized; plain tensors are stored [in, out] and transposed."""
        if not name.endswith("_blocks"):
            return self._slice(name, e).t()
        scale_name = name[: -len("_blocks")] + "_scales"
        blocks = self._handle(self._shard_of[name]).get_slice(name)[e]  # [out, in/32, 16]
        scales = self._handle(self._shard_of[scale_name]).get_slice(scale_name)[e]
        try:
            return dequantize_mxfp4(blocks, scales)
        except Mxfp4Error as err:
            raise CheckpointError(f"tensor {name!r}: {err}") from err
