"""Convert crash-consistency (convert/writer.py): a convert killed at any point leaves no partial
folder behind once the next one ran (SIGTERM / SIGHUP clean up at once, SIGKILL on the next run);
two conversions into one destination take turns (the cache's second reuses the first's store, an
explicit second convert is refused as existing); a full disk, a read-only destination and
dangling symlinks are one-line errors naming the path."""

from __future__ import annotations

import errno
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moestream.cli import main
from moestream.config import ConfigError
from moestream.convert import writer
from moestream.convert.writer import convert, destination_lock
from moestream.quant import make_scheme
from moestream.store.format import Store

ROOT = Path(__file__).resolve().parents[1]
INT8 = make_scheme("int8")

# A convert in a subprocess that sends itself `sig` at its `at`-th expert record (-1: at the
# dense write, 10**6: just before the rename), so "random" points are reproducible.
KILLER = """
import os, sys
from moestream.convert import writer
sig, at = int(sys.argv[3]), int(sys.argv[4])
n = 0
def hit():
    os.kill(os.getpid(), sig)
record, dense, rename = writer._expert_record, writer._write_dense, writer._fsync_dir
def expert_record(*a):
    global n
    if n == at: hit()
    n += 1
    return record(*a)
def write_dense(*a):
    if at == -1: hit()
    return dense(*a)
def fsync_dir(folder):
    rename(folder)
    if at == 10**6: hit()
writer._expert_record, writer._write_dense, writer._fsync_dir = expert_record, write_dense, fsync_dir
from moestream.quant import make_scheme
writer.convert(sys.argv[1], sys.argv[2], make_scheme("int8"), False)
"""


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def _partials(dst: Path) -> list[Path]:
    return list(dst.parent.glob(f".{dst.name}.partial-*"))


def _kill_points(n_records: int) -> list[tuple[int, int]]:
    rng = random.Random(20)  # fixed seed: the same points every run
    return [
        (signal.SIGKILL, -1),
        (signal.SIGKILL, rng.randrange(n_records)),
        (signal.SIGKILL, 10**6),
        (signal.SIGTERM, rng.randrange(n_records)),
        (signal.SIGHUP, rng.randrange(n_records)),
    ]


@pytest.fixture(scope="module")
def src(tiny_dir):
    return tiny_dir("qwen3_moe")


