"""Command line: `moestream generate | serve | chat ...`. argparse lives only here."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from moestream.config import SamplingConfig

# quant.SCHEMES, spelled here so --help does not import torch (tests/test_cli_modes.py checks they match)
QUANT_CHOICES = ("bf16", "int8", "int4", "q4_0", "q4_1", "q5_0", "q8_0", "mxfp4", "q4_k", "q5_k",
                 "q6_k")  # fmt: skip

# Measured with torch 2.13 on the dev CPU (AVX512-BF16/AMX present): a bf16 GEMV at one token
# reads 7 GB/s against fp32's 19 GB/s at D=2048, so fp32 decodes faster despite twice the bytes.
DTYPE_HELP = (
    "compute dtype (default float32: on CPU torch's one-token bf16 GEMMs are slower than fp32; "
    "bf16 for parity with a bf16 reference)"
)


def _add_sampling_args(p) -> None:
    p.add_argument("--temp", type=float, default=0.0, help="temperature; 0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument(
        "--repeat-penalty", type=float, default=1.0, help="llama.cpp's, e.g. 1.1 (1 = off)"
    )
    p.add_argument("--repeat-last-n", type=int, default=64, help="tokens penalized (0 = all)")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="per occurrence, -2..2")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="once per token, -2..2")


def _sampling(a: argparse.Namespace) -> SamplingConfig:
    """The SamplingConfig of a command built with _add_sampling_args (and -n, --ignore-eos)."""
    return SamplingConfig(
        temperature=a.temp,
        top_p=a.top_p,
        top_k=a.top_k,
        seed=a.seed,
        max_new_tokens=a.max_tokens,
        stop=tuple(a.stop),
        ignore_eos=getattr(a, "ignore_eos", False),
        repeat_penalty=a.repeat_penalty,
        repeat_last_n=a.repeat_last_n,
        frequency_penalty=a.frequency_penalty,
        presence_penalty=a.presence_penalty,
    )


def _add_ctx_size(p) -> None:
    p.add_argument(
        "-c",
        "--ctx-size",
        type=int,
        default=None,
        help="positions a sequence may use, prompt + reply (default: the model's context)",
    )


def _add_quiet(p) -> None:
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars")


def _progress(a: argparse.Namespace) -> bool:
    """The one rule for progress bars: on stderr when it is a terminal, never with --quiet or
    --json (a log file or a pipe gets the results, not bar redraws)."""
    quiet = getattr(a, "quiet", False) or getattr(a, "json", False)
    return not quiet and sys.stderr.isatty()


def _add_threads(p) -> None:
    p.add_argument(
        "-t", "--threads", type=int, default=None, help="torch threads (default: all cores)"
    )


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate a completion for one prompt")
    _add_model_args(p)
    _add_ctx_size(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("-p", "--prompt", help="prompt text, used raw unless --chat; '-' reads stdin")
    src.add_argument("-f", "--file", help="read the prompt from this UTF-8 file")
    p.add_argument(
        "-n", "--max-tokens", type=int, default=64, help="tokens to generate (default 64)"
    )
    _add_sampling_args(p)
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")
    p.add_argument(
        "--chat", action="store_true", help="wrap the prompt in the model's chat template"
    )
    p.add_argument(
        "--json", action="store_true", help="print one JSON object instead of streaming text"
    )
    p.add_argument(
        "--devices",
        default=None,
        help="expert parallelism: cpu:N spawns N CPU ranks (gloo), each holding experts e %% N "
        "(its own --memory-budget), dense weights on every rank; also under torchrun",
    )
    _add_guard_arg(p)
    _add_quiet(p)
    p.set_defaults(func=cmd_generate)


def _add_store_args(p) -> None:
    """Expert store flags: any of them turns a Hugging Face folder into a (cached) store."""
    g = p.add_argument_group("expert store (streaming)")
    g.add_argument(
        "--memory-budget",
        default=None,
        help="expert cache size (streams experts): bytes (512MiB, 4GB; binary units) or a "
        "fraction of the expert bytes (0.25, 25%%)",
    )
    g.add_argument(
        "--resident", action="store_true", help="load every expert into RAM (VRAM with cuda)"
    )
    g.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="cuda: dense weights, KV cache and an expert slot pool in VRAM (default cpu)",
    )
    g.add_argument(
        "--gpu-budget", default=None, help="VRAM expert slots with --device cuda: 2GiB or 0.25"
    )
    g.add_argument(
        "--pin-experts",
        action="store_true",
        help="with --gpu-budget: keep every expert record in pinned host RAM (no disk reads)",
    )
    g.add_argument(
        "--host-misses",
        action="store_true",
        help="with --gpu-budget --pin-experts: resolve misses on the host once per MoE layer "
        "(copies, no CUDA graph) instead of reading them on the device from pinned RAM",
    )
    g.add_argument(
        "--gpu-prefill",
        default=None,
        choices=["grouped", "triton"],
        help="--device cuda: a prompt's expert kernels; grouped (default): int4 experts "
        "dequantized to bf16 + torch's grouped GEMM (sm_90+, bf16; ~1.2 GB scratch at "
        "Qwen3-30B-A3B); triton: the Triton kernels on the int4 rows",
    )
    g.add_argument(
        "--gpu-admit",
        default=None,
        choices=["scored", "all"],
        help="--gpu-budget --pin-experts: which misses the VRAM pool keeps; scored (default): "
        "only a miss whose use history beats the expert it would evict (the others are read "
        "from pinned RAM each time); all: every miss",
    )
    g.add_argument(
        "--gpu-admit-pause",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="--gpu-budget --pin-experts: the pool's admissions wait while a decode step stages "
        "its misses, which then get the whole PCIe link; on by default wherever misses are "
        "staged (H200, 16 layers: 1.04x at 50%% of the experts in VRAM with 0.73 of the link's "
        "rate against 0.69, 1.01x at 25%%); --no-gpu-admit-pause turns it off",
    )
    g.add_argument(
        "--no-cuda-graph",
        action="store_true",
        help="--device cuda: run each decode step eagerly instead of replaying a captured graph",
    )
    g.add_argument(
        "--compile",
        action="store_true",
        help="--device cuda, every expert in VRAM: torch.compile the captured decode step (norms, "
        "RoPE, casts, router and softmax fused; 1.3x decode at 16 layers on an H200, ~15 s more "
        "start-up)",
    )
    g.add_argument(
        "--io",
        default=None,
        choices=["direct", "pagecache", "mmap"],
        help="how misses are read: O_DIRECT pread (default), buffered pread, or OS mmap",
    )
    g.add_argument("--io-threads", type=int, default=4, help="parallel reads (default 4)")
    g.add_argument("--io-split", type=int, default=1, help="parallel parts per record")
    g.add_argument(
        "--kernel",
        default="native",
        choices=["native", "cpu", "ref"],
        help="CPU expert kernels: native (C++, int8 activations per block of 32; built on first "
        "use, torch kernels where it cannot build), cpu (torch kernels), ref (pure-torch spec)",
    )
    g.add_argument(
        "--policy",
        default=None,
        choices=["lru", "lfu", "lrfu", "sticky"],
        help="slot cache eviction: lrfu (default: uses weighed by a decay of 0.9 per token, so "
        "recency and frequency count), lru, lfu, sticky (per-layer slots)",
    )
    g.add_argument(
        "--quant",
        default=None,
        choices=QUANT_CHOICES,
        help="expert quantization when converting a Hugging Face folder (default bf16) or a "
        "GGUF file (default: its experts' type when all are one of Q8_0 / Q4_0 / Q4_1 / Q5_0 / "
        "MXFP4 / Q4_K / Q5_K / Q6_K, kept exactly; else int8 for >= 8-bit ones, else int4)",
    )
    g = p.add_argument_group("routing prediction (prefetch / prediction as routing)")
    g.add_argument(
        "--predictor",
        default="none",
        choices=["none", "temporal", "stale-gate", "prerouter", "oracle"],
        help="predict upcoming experts and prefetch them (default none: on-demand reads; on "
        "--device cuda only stale-gate, measured slower there: docs/gpu.md)",
    )
    g.add_argument(
        "--routing",
        default="exact",
        choices=["exact", "predicted"],
        help="exact: predictions only prefetch (tokens identical); predicted: the prediction is "
        "the routing (Edge0, lossy)",
    )
    g.add_argument("--oracle-trace", default=None, help="trace folder the oracle predictor replays")
    g.add_argument(
        "--min-score",
        type=float,
        default=0.0,
        help="prefetch only predicted experts whose router/head probability reaches this "
        "(exact routing; fewer wasted reads; the prediction benchmark uses 0.04)",
    )
    g.add_argument(
        "--predict-ahead",
        type=int,
        default=1,
        choices=[1, 2],
        help="stale gate: name the experts of the next 1 or 2 layers (2: earlier, lower recall)",
    )
    g.add_argument(
        "--lora",
        default=None,
        metavar="PATH",
        help="recovery adapter for --routing predicted (default: recovery.lora beside the model "
        "or store, used with --predictor prerouter when present; make it with train-recovery)",
    )
    g.add_argument(
        "--no-lora", action="store_true", help="predicted routing without the recovery adapter"
    )


def _predict_config(a: argparse.Namespace):
    from moestream.experts.config import PredictConfig

    return PredictConfig(
        predictor=getattr(a, "predictor", "none"),
        routing=getattr(a, "routing", "exact"),
        trace=getattr(a, "oracle_trace", None),
        min_score=getattr(a, "min_score", 0.0),
        ahead=getattr(a, "predict_ahead", 1),
        lora=getattr(a, "lora", None),
        use_lora=not getattr(a, "no_lora", False),
    )


def _store_kwargs(a: argparse.Namespace) -> dict:
    """open_model's experts/quant/predict arguments from the flags (no experts config: a store
    opens resident, a Hugging Face folder loads directly). Checked here, before anything loads:
    a flag that the others would leave unused is refused, prediction without a cache noted."""
    _check_device_flags(a)
    kw = {"quant": a.quant, "threads": a.threads, "predict": _predict_config(a)}
    if getattr(a, "ctx_size", None) is not None:
        kw["context"] = a.ctx_size
    experts = _gpu_config(a) if a.device == "cuda" else _stream_config(a)
    _check_policy(a, experts)
    _note_prediction(kw["predict"], experts)
    return kw if experts is None else {**kw, "experts": experts}


def _stream_config(a: argparse.Namespace):
    from moestream.config import parse_budget
    from moestream.experts.config import StreamConfig
    from moestream.store.io import IOConfig

    kernel = getattr(a, "kernel", "native")
    if a.memory_budget is None and not a.resident and a.io is None and kernel == "native":
        return None
    io = IOConfig(mode=a.io or "direct", threads=a.io_threads, split=a.io_split)
    budget = None if a.memory_budget is None else parse_budget(a.memory_budget, "--memory-budget")
    policy = a.policy or "lrfu"
    # --kernel alone: every expert resident, on those kernels.
    resident = a.resident or (budget is None and a.io is None)
    return StreamConfig(
        memory_budget=budget, resident=resident, io=io, policy=policy, kernel=kernel
    )


def _gpu_config(a: argparse.Namespace):
    from moestream.config import parse_budget
    from moestream.experts.config import GpuConfig
    from moestream.store.io import IOConfig

    budget = None if a.gpu_budget is None else parse_budget(a.gpu_budget, "--gpu-budget")
    io = IOConfig(mode=a.io or "pagecache", threads=a.io_threads, split=a.io_split)
    return GpuConfig(
        gpu_budget=budget,
        resident=a.resident or budget is None,
        pinned_mirror=a.pin_experts,
        io=io,
        policy=a.policy or "lrfu",
        cuda_graph=not a.no_cuda_graph,
        compile_step=a.compile,
        device_misses=False if a.host_misses else None,
        prefill=a.gpu_prefill or "grouped",
        admit=a.gpu_admit or "scored",
        admit_pause=a.gpu_admit_pause,
    )


def _check_device_flags(a: argparse.Namespace) -> None:
    """Flags of one device given for the other, and a CUDA device torch cannot see."""
    from moestream.config import ConfigError

    if a.device != "cuda":
        # the pause's default (None) is on where misses are staged: named only when given
        pause = "--no-gpu-admit-pause" if a.gpu_admit_pause is False else "--gpu-admit-pause"
        gpu_only = {
            "--gpu-budget": a.gpu_budget is not None,
            "--pin-experts": a.pin_experts,
            "--host-misses": a.host_misses,
            "--no-cuda-graph": a.no_cuda_graph,
            "--compile": a.compile,
            "--gpu-prefill": a.gpu_prefill is not None,
            "--gpu-admit": a.gpu_admit is not None,
            pause: a.gpu_admit_pause is not None,
        }
        for flag, given in gpu_only.items():
            if given:
                raise ConfigError(
                    f"{flag} is for the GPU expert pool: add --device cuda (on the CPU the "
                    "expert cache is --memory-budget)"
                )
        return
    if a.memory_budget is not None:
        raise ConfigError("--memory-budget is the CPU cache; with --device cuda use --gpu-budget")
    if a.host_misses and not (a.pin_experts and a.gpu_budget is not None):
        raise ConfigError(
            "--host-misses picks how a pool fed from pinned RAM resolves misses: it needs "
            "--gpu-budget and --pin-experts (without them misses are always resolved on the host)"
        )
    _require_cuda()


def _check_policy(a: argparse.Namespace, experts) -> None:
    from moestream.config import ConfigError

    if a.policy is None or (experts is not None and experts.slot_cache):
        return
    raise ConfigError(
        f"--policy {a.policy} picks what a slot cache evicts, but {_no_cache(experts)}: give "
        "--memory-budget (--gpu-budget with --device cuda) to stream, or drop --policy"
    )


def _no_cache(experts) -> str:
    """Why an experts config (None: resident) has no slot cache, for messages."""
    from moestream.experts.config import StreamConfig

    if isinstance(experts, StreamConfig) and experts.mmap:
        return "--io mmap pages experts in through the OS page cache"
    return "every expert is resident"


def _note_prediction(predict, experts) -> None:
    """Prediction without a slot cache runs (predictions are scored; predicted routing changes
    which experts run, as `eval` measures) but nothing is prefetched: say so, it is no error."""
    from moestream.experts.config import GpuConfig

    # a GPU config is checked by open_model: it prefetches inside the step or is refused
    if not predict.active or isinstance(experts, GpuConfig):
        return
    if experts is not None and experts.slot_cache:
        return
    what = (
        "the predicted experts run (lossy) but no reads are saved"
        if predict.routing == "predicted"
        else "predictions are only scored"
    )
    print(
        f"moestream: note: --predictor {predict.predictor}: {_no_cache(experts)}, so nothing "
        f"is prefetched; {what}",
        file=sys.stderr,
    )


def _add_convert(sub) -> None:
    p = sub.add_parser(
        "convert", help="convert a Hugging Face folder or a GGUF file into an expert store"
    )
    p.add_argument("src", help="Hugging Face checkpoint folder, or a GGUF file (docs/gguf.md)")
    p.add_argument("dst", help="store folder to create (must not exist)")
    p.add_argument(
        "--quant",
        default=None,
        choices=QUANT_CHOICES,
        help="expert format (default bf16 for a Hugging Face folder: lossless for bf16 "
        "checkpoints, mxfp4 for one with MXFP4 experts (gpt-oss: kept exactly), as -m HF with "
        "store flags converts; for a GGUF q4_0 / q4_1 / q5_0 / mxfp4 / "
        "q4_k / q5_k / q6_k when its experts are all Q4_0 / Q4_1 / Q5_0 / MXFP4 / Q4_K / Q5_K / "
        "Q6_K (kept exactly, CPU only), int8 when "
        "they have >= 8 bits (Q8_0 kept exactly), else int4; q8_0 = int8 with fp16 scales "
        "(llama.cpp's Q8_0: a Q8_0 GGUF kept exactly in fewer bytes than int8; CPU only); "
        "int8/int4/q4_0/q4_1/q5_0/q8_0/mxfp4 from floats are "
        "lossy: measure them with eval (mxfp4 keeps gpt-oss's hub MXFP4 experts exactly, 4.25 "
        "bits a weight; CPU only); the K-quants only keep a GGUF's blocks)",
    )
    p.add_argument("--group-size", type=int, default=32, help="int8/int4 group (default 32)")
    p.add_argument(
        "--dense",
        default="auto",
        choices=["auto", "float", "int8", "int4"],
        help="non-expert weights (attention, shared MLPs, embedding, output layer): auto = the "
        "--quant format (4-bit and q5_0: output layer q6_k as llama.cpp keeps it, int8 where its "
        "input dim is not a multiple of 256; bf16: float; mxfp4: as the source holds them; a "
        "GGUF's Q8_0 / Q4_0 / "
        "Q4_1 / Q5_0 / Q4_K / Q5_K / Q6_K tensors kept exactly as int8 (q8_0 under --quant "
        "q8_0) / q4_0 / q4_1 / q5_0 / q4_k / q5_k / q6_k, its other "
        "quantized types dequantized), float = as in the "
        "checkpoint (dequantized), int8 / int4; "
        "norms, routers, biases and small tensors stay float",
    )
    _add_quiet(p)
    p.set_defaults(func=cmd_convert)


def cmd_convert(a: argparse.Namespace) -> int:
    from moestream.convert.writer import convert, source_scheme
    from moestream.quant import make_dense

    experts = source_scheme(a.src, a.quant, a.group_size)
    dense = make_dense(a.dense, experts.scheme)
    out = convert(a.src, a.dst, experts, progress=_progress(a), dense=dense)
    print(f"wrote {out}", file=sys.stderr)
    return 0


def _setup_threads(n: int | None) -> None:
    from moestream.config import ConfigError

    if n is not None and n < 1:
        raise ConfigError(f"--threads {n}: give a positive number of threads (default: all cores)")
    import torch

    # Set once, before any op: switching thread counts later makes every op slow.
    if n:
        torch.set_num_threads(n)


def mode_line(mode: dict) -> str:
    """The mode a run used, in one bracket: experts (cache size, policy), quant, device, ..."""
    parts = [mode["experts"]]
    if "cache_bytes" in mode:
        parts[0] += (
            f" {mode['cache_bytes'] / 2**20:.1f} MiB ({100 * mode['cache_fraction']:.0f}% of "
            f"experts, {mode['policy']})"
        )
        if mode.get("misses") == "device":
            parts[0] += (", misses staged from pinned RAM on the device"
                         if mode.get("miss_reads") == "stage" else
                         ", misses read from pinned RAM on the device")  # fmt: skip
        if mode.get("prefetch"):
            parts[0] += f", {mode['prefetch']} prefetch one layer ahead"
        if mode.get("admit"):
            parts[0] += ", " + ("scored admission" if mode["admit"] == "scored" else
                                "every miss admitted")  # fmt: skip
        if mode.get("admit_pause"):
            parts[0] += ", admissions paused while misses stage"
        if mode.get("hits_first"):
            parts[0] += ", hits computed while misses stage"
        if mode.get("split_staging"):
            parts[0] += ", down sections staged beside gate/up"
        if mode.get("staging_note"):
            parts[0] += f" ({mode['staging_note']})"
    parts += [mode["quant"], f"{mode['device']} {mode['dtype']}"]
    if mode.get("ranks"):
        parts.append(f"expert-parallel {mode['ranks']} ranks (e % {mode['ranks']}), per rank")
    if mode.get("predictor"):
        parts.append(f"predictor {mode['predictor']}, routing {mode['routing']}")
    if mode.get("lora"):
        lo = mode["lora"]
        parts.append(f"lora r{lo['rank']} on {lo['targets']} projections ({lo['path']})")
    if mode["device"] == "cuda":
        graph = "cuda graph, compiled step" if mode.get("compiled_step") else "cuda graph"
        parts.append(graph if mode["cuda_graph"] else "eager")
    if mode.get("prefill"):  # the GPU provider's prompt kernels
        parts.append("prompt " + mode["prefill"])
        if mode.get("prefill_note"):
            parts[-1] += f" ({mode['prefill_note']})"
    if mode.get("native_step"):
        parts.append("native decode step")
    return "[mode: " + ", ".join(parts) + "]"


def _expert_stats(s: dict) -> str:
    """Expert-store part of the stats line: hit rate, MB read per token, read GB/s."""
    if "bytes_read" not in s:
        return ""
    looked_up = s["hits"] + s["misses"]
    hit = 100 * s["hits"] / looked_up if looked_up else 0.0
    per_tok = s["bytes_read"] / max(s["prompt_tokens"] + s["generated_tokens"], 1) / 2**20
    out = (
        f"experts hit {hit:.0f}%, {per_tok:.2f} MiB read/tok, {s['read_gbps']:.2f} GB/s read "
        f"({s['stall_read_gbps']:.2f} GB/s while stalled) | "
    )
    if s.get("predict_routed"):  # a predictor ran: how often it named the routed experts
        rec = 100 * s["predict_correct"] / s["predict_routed"]
        used = f"{s['prefetch_used']}/{s['prefetch_reads']} prefetches used, " if s.get(
            "prefetch_reads") else ""  # fmt: skip
        out += f"{used}prediction recall {rec:.0f}% | "
    if s.get("host_reads"):  # the GPU pool's device misses: read from pinned RAM, kept or not
        out += (f"{s['host_reads']} misses read from pinned RAM, "
                f"{s.get('admissions_declined', 0)} not admitted | ")  # fmt: skip
    return out


def cmd_generate(a: argparse.Namespace) -> int:
    from moestream.runtime import open_model

    if a.devices is not None:
        return _generate_parallel(a)
    _setup_threads(a.threads)
    cfg = _sampling(a)
    with open_model(a.model, dtype=a.dtype, progress=_progress(a), **_store_kwargs(a)) as rt:
        return _generate(rt, a, cfg)


def _generate_parallel(a: argparse.Namespace) -> int:
    """--devices: every flag checked here, then the ranks run _generate_rank."""
    from moestream.config import ConfigError
    from moestream.distributed import Devices, launch

    devices = Devices.parse(a.devices)
    if a.device != "cpu":
        raise ConfigError("--devices names every rank's device: drop --device")
    if a.predictor != "none":
        raise ConfigError("routing prediction with --devices is not built yet: drop --predictor")
    _store_kwargs(a)
    return launch(devices, _generate_rank, a)


def _generate_rank(rank: int, world: int, a: argparse.Namespace) -> int:
    """One rank of --devices: this rank's shard of the experts, the same sampling seed."""
    from dataclasses import replace

    from moestream.distributed import shared_seed
    from moestream.experts.config import Shard, StreamConfig
    from moestream.runtime import open_model

    _setup_threads(a.threads)
    kw = _store_kwargs(a)
    experts = kw.get("experts") or StreamConfig(resident=True, kernel=a.kernel)
    kw["experts"] = replace(experts, shard=Shard(rank, world))
    cfg = replace(_sampling(a), seed=shared_seed(a.seed))
    with open_model(a.model, dtype=a.dtype, progress=_progress(a), **kw) as rt:
        return _generate(rt, a, cfg)


