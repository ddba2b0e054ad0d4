//! QSA and the PLE mix on the device against the CPU oracle:
//!
//! - kernels: the index-key write (LayerNorm, RoPE, bf16 scale, fp8 e4m3) byte for byte; the index
//!   scores bit for bit and the top-k selected sets exactly (ties included: repeated keys and all-zero
//!   scores); the attention over gathered selected rows within bf16 rounding; the decode forms of the
//!   three (contexts, block tables read on the device, rows on both sides of topk, a score row longer
//!   than every context) the same way, and the PLE conv's decode form (state slots read on the
//!   device) within rounding, its state exactly;
//! - the backend ops: `qsa_attention` (mixed prefill chunks and decodes of two sequences, dense and
//!   selecting, selected sets recorded on both sides) and `ple_mix` (chunks, decodes, a `copy_state`
//!   fork) on `CudaBackend` against `CpuBackend` with the same inputs;
//! - the VRAM row cache of offloaded QSA K/V rows (`row_cache.rs`): the cached decode attention byte
//!   for byte the uncached one's over thousands of steps, the device state equal to the CPU twin's;
//!   `bench_qsa_cached_attention` (ignored) times it at the 125B shape;
//!
//! The end-to-end comparison on the tiny fixtures is `qsa_ple_e2e.rs`.
//!
//! Without a GPU every test prints `skipped: <test>: <reason>` and passes. Each check prints a
//! `PARITY` or `E2E` line.

#[path = "../support/options.rs"]
mod options;

use options::backend;

use half::bf16;
use sanmai_cpu::{ops as cpu, CpuBackend};
use sanmai_cuda::cudarc::driver::CudaSlice;
use sanmai_cuda::{
    AttnDims, CudaBackend, IndexCache, IndexHeads, IndexProj, IndexQueries, KeyNorm, KvPools,
    PagedCache, PleDims, PleGated, Queries, RopeArgs, ScoreRows, Selection,
};
use sanmai_model::backend::{
    AttnCall, AttnShape, AttnWeights, CacheSpec, GdnShape, IndexerWeights, PleCall, PleShape,
    PleWeights, QsaCall, QsaShape, Rope,
};
use sanmai_model::{Backend, OpResult, SeqChunk};

mod ple;
mod qsa;
mod qsa_decode;
mod qsa_select_bench;
mod qsa_staged;
mod row_cache;
mod row_cache_bench;
mod row_cache_pools;

/// xorshift64* with Box–Muller normals.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }
    fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn unit(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }
    fn normal(&mut self) -> f32 {
        let u = self.unit().max(1e-7);
        let v = self.unit();
        (-2.0 * u.ln()).sqrt() * (std::f32::consts::TAU * v).cos()
    }
    /// `n` bf16-representable normals times `scale` plus `mean`.
    fn bf16s(&mut self, n: usize, mean: f32, scale: f32) -> Vec<f32> {
        (0..n)
            .map(|_| bf16::from_f32(mean + scale * self.normal()).to_f32())
            .collect()
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

fn to_dev(b: &CudaBackend, x: &[f32]) -> sanmai_cuda::cudarc::driver::CudaSlice<bf16> {
    let v: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
    b.gpu().upload(&v).unwrap()
}

/// The attention shape of the shipped 125B qwen4_exp config, for the timing runs.
struct Q125 {
    hq: usize,
    hkv: usize,
    d: usize,
    topk: usize,
    qsa_layers: usize,
    /// The indexer's heads and head size.
    ni: usize,
    di: usize,
}

/// Reads [`Q125`] from `configs/models/qwen4-exp-125b-a6b.json`: under the working directory (a
/// copied test binary run from the repository root), else next to this crate's sources.
fn q125() -> Q125 {
    let rel = std::path::Path::new("configs/models/qwen4-exp-125b-a6b.json");
    let path = if rel.exists() {
        rel.to_path_buf()
    } else {
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../..")
            .join(rel)
    };
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let num = |v: &serde_json::Value| v.as_u64().unwrap() as usize;
    Q125 {
        hq: num(&cfg["num_attention_heads"]),
        hkv: num(&cfg["num_key_value_heads"]),
        d: num(&cfg["head_dim"]),
        topk: num(&cfg["qsa"]["index_topk"]),
        qsa_layers: num(&cfg["num_hidden_layers"]) / num(&cfg["full_attention_interval"]),
        ni: num(&cfg["qsa"]["index_n_heads"]),
        di: num(&cfg["qsa"]["index_head_dim"]),
    }
}

/// Mean seconds per call of `f` over `iters` calls after `warm` warm-up calls (the argument counts
/// every call from 0), timed with events on the device's stream.
fn time(g: &sanmai_cuda::Gpu, warm: usize, iters: usize, mut f: impl FnMut(usize)) -> f64 {
    use sanmai_cuda::cudarc::driver::sys::CUevent_flags;
    for i in 0..warm {
        f(i);
    }
    let s = g.stream();
    let start = s
        .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
        .unwrap();
    for i in 0..iters {
        f(warm + i);
    }
    let end = s
        .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
        .unwrap();
    start.elapsed_ms(&end).unwrap() as f64 / 1e3 / iters as f64
}

fn inv_freq(rot: usize, theta: f32) -> Vec<f32> {
    (0..rot / 2)
        .map(|j| theta.powf(-2.0 * j as f32 / rot as f32))
        .collect()
}

/// `max|got − want| / max|want|`.
fn max_rel(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    let m = want.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-30);
    got.iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max)
        / m
}

/// Both backends with the same weights and caches.
struct Pair {
    gpu: CudaBackend,
    cpu: CpuBackend,
}

impl Pair {
    fn weight(
        &self,
        data: Vec<f32>,
        shape: &[usize],
    ) -> (sanmai_cuda::CudaWeight, sanmai_cpu::CpuWeight) {
        (
            self.gpu.weight(data.clone(), shape).unwrap(),
            self.cpu.weight(data, shape).unwrap(),
        )
    }
    fn init(&self, spec: &CacheSpec) {
        self.gpu.init_cache(spec).unwrap();
        self.cpu.init_cache(spec).unwrap();
    }
}

fn spec(attn: bool, di: usize, ple: Option<PleShape>) -> CacheSpec {
    CacheSpec {
        num_blocks: 128,
        block_size: 16,
        attn_layers: if attn { vec![0] } else { vec![] },
        num_kv_heads: 2,
        head_dim: 32,
        index_head_dim: di,
        gdn_layers: vec![],
        gdn: GdnShape {
            num_k_heads: 1,
            num_v_heads: 1,
            k_head_dim: 8,
            v_head_dim: 8,
            conv_kernel: 4,
        },
        ple_layers: if ple.is_some() { vec![0] } else { vec![] },
        ple,
        kv_host: None,
    }
}
