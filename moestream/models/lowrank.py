"""Unmerged LoRA deltas, the recovery adapter's math (recovery/adapter.py attaches them):
y = W x + (alpha / r) B A x beside a frozen, possibly quantized projection W.

Training runs each delta as its own module (autograd). Without gradients, in fp32, a delta is
added with one addmm on A x, and the q/k/v deltas of a fused q/k/v output with one GEMM for the
three A's and one for the three B's (`LoraStack`): a decode step's adapters cost two ops per
projection group instead of ~6 per projection plus a split and a cat.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class LowRank(nn.Module):
    """An unmerged LoRA delta beside a frozen (possibly quantized) projection W:
    y = W x + (alpha / r) B A x, with A [r, in] and B [out, r] in fp32 whatever W's format (merged
    into an int4 W it would mostly round away: its RMS is below one quantization step)."""

    def __init__(self, n_in: int, n_out: int, rank: int, alpha: float):
        super().__init__()
        self.rank, self.alpha, self.scale = rank, alpha, alpha / rank
        self.A = nn.Parameter(torch.zeros(rank, n_in))
        self.B = nn.Parameter(torch.zeros(n_out, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] -> the delta [T, out] in x's dtype."""
        return (F.linear(F.linear(x.float(), self.A), self.B) * self.scale).to(x.dtype)

    def add_to(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """y [T, out] (W x) plus this delta of x [T, in]. Inference in fp32: y + scale (A x) B^T
        as one addmm (the same terms; the BLAS may round the last add differently, ~1 ulp)."""
        if not _inference_fp32(y, x):
            return y + self(x)
        a, b = self._parameters["A"], self._parameters["B"]  # (nn.Module's __getattr__: ~1 us)
        return torch.addmm(y, F.linear(x, a), b.t(), alpha=self.scale)


def plus_lora(lora: nn.ModuleDict, name: str, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """y (projection `name` of x) plus its adapter's delta, if it has one."""
    m = lora._modules.get(name)  # the ModuleDict's own dict: no per-call module lookups
    return y if m is None else m.add_to(y, x)


def _inference_fp32(y: torch.Tensor, x: torch.Tensor) -> bool:
    return (
        not torch.is_grad_enabled()
        and y.dtype == torch.float32
        and x.dtype == torch.float32
        and y.dim() == 2
        and x.dim() == 2
    )


def _state(m: LowRank) -> tuple:
    """What a stacked copy of m depends on: its identity, its tensors' and their in-place
    versions, its scale (ids: the stack holds the objects, so none can be reused meanwhile)."""
    a, b = m._parameters["A"], m._parameters["B"]
    return (id(m), id(a), id(b), _version(a), _version(b), m.scale)


def _version(t: torch.Tensor) -> int:
    """t's in-place version; an inference tensor (an adapter loaded under inference_mode) has
    none, and cannot be changed outside inference_mode: nothing trains it."""
    return -1 if t.is_inference() else t._version


class LoraStack:
    """The adapters of projections that read one input and whose outputs are column blocks of one
    fused output (q/k/v: `names` with `sizes` columns each), added as two GEMMs: the A's stacked
    [R, in] (R = the ranks' sum) and the B's block diagonal, transposed [R, out] (zeros off the
    blocks; a projection without an adapter has no rows). Remade when an adapter is added,
    removed, replaced, rescaled or changed in place (training steps, `copy_`)."""

    def __init__(self, names: tuple[str, ...], sizes: tuple[int, ...]):
        self.names, self.sizes = names, sizes
        self._key: tuple | None = None
        self._mats: tuple[torch.Tensor, torch.Tensor, float] | None = None
        self._held: list = []  # the objects whose ids are in _key

    def add_to(self, lora: nn.ModuleDict, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
        """y [T, sum(sizes)] plus each adapter's delta of x [T, in] in its columns; None where the
        stacked path does not apply (gradients, not fp32, scales that differ): add them one by one."""
        if not _inference_fp32(y, x):
            return None
        mods = [lora._modules.get(n) for n in self.names]  # (no per-call module lookups)
        key = tuple(None if m is None else _state(m) for m in mods)
        if key != self._key:
            self._mats, self._key = self._stack(mods), key
            self._held = [
                (m, m._parameters["A"], m._parameters["B"]) for m in mods if m is not None
            ]
        if self._mats is None:
            return None
        a, bt, scale = self._mats
        return torch.addmm(y, F.linear(x, a), bt, alpha=scale)

    def _stack(self, mods: list[LowRank | None]) -> tuple[torch.Tensor, torch.Tensor, float] | None:
        present = [m for m in mods if m is not None]
        if not present or len({m.scale for m in present}) > 1:
            return None
        with torch.no_grad():
            a = torch.cat([m.A.detach() for m in present])  # [R, in]
            bt = a.new_zeros(a.shape[0], sum(self.sizes))  # [R, out]
            row = col = 0
            for m, size in zip(mods, self.sizes):
                if m is not None:
                    bt[row : row + m.rank, col : col + size] = m.B.detach().t()
                    row += m.rank
                col += size
        return a, bt, present[0].scale
