//! The one-row packed GEMV's kernel choice ([`PackedM1`], a device's own: `Gpu::set_packed_gemv_m1`)
//! and the shape rules and launch plans of the chunk and row-phase kernels it may choose
//! (`kernels/quant.cu`, `kernels/gemv_rows.cu`); `quant.rs` launches them.

/// The kernel a one-row packed GEMV runs
/// ([`Gpu::set_packed_gemv_m1`](crate::Gpu::set_packed_gemv_m1); `crates/cuda/benches/gemv.rs`
/// compares them). Each applies where its shape rules hold; elsewhere the unit GEMV runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PackedM1 {
    /// `gemv_q{4,6,8}_m1`: row slots of 32-value units (every shape).
    Units,
    /// `gemv_q{4,8}v{R}_m1`: 16-byte chunks, R ∈ {1, 2, 4} rows a slot (INT8 and INT4; read the 80B
    /// model's INT8 projections 8-20% faster than the units on a GPU host, docs/gpu/gemv-2026-12-04.md).
    Chunks(usize),
    /// `gemv_q8_rows_u{GU}`: a warp a row, several rows' loads in flight a warp, x in shared memory,
    /// the layer launches' row phase (`kernels/gemv_rows.cu`; INT8, bf16 output, 1024 ≤ k ≤ 6144;
    /// 72–76% of the copy bandwidth at the 80B's and the 125B's widest projections on an H100, where
    /// INT6 ran slower than its unit GEMV, docs/gpu/row-gemv-2026-12-07.md). The default
    /// ([`GpuOptions::row_gemv`](crate::GpuOptions::row_gemv)).
    Rows,
}

impl PackedM1 {
    /// The choice a [`GpuOptions`](crate::GpuOptions) opens with.
    pub(crate) fn of_options(options: &crate::GpuOptions) -> Self {
        if options.row_gemv {
            PackedM1::Rows
        } else {
            PackedM1::Units
        }
    }

    /// As stored in [`Gpu`](crate::Gpu)'s atomic: 0 units, 1, 2, 4 chunks, 8 rows.
    pub(crate) fn code(self) -> usize {
        match self {
            PackedM1::Units => 0,
            PackedM1::Chunks(r) => r,
            PackedM1::Rows => 8,
        }
    }

    pub(super) fn of_code(code: usize) -> Self {
        match code {
            1 | 2 | 4 => PackedM1::Chunks(code),
            8 => PackedM1::Rows,
            _ => PackedM1::Units,
        }
    }
}

/// Most inputs a row-phase GEMV row takes (`GU` 6 in gemv_rows.cu), and fewest (below, a warp a row
/// leaves lanes idle: the unit GEMV's narrower slots serve such rows).
const ROWS_MAX_K: usize = 6144;
const ROWS_MIN_K: usize = 1024;
/// Warps of a row-phase GEMV block (`ML_WARPS`), and its blocks a multiprocessor.
const ROWS_WARPS: usize = 8;
const ROWS_BLOCKS_PER_SM: usize = 2;

/// The units of 32 inputs a lane takes in the row-phase GEMV of `k` inputs (its kernel's `GU`), when
/// that kernel takes a one-row GEMV of `bits` with effective `group` and bf16 output (INT8 only).
pub(super) fn rows_gemv_units(bits: u32, group: usize, m: usize, k: usize) -> Option<usize> {
    let fits = m == 1
        && bits == 8
        && k.is_multiple_of(32)
        && (ROWS_MIN_K..=ROWS_MAX_K).contains(&k)
        && (group >= k || group.is_multiple_of(32));
    fits.then(|| {
        [2, 3, 4, 6]
            .into_iter()
            .find(|&gu| k <= 1024 * gu)
            .unwrap_or(6)
    })
}

/// Rows a warp of the row-phase GEMV has in flight (`gr_batch` in gemv_rows.cu): about 48 words of
/// INT8 codes a lane, 8 a unit.
pub(super) fn rows_batch(gu: usize) -> usize {
    (48 / (gu * 8)).max(1)
}

/// Blocks of the row-phase GEMV for a segment of `n` of the launch's `total` rows: its share of
/// [`ROWS_BLOCKS_PER_SM`] blocks a multiprocessor, then as few as give each warp the same number of
/// rounds of `batch` rows.
pub(super) fn rows_blocks(n: usize, total: usize, batch: usize, sms: usize) -> usize {
    let per_block = ROWS_WARPS * batch;
    let share = (ROWS_BLOCKS_PER_SM * sms.max(1) * n).div_ceil(total.max(1));
    let blocks = n.div_ceil(per_block).min(share).max(1);
    let rounds = n.div_ceil(per_block * blocks);
    n.div_ceil(per_block * rounds)
}

/// Whether a one-row packed GEMV runs on 16-byte chunks (`gemv_q{4,8}v{R}_m1`): INT8 or INT4, m = 1,
/// per-row scales or groups of whole chunks (16 values for INT8, 32 for INT4). `group` is the effective
/// group (k for per-row scales).
pub(super) fn chunk_gemv(bits: u32, group: usize, m: usize, k: usize) -> bool {
    let cv = match bits {
        8 => 16,
        4 => 32,
        _ => return false,
    };
    m == 1 && k.is_multiple_of(cv) && (group >= k || group.is_multiple_of(cv))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_row_phase_gemv_takes_one_row_of_whole_units_from_1024_to_6144_inputs() {
        assert_eq!(rows_gemv_units(8, 2560, 1, 2560), Some(3));
        assert_eq!(rows_gemv_units(8, 6144, 1, 6144), Some(6));
        assert_eq!(rows_gemv_units(8, 4096, 1, 4096), Some(4));
        assert_eq!(rows_gemv_units(4, 128, 1, 2048), None);
        assert_eq!(rows_gemv_units(6, 1024, 1, 1024), None);
        assert_eq!(rows_gemv_units(8, 5120, 1, 5120), Some(6));
        assert_eq!(rows_gemv_units(8, 2048, 2, 2048), None);
        assert_eq!(rows_gemv_units(8, 512, 1, 512), None);
        assert_eq!(rows_gemv_units(8, 6176, 1, 6176), None);
        assert_eq!(rows_gemv_units(8, 16, 1, 2048), None);
        assert_eq!(rows_gemv_units(6, 1000, 1, 1000), None);
        // The kernel's gr_batch: about 48 words of codes a lane.
        assert_eq!(rows_batch(2), 3);
        assert_eq!(rows_batch(3), 2);
        assert_eq!(rows_batch(6), 1);
    }

    #[test]
    fn row_phase_blocks_cover_their_rows_in_even_rounds() {
        for (n, total, batch, sms) in [
            (13312, 14336, 2, 132),
            (512, 14336, 2, 132),
            (2560, 2560, 1, 132),
            (1, 1, 3, 132),
            (7, 9000, 6, 8),
            (248_320, 248_320, 2, 132),
        ] {
            let blocks = rows_blocks(n, total, batch, sms);
            let per_round = blocks * ROWS_WARPS * batch;
            let rounds = n.div_ceil(per_round);
            assert!(blocks >= 1 && blocks <= n.div_ceil(ROWS_WARPS * batch));
            assert!(blocks <= (ROWS_BLOCKS_PER_SM * sms * n).div_ceil(total).max(1));
            // One block fewer would take another round.
            assert!(blocks == 1 || n > (blocks - 1) * ROWS_WARPS * batch * rounds);
        }
    }
}
