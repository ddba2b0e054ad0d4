//! CUDA graphs for decode steps ([`Backend::decode_step`](sanmai_model::Backend::decode_step)).
//!
//! A decode step of a batch size in the configured set ([`DEFAULT_GRAPH_BATCH_SIZES`], changed with
//! [`CudaBackend::set_graph_batch_sizes`]) stages its metadata first ([`CudaBackend::begin_step`]
//! with the block tables padded to the step's *span*), so every launch of the step reads its
//! positions, K/V destinations, state slots, context lengths and block tables from the same device
//! addresses. The span is the context the attention split grid covers: the next power of two of
//! the step's longest context (at least [`MIN_GRAPH_SPAN`]); decode attention launches about 64
//! splits of at most span/64 positions (32 to 256), each sequence divides its own length (read on
//! the device) over them and the splits beyond it exit at once, so one recording serves every
//! context length up to its span.
//!
//! Per (region, batch size, output rows, span): the first step runs eagerly (a warm-up: lazy
//! uploads such as RoPE tables and expert address tables happen there, never under capture); the
//! second is captured (thread-local stream capture; intermediate tensors from the stream-ordered
//! allocator become graph memory nodes, allocated and freed inside the graph), its outputs copied at
//! the end of the graph into persistent per-graph buffers, then launched; later steps launch the
//! graph and hand back fresh copies of those buffers. When a capture fails (an op that is not
//! capturable, or an error of the step under capture: the capture is ended and dropped), the step
//! runs eagerly: if that succeeds, the capture was at fault, which logs one warning and leaves the
//! key eager; if it fails, its error is the step's error and the key stays warm. An error of an
//! eager or warm-up step is the step's error.
//!
//! A step whose contexts are all within the QSA layers' topk may run those layers in one launch each
//! (dense attention: every position selected), so whether they are is part of the key.
//!
//! QSA layers otherwise record their batched decode form (indexer scan over the span, exact top-k,
//! attention over the selected rows; each sequence's context and whether it selects at all read on
//! the device), and PLE layers read the step's rows from the persistent buffer that
//! [`Backend::ple_step_rows`](sanmai_model::Backend::ple_step_rows) fills before the step.
//!
//! With kernel timing on ([`CudaBackend::time_kernels`], `sanmai bench --kernel-times`) a capture puts a
//! timed event after each kernel ([`crate::timer`]) and [`CudaBackend::kernel_times`] reads the last
//! timed replay's intervals.
//!
//! Recordings hold device addresses: uploading a weight, re-initialising the caches, growing the
//! state slot pools, the metadata buffer or the PLE rows buffer drops every recording (the next step
//! warms up again). While routed experts or QSA selections are recorded (a host round trip per MoE
//! or QSA call) steps run eagerly.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use cudarc::driver::{sys, CudaGraph};
use sanmai_model::{DecodeStep, OpResult, SeqChunk};

use super::{all_decode, CudaBackend, CudaTensor};
use crate::error::{At, Result};
use crate::timer::{intervals, Armed, Mark, TraceArena, TRACE_SLOTS, TRACE_WORDS};

/// The batch sizes recorded by default.
pub const DEFAULT_GRAPH_BATCH_SIZES: [usize; 4] = [1, 2, 4, 8];
/// The smallest attention span of a recording (context positions).
pub const MIN_GRAPH_SPAN: usize = 4096;

/// What a recording is keyed by.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Key {
    region: u32,
    batch: usize,
    out_rows: usize,
    span: usize,
    /// Every context within the QSA layers' topk (their one-launch dense form recorded).
    qsa_within_topk: bool,
}

/// A recorded step: the graph and the persistent buffers its last nodes copy the outputs into, and
/// with kernel timing on, the timed events after its kernels and the layer kernels given trace
/// slots 0, 1, ...
struct Recorded {
    graph: CudaGraph,
    outs: Vec<CudaTensor>,
    marks: Vec<Mark>,
    traces: Vec<Arc<str>>,
}

// SAFETY: a CudaGraph holds raw driver handles that must not be used from two threads at once;
// every use goes through the `Graphs` mutex.
unsafe impl Send for Recorded {}

enum Entry {
    /// Ran eagerly once (the warm-up) with these output shapes: captured at the next step.
    Warm(Vec<(usize, usize)>),
    Ready(Recorded),
    /// The capture failed: eager from now on.
    Failed,
}

/// How decode steps ran so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GraphStats {
    /// Steps run eagerly without a recording in view (size not recorded, graphs off, failed keys).
    pub eager: u64,
    /// Eager first steps of a key.
    pub warmups: u64,
    /// Graphs captured.
    pub captures: u64,
    /// Steps run by launching a graph (captures included).
    pub replays: u64,
    /// Captures that failed.
    pub failures: u64,
}

