"""CPU expert kernel cost at Qwen3-30B-A3B / Qwen3.5-35B-A3B expert shapes (D 2048, I 768 / 512),
one decode token: the torch kernels (kernels/cpu.py, what StreamConfig(kernel="cpu") runs) vs the
native ones (kernels/native.py), interleaved, medians, against a DRAM read ceiling measured in the
same run (torch sum over a 1 GiB fp32 tensor, once per rep): `of_ceiling` is the median GB/s over
the median ceiling, `of_ceiling_paired` the median of each rep's GB/s over its own ceiling.

- expert: one record (gate|up, SiLU*up, down) per call;
- layer: K=8 records of 128 distinct ones per call, weighted and summed (the decode step's MoE);
  records rotate through all 128, so the weights come from DRAM, not cache;
- layers: 15 layer ops back to back over 120 distinct records, timed as one (a decode step runs
  its layers one after another; a lone call right after the 1 GiB ceiling read also pays for
  restarting: ~10-15% of its time in this VM).
Bytes read = whole padded records (what a store read moves). int8's torch path dequantizes to fp32
and calls F.linear (no torch kernel takes per-block scales).

    python benchmarks/bench_kernels_cpu.py [--threads 2] [--reps 15]
    python benchmarks/bench_kernels_cpu.py --model gpt-oss --schemes int8,mxfp4   # D = I = 2880,
        top-4, biases and the clamped SwiGLU (gpt-oss-20b / 120b's experts: their MXFP4 kept as
        mxfp4, 4.25 bits a weight, or as int8, 9)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_row, write_rows  # noqa: E402

from moestream.kernels import native  # noqa: E402
from moestream.kernels.dispatch import qlinear  # noqa: E402
from moestream.kernels.ref import ExpertActivation, expert_ffn_q  # noqa: E402
from moestream.quant import RecordLayout, make_scheme, quantize_expert, record_bytes  # noqa: E402
from moestream.store.io import record_memory  # noqa: E402

N_RECORDS, K = 128, 8
LAYERS = N_RECORDS // K - 1  # the layers row: distinct records, none of the previous call's
# --model: (D, I values, routed experts a token, biases and the clamped SwiGLU)
MODELS = {
    "qwen3": (2048, (768, 512), 8, None),
    "gpt-oss": (2880, (2880,), 4, ExpertActivation(1.702, 7.0)),
}


def make_records(
    scheme: str, D: int, I: int, bias: bool = False
) -> tuple[RecordLayout, list[dict]]:
    """128 record buffers (8 distinct quantized experts, each copied 16 times: distinct memory)."""
    layout = RecordLayout.build(make_scheme(scheme), D, I, bias=bias)
    g = torch.Generator().manual_seed(0)

    def biases():
        return (torch.randn(2 * I, generator=g), torch.randn(D, generator=g)) if bias else ()

    bases = [
        record_bytes(layout, quantize_expert(layout, torch.randn(2 * I, D, generator=g) / D**0.5,
                                             torch.randn(D, I, generator=g) / I**0.5, *biases()))
        for _ in range(K)
    ]  # fmt: skip
    # one allocation as the engine's slot pool holds them (store.io.record_memory)
    mem = record_memory(N_RECORDS * layout.size)
    pool = torch.frombuffer(mem, dtype=torch.uint8, count=N_RECORDS * layout.size)
    for i in range(N_RECORDS):
        pool[i * layout.size : (i + 1) * layout.size] = torch.frombuffer(
            bytearray(bases[i % K]), dtype=torch.uint8
        )
    return layout, [
        layout.views(pool[i * layout.size : (i + 1) * layout.size]) for i in range(N_RECORDS)
    ]


def torch_layer(x, secs, w, act=None):
    """The torch path of StoreExperts' decode: one expert at a time, added in order."""
    lin, out = qlinear("cpu"), torch.zeros_like(x)
    for e, sec in enumerate(secs):
        out += expert_ffn_q(x, sec, 32, lin, act) * w[:, e : e + 1]
    return out


def variants(names: list[str], act: ExpertActivation | None = None) -> dict:
    """torch, and the native layer op at each ISA this CPU runs (avx2, avx512...), by name."""
    out = {"torch": lambda x, secs, w: torch_layer(x, secs, w, act)} if "torch" in names else {}
    for isa in native.isas()[1:]:  # scalar: the spec's twin, not a speed path
        if f"native-{isa}" in names or "native" in names:
            out[f"native-{isa}"] = lambda x, secs, w, isa=isa: native.moe(x, secs, w, isa, act=act)
    return out


