//! A gated-attention mixer's one-token decode step in one persistent launch
//! ([`Gpu::attn_layer_decode`], `kernels/attn_layer.cu`): the q|gate, k and v projections, the head
//! norms and RoPE, the K/V write, the paged split-K attention with its merge and output gate, and
//! o_proj (with the residual add and the next norm) in phases of one cooperative grid, where the
//! separate launches take seven.

use cudarc::driver::{CudaSlice, DevicePtr, DeviceRepr};
use half::bf16;

use super::attention::AttnDims;
use super::layer::{check_packed, unit_scheme};
use super::moe::CombineInto;
use super::quant::{PackedMat, PackedScheme};
use super::KvPools;
use crate::error::{ensure, CudaError, Result};
use crate::gpu::{check_len, Gpu};

/// The head size the kernel takes (`AL_D` in attn_layer.cu).
const HEAD_DIM: usize = 256;

/// The kernel instance for input width `h`, `group` query heads a KV head, an attention output of
/// `ko` values and `bits`-bit projections: its units of 32 values a lane in the h-wide and the
/// o_proj dots (attn_layer.cu's entry points: `u2_o4`, a query head a warp, for every width;
/// `u3_o6`, two a warp, for INT8).
fn instance(h: usize, group: usize, ko: usize, bits: u32) -> Option<(usize, usize)> {
    if h <= 2048 && group <= 8 && ko <= 4096 {
        Some((2, 4))
    } else if h <= 3072 && group <= 16 && ko <= 6144 && bits == 8 {
        Some((3, 6))
    } else {
        None
    }
}

/// The K/V tile ring's dynamic shared memory (`AL_STAGES` tiles of 16 KiB in attn_layer.cu): four
/// from compute capability 9.0 on, else two (two blocks in an sm_86 multiprocessor).
fn ring_smem(compute_capability: (u32, u32)) -> usize {
    let stages = if compute_capability.0 >= 9 { 4 } else { 2 };
    stages * 2 * 16 * HEAD_DIM * 2
}

/// The kernel's arguments (`AttnLayerArgs` in attn_layer.cu, field for field).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct AttnLayerArgs {
    x: u64,
    q_w: u64,
    q_s: u64,
    k_w: u64,
    k_s: u64,
    v_w: u64,
    v_s: u64,
    q_norm: u64,
    k_norm: u64,
    inv_freq: u64,
    k_pool: u64,
    v_pool: u64,
    table: u64,
    lens: u64,
    positions: u64,
    kv_dst: u64,
    o_w: u64,
    o_s: u64,
    qkv: u64,
    part_o: u64,
    part_ml: u64,
    attn: u64,
    partials: u64,
    y: u64,
    acc: u64,
    norm_w: u64,
    normed: u64,
    sync: u64,
    h: i32,
    hq: i32,
    hkv: i32,
    bs: i32,
    max_blocks: i32,
    num_blocks: i32,
    max_splits: i32,
    half: i32,
    qkv_group: i32,
    o_group: i32,
    head_eps: f32,
    mscale: f32,
    scale: f32,
    eps: f32,
    offset: f32,
    pad: i32,
    trace: u64,
}

// SAFETY: a plain `#[repr(C)]` struct of 8-byte addresses and 4-byte numbers, laid out as the
// kernel's `AttnLayerArgs` (28 pointers, 10 ints, 5 floats, a padding int, the trace pointer; 296
// bytes, 8-byte aligned).
unsafe impl DeviceRepr for AttnLayerArgs {}

/// An attention mixer's weights as [`Gpu::attn_layer_decode`] takes them: the packed projections
/// `q` `[2·hq·d, h]` (each head's d query rows, then its d gate rows), `k`, `v` `[hkv·d, h]` and `o`
/// `[h, hq·d]` of one bit width (q, k and v of one scheme), and the head norms' weights `[d]` (used
/// as `1 + w`, eps `head_eps`).
pub struct AttnLayer<'a> {
    pub dims: AttnDims,
    pub q: PackedMat<'a, CudaSlice<u32>, CudaSlice<f32>>,
    pub k: PackedMat<'a, CudaSlice<u32>, CudaSlice<f32>>,
    pub v: PackedMat<'a, CudaSlice<u32>, CudaSlice<f32>>,
    pub o: PackedMat<'a, CudaSlice<u32>, CudaSlice<f32>>,
    pub q_norm: &'a CudaSlice<bf16>,
    pub k_norm: &'a CudaSlice<bf16>,
    pub head_eps: f32,
}

