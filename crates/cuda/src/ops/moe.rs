//! Routed experts without a host round trip: the pairs (token, choice) are grouped by expert on the
//! device ([`Gpu::moe_sort`]), a grouped GEMV multiplies each tile of at most [`MOE_TILE`] pairs by
//! its expert's weight, found through a device table of expert weight addresses ([`Gpu::moe_gemv`]),
//! and [`Gpu::moe_combine`] sums each token's expert outputs with its routing weights. Only the chosen
//! experts' weights are read, each once per tile. Pair `p = token·top_k + choice`, the router's layout.
//! [`Gpu::moe_gemv_packed`] is the same grouped GEMV over packed integer experts (INT4/INT8
//! pack-quantized, INT6 gapless; see `ops::quant`), through tables of word and scale addresses.

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, DeviceRepr, DeviceSlice};
use half::bf16;

use super::{row_threads, PackedScheme};
use crate::error::{ensure, CudaError, Result};
use crate::gpu::{cfg, check_len, grid_u32, int, Gpu, Launch};
use crate::registry::Kernel;

/// Pairs per tile of the grouped GEMV (`MOE_TILE` in `moe_route.cuh`).
pub const MOE_TILE: usize = 8;
/// Threads per block of the grouped GEMV.
const GEMV_THREADS: usize = 256;
/// Warps per block, rows per row group and load slots per warp of the INT4 tensor-core grouped GEMV
/// (`moe_gemv_q4_mma_*`: `MOE_MMA_WARPS` warps split a 16-row group's k, `MOE_MMA_SPW` slots).
const MMA_WARPS: usize = 4;
const MMA_ROWS: usize = 16;
const MMA_SLOTS: usize = 4;
/// Most pairs for which a decode step's INT4 down projection stages its SwiGLU itself
/// ([`Gpu::moe_gemv_packed_swiglu`]); past them a `swiglu` launch first. A block of the fused kernel
/// computes its tile's activations for the rows it takes. On an H100 (the 80B's down projection
/// alone, `docs/gpu/grouped-gemv-stream-2026-12-06.md`) fused against a `swiglu` launch plus the
/// plain kernel: 7.7 against 8.5 µs at 10 pairs, 18.4 against 19.4 at 40, 31.4 against 31.1 at 80
/// (batch 8, top 10). The two give the same bits.
pub const SWIGLU_FUSED_MAX_PAIRS: usize = 32;
/// Threads per block of `moe_combine` (each sums 4 columns).
const COMBINE_THREADS: usize = 128;

/// A pair-grouping launch ([`Gpu::group_pairs`]): its op and kernel, `e` experts, the `max_tiles`
/// tile slots and `smem` bytes of shared memory.
pub(super) struct Grouping {
    pub op: &'static str,
    pub kernel: &'static str,
    pub e: usize,
    pub max_tiles: usize,
    pub smem: usize,
}

/// The most tiles `n_pairs` pairs over `e` experts can need: each non-empty expert adds at most one
/// partial tile.
pub fn moe_max_tiles(n_pairs: usize, e: usize) -> usize {
    n_pairs.min(n_pairs.div_ceil(MOE_TILE) + e).max(1)
}

/// Dynamic shared memory of the INT4 tensor-core grouped GEMV: `MOE_TILE` staged x rows of `k`
/// bf16, each padded by 64 bytes.
fn mma_smem(k: usize) -> usize {
    MOE_TILE * (k / 8 + 4) * 16
}

/// Row groups of 16 rows a block of the tensor-core grouped GEMV takes for rows of `k` values
/// (`moe_mma_groups`): as many as a warp's load slots hold its spans of (one where they fill them).
fn mma_groups(k: usize) -> usize {
    let per_warp = (k / 128).div_ceil(MMA_WARPS).max(1);
    if per_warp >= MMA_SLOTS {
        1
    } else {
        MMA_SLOTS / per_warp
    }
}

