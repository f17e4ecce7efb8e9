"""The one engine worker: a thread that takes requests from a FIFO queue and generates them in turn.

The engine holds one sequence at a time (one KV cache, one expert working set), so requests are
served strictly first come, first served; the rest wait in the queue (/stats shows its depth).
Text pieces go back to the request's asyncio loop through `call_soon_threadsafe`, so no event-loop
thread is ever blocked waiting for the engine. A request whose client went away is cancelled: the
worker stops iterating `Generator.stream` (a Python generator) at the next token, or skips it if it
has not started.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from moestream.config import ConfigError, SamplingConfig
from moestream.engine.generate import GenerationResult, Generator, peak_rss_bytes
from moestream.engine.tokenizer import CONTEXT_TOKENS
from moestream.errors import CheckpointError
from moestream.obs.guard import MemoryPressureError

log = logging.getLogger("moestream.serve")


@dataclass
class Piece:
    """New text plus the tokens produced since the last piece (end-of-sequence tokens left out);
    `before`: the last tokens before them (of the prompt for the first piece), their context."""

    text: str
    ids: list[int]
    logprobs: list[float]
    before: list[int]


@dataclass
class Finished:
    result: GenerationResult


@dataclass
class Failed:
    message: str
    status: int  # 400: the request cannot be served as asked; 500: damaged files or an engine
    # bug; 503: stopped by the memory-pressure guard


Event = Piece | Finished | Failed


@dataclass
class Job:
    prompt_ids: list[int]
    sampling: SamplingConfig
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self):
        self.result = GenerationResult(list(self.prompt_ids))

    def emit(self, event: Event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the loop closed (server shutting down): nobody is listening
            self.cancelled.set()

    def cancel(self) -> None:
        self.cancelled.set()


@dataclass
class Counters:
    requests_completed: int = 0
    requests_cancelled: int = 0
    requests_failed: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    decode_tokens: int = 0  # generated minus each request's first token (that one is prefill's)
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    last_decode_tok_s: float = 0.0


class Worker:
    """Owns the generator; `submit` enqueues, the thread generates one job at a time."""

    def __init__(self, generator: Generator):
        self.gen = generator
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.counters = Counters()
        self.active = 0
        self.started = time.time()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="moestream-engine", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        self.jobs.put(job)

    def close(self, timeout: float = 5.0) -> None:
        self.jobs.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while (job := self.jobs.get()) is not None:
            if job.cancelled.is_set():
                self._count(job, "cancelled")
                continue
            self.active = 1
            try:
                self._generate(job)
            finally:
                self.active = 0

    def _generate(self, job: Job) -> None:
        stream = self.gen.stream(job.prompt_ids, job.sampling, job.result)
        visible = self._visible_ids(job.sampling)
        sent = 0
        try:
            for text in stream:
                if job.cancelled.is_set():
                    break
                sent = self._emit_piece(job, text, visible, sent)
        except ConfigError as e:  # checked before queueing; kept as a safety net
            return self._fail(job, str(e), 400)
        except CheckpointError as e:  # a damaged store: the message names file, layer, expert
            log.error("generation failed: %s", e)
            return self._fail(job, f"the server's model files are damaged: {e}", 500)
        except MemoryPressureError as e:
            log.error("generation stopped: %s", e)
            return self._fail(job, f"stopped under memory pressure: {e}", 503)
        except Exception:
            log.exception("generation failed")
            return self._fail(job, "the engine failed on this request; see the server log", 500)
        finally:
            stream.close()  # stops a cancelled generation where it is
        if job.cancelled.is_set():
            return self._count(job, "cancelled")
        self._emit_piece(job, "", visible, sent)  # logprobs of tokens that produced no text
        # Count first: a client that has seen its answer end also sees it in /stats.
        self._count(job, "completed")
        job.emit(Finished(job.result))

    def _fail(self, job: Job, message: str, status: int) -> None:
        self._count(job, "failed")
        job.emit(Failed(message, status))

    def _visible_ids(self, cfg: SamplingConfig):
        eos = set() if cfg.ignore_eos else self.gen.eos_ids

        def visible(ids: list[int], lps: list[float]) -> tuple[list[int], list[float]]:
            keep = [k for k, t in enumerate(ids) if t not in eos]
            return [ids[k] for k in keep], [lps[k] for k in keep]

        return visible

    @staticmethod
    def _emit_piece(job: Job, text: str, visible, sent: int) -> int:
        res = job.result
        ids, lps = visible(res.ids[sent:], res.logprobs[sent:])
        if text or ids:
            before = (res.prompt_ids + res.ids[:sent])[-CONTEXT_TOKENS:]
            job.emit(Piece(text, ids, lps, before))
        return len(res.ids)

    def _count(self, job: Job, outcome: str) -> None:
        res = job.result
        with self._lock:
            c = self.counters
            setattr(c, f"requests_{outcome}", getattr(c, f"requests_{outcome}") + 1)
            if res.ids:
                c.prompt_tokens += len(res.prompt_ids)
                c.generated_tokens += len(res.ids)
                c.prefill_seconds += res.prefill_seconds
                if res.decode_seconds:  # unset when a cancel interrupted the decode loop
                    c.decode_seconds += res.decode_seconds
                    c.decode_tokens += len(res.ids) - 1
                c.last_decode_tok_s = res.stats()["decode_tok_s"]

    def stats(self) -> dict:
        with self._lock:
            c = Counters(**vars(self.counters))
        return {
            "uptime_seconds": time.time() - self.started,
            "queue_depth": self.jobs.qsize(),
            "active": self.active,
            **vars(c),
            "prefill_tok_s": c.prompt_tokens / c.prefill_seconds if c.prefill_seconds else 0.0,
            "decode_tok_s": c.decode_tokens / c.decode_seconds if c.decode_seconds else 0.0,
            "peak_rss_bytes": peak_rss_bytes(),
            "experts": self.gen.provider.stats() or None,
        }
