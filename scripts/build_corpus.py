#!/usr/bin/env python3
"""Build the training corpus for the reference MoE model from Debian and PyPI packages only.

Sources (all fetched with the ordinary package clients, nothing else):
  * Debian: the CPython standard library (libpython3.X-minimal, -stdlib, -testsuite) and the
    reStructuredText sources of the Python documentation (python3.X-doc, html/_sources/*.txt),
    fetched with `apt-get download` and unpacked with `dpkg -x` into a temporary folder;
  * PyPI: wheels pinned by version (sympy, Django, numpy, pandas, scipy, ...), fetched with
    `pip download` for a fixed Python version and platform; only their .py files are taken.

Every file is a document. Documents are sorted by (source, path), and each goes to the validation
split when a hash of its name falls under --valid-percent, so the split is by file and does not
depend on the machine. Documents are joined with the end-of-text marker on its own line.

    python scripts/build_corpus.py --out data/corpus
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile

EOT = "<|endoftext|>"

DEFAULT_PYVER = "3.11"
# Pinned wheels; their .py files are the text taken. Platform and Python version are fixed below, so
# every machine downloads the same files.
DEFAULT_WHEELS = [
    "sympy==1.13.3",
    "Django==5.1.4",
    "numpy==2.1.3",
    "pandas==2.2.3",
    "scipy==1.14.1",
    "scikit-learn==1.5.2",
    "matplotlib==3.9.2",
    "networkx==3.4.2",
    "SQLAlchemy==2.0.36",
    "Twisted==24.10.0",
    "astropy==6.1.6",
]
WHEEL_PLATFORM = [
    "--python-version",
    "3.11",
    "--implementation",
    "cp",
    "--platform",
    "manylinux2014_x86_64",
    "--platform",
    "manylinux_2_17_x86_64",
]
MAX_FILE_BYTES = 400_000


def debs_for(pyver: str) -> list[tuple[str, str]]:
    """(package, what to take from it)."""
    return [
        (f"libpython{pyver}-minimal", "py"),
        (f"libpython{pyver}-stdlib", "py"),
        (f"libpython{pyver}-testsuite", "py"),
        (f"python{pyver}-doc", "rst"),
    ]


def clean(text: str) -> str | None:
    """Return the text to keep, or None to drop the file."""
    if EOT in text or "\x00" in text:
        return None
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    lines = text.split("\n")
    if not text.strip() or max(len(line) for line in lines) > 1000:
        return None  # generated tables and data blobs, not code
    return text.strip("\n") + "\n"


def read_text(path: str) -> str | None:
    if os.path.getsize(path) > MAX_FILE_BYTES:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return clean(f.read())
    except UnicodeDecodeError:
        return None


def fetch_debs(work: str, pyver: str) -> list[tuple[str, str, str]]:
    """Download and unpack the Debian packages; return (source, relpath, text) documents."""
    docs = []
    debdir = os.path.join(work, "debs")
    os.makedirs(debdir, exist_ok=True)
    for pkg, kind in debs_for(pyver):
        subprocess.run(["apt-get", "download", "-q", pkg], cwd=debdir, check=True)
        debs = sorted(glob.glob(os.path.join(debdir, f"{pkg}_*.deb")))
        if not debs:
            raise SystemExit(f"apt-get download {pkg} produced no .deb")
        deb = debs[-1]
        root = os.path.join(work, "x_" + pkg)
        subprocess.run(["dpkg", "-x", deb, root], check=True)
        print(f"  deb {os.path.basename(deb)}", file=sys.stderr)
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            for name in sorted(filenames):
                full = os.path.join(dirpath, name)
                rel = os.path.relpath(full, root)
                if os.path.islink(full):
                    continue
                if kind == "py" and not name.endswith(".py"):
                    continue
                if kind == "rst" and not ("/_sources/" in full and name.endswith(".txt")):
                    continue
                text = read_text(full)
                if text is not None:
                    docs.append((pkg, rel, text))
    return docs


def fetch_wheels(work: str, specs: list[str]) -> list[tuple[str, str, str]]:
    docs = []
    wdir = os.path.join(work, "wheels")
    os.makedirs(wdir, exist_ok=True)
    if specs:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                "--only-binary=:all:",
                *WHEEL_PLATFORM,
                "-d",
                wdir,
                *specs,
            ],
            check=True,
        )
    for whl in sorted(glob.glob(os.path.join(wdir, "*.whl"))):
        print(f"  wheel {os.path.basename(whl)}", file=sys.stderr)
        src = os.path.basename(whl).split("-")[0].lower()
        with zipfile.ZipFile(whl) as z:
            for info in sorted(z.infolist(), key=lambda i: i.filename):
                if not info.filename.endswith(".py") or info.file_size > MAX_FILE_BYTES:
                    continue
                try:
                    text = clean(z.read(info).decode("utf-8"))
                except UnicodeDecodeError:
                    continue
                if text is not None:
                    docs.append((src, info.filename, text))
    return docs


def is_valid(source: str, rel: str, percent: float) -> bool:
    # Sources are named without versions, so a rebuilt Debian mirror keeps the split stable.
    key = source + "/" + rel
    h = int(hashlib.sha256(key.encode()).hexdigest()[:8], 16)
    return (h % 10000) < percent * 100


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", default="data/corpus")
    ap.add_argument(
        "--pyver", default=DEFAULT_PYVER, help="Debian's CPython version (bookworm: 3.11)"
    )
    ap.add_argument("--wheels", nargs="*", default=DEFAULT_WHEELS, help="pinned PyPI wheels")
    ap.add_argument("--valid-percent", type=float, default=2.0)
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="moestream-corpus-") as work:
        docs = fetch_debs(work, args.pyver) + fetch_wheels(work, args.wheels)

    # dedupe identical files (the same module can ship in two packages)
    seen = set()
    uniq = []
    for src, rel, text in sorted(docs, key=lambda d: (d[0], d[1])):
        h = hashlib.sha256(text.encode()).digest()
        if h in seen:
            continue
        seen.add(h)
        uniq.append((src, rel, text))

    os.makedirs(args.out, exist_ok=True)
    stats = {"train": {"files": 0, "bytes": 0}, "valid": {"files": 0, "bytes": 0}}
    per_source: dict[str, int] = {}
    outs = {s: open(os.path.join(args.out, f"{s}.txt"), "w", encoding="utf-8") for s in stats}
    try:
        for src, rel, text in uniq:
            split = "valid" if is_valid(src, rel, args.valid_percent) else "train"
            outs[split].write(text)
            outs[split].write(EOT + "\n")
            stats[split]["files"] += 1
            stats[split]["bytes"] += len(text.encode())
            per_source[src] = per_source.get(src, 0) + len(text.encode())
    finally:
        for f in outs.values():
            f.close()
    manifest = {
        "sources": per_source,
        "splits": stats,
        "valid_percent": args.valid_percent,
        "files_dropped_or_duplicate": len(docs) - len(uniq),
    }
    with open(os.path.join(args.out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    for src, n in per_source.items():
        print(f"{src:60s} {n / 1e6:8.2f} MB")
    for s, st in stats.items():
        print(f"{s}: {st['files']} files, {st['bytes'] / 1e6:.2f} MB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
