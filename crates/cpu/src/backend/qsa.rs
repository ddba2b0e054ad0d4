//! The qwen4_exp ops of [`CpuBackend`]: QSA attention over the index-key cache, the PLE mix with its
//! conv state in the state slots, and the hyper-connections' elementwise ops. Semantics are those
//! documented on the `Backend` trait.

use rayon::prelude::*;
use sanmai_model::backend::{
    AttnShape, AttnWeights, IndexerWeights, PleShape, PleWeights, QsaShape, Rope, SeqChunk,
};

use crate::backend::{gather, matmul, pool_offset, prepare_attention, CpuBackend, QsaSelection};
use crate::{ops, CpuTensor, CpuWeight};

/// Epsilon of the indexer's key LayerNorm.
const INDEX_NORM_EPS: f32 = 1e-6;

/// One sequence's QSA inputs after norms and RoPE.
struct Prepared {
    q: Vec<f32>,
    gate: Vec<f32>,
    k: Vec<f32>,
    /// Indexer queries `[len, nI·dI]`, roped.
    qi: Vec<f32>,
    /// Index-key entries `[len, dI + 2]` bytes.
    entries: Vec<u8>,
    /// Head weights `[len, nI]`, scaled by `nI^-0.5·dI^-0.5`.
    wts: Vec<f32>,
}

fn add_bias(x: &mut CpuTensor, b: &CpuWeight) {
    for row in x.data.chunks_exact_mut(x.cols) {
        row.iter_mut().zip(&b.data).for_each(|(v, b)| *v += b);
    }
}

