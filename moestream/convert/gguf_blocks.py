"""GGUF block types as store schemes: which types a scheme holds exactly (`EXACT`, `EXACT_ALSO`,
`HELD_BY`), and their stored rows split into the scheme's sections byte for byte (`sections`)."""

from __future__ import annotations

import numpy as np
import torch

from moestream.quant import (
    KQUANT_BYTES,
    MXFP4_BYTES,
    Q5_0_BYTES,
    QuantScheme,
    make_scheme,
    unpack_mxfp4,
)

# Types kept as they are in the dense file; every other weight type is dequantized to fp32.
GGUF_FLOAT_TYPES = ("F32", "F16", "BF16")
INT_TYPES = ("I8", "I16", "I32", "I64", "F64")
# GGUF block types that are a store scheme exactly: Q8_0 / Q4_0 / Q4_1 (blocks of 32, fp16 d (Q4_1:
# and m), then the quants: split into the scheme's sections), Q5_0 and the K-quants (their blocks
# as they are; MXFP4, gpt-oss's experts: mxfp4, its blocks as they are).
EXACT = {"Q8_0": "int8", "Q4_0": "q4_0", "Q4_1": "q4_1", "Q5_0": "q5_0", "MXFP4": "mxfp4"}
EXACT.update({"Q4_K": "q4_k", "Q5_K": "q5_k", "Q6_K": "q6_k"})
# Q8_0 is also q8_0 exactly (its fp16 d kept: 8.5 bits per weight against int8's 9); int8 stays
# its default scheme, the one the GPU kernels read. MXFP4 is int8 exactly too (twice each e2m1
# value is an integer in [-12, 12], half the e8m0 scale a power of two: 9 bits per weight against
# the file's 4.25), the scheme the GPU kernels and the dense ones read.
EXACT_ALSO = {"Q8_0": "q8_0", "MXFP4": "int8"}
# A dense tensor's type whose EXACT scheme the dense kernels do not read: kept in this one instead
DENSE_EXACT = {"MXFP4": "int8"}
# Types a float scheme holds every value of: dequantized into it, nothing rounded (MXFP4's e2m1
# values times a power of two, gpt-oss's experts, are bf16 numbers).
HELD_BY = {"bf16": ("BF16", "MXFP4")}
_BLOCK_BYTES = {
    "Q8_0": 34,
    "Q4_0": 18,
    "Q4_1": 20,
    "Q5_0": Q5_0_BYTES,
    "MXFP4": MXFP4_BYTES,
    **{k.upper(): b for k, b in KQUANT_BYTES.items()},
}


def is_exact(kind: str, scheme: QuantScheme) -> bool:
    """GGUF type `kind` is `scheme` exactly (its blocks copy into the scheme's sections)."""
    names = (EXACT.get(kind), EXACT_ALSO.get(kind))
    return any(n is not None and make_scheme(n) == scheme for n in names)


def sections(kind: str, raw: np.ndarray, scheme: str | None = None) -> dict[str, torch.Tensor]:
    """Rows of EXACT blocks, raw uint8 [N, K/32 * block bytes] -> the scheme's sections by suffix:
    Q8_0 -> q int8 [N, K], s fp32 [N, K/32] (fp16 d widened: exact; scheme "q8_0": d fp16 [N, K/32]
    as stored); MXFP4 -> q uint8 [N, K/32, 17] as stored (scheme "int8": int8 q, s, exactly:
    quant.unpack_mxfp4); Q4_0 -> q uint8 [N, K/2]
    (the 16 nibble bytes as stored), d fp16 [N, K/32]; Q4_1 -> q as Q4_0's, dm fp16 [N, K/32, 2]
    (d, m as stored); Q5_0 -> q uint8 [N, K/32, 22] and K-quants -> q uint8 [N, K/256, B], the
    blocks as stored."""
    raw = np.ascontiguousarray(raw)
    n = raw.shape[0]
    if kind == "MXFP4" and scheme == "int8":
        q, s = unpack_mxfp4(torch.from_numpy(raw.reshape(n, -1, MXFP4_BYTES).copy()))
        return {"q": q, "s": s}
    if kind.lower() in KQUANT_BYTES or kind in ("Q5_0", "MXFP4"):
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


# What requantizing a type's experts cost, measured on the 29M reference model
# (models/pystd-moe-29m through llama.cpp's converter and `llama-quantize --pure`, every 2-D
# weight of that type where its blocks fit; issue 21's 2,048 tokens; rows in
# benchmarks/results/gguf_requant_cost.jsonl from benchmarks/gguf_requant_cost.py, docs/gguf.md):
# (type, scheme) -> (mean KL of the store, native kernels, against the file's own values: what
# convert and the kernels add; mean KL of the file's values against the original model: the
# type's own cost). A kept Q8_0 / Q4_0 store adds 0.0013 / 0.0019 (the activations' rounding).
REQUANT_COST: dict[tuple[str, str], tuple[float, float]] = {
    ("Q5_1", "int4"): (0.0244, 0.0150),
    ("Q5_1", "int8"): (0.0011, 0.0150),
    # Q5_0 is kept (q5_0) by default, adding 0.0018: these are `--quant int4` / `int8` of it
    # (int4 measured before q5_0 existed, with the dense Q5_0 tensors dequantized)
    ("Q5_0", "int4"): (0.0215, 0.0189),
    ("Q5_0", "int8"): (0.0017, 0.0189),
    ("IQ4_NL", "int4"): (0.0241, 0.0484),
    ("IQ4_NL", "int8"): (0.0007, 0.0484),
    ("IQ4_XS", "int4"): (0.0244, 0.0486),
    ("IQ4_XS", "int8"): (0.0008, 0.0486),
    ("Q3_K", "int4"): (0.0166, 0.1704),
    ("Q3_K", "int8"): (0.0009, 0.1704),
    ("IQ3_S", "int4"): (0.0298, 0.1910),
    ("IQ3_S", "int8"): (0.0017, 0.1910),
    ("IQ3_XXS", "int4"): (0.0281, 0.2633),
    ("IQ3_XXS", "int8"): (0.0011, 0.2633),
    ("Q2_K", "int4"): (0.0194, 0.6698),
    ("Q2_K", "int8"): (0.0021, 0.6698),
}


def requant_cost_note(kind: str, scheme: str) -> str:
    """`; measured ...` for convert's note on a requantized type, where REQUANT_COST has it."""
    cost = REQUANT_COST.get((kind, scheme))
    if cost is None:
        return ""
    added, own = cost
    wider = REQUANT_COST.get((kind, "int8")) if scheme == "int4" else None
    hint = f"; --quant int8 added {wider[0]:.4f}" if wider else ""
    return (
        f"; on the 29M reference model it added KL {added:.4f} to the file's own {own:.4f} "
        f"against the original{hint} (docs/gguf.md)"
    )