def _guard(rt, a: argparse.Namespace) -> None:
    """The memory-pressure guard on rt's model unless --no-memory-guard."""
    if not a.no_memory_guard:
        from moestream.obs.guard import MemoryGuard

        MemoryGuard().attach(rt.model)  # PSI + swap growth; off without /proc files


def _add_guard_arg(p) -> None:
    p.add_argument("--no-memory-guard", action="store_true", help="do not stop on memory pressure")


def _prompt_text(a: argparse.Namespace) -> str:
    """-p TEXT, -p - (standard input) or -f FILE."""
    from moestream.config import ConfigError

    if a.file is not None:
        try:
            return Path(a.file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"-f {a.file}: cannot read the prompt ({e})") from e
    return sys.stdin.read() if a.prompt == "-" else a.prompt


def _generate(rt, a: argparse.Namespace, cfg) -> int:
    _guard(rt, a)
    prompt_ids = rt.encode_prompt(_prompt_text(a), chat=a.chat)
    if a.json:
        res = rt.generator.generate(prompt_ids, cfg)
        out = {
            "prompt_ids": res.prompt_ids,
            "ids": res.ids,
            "text": res.text,
            "logprobs": res.logprobs,
            "stats": res.stats(),
            "mode": rt.mode,
        }
        print(json.dumps(out))
        return 0
    from moestream.engine.generate import GenerationResult

    res = GenerationResult(prompt_ids)
    print(mode_line(rt.mode), file=sys.stderr)
    for piece in rt.generator.stream(prompt_ids, cfg, res):
        sys.stdout.write(piece)
        sys.stdout.flush()
    s = res.stats()
    print(
        f"\n[prompt {s['prompt_tokens']} tok, {s['prefill_tok_s']:.1f} tok/s | "
        f"decode {s['generated_tokens']} tok, {s['decode_tok_s']:.1f} tok/s | "
        f"{_expert_stats(s)}peak RSS {s['peak_rss_bytes'] / 2**20:.0f} MiB]",
        file=sys.stderr,
    )
    return 0