/// Output element types of [`Gpu::moe_gemv`].
pub trait MoeOut: DeviceRepr {
    const KERNEL: &'static str;
    /// The packed kernels' name suffix.
    const SUFFIX: &'static str;
}
// `KERNEL` names the bf16 experts' plain kernel; the launchers build every name from `SUFFIX`.
impl MoeOut for bf16 {
    const KERNEL: &'static str = "moe_gemv_bf16";
    const SUFFIX: &'static str = "bf16";
}
impl MoeOut for f32 {
    const KERNEL: &'static str = "moe_gemv_f32";
    const SUFFIX: &'static str = "f32";
}

/// How a grouped GEMV launch is cut: the kernel (the `_m1` form for decode-sized batches), the lanes
/// sharing a weight row and the grid's row blocks. Depends on shapes only (never on the routing), so
/// a captured graph replays it for any routing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct MoeGemvPlan {
    /// The entry point in `moe.cu`.
    pub(crate) kernel: String,
    /// Lanes per weight row (a power of two, 8..=32).
    pub(crate) lanes: usize,
    /// Weight rows per block.
    pub(crate) rows_per_block: usize,
}

/// The plan of a grouped GEMV over `e` experts of `[n, k]` weights stored with `bits` (16 = bf16; 4,
/// 6, 8 packed), for `n_pairs` pairs, output suffix `suffix` (`bf16` or `f32`). At most 4 pairs per
/// expert on average (decode) it takes the `_m1` kernels, which keep few registers (many warps, all
/// their loads in flight) and take a tile's pairs one at a time; beyond, the plain kernels, which take
/// up to 8 pairs per weight read. The per-variant rows per lane group (RPG) and units loaded ahead
/// per lane (D) mirror the entry points in `moe.cu`; a lane group is sized so each lane has about D
/// units (8 bf16 values or 32 packed values) of a row.
pub(crate) fn moe_gemv_plan(
    bits: u32,
    suffix: &str,
    n_pairs: usize,
    e: usize,
    k: usize,
) -> MoeGemvPlan {
    let decode = n_pairs <= 4 * e;
    let (rpg, d) = match (bits, decode) {
        (16, _) => (4, 2),
        (4 | 6, true) => (2, 2),
        (_, true) => (2, 1),
        (_, false) => (4, 1),
    };
    let units = if bits == 16 {
        k.div_ceil(8)
    } else {
        k.div_ceil(32)
    };
    let lanes = units.div_ceil(d).next_power_of_two().clamp(8, 32);
    let base = if bits == 16 {
        format!("moe_gemv_{suffix}")
    } else {
        format!("moe_gemv_q{bits}_{suffix}")
    };
    MoeGemvPlan {
        kernel: if decode { format!("{base}_m1") } else { base },
        lanes,
        rows_per_block: GEMV_THREADS / lanes * rpg,
    }
}

/// The routed (token, expert) pairs grouped by expert as [`Gpu::moe_sort`] (or
/// [`Gpu::moe_gemm_plan`]) lays them out: `perm` `[n_pairs]` pair numbers expert after expert, and
/// `tiles` their `(expert, start in perm, count)` triples.
pub struct PairGroups<'a, U: DevicePtr<u32>> {
    pub perm: &'a U,
    pub tiles: &'a U,
    pub n_pairs: usize,
}

impl<U: DevicePtr<u32>> PairGroups<'_, U> {
    /// Checks a grouped launch's `perm`, `tiles` (`max_tiles` triples) and `y` (`[n_pairs, n]`)
    /// lengths and the grid limit; `false` when there is nothing to compute (no pairs or no rows).
    pub(crate) fn check_launch<O>(
        &self,
        op: &'static str,
        max_tiles: usize,
        y: &impl DeviceSlice<O>,
        n: usize,
    ) -> Result<bool> {
        check_len(op, "perm", self.perm, self.n_pairs)?;
        check_len(op, "tiles", self.tiles, 3 * max_tiles)?;
        check_len(op, "y", y, self.n_pairs * n)?;
        if self.n_pairs == 0 || n == 0 {
            return Ok(false);
        }
        ensure(max_tiles <= 65535, op, || {
            format!("{max_tiles} tiles exceed the grid limit")
        })?;
        Ok(true)
    }
}

