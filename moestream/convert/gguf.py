"""GGUF files (llama.cpp's format, as downloaded) as a checkpoint the store writer reads.

`GGUFCheckpoint` gives the writer what `HFCheckpoint` gives it: `args`, `dense_names` (in Hugging
Face naming), `tensor(name)`, `expert(layer, e)`, plus the files a store needs (config.json,
tokenizer.json, tokenizer_config.json) built from the metadata. llama.cpp's architecture and
metadata keys become a Hugging Face config dict, so each model file's own `config_fields` maps
it (`ARCHS`: which llama.cpp architecture runs as which model file); where llama.cpp's converter
rewrote a tensor (deepseek2's split kv_b, qwen35moe's shifted norms, A = -exp(A_log) and tiled
value heads) `gguf_inverse` gives the Hugging Face tensor back; gpt-oss's expert biases
(`ffn_*_exps.bias`) go into the records' b13 / b2; fused tensors (`attn_qkv`, `ffn_gate_up_exps`)
are read as their parts, row ranges of the one tensor. GGUF blocks a store scheme holds exactly
(`EXACT`: Q8_0 -> int8, Q4_0 -> q4_0, Q4_1 -> q4_1, Q4_K / Q5_K / Q6_K -> q4_k / q5_k / q6_k;
MXFP4 -> int8, its values rewritten exactly) are copied byte for byte, experts (`expert_sections`) and dense
weights (`dense_sections`) alike; under `ExpertQuant.keep_source` each expert projection keeps
its own type (`record_layouts`: per layer, w13's and w2's scheme), so mixed files (Q4_K_M) stay
exact. Other expert types are dequantized and requantized, and `conversion_notes` says so per
type; other dense types are dequantized (F32/F16/BF16 kept as they are).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moestream.config import ConfigError, ModelArgs
from moestream.convert.gguf_inverse import kv_b, qwen35_order, qwen35_values
from moestream.errors import CheckpointError
from moestream.models import model_args_from_dict
from moestream.quant import (
    KQUANT_BYTES,
    ExpertQuant,
    QuantScheme,
    RecordLayout,
    make_scheme,
    quantize,
)

MAGIC = b"GGUF"
_SPLIT = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<n>\d{5})\.gguf$")


@dataclass(frozen=True, slots=True)
class GgufArch:
    """How one llama.cpp architecture maps onto a moestream model file."""

    model_type: str
    norm_topk_prob: bool  # llama.cpp's default when `{arch}.expert_weights_norm` is absent
    permuted_qk: bool = False  # llama.cpp's HF converter permutes Q/K rows (`llama` arch)
    shared: str = "mlp.shared_expert"  # the HF module of `ffn_*_shexp` (glm4moe: shared_experts)
    sigmoid: bool = False  # sigmoid router scores (`{arch}.expert_gating_func` must agree)
    # Our names where a model file spells a block differently (lfm2_moe: feed_forward, its norms
    # operator_norm / ffn_norm, the final norm written as token_embd_norm): GGUF name -> ours.
    names: tuple[tuple[str, str], ...] = ()
    # Block tensors every MoE layer must hold (gpt-oss: sinks and biases), checked by name.
    per_layer: tuple[str, ...] = ()


# The llama.cpp architectures read so far; `llama` runs as mixtral when it has experts.
ARCHS = {
    "qwen3moe": GgufArch("qwen3_moe", norm_topk_prob=True),
    "qwen2moe": GgufArch("qwen2_moe", norm_topk_prob=False),
    "olmoe": GgufArch("olmoe", norm_topk_prob=False),
    "llama": GgufArch("mixtral", norm_topk_prob=True, permuted_qk=True),
    "glm4moe": GgufArch(
        "glm4_moe", norm_topk_prob=False, shared="mlp.shared_experts", sigmoid=True
    ),
    "lfm2moe": GgufArch(
        "lfm2_moe",
        norm_topk_prob=True,
        sigmoid=True,
        names=(
            ("token_embd_norm.weight", "model.norm.weight"),
            ("attn_norm.weight", "operator_norm.weight"),
            ("ffn_norm.weight", "ffn_norm.weight"),
            ("ffn_gate_inp.weight", "feed_forward.gate.weight"),
            ("exp_probs_b.bias", "feed_forward.expert_bias"),
            ("shortconv.conv.weight", "conv.conv.weight"),
            ("shortconv.in_proj.weight", "conv.in_proj.weight"),
            ("shortconv.out_proj.weight", "conv.out_proj.weight"),
            *((f"ffn_{r}.weight", f"feed_forward.{r}_proj.weight") for r in ("gate", "up", "down")),
        ),
    ),
    # DeepSeek-V3 / R1 / Kimi-K2: MLA attention (kv_b_proj written split as attn_k_b + attn_v_b)
    "deepseek2": GgufArch(
        "deepseek_v3",
        norm_topk_prob=False,  # the converter writes expert_weights_norm only when true
        shared="mlp.shared_experts",
        sigmoid=True,
        names=(
            ("attn_q_a.weight", "self_attn.q_a_proj.weight"),
            ("attn_q_a_norm.weight", "self_attn.q_a_layernorm.weight"),
            ("attn_q_b.weight", "self_attn.q_b_proj.weight"),
            ("attn_kv_a_mqa.weight", "self_attn.kv_a_proj_with_mqa.weight"),
            ("attn_kv_a_norm.weight", "self_attn.kv_a_layernorm.weight"),
            ("attn_kv_b.weight", "self_attn.kv_b_proj.weight"),  # files before the split
            ("attn_k_b.weight", "self_attn.kv_b_proj.weight"),  # joined with attn_v_b
        ),
    ),
    # Qwen3.5 / 3.6 MoE (text): Gated DeltaNet layers under ssm_* / attn_qkv / attn_gate
    "qwen35moe": GgufArch(
        "qwen3_5_moe_text",
        norm_topk_prob=True,
        names=(
            ("attn_qkv.weight", "linear_attn.in_proj_qkv.weight"),
            ("attn_gate.weight", "linear_attn.in_proj_z.weight"),
            ("ssm_beta.weight", "linear_attn.in_proj_b.weight"),
            ("ssm_alpha.weight", "linear_attn.in_proj_a.weight"),
            ("ssm_a", "linear_attn.A_log"),
            ("ssm_dt.bias", "linear_attn.dt_bias"),
            ("ssm_conv1d.weight", "linear_attn.conv1d.weight"),
            ("ssm_norm.weight", "linear_attn.norm.weight"),
            ("ssm_out.weight", "linear_attn.out_proj.weight"),
        ),
    ),
    # gpt-oss: attention sinks, sliding / full layers, router and experts with biases
    "gpt-oss": GgufArch(
        "gpt_oss",
        norm_topk_prob=False,  # llama.cpp's SOFTMAX_WEIGHT: softmax over the k picked logits
        names=(
            ("attn_sinks.weight", "self_attn.sinks"),
            ("ffn_gate_inp.weight", "mlp.router.weight"),
            ("ffn_gate_inp.bias", "mlp.router.bias"),
        ),
        per_layer=(
            "attn_sinks.weight",
            "ffn_gate_inp.bias",
            *(f"ffn_{r}_exps.bias" for r in ("gate", "up", "down")),
        ),
    ),
}
# The second half of a tensor llama.cpp splits in two (deepseek2's kv_b): read with the first.
_SECOND_HALF = {"attn_v_b.weight": "attn_k_b.weight"}
GATING_SOFTMAX, GATING_SIGMOID = 1, 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_*

_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    # glm4moe: the pre-FFN norm (HF's post_attention_layernorm, as ffn_norm elsewhere) and the
    # router's selection bias
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
}
# shared-expert projections: under GgufArch.shared
_SHARED = {f"ffn_{r}_shexp.weight": f"{r}_proj.weight" for r in ("gate", "up", "down")}
for _g, _h in (
    ("attn_q", "q_proj"),
    ("attn_k", "k_proj"),
    ("attn_v", "v_proj"),
    ("attn_output", "o_proj"),
):
    for _p in ("weight", "bias"):
        _BLOCK[f"{_g}.{_p}"] = f"self_attn.{_h}.{_p}"
_EXPERTS = {
    "ffn_gate_exps.weight": "gate",
    "ffn_up_exps.weight": "up",
    "ffn_down_exps.weight": "down",
}
# Tensors llama.cpp's converter fuses on request (`--fuse-gate-up-exps`: gate rows then up rows of
# each expert, written for qwen35moe / qwen3next; `--fuse-qkv`: q, k, v rows, every architecture
# with attn_qkv): read as their parts, row ranges of one tensor.
_GATE_UP = "ffn_gate_up_exps.weight"
_QKV = {"attn_qkv.weight": "weight", "attn_qkv.bias": "bias"}
# gpt-oss's expert biases, stacked [E, I] (gate, up) and [E, D] (down)
_EXPERT_BIASES = {f"ffn_{r}_exps.bias": r for r in ("gate", "up", "down")}
_BLK = re.compile(r"^blk\.(\d+)\.(.+)$")
# llama.cpp's gpt-oss constants (llm_graph's LLM_FFN_SWIGLU_OAI_MOE): no GGUF key holds them.
GPT_OSS_SWIGLU = {"swiglu_alpha": 1.702, "swiglu_limit": 7.0}

# Types kept as they are in the dense file; every other weight type is dequantized to fp32.
GGUF_FLOAT_TYPES = ("F32", "F16", "BF16")
_INT_TYPES = ("I8", "I16", "I32", "I64", "F64")
# Sources of at least 8 bits per weight default to int8 experts, lower ones to int4.
_INT8_BITS = 8.0
# GGUF block types that are a store scheme exactly: Q8_0 / Q4_0 / Q4_1 (blocks of 32, fp16 d (Q4_1:
# and m), then the quants: split into the scheme's sections) and the K-quants (their blocks as
# they are).
EXACT = {"Q8_0": "int8", "Q4_0": "q4_0", "Q4_1": "q4_1"}
EXACT.update({"Q4_K": "q4_k", "Q5_K": "q5_k", "Q6_K": "q6_k"})
# MXFP4 (gpt-oss's experts) is int8 exactly too: twice each e2m1 value is an integer in [-12, 12]
# and half the e8m0 scale a power of two (9 bits per weight against the file's 4.25).
EXACT["MXFP4"] = "int8"
# Q8_0 is also q8_0 exactly (its fp16 d kept: 8.5 bits per weight against int8's 9); int8 stays
# its default scheme, the one the GPU kernels read.
EXACT_ALSO = {"Q8_0": "q8_0"}
# Types a float scheme holds every value of: dequantized into it, nothing rounded (MXFP4's e2m1
# values times a power of two, gpt-oss's experts, are bf16 numbers).
HELD_BY = {"bf16": ("BF16", "MXFP4")}
_BLOCK_BYTES = {
    "Q8_0": 34,
    "Q4_0": 18,
    "Q4_1": 20,
    "MXFP4": 17,
    **{k.upper(): b for k, b in KQUANT_BYTES.items()},
}


def _f32(v: float) -> float:
    """A float32 metadata value as the decimal it was written from (1e-06, not 9.99999997e-07)."""
    return float(str(np.float32(v)))


def is_gguf(path: str | Path) -> bool:
    """A file that starts with the GGUF magic (the content decides, not the name)."""
    p = Path(path)
    if not p.is_file():
        return False
    with open(p, "rb") as f:
        return f.read(4) == MAGIC


def split_files(path: Path) -> list[Path]:
    """The files of a (possibly split) GGUF: `x-00001-of-00003.gguf` names all three."""
    m = _SPLIT.match(path.name)
    if m is None:
        return [path]
    n = int(m["n"])
    files = [path.with_name(f"{m['stem']}-{i:05d}-of-{n:05d}.gguf") for i in range(1, n + 1)]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise CheckpointError(
            f"{path}: split GGUF part(s) missing: {', '.join(missing)}; download every part "
            "into the same folder"
        )
    return files


def gguf_fingerprint(path: str | Path) -> str:
    """sha256 over each part's name, size and mtime (no weight bytes hashed)."""
    h = hashlib.sha256(b"gguf\n")
    for p in split_files(Path(path)):
        st = p.stat()
        h.update(f"{p.name}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def _reader_class():
    import gguf

    class _Reader(gguf.GGUFReader):
        """GGUFReader that names the first tensor a truncated file cuts off (the library would
        fail reshaping an anonymous short array)."""

        def _build_tensors(self, start_offs, fields):
            size = len(self.data)
            for field in fields:
                _, name, _, dims, raw_type, offset = field.parts
                qtype = gguf.GGMLQuantizationType(int(raw_type[0]))
                block, type_size = gguf.GGML_QUANT_SIZES[qtype]
                end = start_offs + int(offset[0]) + int(np.prod(dims)) * type_size // block
                if end > size:
                    raise CheckpointError(
                        f"{self.path}: file is truncated: tensor {bytes(name).decode()!r} needs "
                        f"{end} bytes, the file has {size}; download it again"
                    )
            super()._build_tensors(start_offs, fields)

    return _Reader


def _open_reader(path: Path):
    cls = _reader_class()
    cls.path = path
    try:
        return cls(str(path), "r")
    except CheckpointError:
        raise
    except (ValueError, IndexError, KeyError, OSError) as e:
        raise CheckpointError(
            f"{path}: not a readable GGUF file ({e}); the file is truncated or damaged, "
            "download it again"
        ) from e


class GGUFCheckpoint:
    """A GGUF file (or split set): `args`, `config`, dense names, expert tensors on demand."""

    def __init__(self, path: str | Path):
        import gguf

        self._gguf = gguf
        self.folder = Path(path)  # named `folder` as HFCheckpoint's, for the writer's messages
        self.files = split_files(self.folder)
        readers = [_open_reader(p) for p in self.files]
        self.meta = {k: f.contents() for k, f in readers[0].fields.items()}
        self._check_split(readers)
        self._tensors = {t.name: t for r in readers for t in r.tensors}
        arch_name = self._key("general.architecture")
        if arch_name not in ARCHS:
            raise CheckpointError(
                f"{self.folder}: general.architecture {arch_name!r} is not supported; "
                f"supported: {', '.join(ARCHS)}"
            )
        self.arch = ARCHS[arch_name]
        self.arch_name = arch_name
        self.dense_names: list[str] = []
        self._dense_src: dict[str, str] = {}  # HF name -> GGUF name
        self._experts: dict[int, dict[str, str]] = {}  # layer -> gate/up/down -> GGUF name
        self._fused_gate_up: set[int] = set()  # layers whose gate and up are one tensor
        self._qkv_part: dict[str, int] = {}  # HF q/k/v name -> 0/1/2 of its fused attn_qkv
        self._expert_biases: dict[int, dict[str, str]] = {}  # the same, of their biases
        self._classify()
        self._check_types()
        self.config = self._hf_config()
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

    # ---- metadata -----------------------------------------------------------------------------
    def _key(self, key: str, default: Any = ...) -> Any:
        if key in self.meta:
            return self.meta[key]
        if default is ...:
            raise CheckpointError(f"{self.folder}: metadata key {key!r} is missing")
        return default

    def _arch_key(self, key: str, default: Any = ...) -> Any:
        return self._key(f"{self.arch_name}.{key}", default)

    def _check_split(self, readers) -> None:
        count = int(self.meta.get("split.count", 1))
        if count != len(readers):
            raise CheckpointError(
                f"{self.folder}: split.count is {count} but {len(readers)} file(s) were found; "
                "open the first part (-00001-of-N.gguf) with every part beside it"
            )
        for i, r in enumerate(readers):
            no = r.fields.get("split.no")
            if count > 1 and (no is None or int(no.contents()) != i):
                raise CheckpointError(f"{self.files[i]}: split.no is not {i}; the parts are mixed")

    def _hf_config(self) -> dict[str, Any]:
        """The metadata as a Hugging Face config dict of the arch's model_type."""
        heads = int(self._arch_key("attention.head_count"))
        hidden = int(self._arch_key("embedding_length"))
        kv = self._arch_key("attention.head_count_kv", heads)
        self.kv_per_layer = kv if isinstance(kv, list) else None
        if isinstance(kv, list) and self.arch.model_type == "lfm2_moe":
            kv = [k for k in kv if k] or [0]  # 0 marks a short-convolution layer
        if isinstance(kv, list):  # per-layer counts: one value is all our models support
            if len(set(kv)) != 1:
                raise CheckpointError(
                    f"{self.folder}: {self.arch_name}.attention.head_count_kv differs per layer"
                )
            kv = kv[0]
        n_layers = self.n_layers
        first = min(self._experts)
        gate = self._tensors[self._experts[first]["gate"]]
        _, inter, n_exp = (int(x) for x in gate.shape)  # ne [D, I, E] ([D, 2I, E] fused)
        inter //= 2 if first in self._fused_gate_up else 1
        vocab = int(self._tensors["token_embd.weight"].shape[1])
        cfg: dict[str, Any] = {
            "model_type": self.arch.model_type,
            "vocab_size": vocab,
            "hidden_size": hidden,
            "num_hidden_layers": n_layers,
            "num_attention_heads": heads,
            "num_key_value_heads": int(kv),
            "head_dim": int(self._arch_key("attention.key_length", hidden // heads)),
            "rms_norm_eps": _f32(self._arch_key("attention.layer_norm_rms_epsilon")),
            "max_position_embeddings": int(self._arch_key("context_length", 4096)),
            "rope_parameters": self._rope(),
            "num_experts_per_tok": int(self._arch_key("expert_used_count")),
            "norm_topk_prob": bool(self._arch_key("expert_weights_norm", self.arch.norm_topk_prob)),
            "tie_word_embeddings": "output.weight" not in self._tensors,
            "attention_bias": any(n.endswith("self_attn.q_proj.bias") for n in self.dense_names),
            "hidden_act": "silu",
            "bos_token_id": self._special_id("bos"),
            "eos_token_id": self._eos_ids(),
        }
        if int(self._arch_key("expert_count", n_exp)) != n_exp:
            raise CheckpointError(
                f"{self.folder}: {self.arch_name}.expert_count is "
                f"{self._arch_key('expert_count')}, tensor {gate.name!r} holds {n_exp} experts"
            )
        dense_layers = [i for i in range(n_layers) if i not in self._experts]
        mt = self.arch.model_type
        if mt == "mixtral":
            cfg.update(num_local_experts=n_exp, intermediate_size=inter, sliding_window=None)
            if dense_layers:
                raise CheckpointError(
                    f"{self.folder}: llama layer(s) {dense_layers} have no experts"
                )
        else:
            cfg.update(num_experts=n_exp, moe_intermediate_size=inter, mlp_only_layers=dense_layers)
            cfg["intermediate_size"] = int(self._arch_key("feed_forward_length", inter))
        if mt == "qwen2_moe":
            shared = self._tensors.get("blk.0.ffn_gate_shexp.weight")
            cfg["shared_expert_intermediate_size"] = 0 if shared is None else int(shared.shape[1])
            cfg.update(qkv_bias=cfg["attention_bias"], use_sliding_window=False)
        if mt == "olmoe":
            cfg["clip_qkv"] = self._arch_key("attention.clamp_kqv", None)
        if mt == "glm4_moe":
            cfg.update(self._glm4_fields(cfg, dense_layers, n_exp))
        if mt == "lfm2_moe":
            cfg.update(self._lfm2_fields(cfg, dense_layers))
        if mt == "deepseek_v3":
            cfg.update(self._deepseek2_fields(cfg, dense_layers, n_exp))
        if mt == "qwen3_5_moe_text":
            cfg.update(self._qwen35_fields(cfg))
        if mt == "gpt_oss":
            cfg.update(self._gpt_oss_fields(cfg, dense_layers))
        return cfg

    def _lead_dense(self, dense_layers: list[int]) -> int:
        lead = int(self._arch_key("leading_dense_block_count", 0))
        if dense_layers != list(range(lead)):
            raise CheckpointError(
                f"{self.folder}: layers {dense_layers} have no experts, but "
                f"{self.arch_name}.leading_dense_block_count is {lead}"
            )
        return lead

    def _check_sigmoid(self, absent: int = GATING_SIGMOID) -> None:
        """`absent`: the gating llama.cpp assumes without the key (deepseek2: softmax, V2's)."""
        key = f"{self.arch_name}.expert_gating_func"
        gating = int(self._key(key, absent))
        if gating != GATING_SIGMOID:
            what = f"is {gating}" if key in self.meta else f"is absent: llama.cpp reads {gating}"
            raise CheckpointError(
                f"{self.folder}: {key} {what}, but {self.arch.model_type} routes "
                f"with sigmoid scores ({GATING_SIGMOID}); a sigmoid-routed model's file needs "
                f"{key} = {GATING_SIGMOID} (its config.json's scoring_func: sigmoid)"
            )

    def _lfm2_fields(self, cfg: dict[str, Any], dense_layers: list[int]) -> dict:
        """lfm2moe: which layers are short convolutions (head_count_kv 0, llama.cpp's marking),
        the kernel length, leading dense layers, sigmoid routing with the selection bias
        `exp_probs_b`, renormalised weights (llama.cpp writes no scaling factor: 1)."""
        self._check_sigmoid()
        n = cfg["num_hidden_layers"]
        kv = self.kv_per_layer or [cfg["num_key_value_heads"]] * n
        if len(kv) != n:
            raise CheckpointError(
                f"{self.folder}: {self.arch_name}.attention.head_count_kv has {len(kv)} entries "
                f"for {n} layers"
            )
        return {
            "layer_types": ["full_attention" if k else "conv" for k in kv],
            "conv_L_cache": int(self._arch_key("shortconv.l_cache")),
            "conv_bias": False,  # llama.cpp's LFM2 has no conv biases (a bias tensor is refused)
            "num_dense_layers": self._lead_dense(dense_layers),
            "use_expert_bias": f"blk.{n - 1}.exp_probs_b.bias" in self._tensors,
            "routed_scaling_factor": 1.0,
            "norm_eps": cfg["rms_norm_eps"],
            "tie_embedding": cfg["tie_word_embeddings"],
        }

    def _grouped_sigmoid_fields(self, cfg: dict[str, Any], dense_layers: list[int], n_exp: int):
        """glm4moe / deepseek2: leading dense layers, shared experts, group-limited top-k and
        scaled weights (llama.cpp's keys and defaults: no scale written means 1, no groups 1)."""
        lead = self._lead_dense(dense_layers)
        shexp = self._tensors.get(f"blk.{lead}.ffn_gate_shexp.weight")
        n_shared = int(self._arch_key("expert_shared_count", 0 if shexp is None else 1))
        if shexp is not None and int(shexp.shape[1]) != n_shared * cfg["moe_intermediate_size"]:
            raise CheckpointError(
                f"{self.folder}: ffn_gate_shexp holds {int(shexp.shape[1])} rows, not "
                f"expert_shared_count {n_shared} x {cfg['moe_intermediate_size']}"
            )
        return {
            "n_routed_experts": n_exp,
            "n_shared_experts": n_shared,
            "first_k_dense_replace": lead,
            "routed_scaling_factor": _f32(self._arch_key("expert_weights_scale", 1.0)) or 1.0,
            "n_group": int(self._arch_key("expert_group_count", 1)) or 1,
            "topk_group": int(self._arch_key("expert_group_used_count", 1)) or 1,
            "num_nextn_predict_layers": 0,  # the MTP layers' tensors were not read
        }

    def _glm4_fields(self, cfg: dict[str, Any], dense_layers: list[int], n_exp: int) -> dict:
        """glm4moe: sigmoid routing with a selection bias, group-limited top-k, scaled weights,
        leading dense layers, shared experts, partial rotary (llama.cpp's keys and defaults)."""
        self._check_sigmoid()
        head_dim = cfg["head_dim"]
        rot = int(self._arch_key("rope.dimension_count", head_dim))
        return {
            **self._grouped_sigmoid_fields(cfg, dense_layers, n_exp),
            "partial_rotary_factor": rot / head_dim,
            "use_qk_norm": "blk.0.attn_q_norm.weight" in self._tensors,
        }

    def _deepseek2_fields(self, cfg: dict[str, Any], dense_layers: list[int], n_exp: int) -> dict:
        """deepseek2: the MLA dims (llama.cpp writes attention as MQA over the latent: head_count_kv
        1, key_length r + rope; the per-head sizes under key_length_mla / value_length_mla, or, in
        files before the kv_b split, key_length / value_length themselves), interleaved RoPE on
        the rope part, yarn's mscale from yarn_log_multiplier, DeepSeek-V3's sigmoid routing."""
        self._check_sigmoid(absent=GATING_SOFTMAX)
        heads, r = cfg["num_attention_heads"], int(self._arch_key("attention.kv_lora_rank"))
        rope = int(self._arch_key("rope.dimension_count"))
        qk = int(self._arch_key("attention.key_length_mla", self._arch_key("attention.key_length")))
        vd = self._arch_key("attention.value_length_mla", self._arch_key("attention.value_length"))
        q_lora = self._arch_key("attention.q_lora_rank", None)
        mqa = self._tensors.get("blk.0.attn_kv_a_mqa.weight")
        if mqa is not None and int(mqa.shape[1]) != r + rope:
            raise CheckpointError(
                f"{self.folder}: tensor 'blk.0.attn_kv_a_mqa.weight' has {int(mqa.shape[1])} rows, "
                f"not {self.arch_name}.attention.kv_lora_rank {r} + rope.dimension_count {rope}"
            )
        rope_parameters = dict(cfg["rope_parameters"])
        log_mul = self._arch_key("rope.scaling.yarn_log_multiplier", None)
        if rope_parameters["rope_type"] == "yarn" and log_mul is not None:
            # the converter writes 0.1 * mscale_all_dim; llama.cpp takes mscale equal to it
            m = _f32(_f32(log_mul) / 0.1)
            rope_parameters.update(mscale=m, mscale_all_dim=m)
        return {
            **self._grouped_sigmoid_fields(cfg, dense_layers, n_exp),
            "num_key_value_heads": heads,  # MLA expands the latent to every head
            "head_dim": rope,
            "q_lora_rank": None if q_lora is None else int(q_lora),
            "kv_lora_rank": r,
            "qk_rope_head_dim": rope,
            "qk_nope_head_dim": qk - rope,
            "v_head_dim": int(vd),
            "rope_interleave": True,  # llama.cpp's deepseek2 rotates adjacent pairs
            "rope_parameters": rope_parameters,
        }

    def _qwen35_fields(self, cfg: dict[str, Any]) -> dict:
        """qwen35moe: which layers are Gated DeltaNet (`attention.recurrent_layers`, else every
        full_attention_interval-th is full attention), their dims under `ssm.*`, the shared
        expert's width, the rotary share of each head."""
        n = cfg["num_hidden_layers"]
        recurrent = self._arch_key("attention.recurrent_layers", None)
        if recurrent is None:
            every = int(self._arch_key("full_attention_interval", 4))
            recurrent = [(i + 1) % every != 0 for i in range(n)]
        recurrent = list(recurrent)[:n]  # MTP layers, after the trunk, are not recurrent
        n_v = int(self._arch_key("ssm.time_step_rank"))
        inner = int(self._arch_key("ssm.inner_size"))
        shexp = self._tensors.get("blk.0.ffn_gate_shexp.weight")
        return {
            "layer_types": ["linear_attention" if x else "full_attention" for x in recurrent],
            "linear_conv_kernel_dim": int(self._arch_key("ssm.conv_kernel")),
            "linear_num_key_heads": int(self._arch_key("ssm.group_count")),
            "linear_num_value_heads": n_v,
            "linear_key_head_dim": int(self._arch_key("ssm.state_size")),
            "linear_value_head_dim": inner // n_v,
            "shared_expert_intermediate_size": 0 if shexp is None else int(shexp.shape[1]),
            "partial_rotary_factor": int(self._arch_key("rope.dimension_count")) / cfg["head_dim"],
        }

    def _gpt_oss_fields(self, cfg: dict[str, Any], dense_layers: list[int]) -> dict:
        """gpt-oss: which layers slide (`attention.sliding_window_pattern`: per-layer flags, or a
        period whose last layer is full; absent: llama.cpp's 2, every even layer slides), the
        window, the SwiGLU constants llama.cpp fixes. Yarn as llama.cpp computes it: correction
        dims rounded (`truncate`, our default), where gpt-oss's config.json says false."""
        n = cfg["num_hidden_layers"]
        if dense_layers:
            raise CheckpointError(
                f"{self.folder}: gpt-oss layer(s) {dense_layers} have no experts (every gpt-oss "
                "layer is MoE)"
            )
        pattern = self._arch_key("attention.sliding_window_pattern", 2)
        if isinstance(pattern, list):
            if len(pattern) < n:
                raise CheckpointError(
                    f"{self.folder}: {self.arch_name}.attention.sliding_window_pattern has "
                    f"{len(pattern)} entries for {n} layers"
                )
            slides = [bool(x) for x in pattern[:n]]
        else:
            p = int(pattern)
            slides = [p == 0 or i % p < p - 1 for i in range(n)]
        base_swa = self._arch_key("rope.freq_base_swa", None)
        if base_swa is not None and _f32(base_swa) != cfg["rope_parameters"]["rope_theta"]:
            raise CheckpointError(
                f"{self.folder}: {self.arch_name}.rope.freq_base_swa {_f32(base_swa)} differs "
                "from rope.freq_base: gpt_oss has one RoPE base for every layer"
            )
        return {
            "num_local_experts": cfg["num_experts"],
            "sliding_window": int(self._arch_key("attention.sliding_window")),
            "layer_types": ["sliding_attention" if x else "full_attention" for x in slides],
            **GPT_OSS_SWIGLU,
        }

    def _rope(self) -> dict[str, Any]:
        rope: dict[str, Any] = {"rope_theta": _f32(self._arch_key("rope.freq_base", 10000.0))}
        kind = self._arch_key("rope.scaling.type", "none")
        if kind in ("none", ""):
            return {**rope, "rope_type": "default"}
        if kind not in ("linear", "yarn"):
            raise CheckpointError(
                f"{self.folder}: {self.arch_name}.rope.scaling.type {kind!r} is not supported "
                "(supported: none, linear, yarn)"
            )
        rope.update(rope_type=kind, factor=float(self._arch_key("rope.scaling.factor")))
        if kind == "yarn":
            rope["original_max_position_embeddings"] = int(
                self._arch_key("rope.scaling.original_context_length")
            )
            for ours in ("beta_fast", "beta_slow"):  # llama.cpp's defaults (32, 1) as HF's
                if (v := self._arch_key(f"rope.scaling.yarn_{ours}", None)) is not None:
                    rope[ours] = _f32(v)
        return rope

    def _eos_ids(self) -> list[int] | None:
        ids = [self._special_id(k) for k in ("eos", "eot", "eom")]
        ids = list(dict.fromkeys(i for i in ids if i is not None))
        return ids or None

    def _special_id(self, which: str) -> int | None:
        from moestream.convert.gguf_vocab import special_token_id

        n = len(self.meta.get("tokenizer.ggml.tokens") or [])
        try:
            return special_token_id(self.meta, which, n)
        except CheckpointError as e:
            raise CheckpointError(f"{self.folder}: {e}") from e

    # ---- tensors ------------------------------------------------------------------------------
    def _classify(self) -> None:
        # llama.cpp counts multi-token-prediction layers (glm4moe's `nextn`) in block_count and
        # writes them after the trunk; moestream runs the trunk, so their tensors are skipped
        n = int(self._arch_key("block_count"))
        self.mtp_layers = int(self._arch_key("nextn_predict_layers", 0))
        self.n_layers = n - self.mtp_layers
        own = dict(self.arch.names)
        for name in self._tensors:
            if name in _GLOBAL or name in own:  # own: only the final norm is not in a block
                self._add_dense(own.get(name) or _GLOBAL[name], name)
                continue
            m = _BLK.match(name)
            if m and int(m[1]) >= self.n_layers and self.mtp_layers:
                continue
            if m and m[2] in _EXPERTS:
                self._experts.setdefault(int(m[1]), {})[_EXPERTS[m[2]]] = name
            elif m and m[2] == _GATE_UP:
                self._experts.setdefault(int(m[1]), {}).update(gate=name, up=name)
                self._fused_gate_up.add(int(m[1]))
            elif m and m[2] in _QKV and f"blk.{m[1]}.ssm_out.weight" not in self._tensors:
                # (qwen35moe's Gated DeltaNet layers name their in_proj_qkv attn_qkv: own names)
                for k, proj in enumerate(("q_proj", "k_proj", "v_proj")):
                    hf = f"model.layers.{m[1]}.self_attn.{proj}.{_QKV[m[2]]}"
                    self._add_dense(hf, name)
                    self._qkv_part[hf] = k
            elif m and m[2] in _EXPERT_BIASES and self.arch.model_type == "gpt_oss":
                self._expert_biases.setdefault(int(m[1]), {})[_EXPERT_BIASES[m[2]]] = name
            elif m and m[2] in _SECOND_HALF:
                continue  # read by tensor() with its first half
            elif m and m[2] in own:
                self._add_dense(f"model.layers.{m[1]}.{own[m[2]]}", name)
            elif m and m[2] in _BLOCK:
                self._add_dense(f"model.layers.{m[1]}.{_BLOCK[m[2]]}", name)
            elif m and m[2] in _SHARED:
                self._add_dense(f"model.layers.{m[1]}.{self.arch.shared}.{_SHARED[m[2]]}", name)
            else:
                raise CheckpointError(
                    f"{self.folder}: tensor {name!r} is not one moestream maps for GGUF "
                    f"architecture {self._key('general.architecture')!r}"
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
        for second, first in _SECOND_HALF.items():
            for name in self._tensors:
                m = _BLK.match(name)
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
        if t.tensor_type.name in _INT_TYPES:
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
                if layer in self._fused_gate_up and role != "down":
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
        if layer in self._fused_gate_up and role != "down":
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
        return all(_is_exact(self.expert_type(layer, r), scheme) for r in roles)

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
                    _sections(
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
        if prefer is None or not _is_exact(kind, prefer):
            prefer = make_scheme(EXACT[kind])
        order = qwen35_order(name, self.args) if self.arch_name == "qwen35moe" else None
        if order is not None and order[0] != 0:
            return None  # columns reordered inside the blocks: dequantized instead
        secs = _sections(kind, self._dense_data(name), prefer.name)
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
        (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K, MXFP4: kept exactly), else int8 when every one has >= 8 bits
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
                kept = all(_is_exact(k, scheme) for k in kinds)
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
                "(lossy: a second rounding; measure with `moestream eval`)",
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


def _is_exact(kind: str, scheme: QuantScheme) -> bool:
    """GGUF type `kind` is `scheme` exactly (its blocks copy into the scheme's sections)."""
    names = (EXACT.get(kind), EXACT_ALSO.get(kind))
    return any(n is not None and make_scheme(n) == scheme for n in names)


def _sections(kind: str, raw: np.ndarray, scheme: str | None = None) -> dict[str, torch.Tensor]:
    """Rows of EXACT blocks, raw uint8 [N, K/32 * block bytes] -> the scheme's sections by suffix:
    Q8_0 -> q int8 [N, K], s fp32 [N, K/32] (fp16 d widened: exact; scheme "q8_0": d fp16 [N, K/32]
    as stored); MXFP4 -> int8 q, s (`_mxfp4_int8`); Q4_0 -> q uint8 [N, K/2]
    (the 16 nibble bytes as stored), d fp16 [N, K/32]; Q4_1 -> q as Q4_0's, dm fp16 [N, K/32, 2]
    (d, m as stored); K-quants -> q uint8 [N, K/256, B], the blocks as stored."""
    raw = np.ascontiguousarray(raw)
    n = raw.shape[0]
    if kind == "MXFP4":
        return _mxfp4_int8(raw.reshape(n, -1, _BLOCK_BYTES[kind]))
    if kind.lower() in KQUANT_BYTES:
        return {"q": torch.from_numpy(raw.reshape(n, -1, _BLOCK_BYTES[kind]).copy())}
    blocks = raw.reshape(n, -1, _BLOCK_BYTES[kind])  # per block: fp16 d, then the quants
    if kind == "Q4_1":  # fp16 d, fp16 m, then the nibbles
        dm = torch.from_numpy(blocks[..., :4].copy().view(np.float16))  # [N, K/32, 2]
        return {"q": torch.from_numpy(blocks[..., 4:].copy().reshape(n, -1)), "dm": dm}
    d = torch.from_numpy(blocks[..., :2].copy().view(np.float16)[..., 0])
    qs = blocks[..., 2:].copy().reshape(n, -1)
    if kind == "Q8_0":
        q = torch.from_numpy(qs.view(np.int8))
        return {"q": q, "d": d} if scheme == "q8_0" else {"q": q, "s": d.float()}
    return {"q": torch.from_numpy(qs), "d": d}


# e2m1 codes -> twice their value (sign bit 3): llama.cpp's kvalues_mxfp4
_E2M1_X2 = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int8)


def _mxfp4_int8(blocks: np.ndarray) -> dict[str, torch.Tensor]:
    """MXFP4 blocks uint8 [N, G, 17] (e8m0 exponent e, then 16 bytes: element j in the low nibble
    of byte j, element j + 16 in the high one) -> int8 sections, exactly: q int8 [N, G * 32] = 2x
    the e2m1 values, s fp32 [N, G] = 2^(e - 128) (half the block scale; e < 2 gives the
    subnormals llama.cpp's e8m0_to_fp32_half gives)."""
    n, g, _ = blocks.shape
    qs = blocks[..., 1:]
    q = np.concatenate([_E2M1_X2[qs & 0x0F], _E2M1_X2[qs >> 4]], axis=-1)  # [N, G, 32]
    s = np.ldexp(np.float32(1.0), blocks[..., 0].astype(np.int32) - 128).astype(np.float32)
    return {"q": torch.from_numpy(q.reshape(n, g * 32)), "s": torch.from_numpy(s)}
