"""The native CPU expert kernels (csrc/moe_cpu.cpp: int4, int8, q4_0, q4_1, q5_0, mxfp4; csrc/kquant_cpu.cpp:
the GGUF K-quants q4_k, q5_k, q6_k): built on first use by torch's cpp_extension,
cached under config.ext_cache_root() keyed by source hash, torch version and CPU flags.

Numerics (the spec is `kernels/ref.py: qlinear_q8 / moe_q8_ref`): the activation entering each
projection is quantized per block of 32, to int8 (llama.cpp's Q8_0: d = amax / 127,
q = round(x / d)), lossy: error per element <= 1/254 of its block's max; the int8 scheme's down
projection takes int16 instead (d = amax / 32767): its SiLU*up input is heavy-tailed, and in int8
it doubled the eval KL vs the torch path (docs/cpu.md). Integer block dots are exact
and blocks are combined in fp32 in a fixed order (int4 ascending; int8 / q4_0 / q4_1 / q5_0 / mxfp4 in 8 lanes, see
ref.qlinear_q8), so one projection gives the reference's bits on
every ISA and for any number of rows (a prompt's rows pass over the weights in tiles of up to 4,
each element the one-row kernel's bits); a whole expert differs from the reference only where SiLU's exp (libm vs torch) flips an
activation's rounding. Variants: AVX-512 VNNI (with VBMI), AVX2+FMA and portable scalar, picked at run time;
MOESTREAM_NATIVE_ISA=scalar|avx2|avx512 caps the choice (tests, benchmarks).
If the build fails (no compiler, no ninja), `module()` says so once on stderr and returns None:
callers keep the torch kernels.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import shutil
import sys
from pathlib import Path

import torch

from moestream.config import ext_cache_root
from moestream.kernels.ref import ExpertActivation
from moestream.quant import is_kquant

_CSRC = Path(__file__).parent / "csrc"
# compiled and linked together
SOURCES = (_CSRC / "moe_cpu.cpp", _CSRC / "kquant_cpu.cpp", _CSRC / "avx512_cpu.cpp")
HASHED = (*SOURCES, _CSRC / "kquant_cpu.h", _CSRC / "cpu_rows.h")  # every file the build key covers
ISAS = {"scalar": 0, "avx2": 1, "avx512": 2}
SUPPORTED = ("int4", "int8", "q4_0", "q4_1", "q5_0", "q8_0", "mxfp4")  # besides the K-quants
_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512vbmi", "avx_vnni")
# No FMA contraction: the reference's roundings hold. -fopenmp: at::parallel_for is a header
# template that runs serially unless the extension itself is built with OpenMP (it then shares
# torch's libgomp.so.1, loaded first, so torch.set_num_threads applies).
CFLAGS = ["-O3", "-ffp-contract=off", "-fopenmp"]


def _cpu_flags() -> str:
    try:
        line = next(x for x in open("/proc/cpuinfo") if x.startswith("flags"))
    except (OSError, StopIteration):
        return "unknown"
    have = set(line.split(":", 1)[1].split())
    return ",".join(f for f in _FLAGS if f in have)


def _key() -> str:
    h = hashlib.sha256()
    for p in HASHED:
        h.update(p.read_bytes())
    h.update(f"{torch.__version__}|{_cpu_flags()}|{CFLAGS}".encode())
    return h.hexdigest()[:16]


def _ensure_ninja() -> None:
    """cpp_extension runs `ninja` from PATH; the pip package's binary may sit outside it."""
    if shutil.which("ninja"):
        return
    try:
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    except ImportError:
        pass


def _import_built(name: str, so: Path):
    """The cached build, imported directly: load() re-checks it through setuptools and ninja
    (~2 s per process). The key names source, flags and torch, so a present file is current."""
    if not so.is_file():
        return None
    try:
        spec = importlib.util.spec_from_file_location(name, so)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    except ImportError:  # e.g. a build still being linked: load() waits for it
        return None