def _add_model_args(p, positional: bool = False) -> None:
    """The model-opening flags serve and chat share with generate (-m, dtype, threads, store).
    `positional`: the folder may also come as the first argument (`serve MODEL`, as vllm)."""
    if positional:
        p.add_argument("model_arg", nargs="?", metavar="MODEL", help="same as -m")
    p.add_argument(
        "-m",
        "--model",
        required=not positional,
        help="Hugging Face checkpoint or store folder, or a GGUF file (converted once)",
    )
    p.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help=DTYPE_HELP,
    )
    _add_threads(p)
    _add_store_args(p)


def _open_runtime(a: argparse.Namespace):
    from moestream.runtime import open_model

    _setup_threads(a.threads)
    return open_model(a.model, dtype=a.dtype, progress=_progress(a), **_store_kwargs(a))


def _add_serve(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (requests served FIFO)")
    _add_model_args(p, positional=True)
    _add_ctx_size(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument(
        "--model-name", default=None, help="model id clients send (default: the folder name)"
    )
    p.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]
    )
    p.add_argument(
        "--max-body-bytes",
        type=_positive_size,
        default=4 * 2**20,
        help="largest request body accepted, bytes or e.g. 16MiB (default 4MiB; larger: 413)",
    )
    _add_guard_arg(p)
    _add_quiet(p)
    p.set_defaults(func=cmd_serve)


