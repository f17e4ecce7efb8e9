"""Generation: prefill the prompt, then decode one token at a time with streamed text and stats."""

from __future__ import annotations

import resource
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from moestream.config import ConfigError, ModelArgs, SamplingConfig
from moestream.engine.kv_cache import KVCache
from moestream.engine.sampling import choose
from moestream.engine.tokenizer import context_of, decode_after
from moestream.experts.base import ExpertProvider, stats_delta


def peak_rss_bytes() -> int:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # Linux reports KiB


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: str = ""
    finish_reason: str = "length"
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    wait_seconds: float = 0.0  # decode time blocked on the device (CUDA): the rest is host time
    provider_stats: dict = field(default_factory=dict)  # bytes_read, hits, ... (store providers)

    def stats(self) -> dict:
        n_dec = max(len(self.ids) - 1, 0)  # the first token comes out of the prefill
        return {
            "prompt_tokens": len(self.prompt_ids),
            "generated_tokens": len(self.ids),
            "prefill_seconds": self.prefill_seconds,
            "decode_seconds": self.decode_seconds,
            "prefill_tok_s": len(self.prompt_ids) / self.prefill_seconds
            if self.prefill_seconds
            else 0.0,
            "decode_tok_s": n_dec / self.decode_seconds if self.decode_seconds else 0.0,
            **self._host_time(n_dec),
            "peak_rss_bytes": peak_rss_bytes(),
            "finish_reason": self.finish_reason,
            **self.provider_stats,
            **self._read_rate(),
        }

    def _host_time(self, n_dec: int) -> dict:
        """Host time per decode token: the decode's wall time not spent blocked on the device
        (measured on CUDA only; on the CPU the host is the device)."""
        if not self.wait_seconds or not n_dec:
            return {}
        return {"host_ms_per_token": (self.decode_seconds - self.wait_seconds) / n_dec * 1e3}

    def _read_rate(self) -> dict:
        """The achieved read bandwidth: every byte the experts read over the whole generation."""
        if "bytes_read" not in self.provider_stats:
            return {}
        wall = self.prefill_seconds + self.decode_seconds
        return {"read_gbps": self.provider_stats["bytes_read"] / wall / 1e9 if wall else 0.0}


class TextStream:
    """Incremental detokenisation that never emits half a UTF-8 character or part of a stop string.
    `context`: the token(s) before the generated ones (`tokenizer.context_of` the prompt), decoded
    with them so a SentencePiece piece keeps its leading space (`tokenizer.decode_after`)."""

    def __init__(self, tokenizer, stop: tuple[str, ...], context: list[int] = ()):
        self.tok, self.stop, self.context = tokenizer, stop, list(context)
        self.ids: list[int] = []
        self.emitted = 0
        self.text = ""
        self.stopped = False

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = decode_after(self.tok, self.context, self.ids)
        for s in self.stop:
            i = text.find(s, max(self.emitted - len(s), 0))
            if i >= 0:
                self.stopped = True
                text = text[:i]
        self.text = text
        if self.stopped:
            return self.flush()
        # Trailing U+FFFD may be an incomplete UTF-8 sequence that a later token turns into a
        # character (possibly of a stop string): never emitted yet, and the stop prefixes are
        # looked for before it ("am" of a stop "amé" is held while the é is half decoded).
        stable = text.rstrip("\ufffd")
        hold = 0  # longest tail that is the start of a stop string
        for s in self.stop:
            for n in range(min(len(s) - 1, len(stable)), 0, -1):
                if stable.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        safe = len(stable) - hold
        out = text[self.emitted : max(safe, self.emitted)]
        self.emitted = max(safe, self.emitted)
        return out

    def flush(self) -> str:
        out = self.text[self.emitted :]
        self.emitted = len(self.text)
        return out


