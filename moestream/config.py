"""Frozen, validated configuration: model arguments (from config.json), sampling, sizes.

Model files read everything they need from `ModelArgs`. This file holds the architecture-neutral
part of reading config.json (required keys, RoPE, common fields); each model file maps its own
fields (`config_fields`) and `moestream.models` picks the file by `model_type`.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def cache_root() -> Path:
    """Converted stores and built native kernels (the one place that reads MOESTREAM_CACHE)."""
    return Path(os.environ.get("MOESTREAM_CACHE", Path.home() / ".cache" / "moestream"))


def ext_cache_root() -> Path:
    """Built native kernels (MOESTREAM_EXT_CACHE; default ~/.cache/moestream/ext): apart from
    cache_root so a test's private store cache does not rebuild them."""
    return Path(os.environ.get("MOESTREAM_EXT_CACHE", Path.home() / ".cache" / "moestream" / "ext"))


class ConfigError(ValueError):
    """A config.json or a command-line setting that cannot work; the message says how to fix it."""


@dataclass(frozen=True, slots=True)
class RopeArgs:
    rope_type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    # yarn
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True
    # llama3
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None

    def __post_init__(self):
        known = ("default", "linear", "dynamic", "yarn", "llama3")
        if self.rope_type not in known:
            raise ConfigError(
                f"rope type {self.rope_type!r} is not supported (supported: {', '.join(known)})"
            )
        if not (math.isfinite(self.theta) and self.theta > 0):
            raise ConfigError(
                f"config.json: rope_theta must be a positive number, got {self.theta}"
            )
        if self.rope_type != "default" and self.factor <= 0:
            raise ConfigError(f"rope scaling factor must be > 0, got {self.factor}")


