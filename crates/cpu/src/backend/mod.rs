//! [`CpuBackend`]: the model's ops on host memory in f32, with attention K/V in block pools (one per
//! attention layer, with QSA's index keys next to them) and GDN conv + recurrent state (and the PLE
//! conv state) in state slots. The qwen4_exp ops live in `backend_ext.rs`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, RwLock};

use rayon::prelude::*;
use sanmai_model::backend::{
    AttnShape, AttnWeights, Backend, CacheSpec, GdnShape, GdnWeights, IndexerWeights, MoeWeights,
    PleShape, PleWeights, QsaShape, Rope, SeqChunk,
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

    pub(crate) fn row_range(&self, start: usize, len: usize) -> &[f32] {
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
    pub(crate) fn cols(&self) -> usize {
        *self.shape.last().unwrap_or(&1)
    }
    pub(crate) fn rows(&self) -> usize {
        self.data.len() / self.cols().max(1)
    }
}

/// K/V of one attention layer for every block: `[num_blocks, block_size, kv_heads·head_dim]` each,
/// and QSA's index-key entries `[num_blocks, block_size, dI + 2]` bytes (empty without QSA).
pub(crate) struct KvPool {
    pub(crate) k: Vec<f32>,
    pub(crate) v: Vec<f32>,
    pub(crate) idx: Vec<u8>,
}

struct GdnState {
    conv: Vec<f32>,
    ssm: Vec<f32>,
}

/// The block pools and their geometry.
#[derive(Default)]
pub(crate) struct Pools {
    pub(crate) block_size: usize,
    /// `kv_heads · head_dim`.
    pub(crate) row: usize,
    /// Bytes of one index-key entry (`dI + 2`; 0 without QSA).
    pub(crate) idx_row: usize,
    pub(crate) layers: HashMap<usize, KvPool>,
}

/// The states of one state slot: GDN conv + recurrent state per GDN layer, PLE conv state
/// `[(kernel−1)·dilation, S·H]` per PLE layer.
#[derive(Default)]
pub(crate) struct SlotStates {
    gdn: HashMap<usize, GdnState>,
    pub(crate) ple: HashMap<usize, Vec<f32>>,
}

/// The f32 reference backend.
#[derive(Default)]
pub struct CpuBackend {
    pub(crate) pools: RwLock<Pools>,
    states: Mutex<HashMap<usize, SlotStates>>,
    gdn: Mutex<Option<(Vec<usize>, GdnShape)>>,
    ple: Mutex<Option<(Vec<usize>, PleShape)>>,
    next_state: AtomicUsize,
    /// QSA selections recorded while tracing is on (see [`CpuBackend::trace_qsa`]).
    pub(crate) qsa_trace: Mutex<Option<Vec<QsaSelection>>>,
    /// Distinct experts per MoE call while recording is on (see [`Backend::record_routing`]).
    routing: Mutex<Option<Vec<usize>>>,
}

/// One query row's QSA selection, recorded by a tracing backend.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QsaSelection {
    /// Attention layer index (the MTP layer is `num_layers`).
    pub layer: usize,
    /// The sequence's state slot.
    pub state: usize,
    /// The query's position.
    pub pos: usize,
    /// The selected positions, increasing.
    pub selected: Vec<usize>,
}

impl CpuBackend {
    pub fn new() -> Self {
        Self::default()
    }

    /// Starts (or stops) recording every QSA query row's selected positions.
    pub fn trace_qsa(&self, on: bool) {
        *self.qsa_trace.lock().unwrap() = on.then(Vec::new);
    }

    /// The selections recorded since the last call (empty when tracing is off).
    pub fn take_qsa_trace(&self) -> Vec<QsaSelection> {
        self.qsa_trace
            .lock()
            .unwrap()
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }

    fn fresh_states(&self) -> SlotStates {
        let mut out = SlotStates::default();
        if let Some((layers, sh)) = self.ple.lock().unwrap().as_ref() {
            for &l in layers {
                out.ple
                    .insert(l, vec![0.0; sh.state_rows() * sh.channels()]);
            }
        }
        let guard = self.gdn.lock().unwrap();
        let Some((layers, g)) = guard.as_ref() else {
            return out;
        };
        let conv_dim = 2 * g.num_k_heads * g.k_head_dim + g.num_v_heads * g.v_head_dim;
        out.gdn = layers
            .iter()
            .map(|&l| {
                let st = GdnState {
                    conv: vec![0.0; (g.conv_kernel - 1) * conv_dim],
                    ssm: vec![0.0; g.num_v_heads * g.k_head_dim * g.v_head_dim],
                };
                (l, st)
            })
            .collect();
        out
    }

