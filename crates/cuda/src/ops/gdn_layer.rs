//! A gated-delta-net mixer's one-token decode step in one persistent launch
//! ([`Gpu::gdn_layer_decode`], `kernels/gdn_layer.cu`): the input projections (q|k|v, z and the
//! gates), the GDN step (conv, delta rule, gated RMSNorm) and the output projection (with the
//! residual add and the next norm) in phases of one cooperative grid, where the separate launches
//! take three.

use cudarc::driver::{CudaSlice, DevicePtr, DeviceRepr};
use half::bf16;

use super::gdn::{DecodeSlots, GdnDecodeWeights, GdnDims, GdnPools};
use super::layer::{check_packed, unit_scheme};
use super::moe::CombineInto;
use super::quant::{PackedMat, PackedScheme};
use crate::error::{ensure, Result};
use crate::gpu::{check_len, Gpu};

/// The kernel's shape limits (gdn_layer.cu): value columns of an item (`GL_TC`), key and value head
/// sizes (`GL_MAX_DK`, `GL_MAX_DV`), conv taps (`GL_MAX_CONV`), all heads' values (`GL_MAX_O`),
/// the h-wide dots' and out_proj dots' widths of its two instances (`u2_o4`, `u3_o6`).
const TILE: usize = 16;
const MAX_DK: usize = 128;
const MAX_DV: usize = 128;
const MAX_CONV: usize = 4;
const MAX_O: usize = 6144;
const MAX_H: usize = 3072;

/// The kernel's arguments (`GdnLayerArgs` in gdn_layer.cu, field for field).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct GdnLayerArgs {
    x: u64,
    qkv_w: u64,
    qkv_s: u64,
    z_w: u64,
    z_s: u64,
    w_b: u64,
    w_a: u64,
    conv_w: u64,
    a_log: u64,
    dt_bias: u64,
    gnorm_w: u64,
    conv_pool: u64,
    state_pool: u64,
    slots: u64,
    positions: u64,
    out_w: u64,
    out_s: u64,
    qkv: u64,
    z: u64,
    ab: u64,
    o: u64,
    partials: u64,
    y: u64,
    acc: u64,
    norm_w: u64,
    normed: u64,
    sync: u64,
    h: i32,
    hk: i32,
    hv: i32,
    dk: i32,
    dv: i32,
    kernel: i32,
    num_slots: i32,
    qkv_group: i32,
    z_group: i32,
    out_group: i32,
    q_scale: f32,
    geps: f32,
    eps: f32,
    offset: f32,
    trace: u64,
}

// SAFETY: a plain `#[repr(C)]` struct of 8-byte addresses and 4-byte numbers, laid out as the
// kernel's `GdnLayerArgs` (27 pointers, 10 ints, 4 floats, the trace pointer; 280 bytes, 8-byte
// aligned).
unsafe impl DeviceRepr for GdnLayerArgs {}

/// A GDN mixer's weights as [`Gpu::gdn_layer_decode`] takes them: the packed projections `qkv`
/// `[conv_dim, h]`, `z` `[hv·dv, h]` and `out` `[h, hv·dv]` of one bit width, the bf16 gate
/// projections `w_b`, `w_a` `[hv, h]`, and what the GDN step reads besides
/// ([`GdnDecodeWeights`]).
pub struct GdnLayer<'a> {
    pub dims: GdnDims,
    pub qkv: PackedMat<'a, CudaSlice<u32>, CudaSlice<f32>>,
    pub z: PackedMat<'a, CudaSlice<u32>, CudaSlice<f32>>,
    pub w_b: &'a CudaSlice<bf16>,
    pub w_a: &'a CudaSlice<bf16>,
    pub step: GdnDecodeWeights<'a, CudaSlice<bf16>, CudaSlice<f32>>,
    pub out: PackedMat<'a, CudaSlice<u32>, CudaSlice<f32>>,
}

/// The buffers [`Gpu::gdn_layer_decode`] writes besides its output and the state pools: `qkv`
/// `[conv_dim]` and `z` `[hv·dv]` (bf16), `ab` `[2·hv]` and `o` `[hv·dv]` (f32), `partials` (f32,
/// one a block of the grid: [`Gpu::moe_layer_max_blocks`]), and `sync`: two `u32` that are 0 before
/// the launch and are left 0 (the backend's ticket buffer).
pub struct GdnLayerBufs<'a> {
    pub qkv: &'a mut CudaSlice<bf16>,
    pub z: &'a mut CudaSlice<bf16>,
    pub ab: &'a mut CudaSlice<f32>,
    pub o: &'a mut CudaSlice<f32>,
    pub partials: &'a mut CudaSlice<f32>,
    pub sync: &'a mut CudaSlice<u32>,
    /// `[16]` u64 or `None`: block 0's phase times (the device's global timer, ns) for the bench;
    /// slots 0..=7 and, from the last block, 9.
    pub trace: Option<&'a mut CudaSlice<u64>>,
}