def _positive_size(text: str) -> int:
    from moestream.config import parse_size

    n = parse_size(text)
    if n <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give a positive size")
    return n


def _model_folder(a: argparse.Namespace) -> str:
    """MODEL or -m MODEL, one of them."""
    from moestream.config import ConfigError

    if a.model and a.model_arg and a.model != a.model_arg:
        raise ConfigError(f"two models given ({a.model_arg} and -m {a.model}); give one")
    if not (a.model or a.model_arg):
        raise ConfigError("give the model folder: moestream serve MODEL (or -m MODEL)")
    return a.model or a.model_arg


def cmd_serve(a: argparse.Namespace) -> int:
    a.model = _model_folder(a)
    try:
        import uvicorn

        from moestream.serve.app import create_app
    except ImportError as e:
        print(
            f"moestream: error: serve needs FastAPI and uvicorn ({e}); "
            "install them with: pip install 'moestream[serve]'",
            file=sys.stderr,
        )
        return 2
    from pathlib import Path

    with _open_runtime(a) as rt:
        _guard(rt, a)  # a request under memory pressure fails with 503, the server lives on
        model_id = a.model_name or Path(a.model).resolve().name
        print(
            f"serving {model_id!r} on http://{a.host}:{a.port}/v1 (FIFO, one request at a time)",
            file=sys.stderr,
        )
        app = create_app(rt, model_id, a.max_body_bytes)
        uvicorn.run(app, host=a.host, port=a.port, log_level=a.log_level)
    return 0


