//! Where a PLE model's table rows come from: the table file mmapped through sanmai-ple (whose hash and
//! gather these are), or zero rows for a model run without a table (dummy weights benchmarked without
//! NVMe).

use std::path::Path;
use std::sync::Arc;

use half::bf16;
use sanmai_config::PleConfig;
use sanmai_ple::{PleError, PleTable};

/// The source of a PLE model's rows.
#[derive(Clone)]
pub enum PleSource {
    /// A validated table file.
    Table(Arc<PleTable>),
    /// Every row is zero (no table: dummy weights without `--ple-table`).
    Zeros,
}

impl PleSource {
    /// Opens the table in `dir` for the config's `ple` block. With real weights (`dummy_weights`
    /// false) the table must be the config's exactly: sidecar and file checked against the config,
    /// same sizes (no `rows_scale`). With dummy weights the sidecar's own sizes are used (a table made
    /// with `--rows-scale`), but its orders, heads, row width and seed must still be the config's.
    pub fn open(dir: &Path, cfg: &PleConfig, dummy_weights: bool) -> Result<Self, PleError> {
        let table = if dummy_weights {
            let t = PleTable::open_sidecar(dir, cfg.eos_token_id)?;
            sanmai_ple::check_shape(dir, t.sidecar(), cfg)?;
            t
        } else {
            let t = PleTable::open(dir, cfg)?;
            if t.sidecar().sizes != cfg.table_sizes {
                return Err(PleError::Table {
                    dir: dir.to_path_buf(),
                    what: format!(
                        "table sizes {:?} (rows_scale {}) differ from the model config's {:?}; \
                         a scaled table serves only dummy weights",
                        t.sidecar().sizes,
                        t.sidecar().rows_scale,
                        cfg.table_sizes
                    ),
                });
            }
            t
        };
        Ok(PleSource::Table(Arc::new(table)))
    }

    /// Writes the rows of `positions` of `tokens` (the sequence from position 0) into `out`
    /// (`width` f32 values per position, the bf16 rows widened exactly).
    pub fn gather(
        &self,
        tokens: &[u32],
        positions: std::ops::Range<usize>,
        width: usize,
        out: &mut [f32],
    ) -> Result<(), PleError> {
        if out.len() != positions.len() * width {
            return Err(PleError::Input(format!(
                "PLE gather: {} outputs for {} positions of width {width}",
                out.len(),
                positions.len()
            )));
        }
        match self {
            PleSource::Zeros => {
                if positions.end > tokens.len() {
                    return Err(PleError::Input(format!(
                        "positions {positions:?} outside a sequence of {} tokens",
                        tokens.len()
                    )));
                }
                out.fill(0.0);
                Ok(())
            }
            PleSource::Table(t) => {
                if t.token_dim() != width {
                    return Err(PleError::Input(format!(
                        "table rows are {} wide, the model expects {width}",
                        t.token_dim()
                    )));
                }
                let mut buf = vec![bf16::ZERO; out.len()];
                t.gather(tokens, positions, &mut buf)?;
                out.iter_mut().zip(&buf).for_each(|(o, b)| *o = b.to_f32());
                Ok(())
            }
        }
    }
}