    /// Takes the state slots of the step's sequences out of the table (so they can be worked on in parallel).
    pub(crate) fn take(&self, seqs: &[SeqChunk<'_>]) -> Vec<SlotStates> {
        let mut table = self.states.lock().unwrap();
        seqs.iter()
            .map(|s| {
                table
                    .remove(&s.state)
                    .unwrap_or_else(|| panic!("state slot {} is not allocated", s.state))
            })
            .collect()
    }

    pub(crate) fn put_back(&self, seqs: &[SeqChunk<'_>], states: Vec<SlotStates>) {
        let mut table = self.states.lock().unwrap();
        for (s, st) in seqs.iter().zip(states) {
            table.insert(s.state, st);
        }
    }

    /// Stacks per-sequence outputs (`cols` wide) in row order.
    pub(crate) fn stack(seqs: &[SeqChunk<'_>], cols: usize, outs: Vec<Vec<f32>>) -> CpuTensor {
        let rows = seqs.iter().map(|s| s.start + s.len).max().unwrap_or(0);
        let mut out = CpuTensor::zeros(rows, cols);
        for (s, o) in seqs.iter().zip(outs) {
            out.data[s.start * cols..(s.start + s.len) * cols].copy_from_slice(&o);
        }
        out
    }
}

/// Offset of position `pos`'s row in a pool.
pub(crate) fn pool_offset(blocks: &[u32], block_size: usize, row: usize, pos: usize) -> usize {
    (blocks[pos / block_size] as usize * block_size + pos % block_size) * row
}

/// Copies positions `0..len` of a sequence's K or V out of the pool into a contiguous `[len, row]` buffer.
pub(crate) fn gather(
    pool: &[f32],
    blocks: &[u32],
    block_size: usize,
    row: usize,
    len: usize,
) -> Vec<f32> {
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

pub(crate) fn matmul(x: &[f32], t: usize, w: &CpuWeight) -> CpuTensor {
    let (n, k) = (w.rows(), w.cols());
    let mut y = CpuTensor::zeros(t, n);
    ops::matmul_t(x, &w.data, t, k, n, &mut y.data);
    y
}

/// One sequence's gated-attention inputs: the query heads and gates split from `[q | gate]` rows, the
/// zero-centred q/k norms and RoPE applied; returns `(q, gate, k)` as `[len, heads·head_dim]`.
pub(crate) fn prepare_attention(
    s: &SeqChunk<'_>,
    sh: &AttnShape,
    rope: &Rope,
    q_gate: &CpuTensor,
    k: &CpuTensor,
    w: &AttnWeights<CpuWeight>,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (nh, nkv, d) = (sh.num_heads, sh.num_kv_heads, sh.head_dim);
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

    /// Dequantises the packed integers (`q · scale` in f32, the same values the GPU decodes) and
    /// stores them like [`Backend::weight`].
    fn packed_weight(&self, p: &sanmai_model::backend::PackedTensor<'_>) -> CpuWeight {
        self.weight(p.dequantize(), &[p.out_features, p.in_features])
    }

    fn init_cache(&self, spec: &CacheSpec) {
        let row = spec.num_kv_heads * spec.head_dim;
        let n = spec.num_blocks * spec.block_size * row;
        let idx_row = if spec.index_head_dim > 0 {
            spec.index_head_dim + 2
        } else {
            0
        };
        let mut pools = self.pools.write().unwrap();
        pools.block_size = spec.block_size;
        pools.row = row;
        pools.idx_row = idx_row;
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
                        idx: vec![0; spec.num_blocks * spec.block_size * idx_row],
                    },
                )
            })
            .collect();
        *self.gdn.lock().unwrap() = Some((spec.gdn_layers.clone(), spec.gdn));
        *self.ple.lock().unwrap() = spec.ple.map(|sh| (spec.ple_layers.clone(), sh));
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
        let from = &table[&src];
        let copy = SlotStates {
            gdn: from
                .gdn
                .iter()
                .map(|(&l, st)| {
                    let st = GdnState {
                        conv: st.conv.clone(),
                        ssm: st.ssm.clone(),
                    };
                    (l, st)
                })
                .collect(),
            ple: from.ple.clone(),
        };
        table.insert(dst, copy);
    }

