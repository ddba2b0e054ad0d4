//! The hyper-connections' gated residual of a decode step in one launch (`kernels/hc.cu`,
//! [`Gpu::hc_residual`]): `s = silu(down·y + inject·x)` and `R_c += sigmoid(up_c·s) ⊙ y`, with
//! `down` / `up` packed INT8 with one scale per row and `inject` bf16, and with them, when given,
//! the next sublayer's pre-mix of the new streams and its RMSNorm.

use cudarc::driver::{CudaSlice, DevicePtr, DeviceRepr};
use half::bf16;

use super::norm::{norm_plan, vector_ok};
use super::{PackedMat, PackedScheme};
use crate::error::{ensure, Result};
use crate::gpu::{cfg, check_len, grid_u32, int, Gpu};

/// Most rows (tokens) the fused kernel takes: one entry point per row count 1..=8.
pub(crate) const HC_MAX_ROWS: usize = 8;
/// Threads of a block (`HC_THREADS` in hc.cu).
const THREADS: u32 = 256;
/// Outputs of up a block computes (`HC_UP_ROWS`): `UP_ROWS / S` columns of each of S streams.
const UP_ROWS: usize = 32;
/// The kernel's counters (`sync`): 0 before a launch and left 0.
pub(crate) const HC_SYNC: usize = 3;

/// `hc_residual_m{M}`'s arguments (`HcArgs` in hc.cu, field for field).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct HcArgs {
    down: u64,
    down_s: u64,
    inject: u64,
    up: u64,
    up_s: u64,
    x: u64,
    y: u64,
    streams: u64,
    s: u64,
    pre: u64,
    norm_w: u64,
    xn: u64,
    hn: u64,
    sync: u64,
    h: i32,
    rank: i32,
    n: i32,
    tpr_log2: i32,
    eps: f32,
    offset: f32,
}

// SAFETY: a plain `#[repr(C)]` struct of 8-byte addresses and 4-byte numbers, laid out as the
// kernel's `HcArgs` (14 pointers, 4 ints, 2 floats; 136 bytes, 8-byte aligned).
unsafe impl DeviceRepr for HcArgs {}

/// One sublayer's hyper-connection weights as [`Gpu::hc_residual`] takes them: `down` `[rank, h]`
/// and `up` `[S·h, rank]` packed INT8 with one scale a row, `inject` `[rank, h]` bf16.
pub struct HcFusedWeights<'a> {
    pub down: PackedMat<'a, CudaSlice<u32>, CudaSlice<f32>>,
    pub inject: &'a CudaSlice<bf16>,
    pub up: PackedMat<'a, CudaSlice<u32>, CudaSlice<f32>>,
}

/// The next sublayer's pre-mix and norm, done in the same launch: its logits `pre` `[S]` f32, its
/// norm's weight `w` `[h]`, `eps` and `offset`; the pre-mixed rows `xn` and their norm `hn`
/// `[rows, h]` (written).
pub struct HcPremixNorm<'a> {
    pub pre: &'a CudaSlice<f32>,
    pub w: &'a CudaSlice<bf16>,
    pub eps: f32,
    pub offset: f32,
    pub xn: &'a mut CudaSlice<bf16>,
    pub hn: &'a mut CudaSlice<bf16>,
}

/// The rows [`Gpu::hc_residual`] reads and writes: the sublayer's pre-mixed input `x` and output
/// `y` `[rows, h]`, the streams `[rows, S·h]` (updated in place), `s` `[rows, rank]` (scratch) and
/// `sync` ([`HC_SYNC`] `u32`, 0 before the launch and left 0).
pub struct HcRows<'a> {
    pub rows: usize,
    pub x: &'a CudaSlice<bf16>,
    pub y: &'a CudaSlice<bf16>,
    pub streams: &'a mut CudaSlice<bf16>,
    pub s: &'a mut CudaSlice<bf16>,
    pub sync: &'a mut CudaSlice<u32>,
}

/// Whether the fused kernel takes a hidden size `h` and a rank: both whole 32-value INT8 units.
pub(crate) fn hc_fused_shape(h: usize, rank: usize) -> bool {
    h > 0 && rank > 0 && h.is_multiple_of(32) && rank.is_multiple_of(32)
}

/// The words of `w` when it is INT8 with one scale per row (the fused kernel's format), else why not.
fn int8_words<'a, W: DevicePtr<u32>>(
    op: &'static str,
    w: &PackedMat<'a, W, impl DevicePtr<f32>>,
) -> Result<&'a W> {
    let PackedScheme { bits, group_size } = w.scheme;
    ensure(
        bits == 8 && (group_size == 0 || group_size == w.k),
        op,
        || format!("INT{bits} weights with groups of {group_size}: expected INT8, one scale a row"),
    )?;
    Ok(w.words)
}

impl Gpu {
    /// Whether [`Gpu::hc_residual`] can pre-mix and norm rows of `h` (the norm kernels' vector
    /// form: `h % 8 == 0`, `h ≤ NORM_MAX_D`) into buffers at these addresses.
    pub(crate) fn hc_norm_fits(&self, h: usize, w: &CudaSlice<bf16>) -> bool {
        vector_ok(h, &[self.addr(w)])
    }