def ceiling_gbps(big: torch.Tensor) -> float:
    t0 = time.perf_counter()
    big.sum()
    return big.numel() * 4 / (time.perf_counter() - t0) / 1e9


def bench_shape(scheme: str, D: int, I: int, reps: int, big: torch.Tensor, fns: dict,
                k: int = K, bias: bool = False) -> list[dict]:  # fmt: skip
    """k: the routed experts a layer op takes (the layers row: LAYERS * K records, k a call)."""
    layout, recs = make_records(scheme, D, I, bias)
    x, w = torch.randn(1, D), torch.rand(1, k)
    times = {(v, n): [] for v in fns for n in (1, k, LAYERS * K)}
    ceil, nxt = [], 0
    with torch.inference_mode():
        for rep in range(reps + 1):  # rep 0 warms up
            for n in (1, k, LAYERS * K):
                for v, fn in fns.items():  # interleaved: all see the same machine state
                    secs = [recs[(nxt + i) % N_RECORDS] for i in range(n)]
                    nxt += n
                    t0 = time.perf_counter()
                    for l0 in range(0, n, k):  # n = LAYERS * K: one layer op after another
                        fn(x, secs[l0 : l0 + k], w[:, : min(n, k)])
                    if rep:
                        times[v, n].append(time.perf_counter() - t0)
            if rep:
                ceil.append(ceiling_gbps(big))
    c = statistics.median(ceil)
    rows = []
    for (v, n), ts in times.items():
        dt, nbytes = statistics.median(ts), n * layout.size
        rows.append({
            "op": {1: "cpu_expert_kernel", k: "cpu_moe_layer"}.get(n, "cpu_moe_layers"),
            "D": D, "I": I, "K": min(n, k), "layers": max(1, n // k), "scheme": scheme, "variant": v,
            "us": round(dt * 1e6, 1), "record_bytes": nbytes,
            "gbps": round(nbytes / dt / 1e9, 2), "dram_ceiling_gbps": round(c, 2),
            "of_ceiling": round(nbytes / dt / 1e9 / c, 3),
            # per rep against the ceiling read right after it, then the median: the VM's DRAM
            # rate drifts by 2x within a run, and a ratio of two medians mixes periods
            "of_ceiling_paired": round(
                statistics.median(nbytes / t / 1e9 / ci for t, ci in zip(ts, ceil)), 3
            ),
        })  # fmt: skip
    # each native variant vs torch and vs the first native one, same run
    for op in ("cpu_expert_kernel", "cpu_moe_layer", "cpu_moe_layers"):
        same = {r["variant"]: r for r in rows if r["op"] == op}
        first = next((r for v, r in same.items() if v.startswith("native")), None)
        for v, r in same.items():
            if v.startswith("native") and "torch" in same:
                r["speedup_vs_torch"] = round(same["torch"]["us"] / r["us"], 2)
            if v.startswith("native") and first is not None and r is not first:
                r[f"speedup_vs_{first['variant']}"] = round(first["us"] / r["us"], 2)
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--schemes", default="int4,int8")
    p.add_argument(
        "--variants", default="torch,native", help="torch, native (every ISA), native-avx2, ..."
    )
    p.add_argument("--model", choices=list(MODELS), default="qwen3",
                   help="expert shapes: Qwen3-30B-A3B's (I 768 / 512), or gpt-oss's")  # fmt: skip
    p.add_argument("--out", default=None, help="append JSON rows here")
    a = p.parse_args()
    D, widths, k, act = MODELS[a.model]
    torch.set_num_threads(a.threads)
    if not native.available():
        sys.exit("native kernels did not build: nothing to compare")
    # 1 GiB fp32 in the records' kind of memory (huge pages): the DRAM read ceiling
    big = torch.frombuffer(record_memory(2**30), dtype=torch.float32).fill_(1.0)
    fns = variants(a.variants.split(","), act)
    rows = []
    for scheme in a.schemes.split(","):
        for I in widths:
            for row in bench_shape(scheme, D, I, a.reps, big, fns, k, bias=act is not None):
                row.update(threads=a.threads, isa=row["variant"].removeprefix("native-"))
                print({k: row[k] for k in ("op", "scheme", "I", "variant", "us", "gbps",
                                           "dram_ceiling_gbps", "of_ceiling",
                                           "of_ceiling_paired")})  # fmt: skip
                rows.append(row)
    config = {
        "threads": a.threads,
        "reps": a.reps,
        "model": a.model,
        "D": D,
        "I": list(widths),
        "K": k,
        "layers": LAYERS * K // k,
        "variants": list(fns),
    }
    write_rows(a.out, [bench_row("cpu_kernels", config, r) for r in rows])


if __name__ == "__main__":
    main()
