//! The table file and its JSON sidecar (spec §3.5): the sub-tables back to back in (order, head)
//! order, each `P·row_dim` bf16 little-endian, no header; `ple.json` names the file and records the
//! shape with a checksum of its own fields. Writing streams fixed-size chunks, never the whole table.

use crate::error::PleError;
use crate::hash::splitmix64_outputs;
use sanmai_config::PleConfig;
use serde::{Deserialize, Serialize};
use std::io::Write;
use std::path::{Path, PathBuf};

/// File name of the table inside its directory.
pub const TABLE_FILE: &str = "ple.bin";
/// File name of the sidecar inside the table directory.
pub const SIDECAR_FILE: &str = "ple.json";

const CHUNK_BYTES: usize = 8 << 20;

/// What the rows of a new table hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fill {
    /// Deterministic pseudo-random values within ±0.05 (bf16-rounded), from the config's seed.
    Random,
    /// All zeros (still written, so the file occupies the disk like a real one).
    Zeros,
}

impl Fill {
    fn name(self) -> &'static str {
        match self {
            Fill::Random => "random",
            Fill::Zeros => "zeros",
        }
    }
}

impl std::str::FromStr for Fill {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "random" => Ok(Fill::Random),
            "zeros" => Ok(Fill::Zeros),
            _ => Err(format!("unknown fill `{s}` (random|zeros)")),
        }
    }
}

/// Options of [`create_table`].
#[derive(Debug, Clone, Copy)]
pub struct CreateOptions {
    /// Each size becomes the largest prime ≤ `P·rows_scale` (at least 2); 1.0 keeps the config's.
    pub rows_scale: f64,
    pub fill: Fill,
    /// Log progress every ~5% of the file.
    pub progress: bool,
}

impl Default for CreateOptions {
    fn default() -> Self {
        CreateOptions {
            rows_scale: 1.0,
            fill: Fill::Random,
            progress: false,
        }
    }
}

/// The JSON sidecar next to a table file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Sidecar {
    pub file: String,
    pub dtype: String,
    pub row_dim: usize,
    pub orders: Vec<usize>,
    pub heads: usize,
    /// Sub-table sizes as written (after `rows_scale`), `[order][head]`.
    pub sizes: Vec<Vec<u64>>,
    pub seed: u64,
    pub rows_scale: f64,
    pub fill: String,
    /// `fnv1a64:` and 16 hex digits over the compact JSON of every other field, in this order.
    pub checksum: String,
}

