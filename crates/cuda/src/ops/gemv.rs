//! The decode GEMV: `y[m, :] = W · x[m, :]` for up to [`GEMV_MAX_M`] rows of `x`, bf16 weights and
//! activations, f32 accumulation, bf16 or f32 output.
//!
//! The GEMV kernels (here and the packed ones in `quant.rs`) split a 256-thread block into row slots
//! ([`gemv_plan`]): on a large `n` a warp owns a few rows and streams them, as many blocks as rows
//! allow; on a small `n` the slots widen (up to the whole block on one row, reduced through shared
//! memory) and own fewer rows, so that every shape fills the GPU's multiprocessors. Batches of 2..8 rows
//! of `x` (at `k % 32 == 0`, any `n`) run on the tensor cores instead: 16 rows of `W` a block, the
//! 8 warps split over k, one mma per 16 values of 16 rows for every row of `x` at once.
//!
//! One launch serves up to [`GEMV_SEGS`] weights that read the same `x` ([`Gpu::gemv_bf16_many`]; the
//! packed [`Gpu::gemv_packed_many`]): the grid is the weights' grids one after another, and a block finds
//! its weight in a segment table passed by value ([`GemvSegs`]). At decode most GEMVs are small and
//! their time is launch latency, so the projections of one input share a launch. A single GEMV is a
//! one-segment table.

use cudarc::driver::{DevicePtr, DevicePtrMut, DeviceRepr};
use half::bf16;

use crate::error::{ensure, Result};
use crate::gpu::{cfg, check_len, grid_u32, int, Gpu};

/// The most rows of `x` one GEMV call takes.
pub const GEMV_MAX_M: usize = 8;

/// Most rows of `W` one row slot of the bf16 GEMV owns (`GEMV_ROWS` in gemv.cu).
const GEMV_ROWS: usize = 4;

/// Threads per GEMV block (bf16 and packed).
pub(crate) const GEMV_THREADS: usize = 256;

/// Rows of W one block of a tensor-core GEMV owns (`gemv_*_tc` in gemv.cu and quant.cu).
pub(crate) const TC_ROWS: usize = 16;

/// Most weights one GEMV launch takes (`GEMV_SEGS` in common.cuh).
pub const GEMV_SEGS: usize = 4;

/// One weight of a GEMV launch (`GemvSeg` in common.cuh): its rows `w` (bf16 or packed words), scales
/// `s` (packed; 0 for bf16), output `y` (`[m, n]`), `n`, its first block, and its row-slot cut (0 for
/// the tensor-core GEMVs).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct GemvSeg {
    w: u64,
    s: u64,
    y: u64,
    n: i32,
    block0: i32,
    rps: i32,
    tpr_log2: i32,
}

/// The segment table of a GEMV launch (`GemvSegs` in common.cuh), a kernel parameter passed by value:
/// segment i owns blocks `block0_i .. block0_{i+1}`; unused segments start at `i32::MAX`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(crate) struct GemvSegs {
    seg: [GemvSeg; GEMV_SEGS],
}

// SAFETY: a plain `#[repr(C)]` struct of integers, laid out as the kernels' `GemvSegs` (three 8-byte
// pointers and four ints a segment, 40 bytes, 8-byte aligned).
unsafe impl DeviceRepr for GemvSegs {}

/// The device addresses of one segment: weight `w`, its scales `s` (0 for bf16) and output `y`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SegAddrs {
    pub w: u64,
    pub s: u64,
    pub y: u64,
}

/// A [`GemvSegs`] being filled, with the blocks its segments take so far.
pub(crate) struct SegTable {
    segs: GemvSegs,
    len: usize,
    blocks: usize,
}

impl SegTable {
    pub(crate) fn new() -> Self {
        let unused = GemvSeg {
            w: 0,
            s: 0,
            y: 0,
            n: 0,
            block0: i32::MAX,
            rps: 0,
            tpr_log2: 0,
        };
        Self {
            segs: GemvSegs {
                seg: [unused; GEMV_SEGS],
            },
            len: 0,
            blocks: 0,
        }
    }

