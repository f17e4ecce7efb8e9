"""Run the store fault matrix (tests/fault_kinds.py: every fault kind x IO mode) on a tiny
converted store and print the table: per kind the outcome in each mode, then the totals (kinds,
runs, clean errors, unchanged, wrong, tracebacks, unnamed errors) and every hole's last line.

    PYTHONPATH=. python scripts/fault_matrix.py [--modes resident,mmap] [--kinds SUBSTRING]
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def main() -> int:
    import json

    from fault_kinds import KINDS, MODES, OUTCOMES, generate, run_case
    from tiny_models import perturbed_model, save

    from moestream.convert.writer import convert
    from moestream.quant import make_scheme

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--kinds", default="", help="only kinds whose name contains this")
    a = p.parse_args()
    modes = a.modes.split(",")
    kinds = [k for k in KINDS if a.kinds in k]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        hf = save(perturbed_model("qwen3_moe"), tmp / "hf", "per_expert")
        store = convert(hf, tmp / "store", make_scheme("int8"), False)
        rc, out, err = generate(store, "resident")
        assert rc == 0, err
        want = json.loads(out)["ids"]
        counts, holes = collections.Counter(), []
        width = max(map(len, kinds))
        print(f"{'kind':<{width}}  " + "  ".join(f"{m:<11}" for m in modes))
        for kind in kinds:
            row = []
            for mode in modes:
                outcome, detail = run_case(store, tmp, kind, mode, want)
                counts[outcome] += 1
                row.append(outcome)
                if outcome not in ("clean error", "unchanged"):
                    holes.append(f"{kind} [{mode}] {outcome}: {detail[:300]}")
            print(f"{kind:<{width}}  " + "  ".join(f"{o:<11}" for o in row), flush=True)
    print()
    print(
        f"kinds {len(kinds)}, runs {sum(counts.values())}, "
        + ", ".join(f"{o} {counts[o]}" for o in OUTCOMES)
    )
    for h in holes:
        print("HOLE", h)
    return 1 if holes else 0


if __name__ == "__main__":
    sys.exit(main())
