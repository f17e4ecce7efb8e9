"""config.json rules shared by more than one model file.

Each model file's `config_fields` picks the rules its architecture follows; a rule only one
architecture has lives in that model file.
"""

from __future__ import annotations

from typing import Any

from moestream.config import ConfigError, require


def routed_experts(cfg: dict[str, Any], path: str) -> dict[str, Any]:
    """Expert count and width under the common spellings (`num_experts`, `moe_intermediate_size`)."""
    # transformers 5 may write `num_local_experts` where hub configs say `num_experts`.
    n_exp = cfg.get("num_experts", cfg.get("num_local_experts"))
    if n_exp is None:
        raise ConfigError(f"{path}: missing required field 'num_experts'")
    moe_inter = cfg.get("moe_intermediate_size", cfg.get("intermediate_size", 0))
    return dict(num_experts=int(n_exp), moe_intermediate_size=int(moe_inter))


def qwen_moe_fields(cfg: dict[str, Any], path: str) -> dict[str, Any]:
    """Qwen2/Qwen3-MoE experts: every `decoder_sparse_step`-th layer is MoE unless it is listed in
    `mlp_only_layers`."""
    experts = routed_experts(cfg, path)
    step = int(cfg.get("decoder_sparse_step", 1))
    dense_only = set(cfg.get("mlp_only_layers") or [])
    n_exp = experts["num_experts"]
    moe_layers = tuple(
        (i not in dense_only) and n_exp > 0 and (i + 1) % step == 0
        for i in range(int(cfg["num_hidden_layers"]))
    )
    return dict(experts, moe_layers=moe_layers)


def first_dense_layers(n_layers: int, n_dense: int, n_experts: int) -> tuple[bool, ...]:
    """moe_layers when the first `n_dense` layers keep a dense MLP (DeepSeek, GLM, LFM2)."""
    return tuple(i >= n_dense and n_experts > 0 for i in range(n_layers))


def layer_windows(types: list[str], window: int | None) -> tuple[int | None, ...]:
    """Per-layer windows from transformers' `layer_types`: only sliding_attention layers slide."""
    return tuple(window if t == "sliding_attention" else None for t in types)


def layer_mixers(types: list[str], known: dict[str, str]) -> tuple[str, ...]:
    """`layer_types` -> ModelArgs.layer_mixers through `known`; any other type is an error."""
    unknown = sorted(set(types) - set(known))
    if unknown:
        raise ConfigError(f"config.json: layer type(s) {', '.join(unknown)} are not supported")
    return tuple(known[t] for t in types)


def deepseek_style_fields(
    cfg: dict[str, Any],
    path: str,
    *,
    first_dense: int,
    routed_scaling: float,
    n_group: int,
    topk_group: int,
) -> dict[str, Any]:
    """DeepSeek-V3 / GLM-4.5 experts, routing, shared-expert and MTP fields; the keyword
    arguments are the type's defaults (its transformers config class)."""
    n_exp = cfg.get("n_routed_experts", cfg.get("num_local_experts"))
    if n_exp is None:
        raise ConfigError(f"{path}: missing required field 'n_routed_experts'")
    moe_inter = int(require(cfg, "moe_intermediate_size", path))
    # transformers reads only first_k_dense_replace (DeepSeek's moe_layer_freq is always 1).
    n_dense = int(cfg.get("first_k_dense_replace", first_dense) or 0)
    return dict(
        num_experts=int(n_exp),
        moe_intermediate_size=moe_inter,
        moe_layers=first_dense_layers(int(cfg["num_hidden_layers"]), n_dense, n_exp),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        n_shared_experts=int(cfg.get("n_shared_experts", 1) or 0),
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", routed_scaling)),
        n_group=int(cfg.get("n_group", n_group) or 1),
        topk_group=int(cfg.get("topk_group", topk_group) or 1),
        num_mtp_layers=int(cfg.get("num_nextn_predict_layers", cfg.get("num_mtp_layers", 1)) or 0),
        use_qk_norm=bool(cfg.get("use_qk_norm", False)),
    )
