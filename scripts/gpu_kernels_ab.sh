#!/usr/bin/env bash
# Kernel variants against each other with one `sanmai` build (built elsewhere with `cargo build
# --release --features cuda`) on one GPU host: each variant is a folder holding every file of
# `kernels/` (SANMAI_KERNEL_SOURCES), e.g. made from a commit with
#   mkdir -p V && git archive REV kernels | tar -x -C V --strip-components=1
# The first folder is the reference. For each variant, in this order:
#   1. the greedy 80B on dummy weights (32 tokens with log-probs): identical to the reference's or not;
#   2. `sanmai bench --batch 1 --kernel-times` (µs a launch of every kernel of one replayed step);
#   3. ROUNDS runs of `sanmai bench --batch 1,8`, the variants alternated within each round.
# Writes OUT_DIR/summary.txt (the bench lines, their roofline shares, the layer launches' rows and
# the step totals of the kernel tables, the greedy comparisons), OUT_DIR/bench.log (every run's
# output) and OUT_DIR/gen_*.json, and prints the summary. Builds nothing.
#
#   scripts/gpu_kernels_ab.sh OUT_DIR SANMAI ROUNDS KERNELS_DIR [KERNELS_DIR ...]
#
# The config is $SANMAI_BENCH_CONFIG (default the Qwen3-Next-80B-A3B config with its quantization mix).
# With $SANMAI_PARITY (the sanmai-cuda `parity` test binary of the same build), each variant also runs
# the MoE, GDN and attention layer launches' parity tests (or the test filters in
# $SANMAI_PARITY_FILTERS, e.g. "moe:: moe_fused:: gdn_layer::") and their phase timings
# (bench_moe_layer, bench_gdn_layer, bench_attn_layer) after its greedy output. Each command stops after
# $SANMAI_AB_TIMEOUT seconds (default 300), so one hung variant does not take the run's time.
set -uo pipefail
usage="usage: gpu_kernels_ab.sh OUT_DIR SANMAI ROUNDS KERNELS_DIR [KERNELS_DIR ...]"
out=${1:?$usage}
bin=${2:?$usage}
rounds=${3:?$usage}
shift 3
[ $# -ge 1 ] || { echo "$usage" >&2; exit 2; }
for k in "$@"; do
  [ -f "$k/layer.cuh" ] || { echo "gpu_kernels_ab.sh: $k is not a copy of kernels/ (no layer.cuh)" >&2; exit 2; }
done
config=${SANMAI_BENCH_CONFIG:-configs/models/qwen3-next-80b-a3b.json}
prompt=785,3974,13876,38835,34208,916,279,15678,5562,323,1221
mkdir -p "$out"
sum="$out/summary.txt"
log="$out/bench.log"
: >"$sum"
: >"$log"
rc=0
name() { basename "$1"; }
limit=${SANMAI_AB_TIMEOUT:-300}
with() { # KERNELS_DIR, command...: the command on that variant's kernels, under the time limit
  local k=$1
  shift
  SANMAI_KERNEL_SOURCES=$(realpath "$k") timeout "$limit" "$@"
}
run() { with "$1" "$bin" "${@:2}"; } # KERNELS_DIR, sanmai arguments...
parity() { # KERNELS_DIR: the parity tests (SANMAI_PARITY_FILTERS) and the layer launches' phase timings
  local k=$1 p
  for p in ${SANMAI_PARITY_FILTERS:-moe_layer:: gdn_layer:: attn_layer::}; do
    with "$k" "$SANMAI_PARITY" "$p" >"$out/last.txt" 2>&1 || rc=1
    grep -E '^test result|FAILED|panicked' "$out/last.txt" | sed "s#^#parity $(name "$k") $p: #" >>"$sum"
  done
  with "$k" "$SANMAI_PARITY" --ignored --nocapture --exact \
    bench_moe_layer::bench_moe_layer bench_gdn_layer::bench_gdn_layer bench_attn_layer::bench_attn_layer >"$out/last.txt" 2>&1 || rc=1
  grep -E '^BENCH' "$out/last.txt" | sed "s#^#    $(name "$k"): #" >>"$sum"
}
bench() { # KERNELS_DIR, bench arguments...
  local k=$1
  shift
  echo "=== $(name "$k") $*" >>"$log"
  run "$k" bench --device cuda --load-format dummy --config "$config" --prompt-len 512 --gen-len 32 "$@" \
    >"$out/last.txt" 2>"$out/last.err" || { rc=1; tail -5 "$out/last.err" >>"$sum"; }
  cat "$out/last.txt" >>"$log"
  grep -E '^batch' "$out/last.txt" | sed "s#^#$(name "$k") | #" >>"$sum"
  grep -E '(moe|gdn|attn)_layer_m1|us in all|achieved' "$out/last.txt" | sed "s#^#    $(name "$k"): #" >>"$sum"
}
ref=$1
for k in "$@"; do
  g="$out/gen_$(name "$k").json"
  # One request: a K/V budget and state for a few sequences of 4,096 tokens (the 125B's default
  # 262,144-token context does not fit beside its weights on an 80 GB card; the tokens do not depend on it).
  run "$k" generate --device cuda --load-format dummy --config "$config" --prompt-ids "$prompt" \
    --max-num-seqs 8 --max-model-len 4096 --max-tokens 32 --logprobs 1 --json >"$g" 2>"$out/last.err" || { rc=1; tail -5 "$out/last.err" >>"$sum"; }
  if cmp -s "$g" "$out/gen_$(name "$ref").json"; then
    echo "greedy $(name "$k"): identical to $(name "$ref")" >>"$sum"
  else
    echo "greedy $(name "$k"): differs from $(name "$ref")" >>"$sum"
  fi
  [ -z "${SANMAI_PARITY:-}" ] || parity "$k"
done
for k in "$@"; do bench "$k" --batch 1 --kernel-times; done
for _ in $(seq "$rounds"); do
  for k in "$@"; do bench "$k" --batch 1,8; done
done
rm -f "$out/last.txt" "$out/last.err"
cat "$sum"
exit $rc
