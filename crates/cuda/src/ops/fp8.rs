//! Block-scaled FP8 weights consumed as their bytes (`kernels/fp8.cu`): a weight `[n, k]` is `n` rows
//! of `k` float8_e4m3fn bytes and f32 scales `[n, ceil(k / group)]`, the checkpoint's block scales
//! repeated per row, exactly as `sanmai_weights::fp8::packed` lays them out (upload its
//! `packed_bytes()` and `scales`). The weight is `fp8(q) · scale[row, j / group]`, decoded exactly.
//!
//! - Decode: [`Gpu::gemv_fp8`] / [`Gpu::gemv_fp8_f32`] / [`Gpu::gemv_fp8_many`],
//!   `y[m, :] = W · x[m, :]` for 1 ≤ m ≤ 8: one byte a weight, read once for every row of x, each
//!   16-value chunk's dot product times its block scale in f32, one rounding per output. Batches of
//!   2..8 rows with `k` and the group whole k-blocks of 64 run on the tensor cores (the weights decoded
//!   exactly to bf16), others on the FMA GEMV.
//! - Prefill: [`Gpu::gemm_fp8`] dequantises W tile by tile into a caller-owned bf16 workspace
//!   ([`Gpu::dequant_fp8`], `bf16(fp8 · scale)`) and multiplies each tile with cuBLAS.
//! - Routed experts: [`Gpu::moe_gemv_fp8`], the grouped GEMV of `ops::moe` over FP8 experts.
//!
//! Shape rules (errors, never panics, see [`fp8_fits`]): `k % 16 == 0`, `group % 16 == 0`; weights
//! and x 16-byte aligned.

use cudarc::cublas::sys;
use cudarc::driver::{DevicePtr, DevicePtrMut};
use half::bf16;

use super::gemm::WxT;
use super::gemv::{gemv_plan, SegAddrs, SegTable, GEMV_SEGS, GEMV_THREADS};
use super::moe::{moe_max_tiles, MoeOut, PairGroups, PairRows, MOE_TILE};
use crate::error::{ensure, Result};
use crate::gpu::{cfg, check_len, grid_u32, int, Gpu};

/// Most rows of W one row slot of the FP8 GEMV of `m` rows of x owns (`gemv_f8_segs<M, R, ..>` in
/// fp8.cu: 2 up to m = 4, 1 beyond).
fn f8_rows(m: usize) -> usize {
    if m <= 4 {
        2
    } else {
        1
    }
}
/// Whether an FP8 GEMV of `m` rows of x runs on the tensor cores (`gemv_f8_tc*`): 2..=8 rows, `k` whole
/// k-blocks of 64 values and groups of whole k-blocks. Depends on the shape alone.
fn tensor_core_fp8(group: usize, m: usize, k: usize) -> bool {
    (2..=8).contains(&m) && k.is_multiple_of(64) && group.is_multiple_of(64)
}

/// Rows of W a tensor-core FP8 GEMV block owns.
const TC_ROWS: usize = 16;

/// Threads per block of the grouped FP8 GEMV.
const MOE_THREADS: usize = 256;

/// Whether the FP8 kernels take a `[_, k]` weight whose scales cover `group` inputs: whole 16-byte
/// chunks of a row, each inside one group.
/// The rule lives with the format (`sanmai_weights::fp8::device_fits`) so a plan made without a GPU
/// counts the same bytes.
pub fn fp8_fits(group: usize, k: usize) -> bool {
    sanmai_weights::fp8::device_fits(group, k)
}

/// An FP8 weight `[n, k]` as the kernels read it: `n·k` bytes and `n · ceil(k / group)` scales.
pub struct Fp8Mat<'a, W: DevicePtr<u8>, S: DevicePtr<f32>> {
    pub bytes: &'a W,
    pub scales: &'a S,
    pub group: usize,
    pub n: usize,
    pub k: usize,
}

