"""The small decode kernels against their specs: the router top-k (kernels/triton/router.py) equals
torch.topk; the one-pass greedy choice (kernels/triton/pick.py): the first maximum equals
torch.argmax's, the log-probability log_softmax's in fp32 within summation-order rounding; the
record copy and the decode misses' staging (kernels/triton/copy.py) equal plain indexing, every
section in one launch. Runs
through TRITON_INTERPRET=1 on CPU tensors without a GPU (conftest.py), compiled on CUDA."""

from __future__ import annotations

import threading
import time

import pytest
import torch

try:
    from moestream.kernels.triton.pick import BLOCK, greedy_pick, greedy_pick_ref
except ImportError:
    pytest.skip("triton not installed (gpu extra)", allow_module_level=True)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _set_word(word: torch.Tensor, value: int) -> None:
    """word[0] = value as the provider writes its hurry word: on CUDA a copy from pinned
    memory on another stream (the copying kernel may hold the current one)."""
    if word.is_cuda:
        with torch.cuda.stream(torch.cuda.Stream(word.device)):
            word.copy_(torch.full((1,), value, dtype=torch.int32).pin_memory(), non_blocking=True)
    else:
        word.fill_(value)


def _finishes(fn, seconds: float, release=None) -> None:
    """fn() (and the GPU's work) within `seconds`, else fail: a copy whose pause ignores its
    release spins forever, and a hang would stop the suite instead of failing a test.
    `release`: called 0.3 s after fn started (a waiting copy is released by it)."""
    err: list[BaseException] = []

    def run():
        try:
            fn()
            if DEVICE == "cuda":
                torch.cuda.synchronize()
        except BaseException as e:  # re-raised on the test's thread
            err.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    if release is not None:
        time.sleep(0.3)
        release()
    t.join(seconds)
    assert not t.is_alive(), f"still running after {seconds} s: a pause that is never released"
    if err:
        raise err[0]


@pytest.mark.parametrize("n_sections,programs,pause", [(1, 8, ""), (2, 1, ""), (4, 5, ""),
                                                       (4, 64, ""), (4, 5, "idle"),
                                                       (4, 5, "hurried"), (4, 5, "hurry")])  # fmt: skip
def test_section_copy_equals_indexing(n_sections, programs, pause):
    """Rows of a (pinned on CUDA) host mirror into device slots, sections of different widths
    (one of more than the kernel's chunks x BLOCK words, one under a block), by fewer programs
    than work items (each walks several) or more; slots not named keep their poison. `pause`:
    the admission that waits for an idle staging counter (4 KB sub-blocks), the same bytes;
    "hurried": the counter up and the hurry word set from the start (whole blocks, no wait);
    "hurry": the counter up, the copy waiting, and the hurry word set from another thread
    (a wait that ignores the word spins forever)."""
    from moestream.kernels.triton.copy import BLOCK, CHUNKS, SectionCopy, copy_rows_ref

    g = torch.Generator().manual_seed(n_sections)
    shapes = [((CHUNKS * BLOCK + 40) * 2,), (3, 8), (7, 16), (5,)][:n_sections]
    dtypes = [torch.int16, torch.uint8, torch.int32, torch.float32][:n_sections]
    pin = torch.cuda.is_available()
    srcs = [torch.randint(-99, 99, (10, *sh), generator=g).to(dt).pin_memory() if pin else
            torch.randint(-99, 99, (10, *sh), generator=g).to(dt)
            for sh, dt in zip(shapes, dtypes)]  # fmt: skip
    dsts = [torch.full((6, *sh), 77, dtype=dt, device=DEVICE) for sh, dt in zip(shapes, dtypes)]
    want = [d.clone() for d in dsts]
    rows = torch.tensor([9, 0, 4], device=DEVICE)
    slots = torch.tensor([2, 5, 0], device=DEVICE)
    busy = hurry = None
    if pause:
        busy = torch.full((1,), int(pause != "idle"), dtype=torch.int32, device=DEVICE)
        hurry = torch.full((1,), int(pause == "hurried"), dtype=torch.int32, device=DEVICE)
    copy = SectionCopy(srcs, dsts, programs=programs, busy=busy, hurry=hurry)
    release = (lambda: _set_word(hurry, 1)) if pause == "hurry" else None
    _finishes(lambda: copy(rows, slots), 120, release)
    for s, d, w in zip(srcs, dsts, want):
        copy_rows_ref(s, w, rows, slots)
        assert torch.equal(d.cpu(), w.cpu())
    assert all(torch.equal(d[[1, 3, 4]].cpu(), torch.full_like(d[[1, 3, 4]].cpu(), 77))
               for d in dsts)  # fmt: skip
    SectionCopy(srcs, dsts)(rows[:0], slots[:0])  # nothing to copy: no launch


