//! The gated delta rule's prefill on the GPU: every sequence of a step in one launch, each walked chunk
//! by chunk in the WY / UT-transform form (`kernels/gdn_chunk.cu`), state f32 in its slot.

use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{DevicePtr, DevicePtrMut};
use half::bf16;

use super::{GdnDims, SeqRows};
use crate::error::{ensure, Result};
use crate::gpu::{cfg, check_len, int, Gpu};

/// Threads of a block (`GDN_CHUNK_THREADS` in `gdn_chunk.cu`).
const THREADS: u32 = 256;
/// Value columns of a block (`GDN_CHUNK_COLS`).
const COLS: usize = 32;
/// The largest key head size of `gdn_chunk_prefill` (chunks of 32 tokens).
const SMALL_DK: usize = 128;
/// The largest key head size of `gdn_chunk_prefill_dk256` (chunks of 16 tokens).
const MAX_DK: usize = 256;

/// The kernel for key heads of `dk` and its chunk length.
fn variant(dk: usize) -> (&'static str, usize) {
    if dk <= SMALL_DK {
        ("gdn_chunk_prefill", 32)
    } else {
        ("gdn_chunk_prefill_dk256", 16)
    }
}

/// Dynamic shared memory of a block, as `gdn_chunk_impl` lays it out: q and k of the chunk
/// (`[chunk, dk4 + 4]` each), the state columns (`[dk4, 32]`), A and P (`[chunk, chunk]` each), the
/// value slab (`[chunk, 32]`) and three per-token vectors, f32; `dk4` is `dk` rounded up to 4.
/// At most 70 KiB (dk 256), inside the 99 KiB a block may opt into on sm_86.
fn shared_bytes(dk: usize, chunk: usize) -> usize {
    let dk4 = dk.div_ceil(4) * 4;
    4 * (2 * chunk * (dk4 + 4) + dk4 * COLS + 2 * chunk * chunk + chunk * COLS + 3 * chunk)
}

/// The inputs of the GDN gates (`g = −exp(A_log)·softplus(a + dt_bias)`, `β = sigmoid(b)`): the raw
/// projections `a`, `b` `[rows, hv]` and the weights `a_log`, `dt_bias` `[hv]`.
pub struct GdnGates<'a, B: DevicePtr<bf16>, F: DevicePtr<f32>> {
    pub a: &'a B,
    pub b: &'a B,
    pub a_log: &'a F,
    pub dt_bias: &'a F,
}

