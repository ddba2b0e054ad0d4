//! [`CpuBackend`]: the model's ops on host memory in f32, with per-sequence caches kept in growable
//! buffers (attention K/V per layer, GDN conv + recurrent state per layer).

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use rayon::prelude::*;
use sanmai_model::backend::{
    AttnShape, AttnWeights, Backend, GdnShape, GdnWeights, MoeWeights, Rope, SeqChunk,
};

use crate::ops;

/// Activations `[rows, cols]`, row-major.
#[derive(Debug, Clone, PartialEq)]
pub struct CpuTensor {
    pub rows: usize,
    pub cols: usize,
    pub data: Vec<f32>,
}

impl CpuTensor {
    pub fn zeros(rows: usize, cols: usize) -> Self {
        CpuTensor {
            rows,
            cols,
            data: vec![0.0; rows * cols],
        }
    }

    fn row_range(&self, start: usize, len: usize) -> &[f32] {
        &self.data[start * self.cols..(start + len) * self.cols]
    }
}

/// A weight: its shape and f32 values (`[out, in]` for matrices).
#[derive(Debug)]
pub struct CpuWeight {
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

impl CpuWeight {
    /// Columns of a matrix (its input width); the length of a vector.
    fn cols(&self) -> usize {
        *self.shape.last().unwrap_or(&1)
    }
    fn rows(&self) -> usize {
        self.data.len() / self.cols().max(1)
    }
}

#[derive(Default)]
struct KvCache {
    k: Vec<f32>,
    v: Vec<f32>,
    len: usize,
}

struct GdnState {
    conv: Vec<f32>,
    ssm: Vec<f32>,
}

#[derive(Default)]
struct SeqState {
    kv: HashMap<usize, KvCache>,
    gdn: HashMap<usize, GdnState>,
}

/// The f32 reference backend.
#[derive(Default)]
pub struct CpuBackend {
    seqs: Mutex<HashMap<usize, SeqState>>,
    next_slot: AtomicUsize,
}

impl CpuBackend {
    pub fn new() -> Self {
        Self::default()
    }

    /// Takes the states of the step's sequences out of the table (so they can be worked on in parallel).
    fn take(&self, seqs: &[SeqChunk]) -> Vec<SeqState> {
        let mut table = self.seqs.lock().unwrap();
        seqs.iter()
            .map(|s| {
                table
                    .remove(&s.slot)
                    .unwrap_or_else(|| panic!("sequence slot {} is not allocated", s.slot))
            })
            .collect()
    }

    fn put_back(&self, seqs: &[SeqChunk], states: Vec<SeqState>) {
        let mut table = self.seqs.lock().unwrap();
        for (s, st) in seqs.iter().zip(states) {
            table.insert(s.slot, st);
        }
    }

    /// Runs `f` on each chunk with its state, in parallel across sequences, and stacks the outputs
    /// (`cols` wide) in row order.
    fn per_seq(
        &self,
        seqs: &[SeqChunk],
        cols: usize,
        f: impl Fn(&SeqChunk, &mut SeqState) -> Vec<f32> + Sync,
    ) -> CpuTensor {
        let mut states = self.take(seqs);
        let outs: Vec<Vec<f32>> = seqs
            .par_iter()
            .zip(states.par_iter_mut())
            .map(|(s, st)| f(s, st))
            .collect();
        self.put_back(seqs, states);
        let rows = seqs.iter().map(|s| s.start + s.len).max().unwrap_or(0);
        let mut out = CpuTensor::zeros(rows, cols);
        for (s, o) in seqs.iter().zip(outs) {
            out.data[s.start * cols..(s.start + s.len) * cols].copy_from_slice(&o);
        }
        out
    }
}

fn matmul(x: &[f32], t: usize, w: &CpuWeight) -> CpuTensor {
    let (n, k) = (w.rows(), w.cols());
    let mut y = CpuTensor::zeros(t, n);
    ops::matmul_t(x, &w.data, t, k, n, &mut y.data);
    y
}

impl Backend for CpuBackend {
    type Tensor = CpuTensor;
    type Weight = CpuWeight;

    fn weight(&self, data: Vec<f32>, shape: &[usize]) -> CpuWeight {
        assert_eq!(
            data.len(),
            shape.iter().product::<usize>(),
            "weight data does not match its shape"
        );
        CpuWeight {
            shape: shape.to_vec(),
            data,
        }
    }

    fn alloc_seq(&self) -> usize {
        let slot = self.next_slot.fetch_add(1, Ordering::Relaxed);
        self.seqs.lock().unwrap().insert(slot, SeqState::default());
        slot
    }

    fn free_seq(&self, slot: usize) {
        self.seqs.lock().unwrap().remove(&slot);
    }

    fn embed(&self, table: &CpuWeight, ids: &[u32]) -> CpuTensor {
        let h = table.cols();
        let mut out = CpuTensor::zeros(ids.len(), h);
        for (row, &id) in out.data.chunks_exact_mut(h).zip(ids) {
            let id = id as usize;
            row.copy_from_slice(&table.data[id * h..(id + 1) * h]);
        }
        out
    }

