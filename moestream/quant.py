"""Quantization schemes for expert (and dense) weights and the byte layout of one expert record.

A scheme is a frozen dataclass, never a flag: `bf16`, `int8` (symmetric per K-block of 32, the
"sym8" of seed 001), `int4` (per group of 32, asymmetric by default: see INT4_CHOICE), `q4_0`
(llama.cpp's Q4_0: symmetric 4-bit blocks of 32, fp16 scale; a GGUF's Q4_0 bytes as stored), `q4_1`
(llama.cpp's Q4_1: 4-bit blocks of 32 with an fp16 scale and an fp16 minimum), `q5_0`
(llama.cpp's Q5_0: symmetric 5-bit blocks of 32, fp16 scale, kept as a GGUF stores them), `q8_0`
(llama.cpp's Q8_0: int8 as `int8` with the scale in fp16, 8.5 bits per weight against int8's 9),
`mxfp4` (OCP MX FP4, gpt-oss's experts as downloaded: e2m1 4-bit values in blocks of 32 with a
shared power-of-two scale, 4.25 bits per weight; a hub or GGUF file's values kept exactly) and
the K-quants `q4_k`, `q5_k`, `q6_k` (llama.cpp's super-blocks of 256 as a GGUF stores them; GGUF
only: `quantize` does not write them). Every
2-D weight [N, K] (N outputs, K inputs) is quantized along K, so concatenating gate and up rows
into w13 [2I, D] changes nothing per row.

Tensor sections (what `kernels/ref.py` dequantizes and `kernels/cpu.py` multiplies in place):
  bf16: `q` bf16 [N, K]
  int8: `q` int8 [N, K], `s` fp32 [N, K/g]             w = q * s
  q8_0: `q` int8 [N, K], `d` fp16 [N, K/32]             w = q * d   (a GGUF's Q8_0 blocks split)
  int4: `q` uint8 [N, K/2] packed as torch's CPU tinygemm kernel packs it on AVX-512 (blocks of
        64 rows; see pack_int4), `sz` bf16 [N * K/g, 2] (scale, zero), blocked like `q`: per
        64-row block its [K/g, rows, 2] (int4_sz_blocked; store version 6)   w = (q - 8) * s + z
  q4_0: `q` uint8 [N, K/2], per row and block of 32 the block's 16 GGUF bytes (byte i: element i
        in the low nibble, element i + 16 in the high one), `d` fp16 [N, K/32]   w = (q - 8) * d
        (row-major like int8: the native kernel streams each row front to back)
  q4_1: `q` as q4_0 (a GGUF's Q4_1 nibbles), `dm` fp16 [N, K/32, 2] (per block d, then m, as
        block_q4_1 holds them)   w = (q * d) + m
  q5_0: `q` uint8 [N, K/32, 22], each row's GGUF blocks byte for byte (block_q5_0 {d fp16, qh[4]:
        bit i of the little-endian u32 is element i's 5th bit, qs[16]: element i in the low nibble
        of byte i, i + 16 in the high one})   w = (q - 16) * d
  mxfp4: `q` uint8 [N, K/32, 17], each row's GGUF MXFP4 blocks byte for byte (block_mxfp4 {e: the
        e8m0 exponent, qs[16]: code i in the low nibble of byte i, i + 16 in the high one})
        w = E2M1[code] * 2^(e - 127), E2M1 = 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives (code
        bit 3: the sign); held as integers twice the value, w = MXFP4_X2[code] * 2^(e - 128)
  q4_k / q5_k / q6_k: `q` uint8 [N, K/256, B], each row's GGUF blocks byte for byte (B = 144 /
        176 / 210: block_q4_K {d, dmin fp16, scales[12] (6-bit sc and m of 8 sub-blocks of 32),
        qs[128]}, block_q5_K {d, dmin, scales[12], qh[32], qs[128]}, block_q6_K {ql[128],
        qh[64], scales[16] int8 (16 sub-blocks of 16), d fp16}); the blocks carry their scales
        (`unpack_kquant`), w = (d * sc) * q - (dmin * m), q6_k: (d * sc) * (q - 32)
An expert record holds w13 [2I, D] then w2 [D, I] (then, for experts with biases (gpt_oss),
`b13` fp32 [2I] and `b2` fp32 [D], never quantized), each section 64-byte aligned, and is padded
to a 4 KiB multiple so O_DIRECT can read it in place. Each projection has its own scheme
(`RecordLayout.schemes`): one for both, except where a GGUF's blocks are kept as they are and its
types differ (Q4_K_M: Q4_K gate/up, Q6_K down).
Dense 2-D weights quantized under `DenseQuant` use the same sections ("{name}.q", ".s" / ".sz")
in the store's dense file.
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
SCHEMES = ("bf16", "int8", "int4", "q4_0", "q4_1", "q5_0", "q8_0", "mxfp4", "q4_k", "q5_k", "q6_k")
Q4_0_BLOCK = 32  # llama.cpp's QK4_0 (and QK4_1, QK8_0)
QK_K = 256  # llama.cpp's K-quant super-block; a K-quant scheme's group_size
KQUANT_BYTES = {"q4_k": 144, "q5_k": 176, "q6_k": 210}  # bytes per super-block of 256
KQUANT_OF_BYTES = {b: name for name, b in KQUANT_BYTES.items()}
Q5_0_BYTES = 22  # block_q5_0: fp16 d, qh[4], qs[16] per 32 weights
MXFP4_BYTES = 17  # block_mxfp4: e8m0 exponent, qs[16] per 32 weights
# twice the e2m1 value of each 4-bit code (bit 3: the sign), an integer: llama.cpp's kvalues_mxfp4
MXFP4_X2 = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


@dataclass(frozen=True, slots=True)
class QuantScheme:
    name: str  # one of SCHEMES
    group_size: int = 32
    symmetric: bool = True

    def __post_init__(self):
        if self.name not in SCHEMES:
            raise ConfigError(f"unknown quantization {self.name!r}; use {', '.join(SCHEMES)}")
        if self.group_size <= 0 or self.group_size % 2:
            raise ConfigError(f"group size must be a positive even number, got {self.group_size}")
        if self.name in ("q4_0", "q5_0", "q8_0", "mxfp4") and (
            self.group_size != Q4_0_BLOCK or not self.symmetric
        ):
            raise ConfigError(f"{self.name} is symmetric blocks of {Q4_0_BLOCK}; drop --group-size")
        if self.name == "q4_1" and (self.group_size != Q4_0_BLOCK or self.symmetric):
            raise ConfigError(f"q4_1 is blocks of {Q4_0_BLOCK} with a minimum; drop --group-size")
        if self.name in KQUANT_BYTES and (self.group_size != QK_K or not self.symmetric):
            raise ConfigError(f"{self.name} is super-blocks of {QK_K}; drop --group-size")

    def to_json(self) -> dict:
        return {"name": self.name, "group_size": self.group_size, "symmetric": self.symmetric}


def make_scheme(name: str, group_size: int = 32) -> QuantScheme:
    """The scheme a `--quant` name means (int4 asymmetric, int8 symmetric, q4_0 / q4_1 their own
    blocks; a K-quant's group is its super-block: the default 32 means it, another size is
    refused)."""
    if name in KQUANT_BYTES and group_size == 32:
        group_size = QK_K
    if name == "q4_1":
        return QuantScheme(name, group_size, symmetric=False)
    return QuantScheme(name, group_size, symmetric=name != "int4" or INT4_CHOICE == "symmetric")


def is_kquant(scheme: QuantScheme) -> bool:
    return scheme.name in KQUANT_BYTES


@dataclass(frozen=True, slots=True)
class ExpertQuant:
    """How convert stores the experts: `scheme`, what it quantizes them into. `keep_source` (a
    GGUF's default, no --quant): a projection whose blocks a store scheme holds exactly keeps
    them in that scheme whatever `scheme` is, so a record may hold two (Q4_K w13, Q6_K w2) and
    layers may differ; without it only blocks that are `scheme` itself are kept."""

    scheme: QuantScheme
    keep_source: bool = False

    @property
    def tag(self) -> str:
        """Cache-key part: e.g. 'int4-g32', 'int4-g32-keep'."""
        s = self.scheme
        return f"{s.name}-g{s.group_size}" + ("-keep" if self.keep_source else "")


def expert_quant(experts: QuantScheme | ExpertQuant) -> ExpertQuant:
    """A plain scheme means: every expert in that one scheme."""
    return experts if isinstance(experts, ExpertQuant) else ExpertQuant(experts)


# Dense (non-expert) weights under --quant: the output layer is the one weight whose error every
# logit sees; under 4-bit weights it is Q6_K, as llama.cpp's Q4_0 files keep it (int8 where its
# input dim is not a multiple of 256; 8-bit weights keep it in their own format).
DENSE_MODES = ("auto", "float", "int8", "int4")
DENSE_ROLES = ("linear", "embedding", "output")  # output: lm_head, or the tied embedding
# Below this many weights a tensor stays float: it saves nothing worth a rounding (norms, biases
# and routers stay float by role, whatever their size).
MIN_DENSE_PARAMS = 1 << 18


@dataclass(frozen=True, slots=True)
class DenseQuant:
    """How convert stores the dense 2-D weights (attention, dense / shared-expert MLPs, embedding,
    output layer): `weights` for the rest, `output` for lm_head (and a tied embedding); None keeps
    a tensor as in the checkpoint. Routers, norms, biases and sinks are never given a role."""

    weights: QuantScheme | None = None
    output: QuantScheme | None = None
    min_params: int = MIN_DENSE_PARAMS
    # A source weight that is already quantized (a GGUF's) is never rounded again: kept in its
    # blocks where a store scheme holds them exactly (Q8_0 -> int8, Q4_0 / Q4_1 -> q4_0 / q4_1),
    # else dequantized to float (--dense auto); float source weights follow `weights` / `output`.
    keep_source: bool = False

    def __post_init__(self):
        for s in (self.weights, self.output):
            if s is not None and s.name == "bf16":
                raise ConfigError("dense weights are int8, int4 or float (as in the checkpoint)")
        if self.min_params < 0:
            raise ConfigError(f"min_params must be >= 0, got {self.min_params}")

    def scheme_for(self, role: str | None, shape: tuple[int, ...]) -> QuantScheme | None:
        """The scheme a tensor of `role` and `shape` is stored in (None: float as in the source).
        Shapes a scheme cannot hold (K not a multiple of the group, odd N for int4) stay float."""
        if role is None or len(shape) != 2 or shape[0] * shape[1] < self.min_params:
            return None
        scheme = self.output if role == "output" else self.weights
        if scheme is None:
            return None
        n, k = shape
        if is_kquant(scheme) and k % scheme.group_size:  # q6_k output, K not whole super-blocks
            scheme = make_scheme("int8")
        if k % scheme.group_size or (scheme.name == "int4" and n % 2):
            return None
        return scheme

    def to_json(self) -> dict:
        return {
            "weights": None if self.weights is None else self.weights.to_json(),
            "output": None if self.output is None else self.output.to_json(),
            "min_params": self.min_params,
            "keep_source": self.keep_source,
        }

    @property
    def tag(self) -> str:
        """Short name for cache keys and the mode line: e.g. 'int4+int8out', 'float'."""
        if self.weights is None and self.output is None:
            return "float"
        w = self.weights.name if self.weights else "float"
        o = self.output.name if self.output else "float"
        return (w if o == w else f"{w}+{o}out") + ("+src" if self.keep_source else "")


def make_dense(mode: str, experts: QuantScheme) -> DenseQuant:
    """The dense rule a `--dense` mode means next to the experts' scheme. auto: the experts'
    format (bf16 experts: float dense), the output layer q6_k under 4 bits, a quantized source
    weight (a GGUF's) never rounded again (`keep_source`); float: as in the checkpoint
    (dequantized); int8 / int4: that format, the output layer as auto would put it."""
    if mode not in DENSE_MODES:
        raise ConfigError(f"unknown --dense {mode!r}; use {', '.join(DENSE_MODES)}")
    name = experts.name if mode == "auto" else mode
    if name in KQUANT_BYTES:
        # K-quant experts come from a GGUF, whose quantized dense weights keep their blocks
        # (keep_source); `quantize` writes no K-quant, so a float source weight goes int8.
        name = "int8"
    if name == "mxfp4":
        # mxfp4 is the experts' own format (gpt-oss's, hub or GGUF): the dense weights stay as
        # the source holds them, its quantized blocks kept, its floats float (nothing rounded;
        # `--dense int8` for llama.cpp's MXFP4_MOE, whose dense weights are Q8_0).
        return DenseQuant(keep_source=True)
    if name in ("float", "bf16"):
        return DenseQuant()
    weights = make_scheme(name, experts.group_size)
    output = make_scheme("q6_k") if name in ("int4", "q4_0", "q4_1", "q5_0") else weights
    return DenseQuant(weights, output, keep_source=mode == "auto")


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
DTYPE_NAMES.update({torch.float32: "float32", torch.float16: "float16"})


def tensor_sections(scheme: QuantScheme, name: str, n: int, k: int) -> list[tuple]:
    """(name, dtype, shape) of one weight [n, k] under scheme."""
    g = scheme.group_size
    if scheme.name in KQUANT_BYTES:
        if k % QK_K:
            raise ConfigError(
                f"{name}: input dim {k} is not a multiple of {QK_K} ({scheme.name} super-blocks); "
                "convert with --quant int4 (or int8)"
            )
        return [(f"{name}.q", torch.uint8, (n, k // QK_K, KQUANT_BYTES[scheme.name]))]
    if scheme.name != "bf16" and k % g:
        raise ConfigError(
            f"{name}: input dim {k} is not a multiple of group size {g}; pick --group-size dividing it"
        )
    if scheme.name == "bf16":
        return [(f"{name}.q", torch.bfloat16, (n, k))]
    if scheme.name == "int8":
        return [(f"{name}.q", torch.int8, (n, k)), (f"{name}.s", torch.float32, (n, k // g))]
    if scheme.name == "q4_0":
        return [(f"{name}.q", torch.uint8, (n, k // 2)), (f"{name}.d", torch.float16, (n, k // g))]
    if scheme.name == "q4_1":
        return [
            (f"{name}.q", torch.uint8, (n, k // 2)),
            (f"{name}.dm", torch.float16, (n, k // g, 2)),
        ]
    if scheme.name == "q5_0":
        return [(f"{name}.q", torch.uint8, (n, k // g, Q5_0_BYTES))]
    if scheme.name == "mxfp4":
        return [(f"{name}.q", torch.uint8, (n, k // g, MXFP4_BYTES))]
    if scheme.name == "q8_0":
        return [(f"{name}.q", torch.int8, (n, k)), (f"{name}.d", torch.float16, (n, k // g))]
    if n % 2:
        raise ConfigError(f"{name}: int4 packing needs an even number of rows, got {n}")
    return [
        (f"{name}.q", torch.uint8, (n, k // 2)),
        (f"{name}.sz", torch.bfloat16, (n * (k // g), 2)),
    ]


def tensor_width(scheme: QuantScheme, q: torch.Tensor) -> int:
    """K of a weight from its `q` section (4-bit schemes pack two values per byte)."""
    if scheme.name in KQUANT_BYTES:
        return q.shape[1] * QK_K
    if scheme.name in ("q5_0", "mxfp4"):
        return q.shape[1] * Q4_0_BLOCK
    return q.shape[1] * (2 if scheme.name in ("int4", "q4_0", "q4_1") else 1)


PROJECTIONS = ("w13", "w2")  # an expert record's weights, in record order


@dataclass(frozen=True, slots=True)
class RecordLayout:
    """One expert record: each projection's scheme (`schemes`, in PROJECTIONS order: a GGUF's
    Q4_K_M keeps Q4_K w13 beside Q6_K w2), its sections and their offsets, the padded size."""

    schemes: tuple[QuantScheme, ...]
    sections: tuple[Section, ...]
    size: int  # padded to RECORD_ALIGN

    @staticmethod
    def build(
        scheme: QuantScheme,
        hidden: int,
        inter: int,
        bias: bool = False,
        w2: QuantScheme | None = None,
    ) -> RecordLayout:
        """`scheme` for both projections, or for w13 when `w2` names down's own."""
        schemes = (scheme, scheme if w2 is None else w2)
        shapes = (("w13", 2 * inter, hidden), ("w2", hidden, inter))
        specs = [
            spec
            for s, (name, n, k) in zip(schemes, shapes)
            for spec in tensor_sections(s, name, n, k)
        ]
        if bias:
            specs += [("b13", torch.float32, (2 * inter,)), ("b2", torch.float32, (hidden,))]
        secs, off = [], 0
        for sname, dtype, shape in specs:
            s = Section(sname, dtype, shape, off)
            secs.append(s)
            off = -(-(off + s.nbytes) // SECTION_ALIGN) * SECTION_ALIGN
        size = -(-off // RECORD_ALIGN) * RECORD_ALIGN
        return RecordLayout(schemes, tuple(secs), size)

    @property
    def mixed(self) -> bool:
        """The projections differ in scheme."""
        return len(set(self.schemes)) > 1

    @property
    def scheme(self) -> QuantScheme:
        """The one scheme of every projection (callers that need one check `mixed` first)."""
        if self.mixed:
            raise ValueError(f"a mixed record ({self.name}) has no single scheme")
        return self.schemes[0]

    def scheme_of(self, proj: str) -> QuantScheme:
        return self.schemes[PROJECTIONS.index(proj)]

    @property
    def name(self) -> str:
        """e.g. 'q4_k' or 'q4_k+q6_k' (w13's, then w2's)."""
        return "+".join(dict.fromkeys(s.name for s in self.schemes))

    @property
    def groups(self) -> tuple[int, ...]:
        """Each projection's group size (what the torch kernels dequantize with)."""
        return tuple(s.group_size for s in self.schemes)

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
    if scheme.name == "q6_k":
        return {"q": quantize_q6_k(w)}
    if scheme.name in KQUANT_BYTES:
        raise ConfigError(kquant_source_error(scheme))
    n, k = w.shape
    g = scheme.group_size
    blocks = w.view(n, k // g, g)
    if scheme.name == "int8":
        s = blocks.abs().amax(-1) / 127.0
        s = torch.where(s == 0, torch.ones_like(s), s)
        q = torch.round(blocks / s[..., None]).clamp(-127, 127).to(torch.int8)
        return {"q": q.view(n, k), "s": s}
    if scheme.name == "q4_0":
        return quantize_q4_0(blocks)
    if scheme.name == "q4_1":
        return quantize_q4_1(blocks)
    if scheme.name == "q5_0":
        return quantize_q5_0(blocks)
    if scheme.name == "q8_0":
        return quantize_q8_0(blocks)
    if scheme.name == "mxfp4":
        return {"q": quantize_mxfp4(blocks)}
    return _quantize_int4(scheme, blocks)


def quantize_q8_0(blocks: torch.Tensor) -> dict[str, torch.Tensor]:
    """blocks [N, K/32, 32] -> q8_0 sections, as llama.cpp's quantize_row_q8_0_ref: d = amax / 127,
    q = round-half-away(x * (1 / d)) with the fp32 d, d kept fp16."""
    n, kg, g = blocks.shape
    d = blocks.abs().amax(-1) / 127.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    x = blocks * inv[..., None]
    q = (x.sign() * (x.abs() + 0.5).floor()).clamp(-127, 127).to(torch.int8)
    return {"q": q.view(n, kg * g), "d": d.to(torch.float16)}


def quantize_q4_0(blocks: torch.Tensor) -> dict[str, torch.Tensor]:
    """blocks [N, K/32, 32] -> q4_0 sections, as llama.cpp's quantize_row_q4_0_ref: d = (the
    value of largest magnitude) / -8, q = min(15, trunc(x / d + 8.5)) with the fp32 d, d kept fp16."""
    n, kg, g = blocks.shape
    idx = blocks.abs().argmax(-1, keepdim=True)
    d = torch.gather(blocks, -1, idx)[..., 0] / -8.0  # [N, K/32]
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.clamp((blocks * inv[..., None] + 8.5).trunc(), max=15).to(torch.uint8)
    return {"q": pack_q4_0(q.view(n, kg * g)), "d": d.to(torch.float16)}


def quantize_q4_1(blocks: torch.Tensor) -> dict[str, torch.Tensor]:
    """blocks [N, K/32, 32] -> q4_1 sections, as llama.cpp's quantize_row_q4_1_ref: d = (max -
    min) / 15, m = min, q = min(15, trunc((x - min) * (1 / d) + 0.5)) with the fp32 d and min,
    both kept fp16."""
    n, kg, g = blocks.shape
    lo, hi = blocks.amin(-1), blocks.amax(-1)  # [N, K/32]
    d = (hi - lo) / 15.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.clamp(((blocks - lo[..., None]) * inv[..., None] + 0.5).trunc(), max=15)
    dm = torch.stack([d, lo], -1).to(torch.float16)  # [N, K/32, 2]
    return {"q": pack_q4_0(q.to(torch.uint8).view(n, kg * g)), "dm": dm}


def quantize_q5_0(blocks: torch.Tensor) -> dict[str, torch.Tensor]:
    """blocks [N, K/32, 32] -> q5_0 blocks, as llama.cpp's quantize_row_q5_0_ref: d = (the value
    of largest magnitude) / -16, q = min(31, trunc(x / d + 16.5)) with the fp32 d, d kept fp16."""
    n, kg, g = blocks.shape
    idx = blocks.abs().argmax(-1, keepdim=True)
    d = torch.gather(blocks, -1, idx)[..., 0] / -16.0  # [N, K/32]
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.clamp((blocks * inv[..., None] + 16.5).trunc(), max=31).to(torch.uint8)
    return {"q": pack_q5_0(q, d.to(torch.float16))}


def pack_q5_0(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """q [N, K/32, 32] values 0..31 and d fp16 [N, K/32] -> blocks uint8 [N, K/32, 22]: d, qh
    (bit i of the little-endian u32: element i's 5th bit), qs (as pack_q4_0's bytes)."""
    n, kg, _ = q.shape
    bits = ((q >> 4) & 1).to(torch.int64) << torch.arange(32, device=q.device)  # [N, K/32, 32]
    qh = bits.sum(-1)  # the u32, in int64
    qh_bytes = torch.stack([(qh >> (8 * i)) & 0xFF for i in range(4)], -1).to(torch.uint8)
    qs = pack_q4_0((q & 15).reshape(n, kg * 32)).view(n, kg, 16)
    return torch.cat([d.contiguous().view(torch.uint8).view(n, kg, 2), qh_bytes, qs], -1)


def unpack_q5_0(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of pack_q5_0: blocks uint8 [N, K/32, 22] -> (q int8 [N, K] = the values - 16, in
    -16..15; d fp16 [N, K/32])."""
    n, kg, _ = blocks.shape
    d = blocks[..., :2].contiguous().view(torch.float16)[..., 0]
    qh = blocks[..., 2:6].to(torch.int64)
    word = qh[..., 0] | (qh[..., 1] << 8) | (qh[..., 2] << 16) | (qh[..., 3] << 24)  # [N, K/32]
    bit = torch.arange(32, device=word.device)
    hi = ((word[..., None] >> bit) & 1).to(torch.uint8) << 4  # [N, K/32, 32]
    lo = unpack_q4_0(blocks[..., 6:].reshape(n, kg * 16)).view(n, kg, 32)
    return ((lo | hi).view(torch.int8) - 16).view(n, kg * 32), d


# nearest doubled e2m1 magnitude: the midpoints of 0, 1, 2, 3, 4, 6, 8, 12 (a tie: the smaller)
_MXFP4_MIDS = (0.5, 1.5, 2.5, 3.5, 5.0, 7.0, 10.0)


def quantize_mxfp4(blocks: torch.Tensor) -> torch.Tensor:
    """blocks [N, K/32, 32] -> mxfp4 blocks uint8 [N, K/32, 17], as llama.cpp's
    quantize_row_mxfp4_ref: e = floor(log2(amax)) - 2 + 127 (0 for a zero block; floor(log2) from
    frexp, exact), then each x the nearest of MXFP4_X2 * 2^(e - 128) (a tie: the smaller
    magnitude, the first of the table). Weights that are MXFP4 values already (a hub checkpoint's,
    dequantized) come back as the same values: the block's largest code decides e <= the file's
    exponent, and every e2m1 value times 2, 4 or 8 that fits is one too (test_quant)."""
    n, kg, g = blocks.shape
    amax = blocks.abs().amax(-1)
    e = torch.frexp(amax).exponent.to(torch.int32) - 1 - 2 + 127  # floor(log2) = frexp's - 1
    e = torch.where(amax > 0, e, torch.zeros_like(e)).clamp(0, 254)
    d = torch.ldexp(torch.ones(()), (e - 128).float())  # 2^(e - 128): x / d is exact
    m = blocks.abs() / d[..., None]
    mids = torch.tensor(_MXFP4_MIDS, dtype=m.dtype)
    idx = (m[..., None] > mids).sum(-1).to(torch.uint8)  # index of the magnitude, 0..7
    code = torch.where((blocks < 0) & (idx > 0), idx + 8, idx)
    qs = pack_q4_0(code.view(n, kg * g)).view(n, kg, 16)
    return torch.cat([e.to(torch.uint8)[..., None], qs], -1)


def unpack_mxfp4(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """mxfp4 blocks uint8 [N, K/32, 17] -> (q int8 [N, K] = MXFP4_X2 of each code, s fp32 [N, K/32]
    = 2^(e - 128)): w = q * s exactly (e < 2 gives the subnormals llama.cpp's e8m0_to_fp32_half
    gives)."""
    n, kg, _ = blocks.shape
    lut = torch.tensor(MXFP4_X2, dtype=torch.int8, device=blocks.device)
    codes = unpack_q4_0(blocks[..., 1:].reshape(n, kg * 16))  # [N, K] 0..15
    s = torch.ldexp(torch.ones((), device=blocks.device), blocks[..., 0].float() - 128)
    return lut[codes.long()], s


def pack_q4_0(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] values 0..15 -> [N, K/2] uint8 in GGUF's Q4_0 order (per block of 32: byte i =
    element i | element i + 16 << 4)."""
    n, k = q.shape
    b = q.to(torch.uint8).view(n, k // 32, 2, 16)
    return (b[:, :, 0] | (b[:, :, 1] << 4)).reshape(n, k // 2)


def unpack_q4_0(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_q4_0: [N, K/2] uint8 -> [N, K] uint8 values 0..15."""
    n, k2 = packed.shape
    b = packed.view(n, k2 // 16, 16)
    return torch.stack([b & 0xF, b >> 4], 2).reshape(n, 2 * k2)


def kquant_source_error(scheme: QuantScheme) -> str:
    """Why experts cannot be written in a K-quant from float weights (q4_k / q5_k: llama.cpp's
    search for scales and mins is not reimplemented; q6_k is written only as the 4-bit rules'
    output layer), and the fix."""
    t = scheme.name.upper()
    what = (
        "writes q6_k only for the output layer under 4-bit --quant"
        if scheme.name == "q6_k"
        else f"does not quantize into {scheme.name}"
    )
    return (
        f"--quant {scheme.name} keeps a GGUF's {t} blocks as they are; moestream {what}: convert "
        f"a GGUF whose expert tensors are all {t} (or drop --quant: a GGUF's blocks then keep "
        "their own types), or use --quant int4, q4_0 or int8"
    )


# q6_k's sub-block search (llama.cpp's make_qx_quants, rmse_type 1): the scale -32 / max, then
# -(32 + is / 10) / max for is in -9..9 (not 0), a try kept when its x^2-weighted least-squares
# fit beats the best so far. The constants, sums and comparisons run in fp32 in ggml's order, so
# the bytes are llama-quantize's (tests/test_gguf_llama_cpp.py compares a Q4_0 file's output).
Q6_K_TRIES = tuple(range(-9, 0)) + tuple(range(1, 10))


def quantize_q6_k(w: torch.Tensor, rows_per_chunk: int = 4096) -> torch.Tensor:
    """w [N, K] float (K a multiple of 256) -> GGUF block_q6_K bytes uint8 [N, K/256, 210] by the
    algorithm of llama.cpp's quantize_row_q6_K_ref (written here from it, vectorized): per
    sub-block of 16 a scale from the search above, the 16 sub-block scales as int8 of the
    super-block's fp16 d = -(the scale of largest magnitude) / 128, then each value rounded
    against its sub-block's d * sc, clamped to -32..31. Rounding is half-to-even (ggml's
    nearest_int). Chunked over rows: an output layer has ~300 M weights."""
    n, k = w.shape
    if k % QK_K:
        raise ConfigError(f"q6_k needs an input dim that is a multiple of {QK_K}, got {k}")
    out = torch.empty(n, k // QK_K, KQUANT_BYTES["q6_k"], dtype=torch.uint8)
    for r0 in range(0, n, rows_per_chunk):
        r1 = min(n, r0 + rows_per_chunk)
        out[r0:r1] = _q6_k_rows(w[r0:r1].float())
    return out


def _fit(x: torch.Tensor, iscale: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """One try of the search: l = clamp(round(iscale * x), -32, 31) and the x^2-weighted sums
    of x l and l^2, accumulated element by element in fp32 as ggml does."""
    l = torch.round(x * iscale[:, None]).clamp_(-32, 31)
    xt, lt = x.t(), l.t().contiguous()  # x.t(): the caller's column-major copy, rows contiguous
    wx = xt * xt * xt  # (x * x) * x, exact in ggml's order: w = x * x, then w * x
    sumlx = wx[0] * lt[0]
    suml2 = (xt[0] * xt[0]) * lt[0] * lt[0]
    for i in range(1, 16):
        sumlx += wx[i] * lt[i]
        suml2 += (xt[i] * xt[i]) * lt[i] * lt[i]
    return l, sumlx, suml2


def _q6_k_rows(w: torch.Tensor) -> torch.Tensor:
    n, k = w.shape
    x = w.reshape(-1, 16).t().contiguous().t()  # sub-blocks, stored column-major for _fit
    idx = x.abs().argmax(-1, keepdim=True)  # the first of the largest magnitude, as ggml's scan
    mx = torch.gather(x, -1, idx)[:, 0]
    live = mx.abs() >= 1e-15  # ggml's GROUP_MAX_EPS: else L = 0, scale 0
    safe = torch.where(live, mx, torch.ones_like(mx))
    best_l, sumlx, suml2 = _fit(x, -32.0 / safe)
    scale = torch.where(suml2 > 0, sumlx / torch.where(suml2 > 0, suml2, 1.0), 0.0)
    best = scale * sumlx
    tenth = torch.tensor(0.1, dtype=torch.float32)
    for c in Q6_K_TRIES:
        l, sumlx, suml2 = _fit(x, -(32.0 + tenth * c) / safe)
        take = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        best_l = torch.where(take[:, None], l, best_l)
        scale = torch.where(take, sumlx / torch.where(suml2 > 0, suml2, 1.0), scale)
        best = torch.where(take, scale * sumlx, best)
    scale = torch.where(live, scale, 0.0)
    best_l = torch.where(live[:, None], best_l, -32.0).contiguous()
    # super-blocks: [n * k / 256, 16] sub-block scales
    scales = scale.view(-1, 16)
    smax = torch.gather(scales, -1, scales.abs().argmax(-1, keepdim=True))[:, 0]
    slive = smax.abs() >= 1e-15
    iscale = -128.0 / torch.where(slive, smax, 1.0)
    d16 = torch.where(slive, 1.0 / iscale, 0.0).to(torch.float16)
    sc = torch.round(iscale[:, None] * scales).clamp(max=127)  # >= -128: |scale| <= |smax|
    sc = torch.where(slive[:, None], sc, 0.0)
    dj = d16.float()[:, None] * sc  # [., 16]
    xs = w.reshape(-1, 16, 16)
    l = torch.round(xs / torch.where(dj == 0, 1.0, dj)[..., None]).clamp(-32, 31)
    l = torch.where((dj == 0)[..., None], best_l.view(-1, 16, 16), l)  # as the search left it
    l = torch.where(slive[:, None, None], l, -32.0)  # an all-zero block: bytes 0
    L = (l + 32).to(torch.uint8).view(-1, 2, 4, 32)  # [super-block, half, quarter, 32]
    lo = L & 15
    ql = torch.cat([lo[:, :, 0] | (lo[:, :, 2] << 4), lo[:, :, 1] | (lo[:, :, 3] << 4)], -1)
    qh = (
        (L[:, :, 0] >> 4)
        | ((L[:, :, 1] >> 4) << 2)
        | ((L[:, :, 2] >> 4) << 4)
        | ((L[:, :, 3] >> 4) << 6)
    )
    blocks = torch.cat(
        [
            ql.reshape(-1, 128),
            qh.reshape(-1, 64),
            sc.to(torch.int8).view(torch.uint8),
            d16.view(-1, 1).view(torch.uint8),
        ],
        -1,
    )
    return blocks.view(n, k // QK_K, KQUANT_BYTES["q6_k"])


def q6_k_as_int8(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q6_k blocks [N, K/256, 210] -> (values int8 [N, K] (q - 32), steps fp32 [N, K/16] = d * sc):
    int8 of group 16 holding exactly the weights dequantize_kquant gives, step times value."""
    f = unpack_kquant(q)
    n = q.shape[0]
    steps = f["d"][..., None] * f["sc"].view(n, -1, 16).float()
    return f["q"].contiguous(), steps.view(n, -1).contiguous()


def unpack_kquant(q: torch.Tensor) -> dict[str, torch.Tensor]:
    """GGUF K-quant blocks q uint8 [N, nb, B] -> their fields (exact, no arithmetic on values):
    q4_k / q5_k: q uint8 [N, K] (0..15 / 0..31), sc and m uint8 [N, K/32], d and dmin fp32
    [N, nb] (fp16 widened); q6_k: q int8 [N, K] (q - 32, -32..31), sc int8 [N, K/16], d fp32
    [N, nb]. Element order as llama.cpp's dequantize_row_q*_K writes y."""
    n, nb, nbytes = q.shape
    kind = KQUANT_OF_BYTES[nbytes]
    b = q.reshape(n * nb, nbytes)
    if kind == "q6_k":
        ql, qh = b[:, :128].view(-1, 2, 64), b[:, 128:192].view(-1, 2, 32)
        sc = b[:, 192:208].view(torch.int8)
        d = b[:, 208:210].contiguous().view(torch.float16).float()
        # half h, quarter j (32 values each): ql nibble (j even: low, odd: high) of byte
        # 64 h + 32 (j % 2) + l, with bits 2 j..2 j + 1 of qh[32 h + l] on top.
        lo = torch.stack(
            [ql[..., :32] & 15, ql[..., 32:] & 15, ql[..., :32] >> 4, ql[..., 32:] >> 4], 2
        )
        hi = torch.stack([(qh >> s) & 3 for s in (0, 2, 4, 6)], 2)
        vals = (lo | (hi << 4)).view(torch.int8) - 32
        return {"q": vals.reshape(n, nb * QK_K), "sc": sc.reshape(n, nb * 16), "d": d.view(n, nb)}
    d = b[:, 0:4].contiguous().view(torch.float16).float().view(n, nb, 2)
    s = b[:, 4:16].reshape(-1, 3, 4)  # (EEAAAAAA.., eeaaaaaa.., eeeeEEEE..) x 4, as ggml packs
    sc = torch.cat([s[:, 0] & 63, (s[:, 2] & 15) | ((s[:, 0] >> 2) & 48)], 1)
    m = torch.cat([s[:, 1] & 63, (s[:, 2] >> 4) | ((s[:, 1] >> 2) & 48)], 1)
    qs = b[:, -128:].reshape(-1, 4, 1, 32)  # chunk j of 64 values: low nibbles, then high
    nib = torch.tensor([0, 4], dtype=torch.uint8, device=b.device).view(1, 1, 2, 1)
    vals = (qs >> nib) & 15  # [., 4, 2, 32]
    if kind == "q5_k":
        qh = b[:, 16:48].reshape(-1, 1, 1, 32)  # bit 2 j + i of qh[l]: value 64 j + 32 i + l
        shifts = torch.arange(8, dtype=torch.uint8, device=b.device).view(1, 4, 2, 1)
        vals = vals | (((qh >> shifts) & 1) << 4)
    return {
        "q": vals.reshape(n, nb * QK_K),
        "sc": sc.reshape(n, nb * 8),
        "m": m.reshape(n, nb * 8),
        "d": d[..., 0],
        "dmin": d[..., 1],
    }


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
    sz = torch.stack([s, z], -1).transpose(0, 1).to(torch.bfloat16)  # [K/g, N, 2]
    return {"q": pack_int4(q.view(n, kg * g)), "sz": int4_sz_blocked(sz)}


def int4_sz_blocked(sz: torch.Tensor) -> torch.Tensor:
    """int4 (scale, zero) pairs [..., K/g, N, 2] -> the store's blocked layout [..., N * K/g, 2]:
    per 64-row block of `q` (the last may be shorter), that block's [K/g, rows, 2], so a kernel
    reads a block's scales as one stream beside its nibbles (docs/cpu.md: 17-18% faster than
    [K/g, N, 2] in the native layer op)."""
    *lead, kg, n, _ = sz.shape
    full = n - n % INT4_BLOCK_N
    head = sz[..., :full, :].reshape(*lead, kg, full // INT4_BLOCK_N, INT4_BLOCK_N, 2)
    parts = [head.transpose(-4, -3).reshape(*lead, full * kg, 2)]
    if full < n:
        parts.append(sz[..., full:, :].reshape(*lead, (n - full) * kg, 2))
    return torch.cat(parts, -2).contiguous()


def int4_sz_kn(sz: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of int4_sz_blocked: [..., N * K/g, 2] -> [..., K/g, N, 2] (torch's tinygemm order,
    the GPU kernels' and the reference's)."""
    *lead, nkg, _ = sz.shape
    kg, full = nkg // n, n - n % INT4_BLOCK_N
    head = sz[..., : full * kg, :].reshape(*lead, full // INT4_BLOCK_N, kg, INT4_BLOCK_N, 2)
    parts = [head.transpose(-4, -3).reshape(*lead, kg, full, 2)]
    if full < n:
        parts.append(sz[..., full * kg :, :].reshape(*lead, kg, n - full, 2))
    return torch.cat(parts, -2).contiguous()


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] values 0..15 -> [N, K/2] uint8 in the CPU tinygemm layout: per block of 64 rows
    (the last block may be shorter), byte [k, d] = row d (low nibble) | row d + b/2 (high nibble)."""
    n, k = q.shape
    full = n - n % INT4_BLOCK_N
    v = q[:full].to(torch.uint8).view(-1, 2, INT4_BLOCK_N // 2, k)  # [blocks, lo|hi, 32, K]
    out = [(v[:, 0] | (v[:, 1] << 4)).transpose(1, 2).reshape(-1)]  # each block [K, 32]
    if full < n:
        v = q[full:].to(torch.uint8)
        b = v.shape[0]
        out.append((v[: b // 2] | (v[b // 2 :] << 4)).t().contiguous().view(-1))  # [K, b/2]
    return torch.cat(out).view(n, k // 2)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_int4: [N, K/2] uint8 -> [N, K] uint8 values 0..15 (whole blocks at once:
    an output layer has thousands of them)."""
    n, k2 = packed.shape
    full = n - n % INT4_BLOCK_N
    flat = packed.reshape(-1)
    blk = flat[: full * k2].view(-1, 2 * k2, INT4_BLOCK_N // 2).transpose(1, 2)  # [blocks, 32, K]
    parts = [torch.stack([blk & 0xF, blk >> 4], 1).reshape(full, 2 * k2)]
    if full < n:
        b = n - full
        tail = flat[full * k2 :].view(2 * k2, b // 2).t()  # [b/2, K]
        parts.append(torch.cat([tail & 0xF, tail >> 4]))
    return torch.cat(parts)


def unpack_int4_rows(packed: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Rows `rows` [T] of unpack_int4(packed) -> [T, K] uint8, reading only those rows' bytes (an
    embedding lookup). Row r sits in block r // 64 (of b rows), column (r % 64) % (b / 2), in the
    low nibble for the block's first half, else the high one."""
    n, k2 = packed.shape
    start = rows - rows % INT4_BLOCK_N
    b = torch.clamp(n - start, max=INT4_BLOCK_N)
    half = b // 2
    col, hi = (rows - start) % half, (rows - start) >= half
    k = torch.arange(2 * k2, device=packed.device)
    idx = start[:, None] * k2 + k[None, :] * half[:, None] + col[:, None]  # [T, K] byte offsets
    byte = packed.reshape(-1)[idx]
    return torch.where(hi[:, None], byte >> 4, byte & 0xF)


def int4_to_rows(
    q: torch.Tensor, sz: torch.Tensor, group: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """int4 sections of [m] stacked weights (q [m, N, K/2] in 64-row blocks, sz [m, N * K/G, 2]
    bf16, blocked; m may be absent) -> the GPU's row-major layout: (rows [m, N, K/2] uint8, per 32 inputs
    16 bytes, input i low nibble, i + 16 high, as q4_0; words [m, N, K/G] int32, the (scale, zero)
    bf16 pair of each row's group). The same numbers, moved (int4_from_rows inverts it)."""
    one = q.dim() == 2
    q, sz = (q[None], sz[None]) if one else (q, sz)
    m, n, k2 = q.shape
    if n % INT4_BLOCK_N == 0:  # whole blocks: records unpack as one tall weight
        v = unpack_int4(q.reshape(m * n, k2))
    else:
        v = torch.cat([unpack_int4(r) for r in q])
    v = v.view(m, n, k2 // 16, 2, 16)
    rows = (v[:, :, :, 0] | (v[:, :, :, 1] << 4)).reshape(m, n, k2).contiguous()
    words = int4_sz_kn(sz, n).view(torch.int32).view(m, -1, n).transpose(1, 2).contiguous()
    return (rows[0], words[0]) if one else (rows, words)


def int4_from_rows(rows: torch.Tensor, words: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of int4_to_rows for one weight: (rows [N, K/2], words [N, K/G]) -> (q [N, K/2] in
    64-row blocks, sz [N * K/G, 2] bf16, blocked)."""
    n, k2 = rows.shape
    b = rows.view(n, k2 // 16, 1, 16)
    v = torch.cat([b & 0xF, b >> 4], 2).reshape(n, 2 * k2)
    sz = words.t().contiguous().view(torch.bfloat16).view(-1, n, 2)
    return pack_int4(v), int4_sz_blocked(sz)


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
        for suffix, t in quantize(layout.scheme_of(name), w).items():
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