impl Sidecar {
    /// The checksum of the sidecar's fields (all but `checksum`).
    pub fn compute_checksum(&self) -> String {
        let fields = serde_json::json!({
            "file": self.file, "dtype": self.dtype, "row_dim": self.row_dim,
            "orders": self.orders, "heads": self.heads, "sizes": self.sizes,
            "seed": self.seed, "rows_scale": self.rows_scale, "fill": self.fill,
        });
        let text = serde_json::to_string(&fields).unwrap_or_default();
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in text.bytes() {
            h ^= b as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        format!("fnv1a64:{h:016x}")
    }

    /// The config the sidecar implies (its sizes as written, `rows_scale` folded in), for tools
    /// that open a table without the model config; `eos_token_id` is not in the sidecar.
    pub fn config(&self, eos_token_id: i64) -> Result<PleConfig, PleError> {
        Ok(PleConfig::from_block(&serde_json::json!({
            "orders": self.orders, "heads": self.heads, "row_dim": self.row_dim, "seed": self.seed,
            "layer_ids": [], "table_sizes": self.sizes, "conv_kernel": 1, "conv_dilation": 1,
            "eos_token_id": eos_token_id,
        }))?)
    }

    /// Total rows over all sub-tables.
    pub fn total_rows(&self) -> u64 {
        self.sizes.iter().flatten().sum()
    }

    /// Expected table file length in bytes.
    pub fn file_len(&self) -> u64 {
        self.total_rows() * self.row_dim as u64 * 2
    }

    /// Reads `ple.json` from a table directory.
    pub fn read(dir: &Path) -> Result<Self, PleError> {
        let path = dir.join(SIDECAR_FILE);
        let text = std::fs::read_to_string(&path).map_err(|e| PleError::io(&path, e))?;
        serde_json::from_str(&text).map_err(|e| table_err(dir, format!("{SIDECAR_FILE}: {e}")))
    }
}

fn table_err(dir: &Path, what: impl Into<String>) -> PleError {
    PleError::Table {
        dir: dir.to_path_buf(),
        what: what.into(),
    }
}

fn is_prime(n: u64) -> bool {
    if n < 2 {
        return false;
    }
    if n.is_multiple_of(2) {
        return n == 2;
    }
    let mut d = 3u64;
    while d.saturating_mul(d) <= n {
        if n.is_multiple_of(d) {
            return false;
        }
        d += 2;
    }
    true
}

/// The sizes a table written with `rows_scale` has: each `P` becomes the largest prime ≤
/// `floor(P·rows_scale)` (at least 2). A scale of 1.0 keeps the sizes as they are.
pub fn scaled_sizes(sizes: &[Vec<u64>], rows_scale: f64) -> Result<Vec<Vec<u64>>, PleError> {
    if !(rows_scale > 0.0 && rows_scale <= 1.0) {
        return Err(PleError::Input(format!(
            "rows_scale {rows_scale} outside (0, 1]"
        )));
    }
    if rows_scale == 1.0 {
        return Ok(sizes.to_vec());
    }
    Ok(sizes
        .iter()
        .map(|row| {
            row.iter()
                .map(|&p| {
                    let mut n = ((p as f64 * rows_scale).floor() as u64).max(2);
                    while !is_prime(n) {
                        n -= 1;
                    }
                    n
                })
                .collect()
        })
        .collect())
}

/// Writes `dir/ple.bin` and `dir/ple.json` for `cfg`, streaming 8 MiB chunks (the file is written
/// under a temporary name and renamed when complete). Returns the sidecar written.
pub fn create_table(cfg: &PleConfig, dir: &Path, opts: CreateOptions) -> Result<Sidecar, PleError> {
    let sizes = scaled_sizes(&cfg.table_sizes, opts.rows_scale)?;
    let mut sidecar = Sidecar {
        file: TABLE_FILE.to_string(),
        dtype: "bf16".to_string(),
        row_dim: cfg.row_dim,
        orders: cfg.orders.clone(),
        heads: cfg.heads,
        sizes,
        seed: cfg.seed,
        rows_scale: opts.rows_scale,
        fill: opts.fill.name().to_string(),
        checksum: String::new(),
    };
    sidecar.checksum = sidecar.compute_checksum();
    std::fs::create_dir_all(dir).map_err(|e| PleError::io(dir, e))?;
    let tmp: PathBuf = dir.join(format!("{TABLE_FILE}.partial"));
    let file = std::fs::File::create(&tmp).map_err(|e| PleError::io(&tmp, e))?;
    let mut w = std::io::BufWriter::with_capacity(CHUNK_BYTES, file);
    let total = sidecar.file_len();
    let mut chunk = vec![0u8; CHUNK_BYTES];
    // The random stream: SplitMix64 seeded away from the multipliers' stream.
    let mut state = splitmix64_outputs(cfg.seed ^ 0x504c_455f_5441_424c, 1)[0];
    let mut written = 0u64;
    let mut next_report = total / 20;
    while written < total {
        let n = (total - written).min(CHUNK_BYTES as u64) as usize;
        let buf = &mut chunk[..n];
        if opts.fill == Fill::Random {
            for pair in buf.chunks_exact_mut(2) {
                state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
                let mut z = state;
                z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
                z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
                z ^= z >> 31;
                let v = ((z >> 48) as i16) as f32 * (0.05 / 32768.0);
                pair.copy_from_slice(&half::bf16::from_f32(v).to_le_bytes());
            }
        }
        w.write_all(buf).map_err(|e| PleError::io(&tmp, e))?;
        written += n as u64;
        if opts.progress && written >= next_report {
            tracing::info!(
                "ple table: {:.1} / {:.1} GiB ({:.0}%)",
                written as f64 / (1u64 << 30) as f64,
                total as f64 / (1u64 << 30) as f64,
                100.0 * written as f64 / total as f64
            );
            next_report = written + total / 20;
        }
    }
    let file = w
        .into_inner()
        .map_err(|e| PleError::io(&tmp, e.into_error()))?;
    file.sync_all().map_err(|e| PleError::io(&tmp, e))?;
    drop(file);
    let dst = dir.join(TABLE_FILE);
    std::fs::rename(&tmp, &dst).map_err(|e| PleError::io(&dst, e))?;
    let side = dir.join(SIDECAR_FILE);
    let text = serde_json::to_string_pretty(&sidecar).unwrap_or_default();
    std::fs::write(&side, text + "\n").map_err(|e| PleError::io(&side, e))?;
    Ok(sidecar)
}

/// Validates a table directory on its own: the sidecar's checksum, file name and dtype, and that
/// the file's length matches the sizes the sidecar records. Returns the sidecar.
pub fn check_sidecar(dir: &Path) -> Result<Sidecar, PleError> {
    let s = Sidecar::read(dir)?;
    let sum = s.compute_checksum();
    if s.checksum != sum {
        return Err(table_err(
            dir,
            format!("sidecar checksum {} but its fields give {sum}", s.checksum),
        ));
    }
    if s.file.contains('/') || s.file.contains('\\') || s.file.is_empty() {
        return Err(table_err(
            dir,
            format!("sidecar file name `{}` is not a plain name", s.file),
        ));
    }
    if s.dtype != "bf16" {
        return Err(table_err(
            dir,
            format!("dtype {} (only bf16 is supported)", s.dtype),
        ));
    }
    let path = dir.join(&s.file);
    let len = std::fs::metadata(&path)
        .map_err(|e| PleError::io(&path, e))?
        .len();
    if len != s.file_len() {
        return Err(table_err(
            dir,
            format!("{} is {len} bytes, the sizes need {}", s.file, s.file_len()),
        ));
    }
    Ok(s)
}

/// Checks the sidecar `s` of the table in `dir` against `cfg`'s shape and seed (row width, orders,
/// heads, hash seed): what a table must share with its model whatever its sizes. The error names
/// the first field that disagrees.
pub fn check_shape(dir: &Path, s: &Sidecar, cfg: &PleConfig) -> Result<(), PleError> {
    let mismatch = |what: &str, table: String, config: String| {
        table_err(
            dir,
            format!("{what}: table has {table}, config has {config}"),
        )
    };
    if s.row_dim != cfg.row_dim {
        return Err(mismatch(
            "row_dim",
            s.row_dim.to_string(),
            cfg.row_dim.to_string(),
        ));
    }
    if s.orders != cfg.orders {
        return Err(mismatch(
            "orders",
            format!("{:?}", s.orders),
            format!("{:?}", cfg.orders),
        ));
    }
    if s.heads != cfg.heads {
        return Err(mismatch(
            "heads",
            s.heads.to_string(),
            cfg.heads.to_string(),
        ));
    }
    if s.seed != cfg.seed {
        return Err(mismatch("seed", s.seed.to_string(), cfg.seed.to_string()));
    }
    Ok(())
}

/// Validates the table in `dir` against `cfg`: [`check_sidecar`], then the shape, seed and sizes
/// (the config's, scaled by the sidecar's `rows_scale`). Returns the sidecar; errors name what
/// disagrees.
pub fn check_table(dir: &Path, cfg: &PleConfig) -> Result<Sidecar, PleError> {
    let s = check_sidecar(dir)?;
    check_shape(dir, &s, cfg)?;
    let mismatch = |what: &str, table: String, config: String| {
        table_err(
            dir,
            format!("{what}: table has {table}, config has {config}"),
        )
    };
    let want = scaled_sizes(&cfg.table_sizes, s.rows_scale)
        .map_err(|e| table_err(dir, format!("rows_scale: {e}")))?;
    if s.sizes != want {
        let scaled = if s.rows_scale == 1.0 {
            String::new()
        } else {
            format!(" (scaled by rows_scale {})", s.rows_scale)
        };
        return Err(mismatch(
            "table_sizes",
            format!("{:?}", s.sizes),
            format!("{want:?}{scaled}"),
        ));
    }
    Ok(s)
}
