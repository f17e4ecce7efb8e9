"""Static instruction mix of the decode kernels for sm_90, compiled on this machine (no GPU needed).

Triton compiles the gate/up and down kernels of kernels/triton/decode.py for an H100/H200 target
with the launch-time specialisation (16-byte aligned pointers), and cuobjdump (shipped with
Triton) lists the SASS. The loops are unrolled (`tl.static_range`), so the static count is what one
program executes. Prints per kernel: SASS instructions, thread-instructions per weight, shared
memory, layout conversions in the TTGIR, number-format conversions (I2F, F2I, ...: 16 a clock an
SM on sm_90, an eighth of fp32's rate) and the most frequent opcodes. A GPU's issue rate (4 warp
instructions per clock per SM) turns the count into a floor on time; the time itself is measured
only by bench_gpu_moe.py on the GPU. `--out` appends the figures as JSON rows.
  python benchmarks/sass_decode.py --quant int4 int8 --mma both [--out /tmp/sass.jsonl]
"""

from __future__ import annotations

import argparse
import collections
import math
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from moestream.kernels.triton import decode as dk
from moestream.kernels.triton.layout import KQUANTS
from moestream.quant import make_scheme, tensor_sections

sys.path.insert(0, str(Path(__file__).parent))
from ablations import triton_decode as ab  # noqa: E402
from common import bench_row, group_of, override, tiles_of, write_rows  # noqa: E402

MODELS = {"Qwen3-30B-A3B": (2048, 768), "Qwen3.5-35B-A3B": (2048, 512)}
Q_TYPE = {"bf16": "*bf16", "int8": "*i8", "int4": "*u8", "int4r": "*u8", "q4_0": "*u8",
          "q4_1": "*u8", **dict.fromkeys(KQUANTS, "*u8")}  # fmt: skip
S_TYPE = {"bf16": "*bf16", "int8": "*fp32", "int4": "*i32", "int4r": "*i32", "q4_0": "*fp16",
          "q4_1": "*fp16", **dict.fromkeys(KQUANTS, "*u8")}  # fmt: skip
DEVICE = "NVIDIA H200"  # the sm_90 GPU whose tuned tiles are compiled
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


def compile_sm90(fn, sig: dict, consts: dict, warps: int):
    full = {**sig, **dict.fromkeys(consts, "constexpr")}
    names = list(fn.arg_names)
    # what a launch specialises: pointers 16-byte aligned (vector loads depend on it)
    attrs = {(names.index(k),): [["tt.divisibility", 16]] for k, v in sig.items() if v[0] == "*"}
    src = ASTSource(fn=fn, signature={n: full[n] for n in names}, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})


