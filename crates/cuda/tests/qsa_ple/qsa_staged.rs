//! The sectioned gathered attention (`Gpu::qsa_attention_gather_staged`, `kernels/qsa_staged.cu`)
//! on the device:
//!
//! - its output is byte for byte `qsa_attention_gather`'s over the pools, over shapes of 8 and 24
//!   query heads, head sizes 64 and 256, topk 128 and 2048, contexts of one to five arena sections
//!   (arenas of 96, 1000 and 4096 rows), 1 to 300 query rows with full, partial, single and empty
//!   selections (some repeated across rows), weights that underflow to 0, a garbage-filled arena, and
//!   pools in VRAM and in host-registered memory;
//! - its contract errors (an empty arena, an arena shorter than its rows, a short table);
//! - `bench_qsa_staged` (ignored; `--ignored` runs it): the 125B shape's prefill group (256 query rows)
//!   at contexts 65,536 and 262,144 with the pools in host-registered memory, staged through an arena
//!   of 48,576 rows against the gathered attention reading host memory.
//!
//! Prints `PARITY op=qsa_attention_gather_staged ...` and `BENCH qsa_staged ...` lines.

use std::sync::Arc;

use sanmai_cuda::cudarc::driver::{sys, CudaStream, DevicePtr, DeviceSlice, SyncOnDrop};
use sanmai_cuda::{Gpu, SeqKv, StagingArena};

use super::*;

/// Host memory registered with the driver, device-mapped (as the backend's offloaded K/V pools):
/// the kernels read it through its device pointer.
struct HostMem {
    ptr: *mut bf16,
    len: usize,
    layout: std::alloc::Layout,
    dptr: sys::CUdeviceptr,
    stream: Arc<CudaStream>,
}

impl HostMem {
    /// `data`, copied into page-aligned memory registered with `g`'s context.
    fn new(g: &Gpu, data: &[bf16]) -> Self {
        let bytes = (data.len() * 2).div_ceil(4096).max(1) * 4096;
        let layout = std::alloc::Layout::from_size_align(bytes, 4096).unwrap();
        // SAFETY: a non-zero size; freed in Drop with the same layout.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) }.cast::<bf16>();
        assert!(!ptr.is_null(), "host allocation of {bytes} bytes failed");
        // SAFETY: `data.len()` values fit the fresh allocation, which nothing else references.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), ptr, data.len()) };
        g.context().bind_to_thread().unwrap();
        let mut dptr: sys::CUdeviceptr = 0;
        let flags = sys::CU_MEMHOSTREGISTER_DEVICEMAP | sys::CU_MEMHOSTREGISTER_PORTABLE;
        // SAFETY: `ptr` is a live page-aligned allocation of `bytes` bytes, unregistered in Drop
        // before it is freed.
        unsafe {
            sys::cuMemHostRegister_v2(ptr.cast(), bytes, flags)
                .result()
                .unwrap();
            sys::cuMemHostGetDevicePointer_v2(&mut dptr, ptr.cast(), 0)
                .result()
                .unwrap();
        }
        Self {
            ptr,
            len: data.len(),
            layout,
            dptr,
            stream: g.stream().clone(),
        }
    }
}

impl Drop for HostMem {
    fn drop(&mut self) {
        let _ = self.stream.synchronize();
        // SAFETY: registered in `new`; no queued work reads it any more (synchronised above).
        unsafe {
            let _ = sys::cuMemHostUnregister(self.ptr.cast());
            std::alloc::dealloc(self.ptr.cast(), self.layout);
        }
    }
}

/// A K or V pool in VRAM or in host-registered memory.
enum Pool {
    Device(CudaSlice<bf16>),
    Host(HostMem),
}

impl Pool {
    fn new(g: &Gpu, data: &[bf16], host: bool) -> Self {
        if host {
            Pool::Host(HostMem::new(g, data))
        } else {
            Pool::Device(g.upload(data).unwrap())
        }
    }
}