/// One weight of a many-weight FP8 GEMV ([`Gpu::gemv_fp8_many`]): `(W, scales, y, n)`.
pub type Fp8Part<'a, W, S, Y> = (&'a W, &'a S, &'a mut Y, usize);

/// One projection of every routed expert in FP8, through device tables of addresses (one entry per
/// expert): `bytes[x]` the expert's `[n, k]` bytes, `scales[x]` its `[n, ceil(k / group)]` scales.
pub struct Fp8Experts<'a, P: DevicePtr<u64>> {
    pub bytes: &'a P,
    pub scales: &'a P,
    pub group: usize,
    pub n: usize,
    pub k: usize,
}

/// Checks the shape rules and the lengths of an FP8 weight's `(bytes, scales)`.
fn check_fp8(
    op: &'static str,
    (w, s): (&impl DevicePtr<u8>, &impl DevicePtr<f32>),
    group: usize,
    n: usize,
    k: usize,
) -> Result<()> {
    ensure(fp8_fits(group, k), op, || {
        format!("k = {k}, group = {group}: FP8 weights need both multiples of 16")
    })?;
    check_len(op, "W", w, n * k)?;
    check_len(op, "scales", s, n * k.div_ceil(group))
}

/// The grouped FP8 GEMV's cut for `n_pairs` pairs over `e` experts of `k` inputs: the kernel, lanes
/// per row and rows per block (mirrors `moe_gemv_f8_*` in fp8.cu: RPG 2 and D 2 for the `_m1` forms,
/// RPG 2 and D 1 otherwise; a unit is 16 values).
fn moe_f8_plan(suffix: &str, n_pairs: usize, e: usize, k: usize) -> (String, usize, usize) {
    let decode = n_pairs <= 4 * e;
    let (rpg, d) = if decode { (2, 2) } else { (2, 1) };
    let lanes = (k / 16).div_ceil(d).next_power_of_two().clamp(8, 32);
    let kernel = if decode {
        format!("moe_gemv_f8_{suffix}_m1")
    } else {
        format!("moe_gemv_f8_{suffix}")
    };
    (kernel, lanes, MOE_THREADS / lanes * rpg)
}

impl Gpu {
    /// `y[m, :] = W · x[m, :]`: W FP8 `[n, k]` (see the module doc), `x` `[m, k]` bf16, `y` `[m, n]`
    /// bf16, `1 ≤ m ≤ 8`.
    pub fn gemv_fp8(
        &self,
        w: &Fp8Mat<'_, impl DevicePtr<u8>, impl DevicePtr<f32>>,
        x: &impl DevicePtr<bf16>,
        y: &mut impl DevicePtrMut<bf16>,
        m: usize,
    ) -> Result<()> {
        let part = (w.bytes, w.scales, y, w.n);
        self.gemv_f8("", w.group, x, &mut [part], m, w.k)
    }

    /// As [`Gpu::gemv_fp8`] with an f32 output.
    pub fn gemv_fp8_f32(
        &self,
        w: &Fp8Mat<'_, impl DevicePtr<u8>, impl DevicePtr<f32>>,
        x: &impl DevicePtr<bf16>,
        y: &mut impl DevicePtrMut<f32>,
        m: usize,
    ) -> Result<()> {
        let part = (w.bytes, w.scales, y, w.n);
        self.gemv_f8("_f32", w.group, x, &mut [part], m, w.k)
    }

