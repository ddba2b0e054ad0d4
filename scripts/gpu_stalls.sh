#!/usr/bin/env bash
# Why the latency-bound decode kernels take the time they take: Nsight Compute's speed-of-light,
# occupancy, launch and warp-state (stall reason) sections of one launch of each, taken from the parity
# suite's timing tests (prebuilt by scripts/gpu_bins.sh; builds nothing): the separate launches of
# batches 2-8 and the persistent layer launches of batch 1 at the 80B's shapes and the 125B's (u3,
# o6). In a persistent launch a warp waiting at a grid barrier counts as a `barrier` stall (its
# block's __syncthreads) and the polling thread as `long_scoreboard`. Run on a GPU host from the
# repository root.
#
#   scripts/gpu_stalls.sh OUT_DIR BIN_DIR
#
# Writes OUT_DIR/KERNEL.ncu-rep (the report), OUT_DIR/KERNEL.txt (ncu's details page of the launch),
# for the persistent layer launches OUT_DIR/KERNEL.phases.md (their stall samples phase by phase,
# scripts/ncu_phases.py, from the SASS source page OUT_DIR/KERNEL.source.csv) and OUT_DIR/stalls.md
# (each kernel's duration, achieved occupancy, DRAM throughput and its three largest stall reasons). Exits 0 with
# "skipped: no ncu" where Nsight Compute is missing.
set -uo pipefail
out=${1:?usage: gpu_stalls.sh OUT_DIR BIN_DIR}
bin=${2:?usage: gpu_stalls.sh OUT_DIR BIN_DIR}
mkdir -p "$out"
ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
[ -n "$ncu" ] || { echo "skipped: no ncu" | tee "$out/stalls.md"; exit 0; }
if [ -d "${CUDA_HOME:-/usr/local/cuda}/lib64" ]; then
  export LD_LIBRARY_PATH="${CUDA_HOME:-/usr/local/cuda}/lib64:${LD_LIBRARY_PATH:-}"
fi
# (kernel, the timing test that launches it at decode shapes)
pairs=(
  "attn_paged_partial bench_attn::bench_attention_decode"
  "attn_paged_reduce bench_attn::bench_attention_decode"
  "gdn_decode_fused bench_gdn::bench_gdn_decode"
  "moe_route_decode_m1 bench_moe::bench_moe_route_decode"
  "moe_combine bench_moe::bench_moe_decode"
  "moe_combine_add_rms_norm bench_moe::bench_moe_decode"
  "add_rms_norm_bf16 bench_dense::bench_norms"
  "gemv_q8_m1 bench_dense::bench_dense_gemv"
  "moe_layer_m1_q4_s6_u2 bench_moe_layer::bench_moe_layer"
  "moe_layer_m1_q4_s6_u3 bench_moe_layer::bench_moe_layer"
  "gdn_layer_m1_p8_u2_o4 bench_gdn_layer::bench_gdn_layer"
  "gdn_layer_m1_p8_u3_o6 bench_gdn_layer::bench_gdn_layer"
  "attn_layer_m1_p8_u2_o4 bench_attn_layer::bench_attn_layer"
)
sections=(--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats
  --section MemoryWorkloadAnalysis --section SourceCounters)
# Cycles a warp spends stalled per issued instruction, by reason (what WarpStateStats sums).
reasons="barrier branch_resolving dispatch_stall drain imc_miss lg_throttle long_scoreboard math_pipe_throttle
  membar mio_throttle misc no_instruction not_selected selected short_scoreboard sleeping tex_throttle wait"
metrics=$(for r in $reasons; do printf 'smsp__average_warps_issue_stalled_%s_per_issue_active.ratio,' "$r"; done)
sections+=(--metrics "${metrics%,}")
echo "| kernel | test | duration | achieved occupancy | DRAM throughput | largest stalls |" >"$out/stalls.md"
echo "| --- | --- | --- | --- | --- | --- |" >>"$out/stalls.md"
for p in "${pairs[@]}"; do
  set -- $p
  k=$1 test=$2
  # The sixth launch of the kernel: past the warm-up's first ones, caches as the timing loop has them.
  "$ncu" --clock-control none -k "regex:^$k\$" -s 5 -c 1 "${sections[@]}" -o "$out/$k" -f \
    "$bin/parity" --ignored --exact "$test" --test-threads=1 >"$out/$k.log" 2>&1
  "$ncu" -i "$out/$k.ncu-rep" --page details >"$out/$k.txt" 2>&1
  # A persistent layer launch: its stall samples cut at its phase marks (scripts/ncu_phases.py).
  case $k in
    *_layer_m1_*)
      "$ncu" -i "$out/$k.ncu-rep" --page source --csv --print-source sass >"$out/$k.source.csv" 2>>"$out/$k.log" &&
        python3 "$(dirname "$0")/ncu_phases.py" "$out/$k.source.csv" >"$out/$k.phases.md" 2>>"$out/$k.log"
      ;;
  esac
  python3 - "$out/$k.txt" "$k" "$test" >>"$out/stalls.md" <<'PY'
import re, sys
text = open(sys.argv[1], errors="replace").read()
def metric(name):
    m = re.search(r"^\s*" + re.escape(name) + r"\s+(\S+)\s+([\d.,]+)", text, re.M)
    return f"{m.group(2)} {m.group(1)}" if m else "?"
stalls = re.findall(r"smsp__average_warps_issue_stalled_(\w+?)_per_issue_active\.ratio\s+\S+\s+([\d.]+)", text)
top = sorted(((float(v), n) for n, v in stalls), reverse=True)[:3]
print(f"| {sys.argv[2]} | {sys.argv[3]} | {metric('Duration')} | {metric('Achieved Occupancy')} | "
      f"{metric('DRAM Throughput')} | " + ", ".join(f"{n} {v:g}" for v, n in top) + " |")
PY
done
cat "$out/stalls.md"
