"""Quantization schemes for expert weights and the byte layout of one expert record.

A scheme is a frozen dataclass, never a flag: `bf16`, `int8` (symmetric per K-block of 32, the
"sym8" of seed 001) and `int4` (per group of 32, asymmetric by default: see INT4_CHOICE). Every
2-D weight [N, K] (N outputs, K inputs) is quantized along K, so concatenating gate and up rows
into w13 [2I, D] changes nothing per row.

Tensor sections (what `kernels/ref.py` dequantizes and `kernels/cpu.py` multiplies in place):
  bf16: `q` bf16 [N, K]
  int8: `q` int8 [N, K], `s` fp32 [N, K/g]             w = q * s
  int4: `q` uint8 [N, K/2] packed as torch's CPU tinygemm kernel packs it on AVX-512 (blocks of
        64 rows; see pack_int4), `sz` bf16 [K/g, N, 2] (scale, zero)   w = (q - 8) * s + z
An expert record holds w13 [2I, D] then w2 [D, I] (then, for experts with biases (gpt_oss),
`b13` fp32 [2I] and `b2` fp32 [D], never quantized), each section 64-byte aligned, and is padded
to a 4 KiB multiple so O_DIRECT can read it in place.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moestream.config import ConfigError

RECORD_ALIGN = 4096  # O_DIRECT needs offsets, sizes and buffers aligned to the logical block
SECTION_ALIGN = 64
INT4_BLOCK_N = 64  # rows per packed block of torch's AVX-512 int4 CPU kernel

# Measured on gaussian weights, group 32 (tests/test_quant.py::test_int4_asymmetric_is_better):
# relative RMS weight error symmetric 0.097, asymmetric 0.078 (1536x2048); asymmetric also uses the kernel's
# zero point for free, so int4 is asymmetric.
INT4_CHOICE = "asymmetric"


@dataclass(frozen=True, slots=True)
class QuantScheme:
    name: str  # bf16 | int8 | int4
    group_size: int = 32
    symmetric: bool = True

    def __post_init__(self):
        if self.name not in ("bf16", "int8", "int4"):
            raise ConfigError(f"unknown quantization {self.name!r}; use bf16, int8 or int4")
        if self.group_size <= 0 or self.group_size % 2:
            raise ConfigError(f"group size must be a positive even number, got {self.group_size}")

    def to_json(self) -> dict:
        return {"name": self.name, "group_size": self.group_size, "symmetric": self.symmetric}


def make_scheme(name: str, group_size: int = 32) -> QuantScheme:
    """The scheme a `--quant` name means (int4 asymmetric, int8 symmetric)."""
    return QuantScheme(name, group_size, symmetric=name != "int4" or INT4_CHOICE == "symmetric")


@dataclass(frozen=True, slots=True)
class Section:
    name: str  # e.g. "w13.q"
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # within the record

    @property
    def nbytes(self) -> int:
        n = torch.tensor([], dtype=self.dtype).element_size()
        for s in self.shape:
            n *= s
        return n


DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.int8: "int8", torch.uint8: "uint8"}
DTYPE_NAMES[torch.float32] = "float32"


def tensor_sections(scheme: QuantScheme, name: str, n: int, k: int) -> list[tuple]:
    """(name, dtype, shape) of one weight [n, k] under scheme."""
    g = scheme.group_size
    if scheme.name != "bf16" and k % g:
        raise ConfigError(
            f"{name}: input dim {k} is not a multiple of group size {g}; pick --group-size dividing it"
        )
    if scheme.name == "bf16":
        return [(f"{name}.q", torch.bfloat16, (n, k))]
    if scheme.name == "int8":
        return [(f"{name}.q", torch.int8, (n, k)), (f"{name}.s", torch.float32, (n, k // g))]
    if n % 2:
        raise ConfigError(f"{name}: int4 packing needs an even number of rows, got {n}")
    return [(f"{name}.q", torch.uint8, (n, k // 2)), (f"{name}.sz", torch.bfloat16, (k // g, n, 2))]


@dataclass(frozen=True, slots=True)
class RecordLayout:
    scheme: QuantScheme
    sections: tuple[Section, ...]
    size: int  # padded to RECORD_ALIGN

    @staticmethod
    def build(scheme: QuantScheme, hidden: int, inter: int, bias: bool = False) -> RecordLayout:
        specs = [
            spec
            for name, n, k in (("w13", 2 * inter, hidden), ("w2", hidden, inter))
            for spec in tensor_sections(scheme, name, n, k)
        ]
        if bias:
            specs += [("b13", torch.float32, (2 * inter,)), ("b2", torch.float32, (hidden,))]
        secs, off = [], 0
        for sname, dtype, shape in specs:
            s = Section(sname, dtype, shape, off)
            secs.append(s)
            off = -(-(off + s.nbytes) // SECTION_ALIGN) * SECTION_ALIGN
        size = -(-off // RECORD_ALIGN) * RECORD_ALIGN
        return RecordLayout(scheme, tuple(secs), size)

    def views(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        """Typed views of a uint8 record buffer (no copy)."""
        out = {}
        for s in self.sections:
            raw = buf[s.offset : s.offset + s.nbytes]
            out[s.name] = raw.view(s.dtype).view(s.shape)
        return out

    def to_json(self) -> dict:
        return {
            "size": self.size,
            "sections": [
                {
                    "name": s.name,
                    "dtype": DTYPE_NAMES[s.dtype],
                    "shape": list(s.shape),
                    "offset": s.offset,
                }
                for s in self.sections
            ],
        }


# ---- quantizers (convert time) --------------------------------------------------------------
def quantize(scheme: QuantScheme, w: torch.Tensor) -> dict[str, torch.Tensor]:
    """w [N, K] float -> section suffix ('q', 's', 'sz') -> tensor."""
    w = w.float()
    if scheme.name == "bf16":
        return {"q": w.to(torch.bfloat16)}
    n, k = w.shape
    g = scheme.group_size
    blocks = w.view(n, k // g, g)
    if scheme.name == "int8":
        s = blocks.abs().amax(-1) / 127.0
        s = torch.where(s == 0, torch.ones_like(s), s)
        q = torch.round(blocks / s[..., None]).clamp(-127, 127).to(torch.int8)
        return {"q": q.view(n, k), "s": s}
    return _quantize_int4(scheme, blocks)


def _quantize_int4(scheme: QuantScheme, blocks: torch.Tensor) -> dict[str, torch.Tensor]:
    n, kg, g = blocks.shape
    if scheme.symmetric:
        s = blocks.abs().amax(-1) / 7.0
        z = torch.zeros_like(s)
    else:
        lo, hi = blocks.amin(-1), blocks.amax(-1)
        s = (hi - lo) / 15.0
        z = lo + 8 * s  # w = (q - 8) * s + z  with q = 0 at the group minimum
    s = torch.where(s == 0, torch.ones_like(s), s)
    # Round scale/zero to their stored dtype first so q is chosen against what dequant will see.
    s, z = s.to(torch.bfloat16).float(), z.to(torch.bfloat16).float()
    q = torch.round((blocks - z[..., None]) / s[..., None] + 8).clamp(0, 15).to(torch.uint8)
    sz = torch.stack([s, z], -1).transpose(0, 1).contiguous().to(torch.bfloat16)  # [K/g, N, 2]
    return {"q": pack_int4(q.view(n, kg * g)), "sz": sz}


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] values 0..15 -> [N, K/2] uint8 in the CPU tinygemm layout: per block of 64 rows
    (the last block may be shorter), byte [k, d] = row d (low nibble) | row d + b/2 (high nibble)."""
    n, k = q.shape
    out = []
    for r in range(0, n, INT4_BLOCK_N):
        v = q[r : r + INT4_BLOCK_N].to(torch.uint8)
        b = v.shape[0]
        out.append((v[: b // 2] | (v[b // 2 :] << 4)).t().contiguous().view(-1))  # [K, b/2]
    return torch.cat(out).view(n, k // 2)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_int4: [N, K/2] uint8 -> [N, K] uint8 values 0..15."""
    n, k2 = packed.shape
    flat = packed.reshape(-1)
    rows, start = [], 0
    for r in range(0, n, INT4_BLOCK_N):
        b = min(INT4_BLOCK_N, n - r)
        blk = flat[start : start + b * k2].view(2 * k2, b // 2).t()  # [b/2, K]
        start += b * k2
        rows += [blk & 0xF, blk >> 4]
    lo_hi = []
    for i in range(0, len(rows), 2):
        lo_hi.append(torch.cat([rows[i], rows[i + 1]]))
    return torch.cat(lo_hi)


def quantize_expert(
    layout: RecordLayout,
    w13: torch.Tensor,
    w2: torch.Tensor,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """w13 [2I, D], w2 [D, I] (and biases b13 [2I], b2 [D], kept fp32) -> section name -> tensor,
    ready to write into a record."""
    out = {}
    for name, w in (("w13", w13), ("w2", w2)):
        for suffix, t in quantize(layout.scheme, w).items():
            out[f"{name}.{suffix}"] = t
    if b13 is not None:
        out["b13"], out["b2"] = b13.float(), b2.float()
    return out


def record_bytes(layout: RecordLayout, tensors: dict[str, torch.Tensor]) -> bytearray:
    buf = torch.zeros(layout.size, dtype=torch.uint8)
    views = layout.views(buf)
    for s in layout.sections:
        views[s.name].copy_(tensors[s.name])
    return bytearray(buf.numpy().tobytes())
