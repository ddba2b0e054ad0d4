#!/usr/bin/env bash
# Runs the prebuilt, stripped CUDA test binaries on a GPU host and writes one report. Builds nothing.
#
#   scripts/gpu_check.sh OUT_DIR [BIN_DIR]
#   scripts/gpu_check.sh --report-only OUT_DIR    (re-renders OUT_DIR/report.md from the logs there)
#
# BIN_DIR (default: .device-bin) holds `parity`, `e2e` and `graphs`, the sanmai-cuda test binaries, built
# elsewhere with
#   cargo test -p sanmai-cuda --release --no-run
# (cargo prints their paths: target/release/deps/parity-<hash>, target/release/deps/e2e-<hash>,
# target/release/deps/graphs-<hash>), then stripped and copied as BIN_DIR/parity, BIN_DIR/e2e and
# BIN_DIR/graphs. The e2e and graphs binaries read the committed fixtures under tests/fixtures (graphs
# also configs/models), so run this from the repository root.
# Writes OUT_DIR/report.md (device, parity table, end-to-end results, CUDA graphs, timings),
# OUT_DIR/parity.log, OUT_DIR/e2e.log, OUT_DIR/graphs.log and OUT_DIR/bench.log. The graphs run includes
# its timing tests (decode step eager against graph replay on the fixtures and on a dummy-weight
# qwen3.5-35b-a3b with SANMAI_GRAPH_BENCH_LAYERS layers, default 4; SANMAI_GRAPH_BENCH=0 skips the
# timings). Exits non-zero when a parity, end-to-end or graph test fails (or when BIN_DIR/e2e or
# BIN_DIR/graphs is missing). The CUDA libraries are found through LD_LIBRARY_PATH, to which
# $CUDA_HOME/lib64 (default /usr/local/cuda) is added when it exists; headers through $CUDA_HOME/include.
# Optional: BIN_DIR/qsa_ple and BIN_DIR/qsa_ple_e2e (target/release/deps/qsa_ple-<hash>,
# qsa_ple_e2e-<hash>), the QSA and PLE parity and end-to-end tests, run when present into
# OUT_DIR/qsa_ple.log (their failure fails the check).
# Optional: BIN_DIR/sanmai (`cargo build --release --features cuda`, stripped): scripts/gpu_models.sh
# runs `sanmai bench` on the full-size configs and a `sanmai serve` smoke test into OUT_DIR/models.log.
# Optional: BIN_DIR/packed (target/release/deps/packed-<hash>), the packed-weight tests (grouped packed
# GEMV and packed linear parity, the quantized tiny fixture GPU against CPU), run when present into
# OUT_DIR/packed.log (its failure fails the check).
# Optional: BIN_DIR/fp8, BIN_DIR/mrope and BIN_DIR/vision (their test binaries), each into OUT_DIR/NAME.log
# (their `FP8` lines include the FP8 tensor-core GEMM against its CPU twin; a failure fails the check).
set -uo pipefail

report_only=0
if [ "${1:-}" = "--report-only" ]; then report_only=1; shift; fi
out=${1:?usage: gpu_check.sh [--report-only] OUT_DIR [BIN_DIR]}
bin_dir=${2:-.device-bin}
bin="$bin_dir/parity"
e2e_bin="$bin_dir/e2e"
graphs_bin="$bin_dir/graphs"
mkdir -p "$out"

# Every tagged line of a log, also when the test harness printed it after "test name ... ".
tagged() { grep -o "$1 .*" "$2" 2>/dev/null || true; }

