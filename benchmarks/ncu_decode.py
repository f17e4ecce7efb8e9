"""One MoE layer of the decode kernels, run a few times, for Nsight Compute to profile.

Builds one random layer of a benchmark model shape (bench_gpu_moe.random_layer) and runs
`moe_decode` with the default (or the given) config `--iters` times after two warm-up calls, so
`ncu --launch-skip 4` sees compiled, warm kernels:
  ncu --clock-control none --kernel-name regex:"_gate_up|_down" --launch-skip 4 --launch-count 2 \
      --section SpeedOfLight --section WarpStateStats \
      python benchmarks/ncu_decode.py --quant int8
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from ablations.triton_decode import default, moe_decode  # noqa: E402
from bench_gpu_moe import MODELS, random_layer, routing  # noqa: E402
from common import override  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quant", default="int8", choices=["bf16", "int8", "int4"])
    ap.add_argument("--model", default="Qwen3-30B-A3B", choices=sorted(MODELS))
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--config", default=None,
                    help="AblationConfig fields, e.g. 'bn=8,bk=256' or 'fused=1'")  # fmt: skip
    args = ap.parse_args()
    D, I, E, K = MODELS[args.model]
    cfg = default(args.quant, D, I)
    if args.config:
        cfg = override(cfg, args.config)
    gen = torch.Generator().manual_seed(0)
    ex = random_layer(args.quant, D, I, E)
    x = torch.randn(args.tokens, D, generator=gen).cuda().bfloat16()
    ids, w = routing(args.tokens, E, K, gen)
    for _ in range(2 + args.iters):
        y = moe_decode(x, ids, w, ex, cfg)
    torch.cuda.synchronize()
    print(args.quant, args.model, cfg, float(y.float().norm()))


if __name__ == "__main__":
    main()
