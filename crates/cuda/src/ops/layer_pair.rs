//! A MoE layer's one-token decode step and the next layer's mixer in one persistent launch
//! ([`Gpu::moe_gdn_layer_decode`], [`Gpu::moe_attn_layer_decode`]; `kernels/layer_pair.cu`): the
//! launches of [`Gpu::moe_layer_decode`] (its output added to the residual and normed) and of
//! [`Gpu::gdn_layer_decode`] or [`Gpu::attn_layer_decode`] on that normed row, in one cooperative
//! grid, the same arithmetic bit for bit.

use cudarc::driver::{CudaSlice, DevicePtr, DeviceRepr};
use half::bf16;

use super::attn_layer::{AttnLayerArgs, LayerRope, LayerSeq};
use super::gdn::{DecodeSlots, GdnPools};
use super::gdn_layer::GdnLayerArgs;
use super::layer::{LayerArgs, LayerLaunch, LayerSync, RowOut};
use super::moe::CombineInto;
use super::moe_layer::MoeLayerArgs;
use super::{AttnLayer, AttnLayerBufs, GdnLayer, GdnLayerBufs, MoeLayer, MoeLayerBufs};
use crate::error::{ensure, Result};
use crate::gpu::{check_len, Gpu};

/// The kernels' arguments (`MoeGdnArgs`, `MoeAttnArgs` in layer_pair.cu): the two launches'
/// argument structs, both naming the launch's partials and counters.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct PairArgs<M> {
    moe: MoeLayerArgs,
    mixer: M,
}

// SAFETY: `#[repr(C)]` pairs of the plain argument structs (8-byte aligned, sizes multiples of 8),
// laid out as the kernels' structs of the same two members.
unsafe impl DeviceRepr for PairArgs<GdnLayerArgs> {}
// SAFETY: as above.
unsafe impl DeviceRepr for PairArgs<AttnLayerArgs> {}

impl<M: LayerArgs> LayerArgs for PairArgs<M> {
    fn set_sync(&mut self, partials: u64, sync: u64) {
        self.moe.set_sync(partials, sync);
        self.mixer.set_sync(partials, sync);
    }
}

/// The mixer a pair launch runs after the MoE step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PairMixer {
    Gdn,
    Attention,
}

/// The pair kernel of a MoE launch and a mixer launch, from their kernels' names
/// (`moe_layer_m1_q4_s{S}_u{U}`, `gdn_layer_m1_p{P}_u{U}_o{O}`, `attn_layer_m1_p{P}_u{U}_o{O}`): the
/// same units in the h-wide dots, projections of 8 bits (the instances layer_pair.cu has).
fn pair_kernel(moe: &str, mixer: &str) -> Option<String> {
    let (s, u) = moe.strip_prefix("moe_layer_m1_q4_")?.split_once('_')?;
    let (kind, rest) = match mixer.strip_prefix("gdn_layer_m1_") {
        Some(rest) => ("gdn", rest),
        None => ("attn", mixer.strip_prefix("attn_layer_m1_")?),
    };
    let (p, uo) = rest.split_once('_')?;
    (p == "p8" && uo.starts_with(u) && uo.as_bytes().get(u.len()) == Some(&b'_'))
        .then(|| format!("moe_{kind}_m1_{s}_{p}_{uo}"))
}

/// A GDN pair's mixer half: the layer, its state pools, the sequence's slot and position, its
/// scratch buffers ([`Gpu::gdn_layer_decode`]'s).
pub type GdnHalf<'a, P> = (
    &'a GdnLayer<'a>,
    GdnPools<'a, CudaSlice<bf16>, CudaSlice<f32>>,
    &'a DecodeSlots<'a, P>,
    GdnLayerBufs<'a>,
);

/// The residual both halves add to, the MoE step's norm weight (its normed row is not written: the
/// mixer stages it from the residual) and the mixer's: the pair's output is the mixer's output added
/// to the residual and normed into `normed`, with `eps` and `offset` for both norms.
pub struct PairOut<'a> {
    pub acc: &'a mut CudaSlice<bf16>,
    pub moe_norm: &'a CudaSlice<bf16>,
    pub mixer_norm: &'a CudaSlice<bf16>,
    pub normed: &'a mut CudaSlice<bf16>,
    pub eps: f32,
    pub offset: f32,
}