def _add_chat(sub) -> None:
    p = sub.add_parser("chat", help="interactive terminal chat with history and streamed replies")
    _add_model_args(p)
    _add_ctx_size(p)
    p.add_argument("--system", default=None, help="system message that starts the conversation")
    p.add_argument(
        "-n", "--max-tokens", type=int, default=512, help="most tokens per reply (default 512)"
    )
    _add_sampling_args(p)
    p.add_argument("--no-stats", action="store_true", help="no stats line after each reply")
    _add_guard_arg(p)
    _add_quiet(p)
    p.set_defaults(func=cmd_chat)


def cmd_chat(a: argparse.Namespace) -> int:
    from moestream.chat import run_chat

    cfg = _sampling(a)
    with _open_runtime(a) as rt:
        _guard(rt, a)
        return run_chat(rt, cfg, system=a.system, show_stats=not a.no_stats)


def _add_bench(sub) -> None:
    p = sub.add_parser(
        "bench", help="prompt and decode tok/s at fixed lengths, memory, bytes per token"
    )
    _add_model_args(p)
    p.add_argument(
        "-p", "--n-prompt", type=int, default=512, help="synthetic prompt tokens (default 512)"
    )
    p.add_argument("-n", "--n-gen", type=int, default=128, help="tokens decoded (default 128)")
    p.add_argument("-r", "--repetitions", type=int, default=3, help="timed runs (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs first (default 1)")
    p.add_argument("--json", action="store_true", help="print the JSON row instead of the table")
    p.add_argument("-o", "--output", default=None, help="append the JSON row to this file")
    _add_guard_arg(p)
    _add_quiet(p)
    p.set_defaults(func=cmd_bench)


def cmd_bench(a: argparse.Namespace) -> int:
    from moestream.obs.bench import BenchConfig, format_bench, run_bench
    from moestream.obs.rows import bench_row, write_rows

    cfg = BenchConfig(a.n_prompt, a.n_gen, a.repetitions, a.warmup)  # checked before loading
    with _open_runtime(a) as rt:
        _guard(rt, a)
        results = run_bench(rt, cfg)
    # every flag, so a row says what was asked (-p/-n/-r/--warmup among them)
    config = {k: v for k, v in vars(a).items() if k not in ("func", "json", "output", "command")}
    row = bench_row("moestream bench", config, results)
    write_rows(a.output, [row])
    print(json.dumps(row) if a.json else format_bench(row, mode_line(results["mode"])))
    return 0


def _add_obs(sub) -> None:
    """Router observation: trace, stats, plot, simulate (moestream/obs/)."""
    p = sub.add_parser("trace", help="record every MoE layer's routing while generating")
    p.add_argument("-m", "--model", required=True, help="checkpoint or store folder")
    p.add_argument(
        "--prompts", required=True, help="file: one prompt per line, or JSONL with 'prompt'"
    )
    p.add_argument("-n", "--max-tokens", type=int, default=128, help="tokens per prompt")
    p.add_argument("-o", "--out", required=True, help="trace folder to write (must not exist)")
    p.add_argument("--force", action="store_true", help="replace the trace folder -o if it exists")
    p.add_argument("--hidden", action="store_true", help="also save router inputs (float16)")
    p.add_argument("--chat", action="store_true", help="wrap prompts in the chat template")
    p.add_argument(
        "--student-path",
        action="store_true",
        help="prefill each prompt on the student path (with --routing predicted --predictor "
        "prerouter -n 1): the router inputs and choices that predicted routing, with the heads "
        "and the recovery adapter, produces (training rows for heads: train-prerouter)",
    )
    _add_sampling_args(p)
    p.add_argument("--ignore-eos", action="store_true", help="always generate -n tokens")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    _add_threads(p)
    p.add_argument("--no-memory-guard", action="store_true", help="do not stop on memory pressure")
    _add_store_args(p)
    _add_quiet(p)
    p.set_defaults(func=cmd_trace)

    p = sub.add_parser("stats", help="routing statistics of a trace")
    p.add_argument("trace", help="trace folder")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--top", type=int, default=5, help="hottest experts listed per layer")
    p.set_defaults(func=cmd_stats)

    p = sub.add_parser("plot", help="PNG plots of a trace (needs matplotlib)")
    p.add_argument("trace", help="trace folder")
    p.add_argument("-o", "--out", required=True, help="folder for the PNGs")
    p.add_argument("--layer", type=int, default=None, help="MoE layer of the raster (middle)")
    p.add_argument("--sequence", type=int, default=0, help="sequence of the raster (0)")
    p.set_defaults(func=cmd_plot)

    p = sub.add_parser("simulate", help="replay a trace through the expert cache policies")
    p.add_argument("trace", help="trace folder")
    p.add_argument(
        "--policy",
        action="append",
        default=None,
        help="lru|lfu|lrfu|pinned|sticky|belady (repeatable)",
    )
    p.add_argument(
        "--budget",
        action="append",
        default=None,
        help="bytes (512MiB) or a fraction of all experts (0.25); repeatable",
    )
    p.add_argument(
        "--expert-bytes", type=int, default=None, help="bytes per expert (default: the trace's)"
    )
    p.add_argument(
        "--pin-fraction", type=float, default=0.5, help="share of slots pinned by 'pinned'"
    )
    p.add_argument(
        "--gpu-admit",
        default=None,
        help="replay as the GPU pool with device-side misses (a decode miss crosses the link for "
        "its step, an admitted one again), under these admission rules: all, scored or all,scored",
    )
    p.add_argument("--plot", default=None, help="PNG file: hit rate vs budget")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_simulate)


def cmd_trace(a: argparse.Namespace) -> int:
    from moestream.config import ConfigError
    from moestream.obs.guard import MemoryGuard
    from moestream.obs.trace import prepare_out, read_prompts
    from moestream.runtime import open_model

    _setup_threads(a.threads)
    prompts = read_prompts(a.prompts)
    cfg, kw = _sampling(a), _store_kwargs(a)
    if a.student_path and (
        (a.routing, a.predictor) != ("predicted", "prerouter") or a.max_tokens != 1
    ):
        raise ConfigError(
            "--student-path prefills prompts through the prerouter heads as predicted routing "
            "decodes: it needs --routing predicted --predictor prerouter and -n 1"
        )
    prepare_out(a.out, a.force)  # after the flags, before the model loads: refusals cost nothing
    with open_model(a.model, dtype=a.dtype, progress=_progress(a), **kw) as rt:
        if not a.no_memory_guard:
            MemoryGuard().attach(rt.model)
        if a.student_path:
            _student_path(rt)
        out = _trace(rt, a, prompts, cfg)
    print(f"wrote {out}", file=sys.stderr)
    return 0


def _student_path(rt) -> None:
    """The model's provider becomes the student path over the predicting wrapper's provider:
    a prompt's prefill then routes as predicted decode would (StudentPath)."""
    from moestream.recovery.student import StudentPath

    pred = rt.provider  # PredictingExperts (--routing predicted --predictor prerouter)
    rt.model.set_provider(StudentPath(pred.inner, pred.predictor.heads, rt.model.moe_blocks))


