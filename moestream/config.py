"""Frozen, validated configuration: model arguments (from config.json), sampling, sizes.

Model files read everything they need from `ModelArgs`; nothing else parses config.json.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = (
    "qwen3_moe",
    "qwen2_moe",
    "mixtral",
    "olmoe",
    "glm4_moe",
    "deepseek_v3",
    "gpt_oss",
    "qwen3_5_moe",
    "lfm2_moe",
)
# config.json model_type -> the model file that runs it (text-only variants of multimodal models).
MODEL_TYPE_ALIASES = {"qwen3_5_moe_text": "qwen3_5_moe"}


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
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"model_type {self.model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
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
    mt = cfg.get("model_type")
    params = dict(
        cfg.get("rope_parameters") or cfg.get("rope_scaling") or _DEFAULT_ROPE.get(mt, {})
    )
    theta = params.get("rope_theta", cfg.get("rope_theta", _DEFAULT_THETA.get(mt, 10000.0)))
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


# transformers' defaults when config.json names no RoPE parameters (GptOssConfig.__post_init__).
_DEFAULT_ROPE = {
    "gpt_oss": dict(
        rope_type="yarn",
        factor=32.0,
        beta_fast=32.0,
        beta_slow=1.0,
        truncate=False,
        original_max_position_embeddings=4096,
    )
}
_DEFAULT_THETA = {"gpt_oss": 150000.0}


def _require(cfg: dict[str, Any], key: str, path: str) -> Any:
    if key not in cfg:
        raise ConfigError(f"{path}: missing required field {key!r}")
    return cfg[key]


def model_args_from_dict(cfg: dict[str, Any], path: str = "config.json") -> ModelArgs:
    """Build ModelArgs from a Hugging Face config dict, applying each architecture's defaults."""
    mt = cfg.get("model_type")
    if mt == "qwen3_5_moe" and "text_config" in cfg:
        cfg = _text_config(cfg)
    mt = MODEL_TYPE_ALIASES.get(mt, mt)
    if mt == "lfm2_moe":
        cfg = _lfm2_config(cfg)
    if mt is None:
        raise ConfigError(
            f"{path}: no 'model_type' field; is this a Hugging Face checkpoint folder?"
        )
    if mt not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"{path}: model_type {mt!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    n_layers = int(_require(cfg, "num_hidden_layers", path))
    hidden = int(_require(cfg, "hidden_size", path))
    n_heads = int(_require(cfg, "num_attention_heads", path))
    n_kv = cfg.get("num_key_value_heads") or n_heads
    head_dim = cfg.get("head_dim") or hidden // n_heads
    extra = _deepseek_style_fields(cfg, mt) if mt in _DEEPSEEK_STYLE else {}
    if mt == "deepseek_v3":
        head_dim = extra["qk_rope_head_dim"]  # RoPE and the config's head_dim cover the rope part
    if mt == "mixtral":
        n_exp, moe_inter = cfg.get("num_local_experts", 8), cfg.get("intermediate_size", 14336)
    elif mt in _DEEPSEEK_STYLE:
        n_exp = cfg.get("n_routed_experts", cfg.get("num_local_experts"))
        if n_exp is None:
            raise ConfigError(f"{path}: missing required field 'n_routed_experts'")
        moe_inter = int(_require(cfg, "moe_intermediate_size", path))
    else:
        # transformers 5 may write `num_local_experts` where hub configs say `num_experts`.
        n_exp = cfg.get("num_experts", cfg.get("num_local_experts"))
        if n_exp is None:
            raise ConfigError(f"{path}: missing required field 'num_experts'")
        moe_inter = int(cfg.get("moe_intermediate_size", cfg.get("intermediate_size", 0)))
    if mt == "qwen3_5_moe":
        extra.update(_linear_attention_fields(cfg, n_layers))
    if mt == "lfm2_moe":
        extra.update(_lfm2_fields(cfg, n_layers))
    if mt in ("qwen3_moe", "qwen2_moe"):
        step = int(cfg.get("decoder_sparse_step", 1))
        dense_only = set(cfg.get("mlp_only_layers") or [])
        moe_layers = tuple(
            (i not in dense_only) and n_exp > 0 and (i + 1) % step == 0 for i in range(n_layers)
        )
    elif mt == "lfm2_moe":
        dense = int(cfg.get("num_dense_layers", 2))
        moe_layers = tuple(i >= dense and n_exp > 0 for i in range(n_layers))
    elif mt in _DEEPSEEK_STYLE:
        # transformers reads only first_k_dense_replace (DeepSeek's moe_layer_freq is always 1).
        first_dense = int(cfg.get("first_k_dense_replace", 3 if mt == "deepseek_v3" else 1) or 0)
        moe_layers = tuple(i >= first_dense and n_exp > 0 for i in range(n_layers))
    else:
        moe_layers = (True,) * n_layers
    sliding = _sliding_windows(cfg, mt, n_layers)
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    return ModelArgs(
        model_type=mt,
        vocab_size=int(_require(cfg, "vocab_size", path)),
        hidden_size=hidden,
        num_hidden_layers=n_layers,
        num_attention_heads=n_heads,
        num_key_value_heads=int(n_kv),
        head_dim=int(head_dim),
        intermediate_size=int(cfg.get("intermediate_size", 0)),
        moe_intermediate_size=int(moe_inter),
        num_experts=int(n_exp),
        num_experts_per_tok=int(_require(cfg, "num_experts_per_tok", path)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        rope=_rope_from_config(cfg),
        norm_topk_prob=True
        if mt in ("mixtral", "qwen3_5_moe")  # qwen3_5_moe always renormalises
        else bool(cfg.get("norm_topk_prob", mt in _DEEPSEEK_STYLE)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", mt == "gpt_oss")),
        qkv_bias=bool(cfg.get("qkv_bias", mt == "qwen2_moe")),
        clip_qkv=cfg.get("clip_qkv"),
        shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size", 0)),
        moe_layers=moe_layers,
        sliding_windows=sliding,
        hidden_act=cfg.get("hidden_act", "silu"),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
        torch_dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
        partial_rotary_factor=_partial_rotary_factor(cfg, mt),
        **extra,
        **(_gpt_oss_fields(cfg) if mt == "gpt_oss" else {}),
    )


_DEEPSEEK_STYLE = ("glm4_moe", "deepseek_v3")


def _text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """Multimodal checkpoints (Qwen3.5) nest the language model's fields under text_config; the
    top level keeps tie_word_embeddings (and sometimes eos_token_id)."""
    text = dict(cfg["text_config"])
    text["model_type"] = "qwen3_5_moe"
    for key in ("eos_token_id", "bos_token_id", "torch_dtype", "dtype"):
        if key in cfg and key not in text:
            text[key] = cfg[key]
    if "tie_word_embeddings" in cfg:  # transformers ties by the top-level config
        text["tie_word_embeddings"] = cfg["tie_word_embeddings"]
    return text


def _lfm2_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """LFM2's own spellings and defaults (Lfm2MoeConfig): norm_eps, tie_embedding, theta 1e6,
    renormalised top-k."""
    out = dict(cfg)
    out["rms_norm_eps"] = cfg.get("norm_eps", 1e-5)
    out["tie_word_embeddings"] = cfg.get("tie_embedding", cfg.get("tie_word_embeddings", True))
    out.setdefault("norm_topk_prob", True)
    if "rope_theta" not in cfg and "rope_theta" not in (cfg.get("rope_parameters") or {}):
        out["rope_theta"] = 1000000.0
    return out


def _lfm2_fields(cfg: dict[str, Any], n_layers: int) -> dict[str, Any]:
    """Which layers are short convolutions (layer_types, or older configs' full_attn_idxs)."""
    types = cfg.get("layer_types")
    if types is None:
        if "full_attn_idxs" not in cfg:
            raise ConfigError("config.json: lfm2_moe needs layer_types (or full_attn_idxs)")
        full = set(cfg["full_attn_idxs"])
        types = ["full_attention" if i in full else "conv" for i in range(n_layers)]
    known = {"full_attention": "attention", "conv": "conv"}
    unknown = sorted(set(types) - set(known))
    if unknown:
        raise ConfigError(f"config.json: layer type(s) {', '.join(unknown)} are not supported")
    return dict(
        layer_mixers=tuple(known[t] for t in types),
        conv_kernel=int(cfg.get("conv_L_cache", 3)),
        conv_bias=bool(cfg.get("conv_bias", False)),
        selection_bias=bool(cfg.get("use_expert_bias", True)),
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
    )


def _linear_attention_fields(cfg: dict[str, Any], n_layers: int) -> dict[str, Any]:
    """Qwen3.5 hybrid layers: layer_types (or every full_attention_interval-th layer full
    attention, as Qwen3_5MoeTextConfig) and the Gated DeltaNet dims, with transformers' defaults."""
    types = cfg.get("layer_types")
    if types is None:
        every = int(cfg.get("full_attention_interval", 4))
        types = [
            "full_attention" if (i + 1) % every == 0 else "linear_attention"
            for i in range(n_layers)
        ]
    known = {"full_attention": "attention", "linear_attention": "linear_attention"}
    unknown = sorted(set(types) - set(known))
    if unknown:
        raise ConfigError(f"config.json: layer type(s) {', '.join(unknown)} are not supported")
    return dict(
        layer_mixers=tuple(known[t] for t in types),
        linear_conv_kernel_dim=int(cfg.get("linear_conv_kernel_dim", 4)),
        linear_num_key_heads=int(cfg.get("linear_num_key_heads", 16)),
        linear_num_value_heads=int(cfg.get("linear_num_value_heads", 32)),
        linear_key_head_dim=int(cfg.get("linear_key_head_dim", 128)),
        linear_value_head_dim=int(cfg.get("linear_value_head_dim", 128)),
    )


def _partial_rotary_factor(cfg: dict[str, Any], mt: str) -> float:
    # transformers 5 keeps it in rope_parameters; hub configs have it at the top level. GLM-4.5
    # rotates half of each head when neither says (Glm4MoeConfig.__post_init__).
    params = cfg.get("rope_parameters") or {}
    default = {"glm4_moe": 0.5, "qwen3_5_moe": 0.25}.get(mt, 1.0)
    return float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", default)))


def _deepseek_style_fields(cfg: dict[str, Any], mt: str) -> dict[str, Any]:
    """Routing, shared-expert, MTP and (deepseek_v3) latent-attention fields, with transformers'
    defaults for each type."""
    ds = mt == "deepseek_v3"
    out: dict[str, Any] = dict(
        n_shared_experts=int(cfg.get("n_shared_experts", 1) or 0),
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 2.5 if ds else 1.0)),
        n_group=int(cfg.get("n_group", 8 if ds else 1) or 1),
        topk_group=int(cfg.get("topk_group", 4 if ds else 1) or 1),
        num_mtp_layers=int(cfg.get("num_nextn_predict_layers", cfg.get("num_mtp_layers", 1)) or 0),
        use_qk_norm=bool(cfg.get("use_qk_norm", False)),
    )
    if ds:
        q_lora = cfg.get("q_lora_rank", 1536)
        out.update(
            q_lora_rank=None if q_lora is None else int(q_lora),
            kv_lora_rank=int(cfg.get("kv_lora_rank", 512)),
            qk_nope_head_dim=int(cfg.get("qk_nope_head_dim", 128)),
            qk_rope_head_dim=int(cfg.get("qk_rope_head_dim", 64)),
            v_head_dim=int(cfg.get("v_head_dim", 128)),
            rope_interleave=bool(cfg.get("rope_interleave", True)),
        )
    return out