@pytest.mark.cuda
@pytest.mark.skipif(DEVICE != "cuda", reason="two streams running at once: CUDA")
@pytest.mark.parametrize("release", ["idle", "hurry"])
def test_cuda_pausing_admission_waits_while_staging_copies(release):
    """A pausing admission launched while the staging counter is above zero is still running
    200 ms later (it waits), and once another stream sets the counter to zero ("idle"), or
    copies 1 from pinned memory into the hurry word with the counter still up ("hurry", as the
    provider does), it finishes with the spec's bytes."""
    from moestream.kernels.triton.copy import SectionCopy, copy_rows_ref

    src = [torch.randint(-99, 99, (4, 5000), dtype=torch.int32).pin_memory()]
    dst = [torch.zeros((4, 5000), dtype=torch.int32, device=DEVICE)]
    want = [dst[0].clone()]
    rows, slots = torch.tensor([3, 1], device=DEVICE), torch.tensor([0, 2], device=DEVICE)
    busy = torch.ones(1, dtype=torch.int32, device=DEVICE)
    hurry = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    admit = SectionCopy(src, dst, busy=busy, hurry=hurry)
    admit(rows[:0], slots[:0])  # nothing to copy: no launch
    zero = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    admit_stream, other = torch.cuda.Stream(), torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(admit_stream):
        admit(rows, slots)
        done = torch.cuda.Event()
        done.record()
    time.sleep(0.2)
    assert not done.query(), "the admission ran while the counter was above zero"
    if release == "idle":
        with torch.cuda.stream(other):
            busy.copy_(zero)
    else:  # a copy engine's 4 bytes, read by the waiting programs
        _set_word(hurry, 1)
    done.synchronize()
    assert busy.item() == (release == "hurry")
    copy_rows_ref(src[0], want[0], rows, slots)
    assert torch.equal(dst[0].cpu(), want[0].cpu())


def _staging_sections(seed: int, shapes, dtypes, n_dst: int):
    """Random source sections of 10 records (pinned on CUDA), destination sections of n_dst
    slots filled with 77 on DEVICE, and a copy of those for the spec."""
    g = torch.Generator().manual_seed(seed)
    srcs = [torch.randint(-99, 99, (10, *sh), generator=g).to(dt) for sh, dt in zip(shapes, dtypes)]
    srcs = [s.pin_memory() for s in srcs] if torch.cuda.is_available() else srcs
    dsts = [torch.full((n_dst, *sh), 77, dtype=dt, device=DEVICE)
            for sh, dt in zip(shapes, dtypes)]  # fmt: skip
    return srcs, dsts, [d.clone() for d in dsts]