@dataclass(frozen=True, slots=True)
class ModelArgs:
    """The union of the fields the supported MoE architectures read from config.json."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int  # dense MLP width (non-MoE layers; Mixtral's expert width)
    moe_intermediate_size: int  # routed expert width
    num_experts: int
    num_experts_per_tok: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeArgs
    norm_topk_prob: bool = False
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v (and o for olmoe) bias
    qkv_bias: bool = False  # qwen2_moe: q/k/v bias, no o bias
    clip_qkv: float | None = None
    shared_expert_intermediate_size: int = 0
    moe_layers: tuple[bool, ...] = ()
    sliding_windows: tuple[int | None, ...] = ()  # per layer; None = full attention
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "float32"
    # DeepSeek-V3 / GLM-4.5 routing: sigmoid scores, group-limited top-k, scaled weights.
    n_shared_experts: int = 0  # ungated shared experts of width moe_intermediate_size * n
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    num_mtp_layers: int = 0  # multi-token-prediction layers stored after the last layer (ignored)
    partial_rotary_factor: float = 1.0  # RoPE covers the first head_dim * factor dims
    use_qk_norm: bool = False  # glm4_moe: per-head q/k RMSNorm
    # DeepSeek multi-head latent attention (kv_lora_rank > 0); head_dim is then qk_rope_head_dim.
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False
    # gpt_oss experts: biases on gate_up/down and the clamped SwiGLU
    # (up.clamp(-limit, limit) + 1) * g * sigmoid(alpha * g), g = gate.clamp(max=limit).
    expert_bias: bool = False
    swiglu_limit: float | None = None  # None: plain silu(gate) * up
    swiglu_alpha: float = 1.702
    # Token mixer per layer: "attention", or a recurrent one ("linear_attention": Gated DeltaNet)
    # whose decode state lives in KVCache.state instead of K/V; empty = attention everywhere.
    layer_mixers: tuple[str, ...] = ()
    # Gated DeltaNet (qwen3_5_moe linear-attention layers)
    linear_conv_kernel_dim: int = 4
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    # LFM2 short-convolution layers (layer_mixers "conv"): depthwise kernel width; conv/proj biases
    conv_kernel: int = 0
    conv_bias: bool = False
    # lfm2_moe routing: sigmoid scores plus a learned `expert_bias` used for the top-k choice only
    selection_bias: bool = False

    def __post_init__(self):
        for name in (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "num_experts",
            "num_experts_per_tok",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"config.json: {name} must be > 0, got {getattr(self, name)}")
        if not (math.isfinite(self.rms_norm_eps) and self.rms_norm_eps > 0):
            raise ConfigError(f"config.json: rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"config.json: num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.num_experts_per_tok > self.num_experts:
            raise ConfigError(
                f"config.json: num_experts_per_tok ({self.num_experts_per_tok}) > num_experts ({self.num_experts})"
            )
        if (
            len(self.moe_layers) != self.num_hidden_layers
            or len(self.sliding_windows) != self.num_hidden_layers
        ):
            raise ConfigError("internal: moe_layers/sliding_windows must have one entry per layer")
        if self.hidden_act != "silu":
            raise ConfigError(
                f"config.json: hidden_act {self.hidden_act!r} is not supported (only silu)"
            )
        if self.n_group > 1:
            per_group = self.num_experts // self.n_group
            if self.num_experts % self.n_group or per_group < 2:
                raise ConfigError(
                    f"config.json: n_routed_experts ({self.num_experts}) must split into n_group "
                    f"({self.n_group}) groups of at least 2 experts"
                )
            if not 0 < self.topk_group <= self.n_group:
                raise ConfigError(
                    f"config.json: topk_group ({self.topk_group}) must be in 1..n_group ({self.n_group})"
                )
            if self.num_experts_per_tok > self.topk_group * per_group:
                raise ConfigError(
                    f"config.json: num_experts_per_tok ({self.num_experts_per_tok}) exceeds the "
                    f"experts in topk_group ({self.topk_group}) groups of {per_group}"
                )
        if self.layer_mixers and len(self.layer_mixers) != self.num_hidden_layers:
            raise ConfigError(
                f"config.json: layer_types has {len(self.layer_mixers)} entries for "
                f"{self.num_hidden_layers} layers"
            )
        if "linear_attention" in self.layer_mixers and (
            self.linear_num_key_heads <= 0
            or self.linear_num_value_heads % self.linear_num_key_heads
        ):
            raise ConfigError(
                f"config.json: linear_num_value_heads ({self.linear_num_value_heads}) must be a "
                f"multiple of linear_num_key_heads ({self.linear_num_key_heads})"
            )
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ConfigError(
                f"config.json: rotary dim {self.rotary_dim} (head_dim {self.head_dim} x "
                f"partial_rotary_factor {self.partial_rotary_factor}) must be even and <= head_dim"
            )

    @property
    def moe_layer_ids(self) -> list[int]:
        return [i for i, m in enumerate(self.moe_layers) if m]

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def attention_layers(self) -> tuple[bool, ...]:
        """Per layer: does it keep a KV cache (False for recurrent mixers)."""
        if not self.layer_mixers:
            return (True,) * self.num_hidden_layers
        return tuple(m == "attention" for m in self.layer_mixers)

    @property
    def kv_cache_dims(self) -> tuple[int, int, int]:
        """(heads, key dim, value dim) of one layer's KV cache.

        MLA caches the expanded per-head K (nope + rope) and V: decode then projects only the new
        token through kv_b_proj instead of re-expanding the whole latent cache every step.
        """
        if self.kv_lora_rank:
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            return self.num_attention_heads, qk, self.v_head_dim
        return self.num_key_value_heads, self.head_dim, self.head_dim


def _rope_from_config(cfg: dict[str, Any]) -> RopeArgs:
    # transformers 5 writes `rope_parameters`; older checkpoints have `rope_theta` + `rope_scaling`.
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    orig = params.get("original_max_position_embeddings")
    if rope_type in ("yarn", "llama3") and orig is None:
        orig = cfg.get("max_position_embeddings")
    return RopeArgs(
        rope_type=rope_type,
        theta=float(theta),
        factor=float(params.get("factor") or 1.0),
        original_max_position_embeddings=orig,
        beta_fast=params.get("beta_fast"),
        beta_slow=params.get("beta_slow"),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        attention_factor=params.get("attention_factor"),
        truncate=params.get("truncate", True),
        low_freq_factor=params.get("low_freq_factor"),
        high_freq_factor=params.get("high_freq_factor"),
    )


def partial_rotary_factor(cfg: dict[str, Any], default: float = 1.0) -> float:
    # transformers 5 keeps it in rope_parameters; hub configs have it at the top level.
    params = cfg.get("rope_parameters") or {}
    return float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", default)))


def require(cfg: dict[str, Any], key: str, path: str) -> Any:
    if cfg.get(key) is None:
        raise ConfigError(f"{path}: missing required field {key!r}")
    return cfg[key]


# Keys the model files read with int()/float(): checked first, so that `num_experts: 64.5` is
# refused by name instead of truncated to 64. null stays allowed (HF writes it for "unset").
POSITIVE_INTS = (
    "vocab_size hidden_size num_hidden_layers num_attention_heads num_key_value_heads head_dim "
    "num_experts num_local_experts n_routed_experts num_experts_per_tok max_position_embeddings "
    "moe_intermediate_size decoder_sparse_step"
).split()
NON_NEGATIVE_INTS = (
    "intermediate_size shared_expert_intermediate_size n_shared_experts n_group topk_group "
    "kv_lora_rank q_lora_rank qk_nope_head_dim qk_rope_head_dim v_head_dim first_k_dense_replace "
    "num_nextn_predict_layers num_mtp_layers num_dense_layers max_window_layers "
    "full_attention_interval linear_conv_kernel_dim linear_num_key_heads linear_num_value_heads "
    "linear_key_head_dim linear_value_head_dim"
).split()
POSITIVE_FLOATS = "rms_norm_eps norm_eps rope_theta routed_scaling_factor partial_rotary_factor"


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) or isinstance(v, float) and v.is_integer()


def check_config_values(cfg: dict[str, Any], path: str = "config.json") -> None:
    """Refuse, naming the key, a number of the wrong type or sign in config.json."""
    for key in POSITIVE_INTS + NON_NEGATIVE_INTS:
        v = cfg.get(key)
        if v is not None and not (_is_int(v) and v >= (key in POSITIVE_INTS)):
            sign = "a positive" if key in POSITIVE_INTS else "a non-negative"
            raise ConfigError(f"{path}: {key} must be {sign} integer, got {v!r}")
    nest = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"
    rope = cfg.get(nest) if isinstance(cfg.get(nest), dict) else {}
    for key in POSITIVE_FLOATS.split():
        for where, v in ((key, cfg.get(key)), (f"{nest}.{key}", rope.get(key))):
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < math.inf
            if v is not None and not ok:
                raise ConfigError(f"{path}: {where} must be a positive number, got {v!r}")


def common_fields(cfg: dict[str, Any], path: str = "config.json") -> dict[str, Any]:
    """The ModelArgs fields every architecture reads the same way, with the plain Hugging Face
    defaults; a model file's `config_fields` adds its experts and overrides the rest."""
    n_layers = int(require(cfg, "num_hidden_layers", path))
    hidden = int(require(cfg, "hidden_size", path))
    n_heads = int(require(cfg, "num_attention_heads", path))
    # Qwen-style flags: one window on every layer when use_sliding_window.
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", False) else None
    eos = cfg.get("eos_token_id")
    return dict(
        vocab_size=int(require(cfg, "vocab_size", path)),
        hidden_size=hidden,
        num_hidden_layers=n_layers,
        num_attention_heads=n_heads,
        num_key_value_heads=int(cfg.get("num_key_value_heads") or n_heads),
        head_dim=int(cfg.get("head_dim") or hidden // n_heads),
        intermediate_size=int(cfg.get("intermediate_size", 0)),
        num_experts_per_tok=int(require(cfg, "num_experts_per_tok", path)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        rope=_rope_from_config(cfg),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", False)),
        qkv_bias=bool(cfg.get("qkv_bias", False)),
        clip_qkv=cfg.get("clip_qkv"),
        shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size", 0)),
        moe_layers=(True,) * n_layers,
        sliding_windows=(window,) * n_layers,
        hidden_act=cfg.get("hidden_act", "silu"),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),)),
        torch_dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
        partial_rotary_factor=partial_rotary_factor(cfg),
    )


