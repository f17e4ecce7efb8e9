"""Memory-pressure guard on simulated /proc readings."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from moestream.obs.guard import GuardConfig, MemoryGuard, MemoryPressureError, parse_psi

MiB = 2**20


def write_proc(root, *, some=0.0, full=0.0, swap_total_kb=1048576, swap_free_kb=1048576, pswpout=0):
    (root / "pressure").mkdir(exist_ok=True)
    (root / "pressure" / "memory").write_text(
        f"some avg10={some:.2f} avg60=0.00 avg300=0.00 total=0\n"
        f"full avg10={full:.2f} avg60=0.00 avg300=0.00 total=0\n"
    )
    (root / "meminfo").write_text(
        f"MemTotal:       24000000 kB\nMemFree:          100000 kB\n"
        f"SwapTotal:      {swap_total_kb} kB\nSwapFree:       {swap_free_kb} kB\n"
    )
    (root / "vmstat").write_text(f"nr_free_pages 1000\npswpin 0\npswpout {pswpout}\n")


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_parse_psi():
    text = "some avg10=12.50 avg60=1.00 avg300=0.00 total=5\nfull avg10=3.25 avg60=0 avg300=0 total=1\n"
    assert parse_psi(text) == {"some": 12.5, "full": 3.25}


def test_quiet_system_passes_and_low_free_memory_is_ignored(tmp_path):
    write_proc(tmp_path, some=30.0, full=5.0)
    g = MemoryGuard(proc=tmp_path)
    assert g.enabled
    g.check()  # some-stall alone (page-cache streaming) and little free memory are not danger


def test_psi_full_trips(tmp_path):
    write_proc(tmp_path)
    clock = Clock()
    g = MemoryGuard(GuardConfig(psi_full_avg10=20.0), proc=tmp_path, clock=clock)
    g.check()
    write_proc(tmp_path, full=35.0)
    clock.t += 1
    with pytest.raises(MemoryPressureError, match=r"stalled on memory 35% .*PSI full.*OOM killer"):
        g.check()


def test_psi_some_trips_only_when_enabled(tmp_path):
    write_proc(tmp_path, some=80.0)
    MemoryGuard(proc=tmp_path).check()
    with pytest.raises(MemoryPressureError, match="PSI some"):
        MemoryGuard(GuardConfig(psi_some_avg10=50.0), proc=tmp_path).check()


def test_swap_growth_trips_relative_to_start(tmp_path):
    # 600 MiB of swap already in use when the guard starts: not a problem by itself.
    write_proc(tmp_path, swap_free_kb=1048576 - 600 * 1024)
    clock = Clock()
    g = MemoryGuard(GuardConfig(swap_growth_bytes=256 * MiB), proc=tmp_path, clock=clock)
    g.check()
    write_proc(tmp_path, swap_free_kb=1048576 - 800 * 1024)  # +200 MiB
    clock.t += 1
    g.check()
    write_proc(tmp_path, swap_free_kb=1048576 - 900 * 1024)  # +300 MiB
    clock.t += 1
    with pytest.raises(MemoryPressureError, match="swap in use grew by 300 MiB"):
        g.check()


def test_swapped_out_pages_trip(tmp_path):
    write_proc(tmp_path, pswpout=1000)
    g = MemoryGuard(GuardConfig(swap_growth_bytes=100 * MiB), proc=tmp_path)
    write_proc(tmp_path, pswpout=1000 + 100 * MiB // 4096)
    with pytest.raises(MemoryPressureError, match="pages swapped out by 100 MiB"):
        g.check()


def test_reads_are_rate_limited(tmp_path):
    write_proc(tmp_path)
    clock = Clock()
    g = MemoryGuard(GuardConfig(interval_s=0.5), proc=tmp_path, clock=clock)
    g.check()
    write_proc(tmp_path, full=90.0)
    clock.t += 0.1
    g.check()  # too soon to read again
    clock.t += 0.5
    with pytest.raises(MemoryPressureError):
        g.check()


def test_off_where_files_do_not_exist(tmp_path):
    g = MemoryGuard(proc=tmp_path / "missing")
    assert not g.enabled
    g.check()


def test_attach_stops_forward(tmp_path):
    write_proc(tmp_path)
    clock = Clock()
    g = MemoryGuard(proc=tmp_path, clock=clock)
    model = nn.Linear(2, 2)
    handle = g.attach(model)
    model(torch.zeros(1, 2))
    write_proc(tmp_path, full=50.0)
    clock.t += 1
    with pytest.raises(MemoryPressureError):
        model(torch.zeros(1, 2))
    handle.remove()
    model(torch.zeros(1, 2))


def test_generate_stops_with_a_clear_message(tiny_dir, tmp_path, monkeypatch, capsys):
    from moestream.cli import main as cli_main

    write_proc(tmp_path, full=90.0)
    real_init = MemoryGuard.__init__
    monkeypatch.setattr(
        MemoryGuard, "__init__", lambda self, cfg=None, proc="/proc": real_init(self, cfg, tmp_path)
    )
    rc = cli_main(["generate", "-m", str(tiny_dir("olmoe")), "-p", "def f", "-n", "3"])
    assert rc == 3
    err = capsys.readouterr().err
    assert "moestream: stopped: memory pressure: all tasks were stalled on memory 90%" in err
    argv = ["generate", "-m", str(tiny_dir("olmoe")), "-p", "def f", "-n", "3", "--json"]
    assert cli_main([*argv, "--no-memory-guard"]) == 0
