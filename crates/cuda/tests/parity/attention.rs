//! Gated attention over the paged cache (decode split-K and causal prefill) against
//! `sanmai_cpu::ops::attention_causal` over the gathered cache, times `sigmoid(gate)`.

use half::bf16;
use sanmai_cpu::ops;
use sanmai_cuda::AttnDims;

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
    ops::attention_causal(q, &kc, &vc, t, len, dims.hq, dims.hkv, d, scale, &mut out);
    out.iter_mut()
        .zip(gate)
        .for_each(|(o, g)| *o *= ops::sigmoid(*g));
    out
}

const SHAPES: [AttnDims; 2] = [
    // Qwen3-Next's full-attention layer, then one without GQA and a head size below a warp multiple.
    AttnDims {
        hq: 16,
        hkv: 2,
        head_dim: 256,
        block_size: 16,
    },
    AttnDims {
        hq: 4,
        hkv: 4,
        head_dim: 72,
        block_size: 32,
    },
];

#[test]
fn attention_paged_decode_matches_cpu() {
    let Some(g) = gpu("attention_paged_decode_matches_cpu") else {
        return;
    };
    let mut rng = Rng::new(50);
    for dims in SHAPES {
        // One short sequence, one inside a split, two spanning several splits (split-K + reduce).
        let lens: Vec<u32> = vec![1, 37, 300, 1100];
        let b = lens.len();
        let bs = dims.block_size;
        let max_len = *lens.iter().max().unwrap() as usize;
        let max_blocks = max_len.div_ceil(bs);
        let num_blocks = b * max_blocks;
        let p = pool(&mut rng, dims, num_blocks);
        let ids = shuffled(&mut rng, num_blocks);
        let table: Vec<u32> = ids.clone(); // sequence i owns ids[i·max_blocks ..]
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
        let (tab, sl) = (g.upload(&table).unwrap(), g.upload(&lens).unwrap());
        let mut out = g.zeros::<bf16>(b * dims.q_row()).unwrap();
        g.attention_paged_decode(
            dims, &q, &gate, &k, &v, &tab, max_blocks, &sl, max_len, &mut out, b,
        )
        .unwrap();
        let got = from_bf16(&g.download(&out).unwrap());
        let AttnDims {
            hq,
            hkv,
            head_dim: d,
            block_size: bs,
        } = dims;
        let shape = format!("b{b}_lens1-1100_hq{hq}_hkv{hkv}_d{d}_bs{bs}");
        check_reduction("attn_paged_decode", &shape, &got, &want);
    }
}

#[test]
fn attention_paged_prefill_matches_cpu() {
    let Some(g) = gpu("attention_paged_prefill_matches_cpu") else {
        return;
    };
    let mut rng = Rng::new(51);
    for dims in SHAPES {
        // A first chunk, then a later chunk whose queries straddle a split boundary.
        for (pos0, t) in [(0usize, 40usize), (300, 70)] {
            let len = pos0 + t;
            let bs = dims.block_size;
            let nb = len.div_ceil(bs);
            let num_blocks = nb + 5; // spare blocks the table does not name
            let p = pool(&mut rng, dims, num_blocks);
            let table: Vec<u32> = shuffled(&mut rng, num_blocks)[..nb].to_vec();
            let (qb, qf) = to_bf16(&rng.normals(t * dims.q_row(), 0.0, 1.0));
            let (gb, gf) = to_bf16(&rng.normals(t * dims.q_row(), 0.0, 2.0));
            let want = reference(&p, &table, dims, &qf, &gf, t, len);

            let (q, gate) = (g.upload(&qb).unwrap(), g.upload(&gb).unwrap());
            let (k, v) = (g.upload(&p.kb).unwrap(), g.upload(&p.vb).unwrap());
            let tab = g.upload(&table).unwrap();
            let mut out = g.zeros::<bf16>(t * dims.q_row()).unwrap();
            g.attention_paged_prefill(dims, &q, &gate, &k, &v, &tab, pos0, t, &mut out)
                .unwrap();
            let got = from_bf16(&g.download(&out).unwrap());
            let AttnDims {
                hq,
                hkv,
                head_dim: d,
                ..
            } = dims;
            let shape = format!("pos0{pos0}_t{t}_hq{hq}_hkv{hkv}_d{d}_bs{bs}");
            check_reduction("attn_paged_prefill", &shape, &got, &want);
        }
    }
}
