"""What the experts of a model run on, as frozen validated configs: the CPU store providers
(`StreamConfig`: resident, slot cache or mmap), the GPU pool (`GpuConfig`), and routing prediction
(`PredictConfig`). The loader takes one experts config; the type says which provider is built.
`slot_count` is the one budget rule, checked from the store's manifest alone."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from moestream.config import Budget, ConfigError
from moestream.kernels.triton import PREFILL
from moestream.store.format import Store
from moestream.store.io import IOConfig

ROUTINGS = ("exact", "predicted")
CPU_KERNELS = ("native", "cpu", "ref")
GPU_KERNELS = ("triton", "ref")  # the CUDA kernels; the pure-torch spec (run on the CPU: tests)


@dataclass(frozen=True, slots=True)
class Shard:
    """The experts of every MoE layer one rank of `world` holds: expert e lives on rank
    e % world. Strided, not contiguous blocks: group-limited routers (DeepSeek-V3, GLM) pick
    whole runs of neighbouring ids, which blocks would put on one rank, and a layer's decode
    waits for its busiest rank. Records are read one by one, so contiguity would buy nothing."""

    rank: int
    world: int

    def __post_init__(self):
        if self.world < 1 or not 0 <= self.rank < self.world:
            raise ConfigError(f"rank {self.rank} of {self.world}: need 0 <= rank < world >= 1")

    def owner(self, expert: int) -> int:
        return expert % self.world

    def experts(self, num_experts: int) -> range:
        return range(self.rank, num_experts, self.world)


@dataclass(frozen=True, slots=True)
class StreamConfig:
    """Experts of a store on the CPU: every one in RAM (`resident`), a slot cache of
    `memory_budget` bytes fed by the IO pool, or the OS page cache (`io.mode == "mmap"`)."""

    memory_budget: int | Budget | None = None  # bytes of expert slots (direct/pagecache)
    resident: bool = False  # every expert in RAM (ignores the budget)
    io: IOConfig = field(default_factory=IOConfig)
    policy: str = "lrfu"
    # "native": C++ kernels (kernels/native.py) where they built, else the torch ones; "cpu": the
    # torch kernels (kernels/cpu.py); "ref": the pure-torch spec.
    kernel: str = "native"
    # A layer's resident experts run while its misses are read (decode and prefill chunks);
    # False = read, then compute (the plain schedule, for ablations: bench_predict.py).
    overlap: bool = True
    # Expert parallelism (experts/parallel.py): only this rank's experts are held and computed.
    shard: Shard | None = None

    def __post_init__(self):
        if self.kernel not in CPU_KERNELS:
            raise ConfigError(f"unknown CPU kernel {self.kernel!r}; use {', '.join(CPU_KERNELS)}")
        if self.slot_cache and self.memory_budget is None:
            raise ConfigError("streaming needs --memory-budget (or use --resident / --io mmap)")
        _check_bytes(self.memory_budget, "--memory-budget")
        # A budget that nothing uses would say a cache runs where none does.
        if self.memory_budget is not None and self.resident:
            raise ConfigError(
                "--resident keeps every expert in RAM and has no budget: drop --memory-budget "
                "(or drop --resident to stream through a cache of that size)"
            )
        if self.memory_budget is not None and self.mmap:
            raise ConfigError(
                "--io mmap reads experts through the OS page cache, which takes no budget: drop "
                "--memory-budget (or use --io direct|pagecache for a slot cache of that size)"
            )

    @property
    def mmap(self) -> bool:
        return not self.resident and self.io.mode == "mmap"

    @property
    def slot_cache(self) -> bool:
        return not self.resident and self.io.mode != "mmap"


def _check_bytes(budget: int | Budget | None, flag: str) -> None:
    if isinstance(budget, int) and budget <= 0:
        raise ConfigError(f"{flag} must be > 0, got {budget}")


GPU_PREFETCH = ("none", "stale-gate")  # GpuConfig.prefetch
MISS_READS = ("stage", "direct")
ADMIT = ("scored", "all")  # GpuConfig.admit


@dataclass(frozen=True, slots=True)
class GpuConfig:
    """Experts of a store in a VRAM slot pool on `device` (every one with `resident`), misses
    read from the store (or a pinned host mirror). `device="cpu"` + `kernel="ref"`: tests."""

    gpu_budget: int | Budget | None = None  # bytes of VRAM expert slots (streaming)
    resident: bool = False  # every expert in VRAM
    pinned_mirror: bool = False  # every record in pinned host RAM; misses skip the disk
    io: IOConfig = field(default_factory=lambda: IOConfig(mode="pagecache"))
    policy: str = "lrfu"
    kernel: str = "triton"  # GPU_KERNELS
    device: str = "cuda"
    # Decode steps captured as CUDA graphs where the model allows it (engine/graph.py).
    cuda_graph: bool = True
    # The captured step's dense ops (norms, RoPE, casts, router, attention softmax) fused by
    # torch.compile before capture (engine/graph.py); the expert kernels stay as they are.
    compile_step: bool = False
    # Streaming with the pinned mirror: a decode token's misses are read by the kernels straight
    # from pinned host RAM (unified addressing) and the slot table is updated between steps, so
    # nothing syncs per layer and the step is captured. None: on wherever it can run (CUDA,
    # Triton kernels, --pin-experts); False: misses resolved on the host per layer (--host-misses).
    device_misses: bool | None = None
    # How a device-side miss reaches the decode kernels: "stage" = one launch per layer copies the
    # step's missed records from the mirror into K staging slots of the pool (taken from the
    # budget), the kernels then read VRAM only; "direct" = the kernels read the mirror's rows
    # themselves. Same bytes, so the same bits; the benchmarks run both.
    miss_reads: str = "stage"
    # "stale-gate": with staged misses, each decode layer also runs the next layer's router on
    # its own router input and copies the predicted misses into 2K more slots on a side stream
    # while the layer computes; the next layer reads a prefetched miss from there (the same
    # mirror row: the same bits). `--predictor stale-gate` on a GPU (runtime.open_model).
    prefetch: str = "none"
    # A prompt's MoE on CUDA: "grouped" = int4 rows dequantized to bf16, then torch's grouped
    # GEMM (kernels/triton/grouped.py; bf16 on sm_90+, else the Triton kernels), "triton" = the
    # grouped Triton kernels (prefill.py) always. Decode is the same either way.
    prefill: str = "grouped"
    # Device-side misses are read from the pinned mirror whether or not they are admitted, so an
    # admission is an extra copy over the same link: "scored" admits a miss only when the
    # policy's history of it beats its victim's (SlotTable.access(scored=True)); "all" admits
    # every miss (what the pool did before). Only with device-side misses: on the host path a
    # miss is computed from its slot, so every miss is admitted.
    admit: str = "scored"
    # Staged device-side misses and the copy stream's admissions read the same link. True: the
    # staging programs count themselves in a device counter while they copy and the admissions
    # wait before each 4 KB block while it is above zero, so a step's misses (its critical path)
    # get the whole link and admissions move while the step computes; while the host sees its
    # admissions falling behind (GpuExperts.HURRY_PENDING launches in flight) they go at once,
    # in whole 16 KB blocks.
    # A throttle only: the same bytes, the same bits. None (the default): on wherever misses are
    # staged (H200, 16 layers at f19ff41: 1.006x the unpaused speed at 25% of the experts in
    # VRAM, 1.037x at 50% with 0.73 of the link's rate against 0.69; docs/gpu.md); True: asked
    # for, refused where misses are not device-side; False: off.
    admit_pause: bool | None = None
    # Staged device-side misses: a one-token layer runs its hits' experts while its misses are
    # staged on a side stream, then the misses' (two picked launches of each kernel, one
    # output: the one launch's bits), so the hits' compute leaves the critical path.
    hits_first: bool = False
    # Staged device-side misses: a one-token layer stages its misses' gate/up sections, then
    # their down sections on a side stream while the gate/up kernel runs (joined before the
    # down kernel), so the down sections' PCIe time overlaps gate/up's compute. The same bytes
    # into the same slots: the same bits.
    split_staging: bool = False

    def __post_init__(self):
        if self.prefill not in PREFILL:  # kernels/triton/__init__.py
            raise ConfigError(
                f"unknown GPU prefill kernels {self.prefill!r}; use {', '.join(PREFILL)}"
            )
        if self.miss_reads not in MISS_READS:
            raise ConfigError(
                f"unknown miss reads {self.miss_reads!r}; use {', '.join(MISS_READS)}"
            )
        if self.prefetch not in GPU_PREFETCH:
            raise ConfigError(
                f"unknown GPU prefetch {self.prefetch!r}; use {', '.join(GPU_PREFETCH)}"
            )
        if self.prefetch != "none" and (
            not self.device_side_misses() or self.miss_reads != "stage"
        ):
            raise ConfigError(
                f"--predictor {self.prefetch} on the GPU prefetches into the staged misses of a "
                "streamed pool: stream with --gpu-budget and --pin-experts (misses staged, the "
                "default), or drop --predictor"
            )
        if self.hits_first and (self.miss_reads != "stage" or self.prefetch != "none"):
            raise ConfigError(
                "hits_first runs a layer's hits beside the staging of its misses: it needs "
                "miss_reads='stage' and no --predictor prefetch; drop one of them"
            )
        if self.split_staging and (self.miss_reads != "stage" or self.prefetch != "none"
                                   or self.hits_first):  # fmt: skip
            raise ConfigError(
                "split_staging stages a layer's misses in two launches around its gate/up kernel: "
                "it needs miss_reads='stage', no --predictor prefetch and no hits_first; drop one "
                "of them"
            )
        if self.admit not in ADMIT:
            raise ConfigError(f"unknown admission rule {self.admit!r}; use {', '.join(ADMIT)}")
        if self.kernel not in GPU_KERNELS:
            raise ConfigError(f"unknown GPU kernel {self.kernel!r}; use {', '.join(GPU_KERNELS)}")
        # the device-side misses' own options, off their defaults, need device-side misses
        for given, what in (
            (self.miss_reads != "stage",
             f"miss_reads={self.miss_reads!r} chooses how device-side misses reach the kernels"),
            (self.admit != "scored",
             f"--gpu-admit {self.admit} chooses which device-side misses enter the pool"),
            (self.admit_pause is True,
             "--gpu-admit-pause (admit_pause) lets staged device-side misses go first on the link"),
            (self.hits_first, "hits_first computes a layer's hits while its misses are staged"),
            (self.split_staging, "split_staging stages the misses' down sections beside gate/up"),
        ):  # fmt: skip
            if given and not self.device_side_misses():
                raise ConfigError(
                    f"{what}; this config resolves misses on the host (every miss is admitted) or "
                    "has none: drop it, or stream with --gpu-budget and --pin-experts"
                )
        if not self.resident and self.gpu_budget is None:
            raise ConfigError("--device cuda streams experts: give --gpu-budget (or --resident)")
        _check_bytes(self.gpu_budget, "--gpu-budget")
        if self.resident and self.gpu_budget is not None:
            raise ConfigError(
                "--resident keeps every expert in VRAM and has no budget: drop --gpu-budget "
                "(or drop --resident to stream through a VRAM pool of that size)"
            )
        if self.device_misses and not (self.pinned_mirror and self.kernel == "triton"):
            raise ConfigError(
                "device-side misses read the pinned host mirror with the Triton kernels: add "
                "--pin-experts (with --gpu-budget), or drop the request for them"
            )
        if self.compile_step and not (self.cuda_graph and self.captures_streaming()):
            raise ConfigError(
                "--compile fuses the captured decode step, which needs CUDA graphs and every "
                "expert in VRAM (or --gpu-budget with --pin-experts, misses read on the device): "
                "drop --compile, --no-cuda-graph or --host-misses, or add --pin-experts"
            )
        if self.resident and self.pinned_mirror:
            raise ConfigError(
                "--pin-experts mirrors records in host RAM for a streaming VRAM pool; with every "
                "expert in VRAM there is nothing to read: give --gpu-budget or drop --pin-experts"
            )

    @property
    def slot_cache(self) -> bool:
        return not self.resident

    def device_side_misses(self) -> bool:
        """The one rule for whether a streamed pool resolves decode misses on the device."""
        if self.resident or not self.pinned_mirror or self.kernel != "triton":
            return False
        return self.device_misses is not False

    def captures_streaming(self) -> bool:
        """Every expert resident, or streamed with device-side misses: nothing syncs in a step."""
        return self.resident or self.device_side_misses()


@dataclass(frozen=True, slots=True)
class PredictConfig:
    """Routing prediction and prefetch (moestream/predict/): `predictor` names expert sets ahead;
    `routing="predicted"` runs them as the routing (lossy). `trace`: the oracle's trace folder."""

    predictor: str = "none"
    routing: str = "exact"
    trace: str | Path | None = None
    min_score: float = 0.0
    ahead: int = 1
    # The recovery adapter (recovery/adapter.py) under predicted routing: an explicit file, or
    # (None) recovery.lora beside the model when the prerouter routes; use_lora=False: none.
    lora: str | Path | None = None
    use_lora: bool = True

    def __post_init__(self):
        from moestream.predict.base import PREDICTORS

        if self.predictor not in PREDICTORS:
            raise ConfigError(
                f"unknown --predictor {self.predictor!r}; use one of {', '.join(PREDICTORS)}"
            )
        if self.routing not in ROUTINGS:
            raise ConfigError(f"unknown --routing {self.routing!r}; use exact or predicted")
        if self.predictor == "none" and self.routing != "exact":
            raise ConfigError("--routing predicted needs a --predictor (e.g. prerouter)")
        if not 0.0 <= self.min_score < 1.0:
            raise ConfigError(
                f"--min-score {self.min_score} must be in [0, 1): a router probability"
            )
        if self.ahead not in (1, 2):
            raise ConfigError(
                f"--predict-ahead {self.ahead}: the stale gate names 1 or 2 layers ahead"
            )
        if self.ahead != 1 and self.predictor != "stale-gate":
            raise ConfigError(
                f"--predict-ahead applies to --predictor stale-gate, not {self.predictor}"
            )
        self._check_unused()

    def _check_unused(self) -> None:
        """Settings that nothing would read with this predictor and routing."""
        if self.min_score and (self.predictor == "none" or self.routing == "predicted"):
            raise ConfigError(
                f"--min-score {self.min_score} filters the prefetches of a --predictor under exact "
                "routing; give one (e.g. --predictor stale-gate) or drop --min-score"
            )
        if (self.trace is not None) != (self.predictor == "oracle"):
            raise ConfigError(
                "--predictor oracle replays --oracle-trace FOLDER: give both or neither"
            )
        if self.lora is not None and not self.use_lora:
            raise ConfigError("--lora PATH and --no-lora contradict each other: give one")
        if (self.lora is not None or not self.use_lora) and self.routing != "predicted":
            flag = "--lora" if self.lora is not None else "--no-lora"
            raise ConfigError(
                f"{flag}: the recovery adapter runs only with --routing predicted (exact routing "
                f"never loads one); add --routing predicted --predictor prerouter or drop {flag}"
            )

        if not self.use_lora and self.routing == "predicted" and self.predictor != "prerouter":
            raise ConfigError(
                f"--no-lora: with --predictor {self.predictor} no recovery adapter is looked for "
                "(only the prerouter's routing loads recovery.lora); drop --no-lora"
            )

    @property
    def wants_lora(self) -> bool:
        """Whether a recovery adapter is loaded: given, or looked for beside the model."""
        if not self.use_lora or self.routing != "predicted":
            return False
        return self.lora is not None or self.predictor == "prerouter"

    @property
    def active(self) -> bool:
        return self.predictor != "none" or self.routing != "exact"


