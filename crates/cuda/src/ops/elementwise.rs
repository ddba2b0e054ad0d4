//! SwiGLU on a fused gate|up buffer, and the embedding gather.

use cudarc::driver::{DevicePtr, DevicePtrMut};
use half::bf16;

use crate::error::Result;
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
}