    fn copy_block(&self, src: u32, dst: u32) {
        let mut pools = self.pools.write().unwrap();
        let n = pools.block_size * pools.row;
        let (s, d) = (src as usize * n, dst as usize * n);
        let ni = pools.block_size * pools.idx_row;
        let (si, di) = (src as usize * ni, dst as usize * ni);
        for pool in pools.layers.values_mut() {
            pool.k.copy_within(s..s + n, d);
            pool.v.copy_within(s..s + n, d);
            pool.idx.copy_within(si..si + ni, di);
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
            .map(|s| prepare_attention(s, sh, rope, q_gate, k, w))
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
        let outs: Vec<Vec<f32>> =
            seqs.par_iter()
                .zip(states.par_iter_mut())
                .map(|(s, st)| {
                    let t = s.len;
                    let state = st.gdn.get_mut(&layer).unwrap_or_else(|| {
                        panic!("no GDN state for layer {layer}: init_cache first")
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
                .collect();
        self.put_back(seqs, states);
        Self::stack(seqs, hv * dv, outs)
    }

    fn moe_experts(
        &self,
        x: &CpuTensor,
        w: &MoeWeights<CpuWeight>,
        shared: Option<(&CpuTensor, &CpuTensor)>,
    ) -> CpuTensor {
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
        if let Some(log) = self.routing.lock().unwrap().as_mut() {
            let mut seen = vec![false; e];
            ids.iter().for_each(|&i| seen[i as usize] = true);
            log.push(seen.iter().filter(|&&x| x).count());
        }
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
        if let Some((y, gate)) = shared {
            for ((o, yr), g) in out
                .data
                .chunks_exact_mut(h)
                .zip(y.data.chunks_exact(h))
                .zip(&gate.data)
            {
                let s = ops::sigmoid(*g);
                o.iter_mut().zip(yr).for_each(|(o, y)| *o += s * y);
            }
        }
        out
    }

    fn to_host(&self, x: CpuTensor) -> (usize, usize, Vec<f32>) {
        (x.rows, x.cols, x.data)
    }

    fn weight_bytes(&self, w: &CpuWeight) -> usize {
        w.data.len() * std::mem::size_of::<f32>()
    }

    /// The best of five parallel copies of 256 MiB (one chunk per thread).
    fn copy_bandwidth(&self) -> f64 {
        const BYTES: usize = 256 << 20;
        let src = vec![1u8; BYTES];
        let mut dst = vec![0u8; BYTES];
        let chunk = BYTES.div_ceil(rayon::current_num_threads().max(1));
        let mut best = f64::INFINITY;
        for _ in 0..5 {
            let t0 = std::time::Instant::now();
            dst.par_chunks_mut(chunk)
                .zip(src.par_chunks(chunk))
                .for_each(|(d, s)| d.copy_from_slice(s));
            best = best.min(t0.elapsed().as_secs_f64());
        }
        std::hint::black_box(&dst);
        2.0 * BYTES as f64 / best
    }

    fn record_routing(&self, on: bool) {
        *self.routing.lock().unwrap() = on.then(Vec::new);
    }

    fn take_routing(&self) -> Vec<usize> {
        self.routing
            .lock()
            .unwrap()
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }

    fn decode_step(
        &self,
        _step: &sanmai_model::DecodeStep<'_>,
        run: &dyn Fn() -> Vec<CpuTensor>,
    ) -> Vec<CpuTensor> {
        run()
    }

    fn upload(&self, rows: usize, cols: usize, data: Vec<f32>) -> CpuTensor {
        assert_eq!(data.len(), rows * cols, "upload: data must be [rows, cols]");
        CpuTensor { rows, cols, data }
    }

    fn silu(&self, x: &CpuTensor) -> CpuTensor {
        let mut y = x.clone();
        y.data.iter_mut().for_each(|v| *v = ops::silu(*v));
        y
    }

    fn hc_premix(&self, streams: &CpuTensor, pre: &CpuWeight) -> CpuTensor {
        self.hc_premix_impl(streams, pre)
    }

    fn hc_gated_residual(&self, streams: &mut CpuTensor, u: &CpuTensor, y: &CpuTensor) {
        self.hc_gated_residual_impl(streams, u, y)
    }

    fn qsa_attention(
        &self,
        layer: usize,
        shape: &AttnShape,
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
        self.qsa_impl(
            layer, shape, rope, qsa, q_gate, k, v, w, iq, ik, iw, iw_, seqs,
        )
    }

    fn ple_mix(
        &self,
        layer: usize,
        shape: &PleShape,
        streams: &mut CpuTensor,
        rows: &CpuTensor,
        w: &PleWeights<CpuWeight>,
        seqs: &[SeqChunk<'_>],
    ) {
        self.ple_mix_impl(layer, shape, streams, rows, w, seqs)
    }
}
