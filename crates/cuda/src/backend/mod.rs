//! [`CudaBackend`]: `sanmai_model::Backend` on one CUDA device. Activations are device bf16 tensors
//! ([`CudaTensor`]), weights device bf16 ([`CudaWeight`]), attention K/V bf16 block pools and GDN state
//! in slot pools (conv state bf16, recurrent state f32).
//!
//! Graph-ready: each step's metadata (token ids, output rows, positions, K/V destinations, state
//! slots, context lengths, block tables) reaches the device in one async copy from pinned staging
//! ([`CudaBackend::begin_step`]; without it, each op uploads what it needs the first time it sees it),
//! every kernel reads it from persistent device buffers, and nothing in a forward pass waits for the
//! device except [`Backend::to_host`]. Intermediate tensors come from the stream-ordered allocator.
//!
//! Every op returns an [`OpResult`]: the ops are written over this crate's [`Result`] (`*_impl`) and
//! the trait methods name the op ([`CudaError::at`]): a call that breaks the trait's contract (shapes
//! that do not fit, a state slot not allocated, a K/V pool not initialised) is
//! `BackendError::Invalid`, a device failure (out of memory, a launch or copy error) is
//! `BackendError::Device`. Nothing on a step's path panics.
//!
//! The backend also implements [`sanmai_model::Probe`] (`roofline.rs`): the copy bandwidth, the
//! routed-expert record and the kernel times `sanmai bench` reads.

mod attn;
mod attn_layer;
mod cache;
mod fp8;
mod gdn;
mod gdn_layer;
mod graph;
mod handover;
mod hc;
mod host_rows;
mod linear;
mod memory;
mod meta;
mod moe;
mod moe_decode;
mod moe_layer;
mod moe_tables;
mod norm_after;
mod options;
mod packed;
mod ple;
mod qsa;
mod roofline;
mod sample;
mod tensor;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};

use cudarc::driver::{CudaSlice, DeviceRepr, ValidAsZeroBits};
use half::bf16;
use sanmai_model::backend::{
    AttnCall, AttnMixerCall, AttnShape, AttnWeights, Backend, CacheSpec, DecodeStep, GdnCall,
    GdnMixerCall, GdnShape, GdnWeights, Handover, HcNext, HcWeights, KvHostStats, MoeCall,
    MoeWeights, OpResult, PackedTensor, PleCall, QsaCall, QsaMixerCall, SampleCall, SeqChunk,
    SharedFusion,
};
use sanmai_model::sample::{RowError, Sampled};

use crate::error::{At, CudaError, Result};
use crate::gpu::Gpu;
use crate::ops::NormRows;
pub use fp8::fp8_device_bytes;
pub use graph::{GraphStats, DEFAULT_GRAPH_BATCH_SIZES, MIN_GRAPH_SPAN};
pub use memory::MemoryReport;
pub use options::CudaOptions;
pub use packed::{packed_device_bytes, packed_fits, PACKED_WORKSPACE_BYTES};
pub use tensor::{CudaTensor, CudaWeight, DenseBf16, Fp8Weight, PackedWeight};

/// Default step limits the metadata buffers are first sized for (larger steps grow them).
pub const DEFAULT_MAX_TOKENS: usize = 8192;
pub const DEFAULT_MAX_SEQS: usize = 256;

pub(crate) struct State {
    pub meta: meta::Meta,
    pub kv: cache::KvPools,
    pub states: cache::StateSlots,
    pub experts: HashMap<u64, moe_tables::ExpertTable>,
    /// The fused MoE's pair buffers, by (tokens, top_k, experts) (`moe.rs`).
    pub fused_pairs: HashMap<(usize, usize, usize), moe_tables::FusedPairs>,
    /// The packed and FP8 GEMMs' bf16 workspace, allocated with the first packed or FP8 weight.
    pub packed_ws: Option<CudaSlice<bf16>>,
    /// Device copies of RoPE inverse frequencies, by their host values.
    rope: Vec<(Vec<f32>, CudaSlice<f32>)>,
    /// Context positions decode attention sizes its split grid for, while a decode step that may be
    /// recorded runs (see `graph`); `None`: the step's longest context.
    pub decode_span: Option<usize>,
    max_tokens: usize,
    max_seqs: usize,
}

