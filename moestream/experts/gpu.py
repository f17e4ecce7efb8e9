"""The GPU expert provider: a VRAM slot pool fed from pinned host buffers, Triton kernels on slot ids.

route (on the GPU) -> make resident -> compute (Triton, `kernels/triton`) -> combine.

- The VRAM pool is one `StackedExperts` whose leading axis is the slot, so the routed-only kernels
  run on slot ids unchanged. `resident=True` gives every (layer, expert) its own slot
  (slot = layer index * E + expert): the slot ids are computed on the device and nothing syncs.
- Streaming (`gpu_budget` bytes of slots): the slot table is store/policy.py's `SlotTable` (plain
  Python). A device tensor `slot_map [L, E]` (-1 = not resident) turns the routed ids into slot ids
  on the GPU; the ids come to the host once per MoE layer (the one synchronisation, counted in
  `sync_seconds`) so the table can resolve misses. Misses are read by the store's IO pool
  (`RecordReader`, pread) into pinned host staging buffers (or come from a pinned mirror of every
  record with `pinned_mirror=True`), copied host->device in one transfer on a separate CUDA stream,
  scattered into the pool's section tensors there, and the compute stream waits on that copy's event.
- Device-side misses (`GpuConfig.device_side_misses`: streaming with the pinned mirror and the
  Triton kernels): the mirror holds every record section by section, and `slot_map` holds, for a
  key that is not in VRAM, the code -1 - (its mirror row). A one-token call then gathers the
  codes on the device and the decode kernels read a miss straight from pinned host memory through
  unified addressing (kernels/triton/decode.py `host=`): the same arithmetic, the resident bits,
  no synchronisation, so the step is captured in a CUDA graph. Each step's routed ids and the
  codes its kernels ran with go to one of two pinned host buffers behind it (`decode_issued`);
  once the generator has read a step (`decode_read`) and a later one is running, the slot table
  takes the read step's routing: evicted keys get their codes back on the compute stream, and
  admitted records are copied mirror -> slot on the copy stream behind every issued step
  (kernels/triton/copy.py), their slots published in `slot_map` by that stream right after the
  copy (a step reads a code before or after the publish: the mirror row or the copied slot, the
  same bits). Greedy decode therefore runs one step ahead of the host, as with every expert
  resident. Prompts (T > 1) take the per-layer host path above, after every pending copy.
- int4 records enter the pool (and the mirror) repacked into the kernels' row layout
  (kernels/triton/layout.py: `rows_sections`; the same numbers, moved): the decode kernels then
  run int8's CUDA-core structure on half the bytes instead of the store's k-major 64-row blocks.
  q4_0 / q4_1 records (a GGUF's Q4_0 / Q4_1 experts) already hold those row bytes (an fp16 d a
  32-block; q4_0 no zero, q4_1 an fp16 m) and enter as they are.
- `device="cpu"` with `kernel="ref"` runs the same bookkeeping without CUDA (tests, CI); with
  `kernel="triton"` the interpreter runs the device-side misses on CPU tensors.
"""

from __future__ import annotations

import contextlib
import functools
import time

import torch

from moestream.config import ConfigError
from moestream.experts.base import ExpertProvider
from moestream.experts.config import GpuConfig, slot_count
from moestream.kernels.dispatch import moe_kernel
from moestream.kernels.triton import (
    SCHEMES,
    combine_pairs,
    moe_pairs,
    prompt_kernels,
    prompt_path,
    scratch_bytes,
    unsupported,
)  # fmt: skip
from moestream.kernels.triton.layout import (
    DOWN_FALLBACKS,
    KQUANTS,
    StackedExperts,
    padded_view,
    pool_shapes,
    rows_sections,
)
from moestream.quant import QuantScheme
from moestream.store.format import Store
from moestream.store.io import RecordReader
from moestream.store.policy import PolicyError, SlotTable, make_policy

PAGE = 4096


class PinnedPool:
    """n record buffers in one page-aligned (pinned when `pin`) host allocation; the interface
    `RecordReader` reads into (`size`, `memview(slot)`)."""

    def __init__(self, size: int, n: int, pin: bool):
        self.size, self.n = size, n
        raw = torch.empty(n * size + PAGE, dtype=torch.uint8, pin_memory=pin)
        off = -raw.data_ptr() % PAGE  # O_DIRECT wants page-aligned buffers
        self.buf = raw[off : off + n * size].view(n, size)
        self._np = self.buf.view(-1).numpy()

    def memview(self, slot: int) -> memoryview:
        return memoryview(self._np[slot * self.size : (slot + 1) * self.size])


def check_scheme(store: Store) -> None:
    """Refuse, before anything is loaded, experts in a scheme the GPU kernels do not read: every
    projection in a GPU scheme (q5_0: only as a K-quant layer's down), one record layout in
    every layer or K-quant layers only (a GGUF's blocks kept per tensor, as a Q4_K_M file's q6_k
    and q4_k down projections, or its q5_0 and int8 fallbacks where 256 does not divide the
    experts' width: the pool's slots hold the largest record, each layer's kernels their own), a
    down of its own scheme only below K-quant gate/up (a K-quant or DOWN_FALLBACKS)."""
    fix = "run it on the CPU, or convert the model with --quant int4 (or int8) for the GPU"
    layouts = set(store.layouts.values())
    if any(sec.name in ("b13", "b2") for layout in layouts for sec in layout.sections):
        raise ConfigError(
            f"{store.folder} holds experts with biases and the clamped SwiGLU (gpt-oss), which "
            "the GPU kernels do not take yet: run it on the CPU (--device cpu; its native layer "
            "op takes them)"
        )
    w13s, w2s = ({layout.schemes[i].name for layout in layouts} for i in (0, 1))
    for name in sorted(w13s - set(SCHEMES) | (w2s - set(SCHEMES) - set(DOWN_FALLBACKS))):
        raise ConfigError(
            f"{store.folder} holds {name} experts, which have no GPU kernel yet (CPU only; "
            f"the GPU reads {', '.join(SCHEMES)}, and {', '.join(DOWN_FALLBACKS)} as a "
            f"K-quant layer's down); {fix}"
        )

    def kquant_layer(layout) -> bool:  # K-quant gate/up over a K-quant or fallback down
        w13, w2 = layout.schemes
        return w13.name in KQUANTS and w2.name in (*KQUANTS, *DOWN_FALLBACKS)

    if len(layouts) > 1 and not all(kquant_layer(layout) for layout in layouts):
        raise ConfigError(
            f"{store.folder} holds experts whose record layout differs across layers "
            f"({store.quant_name}), which the GPU pool holds for K-quant layers only; {fix}"
        )
    for layout in layouts:
        w13, w2 = layout.schemes
        if w13 != w2 and not kquant_layer(layout):
            raise ConfigError(
                f"{store.folder} holds {w13.name} gate/up and {w2.name} down projections, which "
                f"the GPU kernels do not read together (a down of its own scheme: below K-quant "
                f"gate/up, in a K-quant or {' / '.join(DOWN_FALLBACKS)}); {fix}"
            )