/// The rows the pairs read: `x` `[rows, ·]` (bf16; e4m3 bytes for the FP8 tensor-core GEMM), pair `p`
/// reading row `p / div` (`div` = top_k
/// reads token rows, the gate|up projection; 1 reads pair rows, the down projection). With `tail`
/// (token rows only), the pairs at or past it (the shared expert's, one a token after the routed
/// pairs) read row `p - tail`.
pub struct PairRows<'a, X> {
    pub x: &'a X,
    pub rows: usize,
    pub div: usize,
    pub tail: Option<usize>,
}

impl<X> PairRows<'_, X> {
    /// Rows of `x` that `n_pairs` pairs read.
    pub fn rows_needed(&self, n_pairs: usize) -> usize {
        match self.tail {
            Some(t) if t < n_pairs => t.div_ceil(self.div.max(1)).max(n_pairs - t),
            _ => n_pairs.div_ceil(self.div.max(1)),
        }
    }

    /// The kernels' `x_tail` argument (`u32::MAX`: no tail).
    pub(crate) fn x_tail(&self, op: &'static str) -> Result<u32> {
        match self.tail {
            None => Ok(u32::MAX),
            Some(t) => u32::try_from(t)
                .ok()
                .filter(|&v| v < u32::MAX)
                .ok_or_else(|| crate::error::CudaError::Shape {
                    op,
                    msg: format!("{t} routed pairs exceed the kernels' range"),
                }),
        }
    }
}

/// One projection of every expert, an `[n, k]` matrix each, through device tables of addresses (one
/// entry per expert): `weights` holds the bf16 values' addresses (`scheme` `None`) or the packed
/// words' (`scheme` `Some`), `scales` the packed scales' (not read for bf16 experts, which may pass
/// any table of as many entries).
pub struct Experts<'a, P: DevicePtr<u64>> {
    pub weights: &'a P,
    pub scales: &'a P,
    pub scheme: Option<PackedScheme>,
    pub n: usize,
    pub k: usize,
}

/// Where [`Gpu::moe_combine`] finds the shared expert's gate logits.
pub enum SharedGate<'a> {
    /// `[tokens]` bf16, computed apart.
    Bf16(&'a CudaSlice<bf16>),
    /// `[tokens]` f32 from index `at` of `logits` (the decode routing's, after the router's).
    F32 {
        logits: &'a CudaSlice<f32>,
        at: usize,
    },
}

/// Where [`Gpu::moe_combine`] puts the combined rows.
pub enum CombineInto<'a, T: DevicePtrMut<bf16>> {
    /// The rows, `[tokens, h]`.
    Rows(&'a mut T),
    /// Added to the residual `acc` (`[tokens, h]`), whose RMSNorm with weight `w` (`[h]`; `eps`,
    /// `offset` as [`Gpu::rms_norm`]) goes to `normed` (`[tokens, h]`): what [`Gpu::add_rms_norm`]
    /// of the rows gives, bit for bit, in the combine's launch. The rows themselves are not kept.
    AddNorm {
        acc: &'a mut T,
        w: &'a CudaSlice<bf16>,
        normed: &'a mut T,
        eps: f32,
        offset: f32,
    },
}

/// Where [`Gpu::moe_combine`] finds the shared expert's output.
pub enum SharedY<'a> {
    /// Its own `[tokens, h]` bf16 rows, computed apart.
    Apart(&'a CudaSlice<bf16>),
    /// The f32 rows of `y` after the routed pairs' (the grouped GEMV's shared pairs).
    AfterRouted,
}

/// The router's choice for a combine: `ids` and `weights` `[tokens, top_k]`, ids at or beyond
/// `experts` skipped.
pub struct Routed<'a, U: DevicePtr<u32>, F: DevicePtr<f32>> {
    pub ids: &'a U,
    pub weights: &'a F,
    pub experts: usize,
    pub top_k: usize,
    pub tokens: usize,
}

