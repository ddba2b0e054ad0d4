//! Timing (ignored by default; `--ignored` runs it) of the dense decode GEMVs (bf16 and packed), RMSNorm at the shapes of a
//! full-size decode step. Prints `BENCH` lines.
