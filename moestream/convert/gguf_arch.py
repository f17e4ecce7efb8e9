"""How llama.cpp's architectures map onto moestream's model files: `GgufArch` per
`general.architecture` (`ARCHS`), llama.cpp's tensor names -> Hugging Face's (the tables
`GGUFCheckpoint` classifies by), and `GgufHeader`: a file's metadata keys read as the Hugging
Face config dict of its model_type (each model file's `config_fields` then maps it, as it maps
config.json)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from moestream.errors import CheckpointError


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
SECOND_HALF = {"attn_v_b.weight": "attn_k_b.weight"}
GATING_SOFTMAX, GATING_SIGMOID = 1, 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_*

GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
BLOCK_NAMES = {
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
SHARED_NAMES = {f"ffn_{r}_shexp.weight": f"{r}_proj.weight" for r in ("gate", "up", "down")}
for _g, _h in (
    ("attn_q", "q_proj"),
    ("attn_k", "k_proj"),
    ("attn_v", "v_proj"),
    ("attn_output", "o_proj"),
):
    for _p in ("weight", "bias"):
        BLOCK_NAMES[f"{_g}.{_p}"] = f"self_attn.{_h}.{_p}"
EXPERT_NAMES = {
    "ffn_gate_exps.weight": "gate",
    "ffn_up_exps.weight": "up",
    "ffn_down_exps.weight": "down",
}
# Tensors llama.cpp's converter fuses on request (`--fuse-gate-up-exps`: gate rows then up rows of
# each expert, written for qwen35moe / qwen3next; `--fuse-qkv`: q, k, v rows, every architecture
# with attn_qkv): read as their parts, row ranges of one tensor.
GATE_UP = "ffn_gate_up_exps.weight"


def fused_gate_up(roles: dict[str, str]) -> bool:
    """Whether a layer's gate and up experts are one tensor (`ffn_gate_up_exps`, its gate rows
    then its up rows): both roles then name it."""
    return roles.get("gate") is not None and roles.get("gate") == roles.get("up")


QKV = {"attn_qkv.weight": "weight", "attn_qkv.bias": "bias"}
# gpt-oss's expert biases, stacked [E, I] (gate, up) and [E, D] (down)
EXPERT_BIASES = {f"ffn_{r}_exps.bias": r for r in ("gate", "up", "down")}
BLK = re.compile(r"^blk\.(\d+)\.(.+)$")
# llama.cpp's gpt-oss constants (llm_graph's LLM_FFN_SWIGLU_OAI_MOE): no GGUF key holds them.
GPT_OSS_SWIGLU = {"swiglu_alpha": 1.702, "swiglu_limit": 7.0}


def _f32(v: float) -> float:
    """A float32 metadata value as the decimal it was written from (1e-06, not 9.99999997e-07)."""
    return float(str(np.float32(v)))


class GgufHeader:
    """A GGUF's metadata and tensor index (name -> the reader's tensor) under its architecture:
    metadata keys (`key`, `arch_key`: a missing one named) and the config dict they make."""

    def __init__(self, folder: Path, meta: dict[str, Any], tensors: dict[str, Any]):
        self.folder, self.meta, self.tensors = folder, meta, tensors
        arch_name = self.key("general.architecture")
        if arch_name not in ARCHS:
            raise CheckpointError(
                f"{folder}: general.architecture {arch_name!r} is not supported; "
                f"supported: {', '.join(ARCHS)}"
            )
        self.arch_name, self.arch = arch_name, ARCHS[arch_name]
        # llama.cpp counts multi-token-prediction layers (glm4moe's `nextn`) in block_count and
        # writes them after the trunk; moestream runs the trunk, so their tensors are skipped
        self.mtp_layers = int(self.arch_key("nextn_predict_layers", 0))
        self.n_layers = int(self.arch_key("block_count")) - self.mtp_layers
        self.kv_per_layer: list[int] | None = None  # head_count_kv per layer, where a list

    def key(self, key: str, default: Any = ...) -> Any:
        if key in self.meta:
            return self.meta[key]
        if default is ...:
            raise CheckpointError(f"{self.folder}: metadata key {key!r} is missing")
        return default

    def arch_key(self, key: str, default: Any = ...) -> Any:
        return self.key(f"{self.arch_name}.{key}", default)

    def hf_config(self, experts: dict[int, dict[str, str]], attention_bias: bool) -> dict[str, Any]:
        """The metadata as a Hugging Face config dict of the arch's model_type; `experts`: MoE layer
        -> role -> tensor name (one tensor for gate and up where they are fused)."""
        heads = int(self.arch_key("attention.head_count"))
        hidden = int(self.arch_key("embedding_length"))
        kv = self.arch_key("attention.head_count_kv", heads)
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
        first = min(experts)
        gate = self.tensors[experts[first]["gate"]]
        _, inter, n_exp = (int(x) for x in gate.shape)  # ne [D, I, E] ([D, 2I, E] fused)
        inter //= 2 if fused_gate_up(experts[first]) else 1
        vocab = int(self.tensors["token_embd.weight"].shape[1])
        cfg: dict[str, Any] = {
            "model_type": self.arch.model_type,
            "vocab_size": vocab,
            "hidden_size": hidden,
            "num_hidden_layers": n_layers,
            "num_attention_heads": heads,
            "num_key_value_heads": int(kv),
            "head_dim": int(self.arch_key("attention.key_length", hidden // heads)),
            "rms_norm_eps": _f32(self.arch_key("attention.layer_norm_rms_epsilon")),
            "max_position_embeddings": int(self.arch_key("context_length", 4096)),
            "rope_parameters": self._rope(),
            "num_experts_per_tok": int(self.arch_key("expert_used_count")),
            "norm_topk_prob": bool(self.arch_key("expert_weights_norm", self.arch.norm_topk_prob)),
            "tie_word_embeddings": "output.weight" not in self.tensors,
            "attention_bias": attention_bias,
            "hidden_act": "silu",
            "bos_token_id": self._special_id("bos"),
            "eos_token_id": self._eos_ids(),
        }
        if int(self.arch_key("expert_count", n_exp)) != n_exp:
            raise CheckpointError(
                f"{self.folder}: {self.arch_name}.expert_count is "
                f"{self.arch_key('expert_count')}, tensor {gate.name!r} holds {n_exp} experts"
            )
        dense_layers = [i for i in range(n_layers) if i not in experts]
        mt = self.arch.model_type
        if mt == "mixtral":
            cfg.update(num_local_experts=n_exp, intermediate_size=inter, sliding_window=None)
            if dense_layers:
                raise CheckpointError(
                    f"{self.folder}: llama layer(s) {dense_layers} have no experts"
                )
        else:
            cfg.update(num_experts=n_exp, moe_intermediate_size=inter, mlp_only_layers=dense_layers)
            cfg["intermediate_size"] = int(self.arch_key("feed_forward_length", inter))
        if mt == "qwen2_moe":
            shared = self.tensors.get("blk.0.ffn_gate_shexp.weight")
            cfg["shared_expert_intermediate_size"] = 0 if shared is None else int(shared.shape[1])
            cfg.update(qkv_bias=cfg["attention_bias"], use_sliding_window=False)
        if mt == "olmoe":
            cfg["clip_qkv"] = self.arch_key("attention.clamp_kqv", None)
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
        lead = int(self.arch_key("leading_dense_block_count", 0))
        if dense_layers != list(range(lead)):
            raise CheckpointError(
                f"{self.folder}: layers {dense_layers} have no experts, but "
                f"{self.arch_name}.leading_dense_block_count is {lead}"
            )
        return lead

    def _check_sigmoid(self, absent: int = GATING_SIGMOID) -> None:
        """`absent`: the gating llama.cpp assumes without the key (deepseek2: softmax, V2's)."""
        key = f"{self.arch_name}.expert_gating_func"
        gating = int(self.key(key, absent))
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
            "conv_L_cache": int(self.arch_key("shortconv.l_cache")),
            "conv_bias": False,  # llama.cpp's LFM2 has no conv biases (a bias tensor is refused)
            "num_dense_layers": self._lead_dense(dense_layers),
            "use_expert_bias": f"blk.{n - 1}.exp_probs_b.bias" in self.tensors,
            "routed_scaling_factor": 1.0,
            "norm_eps": cfg["rms_norm_eps"],
            "tie_embedding": cfg["tie_word_embeddings"],
        }

    def _grouped_sigmoid_fields(self, cfg: dict[str, Any], dense_layers: list[int], n_exp: int):
        """glm4moe / deepseek2: leading dense layers, shared experts, group-limited top-k and
        scaled weights (llama.cpp's keys and defaults: no scale written means 1, no groups 1)."""
        lead = self._lead_dense(dense_layers)
        shexp = self.tensors.get(f"blk.{lead}.ffn_gate_shexp.weight")
        n_shared = int(self.arch_key("expert_shared_count", 0 if shexp is None else 1))
        if shexp is not None and int(shexp.shape[1]) != n_shared * cfg["moe_intermediate_size"]:
            raise CheckpointError(
                f"{self.folder}: ffn_gate_shexp holds {int(shexp.shape[1])} rows, not "
                f"expert_shared_count {n_shared} x {cfg['moe_intermediate_size']}"
            )
        return {
            "n_routed_experts": n_exp,
            "n_shared_experts": n_shared,
            "first_k_dense_replace": lead,
            "routed_scaling_factor": _f32(self.arch_key("expert_weights_scale", 1.0)) or 1.0,
            "n_group": int(self.arch_key("expert_group_count", 1)) or 1,
            "topk_group": int(self.arch_key("expert_group_used_count", 1)) or 1,
            "num_nextn_predict_layers": 0,  # the MTP layers' tensors were not read
        }

    def _glm4_fields(self, cfg: dict[str, Any], dense_layers: list[int], n_exp: int) -> dict:
        """glm4moe: sigmoid routing with a selection bias, group-limited top-k, scaled weights,
        leading dense layers, shared experts, partial rotary (llama.cpp's keys and defaults)."""
        self._check_sigmoid()
        head_dim = cfg["head_dim"]
        rot = int(self.arch_key("rope.dimension_count", head_dim))
        return {
            **self._grouped_sigmoid_fields(cfg, dense_layers, n_exp),
            "partial_rotary_factor": rot / head_dim,
            "use_qk_norm": "blk.0.attn_q_norm.weight" in self.tensors,
        }

    def _deepseek2_fields(self, cfg: dict[str, Any], dense_layers: list[int], n_exp: int) -> dict:
        """deepseek2: the MLA dims (llama.cpp writes attention as MQA over the latent: head_count_kv
        1, key_length r + rope; the per-head sizes under key_length_mla / value_length_mla, or, in
        files before the kv_b split, key_length / value_length themselves), interleaved RoPE on
        the rope part, yarn's mscale from yarn_log_multiplier, DeepSeek-V3's sigmoid routing."""
        self._check_sigmoid(absent=GATING_SOFTMAX)
        heads, r = cfg["num_attention_heads"], int(self.arch_key("attention.kv_lora_rank"))
        rope = int(self.arch_key("rope.dimension_count"))
        qk = int(self.arch_key("attention.key_length_mla", self.arch_key("attention.key_length")))
        vd = self.arch_key("attention.value_length_mla", self.arch_key("attention.value_length"))
        q_lora = self.arch_key("attention.q_lora_rank", None)
        mqa = self.tensors.get("blk.0.attn_kv_a_mqa.weight")
        if mqa is not None and int(mqa.shape[1]) != r + rope:
            raise CheckpointError(
                f"{self.folder}: tensor 'blk.0.attn_kv_a_mqa.weight' has {int(mqa.shape[1])} rows, "
                f"not {self.arch_name}.attention.kv_lora_rank {r} + rope.dimension_count {rope}"
            )
        rope_parameters = dict(cfg["rope_parameters"])
        log_mul = self.arch_key("rope.scaling.yarn_log_multiplier", None)
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
        recurrent = self.arch_key("attention.recurrent_layers", None)
        if recurrent is None:
            every = int(self.arch_key("full_attention_interval", 4))
            recurrent = [(i + 1) % every != 0 for i in range(n)]
        recurrent = list(recurrent)[:n]  # MTP layers, after the trunk, are not recurrent
        n_v = int(self.arch_key("ssm.time_step_rank"))
        inner = int(self.arch_key("ssm.inner_size"))
        shexp = self.tensors.get("blk.0.ffn_gate_shexp.weight")
        rot = int(self.arch_key("rope.dimension_count"))
        self._check_text_mrope(rot // 2)
        return {
            "layer_types": ["linear_attention" if x else "full_attention" for x in recurrent],
            "linear_conv_kernel_dim": int(self.arch_key("ssm.conv_kernel")),
            "linear_num_key_heads": int(self.arch_key("ssm.group_count")),
            "linear_num_value_heads": n_v,
            "linear_key_head_dim": int(self.arch_key("ssm.state_size")),
            "linear_value_head_dim": inner // n_v,
            "shared_expert_intermediate_size": 0 if shexp is None else int(shexp.shape[1]),
            "partial_rotary_factor": rot / cfg["head_dim"],
        }

    def _check_text_mrope(self, pairs: int) -> None:
        """qwen35moe's interleaved mrope (llama.cpp's IMROPE) is the plain RoPE for text only where
        `rope.dimension_sections` give every rotary pair a temporal / height / width section: a
        pair left on the 4th, which llama.cpp holds at position 0 for text, never rotates there
        (ggml-cpu ops.cpp `ggml_mrope_cache_init`, llama-graph.cpp "4th dim is 0"), where the
        Hugging Face model rotates it. Hub files' [11, 11, 10] cover all 32 pairs; without the key
        (a config without mrope_section; llama.cpp requires it) RoPE is plain."""
        key = f"{self.arch_name}.rope.dimension_sections"
        sections = [int(s) for s in self.key(key, [1, 1, 1])][:4]
        total = sum(sections)
        if len(sections) < 3 or total <= 0:
            raise CheckpointError(f"{self.folder}: {key} {sections} gives no rotary pair a section")
        # pair i's sector i % total takes section sector % 3 if sector < 3 x that section's size
        left = [i for i in range(pairs) if (s := i % total) >= 3 * sections[s % 3]]
        if left:
            raise CheckpointError(
                f"{self.folder}: {key} {sections} leaves rotary pair(s) {left} of {pairs} on "
                "llama.cpp's 4th mrope position, which it holds at 0 for text: llama.cpp never "
                "rotates them, the Hugging Face model does; not supported (the hub files' "
                "sections cover every pair)"
            )

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
        pattern = self.arch_key("attention.sliding_window_pattern", 2)
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
        base_swa = self.arch_key("rope.freq_base_swa", None)
        if base_swa is not None and _f32(base_swa) != cfg["rope_parameters"]["rope_theta"]:
            raise CheckpointError(
                f"{self.folder}: {self.arch_name}.rope.freq_base_swa {_f32(base_swa)} differs "
                "from rope.freq_base: gpt_oss has one RoPE base for every layer"
            )
        return {
            "num_local_experts": cfg["num_experts"],
            "sliding_window": int(self.arch_key("attention.sliding_window")),
            "layer_types": ["sliding_attention" if x else "full_attention" for x in slides],
            **GPT_OSS_SWIGLU,
        }

    def _rope(self) -> dict[str, Any]:
        rope: dict[str, Any] = {"rope_theta": _f32(self.arch_key("rope.freq_base", 10000.0))}
        kind = self.arch_key("rope.scaling.type", "none")
        if kind in ("none", ""):
            return {**rope, "rope_type": "default"}
        if kind not in ("linear", "yarn"):
            raise CheckpointError(
                f"{self.folder}: {self.arch_name}.rope.scaling.type {kind!r} is not supported "
                "(supported: none, linear, yarn)"
            )
        rope.update(rope_type=kind, factor=float(self.arch_key("rope.scaling.factor")))
        if kind == "yarn":
            rope["original_max_position_embeddings"] = int(
                self.arch_key("rope.scaling.original_context_length")
            )
            for ours in ("beta_fast", "beta_slow"):  # llama.cpp's defaults (32, 1) as HF's
                if (v := self.arch_key(f"rope.scaling.yarn_{ours}", None)) is not None:
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
