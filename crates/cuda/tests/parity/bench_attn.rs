//! Timing (ignored by default; `--ignored` runs it) of decode attention at the shapes of a full-size
//! decode step, and of prefill attention chunks. Prints `BENCH` lines.

use half::bf16;
use sanmai_cuda::{AttnDims, ChunkRows, DecodeLens, KvPools, PagedCache, Queries};

use crate::bench::{pattern, time};
use crate::common::gpu;

/// Qwen3-Next's full-attention layer with the cache's block size.
const ATTN: AttnDims = AttnDims {
    hq: 16,
    hkv: 2,
    head_dim: 256,
    block_size: 16,
};

#[test]
#[ignore = "timing; run with --ignored on a GPU host"]
fn bench_attention_decode() {
    let Some(g) = gpu("bench_attention_decode") else {
        return;
    };
    let dims = ATTN;
    let bs = dims.block_size;
    // (batch, context of every sequence, span of the recording: the split grid covers it).
    for (batch, ctx, span) in [
        (1usize, 576usize, 4096usize),
        (8, 576, 4096),
        (1, 4096, 4096),
        (8, 4096, 4096),
        (1, 8192, 8192),
        (8, 8192, 8192),
        (1, 32768, 32768),
        (8, 32768, 32768),
    ] {
        let per_seq = ctx.div_ceil(bs);
        let max_blocks = span / bs;
        let n = batch * per_seq * bs * dims.kv_row();
        let k = g.upload(&pattern(n, 1)).unwrap();
        let v = g.upload(&pattern(n, 2)).unwrap();
        let mut table = vec![0u32; batch * max_blocks];
        for b in 0..batch {
            for i in 0..per_seq {
                table[b * max_blocks + i] = (b * per_seq + i) as u32;
            }
        }
        let tab = g.upload(&table).unwrap();
        let lens = g.upload(&vec![ctx as u32; batch]).unwrap();
        let q = g.upload(&pattern(batch * dims.q_row(), 3)).unwrap();
        let gate = g.upload(&pattern(batch * dims.q_row(), 4)).unwrap();
        let mut out = g.zeros::<bf16>(batch * dims.q_row()).unwrap();
        let queries = Queries { q: &q, gate: &gate };
        let cache = PagedCache {
            pools: KvPools { k: &k, v: &v },
            tables: &tab,
            stride: max_blocks,
        };
        let seqs = DecodeLens {
            lens: &lens,
            max_len: span,
            batch,
        };
        let t = time(g, 3, 50, || {
            g.attention_paged_decode(dims, &queries, &cache, &seqs, &mut out)
                .unwrap()
        });
        // The K and V rows of every sequence, read once for all query heads of their group.
        let bytes = batch * ctx * dims.kv_row() * 2 * 2;
        println!(
            "BENCH attn_paged_decode b={batch} ctx={ctx} span={span} hq={} hkv={} d={} bs={bs} bytes={bytes} time_us={:.1} GB/s={:.0}",
            dims.hq,
            dims.hkv,
            dims.head_dim,
            t * 1e6,
            bytes as f64 / t / 1e9
        );
    }
}

#[test]
#[ignore = "timing; run with --ignored on a GPU host"]
fn bench_attention_prefill() {
    let Some(g) = gpu("bench_attention_prefill") else {
        return;
    };
    let dims = ATTN;
    let bs = dims.block_size;
    // One chunk of one sequence: (position of its first query, queries).
    for (pos0, t) in [(0usize, 512usize), (0, 2048), (4096, 512), (0, 8192)] {
        let len = pos0 + t;
        let nb = len.div_ceil(bs);
        let n = nb * bs * dims.kv_row();
        let k = g.upload(&pattern(n, 5)).unwrap();
        let v = g.upload(&pattern(n, 6)).unwrap();
        let table: Vec<u32> = (0..nb as u32).collect();
        let tab = g.upload(&table).unwrap();
        let q = g.upload(&pattern(t * dims.q_row(), 7)).unwrap();
        let gate = g.upload(&pattern(t * dims.q_row(), 8)).unwrap();
        let mut out = g.zeros::<bf16>(t * dims.q_row()).unwrap();
        let queries = Queries { q: &q, gate: &gate };
        let cache = PagedCache {
            pools: KvPools { k: &k, v: &v },
            tables: &tab,
            stride: 0,
        };
        let secs = time(g, 2, 10, || {
            g.attention_paged_prefill(dims, &queries, &cache, ChunkRows { pos0, t }, &mut out)
                .unwrap()
        });
        // K/V rows each query row attends (causal), read once per KV head group.
        let rows: usize = (0..t).map(|r| pos0 + r + 1).sum();
        let bytes = rows * dims.kv_row() * 2 * 2;
        // Two products of 2·head_dim flops per (query, head, visible position).
        let flops = 4 * rows * dims.hq * dims.head_dim;
        println!(
            "BENCH attn_paged_prefill pos0={pos0} t={t} hq={} hkv={} d={} bs={bs} bytes={bytes} time_us={:.1} GB/s={:.0} TFLOP/s={:.1}",
            dims.hq,
            dims.hkv,
            dims.head_dim,
            secs * 1e6,
            bytes as f64 / secs / 1e9,
            flops as f64 / secs / 1e12
        );
    }
}