pub(crate) struct Graphs {
    sizes: Vec<usize>,
    entries: HashMap<Key, Entry>,
    /// The (backend epoch, metadata buffer generation) the entries were recorded against.
    epoch: (u64, u64),
    stats: GraphStats,
    /// Why the last failed capture failed.
    failure: Option<String>,
    /// The last recording replayed with timed kernels.
    timed: Option<Key>,
}

impl Graphs {
    /// Recordings of decode steps of these batch sizes (empty: every step eager).
    pub fn new(sizes: &[usize]) -> Self {
        Self {
            sizes: sizes.to_vec(),
            entries: HashMap::new(),
            epoch: (0, 0),
            stats: GraphStats::default(),
            failure: None,
            timed: None,
        }
    }
}

/// Resets the attention span of the backend's state when dropped (also when the step fails).
struct SpanGuard<'a>(&'a CudaBackend);

impl<'a> SpanGuard<'a> {
    fn set(b: &'a CudaBackend, span: usize) -> Self {
        b.lock().decode_span = Some(span);
        SpanGuard(b)
    }
}

impl Drop for SpanGuard<'_> {
    fn drop(&mut self) {
        self.0.lock().decode_span = None;
    }
}

/// Copies the values of `src` into `dst` (same shape) on the stream.
fn copy(b: &CudaBackend, src: &CudaTensor, dst: &mut CudaTensor) -> Result<()> {
    let n = src.len();
    if n > 0 {
        b.gpu
            .stream()
            .memcpy_dtod(&src.buf.slice(..n), &mut dst.buf.slice_mut(..n))?;
    }
    Ok(())
}

/// The input streams of a pipeline stage's decode steps, one buffer per shape that stays in place
/// (a recorded step reads its shape's buffer at every replay), and the shape kept last.
#[derive(Default)]
pub(crate) struct KeptStreams {
    bufs: HashMap<(usize, usize), CudaTensor>,
    last: Option<(usize, usize)>,
}

impl CudaBackend {
    /// Copies `x` into its shape's buffer (the first tensor of a shape becomes its buffer).
    pub(crate) fn keep_streams_impl(&self, x: CudaTensor) -> Result<()> {
        let mut k = self.kept.lock().unwrap_or_else(|p| p.into_inner());
        let key = (x.rows, x.cols);
        match k.bufs.get_mut(&key) {
            Some(buf) => copy(self, &x, buf)?,
            None => {
                k.bufs.insert(key, x);
            }
        }
        k.last = Some(key);
        Ok(())
    }

    /// A copy of the buffer kept last (a recording captures the copy from the buffer's address).
    pub(crate) fn kept_streams_impl(&self) -> Result<CudaTensor> {
        let k = self.kept.lock().unwrap_or_else(|p| p.into_inner());
        let buf = k.last.and_then(|key| k.bufs.get(&key)).ok_or_else(|| {
            crate::error::CudaError::Shape {
                op: "kept_streams",
                msg: "no streams were kept".into(),
            }
        })?;
        let mut t = self.alloc(buf.rows, buf.cols)?;
        copy(self, buf, &mut t)?;
        Ok(t)
    }
}

fn shapes(ts: &[CudaTensor]) -> Vec<(usize, usize)> {
    ts.iter().map(|t| (t.rows, t.cols)).collect()
}

impl Drop for CudaBackend {
    /// Says how decode steps ran (a bench or a server's shutdown shows whether graphs were used).
    fn drop(&mut self) {
        let g = self.graphs();
        let s = g.stats;
        if s.eager + s.warmups + s.replays > 0 {
            tracing::info!(
                "CUDA decode steps: {} graph launches ({} captures), {} warm-ups, {} eager, {} failed \
                 captures{}",
                s.replays,
                s.captures,
                s.warmups,
                s.eager,
                s.failures,
                g.failure
                    .as_deref()
                    .map(|w| format!(" (last: {w})"))
                    .unwrap_or_default()
            );
        }
    }
}

impl CudaBackend {
    /// Records decode steps of these batch sizes as CUDA graphs (empty: every step eager). Drops
    /// the recordings made so far.
    pub fn set_graph_batch_sizes(&self, sizes: &[usize]) {
        let mut g = self.graphs();
        g.sizes = sizes.to_vec();
        g.entries.clear();
    }

    /// The batch sizes recorded as CUDA graphs.
    pub fn graph_batch_sizes(&self) -> Vec<usize> {
        self.graphs().sizes.clone()
    }

    /// How decode steps ran so far.
    pub fn graph_stats(&self) -> GraphStats {
        self.graphs().stats
    }