@pytest.mark.parametrize("chunks,mark", [(None, False), (3, False), (3, True)])
def test_stage_misses_equals_spec(chunks, mark):
    """A decode call's misses into its staging slots: pairs with a negative code get mirror row
    -1 - code copied into slot base + p (every section, one larger than the kernel's chunks x
    BLOCK words), pairs with a slot keep it and copy nothing; the returned slots are the spec's
    (the default chunks a pair, and fewer). `mark`: the programs that copy count themselves in
    a pausing admission's counter and out again (it ends where it began)."""
    from moestream.kernels.triton.copy import BLOCK, STAGE_CHUNKS, StageMisses, stage_misses_ref

    shapes = [((STAGE_CHUNKS * BLOCK + 40) * 2,), (3, 8), (7, 16), (5,)]
    dtypes = [torch.int16, torch.uint8, torch.int32, torch.float32]
    base, P = 5, 4
    srcs, dsts, want = _staging_sections(5, shapes, dtypes, base + P)
    codes = torch.tensor([3, -1 - 9, 1, -1 - 0], device=DEVICE)  # slots 3, 1; rows 9, 0
    slots = torch.full((P,), -5, dtype=torch.int64, device=DEVICE)
    busy = torch.full((1,), 3, dtype=torch.int32, device=DEVICE) if mark else None
    kw = {"busy": busy} | ({} if chunks is None else {"chunks": chunks})
    stage = StageMisses(srcs, dsts, **kw)
    stage(codes, slots, base)
    assert busy is None or busy.tolist() == [3]
    want_slots = stage_misses_ref(srcs, want, codes, base)
    assert slots.tolist() == want_slots.tolist() == [3, base + 1, 1, base + 3]
    for s, d, w in zip(srcs, dsts, want):
        assert torch.equal(d.cpu(), w.cpu())
        assert torch.equal(d[base + 1].cpu(), s[9]) and torch.equal(d[base + 3].cpu(), s[0])
    untouched = [0, 1, 2, 3, 4, base, base + 2]
    assert all(torch.equal(d[untouched].cpu(), torch.full_like(d[untouched].cpu(), 77))
               for d in dsts)  # fmt: skip


def test_stage_misses_in_two_launches_is_the_one_launch():
    """GpuConfig.split_staging's staging: a launch over the first sections (writing the slots),
    then one over the rest with write_slots=False (which must leave the slots as they are: a
    poisoned slots tensor stays poisoned); the pool then holds the one launch's bytes."""
    from moestream.kernels.triton.copy import StageMisses, stage_misses_ref

    shapes, dtypes = [(300,), (3, 8), (40,)], [torch.int16, torch.uint8, torch.float32]
    base, P = 4, 3
    srcs, dsts, want = _staging_sections(7, shapes, dtypes, base + P)
    codes = torch.tensor([-1 - 6, 2, -1 - 1], device=DEVICE)
    first = StageMisses(srcs[:2], dsts[:2], chunks=2)
    rest = StageMisses(srcs[2:], dsts[2:], chunks=2, write_slots=False)
    slots = torch.full((P,), -5, dtype=torch.int64, device=DEVICE)
    rest(codes, slots, base)
    assert slots.tolist() == [-5, -5, -5]  # the second launch writes no slot
    first(codes, slots, base)
    want_slots = stage_misses_ref(srcs, want, codes, base)
    assert slots.tolist() == want_slots.tolist() == [base, 2, base + 2]
    for d, w in zip(dsts, want):
        assert torch.equal(d.cpu(), w.cpu())


@pytest.mark.parametrize("P,dtype", [(8, torch.int64), (6, torch.int32)])
def test_gather_codes_is_the_index_and_the_copy(P, dtype):
    """gather_codes: codes = table[ids] and seen = ids (int64) for every pair, nothing written
    past P (the padded lanes of its one program are masked); the table's negative codes (a
    mirror row) and slots come back as they are."""
    from moestream.kernels.triton.copy import gather_codes

    g = torch.Generator().manual_seed(P)
    table = torch.randint(-300, 300, (128,), generator=g).to(DEVICE)
    ids = torch.randperm(128, generator=g)[:P].to(dtype).to(DEVICE)
    codes = torch.full((P + 2,), 99, dtype=torch.int64, device=DEVICE)
    seen = torch.full((P + 2,), 98, dtype=torch.int64, device=DEVICE)
    gather_codes(ids, table, codes[:P], seen[:P])
    assert codes[:P].tolist() == table[ids.long()].tolist()
    assert (table[ids.long()] < 0).any() and (table[ids.long()] >= 0).any()
    assert seen[:P].tolist() == ids.long().tolist()
    assert codes[P:].tolist() == [99, 99] and seen[P:].tolist() == [98, 98]


