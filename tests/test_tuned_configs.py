"""Tuned Triton tiles as data (moestream/kernels/triton/configs/tiles.json, read by tuned.py): the
shipped rows are the tiles the kernels had as literals (behaviour unchanged; the prefill rows of
bf16, int8 and int4 rows since changed on purpose, PREFILL_ROWS), an unknown device and
the interpreter fall back to them, a shape row wins over "any", and rows written the way
benchmarks/tune_gpu_decode.py --write writes them read back."""

from __future__ import annotations

import pytest

from moestream.kernels.triton import tuned

# decode.DEFAULT_CONFIGS and PrefillConfig() before the tiles became data
SHIPPED = {
    "bf16": dict(bn=4, bk=128, split=1, bn_d=16, bk_d=256, num_warps=4, warps_d=4),
    "int8": dict(bn=4, bk=512, split=1, bn_d=8, bk_d=256, num_warps=4, warps_d=2),
    "int4": dict(bn=64, bk=128, split=4, bn_d=64, bk_d=256, num_warps=4, warps_d=4),
}
FLAGS = {"bf16": (False, 0), "int8": (False, 0), "int4": (True, 3)}  # mma, stages
PREFILL = dict(block_m=32, half=32, bk=64, num_warps=4)
# bf16, int8 (and int4 rows) prefill since 2a9a48e: weight rows on the dot's M side (block_n)
PREFILL_ROWS = {"bf16": {**PREFILL, "block_n": 64}, "int8": {**PREFILL, "block_n": 64},
                "int4": PREFILL}  # fmt: skip
# int4 rows: the tokens-on-M family up to SHORT tokens (faster at 64, slower at 512)
SHORT = 64
INT4R = {**PREFILL, "block_n": 64, "short": {"max_tokens": SHORT, "block_n": 0}}
SHAPES = [(2048, 768), (2048, 512), (64, 64)]


def _decode(quant: str) -> dict:
    mma, stages = FLAGS[quant]
    return {**SHIPPED[quant], "pdl": True, "mma": mma, "stages": stages}


@pytest.mark.parametrize("quant", list(SHIPPED))
@pytest.mark.parametrize("shape", SHAPES)
def test_shipped_rows_are_the_tiles_the_kernels_had(quant, shape):
    assert tuned.settings("decode", quant, *shape, "NVIDIA H200") == _decode(quant)
    assert tuned.settings("prefill", quant, *shape, "NVIDIA H200") == PREFILL_ROWS[quant]


@pytest.mark.parametrize("device", ["NVIDIA B200", "Some Future GPU", None])
def test_unknown_device_and_interpreter_take_the_fallback(device):
    assert tuned.load()["fallback_device"] == "NVIDIA H200"
    for quant in SHIPPED:
        assert tuned.settings("decode", quant, 2048, 768, device) == _decode(quant)
        assert tuned.settings("prefill", quant, 2048, 768, device) == PREFILL_ROWS[quant]


def test_a_shape_row_wins_and_written_rows_read_back(tmp_path):
    row = {**_decode("int8"), "bn": 8, "note": "tune_gpu_decode.py at abc: 20.0 us"}
    data = tuned.with_row(tuned.load(), "NVIDIA H100", "decode", "int8", "D=2048,I=768", row)
    path = tmp_path / "tiles.json"
    path.write_text(tuned.dumps(data))
    got = tuned.settings("decode", "int8", 2048, 768, "NVIDIA H100", path)
    assert got == {**_decode("int8"), "bn": 8}  # the note is not a config field
    # another shape, another quant or another kernel on that device: the fallback device's rows
    assert tuned.settings("decode", "int8", 2048, 512, "NVIDIA H100", path) == _decode("int8")
    assert tuned.settings("decode", "bf16", 2048, 768, "NVIDIA H100", path) == _decode("bf16")
    assert tuned.settings("prefill", "int8", 2048, 768, "NVIDIA H100", path) == PREFILL_ROWS["int8"]
    assert tuned.load()["devices"].keys() == {"NVIDIA H200"}  # with_row copied the file's rows
    assert tuned.dumps(tuned.load()) == tuned.CONFIG_FILE.read_text()  # the tuner's layout


def test_the_kernels_build_their_configs_from_the_rows():
    pytest.importorskip("triton")
    from moestream.kernels.triton import decode, prefill

    for quant in SHIPPED:
        want = decode.DecodeConfig(**_decode(quant))
        assert decode.default_config(quant, 2048, 768, 32, None) == want
        assert decode.default_config(quant, 2048, 768, 32, "NVIDIA H200") == want
        for tokens in (None, 9, SHORT, 512):  # one family at every length
            assert prefill.default_config(quant, 2048, 768, None, tokens) == prefill.PrefillConfig(
                **PREFILL_ROWS[quant]
            )
    # int4 rows: the prompt's length picks the family (a chunk passes its call's length)
    assert tuned.settings("prefill", "int4r", 2048, 768, "NVIDIA H200") == INT4R
    long = prefill.PrefillConfig(**PREFILL, block_n=64)
    short = prefill.PrefillConfig(**PREFILL, block_n=0)
    got = {t: prefill.default_config("int4r", 2048, 768, "NVIDIA H200", t) for t in
           (None, 9, SHORT, SHORT + 1, 512)}  # fmt: skip
    assert got == {None: long, 9: short, SHORT: short, SHORT + 1: long, 512: long}
    # small shapes: the tuned tiles fitted (halved) until they fit, None when nothing does
    want = decode.fit_config("bf16", 64, 64, 32, decode.DecodeConfig(**_decode("bf16")))
    assert decode.default_config("bf16", 64, 64, 32, None) == want and want.bk_d == 64
    assert decode.default_config("int4", 96, 96, 32, None) is None
