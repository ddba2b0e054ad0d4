//! A layer's pending MoE output, the next layer's input norm and its mixer in one launch
//! ([`crate::Gpu::moe_gdn_layer_decode`], [`crate::Gpu::moe_attn_layer_decode`]): with the one-launch
//! MoE layer and the one-launch mixer both taking a decoding row and the pair switch on, the two
//! persistent launches run as one (the same bits).

use std::sync::atomic::Ordering;

use cudarc::driver::CudaSlice;
use sanmai_model::backend::{
    AttnMixerCall, Backend, GdnMixerCall, GdnShape, GdnWeights, MoeCall, MoeWeights, OpResult,
};

use super::cache::{KvPools, StateSlots};
use super::meta::Meta;
use super::moe_layer::MoeLaunch;
use super::tensor::{CudaTensor, CudaWeight};
use super::CudaBackend;
use crate::error::{At, CudaError, Result};
use crate::ops::{LayerSync, PairMixer, PairOut};

/// The bits and input width of a packed weight, or `None`.
fn packed(w: &CudaWeight) -> Option<(u32, usize)> {
    match w {
        CudaWeight::Packed(p) => Some((p.scheme().bits, p.in_features())),
        _ => None,
    }
}

/// The backend state a pair's mixer half reads besides the MoE step's expert tables.
struct MixerState<'a> {
    meta: &'a mut Meta,
    states: &'a mut StateSlots,
    kv: &'a mut KvPools,
    /// The attention mixer's RoPE table (device copy), when it has one.
    inv_freq: Option<&'a CudaSlice<f32>>,
}

/// What a pair's mixer half is handed: the state, the MoE half, the outputs and the grid buffers.
type MixerHalf<'a> = (MixerState<'a>, MoeLaunch<'a>, PairOut<'a>, LayerSync<'a>);

impl CudaBackend {
    /// Whether the pair launch may take a step of `rows` rows through MoE layer `moe` and then a
    /// mixer of `kind` with projections of `mixer_bits` at value width `ko` (GDN): the switch on,
    /// one row, the MoE step's one launch taking it, and a pair kernel of their widths.
    fn pair_fits(
        &self,
        moe: &MoeWeights<CudaWeight>,
        rows: usize,
        kind: PairMixer,
        (mixer_bits, h, ko): (u32, usize, usize),
    ) -> bool {
        let shared_bits = match &moe.shared {
            Some(s) => packed(&s.gate_up).map(|p| p.0),
            None => Some(4),
        };
        self.switches.layer_pair.load(Ordering::Relaxed)
            && self.moe_layer_takes(moe, rows)
            && shared_bits.is_some_and(|s| self.gpu.layer_pair_fits(kind, (s, mixer_bits), (h, ko)))
    }

    /// Whether the pair launch takes a step of `rows` rows through MoE layer `moe` and then GDN
    /// mixer `mixer` of shape `sh` (each half's one launch taking it, and a pair kernel of their
    /// widths: [`crate::Gpu::layer_pair_fits`]).
    pub fn layer_pair_takes(
        &self,
        moe: &MoeWeights<CudaWeight>,
        mixer: &GdnWeights<CudaWeight>,
        sh: &GdnShape,
        rows: usize,
    ) -> bool {
        let ko = sh.num_v_heads * sh.v_head_dim;
        self.gdn_layer_takes(mixer, sh, rows)
            && packed(&mixer.in_proj_qkv)
                .is_some_and(|(p, h)| self.pair_fits(moe, rows, PairMixer::Gdn, (p, h, ko)))
    }

