//! SwiGLU on a fused gate|up buffer, the embedding gather, and the L2 prefetch of weights ahead of use.

use cudarc::driver::{DevicePtr, DevicePtrMut};
use half::bf16;

use crate::error::{CudaError, Result};
use crate::gpu::{cfg, check_len, grid_u32, int, Gpu};

impl Gpu {
    /// `out[s, j] = silu(gate_up[s, j]) · gate_up[s, i + j]`. `gate_up`: `[t, 2i]`; `out`: `[t, i]`.
    pub fn swiglu(
        &self,
        gate_up: &impl DevicePtr<bf16>,
        out: &mut impl DevicePtrMut<bf16>,
        t: usize,
        i: usize,
    ) -> Result<()> {
        const OP: &str = "swiglu";
        check_len(OP, "gate_up", gate_up, t * 2 * i)?;
        check_len(OP, "out", out, t * i)?;
        if t * i == 0 {
            return Ok(());
        }
        let ii = int(OP, "i", 2 * i)? / 2;
        let tt = t as i64;
        let blocks = grid_u32(OP, (t * i).div_ceil(256).min(1 << 20))?;
        let mut b = self.launch(self.kernel("swiglu_bf16")?);
        b.ptr(gate_up).ptr_mut(out).arg(&tt).arg(&ii);
        // SAFETY: argument types match the kernel; lengths checked above.
        unsafe { b.launch(cfg((blocks, 1, 1), 256, 0)) }?;
        Ok(())
    }

    /// `out[s, :] = table[ids[s], :]` (zeros for an id ≥ `vocab`). `table`: `[vocab, hidden]`;
    /// `ids`: `[t]`; `out`: `[t, hidden]`.
    pub fn embed(
        &self,
        table: &impl DevicePtr<bf16>,
        ids: &impl DevicePtr<u32>,
        out: &mut impl DevicePtrMut<bf16>,
        vocab: usize,
        hidden: usize,
        t: usize,
    ) -> Result<()> {
        const OP: &str = "embed";
        check_len(OP, "table", table, vocab * hidden)?;
        check_len(OP, "ids", ids, t)?;
        check_len(OP, "out", out, t * hidden)?;
        if t == 0 || hidden == 0 {
            return Ok(());
        }
        let v = u32::try_from(vocab).unwrap_or(u32::MAX);
        let h = int(OP, "hidden", hidden)?;
        let threads = (if hidden.is_multiple_of(8) {
            hidden / 8
        } else {
            hidden
        })
        .div_ceil(32)
        .clamp(1, 8) as u32
            * 32;
        let vec = i32::from(
            hidden.is_multiple_of(8)
                && self.addr(table).is_multiple_of(16)
                && self.addr_mut(out).is_multiple_of(16),
        );
        let mut b = self.launch(self.kernel("embed_bf16")?);
        b.ptr(table).ptr(ids).ptr_mut(out).arg(&v).arg(&h).arg(&vec);
        // SAFETY: argument types match the kernel; lengths checked above; the kernel reads table rows
        // only for ids below `vocab`.
        unsafe { b.launch(cfg((grid_u32(OP, t)?, 1, 1), threads, 0)) }?;
        Ok(())
    }

    /// Asks L2 for up to four device byte ranges `(address, bytes)` that no op of the step writes
    /// (the weights of a later launch), in a launch of its own (`l2_prefetch`) that exits once the
    /// requests are issued: a hint, no value changes. Nothing is launched without PDL (sm_90 and
    /// later, whose bulk prefetch it issues) or when no range has bytes.
    pub fn l2_prefetch(&self, ranges: &[(u64, usize)]) -> Result<()> {
        const OP: &str = "l2_prefetch";
        if ranges.len() > 4 {
            return Err(CudaError::Shape {
                op: OP,
                msg: format!("{} ranges; at most 4", ranges.len()),
            });
        }
        let total: usize = ranges.iter().map(|r| r.1).sum();
        if !self.pdl() || total == 0 {
            return Ok(());
        }
        let mut args = [(0u64, 0i64); 4];
        for (slot, &(addr, bytes)) in args.iter_mut().zip(ranges) {
            *slot = (addr, i64::try_from(bytes).unwrap_or(i64::MAX));
        }
        // One 32 KB request a thread (PDL_PREFETCH_PIECE), 128 threads a block, at most 8 blocks.
        let blocks = total.div_ceil(32768).div_ceil(128).clamp(1, 8) as u32;
        let mut b = self.launch(self.kernel(OP)?);
        for (addr, bytes) in &args {
            b.arg(addr).arg(bytes);
        }
        // SAFETY: four (pointer, i64) pairs as the kernel takes them; it only issues L2 prefetches of
        // the ranges, which read nothing into the kernel and write nothing.
        unsafe { b.launch(cfg((blocks, 1, 1), 128, 0)) }?;
        Ok(())
    }
}
