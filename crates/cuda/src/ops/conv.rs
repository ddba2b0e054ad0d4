//! Depthwise causal conv1d + SiLU over the prefill chunks of a step, with the conv state ring of each
//! sequence (`[kernel, c]` per slot, input `x_q` at entry `q mod kernel`; the decode step reads and
//! writes the same ring inside `gdn_decode`).

use cudarc::driver::{DevicePtr, DevicePtrMut};
use half::bf16;

use super::SeqRows;
use crate::error::{ensure, Result};
use crate::gpu::{cfg, check_len, grid_u32, int, Gpu};

/// Rows of one channel a prefill thread convolves (about).
const ROWS_PER_THREAD: usize = 16;

/// A depthwise causal conv's weight `w` `[channels, kernel]`.
pub struct ConvWeight<'a, W: DevicePtr<bf16>> {
    pub w: &'a W,
    pub channels: usize,
    pub kernel: usize,
}

impl Gpu {
    /// Prefill of every sequence of a step: sequence `i` of `seqs` owns rows
    /// `starts[i] .. starts[i] + lens[i]` of `x` and `out` (`[rows, c]`; clamped to `rows`), row `r`
    /// at position `positions[r]` (the chunk's positions are consecutive), and slot `slots[i]` of
    /// `state_pool` `[num_slots, kernel, c]`, a ring holding input `x_q` at entry `q mod kernel`. Per
    /// row at position `p`: `out[p, ch] = silu(Σ_j w[ch, j] · x_{p−kernel+1+j}[ch])`, inputs before
    /// the chunk read from the ring; then the chunk's last `min(len, kernel − 1)` inputs are stored in
    /// the ring.
    /// A slot id out of range gives zero outputs and touches no state; rows of no sequence are
    /// untouched. Two launches (the convolution, then the ring stores), whatever the number of
    /// sequences. Matches `sanmai_cpu::ops::causal_conv1d_silu` per sequence, whose `[kernel − 1, c]`
    /// state is the ring's entries of the `kernel − 1` positions before the chunk.
    pub fn conv1d_prefill(
        &self,
        x: &impl DevicePtr<bf16>,
        conv: &ConvWeight<'_, impl DevicePtr<bf16>>,
        state_pool: &mut impl DevicePtrMut<bf16>,
        positions: &impl DevicePtr<u32>,
        seqs: &SeqRows<'_, impl DevicePtr<u32>>,
        out: &mut impl DevicePtrMut<bf16>,
    ) -> Result<()> {
        const OP: &str = "conv1d_prefill";
        let ConvWeight {
            w,
            channels: c,
            kernel,
        } = *conv;
        let SeqRows {
            starts,
            lens,
            slots,
            rows,
            n_seq,
            max_len,
        } = *seqs;
        ensure(kernel >= 1, OP, || "kernel size must be at least 1".into())?;
        ensure(n_seq <= 65535, OP, || {
            format!("{n_seq} sequences exceed 65535")
        })?;
        check_len(OP, "x", x, rows * c)?;
        check_len(OP, "w", w, c * kernel)?;
        check_len(OP, "positions", positions, rows)?;
        check_len(OP, "starts", starts, n_seq)?;
        check_len(OP, "lens", lens, n_seq)?;
        check_len(OP, "slots", slots, n_seq)?;
        check_len(OP, "out", out, rows * c)?;
        if rows == 0 || n_seq == 0 || max_len == 0 || c == 0 {
            return Ok(());
        }
        let num_slots = u32::try_from(state_pool.len() / (kernel * c)).unwrap_or(u32::MAX);
        let (ri, ci, ki) = (
            int(OP, "rows", rows)?,
            int(OP, "c", c)?,
            int(OP, "kernel", kernel)?,
        );
        // Blocks of 256 channels by groups of rows by sequences: a thread takes about ROWS_PER_THREAD
        // rows of its channel (strided), which hides the latency of its first loads.
        let grid = (
            grid_u32(OP, c.div_ceil(256))?,
            max_len.min(rows).div_ceil(ROWS_PER_THREAD).min(65535) as u32,
            n_seq as u32,
        );
        let mut b = self.launch(self.kernel("conv1d_prefill_seqs_bf16")?);
        b.ptr(x)
            .ptr(w)
            .ptr_mut(state_pool)
            .ptr(positions)
            .ptr(starts)
            .ptr(lens)
            .ptr(slots)
            .ptr_mut(out)
            .arg(&ri)
            .arg(&ci)
            .arg(&ki)
            .arg(&num_slots);
        // SAFETY: argument types match the kernel; lengths checked above; the kernel clamps every
        // sequence's rows to `rows` (so the position it reads lies inside `positions`) and skips slot
        // ids at or beyond `num_slots`.
        unsafe { b.launch(cfg(grid, 256, 0)) }?;
        drop(b);
        // With kernel 1 no later token reads an input of the chunk.
        if kernel > 1 {
            let mut b = self.launch(self.kernel("conv1d_ring_store_seqs_bf16")?);
            b.ptr(x)
                .ptr_mut(state_pool)
                .ptr(positions)
                .ptr(starts)
                .ptr(lens)
                .ptr(slots)
                .arg(&ri)
                .arg(&ci)
                .arg(&ki)
                .arg(&num_slots);
            // SAFETY: as above; queued after the convolution on the same stream.
            let grid = (grid_u32(OP, c.div_ceil(256))?, n_seq as u32, 1);
            unsafe { b.launch(cfg(grid, 256, 0)) }?;
        }
        Ok(())
    }
}
