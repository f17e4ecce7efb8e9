"""GGUF K-quant schemes (q4_k, q5_k, q6_k: llama.cpp's super-blocks of 256 kept byte for byte):
dequantization equals the gguf package's (llama.cpp's dequantize_row_q*_K port) bit for bit, the
torch kernels run them, and the shapes / sources they cannot hold are refused with the fix."""

from __future__ import annotations

import gguf
import pytest
import torch
from gguf_models import kquant_blocks

from moestream.config import ConfigError
from moestream.kernels.cpu import qlinear_cpu
from moestream.kernels.dense import QuantWeight
from moestream.kernels.ref import dequantize, dequantize_rows, qlinear_ref
from moestream.quant import KQUANT_BYTES, RecordLayout, make_scheme, quantize, tensor_width

KINDS = tuple(KQUANT_BYTES)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("seed", [0, 1])
def test_dequantize_is_the_gguf_packages(kind, seed):
    raw = kquant_blocks(kind, 7, 768, seed)
    want = gguf.quants.dequantize(raw.reshape(7, -1), gguf.GGMLQuantizationType[kind.upper()])
    sec = {"w.q": torch.from_numpy(raw)}
    got = dequantize(sec, "w", 256, torch.float32)
    assert torch.equal(got, torch.from_numpy(want))
    rows = torch.tensor([5, 0, 5])
    assert torch.equal(dequantize_rows(sec, "w", rows, 256, torch.float32), got[rows])
    assert tensor_width(make_scheme(kind), sec["w.q"]) == 768


@pytest.mark.parametrize("kind", KINDS)
def test_torch_kernels_are_the_dequantized_matmul(kind):
    sec = {"w.q": torch.from_numpy(kquant_blocks(kind, 5, 512))}
    x = torch.randn(3, 512)
    want = x @ dequantize(sec, "w", 256, torch.float32).T
    assert torch.equal(qlinear_ref(x, sec, "w", 256), want)
    assert torch.equal(qlinear_cpu(x, sec, "w", 256), want)


def test_kquant_rules_are_refused_with_the_fix():
    s = make_scheme("q6_k")
    assert s.group_size == 256  # the super-block, whatever the default --group-size
    with pytest.raises(ConfigError, match="super-blocks of 256; drop --group-size"):
        make_scheme("q4_k", 64)
    with pytest.raises(ConfigError, match="not a multiple of 256.*--quant int4"):
        RecordLayout.build(s, 256, 96)
    with pytest.raises(ConfigError, match="does not quantize into q4_k.*--quant int4"):
        quantize(make_scheme("q4_k"), torch.randn(4, 256))


def test_dense_rows_stack_as_stored():
    """The fused q/k/v projection stacks K-quant rows as they are (row-major blocks)."""
    s = make_scheme("q4_k")
    parts = [torch.from_numpy(kquant_blocks("q4_k", n, 256, n)) for n in (3, 5)]
    w = QuantWeight.cat([QuantWeight(s, (p.shape[0], 256), {"q": p}) for p in parts])
    want = torch.cat([dequantize({"w.q": p}, "w", 256, torch.float32) for p in parts])
    assert torch.equal(dequantize(w.sections(), "w", 256, torch.float32), want)