def read_config_json(folder: str | Path) -> tuple[dict[str, Any], str]:
    """(the parsed config.json of a checkpoint folder, its path for error messages)."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ConfigError(
            f"{path} not found: -m must point at a Hugging Face checkpoint folder (with config.json) "
            "or a moestream store"
        )
    try:
        return json.loads(path.read_text()), str(path)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON ({e}); re-download the checkpoint") from e


@dataclass(frozen=True, slots=True)
class SamplingConfig:
    """How the next token is picked. temperature 0 = greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_new_tokens: int = 64
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    # Penalties over the last `repeat_last_n` tokens (prompt included; 0 = all): llama.cpp's
    # repeat penalty (positive logits divided, negative multiplied) and OpenAI's frequency /
    # presence penalties (subtracted per occurrence / once). Defaults change nothing.
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0

    @property
    def penalizes(self) -> bool:
        return self.repeat_penalty != 1 or self.frequency_penalty != 0 or self.presence_penalty != 0

    def __post_init__(self):
        if not 0.01 <= self.repeat_penalty <= 100:  # far outside, logits overflow to inf
            raise ConfigError(
                f"repeat penalty must be in [0.01, 100] (1 = off), got {self.repeat_penalty}"
            )
        if self.repeat_last_n < 0:
            raise ConfigError(f"repeat-last-n must be >= 0 (0 = all), got {self.repeat_last_n}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ConfigError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.temperature < 0:
            raise ConfigError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.max_new_tokens < 0:
            raise ConfigError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")


_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}
_FRACTION = re.compile(r"^\s*([0-9]*\.[0-9]+|[0-9]+\.)\s*$|^\s*([0-9]*\.?[0-9]+)\s*%\s*$")


