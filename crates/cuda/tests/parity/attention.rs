//! Gated attention over the paged cache (decode split-K and causal prefill) against
//! `sanmai_cpu::ops::attention_causal` over the gathered cache, times `sigmoid(gate)`.

use half::bf16;
use sanmai_cpu::ops;
use sanmai_cuda::{AttnDims, ChunkRows, DecodeLens, KvPools, PagedCache, Queries};

use crate::common::{check_reduction, from_bf16, gpu, to_bf16, Rng};

/// A random pool of `num_blocks` blocks (bf16 and its f32 value) for K and V.
struct Pool {
    kb: Vec<bf16>,
    kf: Vec<f32>,
    vb: Vec<bf16>,
    vf: Vec<f32>,
}

fn pool(rng: &mut Rng, dims: AttnDims, num_blocks: usize) -> Pool {
    let n = num_blocks * dims.block_size * dims.kv_row();
    let (kb, kf) = to_bf16(&rng.normals(n, 0.0, 1.0));
    let (vb, vf) = to_bf16(&rng.normals(n, 0.0, 1.0));
    Pool { kb, kf, vb, vf }
}

/// Positions `0..len` of a sequence's blocks, contiguous `[len, hkv·head_dim]`.
fn gather(pool: &[f32], blocks: &[u32], dims: AttnDims, len: usize) -> Vec<f32> {
    let (bs, row) = (dims.block_size, dims.kv_row());
    (0..len)
        .flat_map(|p| {
            let o = (blocks[p / bs] as usize * bs + p % bs) * row;
            pool[o..o + row].iter().copied()
        })
        .collect()
}

/// A random permutation of `0..n` (distinct block ids, scattered over the pool).
fn shuffled(rng: &mut Rng, n: usize) -> Vec<u32> {
    let mut v: Vec<u32> = (0..n as u32).collect();
    for i in (1..n).rev() {
        v.swap(i, rng.below(i as u32 + 1) as usize);
    }
    v
}

/// CPU reference: attention of `t` queries ending at position `len − 1`, times sigmoid(gate).
fn reference(
    p: &Pool,
    blocks: &[u32],
    dims: AttnDims,
    q: &[f32],
    gate: &[f32],
    t: usize,
    len: usize,
) -> Vec<f32> {
    let kc = gather(&p.kf, blocks, dims, len);
    let vc = gather(&p.vf, blocks, dims, len);
    let d = dims.head_dim;
    let mut out = vec![0f32; t * dims.q_row()];
    let scale = (d as f32).powf(-0.5);
    let c = ops::Causal {
        t,
        len,
        heads: ops::Heads {
            hq: dims.hq,
            hkv: dims.hkv,
            d,
            scale,
        },
    };
    ops::attention_causal(q, &kc, &vc, &c, &mut out);
    out.iter_mut()
        .zip(gate)
        .for_each(|(o, g)| *o *= ops::sigmoid(*g));
    out
}

/// The attention shape of `hq` query and `hkv` KV heads of `head_dim` over blocks of `block_size`.
const fn attn_dims(hq: usize, hkv: usize, head_dim: usize, block_size: usize) -> AttnDims {
    AttnDims {
        hq,
        hkv,
        head_dim,
        block_size,
    }
}

const SHAPES: [AttnDims; 5] = [
    // Qwen3-Next's full-attention layer (8 query heads per KV head); qwen4-exp's (12 per KV head: two
    // blocks of 6); one without GQA and a head size of 16-byte chunks below a warp; the tiny configs'
    // head size 32; a head size that is not a multiple of 8 (scalar loads).
    attn_dims(16, 2, 256, 16),
    attn_dims(24, 2, 256, 16),
    attn_dims(4, 4, 72, 32),
    attn_dims(4, 2, 32, 16),
    attn_dims(6, 2, 36, 8),
];

