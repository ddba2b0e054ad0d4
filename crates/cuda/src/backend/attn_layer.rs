//! An attention mixer's one-token decode step in one launch ([`Gpu::attn_layer_decode`]): with the
//! fused decode launches and the one-launch attention mixer on, a layer whose q|gate, k, v and o
//! projections are packed in one width, with head size 256 and plain RoPE, takes its projections,
//! head norms and RoPE, K/V write, attention and o_proj (with the residual add and the next norm) in
//! one persistent launch instead of seven. A QSA layer whose context is within its topk (every
//! position selected: the dense attention) takes it too, after its index key's projection and write
//! ([`CudaBackend::qsa_mixer_within_topk_impl`]), where its separate launches take about ten.

use sanmai_model::backend::{
    AttnMixerCall, AttnShape, AttnWeights, Backend, IndexerWeights, OpResult, QsaMixerCall,
    QsaShape,
};

use super::attn::attn_dims;
use super::host_rows::Rows;
use super::norm_after::NormAfter;
use super::qsa::INDEX_NORM_EPS;
use super::tensor::{CudaTensor, CudaWeight};
use super::{all_decode, CudaBackend};
use crate::error::{At, CudaError, Result};
use crate::ops::{AttnLayer, AttnLayerBufs, KeyNorm, KvPools, LayerRope, LayerSeq, RopeArgs};
use crate::Gpu;
use std::sync::atomic::Ordering;

/// A QSA layer's index key for the one launch's row: `ik = wk·x` `[1, dI]` (before its LayerNorm),
/// the QSA shape and the indexer's weights.
struct IndexKey<'a> {
    ik: &'a CudaTensor,
    qsa: &'a QsaShape,
    indexer: &'a IndexerWeights<CudaWeight>,
}

/// The layer's weights as the one launch takes them for RoPE over `rot_dim` values, or `None` where
/// their formats or shapes do not suit it (packed q `[2·hq·d, h]`, k and v `[hkv·d, h]`, o
/// `[h, hq·d]`, bf16 head norms `[d]`). The block size only enters the launch, not the check.
fn layer_of<'a>(
    gpu: &Gpu,
    w: &'a AttnWeights<CudaWeight>,
    sh: &AttnShape,
    rot_dim: usize,
) -> Option<AttnLayer<'a>> {
    let dims = attn_dims(sh, 1);
    let (
        CudaWeight::Packed(q),
        CudaWeight::Packed(k),
        CudaWeight::Packed(v),
        CudaWeight::Packed(o),
    ) = (&w.q_proj, &w.k_proj, &w.v_proj, &w.o_proj)
    else {
        return None;
    };
    let (h, d) = (q.in_features(), sh.head_dim);
    let shaped = q.shape == [2 * dims.q_row(), h]
        && k.shape == [dims.kv_row(), h]
        && v.shape == [dims.kv_row(), h]
        && o.shape == [h, dims.q_row()];
    let schemes = [q.scheme(), k.scheme(), v.scheme(), o.scheme()];
    if !(shaped && gpu.attn_layer_fits(h, dims, rot_dim, schemes)) {
        return None;
    }
    let (q_norm, k_norm) = (w.q_norm.bf16().ok()?, w.k_norm.bf16().ok()?);
    if q_norm.len() != d || k_norm.len() != d {
        return None;
    }
    Some(AttnLayer {
        dims,
        q: q.mat(),
        k: k.mat(),
        v: v.mat(),
        o: o.mat(),
        q_norm,
        k_norm,
        head_eps: sh.eps,
    })
}

impl CudaBackend {
    /// Whether a mixer call of `rows` rows on `w` may take the one launch: both switches on, one
    /// row, and weights it takes with RoPE over any rotary width it allows (the call's own RoPE and
    /// MRoPE are checked by [`CudaBackend::attn_mixer_add_rms_norm_impl`]).
    pub fn attn_layer_takes(
        &self,
        w: &AttnWeights<CudaWeight>,
        sh: &AttnShape,
        rows: usize,
    ) -> bool {
        rows == 1 && self.attn_layer_on() && layer_of(&self.gpu, w, sh, 16).is_some()
    }

    /// Both switches the one launch needs are on.
    fn attn_layer_on(&self) -> bool {
        self.switches.fused_decode.load(Ordering::Relaxed)
            && self.switches.attn_layer.load(Ordering::Relaxed)
    }

    /// [`Backend::attn_mixer_add_rms_norm`]: the one launch where it takes the call (one decoding
    /// row, plain RoPE of a width it takes, K/V pools on the device), else the mixer's ops and
    /// `o_proj` with the add and norm.
    pub(super) fn attn_mixer_add_rms_norm_impl(
        &self,
        c: &AttnMixerCall<'_, CudaTensor, CudaWeight>,
        acc: &mut CudaTensor,
        norm: &CudaWeight,
        eps: f32,
        offset: f32,
    ) -> OpResult<CudaTensor> {
        let one = c.x.rows == 1 && c.seqs.len() == 1 && all_decode(c.seqs) && c.mrope.is_none();
        let layer = if one && self.attn_layer_on() {
            layer_of(&self.gpu, c.w, c.shape, c.rope.rot_dim)
        } else {
            None
        };
        let Some(layer) = layer else {
            let o = self.attn_from_input(c)?;
            return self.linear_add_rms_norm(&o, &c.w.o_proj, acc, norm, eps, offset);
        };
        NormAfter::for_rows(acc, c.x, norm, eps, offset)
            .and_then(|after| self.attn_layer_step(c, layer, Some(after), None))
            .at("attn_mixer_add_rms_norm")
    }

