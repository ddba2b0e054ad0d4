#!/usr/bin/env bash
# Builds what scripts/gpu_check.sh runs on a GPU host and copies it, stripped, into BIN_DIR:
# `sanmai` (release, --features cuda) and the sanmai-cuda test binaries (parity, e2e, graphs, packed,
# qsa_ple, qsa_ple_e2e, mrope, vision, fp8, and nccl_link for scripts/gpu_multi.sh). Run from the repository root on the build machine (no GPU needed).
#
#   scripts/gpu_bins.sh BIN_DIR
set -euo pipefail
dir=${1:?usage: gpu_bins.sh BIN_DIR}
mkdir -p "$dir"
cargo build --release --features cuda
install -m 755 target/release/sanmai "$dir/sanmai"
cargo test -p sanmai-cuda --release --no-run --message-format=json 2>/dev/null |
  python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and "test" in m["target"]["kind"]:
        print(m["target"]["name"], m["executable"])
' | while read -r name exe; do
  case "$name" in
    parity | e2e | graphs | packed | qsa_ple | qsa_ple_e2e | mrope | vision | fp8 | nccl_link) install -m 755 "$exe" "$dir/$name" ;;
  esac
done
strip "$dir"/*
ls -l "$dir"
