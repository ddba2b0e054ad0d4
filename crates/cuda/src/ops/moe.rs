//! Routed experts without a host round trip: the pairs (token, choice) are grouped by expert on the
//! device ([`Gpu::moe_sort`]), a grouped GEMV multiplies each tile of at most [`MOE_TILE`] pairs by
//! its expert's weight, found through a device table of expert weight addresses ([`Gpu::moe_gemv`]),
//! and [`Gpu::moe_combine`] sums each token's expert outputs with its routing weights. Only the chosen
//! experts' weights are read, each once per tile. Pair `p = token·top_k + choice`, the router's layout.
//! [`Gpu::moe_gemv_packed`] is the same grouped GEMV over packed integer experts (INT4/INT8
//! pack-quantized, INT6 gapless; see `ops::quant`), through tables of word and scale addresses.

use cudarc::driver::{DevicePtr, DevicePtrMut, DeviceRepr, PushKernelArg};
use half::bf16;

use crate::error::{ensure, Result};
use crate::gpu::{cfg, check_len, grid_u32, int, Gpu};

/// Pairs per tile of the grouped GEMV (`MOE_TILE` in `moe.cu`).
pub const MOE_TILE: usize = 8;
/// Weight rows per block of the grouped GEMV: 8 warps of 4 rows.
const ROWS_PER_BLOCK: usize = 32;

/// The most tiles `n_pairs` pairs over `e` experts can need: each non-empty expert adds at most one
/// partial tile.
pub fn moe_max_tiles(n_pairs: usize, e: usize) -> usize {
    n_pairs.min(n_pairs.div_ceil(MOE_TILE) + e).max(1)
}

/// Output element types of [`Gpu::moe_gemv`].
pub trait MoeOut: DeviceRepr {
    const KERNEL: &'static str;
    /// The packed kernels' name suffix.
    const SUFFIX: &'static str;
}
impl MoeOut for bf16 {
    const KERNEL: &'static str = "moe_gemv_bf16";
    const SUFFIX: &'static str = "bf16";
}
impl MoeOut for f32 {
    const KERNEL: &'static str = "moe_gemv_f32";
    const SUFFIX: &'static str = "f32";
}

impl Gpu {
    /// Groups `n_pairs` expert ids (`ids`, each `< e`; others are dropped) by expert: `perm`
    /// `[n_pairs]` lists pair numbers expert after expert, `tiles` `[max_tiles, 3]` holds
    /// `(expert, start in perm, count ≤ MOE_TILE)` with an unused tail of count 0, where
    /// `max_tiles = moe_max_tiles(n_pairs, e)`.
    pub fn moe_sort(
        &self,
        ids: &impl DevicePtr<u32>,
        n_pairs: usize,
        e: usize,
        perm: &mut impl DevicePtrMut<u32>,
        tiles: &mut impl DevicePtrMut<u32>,
    ) -> Result<()> {
        const OP: &str = "moe_sort";
        ensure(e > 0 && 8 * e <= 48 * 1024, OP, || {
            format!("{e} experts do not fit shared memory")
        })?;
        let max_tiles = moe_max_tiles(n_pairs, e);
        check_len(OP, "ids", ids, n_pairs)?;
        check_len(OP, "perm", perm, n_pairs)?;
        check_len(OP, "tiles", tiles, 3 * max_tiles)?;
        let (np, ei, mt) = (
            int(OP, "n_pairs", n_pairs)?,
            int(OP, "e", e)?,
            int(OP, "max_tiles", max_tiles)?,
        );
        let s = self.stream();
        let (ip, _gi) = ids.device_ptr(s);
        let (pp, _gp) = perm.device_ptr_mut(s);
        let (tp, _gt) = tiles.device_ptr_mut(s);
        let mut b = s.launch_builder(self.kernel("moe_sort")?);
        b.arg(&ip).arg(&np).arg(&ei).arg(&pp).arg(&tp).arg(&mt);
        // SAFETY: argument types match the kernel; lengths and shared memory (2·e u32) checked above.
        unsafe { b.launch(cfg((1, 1, 1), 1024, (8 * e) as u32)) }?;
        Ok(())
    }