    /// [`Backend::moe_gdn_mixer_add_rms_norm`]: the pair launch where it takes the calls, else the
    /// MoE step's and the mixer's own calls.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn moe_gdn_mixer_impl(
        &self,
        moe: &MoeCall<'_, CudaTensor, CudaWeight>,
        acc: &mut CudaTensor,
        norm: &CudaWeight,
        mixer: &GdnMixerCall<'_, CudaTensor, CudaWeight>,
        post: &CudaWeight,
        eps: f32,
        offset: f32,
    ) -> OpResult<CudaTensor> {
        if !self.layer_pair_takes(moe.w, mixer.w, mixer.shape, moe.x.rows) {
            let hn = self.moe_experts_add_rms_norm(moe, acc, norm, eps, offset)?;
            return self.gdn_mixer_add_rms_norm(&mixer.on(&hn), acc, post, eps, offset);
        }
        self.pair_step(
            moe,
            acc,
            (norm, post, eps, offset),
            None,
            |(s, m, out, sync)| {
                let block_size = s.kv.block_size;
                self.with_gdn_layer((s.meta, s.states, block_size), mixer, |l| {
                    self.gpu
                        .moe_gdn_layer_decode(m, (l.layer, l.pools, l.seq, l.bufs), out, sync)
                })
            },
        )
        .at("moe_gdn_mixer_add_rms_norm")
    }

    /// [`Backend::moe_attn_mixer_add_rms_norm`]: the pair launch where it takes the calls, else the
    /// MoE step's and the mixer's own calls.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn moe_attn_mixer_impl(
        &self,
        moe: &MoeCall<'_, CudaTensor, CudaWeight>,
        acc: &mut CudaTensor,
        norm: &CudaWeight,
        mixer: &AttnMixerCall<'_, CudaTensor, CudaWeight>,
        post: &CudaWeight,
        eps: f32,
        offset: f32,
    ) -> OpResult<CudaTensor> {
        let layer = self.attn_layer_for(mixer).filter(|l| {
            let kind = PairMixer::Attention;
            self.pair_fits(moe.w, moe.x.rows, kind, (l.q.scheme.bits, l.q.k, 0))
        });
        let Some(layer) = layer else {
            let hn = self.moe_experts_add_rms_norm(moe, acc, norm, eps, offset)?;
            return self.attn_mixer_add_rms_norm(&mixer.on(&hn), acc, post, eps, offset);
        };
        let freqs = Some(&mixer.rope.inv_freq[..]);
        self.pair_step(
            moe,
            acc,
            (norm, post, eps, offset),
            freqs,
            |(s, m, out, sync)| {
                let inv_freq = s.inv_freq.expect("the RoPE table was asked for");
                self.with_attn_layer((s.meta, s.kv, inv_freq), mixer, layer, |l| {
                    self.gpu
                        .moe_attn_layer_decode(m, (l.layer, l.rope, l.seq, l.bufs), out, sync)
                })
            },
        )
        .at("moe_attn_mixer_add_rms_norm")
    }

    /// A pair launch of one decoding row: the MoE half of `moe` (its output added to `acc` and
    /// normed with `norm`), handed with the state, the outputs (the mixer's add to `acc` normed with
    /// `post` into a new tensor) and the grid buffers to `mixer`, which builds the mixer half and
    /// launches the pair. `inv_freq`: the frequencies whose RoPE table the mixer reads.
    fn pair_step(
        &self,
        moe: &MoeCall<'_, CudaTensor, CudaWeight>,
        acc: &mut CudaTensor,
        (norm, post, eps, offset): (&CudaWeight, &CudaWeight, f32, f32),
        inv_freq: Option<&[f32]>,
        mixer: impl FnOnce(MixerHalf<'_>) -> Result<()>,
    ) -> Result<CudaTensor> {
        let h = moe.x.cols;
        if (acc.rows, acc.cols) != (1, h) {
            return Err(CudaError::Shape {
                op: "add_rms_norm",
                msg: format!("[{}, {}] plus [1, {h}]", acc.rows, acc.cols),
            });
        }
        let (moe_norm, mixer_norm) = (norm.bf16()?, post.bf16()?);
        let mut st = self.lock();
        let st = &mut *st;
        let ri = inv_freq.map(|f| st.rope_table(&self.gpu, f)).transpose()?;
        let mut partials = self.scratch::<f32>(self.gpu.moe_layer_max_blocks())?;
        let mut sync = self.ticket.lock().unwrap_or_else(|p| p.into_inner());
        let mut out = self.alloc(1, h)?;
        let state = MixerState {
            meta: &mut st.meta,
            states: &mut st.states,
            kv: &mut st.kv,
            inv_freq: ri.map(|i| &st.rope[i].1),
        };
        let ((), ids) = self.with_moe_layer(&mut st.experts, moe, |m| {
            let out = PairOut {
                acc: &mut acc.buf,
                moe_norm,
                mixer_norm,
                normed: &mut out.buf,
                eps,
                offset,
            };
            let sync = LayerSync {
                partials: &mut partials,
                sync: &mut sync,
            };
            mixer((state, m, out, sync))
        })?;
        drop(sync);
        self.log_routing(&ids, moe.w.top_k, moe.w.experts.len())?;
        Ok(out)
    }
}
