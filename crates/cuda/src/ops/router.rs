//! The MoE router: softmax, top-k with ties to the lower expert id, optional renormalisation. Up to
//! 1024 experts and k ≤ 16 (the decode shapes: 512 experts, top 10) one block per token sorts and merges
//! the experts by warp shuffles (`router_topk_sort`); larger k up to 1024 experts, one warp routes a
//! token with its probabilities in registers (`router_topk_w{8,16,32}`); beyond, one block per token
//! with k arg-max rounds (`router_topk_f32`).
//!
//! [`Gpu::moe_route_decode`] is a decode step's whole routing in one launch (`moe_route.cu`): the
//! router GEMV, the sort-and-merge top-k of every token and the grouping of the pairs by expert that
//! [`Gpu::moe_sort`] does, the last two in the block that finishes its logits last.

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
use half::bf16;

use super::moe::moe_max_tiles;
use crate::error::{ensure, Result};
use crate::gpu::{cfg, check_len, grid_u32, int, Gpu};

/// The largest `k` the router kernel takes.
pub const ROUTER_MAX_K: usize = 64;
/// The largest `k` and `e` of the sort-and-merge kernel (`router_topk_sort`).
const SORT_MAX_K: usize = 16;
const SORT_MAX_E: usize = 1024;
/// Tokens (warps) per block of the one-warp-per-token kernels.
const WARPS_PER_BLOCK: usize = 4;
/// Threads per block of `moe_route_decode_m1` (`ROUTE_THREADS` in moe_route.cu).
const DECODE_THREADS: usize = 512;
/// The widest row slot of `moe_route_decode_m1` (`gemv_slot_sum` sums at most 8 warps).
const DECODE_MAX_SLOT: usize = 256;

/// log2 of the threads per router row of [`Gpu::moe_route_decode`] for rows of `h` values: the widest
/// slot (most blocks, fewest loads a thread: 256 threads and 256 blocks for the 80B's router of 512
/// rows of 2048) that still has a 16-byte chunk of the row per thread, one warp at least. Depends on
/// the shape alone.
fn decode_slot_log2(h: usize) -> u32 {
    let chunks = (h / 8).clamp(32, DECODE_MAX_SLOT);
    usize::BITS - 1 - chunks.leading_zeros()
}

/// A routing: each of `tokens` rows to its `top_k` most probable of `experts`, the kept
/// probabilities divided by their sum when `renormalize`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RouteDims {
    pub tokens: usize,
    pub experts: usize,
    pub top_k: usize,
    pub renormalize: bool,
}

/// What [`Gpu::moe_route_decode`] writes: the router `logits` `[t, e]` f32, each token's `ids` and
/// `weights` `[t, k]`, and the pairs grouped by expert (`perm` `[t·k]`, `tiles`, as
/// [`Gpu::moe_sort`] lays them out).
pub struct DecodeRouting<'a, F: DevicePtrMut<f32>, U: DevicePtrMut<u32>> {
    pub logits: &'a mut F,
    pub ids: &'a mut U,
    pub weights: &'a mut F,
    pub perm: &'a mut U,
    pub tiles: &'a mut U,
}

