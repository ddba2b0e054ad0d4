//! The table reader: the file mmapped read-only with readahead off (`MADV_RANDOM`), and the gather
//! of `num_tables` rows per token into a caller's buffer, the rows found by [`PleHasher`].

use crate::error::PleError;
use crate::hash::PleHasher;
use crate::metrics::PleMetrics;
use crate::plan::{page_ranges, system_page_size};
use crate::table::{check_sidecar, check_table, Sidecar};
use half::bf16;
use memmap2::{Advice, Mmap};
use sanmai_config::PleConfig;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

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
    page_size: u64,
    metrics: Arc<PleMetrics>,
}

impl PleTable {
    /// Validates `dir` against `cfg` (see [`check_table`]) and maps the table file.
    pub fn open(dir: &Path, cfg: &PleConfig) -> Result<Self, PleError> {
        let sidecar = check_table(dir, cfg)?;
        Self::map(dir, sidecar, cfg)
    }

    /// Opens a table by its sidecar alone (checksum and length checked; no model config), for
    /// tools such as the benchmark. `eos_token_id` is the document separator the hash uses.
    pub fn open_sidecar(dir: &Path, eos_token_id: i64) -> Result<Self, PleError> {
        let sidecar = check_sidecar(dir)?;
        let cfg = sidecar.config(eos_token_id)?;
        Self::map(dir, sidecar, &cfg)
    }

    fn map(dir: &Path, sidecar: Sidecar, cfg: &PleConfig) -> Result<Self, PleError> {
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
            page_size: system_page_size(),
            metrics: Arc::default(),
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

    /// The page size plans are made in.
    pub fn page_size(&self) -> u64 {
        self.page_size
    }

    /// Counters of gathers and prefetches on this table.
    pub fn metrics(&self) -> &Arc<PleMetrics> {
        &self.metrics
    }

    /// The page plan of `indices`: sorted, merged, page-aligned byte ranges of the file covering
    /// every page the gather of those rows touches, and the number of unique pages. See
    /// [`page_ranges`]; `pages` is scratch.
    pub fn page_plan_into(
        &self,
        indices: &[u64],
        pages: &mut Vec<u64>,
        out: &mut Vec<Range<u64>>,
    ) -> usize {
        page_ranges(
            indices,
            &self.base_rows,
            &self.sizes,
            self.row_dim as u64 * 2,
            self.page_size,
            pages,
            out,
        )
    }

    /// [`Self::page_plan_into`] with fresh buffers.
    pub fn page_plan(&self, indices: &[u64]) -> Vec<Range<u64>> {
        let mut out = Vec::new();
        self.page_plan_into(indices, &mut Vec::new(), &mut out);
        out
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
        let start = Instant::now();
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
        PleMetrics::add(&self.metrics.gather_ns, start.elapsed().as_nanos() as u64);
        PleMetrics::add(&self.metrics.gathered_tokens, (indices.len() / nt) as u64);
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
