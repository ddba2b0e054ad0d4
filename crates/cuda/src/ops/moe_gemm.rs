//! Routed experts as a grouped GEMM on tensor cores (`kernels/moe_gemm.cu`), for steps with many
//! (token, expert) pairs: [`Gpu::moe_gemm_plan`] groups the pairs by expert into tiles of at most
//! [`Gpu::MOE_GEMM_TILE`] pairs, and [`Gpu::moe_gemm`] multiplies each tile's gathered input rows by
//! its expert's weight (bf16 values, packed INT4/INT6/INT8 words with f32 scales, or FP8 bytes with
//! block scales ([`Gpu::moe_gemm_fp8`]), through the same address tables as the grouped GEMV) with
//! `mma.sync`, f32 accumulation, each scale group's partial product scaled in f32. The outputs are the grouped GEMV's: `y[p, :]` for pair `p`.
//! FP8 experts also run on the FP8 tensor cores ([`Gpu::moe_gemm_fp8_mma`], sm_89 and later): the
//! input rows quantised per row and 128 columns, e4m3 times e4m3, as the format's dynamic scheme does.
//!
//! The grouped GEMV ([`Gpu::moe_gemv`], [`Gpu::moe_gemv_packed`]) decodes every weight on the CUDA
//! cores once per tile of at most 8 pairs; the GEMM reads each chosen expert's weight once per 64 pairs
//! and does the arithmetic on tensor cores, so it runs near the weight-streaming bound. Decode steps
//! keep the GEMV (see [`Gpu::moe_gemm_wanted`]).

use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{DevicePtr, DevicePtrMut};
use half::bf16;

use super::fp8::Fp8Experts;
use super::moe::{Experts, Grouping, MoeOut, PairGroups, PairRows};
use crate::error::{ensure, Result};
use crate::gpu::{cfg, check_len, grid_u32, int, Gpu};

/// Weight rows per block (`MG_BM`).
const BM: usize = 128;
/// k per pipeline stage (`MG_KC`).
const KC: usize = 64;
/// Shared bytes of one input row of a stage (`MG_XROW`).
const XROW: usize = 144;
/// The FP8 tensor-core kernels' shared bytes of one 64-byte row (weights or quantised inputs) of a
/// stage (`MG_QROW`), their stages (`MG_QSTAGES`) and the columns of a scale block.
const QROW: usize = 80;
const QSTAGES: usize = 4;
const QBLOCK: usize = 128;

/// The weights of one grouped-GEMM launch: bf16 values, packed words (`bits`, scale `group`: 0 per
/// row), or FP8 bytes with block scales of `group` columns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum GemmFormat {
    Bf16,
    Packed { bits: u32, group: usize },
    Fp8 { group: usize },
}

impl GemmFormat {
    /// `(shared bytes per weight row of a stage, stages)`, as `MgFmt` in the kernel.
    fn layout(self) -> (usize, usize) {
        match self {
            Self::Bf16 => (144, 3),
            Self::Packed { bits: 4, .. } => (32, 4),
            Self::Packed { bits: 6, .. } => (48, 4),
            Self::Packed { .. } | Self::Fp8 { .. } => (80, 3),
        }
    }

    /// The scale group the kernel takes (`k` for per-row scales and bf16).
    fn group(self, k: usize) -> usize {
        match self {
            Self::Packed { group, .. } | Self::Fp8 { group } if group > 0 => group,
            _ => k,
        }
    }

    fn kernel(self, suffix: &str) -> String {
        match self {
            Self::Bf16 => format!("moe_gemm_bf16_{suffix}"),
            Self::Packed { bits, .. } => format!("moe_gemm_q{bits}_{suffix}"),
            Self::Fp8 { .. } => format!("moe_gemm_f8_{suffix}"),
        }
    }

    /// Whether the kernel takes this format with `k` inputs: `k % 64 == 0`, bits 4, 6 or 8, a scale
    /// group of 16, 32, a multiple of 64, or per row (packed only).
    fn supports(self, k: usize) -> bool {
        let group_ok = |g: usize| g == 16 || g == 32 || g.is_multiple_of(KC);
        k > 0
            && k.is_multiple_of(KC)
            && match self {
                Self::Bf16 => true,
                Self::Packed { bits, group } => {
                    matches!(bits, 4 | 6 | 8) && (group == 0 || group_ok(group))
                }
                Self::Fp8 { group } => group > 0 && group_ok(group),
            }
    }
}

