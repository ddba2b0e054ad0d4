//! The hyper-connections' gated residual of a decode step as two fused kernels (`kernels/hc.cu`):
//! `s = silu(down·y + inject·x)` ([`Gpu::hc_down_inject_silu`]) and `R_c += sigmoid(up_c·s) ⊙ y`
//! ([`Gpu::hc_up_gate_mix`]), with `down` / `up` packed INT8 with one scale per row and `inject` bf16;
//! and for one row the residual with the next sublayer's pre-mix and norm in one persistent launch
//! ([`Gpu::hc_step`]).

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, DeviceRepr};
use half::bf16;

use super::norm::{norm_plan, NORM_MAX_D as VECTOR_NORM_MAX_D};
use super::{PackedMat, PackedScheme};
use crate::error::{ensure, Result};
use crate::gpu::{cfg, check_len, grid_u32, int, Gpu};

/// Most rows (tokens) the fused kernels take: one entry point per row count 1..=8.
pub(crate) const HC_MAX_ROWS: usize = 8;
/// Threads of a `hc_down_inject_silu` block (`HC_DOWN_THREADS` in hc.cu).
const DOWN_THREADS: u32 = 128;
/// Threads of a `hc_up_gate_mix` block and outputs a block computes (`HC_UP_THREADS`,
/// `HC_UP_THREADS / HC_UP_TPR` in hc.cu).
const UP_THREADS: u32 = 256;
const UP_ROWS: usize = 32;

/// Most streams [`Gpu::hc_step`] takes (a warp's slots of `HC_UP_TPR` lanes, hc.cu).
pub(crate) const HC_STEP_MAX_STREAMS: usize = 4;
/// Widest rank [`Gpu::hc_step`] takes (`32 · HC_UP_TPR · HC_STEP_MAXU`).
pub(crate) const HC_STEP_MAX_RANK: usize = 512;
/// Columns of `h` a warp of [`Gpu::hc_step`] takes at most (`HC_STEP_MAXC`).
const STEP_MAX_COLS: usize = 2;

/// `hc_step_m1`'s arguments (`HcStepArgs` in hc.cu, field for field).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct HcStepArgs {
    down: u64,
    down_s: u64,
    inject: u64,
    up: u64,
    up_s: u64,
    pre: u64,
    norm_w: u64,
    x: u64,
    y: u64,
    streams: u64,
    s: u64,
    xn: u64,
    hn: u64,
    sync: u64,
    trace: u64,
    h: i32,
    rank: i32,
    ns: i32,
    tpr_log2: i32,
    eps: f32,
    offset: f32,
}

// SAFETY: a plain `#[repr(C)]` struct of 8-byte addresses and 4-byte numbers, laid out as the
// kernel's `HcStepArgs` (15 pointers, 4 ints, 2 floats; 144 bytes, 8-byte aligned).
unsafe impl DeviceRepr for HcStepArgs {}

/// One sublayer's hyper-connection weights as [`Gpu::hc_step`] takes them: `down` `[rank, h]` and
/// `up` `[S·h, rank]` packed INT8 with one scale a row, `inject` `[rank, h]` bf16.
pub struct HcStepWeights<'a> {
    pub down: PackedMat<'a, CudaSlice<u32>, CudaSlice<f32>>,
    pub inject: &'a CudaSlice<bf16>,
    pub up: PackedMat<'a, CudaSlice<u32>, CudaSlice<f32>>,
}

/// The next sublayer's pre-mix logits `pre` `[S]` and its norm (weight `w` `[h]`, `eps`, `offset`).
pub struct HcNextNorm<'a> {
    pub pre: &'a CudaSlice<f32>,
    pub w: &'a CudaSlice<bf16>,
    pub eps: f32,
    pub offset: f32,
}

