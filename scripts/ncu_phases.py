#!/usr/bin/env python3
"""Where a persistent layer launch's warps stall, phase by phase.

Reads the source page of one launch that Nsight Compute profiled with its SourceCounters section,
exported as SASS (`ncu -i REPORT --page source --csv --print-source sass > FILE.csv`), and cuts the
instructions at each read of the global timer (the phase marks of `ml_mark` and the barriers'
arrival times in kernels/layer.cuh), in address order. For each piece it prints the instructions it
holds, those executed, the warp stall samples and the largest stall reasons, so that a phase whose
warps wait for data (`long_sb`) tells apart from one that waits for its next instruction (`no_inst`)
or at a barrier. Piece 0 is the prologue; in a launch whose phases are traced, piece p + 1 starts at
the p-th timer read in the code, which is not always the p-th phase mark in time.

    scripts/ncu_phases.py FILE.csv
"""
import csv
import sys


def main(path):
    with open(path, newline="", errors="replace") as f:
        rows = list(csv.reader(f))
    header_at = next((i for i, r in enumerate(rows) if "Source" in r and "Address" in r), None)
    if header_at is None:
        sys.exit(f"{path}: no source page header (Address, Source, ...) found")
    hdr = rows[header_at]
    col = {h: i for i, h in enumerate(hdr)}
    samples_col = col.get("Warp Stall Sampling (All Samples)")
    if samples_col is None:
        sys.exit(f"{path}: no 'Warp Stall Sampling (All Samples)' column (profile with --section SourceCounters)")
    stalls = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]

    def num(r, c):
        try:
            return int(float(r[c] or 0))
        except (ValueError, IndexError):
            return 0

    pieces = []
    for r in rows[header_at + 1:]:
        if len(r) < len(hdr):
            continue
        if "GLOBALTIMER" in r[col["Source"]] or not pieces:
            pieces.append({"lines": 0, "executed": 0, "samples": 0, **{s: 0 for s in stalls}})
        p = pieces[-1]
        p["lines"] += 1
        p["executed"] += num(r, col.get("Instructions Executed", samples_col))
        p["samples"] += num(r, samples_col)
        for s in stalls:
            p[s] += num(r, col[s])
    total = sum(p["samples"] for p in pieces) or 1
    print("| piece | instructions | executed (warp) | stall samples | share | largest stalls |")
    print("| --- | --- | --- | --- | --- | --- |")
    for i, p in enumerate(pieces):
        top = sorted(((p[s], s[len("stall_"):]) for s in stalls), reverse=True)[:4]
        top_s = ", ".join(f"{n} {v}" for v, n in top if v > 0)
        print(f"| {i} | {p['lines']} | {p['executed']} | {p['samples']} | {100 * p['samples'] / total:.1f}% | {top_s} |")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