def _trace(rt, a: argparse.Namespace, prompts, cfg):
    from moestream.obs.trace import record_trace

    def progress(i, res):
        print(
            f"[{i + 1}/{len(prompts)}] {len(res.prompt_ids)} prompt + {len(res.ids)} generated "
            f"tokens ({res.finish_reason})",
            file=sys.stderr,
        )

    return record_trace(
        rt, prompts, cfg, a.out, hidden=a.hidden, chat=a.chat, dtype=a.dtype, on_sequence=progress
    )


def cmd_stats(a: argparse.Namespace) -> int:
    from moestream.obs.stats import format_table, summarize
    from moestream.obs.trace import load_trace

    s = summarize(load_trace(a.trace), top_n=a.top)
    print(json.dumps(s) if a.json else format_table(s))
    return 0


def cmd_plot(a: argparse.Namespace) -> int:
    from moestream.obs.plots import plot_trace
    from moestream.obs.trace import load_trace

    for path in plot_trace(load_trace(a.trace), a.out, a.layer, a.sequence):
        print(f"wrote {path}", file=sys.stderr)
    return 0


def cmd_simulate(a: argparse.Namespace) -> int:
    from moestream.obs.simulate import format_results, run_grid
    from moestream.obs.trace import load_trace

    t = load_trace(a.trace)
    expert_bytes = a.expert_bytes if a.expert_bytes is not None else t.model.expert_bytes
    # --expert-bytes sizes every record; else each layer's record as the trace recorded it.
    sizes = None if a.expert_bytes is not None else t.model.layer_bytes()
    budgets = a.budget or ["0.125", "0.25", "0.5"]
    admits = [None] if a.gpu_admit is None else a.gpu_admit.split(",")
    results, skipped = run_grid(
        t,
        a.policy or ["lru"],
        budgets,
        expert_bytes,
        a.pin_fraction,
        record_bytes=sizes,
        admits=admits,
    )
    if a.plot:
        from moestream.obs.plots import plot_simulation

        plot_simulation(results, t.n_layers * t.num_experts, a.plot)
    if a.json:
        out = {"expert_bytes": expert_bytes, "results": [r.to_json() for r in results]}
        print(json.dumps({**out, "skipped": skipped}))
        return 0
    print(format_results(results, expert_bytes))
    for line in skipped:
        print(f"skipped: {line}")
    return 0