impl Gpu {
    /// Whether a pair launch exists for a MoE step whose shared expert has `shared_bits` (4
    /// without one) and a mixer of `kind` whose projections have `mixer_bits`, at width `h` and
    /// (GDN) value width `ko`, given that each half alone fits its launch.
    pub fn layer_pair_fits(
        &self,
        kind: PairMixer,
        (shared_bits, mixer_bits): (u32, u32),
        (h, ko): (usize, usize),
    ) -> bool {
        let units = if h <= 2048 { 2 } else { 3 };
        let moe = format!("moe_layer_m1_q4_s{shared_bits}_u{units}");
        let mixer = match kind {
            PairMixer::Gdn if h <= 2048 && ko <= 4096 => {
                format!("gdn_layer_m1_p{mixer_bits}_u2_o4")
            }
            PairMixer::Gdn => format!("gdn_layer_m1_p{mixer_bits}_u3_o6"),
            PairMixer::Attention => format!("attn_layer_m1_p{mixer_bits}_u2_o4"),
        };
        pair_kernel(&moe, &mixer).is_some_and(|k| self.kernel(&k).is_ok())
    }

    /// The MoE step's half of a pair (its launch with the residual add and the norm's sums, no
    /// normed row written) and the mixer's output (its add to the residual and norm).
    fn pair_rows(
        &self,
        moe: (&MoeLayer<'_>, &CudaSlice<bf16>, usize, MoeLayerBufs<'_>),
        mut out: PairOut<'_>,
    ) -> Result<(LayerLaunch<MoeLayerArgs>, RowOut)> {
        let m = self.pair_moe(moe, &mut out)?;
        let into = CombineInto::AddNorm {
            acc: out.acc,
            w: out.mixer_norm,
            normed: out.normed,
            eps: out.eps,
            offset: out.offset,
        };
        let row = self.layer_row_out("layer_pair", into, m.h)?;
        Ok((m, row))
    }

    /// The MoE step's half of a pair: its launch with the residual add and the norm's sums, no
    /// normed row written.
    fn pair_moe(
        &self,
        (layer, x, h, bufs): (&MoeLayer<'_>, &CudaSlice<bf16>, usize, MoeLayerBufs<'_>),
        out: &mut PairOut<'_>,
    ) -> Result<LayerLaunch<MoeLayerArgs>> {
        const OP: &str = "layer_pair";
        check_len(OP, "acc", &*out.acc, h)?;
        check_len(OP, "MoE norm weight", out.moe_norm, h)?;
        let row = RowOut {
            acc: self.addr_mut(out.acc),
            norm_w: self.addr(out.moe_norm),
            eps: out.eps,
            offset: out.offset,
            ..RowOut::default()
        };
        self.moe_layer_args(layer, x, h, bufs, row)
    }

    /// Launches the two halves as one.
    ///
    /// # Safety
    /// Both launches must have been built by their checked builders.
    unsafe fn launch_pair<M: DeviceRepr + LayerArgs + Copy>(
        &self,
        moe: LayerLaunch<MoeLayerArgs>,
        mixer: LayerLaunch<M>,
        sync: LayerSync<'_>,
    ) -> Result<()>
    where
        PairArgs<M>: DeviceRepr,
    {
        const OP: &str = "layer_pair";
        ensure(moe.h == mixer.h, OP, || {
            format!("a MoE step of {} rows and a mixer of {}", moe.h, mixer.h)
        })?;
        let kernel = pair_kernel(&moe.kernel, &mixer.kernel).ok_or_else(|| {
            crate::error::CudaError::Shape {
                op: OP,
                msg: format!("no pair launch of {} and {}", moe.kernel, mixer.kernel),
            }
        })?;
        let pair = LayerLaunch {
            kernel,
            args: PairArgs {
                moe: moe.args,
                mixer: mixer.args,
            },
            smem: moe.smem.max(mixer.smem),
            h: moe.h,
        };
        // SAFETY: both halves' builders checked their buffers and shapes; the pair kernel runs
        // the two bodies in turn over one grid, with the larger of their dynamic shared memories.
        unsafe { self.launch_layer(OP, pair, sync) }
    }