/// The rotary embedding of the launch: the inverse frequencies `[rot_dim / 2]` (device), `rot_dim`
/// and the cos/sin scale (NeoX halves over the first `rot_dim` values of a head).
pub struct LayerRope<'a> {
    pub inv_freq: &'a CudaSlice<f32>,
    pub rot_dim: usize,
    pub mscale: f32,
}

/// The one sequence of the launch and its cache: the layer's K/V pools `[num_blocks·bs, hkv·d]`,
/// and (device values, read by the kernel) its context `lens[0]` (the new token included), the new
/// token's position `positions[0]` and pool row `kv_dst[0]` (at or past the pools' rows: not
/// written), and its block table `table` (`max_blocks` ids).
pub struct LayerSeq<'a, P: DevicePtr<u32>> {
    pub pools: KvPools<&'a mut CudaSlice<bf16>>,
    pub lens: &'a P,
    pub positions: &'a P,
    pub kv_dst: &'a P,
    pub table: &'a P,
    pub max_blocks: usize,
}

/// The buffers [`Gpu::attn_layer_decode`] writes besides its output and the K/V pools: `qkv`
/// `[2·hq·d + 2·hkv·d]` and `attn` `[hq·d]` (bf16), `part_o` `[hq·S·d]` and `part_ml` `[hq·S·2]` (f32,
/// `S` = [`Gpu::attn_layer_max_splits`]), `partials` (f32, one a block of the grid:
/// [`Gpu::moe_layer_max_blocks`]), and `sync`: two `u32` that are 0 before the launch and are left 0
/// (the backend's ticket buffer).
pub struct AttnLayerBufs<'a> {
    pub qkv: &'a mut CudaSlice<bf16>,
    pub attn: &'a mut CudaSlice<bf16>,
    pub part_o: &'a mut CudaSlice<f32>,
    pub part_ml: &'a mut CudaSlice<f32>,
    pub partials: &'a mut CudaSlice<f32>,
    pub sync: &'a mut CudaSlice<u32>,
    /// `[16]` u64 or `None`: block 0's phase times (the device's global timer, ns) for the bench;
    /// slots 0..=8 and, from the last block, 9 and 10..=13 (the barriers' last arrivals).
    pub trace: Option<&'a mut CudaSlice<u64>>,
}

impl Gpu {
    /// Whether [`Gpu::attn_layer_decode`] takes a layer of width `h`, heads `dims` and RoPE over
    /// `rot_dim` values whose projections are packed as `q`, `k`, `v` and `o`: head size 256, one
    /// width of 4, 6 or 8 bits (q, k and v of one scheme) with per-row scales or groups of a
    /// multiple of 32, `h % 32 == 0` up to 2048 with at most 8 query heads a KV head and `hq·d ≤
    /// 4096`, or for INT8 up to 3072 with at most 16 and `hq·d ≤ 6144`; `rot_dim` a multiple of 16
    /// up to the head size, and a device that runs cooperative launches.
    pub fn attn_layer_fits(
        &self,
        h: usize,
        dims: AttnDims,
        rot_dim: usize,
        [q, k, v, o]: [PackedScheme; 4],
    ) -> bool {
        let AttnDims {
            hq, hkv, head_dim, ..
        } = dims;
        let shape = head_dim == HEAD_DIM
            && hkv > 0
            && hq.is_multiple_of(hkv)
            && h.is_multiple_of(32)
            && h >= 32
            && instance(h, hq / hkv, hq * head_dim, q.bits).is_some()
            && rot_dim.is_multiple_of(16)
            && rot_dim <= head_dim
            && dims.block_size > 0;
        let bits = q.bits;
        let schemes = matches!(bits, 4 | 6 | 8)
            && unit_scheme(q, bits, h)
            && k == q
            && v == q
            && unit_scheme(o, bits, hq * head_dim);
        shape && schemes && self.info().cooperative_launch
    }