/// The kernel instance's dot widths for inputs of `h` values and an out_proj of `ko` inputs: units
/// of 32 values a lane in the h-wide dots and in the out_proj dots.
fn instance(h: usize, ko: usize) -> Option<(usize, usize)> {
    if h <= 2048 && ko <= 4096 {
        Some((2, 4))
    } else if h <= MAX_H && ko <= 6144 {
        Some((3, 6))
    } else {
        None
    }
}

impl Gpu {
    /// Whether [`Gpu::gdn_layer_decode`] takes a layer of width `h`, GDN `dims` and conv `kernel`
    /// taps whose projections are packed as `qkv`, `z` and `out`: one width of 4, 6 or 8 bits with
    /// per-row scales or groups of a multiple of 32; `dk ≤ 128`, `dv` a power of two from 16 to 128,
    /// `hv` a multiple of `hk`, `1 ≤ kernel ≤ 4`, `h % 32 == 0` up to 3072 and `hv·dv` up to 6144
    /// (4096 with `h` over 2048), and a device that runs cooperative launches.
    pub fn gdn_layer_fits(
        &self,
        h: usize,
        dims: GdnDims,
        kernel: usize,
        [qkv, z, out]: [PackedScheme; 3],
    ) -> bool {
        let GdnDims { hk, hv, dk, dv } = dims;
        let ko = hv * dv;
        let shape = (1..=MAX_DK).contains(&dk)
            && (TILE..=MAX_DV).contains(&dv)
            && dv.is_power_of_two()
            && hk > 0
            && hv.is_multiple_of(hk)
            && (1..=MAX_CONV).contains(&kernel)
            && h.is_multiple_of(32)
            && ko <= MAX_O
            && instance(h, ko).is_some();
        let bits = qkv.bits;
        let schemes = matches!(bits, 4 | 6 | 8)
            && unit_scheme(qkv, bits, h)
            && unit_scheme(z, bits, h)
            && unit_scheme(out, bits, ko);
        shape && schemes && self.info().cooperative_launch
    }

