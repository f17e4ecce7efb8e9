"""Command line: `moestream generate ...`. argparse lives only here."""

from __future__ import annotations

import argparse
import json
import sys

from moestream.config import SamplingConfig


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate a completion for one prompt")
    p.add_argument("-m", "--model", required=True, help="Hugging Face checkpoint folder")
    p.add_argument("-p", "--prompt", required=True, help="prompt text (used raw unless --chat)")
    p.add_argument(
        "-n", "--max-tokens", type=int, default=64, help="tokens to generate (default 64)"
    )
    p.add_argument("--temp", type=float, default=0.0, help="temperature; 0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")
    p.add_argument(
        "--chat", action="store_true", help="wrap the prompt in the model's chat template"
    )
    p.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="compute dtype (CPU default float32: this CPU has no bf16 instructions)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument(
        "--json", action="store_true", help="print one JSON object instead of streaming text"
    )
    p.set_defaults(func=cmd_generate)


def _setup_threads(n: int | None) -> None:
    import torch

    # Set once, before any op: switching thread counts later makes every op slow.
    if n:
        torch.set_num_threads(n)


def cmd_generate(a: argparse.Namespace) -> int:
    from moestream.runtime import open_model

    _setup_threads(a.threads)
    cfg = SamplingConfig(
        temperature=a.temp,
        top_p=a.top_p,
        top_k=a.top_k,
        seed=a.seed,
        max_new_tokens=a.max_tokens,
        stop=tuple(a.stop),
        ignore_eos=a.ignore_eos,
    )
    rt = open_model(a.model, dtype=a.dtype, progress=not a.json)
    prompt_ids = rt.encode_prompt(a.prompt, chat=a.chat)
    if a.json:
        res = rt.generator.generate(prompt_ids, cfg)
        out = {
            "prompt_ids": res.prompt_ids,
            "ids": res.ids,
            "text": res.text,
            "logprobs": res.logprobs,
            "stats": res.stats(),
        }
        print(json.dumps(out))
        return 0
    from moestream.engine.generate import GenerationResult

    res = GenerationResult(prompt_ids)
    for piece in rt.generator.stream(prompt_ids, cfg, res):
        sys.stdout.write(piece)
        sys.stdout.flush()
    s = res.stats()
    print(
        f"\n[prompt {s['prompt_tokens']} tok, {s['prefill_tok_s']:.1f} tok/s | "
        f"decode {s['generated_tokens']} tok, {s['decode_tok_s']:.1f} tok/s | "
        f"peak RSS {s['peak_rss_bytes'] / 2**20:.0f} MiB]",
        file=sys.stderr,
    )
    return 0


def _add_obs(sub) -> None:
    """Router observation: trace, stats, plot, simulate (moestream/obs/)."""
    p = sub.add_parser("trace", help="record every MoE layer's routing while generating")
    p.add_argument("-m", "--model", required=True, help="checkpoint or store folder")
    p.add_argument(
        "--prompts", required=True, help="file: one prompt per line, or JSONL with 'prompt'"
    )
    p.add_argument("-n", "--max-tokens", type=int, default=128, help="tokens per prompt")
    p.add_argument("-o", "--out", required=True, help="trace folder to write")
    p.add_argument("--hidden", action="store_true", help="also save router inputs (float16)")
    p.add_argument("--chat", action="store_true", help="wrap prompts in the chat template")
    p.add_argument("--temp", type=float, default=0.0, help="temperature; 0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true", help="always generate -n tokens")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--no-memory-guard", action="store_true", help="do not stop on memory pressure")
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
        "--policy", action="append", default=None, help="lru|lfu|pinned|sticky (repeatable)"
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
    p.add_argument("--plot", default=None, help="PNG file: hit rate vs budget")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_simulate)


def cmd_trace(a: argparse.Namespace) -> int:
    from moestream.obs.guard import MemoryGuard
    from moestream.obs.trace import read_prompts, record_trace
    from moestream.runtime import open_model

    _setup_threads(a.threads)
    prompts = read_prompts(a.prompts)
    cfg = SamplingConfig(
        temperature=a.temp,
        top_p=a.top_p,
        top_k=a.top_k,
        seed=a.seed,
        max_new_tokens=a.max_tokens,
        ignore_eos=a.ignore_eos,
    )
    rt = open_model(a.model, dtype=a.dtype, progress=True)
    if not a.no_memory_guard:
        MemoryGuard().attach(rt.generator.model)

    def progress(i, res):
        print(
            f"[{i + 1}/{len(prompts)}] {len(res.prompt_ids)} prompt + {len(res.ids)} generated "
            f"tokens ({res.finish_reason})",
            file=sys.stderr,
        )

    out = record_trace(
        rt, prompts, cfg, a.out, hidden=a.hidden, chat=a.chat, dtype=a.dtype, on_sequence=progress
    )
    print(f"wrote {out}", file=sys.stderr)
    return 0


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
    budgets = a.budget or ["0.125", "0.25", "0.5"]
    results, skipped = run_grid(t, a.policy or ["lru"], budgets, expert_bytes, a.pin_fraction)
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moestream", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_obs(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    from moestream.errors import USER_ERRORS
    from moestream.obs.guard import MemoryPressureError

    try:
        return a.func(a)
    except USER_ERRORS as e:
        print(f"moestream: error: {e}", file=sys.stderr)
        return 2
    except MemoryPressureError as e:
        print(f"moestream: stopped: {e}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