# Below this many weights (elements) a per-layer GEMM runs faster on one thread at one token:
# waking a second OpenMP thread costs more than it saves. F.linear at one token on the dev box,
# 1 vs 2 threads: 0.13 MB 7.8 vs 25.8 us, 1 MB 29 vs 37 us, 4 MB 208 vs 86 us, 12.6 MB 560 vs 301.
SMALL_GEMM = 1 << 19


def small_decode_threads(args: ModelArgs) -> int | None:
    """1 when every per-layer GEMM of a decode step is small (SMALL_GEMM): the tiny and reference
    models decode ~25% faster on one thread, real models (Qwen3-30B: 3.1M-weight experts) need
    all of them. None keeps the process's setting. The lm_head, one GEMM per token, is left out."""
    D = args.hidden_size
    attn = (args.num_attention_heads + 2 * args.num_key_value_heads) * args.head_dim * D
    gemms = [attn, 2 * args.moe_intermediate_size * D]
    if not all(args.moe_layers):
        gemms.append(2 * args.intermediate_size * D)
    if args.shared_expert_intermediate_size:
        gemms.append(2 * args.shared_expert_intermediate_size * D)
    return 1 if max(gemms) < SMALL_GEMM else None


class Generator:
    """Runs the model over one sequence at a time (requests are served FIFO); `provider` is the
    model's expert provider (reset before each sequence, its counters reported per generation).

    `decode_threads`: torch threads for the one-token steps (None: the process's setting); the
    prompt always runs with the process's setting."""

    def __init__(self, model, args: ModelArgs, tokenizer, provider: ExpertProvider, eos_ids=()):
        self.model, self.args, self.tok, self.provider = model, args, tokenizer, provider
        self.graphs = None  # engine.graph.DecodeGraphs: decode steps replayed as CUDA graphs
        # Positions one sequence may use: the model's context, or less (--ctx-size).
        self.context = args.max_position_embeddings
        self.decode_threads: int | None = None
        self.eos_ids = set(eos_ids)
        self.dtype = model.dtype
        self.device = model.device  # KV cache and token ids live there

    @torch.inference_mode()
    def stream(
        self, prompt_ids: list[int], cfg: SamplingConfig, result: GenerationResult | None = None
    ) -> Iterator[str]:
        """Yield text pieces as tokens are produced; fill `result` (ids, logprobs, timings)."""
        res = result if result is not None else GenerationResult(list(prompt_ids))
        if not prompt_ids:
            raise ConfigError("the prompt is empty after tokenisation; give at least one token")
        if max(prompt_ids) >= self.args.vocab_size or min(prompt_ids) < 0:
            raise ConfigError(
                f"prompt token id {max(prompt_ids)} is outside the model's vocabulary "
                f"({self.args.vocab_size}); the tokenizer does not belong to this model"
            )
        total = len(prompt_ids) + cfg.max_new_tokens
        if total > self.context:
            whose = "model's" if self.context == self.args.max_position_embeddings else "--ctx-size"
            raise ConfigError(
                f"prompt ({len(prompt_ids)} tokens) + max new tokens ({cfg.max_new_tokens}) exceeds "
                f"the {whose} context of {self.context}; shorten the prompt or lower -n"
            )
        if cfg.max_new_tokens == 0:
            return
        gen = torch.Generator().manual_seed(cfg.seed) if cfg.seed is not None else None
        graph = self.graphs.for_length(total) if self.graphs is not None else None
        cache = graph.cache if graph else KVCache(self.args, total, self.dtype, self.device)
        text = TextStream(self.tok, cfg.stop, context_of(self.tok, prompt_ids))
        before = self.provider.stats()
        self.provider.reset()
        t0 = time.perf_counter()
        prompt = torch.tensor(prompt_ids, device=self.device)
        logits = self.model(prompt, cache, 0, last_only=True)[-1]
        if self.device.type == "cuda":  # the prompt's kernels run asynchronously: time them
            torch.cuda.current_stream(self.device).synchronize()
        res.prefill_seconds = time.perf_counter() - t0
        pos = len(prompt_ids)
        threads = torch.get_num_threads()
        if self.decode_threads:
            torch.set_num_threads(self.decode_threads)
        try:
            yield from self._decode(logits, cache, pos, cfg, gen, text, res, graph)
        finally:
            torch.set_num_threads(threads)
        if before:
            res.provider_stats = stats_delta(before, self.provider.stats())
        tail = text.flush()
        if tail:
            yield tail
        res.text = text.text

    def _decode(self, logits, cache, pos: int, cfg, gen, text, res, graph=None) -> Iterator[str]:
        t1 = time.perf_counter()
        ahead = (graph is not None and cfg.temperature == 0 and not cfg.penalizes
                 and self.provider.decodes_ahead())  # fmt: skip
        steps = self._ahead if ahead else self._steps
        try:
            yield from steps(logits, cache, pos, cfg, gen, text, res, graph)
        finally:  # also when the consumer stops early (Ctrl-C in chat): honest timings
            res.decode_seconds = time.perf_counter() - t1

    def _take(self, token: int, logprob: float, cfg, text, res) -> tuple[str, bool]:
        """Record one chosen token: (its text piece, whether generation ends here)."""
        res.ids.append(token)
        res.logprobs.append(logprob)
        if token in self.eos_ids and not cfg.ignore_eos:
            res.finish_reason = "stop"
            return "", True
        piece = text.push(token)
        if text.stopped:
            res.finish_reason = "stop"
            return piece, True
        return piece, len(res.ids) >= cfg.max_new_tokens

    def _stream(self):
        return torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None

    def _wait(self, res, stream) -> None:
        """Block until the device finished what was issued, counted apart from host time."""
        if stream is not None:
            t = time.perf_counter()
            stream.synchronize()
            res.wait_seconds += time.perf_counter() - t

    def _steps(self, logits, cache, pos: int, cfg, gen, text, res, graph) -> Iterator[str]:
        stream = self._stream()
        while True:
            # The history only when a penalty reads it: no list built per token otherwise.
            history = res.prompt_ids + res.ids if cfg.penalizes else None
            self._wait(res, stream)
            piece, done = self._take(*choose(logits, cfg, gen, history), cfg, text, res)
            if piece:
                yield piece
            if done:
                break
            self.provider.decode_read()
            if graph is not None:
                logits = graph.step(res.ids[-1], pos)
            else:
                nxt = torch.tensor([res.ids[-1]], device=self.device)
                logits = self.model(nxt, cache, pos, last_only=True)[-1]
            self.provider.decode_issued()
            pos += 1

    def _ahead(self, logits, cache, pos: int, cfg, gen, text, res, graph) -> Iterator[str]:
        """Greedy decode through a captured step that feeds its own pick back: step n + 1 is
        issued before the host reads step n's token, so the host's work per token (reading it,
        detokenizing, stop checks) overlaps the GPU's. The step issued past the end is dropped
        (its cache position is masked or overwritten by the next sequence). The provider hears
        of each launch (`decode_issued`) and each read (`decode_read`), in that order of
        events."""
        self._wait(res, self._stream())
        piece, done = self._take(*choose(logits, cfg, gen), cfg, text, res)
        if piece:
            yield piece
        if done:
            return
        pending = [graph.launch(pos, res.ids[-1])]
        self.provider.decode_issued()
        while True:
            if len(res.ids) + len(pending) < cfg.max_new_tokens:
                pending.append(graph.launch(pos + len(pending)))
                self.provider.decode_issued()
            t = time.perf_counter()
            token, logprob = graph.read(pending.pop(0))
            res.wait_seconds += time.perf_counter() - t
            self.provider.decode_read()  # its bookkeeping overlaps the step still in flight
            pos += 1
            piece, done = self._take(token, logprob, cfg, text, res)
            if piece:
                yield piece
            if done:
                break

    def generate(self, prompt_ids: list[int], cfg: SamplingConfig) -> GenerationResult:
        res = GenerationResult(list(prompt_ids))
        for _ in self.stream(prompt_ids, cfg, res):
            pass
        return res
