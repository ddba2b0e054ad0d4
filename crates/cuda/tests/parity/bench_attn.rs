//! Timing (ignored by default; `--ignored` runs it) of decode attention and the GDN recurrent step at the shapes of a
//! full-size decode step. Prints `BENCH` lines.