impl DeviceSlice<bf16> for Pool {
    fn len(&self) -> usize {
        match self {
            Pool::Device(s) => s.len(),
            Pool::Host(h) => h.len,
        }
    }
    fn stream(&self) -> &Arc<CudaStream> {
        match self {
            Pool::Device(s) => s.stream(),
            Pool::Host(h) => &h.stream,
        }
    }
}

impl DevicePtr<bf16> for Pool {
    fn device_ptr<'a>(&'a self, stream: &'a CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        match self {
            Pool::Device(s) => s.device_ptr(stream),
            // Ordered by the one stream that reads it.
            Pool::Host(h) => (h.dptr, SyncOnDrop::Sync(None)),
        }
    }
}

/// One parity case.
#[derive(Clone, Copy)]
struct Case {
    hq: usize,
    hkv: usize,
    d: usize,
    topk: usize,
    bs: usize,
    context: usize,
    arena: usize,
    rows: usize,
    /// The query values' scale: large scores make many weights underflow to 0.
    q_scale: f32,
    host: bool,
    seed: u64,
}

/// `n` distinct positions below `limit` (n ≤ limit), ascending.
fn subset(rng: &mut Rng, n: usize, limit: usize) -> Vec<u32> {
    let mut take = vec![false; limit];
    let mut left = n;
    // Floyd's algorithm: n draws, each adding one new position.
    for j in limit - n..limit {
        let t = rng.below(j + 1);
        if take[t] {
            take[j] = true;
        } else {
            take[t] = true;
        }
        left -= 1;
    }
    debug_assert_eq!(left, 0);
    (0..limit as u32).filter(|&p| take[p as usize]).collect()
}

/// Row selections `[rows, topk]` and counts: each row a query at the end of the context (row `r`
/// sees `context − rows + r + 1` positions, at least 1) with every kind of count: full, partial,
/// one, none, and some rows repeating the row before.
fn selections(rng: &mut Rng, c: &Case) -> (Vec<u32>, Vec<u32>) {
    let (rows, topk, context) = (c.rows, c.topk, c.context);
    let mut sel = vec![u32::MAX; rows * topk];
    let mut counts = vec![0u32; rows];
    for r in 0..rows {
        let ctx = (context + r + 1).saturating_sub(rows).clamp(1, context);
        let full = topk.min(ctx);
        if r > 0 && rng.below(6) == 0 {
            let (prev, cur) = sel.split_at_mut(r * topk);
            cur[..topk].copy_from_slice(&prev[(r - 1) * topk..r * topk]);
            counts[r] = counts[r - 1];
            continue;
        }
        let n = match rng.below(8) {
            0 => 0,
            1 => 1.min(full),
            2 | 3 => rng.below(full + 1),
            _ => full,
        };
        let picked = subset(rng, n, ctx);
        sel[r * topk..r * topk + n].copy_from_slice(&picked);
        counts[r] = n as u32;
    }
    (sel, counts)
}

fn bf16s(rng: &mut Rng, n: usize, scale: f32) -> Vec<bf16> {
    (0..n)
        .map(|_| bf16::from_f32(scale * rng.normal()))
        .collect()
}