def _gpt_oss_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    return dict(
        expert_bias=True,
        swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
        swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
    )


def _sliding_windows(cfg: dict[str, Any], mt: str, n_layers: int) -> tuple[int | None, ...]:
    window = cfg.get("sliding_window")
    if mt == "gpt_oss":  # no use_sliding_window flag: layer_types, sliding on even layers
        types = cfg.get("layer_types") or [
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)
        ]
        return tuple(window if t == "sliding_attention" else None for t in types)
    if mt == "mixtral":
        return (window,) * n_layers
    if mt == "olmoe" or not cfg.get("use_sliding_window", False) or window is None:
        return (None,) * n_layers
    if mt == "qwen2_moe":
        types = cfg.get("layer_types")
        if types is None:
            first = int(cfg.get("max_window_layers", n_layers))
            types = [
                "sliding_attention" if i >= first else "full_attention" for i in range(n_layers)
            ]
        return tuple(window if t == "sliding_attention" else None for t in types)
    return (window,) * n_layers  # qwen3_moe: every layer when use_sliding_window


def load_model_args(folder: str | Path) -> ModelArgs:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ConfigError(
            f"{path} not found: -m must point at a Hugging Face checkpoint folder (with config.json) "
            "or a moestream store"
        )
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON ({e}); re-download the checkpoint") from e
    return model_args_from_dict(cfg, str(path))


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

    def __post_init__(self):
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


def parse_size(text: str | int) -> int:
    """'512MiB' / '2G' / '1.5GiB' / '4096' -> bytes (binary units)."""
    if isinstance(text, int):
        return text
    m = _SIZE.match(str(text))
    if not m:
        raise ConfigError(
            f"cannot read size {text!r}: use bytes or a KiB/MiB/GiB suffix, e.g. 512MiB"
        )
    unit = (m.group(2) or "").upper().rstrip("B").rstrip("I") if m.group(2) else ""
    return int(float(m.group(1)) * _UNITS[unit])
