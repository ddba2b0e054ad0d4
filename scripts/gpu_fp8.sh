#!/usr/bin/env bash
# The FP8 checks on one GPU host with prebuilt binaries (`scripts/gpu_bins.sh BIN_DIR` on the build
# machine). Builds nothing.
#
#   scripts/gpu_fp8.sh OUT_DIR [BIN_DIR]
#
# 1. The `fp8`, `packed` and `e2e` test binaries (FP8 GEMVs and GEMMs against their CPU twins, the FP8
#    tensor-core grouped GEMM among them; the packed formats; the fixtures end to end) into
#    OUT_DIR/tests/NAME.log.
# 2. The bf16 tiles (the default) against the FP8 tensor cores in one build (`SANMAI_FP8_TENSOR_CORES=1`:
#    the cuBLASLt dense GEMM and the expert MMA GEMM): scripts/gpu_ab.sh on dummy weights of
#    $SANMAI_FP8_CONFIG (default the Qwen3-Next-80B-A3B FP8 release's config; needs about 85 GB of GPU
#    memory), batch 1, 4, 8 and 10, prompts of 512 and 4,096 tokens, $SANMAI_FP8_ROUNDS (default 2)
#    alternated rounds: OUT_DIR/ab/ab.md.
# 3. The INT4/INT8 mix of the same shape ($SANMAI_FP8_INT_CONFIG, default the 80B's), back to back,
#    with the decode step by kernel (--kernel-times): OUT_DIR/intmix.log.
# 4. A full-size FP8 checkpoint on disk: scripts/fp8_checkpoint.py writes random weights in the FP8
#    releases' layout for $SANMAI_FP8_CHECKPOINT_CONFIG (default the Qwen3.5-35B-A3B config, about 35 GB:
#    the GPU host's disk holds it, not the 80B's) into a temporary folder (needs python3 with torch and
#    transformers), written while steps 1-3 run; then `sanmai bench --model` on it on the bf16 tiles and
#    on the tensor cores: the load time beside the time to read the files again from the page cache, the load's
#    progress lines, prefill and decode (OUT_DIR/checkpoint.log, OUT_DIR/checkpoint_tiles.log,
#    OUT_DIR/checkpoint_tc.log). The folder is removed at the end.
# OUT_DIR/times.txt gets each step's exit status and seconds. Exits non-zero when a step fails.
set -uo pipefail
out=${1:?usage: gpu_fp8.sh OUT_DIR [BIN_DIR]}
bin_dir=${2:-.device-bin}
sanmai="$bin_dir/sanmai"
[ -x "$sanmai" ] || { echo "no executable $sanmai" >&2; exit 1; }
mkdir -p "$out/tests"
rc=0
t0=$(date +%s)
step() { # step NAME STATUS: one line of times.txt
  echo "[$(($(date +%s) - t0)) s] $1 rc=$2" | tee -a "$out/times.txt"
  [ "$2" = 0 ] || rc=1
}
ckpt=$(mktemp -d)
tc=$(mktemp)
trap 'rm -rf "$ckpt" "$tc"' EXIT
printf '#!/bin/sh\nSANMAI_FP8_TENSOR_CORES=1 exec "%s" "$@"\n' "$(realpath "$sanmai")" >"$tc"
chmod +x "$tc"

python3 "$(dirname "$0")/fp8_checkpoint.py" \
  "${SANMAI_FP8_CHECKPOINT_CONFIG:-configs/models/qwen3.5-35b-a3b.json}" "$ckpt/model" \
  >"$out/checkpoint.log" 2>&1 &
writer=$!

for b in fp8 packed e2e; do
  if [ -x "$bin_dir/$b" ]; then
    "$bin_dir/$b" --test-threads=1 --nocapture >"$out/tests/$b.log" 2>&1
    status=$?
    step "$b: $(grep -h '^test result' "$out/tests/$b.log" | head -1)" $status
  fi
done

SANMAI_BENCH_CONFIGS=${SANMAI_FP8_CONFIG:-configs/models/qwen3-next-80b-a3b-fp8.json} SANMAI_BENCH_BATCH=1,4,8,10 \
  SANMAI_AB_PROMPT_LEN=512,4096 bash "$(dirname "$0")/gpu_ab.sh" "$out/ab" "$sanmai" "$tc" "${SANMAI_FP8_ROUNDS:-2}" >/dev/null
step "bf16 tiles (A) / tensor cores (B)" $?

"$sanmai" bench --device cuda --load-format dummy --config "${SANMAI_FP8_INT_CONFIG:-configs/models/qwen3-next-80b-a3b.json}" \
  --batch 1,4,8,10 --prompt-len 512,4096 --gen-len 32 --kernel-times >"$out/intmix.log" 2>&1
step "INT4/INT8 mix" $?

wait "$writer"
step "checkpoint written" $?
du -sh "$ckpt/model" >>"$out/checkpoint.log"
for arm in tiles tc; do
  bin=$sanmai
  [ "$arm" = tc ] && bin=$tc
  RUST_LOG=info NO_COLOR=1 "$bin" bench --device cuda --model "$ckpt/model" --batch 1,4,8,10 \
    --prompt-len 512,4096 --gen-len 32 >"$out/checkpoint_$arm.log" 2>&1
  step "checkpoint, $arm" $?
done
exit $rc