    /// Appends a weight of `n` rows at `addrs` cut into `blocks` blocks (`plan` the row-slot cut,
    /// `None` for a tensor-core GEMV).
    pub(crate) fn push(
        &mut self,
        op: &'static str,
        addrs: SegAddrs,
        n: usize,
        blocks: usize,
        plan: Option<GemvPlan>,
    ) -> Result<()> {
        let SegAddrs { w, s, y } = addrs;
        ensure(self.len < GEMV_SEGS, op, || {
            format!("more than {GEMV_SEGS} weights in one launch")
        })?;
        let (rps, tpr_log2) = plan.map_or((0, 0), |p| (p.rps, p.tpr_log2 as usize));
        self.segs.seg[self.len] = GemvSeg {
            w,
            s,
            y,
            n: int(op, "n", n)?,
            block0: int(op, "first block", self.blocks)?,
            rps: int(op, "rps", rps)?,
            tpr_log2: int(op, "tpr_log2", tpr_log2)?,
        };
        self.len += 1;
        self.blocks += blocks;
        Ok(())
    }

    /// The table, as the kernel parameter.
    pub(crate) fn segs(&self) -> &GemvSegs {
        &self.segs
    }

    /// The launch's grid: every segment's blocks (0 when no weight has rows).
    pub(crate) fn grid(&self, op: &'static str) -> Result<u32> {
        int(op, "grid", self.blocks)?;
        grid_u32(op, self.blocks)
    }
}

/// One weight of a many-weight GEMV ([`Gpu::gemv_bf16_many`]): `(W, y, n)`, `y[m, :] = W · x[m, :]`
/// with `W` `[n, k]` and `y` `[m, n]`.
pub type GemvPart<'a, W, Y> = (&'a W, &'a mut Y, usize);

/// Whether a GEMV of `m` rows of x runs on the tensor cores (`gemv_bf16_tc*`, and with the packed
/// formats' own k rules `gemv_q*_tc*`) whatever n is: 2 ≤ m ≤ 8. One mma multiplies each weight with
/// every row of x, where the FMA GEMV issues an FMA and a widening per weight and row, so at m = 8 the
/// FMA GEMV is bound by issue however it is cut. A small n does not need the FMA GEMV's wider cuts
/// either: a tensor-core block already splits k over its 8 warps with every row of x read per weight
/// load, and at the models' k (2048 and below) each warp's share of a row is one or two rounds of loads,
/// so a block of 16 rows costs about what one row costs; on a GPU host, m = 8 and k = 2048, it took
/// 3.2-4.3 µs from n = 1 to 512 against 4.0-5.4 µs for the FMA GEMV (m = 1: 3.8-4.3 µs).
pub(crate) fn tensor_core_batch(m: usize) -> bool {
    (2..=GEMV_MAX_M).contains(&m)
}

/// Whether a bf16 GEMV of `m` rows of x runs on the tensor cores: a batch ([`tensor_core_batch`]) and
/// `k % 32 == 0`. Depends on the shape alone.
fn tensor_core_gemv(m: usize, k: usize) -> bool {
    tensor_core_batch(m) && k.is_multiple_of(32)
}

/// How a GEMV over `n` rows is cut (see [`gemv_plan`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct GemvPlan {
    /// Rows each slot owns, 1 ≤ rps ≤ the kernel's maximum.
    pub rps: usize,
    /// log2 of the threads per slot (0..=8).
    pub tpr_log2: u32,
    /// Blocks of [`GEMV_THREADS`].
    pub blocks: usize,
}

/// The cut of a GEMV over `n` rows of `chunks` loads each (16-byte chunks for bf16, 32-value units for
/// packed weights) on a GPU of `sms` multiprocessors, `max_rows` the kernel's most rows per slot.
///
/// Starts from a warp per slot owning `max_rows` rows (narrower if a row has fewer than 32 chunks);
/// while that gives fewer than two blocks per multiprocessor, first widens the slot (each thread keeps at
/// least one chunk of every row: fewer serial loads per thread), then gives each slot fewer rows. Depends
/// on the shape alone, so a captured decode step replays the same launches.
/// The row-slot cut of a one-to-eight-row bf16 GEMV (`gemv_bf16_m1` …) of `n` rows of `k`.
pub(crate) fn gemv_bf16_plan(n: usize, k: usize, sms: usize) -> GemvPlan {
    gemv_plan(n, k / 8, GEMV_ROWS, sms)
}