/// Runs case `c`: the staged output against the gathered attention over the pools; returns how many
/// output values differ in their bits.
fn check_case(g: &Gpu, c: &Case) -> usize {
    let mut rng = Rng::new(c.seed);
    let row = c.hkv * c.d;
    // The pools: the sequence's blocks in a shuffled order among spare ones.
    let nb = c.context.div_ceil(c.bs);
    let pool_blocks = nb + 3;
    let mut ids: Vec<u32> = (0..pool_blocks as u32).collect();
    for i in (1..pool_blocks).rev() {
        ids.swap(i, rng.below(i + 1));
    }
    let table: Vec<u32> = ids[..nb].to_vec();
    let kh = bf16s(&mut rng, pool_blocks * c.bs * row, 1.0);
    let vh = bf16s(&mut rng, pool_blocks * c.bs * row, 1.0);
    let (kp, vp) = (Pool::new(g, &kh, c.host), Pool::new(g, &vh, c.host));
    let table_d = g.upload(&table).unwrap();
    let q = g
        .upload(&bf16s(&mut rng, c.rows * c.hq * c.d, c.q_scale))
        .unwrap();
    let gate = g
        .upload(&bf16s(&mut rng, c.rows * c.hq * c.d, 1.0))
        .unwrap();
    let (sel, counts) = selections(&mut rng, c);
    let (sel_d, counts_d) = (g.upload(&sel).unwrap(), g.upload(&counts).unwrap());
    let dims = AttnDims {
        hq: c.hq,
        hkv: c.hkv,
        head_dim: c.d,
        block_size: c.bs,
    };
    let queries = Queries { q: &q, gate: &gate };
    let selection = Selection {
        sel: &sel_d,
        stride: c.topk,
        counts: &counts_d,
        max_count: c.topk,
        rows: c.rows,
    };
    let pools = KvPools { k: &kp, v: &vp };
    let n_out = c.rows * c.hq * c.d;
    let mut want = g.zeros::<bf16>(n_out).unwrap();
    let cache = PagedCache {
        pools,
        tables: &table_d,
        stride: 0,
    };
    g.qsa_attention_gather(dims, &queries, &cache, &selection, &mut want)
        .unwrap();
    // The arena full of garbage (NaN among it): only staged rows may be read.
    let junk: Vec<bf16> = (0..c.arena * row)
        .map(|i| {
            if i % 7 == 0 {
                bf16::NAN
            } else {
                bf16::from_f32(1e4 * rng.normal())
            }
        })
        .collect();
    let mut ak = g.upload(&junk).unwrap();
    let mut av = g.upload(&junk).unwrap();
    let kv = SeqKv {
        pools,
        table: &table_d,
        context: c.context,
    };
    let mut got = g.upload(&vec![bf16::from_f32(7.0); n_out]).unwrap();
    let mut differing = 0;
    // Twice: the second run starts from the first one's arena contents.
    for _ in 0..2 {
        let mut arena = StagingArena {
            k: &mut ak,
            v: &mut av,
            rows: c.arena,
        };
        g.qsa_attention_gather_staged(dims, &queries, &kv, &selection, &mut arena, &mut got)
            .unwrap();
        let (w, o) = (g.download(&want).unwrap(), g.download(&got).unwrap());
        differing = differing.max(
            w.iter()
                .zip(&o)
                .filter(|(a, b)| a.to_bits() != b.to_bits())
                .count(),
        );
    }
    let entries: u64 = counts.iter().map(|&n| u64::from(n)).sum();
    println!(
        "PARITY op=qsa_attention_gather_staged shape=hq{}_hkv{}_d{}_topk{}_bs{}_ctx{}_arena{}_rows{} kv_pool={} sections={} entries={entries} values={n_out} differing={differing} tol=exact",
        c.hq,
        c.hkv,
        c.d,
        c.topk,
        c.bs,
        c.context,
        c.arena,
        c.rows,
        if c.host { "host_registered" } else { "vram" },
        c.context.div_ceil(c.arena),
    );
    differing
}