/// The rows [`Gpu::hc_step`] reads and writes: this sublayer's pre-mixed input `x` and output `y`
/// `[h]`, the streams `[S·h]` (updated), the next pre-mixed input `xn` and its norm `hn` `[h]`
/// (written), `s` `[rank]` (scratch), `sync` (two `u32`, 0 before and left 0) and an optional
/// `[16]` u64 phase trace.
pub struct HcStepRows<'a> {
    pub x: &'a CudaSlice<bf16>,
    pub y: &'a CudaSlice<bf16>,
    pub streams: &'a mut CudaSlice<bf16>,
    pub xn: &'a mut CudaSlice<bf16>,
    pub hn: &'a mut CudaSlice<bf16>,
    pub s: &'a mut CudaSlice<bf16>,
    pub sync: &'a mut CudaSlice<u32>,
    pub trace: Option<&'a mut CudaSlice<u64>>,
}

/// Whether the fused kernels take a hidden size `h` and a rank: both whole 32-value INT8 units.
pub(crate) fn hc_fused_shape(h: usize, rank: usize) -> bool {
    h > 0 && rank > 0 && h.is_multiple_of(32) && rank.is_multiple_of(32)
}

/// Checks the row count and shape the fused kernels take.
fn check_shape(op: &'static str, rows: usize, h: usize, rank: usize) -> Result<()> {
    ensure((1..=HC_MAX_ROWS).contains(&rows), op, || {
        format!("rows = {rows}, expected 1..={HC_MAX_ROWS}")
    })?;
    ensure(hc_fused_shape(h, rank), op, || {
        format!("h = {h} and rank = {rank} must be positive multiples of 32")
    })
}

/// The words of `w` when it is INT8 with one scale per row (the fused kernels' format), else why not.
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

/// Checks a device address for the kernels' 16-byte vector loads.
fn aligned(op: &'static str, what: &str, p: u64) -> Result<()> {
    ensure(p.is_multiple_of(16), op, || {
        format!("{what} must be 16-byte aligned")
    })
}

impl Gpu {
    /// `s[m, r] = bf16(silu(scale[r]·(q_down[r]·y[m]) + inject[r]·x[m]))` for `rows` ≤ 8 rows:
    /// `down` packed INT8 `[rank, h]` (`rank · h/4` words) with one scale a row, `inject`
    /// `[rank, h]` bf16, `x`, `y` `[rows, h]`, `s` `[rows, rank]`. The sum is f32, rounded once.
    pub fn hc_down_inject_silu(
        &self,
        down: &PackedMat<'_, impl DevicePtr<u32>, impl DevicePtr<f32>>,
        inject: &impl DevicePtr<bf16>,
        x: &impl DevicePtr<bf16>,
        y: &impl DevicePtr<bf16>,
        s: &mut impl DevicePtrMut<bf16>,
        rows: usize,
    ) -> Result<()> {
        const OP: &str = "hc_down_inject_silu";
        let (rank, h) = (down.n, down.k);
        let (down_scales, down) = (down.scales, int8_words(OP, down)?);
        check_shape(OP, rows, h, rank)?;
        check_len(OP, "down", down, rank * h / 4)?;
        check_len(OP, "down_scales", down_scales, rank)?;
        check_len(OP, "inject", inject, rank * h)?;
        check_len(OP, "x", x, rows * h)?;
        check_len(OP, "y", y, rows * h)?;
        check_len(OP, "s", s, rows * rank)?;
        for (what, p) in [
            ("down", self.addr(down)),
            ("inject", self.addr(inject)),
            ("x", self.addr(x)),
            ("y", self.addr(y)),
        ] {
            aligned(OP, what, p)?;
        }
        let (hi, ri) = (int(OP, "h", h)?, int(OP, "rank", rank)?);
        let mut b = self.launch(self.kernel(&format!("hc_down_inject_silu_m{rows}"))?);
        b.ptr(down)
            .ptr(down_scales)
            .ptr(inject)
            .ptr(x)
            .ptr(y)
            .ptr_mut(s)
            .arg(&hi)
            .arg(&ri);
        // SAFETY: argument types match the kernel; lengths, shape rules and alignment checked above;
        // one block of DOWN_THREADS per output r, as the kernel assumes.
        unsafe { b.launch(cfg((grid_u32(OP, rank)?, 1, 1), DOWN_THREADS, 0)) }?;
        Ok(())
    }

