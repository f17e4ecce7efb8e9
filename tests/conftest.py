import os
import sys
import tempfile
from pathlib import Path

# Sleeping OpenMP threads: spinning ones make tests crawl when another process shares the cores.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Conversions on first use go to a throwaway cache: the suite never writes into ~/.cache/moestream
# (subprocesses inherit it).
os.environ["MOESTREAM_CACHE"] = tempfile.mkdtemp(prefix="moestream-test-cache-")
# The native kernels' build is kept in the checkout's ignored .cache/ (built once, ~1 min).
os.environ.setdefault(
    "MOESTREAM_EXT_CACHE", str(Path(__file__).resolve().parent.parent / ".cache" / "ext")
)

import pytest  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
# the benchmark modules their tests import (ablations, bench_warmup, common)
sys.path.insert(1, str(Path(__file__).parents[1] / "benchmarks"))
torch.set_num_threads(2)
# Without a GPU the Triton kernels run through the interpreter on CPU tensors; triton reads the
# variable when a kernel is decorated, so it is set before any test module imports them.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """(arch, layout) -> folder of a saved tiny checkpoint, built once per session."""
    from tiny_models import perturbed_model, save

    root = tmp_path_factory.mktemp("tiny")
    cache = {}

    def get(arch: str, layout: str = "per_expert") -> Path:
        key = (arch, layout)
        if key not in cache:
            cache[key] = save(perturbed_model(arch), root / f"{arch}-{layout}", layout)
        return cache[key]

    return get