def _schemes(w13: QuantScheme, w2: QuantScheme) -> tuple[QuantScheme, QuantScheme | None]:
    """(w13's scheme, w2's where it differs): StackedExperts' scheme and down."""
    return w13, (w2 if w2 != w13 else None)


class GpuExperts(ExpertProvider):
    """ExpertProvider with a VRAM (or, for tests, CPU) slot pool. `stats()`: cumulative counters."""

    def __init__(self, store: Store, cfg: GpuConfig):
        check_scheme(store)
        self.store, self.cfg = store, cfg
        self.device = torch.device(cfg.device)
        self.cuda = self.device.type == "cuda"
        self.kernel = moe_kernel(cfg.kernel)
        a = store.args
        self.layers = sorted(store.crc)
        self.layer_index = {layer: i for i, layer in enumerate(self.layers)}
        self.E, self.K = a.num_experts, a.num_experts_per_tok
        self.n_slots = slot_count(store, cfg)
        self.size = store.slot_size  # the largest record (per-layer layouts: a Q4_K_M store's)
        # Each section at its largest layout's shape; a layer of a smaller one reads its records
        # packed at each slot's start (layout.padded_view: _layer_view). One layout: the pool's.
        self.layouts = [store.layouts[layer] for layer in self.layers]
        self.mixed = len(set(self.layouts)) > 1
        self.largest: dict = {}  # section name -> its largest Section over the layouts
        owner: dict = {}  # section name -> the schemes of the layout holding the largest
        for layout in self.layouts:
            for sec in layout.sections:
                if sec.name not in self.largest or sec.nbytes > self.largest[sec.name].nbytes:
                    self.largest[sec.name] = sec
                    owner[sec.name] = layout.schemes
        # the pool's schemes (w13's, w2's where it differs): the one layout's, or those of the
        # layouts holding its largest sections (each layer's views: its own, _layer_view)
        self.scheme, self.down = _schemes(owner["w13.q"][0], owner["w2.q"][1])
        # VRAM pool: per section [n_slots, *shape] (the Triton kernels index it by slot id), int4
        # in the kernels' row layout (layout.py: records are repacked as they enter the pool).
        self.rows = (self.scheme.name == "int4" and self.scheme.group_size % 32 == 0
                     and cfg.kernel == "triton")  # fmt: skip
        # the decode kernels must take the shape (else the reference kernel runs, host misses)
        shape_only = self._stacked(self._sections((0,), self.device))
        self.device_misses = cfg.device_side_misses() and unsupported(shape_only, 1) is None
        # a declined miss is read from the mirror again next time: only with device misses
        self.scored = self.device_misses and cfg.admit == "scored"
        # Staged misses: K slots of the budget past the table's hold one decode layer's misses
        # (a budget of fewer than 2K slots leaves the kernels reading the mirror: describe()).
        self.staged = (self.device_misses and cfg.miss_reads == "stage"
                       and self.n_slots >= 2 * self.K)  # fmt: skip
        if self.staged:
            self.n_slots -= self.K
        # admissions wait while the staging copies (GpuConfig.admit_pause: on unless turned off)
        self.pausing = self.staged and cfg.admit_pause is not False
        # Prefetch (GpuConfig.prefetch): two sets of K slots past the staging, one per layer
        # parity (a layer reads its set while the next layer's prefetch fills the other).
        self.prefetching = cfg.prefetch != "none"
        if self.prefetching:
            if not self.staged:
                raise ConfigError(
                    f"--predictor {cfg.prefetch} on the GPU prefetches beside the staged misses, "
                    "and this pool does not stage them (the Triton decode kernels do not take "
                    f"this model's shape, or the budget holds under {2 * self.K} slots): raise "
                    "--gpu-budget or drop --predictor"
                )
            if self.n_slots < 3 * self.K:
                raise ConfigError(
                    f"--predictor {cfg.prefetch} on the GPU takes {3 * self.K} slots of the budget "
                    f"(the staging and two prefetch sets of {self.K}) beside a slot table of at "
                    f"least {self.K}; this budget holds {slot_count(store, cfg)} slots of "
                    f"{self.size / 2**20:.1f} MiB: raise --gpu-budget or drop --predictor"
                )
            self.n_slots -= 2 * self.K
        n_pool = self.n_slots + (self.K if self.staged else 0) + 2 * self.K * self.prefetching
        # routed=E: a call's ids are one layer's experts (the grouped prefill's scratch bound)
        self.pool = self._stacked(self._sections((n_pool,), self.device), self.E)
        # each layer's view of the pool (its own layout, per-layer layouts; else the pool)
        self.pools = [self._layer_view(i, self.pool.sections, self.E)
                      for i in range(len(self.layers))]  # fmt: skip
        self.copy_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.h2d_bytes = 0
        self.syncs = 0
        self.sync_seconds = 0.0
        self.table_seconds = 0.0  # host time in the slot table (after the sync, before copies)
        self.chunked = 0  # layer calls whose experts did not fit the pool at once
        self.copy_seconds = 0.0  # host time issuing copies (and waiting for staging reuse)
        self._copy_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._copy_gpu_ms = 0.0
        self._last_copy: torch.cuda.Event | None = None
        self.table = None
        self.mirror: StackedExperts | None = None
        if cfg.resident:
            self.reader, self.host = None, None
            self._fill_resident()
            # each layer's experts as a view: its routed ids are its slots (no offset kernel)
            E = self.E
            self.layer_pools = [
                self._layer_view(
                    i, {k: v[i * E : (i + 1) * E] for k, v in self.pool.sections.items()}
                )
                for i in range(len(self.layers))
            ]
            self._choose_prefill()
            return
        self._choose_prefill()
        self.table = SlotTable(self.n_slots, make_policy(cfg.policy, layers=self.layers), self.K)
        # slot_map[layer index, expert] = slot, or the absent code when not resident (kept equal
        # to the table): -1, or with device misses -1 - mirror row (row = layer index * E + e).
        L = len(self.layers)
        self.slot_map = self._absent(torch.arange(L * self.E, device=self.device)).view(L, self.E)
        self._batch = min(self.E, self.n_slots)  # records per host-path copy batch
        if self.device_misses:
            self.reader = self.host = None
            self._fill_mirror()
            self._init_device_misses()
        else:
            n_stage = L * self.E if cfg.pinned_mirror else self._batch
            self.host = PinnedPool(self.size, n_stage, pin=self.cuda)
            self.reader = RecordReader(store, self.host, cfg.io)
            if cfg.pinned_mirror:  # read every record once; a miss is then one host->device copy
                for i, layer in enumerate(self.layers):
                    self.reader.read(layer, [(e, i * self.E + e) for e in range(self.E)])
            # Device staging for one batch of records (scattered into the sections from there).
            self.dev_stage = torch.empty((self._batch, self.size), dtype=torch.uint8,
                                         device=self.device)  # fmt: skip
        # Pinned scratch for the small index tensors sent with each layer's misses (slots, slot_map
        # updates): one layer touches at most E experts, so 7E entries hold one call's. Reused
        # once the last call's copies are done (the next layer's sync, or an explicit one).
        self._meta = torch.empty(8 * self.E, dtype=torch.int64, pin_memory=self.cuda)
        self._meta_np = self._meta.numpy()
        self._meta_at = 0

    def _choose_prefill(self) -> None:
        """A prompt's kernels (GpuConfig.prefill), fixed once the pool is allocated: the grouped
        GEMMs need their bf16 scratch of a layer's experts free beside it (else the Triton
        kernels, and describe() says why). Free VRAM is read at start-up, before the KV cache."""
        a = self.store.args
        self.prefill_scratch = scratch_bytes(self.E, a.hidden_size, a.moe_intermediate_size)
        free = None
        if self.cuda and self.cfg.kernel == "triton":  # (the reference needs no scratch)
            dev = self.device
            free, _ = torch.cuda.mem_get_info(dev)
            # what torch's cache holds unused is free for the scratch too
            free += torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
        cap = torch.cuda.get_device_capability(self.device) if self.cuda else None
        self.prefill, self.prefill_why = prompt_kernels(
            self.cfg.prefill, self.pool.kernel_quant, cap, free, self.prefill_scratch
        )
        if self.cfg.kernel == "triton":
            self.kernel = functools.partial(self.kernel, prefill=self.prefill)

    def _stacked(self, secs: dict[str, torch.Tensor], routed: int | None = None) -> StackedExperts:
        """Pool-layout sections as the kernels' StackedExperts (w2's own scheme where it differs)."""
        return StackedExperts(self.scheme, secs, routed, self.down)

    def _layer_view(self, li: int, secs: dict[str, torch.Tensor],
                    routed: int | None = None) -> StackedExperts:  # fmt: skip
        """Pool-layout sections [n, *largest shape] as layer li's StackedExperts: a section of a
        smaller layout read packed at each slot's start (layout.padded_view), its own schemes."""
        if not self.mixed:
            return self._stacked(secs, routed)
        layout = self.layouts[li]
        own = {sec.name: sec for sec in layout.sections}  # (a fallback's sections: its layers')
        views = {
            n: t if (t.shape[1:], t.dtype) == (own[n].shape, own[n].dtype)
            else padded_view(t, own[n].shape, own[n].dtype)
            for n, t in secs.items() if n in own
        }  # fmt: skip
        w13, down = _schemes(*layout.schemes)
        return StackedExperts(w13, views, routed, down)

    def _sections(self, lead: tuple, device, pin: bool = False) -> dict[str, torch.Tensor]:
        """Empty pool-layout sections [*lead, *shape] (the pool's, or the mirror's; each section
        at its largest layout's shape)."""
        shapes = {n: (sec.shape, sec.dtype) for n, sec in self.largest.items()}
        # int4's sz -> rz [N, K/G] int32 (rows), or sz in the store-layout kernels' order
        shapes = pool_shapes(self.scheme, shapes, self.rows)
        return {n: torch.empty((*lead, *sh), dtype=dt, device=device, pin_memory=pin)
                for n, (sh, dt) in shapes.items()}  # fmt: skip

    def _pool_layout(self, secs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Store-layout sections [m, ...] -> the pool's layout (int4: repacked into rows, or its
        sz reordered once for the store-layout kernels)."""
        return rows_sections(self.scheme, secs, self.rows)

    def _absent(self, rows):
        """slot_map's code for mirror rows (layer index * E + expert) not in VRAM."""
        return -1 - rows if self.device_misses else torch.full_like(rows, -1)

    # ---- device-side misses ----------------------------------------------------------------------
    def _fill_mirror(self) -> None:
        """Every record into the pinned mirror, section by section ([L * E, *shape] each, the
        pool's layout, so the kernels index it like the pool)."""
        E = self.E
        n = len(self.layers) * E
        secs = self._sections((n,), "cpu", pin=self.cuda)
        stage = PinnedPool(self.size, E, pin=False)
        reader = RecordReader(self.store, stage, self.cfg.io)
        try:
            for i, layer in enumerate(self.layers):
                reader.read(layer, [(e, e) for e in range(E)])
                got = {s.name: stage.buf[:, s.offset : s.offset + s.nbytes].contiguous()
                       .view(s.dtype).view(E, *s.shape) for s in self.layouts[i].sections}  # fmt: skip
                rows = self._layer_view(i, {k: v[i * E : (i + 1) * E] for k, v in secs.items()})
                for name, t in self._pool_layout(got).items():
                    rows.sections[name].copy_(t)
        finally:
            reader.close()
        self.mirror = self._stacked(secs)
        self.mirrors = [self._layer_view(i, secs) for i in range(len(self.layers))]

    def _init_device_misses(self) -> None:
        L, K = len(self.layers), self.K
        # each one-token call's routed ids and the codes its kernels ran with (rows 0..L-1 and
        # L..2L-1), copied to one of AHEAD pinned buffers after the step is issued; prefetching,
        # also the slots the kernels read (2L..), the prefetch's codes (3L..) and predicted ids
        # (4L..) of each layer (layer 0's: never predicted, zeros)
        rows = (5 if self.prefetching else 2) * L
        self._seen = torch.zeros(rows, K, dtype=torch.int64, device=self.device)
        self._seen_host = torch.zeros(self.AHEAD, rows, K, dtype=torch.int64,
                                      pin_memory=self.cuda)  # fmt: skip
        self._issued: list[int] = []  # steps issued and not read yet: their buffers
        self._ready: list = []  # read steps' rows of _seen (ids, codes, ...), for the table
        self._n_issued = 0
        # one account's index uploads (evicted rows + codes, admitted rows + slots: at most
        # 4 L K values) through AHEAD pinned buffers, each reused once its last upload is done
        self._idx_host = torch.zeros(self.AHEAD, 4 * L * K, dtype=torch.int64, pin_memory=self.cuda)
        self._n_idx = 0
        cuda_event = torch.cuda.Event if self.cuda else lambda: None
        self._seen_ev = [cuda_event() for _ in range(self.AHEAD)]
        self._idx_ev = [cuda_event() for _ in range(self.AHEAD)]
        from moestream.kernels.triton.copy import FILL_PROGRAMS, SectionCopy, StageMisses

        names = list(self.pool.sections)
        pairs = [self.mirror.sections[n] for n in names], [self.pool.sections[n] for n in names]
        # admit_pause: staging programs count themselves here, admissions wait for zero
        pause = self.pausing
        busy = torch.zeros(1, dtype=torch.int32, device=self.device) if pause else None
        # ... unless the host sets hurry: its admissions are falling behind (_account). A device
        # word, written by a 4-byte copy on a stream of its own from pinned 0 / 1 (never
        # rewritten, so a copy still queued reads the value it was given); the waiting programs
        # poll it, and a pinned word polled by 32 programs took the link from the staging
        self._hurry = torch.zeros(1, dtype=torch.int32, device=self.device) if pause else None
        if pause:
            self._hurry_vals = torch.tensor([0, 1], dtype=torch.int32, pin_memory=self.cuda)
            self._hurry_stream = torch.cuda.Stream(self.device, priority=-1) if self.cuda else None
        self._hurry_set = 0  # the value last written
        # decode admissions: few bytes in flight
        self._admit_rows = SectionCopy(*pairs, busy=busy, hurry=self._hurry)
        self._copy_rows = SectionCopy(*pairs, programs=FILL_PROGRAMS)  # a prompt's misses
        self._stage = self._stage_down = None
        if self.staged and self.cfg.split_staging:  # gate/up sections, then down's beside gate/up
            down = [n.startswith("w2.") for n in names]  # the down kernel's sections
            gu = [[t for t, d in zip(ts, down) if not d] for ts in pairs]
            dn = [[t for t, d in zip(ts, down) if d] for ts in pairs]
            self._stage = StageMisses(*gu, busy=busy)
            self._stage_down = StageMisses(*dn, busy=busy, write_slots=False)
        elif self.staged:
            self._stage = StageMisses(*pairs, busy=busy)
        if self.staged:  # the slots a call's pairs are read from (written by the staging)
            self._stage_slots = torch.zeros(K, dtype=torch.int64, device=self.device)
        side = self.cfg.hits_first or self.cfg.split_staging
        if self.staged and side and self.cuda:  # first to the SMs: it waits on PCIe
            self._stage_stream = torch.cuda.Stream(self.device, priority=-1)
        self._routes: list | None = None  # set_routes: each MoE block's router (prefetch)
        if self.prefetching:
            self._side = torch.cuda.Stream(self.device) if self.cuda else None
            self._prefetch_out = torch.zeros(K, dtype=torch.int64, device=self.device)
        self.prefetch_reads = 0  # predicted misses copied into a prefetch set
        self.prefetch_used = 0  # routed misses read from a prefetch set (not staged again)
        self.predict_routed = 0  # routed pairs of predicted layers
        self.predict_correct = 0  # of which the prediction named
        self._pending: list[tuple[object, list[tuple[int, int, int]]]] = []  # (event, admits)
        self.host_reads = 0  # routed pairs whose records came from pinned host memory
        self.device_hits = 0
        self.skipped = 0  # layer steps whose admissions were skipped: every victim was busy
        self.declined = 0  # misses the scored admission left in pinned RAM (GpuConfig.admit)
        self.hurried = 0  # accounts that left the hurry word set (admit_pause)
        self.admit_bytes = 0  # decode admissions copied (h2d_bytes also counts the prompts')
        self._table_counted = [0, 0]  # the table's hits / misses for decode steps (replaced)
        self.bookkeeping_seconds = 0.0  # host time in decode_read + decode_issued
        self.decode_table_seconds = 0.0  # of which: the slot table's accesses

    AHEAD = 2  # routing buffers: a step in flight while the host reads the one before
    # admit_pause: pausing admissions go at once while this many admission launches are in
    # flight. Paused without a bound they fell behind where the staging holds the link most of
    # a token (25%): keys admitted but not landed are read from the mirror, and the decode hit
    # rate fell 0.64 -> 0.47 (docs/gpu.md, "Admissions that pause"). A bound of 1 did not
    # help while hurried admissions still copied 4 KB blocks (docs/gpu.md, a1f37fe's section).
    HURRY_PENDING = 3

    def set_routes(self, routes: list) -> None:
        """Prefetch: each MoE block's `route` (x [1, D] -> (weights, ids [1, K])), in layer
        order; decode layer li runs routes[li + 1] on its own router input (the stale gate)."""
        assert self.prefetching and len(routes) == len(self.layers)
        self._routes = routes

    def _device_call(self, li: int, x, ids, weights) -> torch.Tensor:
        """One token: codes gathered on the device, misses staged into VRAM (or read from the
        mirror by the kernels). Syncs nothing."""
        from moestream.kernels.triton.copy import gather_codes  # triton: the gpu extra only
        from moestream.kernels.triton.decode import moe_decode

        codes = self._seen[len(self.layers) + li]  # the gather written where the host reads it
        gather_codes(ids.reshape(-1), self.slot_map[li], codes, self._seen[li])
        if self.prefetching:
            slots = self._prefetching_stage(li, x, codes)
            return moe_decode(x, slots.view_as(ids), weights, self.pools[li])
        if self._stage is not None and self.cfg.hits_first:
            return self._hits_first(li, x, ids, weights, codes)
        if self._stage_down is not None:
            return self._split_staged(li, x, ids, weights, codes)
        if self._stage is not None:  # staging slots n_slots .. n_slots + K - 1, this layer's
            self._stage(codes, self._stage_slots, self.n_slots)
            return moe_decode(x, self._stage_slots.view_as(ids), weights, self.pools[li])
        return moe_decode(x, codes.view_as(ids), weights, self.pools[li], host=self.mirrors[li])

    @contextlib.contextmanager
    def _aside(self):
        """Launches on the staging's side stream, forked after what this stream has issued (CUDA;
        inline on the CPU); `_join` makes this stream's later work wait for them. Both are
        captured into a step's graph as its fork and join."""
        if not self.cuda:
            yield
            return
        self._stage_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stage_stream):
            yield

    def _join(self) -> None:
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self._stage_stream)

    def _hits_first(self, li: int, x, ids, weights, codes) -> torch.Tensor:
        """GpuConfig.hits_first: the misses staged on a side stream (forked and joined inside a
        captured step) while the hits' pairs compute on this one, then the misses' pairs, both
        into one output (moe_decode's `pick`: the one launch's bits)."""
        from moestream.kernels.triton.decode import moe_decode

        with self._aside():  # after the codes' gather and the last layer's reads
            self._stage(codes, self._stage_slots, self.n_slots)
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        moe_decode(x, codes.view_as(ids), weights, self.pools[li], out=out, pick=(codes, 1))
        self._join()
        return moe_decode(x, self._stage_slots.view_as(ids), weights, self.pools[li], out=out,
                          pick=(codes, 2))  # fmt: skip

    def _split_staged(self, li: int, x, ids, weights, codes) -> torch.Tensor:
        """GpuConfig.split_staging: the misses' gate/up sections staged on this stream, then their
        down sections on a side stream (forked after that staging, joined before the down kernel)
        while the gate/up kernel runs. The same rows into the same staging slots as one launch."""
        from moestream.kernels.triton.decode import moe_decode

        self._stage(codes, self._stage_slots, self.n_slots)
        with self._aside():  # after the gate/up sections and the last layer's down reads
            self._stage_down(codes, self._stage_slots, self.n_slots)
        return moe_decode(x, self._stage_slots.view_as(ids), weights, self.pools[li],
                          before_down=self._join)  # fmt: skip

    def _prefetch_base(self, li: int) -> int:
        """First slot of layer li's prefetch set (past the table's slots and the staging)."""
        return self.n_slots + self.K * (1 + li % 2)

    def _prefetching_stage(self, li: int, x, codes) -> torch.Tensor:
        """Stage layer li's misses, reading those the previous layer prefetched from its set;
        then, on the side stream while this layer computes, prefetch layer li + 1's predicted
        misses (router li + 1 on this layer's router input). Returns the slots to read."""
        assert self._routes is not None, "set_routes before a prefetching decode step"
        L = len(self.layers)
        slots = self._seen[2 * L + li]
        ahead = None
        if li > 0:  # the prefetch issued by layer li - 1 must have landed
            if self.cuda:
                torch.cuda.current_stream(self.device).wait_stream(self._side)
            ahead = (self._seen[3 * L + li], self._prefetch_base(li))
        self._stage(codes, slots, self.n_slots, ahead=ahead)
        if li + 1 < L:
            pred, pcodes = self._seen[4 * L + li + 1], self._seen[3 * L + li + 1]
            pred.copy_(self._routes[li + 1](x)[1].reshape(-1))
            torch.index_select(self.slot_map[li + 1], 0, pred, out=pcodes)
            if self.cuda:
                self._side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._side) if self.cuda else contextlib.nullcontext():
                self._stage(pcodes, self._prefetch_out, self._prefetch_base(li + 1))
        return slots

    def decode_issued(self) -> None:
        if not self.device_misses:
            return
        t0 = time.perf_counter()
        try:
            # the step's routing and codes to the host behind it (before the next step writes
            # _seen); on the CPU the step ran already
            j = self._n_issued % self.AHEAD
            self._n_issued += 1
            assert len(self._issued) < self.AHEAD, "a routing buffer reused before it was read"
            self._seen_host[j].copy_(self._seen, non_blocking=True)
            if self.cuda:
                self._seen_ev[j].record()
            self._issued.append(j)
            self._account()
        finally:
            self.bookkeeping_seconds += time.perf_counter() - t0

    def decode_read(self) -> None:
        if not self.device_misses or not self._issued:  # after a prompt: nothing issued yet
            return
        t0 = time.perf_counter()
        try:
            j = self._issued.pop(0)
            if self.cuda:
                self._seen_ev[j].synchronize()  # done already: the generator read the step
            self._ready.append(self._seen_host[j].numpy().copy())
            self._account()
        finally:
            self.bookkeeping_seconds += time.perf_counter() - t0

    def _account(self) -> None:
        """Read steps through the slot table, once a later step is issued (the GPU then has work
        while the host does this): decode_issued in the step-by-step loop, decode_read when the
        generator runs ahead."""
        if not self._issued:
            return
        self._published(wait=False)
        for seen in self._ready:
            self._account_step(seen)
        self._ready.clear()
        if self._hurry is not None:  # read live by waiting admission programs
            hurry = int(len(self._pending) >= self.HURRY_PENDING)
            if hurry != self._hurry_set:
                src = self._hurry_vals[hurry : hurry + 1]
                side = torch.cuda.stream(self._hurry_stream) if self.cuda else None
                with side or contextlib.nullcontext():
                    self._hurry.copy_(src, non_blocking=self.cuda)
                self._hurry_set = hurry
            self.hurried += hurry

    def _account_step(self, seen) -> None:
        """One read step's routing through the slot table: evicted keys' codes back, admitted
        records copied behind every issued step (published when done)."""
        t, E, L = self.table, self.E, len(self.layers)
        codes = seen[L : 2 * L]  # the codes the step's kernels ran with
        reads = int((codes < 0).sum())
        self.host_reads += reads
        self.device_hits += codes.size - reads
        if self.prefetching:
            self._account_prefetch(seen)
        h0, m0, t0 = t.hits, t.misses, time.perf_counter()
        fix: list[int] = []  # mirror rows of evicted keys (their code: -1 - row)
        admits: list[tuple[int, int, int]] = []  # (layer index, expert, slot)
        routed = seen[:L].tolist()
        for li, layer in enumerate(self.layers):
            try:
                step = t.access(layer, sorted(set(routed[li])), scored=self.scored)
                evicted = step.evicted
                self.declined += len(step.declined)
            except PolicyError as err:
                # Every victim is being copied: these misses stay host reads this step; the
                # keys the failed access had already evicted must still get their codes back.
                self.skipped += 1
                evicted, step = err.evicted, None
            fix += [self.layer_index[lay] * E + e for lay, e in evicted]
            if step is None:
                continue
            # busy until published: no later access (this loop's other layers included) may
            # hand their slots to another key while the copies are in flight
            t.reserve([(layer, e) for e, _ in step.misses])
            admits += [(li, e, slot) for e, slot in step.misses]
        self._table_counted[0] += t.hits - h0
        self._table_counted[1] += t.misses - m0
        self.decode_table_seconds += time.perf_counter() - t0
        if fix or admits:
            self._apply(fix, admits)

    def _account_prefetch(self, seen) -> None:
        """A read step's prefetch counters: copies, misses served by them, recall (layers 1..)."""
        L, K = len(self.layers), self.K
        codes, slots = seen[L + 1 : 2 * L], seen[2 * L + 1 : 3 * L]
        self.prefetch_reads += int((seen[3 * L + 1 : 4 * L] < 0).sum())
        self.prefetch_used += int(((codes < 0) & (slots >= self.n_slots + K)).sum())
        self.predict_routed += (L - 1) * K
        self.predict_correct += sum(len(set(a) & set(b)) for a, b in
                                    zip(seen[1:L].tolist(), seen[4 * L + 1 : 5 * L].tolist()))  # fmt: skip

    def _published(self, wait: bool) -> None:
        """Admissions whose copies are done (all of them with `wait`) leave the busy set (their
        slots were published in slot_map on the copy stream); the compute stream is ordered
        after those copies (the host path of a prompt reads the pool)."""
        keep = []
        for ev, admits in self._pending:
            if self.cuda and not wait and not ev.query():
                keep.append((ev, admits))
                continue
            if self.cuda:
                torch.cuda.current_stream(self.device).wait_event(ev)
            self.table.release((self.layers[li], e) for li, e, _ in admits)
        self._pending = keep

    def _upload(self, values: list[int]) -> torch.Tensor:
        """int64 values -> the device in one copy on the current stream, through the next of
        AHEAD pinned buffers (waiting, rarely, for its last upload to finish)."""
        j = self._n_idx % self.AHEAD
        self._n_idx += 1
        if self.cuda:
            self._idx_ev[j].synchronize()
        buf = self._idx_host[j, : len(values)]
        buf.numpy()[:] = values
        if not self.cuda:
            return buf.clone()
        dev = buf.to(self.device, non_blocking=True)
        self._idx_ev[j].record()
        return dev

    def _apply(self, fix: list[int], admits: list[tuple[int, int, int]]) -> None:
        """Evicted keys' codes back on the compute stream, behind every issued step; then the
        admitted records copied mirror -> their slots on the copy stream behind those steps (an
        evicted slot may still be read by them) and their slots published in slot_map right
        after the copy, on that stream: a step issued later, or a later layer of a running one,
        reads them from VRAM as soon as they land (a step reads a code either before or after
        the publish: the mirror row or the copied slot, the same bits)."""
        f, n = len(fix), len(admits)
        vals = self._upload(fix + [-1 - r for r in fix] + [li * self.E + e for li, e, _ in admits]
                            + [s for _, _, s in admits])  # fmt: skip
        flat = self.slot_map.view(-1)
        if f:
            flat[vals[:f]] = vals[f : 2 * f]
        if not n:
            return
        rows, slots = vals[2 * f : 2 * f + n], vals[2 * f + n :]
        ev = None
        if self.cuda:
            self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            vals.record_stream(self.copy_stream)  # read there after this stream moves on
        with torch.cuda.stream(self.copy_stream) if self.cuda else contextlib.nullcontext():
            self._admit_rows(rows, slots)
            flat[rows] = slots
            if self.cuda:
                ev = torch.cuda.Event()
                ev.record()
        self.h2d_bytes += n * self.size
        self.admit_bytes += n * self.size
        self._pending.append((ev, admits))

    def _drain(self) -> None:
        """Finish every pending admission (before the host path reads slot_map and the pool)."""
        self.reset()
        self._published(wait=True)

    def reset(self) -> None:
        """A new sequence: steps issued past the last one read (greedy decode runs ahead) are
        not accounted."""
        if self.device_misses:
            self._issued.clear()
            self._ready.clear()

    # ---- filling slots -------------------------------------------------------------------------
    def _fill_resident(self) -> None:
        """Every record through a pinned staging pool of one layer into its fixed slot."""
        stage = PinnedPool(self.size, self.E, pin=self.cuda)
        reader = RecordReader(self.store, stage, self.cfg.io)
        try:
            for i, layer in enumerate(self.layers):
                reader.read(layer, [(e, e) for e in range(self.E)])
                dev = stage.buf.to(self.device)
                slots = torch.arange(i * self.E, (i + 1) * self.E, device=self.device)
                self._scatter(i, dev, slots)
                self.h2d_bytes += dev.numel()
        finally:
            reader.close()
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def _scatter(self, li: int, records: torch.Tensor, slots: torch.Tensor) -> None:
        """records [m, size] uint8 of layer li on the device -> the pool's section tensors at
        `slots` [m] (in layer li's layout)."""
        m = records.shape[0]
        secs = {s.name: records[:, s.offset : s.offset + s.nbytes].contiguous().view(s.dtype)
                .view(m, *s.shape) for s in self.layouts[li].sections}  # fmt: skip
        pool = self.pools[li].sections
        for name, t in self._pool_layout(secs).items():
            pool[name].index_copy_(0, slots, t)

    def _load_misses(self, li: int, layer: int, misses: list[tuple[int, int]], evicted) -> None:
        """Fill the VRAM slots of misses [(expert, slot)] and bring slot_map up to date: evicted
        keys -> -1, misses -> their slot (one small pinned host->device copy)."""
        t0 = time.perf_counter()
        cur = torch.cuda.current_stream(self.device) if self.cuda else None
        self._meta_at = 0
        cap = self._batch
        for b in range(0, len(misses), cap):
            batch = misses[b : b + cap]
            m = len(batch)
            if not self.cfg.pinned_mirror:
                # Staging buffers are reused: the previous batch's copy must have left them.
                if self._last_copy is not None:
                    self._last_copy.synchronize()
                self.reader.read(layer, [(e, j) for j, (e, _) in enumerate(batch)])
            slots = self._send([s for _, s in batch])
            if self.cuda:
                self.copy_stream.wait_stream(cur)  # slots being overwritten are no longer read
                with torch.cuda.stream(self.copy_stream):
                    start = torch.cuda.Event(enable_timing=True)
                    start.record()
                    self._copy_batch(li, batch, slots)
                    end = torch.cuda.Event(enable_timing=True)
                    end.record()
                self._copy_events.append((start, end))
                self._last_copy = end
                cur.wait_event(end)
            else:
                self._copy_batch(li, batch, slots)
            self.h2d_bytes += m * self.size
        gone = [self.layer_index[lay] * self.E + e for lay, e in evicted]
        upd = gone + [li * self.E + e for e, _ in misses]
        if upd:
            absent = [-1 - r for r in gone] if self.device_misses else [-1] * len(gone)
            u = self._send(upd + absent + [s for _, s in misses])
            self.slot_map.view(-1)[u[: len(upd)]] = u[len(upd) :]
        self.copy_seconds += time.perf_counter() - t0

    def _send(self, values: list[int]) -> torch.Tensor:
        """Small int64 list -> device tensor through the pinned scratch (no stream sync, no
        allocation of pinned memory per call)."""
        if not self.cuda:
            return torch.tensor(values, dtype=torch.int64)
        a, b = self._meta_at, self._meta_at + len(values)
        self._meta_np[a:b] = values
        self._meta_at = b
        return self._meta[a:b].to(self.device, non_blocking=True)

    def _copy_batch(self, li: int, batch: list[tuple[int, int]], slots: torch.Tensor) -> None:
        m = len(batch)
        if self.device_misses:  # rows of the section-major mirror, read through the kernel
            self._copy_rows(self._send([li * self.E + e for e, _ in batch]), slots)
            return
        dev = self.dev_stage[:m]
        if self.cfg.pinned_mirror:  # records straight from the mirror, one copy each
            for j, (e, _) in enumerate(batch):
                dev[j].copy_(self.host.buf[li * self.E + e], non_blocking=True)
        else:
            dev.copy_(self.host.buf[:m], non_blocking=True)
        self._scatter(li, dev, slots)

    # ---- compute -------------------------------------------------------------------------------
    def _slot_ids(self, layer: int, ids: torch.Tensor) -> torch.Tensor:
        li = self.layer_index[layer]
        t0 = time.perf_counter()
        host_ids = ids.cpu()  # the one synchronisation per layer: misses are resolved on the host
        self.sync_seconds += time.perf_counter() - t0
        self.syncs += 1
        t1 = time.perf_counter()
        experts = sorted(set(host_ids.reshape(-1).tolist()))
        cap = self.table.policy.capacity(self.n_slots)
        if len(experts) > cap:
            return None  # prefill chunks (see _chunked)
        step = self.table.access(layer, experts)
        self.table_seconds += time.perf_counter() - t1
        if step.misses or step.evicted:
            self._load_misses(li, layer, step.misses, step.evicted)
        return self.slot_map[li][ids]

    @torch.compiler.disable  # a compiled decode step (engine/graph.py) calls the kernels as they are
    def experts(
        self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """x [T, D], ids [T, K], weights [T, K] (on self.device) -> [T, D]."""
        if self.device_misses:
            if x.shape[0] == 1:
                return self._device_call(self.layer_index[layer], x, ids, weights)
            self._drain()  # a prompt: the host path reads slot_map, so it must be current
        if self.cfg.resident:
            pool = self.layer_pools[self.layer_index[layer]]
            return self.kernel(x, ids, weights, pool, expert_ids=ids)
        slots = self._slot_ids(layer, ids)
        if slots is None:
            return self._chunked(layer, x, ids, weights)
        # expert ids: the reference kernel adds experts in ascending id, not slot, order
        return self.kernel(x, slots, weights, self.pools[self.layer_index[layer]], expert_ids=ids)

    def _chunked(self, layer: int, x, ids, weights) -> torch.Tensor:
        """A prefill whose experts do not fit the pool at once: the (token, k) pairs of each chunk
        of experts run as a K=1 problem over their tokens. With the Triton kernels each pair's
        fp32 row lands in one [T * K, D] buffer and `combine_pairs` adds them in slot order: the
        bits of the resident call. With the reference kernel (which adds experts in ascending id
        order, in x's dtype) each expert's rows are added in that order, one expert at a time
        (no repeated index in one index_add_, whose order CUDA does not fix): the same bits."""
        li = self.layer_index[layer]
        self.chunked += 1
        T, K = ids.shape
        flat = ids.reshape(-1)
        host = flat.cpu()
        experts = sorted(set(host.tolist()))
        cap = self.table.policy.capacity(self.n_slots)
        pairs = self.cfg.kernel == "triton" and (
            prompt_path(self.pools[li], x, T, self.prefill) or not unsupported(self.pools[li], T)
        )
        if pairs:
            rows = torch.empty(T * K, x.shape[1], device=self.device, dtype=torch.float32)
        else:
            out = torch.zeros_like(x)
        for c in range(0, len(experts), cap):
            if c and self.cuda:  # the pinned scratch and staging of the last chunk are reused
                torch.cuda.current_stream(self.device).synchronize()
            chunk = experts[c : c + cap]
            step = self.table.access(layer, chunk)
            self._load_misses(li, layer, step.misses, step.evicted)
            sel_host = torch.nonzero((host >= chunk[0]) & (host <= chunk[-1])).reshape(-1)
            sel = sel_host.to(self.device)
            tok = sel // K
            slots = self.slot_map[li][flat[sel]].reshape(-1, 1)
            w = weights.reshape(-1)[sel].reshape(-1, 1)
            if pairs:
                rows[sel] = moe_pairs(x[tok], slots, w, self.pools[li], tokens=T,
                                      prefill=self.prefill)  # fmt: skip
            else:
                y = self.kernel(x[tok], slots, w, self.pools[li],
                                expert_ids=flat[sel].reshape(-1, 1))  # fmt: skip
                y = y.to(out.dtype)
                owner = host[sel_host]
                for e in chunk:  # ascending ids, as the resident call adds them
                    at = torch.nonzero(owner == e).reshape(-1).to(self.device)
                    out.index_add_(0, tok[at], y[at])
        return combine_pairs(rows, K, x.dtype) if pairs else out

    def describe(self) -> dict:
        d = {"experts": "vram resident" if self.cfg.resident else "vram slot cache",
             "quant": self.store.quant_name, "kernel": self.cfg.kernel}  # fmt: skip
        if self.cfg.kernel == "triton":  # a prompt's kernels (bf16 prompts; fp32 ones: triton)
            d["prefill"] = "grouped-gemm" if self.prefill == "grouped" else "triton"
            if self.prefill == "grouped":
                d["prefill_scratch_bytes"] = self.prefill_scratch
            if self.prefill_why:
                d["prefill_note"] = f"--gpu-prefill grouped not used: {self.prefill_why}"
        if not self.cfg.resident:
            total = len(self.layers) * self.E
            d.update(cache_bytes=self.n_slots * self.size, cache_slots=self.n_slots,
                     cache_fraction=self.n_slots / total, policy=self.cfg.policy,
                     host="pinned mirror" if self.cfg.pinned_mirror else self.cfg.io.mode,
                     misses="device" if self.device_misses else "host")  # fmt: skip
            if self.device_misses:
                d["miss_reads"] = "stage" if self.staged else "direct"
                d["admit"] = self.cfg.admit
            if self.staged:
                d["staging_slots"] = self.K
            if self.device_misses:
                d["admit_pause"] = self.pausing
                d["hits_first"] = self.staged and self.cfg.hits_first
                d["split_staging"] = self.staged and self.cfg.split_staging
                # asked for (the pause's default, None, is on only where misses are staged)
                opts = (self.cfg.admit_pause is True or self.cfg.hits_first
                        or self.cfg.split_staging)  # fmt: skip
                if opts and not self.staged:
                    d["staging_note"] = (
                        "admit_pause / hits_first / split_staging not used: this pool's misses "
                        f"are not staged (a budget under {2 * self.K} slots, or "
                        "miss_reads='direct')"
                    )
            if self.prefetching:
                d.update(prefetch=self.cfg.prefetch, prefetch_slots=2 * self.K)
        return d

    # ---- stats ---------------------------------------------------------------------------------
    def stats(self) -> dict:
        for start, end in self._copy_events:
            end.synchronize()
            self._copy_gpu_ms += start.elapsed_time(end)
        self._copy_events.clear()
        t = self.table
        hits, misses = (t.hits, t.misses) if t else (0, 0)
        extra = {}
        if self.device_misses:  # decode steps count what the kernels read, not the table's view
            hits += self.device_hits - self._table_counted[0]
            misses += self.host_reads - self._table_counted[1]
            # records read from pinned memory in decode: staged misses and prefetch copies
            copies = self.host_reads - self.prefetch_used + self.prefetch_reads
            extra = {"host_reads": self.host_reads, "decode_hits": self.device_hits,
                     "host_read_bytes": copies * self.size,
                     "admit_bytes": self.admit_bytes, "admissions_skipped": self.skipped,
                     "admissions_declined": self.declined, "admissions_hurried": self.hurried,
                     "bookkeeping_seconds": self.bookkeeping_seconds,
                     "decode_table_seconds": self.decode_table_seconds}  # fmt: skip
            if self.prefetching:
                extra.update(prefetch_reads=self.prefetch_reads, prefetch_used=self.prefetch_used,
                             predict_routed=self.predict_routed,
                             predict_correct=self.predict_correct)  # fmt: skip
        return {
            "bytes_read": 0 if self.reader is None else self.reader.bytes_read,
            "io_seconds": 0.0 if self.reader is None else self.reader.io_seconds,
            "hits": hits,
            "misses": misses,
            "evictions": t.evictions if t else 0,
            "h2d_bytes": self.h2d_bytes,
            "h2d_gpu_seconds": self._copy_gpu_ms / 1e3,
            "copy_seconds": self.copy_seconds,
            "syncs": self.syncs,
            "sync_seconds": self.sync_seconds,
            "table_seconds": self.table_seconds,
            "chunked_layers": self.chunked,
            **extra,
        }

    def close(self) -> None:
        if self.device_misses:
            self._drain()
        if self.reader is not None:
            self.reader.close()
