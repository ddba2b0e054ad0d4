//! A MoE layer's one-token decode step in one persistent launch ([`Gpu::moe_layer_decode`],
//! `kernels/moe_layer.cu`): the router, top-k, the shared expert, the chosen experts' gate|up and
//! down projections and the combine (with the residual add and the next norm) in phases of one
//! cooperative grid, where the separate launches take six.

use cudarc::driver::{CudaSlice, DeviceRepr};
use half::bf16;

use super::layer::check_packed;
use super::moe::{CombineInto, Experts};
use super::quant::{PackedMat, PackedScheme};
use crate::error::{ensure, Result};
use crate::gpu::{check_len, Gpu};

/// The kernel's shape limits: rows of at most `MAX_H` values in the full-warp dots (`ML_CHUNKS`,
/// `ML_UNITS`), down rows of at most `MAX_INTER` (`ML_DUNITS`), at most `MAX_K` experts a token
/// (`ML_MAX_K`).
const MAX_H: usize = 3072;
const MAX_INTER: usize = 1024;
const MAX_K: usize = 16;
/// Most experts of a layer (`32 · ML_TOPK_PER`: the one-warp top-k's registers).
const MAX_E: usize = 512;

/// The kernel's arguments (`MoeLayerArgs` in moe_layer.cu, field for field).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct MoeLayerArgs {
    x: u64,
    router: u64,
    shared_gate: u64,
    sgu_w: u64,
    sgu_s: u64,
    sdn_w: u64,
    sdn_s: u64,
    gu_w: u64,
    gu_s: u64,
    dn_w: u64,
    dn_s: u64,
    logits: u64,
    sgu: u64,
    act: u64,
    ids: u64,
    weights: u64,
    sdn: u64,
    partials: u64,
    y: u64,
    acc: u64,
    norm_w: u64,
    normed: u64,
    sync: u64,
    e: i32,
    h: i32,
    k: i32,
    renorm: i32,
    inter: i32,
    si: i32,
    gu_group: i32,
    dn_group: i32,
    sgu_group: i32,
    sdn_group: i32,
    eps: f32,
    offset: f32,
    trace: u64,
}

// SAFETY: a plain `#[repr(C)]` struct of 8-byte addresses and 4-byte numbers, laid out as the
// kernel's `MoeLayerArgs` (23 pointers, 10 ints, 2 floats, the trace pointer; 240 bytes, 8-byte
// aligned).
unsafe impl DeviceRepr for MoeLayerArgs {}

/// A layer's shared expert as [`Gpu::moe_layer_decode`] takes it: its gate row `[h]` (bf16), its
/// packed gate|up `[2·si, h]` and down `[h, si]`.
pub struct MoeLayerShared<'a> {
    pub gate: &'a CudaSlice<bf16>,
    pub gate_up: PackedMat<'a, CudaSlice<u32>, CudaSlice<f32>>,
    pub down: PackedMat<'a, CudaSlice<u32>, CudaSlice<f32>>,
}

/// A MoE layer as [`Gpu::moe_layer_decode`] takes it: the bf16 router `[e, h]`, the routed experts'
/// gate|up (`[2·inter, h]`) and down (`[h, inter]`) through their address tables, and the shared
/// expert when the layer has one.
pub struct MoeLayer<'a> {
    pub router: &'a CudaSlice<bf16>,
    pub gate_up: Experts<'a, CudaSlice<u64>>,
    pub down: Experts<'a, CudaSlice<u64>>,
    pub experts: usize,
    pub top_k: usize,
    pub renormalize: bool,
    pub shared: Option<MoeLayerShared<'a>>,
}

/// The buffers [`Gpu::moe_layer_decode`] writes besides its output: `logits` `[e + 1]` (f32),
/// `shared_gate_up` `[2·si]` and `shared_down` `[h]` (f32; any length without a shared expert),
/// `act` `[k, inter]` (the chosen experts' SwiGLU rows), the routed `ids` and `weights` `[k]`, `partials` (f32, one a block of
/// the grid: [`Gpu::moe_layer_max_blocks`]), and `sync`: two `u32` that are 0 before the launch and are
/// left 0 (allocate them zeroed once and pass the same buffer to every launch of the stream).
pub struct MoeLayerBufs<'a> {
    pub logits: &'a mut CudaSlice<f32>,
    pub shared_gate_up: &'a mut CudaSlice<bf16>,
    pub shared_down: &'a mut CudaSlice<f32>,
    pub act: &'a mut CudaSlice<bf16>,
    pub ids: &'a mut CudaSlice<u32>,
    pub weights: &'a mut CudaSlice<f32>,
    pub partials: &'a mut CudaSlice<f32>,
    pub sync: &'a mut CudaSlice<u32>,
    /// `[16]` u64 or `None`: block 0's phase times (the device's global timer, ns) for the bench;
    /// slots 0..=8 and, from the last block, 9.
    pub trace: Option<&'a mut CudaSlice<u64>>,
}