impl State {
    /// The index in `rope` of the device copy of `inv_freq`, uploaded on first use.
    pub fn rope_table(&mut self, gpu: &Gpu, inv_freq: &[f32]) -> Result<usize> {
        if let Some(i) = self.rope.iter().position(|(h, _)| h == inv_freq) {
            return Ok(i);
        }
        let t = gpu.upload(if inv_freq.is_empty() {
            &[0.0]
        } else {
            inv_freq
        })?;
        self.rope.push((inv_freq.to_vec(), t));
        Ok(self.rope.len() - 1)
    }
}

/// The CUDA backend: one device, one stream.
pub struct CudaBackend {
    pub(crate) gpu: Gpu,
    state: Mutex<State>,
    weight_bytes: AtomicUsize,
    routing: roofline::RoutingLog,
    routing_on: AtomicBool,
    graphs: Mutex<graph::Graphs>,
    /// Bumped when a buffer a recorded graph may point at is replaced (weights, caches, state pools).
    epoch: AtomicU64,
    /// The PLE rows of the coming decode step (`ple.rs`).
    ple_in: Mutex<Option<ple::StagedRows>>,
    /// The last-block counters of the launches whose last block to finish does their final part (the
    /// one-launch decode routing, `moe_tables.rs`; a GEMV's add and norm, `packed.rs`; the one-launch
    /// MoE layer, which also counts its grid barriers in the second, `moe_layer.rs`): 0 between
    /// launches, which the stream orders one after another.
    ticket: Mutex<CudaSlice<u32>>,
    /// Which decode launches the steps take ([`CudaOptions`]' switches).
    switches: options::Switches,
    /// Held while a CUDA graph captures this backend's stream, and by the cache operations another
    /// thread may call (a pipeline's engine thread): work queued on a capturing stream, from any
    /// thread, would join the graph instead of running.
    capture: Mutex<()>,
    /// A pipeline stage's input streams for recorded decode steps (`graph.rs`).
    kept: Mutex<graph::KeptStreams>,
}

/// The rows of `x` as a norm kernel takes them.
fn norm_rows(x: &CudaTensor, eps: f32) -> NormRows {
    NormRows {
        rows: x.rows,
        d: x.cols,
        eps,
    }
}