    /// [`Backend::qsa_mixer_within_topk`](sanmai_model::Backend::qsa_mixer_within_topk): the index
    /// key's projection and write, then the one launch, where it takes the call (one decoding row
    /// within topk, the attention's weights as [`layer_of`] takes them, K/V pools on the device
    /// without host rows, no selections traced), else `None`.
    pub(super) fn qsa_mixer_within_topk_impl(
        &self,
        c: &QsaMixerCall<'_, CudaTensor, CudaWeight>,
    ) -> Result<Option<CudaTensor>> {
        let m = &c.mixer;
        let one = m.x.rows == 1 && m.seqs.len() == 1 && all_decode(m.seqs) && m.mrope.is_none();
        let within = m.seqs.iter().all(|s| s.pos0 + s.len <= c.qsa.topk);
        if !(one && within && self.attn_layer_on()) {
            return Ok(None);
        }
        let Some(layer) = layer_of(&self.gpu, m.w, m.shape, m.rope.rot_dim) else {
            return Ok(None);
        };
        {
            let mut st = self.lock();
            let kv = &mut st.kv;
            let on_device = kv.pool(m.layer).is_ok_and(|p| {
                matches!((&p.k, &p.v), (Rows::Device(_), Rows::Device(_))) && p.idx.is_some()
            });
            let plain = kv.qsa_trace.is_none() && kv.arena.is_none();
            if !(on_device && plain && kv.idx_row == c.qsa.head_dim + 2) {
                return Ok(None);
            }
            kv.qsa_whole_topk = Some(c.qsa.topk);
        }
        let ik = self.linear_impl(m.x, &c.indexer.wk)?;
        let index = IndexKey {
            ik: &ik,
            qsa: c.qsa,
            indexer: c.indexer,
        };
        self.attn_layer_step(m, layer, None, Some(index)).map(Some)
    }

    /// The one launch for a decoding row whose layer `layer` took ([`layer_of`]): its output row,
    /// or with `after` the new residual's norm; a QSA layer's `index` key is written first.
    fn attn_layer_step(
        &self,
        c: &AttnMixerCall<'_, CudaTensor, CudaWeight>,
        mut layer: AttnLayer<'_>,
        after: Option<NormAfter<'_>>,
        index: Option<IndexKey<'_>>,
    ) -> Result<CudaTensor> {
        let g = &self.gpu;
        let bad = |msg: String| CudaError::Shape {
            op: "attn_mixer",
            msg,
        };
        let h = layer.q.k;
        if c.x.cols != h {
            return Err(bad(format!("input of {} columns for h = {h}", c.x.cols)));
        }
        let mut st = self.lock();
        let st = &mut *st;
        let bs = st.kv.block_size;
        layer.dims.block_size = bs;
        let dims = layer.dims;
        let m = st.meta.seqs(g, c.seqs, 1, bs)?;
        let ri = st.rope_table(g, &c.rope.inv_freq)?;
        let qi = match &index {
            Some(ix) => st.rope_table(g, &ix.qsa.rope.inv_freq)?,
            None => ri,
        };
        let (lens, positions) = (st.meta.view(m.lens, 1), st.meta.view(m.positions, 1));
        let (kv_dst, table) = (st.meta.view(m.kv_dst, 1), st.meta.view(m.tables, m.stride));
        if let Some(ix) = index {
            let rope = RopeArgs {
                positions: &positions,
                inv_freq: &st.rope[qi].1,
                rot_dim: ix.qsa.rope.rot_dim,
                mscale: 1.0,
            };
            let norm = KeyNorm {
                w: ix.indexer.k_norm.bf16()?,
                b: ix.indexer.k_norm_bias.bf16()?,
                eps: INDEX_NORM_EPS,
                dim: ix.qsa.head_dim,
            };
            let idx = st
                .kv
                .pool_mut(c.layer)?
                .idx
                .as_mut()
                .ok_or_else(|| bad(format!("layer {} has no index-key pool", c.layer)))?;
            g.qsa_index_key_write(&ix.ik.buf, &norm, &rope, &kv_dst, idx, 1)?;
        }
        let pool = st.kv.pool_mut(c.layer)?;
        let (Rows::Device(k_pool), Rows::Device(v_pool)) = (&mut pool.k, &mut pool.v) else {
            return Err(bad(
                "the one-launch attention mixer reads K/V pools on the device".into(),
            ));
        };
        let seq = LayerSeq {
            pools: KvPools {
                k: k_pool,
                v: v_pool,
            },
            lens: &lens,
            positions: &positions,
            kv_dst: &kv_dst,
            table: &table,
            max_blocks: m.stride,
        };
        let rope = LayerRope {
            inv_freq: &st.rope[ri].1,
            rot_dim: c.rope.rot_dim,
            mscale: c.rope.mscale,
        };
        let splits = g.attn_layer_max_splits(dims.hkv);
        let (nq, d) = (dims.q_row(), dims.head_dim);
        let mut qkv = self.scratch(2 * nq + 2 * dims.kv_row())?;
        let mut attn = self.scratch(nq)?;
        let mut part_o = self.scratch::<f32>(dims.hq * splits * d)?;
        let mut part_ml = self.scratch::<f32>(dims.hq * splits * 2)?;
        let mut partials = self.scratch::<f32>(g.moe_layer_max_blocks())?;
        let mut sync = self.ticket.lock().unwrap_or_else(|p| p.into_inner());
        let bufs = AttnLayerBufs {
            qkv: &mut qkv,
            attn: &mut attn,
            part_o: &mut part_o,
            part_ml: &mut part_ml,
            partials: &mut partials,
            sync: &mut sync,
            trace: None,
        };
        let mut out = self.alloc(1, h)?;
        let into = NormAfter::combine_into(after, &mut out);
        g.attn_layer_decode(&layer, &c.x.buf, &rope, seq, bufs, into)?;
        Ok(out)
    }
}
