"""GGUF files (llama.cpp's format, as downloaded) as a checkpoint the store writer reads.

`GGUFCheckpoint` gives the writer what `HFCheckpoint` gives it: `args`, `dense_names` (in Hugging
Face naming), `tensor(name)`, `expert(layer, e)`, plus the files a store needs (config.json,
tokenizer.json, tokenizer_config.json) built from the metadata. Its parts: `gguf_file` (the file
or split set, the reader), `gguf_arch` (which llama.cpp architecture runs as which model file,
llama.cpp's tensor names, the metadata as a Hugging Face config dict: `GgufHeader`),
`gguf_blocks` (block types a store scheme holds exactly, split into its sections),
`gguf_inverse` (the converter's tensor rewrites undone: deepseek2's split kv_b, qwen35moe's
shifted norms, A = -exp(A_log) and tiled value heads), `gguf_vocab` (the tokenizer).

Here: each tensor classified by name (an unknown one refused), read in Hugging Face's shape and
row order; fused tensors (`attn_qkv`, `ffn_gate_up_exps`) as their parts, row ranges of the one
tensor; gpt-oss's expert biases (`ffn_*_exps.bias`) into the records' b13 / b2. Blocks a store
scheme holds exactly (Q8_0 -> int8, Q4_0 -> q4_0, Q4_1 -> q4_1, Q5_0 -> q5_0, Q4_K / Q5_K / Q6_K -> q4_k /
q5_k / q6_k, MXFP4 -> mxfp4; `--quant int8`: MXFP4 -> int8, its values rewritten exactly; a dense
MXFP4 tensor: int8, which the dense kernels read) are copied byte for byte, experts
(`expert_sections`) and dense weights (`dense_sections`) alike; under `ExpertQuant.keep_source`
each expert projection keeps its own type (`record_layouts`: per layer, w13's and w2's scheme),
so mixed files (Q4_K_M) stay exact. Other expert types are dequantized and requantized, and
`conversion_notes` says so per type; other dense types are dequantized (F32/F16/BF16 kept as
they are)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from moestream.config import ConfigError, ModelArgs
from moestream.convert.gguf_arch import (
    BLK,
    BLOCK_NAMES,
    EXPERT_BIASES,
    EXPERT_NAMES,
    GATE_UP,
    GLOBAL_NAMES,
    QKV,
    SECOND_HALF,
    SHARED_NAMES,
    GgufHeader,
    fused_gate_up,
)
from moestream.convert.gguf_blocks import (
    DENSE_EXACT,
    EXACT,
    GGUF_FLOAT_TYPES,
    HELD_BY,
    INT_TYPES,
    is_exact,
    requant_cost_note,
    sections,
)
from moestream.convert.gguf_file import gguf_fingerprint, is_gguf, open_parts
from moestream.convert.gguf_inverse import kv_b, qwen35_order, qwen35_values
from moestream.errors import CheckpointError
from moestream.models import model_args_from_dict
from moestream.quant import ExpertQuant, QuantScheme, RecordLayout, make_scheme, quantize

# the package's names, imported from here by the writer, the runtime and the benchmarks
__all__ = ["GGUF_FLOAT_TYPES", "GGUFCheckpoint", "gguf_fingerprint", "is_gguf"]

# Sources of at least 8 bits per weight default to int8 experts, lower ones to int4.
_INT8_BITS = 8.0


class GGUFCheckpoint:
    """A GGUF file (or split set): `args`, `config`, dense names, expert tensors on demand."""

    def __init__(self, path: str | Path):
        import gguf

        self._gguf = gguf
        self.folder = Path(path)  # named `folder` as HFCheckpoint's, for the writer's messages
        self.files, readers, self.meta = open_parts(self.folder)
        self._tensors = {t.name: t for r in readers for t in r.tensors}
        self.header = GgufHeader(self.folder, self.meta, self._tensors)
        self.arch, self.arch_name = self.header.arch, self.header.arch_name
        self.n_layers = self.header.n_layers
        self.dense_names: list[str] = []
        self._dense_src: dict[str, str] = {}  # HF name -> GGUF name
        self._experts: dict[int, dict[str, str]] = {}  # layer -> gate/up/down -> GGUF name
        self._qkv_part: dict[str, int] = {}  # HF q/k/v name -> 0/1/2 of its fused attn_qkv
        self._expert_biases: dict[int, dict[str, str]] = {}  # the same, of their biases
        self._classify()
        self._check_types()
        bias = any(n.endswith("self_attn.q_proj.bias") for n in self.dense_names)
        self.config = self.header.hf_config(self._experts, bias)
        try:
            self.args: ModelArgs = model_args_from_dict(self.config, str(self.folder))
        except ConfigError as e:
            raise CheckpointError(f"{self.folder}: {e}") from e
        self._check_experts()
        self._check_qkv()
        from moestream.convert.gguf_vocab import build_tokenizer

        self.tokenizer_json, self.tokenizer_config = build_tokenizer(
            self.meta, self.args.vocab_size, str(self.folder)
        )

    # ---- tensors ------------------------------------------------------------------------------
    def _classify(self) -> None:
        """Each tensor by its llama.cpp name -> a dense Hugging Face name, or an expert tensor of a
        layer and role; an unknown name is refused. The MTP layers (`GgufHeader.mtp_layers`)
        after the trunk are skipped."""
        own = dict(self.arch.names)
        for name in self._tensors:
            if name in GLOBAL_NAMES or name in own:  # own: only the final norm is not in a block
                self._add_dense(own.get(name) or GLOBAL_NAMES[name], name)
                continue
            m = BLK.match(name)
            if m and int(m[1]) >= self.n_layers and self.header.mtp_layers:
                continue
            if m and m[2] in EXPERT_NAMES:
                self._experts.setdefault(int(m[1]), {})[EXPERT_NAMES[m[2]]] = name
            elif m and m[2] == GATE_UP:
                self._experts.setdefault(int(m[1]), {}).update(gate=name, up=name)
            elif m and m[2] in QKV and f"blk.{m[1]}.ssm_out.weight" not in self._tensors:
                # (qwen35moe's Gated DeltaNet layers name their in_proj_qkv attn_qkv: own names)
                for k, proj in enumerate(("q_proj", "k_proj", "v_proj")):
                    hf = f"model.layers.{m[1]}.self_attn.{proj}.{QKV[m[2]]}"
                    self._add_dense(hf, name)
                    self._qkv_part[hf] = k
            elif m and m[2] in EXPERT_BIASES and self.arch.model_type == "gpt_oss":
                self._expert_biases.setdefault(int(m[1]), {})[EXPERT_BIASES[m[2]]] = name
            elif m and m[2] in SECOND_HALF:
                continue  # read by tensor() with its first half
            elif m and m[2] in own:
                self._add_dense(f"model.layers.{m[1]}.{own[m[2]]}", name)
            elif m and m[2] in BLOCK_NAMES:
                self._add_dense(f"model.layers.{m[1]}.{BLOCK_NAMES[m[2]]}", name)
            elif m and m[2] in SHARED_NAMES:
                self._add_dense(
                    f"model.layers.{m[1]}.{self.arch.shared}.{SHARED_NAMES[m[2]]}", name
                )
            else:
                raise CheckpointError(
                    f"{self.folder}: tensor {name!r} is not one moestream maps for GGUF "
                    f"architecture {self.arch_name!r}"
                )
        self._check_halves()
        self._check_per_layer()
        if "token_embd.weight" not in self._tensors:
            raise CheckpointError(f"{self.folder}: tensor 'token_embd.weight' is missing")
        if not self._experts:
            raise CheckpointError(
                f"{self.folder}: no expert tensors (blk.N.ffn_gate_exps): not a MoE model"
            )

    def _check_per_layer(self) -> None:
        """Every MoE layer holds the block tensors its architecture needs (`GgufArch.per_layer`)."""
        for layer in sorted(self._experts):
            for part in self.arch.per_layer:
                if f"blk.{layer}.{part}" not in self._tensors:
                    raise CheckpointError(
                        f"{self.folder}: tensor 'blk.{layer}.{part}' is missing ({self.arch_name} "
                        "layers need it); the file is incomplete: convert it again"
                    )

    def _check_halves(self) -> None:
        """Each half of a split tensor (deepseek2's attn_k_b / attn_v_b) has the other beside it."""
        for second, first in SECOND_HALF.items():
            for name in self._tensors:
                m = BLK.match(name)
                if m is None or int(m[1]) >= self.n_layers or m[2] not in (first, second):
                    continue
                other = f"blk.{m[1]}.{second if m[2] == first else first}"
                if other not in self._tensors:
                    raise CheckpointError(
                        f"{self.folder}: tensor {name!r} has no {other!r} beside it (llama.cpp "
                        "writes both halves of kv_b_proj); the file is incomplete: convert again"
                    )

    def _add_dense(self, hf: str, src: str) -> None:
        if hf in self._dense_src:
            raise CheckpointError(
                f"{self.folder}: tensors {self._dense_src[hf]!r} and {src!r} both hold {hf!r}; "
                "the file mixes two converter versions: convert the model again"
            )
        self.dense_names.append(hf)
        self._dense_src[hf] = src

    def _check_types(self) -> None:
        """Refuse, before anything is written, a tensor type numpy cannot dequantize."""
        seen: dict[str, bool] = {}
        for t in self._tensors.values():
            tname = t.tensor_type.name
            if tname not in seen:
                seen[tname] = self._dequantizable(t)
            if not seen[tname]:
                raise CheckpointError(
                    f"{self.folder}: tensor {t.name!r} has type {tname}, which moestream cannot "
                    "read (no dequantizer); requantize the model with llama-quantize to a "
                    "supported type (Q8_0, Q4_K, Q6_K, ...)"
                )

    def _dequantizable(self, t) -> bool:
        if t.tensor_type.name in GGUF_FLOAT_TYPES:
            return True
        if t.tensor_type.name in INT_TYPES:
            return False  # integer tensors are no weights
        try:
            self._gguf.quants.dequantize(t.data.reshape(-1, t.data.shape[-1])[:1], t.tensor_type)
        except NotImplementedError:
            return False
        return True

    def _check_experts(self) -> None:
        a = self.args
        D, I, E = a.hidden_size, a.moe_intermediate_size, a.num_experts
        want = {"gate": [D, I, E], "up": [D, I, E], "down": [I, D, E]}
        for layer in range(a.num_hidden_layers):
            roles = self._experts.get(layer)
            if roles is None:
                continue
            for role, shape in want.items():
                name = roles.get(role)
                if fused_gate_up(self._experts[layer]) and role != "down":
                    shape = [D, 2 * I, E]  # gate rows then up rows
                if name is None:
                    raise CheckpointError(
                        f"{self.folder}: layer {layer}: tensor 'blk.{layer}.ffn_{role}_exps.weight' "
                        "is missing"
                    )
                self._check_shape(name, shape)
        for roles in self._expert_biases.values():  # ne [I, E] (gate, up), [D, E]
            for role, name in roles.items():
                self._check_shape(name, [D if role == "down" else I, E])

    def _qkv_rows(self) -> tuple[int, int]:
        """Rows of q and of k (= v) in a fused attn_qkv (qwen35moe's q holds its output gate)."""
        a = self.args
        gated = 2 if self.arch_name == "qwen35moe" else 1
        return gated * a.num_attention_heads * a.head_dim, a.num_key_value_heads * a.head_dim

    def _check_qkv(self) -> None:
        q, kv = self._qkv_rows()
        fused = {self._dense_src[hf] for hf in self._qkv_part}
        for name in sorted(fused, key=lambda n: int(n.split(".")[1])):
            rows = int(self._tensors[name].shape[-1])
            if rows != q + 2 * kv:
                raise CheckpointError(
                    f"{self.folder}: tensor {name!r} has {rows} rows, but q, k and v of "
                    f"{self.arch_name}.attention.head_count / head_count_kv / key_length need "
                    f"{q} + {kv} + {kv}; the file is damaged or its metadata wrong: convert again"
                )

    def _dense_data(self, name: str) -> np.ndarray:
        """A dense tensor's stored data (rows), its part's rows of a fused attn_qkv."""
        data = self._tensors[self._dense_src[name]].data
        part = self._qkv_part.get(name)
        if part is None:
            return data
        q, kv = self._qkv_rows()
        start = (0, q, q + kv)[part]
        return data[start : start + (q, kv, kv)[part]]

    def _check_shape(self, name: str, shape: list[int]) -> None:
        got = [int(x) for x in self._tensors[name].shape]
        if got != shape:
            raise CheckpointError(
                f"{self.folder}: tensor {name!r} has shape {got} (GGUF order), the metadata "
                f"implies {shape}"
            )

    def _as_torch(self, t, data: np.ndarray) -> torch.Tensor:
        """A tensor's (or one expert slice's) stored data -> torch, dequantized unless float."""
        kind = t.tensor_type.name
        if kind in ("F32", "F16"):
            return torch.from_numpy(np.array(data))  # a copy: the file is mapped read-only
        if kind == "BF16":  # stored as bytes [..., 2n]: reinterpret, bit-exact
            raw = np.array(data).view(np.int16)
            return torch.from_numpy(raw).view(torch.bfloat16)
        return torch.from_numpy(self._gguf.quants.dequantize(data, t.tensor_type).copy())

    def tensor(self, name: str) -> torch.Tensor:
        """A dense tensor by its Hugging Face name, in Hugging Face's shape and row order."""
        src = self._dense_src.get(name)
        if src is None:
            raise CheckpointError(f"{self.folder}: tensor {name!r} not found")
        t = self._tensors[src]
        out = self._as_torch(t, self._dense_data(name))
        if src.endswith("attn_k_b.weight"):
            out = self._kv_b(name, out, src)
        if self.arch_name == "qwen35moe":
            out = qwen35_values(name, out)
            if (order := qwen35_order(name, self.args)) is not None:
                out = out.index_select(*order)
        if name.endswith("shared_expert_gate.weight"):
            out = out.reshape(1, -1)  # stored 1-D by some converters; HF's [1, D]
        if name.endswith("conv.conv.weight") and out.dim() == 2:
            out = out.unsqueeze(1)  # llama.cpp squeezes the depthwise conv's [D, 1, L]
        if self.arch.permuted_qk:
            out = self._unpermute(name, out)
        return out

    def _kv_b(self, name: str, k_b: torch.Tensor, src: str) -> torch.Tensor:
        """kv_b_proj from llama.cpp's two halves (attn_k_b, attn_v_b), checked against the dims."""
        v = self._tensors[src.replace("attn_k_b", "attn_v_b")]
        a = self.args
        out = kv_b(k_b, self._as_torch(v, v.data))
        want = [a.num_attention_heads * (a.qk_nope_head_dim + a.v_head_dim), a.kv_lora_rank]
        if list(out.shape) != want:
            raise CheckpointError(
                f"{self.folder}: tensors {src!r} and {v.name!r} give {name} of shape "
                f"{list(out.shape)}, the metadata implies {want}"
            )
        return out

    def _unpermute(self, name: str, w: torch.Tensor) -> torch.Tensor:
        """Undo llama.cpp's HF-converter permutation of Q/K rows (its rotate-adjacent RoPE):
        per head, rows were reordered from [2, hd/2] to [hd/2, 2]."""
        a = self.args
        if name.endswith("q_proj.weight"):
            n = a.num_attention_heads
        elif name.endswith("k_proj.weight"):
            n = a.num_key_value_heads
        else:
            return w
        return w.reshape(n, w.shape[0] // n // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)

    def expert_type(self, layer: int, role: str) -> str:
        return self._tensors[self._experts[layer][role]].tensor_type.name

    def _expert_data(self, layer: int, role: str, e: int) -> np.ndarray:
        """One expert's stored rows of one projection (gate / up: its half of a fused gate_up)."""
        data = self._tensors[self._experts[layer][role]].data[e]
        if fused_gate_up(self._experts[layer]) and role != "down":
            half = data.shape[0] // 2
            return data[:half] if role == "gate" else data[half:]
        return data

    def _expert_slice(self, layer: int, role: str, e: int) -> torch.Tensor:
        t = self._tensors[self._experts[layer][role]]
        return self._as_torch(t, self._expert_data(layer, role, e))

    def expert(self, layer: int, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(gate [I, D], up [I, D], down [D, I]) of one expert, dequantized."""
        return tuple(self._expert_slice(layer, r, e) for r in ("gate", "up", "down"))

    def expert_biases(
        self, layer: int, e: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(gate [I], up [I], down [D]) biases of one expert in fp32 (gpt-oss), else None."""
        roles = self._expert_biases.get(layer)
        if roles is None:
            return None
        parts = (self._tensors[roles[r]] for r in ("gate", "up", "down"))
        return tuple(self._as_torch(t, t.data[e]).float() for t in parts)

    def _exact(self, scheme: QuantScheme, layer: int, roles: tuple[str, ...]) -> bool:
        """The experts' blocks are `scheme` exactly (EXACT)."""
        return all(is_exact(self.expert_type(layer, r), scheme) for r in roles)

    def record_layouts(self, experts: ExpertQuant) -> dict[int, RecordLayout]:
        """MoE layer -> its record layout: per projection the scheme its blocks are kept in, or
        `experts.scheme` for what is requantized (gate and up form one section, w13: kept only
        when they share a type)."""
        a, out = self.args, {}
        for layer in a.moe_layer_ids:
            w13, w2 = (self._kept_as(experts, layer, roles) for _, roles in _PROJECTIONS)
            out[layer] = RecordLayout.build(
                w13, a.hidden_size, a.moe_intermediate_size, a.expert_bias, w2=w2
            )
        return out

    def _kept_as(self, experts: ExpertQuant, layer: int, roles: tuple[str, ...]) -> QuantScheme:
        """The scheme one projection is stored in: its own type's (EXACT) where kept, else
        `experts.scheme` (requantized)."""
        kinds = {self.expert_type(layer, r) for r in roles}
        if len(kinds) == 1 and (kind := kinds.pop()) in EXACT:
            own = make_scheme(EXACT[kind])
            if experts.keep_source or own == experts.scheme:
                return own
        return experts.scheme

    def expert_sections(self, layout: RecordLayout, layer: int, e: int) -> dict[str, torch.Tensor]:
        """Section tensors of one expert record: exact blocks copied, others requantized."""
        out = {}
        for name, roles in _PROJECTIONS:
            scheme = layout.scheme_of(name)
            if self._exact(scheme, layer, roles):
                blocks = [
                    sections(
                        self.expert_type(layer, r), self._expert_data(layer, r, e), scheme.name
                    )
                    for r in roles
                ]
                for suffix in blocks[0]:
                    out[f"{name}.{suffix}"] = torch.cat([b[suffix] for b in blocks])
                continue
            w = torch.cat([self._expert_slice(layer, r, e).float() for r in roles])  # [N, K]
            for suffix, t in quantize(scheme, w).items():
                out[f"{name}.{suffix}"] = t
        if self.args.expert_bias:  # fp32 sections after the weights, as quantize_expert's
            b_gate, b_up, out["b2"] = self.expert_biases(layer, e)
            out["b13"] = torch.cat([b_gate, b_up])
        return out

    def dense_type(self, name: str) -> str:
        """The GGUF type of a dense tensor, by its Hugging Face name."""
        return self._tensors[self._dense_src[name]].tensor_type.name

    def dense_sections(
        self, name: str, prefer: QuantScheme | None = None
    ) -> tuple[QuantScheme, dict[str, torch.Tensor]] | None:
        """A dense 2-D tensor whose blocks are a store scheme exactly (EXACT; `prefer` where it
        is one too, e.g. q8_0 for Q8_0) as (scheme, its sections by suffix, in Hugging Face's row
        order), byte for byte; None for other types."""
        t = self._tensors[self._dense_src[name]]
        kind = t.tensor_type.name
        if kind not in EXACT or len(t.shape) != 2:
            return None
        if prefer is None or not is_exact(kind, prefer):
            prefer = make_scheme(DENSE_EXACT.get(kind, EXACT[kind]))
        order = qwen35_order(name, self.args) if self.arch_name == "qwen35moe" else None
        if order is not None and order[0] != 0:
            return None  # columns reordered inside the blocks: dequantized instead
        secs = sections(kind, self._dense_data(name), prefer.name)
        if self.arch.permuted_qk:  # rows permuted; quantization runs along K, so per section
            secs = {k: self._unpermute(name, v) for k, v in secs.items()}
        if order is not None:  # whole rows reordered: the same per section
            secs = {k: v.index_select(0, order[1]) for k, v in secs.items()}
        return prefer, {k: v.contiguous() for k, v in secs.items()}

    # ---- what convert does to the experts -----------------------------------------------------
    def expert_type_counts(self) -> Counter:
        return Counter(
            self._tensors[n].tensor_type.name
            for roles in self._experts.values()
            for n in roles.values()
        )

    def default_scheme(self, group_size: int = 32) -> QuantScheme:
        """The experts' own scheme when every expert tensor has one type a scheme holds exactly
        (Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q5_K, Q6_K, MXFP4: kept exactly), else int8 when every one has >= 8 bits
        per weight, else int4: the scheme of the store, and of what convert requantizes (the
        other types kept, `ExpertQuant.keep_source`)."""
        types = set(self.expert_type_counts())
        if len(types) == 1 and (kind := types.pop()) in EXACT:
            return make_scheme(EXACT[kind], group_size)
        sizes = self._gguf.GGML_QUANT_SIZES
        bits = [
            sizes[t.tensor_type][1] * 8 / sizes[t.tensor_type][0]
            for roles in self._experts.values()
            for t in (self._tensors[n] for n in roles.values())
        ]
        return make_scheme("int8" if min(bits) >= _INT8_BITS else "int4", group_size)

    def conversion_notes(self, layouts: dict[int, RecordLayout], keep: bool) -> list[str]:
        """One line per expert tensor type and outcome: kept exactly, or dequantized and
        requantized; with `keep` (ExpertQuant.keep_source) one per layer whose gate and up types
        differ, so that w13 could not keep either (the writer says what it did to the dense
        tensors); one where the vocabulary's tokens share scores (gguf_vocab.score_ties_note)."""
        from moestream.convert.gguf_vocab import score_ties_note

        done, lines = Counter(), []
        for layer, layout in sorted(layouts.items()):
            for name, roles in _PROJECTIONS:
                scheme, kinds = layout.scheme_of(name), [self.expert_type(layer, r) for r in roles]
                kept = all(is_exact(k, scheme) for k in kinds)
                for kind in kinds:
                    held = kind in HELD_BY.get(scheme.name, ())
                    done[kind, "kept" if kept else "held" if held else "lossy", scheme] += 1
                if keep and len(set(kinds)) > 1 and all(k in EXACT for k in kinds):
                    lines.append(
                        f"layer {layer}: gate {kinds[0]} and up {kinds[1]} differ (one w13 "
                        f"section holds both): that layer's w13 requantized to {scheme.name}"
                    )
        for (kind, how, scheme), n in sorted(done.items(), key=lambda kv: kv[0][:2]):
            what = {
                "kept": f"kept exactly as {scheme.name} (same values)",
                "held": f"dequantized into {scheme.name} (exact: it holds every {kind} value)",
                "lossy": f"dequantized and requantized to {scheme.name} g{scheme.group_size} "
                f"(lossy: a second rounding{requant_cost_note(kind, scheme.name)}; measure "
                "yours with `moestream eval`)",
            }[how]
            lines.append(f"{n} {kind} expert tensor(s): {what}")
        note = score_ties_note(self.meta)
        return lines + ([note] if note else [])

    def write_files(self, out: Path) -> None:
        """config.json and the tokenizer files the store needs, from the metadata."""
        (out / "config.json").write_text(json.dumps(self.config, indent=1))
        (out / "tokenizer.json").write_text(self.tokenizer_json)
        (out / "tokenizer_config.json").write_text(json.dumps(self.tokenizer_config, indent=1))


_PROJECTIONS = (("w13", ("gate", "up")), ("w2", ("down",)))  # record section <- GGUF roles