impl CpuBackend {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn qsa_impl(
        &self,
        layer: usize,
        sh: &AttnShape,
        rope: &Rope,
        qsa: &QsaShape,
        q_gate: &CpuTensor,
        k: &CpuTensor,
        v: &CpuTensor,
        w: &AttnWeights<CpuWeight>,
        iq: &CpuTensor,
        ik: &CpuTensor,
        iw: &CpuTensor,
        iw_: &IndexerWeights<CpuWeight>,
        seqs: &[SeqChunk<'_>],
    ) -> CpuTensor {
        let (nh, nkv, d) = (sh.num_heads, sh.num_kv_heads, sh.head_dim);
        let (ni, di) = (qsa.n_heads, qsa.head_dim);
        assert_eq!(iq.cols, ni * di, "qsa_attention: iq must be [rows, nI*dI]");
        assert_eq!(ik.cols, di, "qsa_attention: ik must be [rows, dI]");
        assert_eq!(iw.cols, ni, "qsa_attention: iw must be [rows, nI]");
        let head_scale = (ni as f32).powf(-0.5) * (di as f32).powf(-0.5);
        // 1. Per sequence: the attention inputs and the indexer's queries, keys and head weights.
        let prepared: Vec<Prepared> = seqs
            .par_iter()
            .map(|s| {
                let (q, gate, kn) = prepare_attention(s, sh, rope, q_gate, k, w);
                let t = s.len;
                let positions: Vec<u32> = (s.pos0..s.pos0 + t).map(|p| p as u32).collect();
                let mut qi = iq.row_range(s.start, t).to_vec();
                let mut ki = ik.row_range(s.start, t).to_vec();
                ops::layer_norm(
                    &mut ki,
                    &iw_.k_norm.data,
                    &iw_.k_norm_bias.data,
                    di,
                    INDEX_NORM_EPS,
                );
                let r = &qsa.rope;
                if r.rot_dim > 0 {
                    ops::rope_neox(&mut qi, ni, di, r.rot_dim, &positions, &r.inv_freq, 1.0);
                    ops::rope_neox(&mut ki, 1, di, r.rot_dim, &positions, &r.inv_freq, 1.0);
                }
                let mut entries = vec![0u8; t * (di + 2)];
                for (kr, e) in ki.chunks_exact(di).zip(entries.chunks_exact_mut(di + 2)) {
                    ops::quantize_index_key(kr, e);
                }
                let wts = iw
                    .row_range(s.start, t)
                    .iter()
                    .map(|x| x * head_scale)
                    .collect();
                Prepared {
                    q,
                    gate,
                    k: kn,
                    qi,
                    entries,
                    wts,
                }
            })
            .collect();
        // 2. Write K, V and the index-key entries into each sequence's blocks.
        let mut pools = self.pools.write().unwrap();
        let (bs, row, irow) = (pools.block_size, pools.row, pools.idx_row);
        assert_eq!(
            irow,
            di + 2,
            "qsa_attention: the cache has no index keys of width dI"
        );
        let pool = pools
            .layers
            .get_mut(&layer)
            .unwrap_or_else(|| panic!("no K/V pool for layer {layer}: init_cache first"));
        for (s, p) in seqs.iter().zip(&prepared) {
            assert!(
                s.blocks.len() * bs >= s.pos0 + s.len,
                "attention layer {layer}: {} blocks cannot hold {} positions",
                s.blocks.len(),
                s.pos0 + s.len
            );
            let vs = v.row_range(s.start, s.len);
            for i in 0..s.len {
                let o = pool_offset(s.blocks, bs, row, s.pos0 + i);
                pool.k[o..o + row].copy_from_slice(&p.k[i * row..(i + 1) * row]);
                pool.v[o..o + row].copy_from_slice(&vs[i * row..(i + 1) * row]);
                let oi = pool_offset(s.blocks, bs, irow, s.pos0 + i);
                pool.idx[oi..oi + irow].copy_from_slice(&p.entries[i * irow..(i + 1) * irow]);
            }
        }
        let pool = &*pool;
        let scale = (d as f32).powf(-0.5);
        let tracing = self.qsa_trace.lock().unwrap().is_some();
        let trace = std::sync::Mutex::new(Vec::new());
        // 3. Attend: densely while every position is selected, else over each row's top-k.
        let outs: Vec<Vec<f32>> = seqs
            .par_iter()
            .zip(&prepared)
            .map(|(s, p)| {
                let len = s.pos0 + s.len;
                let mut out = vec![0f32; s.len * nh * d];
                if len <= qsa.topk {
                    if tracing {
                        let mut tr = trace.lock().unwrap();
                        for i in 0..s.len {
                            let pos = s.pos0 + i;
                            tr.push(QsaSelection {
                                layer,
                                state: s.state,
                                pos,
                                selected: (0..=pos).collect(),
                            });
                        }
                    }
                    let kc = gather(&pool.k, s.blocks, bs, row, len);
                    let vc = gather(&pool.v, s.blocks, bs, row, len);
                    ops::attention_causal(&p.q, &kc, &vc, s.len, len, nh, nkv, d, scale, &mut out);
                    out.iter_mut()
                        .zip(&p.gate)
                        .for_each(|(o, g)| *o *= ops::sigmoid(*g));
                    return out;
                }
                // The indexer scan: every index key of the sequence, dequantised.
                let mut keys = vec![0f32; len * di];
                for (pos, kd) in keys.chunks_exact_mut(di).enumerate() {
                    let o = pool_offset(s.blocks, bs, irow, pos);
                    ops::dequantize_index_key(&pool.idx[o..o + irow], kd);
                }
                out.par_chunks_mut(nh * d).enumerate().for_each(|(i, o)| {
                    let ctx = s.pos0 + i + 1;
                    let sel = if ctx <= qsa.topk {
                        (0..ctx).collect()
                    } else {
                        let mut scores = vec![0f32; ctx];
                        ops::index_scores(
                            &p.qi[i * ni * di..(i + 1) * ni * di],
                            &p.wts[i * ni..(i + 1) * ni],
                            &keys[..ctx * di],
                            di,
                            &mut scores,
                        );
                        ops::topk_positions(&scores, qsa.topk)
                    };
                    if tracing {
                        trace.lock().unwrap().push(QsaSelection {
                            layer,
                            state: s.state,
                            pos: ctx - 1,
                            selected: sel.clone(),
                        });
                    }
                    // Only the selected K/V rows are read.
                    let mut kr = Vec::with_capacity(sel.len() * row);
                    let mut vr = Vec::with_capacity(sel.len() * row);
                    for &pos in &sel {
                        let off = pool_offset(s.blocks, bs, row, pos);
                        kr.extend_from_slice(&pool.k[off..off + row]);
                        vr.extend_from_slice(&pool.v[off..off + row]);
                    }
                    ops::attend_rows(
                        &p.q[i * nh * d..(i + 1) * nh * d],
                        &p.gate[i * nh * d..(i + 1) * nh * d],
                        &kr,
                        &vr,
                        nh,
                        nkv,
                        d,
                        scale,
                        o,
                    );
                });
                out
            })
            .collect();
        if tracing {
            let mut recorded = trace.into_inner().unwrap();
            recorded.sort_by_key(|r| (r.state, r.pos));
            if let Some(t) = self.qsa_trace.lock().unwrap().as_mut() {
                t.extend(recorded);
            }
        }
        Self::stack(seqs, nh * d, outs)
    }

    pub(crate) fn ple_mix_impl(
        &self,
        layer: usize,
        sh: &PleShape,
        streams: &mut CpuTensor,
        rows: &CpuTensor,
        w: &PleWeights<CpuWeight>,
        seqs: &[SeqChunk<'_>],
    ) {
        let (ns, h, e) = (sh.streams, sh.hidden, sh.row_width);
        let sc = ns * h;
        assert_eq!(streams.cols, sc, "ple_mix: streams must be [rows, S*H]");
        assert_eq!(rows.cols, e, "ple_mix: rows must be [rows, E]");
        assert_eq!(rows.rows, streams.rows, "ple_mix: one row of E per token");
        let t = rows.rows;
        let mut v = matmul(&rows.data, t, &w.value);
        add_bias(&mut v, &w.value_bias);
        let keys: Vec<CpuTensor> = (0..ns)
            .map(|c| {
                let mut k = matmul(&rows.data, t, &w.key[c]);
                add_bias(&mut k, &w.key_bias[c]);
                ops::rms_norm(&mut k.data, &w.key_norm[c].data, h, ops::PLE_EPS, 0.0);
                k
            })
            .collect();
        // u and its per-stream normed copy z, [t, S·H].
        let mut u = vec![0f32; t * sc];
        for r in 0..t {
            let rs = streams.row_range(r, 1);
            for c in 0..ns {
                ops::ple_gate(
                    keys[c].row_range(r, 1),
                    &rs[c * h..(c + 1) * h],
                    &w.query_norm[c].data,
                    v.row_range(r, 1),
                    &mut u[r * sc + c * h..r * sc + (c + 1) * h],
                );
            }
        }
        let mut z = u.clone();
        for zr in z.chunks_exact_mut(sc) {
            for c in 0..ns {
                ops::rms_norm(
                    &mut zr[c * h..(c + 1) * h],
                    &w.conv_norm[c].data,
                    h,
                    ops::PLE_EPS,
                    0.0,
                );
            }
        }
        let mut states = self.take(seqs);
        let ys: Vec<Vec<f32>> =
            seqs.par_iter()
                .zip(states.par_iter_mut())
                .map(|(s, st)| {
                    let state = st.ple.get_mut(&layer).unwrap_or_else(|| {
                        panic!("no PLE state for layer {layer}: init_cache first")
                    });
                    let mut y = vec![0f32; s.len * sc];
                    ops::dilated_conv_silu(
                        &z[s.start * sc..(s.start + s.len) * sc],
                        &w.conv.data,
                        state,
                        sc,
                        sh.conv_kernel,
                        sh.conv_dilation,
                        &mut y,
                    );
                    y
                })
                .collect();
        self.put_back(seqs, states);
        for (s, y) in seqs.iter().zip(ys) {
            let dst = &mut streams.data[s.start * sc..(s.start + s.len) * sc];
            let us = &u[s.start * sc..(s.start + s.len) * sc];
            for ((r, u), y) in dst.iter_mut().zip(us).zip(&y) {
                *r += u + y;
            }
        }
    }

    pub(crate) fn hc_premix_impl(&self, streams: &CpuTensor, pre: &CpuWeight) -> CpuTensor {
        let ns = pre.data.len();
        assert!(
            ns > 0 && streams.cols.is_multiple_of(ns),
            "hc_premix: streams must be [rows, S*H]"
        );
        let h = streams.cols / ns;
        let wts = ops::hc_weights(&pre.data);
        let mut out = CpuTensor::zeros(streams.rows, h);
        for (o, r) in out
            .data
            .chunks_exact_mut(h)
            .zip(streams.data.chunks_exact(streams.cols))
        {
            for (c, wc) in wts.iter().enumerate() {
                o.iter_mut()
                    .zip(&r[c * h..(c + 1) * h])
                    .for_each(|(o, x)| *o += wc * x);
            }
        }
        out
    }

    pub(crate) fn hc_gated_residual_impl(
        &self,
        streams: &mut CpuTensor,
        u: &CpuTensor,
        y: &CpuTensor,
    ) {
        let (sc, h) = (streams.cols, y.cols);
        assert!(
            u.cols == sc
                && sc.is_multiple_of(h)
                && u.rows == streams.rows
                && y.rows == streams.rows,
            "hc_gated_residual: streams and u must be [rows, S*H], y [rows, H]"
        );
        for ((r, ur), yr) in streams
            .data
            .chunks_exact_mut(sc)
            .zip(u.data.chunks_exact(sc))
            .zip(y.data.chunks_exact(h))
        {
            for (rc, uc) in r.chunks_exact_mut(h).zip(ur.chunks_exact(h)) {
                for ((x, g), y) in rc.iter_mut().zip(uc).zip(yr) {
                    *x += ops::sigmoid(*g) * y;
                }
            }
        }
    }
}