def resources(compiled, tmp: Path) -> dict:
    """Registers per thread (and stack bytes) from the cubin's resource usage."""
    tmp.write_bytes(compiled.asm["cubin"])
    out = subprocess.run([str(CUOBJDUMP), "--dump-resource-usage", str(tmp)],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    return {k: int(v) for k, v in re.findall(r"(REG|STACK):(\d+)", out)}


def opcodes(compiled, tmp: Path) -> collections.Counter:
    tmp.write_bytes(compiled.asm["cubin"])
    out = subprocess.run([str(CUOBJDUMP), "--dump-sass", str(tmp)], capture_output=True,
                         text=True, check=True).stdout  # fmt: skip
    ops = collections.Counter()
    for line in out.splitlines():
        m = re.match(r"\s+/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_]+)", line)
        if m:
            ops[m.group(2)] += 1
    return ops


def kernels(quant: str, cfg: ab.AblationConfig, D: int, I: int):
    """(name, fn, signature, constexprs, warps, weights per program, programs per pair) of the
    two launches. quant "q4_k+q6_k": a K-quant layer whose w2 has its own scheme (Q4_K_M's)."""
    quant, down = (quant.split("+") * 2)[:2]
    qt, st = Q_TYPE[quant], S_TYPE[quant]
    common = dict(
        D=D,
        I=I,
        QUANT=dk.QUANT_CODE[quant],
        G=group_of(quant),
        TOPK=8,
        FAST=True,
        PDL=True,
        HOST=False,
    )
    # the down launch's own step and nibble conversion (Launch.down_own)
    own = {"QUANT": dk.QUANT_CODE[down], "HALF": cfg.half and down in dk.HALF_QUANTS}
    rows = 64 if quant == "int4" else cfg.bn
    rows_d = 64 if quant == "int4" else cfg.bn_d
    gu = dict(x_ptr="*bf16", ids_ptr="*i64", q_ptr=qt, s_ptr=st, hq_ptr=qt, hs_ptr=st, part_ptr="*fp32",
              cnt_ptr="*i32", h_ptr="*bf16", P="i32")  # fmt: skip
    dn = dict(h_ptr="*bf16", ids_ptr="*i64", rw_ptr="*fp32", q_ptr=qt, s_ptr=st, hq_ptr=qt, hs_ptr=st,
              dpart_ptr="*fp32", cnt_ptr="*i32", out_ptr="*bf16", P="i32")  # fmt: skip
    # every pair in one launch (moe_decode without `pick`)
    tiles = dict(BN=cfg.bn, BK=cfg.bk, SPLIT=cfg.split, sel_ptr=None, PICK=0, LANES=1)
    tiles_d = dict(BN=cfg.bn_d, BK=cfg.bk_d, COMBINE=True, sel_ptr=None, PICK=0, LANES=1)
    if cfg.fused:  # one kernel: its count is per work item loop body, weights of one layer
        sig = dict(x_ptr="*bf16", ids_ptr="*i64", rw_ptr="*fp32", q13_ptr=qt, s13_ptr=st,
                   q2_ptr=qt, s2_ptr=st, part_ptr="*fp32", cnt_g_ptr="*i32", h_ptr="*bf16",
                   ready_ptr="*i32", work_ptr="*i32", dpart_ptr="*fp32", cnt_d_ptr="*i32",
                   out_ptr="*bf16")  # fmt: skip
        consts = dict(common, P=8, NPROG=1024, BN=cfg.bn, BK=cfg.bk, SPLIT=cfg.split,
                      BN_D=cfg.bn_d, BK_D=cfg.bk_d, ELEM=cfg.elem, MMA=cfg.mma, STAGES=cfg.stages,
                      COMBINE=True, DT=tl.bfloat16 if cfg.mma else tl.float32,
                      PREC="tf32" if cfg.mma else "ieee", HALF=cfg.half,
                      CHAIN=cfg.chain)  # fmt: skip
        del consts["PDL"], consts["HOST"]  # the fused kernel reads the VRAM pool only, no PDL
        yield ("fused", ab._fused_kernel, sig, consts, cfg.num_warps, 3 * rows * D,
               max(I // rows * cfg.split, D // rows_d))  # fmt: skip
        return
    if cfg.mma:
        extra = dict(DT=tl.bfloat16, PREC="tf32")
        yield ("gate_up", dk._gate_up_mma_kernel, gu,
               {**common, **tiles, **extra, "STAGES": cfg.stages}, cfg.num_warps,
               2 * rows * D // cfg.split, I // rows * cfg.split)  # fmt: skip
        yield ("down", dk._down_mma_kernel, dn, {**common, **tiles_d, **extra}, cfg.warps_d,
               rows_d * I, D // rows_d)  # fmt: skip
    else:
        # HALF: int4 rows read as 0.5 + q / 256 (the product's and the prefetch ablation's)
        fn, extra = dk._gate_up_kernel, dict(ELEM=cfg.elem, HALF=cfg.half, CHAIN=cfg.chain)
        if cfg.prefetch:  # the ablation's gate/up kernel, with one expert's w2 section bytes
            fn = ab._gate_up_prefetch_kernel
            tiles = {
                k: v for k, v in tiles.items() if k not in ("sel_ptr", "PICK", "LANES")
            }  # not its
            gu.update(w2q_ptr=qt, w2s_ptr=st)
            nbytes = [math.prod(shape) * dt.itemsize
                      for _, dt, shape in tensor_sections(make_scheme(quant), "w2", D, I)]  # fmt: skip
            extra.update(W2Q_BYTES=nbytes[0], W2S_BYTES=sum(nbytes[1:]), NT=32 * cfg.num_warps)
        if fn is dk._gate_up_kernel:  # packed experts (the product's ES; not the ablation's)
            extra.update(ES=0)
        yield ("gate_up", fn, gu, {**common, **tiles, **extra}, cfg.num_warps,
               2 * rows * D // cfg.split, I // rows * cfg.split)  # fmt: skip
        yield ("down", dk._down_kernel, dn,
               {**common, **tiles_d, "ELEM": cfg.elem, "HALF": cfg.half, "CHAIN": cfg.chain,
                "ES": 0, **own}, cfg.warps_d, rows_d * I, D // rows_d)  # fmt: skip


def report(model: str, quant: str, cfg, tmp: Path, show_cfg: bool) -> list[dict]:
    """Compile both kernels of one config (or the fused one), print a line each, return rows."""
    D, I = MODELS[model]
    rows = []
    for name, fn, sig, consts, warps, weights, per_pair in kernels(quant, cfg, D, I):
        c = compile_sm90(fn, sig, consts, warps)
        res, ops = resources(c, tmp), opcodes(c, tmp)
        n = sum(ops.values())
        # thread-instructions per weight; with a pipelined (rolled) loop the body is counted
        # once, so the figure is a lower bound and marked with '>'
        per_weight = n * warps * 32 / weights
        rolled = ">" if cfg.mma and cfg.stages and name == "gate_up" else " "
        conv = c.asm["ttgir"].count("convert_layout")
        # number-format conversions (I2F, I2FP, F2I, F2F, ...): 16 a clock an SM on sm_90
        # against 64 for integer and 128 for fp32 arithmetic (CUDA C guide, throughput table)
        cvt = sum(v for k, v in ops.items() if re.fullmatch(r"[IF]2[IF]\w*", k))
        fam = "mma" if cfg.mma else "cuda-cores"
        # waves of the one-token grid (8 pairs) on 132 SMs at this occupancy (the fused kernel
        # is persistent: one wave of programs taking items)
        bps = ab.blocks_per_sm(res["REG"], warps, c.metadata.shared)
        waves = None if name == "fused" else 8 * per_pair / (132 * bps)
        if show_cfg:
            print(cfg)
        print(f"{model} {quant:4} {fam:10} {name:7} {n:5} SASS, "
              f"{rolled}{per_weight:5.2f} instr/weight, {res['REG']:3} regs "
              f"(stack {res.get('STACK', 0)}), {bps:2} programs/SM, "
              f"{'persistent' if waves is None else f'{waves:4.2f} waves'} "
              f"at T=1, shared {c.metadata.shared:6} B, "
              f"{conv:2} convert_layout, {cvt:3} conversions | {ops.most_common(8)}")  # fmt: skip
        config = {"model": model, "D": D, "I": I, "quant": quant, "tiles": repr(cfg),
                  "target": "sm_90"}  # fmt: skip
        rows.append(bench_row("sass_decode", config, {
            "kernel": name, "sass_instructions": n, "instr_per_weight": per_weight,
            "instr_per_weight_lower_bound": rolled == ">", "registers": res["REG"],
            "stack_bytes": res.get("STACK", 0), "programs_per_sm": bps, "waves_t1": waves,
            "shared_bytes": c.metadata.shared, "convert_layout": conv, "conversions": cvt,
            "top_opcodes": ops.most_common(8),
        }))  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quant", nargs="+", default=["bf16", "int8", "int4"])
    ap.add_argument("--model", default="Qwen3-30B-A3B", choices=list(MODELS))
    ap.add_argument("--mma", default="both", choices=["default", "both"],
                    help="the default configs only, or also the other family")  # fmt: skip
    ap.add_argument("--tmp", default="/tmp/sass_decode.cubin")
    ap.add_argument("--stages", type=int, default=None, help="override the mma gate/up stages")
    ap.add_argument(
        "--config",
        action="append",
        default=[],
        help="AblationConfig fields replacing the default's, e.g. 'bn=8,num_warps=2' "
        "(repeatable; 0/1 for flags); only these configs are compiled",
    )
    ap.add_argument("--out", default=None, help="append one JSON row per kernel here")
    args = ap.parse_args()
    D, I = MODELS[args.model]
    rows = []
    for quant in args.quant:
        cfgs = [ab.default(tiles_of(quant), D, I, DEVICE)]
        if args.config:
            cfgs = [override(cfgs[0], spec) for spec in args.config]
        elif args.mma == "both":
            other = ab.MMA_CONFIGS[quant] if not cfgs[0].mma else replace(
                cfgs[0], mma=False, bn=64, bk=128, split=8, bn_d=64, bk_d=128)  # fmt: skip
            cfgs.append(other)
        for cfg in cfgs:
            cfg = dk.fit_config(tiles_of(quant), D, I, group_of(quant), cfg)
            if args.stages is not None and cfg.mma:
                cfg = replace(cfg, stages=args.stages)
            rows += report(args.model, quant, cfg, Path(args.tmp), bool(args.config))
    if args.out:
        write_rows(args.out, rows)


if __name__ == "__main__":
    main()
