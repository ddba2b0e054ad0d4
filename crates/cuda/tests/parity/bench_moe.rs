//! Timing (ignored by default; `--ignored` runs it) of the MoE decode path: router top-k, sort, grouped expert GEMVs, combine at the shapes of a
//! full-size decode step. Prints `BENCH` lines.
