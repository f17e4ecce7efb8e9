"""Admission programs A/B at a streamed share (docs/gpu.md, "Bounded admissions"), off the product
path: the same store decoded by bench_peers' child with the decode admissions' programs (their
bytes in flight over PCIe: `SectionCopy`'s default, `kernels/triton/copy.py` ADMIT_PROGRAMS; a
prompt's fill names its own, FILL_PROGRAMS) set per variant, interleaved, the
order reversed every other repeat. Rows: programs, decode tok/s (median), PCIe MB per token, the
fraction of the pinned-copy rate measured in the same run, hit rate.

    PYTHONPATH=. python benchmarks/ablations/bench_admit.py STORE --share 0.5 --programs 8,256 \
        --reps 2 --out rows.jsonl --commit abc1234
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


def child(store: str, programs: int, share: float, threads: int, P: int, N: int) -> None:
    """bench_peers' child with every SectionCopy made from now on using `programs` programs."""
    from moestream.kernels.triton import copy

    copy.SectionCopy.__init__.__defaults__ = (programs,)
    moestream_child(store, "triton", threads, P, N, "cuda", share)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("store")
    ap.add_argument("--share", type=float, default=0.5)
    ap.add_argument("--programs", default="8,256", help="admission programs, one variant each")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("-p", "--prompt-tokens", type=int, default=64)
    ap.add_argument("-n", "--tokens", type=int, default=64)
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None)
    ap.add_argument("--commit", default=None)
    a = ap.parse_args(argv)
    if a.child is not None:
        child(a.store, a.child, a.share, a.threads, a.prompt_tokens, a.tokens)
        return 0
    variants = [int(p) for p in a.programs.split(",")]
    ceiling = h2d_gbps()
    runs: dict[int, list[dict]] = {p: [] for p in variants}
    for rep in range(a.reps):
        for p in variants if rep % 2 == 0 else variants[::-1]:
            cmd = [sys.executable, __file__, a.store, "--child", str(p), "--share", str(a.share),
                   "--threads", str(a.threads), "-p", str(a.prompt_tokens), "-n", str(a.tokens)]  # fmt: skip
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            runs[p].append(json.loads(out.strip().splitlines()[-1]))
            print(
                f"rep {rep} programs {p}: {runs[p][-1]['decode_tok_s']:.1f} tok/s", file=sys.stderr
            )
    rows = []
    base = statistics.median(r["decode_tok_s"] for r in runs[variants[0]])
    for p in variants:
        tps = statistics.median(r["decode_tok_s"] for r in runs[p])
        mb = statistics.median(r["pcie_bytes_per_token"] for r in runs[p]) / 1e6
        row = {"programs": p, "decode_tok_s": tps,
               "decode_tok_s_all": [r["decode_tok_s"] for r in runs[p]],
               "ratio_to_first": tps / base, "pcie_mb_per_token": mb, "h2d_gbps": ceiling,
               "pcie_fraction": tps * mb / 1e3 / ceiling,
               "hit_rate": statistics.median(r["hit_rate"] for r in runs[p]),
               "mode": runs[p][0]["mode"]}  # fmt: skip
        rows.append(row)
        print(
            f"programs {p:>4}: {tps:7.1f} tok/s ({row['ratio_to_first']:.3f}x), {mb:6.1f} MB/token, "
            f"{row['pcie_fraction']:.2f} of {ceiling:.1f} GB/s, hits {row['hit_rate']:.3f}"
        )
    config = {"store": a.store, "share": a.share, "reps": a.reps, "prompt_tokens": a.prompt_tokens,
              "tokens": a.tokens, "threads": a.threads}  # fmt: skip
    write_rows(a.out, [bench_row("admit_ab", config, r, a.commit) for r in rows])
    return 0


if __name__ == "__main__":
    sys.exit(main())
