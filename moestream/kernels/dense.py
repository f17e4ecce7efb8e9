"""Quantized dense layers: the store's int4 / int8 / q4_0 / q4_1 / K-quant sections of a dense
weight (quant.DenseQuant) in place of nn.Linear / nn.Embedding. The loader builds them from the
store; models only call them.

Kernels (`DENSE_KERNELS`, chosen by the loader from the run's `--kernel` and device):
  native: the C++ `linear` (kernels/native.py; Q8_0 activations, spec `ref.qlinear_q8`), where it
          built and the scheme has groups of 32; else the torch kernels, as the experts fall back;
  cpu:    `kernels/cpu.qlinear_cpu` (torch's packed int4 kernel, bf16 activations; int8 = ref);
  triton: the GPU's (GpuConfig kernel "triton"): up to 8 tokens the Triton GEMV over the sections
          (kernels/triton/dense.py; fp32 sums of the exact dequantized products, one rounding),
          more tokens (a prompt) dequantize + F.linear per call (tensor cores; a transient
          weight). On CPU tensors the GEMV runs in Triton's interpreter (tests);
  ref:    dequantize into the activation dtype + F.linear, per call, on every device: the bits of
          a float model holding the dequantized weight. native / cpu off the CPU run it too.
No kernel keeps a dequantized copy: memory holds only the sections, each weight once. Kernel
triton holds an int4 weight's row-major repack of the same size in their place once the model
is loaded (the decode GEMV reads it 1.4-1.9x faster; `release_sections`), and a q6_k weight as
int8 of group 16 (`triton_form`, exact: the int8 GEMV's 8.5 bits against q6_k's step at 3x
q4_k's instructions); q4_k / q5_k weights (a Q4_K_M file's attention) run the MoE decode
kernels' super-block steps as a GEMV (kernels/triton/dense.py: _kquant_gemv).
The embedding gathers and dequantizes only the rows it is asked for, on every kernel (triton:
in one launch from the sections as stored, dequant.TABLE_FORMATS).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moestream.kernels import native
from moestream.kernels.cpu import qlinear_cpu
from moestream.kernels.ref import dequantize, dequantize_rows
from moestream.quant import (
    QuantScheme,
    int4_from_rows,
    int4_sz_blocked,
    int4_sz_kn,
    int4_to_rows,
    make_scheme,
    pack_int4,
    q6_k_as_int8,
    unpack_int4,
)

DENSE_KERNELS = ("native", "cpu", "triton", "ref")


class QuantWeight(nn.Module):
    """One quantized [N, K] weight as buffers `q` and `s` (int8), `sz` (int4), `d` (q4_0) or `dm`
    (q4_1), as quant.tensor_sections says. Shared by a tied embedding and lm_head (moved once)."""

    def __init__(
        self, scheme: QuantScheme, shape: tuple[int, int], sections: dict[str, torch.Tensor]
    ):
        super().__init__()
        self.scheme, self.shape = scheme, tuple(shape)
        for suffix, t in sections.items():
            self.register_buffer(suffix, t, persistent=False)
        self.suffixes = tuple(sections)
        # the section of scales next to q (s, d, sz or dm); None where they sit in q's blocks
        self.scale_suffix = self.suffixes[1] if len(self.suffixes) > 1 else None

    def sections(self, name: str = "w") -> dict[str, torch.Tensor]:
        """The buffers under section names ('w.q', 'w.s' / 'w.sz'), as kernels/ref.py reads them."""
        return {f"{name}.{s}": getattr(self, s) for s in self.suffixes}

    @staticmethod
    def cat(parts: list[QuantWeight]) -> QuantWeight | None:
        """Rows of several weights of one scheme and K stacked [sum N, K] (exact: quantization
        runs along K; int4 is unpacked and packed again, its 64-row blocks span the seams).
        None when their formats differ."""
        s0, k = parts[0].scheme, parts[0].shape[1]
        if any(p.scheme != s0 or p.shape[1] != k for p in parts):
            return None
        n = sum(p.shape[0] for p in parts)
        if s0.name != "int4":  # row-major (int8, q8_0, q4_0, K-quants): rows stack as they are
            secs = {k: torch.cat([getattr(p, k) for p in parts]) for k in parts[0].suffixes}
        else:
            q = pack_int4(torch.cat([unpack_int4(p.q) for p in parts]))
            sz = torch.cat([int4_sz_kn(p.sz, p.shape[0]) for p in parts], dim=1)
            secs = {"q": q, "sz": int4_sz_blocked(sz)}
        return QuantWeight(s0, (n, k), secs)


def triton_form(w: QuantWeight) -> QuantWeight:
    """The weight as kernel "triton" holds it: a q6_k one (the 4-bit rules' output layer and tied
    table, a GGUF's) as int8 of group 16, its values (q - 32) and steps (d * sc) exactly
    (quant.q6_k_as_int8), which the GEMV reads (it has no q6_k loop), every lookup and prompt
    dequantizes to the blocks' bits, and nothing holds the blocks beside it (255 MB at Qwen3's
    vocabulary); any other weight as it is. The loader applies it before building the modules,
    so a tied table and lm_head share the one form."""
    if w.scheme.name != "q6_k":
        return w
    q, steps = q6_k_as_int8(w.q)
    return QuantWeight(make_scheme("int8", 16), w.shape, {"q": q, "s": steps})


class QuantLinear(nn.Module):
    """y = x W^T (+ b) with W a QuantWeight; x [T, K] -> [T, N] in x's dtype. `wide`: int16
    activations on the native kernel for int8 weights (a SwiGLU down projection's heavy-tailed
    input, as the experts' down projection)."""

    def __init__(
        self, weight: QuantWeight, bias: torch.Tensor | None, kernel: str, wide: bool = False
    ):
        super().__init__()
        if kernel not in DENSE_KERNELS:
            raise ValueError(f"unknown dense kernel {kernel!r}; use {', '.join(DENSE_KERNELS)}")
        self.qweight = weight
        self.register_buffer("bias", bias, persistent=False)
        self.out_features, self.in_features = weight.shape
        self.kernel, self.wide = kernel, wide and weight.scheme.name in ("int8", "q8_0")
        self._triton = None
        # kernel triton: (format, q buffer, scale buffer, group) of what its GEMV reads
        self._gemv: tuple[str, str, str | None, int] | None = None
        if kernel == "triton":  # imported here, not in a compiled forward; triton: the gpu extra
            from moestream.kernels.triton import dense as triton_dense

            self._triton = triton_dense
            self._gemv = self._gemv_operands(weight)

    def _gemv_operands(self, w: QuantWeight) -> tuple[str, str, str | None, int]:
        """The GEMV's operands, made here rather than at the first call (that may be inside a
        compile): an int4 weight's row-major repack (or its sz in [K/g, N, 2] order), else the
        sections as stored (a q6_k weight reaches this kernel in `triton_form`)."""
        s, g = w.scheme, w.scheme.group_size
        if self._triton.rows_layout(s.name, self.out_features, g):
            rows, words = int4_to_rows(w.q, w.sz, g)
            self.register_buffer("rows_q", rows, persistent=False)
            self.register_buffer("rows_sz", words, persistent=False)
            return "int4_rows", "rows_q", "rows_sz", g
        if s.name == "int4":
            self.register_buffer("kn_sz", int4_sz_kn(w.sz, w.shape[0]), persistent=False)
            return "int4", "qweight.q", "kn_sz", g
        # K-quants: their scales are in the blocks (the GEMV's scale operand: q again, unread)
        scales = f"qweight.{w.scale_suffix}" if w.scale_suffix else "qweight.q"
        return s.name, "qweight.q", scales, g

    @property
    def rows_layout(self) -> bool:
        """Kernel triton runs this int4 weight's decode GEMV from a row-major repack held beside
        its sections (buffers rows_q, rows_sz: kernels/triton/dense.py: rows_layout, int4_rows)
        instead of reading the store's 64-row blocks; a prompt dequantizes the sections."""
        return self._gemv is not None and self._gemv[0] == "int4_rows"

    def gemv_unsupported(self, tokens: int) -> str | None:
        """Why the Triton GEMV does not take `tokens` rows of this weight (None when it does)."""
        if self._triton is None:
            return f"the {self.kernel!r} kernel has no GEMV (kernel 'triton' has)"
        quant, _, _, group = self._gemv
        return self._triton.unsupported(quant, self.out_features, self.in_features, group, tokens)

    def resolved_kernel(self, device: torch.device, tokens: int = 1) -> str:
        """The kernel that runs `tokens` rows on `device`: triton where the GEMV takes them (else
        ref); off the CPU the CPU kernels are ref."""
        if self.kernel == "triton":
            return "ref" if self.gemv_unsupported(tokens) else "triton"
        if device.type != "cpu":
            return "ref"
        if self.kernel == "native" and not (
            native.supports(self.qweight.scheme) and native.available()
        ):
            return "cpu"
        return self.kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        w, g = self.qweight, self.qweight.scheme.group_size
        kind = self.resolved_kernel(x.device, x2.shape[0])
        if kind == "triton":  # bias added in fp32 before the one rounding
            quant, q, scales, group = self._gemv
            y = self._triton.gemv(
                x2, self.get_buffer(q), self.get_buffer(scales), self.bias, quant,
                self.out_features, group,
            )  # fmt: skip
        elif kind == "ref":  # F.linear with the bias inside: a float nn.Linear's bits
            y = F.linear(x2, self._dequantized(x.dtype), self.bias)
        else:
            if kind == "native":
                y = native.linear(x2, w.sections(), "w", wide=self.wide).to(x.dtype)
            else:
                y = qlinear_cpu(x2, w.sections(), "w", g)
            if self.bias is not None:
                y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def _dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight in dtype for F.linear, transient: an int4 row repack or (kernel triton) q4_k /
        q5_k blocks by one Triton launch (kernels/triton/dequant.py: the same values as the
        reference, bit for bit, without its fp32 passes; inside torch.compile the reference, over
        the repack taken back to the store's layout, quant.int4_from_rows), else the reference
        over the sections."""
        g = self.qweight.scheme.group_size
        if self.rows_layout:
            from moestream.kernels.triton import dequant

            if dtype in dequant.DTYPES and not torch.compiler.is_compiling():
                return dequant.dequant_int4_rows(self.rows_q, self.rows_sz, g, dtype)
            q, sz = int4_from_rows(self.rows_q, self.rows_sz)
            return dequantize({"w.q": q, "w.sz": sz}, "w", g, dtype)
        if self._triton is not None and self._gemv[0] in self._triton.GEMV_KQUANTS:
            from moestream.kernels.triton import dequant

            # one launch for the reference's unpack + fp32 passes, the same bits
            if dtype in dequant.DTYPES and not torch.compiler.is_compiling():
                return dequant.dequant_kquant_blocks(self.qweight.q, dtype)
        return dequantize(self.qweight.sections(), "w", g, dtype)

    def release_sections(self) -> None:
        """With a row repack (rows_layout), drop the store-layout sections: no path reads them
        any more (the GEMV and a prompt's dequant read the repack), so VRAM holds the weight once
        (566 MB less at Qwen3-30B-A3B's int4 attention). The loader calls it once q/k/v are fused
        (QuantWeight.cat reads the parts' sections)."""
        if self.rows_layout:
            for name in self.qweight.suffixes:
                self.qweight.register_buffer(name, None, persistent=False)

    @staticmethod
    def cat(parts: list[nn.Module]) -> QuantLinear | None:
        """The fused q/k/v projection: one QuantLinear over the stacked rows (biases stacked
        too), or None unless every part is a QuantLinear of one format and kernel."""
        if not all(isinstance(p, QuantLinear) for p in parts):
            return None
        if len({(p.kernel, p.wide, p.bias is None) for p in parts}) != 1:
            return None
        w = QuantWeight.cat([p.qweight for p in parts])
        if w is None:
            return None
        bias = None if parts[0].bias is None else torch.cat([p.bias for p in parts])
        return QuantLinear(w, bias, parts[0].kernel, parts[0].wide)


class RowsOf(nn.Module):
    """Rows [lo, hi) of a fused QuantLinear's output: what q/k/v_proj become once fused, so the
    quantized rows exist once (the decode path calls the fused module; this is for other callers)."""

    def __init__(self, fused: QuantLinear, lo: int, hi: int):
        super().__init__()
        self._fused = (fused,)  # not a submodule: the attention owns the fused projection
        self.lo, self.hi = lo, hi
        self.out_features, self.in_features = hi - lo, fused.in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._fused[0](x)[..., self.lo : self.hi]


class QuantEmbedding(nn.Module):
    """Token ids [T] -> rows [T, D] in `dtype`, dequantizing only the rows looked up. Kernel
    "triton" with a table in one of dequant.TABLE_FORMATS (every quantized format a store holds:
    int4, int8, q8_0, q4_0, q4_1, q5_0, q4_k, q5_k, q6_k): the rows from its sections as stored by
    one launch (kernels/triton/dequant.py: dequant_table_rows, the reference's bits), no copy of
    the table beside them; the reference's gather and unpacking take 9-51 small kernels a
    lookup, which a captured decode step ran every token (an int4 row: 69-80 us of kernels a token
    in the H200 timeline). Other formats and kernels: the reference."""

    def __init__(self, weight: QuantWeight, dtype: torch.dtype, kernel: str = "ref"):
        super().__init__()
        if kernel not in DENSE_KERNELS:
            raise ValueError(f"unknown dense kernel {kernel!r}; use {', '.join(DENSE_KERNELS)}")
        self.qweight, self.dtype = weight, dtype
        self.num_embeddings, self.embedding_dim = weight.shape
        self._table = None  # kernel triton's dequant module when it reads the sections
        if kernel == "triton":  # imported here, not in a compiled forward; triton: the gpu extra
            from moestream.kernels.triton import dequant

            if weight.scheme.name in dequant.TABLE_FORMATS and dtype in dequant.DTYPES:
                self._table = dequant

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat, w = ids.reshape(-1), self.qweight
        g = w.scheme.group_size
        if self._table is not None and not torch.compiler.is_compiling():
            scales = w.scale_suffix and getattr(w, w.scale_suffix)
            rows = self._table.dequant_table_rows(w.scheme.name, w.q, scales, flat, g, self.dtype)
        else:  # (a compiled step traces the reference)
            rows = dequantize_rows(w.sections(), "w", flat, g, self.dtype)
        return rows.view(*ids.shape, self.embedding_dim)