    /// [`Gpu::gemv_fp8`] for up to `GEMV_SEGS` (4) FP8 weights of one `group` that read the same `x`
    /// (`[m, k]`), in one launch: each part's `y` gets what its own [`Gpu::gemv_fp8`] computes.
    pub fn gemv_fp8_many<W: DevicePtr<u8>, S: DevicePtr<f32>, Y: DevicePtrMut<bf16>>(
        &self,
        group: usize,
        x: &impl DevicePtr<bf16>,
        parts: &mut [Fp8Part<'_, W, S, Y>],
        m: usize,
        k: usize,
    ) -> Result<()> {
        self.gemv_f8("", group, x, parts, m, k)
    }

    fn gemv_f8<O, W: DevicePtr<u8>, S: DevicePtr<f32>, Y: DevicePtrMut<O>>(
        &self,
        suffix: &str,
        group: usize,
        x: &impl DevicePtr<bf16>,
        parts: &mut [Fp8Part<'_, W, S, Y>],
        m: usize,
        k: usize,
    ) -> Result<()> {
        const OP: &str = "gemv_fp8";
        ensure((1..=8).contains(&m), OP, || {
            format!("m = {m} rows, expected 1..=8")
        })?;
        ensure(parts.len() <= GEMV_SEGS, OP, || {
            format!("{} weights, at most {GEMV_SEGS} a launch", parts.len())
        })?;
        for (w, sc, y, n) in parts.iter() {
            check_fp8(OP, (*w, *sc), group, *n, k)?;
            check_len(OP, "y", &**y, m * n)?;
        }
        check_len(OP, "x", x, m * k)?;
        ensure(self.addr(x).is_multiple_of(16), OP, || {
            "x must be 16-byte aligned".into()
        })?;
        let (ki, gi, mi) = (int(OP, "k", k)?, int(OP, "group", group)?, int(OP, "m", m)?);
        let tc = tensor_core_fp8(group, m, k);
        let sms = self.info().multiprocessors as usize;
        let s = self.stream();
        let mut table = SegTable::new();
        let mut guards = Vec::with_capacity(3 * parts.len());
        for (w, sc, y, n) in parts.iter_mut().filter(|p| p.3 > 0) {
            let (wp, gw) = w.device_ptr(s);
            let (sp, gs) = sc.device_ptr(s);
            let (yp, gy) = y.device_ptr_mut(s);
            guards.extend([gw, gs, gy]);
            ensure(wp % 16 == 0, OP, || "W must be 16-byte aligned".into())?;
            let addrs = SegAddrs {
                w: wp,
                s: sp,
                y: yp,
            };
            if tc {
                table.push(OP, addrs, *n, n.div_ceil(TC_ROWS), None)?;
            } else {
                // Work items of a row: 16-byte chunks.
                let plan = gemv_plan(*n, k / 16, f8_rows(m), sms);
                table.push(OP, addrs, *n, plan.blocks, Some(plan))?;
            }
        }
        let grid = table.grid(OP)?;
        if grid == 0 {
            return Ok(());
        }
        if tc {
            let mut b = self.launch(self.kernel(&format!("gemv_f8_tc{suffix}"))?);
            b.arg(table.segs()).ptr(x).arg(&ki).arg(&gi).arg(&mi);
            // SAFETY: argument types match the kernel; every segment's lengths and alignment and the
            // tensor-core k and group rules (tensor_core_fp8) checked above; 2 ≤ m ≤ 8; each segment's
            // blocks cover its n in tiles of 16 rows.
            unsafe { b.launch(cfg((grid, 1, 1), GEMV_THREADS as u32, 0)) }?;
        } else {
            let mut b = self.launch(self.kernel(&format!("gemv_f8{suffix}_m{m}"))?);
            b.arg(table.segs()).ptr(x).arg(&ki).arg(&gi);
            // SAFETY: argument types match the kernel; every segment's lengths and alignment and the k
            // and group rules checked above; each segment's plan has rps ≤ f8_rows(m), slots of at most
            // the block and blocks covering its n.
            unsafe { b.launch(cfg((grid, 1, 1), GEMV_THREADS as u32, 0)) }?;
        }
        drop(guards);
        Ok(())
    }

    /// Rows `[row0, row0 + rows)` of W as bf16 (`bf16(fp8 · scale)`) into `out` (`[rows, k]`).
    pub fn dequant_fp8(
        &self,
        w: &Fp8Mat<'_, impl DevicePtr<u8>, impl DevicePtr<f32>>,
        out: &mut impl DevicePtrMut<bf16>,
        row0: usize,
        rows: usize,
    ) -> Result<()> {
        const OP: &str = "dequant_fp8";
        let (n, k, group) = (w.n, w.k, w.group);
        check_fp8(OP, (w.bytes, w.scales), group, n, k)?;
        ensure(row0 + rows <= n, OP, || {
            format!("rows {row0}..{} past n = {n}", row0 + rows)
        })?;
        check_len(OP, "out", out, rows * k)?;
        if rows == 0 {
            return Ok(());
        }
        ensure(
            self.addr(w.bytes).is_multiple_of(16) && self.addr_mut(out).is_multiple_of(16),
            OP,
            || "W and out must be 16-byte aligned".into(),
        )?;
        let grid = grid_u32(OP, (rows * (k / 16)).div_ceil(256))?;
        let (r0, ri, ki, gi) = (
            int(OP, "row0", row0)?,
            int(OP, "rows", rows)?,
            int(OP, "k", k)?,
            int(OP, "group", group)?,
        );
        let mut b = self.launch(self.kernel("dequant_f8")?);
        b.ptr(w.bytes)
            .ptr(w.scales)
            .ptr_mut(out)
            .arg(&r0)
            .arg(&ri)
            .arg(&ki)
            .arg(&gi);
        // SAFETY: argument types match the kernel; W, scales and out lengths, the row range and the
        // alignment checked above.
        unsafe { b.launch(cfg((grid, 1, 1), 256, 0)) }?;
        Ok(())
    }

    /// `y[m, n] = x[m, k] · Wᵀ` for prefill: W FP8 `[n, k]`, bf16 in and out, f32 accumulation. W is
    /// dequantised `ws.len() / k` rows at a time into `ws` (bf16, caller owned, at least `k`
    /// elements) and each tile multiplied by cuBLAS into its columns of y.
    pub fn gemm_fp8(
        &self,
        x: &impl DevicePtr<bf16>,
        w: &Fp8Mat<'_, impl DevicePtr<u8>, impl DevicePtr<f32>>,
        y: &mut impl DevicePtrMut<bf16>,
        ws: &mut impl DevicePtrMut<bf16>,
        m: usize,
    ) -> Result<()> {
        const OP: &str = "gemm_fp8";
        let (n, k) = (w.n, w.k);
        check_fp8(OP, (w.bytes, w.scales), w.group, n, k)?;
        check_len(OP, "x", x, m * k)?;
        check_len(OP, "y", y, m * n)?;
        let tile = (ws.len() / k).min(n);
        ensure(tile > 0 || n == 0, OP, || {
            format!("workspace of {} elements holds no row of k = {k}", ws.len())
        })?;
        if m == 0 || n == 0 {
            return Ok(());
        }
        let (mi, ni, ki) = (int(OP, "m", m)?, int(OP, "n", n)?, int(OP, "k", k)?);
        let mut row0 = 0;
        while row0 < n {
            let rows = tile.min(n - row0);
            self.dequant_fp8(w, &mut *ws, row0, rows)?;
            let s = self.stream();
            let (xp, _gx) = x.device_ptr(s);
            let (wsp, _gws) = ws.device_ptr_mut(s);
            let (yp, _gy) = y.device_ptr_mut(s);
            let p = WxT {
                rows: int(OP, "rows", rows)?,
                m: mi,
                k: ki,
                w: wsp,
                x: xp,
                y: yp + (row0 * 2) as u64,
                y_type: sys::cudaDataType::CUDA_R_16BF,
                ldy: ni,
            };
            // Columns row0..row0 + rows of y (ld n) = x · tileᵀ.
            // SAFETY: the tile holds rows·k elements, x m·k, y's columns row0..row0 + rows of m rows
            // with ld n lie inside the checked m·n; every buffer is used on this stream.
            unsafe { self.blas_w_xt(p) }?;
            row0 += rows;
        }
        Ok(())
    }

    /// The grouped GEMV of routed experts ([`Gpu::moe_gemv`](crate::Gpu::moe_gemv)'s contract) over
    /// FP8 experts: for every tile `(x, start, count)` of `groups.tiles` and each of its pairs
    /// `p = perm[start + m]`, `y[p, :] = W_x · input.x[p / div, :]`, `W_x` the FP8 `[n, k]` weight at
    /// `experts.bytes[x]` with scales at `experts.scales[x]`. The caller builds the tables from live
    /// weights of this shape and group. The launch depends on the shapes alone.
    pub fn moe_gemv_fp8<O: MoeOut>(
        &self,
        experts: &Fp8Experts<'_, impl DevicePtr<u64>>,
        input: &PairRows<'_, impl DevicePtr<bf16>>,
        groups: &PairGroups<'_, impl DevicePtr<u32>>,
        y: &mut impl DevicePtrMut<O>,
    ) -> Result<()> {
        self.moe_gemv_fp8_with(experts, input, groups, y, false)
    }

    /// Whether [`Gpu::moe_gemv_fp8_swiglu`] takes FP8 experts with rows of `k` values: a tile's
    /// SwiGLU rows (`MOE_TILE · k` bf16) fit the default 48 KiB of shared memory.
    pub fn moe_gemv_fp8_fuses_swiglu(k: usize) -> bool {
        MOE_TILE * k * 2 <= 48 * 1024
    }

    /// The down projection of FP8 experts with the SwiGLU activation fused into its input: as
    /// [`Gpu::moe_gemv_fp8`] over pair rows (`div` 1) with input row `p` = `bf16(silu(g) · u)` of
    /// `gate_up[p] = [g | u]` (`gate_up.x`: `[rows, 2k]` bf16, computed as `swiglu` computes it, so
    /// the result is the unfused pair's), each block staging its tile's rows in shared memory. Only
    /// where [`Gpu::moe_gemv_fp8_fuses_swiglu`] holds.
    pub fn moe_gemv_fp8_swiglu(
        &self,
        experts: &Fp8Experts<'_, impl DevicePtr<u64>>,
        gate_up: &PairRows<'_, impl DevicePtr<bf16>>,
        groups: &PairGroups<'_, impl DevicePtr<u32>>,
        y: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        let k = experts.k;
        ensure(
            Self::moe_gemv_fp8_fuses_swiglu(k),
            "moe_gemv_fp8_swiglu",
            || format!("k = {k}: a tile's SwiGLU rows do not fit shared memory"),
        )?;
        ensure(gate_up.div == 1, "moe_gemv_fp8_swiglu", || {
            "the down projection reads pair rows (div 1)".into()
        })?;
        self.moe_gemv_fp8_with(experts, gate_up, groups, y, true)
    }

    fn moe_gemv_fp8_with<O: MoeOut>(
        &self,
        experts: &Fp8Experts<'_, impl DevicePtr<u64>>,
        input: &PairRows<'_, impl DevicePtr<bf16>>,
        groups: &PairGroups<'_, impl DevicePtr<u32>>,
        y: &mut impl DevicePtrMut<O>,
        swiglu: bool,
    ) -> Result<()> {
        const OP: &str = "moe_gemv_fp8";
        let (n, k, group) = (experts.n, experts.k, experts.group);
        // The SwiGLU form reads gate|up rows twice as wide as the weight's k.
        let x_cols = if swiglu { 2 * k } else { k };
        let (x, x_rows, x_div) = (input.x, input.rows, input.div);
        let n_pairs = groups.n_pairs;
        ensure(fp8_fits(group, k), OP, || {
            format!("k = {k}, group = {group}: FP8 weights need both multiples of 16")
        })?;
        ensure(
            x_div >= 1 && input.rows_needed(n_pairs) <= x_rows,
            OP,
            || format!("{n_pairs} pairs over x_div {x_div} need more than {x_rows} rows of x"),
        )?;
        let e = experts.bytes.len();
        check_len(OP, "scale table", experts.scales, e)?;
        let max_tiles = moe_max_tiles(n_pairs, e);
        check_len(OP, "x", x, x_rows * x_cols)?;
        if !groups.check_launch(OP, max_tiles, y, n)? {
            return Ok(());
        }
        ensure(self.addr(x).is_multiple_of(16), OP, || {
            "x must be 16-byte aligned".into()
        })?;
        let (mut kernel, lanes, rows_per_block) = moe_f8_plan(O::SUFFIX, n_pairs, e, k);
        let smem = if swiglu {
            kernel.push_str("_swiglu");
            MOE_TILE * k * 2
        } else {
            0
        };
        let (xd, ni, ki, gi, li) = (
            int(OP, "x_div", x_div)?,
            int(OP, "n", n)?,
            int(OP, "k", k)?,
            int(OP, "group", group)?,
            lanes as i32,
        );
        let kernel = self.kernel(&kernel)?;
        let tables = [experts.bytes, experts.scales];
        let xt = input.x_tail(OP)?;
        let mut b = self.grouped_launch(kernel, tables, x, (&xd, &xt), groups, y);
        b.arg(&ni).arg(&ki).arg(&gi).arg(&li);
        let grid = (
            grid_u32(OP, n.div_ceil(rows_per_block))?,
            max_tiles as u32,
            1,
        );
        // SAFETY: argument types match the kernel; x, perm, tiles, y and table lengths and the shape
        // rules checked above; perm holds pair numbers below n_pairs, so x rows p / x_div < x_rows and
        // y rows p < n_pairs; byte and scale addresses come from the caller's tables of live FP8
        // [n, k] weights of this group; the SwiGLU form's shared memory holds MOE_TILE rows of k
        // (a tile's most pairs).
        unsafe { b.launch(cfg(grid, MOE_THREADS as u32, smem as u32)) }?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_the_fp8_kernels_take() {
        assert!(fp8_fits(128, 2048));
        assert!(fp8_fits(128, 160));
        assert!(fp8_fits(16, 16));
        assert!(!fp8_fits(128, 40));
        assert!(!fp8_fits(8, 64));
        assert!(!fp8_fits(0, 64));
        assert!(!fp8_fits(128, 0));
    }

    #[test]
    fn batches_of_whole_k_blocks_take_the_tensor_cores() {
        assert!(tensor_core_fp8(128, 2, 2048));
        assert!(tensor_core_fp8(128, 8, 512));
        assert!(!tensor_core_fp8(128, 1, 2048));
        assert!(!tensor_core_fp8(128, 9, 2048));
        assert!(!tensor_core_fp8(128, 4, 160));
        assert!(!tensor_core_fp8(16, 4, 256));
    }

    #[test]
    fn grouped_cut_follows_the_pairs_per_expert() {
        // Decode: one pair per expert on average, k = 2048 (128 units, 2 a lane: 64 → 32 lanes).
        assert_eq!(
            moe_f8_plan("bf16", 10, 512, 2048),
            ("moe_gemv_f8_bf16_m1".to_string(), 32, 16)
        );
        // k = 512: 32 units, 2 a lane → 16 lanes, 16 groups of 2 rows.
        assert_eq!(
            moe_f8_plan("f32", 10, 512, 512),
            ("moe_gemv_f8_f32_m1".to_string(), 16, 32)
        );
        // Prefill: 8 pairs per expert, RPG 2, D 1.
        assert_eq!(
            moe_f8_plan("f32", 4096, 8, 512),
            ("moe_gemv_f8_f32".to_string(), 32, 16)
        );
    }
}
