#!/usr/bin/env bash
# The GPU machine's side-by-side run (issue 22), in two steps so each fits one device call:
#   bash benchmarks/gpu_peers.sh prepare   # llama.cpp CUDA build (background) + checkpoint + conversions
#   setsid bash benchmarks/gpu_peers.sh prepare >/tmp/prep.log 2>&1 &   # detached, then in a later call:
#   bash benchmarks/gpu_peers.sh wait [SECONDS]   # until prepare wrote $WORK/prepare.exit (exit 3: not yet)
#   bash benchmarks/gpu_peers.sh bench OUT [COMMIT]   # PROMPT=512 TOKENS=16 SHARES=1: long prompts
#   bash benchmarks/gpu_peers.sh gguf OUT [COMMIT]    # llama.cpp's Q4_0 file itself on both engines
#     (moestream keeps its Q4_0 experts as q4_0; GGUF=1 prepare converts it beforehand; FILE=Q4_K_M
#     runs that type's file, which GGUF=Q4_K_M prepare quantizes from the Q8_0 and converts)
#   WIDTH=1408 WORK=/tmp/p1408 GGUF=Q4_K_M ... prepare, then FILE=Q4_K_M ... gguf: experts 1408 wide
#   bash benchmarks/gpu_peers.sh admit OUT [COMMIT]  # admissions A/B on the same store (no llama.cpp):
#     SHARE=0.25 POOL_KERNELS=triton,triton-admitall PROGRAMS=32 (LLAMA=0 prepare: the store only)
# Needs .carry/pack/llama.tar.xz: `tar -cJf` of a stripped llama.cpp source (../shared/peers/README.md)
# as llama/ and gen_model_b.py (the repository's tracked files already take ~61 of the 64 MiB a
# device call carries, so the source travels compressed, ~4.4 MB).
# Everything is written under $WORK (default /tmp/peers): nothing of llama.cpp is committed.
set -eu -o pipefail
# bench and admit tee their output to OUT: each run's line (written as it finishes) comes back
# even when a device call's time limit stops the command before the JSON rows are written
WORK=${WORK:-/tmp/peers}
LAYERS=${LAYERS:-16}
SRC=$WORK/src
export PYTHONPATH=$PWD:$SRC/llama/gguf-py PYTHONUNBUFFERED=1
mkdir -p "$WORK"
case ${1:?prepare, wait, bench, gguf or admit} in
prepare)
  rm -f "$WORK/prepare.exit"
  # the marker is written by this shell itself (a subshell of a device call's command can be
  # killed with the call; a detached prepare outlives it), with prepare's exit status
  trap 'echo "prepare exit $?" >"$WORK/prepare.exit"' EXIT
  [ -d "$SRC/llama" ] || { mkdir -p "$SRC" && tar -xJf .carry/pack/llama.tar.xz -C "$SRC"; }
  # WIDTH=1408: the experts that wide (DeepSeek-V2-Lite's, Qwen1.5-MoE's; 256 does not divide it,
  # so a Q4_K_M file's downs are Q5_0 / Q8_0): the extracted copy of gen_model_b.py is edited
  # (use another WORK, its checkpoint is a different model)
  if [ -n "${WIDTH:-}" ]; then
    sed -i "s/\(D, H, KV, hd, E, I = 2048, 32, 4, 128, 128, \)768/\1$WIDTH/" "$SRC/gen_model_b.py"
    grep -q "128, 128, $WIDTH\$" "$SRC/gen_model_b.py" || { echo "WIDTH: gen_model_b.py's shape line not found"; exit 4; }
  fi
  llama=${LLAMA:-1}
  [ "$llama" = 0 ] && echo "llama.cpp build skipped (LLAMA=0)" >"$WORK/build.done"
  [ -f "$WORK/build.done" ] || (cmake -S "$SRC/llama" -B "$WORK/llb" -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON \
     -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=ON -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TESTS=OFF \
     -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF >"$WORK/cmake.log" 2>&1 &&
   cmake --build "$WORK/llb" -j 12 --target llama-bench llama-quantize >"$WORK/build.log" 2>&1;
   echo "llama.cpp build exit $?" >"$WORK/build.done") &
  # vocab 32000: gen_model_b.py's corpus trains at most ~56,000 BPE tokens (151936 exits)
  python "$SRC/gen_model_b.py" "$WORK/hf" --layers "$LAYERS" --vocab 32000
  # the store's name as bench_peers.ensure_store gives it (else the bench converts again)
  name=$(python -c 'import sys; sys.path.insert(0, "benchmarks"); import bench_peers as b; print(b.store_name("int4"))')
  python -m moestream convert "$WORK/hf" "$WORK/work/$name" --quant int4 -q &
  [ "$llama" = 0 ] || python "$SRC/llama/convert_hf_to_gguf.py" "$WORK/hf" --outtype q8_0 --outfile "$WORK/work/llama-Q8_0.gguf" >"$WORK/conv.log" 2>&1
  wait
  cat "$WORK/build.done"
  [ "$llama" = 0 ] && { rm -f "$WORK/build.done"; ls -la "$WORK/work"; exit 0; }
  # GGUF=1: Q4_0's store too; GGUF=Q4_0,Q4_K_M: each type's file (from the Q8_0) and its store
  types=Q4_0; [ "${GGUF:-0}" = 0 ] || [ "${GGUF}" = 1 ] || types=Q4_0,$GGUF
  for t in ${types//,/ }; do
    [ -f "$WORK/work/llama-$t.gguf" ] || "$WORK/llb/bin/llama-quantize" --allow-requantize \
      "$WORK/work/llama-Q8_0.gguf" "$WORK/work/llama-$t.gguf" "$t" >/dev/null 2>&1
    # the store bench_peers --gguf makes of that file (its name: ensure_gguf_store's)
    [ "${GGUF:-0}" = 0 ] || python -c 'import sys; sys.path.insert(0, "benchmarks"); import bench_peers as b; from pathlib import Path; print(b.ensure_gguf_store(Path(sys.argv[1]), Path(sys.argv[2])))' \
      "$WORK/work/llama-$t.gguf" "$WORK/work"
  done
  mkdir -p "$WORK/llama/build/bin" && ln -sf "$WORK/llb/bin/"* "$WORK/llama/build/bin/"
  mkdir -p "$WORK/llama/venv/bin" "$WORK/llama/src" && ln -sf "$(command -v python)" "$WORK/llama/venv/bin/python"
  ln -sf "$SRC/llama/convert_hf_to_gguf.py" "$WORK/llama/src/"
  ls -la "$WORK/work"
  ;;
wait)
  for _ in $(seq 1 "${2:-420}"); do [ -f "$WORK/prepare.exit" ] && break; sleep 1; done
  [ -f "$WORK/prepare.exit" ] || { echo "prepare not done after ${2:-420} s"; exit 3; }
  cat "$WORK/prepare.exit"; grep -q "exit 0" "$WORK/prepare.exit"
  ;;