    /// A GDN mixer's decode step of one token `x` (`[h]` bf16, the layer's normed input) in one
    /// launch: `qkv = W_qkv·x`, `z = W_z·x`, `b = W_b·x`, `a = W_a·x` (each rounded to bf16), the
    /// GDN step of [`Gpu::gdn_decode`] for the sequence at `seq.positions[0]` in slot `seq.slots[0]`
    /// of the pools (out of range: a zero GDN output, no state touched), and `W_out` of its output
    /// rounded to bf16, into `into` (the row, or its add to the residual and the norm of that, as
    /// [`Gpu::add_rms_norm`] gives them, to rounding). Needs [`Gpu::gdn_layer_fits`].
    pub fn gdn_layer_decode(
        &self,
        layer: &GdnLayer<'_>,
        x: &CudaSlice<bf16>,
        pools: GdnPools<'_, CudaSlice<bf16>, CudaSlice<f32>>,
        seq: &DecodeSlots<'_, impl DevicePtr<u32>>,
        bufs: GdnLayerBufs<'_>,
        into: CombineInto<'_, CudaSlice<bf16>>,
    ) -> Result<()> {
        const OP: &str = "gdn_layer_decode";
        let dims = layer.dims;
        let GdnDims { hk, hv, dk, dv } = dims;
        let (h, cd, ko, kernel) = (layer.qkv.k, dims.conv_dim(), hv * dv, layer.step.kernel);
        let schemes = [layer.qkv.scheme, layer.z.scheme, layer.out.scheme];
        ensure(self.gdn_layer_fits(h, dims, kernel, schemes), OP, || {
            format!("h = {h}, {dims:?}, conv kernel {kernel}: outside the kernel's shapes")
        })?;
        ensure(
            (layer.qkv.n, layer.z.n, layer.z.k, layer.out.n, layer.out.k) == (cd, ko, h, h, ko),
            OP,
            || "projections must be qkv [conv_dim, h], z [hv·dv, h], out [h, hv·dv]".into(),
        )?;
        ensure(seq.batch == 1, OP, || {
            format!("one sequence a launch, not {}", seq.batch)
        })?;
        for (name, m) in [("qkv", &layer.qkv), ("z", &layer.z), ("out", &layer.out)] {
            check_packed(OP, name, m)?;
        }
        check_len(OP, "x", x, h)?;
        check_len(OP, "w_b", layer.w_b, hv * h)?;
        check_len(OP, "w_a", layer.w_a, hv * h)?;
        let w = &layer.step;
        check_len(OP, "conv weight", w.conv, cd * kernel)?;
        check_len(OP, "a_log", w.a_log, hv)?;
        check_len(OP, "dt_bias", w.dt_bias, hv)?;
        check_len(OP, "norm weight", w.norm, dv)?;
        check_len(OP, "slots", seq.slots, 1)?;
        check_len(OP, "positions", seq.positions, 1)?;
        check_len(OP, "qkv", &*bufs.qkv, cd)?;
        check_len(OP, "z", &*bufs.z, ko)?;
        check_len(OP, "ab", &*bufs.ab, 2 * hv)?;
        check_len(OP, "o", &*bufs.o, ko)?;
        check_len(OP, "sync", &*bufs.sync, 2)?;
        if let Some(t) = &bufs.trace {
            check_len(OP, "trace", &**t, 16)?;
        }
        // A slot must lie inside both pools.
        let num_slots = (pools.conv.len() / (kernel * cd)).min(pools.ssm.len() / dims.state_len());
        let mut a = GdnLayerArgs {
            x: self.addr(x),
            qkv_w: self.addr(layer.qkv.words),
            qkv_s: self.addr(layer.qkv.scales),
            z_w: self.addr(layer.z.words),
            z_s: self.addr(layer.z.scales),
            w_b: self.addr(layer.w_b),
            w_a: self.addr(layer.w_a),
            conv_w: self.addr(w.conv),
            a_log: self.addr(w.a_log),
            dt_bias: self.addr(w.dt_bias),
            gnorm_w: self.addr(w.norm),
            conv_pool: self.addr_mut(pools.conv),
            state_pool: self.addr_mut(pools.ssm),
            slots: self.addr(seq.slots),
            positions: self.addr(seq.positions),
            out_w: self.addr(layer.out.words),
            out_s: self.addr(layer.out.scales),
            qkv: self.addr_mut(bufs.qkv),
            z: self.addr_mut(bufs.z),
            ab: self.addr_mut(bufs.ab),
            o: self.addr_mut(bufs.o),
            sync: self.addr_mut(bufs.sync),
            trace: bufs.trace.map_or(0, |t| self.addr_mut(t)),
            h: h as i32,
            hk: hk as i32,
            hv: hv as i32,
            dk: dk as i32,
            dv: dv as i32,
            kernel: kernel as i32,
            num_slots: i32::try_from(num_slots).unwrap_or(i32::MAX),
            qkv_group: layer.qkv.scheme.group(h) as i32,
            z_group: layer.z.scheme.group(h) as i32,
            out_group: layer.out.scheme.group(ko) as i32,
            q_scale: (dk as f64).powf(-0.5) as f32,
            geps: w.eps,
            ..GdnLayerArgs::default()
        };
        ensure(
            [a.x, a.w_b, a.w_a].iter().all(|p| p.is_multiple_of(16)),
            OP,
            || "x and the gate weights must be 16-byte aligned".into(),
        )?;
        let out = self.layer_row_out(OP, into, h)?;
        (a.y, a.acc, a.norm_w, a.normed) = (out.y, out.acc, out.norm_w, out.normed);
        (a.eps, a.offset) = (out.eps, out.offset);
        let (u, o) = instance(h, ko).expect("checked by gdn_layer_fits");
        let bits = layer.qkv.scheme.bits;
        let kernel = self.kernel(&format!("gdn_layer_m1_p{bits}_u{u}_o{o}"))?;
        a.trace = self.layer_trace(a.trace, kernel);
        // SAFETY: the argument struct matches the kernel's; every buffer's length, the alignments
        // and the kernel's shape limits are checked above; slot ids at or past `num_slots` (which
        // both pools hold) touch no state.
        unsafe {
            self.launch_layer(OP, (kernel, 0, h), bufs.partials, |partials| GdnLayerArgs {
                partials,
                ..a
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_argument_struct_has_the_kernels_layout() {
        // 27 pointers, 10 ints, 4 floats, the trace pointer (gdn_layer.cu's GdnLayerArgs).
        assert_eq!(
            std::mem::size_of::<GdnLayerArgs>(),
            27 * 8 + 10 * 4 + 4 * 4 + 8
        );
        assert_eq!(std::mem::align_of::<GdnLayerArgs>(), 8);
    }

    #[test]
    fn instances_cover_the_80b_and_125b_widths() {
        // Qwen3-Next-80B: h 2048, 32 value heads of 128; the 125B: h 2560, 48 heads of 128.
        assert_eq!(instance(2048, 4096), Some((2, 4)));
        assert_eq!(instance(2560, 6144), Some((3, 6)));
        assert_eq!(instance(2048, 6144), Some((3, 6)));
        assert_eq!(instance(4096, 4096), None);
        assert_eq!(instance(2048, 8192), None);
    }
}