/// Whether every chunk is one token and chunk `i` is row `i` (the batched decode launches).
pub(crate) fn all_decode(seqs: &[SeqChunk<'_>]) -> bool {
    !seqs.is_empty()
        && seqs
            .iter()
            .enumerate()
            .all(|(i, s)| s.len == 1 && s.start == i)
}

impl CudaBackend {
    /// Opens CUDA device `ordinal` (compiling or loading every kernel) with the default step limits.
    /// `sanmai --device cuda:N` builds its backend with `CudaBackend::new(N, &options)`.
    pub fn new(ordinal: usize, options: &CudaOptions) -> Result<Self> {
        Self::with_limits(ordinal, DEFAULT_MAX_TOKENS, DEFAULT_MAX_SEQS, options)
    }

    /// As [`CudaBackend::new`], with the step metadata buffers sized for `max_tokens` rows and
    /// `max_seqs` sequences.
    pub fn with_limits(
        ordinal: usize,
        max_tokens: usize,
        max_seqs: usize,
        options: &CudaOptions,
    ) -> Result<Self> {
        let backend = Self::from_gpu(Gpu::new(ordinal, &options.gpu)?, max_tokens, max_seqs)?;
        if !options.cuda_graphs {
            backend.set_graph_batch_sizes(&[]);
        }
        backend.set_switches(options);
        Ok(backend)
    }

    /// A backend on an opened [`Gpu`], recording decode steps of [`DEFAULT_GRAPH_BATCH_SIZES`]
    /// ([`CudaBackend::set_graph_batch_sizes`] changes them).
    pub fn from_gpu(gpu: Gpu, max_tokens: usize, max_seqs: usize) -> Result<Self> {
        let meta = meta::Meta::new(&gpu, max_tokens, max_seqs, 64)?;
        let ticket = Mutex::new(gpu.zeros::<u32>(2)?);
        Ok(Self {
            gpu,
            state: Mutex::new(State {
                meta,
                kv: cache::KvPools::default(),
                states: cache::StateSlots::default(),
                experts: HashMap::new(),
                fused_pairs: HashMap::new(),
                packed_ws: None,
                rope: Vec::new(),
                decode_span: None,
                max_tokens,
                max_seqs,
            }),
            weight_bytes: AtomicUsize::new(0),
            routing: roofline::RoutingLog::default(),
            routing_on: AtomicBool::new(false),
            graphs: Mutex::new(graph::Graphs::new(&DEFAULT_GRAPH_BATCH_SIZES)),
            capture: Mutex::new(()),
            kept: Mutex::new(graph::KeptStreams::default()),
            epoch: AtomicU64::new(0),
            ple_in: Mutex::new(None),
            ticket,
            switches: options::Switches::default(),
        })
    }

    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// Uploads a step's metadata (the ids `forward` gets, its chunks and output rows) in one copy; the
    /// ops of the step then find it on the device. Optional: ops upload what is missing themselves.
    pub fn begin_step(&self, ids: &[u32], seqs: &[SeqChunk<'_>], out_rows: &[usize]) -> Result<()> {
        let mut st = self.lock();
        let bs = st.kv.block_size;
        st.meta.stage(&self.gpu, ids, seqs, out_rows, bs, 0)
    }

    /// The step limits the metadata buffers were sized for.
    pub fn limits(&self) -> (usize, usize) {
        let st = self.lock();
        (st.max_tokens, st.max_seqs)
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// No graph captures this backend's stream while the guard lives (taken before [`Self::lock`]).
    pub(crate) fn no_capture(&self) -> MutexGuard<'_, ()> {
        self.capture.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// An uninitialised `[rows, cols]` tensor (every element is written by the op that asks for it).
    pub(crate) fn alloc(&self, rows: usize, cols: usize) -> Result<CudaTensor> {
        // SAFETY: callers write every element before it is read.
        let buf = unsafe { self.gpu.stream().alloc::<bf16>((rows * cols).max(1)) }?;
        Ok(CudaTensor { rows, cols, buf })
    }

    pub(crate) fn zeros(&self, rows: usize, cols: usize) -> Result<CudaTensor> {
        let buf = self.gpu.zeros::<bf16>((rows * cols).max(1))?;
        Ok(CudaTensor { rows, cols, buf })
    }

    /// An uninitialised scratch buffer of `n` values (written by the next op).
    pub(crate) fn scratch<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        n: usize,
    ) -> Result<CudaSlice<T>> {
        // SAFETY: callers write every element before it is read.
        Ok(unsafe { self.gpu.stream().alloc::<T>(n.max(1)) }?)
    }

    fn weight_impl(&self, data: Vec<f32>, shape: &[usize]) -> Result<CudaWeight> {
        if data.len() != shape.iter().product::<usize>() {
            return Err(CudaError::Shape {
                op: "weight",
                msg: format!("{} values for shape {shape:?}", data.len()),
            });
        }
        let dev = self.upload_bf16(&data)?;
        let f32 = if shape.len() == 1 && !data.is_empty() {
            Some(self.gpu.upload(&data)?)
        } else {
            None
        };
        let w = CudaWeight::Bf16(DenseBf16 {
            shape: shape.to_vec(),
            data: dev,
            f32,
        });
        self.weight_bytes.fetch_add(w.bytes(), Ordering::Relaxed);
        self.epoch.fetch_add(1, Ordering::Relaxed);
        Ok(w)
    }

    fn embed_impl(&self, table: &CudaWeight, ids: &[u32]) -> Result<CudaTensor> {
        let (vocab, hidden) = (table.rows(), table.cols());
        let mut out = self.alloc(ids.len(), hidden)?;
        let mut st = self.lock();
        let at = st.meta.ids(&self.gpu, ids)?;
        let view = st.meta.view(at, ids.len());
        match table {
            CudaWeight::Packed(p) => self.embed_packed(p, &view, &mut out.buf, ids.len())?,
            CudaWeight::Fp8(w) => {
                return Err(CudaError::Shape {
                    op: "embed",
                    msg: format!("an FP8 {:?} embedding table (tables stay bf16)", w.shape),
                })
            }
            CudaWeight::Bf16(d) => {
                self.gpu
                    .embed(&d.data, &view, &mut out.buf, vocab, hidden, ids.len())?
            }
        }
        Ok(out)
    }

    fn rows_impl(&self, x: &CudaTensor, rows: &[usize]) -> Result<CudaTensor> {
        let mut out = self.alloc(rows.len(), x.cols)?;
        if let Some(&bad) = rows.iter().find(|&&r| r >= x.rows) {
            return Err(CudaError::Shape {
                op: "rows",
                msg: format!("row {bad} of a {}-row tensor", x.rows),
            });
        }
        let contiguous = rows.windows(2).all(|w| w[1] == w[0] + 1);
        if rows.is_empty() {
            return Ok(out);
        }
        if contiguous {
            let c = x.cols;
            let src = x.buf.slice(rows[0] * c..(rows[0] + rows.len()) * c);
            self.gpu
                .stream()
                .memcpy_dtod(&src, &mut out.buf.slice_mut(..rows.len() * c))?;
        } else {
            let mut st = self.lock();
            let at = st.meta.out_rows(&self.gpu, rows)?;
            let view = st.meta.view(at, rows.len());
            self.gpu
                .gather_rows(&x.buf, &view, &mut out.buf, x.rows, rows.len(), x.cols)?;
        }
        Ok(out)
    }

    fn rms_norm_impl(
        &self,
        x: &CudaTensor,
        w: &CudaWeight,
        eps: f32,
        offset: f32,
    ) -> Result<CudaTensor> {
        let mut y = self.alloc(x.rows, x.cols)?;
        self.gpu
            .rms_norm(&x.buf, w.bf16()?, &mut y.buf, norm_rows(x, eps), offset)?;
        Ok(y)
    }

    /// Row `rows[i]` of `x` becomes row `i` of `values`: one device copy per run of consecutive
    /// rows (an image's placeholder rows are one run).
    fn set_rows_impl(&self, x: &mut CudaTensor, rows: &[usize], values: &CudaTensor) -> Result<()> {
        let bad = |msg: String| CudaError::Shape {
            op: "set_rows",
            msg,
        };
        if values.rows != rows.len() || values.cols != x.cols {
            return Err(bad(format!(
                "values [{}, {}] for {} rows {} wide",
                values.rows,
                values.cols,
                rows.len(),
                x.cols
            )));
        }
        if let Some(&r) = rows.iter().find(|&&r| r >= x.rows) {
            return Err(bad(format!("row {r} of a {}-row tensor", x.rows)));
        }
        let c = x.cols;
        let mut i = 0;
        while i < rows.len() {
            let mut n = 1;
            while i + n < rows.len() && rows[i + n] == rows[i] + n {
                n += 1;
            }
            let src = values.buf.slice(i * c..(i + n) * c);
            let mut dst = x.buf.slice_mut(rows[i] * c..(rows[i] + n) * c);
            self.gpu.stream().memcpy_dtod(&src, &mut dst)?;
            i += n;
        }
        Ok(())
    }

    fn concat_cols_impl(&self, a: &CudaTensor, b: &CudaTensor) -> Result<CudaTensor> {
        if a.rows != b.rows {
            return Err(CudaError::Shape {
                op: "concat_cols",
                msg: format!("{} rows against {}", a.rows, b.rows),
            });
        }
        let mut y = self.alloc(a.rows, a.cols + b.cols)?;
        self.gpu
            .concat_cols(&a.buf, &b.buf, &mut y.buf, a.rows, a.cols, b.cols)?;
        Ok(y)
    }

    fn add_impl(&self, acc: &mut CudaTensor, y: &CudaTensor) -> Result<()> {
        let n = acc.len();
        if y.len() != n {
            return Err(CudaError::Shape {
                op: "add",
                msg: format!("{n} values plus {}", y.len()),
            });
        }
        self.gpu.add_bf16(&mut acc.buf, &y.buf, n)
    }

    fn add_rms_norm_impl(
        &self,
        acc: &mut CudaTensor,
        y: &CudaTensor,
        w: &CudaWeight,
        eps: f32,
        offset: f32,
    ) -> Result<CudaTensor> {
        if y.rows != acc.rows || y.cols != acc.cols {
            return Err(CudaError::Shape {
                op: "add_rms_norm",
                msg: format!("[{}, {}] plus [{}, {}]", acc.rows, acc.cols, y.rows, y.cols),
            });
        }
        let (r, c) = (acc.rows, acc.cols);
        let mut out = self.alloc(r, c)?;
        let shape = norm_rows(acc, eps);
        self.gpu
            .add_rms_norm(&mut acc.buf, &y.buf, w.bf16()?, &mut out.buf, shape, offset)?;
        Ok(out)
    }

    fn swiglu_impl(&self, gate_up: &CudaTensor) -> Result<CudaTensor> {
        if !gate_up.cols.is_multiple_of(2) {
            return Err(CudaError::Shape {
                op: "swiglu",
                msg: format!("{} columns are not gate|up halves", gate_up.cols),
            });
        }
        let i = gate_up.cols / 2;
        let mut y = self.alloc(gate_up.rows, i)?;
        self.gpu.swiglu(&gate_up.buf, &mut y.buf, gate_up.rows, i)?;
        Ok(y)
    }

    fn silu_impl(&self, x: &CudaTensor) -> Result<CudaTensor> {
        let mut y = self.alloc(x.rows, x.cols)?;
        self.gpu.silu(&x.buf, &mut y.buf, x.len())?;
        Ok(y)
    }

    /// Host values rounded to bf16 in a new device buffer (one zero for no values: a buffer is never
    /// empty).
    fn upload_bf16(&self, data: &[f32]) -> Result<CudaSlice<bf16>> {
        if data.is_empty() {
            return self.gpu.zeros(1);
        }
        let b: Vec<bf16> = data.iter().map(|&x| bf16::from_f32(x)).collect();
        self.gpu.upload(&b)
    }

    /// A `[rows, cols]` tensor from host values (rounded to bf16).
    pub fn tensor_from_host(&self, rows: usize, cols: usize, data: &[f32]) -> Result<CudaTensor> {
        if data.len() != rows * cols {
            return Err(CudaError::Shape {
                op: "from_host",
                msg: format!("{} values for [{rows}, {cols}]", data.len()),
            });
        }
        let buf = self.upload_bf16(data)?;
        Ok(CudaTensor { rows, cols, buf })
    }

    fn to_host_impl(&self, x: &CudaTensor) -> Result<Vec<f32>> {
        let n = x.len();
        let v = self.gpu.download(&x.buf)?;
        Ok(v[..n].iter().map(|b| b.to_f32()).collect())
    }
}

impl Backend for CudaBackend {
    type Tensor = CudaTensor;
    type Weight = CudaWeight;
    /// K/V values are bf16. GDN state is not counted at this width: conv state is bf16 but the
    /// recurrent state is f32 (see [`CudaBackend::state_bytes_per_slot`]).
    const CACHE_ELEM_BYTES: usize = 2;

    fn weight(&self, data: Vec<f32>, shape: &[usize]) -> OpResult<CudaWeight> {
        self.weight_impl(data, shape).at("weight")
    }

    fn packed_weight(&self, p: &PackedTensor<'_>) -> OpResult<CudaWeight> {
        self.packed_weight_impl(p).at("packed_weight")
    }

    fn init_cache(&self, spec: &CacheSpec) -> OpResult<()> {
        let _no_capture = self.no_capture();
        let mut st = self.lock();
        let st = &mut *st;
        // Whatever happened, the pools may have been replaced: recordings pointing at them go.
        self.epoch.fetch_add(1, Ordering::Relaxed);
        st.kv.init(&self.gpu, spec).at("init_cache")?;
        st.states.init(&self.gpu, spec).at("init_cache")
    }

    fn alloc_state(&self) -> OpResult<usize> {
        let _no_capture = self.no_capture();
        let mut st = self.lock();
        let before = st.states.bytes();
        let slot = st.states.alloc(&self.gpu);
        if st.states.bytes() != before {
            // The pools grew (moved).
            self.epoch.fetch_add(1, Ordering::Relaxed);
        }
        slot.at("alloc_state")
    }

    fn reserve_states(&self, slots: usize) -> OpResult<()> {
        let mut st = self.lock();
        // The pools are replaced: recordings pointing at them go.
        self.epoch.fetch_add(1, Ordering::Relaxed);
        st.states.reserve(&self.gpu, slots).at("reserve_states")
    }

    fn free_state(&self, slot: usize) {
        self.lock().states.free(slot);
    }

    fn copy_state(&self, src: usize, dst: usize) -> OpResult<()> {
        let _no_capture = self.no_capture();
        self.lock()
            .states
            .copy(&self.gpu, src, dst)
            .at("copy_state")
    }

    fn copy_block(&self, src: u32, dst: u32) -> OpResult<()> {
        let _no_capture = self.no_capture();
        self.lock()
            .kv
            .copy_block(&self.gpu, src, dst)
            .at("copy_block")
    }

    fn embed(&self, table: &CudaWeight, ids: &[u32]) -> OpResult<CudaTensor> {
        self.embed_impl(table, ids).at("embed")
    }

    fn rms_norm(
        &self,
        x: &CudaTensor,
        w: &CudaWeight,
        eps: f32,
        offset: f32,
    ) -> OpResult<CudaTensor> {
        self.rms_norm_impl(x, w, eps, offset).at("rms_norm")
    }

    fn linear(&self, x: &CudaTensor, w: &CudaWeight) -> OpResult<CudaTensor> {
        self.linear_impl(x, w).at("linear")
    }

    fn linear_many(&self, x: &CudaTensor, ws: &[&CudaWeight]) -> OpResult<Vec<CudaTensor>> {
        self.linear_many_impl(x, ws).at("linear_many")
    }

    fn rows(&self, x: &CudaTensor, rows: &[usize]) -> OpResult<CudaTensor> {
        self.rows_impl(x, rows).at("rows")
    }

    fn set_rows(&self, x: &mut CudaTensor, rows: &[usize], values: &CudaTensor) -> OpResult<()> {
        self.set_rows_impl(x, rows, values).at("set_rows")
    }

    fn concat_cols(&self, a: &CudaTensor, b: &CudaTensor) -> OpResult<CudaTensor> {
        self.concat_cols_impl(a, b).at("concat_cols")
    }

    fn add(&self, acc: &mut CudaTensor, y: &CudaTensor) -> OpResult<()> {
        self.add_impl(acc, y).at("add")
    }

    fn add_rms_norm(
        &self,
        acc: &mut CudaTensor,
        y: &CudaTensor,
        w: &CudaWeight,
        eps: f32,
        offset: f32,
    ) -> OpResult<CudaTensor> {
        self.add_rms_norm_impl(acc, y, w, eps, offset)
            .at("add_rms_norm")
    }

    fn swiglu(&self, gate_up: &CudaTensor) -> OpResult<CudaTensor> {
        self.swiglu_impl(gate_up).at("swiglu")
    }

    fn linear_add_rms_norm(
        &self,
        x: &CudaTensor,
        w: &CudaWeight,
        acc: &mut CudaTensor,
        norm: &CudaWeight,
        eps: f32,
        offset: f32,
    ) -> OpResult<CudaTensor> {
        self.linear_add_rms_norm_impl(x, w, acc, norm, eps, offset)
            .at("linear_add_rms_norm")
    }

    fn swiglu_linear(&self, gate_up: &CudaTensor, w: &CudaWeight) -> OpResult<CudaTensor> {
        self.swiglu_linear_impl(gate_up, w).at("swiglu_linear")
    }

    fn silu(&self, x: &CudaTensor) -> OpResult<CudaTensor> {
        self.silu_impl(x).at("silu")
    }

    fn attention(&self, c: &AttnCall<'_, CudaTensor, CudaWeight>) -> OpResult<CudaTensor> {
        self.attention_impl(c).at("attention")
    }

    fn gdn(&self, c: &GdnCall<'_, CudaTensor, CudaWeight>) -> OpResult<CudaTensor> {
        self.gdn_impl(c).at("gdn")
    }

    fn moe_experts(&self, c: &MoeCall<'_, CudaTensor, CudaWeight>) -> OpResult<CudaTensor> {
        self.moe_impl(c, None).at("moe_experts")
    }

    fn moe_experts_add_rms_norm(
        &self,
        c: &MoeCall<'_, CudaTensor, CudaWeight>,
        acc: &mut CudaTensor,
        w: &CudaWeight,
        eps: f32,
        offset: f32,
    ) -> OpResult<CudaTensor> {
        self.moe_add_rms_norm_impl(c, acc, w, eps, offset)
            .at("moe_experts_add_rms_norm")
    }

    fn gdn_projects_gates(&self, w: &GdnWeights<CudaWeight>, sh: &GdnShape, rows: usize) -> bool {
        self.gdn_projects_gates_impl(w, sh, rows)
    }

    fn gdn_mixer_whole(&self, w: &GdnWeights<CudaWeight>, sh: &GdnShape, rows: usize) -> bool {
        self.gdn_layer_takes(w, sh, rows)
    }

    fn gdn_mixer(&self, c: &GdnMixerCall<'_, CudaTensor, CudaWeight>) -> OpResult<CudaTensor> {
        self.gdn_mixer_impl(c)
    }

    fn gdn_mixer_add_rms_norm(
        &self,
        c: &GdnMixerCall<'_, CudaTensor, CudaWeight>,
        acc: &mut CudaTensor,
        norm: &CudaWeight,
        eps: f32,
        offset: f32,
    ) -> OpResult<CudaTensor> {
        self.gdn_mixer_add_rms_norm_impl(c, acc, norm, eps, offset)
    }

    fn attn_mixer_whole(&self, w: &AttnWeights<CudaWeight>, sh: &AttnShape, rows: usize) -> bool {
        self.attn_layer_takes(w, sh, rows)
    }

    fn attn_mixer_add_rms_norm(
        &self,
        c: &AttnMixerCall<'_, CudaTensor, CudaWeight>,
        acc: &mut CudaTensor,
        norm: &CudaWeight,
        eps: f32,
        offset: f32,
    ) -> OpResult<CudaTensor> {
        self.attn_mixer_add_rms_norm_impl(c, acc, norm, eps, offset)
    }

    fn moe_fuses_shared(&self, w: &MoeWeights<CudaWeight>, rows: usize) -> SharedFusion {
        self.moe_fuses_shared_impl(w, rows)
    }

    fn decode_step(
        &self,
        step: &DecodeStep<'_>,
        run: &dyn Fn() -> OpResult<Vec<CudaTensor>>,
    ) -> OpResult<Vec<CudaTensor>> {
        self.decode_step_impl(step, run)
    }

    fn ple_step_rows(&self, rows: &CudaTensor) -> OpResult<()> {
        self.ple_step_rows_impl(rows).at("ple_step_rows")
    }

    fn keep_streams(&self, x: CudaTensor) -> OpResult<Option<CudaTensor>> {
        self.keep_streams_impl(x).at("keep_streams")?;
        Ok(None)
    }

    fn kept_streams(&self) -> OpResult<CudaTensor> {
        self.kept_streams_impl().at("kept_streams")
    }

    fn prepare_step(&self, ids: &[u32], seqs: &[SeqChunk<'_>], out_rows: &[usize]) -> OpResult<()> {
        self.begin_step(ids, seqs, out_rows).at("prepare_step")
    }

    fn hand_over(&self, x: CudaTensor) -> OpResult<Handover<CudaTensor>> {
        self.hand_over_impl(x).at("hand_over")
    }

    fn link_to(&self, next: &Self) -> OpResult<Option<sanmai_model::StageLink<CudaTensor>>> {
        self.link_to_impl(next).at("link_to")
    }

    fn take_over(&self, h: Handover<CudaTensor>) -> OpResult<CudaTensor> {
        self.take_over_impl(h).at("take_over")
    }

    fn to_host(&self, x: CudaTensor) -> OpResult<(usize, usize, Vec<f32>)> {
        let v = self.to_host_impl(&x).at("to_host")?;
        Ok((x.rows, x.cols, v))
    }

    fn upload(&self, rows: usize, cols: usize, data: Vec<f32>) -> OpResult<CudaTensor> {
        self.tensor_from_host(rows, cols, &data).at("upload")
    }

    fn sample(
        &self,
        logits: CudaTensor,
        c: &SampleCall<'_>,
    ) -> OpResult<Vec<std::result::Result<Sampled, RowError>>> {
        self.sample_impl(&logits, c.valid_vocab, c.rows)
            .at("sample")
    }

    fn device_sampling(&self) -> bool {
        true
    }

    fn kv_host_stats(&self) -> OpResult<Option<KvHostStats>> {
        let mut st = self.lock();
        match st.kv.arena.as_mut() {
            Some(a) => a.stats(&self.gpu).map(Some).at("kv_host_stats"),
            None => Ok(None),
        }
    }

    fn weight_bytes(&self, w: &CudaWeight) -> usize {
        w.bytes()
    }

    fn hc_premix(&self, streams: &CudaTensor, pre: &CudaWeight) -> OpResult<CudaTensor> {
        self.hc_premix_impl(streams, pre).at("hc_premix")
    }

    fn hc_gated_residual(
        &self,
        streams: &mut CudaTensor,
        u: &CudaTensor,
        y: &CudaTensor,
    ) -> OpResult<()> {
        self.hc_gated_residual_impl(streams, u, y)
            .at("hc_gated_residual")
    }

    fn hc_residual(
        &self,
        streams: &mut CudaTensor,
        x: &CudaTensor,
        y: &CudaTensor,
        w: &HcWeights<CudaWeight>,
    ) -> OpResult<()> {
        self.hc_residual_impl(streams, (x, y), w)
    }

    fn hc_residual_premix_norm(
        &self,
        streams: &mut CudaTensor,
        (x, y): (&CudaTensor, &CudaTensor),
        w: &HcWeights<CudaWeight>,
        next: HcNext<'_, CudaWeight>,
    ) -> OpResult<(CudaTensor, CudaTensor)> {
        self.hc_residual_premix_norm_impl(streams, (x, y), w, next)
    }

    fn qsa_attention(&self, c: &QsaCall<'_, CudaTensor, CudaWeight>) -> OpResult<CudaTensor> {
        qsa::refuse_mrope("qsa_attention", &c.attn)?;
        self.qsa_impl(c).at("qsa_attention")
    }

    fn qsa_mixer_within_topk(
        &self,
        c: &QsaMixerCall<'_, CudaTensor, CudaWeight>,
    ) -> OpResult<Option<CudaTensor>> {
        self.qsa_mixer_within_topk_impl(c).at("qsa_mixer")
    }

    fn ple_mix(
        &self,
        streams: &mut CudaTensor,
        c: &PleCall<'_, CudaTensor, CudaWeight>,
    ) -> OpResult<()> {
        self.ple_impl(streams, c).at("ple_mix")
    }
}