    /// For every tile `(x, start, count)` of `tiles` and each pair `p = perm[start + m]` of it:
    /// `y[p, :] = W_x · x[p / x_div, :]`, `W_x` the `[n, k]` bf16 matrix at address `w_ptrs[x]`.
    /// `x_div = top_k` reads token rows (the gate|up projection), `1` reads pair rows (the down
    /// projection). Needs `k % 8 == 0` and 16-byte aligned weights and `x`; every address in `w_ptrs`
    /// must hold `n·k` elements (the caller builds the table from live weights).
    #[allow(clippy::too_many_arguments)]
    pub fn moe_gemv<O: MoeOut>(
        &self,
        w_ptrs: &impl DevicePtr<u64>,
        x: &impl DevicePtr<bf16>,
        x_rows: usize,
        x_div: usize,
        perm: &impl DevicePtr<u32>,
        tiles: &impl DevicePtr<u32>,
        n_pairs: usize,
        y: &mut impl DevicePtrMut<O>,
        n: usize,
        k: usize,
    ) -> Result<()> {
        const OP: &str = "moe_gemv";
        ensure(k.is_multiple_of(8) && k > 0, OP, || {
            format!("k = {k} must be a positive multiple of 8")
        })?;
        ensure(x_div >= 1 && n_pairs.div_ceil(x_div) <= x_rows, OP, || {
            format!("{n_pairs} pairs over x_div {x_div} need more than {x_rows} rows of x")
        })?;
        let e = w_ptrs.len();
        let max_tiles = moe_max_tiles(n_pairs, e);
        check_len(OP, "x", x, x_rows * k)?;
        check_len(OP, "perm", perm, n_pairs)?;
        check_len(OP, "tiles", tiles, 3 * max_tiles)?;
        check_len(OP, "y", y, n_pairs * n)?;
        if n_pairs == 0 || n == 0 {
            return Ok(());
        }
        ensure(max_tiles <= 65535, OP, || {
            format!("{max_tiles} tiles exceed the grid limit")
        })?;
        let s = self.stream();
        let (wp, _gw) = w_ptrs.device_ptr(s);
        let (xp, _gx) = x.device_ptr(s);
        let (pp, _gp) = perm.device_ptr(s);
        let (tp, _gt) = tiles.device_ptr(s);
        let (yp, _gy) = y.device_ptr_mut(s);
        ensure(xp % 16 == 0, OP, || "x must be 16-byte aligned".into())?;
        let (xd, ni, ki) = (int(OP, "x_div", x_div)?, int(OP, "n", n)?, int(OP, "k", k)?);
        let mut b = s.launch_builder(self.kernel(O::KERNEL)?);
        b.arg(&wp)
            .arg(&xp)
            .arg(&xd)
            .arg(&pp)
            .arg(&tp)
            .arg(&yp)
            .arg(&ni)
            .arg(&ki);
        let grid = (
            grid_u32(OP, n.div_ceil(ROWS_PER_BLOCK))?,
            max_tiles as u32,
            1,
        );
        // SAFETY: argument types match the kernel; x, perm, tiles and y lengths checked above; perm
        // holds pair numbers below n_pairs (written by moe_sort), so x rows p / x_div < x_rows and y
        // rows p < n_pairs; weight addresses come from the caller's table of live [n, k] weights.
        unsafe { b.launch(cfg(grid, 256, 0)) }?;
        Ok(())
    }