    fn rms_norm(&self, x: &CpuTensor, w: &CpuWeight, eps: f32, offset: f32) -> CpuTensor {
        let mut y = x.clone();
        ops::rms_norm(&mut y.data, &w.data, x.cols, eps, offset);
        y
    }

    fn linear(&self, x: &CpuTensor, w: &CpuWeight) -> CpuTensor {
        assert_eq!(
            x.cols,
            w.cols(),
            "linear: input width does not match the weight"
        );
        matmul(&x.data, x.rows, w)
    }

    fn rows(&self, x: &CpuTensor, rows: &[usize]) -> CpuTensor {
        let mut out = CpuTensor::zeros(rows.len(), x.cols);
        for (dst, &r) in out.data.chunks_exact_mut(x.cols).zip(rows) {
            dst.copy_from_slice(x.row_range(r, 1));
        }
        out
    }

    fn concat_cols(&self, a: &CpuTensor, b: &CpuTensor) -> CpuTensor {
        assert_eq!(a.rows, b.rows);
        let cols = a.cols + b.cols;
        let mut out = CpuTensor::zeros(a.rows, cols);
        for (r, dst) in out.data.chunks_exact_mut(cols).enumerate() {
            dst[..a.cols].copy_from_slice(a.row_range(r, 1));
            dst[a.cols..].copy_from_slice(b.row_range(r, 1));
        }
        out
    }

    fn add(&self, acc: &mut CpuTensor, y: &CpuTensor) {
        assert_eq!(acc.data.len(), y.data.len());
        acc.data.iter_mut().zip(&y.data).for_each(|(a, b)| *a += b);
    }

    fn add_sigmoid_gated(&self, acc: &mut CpuTensor, y: &CpuTensor, gate: &CpuTensor) {
        let c = acc.cols;
        for ((a, yr), g) in acc
            .data
            .chunks_exact_mut(c)
            .zip(y.data.chunks_exact(c))
            .zip(&gate.data)
        {
            let s = ops::sigmoid(*g);
            a.iter_mut().zip(yr).for_each(|(a, y)| *a += s * y);
        }
    }

    fn swiglu(&self, gate_up: &CpuTensor) -> CpuTensor {
        let i = gate_up.cols / 2;
        let mut out = CpuTensor::zeros(gate_up.rows, i);
        ops::swiglu(&gate_up.data, gate_up.rows, i, &mut out.data);
        out
    }

    fn attention(
        &self,
        layer: usize,
        sh: &AttnShape,
        rope: &Rope,
        q_gate: &CpuTensor,
        k: &CpuTensor,
        v: &CpuTensor,
        w: &AttnWeights<CpuWeight>,
        seqs: &[SeqChunk],
    ) -> CpuTensor {
        let (nh, nkv, d) = (sh.num_heads, sh.num_kv_heads, sh.head_dim);
        self.per_seq(seqs, nh * d, |s, st| {
            let t = s.len;
            // Split each head's [q | gate].
            let mut q = vec![0f32; t * nh * d];
            let mut gate = vec![0f32; t * nh * d];
            for (r, row) in q_gate
                .row_range(s.start, t)
                .chunks_exact(2 * nh * d)
                .enumerate()
            {
                for h in 0..nh {
                    let src = &row[h * 2 * d..(h + 1) * 2 * d];
                    q[(r * nh + h) * d..(r * nh + h + 1) * d].copy_from_slice(&src[..d]);
                    gate[(r * nh + h) * d..(r * nh + h + 1) * d].copy_from_slice(&src[d..]);
                }
            }
            let mut kn = k.row_range(s.start, t).to_vec();
            ops::rms_norm(&mut q, &w.q_norm.data, d, sh.eps, 1.0);
            ops::rms_norm(&mut kn, &w.k_norm.data, d, sh.eps, 1.0);
            let positions: Vec<u32> = (s.pos0..s.pos0 + t).map(|p| p as u32).collect();
            ops::rope_neox(
                &mut q,
                nh,
                d,
                rope.rot_dim,
                &positions,
                &rope.inv_freq,
                rope.mscale,
            );
            ops::rope_neox(
                &mut kn,
                nkv,
                d,
                rope.rot_dim,
                &positions,
                &rope.inv_freq,
                rope.mscale,
            );
            let cache = st.kv.entry(layer).or_default();
            assert_eq!(
                cache.len, s.pos0,
                "attention layer {layer}: cache holds {} tokens, chunk starts at {}",
                cache.len, s.pos0
            );
            cache.k.extend_from_slice(&kn);
            cache.v.extend_from_slice(v.row_range(s.start, t));
            cache.len += t;
            let mut out = vec![0f32; t * nh * d];
            let scale = (d as f32).powf(-0.5);
            ops::attention_causal(
                &q, &cache.k, &cache.v, t, cache.len, nh, nkv, d, scale, &mut out,
            );
            out.iter_mut()
                .zip(&gate)
                .for_each(|(o, g)| *o *= ops::sigmoid(*g));
            out
        })
    }