@functools.cache
def module():
    """The built extension, or None (said once on stderr) when it cannot be built here."""
    try:
        key = _key()
        name, build = f"moestream_moe_cpu_{key}", ext_cache_root() / f"moe_cpu-{key}"
        built = _import_built(name, build / f"{name}.so")
        if built is not None:
            return built
        # The compile takes about a minute: said first, so a first run does not look hung.
        print(
            f"moestream: building native CPU kernels (first use, ~1 min) into {build}",
            file=sys.stderr,
            flush=True,
        )
        return _build(name, build)
    except Exception as e:  # noqa: BLE001 - any build failure means: run on the torch kernels
        msg = str(e).strip().splitlines()[-1:] or [type(e).__name__]
        print(
            f"moestream: native CPU kernels unavailable ({msg[0]}); using torch kernels",
            file=sys.stderr,
        )
        return None


def _build(name: str, build: Path):
    from torch.utils.cpp_extension import load  # imports setuptools: only to build

    _ensure_ninja()
    build.mkdir(parents=True, exist_ok=True)
    return load(
        name=name,
        sources=[str(p) for p in SOURCES],
        build_directory=str(build),
        extra_cflags=CFLAGS,
        extra_ldflags=["-fopenmp"],
        verbose=False,
    )


def available() -> bool:
    return module() is not None


def supports(scheme) -> bool:
    """Schemes the native kernels read: int4 / int8 / q4_0 / q4_1 / q5_0 / q8_0 / mxfp4 with groups of 32 (the
    activation block), and the K-quants (their sub-blocks of 32 / 16 align with the activation
    block)."""
    if is_kquant(scheme):
        return True
    return scheme.name in SUPPORTED and scheme.group_size == 32


@functools.cache
def _env_isa() -> str | None:
    return os.environ.get("MOESTREAM_NATIVE_ISA")  # read once: it is looked up per kernel call


def _isa(isa: str | None) -> int:
    isa = isa or _env_isa()
    if isa is None:
        return -1  # the best this CPU has
    if isa not in ISAS:
        raise ValueError(f"unknown native ISA {isa!r}; use {', '.join(ISAS)}")
    return ISAS[isa]


def best_isa() -> str:
    return {v: k for k, v in ISAS.items()}[module().best_isa()]


def isas() -> list[str]:
    """Every variant this CPU runs (scalar up to the best): what tests compare bit for bit."""
    if not available():
        return []
    return [k for k, v in ISAS.items() if v <= ISAS[best_isa()]]


def _pair(sec: dict, name: str) -> list[torch.Tensor]:
    """(q, its scales) of one weight: the C++ side tells the scheme by their dtypes (K-quant
    blocks and q5_0's / mxfp4's, 3-D, carry their scales: q is passed twice; q4_1's `dm` is 3-D fp16)."""
    if sec[f"{name}.q"].dim() == 3:
        return [sec[f"{name}.q"]] * 2
    for scale in ("s", "sz", "d", "dm"):
        if f"{name}.{scale}" in sec:
            return [sec[f"{name}.q"], sec[f"{name}.{scale}"]]
    raise KeyError(f"{name}: no scale section")


def linear(
    x: torch.Tensor, sec: dict, name: str, isa: str | None = None, wide: bool = False
) -> torch.Tensor:
    """x [T, K] through weight `name` of a record -> [T, N] fp32 (wide: int16 activations, int8
    weights only)."""
    return module().linear(x, *_pair(sec, name), wide, _isa(isa))


def moe(
    x: torch.Tensor,
    secs: list[dict],
    weights: torch.Tensor,
    isa: str | None = None,
    cols: list[int] | None = None,
    act: ExpertActivation | None = None,
) -> torch.Tensor:
    """x [T, D], E records' sections, weights [T, E] -> sum_e weights[:, e] * expert_e(x) [T, D]
    fp32, experts added in list order (callers pass ascending expert id). `cols`: expert e's
    weight is column cols[e] of weights [T, K] (the router's slot order, no gather op). Records
    with biases (b13, b2: gpt-oss) add them as ref.expert_ffn_q does; `act`: the clamped SwiGLU
    (None: silu(gate) * up)."""
    flat = [t for sec in secs for t in record_tensors(sec)]
    return moe_flat(
        x, flat, weights, isa, cols, [t for sec in secs for t in bias_tensors(sec)], act
    )