    /// The splits of the context a KV head's attention takes at most in [`Gpu::attn_layer_decode`]
    /// (what `part_o` and `part_ml` hold a query head): the grid's blocks over the KV heads.
    pub fn attn_layer_max_splits(&self, hkv: usize) -> usize {
        (self.moe_layer_max_blocks() / hkv.max(1)).max(1)
    }

    /// An attention mixer's decode step of one token `x` (`[h]` bf16, the layer's normed input) in
    /// one launch: `q|gate = W_q·x`, `k = W_k·x`, `v = W_v·x` (each rounded to bf16), q and k normed
    /// per head and roped at `seq.positions[0]` as [`Gpu::qk_norm_rope`] gives them, k and v written
    /// to pool row `seq.kv_dst[0]` as [`Gpu::kv_write`] does, the attention of q over the
    /// `seq.lens[0]` positions of the sequence's cache (scale `d^-0.5`) times `sigmoid(gate)` as
    /// [`Gpu::attention_paged_decode`] gives it, and `W_o` of that rounded to bf16, into `into` (the
    /// row, or its add to the residual and the norm of that, as [`Gpu::add_rms_norm`] gives them),
    /// all to rounding. Needs [`Gpu::attn_layer_fits`].
    pub fn attn_layer_decode(
        &self,
        layer: &AttnLayer<'_>,
        x: &CudaSlice<bf16>,
        rope: &LayerRope<'_>,
        seq: LayerSeq<'_, impl DevicePtr<u32>>,
        bufs: AttnLayerBufs<'_>,
        into: CombineInto<'_, CudaSlice<bf16>>,
    ) -> Result<()> {
        const OP: &str = "attn_layer_decode";
        let dims = layer.dims;
        let AttnDims {
            hq,
            hkv,
            head_dim: d,
            block_size: bs,
        } = dims;
        let (h, nq, nkv, ko) = (layer.q.k, 2 * hq * d, hkv * d, hq * d);
        let schemes = [
            layer.q.scheme,
            layer.k.scheme,
            layer.v.scheme,
            layer.o.scheme,
        ];
        ensure(
            self.attn_layer_fits(h, dims, rope.rot_dim, schemes),
            OP,
            || {
                format!(
                    "h = {h}, {dims:?}, rot_dim {}: outside the kernel's shapes",
                    rope.rot_dim
                )
            },
        )?;
        ensure(
            [
                (layer.q.n, layer.q.k),
                (layer.k.n, layer.k.k),
                (layer.v.n, layer.v.k),
                (layer.o.n, layer.o.k),
            ] == [(nq, h), (nkv, h), (nkv, h), (h, ko)],
            OP,
            || "projections must be q [2·hq·d, h], k and v [hkv·d, h], o [h, hq·d]".into(),
        )?;
        for (name, m) in [
            ("q", &layer.q),
            ("k", &layer.k),
            ("v", &layer.v),
            ("o", &layer.o),
        ] {
            check_packed(OP, name, m)?;
        }
        check_len(OP, "x", x, h)?;
        check_len(OP, "q_norm", layer.q_norm, d)?;
        check_len(OP, "k_norm", layer.k_norm, d)?;
        check_len(OP, "inv_freq", rope.inv_freq, rope.rot_dim / 2)?;
        check_len(OP, "lens", seq.lens, 1)?;
        check_len(OP, "positions", seq.positions, 1)?;
        check_len(OP, "kv_dst", seq.kv_dst, 1)?;
        ensure(seq.max_blocks > 0, OP, || "an empty block table".into())?;
        check_len(OP, "table", seq.table, seq.max_blocks)?;
        let (row, pools) = (dims.kv_row(), seq.pools);
        ensure(
            pools.k.len() == pools.v.len() && pools.k.len().is_multiple_of(bs * row),
            OP,
            || "the K and V pools must be whole blocks of one size".into(),
        )?;
        let num_blocks = pools.k.len() / (bs * row);
        ensure(
            (seq.max_blocks * bs) < i32::MAX as usize && num_blocks * bs < u32::MAX as usize,
            OP,
            || "the cache is too large for 32-bit positions".into(),
        )?;
        let splits = self.attn_layer_max_splits(hkv);
        check_len(OP, "qkv", &*bufs.qkv, nq + 2 * nkv)?;
        check_len(OP, "attn", &*bufs.attn, ko)?;
        check_len(OP, "part_o", &*bufs.part_o, hq * splits * d)?;
        check_len(OP, "part_ml", &*bufs.part_ml, hq * splits * 2)?;
        check_len(OP, "sync", &*bufs.sync, 2)?;
        if let Some(t) = &bufs.trace {
            check_len(OP, "trace", &**t, 16)?;
        }
        let mut a = AttnLayerArgs {
            x: self.addr(x),
            q_w: self.addr(layer.q.words),
            q_s: self.addr(layer.q.scales),
            k_w: self.addr(layer.k.words),
            k_s: self.addr(layer.k.scales),
            v_w: self.addr(layer.v.words),
            v_s: self.addr(layer.v.scales),
            q_norm: self.addr(layer.q_norm),
            k_norm: self.addr(layer.k_norm),
            inv_freq: self.addr(rope.inv_freq),
            k_pool: self.addr_mut(pools.k),
            v_pool: self.addr_mut(pools.v),
            table: self.addr(seq.table),
            lens: self.addr(seq.lens),
            positions: self.addr(seq.positions),
            kv_dst: self.addr(seq.kv_dst),
            o_w: self.addr(layer.o.words),
            o_s: self.addr(layer.o.scales),
            qkv: self.addr_mut(bufs.qkv),
            part_o: self.addr_mut(bufs.part_o),
            part_ml: self.addr_mut(bufs.part_ml),
            attn: self.addr_mut(bufs.attn),
            sync: self.addr_mut(bufs.sync),
            trace: bufs.trace.map_or(0, |t| self.addr_mut(t)),
            h: h as i32,
            hq: hq as i32,
            hkv: hkv as i32,
            bs: bs as i32,
            max_blocks: seq.max_blocks as i32,
            num_blocks: num_blocks as i32,
            max_splits: splits as i32,
            half: (rope.rot_dim / 2) as i32,
            qkv_group: layer.q.scheme.group(h) as i32,
            o_group: layer.o.scheme.group(ko) as i32,
            head_eps: layer.head_eps,
            mscale: rope.mscale,
            scale: (d as f64).powf(-0.5) as f32,
            ..AttnLayerArgs::default()
        };
        ensure(
            [a.x, a.q_norm, a.k_norm, a.k_pool, a.v_pool]
                .iter()
                .all(|p| p.is_multiple_of(16)),
            OP,
            || "x, the head norms' weights and the pools must be 16-byte aligned".into(),
        )?;
        let out = self.layer_row_out(OP, into, h)?;
        (a.y, a.acc, a.norm_w, a.normed) = (out.y, out.acc, out.norm_w, out.normed);
        (a.eps, a.offset) = (out.eps, out.offset);
        let bits = layer.q.scheme.bits;
        let (u, o) = instance(h, hq / hkv, ko, bits).ok_or_else(|| CudaError::Shape {
            op: OP,
            msg: format!("no instance for h = {h}, {dims:?}"),
        })?;
        let kernel = self.kernel(&format!("attn_layer_m1_p{bits}_u{u}_o{o}"))?;
        a.trace = self.layer_trace(a.trace, kernel);
        let smem = ring_smem(self.info().compute_capability);
        // SAFETY: the argument struct matches the kernel's; every buffer's length, the alignments
        // and the kernel's shape limits are checked above; the kernel reads block ids from the
        // `max_blocks` of the table only for positions below min(lens[0], max_blocks·bs), masks
        // ids at or past the pools' blocks and writes pool row kv_dst[0] only below the pools'
        // rows; the part buffers hold the splits of any grid up to `moe_layer_max_blocks`.
        unsafe {
            self.launch_layer(OP, (kernel, smem, h), bufs.partials, |partials| {
                AttnLayerArgs { partials, ..a }
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_argument_struct_has_the_kernels_layout() {
        // 28 pointers, 10 ints, 5 floats, a padding int, the trace pointer (attn_layer.cu).
        assert_eq!(
            std::mem::size_of::<AttnLayerArgs>(),
            28 * 8 + 10 * 4 + 5 * 4 + 4 + 8
        );
        assert_eq!(std::mem::align_of::<AttnLayerArgs>(), 8);
    }
}
