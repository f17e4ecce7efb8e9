"""Memory-pressure guard: stop generation with a clear message before the OOM killer acts.

With mmap'd weights free memory is meaningless (clean pages are dropped, not swapped), so the guard
watches what does mean danger on Linux: PSI memory stall time (/proc/pressure/memory, "full" = all
non-idle tasks stalled) and swap growth (used swap from /proc/meminfo, pages swapped out from
/proc/vmstat). Where none of these files exist (macOS, old kernels, containers without PSI) the
guard is off and `check()` does nothing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

PAGE = 4096  # /proc/vmstat pswpout counts pages


class MemoryPressureError(RuntimeError):
    """Raised from inside a forward step when memory pressure crosses a GuardConfig limit."""


@dataclass(frozen=True, slots=True)
class GuardConfig:
    psi_full_avg10: float = 20.0  # % of the last 10 s during which all tasks stalled on memory
    psi_some_avg10: float | None = (
        None  # % some-stall; off by default (page-cache streaming sets it)
    )
    swap_growth_bytes: int = 256 * 2**20  # swap used or swapped out since the guard started
    interval_s: float = 0.2  # read /proc at most this often

    def __post_init__(self):
        if self.swap_growth_bytes <= 0:
            raise ValueError(f"swap_growth_bytes must be > 0, got {self.swap_growth_bytes}")
        if not 0 < self.psi_full_avg10 <= 100:
            raise ValueError(f"psi_full_avg10 must be in (0, 100], got {self.psi_full_avg10}")


@dataclass(frozen=True, slots=True)
class Reading:
    psi_some_avg10: float | None
    psi_full_avg10: float | None
    swap_used: int | None  # bytes
    swapped_out: int | None  # bytes, cumulative since boot


def parse_psi(text: str) -> dict[str, float]:
    """'some avg10=1.00 avg60=...\\nfull avg10=0.50 ...' -> {'some': 1.0, 'full': 0.5} (avg10)."""
    out = {}
    for line in text.splitlines():
        kind, *fields = line.split()
        for f in fields:
            key, _, val = f.partition("=")
            if key == "avg10":
                out[kind] = float(val)
    return out


def parse_swap_used(meminfo: str) -> int | None:
    vals = {}
    for line in meminfo.splitlines():
        key, _, rest = line.partition(":")
        if key in ("SwapTotal", "SwapFree"):
            vals[key] = int(rest.split()[0]) * 1024  # kB
    if len(vals) < 2:
        return None
    return vals["SwapTotal"] - vals["SwapFree"]


def parse_pswpout(vmstat: str) -> int | None:
    for line in vmstat.splitlines():
        key, _, val = line.partition(" ")
        if key == "pswpout":
            return int(val) * PAGE
    return None


class MemoryGuard:
    """`check()` raises MemoryPressureError when a limit is crossed; `attach(model)` runs it before
    every forward step (prefill and each decode token)."""

    def __init__(self, cfg: GuardConfig | None = None, proc: str | Path = "/proc", clock=None):
        self.cfg = cfg or GuardConfig()
        root = Path(proc)
        self.psi_path = root / "pressure" / "memory"
        self.meminfo_path = root / "meminfo"
        self.vmstat_path = root / "vmstat"
        self.clock = clock or time.monotonic
        self.enabled = any(
            p.is_file() for p in (self.psi_path, self.meminfo_path, self.vmstat_path)
        )
        self.baseline = self.read() if self.enabled else None
        self.last_check = float("-inf")

    @staticmethod
    def _text(path: Path) -> str | None:
        try:
            return path.read_text()
        except OSError:  # missing, or PSI disabled (EOPNOTSUPP)
            return None

    def read(self) -> Reading:
        psi_text = self._text(self.psi_path)
        psi = parse_psi(psi_text) if psi_text else {}
        meminfo = self._text(self.meminfo_path)
        vmstat = self._text(self.vmstat_path)
        return Reading(
            psi.get("some"),
            psi.get("full"),
            parse_swap_used(meminfo) if meminfo else None,
            parse_pswpout(vmstat) if vmstat else None,
        )

    def problem(self, r: Reading) -> str | None:
        """The first limit the reading crosses, as a sentence; None if all is well."""
        c, b = self.cfg, self.baseline
        if r.psi_full_avg10 is not None and r.psi_full_avg10 >= c.psi_full_avg10:
            return (
                f"all tasks were stalled on memory {r.psi_full_avg10:.0f}% of the last 10 s "
                f"(PSI full avg10; limit {c.psi_full_avg10:.0f}%)"
            )
        if c.psi_some_avg10 is not None and r.psi_some_avg10 is not None:
            if r.psi_some_avg10 >= c.psi_some_avg10:
                return (
                    f"tasks were stalled on memory {r.psi_some_avg10:.0f}% of the last 10 s "
                    f"(PSI some avg10; limit {c.psi_some_avg10:.0f}%)"
                )
        for now, then, what in (
            (r.swap_used, b.swap_used, "swap in use grew"),
            (r.swapped_out, b.swapped_out, "pages swapped out"),
        ):
            if now is not None and then is not None and now - then >= c.swap_growth_bytes:
                return (
                    f"{what} by {(now - then) / 2**20:.0f} MiB since generation started "
                    f"(limit {c.swap_growth_bytes / 2**20:.0f} MiB)"
                )
        return None

    def check(self) -> None:
        if not self.enabled:
            return
        now = self.clock()
        if now - self.last_check < self.cfg.interval_s:
            return
        self.last_check = now
        why = self.problem(self.read())
        if why is not None:
            raise MemoryPressureError(
                f"memory pressure: {why}; stopped generation before the OOM killer acts. "
                "Close other programs, lower the expert cache budget or context length, or use a "
                "smaller model (--no-memory-guard turns this check off)"
            )

    def attach(self, model):
        """Check before every forward of `model`; returns the hook handle (`.remove()` detaches)."""
        return model.register_forward_pre_hook(lambda _m, _args: self.check())