/// The effective group of a packed scheme over `k` inputs when the kernel takes it: 4, 6 or 8 bits,
/// `k % 32 == 0`, and per-row scales or groups of a multiple of 32 values.
fn unit_group(scheme: PackedScheme, k: usize) -> Option<usize> {
    let group = scheme.group(k);
    (matches!(scheme.bits, 4 | 6 | 8) && k > 0 && k.is_multiple_of(32) && group.is_multiple_of(32))
        .then_some(group)
}

impl Gpu {
    /// Whether [`Gpu::moe_layer_decode`] takes a layer of width `h`, `e` experts of which `k` are
    /// chosen, routed experts of scheme `experts` (INT4) and intermediate size `inter`, and a shared
    /// expert of scheme and intermediate size `shared` (any packed width): `h % 32 == 0` up to 3072,
    /// `inter` and the shared size multiples of 32 up to 1024, `1 ≤ k ≤ 16`, `k ≤ e ≤ 512`, per-row
    /// scales or groups of a multiple of 32, and a device that runs cooperative launches.
    pub fn moe_layer_fits(
        &self,
        (h, e, k, inter): (usize, usize, usize, usize),
        experts: Option<PackedScheme>,
        shared: Option<(PackedScheme, usize)>,
    ) -> bool {
        let dims = (32..=MAX_H).contains(&h)
            && h.is_multiple_of(32)
            && (32..=MAX_INTER).contains(&inter)
            && inter.is_multiple_of(32)
            && (1..=MAX_K).contains(&k)
            && k <= e
            && e <= MAX_E;
        let experts = experts.is_some_and(|s| {
            s.bits == 4 && unit_group(s, h).is_some() && unit_group(s, inter).is_some()
        });
        let shared = shared.is_none_or(|(s, si)| {
            (32..=MAX_INTER).contains(&si)
                && unit_group(s, h).is_some()
                && unit_group(s, si).is_some()
        });
        dims && experts && shared && self.info().cooperative_launch
    }