    /// A decode step's gated residual for `rows.rows` ≤ 8 rows in one launch (`hc_residual_m{rows}`):
    /// `s[m] = bf16(silu(scale_down ⊙ (q_down·y[m]) + inject·x[m]))`, then `R_c[m] = bf16(R_c[m] +
    /// sigmoid(scale_up ⊙ (q_up_c·s[m])) ⊙ y[m])` for each stream c, the sums in f32. With `next`,
    /// also `xn[m] = Σ_c softmax(pre)_c · R_c[m]` and `hn = rms_norm(xn)`, as `hc_premix` and
    /// [`Gpu::rms_norm`] compute them (the same bits).
    pub fn hc_residual(
        &self,
        w: &HcFusedWeights<'_>,
        next: Option<HcPremixNorm<'_>>,
        rows: HcRows<'_>,
    ) -> Result<()> {
        const OP: &str = "hc_residual";
        let (rank, h, m) = (w.down.n, w.down.k, rows.rows);
        let down = int8_words(OP, &w.down)?;
        let up = int8_words(OP, &w.up)?;
        ensure((1..=HC_MAX_ROWS).contains(&m), OP, || {
            format!("rows = {m}, expected 1..={HC_MAX_ROWS}")
        })?;
        ensure(hc_fused_shape(h, rank), OP, || {
            format!("h = {h} and rank = {rank} must be positive multiples of 32")
        })?;
        ensure(w.up.k == rank && w.up.n.is_multiple_of(h), OP, || {
            format!(
                "up [{}, {}] against down [{rank}, {h}]: expected [S·{h}, {rank}]",
                w.up.n, w.up.k
            )
        })?;
        let ns = w.up.n / h;
        ensure((1..=UP_ROWS).contains(&ns), OP, || {
            format!("{ns} streams: expected 1..={UP_ROWS}")
        })?;
        let n = ns * h;
        check_len(OP, "down", down, rank * h / 4)?;
        check_len(OP, "down_scales", w.down.scales, rank)?;
        check_len(OP, "inject", w.inject, rank * h)?;
        check_len(OP, "up", up, n * rank / 4)?;
        check_len(OP, "up_scales", w.up.scales, n)?;
        check_len(OP, "x", rows.x, m * h)?;
        check_len(OP, "y", rows.y, m * h)?;
        check_len(OP, "streams", &*rows.streams, m * n)?;
        check_len(OP, "s", &*rows.s, m * rank)?;
        check_len(OP, "sync", &*rows.sync, HC_SYNC)?;
        let mut a = HcArgs {
            down: self.addr(down),
            down_s: self.addr(w.down.scales),
            inject: self.addr(w.inject),
            up: self.addr(up),
            up_s: self.addr(w.up.scales),
            x: self.addr(rows.x),
            y: self.addr(rows.y),
            streams: self.addr_mut(rows.streams),
            s: self.addr_mut(rows.s),
            sync: self.addr_mut(rows.sync),
            h: int(OP, "h", h)?,
            rank: int(OP, "rank", rank)?,
            n: int(OP, "n", n)?,
            ..HcArgs::default()
        };
        if let Some(nx) = next {
            ensure(self.hc_norm_fits(h, nx.w), OP, || {
                format!("the norm kernels' vector form does not take rows of {h}")
            })?;
            check_len(OP, "pre", nx.pre, ns)?;
            check_len(OP, "norm weight", nx.w, h)?;
            check_len(OP, "xn", &*nx.xn, m * h)?;
            check_len(OP, "hn", &*nx.hn, m * h)?;
            a.pre = self.addr(nx.pre);
            a.norm_w = self.addr(nx.w);
            a.xn = self.addr_mut(nx.xn);
            a.hn = self.addr_mut(nx.hn);
            a.tpr_log2 = norm_plan(m, h).0 as i32;
            a.eps = nx.eps;
            a.offset = nx.offset;
            for (what, p) in [("xn", a.xn), ("hn", a.hn)] {
                ensure(p.is_multiple_of(16), OP, || {
                    format!("{what} must be 16-byte aligned")
                })?;
            }
        }
        for (what, p) in [
            ("down", a.down),
            ("inject", a.inject),
            ("up", a.up),
            ("x", a.x),
            ("y", a.y),
            ("s", a.s),
        ] {
            ensure(p.is_multiple_of(16), OP, || {
                format!("{what} must be 16-byte aligned")
            })?;
        }
        // rank / 2 blocks for s (two rows each), then blocks of UP_ROWS / S columns of every stream.
        let blocks = grid_u32(OP, rank / 2 + h.div_ceil(UP_ROWS / ns))?;
        let kernel = self.kernel(&format!("hc_residual_m{m}"))?;
        let mut b = self.launch(kernel);
        b.arg(&a);
        // SAFETY: the argument struct matches the kernel's; every buffer's length, the alignments and
        // the shape rules are checked above; `pre`, `norm_w`, `xn` and `hn` are all null or all hold
        // what the kernel reads and writes; the grid is the kernel's roles, blocks of THREADS.
        unsafe { b.launch(cfg((blocks, 1, 1), THREADS, 0)) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_argument_struct_has_the_kernels_layout() {
        // 14 pointers, 4 ints, 2 floats (hc.cu's HcArgs).
        assert_eq!(std::mem::size_of::<HcArgs>(), 14 * 8 + 4 * 4 + 2 * 4);
        assert_eq!(std::mem::align_of::<HcArgs>(), 8);
    }
}