pub(crate) fn gemv_plan(n: usize, chunks: usize, max_rows: usize, sms: usize) -> GemvPlan {
    let target = 2 * sms.max(1);
    let c = chunks.clamp(1, GEMV_THREADS);
    let tpr_max = 1usize << (usize::BITS - 1 - c.leading_zeros());
    let blocks = |rps: usize, tpr: usize| n.div_ceil(rps * (GEMV_THREADS / tpr));
    let (mut rps, mut tpr) = (max_rows.max(1), tpr_max.min(32));
    while blocks(rps, tpr) < target && tpr < tpr_max {
        tpr *= 2;
    }
    while blocks(rps, tpr) < target && rps > 1 {
        rps /= 2;
    }
    GemvPlan {
        rps,
        tpr_log2: tpr.trailing_zeros(),
        blocks: blocks(rps, tpr),
    }
}

impl Gpu {
    /// `y[m, :] = W · x[m, :]`, `W`: `[n, k]` row-major, `x`: `[m, k]`, `y`: `[m, n]` bf16.
    /// Needs `1 ≤ m ≤ 8`, `k % 8 == 0` and 16-byte aligned `W` and `x`.
    pub fn gemv_bf16(
        &self,
        w: &impl DevicePtr<bf16>,
        x: &impl DevicePtr<bf16>,
        y: &mut impl DevicePtrMut<bf16>,
        m: usize,
        n: usize,
        k: usize,
    ) -> Result<()> {
        self.gemv("gemv_bf16", x, &mut [(w, y, n)], m, k)
    }

    /// As [`Gpu::gemv_bf16`] with an f32 output (logits, router scores).
    pub fn gemv_bf16_f32(
        &self,
        w: &impl DevicePtr<bf16>,
        x: &impl DevicePtr<bf16>,
        y: &mut impl DevicePtrMut<f32>,
        m: usize,
        n: usize,
        k: usize,
    ) -> Result<()> {
        self.gemv("gemv_bf16_f32", x, &mut [(w, y, n)], m, k)
    }