impl Gpu {
    /// The gated delta rule over every sequence of a prefill step (chunks of any length, one-token
    /// decode rows included), one launch: one block per (sequence, value head, 32 value columns), each
    /// walking its sequence in chunks of 32 tokens (16 for `dk` above 128).
    ///
    /// `qkv`: `[rows, conv_dim]`, the conv+SiLU output `[q | k | v]` (q, k `[hk, dk]`, v `[hv, dv]`);
    /// the gates' inputs; `seqs` the step's sequences (each sequence's slot of `state_pool`
    /// `[num_slots, hv, dk, dv]` is read at the start and written at the end; `max_len` is not read);
    /// `out`: `[rows, hv·dv]`, rows of no sequence untouched. Matches the CPU's gates followed by
    /// `sanmai_cpu::ops::gdn_chunked` per sequence (equal to `gdn_recurrent` up to f32 rounding).
    pub fn gdn_chunk_prefill(
        &self,
        dims: GdnDims,
        qkv: &impl DevicePtr<bf16>,
        gates: &GdnGates<'_, impl DevicePtr<bf16>, impl DevicePtr<f32>>,
        state_pool: &mut impl DevicePtrMut<f32>,
        seqs: &SeqRows<'_, impl DevicePtr<u32>>,
        out: &mut impl DevicePtrMut<bf16>,
    ) -> Result<()> {
        const OP: &str = "gdn_chunk_prefill";
        let GdnGates {
            a,
            b,
            a_log,
            dt_bias,
        } = *gates;
        let SeqRows {
            starts,
            lens,
            slots,
            rows,
            n_seq,
            ..
        } = *seqs;
        let GdnDims { hk, hv, dk, dv } = dims;
        ensure(hk > 0 && hv > 0 && hv % hk == 0, OP, || {
            format!("hv = {hv} must be a positive multiple of hk = {hk}")
        })?;
        ensure(dk > 0 && dk <= MAX_DK && dv > 0, OP, || {
            format!("dk = {dk} must be in 1..={MAX_DK}, dv = {dv} positive")
        })?;
        ensure(n_seq <= 65535, OP, || {
            format!("{n_seq} sequences exceed 65535")
        })?;
        let cd = dims.conv_dim();
        check_len(OP, "qkv", qkv, rows * cd)?;
        check_len(OP, "a", a, rows * hv)?;
        check_len(OP, "b", b, rows * hv)?;
        check_len(OP, "a_log", a_log, hv)?;
        check_len(OP, "dt_bias", dt_bias, hv)?;
        check_len(OP, "starts", starts, n_seq)?;
        check_len(OP, "lens", lens, n_seq)?;
        check_len(OP, "slots", slots, n_seq)?;
        check_len(OP, "out", out, rows * hv * dv)?;
        if rows == 0 || n_seq == 0 {
            return Ok(());
        }
        let num_slots = u32::try_from(state_pool.len() / dims.state_len()).unwrap_or(u32::MAX);
        let q_scale = (dk as f64).powf(-0.5) as f32;
        let (rows_i, hki, hvi, dki, dvi) = (
            int(OP, "rows", rows)?,
            int(OP, "hk", hk)?,
            int(OP, "hv", hv)?,
            dk as i32,
            int(OP, "dv", dv)?,
        );
        let (qkv_stride, ab_stride) = (cd as i64, hv as i64);
        let (name, chunk) = variant(dk);
        let smem = shared_bytes(dk, chunk);
        let f = self.kernel(name)?;
        // Above the default 48 KiB of dynamic shared memory a kernel must opt in (a host-side attribute
        // of the function, no stream operation).
        f.set_attribute(
            CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            smem as i32,
        )?;
        let grid = (hvi as u32, dv.div_ceil(COLS) as u32, n_seq as u32);
        let s = self.stream();
        let (qp, _gq) = qkv.device_ptr(s);
        let kp = qp + (hk * dk * 2) as u64;
        let vp = qp + (2 * hk * dk * 2) as u64;
        let mut l = self.launch(f);
        l.arg(&qp)
            .arg(&kp)
            .arg(&vp)
            .arg(&qkv_stride)
            .ptr(a)
            .ptr(b)
            .arg(&ab_stride)
            .ptr(a_log)
            .ptr(dt_bias)
            .ptr_mut(state_pool)
            .ptr(starts)
            .ptr(lens)
            .ptr(slots)
            .ptr_mut(out)
            .arg(&rows_i)
            .arg(&hki)
            .arg(&hvi)
            .arg(&dki)
            .arg(&dvi)
            .arg(&q_scale)
            .arg(&num_slots);
        // SAFETY: argument types match the kernel; lengths checked above (k and v lie inside each qkv
        // row); the kernel clamps every sequence's rows to `rows` and skips slot ids at or beyond
        // `num_slots`; the block size is the GDN_CHUNK_THREADS it requires, dk is within the chosen
        // kernel's limit and its shared memory is the layout's size, opted in above.
        unsafe { l.launch(cfg(grid, THREADS, smem as u32)) }?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_memory_fits_sm86_opt_in() {
        // 99 KiB is the most a block may opt into on sm_86 (sm_90: 227 KiB).
        for dk in [1, 16, 48, 64, 127, 128, 129, 192, 255, 256] {
            let (_, chunk) = variant(dk);
            assert!(shared_bytes(dk, chunk) <= 99 * 1024, "dk {dk}");
        }
        assert_eq!(shared_bytes(128, 32), 62_848);
    }
}