    /// As [`Gpu::moe_gemv`] with packed experts: `W_x` is the packed `[n, k]` matrix whose words are
    /// at `w_ptrs[x]` (`n · words_per_row(bits, k)` u32) and scales at `s_ptrs[x]`
    /// (`n · scale_cols(group_size, k)` f32; `group_size` 0 = one scale per row), every expert of
    /// one scheme (`bits` 4, 6 gapless or 8). Needs the packed
    /// kernels' shape rules (`k % 32 == 0` for INT4/INT8, `k % 8 == 0` for INT6, `group_size % 8 ==
    /// 0`), 16-byte aligned words and `x`; the caller builds the tables from live weights.
    #[allow(clippy::too_many_arguments)]
    pub fn moe_gemv_packed<O: MoeOut>(
        &self,
        w_ptrs: &impl DevicePtr<u64>,
        s_ptrs: &impl DevicePtr<u64>,
        bits: u32,
        group_size: usize,
        x: &impl DevicePtr<bf16>,
        x_rows: usize,
        x_div: usize,
        perm: &impl DevicePtr<u32>,
        tiles: &impl DevicePtr<u32>,
        n_pairs: usize,
        y: &mut impl DevicePtrMut<O>,
        n: usize,
        k: usize,
    ) -> Result<()> {
        const OP: &str = "moe_gemv_packed";
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
        ensure(x_div >= 1 && n_pairs.div_ceil(x_div) <= x_rows, OP, || {
            format!("{n_pairs} pairs over x_div {x_div} need more than {x_rows} rows of x")
        })?;
        let e = w_ptrs.len();
        check_len(OP, "s_ptrs", s_ptrs, e)?;
        let max_tiles = moe_max_tiles(n_pairs, e);
        check_len(OP, "x", x, x_rows * k)?;
        check_len(OP, "perm", perm, n_pairs)?;
        check_len(OP, "tiles", tiles, 3 * max_tiles)?;
        check_len(OP, "y", y, n_pairs * n)?;
        if n_pairs == 0 || n == 0 {
            return Ok(());
        }
        ensure(max_tiles <= 65535, OP, || {
            format!("{max_tiles} tiles exceed the grid limit")
        })?;
        let group = if group_size == 0 { k } else { group_size };
        let s = self.stream();
        let (wp, _gw) = w_ptrs.device_ptr(s);
        let (sp, _gs) = s_ptrs.device_ptr(s);
        let (xp, _gx) = x.device_ptr(s);
        let (pp, _gp) = perm.device_ptr(s);
        let (tp, _gt) = tiles.device_ptr(s);
        let (yp, _gy) = y.device_ptr_mut(s);
        ensure(xp % 16 == 0, OP, || "x must be 16-byte aligned".into())?;
        let (xd, ni, ki, gi) = (
            int(OP, "x_div", x_div)?,
            int(OP, "n", n)?,
            int(OP, "k", k)?,
            int(OP, "group", group)?,
        );
        let name = format!("moe_gemv_q{bits}_{}", O::SUFFIX);
        let mut b = s.launch_builder(self.kernel(&name)?);
        b.arg(&wp)
            .arg(&sp)
            .arg(&xp)
            .arg(&xd)
            .arg(&pp)
            .arg(&tp)
            .arg(&yp)
            .arg(&ni)
            .arg(&ki)
            .arg(&gi);
        let grid = (
            grid_u32(OP, n.div_ceil(ROWS_PER_BLOCK))?,
            max_tiles as u32,
            1,
        );
        // SAFETY: argument types match the kernel; x, perm, tiles, y and table lengths and the shape
        // rules checked above; perm holds pair numbers below n_pairs (written by moe_sort), so x rows
        // p / x_div < x_rows and y rows p < n_pairs; word and scale addresses come from the caller's
        // tables of live packed [n, k] weights of this scheme.
        unsafe { b.launch(cfg(grid, 256, 0)) }?;
        Ok(())
    }

    /// `out[t, j] = Σ_c weights[t, c] · y[t·top_k + c, j]`, skipping pairs whose id is `≥ e`.
    /// `y`: `[tokens·top_k, h]` f32; `weights`, `ids`: `[tokens, top_k]`; `out`: `[tokens, h]`.
    #[allow(clippy::too_many_arguments)]
    pub fn moe_combine(
        &self,
        y: &impl DevicePtr<f32>,
        weights: &impl DevicePtr<f32>,
        ids: &impl DevicePtr<u32>,
        e: usize,
        out: &mut impl DevicePtrMut<bf16>,
        tokens: usize,
        top_k: usize,
        h: usize,
    ) -> Result<()> {
        const OP: &str = "moe_combine";
        check_len(OP, "y", y, tokens * top_k * h)?;
        check_len(OP, "weights", weights, tokens * top_k)?;
        check_len(OP, "ids", ids, tokens * top_k)?;
        check_len(OP, "out", out, tokens * h)?;
        if tokens == 0 || h == 0 {
            return Ok(());
        }
        let s = self.stream();
        let (yp, _gy) = y.device_ptr(s);
        let (wp, _gw) = weights.device_ptr(s);
        let (ip, _gi) = ids.device_ptr(s);
        let (op, _go) = out.device_ptr_mut(s);
        let (ei, ki, hi) = (int(OP, "e", e)?, int(OP, "top_k", top_k)?, int(OP, "h", h)?);
        let mut b = s.launch_builder(self.kernel("moe_combine")?);
        b.arg(&yp)
            .arg(&wp)
            .arg(&ip)
            .arg(&ei)
            .arg(&op)
            .arg(&ki)
            .arg(&hi);
        // SAFETY: argument types match the kernel; lengths checked above.
        unsafe { b.launch(cfg((grid_u32(OP, tokens)?, 1, 1), super::row_threads(h), 0)) }?;
        Ok(())
    }
}