impl Gpu {
    /// Groups `n_pairs` expert ids (`ids`, each `< e`; others are dropped) by expert: `perm`
    /// `[n_pairs]` lists pair numbers expert after expert, `tiles` `[max_tiles, 3]` holds
    /// `(expert, start in perm, count ≤ MOE_TILE)`, experts ascending, with an unused tail of
    /// `(0, 0, 0)`, where `max_tiles = moe_max_tiles(n_pairs, e)`. One block; the counts, offsets and
    /// tile slots are computed in parallel (a block-wide scan over the experts).
    pub fn moe_sort(
        &self,
        ids: &impl DevicePtr<u32>,
        n_pairs: usize,
        e: usize,
        perm: &mut impl DevicePtrMut<u32>,
        tiles: &mut impl DevicePtrMut<u32>,
    ) -> Result<()> {
        const OP: &str = "moe_sort";
        let smem = 4 * (2 * e + 2);
        ensure(e > 0 && smem <= 48 * 1024, OP, || {
            format!("{e} experts do not fit shared memory")
        })?;
        let grouping = Grouping {
            op: OP,
            kernel: "moe_sort",
            e,
            max_tiles: moe_max_tiles(n_pairs, e),
            smem,
        };
        // Shared memory: (2·e + 2) u32, checked above.
        self.group_pairs(grouping, ids, n_pairs, perm, tiles)
    }

    /// Launches a kernel that groups pairs by expert (`moe_sort`, `moe_gemm_plan`: `ids, n_pairs, e,
    /// perm, tiles, max_tiles`) on one block of 1024 threads, after checking the buffers' lengths.
    /// The caller checks that `g.smem` bytes of shared memory are what the kernel needs and fit.
    pub(super) fn group_pairs(
        &self,
        g: Grouping,
        ids: &impl DevicePtr<u32>,
        n_pairs: usize,
        perm: &mut impl DevicePtrMut<u32>,
        tiles: &mut impl DevicePtrMut<u32>,
    ) -> Result<()> {
        let Grouping {
            op,
            kernel,
            e,
            max_tiles,
            smem,
        } = g;
        check_len(op, "ids", ids, n_pairs)?;
        check_len(op, "perm", perm, n_pairs)?;
        check_len(op, "tiles", tiles, 3 * max_tiles)?;
        let (np, ei, mt) = (
            int(op, "n_pairs", n_pairs)?,
            int(op, "e", e)?,
            int(op, "max_tiles", max_tiles)?,
        );
        let mut b = self.launch(self.kernel(kernel)?);
        b.ptr(ids)
            .arg(&np)
            .arg(&ei)
            .ptr_mut(perm)
            .ptr_mut(tiles)
            .arg(&mt);
        // SAFETY: argument types match the kernel; lengths checked above, shared memory by the
        // caller.
        unsafe { b.launch(cfg((1, 1, 1), 1024, smem as u32)) }?;
        Ok(())
    }

