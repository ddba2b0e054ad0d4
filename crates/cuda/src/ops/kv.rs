//! Attention input preparation (per-head q/k RMSNorm + partial NeoX RoPE, the gate split out of the
//! fused `[q | gate]` projection), the write of new K/V rows into the paged pools, and the staging of
//! one sequence's rows into a contiguous VRAM buffer (the prefill of K/V rows kept in host memory).

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
use half::bf16;

use super::{row_threads, KvPools};
use crate::error::{ensure, Result};
use crate::gpu::{cfg, check_len, grid_u32, int, Gpu};

/// The largest head size [`Gpu::qk_norm_rope`] takes (`KV_MAX_D` in `kv.cu`).
pub const QK_MAX_HEAD_DIM: usize = 256;

/// Where the heads of a [`Gpu::qk_norm_rope`] or [`Gpu::rope_neox`] input lie.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeadLayout {
    pub rows: usize,
    pub n_heads: usize,
    pub head_dim: usize,
    /// Elements between consecutive rows of the input.
    pub row_stride: usize,
    /// Elements between consecutive heads of a row (`2·head_dim` inside a fused `[q | gate]` row).
    pub head_stride: usize,
}

/// The rotary embedding of [`Gpu::qk_norm_rope`] and [`Gpu::rope_neox`]: each row's position
/// (`positions` `[rows]`, device), `rot_dim / 2` inverse frequencies (device) and the cos/sin scale.
pub struct RopeArgs<'a, F: DevicePtr<f32>, P: DevicePtr<u32>> {
    pub positions: &'a P,
    pub inv_freq: &'a F,
    pub rot_dim: usize,
    pub mscale: f32,
}

/// The rotary embedding of [`Gpu::qk_norm_rope_mrope`]: the plain arguments `rope` (the rows'
/// sequence positions, checked but not used for the angle, the inverse frequencies, `rot_dim` and
/// the cos/sin scale) with explicit interleaved-MRoPE positions, `(t, h, w)` of every row
/// (`positions` `[rows, 3]`, device), and the config's `mrope_section` (how many rotary frequencies
/// each axis owns; they sum to `rot_dim / 2`). Frequency `j` of row `r` turns by
/// `positions[r][sanmai_model::backend::mrope_axis(j, sections)]`.
pub struct MropeArgs<'a, F: DevicePtr<f32>, P: DevicePtr<u32>, Q: DevicePtr<u32>> {
    pub rope: &'a RopeArgs<'a, F, P>,
    pub positions: &'a Q,
    pub sections: [usize; 3],
}

/// What [`Gpu::qk_norm_rope`] and [`Gpu::qk_norm_rope_mrope`] turn by: the rotary arguments and,
/// for the latter, the MRoPE positions and sections.
struct Rotation<'a, F: DevicePtr<f32>, P: DevicePtr<u32>, Q: DevicePtr<u32>> {
    rope: &'a RopeArgs<'a, F, P>,
    mrope: Option<(&'a Q, [usize; 3])>,
}

/// The per-head RMSNorm of [`Gpu::qk_norm_rope`]: the zero-centred weight `w` `[head_dim]` (the
/// norm scales by `1 + w`) and the epsilon.
pub struct HeadNorm<'a, W: DevicePtr<bf16>> {
    pub w: &'a W,
    pub eps: f32,
}

impl Gpu {
    /// Per head: `y = rms_norm(x_head)·(1 + w)` then NeoX RoPE on the first `rot_dim` dims at
    /// `positions[row]`, in f32 with one rounding; `out`: `[rows, n_heads·head_dim]`. With `gate_out`
    /// (`[rows, n_heads·head_dim]`), the `head_dim` values after each input head (the gate half of a
    /// fused `[q | gate]` head) are copied there. Matches `sanmai_cpu::ops::rms_norm` (offset 1)
    /// followed by `sanmai_cpu::ops::rope_neox`.
    pub fn qk_norm_rope(
        &self,
        x: &impl DevicePtr<bf16>,
        layout: HeadLayout,
        norm: &HeadNorm<'_, impl DevicePtr<bf16>>,
        rope: &RopeArgs<'_, impl DevicePtr<f32>, impl DevicePtr<u32>>,
        out: &mut impl DevicePtrMut<bf16>,
        gate_out: Option<&mut cudarc::driver::CudaViewMut<'_, bf16>>,
    ) -> Result<()> {
        let rot: Rotation<'_, _, _, CudaSlice<u32>> = Rotation { rope, mrope: None };
        self.qk_norm_rope_at(x, layout, norm, rot, out, gate_out)
    }