impl Gpu {
    /// Routes each of `t` tokens to its `k` most probable of `e` experts (`dims`): `p =
    /// softmax(logits)` in f32, the `k` largest kept (ties: lower id), divided by their sum when
    /// `renormalize`. `logits`: `[t, e]`; `ids`, `weights`: `[t, k]`, each row by descending weight.
    /// Matches `sanmai_cpu::ops::route_topk` up to near-ties (probabilities within rounding of each
    /// other).
    pub fn route_topk(
        &self,
        logits: &impl DevicePtr<f32>,
        dims: RouteDims,
        ids: &mut impl DevicePtrMut<u32>,
        weights: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        const OP: &str = "route_topk";
        let RouteDims {
            tokens: t,
            experts: e,
            top_k: k,
            renormalize: renorm,
        } = dims;
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
        if k <= SORT_MAX_K && e <= SORT_MAX_E {
            // One thread an expert, a power-of-two number of warps (the merge tree halves them).
            let threads = (e.div_ceil(32).next_power_of_two() * 32) as u32;
            let mut b = self.launch(self.kernel("router_topk_sort")?);
            b.ptr(logits)
                .ptr_mut(ids)
                .ptr_mut(weights)
                .arg(&ei)
                .arg(&ki)
                .arg(&rn);
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
            b.ptr(logits)
                .ptr_mut(ids)
                .ptr_mut(weights)
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
        b.ptr(logits)
            .ptr_mut(ids)
            .ptr_mut(weights)
            .arg(&ei)
            .arg(&ki)
            .arg(&rn);
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

    /// Whether [`Gpu::moe_route_decode`] takes a step of `t` tokens of width `h` routed to `k` of `e`
    /// experts: one token (`t == 1`: where one launch beats the separate ones, see moe_route.cu), `1 ≤ k ≤ 16`, `k ≤ e ≤ 1024` (the sort-and-merge top-k's limits) and
    /// `h % 8 == 0`.
    pub fn moe_route_decode_fits(t: usize, h: usize, e: usize, k: usize) -> bool {
        t == 1
            && (1..=SORT_MAX_K).contains(&k)
            && k <= e
            && e <= SORT_MAX_E
            && h > 0
            && h.is_multiple_of(8)
    }

    /// A decode step's routing in one launch: `logits = x · routerᵀ` (f32, `[t, e]`, a scratch the
    /// launch also leaves for inspection), then exactly what [`Gpu::route_topk`] writes to `ids` and
    /// `weights` from those logits (`[t, k]`), then exactly the grouping [`Gpu::moe_sort`] describes in
    /// `perm` (`[t·k]`) and `tiles` (`[moe_max_tiles(t·k, e), 3]`), each expert's pairs in ascending
    /// order. `router`: `[e, h]` bf16, `x`: `[t, h]` bf16, both 16-byte aligned. `ticket`: one `u32`
    /// that is 0 before the launch and is left 0 (allocate it zeroed once and pass the same buffer to
    /// every launch of the stream). Needs [`Gpu::moe_route_decode_fits`].
    pub fn moe_route_decode(
        &self,
        router: &impl DevicePtr<bf16>,
        x: &impl DevicePtr<bf16>,
        h: usize,
        dims: RouteDims,
        out: DecodeRouting<'_, impl DevicePtrMut<f32>, impl DevicePtrMut<u32>>,
        ticket: &mut impl DevicePtrMut<u32>,
    ) -> Result<()> {
        self.moe_route_decode_gate(router, None, x, h, dims, out, ticket)
    }

    /// [`Gpu::moe_route_decode`] with one more bf16 row, `gate` `[h]` (a shared expert's gate): its
    /// logit for the token lands at `logits[e]` (`logits` then holds `e + 1` values), in the same
    /// launch.
    #[allow(clippy::too_many_arguments)]
    pub fn moe_route_decode_gate(
        &self,
        router: &impl DevicePtr<bf16>,
        gate: Option<&CudaSlice<bf16>>,
        x: &impl DevicePtr<bf16>,
        h: usize,
        dims: RouteDims,
        out: DecodeRouting<'_, impl DevicePtrMut<f32>, impl DevicePtrMut<u32>>,
        ticket: &mut impl DevicePtrMut<u32>,
    ) -> Result<()> {
        const OP: &str = "moe_route_decode";
        let RouteDims {
            tokens: t,
            experts: e,
            top_k: k,
            renormalize: renorm,
        } = dims;
        let DecodeRouting {
            logits,
            ids,
            weights,
            perm,
            tiles,
        } = out;
        ensure(Self::moe_route_decode_fits(t, h, e, k), OP, || {
            format!(
                "t = {t}, h = {h}, e = {e}, k = {k}: needs t = 1, \
                 1 ≤ k ≤ {SORT_MAX_K}, k ≤ e ≤ {SORT_MAX_E}, h % 8 == 0"
            )
        })?;
        let n = t * k;
        let max_tiles = moe_max_tiles(n, e);
        check_len(OP, "router", router, e * h)?;
        check_len(OP, "x", x, t * h)?;
        let extra = usize::from(gate.is_some());
        check_len(OP, "logits", logits, t * e + extra)?;
        if let Some(gw) = gate {
            check_len(OP, "gate", gw, h)?;
        }
        check_len(OP, "ids", ids, n)?;
        check_len(OP, "weights", weights, n)?;
        check_len(OP, "perm", perm, n)?;
        check_len(OP, "tiles", tiles, 3 * max_tiles)?;
        check_len(OP, "ticket", ticket, 1)?;
        let slot_log2 = decode_slot_log2(h);
        let blocks = (e + extra).div_ceil(DECODE_THREADS >> slot_log2);
        let (ei, hi, ki, rn, mt, sl) = (
            int(OP, "e", e)?,
            int(OP, "h", h)?,
            k as i32,
            i32::from(renorm),
            int(OP, "max_tiles", max_tiles)?,
            slot_log2 as i32,
        );
        ensure(
            self.addr(router).is_multiple_of(16)
                && self.addr(x).is_multiple_of(16)
                && gate.is_none_or(|gw| self.addr(gw).is_multiple_of(16)),
            OP,
            || "router, gate and x must be 16-byte aligned".into(),
        )?;
        let gp = gate.map_or(0, |gw| self.addr(gw));
        let mut b = self.launch(self.kernel("moe_route_decode_m1")?);
        b.ptr(router)
            .arg(&gp)
            .ptr(x)
            .ptr_mut(logits)
            .ptr_mut(ids)
            .ptr_mut(weights)
            .ptr_mut(perm)
            .ptr_mut(tiles)
            .ptr_mut(ticket)
            .arg(&ei)
            .arg(&hi)
            .arg(&ki)
            .arg(&rn)
            .arg(&mt)
            .arg(&sl);
        let smem = 4 * (2 * e + 2);
        // SAFETY: argument types match the kernel; every length and the alignment checked above; the
        // grid's blocks of 512 threads in slots of 32..=256 threads cover the e rows; e ≤ 1024 and
        // k ≤ 16 as the top-k needs, t·k ≤ 128 pairs as its shared copy of the ids holds; the dynamic
        // shared memory is moe_sort_block's (2·e + 2) u32.
        unsafe {
            b.launch(cfg(
                (grid_u32(OP, blocks)?, 1, 1),
                DECODE_THREADS as u32,
                smem as u32,
            ))
        }?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decode_slots_take_the_widest_cut_the_row_fills() {
        // 2048 and 2560 values (256 and 320 chunks): 256-thread slots, 2 rows a block, so the 80B's
        // router of 512 rows is 256 blocks.
        assert_eq!(decode_slot_log2(2048), 8);
        assert_eq!(decode_slot_log2(2560), 8);
        assert_eq!(
            512usize.div_ceil(DECODE_THREADS >> decode_slot_log2(2048)),
            256
        );
        // 1000 values (125 chunks): 64 threads; short rows keep a warp.
        assert_eq!(decode_slot_log2(1000), 6);
        assert_eq!(decode_slot_log2(64), 5);
        assert_eq!(decode_slot_log2(8), 5);
    }

    #[test]
    fn decode_routing_takes_decode_shapes_only() {
        assert!(Gpu::moe_route_decode_fits(1, 2048, 512, 10));
        assert!(Gpu::moe_route_decode_fits(1, 2560, 1024, 16));
        assert!(!Gpu::moe_route_decode_fits(2, 2048, 512, 10));
        assert!(!Gpu::moe_route_decode_fits(0, 2048, 512, 10));
        assert!(!Gpu::moe_route_decode_fits(1, 2048, 512, 17));
        assert!(!Gpu::moe_route_decode_fits(1, 2048, 2048, 10));
        assert!(!Gpu::moe_route_decode_fits(1, 2044, 512, 10));
        assert!(!Gpu::moe_route_decode_fits(1, 64, 8, 9));
    }
}
