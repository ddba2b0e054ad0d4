#!/usr/bin/env python3
"""Summarises an Nsight Compute CSV (`ncu --csv --metrics gpu__time_duration.sum --print-units base`)
of a `sanmai bench` run: the kernels of each forward pass (a pass starts at an embedding kernel),
prefill passes (any GEMM or dequantise kernel) apart from decode passes, and per decode pass the time of
each kernel name, its launches and its share, largest first.

    gpu_profile.py NCU_CSV [TOP]
"""
import csv
import sys
from collections import defaultdict


def rows(path):
    with open(path, newline="") as f:
        lines = [l for l in f if l.startswith('"')]
    for r in csv.DictReader(lines):
        if r.get("Metric Name") == "gpu__time_duration.sum":
            name = r["Kernel Name"].split("(")[0].strip()
            yield name, float(r["Metric Value"].replace(",", ""))


def main():
    path = sys.argv[1]
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 30
    passes, cur = [], None
    for name, ns in rows(path):
        if name.startswith("embed"):
            cur = []
            passes.append(cur)
        if cur is not None:
            cur.append((name, ns))
    prefill_words = ("gemm", "dequant", "prefill", "cutlass", "sm90", "xmma", "Kernel")
    decode = [p for p in passes if not any(w in n for n, _ in p for w in prefill_words)]
    prefill = [p for p in passes if p not in decode]
    print(f"{len(passes)} forward passes: {len(prefill)} prefill, {len(decode)} decode")
    for p in prefill:
        print(f"  prefill pass: {len(p)} kernels, {sum(t for _, t in p) / 1e3:.1f} us")
    if not decode:
        return
    # The last decode pass may record routing (host round trips between kernels): use the others.
    use = decode[:-1] if len(decode) > 1 else decode
    per = defaultdict(lambda: [0.0, 0])
    for p in use:
        for n, t in p:
            per[n][0] += t / len(use)
            per[n][1] += 1
    total = sum(v[0] for v in per.values())
    launches = sum(v[1] for v in per.values()) / len(use)
    print(f"decode pass ({len(use)} averaged): {launches:.0f} kernels, {total / 1e3:.1f} us of kernel time")
    print(f"{'kernel':40} {'us/pass':>9} {'launches':>9} {'us each':>9} {'share':>7}")
    for n, (t, c) in sorted(per.items(), key=lambda kv: -kv[1][0])[:top]:
        c /= len(use)
        print(f"{n:40} {t / 1e3:9.1f} {c:9.0f} {t / 1e3 / c:9.2f} {100 * t / total:6.1f}%")


if __name__ == "__main__":
    main()