impl Gpu {
    /// Pairs per tile of the grouped GEMM (`MG_TILE`).
    pub const MOE_GEMM_TILE: usize = 64;
    /// Fewest (token, expert) pairs for which the backend takes the grouped GEMM. Measured on an H200
    /// at the Qwen3-Next-80B expert shape (INT4 g128, 512 experts, top 10; `bench_moe_gemm`): 640 pairs
    /// take 726 µs in the GEMM against 386 µs in the grouped GEMV, 5,120 pairs 1,028 µs against
    /// 1,201 µs; a line through each pair of points crosses at about 3,600 pairs.
    pub const MOE_GEMM_MIN_PAIRS: usize = 4096;
    /// Most tokens of a step that keeps the grouped GEMV (the decode batch sizes).
    pub const MOE_GEMM_MAX_GEMV_TOKENS: usize = 8;

    /// Whether a step of `tokens` tokens and `pairs` pairs takes the grouped GEMM: more than
    /// [`Gpu::MOE_GEMM_MAX_GEMV_TOKENS`] tokens and at least [`Gpu::MOE_GEMM_MIN_PAIRS`] pairs. It
    /// depends on the step's shape only (never on the routing), so a recorded step replays the same
    /// launches.
    pub fn moe_gemm_wanted(tokens: usize, pairs: usize) -> bool {
        tokens > Self::MOE_GEMM_MAX_GEMV_TOKENS && pairs >= Self::MOE_GEMM_MIN_PAIRS
    }

    /// Whether [`Gpu::moe_gemm`] serves weights of `scheme` (`None`: bf16; `Some((bits, group_size))`
    /// packed, `group_size` 0 for per-row scales) with `k` inputs: `k % 64 == 0`, bits 4, 6 or 8, and
    /// a group of 16, 32, a multiple of 64, or per row.
    pub fn moe_gemm_supports(scheme: Option<(u32, usize)>, k: usize) -> bool {
        match scheme {
            None => GemmFormat::Bf16,
            Some((bits, group)) => GemmFormat::Packed { bits, group },
        }
        .supports(k)
    }

    /// Whether [`Gpu::moe_gemm_fp8`] serves FP8 experts with blocks of `group` columns and `k` inputs:
    /// `k % 64 == 0` and a group of 16, 32 or a multiple of 64.
    pub fn moe_gemm_fp8_supports(group: usize, k: usize) -> bool {
        GemmFormat::Fp8 { group }.supports(k)
    }

    /// The most tiles `n_pairs` pairs over `e` experts can need: each non-empty expert adds at most one
    /// partial tile.
    pub fn moe_gemm_max_tiles(n_pairs: usize, e: usize) -> usize {
        n_pairs
            .min(n_pairs.div_ceil(Self::MOE_GEMM_TILE) + e.min(n_pairs))
            .max(1)
    }

    /// Groups `n_pairs` expert ids (`ids`, each `< e`; others are dropped) by expert: `perm`
    /// `[n_pairs]` lists pair numbers expert after expert (as [`Gpu::moe_sort`]), `tiles`
    /// `[max_tiles, 3]` holds `(expert, start in perm, count ≤ MOE_GEMM_TILE)` with an unused tail
    /// of count 0, where `max_tiles = Gpu::moe_gemm_max_tiles(n_pairs, e)`.
    pub fn moe_gemm_plan(
        &self,
        ids: &impl DevicePtr<u32>,
        n_pairs: usize,
        e: usize,
        perm: &mut impl DevicePtrMut<u32>,
        tiles: &mut impl DevicePtrMut<u32>,
    ) -> Result<()> {
        const OP: &str = "moe_gemm_plan";
        ensure(e > 0 && 8 * e <= 46 * 1024, OP, || {
            format!("{e} experts do not fit shared memory")
        })?;
        let grouping = Grouping {
            op: OP,
            kernel: "moe_gemm_plan",
            e,
            max_tiles: Self::moe_gemm_max_tiles(n_pairs, e),
            smem: 8 * e,
        };
        // Shared memory: 2·e u32 (8·e bytes), checked above.
        self.group_pairs(grouping, ids, n_pairs, perm, tiles)
    }

    /// For every tile `(x, start, count)` of `groups.tiles` (from [`Gpu::moe_gemm_plan`]) and each
    /// pair `p = perm[start + m]` of it: `y[p, :] = W_x · x[p / div, :]`, `W_x` the `[n, k]` weight of
    /// expert `x`: bf16 values at `weights[x]` (`scheme` `None`; `scales` is not read) or packed words
    /// at `weights[x]` with f32 scales at `scales[x]` (the layout of [`Gpu::moe_gemv_packed`]). Needs
    /// [`Gpu::moe_gemm_supports`]`(scheme, k)`, 16-byte aligned weights and `x`; the caller builds the
    /// tables from live weights of that scheme and shape.
    pub fn moe_gemm<O: MoeOut>(
        &self,
        experts: &Experts<'_, impl DevicePtr<u64>>,
        input: &PairRows<'_, impl DevicePtr<bf16>>,
        groups: &PairGroups<'_, impl DevicePtr<u32>>,
        y: &mut impl DevicePtrMut<O>,
    ) -> Result<()> {
        let format = match experts.scheme {
            None => GemmFormat::Bf16,
            Some(s) => GemmFormat::Packed {
                bits: s.bits,
                group: s.group_size,
            },
        };
        let w = (experts.weights, experts.scales, experts.n, experts.k);
        self.moe_gemm_launch(format, w, input, groups, y)
    }

