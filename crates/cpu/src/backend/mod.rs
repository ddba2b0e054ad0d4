//! [`CpuBackend`]: the model's ops on host memory in f32, with attention K/V in block pools (one per
//! attention layer, with QSA's index keys next to them) and GDN conv + recurrent state (and the PLE
//! conv state) in state slots.
//!
//! This file holds the tensor types, the backend and its elementwise and matrix ops; each mixer and
//! block has its own file: `cache.rs` (block pools and state slots), `attention.rs` (the gated
//! attention and the prologue QSA shares), `qsa.rs`, `host_kv.rs` (QSA K/V rows in pinned host
//! memory: the row cache and its counters), `rows.rs` (where a pool's rows live), `gdn.rs`,
//! `moe.rs`, `ple.rs`, `hc.rs`, and `probe.rs` (what `sanmai bench` measures). A call outside an op's contract (shapes that do not
//! fit, a state slot not allocated, caches not initialised) is a [`BackendError::Invalid`], checked
//! before anything is written.

mod attention;
mod cache;
mod gdn;
mod hc;
mod host_kv;
mod moe;
mod ple;
mod probe;
mod qsa;
mod rows;

use std::collections::HashMap;
use std::sync::atomic::AtomicUsize;
use std::sync::{Mutex, RwLock};

use sanmai_model::backend::{
    AttnCall, Backend, BackendError, CacheSpec, DecodeStep, GdnCall, GdnShape, KvHostStats,
    MoeCall, OpResult, PackedTensor, PleCall, PleShape, QsaCall, SeqChunk,
};

