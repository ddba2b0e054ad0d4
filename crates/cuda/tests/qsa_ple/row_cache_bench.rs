//! `bench_qsa_cached_attention` (ignored; `--ignored` runs it): the 125B shape's QSA decode step
//! with the pools in host-registered memory, through the row cache at 0%, ~72% and 100% overlap of
//! consecutive selections, against the uncached attention from host memory and from VRAM. Prints
//! `BENCH qsa_cached_attention ...` lines.

use std::collections::HashSet;

use sanmai_cuda::{Gpu, RowCache};

use sanmai_cuda::cudarc::driver::DevicePtr;

use super::row_cache::BS;
use super::row_cache_pools::HostRegistered;
use super::*;

/// `n` selections of `topk` of `ctx` positions (sorted), each keeping about `overlap` of the one
/// before (0: disjoint from it).
fn selections(rng: &mut Rng, n: usize, ctx: usize, topk: usize, overlap: f32) -> Vec<u32> {
    let mut out = Vec::with_capacity(n * topk);
    let mut prev: Vec<u32> = Vec::new();
    for _ in 0..n {
        let mut set: HashSet<u32> = prev
            .iter()
            .copied()
            .filter(|_| rng.unit() < overlap)
            .collect();
        let old: HashSet<u32> = prev.iter().copied().collect();
        while set.len() < topk {
            let p = rng.below(ctx) as u32;
            if overlap > 0.0 || !old.contains(&p) {
                set.insert(p);
            }
        }
        let mut s: Vec<u32> = set.into_iter().collect();
        s.sort_unstable();
        out.extend_from_slice(&s);
        prev = s;
    }
    out
}

/// What every timed step of the bench shares: the shape, the query, and `n_sel` selections of
/// `topk` positions of one sequence (identity block table) used in turn: a pass of `n_sel / 3` of
/// them warms the cache, the next `2·n_sel / 3` are timed (each new).
struct BenchSteps<'a> {
    g: &'a Gpu,
    dims: AttnDims,
    queries: Queries<'a, CudaSlice<bf16>>,
    sels: CudaSlice<u32>,
    n_sel: usize,
    topk: usize,
    counts: CudaSlice<u32>,
    /// The slot each cached step stores (never selected).
    stored: CudaSlice<u32>,
}

impl BenchSteps<'_> {
    fn sel(&self, i: usize) -> sanmai_cuda::cudarc::driver::CudaView<'_, u32> {
        let a = (i % self.n_sel) * self.topk;
        self.sels.slice(a..a + self.topk)
    }

    /// Mean seconds of the uncached attention over `cache`.
    fn uncached<P: DevicePtr<bf16>>(
        &self,
        cache: &PagedCache<'_, P, CudaSlice<u32>>,
        out: &mut CudaSlice<bf16>,
    ) -> f64 {
        let warm = self.n_sel / 3;
        time(self.g, warm, self.n_sel - warm, |i| {
            let s = self.sel(i);
            let sel = Selection {
                sel: &s,
                stride: self.topk,
                counts: &self.counts,
                max_count: self.topk,
                rows: 1,
            };
            self.g
                .qsa_attention_gather_decode(self.dims, &self.queries, cache, &sel, out)
                .unwrap();
        })
    }

    /// One cached step: invalidate (one stored slot), plan, cached attention over `cache`.
    fn cached_step<P: DevicePtr<bf16>>(
        &self,
        i: usize,
        rc: &mut RowCache,
        cache: &PagedCache<'_, P, CudaSlice<u32>>,
        out: &mut CudaSlice<bf16>,
    ) {
        let g = self.g;
        let s = self.sel(i);
        let sel = Selection {
            sel: &s,
            stride: self.topk,
            counts: &self.counts,
            max_count: self.topk,
            rows: 1,
        };
        let mut bufs = rc.bufs().unwrap();
        g.qsa_rc_invalidate(&mut bufs, &self.stored, 1).unwrap();
        g.qsa_rc_plan(&mut bufs, &sel, cache.tables, cache.stride, BS)
            .unwrap();
        g.qsa_attention_gather_decode_cached(self.dims, &self.queries, cache, &sel, &mut bufs, out)
            .unwrap();
    }

    /// Mean seconds of a cached step and the hit rate, over the timed selections after the
    /// warming ones.
    fn cached<P: DevicePtr<bf16>>(
        &self,
        rc: &mut RowCache,
        cache: &PagedCache<'_, P, CudaSlice<u32>>,
        out: &mut CudaSlice<bf16>,
    ) -> (f64, f64) {
        let warm = self.n_sel / 3;
        for i in 0..warm {
            self.cached_step(i, rc, cache, out);
        }
        let (h0, m0) = rc.counts(self.g).unwrap();
        let t = time(self.g, 0, self.n_sel - warm, |i| {
            self.cached_step(warm + i, rc, cache, out)
        });
        let (h1, m1) = rc.counts(self.g).unwrap();
        let (h, m) = (h1 - h0, m1 - m0);
        (t, h as f64 / (h + m).max(1) as f64)
    }
}