    fn gdn(
        &self,
        layer: usize,
        sh: &GdnShape,
        qkv: &CpuTensor,
        z: &CpuTensor,
        b: &CpuTensor,
        a: &CpuTensor,
        w: &GdnWeights<CpuWeight>,
        eps: f32,
        seqs: &[SeqChunk],
    ) -> CpuTensor {
        let (hk, hv, dk, dv, kk) = (
            sh.num_k_heads,
            sh.num_v_heads,
            sh.k_head_dim,
            sh.v_head_dim,
            sh.conv_kernel,
        );
        let key_dim = hk * dk;
        let conv_dim = 2 * key_dim + hv * dv;
        self.per_seq(seqs, hv * dv, |s, st| {
            let t = s.len;
            let state = st.gdn.entry(layer).or_insert_with(|| GdnState {
                conv: vec![0.0; (kk - 1) * conv_dim],
                ssm: vec![0.0; hv * dk * dv],
            });
            let mut mixed = vec![0f32; t * conv_dim];
            ops::causal_conv1d_silu(
                qkv.row_range(s.start, t),
                &w.conv.data,
                &mut state.conv,
                t,
                conv_dim,
                kk,
                &mut mixed,
            );
            let mut q = Vec::with_capacity(t * key_dim);
            let mut k = Vec::with_capacity(t * key_dim);
            let mut v = Vec::with_capacity(t * hv * dv);
            for row in mixed.chunks_exact(conv_dim) {
                q.extend_from_slice(&row[..key_dim]);
                k.extend_from_slice(&row[key_dim..2 * key_dim]);
                v.extend_from_slice(&row[2 * key_dim..]);
            }
            let mut beta = b.row_range(s.start, t).to_vec();
            beta.iter_mut().for_each(|x| *x = ops::sigmoid(*x));
            let mut g = a.row_range(s.start, t).to_vec();
            for row in g.chunks_exact_mut(hv) {
                for (h, x) in row.iter_mut().enumerate() {
                    *x = -w.a_log.data[h].exp() * ops::softplus(*x + w.dt_bias.data[h]);
                }
            }
            let mut out = vec![0f32; t * hv * dv];
            if t == 1 {
                ops::gdn_recurrent(
                    &q,
                    &k,
                    &v,
                    &g,
                    &beta,
                    &mut state.ssm,
                    &mut out,
                    t,
                    hk,
                    hv,
                    dk,
                    dv,
                );
            } else {
                ops::gdn_chunked(
                    &q,
                    &k,
                    &v,
                    &g,
                    &beta,
                    &mut state.ssm,
                    &mut out,
                    t,
                    hk,
                    hv,
                    dk,
                    dv,
                    64,
                );
            }
            ops::gated_rms_norm(&mut out, z.row_range(s.start, t), &w.norm.data, dv, eps);
            out
        })
    }

    fn moe_experts(&self, x: &CpuTensor, w: &MoeWeights<CpuWeight>) -> CpuTensor {
        let (t, h) = (x.rows, x.cols);
        let e = w.experts.len();
        let logits = matmul(&x.data, t, &w.router);
        let mut ids = vec![0u32; t * w.top_k];
        let mut weights = vec![0f32; t * w.top_k];
        ops::route_topk(
            &logits.data,
            t,
            e,
            w.top_k,
            w.renormalize,
            &mut ids,
            &mut weights,
        );
        // Tokens (and their routing weight) per expert.
        let mut routed: Vec<Vec<(usize, f32)>> = vec![Vec::new(); e];
        for (i, (&id, &wt)) in ids.iter().zip(&weights).enumerate() {
            routed[id as usize].push((i / w.top_k, wt));
        }
        let partial: Vec<(usize, CpuTensor)> = routed
            .par_iter()
            .enumerate()
            .filter(|(_, toks)| !toks.is_empty())
            .map(|(ei, toks)| {
                let ex = &w.experts[ei];
                let mut xs = Vec::with_capacity(toks.len() * h);
                for &(tok, _) in toks {
                    xs.extend_from_slice(x.row_range(tok, 1));
                }
                let gu = matmul(&xs, toks.len(), &ex.gate_up);
                let mut act = CpuTensor::zeros(toks.len(), ex.inter);
                ops::swiglu(&gu.data, toks.len(), ex.inter, &mut act.data);
                (ei, matmul(&act.data, toks.len(), &ex.down))
            })
            .collect();
        let mut out = CpuTensor::zeros(t, h);
        for (ei, y) in partial {
            for (&(tok, wt), yr) in routed[ei].iter().zip(y.data.chunks_exact(h)) {
                out.data[tok * h..(tok + 1) * h]
                    .iter_mut()
                    .zip(yr)
                    .for_each(|(o, v)| *o += wt * v);
            }
        }
        out
    }

    fn to_host(&self, x: &CpuTensor) -> (usize, usize, Vec<f32>) {
        (x.rows, x.cols, x.data.clone())
    }
}