    /// [`Gpu::gemv_bf16`] for up to [`GEMV_SEGS`] weights that read the same `x` (`[m, k]`), in one
    /// launch: each part's `y` gets `W · x` exactly as its own [`Gpu::gemv_bf16`] computes it.
    pub fn gemv_bf16_many<W: DevicePtr<bf16>, Y: DevicePtrMut<bf16>>(
        &self,
        x: &impl DevicePtr<bf16>,
        parts: &mut [GemvPart<'_, W, Y>],
        m: usize,
        k: usize,
    ) -> Result<()> {
        self.gemv("gemv_bf16", x, parts, m, k)
    }

    fn gemv<O, W: DevicePtr<bf16>, Y: DevicePtrMut<O>>(
        &self,
        base: &str,
        x: &impl DevicePtr<bf16>,
        parts: &mut [GemvPart<'_, W, Y>],
        m: usize,
        k: usize,
    ) -> Result<()> {
        const OP: &str = "gemv";
        ensure((1..=GEMV_MAX_M).contains(&m), OP, || {
            format!("m = {m} rows, expected 1..={GEMV_MAX_M}")
        })?;
        ensure(k.is_multiple_of(8), OP, || {
            format!("k = {k} must be a multiple of 8")
        })?;
        ensure(parts.len() <= GEMV_SEGS, OP, || {
            format!("{} weights, at most {GEMV_SEGS} a launch", parts.len())
        })?;
        check_len(OP, "x", x, m * k)?;
        for (w, y, n) in parts.iter() {
            check_len(OP, "W", *w, n * k)?;
            check_len(OP, "y", &**y, m * n)?;
        }
        let (ki, mi) = (int(OP, "k", k)?, int(OP, "m", m)?);
        let tc = tensor_core_gemv(m, k);
        let sms = self.info().multiprocessors as usize;
        ensure(self.addr(x).is_multiple_of(16), OP, || {
            "x must be 16-byte aligned".into()
        })?;
        let s = self.stream();
        let mut table = SegTable::new();
        let mut guards = Vec::with_capacity(2 * parts.len());
        for (w, y, n) in parts.iter_mut().filter(|p| p.2 > 0) {
            let (wp, gw) = w.device_ptr(s);
            let (yp, gy) = y.device_ptr_mut(s);
            guards.extend([gw, gy]);
            ensure(wp % 16 == 0, OP, || "W must be 16-byte aligned".into())?;
            if tc {
                let addrs = SegAddrs { w: wp, s: 0, y: yp };
                table.push(OP, addrs, *n, n.div_ceil(TC_ROWS), None)?;
            } else {
                let plan = gemv_bf16_plan(*n, k, sms);
                let addrs = SegAddrs { w: wp, s: 0, y: yp };
                table.push(OP, addrs, *n, plan.blocks, Some(plan))?;
            }
        }
        let grid = table.grid(OP)?;
        if grid == 0 {
            return Ok(());
        }
        let segs = table.segs();
        if tc {
            let name = format!(
                "gemv_bf16_tc{}",
                base.strip_prefix("gemv_bf16").unwrap_or("")
            );
            let mut b = self.launch(self.kernel(&name)?);
            b.arg(segs).ptr(x).arg(&ki).arg(&mi);
            // SAFETY: argument types match the kernel; every segment's lengths and alignment checked
            // above and its blocks cover its n; 2 ≤ m ≤ 8 and k % 32 == 0 (tensor_core_gemv).
            unsafe { b.launch(cfg((grid, 1, 1), GEMV_THREADS as u32, 0)) }?;
        } else {
            let mut b = self.launch(self.kernel(&format!("{base}_m{m}"))?);
            b.arg(segs).ptr(x).arg(&ki);
            // SAFETY: argument types match the kernel; lengths, k % 8 and alignment checked above; each
            // segment's plan has rps ≤ GEMV_ROWS, slots of at most the block and blocks covering its n.
            unsafe { b.launch(cfg((grid, 1, 1), GEMV_THREADS as u32, 0)) }?;
        }
        drop(guards);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(n: usize, chunks: usize, max_rows: usize) -> (usize, usize, usize) {
        let p = gemv_plan(n, chunks, max_rows, 132);
        (p.rps, 1 << p.tpr_log2, p.blocks)
    }

    #[test]
    fn large_n_keeps_a_warp_of_max_rows_per_slot() {
        // The lm_head: 4 rows per warp, 32 rows per block.
        assert_eq!(plan(151_936, 256, 4), (4, 32, 4748));
        assert_eq!(plan(12_288, 64, 2), (2, 32, 768));
    }

    #[test]
    fn small_n_widens_slots_then_drops_rows() {
        // The router, n = 512, k = 2048: whole-block slots of one row.
        assert_eq!(plan(512, 256, 4), (1, 256, 512));
        // n = 4096, k = 2048: 128-thread slots of 4 rows.
        assert_eq!(plan(4096, 256, 4), (4, 128, 512));
        // n = 1: one block, the row split over 256 threads.
        assert_eq!(plan(1, 256, 4), (1, 256, 1));
        // Packed k = 512 (16 units a row): slots of 16 threads, one row each.
        assert_eq!(plan(2048, 16, 2), (1, 16, 128));
        // Fewer chunks than a warp: the slot never outgrows the row.
        assert_eq!(plan(64, 1, 4), (1, 1, 1));
    }

    #[test]
    fn batches_take_the_tensor_cores_on_whole_k_blocks() {
        assert!(!tensor_core_gemv(1, 2048));
        assert!(tensor_core_gemv(2, 2048));
        assert!(tensor_core_gemv(8, 32));
        assert!(!tensor_core_gemv(8, 40));
        assert!(!tensor_core_gemv(9, 2048));
    }

    #[test]
    fn every_plan_covers_n_within_the_kernel_limits() {
        for n in [1usize, 7, 64, 100, 512, 2048, 8192, 151_936] {
            for chunks in [1usize, 3, 16, 64, 256, 320, 512, 4096] {
                for max_rows in [2usize, 4] {
                    let p = gemv_plan(n, chunks, max_rows, 132);
                    let tpr = 1usize << p.tpr_log2;
                    assert!((1..=max_rows).contains(&p.rps) && tpr <= GEMV_THREADS);
                    assert!(tpr <= chunks.max(1), "n {n} chunks {chunks}: tpr {tpr}");
                    assert!(p.blocks * p.rps * (GEMV_THREADS / tpr) >= n);
                }
            }
        }
    }
}