/// The 125B model's QSA decode attention (hq 24, hkv 2, d 256, topk 2048; batch 1, a context of
/// 65,536 positions) with its K/V pools in host-registered memory: a cached step (invalidate, plan,
/// cached attention) at 0%, ~72% and 100% overlap of consecutive selections, for a cache of the
/// default size (`QSA_ROW_CACHE_ROWS` over the model's 12 QSA layers: 4,048 lines) and one that
/// holds the whole context (there a row read at any earlier step hits, whatever the overlap with
/// the step before), against the uncached attention from host memory and from VRAM.
#[test]
#[ignore = "timing; run with --ignored on a GPU host"]
fn bench_qsa_cached_attention() {
    let Some(b) = backend("bench_qsa_cached_attention") else {
        return;
    };
    let g = b.gpu();
    let super::Q125 {
        hq,
        hkv,
        d,
        topk,
        qsa_layers,
        ..
    } = super::q125();
    let (ctx, n_sel) = (65_536usize, 192usize);
    let row = hkv * d;
    // One block past the context holds the slot each step stores (never selected).
    let slots = ctx + BS;
    let mut kp = HostRegistered::new(g, slots * row);
    let mut vp = HostRegistered::new(g, slots * row);
    let pattern = |i: usize, salt: u32| {
        let h = ((i as u32) ^ salt).wrapping_mul(2_654_435_761) >> 16;
        bf16::from_f32(h as f32 / 65536.0 - 0.5)
    };
    for (i, x) in kp.host_mut().iter_mut().enumerate() {
        *x = pattern(i, 1);
    }
    for (i, x) in vp.host_mut().iter_mut().enumerate() {
        *x = pattern(i, 2);
    }
    let kd = g.upload(kp.host_mut()).unwrap();
    let vd = g.upload(vp.host_mut()).unwrap();
    let stride = slots / BS;
    let table = g.upload(&(0..stride as u32).collect::<Vec<_>>()).unwrap();
    let mut rng = Rng::new(7);
    let q = to_dev(&b, &rng.bf16s(hq * d, 0.0, 1.0));
    let gate = to_dev(&b, &rng.bf16s(hq * d, 0.0, 1.0));
    let host_cache = PagedCache {
        pools: KvPools { k: &kp, v: &vp },
        tables: &table,
        stride,
    };
    let dev_cache = PagedCache {
        pools: KvPools { k: &kd, v: &vd },
        tables: &table,
        stride,
    };
    let mut out = g.zeros::<bf16>(hq * d).unwrap();
    // The default row cache (QSA_ROW_CACHE_ROWS) split over the model's QSA layers.
    let default_lines = 4 * 12_144 / qsa_layers;
    println!(
        "BENCH qsa_cached_attention shape=hq{hq}_hkv{hkv}_d{d}_topk{topk}_ctx{ctx}_batch1 kv_pool=host_registered row_bytes={} selections={n_sel}",
        row * 2
    );
    for overlap in [0.0f32, 0.72, 1.0] {
        let steps = BenchSteps {
            g,
            dims: AttnDims {
                hq,
                hkv,
                head_dim: d,
                block_size: BS,
            },
            queries: Queries { q: &q, gate: &gate },
            sels: g
                .upload(&selections(&mut rng, n_sel, ctx, topk, overlap))
                .unwrap(),
            n_sel,
            topk,
            counts: g.upload(&[topk as u32]).unwrap(),
            stored: g.upload(&[ctx as u32]).unwrap(),
        };
        let t_host = steps.uncached(&host_cache, &mut out);
        let t_dev = steps.uncached(&dev_cache, &mut out);
        println!(
            "BENCH qsa_cached_attention overlap={overlap:.2} uncached_host_us={:.1} uncached_vram_us={:.1}",
            t_host * 1e6,
            t_dev * 1e6
        );
        for lines in [default_lines, ctx] {
            let mut rc = RowCache::new(g, lines, row).unwrap();
            let (t, hit_rate) = steps.cached(&mut rc, &host_cache, &mut out);
            println!(
                "BENCH qsa_cached_attention overlap={overlap:.2} lines={lines} hit_rate={hit_rate:.3} cached_step_us={:.1} speedup_vs_uncached_host={:.2} (step = invalidate + plan + attention)",
                t * 1e6,
                t_host / t
            );
        }
    }
}
