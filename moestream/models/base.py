"""The decoder stack every supported architecture shares: embed -> layers -> norm -> lm_head.

Model files provide `make_attention(args, i)` and `make_mlp(args, i)` (hybrid models: a whole
`make_layer(args, i)` and their own norm class); this file owns the residual wiring and the forward
pass over one sequence (no batch dimension: the engine serves one request).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from moestream.config import ModelArgs
from moestream.kernels import native
from moestream.kernels.dispatch import TOPK_TRITON_MAX_TOKENS
from moestream.models.layers import Attention, RMSNorm, Rope, SparseMoe


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, attn: nn.Module, mlp: nn.Module):
        super().__init__()
        self.self_attn = attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x, cos, sin, cache, start):
        x, h = self.post_attention_layernorm.add_norm(
            x, self.self_attn(self.input_layernorm(x), cos, sin, cache, start)
        )
        return x + self.mlp(h)


class MoeCausalLM(nn.Module):
    """Parameter names mirror transformers (`model.layers.{i}.self_attn.q_proj.weight`, ...)."""

    def __init__(
        self,
        args: ModelArgs,
        make_attention: Callable | None,
        make_mlp: Callable | None,
        *,
        make_layer: Callable | None = None,
        norm: type[nn.Module] = RMSNorm,
    ):
        super().__init__()
        self.args = args
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        if make_layer is None:

            def make_layer(a: ModelArgs, i: int) -> nn.Module:
                return DecoderLayer(a, make_attention(a, i), make_mlp(a, i))

        self.model.layers = nn.ModuleList(
            make_layer(args, i) for i in range(args.num_hidden_layers)
        )
        self.model.norm = norm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.rope = Rope(args.rope, args.rotary_dim, args.max_position_embeddings)
        self._rope_dev: dict = {}  # (dtype, device) -> cos/sin tables copied once to a GPU
        # models/native_step.py: every layer of a one-token CPU step in one native call, built on
        # first use while the fused ops are on (None: not tried since the last change; False: the
        # model or provider does not qualify).
        self.fused_decode = False
        self._decode_step = None
        self.provider = (
            None  # the Runtime's, handed over by set_provider (the step reads its records)
        )

    def set_fused_decode(self, on: bool) -> None:
        """Run the one-token CPU decode's norms, attention core and softmax router through the
        fused native ops (kernels/native.py) where each module's rule allows; the loader turns
        it on for the native kernels in fp32. Off: the torch code, the ops' reference."""
        if on and not native.available():
            on = False  # said once by native.module(); the torch code runs
        for m in self.modules():
            if isinstance(m, (RMSNorm, Attention, SparseMoe)):
                m.fused_decode = on
        self.fused_decode = on
        self.modules_changed()

    def set_gpu_decode(self, on: bool) -> None:
        """Run a one-token CUDA step's attention core (q/k norm, RoPE, cache write, attention),
        a decode step's routing (router GEMM, softmax top-k) and, outside a compiled step, its
        bf16 norms as one Triton launch each, where each module's rule allows (the loader turns
        it on for the GPU's Triton kernels). Off: the torch code, the kernels' reference."""
        for m in self.modules():
            if isinstance(m, (Attention, SparseMoe, RMSNorm)):
                m.gpu_decode = on

    def modules_changed(self) -> None:
        """The provider, observers or adapters changed: the native decode step is rebuilt (or
        found not to qualify) at the next one-token step."""
        self._decode_step = None

    def _native_step(self, x: torch.Tensor, cache, start):
        """The native decode step for this one-token CPU step, or None (the layers run)."""
        if not (self.fused_decode and x.shape[0] == 1 and isinstance(start, int)):
            return None
        if torch.is_grad_enabled():
            return None
        if self._decode_step is None:
            from moestream.models.native_step import NativeDecodeStep

            self._decode_step = NativeDecodeStep.build(self, self.provider) or False
        step = self._decode_step
        return step if step and step.accepts(x, cache) else None

    @property
    def moe_blocks(self) -> list[SparseMoe]:
        return [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, SparseMoe)]

    @property
    def dtype(self) -> torch.dtype:
        """The run's activation dtype (the final norm's: embedding and lm_head may be quantized)."""
        return self.model.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.norm.weight.device

    def dense_roles(self) -> dict[str, str]:
        """Our parameter name -> role ("linear", "embedding", "output") of each weight that convert
        may quantize (quant.DenseQuant): nn.Linear and nn.Embedding weights, except routers (their
        top-k choice is the model's most rounding-sensitive decision) and a tied lm_head (the
        embedding is the output layer then)."""
        routers = {
            id(m)
            for block in self.moe_blocks
            for m in (block.gate, getattr(block, "shared_expert_gate", None))
            if m is not None
        }
        tied = self.args.tie_word_embeddings
        roles = {}
        for name, m in self.named_modules():
            if id(m) in routers or (tied and m is self.lm_head):
                continue
            if isinstance(m, nn.Embedding):
                roles[f"{name}.weight"] = "output" if tied else "embedding"
            elif type(m) is nn.Linear:
                roles[f"{name}.weight"] = "output" if m is self.lm_head else "linear"
        return roles

    def set_provider(self, provider) -> None:
        self.provider = provider
        for block in self.moe_blocks:
            block.provider = provider
        self.modules_changed()

    def set_observer(self, observer) -> None:
        for block in self.moe_blocks:
            block.observer = observer
        self.modules_changed()

    def _rope_on(self, start, end, x: torch.Tensor):
        """cos/sin on x's device: the CPU tables as they are; on a GPU a copy of the whole table made
        once (a per-step copy from pageable memory would synchronise the stream). A device tensor
        `start` [1] (a captured decode step) gathers its row from the whole table."""
        if isinstance(start, torch.Tensor):  # one gather of both rows: one kernel a step
            both = self._rope_table(self.args.max_position_embeddings, x).index_select(1, start)
            return both[0], both[1]
        if x.device.type == "cpu":
            return self.rope(start, end, x.dtype)
        if self.rope.r.rope_type == "dynamic":  # the table changes with the length
            cos, sin = self.rope(start, end, x.dtype)
            return cos.to(x.device), sin.to(x.device)
        tab = self._rope_table(end, x)
        return tab[0][start:end], tab[1][start:end]

    def _rope_table(self, end: int, x: torch.Tensor) -> torch.Tensor:
        """The whole cos/sin table [2, rows, dim] (at least `end` rows) in x's dtype on x's device,
        made once."""
        key = (x.dtype, x.device)
        tab = self._rope_dev.get(key)
        if tab is None or tab.shape[1] < end:
            cos, sin = self.rope(0, max(end, self.args.max_position_embeddings), x.dtype)
            tab = self._rope_dev[key] = torch.stack([cos, sin]).to(x.device)
        return tab

    def forward(self, ids: torch.Tensor, cache, start, last_only: bool = False) -> torch.Tensor:
        """ids [T] at positions start..start+T-1 -> logits [T, V] (or [1, V] with last_only).
        `start` is an int, or a device tensor [1] with a StaticKVCache (one captured decode step)."""
        x = self.model.embed_tokens(ids)  # [T, D]
        cos, sin = self._rope_on(start, start + ids.shape[0], x)
        step = self._native_step(x, cache, start)
        if step is not None:
            x = step(x, cos, sin, cache, start)
        elif self._chained_norms(x):
            h = self._chained(x, cos, sin, cache, start)
            return self.lm_head(h[-1:] if last_only else h)
        else:
            for layer in self.model.layers:
                x = layer(x, cos, sin, cache, start)
        if last_only:
            x = x[-1:]
        return self.lm_head(self.model.norm(x))

    def _chained_norms(self, x: torch.Tensor) -> bool:
        """Decode rows on the GPU's Triton path through plain DecoderLayers: each residual add
        runs in one launch with the norm after it (`_chained`)."""
        return (
            x.is_cuda
            and x.shape[0] <= TOPK_TRITON_MAX_TOKENS
            and isinstance(self.model.norm, RMSNorm)
            and self.model.norm.gpu_decode
            and all(type(layer) is DecoderLayer for layer in self.model.layers)
        )

    def _chained(self, x, cos, sin, cache, start) -> torch.Tensor:
        """The layers as DecoderLayer.forward computes them, with the MLP's residual add taken
        by the next layer's input norm (the last one's by the final norm): RMSNorm.add_norm, the
        same bits, one launch fewer per add. Returns the final norm's output."""
        layers = self.model.layers
        h = layers[0].input_layernorm(x)
        for i, layer in enumerate(layers):
            x, h = layer.post_attention_layernorm.add_norm(
                x, layer.self_attn(h, cos, sin, cache, start)
            )
            after = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.model.norm
            x, h = after.add_norm(x, layer.mlp(h))
        return h