ExpertsConfig = StreamConfig | GpuConfig


def min_budget(store: Store) -> int:
    """The smallest legal budget: the top-k experts of one layer, each in a slot (a slot holds
    the store's largest record: `Store.slot_size`)."""
    return store.args.num_experts_per_tok * store.slot_size


def slot_count(store: Store, cfg: ExpertsConfig) -> int:
    """Record slots the config gives (every record when resident; 0 for mmap). Raises before
    anything is loaded when the budget cannot hold one token's experts of a layer."""
    total = len(store.crc) * store.args.num_experts
    if isinstance(cfg, StreamConfig) and cfg.shard is not None:  # a rank holds its shard only
        check_shard(store, cfg.shard)
        total = len(store.crc) * len(cfg.shard.experts(store.args.num_experts))
    if cfg.resident:
        return total
    if isinstance(cfg, StreamConfig) and cfg.mmap:
        return 0
    given, flag = (
        (cfg.gpu_budget, "--gpu-budget")
        if isinstance(cfg, GpuConfig)
        else (cfg.memory_budget, "--memory-budget")
    )
    # A fraction is of the model's expert slots' bytes (every record in a slot of the largest
    # record's size), known only now that the store is.
    size = store.slot_size
    budget = given.resolve(total * size) if isinstance(given, Budget) else given
    least = min_budget(store)
    if budget < least:
        shown = f"{given} = {budget}" if isinstance(given, Budget) and given.fraction else budget
        raise ConfigError(
            f"{flag} {shown} bytes is below the minimum {least} bytes "
            f"({least / 2**20:.2f} MiB = top-k {store.args.num_experts_per_tok} "
            f"experts x {size} bytes per record slot); raise the budget"
        )
    return min(budget // size, total)


def check_shard(store: Store, shard: Shard) -> None:
    """Every rank must own at least one expert of each layer."""
    E = store.args.num_experts
    if shard.world > E:
        raise ConfigError(
            f"{shard.world} ranks for {E} experts per layer leave ranks without experts; "
            f"use at most {E} devices"
        )