    /// For every tile `(x, start, count)` of `groups.tiles` and each pair `p = perm[start + m]` of
    /// it: `y[p, :] = W_x · x[p / div, :]`, `W_x` the `[n, k]` bf16 matrix at address `weights[x]`
    /// (bf16 experts: `scheme` `None`). Needs `k % 8 == 0` and 16-byte aligned weights and `x`;
    /// every address in the table must hold `n·k` elements (the caller builds the table from live
    /// weights). The kernel and grid come from the shapes alone (see `moe_gemv_plan`): every tile
    /// slot is launched, empty ones return at once, so the launch is the same for any routing.
    pub fn moe_gemv<O: MoeOut>(
        &self,
        experts: &Experts<'_, impl DevicePtr<u64>>,
        input: &PairRows<'_, impl DevicePtr<bf16>>,
        groups: &PairGroups<'_, impl DevicePtr<u32>>,
        y: &mut impl DevicePtrMut<O>,
    ) -> Result<()> {
        const OP: &str = "moe_gemv";
        ensure(experts.scheme.is_none(), OP, || {
            "packed experts take moe_gemv_packed".into()
        })?;
        let (w_ptrs, n, k) = (experts.weights, experts.n, experts.k);
        let (x, x_rows, x_div) = (input.x, input.rows, input.div);
        let n_pairs = groups.n_pairs;
        ensure(k.is_multiple_of(8) && k > 0, OP, || {
            format!("k = {k} must be a positive multiple of 8")
        })?;
        ensure(
            x_div >= 1 && input.rows_needed(n_pairs) <= x_rows,
            OP,
            || format!("{n_pairs} pairs over x_div {x_div} need more than {x_rows} rows of x"),
        )?;
        let e = w_ptrs.len();
        let max_tiles = moe_max_tiles(n_pairs, e);
        check_len(OP, "x", x, x_rows * k)?;
        if !groups.check_launch(OP, max_tiles, y, n)? {
            return Ok(());
        }
        ensure(self.addr(x).is_multiple_of(16), OP, || {
            "x must be 16-byte aligned".into()
        })?;
        let plan = moe_gemv_plan(16, O::SUFFIX, n_pairs, e, k);
        let (xd, ni, ki, gi, li) = (
            int(OP, "x_div", x_div)?,
            int(OP, "n", n)?,
            int(OP, "k", k)?,
            1i32,
            plan.lanes as i32,
        );
        // The scale table is unused for bf16 experts: the word table stands in.
        let kernel = self.kernel(&plan.kernel)?;
        let xt = input.x_tail(OP)?;
        let mut b = self.grouped_launch(kernel, [w_ptrs, w_ptrs], x, (&xd, &xt), groups, y);
        b.arg(&ni).arg(&ki).arg(&gi).arg(&li);
        let grid = (
            grid_u32(OP, n.div_ceil(plan.rows_per_block))?,
            max_tiles as u32,
            1,
        );
        // SAFETY: argument types match the kernel; x, perm, tiles and y lengths checked above; perm
        // holds pair numbers below n_pairs (written by moe_sort), so x rows p / x_div < x_rows and y
        // rows p < n_pairs; weight addresses come from the caller's table of live [n, k] weights.
        unsafe { b.launch(cfg(grid, GEMV_THREADS as u32, 0)) }?;
        Ok(())
    }

    /// As [`Gpu::moe_gemv`] with packed experts: `W_x` is the packed `[n, k]` matrix whose words are
    /// at `weights[x]` (`n · words_per_row(bits, k)` u32) and scales at `scales[x]`
    /// (`n · scale_cols(group_size, k)` f32; `group_size` 0 = one scale per row), every expert of
    /// one scheme (`bits` 4, 6 gapless or 8). Needs the packed
    /// kernels' shape rules (`k % 32 == 0` for INT4/INT8, `k % 8 == 0` for INT6, `group_size % 8 ==
    /// 0`), 16-byte aligned words and `x`; the caller builds the tables from live weights. INT4 with
    /// `k % 128 == 0`, groups of a multiple of 128 values and `k ≤ 3064` runs on tensor cores
    /// (`moe_gemv_q4_mma_*`: rows in groups of 16, the tile's pairs as the mma's columns, f32 sums).
    pub fn moe_gemv_packed<O: MoeOut>(
        &self,
        experts: &Experts<'_, impl DevicePtr<u64>>,
        input: &PairRows<'_, impl DevicePtr<bf16>>,
        groups: &PairGroups<'_, impl DevicePtr<u32>>,
        y: &mut impl DevicePtrMut<O>,
    ) -> Result<()> {
        self.moe_gemv_packed_with(experts, input, groups, y, false)
    }

    /// Whether [`Gpu::moe_gemv_packed_swiglu`] takes experts of `bits` / `group_size` (0: one scale
    /// per row) with rows of `k` values: INT4 on tensor cores, `k % 128 == 0`, groups of a multiple
    /// of 128, `k ≤ 3064`.
    pub fn moe_gemv_fuses_swiglu(bits: u32, group_size: usize, k: usize) -> bool {
        let group = if group_size == 0 { k } else { group_size };
        bits == 4
            && k > 0
            && k.is_multiple_of(128)
            && group.is_multiple_of(128)
            && mma_smem(k) <= 48 * 1024
    }

