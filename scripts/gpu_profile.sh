#!/usr/bin/env bash
# Per-kernel decode profile of a full-size config on a GPU host with Nsight Compute, using a prebuilt
# `sanmai` (built elsewhere with `cargo build --release --features cuda`). Builds nothing.
#
#   scripts/gpu_profile.sh OUT_DIR BIN_DIR [CONFIG] [BATCHES]
#
# For each batch size (default 1,8) runs `sanmai bench --load-format dummy` eagerly under
# `ncu --metrics gpu__time_duration.sum` (clocks left alone) and writes OUT_DIR/profile-bB.csv and
# OUT_DIR/profile.txt: each decode pass's kernels by time (scripts/gpu_profile.py).
set -uo pipefail
out=${1:?usage: gpu_profile.sh OUT_DIR BIN_DIR [CONFIG] [BATCHES]}
bin_dir=${2:?usage: gpu_profile.sh OUT_DIR BIN_DIR [CONFIG] [BATCHES]}
config=${3:-configs/models/qwen3-next-80b-a3b.json}
batches=${4:-1,8}
here=$(dirname "$0")
mkdir -p "$out"
ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
[ -n "$ncu" ] || { echo "skipped: no ncu" | tee "$out/profile.txt"; exit 0; }
for b in ${batches//,/ }; do
  csv="$out/profile-b$b.csv"
  SANMAI_CUDA_GRAPHS=0 "$ncu" --clock-control none --metrics gpu__time_duration.sum --csv \
    --print-units base --log-file "$csv" \
    "$bin_dir/sanmai" bench --device cuda --load-format dummy --config "$config" --batch "$b" \
    --prompt-len 64 --gen-len 2 >"$out/profile-b$b.log" 2>&1
  { echo "== $config batch $b"; python3 "$here/gpu_profile.py" "$csv" 30; } >>"$out/profile.txt" 2>&1
done
cat "$out/profile.txt"