/// One decode launch over sequences of `lens` whose tables hold `span / block_size` ids each (the
/// ids past a sequence's blocks are `u32::MAX`, as a padded table of a recorded step would never be
/// read there), split grid sized by `span`. Returns the GPU output and the CPU reference.
fn decode_case(
    g: &sanmai_cuda::Gpu,
    rng: &mut Rng,
    dims: AttnDims,
    lens: &[u32],
    span: usize,
) -> (Vec<f32>, Vec<f32>) {
    let b = lens.len();
    let bs = dims.block_size;
    let max_blocks = span.div_ceil(bs);
    let used: Vec<usize> = lens.iter().map(|&l| (l as usize).div_ceil(bs)).collect();
    let num_blocks = used.iter().sum::<usize>() + 3; // spare blocks no table names
    let p = pool(rng, dims, num_blocks);
    let ids = shuffled(rng, num_blocks);
    let mut table = vec![u32::MAX; b * max_blocks];
    let mut next = 0;
    for (i, &n) in used.iter().enumerate() {
        table[i * max_blocks..i * max_blocks + n].copy_from_slice(&ids[next..next + n]);
        next += n;
    }
    let (qb, qf) = to_bf16(&rng.normals(b * dims.q_row(), 0.0, 1.0));
    let (gb, gf) = to_bf16(&rng.normals(b * dims.q_row(), 0.0, 2.0));

    let mut want = Vec::new();
    for (i, &len) in lens.iter().enumerate() {
        let r = i * dims.q_row()..(i + 1) * dims.q_row();
        let blocks = &table[i * max_blocks..(i + 1) * max_blocks];
        want.extend(reference(
            &p,
            blocks,
            dims,
            &qf[r.clone()],
            &gf[r],
            1,
            len as usize,
        ));
    }

    let (q, gate) = (g.upload(&qb).unwrap(), g.upload(&gb).unwrap());
    let (k, v) = (g.upload(&p.kb).unwrap(), g.upload(&p.vb).unwrap());
    let (tab, sl) = (g.upload(&table).unwrap(), g.upload(lens).unwrap());
    let mut out = g.zeros::<bf16>(b * dims.q_row()).unwrap();
    let queries = Queries { q: &q, gate: &gate };
    let cache = PagedCache {
        pools: KvPools { k: &k, v: &v },
        tables: &tab,
        stride: max_blocks,
    };
    let seqs = DecodeLens {
        lens: &sl,
        max_len: span,
        batch: b,
    };
    g.attention_paged_decode(dims, &queries, &cache, &seqs, &mut out)
        .unwrap();
    (from_bf16(&g.download(&out).unwrap()), want)
}

fn dims_name(dims: AttnDims) -> String {
    let AttnDims {
        hq,
        hkv,
        head_dim: d,
        block_size: bs,
    } = dims;
    format!("hq{hq}_hkv{hkv}_d{d}_bs{bs}")
}

#[test]
fn attention_paged_decode_matches_cpu() {
    let Some(g) = gpu("attention_paged_decode_matches_cpu") else {
        return;
    };
    let mut rng = Rng::new(50);
    for dims in SHAPES {
        // One short sequence, one inside a split, two spanning several splits (split-K + reduce).
        let lens: Vec<u32> = vec![1, 37, 300, 1100];
        let (got, want) = decode_case(g, &mut rng, dims, &lens, 1100);
        let shape = format!("b4_lens1-1100_{}", dims_name(dims));
        check_reduction("attn_paged_decode", &shape, &got, &want);
    }
}

#[test]
fn attention_paged_decode_span_matches_cpu() {
    let Some(g) = gpu("attention_paged_decode_span_matches_cpu") else {
        return;
    };
    let mut rng = Rng::new(52);
    // Qwen3-Next's layer as a recorded decode step runs it: the split grid sized by the span (4096:
    // 64 splits of at most 64 positions; 8192: 64 of at most 128), each sequence dividing its own
    // length over them (spans of 32 positions up to 2048 of context, then longer, several steps of
    // rows per block), the splits past its length empty.
    let dims = SHAPES[0];
    let cases: [(usize, &[u32]); 12] = [
        (4096, &[1]),
        (4096, &[255]),
        (4096, &[576]),
        (4096, &[4096]),
        (8192, &[1]),
        (8192, &[255]),
        (8192, &[576]),
        (8192, &[4097]),
        (4096, &[576; 8]),
        (4096, &[1, 255, 576, 4096, 576, 2, 1024, 3000]),
        (8192, &[576; 8]),
        (8192, &[1, 255, 576, 4097, 576, 33, 2048, 8192]),
    ];
    for (span, lens) in cases {
        let (got, want) = decode_case(g, &mut rng, dims, lens, span);
        let (lo, hi) = (lens.iter().min().unwrap(), lens.iter().max().unwrap());
        let shape = format!(
            "b{}_lens{lo}-{hi}_span{span}_{}",
            lens.len(),
            dims_name(dims)
        );
        check_reduction("attn_paged_decode", &shape, &got, &want);
    }
}