def test_stage_misses_reads_a_prefetch_instead_of_copying():
    """A prefetch (the same launch on a later layer's predicted codes, into its own slots) and
    then the layer's staging with `ahead`: a miss the prefetch copied is read from the prefetch
    slot and not copied again, a miss it did not name is staged as usual, a predicted hit or a
    mispredicted miss costs the staging nothing; slots and pool equal the spec's."""
    from moestream.kernels.triton.copy import StageMisses, stage_misses_ref

    shapes, dtypes = [(300,), (3, 8)], [torch.int16, torch.uint8]
    base, abase, P = 4, 8, 3  # slots 0-3 the table's, 4-6 staging, 8-10 the prefetch's
    srcs, dsts, want = _staging_sections(6, shapes, dtypes, abase + P)
    stage = StageMisses(srcs, dsts, chunks=2)
    predicted = torch.tensor([-1 - 7, 2, -1 - 5], device=DEVICE)  # rows 7, 5 prefetched; a hit
    out = torch.empty(P, dtype=torch.int64, device=DEVICE)
    stage(predicted, out, abase)
    assert out.tolist() == stage_misses_ref(srcs, want, predicted, abase).tolist()
    codes = torch.tensor([-1 - 5, 1, -1 - 3], device=DEVICE)  # row 5 prefetched, row 3 not
    slots = torch.full((P,), -5, dtype=torch.int64, device=DEVICE)
    for d in dsts:  # poison: the prefetched slot must not be written by the staging
        d[abase + 2] = 55
    for w in want:
        w[abase + 2] = 55
    stage(codes, slots, base, ahead=(predicted, abase))
    want_slots = stage_misses_ref(srcs, want, codes, base, ahead=(predicted, abase))
    assert slots.tolist() == want_slots.tolist() == [abase + 2, 1, base + 2]
    for s, d, w in zip(srcs, dsts, want):
        assert torch.equal(d.cpu(), w.cpu())
        assert torch.equal(d[base + 2].cpu(), s[3]) and torch.equal(d[abase].cpu(), s[7])
        assert torch.equal(d[base].cpu(), torch.full_like(d[base].cpu(), 77))  # nothing staged


@pytest.mark.parametrize("V", [7, BLOCK, BLOCK + 1, 3 * BLOCK + 17])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_pick_matches_argmax_and_log_softmax(V, dtype):
    g = torch.Generator().manual_seed(V)
    x = (torch.randn(V, generator=g) * 4).to(DEVICE, dtype)
    got, want = greedy_pick(x).cpu(), greedy_pick_ref(x).cpu()
    assert got[0] == want[0]
    assert abs(got[1] - want[1]) <= 1e-5 * max(1.0, abs(want[1].item()))


def test_greedy_pick_takes_the_first_of_tied_maxima_across_blocks():
    V = 3 * BLOCK
    x = torch.zeros(V, device=DEVICE)
    for i in (2 * BLOCK + 5, BLOCK + 9, 2 * BLOCK):  # the max three times, in two later blocks
        x[i] = 3.0
    got = greedy_pick(x).cpu()
    assert int(got[0]) == BLOCK + 9 == int(torch.argmax(x))
    want = greedy_pick_ref(x).cpu()[1]
    assert abs(got[1] - want) <= 1e-5 * abs(want)  # fp32 sums of 12,288 terms in two orders


@pytest.mark.parametrize("E,k,T", [(128, 8, 1), (60, 4, 3), (256, 8, 8), (8, 2, 2)])
def test_router_topk_matches_torch(E, k, T):
    from moestream.kernels.triton.router import topk_rows

    g = torch.Generator().manual_seed(E * k + T)
    s = torch.softmax(torch.randn(T, E, generator=g), -1).to(DEVICE)
    top, ids = topk_rows(s, k)
    want_top, want_ids = torch.topk(s, k, dim=-1)
    assert torch.equal(ids, want_ids) and torch.equal(top, want_top)


def test_router_topk_ties_take_the_lower_id():
    from moestream.kernels.triton.router import topk_rows

    s = torch.tensor([[0.1, 0.3, 0.2, 0.3, 0.1]], device=DEVICE)
    top, ids = topk_rows(s, 3)
    assert ids.tolist() == [[1, 3, 2]] and top[0].tolist() == pytest.approx([0.3, 0.3, 0.2])


@pytest.mark.parametrize("packed", [False, True])
def test_routing_ties_take_the_lower_id(packed):
    """route_rows' rule on tied probabilities (equal logits): the lower expert id first, with
    the max-then-min rounds and with the packed 64-bit key alike; masked columns never win."""
    from moestream.kernels.triton.router import route_rows

    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0, 0.0, 2.0]], device=DEVICE)  # 6 of 8 columns used
    w, ids = route_rows(logits, 5, False, torch.float32, packed=packed)
    assert ids.tolist() == [[1, 3, 5, 2, 0]]
    want = torch.softmax(logits.float().cpu(), -1)[0, [1, 3, 5, 2, 0]]
    torch.testing.assert_close(w[0].cpu(), want, rtol=1e-6, atol=0)  # the sum's order differs
    assert w[0, 0] == w[0, 1] == w[0, 2]


