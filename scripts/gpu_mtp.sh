#!/usr/bin/env bash
# MTP speculative decoding on a GPU host with a prebuilt `sanmai` binary (BIN_DIR/sanmai, built with
# `cargo build --release --features cuda`). Builds nothing.
#
#   scripts/gpu_mtp.sh OUT_DIR [BIN_DIR]
#
# Writes OUT_DIR/mtp.log: for each config in $SANMAI_MTP_CONFIGS (default: the Qwen3-Next-80B-A3B and
# qwen4_exp-125B-A6B shapes with their quantization mix, dummy weights; a PLE model's table reads as
# zeros) and each K in $SANMAI_MTP_K (default 1 2), `sanmai bench --speculative-config` at the batch
# sizes $SANMAI_MTP_BATCH (default 1,4): the plain decode, the verify and draft step times, the tokens/s
# at acceptance 0.5/0.7/0.9, and the engine's decode with drafts forced to the plain greedy tokens.
set -uo pipefail
out=${1:?usage: gpu_mtp.sh OUT_DIR [BIN_DIR]}
bin_dir=${2:-.device-bin}
sanmai="$bin_dir/sanmai"
log="$out/mtp.log"
mkdir -p "$out"
: >"$log"
[ -x "$sanmai" ] || { echo "skipped: no executable $sanmai" | tee -a "$log"; exit 0; }
configs=${SANMAI_MTP_CONFIGS:-configs/models/qwen3-next-80b-a3b.json configs/models/qwen4-exp-125b-a6b.json}
rc=0
for c in $configs; do
  for k in ${SANMAI_MTP_K:-1 2}; do
    cmd=("$sanmai" bench --device cuda --load-format dummy --config "$c" --batch "${SANMAI_MTP_BATCH:-1,4}"
      --prompt-len 512 --gen-len "${SANMAI_MTP_GEN:-64}"
      --speculative-config "{\"method\": \"mtp\", \"num_speculative_tokens\": $k}")
    echo "\$ ${cmd[*]}" >>"$log"
    t0=$(date +%s)
    "${cmd[@]}" >>"$log" 2>"$out/last.err" || { rc=1; tail -20 "$out/last.err" >>"$log"; }
    grep -h 'model loaded' "$out/last.err" | sed 's/\x1b\[[0-9;]*m//g' >>"$log"
    echo "($(($(date +%s) - t0)) s)" >>"$log"
  done
done
exit $rc