/// One prefill launch of `t` queries after `pos0` cached positions, the sequence's blocks scattered
/// over a pool with spare blocks the table does not name. Returns the GPU output and the CPU reference.
fn prefill_case(
    g: &sanmai_cuda::Gpu,
    rng: &mut Rng,
    dims: AttnDims,
    pos0: usize,
    t: usize,
) -> (Vec<f32>, Vec<f32>) {
    let len = pos0 + t;
    let nb = len.div_ceil(dims.block_size);
    let num_blocks = nb + 5;
    let p = pool(rng, dims, num_blocks);
    let table: Vec<u32> = shuffled(rng, num_blocks)[..nb].to_vec();
    let (qb, qf) = to_bf16(&rng.normals(t * dims.q_row(), 0.0, 1.0));
    let (gb, gf) = to_bf16(&rng.normals(t * dims.q_row(), 0.0, 2.0));
    let want = reference(&p, &table, dims, &qf, &gf, t, len);

    let (q, gate) = (g.upload(&qb).unwrap(), g.upload(&gb).unwrap());
    let (k, v) = (g.upload(&p.kb).unwrap(), g.upload(&p.vb).unwrap());
    let tab = g.upload(&table).unwrap();
    let mut out = g.zeros::<bf16>(t * dims.q_row()).unwrap();
    let queries = Queries { q: &q, gate: &gate };
    let cache = PagedCache {
        pools: KvPools { k: &k, v: &v },
        tables: &tab,
        stride: 0,
    };
    g.attention_paged_prefill(dims, &queries, &cache, ChunkRows { pos0, t }, &mut out)
        .unwrap();
    (from_bf16(&g.download(&out).unwrap()), want)
}

#[test]
fn attention_paged_prefill_matches_cpu() {
    let Some(g) = gpu("attention_paged_prefill_matches_cpu") else {
        return;
    };
    let mut rng = Rng::new(51);
    for dims in SHAPES {
        // A first chunk, then a later chunk whose queries straddle a split boundary, then a long one
        // (rows of several splits of up to 256 positions, several steps of rows per block).
        for (pos0, t) in [(0usize, 40usize), (300, 70), (600, 160)] {
            let (got, want) = prefill_case(g, &mut rng, dims, pos0, t);
            let shape = format!("pos0{pos0}_t{t}_{}", dims_name(dims));
            check_reduction("attn_paged_prefill", &shape, &got, &want);
        }
    }
}

/// Head sizes the tensor-core prefill kernel takes, with the GQA ratios of the models: Qwen3-Next
/// (8 query heads per KV head) and qwen4-exp (12: row tiles straddle queries) at 256, ratio 2 at
/// 256, 128 at ratios 8 and 2, ratio 3 at 64, the tiny fixtures' 32.
const MMA_SHAPES: [AttnDims; 7] = [
    attn_dims(16, 2, 256, 16),
    attn_dims(24, 2, 256, 16),
    attn_dims(4, 2, 256, 16),
    attn_dims(16, 2, 128, 16),
    attn_dims(8, 4, 128, 32),
    attn_dims(6, 2, 64, 8),
    attn_dims(4, 2, 32, 16),
];

#[test]
fn attention_paged_prefill_mma_matches_cpu() {
    let Some(g) = gpu("attention_paged_prefill_mma_matches_cpu") else {
        return;
    };
    let mut rng = Rng::new(53);
    for (si, dims) in MMA_SHAPES.into_iter().enumerate() {
        // First chunks around the 16-row MMA and 64-row tile edges and past several key tiles; later
        // chunks after a cached prefix: one off the tile grid, short ones after a long prefix (the
        // context split over spans, merged by the reduce) and, for the two real GQA-8 shapes, a long
        // chunk after 4096 positions.
        let mut cases = vec![
            (0usize, 1usize),
            (0, 15),
            (0, 16),
            (0, 17),
            (0, 64),
            (0, 100),
            (0, 512),
            (0, 700),
            (33, 70),
            (1000, 17),
            (3000, 5),
        ];
        if si == 0 || si == 3 {
            cases.extend([(4096, 512), (5000, 1)]);
        }
        for (pos0, t) in cases {
            let (got, want) = prefill_case(g, &mut rng, dims, pos0, t);
            let shape = format!("pos0{pos0}_t{t}_{}", dims_name(dims));
            check_reduction("attn_paged_prefill", &shape, &got, &want);
        }
    }
}