    /// The down projection of the routed experts with the SwiGLU activation fused into its input:
    /// as [`Gpu::moe_gemv_packed`] over pair rows (`div` 1) with input row `p` = `bf16(silu(g) · u)`
    /// of `gate_up[p] = [g | u]` (`gate_up.x`: `[rows, 2k]` bf16, computed as `swiglu` computes it,
    /// so the result is the unfused pair's). Only where [`Gpu::moe_gemv_fuses_swiglu`] holds.
    pub fn moe_gemv_packed_swiglu(
        &self,
        experts: &Experts<'_, impl DevicePtr<u64>>,
        gate_up: &PairRows<'_, impl DevicePtr<bf16>>,
        groups: &PairGroups<'_, impl DevicePtr<u32>>,
        y: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        const OP: &str = "moe_gemv_packed_swiglu";
        let k = experts.k;
        let fused = experts
            .scheme
            .is_some_and(|s| Self::moe_gemv_fuses_swiglu(s.bits, s.group_size, k));
        ensure(fused, OP, || {
            format!("{:?} k = {k}: no fused SwiGLU kernel", experts.scheme)
        })?;
        ensure(gate_up.div == 1, OP, || {
            "the down projection reads pair rows (div 1)".into()
        })?;
        self.moe_gemv_packed_with(experts, gate_up, groups, y, true)
    }

    fn moe_gemv_packed_with<O: MoeOut>(
        &self,
        experts: &Experts<'_, impl DevicePtr<u64>>,
        input: &PairRows<'_, impl DevicePtr<bf16>>,
        groups: &PairGroups<'_, impl DevicePtr<u32>>,
        y: &mut impl DevicePtrMut<O>,
        swiglu: bool,
    ) -> Result<()> {
        const OP: &str = "moe_gemv_packed";
        let PackedScheme { bits, group_size } = experts.scheme.ok_or_else(|| CudaError::Shape {
            op: OP,
            msg: "bf16 experts take moe_gemv".into(),
        })?;
        let (w_ptrs, s_ptrs, n, k) = (experts.weights, experts.scales, experts.n, experts.k);
        let (x, x_rows, x_div) = (input.x, input.rows, input.div);
        let n_pairs = groups.n_pairs;
        ensure(matches!(bits, 4 | 6 | 8), OP, || {
            format!("{bits}-bit weights: expected 4, 6 or 8")
        })?;
        let step = if bits == 6 { 8 } else { 32 };
        ensure(k > 0 && k.is_multiple_of(step), OP, || {
            format!("k = {k} must be a positive multiple of {step} for INT{bits}")
        })?;
        ensure(group_size.is_multiple_of(8), OP, || {
            format!("group_size = {group_size} must be a multiple of 8")
        })?;
        ensure(
            x_div >= 1 && input.rows_needed(n_pairs) <= x_rows,
            OP,
            || format!("{n_pairs} pairs over x_div {x_div} need more than {x_rows} rows of x"),
        )?;
        let e = w_ptrs.len();
        check_len(OP, "s_ptrs", s_ptrs, e)?;
        let max_tiles = moe_max_tiles(n_pairs, e);
        check_len(OP, "x", x, x_rows * if swiglu { 2 * k } else { k })?;
        if !groups.check_launch(OP, max_tiles, y, n)? {
            return Ok(());
        }
        let group = if group_size == 0 { k } else { group_size };
        ensure(self.addr(x).is_multiple_of(16), OP, || {
            "x must be 16-byte aligned".into()
        })?;
        // INT4 with groups of whole 128-value spans: the tensor-core kernel (any batch: a tile's ≤ 8
        // pairs are the mma's 8 columns), its x rows staged in shared memory.
        let mma = Self::moe_gemv_fuses_swiglu(bits, group_size, k);
        let mut plan = moe_gemv_plan(bits, O::SUFFIX, n_pairs, e, k);
        let (threads, smem) = if mma {
            plan = MoeGemvPlan {
                kernel: if swiglu {
                    format!("moe_gemv_q4_mma_swiglu_{}", O::SUFFIX)
                } else {
                    format!("moe_gemv_q4_mma_{}", O::SUFFIX)
                },
                lanes: 32,
                rows_per_block: MMA_ROWS * mma_groups(k),
            };
            ((32 * MMA_WARPS) as u32, mma_smem(k) as u32)
        } else {
            (GEMV_THREADS as u32, 0)
        };
        let (xd, ni, ki, gi, li) = (
            int(OP, "x_div", x_div)?,
            int(OP, "n", n)?,
            int(OP, "k", k)?,
            int(OP, "group", group)?,
            plan.lanes as i32,
        );
        let kernel = self.kernel(&plan.kernel)?;
        let xt = input.x_tail(OP)?;
        let mut b = self.grouped_launch(kernel, [w_ptrs, s_ptrs], x, (&xd, &xt), groups, y);
        b.arg(&ni).arg(&ki).arg(&gi).arg(&li);
        let grid = (
            grid_u32(OP, n.div_ceil(plan.rows_per_block))?,
            max_tiles as u32,
            1,
        );
        // SAFETY: argument types match the kernel; x, perm, tiles, y and table lengths and the shape
        // rules checked above; perm holds pair numbers below n_pairs (written by moe_sort), so x rows
        // p / x_div < x_rows and y rows p < n_pairs; word and scale addresses come from the caller's
        // tables of live packed [n, k] weights of this scheme; the tensor-core kernel's shared memory
        // (MOE_TILE staged x rows) is checked above.
        unsafe { b.launch(cfg(grid, threads, smem)) }?;
        Ok(())
    }