    /// `streams[m, c·h + j] = bf16(streams[m, c·h + j] + sigmoid(u) · y[m, j])` with
    /// `u = scale[c·h + j] · (q_up[c·h + j] · s[m])` kept in f32, for `rows` ≤ 8 rows and `nstreams`
    /// streams of `h`: `up` packed INT8 `[nstreams·h, rank]` (`nstreams·h · rank/4` words) with one
    /// scale a row, `s` `[rows, rank]`, `y` `[rows, h]`, `streams` `[rows, nstreams·h]`.
    pub fn hc_up_gate_mix(
        &self,
        up: &PackedMat<'_, impl DevicePtr<u32>, impl DevicePtr<f32>>,
        s: &impl DevicePtr<bf16>,
        y: &impl DevicePtr<bf16>,
        streams: &mut impl DevicePtrMut<bf16>,
        rows: usize,
        h: usize,
    ) -> Result<()> {
        const OP: &str = "hc_up_gate_mix";
        let rank = up.k;
        let (up_scales, up_rows) = (up.scales, up.n);
        let up = int8_words(OP, up)?;
        check_shape(OP, rows, h, rank)?;
        ensure(up_rows > 0 && up_rows.is_multiple_of(h), OP, || {
            format!("{up_rows} rows of up are not streams of {h}")
        })?;
        let nstreams = up_rows / h;
        let n = nstreams * h;
        check_len(OP, "up", up, n * rank / 4)?;
        check_len(OP, "up_scales", up_scales, n)?;
        check_len(OP, "s", s, rows * rank)?;
        check_len(OP, "y", y, rows * h)?;
        check_len(OP, "streams", streams, rows * n)?;
        for (what, p) in [("up", self.addr(up)), ("s", self.addr(s))] {
            aligned(OP, what, p)?;
        }
        let (ni, hi, ri) = (int(OP, "n", n)?, int(OP, "h", h)?, int(OP, "rank", rank)?);
        let blocks = grid_u32(OP, n.div_ceil(UP_ROWS))?;
        let mut b = self.launch(self.kernel(&format!("hc_up_gate_mix_m{rows}"))?);
        b.ptr(up)
            .ptr(up_scales)
            .ptr(s)
            .ptr(y)
            .ptr_mut(streams)
            .arg(&ni)
            .arg(&hi)
            .arg(&ri);
        // SAFETY: argument types match the kernel; lengths, shape rules and alignment checked above;
        // blocks of UP_THREADS, UP_ROWS outputs each, cover the n outputs as the kernel assumes.
        unsafe { b.launch(cfg((blocks, 1, 1), UP_THREADS, 0)) }?;
        Ok(())
    }
}

impl Gpu {
    /// Whether [`Gpu::hc_step`] takes `streams` streams of `h` at `rank` on this device: a device
    /// with cooperative launches, `h` and `rank` multiples of 32, `rank ≤ 512`, `1 ≤ streams ≤ 4` and
    /// `h` a row the norm kernels take whole (`h ≤ 8192`).
    pub fn hc_step_fits(&self, streams: usize, h: usize, rank: usize) -> bool {
        self.info().cooperative_launch
            && hc_fused_shape(h, rank)
            && rank <= HC_STEP_MAX_RANK
            && (1..=HC_STEP_MAX_STREAMS).contains(&streams)
            && h <= VECTOR_NORM_MAX_D
    }