    /// [`Gpu::qk_norm_rope`] turning each row at explicit interleaved-MRoPE positions
    /// (`mrope.positions[row]`, frequency `j` at axis `mrope_axis(j, mrope.sections)`) instead of
    /// `mrope.rope.positions[row]`: the angle is the same f32 product of the position and the
    /// frequency, so positions equal to the sequence positions on every axis give the same bits.
    /// Matches `sanmai_cpu::ops::rope_mrope_interleaved` after the norm.
    pub fn qk_norm_rope_mrope(
        &self,
        x: &impl DevicePtr<bf16>,
        layout: HeadLayout,
        norm: &HeadNorm<'_, impl DevicePtr<bf16>>,
        mrope: &MropeArgs<'_, impl DevicePtr<f32>, impl DevicePtr<u32>, impl DevicePtr<u32>>,
        out: &mut impl DevicePtrMut<bf16>,
        gate_out: Option<&mut cudarc::driver::CudaViewMut<'_, bf16>>,
    ) -> Result<()> {
        let rot = Rotation {
            rope: mrope.rope,
            mrope: Some((mrope.positions, mrope.sections)),
        };
        self.qk_norm_rope_at(x, layout, norm, rot, out, gate_out)
    }

    /// The launch of [`Gpu::qk_norm_rope`] and [`Gpu::qk_norm_rope_mrope`].
    fn qk_norm_rope_at(
        &self,
        x: &impl DevicePtr<bf16>,
        layout: HeadLayout,
        norm: &HeadNorm<'_, impl DevicePtr<bf16>>,
        rot: Rotation<'_, impl DevicePtr<f32>, impl DevicePtr<u32>, impl DevicePtr<u32>>,
        out: &mut impl DevicePtrMut<bf16>,
        gate_out: Option<&mut cudarc::driver::CudaViewMut<'_, bf16>>,
    ) -> Result<()> {
        let Rotation { rope, mrope } = rot;
        let op = match mrope {
            None => "qk_norm_rope",
            Some(_) => "qk_norm_rope_mrope",
        };
        let HeadNorm { w, eps } = *norm;
        let positions = rope.positions;
        let HeadLayout {
            rows,
            n_heads,
            head_dim: d,
            row_stride,
            head_stride,
        } = layout;
        ensure(d > 0 && d <= QK_MAX_HEAD_DIM, op, || {
            format!("head_dim = {d} must be in 1..={QK_MAX_HEAD_DIM}")
        })?;
        ensure(
            rope.rot_dim.is_multiple_of(2) && rope.rot_dim <= d,
            op,
            || {
                format!(
                    "rot_dim {} must be even and at most head_dim {d}",
                    rope.rot_dim
                )
            },
        )?;
        let need_stride = if gate_out.is_some() { 2 * d } else { d };
        ensure(head_stride >= need_stride, op, || {
            format!("head_stride {head_stride} < {need_stride}")
        })?;
        if rows == 0 || n_heads == 0 {
            return Ok(());
        }
        let extent = (rows - 1) * row_stride + (n_heads - 1) * head_stride + need_stride;
        check_len(op, "x", x, extent)?;
        check_len(op, "w", w, d)?;
        check_len(op, "positions", positions, rows)?;
        check_len(op, "inv_freq", rope.inv_freq, rope.rot_dim / 2)?;
        check_len(op, "out", out, rows * n_heads * d)?;
        if let Some(g) = &gate_out {
            check_len(op, "gate_out", *g, rows * n_heads * d)?;
        }
        let (sec_h, sec_w) = match mrope {
            Some((pos3, sections)) => {
                let half = rope.rot_dim / 2;
                ensure(sections.iter().sum::<usize>() == half, op, || {
                    format!("MRoPE sections {sections:?} for {half} rotary frequencies")
                })?;
                check_len(op, "MRoPE positions", pos3, 3 * rows)?;
                (
                    int(op, "mrope_section", sections[1])?,
                    int(op, "mrope_section", sections[2])?,
                )
            }
            None => (0, 0),
        };
        ensure(rows <= 65535, op, || "more than 65535 rows".into())?;
        let s = self.stream();
        let gp = match gate_out {
            Some(g) => g.device_ptr_mut(s).0,
            None => 0u64,
        };
        let (xrs, xhs, ors) = (row_stride as i64, head_stride as i64, (n_heads * d) as i64);
        let (di, half) = (d as i32, (rope.rot_dim / 2) as i32);
        // Null: every frequency at `positions[row]`.
        let plain = 0u64;
        let mut b = self.launch(self.kernel("qk_norm_rope_bf16")?);
        b.ptr(x)
            .arg(&xrs)
            .arg(&xhs)
            .ptr_mut(out)
            .arg(&ors)
            .arg(&gp)
            .ptr(w)
            .arg(&eps)
            .arg(&di)
            .ptr(positions)
            .ptr(rope.inv_freq)
            .arg(&half)
            .arg(&rope.mscale);
        match mrope {
            Some((pos3, _)) => b.ptr(pos3),
            None => b.arg(&plain),
        };
        b.arg(&sec_h).arg(&sec_w);
        let grid = (grid_u32(op, n_heads)?, rows as u32, 1);
        // SAFETY: argument types match the kernel; the strided extent of x, out, gate_out, positions,
        // the MRoPE positions and inv_freq are checked above; head_dim ≤ KV_MAX_D.
        unsafe { b.launch(cfg(grid, row_threads(d), 0)) }?;
        Ok(())
    }