    /// Starts a launch of a grouped expert kernel (`moe_gemv*`, `moe_gemm*`) with the arguments they
    /// all open with: the weight and scale address tables, `x` and its row divisor, the groups' `perm`
    /// and `tiles`, and `y`; the caller adds the kernel's shape arguments.
    pub(super) fn grouped_launch<'a, O>(
        &'a self,
        kernel: &'a Kernel,
        tables: [&'a impl DevicePtr<u64>; 2],
        x: &'a impl DevicePtr<bf16>,
        (x_div, x_tail): (&'a i32, &'a u32),
        groups: &'a PairGroups<'a, impl DevicePtr<u32>>,
        y: &'a mut impl DevicePtrMut<O>,
    ) -> Launch<'a> {
        let mut b = self.launch(kernel);
        b.ptr(tables[0])
            .ptr(tables[1])
            .ptr(x)
            .arg(x_div)
            .arg(x_tail)
            .ptr(groups.perm)
            .ptr(groups.tiles)
            .ptr_mut(y);
        b
    }

    /// `out[t, j] = Σ_c weights[t, c] · y[t·top_k + c, j]`, skipping pairs whose id is `≥ experts`,
    /// plus `sigmoid(gate[t]) · shared_y[t, j]` when `shared = (shared_y, gate)` is given (the shared
    /// expert, added before the one rounding; `gate` bf16 or the routing's f32 logits): its rows apart (`SharedY::Apart`, `[tokens, h]` bf16)
    /// or the f32 rows of `y` after the routed pairs' (`SharedY::AfterRouted`, pair
    /// `tokens·top_k + t`, as the grouped GEMV writes the shared expert's pairs). `y`:
    /// `[tokens·top_k, h]` f32 (`[tokens·(top_k + 1), h]` with `AfterRouted`); `gate`: `[tokens]`.
    /// `into`: the rows `out` (`[tokens, h]`; grid `(tokens, ceil(h / 512))` of 128 threads, 4
    /// columns a thread), or their residual add and the next norm in the same launch
    /// ([`CombineInto::AddNorm`]: a block a token).
    pub fn moe_combine<T: DevicePtrMut<bf16>>(
        &self,
        routed: &Routed<'_, impl DevicePtr<u32>, impl DevicePtr<f32>>,
        y: &impl DevicePtr<f32>,
        shared: Option<(SharedY<'_>, SharedGate<'_>)>,
        into: CombineInto<'_, T>,
        h: usize,
    ) -> Result<()> {
        let op = match into {
            CombineInto::Rows(_) => "moe_combine",
            CombineInto::AddNorm { .. } => "moe_combine_add_rms_norm",
        };
        let Routed {
            ids,
            weights,
            experts: e,
            top_k,
            tokens,
        } = *routed;
        let after = matches!(shared, Some((SharedY::AfterRouted, _)));
        check_len(
            op,
            "y",
            y,
            (tokens * top_k + if after { tokens } else { 0 }) * h,
        )?;
        check_len(op, "weights", weights, tokens * top_k)?;
        check_len(op, "ids", ids, tokens * top_k)?;
        match &into {
            CombineInto::Rows(out) => check_len(op, "out", *out, tokens * h)?,
            CombineInto::AddNorm { acc, w, normed, .. } => {
                check_len(op, "acc", *acc, tokens * h)?;
                check_len(op, "w", *w, h)?;
                check_len(op, "normed", *normed, tokens * h)?;
            }
        }
        if let Some((sy, sg)) = &shared {
            if let SharedY::Apart(sy) = sy {
                check_len(op, "shared_y", *sy, tokens * h)?;
            }
            match sg {
                SharedGate::Bf16(g) => check_len(op, "shared_gate", *g, tokens)?,
                SharedGate::F32 { logits, at } => {
                    check_len(op, "shared_gate logits", *logits, at + tokens)?
                }
            }
        }
        if tokens == 0 || h == 0 {
            return Ok(());
        }
        let s = self.stream();
        let (sy, _gsy) = match &shared {
            Some((SharedY::Apart(b), _)) => Some(b.device_ptr(s)),
            _ => None,
        }
        .unzip();
        let (sg, _gsg) = match &shared {
            Some((_, SharedGate::Bf16(b))) => Some(b.device_ptr(s)),
            _ => None,
        }
        .unzip();
        let (syp, sgp) = (sy.unwrap_or(0), sg.unwrap_or(0));
        let sg32 = match &shared {
            Some((_, SharedGate::F32 { logits, at })) => self.addr(*logits) + (4 * at) as u64,
            _ => 0,
        };
        // The f32 shared rows start after the routed pairs' rows of y.
        let sy32 = if after {
            self.addr(y) + (4 * tokens * top_k * h) as u64
        } else {
            0
        };
        let (ei, ki, hi) = (int(op, "e", e)?, int(op, "top_k", top_k)?, int(op, "h", h)?);
        // The token's weights and kept flags (then, fused, its combined row from a 16-byte boundary).
        let smem = match into {
            CombineInto::Rows(_) => 8 * top_k,
            CombineInto::AddNorm { .. } => 16 * top_k.div_ceil(2) + 2 * h,
        };
        ensure(smem <= 48 * 1024, op, || {
            format!("top_k = {top_k} and h = {h} exceed shared memory")
        })?;
        let (eps, offset) = match &into {
            CombineInto::AddNorm { eps, offset, .. } => (*eps, *offset),
            CombineInto::Rows(_) => (0.0, 0.0),
        };
        let mut b = self.launch(self.kernel(op)?);
        b.ptr(y)
            .ptr(weights)
            .ptr(ids)
            .arg(&ei)
            .arg(&syp)
            .arg(&sy32)
            .arg(&sgp)
            .arg(&sg32);
        let (grid, threads) = match into {
            CombineInto::Rows(out) => {
                b.ptr_mut(out).arg(&ki).arg(&hi);
                let blocks = grid_u32(op, h.div_ceil(4 * COMBINE_THREADS))?;
                ((grid_u32(op, tokens)?, blocks, 1), COMBINE_THREADS as u32)
            }
            CombineInto::AddNorm { acc, w, normed, .. } => {
                b.ptr_mut(acc)
                    .ptr(w)
                    .ptr_mut(normed)
                    .arg(&ki)
                    .arg(&hi)
                    .arg(&eps)
                    .arg(&offset);
                ((grid_u32(op, tokens)?, 1, 1), row_threads(h))
            }
        };
        // SAFETY: argument types match the kernel; lengths and shared memory checked above (the
        // fused kernel's block size is add_rms_norm_bf16's, as its sums' order needs).
        unsafe { b.launch(cfg(grid, threads, smem as u32)) }?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::mma_groups;

    #[test]
    fn short_rows_give_a_block_several_row_groups() {
        // The 80B's down projection (k 512: a span a warp) 4 row groups, the 125B's (k 768) 2,
        // gate|up rows (k 2048, 2560) one.
        assert_eq!(mma_groups(512), 4);
        assert_eq!(mma_groups(768), 2);
        assert_eq!(mma_groups(2048), 1);
        assert_eq!(mma_groups(2560), 1);
        assert_eq!(mma_groups(128), 4);
        assert_eq!(mma_groups(1536), 1);
        assert_eq!(mma_groups(1024), 2);
    }
}
