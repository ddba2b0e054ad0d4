//! The table reader: the file mmapped read-only with readahead off (`MADV_RANDOM`), and the gather
//! of `num_tables` rows per token into a caller's buffer, the rows found by [`PleHasher`].

use crate::config::PleConfig;
use crate::error::PleError;
use crate::hash::PleHasher;
use crate::table::{check_table, Sidecar};
use half::bf16;
use memmap2::{Advice, Mmap};
use std::ops::Range;
use std::path::{Path, PathBuf};

/// An open, validated PLE table.
pub struct PleTable {
    path: PathBuf,
    mmap: Mmap,
    sidecar: Sidecar,
    hasher: PleHasher,
    row_dim: usize,
    /// First row of each sub-table, (order, head) order.
    base_rows: Vec<u64>,
    sizes: Vec<u64>,
}

impl PleTable {
    /// Validates `dir` against `cfg` (see [`check_table`]) and maps the table file.
    pub fn open(dir: &Path, cfg: &PleConfig) -> Result<Self, PleError> {
        let sidecar = check_table(dir, cfg)?;
        let path = dir.join(&sidecar.file);
        let file = std::fs::File::open(&path).map_err(|e| PleError::io(&path, e))?;
        // SAFETY: the table is read-only for the server's lifetime; nothing here writes to it.
        let mmap = unsafe { Mmap::map(&file) }.map_err(|e| PleError::io(&path, e))?;
        mmap.advise(Advice::Random)
            .map_err(|e| PleError::io(&path, e))?;
        let sizes: Vec<u64> = sidecar.sizes.iter().flatten().copied().collect();
        let hasher = PleHasher::with_sizes(cfg, &sizes)?;
        let mut base_rows = Vec::with_capacity(sizes.len());
        let mut acc = 0u64;
        for &p in &sizes {
            base_rows.push(acc);
            acc += p;
        }
        Ok(PleTable {
            path,
            mmap,
            sidecar,
            hasher,
            row_dim: cfg.row_dim,
            base_rows,
            sizes,
        })
    }

    /// The table file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn sidecar(&self) -> &Sidecar {
        &self.sidecar
    }

    /// The hash with this table's sizes.
    pub fn hasher(&self) -> &PleHasher {
        &self.hasher
    }

    /// Rows per token.
    pub fn num_tables(&self) -> usize {
        self.sizes.len()
    }

    pub fn row_dim(&self) -> usize {
        self.row_dim
    }

    /// bf16 values per token (`num_tables · row_dim`).
    pub fn token_dim(&self) -> usize {
        self.num_tables() * self.row_dim
    }

    /// The mapped bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.mmap
    }

    /// Byte offset in the file of row `row` of sub-table `table`.
    pub fn row_offset(&self, table: usize, row: u64) -> u64 {
        (self.base_rows[table] + row) * self.row_dim as u64 * 2
    }

    /// Copies the rows named by `indices` (`num_tables` per token, as [`PleHasher::fill_indices`]
    /// writes them) into `out` (`token_dim` bf16 per token).
    pub fn gather_indices(&self, indices: &[u64], out: &mut [bf16]) -> Result<(), PleError> {
        let nt = self.num_tables();
        if !indices.len().is_multiple_of(nt) || out.len() != indices.len() * self.row_dim {
            return Err(PleError::Input(format!(
                "{} indices and an output of {} values for {} rows of {}",
                indices.len(),
                out.len(),
                nt,
                self.row_dim
            )));
        }
        let rb = self.row_dim * 2;
        for (i, (&row, dst)) in indices
            .iter()
            .zip(out.chunks_exact_mut(self.row_dim))
            .enumerate()
        {
            let t = i % nt;
            if row >= self.sizes[t] {
                return Err(PleError::Input(format!(
                    "row {row} outside sub-table {t} of {} rows",
                    self.sizes[t]
                )));
            }
            let off = self.row_offset(t, row) as usize;
            let src = &self.mmap[off..off + rb];
            for (d, s) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *d = bf16::from_le_bytes([s[0], s[1]]);
            }
        }
        Ok(())
    }

    /// Hashes `positions` of `tokens` (the sequence from its start) and copies each position's rows
    /// into `out` (`token_dim` bf16 per position), concatenated in (order, head) order.
    pub fn gather<T: Copy + Into<i64>>(
        &self,
        tokens: &[T],
        positions: Range<usize>,
        out: &mut [bf16],
    ) -> Result<(), PleError> {
        let mut idx = vec![0u64; positions.len() * self.num_tables()];
        self.hasher.fill_indices(tokens, positions, &mut idx)?;
        self.gather_indices(&idx, out)
    }
}