    /// [`Gpu::moe_layer_decode`] of one token (its combine added to `out.acc` and normed with
    /// `out.moe_norm`), then [`Gpu::gdn_layer_decode`] of that normed row (added to `out.acc` and
    /// normed into `out.normed` with `out.mixer_norm`), in one launch. Needs both halves' `*_fits`
    /// and [`Gpu::layer_pair_fits`].
    pub fn moe_gdn_layer_decode(
        &self,
        moe: (&MoeLayer<'_>, &CudaSlice<bf16>, usize, MoeLayerBufs<'_>),
        (layer, pools, seq, bufs): GdnHalf<'_, impl DevicePtr<u32>>,
        out: PairOut<'_>,
        sync: LayerSync<'_>,
    ) -> Result<()> {
        let (m, row) = self.pair_rows(moe, out)?;
        let g = self.gdn_layer_args(layer, None, pools, seq, bufs, row)?;
        // SAFETY: both launches come from their checked builders.
        unsafe { self.launch_pair(m, g, sync) }
    }

    /// [`Gpu::moe_layer_decode`] then [`Gpu::attn_layer_decode`] in one launch, as
    /// [`Gpu::moe_gdn_layer_decode`].
    pub fn moe_attn_layer_decode(
        &self,
        moe: (&MoeLayer<'_>, &CudaSlice<bf16>, usize, MoeLayerBufs<'_>),
        (layer, rope, seq, bufs): (
            &AttnLayer<'_>,
            &LayerRope<'_>,
            LayerSeq<'_, impl DevicePtr<u32>>,
            AttnLayerBufs<'_>,
        ),
        out: PairOut<'_>,
        sync: LayerSync<'_>,
    ) -> Result<()> {
        let (m, row) = self.pair_rows(moe, out)?;
        let a = self.attn_layer_args(layer, None, rope, seq, bufs, row)?;
        // SAFETY: both launches come from their checked builders.
        unsafe { self.launch_pair(m, a, sync) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pair_structs_are_the_two_halves_in_order() {
        let m = std::mem::size_of::<MoeLayerArgs>();
        assert_eq!(
            std::mem::size_of::<PairArgs<GdnLayerArgs>>(),
            m + std::mem::size_of::<GdnLayerArgs>()
        );
        assert_eq!(
            std::mem::size_of::<PairArgs<AttnLayerArgs>>(),
            m + std::mem::size_of::<AttnLayerArgs>()
        );
        assert_eq!(std::mem::offset_of!(PairArgs<GdnLayerArgs>, mixer), m);
    }

    #[test]
    fn pair_kernels_match_the_halves_units() {
        let k = |m: &str, x: &str| pair_kernel(m, x);
        assert_eq!(
            k("moe_layer_m1_q4_s6_u2", "gdn_layer_m1_p8_u2_o4").as_deref(),
            Some("moe_gdn_m1_s6_p8_u2_o4")
        );
        assert_eq!(
            k("moe_layer_m1_q4_s4_u3", "gdn_layer_m1_p8_u3_o6").as_deref(),
            Some("moe_gdn_m1_s4_p8_u3_o6")
        );
        assert_eq!(
            k("moe_layer_m1_q4_s8_u2", "attn_layer_m1_p8_u2_o4").as_deref(),
            Some("moe_attn_m1_s8_p8_u2_o4")
        );
        // Other units on the two sides, other projection widths, other kernels: none.
        assert_eq!(k("moe_layer_m1_q4_s6_u2", "gdn_layer_m1_p8_u3_o6"), None);
        assert_eq!(k("moe_layer_m1_q4_s6_u2", "gdn_layer_m1_p6_u2_o4"), None);
        assert_eq!(k("moe_layer_m1_q4_s6_u2", "gemv_q8_m1"), None);
    }

    #[test]
    fn every_pair_name_is_an_entry_point_of_the_source() {
        let src = crate::registry::SOURCES
            .iter()
            .find(|s| s.name == "layer_pair.cu")
            .expect("layer_pair.cu is registered");
        let entries = crate::registry::entry_points(src);
        for s in [4, 6, 8] {
            for (moe_u, mixer) in [
                (2, "gdn_layer_m1_p8_u2_o4"),
                (3, "gdn_layer_m1_p8_u3_o6"),
                (2, "attn_layer_m1_p8_u2_o4"),
            ] {
                let name = pair_kernel(&format!("moe_layer_m1_q4_s{s}_u{moe_u}"), mixer).unwrap();
                assert!(entries.contains(&name), "{name} missing");
            }
        }
        assert_eq!(entries.len(), 9);
    }
}