def record_tensors(sec: dict) -> list[torch.Tensor]:
    """The four tensors `moe` takes per expert record (w13's pair, then w2's)."""
    return [t for name in ("w13", "w2") for t in _pair(sec, name)]


def bias_tensors(sec: dict) -> list[torch.Tensor]:
    """A record's biases as `moe` takes them, fp32 (b13, b2), or [] without."""
    if "b13" not in sec:
        return []
    return [sec[n].float().contiguous() for n in ("b13", "b2")]


def moe_flat(x, flat: list[torch.Tensor], weights, isa: str | None = None, cols=None,
             biases: list[torch.Tensor] | None = None,
             act: ExpertActivation | None = None):  # fmt: skip
    """`moe` over records already flattened by `record_tensors` (a resident store keeps them),
    and their `bias_tensors` (all experts' or none)."""
    alpha, limit = (act.alpha, act.limit) if act is not None else (0.0, 0.0)
    return module().moe(x, flat, weights, _isa(isa), cols or [], biases or [], alpha, limit)


def moe_grouped(
    x: torch.Tensor,
    flat: list[torch.Tensor],
    tok: torch.Tensor,
    off: list[int],
    pw: torch.Tensor,
    isa: str | None = None,
    biases: list[torch.Tensor] | None = None,
    act: ExpertActivation | None = None,
) -> torch.Tensor:
    """A prompt's experts in one call: `flat` holds E records' `record_tensors` in ascending id,
    expert e takes rows tok[off[e]:off[e + 1]] of x [T, D] with weights pw [P] -> [T, D] fp32,
    each token's terms added in list order from zero: the bits of one `moe` call per expert over
    its rows (weight 1), each times its weight, summed in that order. biases, act: moe_flat's."""
    alpha, limit = (act.alpha, act.limit) if act is not None else (0.0, 0.0)
    return module().moe_grouped(x, flat, tok, off, pw, _isa(isa), biases or [], alpha, limit)


# ---- fused one-token decode ops: references are the model's torch code (models/layers.py) ------
# fp32 only, each float sum in one fixed order on every ISA and thread count (csrc/moe_cpu.cpp);
# they differ from torch's ops by rounding alone (tests/test_fused_decode.py bounds it).
def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float, isa: str | None = None) -> torch.Tensor:
    """x [T, D] fp32 -> w * (x / sqrt(mean(x^2) + eps))."""
    return module().rmsnorm(x, w, eps, _isa(isa))


def attend(qkv, qk_w, eps, cos, sin, kc, vc, pos, scaling, window, H, Hkv, isa=None, sinks=None):
    """One decode token after its q/k/v projection: q/k head norm (qk_w [H + Hkv, hd] or None),
    RoPE (signed sin table row), k/v written into the caches at `pos`, GQA attention over keys
    [pos - window + 1 or 0, pos] -> [1, H * hd]; `sinks` fp32 [H]: each head's learned logit in
    its softmax (gpt-oss's SinkAttention)."""
    return module().attend(
        qkv, qk_w, eps, cos, sin, kc, vc, pos, scaling, window or 0, H, Hkv, _isa(isa), sinks
    )


def route(
    x: torch.Tensor,
    gate: torch.Tensor,
    k: int,
    renorm: bool,
    isa: str | None = None,
    bias: torch.Tensor | None = None,
    topk_first: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [1, D], router weight [E, D] -> (weights [1, k], ids [1, k]): fp32 softmax over E,
    top-k descending (ties: lower id), renormalised when `renorm`; `topk_first` (gpt-oss's
    GptOssMoe): the logits plus `bias` [E], their top-k, softmax over those k."""
    w, ids = module().route(x, gate, k, renorm, _isa(isa), bias, topk_first)
    return w, ids


def decode_step():
    """An empty DecodeStep (csrc/moe_cpu.cpp): `add_layer(...)` per decoder layer, then
    `run(x, cos, sin, k_caches, v_caches, pos, isa)` runs them all in one call
    (models/native_step.py builds it from a model)."""
    return module().DecodeStep()