bench)
  out=${2:?OUT folder}
  python benchmarks/bench_peers.py --device cuda --hf "$WORK/hf" --llama "$WORK/llama" --work "$WORK/work" \
    --pairs int4:Q4_0 --shares "${SHARES:-1,0.5,0.25}" --kernels "${KERNELS:-triton,compiled}" \
    --pool-kernels "${POOL_KERNELS:-triton}" --threads 16 -p "${PROMPT:-64}" -n "${TOKENS:-64}" \
    --reps "${REPS:-2}" --out "$out/gpu_peers.jsonl" ${3:+--commit $3} 2>&1 | tee "$out/gpu_peers.log"
  ;;
gguf)
  out=${2:?OUT folder}
  python benchmarks/bench_peers.py --device cuda --gguf "$WORK/work/llama-${FILE:-Q4_0}.gguf" --llama "$WORK/llama" \
    --work "$WORK/work" --shares "${SHARES:-1,0.5,0.25}" --kernels "${KERNELS:-triton}" \
    --pool-kernels "${POOL_KERNELS:-triton}" --threads 16 -p "${PROMPT:-64}" -n "${TOKENS:-64}" \
    --reps "${REPS:-2}" --out "$out/gpu_peers.jsonl" ${3:+--commit $3} 2>&1 | tee -a "$out/gpu_peers_gguf.log"
  ;;
admit)
  out=${2:?OUT folder}
  name=$(python -c 'import sys; sys.path.insert(0, "benchmarks"); import bench_peers as b; print(b.store_name("int4"))')
  python benchmarks/ablations/bench_admit.py "$WORK/work/$name" --share "${SHARE:-0.5}" \
    --kernels "${POOL_KERNELS:-triton}" --programs "${PROGRAMS:-32}" --reps "${REPS:-2}" --out "$out/admit.jsonl" ${3:+--commit $3} \
    2>&1 | tee -a "$out/admit.log"
  ;;
esac