    /// Why the last failed capture failed (`None`: none failed).
    pub fn graph_failure(&self) -> Option<String> {
        self.graphs().failure.clone()
    }

    /// Turns kernel timing of the decode steps recorded from now on on or off; drops the
    /// recordings made so far (the next steps warm up and capture again).
    pub fn time_kernels(&self, on: bool) -> Result<()> {
        let arena = if on {
            let mut buf = self.gpu.zeros::<u64>(TRACE_SLOTS * TRACE_WORDS)?;
            let base = self.gpu.addr_mut(&mut buf);
            Some(TraceArena::new(buf, base))
        } else {
            None
        };
        self.gpu.timer().set_traces(arena);
        self.gpu.timer().set(on);
        let mut g = self.graphs();
        g.entries.clear();
        g.timed = None;
        Ok(())
    }

    /// Each persistent layer launch of the last decode step replayed from a timed recording, in
    /// launch order: its kernel and its trace slot's words (block 0's phase marks, the device's
    /// global timer in ns; kernels/layer.cuh); empty when none was replayed.
    pub fn layer_traces(&self) -> Result<Vec<(String, [u64; TRACE_WORDS])>> {
        let g = self.graphs();
        let Some(Entry::Ready(rec)) = g.timed.and_then(|k| g.entries.get(&k)) else {
            return Ok(Vec::new());
        };
        let words = self
            .gpu
            .timer()
            .read_traces(self.gpu.stream(), rec.traces.len())?;
        Ok(rec
            .traces
            .iter()
            .map(|k| k.to_string())
            .zip(words)
            .collect())
    }

    /// Each kernel of the last decode step replayed from a timed recording, in launch order, with
    /// its microseconds ([`crate::timer::intervals`]); empty when none was replayed.
    pub fn kernel_times(&self) -> Result<Vec<(String, f64)>> {
        let g = self.graphs();
        match g.timed.and_then(|k| g.entries.get(&k)) {
            Some(Entry::Ready(rec)) => intervals(&rec.marks),
            _ => Ok(Vec::new()),
        }
    }

    fn graphs(&self) -> std::sync::MutexGuard<'_, Graphs> {
        self.graphs.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn decode_step_impl(
        &self,
        step: &DecodeStep<'_>,
        run: &dyn Fn() -> OpResult<Vec<CudaTensor>>,
    ) -> OpResult<Vec<CudaTensor>> {
        let out = self.step_graphs(step, run);
        self.end_ple_step();
        out
    }

    fn step_graphs(
        &self,
        step: &DecodeStep<'_>,
        run: &dyn Fn() -> OpResult<Vec<CudaTensor>>,
    ) -> OpResult<Vec<CudaTensor>> {
        let tracing = self.lock().kv.qsa_trace.is_some();
        let mut guard = self.graphs();
        let g = &mut *guard;
        let batch = step.seqs.len();
        let eligible = g.sizes.contains(&batch)
            && all_decode(step.seqs)
            && step.ids.len() == batch
            && !self.routing_on.load(Ordering::Relaxed)
            && !tracing;
        if !eligible {
            g.stats.eager += 1;
            drop(guard);
            self.begin_step(step.ids, step.seqs, step.out_rows)
                .at("decode_step")?;
            return run();
        }
        let (span, epoch) = self.stage_padded(step).at("decode_step")?;
        if g.epoch != epoch {
            g.entries.clear();
            g.epoch = epoch;
        }
        let within = |k: usize| step.seqs.iter().all(|s| s.pos0 + s.len <= k);
        let key = Key {
            region: step.region,
            batch,
            out_rows: step.out_rows.len(),
            span,
            qsa_within_topk: self.lock().kv.qsa_whole_topk.is_some_and(within),
        };
        match g.entries.get(&key) {
            Some(Entry::Ready(rec)) => {
                g.stats.replays += 1;
                self.count_replayed_host_reads(step.seqs);
                let out = self.replay(rec).at("decode_step");
                if !rec.marks.is_empty() {
                    g.timed = Some(key);
                }
                out
            }
            Some(Entry::Warm(sh)) => {
                let sh = sh.clone();
                match self.capture(&sh, span, run) {
                    Ok(rec) => {
                        g.stats.captures += 1;
                        g.stats.replays += 1;
                        let out = self.replay(&rec).at("decode_step");
                        if !rec.marks.is_empty() {
                            g.timed = Some(key);
                        }
                        g.entries.insert(key, Entry::Ready(rec));
                        out
                    }
                    Err(why) => {
                        let out = {
                            let _span = SpanGuard::set(self, span);
                            run()?
                        };
                        // The step runs eagerly: the capture, not the step, failed.
                        tracing::warn!(
                            "CUDA graph capture of decode steps of batch {batch} failed ({why}); \
                             they run eagerly"
                        );
                        g.stats.failures += 1;
                        g.failure = Some(why);
                        g.entries.insert(key, Entry::Failed);
                        Ok(out)
                    }
                }
            }
            Some(Entry::Failed) => {
                g.stats.eager += 1;
                let _span = SpanGuard::set(self, span);
                run()
            }
            None => {
                g.stats.warmups += 1;
                let out = {
                    let _span = SpanGuard::set(self, span);
                    run()?
                };
                g.entries.insert(key, Entry::Warm(shapes(&out)));
                Ok(out)
            }
        }
    }

