//! [`CpuBackend`]: the model's ops on host memory in f32, with attention K/V in block pools (one per
//! attention layer) and GDN conv + recurrent state in state slots.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, RwLock};

use rayon::prelude::*;
use sanmai_model::backend::{
    AttnShape, AttnWeights, Backend, CacheSpec, GdnShape, GdnWeights, MoeWeights, Rope, SeqChunk,
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

/// K/V of one attention layer for every block: `[num_blocks, block_size, kv_heads·head_dim]` each.
struct KvPool {
    k: Vec<f32>,
    v: Vec<f32>,
}

struct GdnState {
    conv: Vec<f32>,
    ssm: Vec<f32>,
}

/// The block pools and their geometry.
#[derive(Default)]
struct Pools {
    block_size: usize,
    /// `kv_heads · head_dim`.
    row: usize,
    layers: HashMap<usize, KvPool>,
}

/// GDN states of one state slot, per GDN layer.
type SlotStates = HashMap<usize, GdnState>;

/// The f32 reference backend.
#[derive(Default)]
pub struct CpuBackend {
    pools: RwLock<Pools>,
    states: Mutex<HashMap<usize, SlotStates>>,
    gdn: Mutex<Option<(Vec<usize>, GdnShape)>>,
    next_state: AtomicUsize,
}

impl CpuBackend {
    pub fn new() -> Self {
        Self::default()
    }

    fn fresh_states(&self) -> SlotStates {
        let guard = self.gdn.lock().unwrap();
        let Some((layers, g)) = guard.as_ref() else {
            return SlotStates::new();
        };
        let conv_dim = 2 * g.num_k_heads * g.k_head_dim + g.num_v_heads * g.v_head_dim;
        layers
            .iter()
            .map(|&l| {
                let st = GdnState {
                    conv: vec![0.0; (g.conv_kernel - 1) * conv_dim],
                    ssm: vec![0.0; g.num_v_heads * g.k_head_dim * g.v_head_dim],
                };
                (l, st)
            })
            .collect()
    }

    /// Takes the state slots of the step's sequences out of the table (so they can be worked on in parallel).
    fn take(&self, seqs: &[SeqChunk<'_>]) -> Vec<SlotStates> {
        let mut table = self.states.lock().unwrap();
        seqs.iter()
            .map(|s| {
                table
                    .remove(&s.state)
                    .unwrap_or_else(|| panic!("state slot {} is not allocated", s.state))
            })
            .collect()
    }

    fn put_back(&self, seqs: &[SeqChunk<'_>], states: Vec<SlotStates>) {
        let mut table = self.states.lock().unwrap();
        for (s, st) in seqs.iter().zip(states) {
            table.insert(s.state, st);
        }
    }

    /// Stacks per-sequence outputs (`cols` wide) in row order.
    fn stack(seqs: &[SeqChunk<'_>], cols: usize, outs: Vec<Vec<f32>>) -> CpuTensor {
        let rows = seqs.iter().map(|s| s.start + s.len).max().unwrap_or(0);
        let mut out = CpuTensor::zeros(rows, cols);
        for (s, o) in seqs.iter().zip(outs) {
            out.data[s.start * cols..(s.start + s.len) * cols].copy_from_slice(&o);
        }
        out
    }
}

/// Offset of position `pos`'s row in a pool.
fn pool_offset(blocks: &[u32], block_size: usize, row: usize, pos: usize) -> usize {
    (blocks[pos / block_size] as usize * block_size + pos % block_size) * row
}

/// Copies positions `0..len` of a sequence's K or V out of the pool into a contiguous `[len, row]` buffer.
fn gather(pool: &[f32], blocks: &[u32], block_size: usize, row: usize, len: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(len * row);
    let mut pos = 0;
    while pos < len {
        let n = (block_size - pos % block_size).min(len - pos);
        let o = pool_offset(blocks, block_size, row, pos);
        out.extend_from_slice(&pool[o..o + n * row]);
        pos += n;
    }
    out
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
    const CACHE_ELEM_BYTES: usize = 4;

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

    fn init_cache(&self, spec: &CacheSpec) {
        let row = spec.num_kv_heads * spec.head_dim;
        let n = spec.num_blocks * spec.block_size * row;
        let mut pools = self.pools.write().unwrap();
        pools.block_size = spec.block_size;
        pools.row = row;
        // Zero-filled allocations are lazily backed by the OS: only touched blocks cost memory.
        pools.layers = spec
            .attn_layers
            .iter()
            .map(|&l| {
                (
                    l,
                    KvPool {
                        k: vec![0.0; n],
                        v: vec![0.0; n],
                    },
                )
            })
            .collect();
        *self.gdn.lock().unwrap() = Some((spec.gdn_layers.clone(), spec.gdn));
    }

    fn alloc_state(&self) -> usize {
        let slot = self.next_state.fetch_add(1, Ordering::Relaxed);
        let fresh = self.fresh_states();
        self.states.lock().unwrap().insert(slot, fresh);
        slot
    }

    fn free_state(&self, slot: usize) {
        self.states.lock().unwrap().remove(&slot);
    }

    fn copy_state(&self, src: usize, dst: usize) {
        let mut table = self.states.lock().unwrap();
        let copy: SlotStates = table[&src]
            .iter()
            .map(|(&l, st)| {
                let st = GdnState {
                    conv: st.conv.clone(),
                    ssm: st.ssm.clone(),
                };
                (l, st)
            })
            .collect();
        table.insert(dst, copy);
    }

    fn copy_block(&self, src: u32, dst: u32) {
        let mut pools = self.pools.write().unwrap();
        let n = pools.block_size * pools.row;
        let (s, d) = (src as usize * n, dst as usize * n);
        for pool in pools.layers.values_mut() {
            pool.k.copy_within(s..s + n, d);
            pool.v.copy_within(s..s + n, d);
        }
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
        seqs: &[SeqChunk<'_>],
    ) -> CpuTensor {
        let (nh, nkv, d) = (sh.num_heads, sh.num_kv_heads, sh.head_dim);
        // 1. Per sequence: split [q | gate], norms, RoPE (in parallel, no shared state).
        let prepared: Vec<(Vec<f32>, Vec<f32>, Vec<f32>)> = seqs
            .par_iter()
            .map(|s| {
                let t = s.len;
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
                (q, gate, kn)
            })
            .collect();
        // 2. Write the new K/V rows into each sequence's blocks.
        let mut pools = self.pools.write().unwrap();
        let (bs, row) = (pools.block_size, pools.row);
        let pool = pools
            .layers
            .get_mut(&layer)
            .unwrap_or_else(|| panic!("no K/V pool for layer {layer}: init_cache first"));
        for (s, (_, _, kn)) in seqs.iter().zip(&prepared) {
            assert!(
                s.blocks.len() * bs >= s.pos0 + s.len,
                "attention layer {layer}: {} blocks cannot hold {} positions",
                s.blocks.len(),
                s.pos0 + s.len
            );
            let vs = v.row_range(s.start, s.len);
            for i in 0..s.len {
                let o = pool_offset(s.blocks, bs, row, s.pos0 + i);
                pool.k[o..o + row].copy_from_slice(&kn[i * row..(i + 1) * row]);
                pool.v[o..o + row].copy_from_slice(&vs[i * row..(i + 1) * row]);
            }
        }
        let pool = &*pool;
        // 3. Attend over positions 0..pos0 + len, in parallel across sequences.
        let scale = (d as f32).powf(-0.5);
        let outs: Vec<Vec<f32>> = seqs
            .par_iter()
            .zip(&prepared)
            .map(|(s, (q, gate, _))| {
                let len = s.pos0 + s.len;
                let kc = gather(&pool.k, s.blocks, bs, row, len);
                let vc = gather(&pool.v, s.blocks, bs, row, len);
                let mut out = vec![0f32; s.len * nh * d];
                ops::attention_causal(q, &kc, &vc, s.len, len, nh, nkv, d, scale, &mut out);
                out.iter_mut()
                    .zip(gate)
                    .for_each(|(o, g)| *o *= ops::sigmoid(*g));
                out
            })
            .collect();
        Self::stack(seqs, nh * d, outs)
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
        seqs: &[SeqChunk<'_>],
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
        let mut states = self.take(seqs);
        let outs: Vec<Vec<f32>> = seqs
            .par_iter()
            .zip(states.par_iter_mut())
            .map(|(s, st)| {
                let t = s.len;
                let state = st
                    .get_mut(&layer)
                    .unwrap_or_else(|| panic!("no GDN state for layer {layer}: init_cache first"));
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
            .collect();
        self.put_back(seqs, states);
        Self::stack(seqs, hv * dv, outs)
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

    fn to_host(&self, x: CpuTensor) -> (usize, usize, Vec<f32>) {
        (x.rows, x.cols, x.data)
    }
}