def parse_size(text: str | int) -> int:
    """'512MiB' / '2G' / '4GB' / '1.5GiB' / '4096' -> bytes (binary units: KB = KiB)."""
    if isinstance(text, int):
        return text
    m = _SIZE.match(str(text))
    if not m:
        raise ConfigError(
            f"cannot read size {text!r}: use bytes or a KiB/MiB/GiB suffix, e.g. 512MiB"
        )
    unit = (m.group(2) or "").upper().rstrip("B").rstrip("I") if m.group(2) else ""
    return int(float(m.group(1)) * _UNITS[unit])


@dataclass(frozen=True, slots=True)
class Budget:
    """Bytes of expert memory: `nbytes`, or a `fraction` of the model's expert bytes, which is
    known only once the store is (`resolve`). `flag` names the setting in errors."""

    nbytes: int | None = None
    fraction: float | None = None
    flag: str = field(default="budget", compare=False)

    def __post_init__(self):
        if (self.nbytes is None) == (self.fraction is None):
            raise ConfigError(f"{self.flag}: give either bytes or a fraction")
        if self.nbytes is not None and self.nbytes <= 0:
            raise ConfigError(f"{self.flag} must be > 0 bytes, got {self.nbytes}")
        if self.fraction is not None and not 0 < self.fraction <= 1:
            raise ConfigError(
                f"{self.flag} {self.fraction:g} ({100 * self.fraction:g}%): a fraction of the "
                "expert bytes must be in (0, 1] (e.g. 0.25 or 25%); for bytes give a unit: 512MiB"
            )

    def resolve(self, total_bytes: int) -> int:
        """Bytes, given the total bytes of every expert of the model."""
        return self.nbytes if self.fraction is None else int(self.fraction * total_bytes)

    def __str__(self) -> str:
        return f"{self.nbytes} bytes" if self.fraction is None else f"{100 * self.fraction:g}%"


def parse_budget(text: str | int, flag: str = "budget") -> Budget:
    """The one reader of budget flags: '512MiB', '4GB', '4096' (bytes) or '25%', '0.25' (a
    fraction of the expert bytes). A unitless number with a decimal point is a fraction."""
    m = _FRACTION.match(str(text))
    if m:
        frac = float(m.group(1)) if m.group(1) else float(m.group(2)) / 100
        return Budget(fraction=frac, flag=flag)
    if not _SIZE.match(str(text)):
        raise ConfigError(
            f"cannot read {flag} {text!r}: give bytes (4096, 512MiB, 4GB; binary units) or "
            "a fraction of the model's expert bytes (0.25 or 25%)"
        )
    return Budget(nbytes=parse_size(text), flag=flag)
