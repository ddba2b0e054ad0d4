//! NeoX-style partial rotary embedding, in place.

use cudarc::driver::{DevicePtr, DevicePtrMut};
use half::bf16;

use super::{HeadLayout, RopeArgs};
use crate::error::{ensure, Result};
use crate::gpu::{cfg, check_len, grid_u32, int, Gpu};

impl Gpu {
    /// Rotates the first `rot_dim` dims of every head of the `layout.rows` token rows in place. Head
    /// `h` of token `s` starts at element `s·row_stride + h·head_stride` of `x` (plain `[t,
    /// n_heads·head_dim]` is `row_stride = n_heads·head_dim`, `head_stride = head_dim`; q inside a
    /// fused `[q | gate]` row uses `head_stride = 2·head_dim`). `positions`: `[t]`; `inv_freq`:
    /// `[rot_dim/2]`; `mscale` scales cos and sin. Matches `sanmai_cpu::ops::rope_neox`.
    pub fn rope_neox(
        &self,
        x: &mut impl DevicePtrMut<bf16>,
        layout: HeadLayout,
        rope: &RopeArgs<'_, impl DevicePtr<f32>, impl DevicePtr<u32>>,
    ) -> Result<()> {
        const OP: &str = "rope_neox";
        let HeadLayout {
            rows: t,
            n_heads,
            head_dim,
            row_stride,
            head_stride,
        } = layout;
        let RopeArgs {
            positions,
            inv_freq,
            rot_dim,
            mscale,
        } = *rope;
        ensure(rot_dim.is_multiple_of(2) && rot_dim <= head_dim, OP, || {
            format!("rot_dim {rot_dim} must be even and at most head_dim {head_dim}")
        })?;
        ensure(head_stride >= head_dim, OP, || {
            "head_stride < head_dim".into()
        })?;
        let half = rot_dim / 2;
        if t == 0 || n_heads == 0 || half == 0 {
            return Ok(());
        }
        let extent = (t - 1) * row_stride + (n_heads - 1) * head_stride + head_dim;
        check_len(OP, "x", x, extent)?;
        check_len(OP, "positions", positions, t)?;
        check_len(OP, "inv_freq", inv_freq, half)?;
        let grid = grid_u32(OP, t)?;
        let (nh, hf) = (int(OP, "n_heads", n_heads)?, int(OP, "rot_dim", half)?);
        let (rs, hs) = (row_stride as i64, head_stride as i64);
        let threads = ((n_heads * half).div_ceil(32) * 32).clamp(32, 512) as u32;
        let mut b = self.launch(self.kernel("rope_neox_bf16")?);
        b.ptr_mut(x)
            .ptr(positions)
            .ptr(inv_freq)
            .arg(&nh)
            .arg(&hf)
            .arg(&rs)
            .arg(&hs)
            .arg(&mscale);
        // SAFETY: argument types match the kernel; the strided extent is inside `x` (checked above).
        unsafe { b.launch(cfg((grid, 1, 1), threads, 0)) }?;
        Ok(())
    }
}