#[test]
fn staged_attention_matches_gather_bytewise() {
    let Some(b) = backend("staged_attention_matches_gather_bytewise") else {
        return;
    };
    let g = b.gpu();
    let case = |hq, d, topk, context, arena, rows| Case {
        hq,
        hkv: 2,
        d,
        topk,
        bs: 16,
        context,
        arena,
        rows,
        q_scale: 1.0,
        host: false,
        seed: 1,
    };
    let cases = [
        // One section (the context fits the arena), one query row.
        case(8, 64, 128, 90, 96, 1),
        // Four sections of 96 rows.
        case(8, 64, 128, 300, 96, 37),
        // Five sections, the last one short; weights underflowing to 0.
        Case {
            q_scale: 40.0,
            ..case(24, 64, 128, 470, 96, 120)
        },
        // topk 2048: eight spans a row; five sections of 1000.
        case(24, 256, 2048, 4500, 1000, 300),
        // Exactly five full sections, a block size that does not divide the arena.
        Case {
            bs: 64,
            ..case(8, 256, 2048, 5000, 1000, 64)
        },
        // Two sections of 4096 (the second short), the pools in host memory.
        Case {
            host: true,
            ..case(8, 256, 2048, 6000, 4096, 200)
        },
        // Three sections of 4096, host pools, head size 64, large scores.
        Case {
            host: true,
            q_scale: 20.0,
            ..case(24, 64, 2048, 12_000, 4096, 48)
        },
        // Contexts below topk: every position selected in the full rows.
        case(8, 64, 2048, 1500, 1000, 150),
    ];
    let mut bad = Vec::new();
    for (i, c) in cases.iter().enumerate() {
        let c = Case {
            seed: 100 + i as u64,
            ..*c
        };
        let n = check_case(g, &c);
        if n > 0 {
            bad.push((i, n));
        }
    }
    assert!(bad.is_empty(), "cases (index, differing values): {bad:?}");
}

#[test]
fn staged_attention_rejects_bad_shapes() {
    let Some(b) = backend("staged_attention_rejects_bad_shapes") else {
        return;
    };
    let g = b.gpu();
    let (hq, hkv, d, bs, topk, rows, context) = (8, 2, 64, 16, 128, 4, 200usize);
    let row = hkv * d;
    let pool = g.zeros::<bf16>(context.div_ceil(bs) * bs * row).unwrap();
    let table = g
        .upload(&(0..context.div_ceil(bs) as u32).collect::<Vec<_>>())
        .unwrap();
    let short_table = g.upload(&[0u32; 2]).unwrap();
    let q = g.zeros::<bf16>(rows * hq * d).unwrap();
    let sel = g.zeros::<u32>(rows * topk).unwrap();
    let counts = g.zeros::<u32>(rows).unwrap();
    let mut out = g.zeros::<bf16>(rows * hq * d).unwrap();
    let (mut ak, mut av) = (
        g.zeros::<bf16>(96 * row).unwrap(),
        g.zeros(96 * row).unwrap(),
    );
    let dims = AttnDims {
        hq,
        hkv,
        head_dim: d,
        block_size: bs,
    };
    let queries = Queries { q: &q, gate: &q };
    let selection = Selection {
        sel: &sel,
        stride: topk,
        counts: &counts,
        max_count: topk,
        rows,
    };
    let pools = KvPools { k: &pool, v: &pool };
    let kv = SeqKv {
        pools,
        table: &table,
        context,
    };
    let mut run = |kv: &SeqKv<'_, CudaSlice<bf16>, CudaSlice<u32>>, arena_rows: usize| {
        let mut arena = StagingArena {
            k: &mut ak,
            v: &mut av,
            rows: arena_rows,
        };
        g.qsa_attention_gather_staged(dims, &queries, kv, &selection, &mut arena, &mut out)
    };
    for (what, res) in [
        ("an empty arena", run(&kv, 0)),
        ("an arena shorter than its rows", run(&kv, 97)),
        (
            "a short table",
            run(
                &SeqKv {
                    table: &short_table,
                    ..kv
                },
                96,
            ),
        ),
    ] {
        match res {
            Err(sanmai_cuda::CudaError::Shape { .. }) => {}
            other => panic!("{what}: expected a shape error, got {other:?}"),
        }
    }
    run(&kv, 96).expect("a valid call");
    g.synchronize().unwrap();
}

