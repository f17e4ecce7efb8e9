#!/usr/bin/env bash
# Every CUDA test in one device call: six shards at once (compiling is CPU-bound, the GPU has
# room), then the slow tile-variant sweep, each shard under its own time limit so a slow or hung
# shard cannot take the others' results with it. Reports land in OUT_DIR/tests_<shard>.txt and a
# one-line summary per shard is printed.
#   bash tests/run_cuda.sh "$OUT" [SECONDS_PER_SHARD]      (PYTHON=... to pick the interpreter)
set -u
out=${1:?usage: tests/run_cuda.sh OUT_DIR [SECONDS_PER_SHARD]}
limit=${2:-300}
py=${PYTHON:-python}
export OMP_WAIT_POLICY=PASSIVE PYTHONPATH=$PWD
# The GPU machine's image has no `gguf` (test_kquant.py and the GGUF tests import it at
# collection; one missing import took the provider shard at d2c6d4e): llama.cpp's own gguf-py,
# from the source the peers' run carries, where the package is missing.
if ! "$py" -c "import gguf" 2>/dev/null && [ -f .carry/pack/llama.tar.xz ]; then
    mkdir -p /tmp/run_cuda_gguf && tar -xJf .carry/pack/llama.tar.xz -C /tmp/run_cuda_gguf llama/gguf-py
    export PYTHONPATH=$PYTHONPATH:/tmp/run_cuda_gguf/llama/gguf-py
fi
kern=tests/test_triton_kernels.py
abl=tests/test_triton_ablations.py

shard() {
    local name=$1
    shift
    timeout "$limit" "$py" -m pytest -q "$@" >"$out/tests_$name.txt" 2>&1
    local rc=$?
    echo "$name (exit $rc): $(tail -n 1 "$out/tests_$name.txt")"
}

# The pair-row and fused-vs-two-launch tests are not marked cuda: they take the GPU when there is one.
# decode in three shards (q4_0, half and chain doubled the 84 cases of one; the second's 150
# cases, ~3 s each, ran past 400 s at d2c6d4e beside the peers' prepare)
shard decode -m cuda "$kern" -k "test_decode_cuda" &
shard decode2 -m cuda "$kern" "$abl" -k "fused_decode_cuda" &
shard decode3 -m cuda "$kern" "$abl" -k "decode_half_cuda or decode_chain_cuda or decode_kquant_cuda or decode_fallback_cuda" &
shard mma -m cuda "$kern" -k mma_cuda &
# The prompt kernels in three shards (one took ~300 s alone and ran past 400 s beside the peers'
# prepare at a1f37fe, 95 of 97 done; q4_0 added 17 cases): the same tests, each once.
pre="prefill_cuda or prefill_tiles_cuda or dispatcher_cuda"
shard prefill "$kern" "$abl" -k "($pre) and not prefill_tiles_cuda" &
shard tiles "$kern" -k prefill_tiles_cuda &
shard prefill2 "$kern" "$abl" -k "(pair_rows or picked_calls or host_reads or fused_layer or grouped or dequant_rows or routed_groups or kquant_blocks or kquant_prompts or fallback_downs) and not ($pre)" &
shard provider -m cuda tests/test_gpu_provider.py tests/test_dense_quant.py tests/test_kquant.py &
# The dense GEMV and the small kernels run on CUDA whenever it is there (unmarked tests included:
# the q6_k output layer's GEMV, the record copy and the misses' staging).
shard dense tests/test_triton_dense.py tests/test_triton_small.py &
# The decode attention (one launch, and split over the positions) and recovery training.
shard attention -m cuda tests/test_triton_attention.py tests/test_recovery.py &
# The int8-activation ablation (its quantization check is unmarked: it takes the GPU when there is one).
shard q8 "$abl" -k q8 &
# The hand-written tensor-core gate/up ablation (CuPy's NVRTC, on the GPU machine's image).
shard mma_cuda -m cuda tests/test_ablation_mma_int4.py &
# The fused add + norm + router ablation (unmarked: it takes the GPU when there is one).
shard norm_router tests/test_ablation_norm_router.py &
wait
# The tile-variant sweep is slow (it has not finished in 300 s on the H200): VARIANTS=1 runs it.
[ "${VARIANTS:-0}" = 1 ] && shard variants -m cuda "$abl" -k variants_cuda
true