    /// [`Gpu::moe_gemm`] for FP8 experts (`Fp8Experts`: bytes and per-row block scales, the layout of
    /// [`Gpu::moe_gemv_fp8`]): each weight decoded exactly to bf16 in shared memory, the block scale
    /// applied in f32 to each group's partial product. Needs [`Gpu::moe_gemm_fp8_supports`]`(group, k)`.
    pub fn moe_gemm_fp8<O: MoeOut>(
        &self,
        experts: &Fp8Experts<'_, impl DevicePtr<u64>>,
        input: &PairRows<'_, impl DevicePtr<bf16>>,
        groups: &PairGroups<'_, impl DevicePtr<u32>>,
        y: &mut impl DevicePtrMut<O>,
    ) -> Result<()> {
        let format = GemmFormat::Fp8 {
            group: experts.group,
        };
        let w = (experts.bytes, experts.scales, experts.n, experts.k);
        self.moe_gemm_launch(format, w, input, groups, y)
    }

    /// Whether [`Gpu::moe_gemm_fp8_mma`] runs here for FP8 experts of `group`-column blocks and `k`
    /// inputs: FP8 `mma.sync` (compute capability 8.9 or later, [`GpuOptions::fp8_tensor_cores`](crate::GpuOptions::fp8_tensor_cores)
    /// on), blocks of 128 columns, `k % 128 == 0`.
    pub fn moe_gemm_fp8_mma_supports(&self, group: usize, k: usize) -> bool {
        self.fp8_tc
            && self.info().compute_capability >= (8, 9)
            && group == QBLOCK
            && k > 0
            && k.is_multiple_of(QBLOCK)
    }

