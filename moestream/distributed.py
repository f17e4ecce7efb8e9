"""Launching expert-parallel ranks (experts/parallel.py): `--devices cpu:N` parsed into `Devices`,
then either this process is one rank of a `torchrun` launch (RANK / WORLD_SIZE set: torchrun's
variables are read here and nowhere else) or N ranks are spawned here, each joining one gloo
process group over localhost. A rank that dies or hangs ends the run with one named error."""

from __future__ import annotations

import os
import pickle
import socket
import sys
import tempfile
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from moestream.config import ConfigError
from moestream.errors import RankError

# Per-collective limit: a layer's all_gather waits this long for a hung peer (a dead one fails at
# once: its socket closes). Far above one layer's compute, far below "looks like a hang".
STEP_TIMEOUT = timedelta(seconds=30)
GRACE = 5.0  # seconds a failed run's other ranks get to exit before they are stopped


@dataclass(frozen=True, slots=True)
class Devices:
    """The ranks of one expert-parallel run: `kind` cpu (gloo) and how many."""

    kind: str
    count: int

    def __post_init__(self):
        if self.kind != "cpu":
            raise ConfigError(
                f"--devices {self.kind}: expert parallelism runs on CPU ranks (gloo) only so far; "
                "the GPU (NCCL) path is not built yet: use --devices cpu:N"
            )
        if self.count < 1:
            raise ConfigError(f"--devices cpu:{self.count}: give at least one rank")

    @classmethod
    def parse(cls, text: str) -> Devices:
        """`cpu:2` (two CPU ranks), `cpu,cpu`; `cuda:0,cuda:1` names GPUs (refused for now)."""
        items = [s.strip() for s in text.split(",") if s.strip()]
        kinds = {s.partition(":")[0] for s in items}
        if not items or len(kinds) != 1 or not kinds <= {"cpu", "cuda"}:
            raise ConfigError(
                f"--devices {text!r}: give cpu:N (N CPU ranks) or a list such as cuda:0,cuda:1"
            )
        kind = kinds.pop()
        if kind == "cpu" and len(items) == 1 and ":" in items[0]:
            n = items[0].partition(":")[2]
            if not n.isdigit():
                raise ConfigError(f"--devices {text!r}: cpu:N takes a number of ranks, e.g. cpu:2")
            return cls("cpu", int(n))
        return cls(kind, len(items))


def torchrun_rank() -> tuple[int, int] | None:
    """(rank, world) when torchrun (or any env:// launcher) started this process."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def launch(devices: Devices, fn: Callable[..., int], *args) -> int:
    """Runs fn(rank, world, *args) -> exit code on every rank; rank 0 alone writes to stdout.
    Spawned ranks hand their exception to this process, which raises the first one."""
    given = torchrun_rank()
    if given is not None:
        rank, world = given
        if world != devices.count:
            raise ConfigError(
                f"--devices asks for {devices.count} ranks but WORLD_SIZE is {world}: make them "
                "agree (torchrun --nproc-per-node N ... --devices cpu:N)"
            )
        return _run_rank(rank, world, "env://", fn, args, errors=None)
    import logging

    import torch.multiprocessing as mp

    # join's "Terminating process ... via SIGTERM" would precede the one line said below.
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    init = f"tcp://127.0.0.1:{_free_port()}"
    with tempfile.TemporaryDirectory(prefix="moestream-ranks-") as errors:
        ctx = mp.start_processes(
            _spawned, (devices.count, init, fn, args, errors), devices.count, join=False,
            start_method="spawn",
        )  # fmt: skip
        try:  # after a failure the others get GRACE to report theirs, then SIGTERM, then SIGKILL
            while not ctx.join(grace_period=GRACE):
                pass
        except mp.ProcessExitedException as e:
            if e.signal_name:  # killed: no message of its own, the others were stopped by join
                raise RankError(
                    f"rank {e.error_index} died ({e.signal_name}); the other ranks were stopped"
                ) from None
            raise _first_error(errors) or RankError(
                f"rank {e.error_index} exited with code {e.exit_code}"
            ) from None
    return 0


def _first_error(folder: str) -> BaseException | None:
    """The exception the first failing rank left in `folder` (files, not a queue: a rank
    killed while holding a queue's lock would leak its semaphore)."""
    files = sorted(Path(folder).glob("*.err"), key=lambda f: f.stat().st_mtime_ns)
    return pickle.loads(files[0].read_bytes()) if files else None


def _spawned(rank: int, world: int, init: str, fn, args, errors: str) -> None:
    code = _run_rank(rank, world, init, fn, args, errors)
    # Leave without the interpreter's teardown: its C++ destructors once met a joinable thread
    # of the process group ("terminate called without an active exception", SIGABRT) after the
    # rank's work was done and its results saved. Outputs are flushed; errors are in their files.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _run_rank(rank: int, world: int, init: str, fn, args, errors: str | None) -> int:
    import torch
    import torch.distributed as dist

    if rank:  # one voice: rank 0 prints; the others' errors reach the launcher
        sys.stdout = sys.stderr = open(os.devnull, "w")  # noqa: SIM115 (lives with the process)
    # The machine's cores split between the ranks (a --threads given to fn wins).
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // world))
    try:
        try:
            dist.init_process_group(
                "gloo", init_method=init, rank=rank, world_size=world, timeout=STEP_TIMEOUT
            )
        except RuntimeError as e:
            raise RankError(f"rank {rank}: the {world} ranks did not all join: {e}") from e
        try:
            return fn(rank, world, *args)
        finally:
            dist.destroy_process_group()
    except BaseException as e:
        if errors is None:
            raise
        tmp = Path(errors) / f"{rank}.tmp"
        tmp.write_bytes(pickle.dumps(_portable(rank, e)))
        tmp.rename(tmp.with_suffix(".err"))  # whole, or not there
        return 1 if isinstance(e, RankError) or not isinstance(e, Exception) else 2


def _portable(rank: int, e: BaseException) -> BaseException:
    """The exception as the launcher can re-raise it: itself when it pickles and is a user
    error; else a RankError naming it (its traceback on this rank's real stderr)."""
    from moestream.errors import USER_ERRORS

    if isinstance(e, (RankError, *USER_ERRORS)):
        try:
            pickle.loads(pickle.dumps(e))  # the launcher must be able to read it back
            return e
        except Exception:
            pass
    traceback.print_exception(e, file=sys.__stderr__)
    return RankError(f"rank {rank} failed: {type(e).__name__}: {e}")


def shared_seed(seed: int | None) -> int | None:
    """Rank 0's seed for everyone: sampling without --seed must still agree on every rank."""
    import random

    import torch.distributed as dist

    box = [seed if seed is not None else random.SystemRandom().randrange(2**63)]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
