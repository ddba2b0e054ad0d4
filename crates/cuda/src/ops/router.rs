//! The MoE router: softmax, top-k with ties to the lower expert id, optional renormalisation. Up to
//! 1024 experts and k ≤ 16 (the decode shapes: 512 experts, top 10) one block per token sorts and merges
//! the experts by warp shuffles (`router_topk_sort`); larger k up to 1024 experts, one warp routes a
//! token with its probabilities in registers (`router_topk_w{8,16,32}`); beyond, one block per token
//! with k arg-max rounds (`router_topk_f32`).

use cudarc::driver::{DevicePtr, DevicePtrMut};

use crate::error::{ensure, Result};
use crate::gpu::{cfg, check_len, grid_u32, int, Gpu};

/// The largest `k` the router kernel takes.
pub const ROUTER_MAX_K: usize = 64;
/// The largest `k` and `e` of the sort-and-merge kernel (`router_topk_sort`).
const SORT_MAX_K: usize = 16;
const SORT_MAX_E: usize = 1024;
/// Tokens (warps) per block of the one-warp-per-token kernels.
const WARPS_PER_BLOCK: usize = 4;

impl Gpu {
    /// Routes each of `t` tokens to its `k` most probable of `e` experts: `p = softmax(logits)` in
    /// f32, the `k` largest kept (ties: lower id), divided by their sum when `renorm`. `logits`:
    /// `[t, e]`; `ids`, `weights`: `[t, k]`, each row by descending weight. Matches
    /// `sanmai_cpu::ops::route_topk` up to near-ties (probabilities within rounding of each other).
    #[allow(clippy::too_many_arguments)]
    pub fn route_topk(
        &self,
        logits: &impl DevicePtr<f32>,
        ids: &mut impl DevicePtrMut<u32>,
        weights: &mut impl DevicePtrMut<f32>,
        t: usize,
        e: usize,
        k: usize,
        renorm: bool,
    ) -> Result<()> {
        const OP: &str = "route_topk";
        ensure(k >= 1 && k <= e && k <= ROUTER_MAX_K, OP, || {
            format!(
                "k = {k} must be in 1..={} and at most e = {e}",
                ROUTER_MAX_K
            )
        })?;
        let smem = 5 * e;
        ensure(smem <= 48 * 1024, OP, || {
            format!("{e} experts exceed shared memory")
        })?;
        check_len(OP, "logits", logits, t * e)?;
        check_len(OP, "ids", ids, t * k)?;
        check_len(OP, "weights", weights, t * k)?;
        if t == 0 {
            return Ok(());
        }
        let (ei, ki, rn) = (int(OP, "e", e)?, k as i32, i32::from(renorm));
        let s = self.stream();
        let (lp, _gl) = logits.device_ptr(s);
        let (ip, _gi) = ids.device_ptr_mut(s);
        let (wp, _gw) = weights.device_ptr_mut(s);
        if k <= SORT_MAX_K && e <= SORT_MAX_E {
            // One thread an expert, a power-of-two number of warps (the merge tree halves them).
            let threads = (e.div_ceil(32).next_power_of_two() * 32) as u32;
            let mut b = self.launch(self.kernel("router_topk_sort")?);
            b.arg(&lp).arg(&ip).arg(&wp).arg(&ei).arg(&ki).arg(&rn);
            // SAFETY: argument types match the kernel; lengths checked above; e ≤ threads ≤ 1024
            // and k ≤ 16 as the kernel requires.
            unsafe { b.launch(cfg((grid_u32(OP, t)?, 1, 1), threads, 0)) }?;
            return Ok(());
        }
        let warp_kernel = match e {
            0..=256 => Some("router_topk_w8"),
            257..=512 => Some("router_topk_w16"),
            513..=1024 => Some("router_topk_w32"),
            _ => None,
        };
        if let Some(name) = warp_kernel {
            let ti = int(OP, "t", t)?;
            let mut b = self.launch(self.kernel(name)?);
            b.arg(&lp)
                .arg(&ip)
                .arg(&wp)
                .arg(&ti)
                .arg(&ei)
                .arg(&ki)
                .arg(&rn);
            let warps = t.min(WARPS_PER_BLOCK);
            // SAFETY: argument types match the kernel; lengths checked above; e ≤ 32·V for the
            // kernel's V, so every token's row fits its warp's registers.
            unsafe {
                b.launch(cfg(
                    (grid_u32(OP, t.div_ceil(warps))?, 1, 1),
                    (32 * warps) as u32,
                    0,
                ))
            }?;
            return Ok(());
        }
        let threads = (e.div_ceil(32) * 32).clamp(32, 256) as u32;
        let mut b = self.launch(self.kernel("router_topk_f32")?);
        b.arg(&lp).arg(&ip).arg(&wp).arg(&ei).arg(&ki).arg(&rn);
        // SAFETY: argument types match the kernel; lengths and shared memory checked above.
        unsafe {
            b.launch(cfg(
                (grid_u32(OP, t)?, 1, 1),
                threads,
                smem.div_ceil(4) as u32 * 4,
            ))
        }?;
        Ok(())
    }
}