    /// [`Gpu::moe_gemm_fp8`] on the FP8 tensor cores, as the format's dynamic scheme computes it: the
    /// input rows quantised per row and 128 columns (`input.x` the e4m3 bytes `[rows, k]` and `scales`
    /// `[k / 128][rows]`, as [`Gpu::quant_f8_tokens`] writes them), multiplied as e4m3 with f32
    /// accumulation, each 128-column block's partial product scaled by its weight row's block scale
    /// times its input row's scale. Needs [`Gpu::moe_gemm_fp8_mma_supports`]`(group, k)`.
    pub fn moe_gemm_fp8_mma<O: MoeOut>(
        &self,
        experts: &Fp8Experts<'_, impl DevicePtr<u64>>,
        (input, scales): (&PairRows<'_, impl DevicePtr<u8>>, &impl DevicePtr<f32>),
        groups: &PairGroups<'_, impl DevicePtr<u32>>,
        y: &mut impl DevicePtrMut<O>,
    ) -> Result<()> {
        const OP: &str = "moe_gemm_fp8_mma";
        let (n, k, x_rows) = (experts.n, experts.k, input.rows);
        let (perm, tiles, n_pairs) = (groups.perm, groups.tiles, groups.n_pairs);
        ensure(self.moe_gemm_fp8_mma_supports(experts.group, k), OP, || {
            let (major, minor) = self.info().compute_capability;
            format!(
                "FP8 experts of {}-column blocks with k = {k} on sm_{major}{minor}: need sm_89 or \
                 later (FP8 tensor cores on), blocks of 128 columns and k % 128 == 0",
                experts.group
            )
        })?;
        ensure(
            input.div >= 1 && input.rows_needed(n_pairs) <= x_rows,
            OP,
            || {
                format!(
                    "{n_pairs} pairs over x_div {} need more than {x_rows} rows of x",
                    input.div
                )
            },
        )?;
        let e = experts.bytes.len();
        check_len(OP, "s_ptrs", experts.scales, e)?;
        let max_tiles = Self::moe_gemm_max_tiles(n_pairs, e);
        check_len(OP, "x", input.x, x_rows * k)?;
        check_len(OP, "scales", scales, x_rows * (k / QBLOCK))?;
        if !groups.check_launch(OP, max_tiles, y, n)? {
            return Ok(());
        }
        ensure(self.addr(input.x).is_multiple_of(16), OP, || {
            "x must be 16-byte aligned".into()
        })?;
        let smem = QSTAGES * (BM * QROW + Self::MOE_GEMM_TILE * QROW + BM * 4);
        let f = self.kernel(&format!("moe_gemm_f8q_{}", O::SUFFIX))?;
        // Above the default 48 KiB of dynamic shared memory (opted in, as moe_gemm_launch does).
        f.set_attribute(
            CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            smem as i32,
        )?;
        let (xr, xd, ni, ki) = (
            int(OP, "x rows", x_rows)?,
            int(OP, "x_div", input.div)?,
            int(OP, "n", n)?,
            int(OP, "k", k)?,
        );
        let xt = input.x_tail(OP)?;
        let mut b = self.launch(f);
        b.ptr(experts.bytes)
            .ptr(experts.scales)
            .ptr(input.x)
            .ptr(scales)
            .arg(&xr)
            .arg(&xd)
            .arg(&xt)
            .ptr(perm)
            .ptr(tiles)
            .ptr_mut(y)
            .arg(&ni)
            .arg(&ki);
        let grid = (grid_u32(OP, n.div_ceil(BM))?, max_tiles as u32, 1);
        // SAFETY: argument types match the kernel; x, scales, perm, tiles, y and table lengths and the
        // shape rules checked above (the device has FP8 MMA); perm holds pair numbers below n_pairs
        // (written by moe_gemm_plan), so x rows stay below x_rows and y rows below n_pairs; weight and
        // scale addresses come from the caller's tables of live FP8 [n, k] weights with [n, k / 128]
        // scales; shared memory opted in above.
        unsafe { b.launch(cfg(grid, 256, smem as u32)) }?;
        Ok(())
    }

    /// One grouped-GEMM launch over the address tables `(weights, scales)` of `[n, k]` weights.
    fn moe_gemm_launch<O: MoeOut, P: DevicePtr<u64>>(
        &self,
        format: GemmFormat,
        (w_ptrs, s_ptrs, n, k): (&P, &P, usize, usize),
        input: &PairRows<'_, impl DevicePtr<bf16>>,
        groups: &PairGroups<'_, impl DevicePtr<u32>>,
        y: &mut impl DevicePtrMut<O>,
    ) -> Result<()> {
        const OP: &str = "moe_gemm";
        let (x, x_rows, x_div) = (input.x, input.rows, input.div);
        let n_pairs = groups.n_pairs;
        ensure(format.supports(k), OP, || {
            format!(
                "weights {format:?} with k = {k}: need k % 64 == 0, bits 4, 6 or 8 and a group of \
                 16, 32, a multiple of 64 or per row"
            )
        })?;
        ensure(
            x_div >= 1 && input.rows_needed(n_pairs) <= x_rows,
            OP,
            || format!("{n_pairs} pairs over x_div {x_div} need more than {x_rows} rows of x"),
        )?;
        let e = w_ptrs.len();
        let scaled = format != GemmFormat::Bf16;
        if scaled {
            check_len(OP, "s_ptrs", s_ptrs, e)?;
        }
        let max_tiles = Self::moe_gemm_max_tiles(n_pairs, e);
        check_len(OP, "x", x, x_rows * k)?;
        if !groups.check_launch(OP, max_tiles, y, n)? {
            return Ok(());
        }
        let group = format.group(k);
        let spc = if group < KC { KC / group } else { 1 };
        let (srow, stages) = format.layout();
        let scale_bytes = if scaled { BM * 4 * spc } else { 0 };
        let smem = stages * (BM * srow + Self::MOE_GEMM_TILE * XROW + scale_bytes);
        let f = self.kernel(&format.kernel(O::SUFFIX))?;
        // Above the default 48 KiB of dynamic shared memory a kernel must opt in (a host-side attribute
        // of the function, no stream operation); every layout is below the 99 KiB of sm_86.
        f.set_attribute(
            CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            smem as i32,
        )?;
        ensure(self.addr(x).is_multiple_of(16), OP, || {
            "x must be 16-byte aligned".into()
        })?;
        let (xd, ni, ki, gi, si) = (
            int(OP, "x_div", x_div)?,
            int(OP, "n", n)?,
            int(OP, "k", k)?,
            int(OP, "group", group)?,
            int(OP, "spc", spc)?,
        );
        let xt = input.x_tail(OP)?;
        let mut b = self.grouped_launch(f, [w_ptrs, s_ptrs], x, (&xd, &xt), groups, y);
        b.arg(&ni).arg(&ki).arg(&gi).arg(&si);
        let grid = (grid_u32(OP, n.div_ceil(BM))?, max_tiles as u32, 1);
        // SAFETY: argument types match the kernel; x, perm, tiles, y and table lengths and the shape
        // rules checked above; perm holds pair numbers below n_pairs (written by moe_gemm_plan), so x
        // rows p / x_div < x_rows and y rows p < n_pairs; weight (and scale) addresses come from the
        // caller's tables of live [n, k] weights of this scheme; shared memory opted in above.
        unsafe { b.launch(cfg(grid, 256, smem as u32)) }?;
        Ok(())
    }
}