def _add_predict(sub) -> None:
    p = sub.add_parser(
        "train-prerouter", help="distil Edge0 prerouter heads from traces with hidden states"
    )
    p.add_argument("-m", "--model", required=True, help="checkpoint or store folder")
    p.add_argument(
        "--traces", required=True, nargs="+", help="trace folders (moestream trace --hidden)"
    )
    p.add_argument("--hidden", type=int, default=256, help="fc1 width (default 256)")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--val-fraction", type=float, default=0.15, help="held-out sequences")
    p.add_argument(
        "--next-state",
        action="store_true",
        help="heads also read layer 0's router input of the token they predict for (all run at "
        "that token's layer 0; not Edge0's timing: docs/prediction.md)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    p.add_argument("-o", "--out", default=None, help="heads file (default: beside the model)")
    _add_threads(p)
    p.add_argument("--json", action="store_true", help="print the per-head report as JSON")
    p.set_defaults(func=cmd_train_prerouter)

    p = sub.add_parser("eval", help="perplexity, flips vs an fp32 oracle, KL over a text file")
    _add_model_args(p)
    p.add_argument("--text", required=True, help="UTF-8 text file to score")
    p.add_argument("--max-tokens", type=int, default=2048, help="tokens scored (default 2048)")
    p.add_argument("--ctx", type=int, default=256, help="window length (default 256)")
    p.add_argument(
        "--reference",
        default=None,
        help="Hugging Face folder run in fp32 as the oracle (default: for a store, the folder it "
        "was converted from, as its manifest records; for a Hugging Face folder, itself)",
    )
    p.add_argument("--no-reference", action="store_true", help="perplexity only")
    p.add_argument(
        "--compare",
        action="store_true",
        help="one table: exact, predicted (prerouter) and predicted + recovery adapter",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    _add_quiet(p)
    p.set_defaults(func=cmd_eval)


def _add_recovery(sub) -> None:
    p = sub.add_parser(
        "train-recovery",
        help="train the recovery adapter for --routing predicted (Edge0 stages 2 and 3)",
    )
    p.add_argument("-m", "--model", required=True, help="Hugging Face folder or store")
    p.add_argument(
        "--corpus",
        required=True,
        help="UTF-8 training text (the reference corpus: data/corpus/train.txt from "
        "scripts/build_corpus.py)",
    )
    p.add_argument(
        "--quant",
        default=None,
        choices=["bf16", "int8", "int4"],
        help="expert format of the student (a Hugging Face folder is converted once; default bf16)",
    )
    p.add_argument("--rank", type=int, default=8, help="LoRA rank (default 8)")
    p.add_argument("--alpha", type=float, default=16.0, help="LoRA alpha (default 16)")
    p.add_argument("--steps", type=int, default=200, help="stage-2 steps (default 200)")
    p.add_argument("--batch", type=int, default=2, help="windows per step (default 2)")
    p.add_argument("--ctx", type=int, default=256, help="tokens per window (default 256)")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (default 2e-3)")
    p.add_argument(
        "--target",
        default="teacher",
        choices=["teacher", "text"],
        help="stage 2: the fp32 teacher's distribution (default) or the corpus tokens (SFT)",
    )
    p.add_argument(
        "--on-policy-steps", type=int, default=0, help="stage-3 steps after stage 2 (default 0)"
    )
    p.add_argument("--gen-tokens", type=int, default=32, help="stage 3: tokens sampled")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--device",
        default="auto",
        choices=["auto", "cpu", "cuda"],
        help="where student and teacher train (default auto: cuda when torch sees a GPU)",
    )
    p.add_argument("-o", "--out", default=None, help="adapter file (default: beside -m)")
    p.add_argument("--plot", default=None, help="PNG of the loss curve (needs matplotlib)")
    _add_threads(p)
    p.add_argument("--json", action="store_true", help="print the run's report as JSON")
    p.set_defaults(func=cmd_train_recovery)


def cmd_train_recovery(a: argparse.Namespace) -> int:
    from moestream.config import ConfigError
    from moestream.quality.eval import oracle_folder
    from moestream.recovery.adapter import ADAPTER_FILE, file_sha256, save_adapter
    from moestream.recovery.train import (
        STUDENT_EXPERTS,
        RecoveryConfig,
        fit,
        student_on,
        teacher_on,
    )
    from moestream.runtime import open_model

    _setup_threads(a.threads)
    device = _resolve_device(a.device)
    cfg = RecoveryConfig(
        rank=a.rank, alpha=a.alpha, steps=a.steps, batch=a.batch, ctx=a.ctx, lr=a.lr,
        target=a.target, on_policy_steps=a.on_policy_steps, gen_tokens=a.gen_tokens, seed=a.seed,
    )  # fmt: skip
    try:
        text = Path(a.corpus).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--corpus {a.corpus}: cannot read it ({e})") from e
    teacher_dir, _ = oracle_folder(a.model, None)
    with open_model(a.model, progress=not a.json, experts=STUDENT_EXPERTS, quant=a.quant) as rt:
        heads, heads_path = _recovery_heads(rt)
        with open_model(teacher_dir, dtype="float32") as teacher:
            student, model = student_on(rt, device), teacher_on(teacher, device)
            t0 = time.perf_counter()
            info, history = _fit_with_bar(student, model, heads, cfg, text, a.json, fit)
            seconds = time.perf_counter() - t0
        out = Path(a.out) if a.out else Path(a.model) / ADAPTER_FILE
        from dataclasses import replace

        save_adapter(rt.model, replace(info, heads=file_sha256(heads_path)), out)
    if a.plot:
        from moestream.obs.plots import plot_loss

        title = f"train-recovery: rank {a.rank}, {a.target} target, {device}"
        plot_loss(history, a.plot, title)
    report = _recovery_report(a, device, out, heads_path, history, seconds)
    if a.json:
        print(json.dumps(report))
    else:
        print(
            f"loss {report['loss_first10']:.4f} -> {report['loss_last10']:.4f} (mean of the "
            f"first / last 10 steps); {len(history)} steps on {report['device_name']} in "
            f"{seconds:.1f} s ({report['step_seconds']:.3f} s a step, median); wrote {out}",
            file=sys.stderr,
        )
    return 0


def _resolve_device(name: str) -> str:
    """--device auto|cpu|cuda -> cpu or cuda; cuda that torch cannot see is refused."""
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        _require_cuda()
    return name


def _require_cuda() -> None:
    import torch

    from moestream.config import ConfigError

    if not torch.cuda.is_available():
        raise ConfigError(
            f"--device cuda, but torch {torch.__version__} sees no CUDA GPU (a CPU-only build, or "
            "no GPU/driver); drop --device cuda to run on the CPU"
        )


def _recovery_report(a, device: str, out, heads_path, history: list[dict], seconds: float) -> dict:
    """train-recovery's --json object: where it ran, the loss at both ends, the time per step."""
    import statistics

    import torch

    first, last = history[: min(10, len(history))], history[-min(10, len(history)) :]
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    return {"out": str(out), "config": {**vars(a), "func": None}, "heads": str(heads_path),
            "device": device, "device_name": name, "seconds": seconds,
            "step_seconds": statistics.median(h["seconds"] for h in history),
            "loss_first10": sum(h["loss"] for h in first) / len(first),
            "loss_last10": sum(h["loss"] for h in last) / len(last), "history": history}  # fmt: skip


def _recovery_heads(rt):
    """The prerouter heads the student routes through (found as --predictor prerouter finds them)."""
    from moestream.config import ConfigError
    from moestream.predict.pipeline import make_predictor
    from moestream.predict.prerouter import HEADS_FILE, PrerouterHeads, find_heads

    found = find_heads(*rt.sources)
    if found is None:
        raise ConfigError(
            f"train-recovery routes through the prerouter heads ({HEADS_FILE}); none in "
            f"{', '.join(str(f) for f in dict.fromkeys(rt.sources))}; make them with "
            "`moestream train-prerouter -m PATH --traces TRACE`"
        )
    heads = PrerouterHeads.load(found)
    make_predictor("prerouter", rt.model, heads=heads)  # the shape check
    return heads, found


def _fit_with_bar(rt, teacher, heads, cfg, text: str, quiet: bool, fit):
    from tqdm import tqdm

    bar = tqdm(total=cfg.steps + cfg.on_policy_steps, desc="train-recovery", disable=quiet)

    def step(h):
        bar.set_postfix(stage=h["stage"], loss=f"{h['loss']:.4f}")
        bar.update()

    try:
        return fit(rt, teacher, heads, cfg, text, step)
    finally:
        bar.close()


def _add_recall(sub) -> None:
    p = sub.add_parser("recall", help="per-layer recall of routing predictors over a trace")
    p.add_argument("-m", "--model", required=True, help="the model the trace was recorded from")
    p.add_argument("--trace", required=True, help="trace folder (hidden states for stale-gate)")
    p.add_argument(
        "--predictor",
        action="append",
        default=None,
        help="temporal|stale-gate|prerouter|oracle (repeatable; default: all available)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    _add_threads(p)
    p.set_defaults(func=cmd_recall)


def cmd_recall(a: argparse.Namespace) -> int:
    from moestream.obs.trace import load_trace
    from moestream.predict.prerouter import PrerouterHeads, find_heads
    from moestream.predict.recall import format_recall, overall, recall_table
    from moestream.runtime import open_model

    _setup_threads(a.threads)
    with open_model(a.model, progress=False) as rt:
        t = load_trace(a.trace)
        found = find_heads(a.model, rt.folder)
        heads = PrerouterHeads.load(found) if found else None
        names = a.predictor or ["temporal"]
        if a.predictor is None and t.hidden is not None:
            names += ["stale-gate"] + (["prerouter"] if heads is not None else [])
        table = recall_table(rt.model, t, names, heads)
    if a.json:
        print(
            json.dumps({"per_layer": table, "overall": {n: overall(r) for n, r in table.items()}})
        )
    else:
        print(format_recall(table))
    return 0


def cmd_train_prerouter(a: argparse.Namespace) -> int:
    from pathlib import Path

    import torch

    from moestream.obs.trace import load_trace
    from moestream.predict.prerouter import HEADS_FILE
    from moestream.predict.train import TrainConfig, train_heads
    from moestream.runtime import open_model

    _setup_threads(a.threads)
    if len(a.traces) > 1:
        from moestream.predict.train import merge_traces

        trace = merge_traces([load_trace(t) for t in a.traces])
    else:
        trace = load_trace(a.traces[0])
    with open_model(a.model, progress=False) as rt:
        routers = [b.gate.weight.detach().float() for b in rt.model.moe_blocks]
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cfg = TrainConfig(
        hidden=a.hidden,
        epochs=a.epochs,
        lr=a.lr,
        batch=a.batch,
        val_fraction=a.val_fraction,
        seed=a.seed,
        device=device,
        next_state=a.next_state,
    )

    def log(col, r):
        if not a.json:
            print(
                f"head {col} -> layer {col + 1}: loss {r['loss_before']:.3f} -> {r['loss_after']:.3f}"
                f"  held-out recall@K {100 * r['recall_before']:.1f}% -> "
                f"{100 * r['recall_after']:.1f}%  ({r['train_rows']} train rows)",
                file=sys.stderr,
            )

    heads, report = train_heads(trace, routers, cfg, log)
    out = Path(a.out) if a.out else Path(a.model) / HEADS_FILE
    heads.save(out)
    if a.json:
        print(json.dumps({"out": str(out), "heads": report}))
    else:
        print(f"wrote {out}", file=sys.stderr)
    return 0


def _eval_window(a: argparse.Namespace, ids: list[int], context: int) -> int:
    """--ctx checked against the model and the text: a window scores ctx - 1 next tokens."""
    from moestream.config import ConfigError

    if a.ctx < 2:
        raise ConfigError(f"--ctx {a.ctx}: a window needs at least 2 tokens (one to predict)")
    if a.ctx > context:
        raise ConfigError(f"--ctx {a.ctx} exceeds the model's context of {context}; lower it")
    if len(ids) < 2:
        raise ConfigError(f"{a.text} has {len(ids)} token(s); eval needs at least 2 to score")
    return a.ctx


def _evaluate(a: argparse.Namespace, cand, ref, ids: list[int], ctx: int, stepwise: bool) -> dict:
    """evaluate() under a bar of the tokens scored (_progress decides whether it shows)."""
    from tqdm import tqdm

    from moestream.quality.eval import evaluate, windows

    total = sum(len(w) - 1 for w in windows(ids, ctx))
    with tqdm(total=total, desc="eval", unit="tok", disable=not _progress(a), leave=False) as bar:
        return evaluate(
            cand,
            ref,
            ids,
            ctx,
            stepwise=stepwise,
            log=lambda w, n: bar.update(n - 1),
        )


def cmd_eval(a: argparse.Namespace) -> int:
    from moestream.quality.eval import oracle_folder

    _setup_threads(a.threads)
    oracle, why = (None, None) if a.no_reference else oracle_folder(a.model, a.reference)
    if a.compare:
        return _eval_compare(a, oracle, why)
    out = _eval_one(a, _store_kwargs(a), oracle)
    out["config"] = _eval_config(a, oracle, why, out.pop("ctx"), out.pop("lora"))
    if a.json:
        print(json.dumps(out))
        return 0
    print(f"perplexity {out['perplexity']:.4f} +/- {out['stderr']:.4f} ({out['tokens']} tokens)")
    if oracle is not None:
        o = out["oracle"]
        print(f"oracle     {o['perplexity']:.4f} +/- {o['stderr']:.4f} (fp32: {oracle}, {why})")
        print(
            f"flips {out['flips']}/{out['positions']} (margin >= 0.1; {out['ties']} ties)  "
            f"KL mean {out['kl_mean']:.5f} max {out['kl_max']:.4f}"
        )
    return 0


def _eval_one(a: argparse.Namespace, kw: dict, oracle) -> dict:
    """One candidate configuration (open_model keywords) against the oracle over --text."""
    from pathlib import Path

    from moestream.runtime import open_model

    with open_model(a.model, dtype=a.dtype, progress=_progress(a), **kw) as cand:
        ref = None
        if oracle is not None:
            ref = open_model(oracle, dtype="float32", progress=_progress(a))
        ids = cand.tokenizer.encode(Path(a.text).read_text(encoding="utf-8"))[: a.max_tokens]
        ctx = _eval_window(a, ids, cand.args.max_position_embeddings)
        try:
            out = _evaluate(a, cand, ref, ids, ctx, kw["predict"].routing == "predicted")
        finally:
            if ref is not None:
                ref.close()
        out["provider"] = cand.provider.stats()
        out["lora"] = cand.mode["lora"]
    out["ctx"] = ctx
    return out


def _eval_config(a, oracle, why, ctx: int, lora) -> dict:
    return {
        "model": str(a.model),
        "dtype": a.dtype,
        "quant": a.quant,
        "predictor": a.predictor,
        "routing": a.routing,
        "lora": lora,
        "reference": None if oracle is None else str(oracle),
        "reference_from": why,
        "ctx": ctx,
    }


# `eval --compare`: the configurations of the prediction-as-routing quality gate.
COMPARE = (
    ("exact", dict(predictor="none", routing="exact")),
    ("predicted", dict(predictor="prerouter", routing="predicted", use_lora=False)),
    ("predicted + adapter", dict(predictor="prerouter", routing="predicted")),
)


def _eval_compare(a: argparse.Namespace, oracle, why) -> int:
    """Exact, predicted (prerouter) and predicted + recovery adapter in one table."""
    from dataclasses import replace

    from moestream.config import ConfigError

    if a.predictor != "none" or a.routing != "exact" or a.no_lora:
        raise ConfigError(
            "--compare runs exact, predicted (--predictor prerouter) and predicted + adapter "
            "itself: drop --predictor, --routing and --no-lora (--lora PATH picks the adapter)"
        )
    lora, a.lora = a.lora, None  # only the adapter row takes --lora
    kw = _store_kwargs(a)
    rows = []
    for name, over in COMPARE:
        if name == "predicted + adapter":
            over = {**over, "lora": lora}
        out = _eval_one(a, {**kw, "predict": replace(kw["predict"], **over)}, oracle)
        if name == "predicted + adapter" and out["lora"] is None:
            raise ConfigError(
                "--compare: no recovery adapter (recovery.lora beside the model or store, or "
                "--lora PATH); make one with `moestream train-recovery`"
            )
        rows.append({"name": name, **out})
    cfg = _eval_config(a, oracle, why, rows[0]["ctx"], rows[-1]["lora"])
    if a.json:
        print(json.dumps({"rows": rows, "config": {**cfg, "predictor": "compare"}}))
        return 0
    print(format_compare(rows, oracle is not None))
    return 0


def format_compare(rows: list[dict], with_oracle: bool) -> str:
    head = "| configuration | PPL +- stderr | flips | ties | KL mean (nats) | prediction recall |"
    lines = [head, "|---|---|---|---|---|---|"]
    if with_oracle:
        o = rows[0]["oracle"]
        lines.append(f"| fp32 oracle | {o['perplexity']:.3f} +- {o['stderr']:.3f} | | | | |")
    for r in rows:
        p = r["provider"]
        rec = p.get("predict_correct", 0) / p["predict_routed"] if p.get("predict_routed") else None
        cells = [r["name"], f"{r['perplexity']:.3f} +- {r['stderr']:.3f}"]
        if with_oracle:
            cells += [f"{r['flips']}/{r['positions']}", str(r["ties"]), f"{r['kl_mean']:.4f}"]
        else:
            cells += ["", "", ""]
        cells.append("" if rec is None else f"{100 * rec:.1f}%")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    from moestream import __version__

    parser = argparse.ArgumentParser(prog="moestream", description=__doc__)
    parser.add_argument("--version", action="version", version=f"moestream {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_convert(sub)
    _add_serve(sub)
    _add_chat(sub)
    _add_bench(sub)
    _add_obs(sub)
    _add_predict(sub)
    _add_recovery(sub)
    _add_recall(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    # OpenMP threads that sleep instead of spinning: with spinning, a second busy process on a
    # 2-core machine made decode ~100x slower (0.6 vs 63 tok/s measured); must precede torch's import.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    parser = build_parser()
    a = parser.parse_args(argv)
    from moestream.errors import USER_ERRORS, RankError
    from moestream.obs.guard import MemoryPressureError

    try:
        return a.func(a)
    except USER_ERRORS as e:
        print(f"moestream: error: {e}", file=sys.stderr)
        return 2
    except RankError as e:
        print(f"moestream: error: {e}", file=sys.stderr)
        return 1
    except MemoryPressureError as e:
        print(f"moestream: stopped: {e}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        _quiet_broken_pipe()
        return 0


def _quiet_broken_pipe() -> None:
    """The reader of stdout left (`generate ... | head`): point stdout at devnull so the
    interpreter's final flush does not fail again (the recipe in Python's signal docs)."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):
        pass  # stdout is no file (captured): nothing will flush to the closed pipe


if __name__ == "__main__":
    sys.exit(main())