def _moe_block(E: int, k: int, renorm: bool, act_dtype: bool):
    import transformers as T

    from moestream.models import model_args_from_dict
    from moestream.models.layers import SparseMoe

    cfg = T.Qwen3MoeConfig(vocab_size=64, hidden_size=64, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                           moe_intermediate_size=32, num_experts=E, num_experts_per_tok=k,
                           norm_topk_prob=renorm)  # fmt: skip
    torch.manual_seed(E + k)
    return SparseMoe(model_args_from_dict(cfg.to_dict()), 0, weights_in_act_dtype=act_dtype)


# The interpreter casts to bf16 by truncation: bf16 weights are checked on CUDA only.
DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])


@pytest.mark.parametrize("E,k,T,renorm", [(128, 8, 1, True), (61, 4, 3, False), (256, 8, 8, True)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gemm", [False, True])
def test_routing_kernels_match_the_block_rule(E, k, T, renorm, dtype, gemm):
    """route_rows on the router's logits, and route_decode from x (its GEMM too, called twice:
    its counter resets; then with other tiles and the packed top-k) = SparseMoe.route + the
    combine cast (the torch code): the same ids, weights within fp32 summation order (then the
    same bits once cast)."""
    from moestream.kernels.triton.router import route_decode, route_decode_impl, route_rows

    block = _moe_block(E, k, renorm, act_dtype=True).to(DEVICE, dtype)
    for _ in range(2 if gemm else 1):
        x = torch.randn(T, 64, device=DEVICE, dtype=dtype)
        with torch.inference_mode():
            want_w, want_ids = block.route(x)
            want_w = block._combine_dtype(want_w, x)
            if gemm:
                w, ids = route_decode(x, block.gate.weight, k, renorm, dtype)
            else:
                w, ids = route_rows(block.gate(x), k, renorm, dtype)
        assert torch.equal(ids, want_ids)
        assert w.dtype == want_w.dtype
        rtol = 1e-5 if dtype == torch.float32 else 2**-8  # bf16: at most a rounding step apart
        torch.testing.assert_close(w.float(), want_w.float(), rtol=rtol, atol=1e-6)
    if gemm:  # the benchmark's variants: 4 rows and one warp a program, the packed top-k
        with torch.inference_mode():
            w2, ids2 = route_decode_impl(x, block.gate.weight, k, renorm, dtype, 4, 1, True)
        assert torch.equal(ids2, ids)
        torch.testing.assert_close(w2.float(), w.float(), rtol=rtol, atol=1e-6)


# The interpreter rounds fp16 as CUDA does (and truncates bf16): bf16 runs on CUDA only.
NORM_DTYPES = [torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


@pytest.mark.parametrize("T,D", [(1, 2048), (3, 96), (8, 37)])
@pytest.mark.parametrize("dtype", NORM_DTYPES)
def test_rms_norm_rows_matches_the_module(T, D, dtype):
    """rms_norm_rows = RMSNorm.forward's torch code (norm in fp32, cast, times the weight): at
    most one rounding step apart (the sum of squares in another order)."""
    from moestream.kernels.triton.norm import rms_norm_rows
    from moestream.models.layers import RMSNorm

    torch.manual_seed(T * D)
    m = RMSNorm(D, 1e-6).to(DEVICE, dtype)
    with torch.no_grad():
        m.weight.copy_(torch.randn(D) + 1)
    x = (torch.randn(T, D) * 3).to(DEVICE, dtype)
    with torch.inference_mode():
        want = m(x)
        got = rms_norm_rows(x, m.weight, m.eps)
    assert got.dtype == want.dtype
    step = 2**-8 if dtype == torch.bfloat16 else 2**-10
    torch.testing.assert_close(got.float(), want.float(), rtol=2 * step, atol=0)
    assert (got != want).float().mean() < 0.05  # rounding flips, not a different function


def test_the_pcie_benchmark_dry_run_checks_every_variant(tmp_path):
    """benchmarks/bench_pcie.py --dry-run: the copy engine's, the admission kernel's (by 1 and 4
    programs) and the staging's (1 and 2 chunks a pair) moves of 1-16 tiny records end to end on
    the CPU (each checked against the mirror's rows inside the script), one row per variant,
    setting and count. Under Triton < 3.7 (the GPU machine's 3.6) the script refuses --dry-run
    with exit 2: that interpreter cannot run the kernels' loops; the compiled kernels are tested
    on CUDA above. --graph with --dry-run is refused (exit 2)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).parents[1]
    sys.path.insert(0, str(root / "benchmarks"))
    from bench_pcie import interpreter_too_old

    path = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
    # --graph (CUDA graphs, inline PTX) runs on a GPU only: refused with the fix, exit 2
    r = subprocess.run([sys.executable, str(root / "benchmarks/bench_pcie.py"), "--dry-run",
                        "--graph"], env={**os.environ, "PYTHONPATH": path}, capture_output=True,
                       text=True, timeout=300)  # fmt: skip
    assert r.returncode == 2 and "--graph runs alone on a GPU" in r.stderr
    if interpreter_too_old():
        r = subprocess.run([sys.executable, str(root / "benchmarks/bench_pcie.py"), "--dry-run"],
                           env={**os.environ, "PYTHONPATH": path}, capture_output=True,
                           text=True, timeout=300)  # fmt: skip
        assert r.returncode == 2 and "needs Triton >= 3.7" in r.stderr
        pytest.skip("Triton < 3.7: its interpreter cannot run the copy kernels' loops")
    out = tmp_path / "rows.jsonl"
    r = subprocess.run([sys.executable, str(root / "benchmarks/bench_pcie.py"), "--dry-run",
                        "--out", str(out)], env={**os.environ, "PYTHONPATH": path},
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    got = {(x["variant"], x.get("programs", x.get("chunks")), x["records"]) for x in rows}
    counts = (1, 2, 4, 8, 16)
    want = {("memcpy", None, n) for n in counts} | {("section_copy", p, n) for p in (1, 4)
                                                    for n in counts}  # fmt: skip
    assert got == want | {("stage", c, n) for c in (1, 2) for n in counts if n <= 8}
    assert all(x["bench"] == "pcie" and x["config"]["dry_run"] and x["us"] > 0 for x in rows)


@pytest.mark.parametrize("T,D", [(1, 2048), (3, 96)])
@pytest.mark.parametrize("dtype", NORM_DTYPES)
def test_add_rms_norm_rows_is_the_add_then_the_norm(T, D, dtype):
    """add_rms_norm_rows(x, y) = (x + y, rms_norm_rows(x + y)) bit for bit: torch's add (fp32,
    one rounding) and the same row reduction as the norm alone."""
    from moestream.kernels.triton.norm import add_rms_norm_rows, rms_norm_rows

    torch.manual_seed(T + D)
    w = (torch.randn(D) + 1).to(DEVICE, dtype)
    x, y = (torch.randn(T, D) * 3).to(DEVICE, dtype), torch.randn(T, D).to(DEVICE, dtype)
    s, h = add_rms_norm_rows(x, y, w, 1e-6)
    assert torch.equal(s, x + y)
    assert torch.equal(h, rms_norm_rows(x + y, w, 1e-6))


def test_the_router_benchmark_dry_run_checks_every_variant(tmp_path):
    """benchmarks/bench_gpu_router.py --dry-run: torch's rule and each (rows, warps, packed)
    variant of route_decode on a tiny router through the interpreter, each variant's ids and
    weights checked against torch's inside the script, one schema row each (times only on CUDA)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).parents[1]
    out = tmp_path / "rows.jsonl"
    cmd = [sys.executable, str(root / "benchmarks/bench_gpu_router.py"), "--dry-run", "--rows", "1",
           "4", "--warps", "1", "--out", str(out)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(root)}
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["config"]["variant"] for row in rows] == [
        "torch", *(f"rows={n},warps=1,packed={p}" for n in (1, 4) for p in (0, 1))]  # fmt: skip
    assert all(row["config"]["dry_run"] and row["us"] is None for row in rows)