render() {
  {
    echo "# CUDA parity and timing report"
    echo
    cat "$out/meta.md"
    echo "- parity $(grep -E '^test result:' "$out/parity.log" | head -1)"
    echo "- e2e $(grep -E '^test result:' "$out/e2e.log" 2>/dev/null | head -1)"
    echo "- graphs $(grep -E '^test result:' "$out/graphs.log" 2>/dev/null | head -1)"
    for b in fp8 mrope vision; do
      [ -f "$out/$b.log" ] && echo "- $b $(grep -E '^test result:' "$out/$b.log" | head -1)"
    done
    if tagged 'skipped:' "$out/parity.log" | grep -q .; then
      echo "- skipped:"
      tagged 'skipped:' "$out/parity.log" | sed 's/^/  - /'
    fi
    fails=("$out/parity.log" "$out/e2e.log" "$out/graphs.log" "$out/packed.log" "$out/fp8.log" "$out/mrope.log" "$out/vision.log")
    if grep -q 'panicked' "${fails[@]}" 2>/dev/null; then
      echo
      echo "## Failures"
      echo
      echo '```'
      grep -h -A3 'panicked' "${fails[@]}" 2>/dev/null | head -60
      echo '```'
    fi
    echo
    echo "## Parity against the CPU oracle"
    echo
    echo "max_rel = max|gpu − cpu| / max|cpu|; rms_rel = ‖gpu − cpu‖ / ‖cpu‖; elem_ratio = largest"
    echo "|gpu − cpu| / (2⁻⁸·|cpu| + 1e-4·max|cpu|) (≤ 1: every element within one bf16 rounding)."
    echo
    echo "| op | shape | max_abs | max_rel | rms_rel | elem_ratio | tolerance |"
    echo "| --- | --- | --- | --- | --- | --- | --- |"
    tagged PARITY "$out/parity.log" | while read -r _ rest; do
      declare -A f=()
      for kv in $rest; do f[${kv%%=*}]=${kv#*=}; done
      if [ -n "${f[max_rel]:-}" ]; then
        echo "| ${f[op]:-} | ${f[shape]:-} | ${f[max_abs]:-} | ${f[max_rel]} | ${f[rms_rel]:-} | ${f[elem_ratio]:-} | ${f[tol]:-} |"
      else
        extra=$(echo "$rest" | tr ' ' '\n' | grep -v '^op=\|^shape=' | tr '\n' ' ')
        echo "| ${f[op]:-} | ${f[shape]:-} | | | | | $extra|"
      fi
      unset f
    done
    echo
    echo "## End to end (CudaBackend on the tiny fixtures)"
    echo
    echo "Against transformers' reference log-probs and greedy tokens, and against the CPU backend on a"
    echo "mixed multi-sequence step (see crates/cuda/tests/e2e.rs for the tolerances)."
    echo
    echo '```'
    tagged E2E "$out/e2e.log"
    tagged 'skipped:' "$out/e2e.log"
    echo '```'
    echo
    echo "## CUDA graphs for decode steps"
    echo
    echo "A backend recording decode steps (warm-up, capture, replays) against an eager one, and an"
    echo "eager control; the second round replays the first round's graphs at other context lengths and"
    echo "block tables; batch 3 is not recorded (see crates/cuda/tests/graphs/main.rs). Decode step"
    echo "times are forward + lm_head + logits to the host, eager against graph replay."
    echo
    echo '```'
    tagged GRAPH "$out/graphs.log"
    tagged GRAPH_BENCH "$out/graphs.log"
    tagged 'skipped:' "$out/graphs.log"
    grep -h 'CUDA graph capture' "$out/graphs.log" 2>/dev/null | head -5
    echo '```'
    echo
    echo "## NVRTC compile times (cold)"
    echo
    echo '```'
    tagged COMPILE "$out/parity.log"
    echo '```'
    echo
    echo "## QSA and PLE"
    echo
    echo '```'
    tagged PARITY "$out/qsa_ple.log"
    tagged E2E "$out/qsa_ple.log" | grep -v '^E2E near-tie'
    echo "near-tie rows: $(tagged 'E2E near-tie' "$out/qsa_ple.log" | wc -l)"
    grep -E '^test result:' "$out/qsa_ple.log" 2>/dev/null
    echo '```'
    echo
    echo "## Packed weights (INT4 / INT8 / INT6 gapless)"
    echo
    echo '```'
    tagged PACKED "$out/packed.log"
    tagged 'skipped:' "$out/packed.log"
    grep -E '^test result:' "$out/packed.log" 2>/dev/null
    echo '```'
    echo
    echo "## FP8 weights (GEMV, grouped GEMV, dequantised tiles, tensor-core GEMM, fixtures)"
    echo
    echo '```'
    tagged FP8 "$out/fp8.log"
    tagged 'skipped:' "$out/fp8.log"
    grep -E '^test result:' "$out/fp8.log" 2>/dev/null
    echo '```'
    echo
    echo "## Models (scripts/gpu_models.sh: sanmai bench with the roofline, sanmai serve)"
    echo
    echo '```'
    cat "$out/models.log" 2>/dev/null
    echo '```'
    echo
    echo "## Timing"
    echo
    echo '```'
    tagged BENCH "$out/bench.log"
    echo '```'
  } >"$out/report.md"
  cat "$out/report.md"
}

if [ "$report_only" = 1 ]; then
  render
  exit 0
fi
[ -x "$bin" ] || { echo "no executable $bin" >&2; exit 2; }

cuda_home=${CUDA_HOME:-/usr/local/cuda}
if [ -d "$cuda_home/lib64" ]; then
  export LD_LIBRARY_PATH="$cuda_home/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
[ -d "$cuda_home/include" ] && export CUDA_HOME="$cuda_home"
# A fresh kernel cache: the parity run compiles every kernel, the timing run loads them from the cache.
export SANMAI_CACHE_DIR="${SANMAI_CACHE_DIR:-$(mktemp -d)}"

t0=$(date +%s)
"$bin" --test-threads=1 --nocapture >"$out/parity.log" 2>&1
parity_rc=$?
t1=$(date +%s)
"$bin" --ignored bench --test-threads=1 --nocapture >"$out/bench.log" 2>&1
bench_rc=$?
t2=$(date +%s)
if [ -x "$e2e_bin" ]; then
  "$e2e_bin" --test-threads=1 --nocapture >"$out/e2e.log" 2>&1
  e2e_rc=$?
else
  echo "no executable $e2e_bin" >"$out/e2e.log"
  e2e_rc=2
fi
t3=$(date +%s)
if [ -x "$graphs_bin" ]; then
  if [ "${SANMAI_GRAPH_BENCH:-1}" = 0 ]; then
    "$graphs_bin" --test-threads=1 --nocapture >"$out/graphs.log" 2>&1
  else
    "$graphs_bin" --include-ignored --test-threads=1 --nocapture >"$out/graphs.log" 2>&1
  fi
  graphs_rc=$?
else
  echo "no executable $graphs_bin" >"$out/graphs.log"
  graphs_rc=2
fi
t4=$(date +%s)
qsa_rc=0
: >"$out/qsa_ple.log"
for b in qsa_ple qsa_ple_e2e; do
  if [ -x "$bin_dir/$b" ]; then
    "$bin_dir/$b" --test-threads=1 --nocapture >>"$out/qsa_ple.log" 2>&1 || qsa_rc=$?
  fi
done
packed_rc=0
: >"$out/packed.log"
if [ -x "$bin_dir/packed" ]; then
  "$bin_dir/packed" --test-threads=1 --nocapture >"$out/packed.log" 2>&1 || packed_rc=$?
fi
extra_rc=0
for b in fp8 mrope vision; do
  if [ -x "$bin_dir/$b" ]; then
    "$bin_dir/$b" --test-threads=1 --nocapture >"$out/$b.log" 2>&1 || extra_rc=$?
  fi
done

{
  echo "- date: $(date -u +%Y-%m-%dT%H:%MZ)"
  echo "- commit: ${GIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
  if command -v nvidia-smi >/dev/null 2>&1; then
    echo "- device: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | head -1)"
  fi
  echo "- parity run: exit $parity_rc in $((t1 - t0)) s (cold kernel cache, every kernel compiled);" \
    "timing run: exit $bench_rc in $((t2 - t1)) s (warm cache); e2e run: exit $e2e_rc in $((t3 - t2)) s;" \
    "graphs run: exit $graphs_rc in $((t4 - t3)) s"
} >"$out/meta.md"
# The model benchmarks and the serve smoke test, with BIN_DIR/sanmai when present.
models_rc=0
if [ -x "$bin_dir/sanmai" ]; then
  bash "$(dirname "$0")/gpu_models.sh" "$out" "$bin_dir" || models_rc=$?
fi
render
[ "$parity_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ] && [ "$e2e_rc" -eq 0 ] && [ "$graphs_rc" -eq 0 ] &&
  [ "$qsa_rc" -eq 0 ] && [ "$packed_rc" -eq 0 ] && [ "$extra_rc" -eq 0 ] && [ "$models_rc" -eq 0 ]