    /// Copies row `r` of `k` and `v` (`[rows, row_elems]`) into pool row `dst[r]` of the K and V
    /// pools (`[pool_rows, row_elems]`); a `dst` at or beyond the pool is skipped.
    pub fn kv_write(
        &self,
        k: &impl DevicePtr<bf16>,
        v: &impl DevicePtr<bf16>,
        pools: KvPools<&mut impl DevicePtrMut<bf16>>,
        dst: &impl DevicePtr<u32>,
        rows: usize,
        row_elems: usize,
    ) -> Result<()> {
        const OP: &str = "kv_write";
        let KvPools {
            k: k_pool,
            v: v_pool,
        } = pools;
        ensure(row_elems > 0, OP, || "row_elems must be positive".into())?;
        ensure(k_pool.len() == v_pool.len(), OP, || {
            "k_pool and v_pool differ in length".into()
        })?;
        check_len(OP, "k", k, rows * row_elems)?;
        check_len(OP, "v", v, rows * row_elems)?;
        check_len(OP, "dst", dst, rows)?;
        if rows == 0 {
            return Ok(());
        }
        let pool_rows = u32::try_from(k_pool.len() / row_elems).unwrap_or(u32::MAX);
        let re = int(OP, "row_elems", row_elems)?;
        let mut b = self.launch(self.kernel("kv_write_bf16")?);
        b.ptr(k)
            .ptr(v)
            .ptr_mut(k_pool)
            .ptr_mut(v_pool)
            .ptr(dst)
            .arg(&re)
            .arg(&pool_rows);
        // SAFETY: argument types match the kernel; k, v, dst lengths checked; the kernel skips pool
        // rows at or beyond the pools' length.
        unsafe { b.launch(cfg((grid_u32(OP, rows)?, 1, 1), row_threads(row_elems), 0)) }?;
        Ok(())
    }

    /// Copies positions `rows.start..rows.end` of one sequence from the K and V pools
    /// (`[pool_rows, row_elems]`, gathered through `table`, `block_size` positions a block; host
    /// memory read through unified addressing) into rows `0..` of `out.k` and `out.v` (`[≥ len,
    /// row_elems]` each; a side given as `None` is not staged): the step then reads them from VRAM
    /// through an identity table, with the same arithmetic as from the pools.
    pub fn kv_stage(
        &self,
        pools: KvPools<&impl DevicePtr<bf16>>,
        table: &impl DevicePtr<u32>,
        block_size: usize,
        rows: std::ops::Range<usize>,
        row_elems: usize,
        out: KvPools<Option<&mut CudaSlice<bf16>>>,
    ) -> Result<()> {
        const OP: &str = "kv_stage";
        ensure(row_elems > 0 && block_size > 0, OP, || {
            "row_elems and block_size must be positive".into()
        })?;
        let n = rows.len();
        check_len(OP, "table", table, rows.end.div_ceil(block_size))?;
        for (side, buf) in [("k_out", &out.k), ("v_out", &out.v)] {
            if let Some(b) = buf {
                check_len(OP, side, *b, n * row_elems)?;
            }
        }
        ensure(pools.k.len() == pools.v.len(), OP, || {
            "the pools differ".into()
        })?;
        if n == 0 || (out.k.is_none() && out.v.is_none()) {
            return Ok(());
        }
        let (bs, re) = (
            int(OP, "block_size", block_size)?,
            int(OP, "row_elems", row_elems)?,
        );
        let first = u32::try_from(rows.start).map_err(|_| crate::error::CudaError::Shape {
            op: OP,
            msg: format!("position {} past u32", rows.start),
        })?;
        let s = self.stream();
        let kp = out.k.map_or(0u64, |k| k.device_ptr_mut(s).0);
        let vp = out.v.map_or(0u64, |v| v.device_ptr_mut(s).0);
        let mut b = self.launch(self.kernel("kv_stage_bf16")?);
        b.ptr(pools.k)
            .ptr(pools.v)
            .ptr(table)
            .arg(&bs)
            .arg(&re)
            .arg(&first)
            .arg(&kp)
            .arg(&vp);
        // SAFETY: argument types match the kernel; the table covers the rows and the outputs hold
        // them; the table's blocks are the sequence's, inside the pools (the caller's block table).
        unsafe { b.launch(cfg((grid_u32(OP, n)?, 1, 1), row_threads(row_elems / 8), 0)) }?;
        Ok(())
    }
}
