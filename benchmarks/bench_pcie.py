"""How fast expert records cross PCIe from pinned host RAM into VRAM, by who moves them: the copy
engine (`cudaMemcpyAsync`, one call per record and section, so its time includes issuing those
calls from the host, as a host-driven miss path would), the admission kernel
(`kernels/triton/copy.py` SectionCopy: SM loads through unified addressing, few programs) and the
decode step's miss staging (StageMisses: a one-token call's K pairs, the misses among them copied).
The 50% pool's PCIe fraction (docs/gpu.md, "Staged misses") rests on the SM-issued rate of
these reads, measured here on an otherwise idle GPU beside the copy engine's, in one run, for
several admission programs (`programs`: its bytes in flight) and staging chunks a pair.

Contention rows: in a streamed decode the admissions of one step run on the copy stream while
the next step stages its misses, both reading pinned memory over the same link. Each such row
starts an admission of ADMIT_N records on one stream and, beside it, STAGE_CALLS staging calls
of one missed pair each on another, and reports both rates while they share the link. A row
with `pause` true runs the pausing admission (GpuConfig.admit_pause: it waits while a staging
launch copies), ADMIT_PROGRAMS programs.

`--graph` times only staging calls, GRAPH_CALLS of them replayed in one CUDA graph (the other
rows include the host's launch of each call): the product's StageMisses and the copy engine's
memcpy nodes of the same records, at 1, 2, 4 and 8 misses a call. (Loads with PTX's L2::256B
prefetch size, an ablation measured within 1.5% of the product's at 05557ed, were removed:
docs/gpu.md, "The staging measured inside graphs".)

Records have the GPU pool's int4-rows sections at a model shape (default Qwen3-30B-A3B: D 2048,
I 768, group 32); a pinned mirror of `--rows` records; each timed call moves n distinct records
to n slots (CUDA events, median of `--reps`). Rows: variant, records, MB moved, us, GB/s and
its fraction of the 1 GiB pinned copy measured in the same run.

    PYTHONPATH=. python benchmarks/bench_pcie.py --out rows.jsonl --commit abc1234
    PYTHONPATH=. python benchmarks/bench_pcie.py --graph --out rows.jsonl --commit abc1234
    python benchmarks/bench_pcie.py --dry-run   # CPU: tiny records through the interpreter
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_peers import h2d_gbps  # noqa: E402
from common import bench_row, cuda_median_seconds, median_seconds, write_rows  # noqa: E402

COUNTS = (1, 2, 4, 8, 16)
TOPK = 8  # a decode call's pairs (the staging grid)
PROGRAMS = (4, 8, 32, 256)  # admission programs (SectionCopy); 256 ~ the old grid's at 16 records
STAGE_CHUNKS = (32, 128)  # staging programs a pair (StageMisses)
ADMIT_N, STAGE_CALLS = 16, 8  # contention rows: one admission beside that many staging calls


def sections(D: int, I: int, G: int, n: int, device, pin: bool) -> list[torch.Tensor]:
    """int4 rows sections [n, ...]: w13.q, w13.rz, w2.q, w2.rz (bytes, int32 words)."""
    shapes = [((2 * I, D // 2), torch.uint8), ((2 * I, D // G), torch.int32),
              ((D, I // 2), torch.uint8), ((D, I // G), torch.int32)]  # fmt: skip
    out = []
    for sh, dt in shapes:
        t = torch.randint(0, 100, (n, *sh), dtype=dt)
        out.append(t.pin_memory() if pin else t.to(device))
    return out


def stage_call(stage, n: int, rows, device, base: int):
    """A staging call with n misses (mirror rows) among TOPK pairs; the others hit slots 0.."""
    codes = torch.arange(TOPK, dtype=torch.int64)
    codes[:n] = -1 - rows[:n]
    codes = codes.to(device)
    got = torch.empty(TOPK, dtype=torch.int64, device=device)
    return lambda: stage(codes, got, base)


def variants(src, dst, n: int, gen, device, programs=PROGRAMS, chunks=STAGE_CHUNKS):
    """name -> (config, a call moving n records: rows of src -> slots of dst), each checked."""
    from moestream.kernels.triton.copy import SectionCopy, StageMisses

    rows = torch.randperm(src[0].shape[0], generator=gen)[:n]
    slots = torch.randperm(dst[0].shape[0] - TOPK, generator=gen)[:n]
    out = {}

    def memcpy():
        for s, d in zip(src, dst):
            for r, t in zip(rows.tolist(), slots.tolist()):
                d[t].copy_(s[r], non_blocking=True)

    out["memcpy"] = ({}, memcpy)
    rows_d, slots_d = rows.to(device), slots.to(device)
    for p in programs:
        admit = SectionCopy(src, dst, programs=p)
        out[f"section_copy/{p}"] = ({"programs": p}, lambda a=admit: a(rows_d, slots_d))
    if n <= TOPK:  # the staging grid is one call's pairs: n misses among TOPK
        base = dst[0].shape[0] - TOPK
        for c in chunks:
            call = stage_call(StageMisses(src, dst, chunks=c), n, rows, device, base)
            out[f"stage/{c}"] = ({"chunks": c}, call)
    return out, rows, slots


def contention(src, dst, reps: int, gen, device) -> list[dict]:
    """Rows of an admission (ADMIT_N records, `programs`, pausing or not) and STAGE_CALLS
    one-miss staging calls (`chunks`) running at once on two streams: each side's time and
    rate."""
    from moestream.kernels.triton.copy import ADMIT_PROGRAMS, SectionCopy, StageMisses

    record = sum(t[0].numel() * t.element_size() for t in src)
    rows = torch.randperm(src[0].shape[0], generator=gen)
    admit_rows, stage_rows = rows[:ADMIT_N].to(device), rows[ADMIT_N:]
    slots = torch.arange(ADMIT_N, dtype=torch.int64, device=device)
    base = dst[0].shape[0] - TOPK
    s_admit, s_stage = torch.cuda.Stream(), torch.cuda.Stream()
    out = []
    busy = torch.zeros(1, dtype=torch.int32, device=device)
    hurry = torch.zeros(1, dtype=torch.int32, device=device)  # never set: always pause
    for c in STAGE_CHUNKS:
        # None: the staging alone; pause: the admission waits while the staging copies
        for p, pause in [*((p, False) for p in PROGRAMS), (ADMIT_PROGRAMS, True), (None, False)]:
            stage = StageMisses(src, dst, chunks=c, busy=busy if pause else None)
            calls = [stage_call(stage, 1, stage_rows[i : i + 1], device, base)
                     for i in range(STAGE_CALLS)]  # fmt: skip
            admit = SectionCopy(src, dst, programs=p or 1, busy=busy if pause else None,
                                hurry=hurry if pause else None)  # fmt: skip
            times = []
            for _ in range(reps + 1):  # the first: warm-up
                ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
                torch.cuda.synchronize()
                ev[0].record()
                s_admit.wait_event(ev[0])
                s_stage.wait_event(ev[0])
                if p is not None:
                    with torch.cuda.stream(s_admit):
                        admit(admit_rows, slots)
                        ev[1].record()
                with torch.cuda.stream(s_stage):
                    for call in calls:
                        call()
                    ev[2].record()
                torch.cuda.synchronize()
                times.append((ev[0].elapsed_time(ev[1]) / 1e3 if p is not None else None,
                              ev[0].elapsed_time(ev[2]) / 1e3))  # fmt: skip
            times = times[1:]
            stage_s = statistics.median(t[1] for t in times)
            row = {"variant": "contention", "chunks": c, "programs": p, "pause": pause,
                   "stage_us": stage_s * 1e6,
                   "stage_gbps": STAGE_CALLS * record / stage_s / 1e9}  # fmt: skip
            if p is not None:
                admit_s = statistics.median(t[0] for t in times)
                row.update(admit_us=admit_s * 1e6, admit_gbps=ADMIT_N * record / admit_s / 1e9)
            out.append(row)
    return out


GRAPH_CALLS = 8  # --graph: staging calls a captured graph replays, each on other mirror rows


def graph_rows(src, dst, reps: int, gen, device) -> list[dict]:
    """--graph: staging calls with 1, 2, 4 or 8 misses among TOPK pairs, GRAPH_CALLS of them
    captured in one CUDA graph and replayed (no host launch in the timed span, as in a captured
    decode step): the product's StageMisses and, for the copy engine's rate at that size, the
    same records' sections as memcpy nodes. Each variant's last call is checked against the
    mirror."""
    from common import capture_graph

    from moestream.kernels.triton.copy import StageMisses

    base = dst[0].shape[0] - TOPK
    out = []
    for n in (1, 2, 4, 8):
        picks = [torch.randperm(src[0].shape[0], generator=gen)[:n] for _ in range(GRAPH_CALLS)]
        calls = {"stage": [stage_call(StageMisses(src, dst), n, rows, device, base)
                           for rows in picks]}  # fmt: skip

        def memcpy(picks=picks):
            for rows in picks:
                for x, d in zip(src, dst):
                    for j, r in enumerate(rows.tolist()):
                        d[base + j].copy_(x[r], non_blocking=True)

        calls["memcpy_nodes"] = [memcpy]
        for name, fns in calls.items():
            g = capture_graph(lambda fns=fns: [f() for f in fns])
            t = cuda_median_seconds(g.replay, reps)
            torch.cuda.synchronize()
            for x, d in zip(src, dst):  # the last call's records are in the staging slots
                assert torch.equal(d[base : base + n].cpu(), x[picks[-1]].cpu()), name
            nbytes = GRAPH_CALLS * n * sum(x[0].numel() * x.element_size() for x in src)
            out.append({"variant": "graph", "kernel": name, "records": n,
                        "us_per_call": t / GRAPH_CALLS * 1e6, "gbps": nbytes / t / 1e9})  # fmt: skip
    return out


def interpreter_too_old() -> bool:
    """Triton < 3.7: its interpreter cannot run the copy kernels' loops (checked 3.6.0 against
    3.7.0 and 3.9.0 with NumPy 2.4)."""
    from importlib.metadata import version

    major, minor = (int(v) for v in version("triton").split(".")[:2])
    return (major, minor) < (3, 7)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="2048,768,32", help="D,I,group of the int4 rows records")
    ap.add_argument("--rows", type=int, default=256, help="records in the pinned mirror")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--dry-run", action="store_true", help="CPU, interpreter, tiny records")
    ap.add_argument(
        "--contention-only",
        action="store_true",
        help="only the contention rows (the copy alone at 1-16 records skipped)",
    )
    ap.add_argument(
        "--graph",
        action="store_true",
        help="only the staging calls replayed in CUDA graphs: the product's and the copy "
        "engine's memcpy nodes",
    )
    ap.add_argument("--out", default=None)
    ap.add_argument("--commit", default=None)
    a = ap.parse_args(argv)
    if a.graph and (a.dry_run or a.contention_only):
        ap.error("--graph runs alone on a GPU: drop --dry-run / --contention-only")
    if a.dry_run and interpreter_too_old():
        print("bench_pcie.py: --dry-run needs Triton >= 3.7 (3.6's interpreter passes launch "
              "arguments as 1-element arrays, which NumPy 2 refuses as range bounds); on a GPU "
              "run it without --dry-run", file=sys.stderr)  # fmt: skip
        return 2
    if a.dry_run:  # before triton is imported: it reads the variable when kernels are decorated
        os.environ["TRITON_INTERPRET"] = "1"
    elif not torch.cuda.is_available():
        print("bench_pcie.py: no CUDA device; --dry-run checks it on the CPU", file=sys.stderr)
        return 2
    cuda = not a.dry_run
    device = "cuda" if cuda else "cpu"
    D, I, G = (64, 64, 32) if a.dry_run else (int(v) for v in a.shape.split(","))
    n_rows = 20 if a.dry_run else a.rows
    src = sections(D, I, G, n_rows, device, pin=cuda)
    dst = [torch.zeros((max(*COUNTS, ADMIT_N) + TOPK, *t.shape[1:]), dtype=t.dtype,
                       device=device)
           for t in src]  # fmt: skip
    record = sum(t[0].numel() * t.element_size() for t in src)
    ceiling = h2d_gbps() if cuda else None
    print(f"record {record / 1e6:.2f} MB" + (f", pinned 1 GiB copy {ceiling:.1f} GB/s" if cuda
                                              else ", dry run: nothing measured"))  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    rows_out = []
    if a.graph:
        for r in graph_rows(src, dst, a.reps, gen, device):
            r["h2d_gbps"] = ceiling
            rows_out.append(r)
            print(
                f"graph {r['kernel']:<18} {r['records']} records a call "
                f"{r['us_per_call']:8.1f} us {r['gbps']:6.1f} GB/s ({r['gbps'] / ceiling:.2f})"
            )
    for n in () if a.contention_only or a.graph else COUNTS:
        # the interpreter runs every program in turn: few of them in a dry run
        sweep = ((1, 4), (1, 2)) if a.dry_run else (PROGRAMS, STAGE_CHUNKS)
        calls, rows, slots = variants(src, dst, n, gen, device, *sweep)
        for name, (cfg, fn) in calls.items():
            for d in dst:
                d.zero_()
            s = median_seconds(fn, 1 if a.dry_run else a.reps, cuda)
            if cuda:
                torch.cuda.synchronize()
            at = slots if not name.startswith("stage") else torch.arange(n) + dst[0].shape[0] - TOPK
            for x, d in zip(src, dst):  # every variant moved the right bytes
                assert torch.equal(d[at].cpu(), x[rows].cpu()), name
            gbps = n * record / s / 1e9
            r = {"variant": name.split("/")[0], **cfg, "records": n, "mb": n * record / 1e6,
                 "us": s * 1e6, "gbps": gbps, "h2d_gbps": ceiling,
                 "h2d_fraction": gbps / ceiling if ceiling else None}  # fmt: skip
            rows_out.append(r)
            print(f"{name:<17} {n:>3} records {r['mb']:7.1f} MB {r['us']:9.1f} us "
                  f"{gbps:7.1f} GB/s" + (f" ({r['h2d_fraction']:.2f})" if ceiling else ""))  # fmt: skip
    if cuda and not a.graph:  # two streams at once: the interpreter runs one kernel at a time
        for r in contention(src, dst, a.reps, gen, device):
            r["h2d_gbps"] = ceiling
            rows_out.append(r)
            kind = "pausing admission" if r["pause"] else "admission"
            admit = (f"{kind} ({r['programs']} programs) {r['admit_gbps']:5.1f} GB/s beside "
                     if r["programs"] else "alone: ")  # fmt: skip
            print(f"contention: {admit}staging ({r['chunks']} chunks) {r['stage_gbps']:5.1f} GB/s")
    if a.out:
        config = {"shape": [D, I, G], "record_bytes": record, "mirror_rows": n_rows,
                  "reps": a.reps, "dry_run": a.dry_run}  # fmt: skip
        write_rows(a.out, [bench_row("pcie", config, r, a.commit) for r in rows_out])
    return 0


if __name__ == "__main__":
    sys.exit(main())