    /// A MoE layer's decode step of one token `x` (`[h]` bf16) in one launch: the router logits, the
    /// softmax top-k (what [`Gpu::route_topk`] writes to `ids` and `weights`), the shared expert
    /// (when `layer` has one) and the chosen experts (SwiGLU between their gate|up and down
    /// projections), and their combine `Σ_c weight_c · y_c + sigmoid(gate) · shared` rounded once to
    /// bf16, into `into` (the row itself, or its add to the residual and the norm of that, as
    /// [`Gpu::add_rms_norm`] gives them, to rounding: the norm's sum runs in another order). Needs
    /// [`Gpu::moe_layer_fits`].
    pub fn moe_layer_decode(
        &self,
        layer: &MoeLayer<'_>,
        x: &CudaSlice<bf16>,
        h: usize,
        bufs: MoeLayerBufs<'_>,
        into: CombineInto<'_, CudaSlice<bf16>>,
    ) -> Result<()> {
        const OP: &str = "moe_layer_decode";
        let (e, k, inter) = (layer.experts, layer.top_k, layer.down.k);
        let shared = layer.shared.as_ref().map(|s| (s.down.scheme, s.down.k));
        ensure(
            self.moe_layer_fits((h, e, k, inter), layer.gate_up.scheme, shared),
            OP,
            || format!("h = {h}, e = {e}, k = {k}, inter = {inter}: outside the kernel's shapes"),
        )?;
        ensure(
            (layer.gate_up.n, layer.gate_up.k, layer.down.n) == (2 * inter, h, h)
                && layer.gate_up.scheme == layer.down.scheme,
            OP,
            || "experts must be [2·inter, h] gate|up and [h, inter] down of one scheme".into(),
        )?;
        let scheme = layer.gate_up.scheme.expect("checked by moe_layer_fits");
        check_len(OP, "router", layer.router, e * h)?;
        check_len(OP, "x", x, h)?;
        for t in [
            layer.gate_up.weights,
            layer.gate_up.scales,
            layer.down.weights,
            layer.down.scales,
        ] {
            check_len(OP, "expert table", t, e)?;
        }
        let si = layer.shared.as_ref().map_or(0, |s| s.down.k);
        check_len(OP, "logits", &*bufs.logits, e + 1)?;
        check_len(OP, "shared gate|up", &*bufs.shared_gate_up, 2 * si)?;
        check_len(OP, "act", &*bufs.act, k * inter)?;
        check_len(
            OP,
            "shared down",
            &*bufs.shared_down,
            if si > 0 { h } else { 0 },
        )?;
        check_len(OP, "ids", &*bufs.ids, k)?;
        check_len(OP, "weights", &*bufs.weights, k)?;
        check_len(OP, "sync", &*bufs.sync, 2)?;
        if let Some(t) = &bufs.trace {
            check_len(OP, "trace", &**t, 16)?;
        }
        let mut a = MoeLayerArgs {
            x: self.addr(x),
            router: self.addr(layer.router),
            gu_w: self.addr(layer.gate_up.weights),
            gu_s: self.addr(layer.gate_up.scales),
            dn_w: self.addr(layer.down.weights),
            dn_s: self.addr(layer.down.scales),
            logits: self.addr_mut(bufs.logits),
            sgu: self.addr_mut(bufs.shared_gate_up),
            sdn: self.addr_mut(bufs.shared_down),
            act: self.addr_mut(bufs.act),
            ids: self.addr_mut(bufs.ids),
            weights: self.addr_mut(bufs.weights),
            sync: self.addr_mut(bufs.sync),
            trace: bufs.trace.map_or(0, |t| self.addr_mut(t)),
            e: e as i32,
            h: h as i32,
            k: k as i32,
            renorm: i32::from(layer.renormalize),
            inter: inter as i32,
            gu_group: scheme.group(h) as i32,
            dn_group: scheme.group(inter) as i32,
            ..MoeLayerArgs::default()
        };
        ensure(
            a.x.is_multiple_of(16) && a.router.is_multiple_of(16),
            OP,
            || "x and the router must be 16-byte aligned".into(),
        )?;
        let mut shared_bits = 4;
        if let Some(s) = &layer.shared {
            ensure(
                (s.gate_up.n, s.gate_up.k, s.down.n) == (2 * si, h, h)
                    && s.gate_up.scheme == s.down.scheme,
                OP,
                || {
                    "the shared expert must be [2·si, h] gate|up and [h, si] down of one scheme"
                        .into()
                },
            )?;
            check_len(OP, "shared gate", s.gate, h)?;
            for (name, m) in [("shared gate|up", &s.gate_up), ("shared down", &s.down)] {
                check_packed(OP, name, m)?;
            }
            shared_bits = s.gate_up.scheme.bits;
            a.shared_gate = self.addr(s.gate);
            a.sgu_w = self.addr(s.gate_up.words);
            a.sgu_s = self.addr(s.gate_up.scales);
            a.sdn_w = self.addr(s.down.words);
            a.sdn_s = self.addr(s.down.scales);
            a.si = si as i32;
            a.sgu_group = s.gate_up.scheme.group(h) as i32;
            a.sdn_group = s.down.scheme.group(si) as i32;
            ensure(a.shared_gate.is_multiple_of(16), OP, || {
                "the shared gate must be 16-byte aligned".into()
            })?;
        }
        let out = self.layer_row_out(OP, into, h)?;
        (a.y, a.acc, a.norm_w, a.normed) = (out.y, out.acc, out.norm_w, out.normed);
        (a.eps, a.offset) = (out.eps, out.offset);
        let units = if h <= 2048 { 2 } else { 3 };
        let name = format!("moe_layer_m1_q4_s{shared_bits}_u{units}");
        let kernel = self.kernel(&name)?;
        a.trace = self.layer_trace(a.trace, kernel);
        let smem = (2 * k * inter).next_multiple_of(16);
        // SAFETY: the argument struct matches the kernel's; every buffer's length, the alignments
        // and the kernel's shape limits are checked above; the dynamic shared memory holds the
        // staged SwiGLU rows.
        unsafe {
            self.launch_layer(OP, (kernel, smem, h), bufs.partials, |partials| {
                MoeLayerArgs { partials, ..a }
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_argument_struct_has_the_kernels_layout() {
        // 23 pointers, 10 ints, 2 floats, the trace pointer (moe_layer.cu's MoeLayerArgs).
        assert_eq!(
            std::mem::size_of::<MoeLayerArgs>(),
            23 * 8 + 10 * 4 + 2 * 4 + 8
        );
        assert_eq!(std::mem::align_of::<MoeLayerArgs>(), 8);
    }

    #[test]
    fn unit_groups_are_per_row_or_multiples_of_32() {
        let s = |bits, group_size| PackedScheme { bits, group_size };
        assert_eq!(unit_group(s(4, 128), 2048), Some(128));
        assert_eq!(unit_group(s(6, 0), 512), Some(512));
        assert_eq!(unit_group(s(8, 0), 2560), Some(2560));
        // Groups of 16 values, k not a multiple of 32, other widths: not taken.
        assert_eq!(unit_group(s(4, 16), 2048), None);
        assert_eq!(unit_group(s(6, 0), 520), None);
        assert_eq!(unit_group(s(5, 0), 512), None);
        assert_eq!(unit_group(s(4, 128), 0), None);
    }
}
