"""Admissions A/B at a streamed share (docs/gpu.md, "Bounded admissions", "Scored admission"),
off the product path and without llama.cpp: the same store decoded by bench_peers' child, one
variant per (pool variant, programs) pair, interleaved, the order reversed every other repeat.
A pool variant is a bench_peers name (`triton`: the product's staged pool, scored admission;
`triton-admitall`: every miss admitted; `triton-pause@H`: pausing admissions that go at once
while H admission launches are in flight, `GpuExperts.HURRY_PENDING`); programs are the decode
admissions' programs (their bytes
in flight over PCIe: `SectionCopy`'s default, `kernels/triton/copy.py` ADMIT_PROGRAMS; a prompt's
fill names its own, FILL_PROGRAMS). Rows: the variant, decode tok/s (median), PCIe MB per token,
the fraction of the pinned-copy rate measured in the same run, hit rate, misses declined and
admission layer steps skipped (every victim busy) per token.

    PYTHONPATH=. python benchmarks/ablations/bench_admit.py STORE --share 0.25 \
        --kernels triton,triton-admitall --programs 32 --reps 2 --out rows.jsonl --commit abc1234
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from bench_peers import h2d_gbps, moestream_child  # noqa: E402
from common import bench_row, write_rows  # noqa: E402


def child(store: str, programs: int, share: float, threads: int, P: int, N: int,
          kernel: str = "triton") -> None:  # fmt: skip
    """bench_peers' child (pool variant `kernel`, `@H` setting GpuExperts.HURRY_PENDING) with
    every SectionCopy made from now on using `programs` programs."""
    from moestream.experts.gpu import GpuExperts
    from moestream.kernels.triton import copy

    kernel, _, hurry = kernel.partition("@")
    if hurry:
        GpuExperts.HURRY_PENDING = int(hurry)
    # defaults (programs, busy, hurry): only programs changes
    rest = copy.SectionCopy.__init__.__defaults__[1:]
    copy.SectionCopy.__init__.__defaults__ = (programs, *rest)
    moestream_child(store, kernel, threads, P, N, "cuda", share)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("store")
    ap.add_argument("--share", type=float, default=0.5)
    ap.add_argument("--programs", default="32", help="admission programs, one variant each")
    ap.add_argument("--kernels", default="triton", help="bench_peers pool variants, e.g. "
                    "triton,triton-admitall")  # fmt: skip
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("-p", "--prompt-tokens", type=int, default=64)
    ap.add_argument("-n", "--tokens", type=int, default=64)
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--kernel", default="triton", help=argparse.SUPPRESS)  # the child's
    ap.add_argument("--out", default=None)
    ap.add_argument("--commit", default=None)
    a = ap.parse_args(argv)
    if a.child is not None:
        child(a.store, a.child, a.share, a.threads, a.prompt_tokens, a.tokens, a.kernel)
        return 0
    variants = [(k, int(p)) for k in a.kernels.split(",") for p in a.programs.split(",")]
    ceiling = h2d_gbps()
    runs: dict[tuple, list[dict]] = {v: [] for v in variants}
    for rep in range(a.reps):
        for v in variants if rep % 2 == 0 else variants[::-1]:
            cmd = [sys.executable, __file__, a.store, "--child", str(v[1]), "--kernel", v[0],
                   "--share", str(a.share), "--threads", str(a.threads),
                   "-p", str(a.prompt_tokens), "-n", str(a.tokens)]  # fmt: skip
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            runs[v].append(json.loads(out.strip().splitlines()[-1]))
            print(f"rep {rep} {v[0]} programs {v[1]}: {runs[v][-1]['decode_tok_s']:.1f} tok/s",
                  file=sys.stderr)  # fmt: skip
    rows = []
    base = statistics.median(r["decode_tok_s"] for r in runs[variants[0]])
    for v in variants:
        rs = runs[v]
        tps = statistics.median(r["decode_tok_s"] for r in rs)
        mb = statistics.median(r["pcie_bytes_per_token"] for r in rs) / 1e6
        row = {"kernel": v[0], "programs": v[1], "decode_tok_s": tps,
               "decode_tok_s_all": [r["decode_tok_s"] for r in rs],
               "ratio_to_first": tps / base, "pcie_mb_per_token": mb, "h2d_gbps": ceiling,
               "pcie_fraction": tps * mb / 1e3 / ceiling,
               "hit_rate": statistics.median(r["hit_rate"] for r in rs),
               "declined_per_token": statistics.median(r.get("declined_per_token", 0) for r in rs),
               "skipped_steps_per_token": statistics.median(r.get("skipped_steps_per_token", 0) for r in rs),
               "hurried_per_token": statistics.median(r.get("hurried_per_token", 0) for r in rs),
               "mode": rs[0]["mode"]}  # fmt: skip
        rows.append(row)
        print(
            f"{v[0]:>16} programs {v[1]:>4}: {tps:7.1f} tok/s ({row['ratio_to_first']:.3f}x), "
            f"{mb:6.1f} MB/token, {row['pcie_fraction']:.2f} of {ceiling:.1f} GB/s, hits "
            f"{row['hit_rate']:.3f}, declined {row['declined_per_token']:.1f} / layer steps skipped "
            f"{row['skipped_steps_per_token']:.1f} per token, hurried {row['hurried_per_token']:.2f}"
        )
    from moestream.store.format import Store

    st = Store(a.store)  # the checkpoint's depth decides how many misses a token has
    config = {"store": a.store, "share": a.share, "reps": a.reps, "prompt_tokens": a.prompt_tokens,
              "tokens": a.tokens, "threads": a.threads, "layers": len(st.crc)}  # fmt: skip
    write_rows(a.out, [bench_row("admit_ab", config, r, a.commit) for r in rows])
    return 0


if __name__ == "__main__":
    sys.exit(main())