def test_killed_convert_then_rerun_leaves_no_partial(src, tmp_path):
    from moestream.convert.hf import HFCheckpoint

    a = HFCheckpoint(src).args
    for i, (sig, at) in enumerate(_kill_points(len(a.moe_layer_ids) * a.num_experts)):
        dst = tmp_path / f"s{i}"
        r = subprocess.run(
            [sys.executable, "-c", KILLER, str(src), str(dst), str(int(sig)), str(at)],
            env=_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode in (-sig, 128 + sig), (sig, at, r.returncode, r.stderr[-2000:])
        assert not dst.exists()
        if sig != signal.SIGKILL:  # caught: the partial folder went with the process
            assert _partials(dst) == [], (sig, at)
            assert "Traceback" not in r.stderr
        convert(src, dst, INT8, False)
        assert _partials(dst) == []
        Store(dst)  # opens: every checksum in place


def test_stale_partial_of_a_dead_process_is_removed(src, tmp_path):
    dst = tmp_path / "s"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # its pid is free now
    stale = tmp_path / f".s.partial-{dead.pid}"
    stale.mkdir()
    (stale / "experts-L000.bin").write_bytes(b"x" * 4096)
    convert(src, dst, INT8, False)
    assert not stale.exists()


def _wait_for(paths: list[Path], text: str, timeout: float = 120) -> None:
    end = time.monotonic() + timeout
    while not all(text in p.read_text() for p in paths):
        assert time.monotonic() < end, [p.read_text()[-500:] for p in paths]
        time.sleep(0.1)


def _two_at_once(tmp_path: Path, dst: Path, argv: list[str], env: dict) -> list[tuple[int, str]]:
    """Start two processes while this one holds dst's lock, so both must wait; then let go."""
    logs = [tmp_path / f"err{i}.txt" for i in range(2)]
    with destination_lock(dst):
        procs = []
        for log in logs:
            with open(log, "w") as f:
                procs.append(subprocess.Popen(argv, env=env, stderr=f, stdout=subprocess.DEVNULL))
        _wait_for(logs, "waiting for another conversion")
    for p in procs:
        p.wait(timeout=120)
    return [(p.returncode, log.read_text()) for p, log in zip(procs, logs)]


def test_two_conversions_into_the_cache_give_one_store(src, tmp_path):
    from moestream.convert.cache import cached_store, store_key

    cache = tmp_path / "cache"
    cache.mkdir()
    env = {**_env(), "MOESTREAM_CACHE": str(cache)}
    code = (
        "import sys; from moestream.convert.cache import cached_store; "
        "from moestream.quant import make_scheme; "
        f"print(cached_store({str(src)!r}, make_scheme('int8'), False), file=sys.stderr)"
    )
    key = store_key(src, INT8)
    results = _two_at_once(tmp_path, cache / key, [sys.executable, "-c", code], env)
    for rc, err in results:
        assert rc == 0, err
        assert err.strip().endswith(str(cache / key))
    stores = [p for p in cache.iterdir() if not p.name.startswith(".")]
    assert stores == [cache / key]
    assert list(cache.glob(".*partial*")) == []
    os.environ["MOESTREAM_CACHE"], saved = str(cache), os.environ["MOESTREAM_CACHE"]
    try:
        assert cached_store(src, INT8, False) == cache / key  # reused, not converted again
    finally:
        os.environ["MOESTREAM_CACHE"] = saved
    Store(cache / key)


def test_second_explicit_convert_is_refused_as_existing(src, tmp_path):
    dst = tmp_path / "s"
    argv = [sys.executable, "-m", "moestream", "convert", str(src), str(dst), "--quant", "int8"]
    results = sorted(_two_at_once(tmp_path, dst, argv, _env()))
    assert results[0][0] == 0, results[0][1]
    rc, err = results[1]
    assert rc == 2
    assert f"moestream: error: {dst} already exists (another convert wrote it while" in err
    assert "Traceback" not in err
    Store(dst)


def test_full_disk_is_a_named_error(src, tmp_path, monkeypatch, capsys):
    def full(*a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(a[1]))

    monkeypatch.setattr(writer, "save_file", full)
    dst = tmp_path / "s"
    assert main(["convert", str(src), str(dst), "--quant", "int8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"moestream: error: converting into {dst} failed: No space left")
    assert err.endswith("free space there or choose another destination, then convert again")
    assert not dst.exists() and _partials(dst) == []


def test_read_only_destination_is_a_named_error(src, tmp_path, monkeypatch):
    def read_only(self, *a, **k):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))

    monkeypatch.setattr(Path, "mkdir", read_only)
    with pytest.raises(ConfigError, match="Read-only file system"):
        convert(src, tmp_path / "ro" / "s", INT8, False)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_chmod_read_only_destination_is_a_named_error(src, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        with pytest.raises(ConfigError, match="is not writable"):
            convert(src, ro / "s", INT8, False)
    finally:
        ro.chmod(0o755)


def test_dangling_symlink_destination_is_a_named_error(src, tmp_path):
    dst = tmp_path / "s"
    dst.symlink_to(tmp_path / "gone")
    with pytest.raises(ConfigError, match="is a dangling symlink"):
        convert(src, dst, INT8, False)


def test_dangling_symlink_in_the_source_is_a_named_error(src, tmp_path, capsys):
    import shutil

    copy = shutil.copytree(src, tmp_path / "m")
    weights = next(copy.glob("*.safetensors"))
    weights.unlink()
    weights.symlink_to(tmp_path / "blobs" / "missing")  # a Hugging Face cache without its blob
    assert main(["convert", str(copy), str(tmp_path / "s"), "--quant", "int8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and weights.name in err[0], err
    assert _partials(tmp_path / "s") == []