#[test]
#[ignore = "a timing run: cargo test --release -- --ignored bench_qsa_staged"]
fn bench_qsa_staged() {
    let Some(b) = backend("bench_qsa_staged") else {
        return;
    };
    let g = b.gpu();
    let super::Q125 {
        hq, hkv, d, topk, ..
    } = super::q125();
    let (rows, arena_rows, bs) = (256usize, 48_576usize, 16usize);
    let row = hkv * d;
    let max_ctx = 262_144usize;
    let pattern = |i: usize, salt: u32| {
        let h = ((i as u32) ^ salt).wrapping_mul(2_654_435_761) >> 16;
        bf16::from_f32(h as f32 / 65536.0 - 0.5)
    };
    let kh: Vec<bf16> = (0..max_ctx * row).map(|i| pattern(i, 1)).collect();
    let kp = HostMem::new(g, &kh);
    let kh: Vec<bf16> = (0..max_ctx * row).map(|i| pattern(i, 2)).collect();
    let vp = HostMem::new(g, &kh);
    drop(kh);
    let (kp, vp) = (Pool::Host(kp), Pool::Host(vp));
    let table = g
        .upload(&(0..(max_ctx / bs) as u32).collect::<Vec<_>>())
        .unwrap();
    let mut rng = Rng::new(11);
    let q = g.upload(&bf16s(&mut rng, rows * hq * d, 1.0)).unwrap();
    let gate = g.upload(&bf16s(&mut rng, rows * hq * d, 1.0)).unwrap();
    let mut ak = g.zeros::<bf16>(arena_rows * row).unwrap();
    let mut av = g.zeros::<bf16>(arena_rows * row).unwrap();
    let dims = AttnDims {
        hq,
        hkv,
        head_dim: d,
        block_size: bs,
    };
    let queries = Queries { q: &q, gate: &gate };
    let pools = KvPools { k: &kp, v: &vp };
    let n_out = rows * hq * d;
    let (mut direct, mut staged) = (g.zeros::<bf16>(n_out).unwrap(), g.zeros(n_out).unwrap());
    println!(
        "BENCH qsa_staged shape=hq{hq}_hkv{hkv}_d{d}_topk{topk}_rows{rows} arena_rows={arena_rows} kv_pool=host_registered row_bytes={}",
        row * 2
    );
    for context in [65_536usize, max_ctx] {
        // The group's query rows are the context's last positions: full selections of topk.
        let mut sel = Vec::with_capacity(rows * topk);
        for r in 0..rows {
            sel.extend(subset(&mut rng, topk, context - rows + r + 1));
        }
        let counts = vec![topk as u32; rows];
        let (sel_d, counts_d) = (g.upload(&sel).unwrap(), g.upload(&counts).unwrap());
        let selection = Selection {
            sel: &sel_d,
            stride: topk,
            counts: &counts_d,
            max_count: topk,
            rows,
        };
        let kv = SeqKv {
            pools,
            table: &table,
            context,
        };
        let t_staged = time(g, 1, 3, |_| {
            let mut arena = StagingArena {
                k: &mut ak,
                v: &mut av,
                rows: arena_rows,
            };
            g.qsa_attention_gather_staged(dims, &queries, &kv, &selection, &mut arena, &mut staged)
                .unwrap();
        });
        let cache = PagedCache {
            pools,
            tables: &table,
            stride: 0,
        };
        let t_direct = time(g, 1, 2, |_| {
            g.qsa_attention_gather(dims, &queries, &cache, &selection, &mut direct)
                .unwrap();
        });
        // The staging alone: every position's K and V rows once.
        let t_stage = time(g, 1, 3, |_| {
            let mut a = 0;
            while a < context {
                let e = (a + arena_rows).min(context);
                let out = KvPools {
                    k: Some(&mut ak),
                    v: Some(&mut av),
                };
                g.kv_stage(pools, &table, bs, a..e, row, out).unwrap();
                a = e;
            }
        });
        let same = g.download(&direct).unwrap() == g.download(&staged).unwrap();
        let gb = (2 * context * row * 2) as f64 / 1e9;
        println!(
            "BENCH qsa_staged context={context} sections={} staged_ms={:.2} direct_host_ms={:.2} speedup={:.1} stage_only_ms={:.2} stage_gbps={:.1} identical={same}",
            context.div_ceil(arena_rows),
            t_staged * 1e3,
            t_direct * 1e3,
            t_direct / t_staged,
            t_stage * 1e3,
            gb / t_stage
        );
        assert!(same, "staged output differs from the gathered attention");
    }
}