use crate::ops;
use cache::{Pools, SlotStates};

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

    /// `Err` unless the tensor is `cols` wide and holds the rows of every chunk of `seqs` (`what`
    /// names it in the message).
    pub(crate) fn check_step(
        &self,
        op: &'static str,
        what: &str,
        cols: usize,
        seqs: &[SeqChunk<'_>],
    ) -> OpResult<()> {
        ensure(self.cols == cols, op, || {
            format!("{what} is {} wide, expected {cols}", self.cols)
        })?;
        let rows = step_rows(seqs);
        ensure(self.rows >= rows, op, || {
            format!(
                "{what} has {} rows, the step's chunks cover {rows}",
                self.rows
            )
        })
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

/// The f32 reference backend.
#[derive(Default)]
pub struct CpuBackend {
    pub(crate) pools: RwLock<Pools>,
    states: Mutex<HashMap<usize, SlotStates>>,
    gdn: Mutex<Option<(Vec<usize>, GdnShape)>>,
    ple: Mutex<Option<(Vec<usize>, PleShape)>>,
    next_state: AtomicUsize,
    /// Live state slots at most ([`Backend::reserve_states`]); `None`: unbounded.
    state_limit: Mutex<Option<usize>>,
    /// QSA selections recorded while tracing is on (see [`CpuBackend::trace_qsa`]).
    pub(crate) qsa_trace: Mutex<Option<Vec<QsaSelection>>>,
    /// What the QSA K/V host pool has served since `init_cache` (`None` unless the rows are
    /// pinned in host memory). Locked after `pools` where both are held, never the other way round.
    pub(crate) kv_stats: Mutex<Option<KvHostStats>>,
    /// Distinct experts per MoE call while recording is on (see
    /// [`sanmai_model::Probe::record_routing`]).
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

    /// Stacks per-sequence outputs (`cols` wide) in row order.
    pub(crate) fn stack(seqs: &[SeqChunk<'_>], cols: usize, outs: Vec<Vec<f32>>) -> CpuTensor {
        let mut out = CpuTensor::zeros(step_rows(seqs), cols);
        for (s, o) in seqs.iter().zip(outs) {
            out.data[s.start * cols..(s.start + s.len) * cols].copy_from_slice(&o);
        }
        out
    }
}

/// `Ok` when `ok`, else the contract breach `msg()` of `op`.
pub(crate) fn ensure(ok: bool, op: &'static str, msg: impl FnOnce() -> String) -> OpResult<()> {
    if ok {
        Ok(())
    } else {
        Err(BackendError::invalid(op, msg()))
    }
}

/// Rows a step's activations have: up to the end of its last chunk.
pub(crate) fn step_rows(seqs: &[SeqChunk<'_>]) -> usize {
    seqs.iter().map(|s| s.start + s.len).max().unwrap_or(0)
}

/// `x · wᵀ` of `t` rows of `x`.
pub(crate) fn matmul(x: &[f32], t: usize, w: &CpuWeight) -> CpuTensor {
    let (n, k) = (w.rows(), w.cols());
    let mut y = CpuTensor::zeros(t, n);
    ops::matmul_t(x, &w.data, t, k, n, &mut y.data);
    y
}

impl Backend for CpuBackend {
    type Tensor = CpuTensor;
    type Weight = CpuWeight;
    const CACHE_ELEM_BYTES: usize = 4;

    fn weight(&self, data: Vec<f32>, shape: &[usize]) -> OpResult<CpuWeight> {
        let n: usize = shape.iter().product();
        ensure(data.len() == n, "weight", || {
            format!("{} values for shape {shape:?}", data.len())
        })?;
        Ok(CpuWeight {
            shape: shape.to_vec(),
            data,
        })
    }

    /// Dequantises the packed integers (`q · scale` in f32, the same values the GPU decodes) and
    /// stores them like [`Backend::weight`].
    fn packed_weight(&self, p: &PackedTensor<'_>) -> OpResult<CpuWeight> {
        self.weight(p.dequantize(), &[p.out_features, p.in_features])
    }

    fn init_cache(&self, spec: &CacheSpec) -> OpResult<()> {
        self.init_cache_impl(spec)
    }

    fn alloc_state(&self) -> OpResult<usize> {
        self.alloc_state_impl()
    }

    fn reserve_states(&self, slots: usize) -> OpResult<()> {
        self.reserve_states_impl(slots)
    }

    fn free_state(&self, slot: usize) {
        self.free_state_impl(slot)
    }

    fn copy_state(&self, src: usize, dst: usize) -> OpResult<()> {
        self.copy_state_impl(src, dst)
    }

    fn copy_block(&self, src: u32, dst: u32) -> OpResult<()> {
        self.copy_block_impl(src, dst)
    }

    fn embed(&self, table: &CpuWeight, ids: &[u32]) -> OpResult<CpuTensor> {
        let (vocab, h) = (table.rows(), table.cols());
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= vocab) {
            return Err(BackendError::invalid(
                "embed",
                format!("token id {id} outside the table's {vocab} rows"),
            ));
        }
        let mut out = CpuTensor::zeros(ids.len(), h);
        for (row, &id) in out.data.chunks_exact_mut(h).zip(ids) {
            let id = id as usize;
            row.copy_from_slice(&table.data[id * h..(id + 1) * h]);
        }
        Ok(out)
    }

    fn rms_norm(&self, x: &CpuTensor, w: &CpuWeight, eps: f32, offset: f32) -> OpResult<CpuTensor> {
        ensure(x.cols > 0 && w.data.len() == x.cols, "rms_norm", || {
            format!(
                "a weight of {} values for rows {} wide",
                w.data.len(),
                x.cols
            )
        })?;
        let mut y = x.clone();
        ops::rms_norm(&mut y.data, &w.data, x.cols, eps, offset);
        Ok(y)
    }

    fn linear(&self, x: &CpuTensor, w: &CpuWeight) -> OpResult<CpuTensor> {
        ensure(x.cols == w.cols(), "linear", || {
            format!(
                "input width {} does not match the weight's {:?}",
                x.cols, w.shape
            )
        })?;
        Ok(matmul(&x.data, x.rows, w))
    }

    fn rows(&self, x: &CpuTensor, rows: &[usize]) -> OpResult<CpuTensor> {
        if let Some(&r) = rows.iter().find(|&&r| r >= x.rows) {
            return Err(BackendError::invalid(
                "rows",
                format!("row {r} of a tensor of {} rows", x.rows),
            ));
        }
        let mut out = CpuTensor::zeros(rows.len(), x.cols);
        for (dst, &r) in out.data.chunks_exact_mut(x.cols).zip(rows) {
            dst.copy_from_slice(x.row_range(r, 1));
        }
        Ok(out)
    }

    fn set_rows(&self, x: &mut CpuTensor, rows: &[usize], values: &CpuTensor) -> OpResult<()> {
        ensure(
            values.rows == rows.len() && values.cols == x.cols,
            "set_rows",
            || {
                format!(
                    "values [{}, {}] for {} rows {} wide",
                    values.rows,
                    values.cols,
                    rows.len(),
                    x.cols
                )
            },
        )?;
        if let Some(&r) = rows.iter().find(|&&r| r >= x.rows) {
            return Err(BackendError::invalid(
                "set_rows",
                format!("row {r} of a tensor of {} rows", x.rows),
            ));
        }
        let c = x.cols;
        for (src, &r) in values.data.chunks_exact(c.max(1)).zip(rows) {
            x.data[r * c..(r + 1) * c].copy_from_slice(src);
        }
        Ok(())
    }

    fn concat_cols(&self, a: &CpuTensor, b: &CpuTensor) -> OpResult<CpuTensor> {
        ensure(a.rows == b.rows, "concat_cols", || {
            format!("{} rows beside {} rows", a.rows, b.rows)
        })?;
        let cols = a.cols + b.cols;
        let mut out = CpuTensor::zeros(a.rows, cols);
        for (r, dst) in out.data.chunks_exact_mut(cols).enumerate() {
            dst[..a.cols].copy_from_slice(a.row_range(r, 1));
            dst[a.cols..].copy_from_slice(b.row_range(r, 1));
        }
        Ok(out)
    }

    fn add(&self, acc: &mut CpuTensor, y: &CpuTensor) -> OpResult<()> {
        ensure((acc.rows, acc.cols) == (y.rows, y.cols), "add", || {
            format!("[{}, {}] += [{}, {}]", acc.rows, acc.cols, y.rows, y.cols)
        })?;
        acc.data.iter_mut().zip(&y.data).for_each(|(a, b)| *a += b);
        Ok(())
    }

    fn swiglu(&self, gate_up: &CpuTensor) -> OpResult<CpuTensor> {
        ensure(gate_up.cols.is_multiple_of(2), "swiglu", || {
            format!("gate|up rows {} wide (odd)", gate_up.cols)
        })?;
        let i = gate_up.cols / 2;
        let mut out = CpuTensor::zeros(gate_up.rows, i);
        ops::swiglu(&gate_up.data, gate_up.rows, i, &mut out.data);
        Ok(out)
    }

    fn silu(&self, x: &CpuTensor) -> OpResult<CpuTensor> {
        let mut y = x.clone();
        y.data.iter_mut().for_each(|v| *v = ops::silu(*v));
        Ok(y)
    }

    fn attention(&self, c: &AttnCall<'_, CpuTensor, CpuWeight>) -> OpResult<CpuTensor> {
        self.attention_impl(c)
    }

    fn gdn(&self, c: &GdnCall<'_, CpuTensor, CpuWeight>) -> OpResult<CpuTensor> {
        self.gdn_impl(c)
    }

    fn moe_experts(&self, c: &MoeCall<'_, CpuTensor, CpuWeight>) -> OpResult<CpuTensor> {
        self.moe_impl(c)
    }

    /// Runs the step's ops once, as they come.
    fn decode_step(
        &self,
        _step: &DecodeStep<'_>,
        run: &dyn Fn() -> OpResult<Vec<CpuTensor>>,
    ) -> OpResult<Vec<CpuTensor>> {
        run()
    }

    fn to_host(&self, x: CpuTensor) -> OpResult<(usize, usize, Vec<f32>)> {
        Ok((x.rows, x.cols, x.data))
    }

    fn upload(&self, rows: usize, cols: usize, data: Vec<f32>) -> OpResult<CpuTensor> {
        ensure(data.len() == rows * cols, "upload", || {
            format!("{} values for [{rows}, {cols}]", data.len())
        })?;
        Ok(CpuTensor { rows, cols, data })
    }

    fn kv_host_stats(&self) -> OpResult<Option<KvHostStats>> {
        Ok(self.kv_stats.lock().unwrap().clone())
    }

    fn weight_bytes(&self, w: &CpuWeight) -> usize {
        w.data.len() * std::mem::size_of::<f32>()
    }

    fn hc_premix(&self, streams: &CpuTensor, pre: &CpuWeight) -> OpResult<CpuTensor> {
        self.hc_premix_impl(streams, pre)
    }

    fn hc_gated_residual(
        &self,
        streams: &mut CpuTensor,
        u: &CpuTensor,
        y: &CpuTensor,
    ) -> OpResult<()> {
        self.hc_gated_residual_impl(streams, u, y)
    }

    fn qsa_attention(&self, c: &QsaCall<'_, CpuTensor, CpuWeight>) -> OpResult<CpuTensor> {
        self.qsa_impl(c)
    }

    fn ple_mix(
        &self,
        streams: &mut CpuTensor,
        c: &PleCall<'_, CpuTensor, CpuWeight>,
    ) -> OpResult<()> {
        self.ple_mix_impl(streams, c)
    }
}