    /// One decode row's gated residual and the next sublayer's pre-mix and norm in one persistent
    /// launch (`hc_step_m1`): `s = silu(down·y + inject·x)`, `R_c += sigmoid(up_c·s) ⊙ y`, then
    /// `xn = Σ_c softmax(pre)_c · R_c` and `hn = rms_norm(xn)`, each value as
    /// [`Gpu::hc_down_inject_silu`], [`Gpu::hc_up_gate_mix`], `hc_premix` and [`Gpu::rms_norm`]
    /// compute it (the same bits).
    pub fn hc_step(
        &self,
        w: &HcStepWeights<'_>,
        next: &HcNextNorm<'_>,
        rows: HcStepRows<'_>,
    ) -> Result<()> {
        const OP: &str = "hc_step";
        let (rank, h) = (w.down.n, w.down.k);
        let down = int8_words(OP, &w.down)?;
        let up = int8_words(OP, &w.up)?;
        ensure(
            w.up.k == rank && w.up.n.is_multiple_of(h.max(1)),
            OP,
            || {
                format!(
                    "up [{}, {}] against down [{rank}, {h}]: expected [S·{h}, {rank}]",
                    w.up.n, w.up.k
                )
            },
        )?;
        let ns = w.up.n / h.max(1);
        ensure(self.hc_step_fits(ns, h, rank), OP, || {
            format!(
                "{ns} streams of h = {h} at rank {rank}: expected 1..={HC_STEP_MAX_STREAMS} \
                 streams, h and rank multiples of 32, rank ≤ {HC_STEP_MAX_RANK}, h ≤ {VECTOR_NORM_MAX_D}, \
                 a device with cooperative launches"
            )
        })?;
        check_len(OP, "down", down, rank * h / 4)?;
        check_len(OP, "down_scales", w.down.scales, rank)?;
        check_len(OP, "inject", w.inject, rank * h)?;
        check_len(OP, "up", up, ns * h * rank / 4)?;
        check_len(OP, "up_scales", w.up.scales, ns * h)?;
        check_len(OP, "pre", next.pre, ns)?;
        check_len(OP, "norm weight", next.w, h)?;
        for (what, buf) in [
            ("x", rows.x),
            ("y", rows.y),
            ("xn", &*rows.xn),
            ("hn", &*rows.hn),
        ] {
            check_len(OP, what, buf, h)?;
        }
        check_len(OP, "streams", &*rows.streams, ns * h)?;
        check_len(OP, "s", &*rows.s, rank)?;
        check_len(OP, "sync", &*rows.sync, 2)?;
        if let Some(t) = &rows.trace {
            check_len(OP, "trace", &**t, 16)?;
        }
        let (tpr_log2, _, _) = norm_plan(1, h);
        let mut a = HcStepArgs {
            down: self.addr(down),
            down_s: self.addr(w.down.scales),
            inject: self.addr(w.inject),
            up: self.addr(up),
            up_s: self.addr(w.up.scales),
            pre: self.addr(next.pre),
            norm_w: self.addr(next.w),
            x: self.addr(rows.x),
            y: self.addr(rows.y),
            streams: self.addr_mut(rows.streams),
            s: self.addr_mut(rows.s),
            xn: self.addr_mut(rows.xn),
            hn: self.addr_mut(rows.hn),
            sync: self.addr_mut(rows.sync),
            trace: rows.trace.map_or(0, |t| self.addr_mut(t)),
            h: int(OP, "h", h)?,
            rank: int(OP, "rank", rank)?,
            ns: int(OP, "streams", ns)?,
            tpr_log2: tpr_log2 as i32,
            eps: next.eps,
            offset: next.offset,
        };
        for (what, p) in [
            ("down", a.down),
            ("inject", a.inject),
            ("up", a.up),
            ("x", a.x),
            ("y", a.y),
            ("s", a.s),
            ("xn", a.xn),
            ("hn", a.hn),
            ("norm weight", a.norm_w),
        ] {
            aligned(OP, what, p)?;
        }
        let kernel = self.kernel("hc_step_m1")?;
        let blocks = self.persistent_blocks(OP, kernel, 0)?;
        ensure(h <= STEP_MAX_COLS * 8 * blocks, OP, || {
            format!("h = {h} exceeds {STEP_MAX_COLS} columns a warp of {blocks} blocks")
        })?;
        a.trace = self.layer_trace(a.trace, kernel);
        // SAFETY: the argument struct matches the kernel's; every buffer's length, the alignments
        // and the kernel's shape limits are checked above; the grid is what the multiprocessors
        // hold at once.
        unsafe { self.launch_persistent(kernel, (grid_u32(OP, blocks)?, 0), &a) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_step_argument_struct_has_the_kernels_layout() {
        // 15 pointers, 4 ints, 2 floats (hc.cu's HcStepArgs).
        assert_eq!(std::mem::size_of::<HcStepArgs>(), 15 * 8 + 4 * 4 + 2 * 4);
        assert_eq!(std::mem::align_of::<HcStepArgs>(), 8);
    }
}