    /// Stages the step with its block tables padded to its span; returns the span and the epoch
    /// the step's device addresses belong to.
    fn stage_padded(&self, step: &DecodeStep<'_>) -> Result<(usize, (u64, u64))> {
        let mut st = self.lock();
        let bs = st.kv.block_size.max(1);
        let need = step
            .seqs
            .iter()
            .map(|s| (s.pos0 + s.len).max(s.blocks.len() * bs))
            .max()
            .unwrap_or(1);
        let stride = need.next_power_of_two().max(MIN_GRAPH_SPAN).div_ceil(bs);
        st.meta
            .stage(&self.gpu, step.ids, step.seqs, step.out_rows, bs, stride)?;
        let epoch = (self.epoch.load(Ordering::Relaxed), st.meta.generation);
        Ok((stride * bs, epoch))
    }

    /// Captures `run` (whose outputs have shapes `sh`) into a graph that ends by copying the outputs
    /// into persistent buffers. Nothing executes: when `run` fails under the capture (an op that is
    /// not capturable, or any error of its own), the capture is ended and dropped and the error says
    /// why (the caller then runs the step eagerly).
    fn capture(
        &self,
        sh: &[(usize, usize)],
        span: usize,
        run: &dyn Fn() -> OpResult<Vec<CudaTensor>>,
    ) -> std::result::Result<Recorded, String> {
        let mut outs = sh
            .iter()
            .map(|&(r, c)| self.alloc(r, c))
            .collect::<Result<Vec<_>>>()
            .map_err(|e| e.to_string())?;
        let s = self.gpu.stream();
        let _capturing = self.no_capture();
        // A timed capture creates its events while capturing: relaxed mode lets it (a measurement,
        // not the serving path, whose captures stay thread-local and strict).
        let mode = if self.gpu.timer().is_on() {
            sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED
        } else {
            sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
        };
        s.begin_capture(mode).map_err(|e| e.to_string())?;
        let body = (|| {
            self.gpu.timer().arm(s).map_err(|e| e.to_string())?;
            let _span = SpanGuard::set(self, span);
            let ts = run().map_err(|e| e.to_string())?;
            if shapes(&ts) != sh {
                return Err(format!(
                    "outputs {:?} differ from the warm-up's {sh:?}",
                    shapes(&ts)
                ));
            }
            for (t, o) in ts.iter().zip(outs.iter_mut()) {
                copy(self, t, o).map_err(|e| e.to_string())?;
            }
            // The outputs are freed inside the graph: the graph owns no allocation across launches.
            drop(ts);
            Ok(())
        })();
        let Armed { marks, traces } = self.gpu.timer().disarm();
        let graph = s.end_capture(sys::CUgraphInstantiate_flags(0));
        // Errors recorded by buffers freed under a failed capture.
        let _ = self.gpu.context().check_err();
        body?;
        match graph {
            Ok(Some(graph)) => {
                graph.upload().map_err(|e| e.to_string())?;
                Ok(Recorded {
                    graph,
                    outs,
                    marks,
                    traces,
                })
            }
            Ok(None) => Err("the capture recorded nothing".into()),
            Err(e) => Err(e.to_string()),
        }
    }

    /// Launches a recording and returns fresh copies of its outputs.
    /// A replayed decode step runs no host code: the QSA rows it reads from host memory without a
    /// row cache (each sequence's context up to topk, every QSA layer) are counted here.
    fn count_replayed_host_reads(&self, seqs: &[SeqChunk<'_>]) {
        let mut st = self.lock();
        if let Some(a) = st.kv.arena.as_mut().filter(|a| a.caches.is_empty()) {
            let per_layer: u64 = seqs.iter().map(|s| (s.pos0 + 1).min(a.topk) as u64).sum();
            a.host_rows += per_layer * a.layers as u64;
        }
    }

    fn replay(&self, rec: &Recorded) -> Result<Vec<CudaTensor>> {
        rec.graph.launch()?;
        rec.outs
            .iter()
            .map(|o| {
                let mut t = self.alloc(o.rows, o.cols)?;
                copy(self, o, &mut t)?;
                Ok(t)
            })
            .collect()
    }
}
