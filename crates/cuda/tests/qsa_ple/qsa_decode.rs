//! QSA's decode form on the device against the CPU oracle: the one-query-per-sequence scores and
//! selection over paged index keys, and the gathered decode attention.

use super::qsa::{bits_differing, cpu_attend_rows_at, query_prep, selected, write_keys};
use super::*;
use sanmai_cuda::Gpu;

/// One case of the decode forms: a query per sequence (contexts `ctxs`), `topk`, the indexer's `ni`
/// heads of `di` (head weights drawn at `weight_scale`: 0 makes every score 0, so the selection is
/// the last topk positions by the tie rule), score rows of `span` positions, attention heads
/// `hq`/`hkv` of `d`.
struct DecodeCase {
    ctxs: Vec<usize>,
    topk: usize,
    ni: usize,
    di: usize,
    span: usize,
    hq: usize,
    hkv: usize,
    d: usize,
    weight_scale: f32,
}

/// The decode forms of the scan, the top-k and the gathered attention on one case against the CPU
/// oracle; returns the score bits and sets that differ (the attention is checked within 1e-2).
fn check_decode(b: &CudaBackend, rng: &mut Rng, c: &DecodeCase) -> usize {
    let (bs, rot) = (16, c.di / 2);
    let (n, di, ni, topk, span) = (c.ctxs.len(), c.di, c.ni, c.topk, c.span);
    let row = di + 2;
    let stride = span / bs;
    // Each sequence's blocks out of one shuffled pool; table rows padded with zeros to the stride.
    let nbs: Vec<usize> = c.ctxs.iter().map(|x| x.div_ceil(bs)).collect();
    let total: usize = nbs.iter().sum();
    let mut perm: Vec<u32> = (0..total as u32).collect();
    for i in (1..total).rev() {
        perm.swap(i, rng.below(i + 1));
    }
    let mut tables = vec![0u32; n * stride];
    let mut pool = vec![0u8; total * bs * row];
    let mut keys: Vec<Vec<f32>> = Vec::new();
    let mut at_block = 0;
    for (r, &ctx) in c.ctxs.iter().enumerate() {
        let mine = &perm[at_block..at_block + nbs[r]];
        at_block += nbs[r];
        tables[r * stride..r * stride + mine.len()].copy_from_slice(mine);
        let ik = rng.bf16s(ctx * di, 0.0, 1.0);
        let pos: Vec<u32> = (0..ctx as u32).collect();
        let (lin, cpu_e) = write_keys(b, &ik, &pos, di, rot, rng);
        for p in 0..ctx {
            let at = (mine[p / bs] as usize * bs + p % bs) * row;
            pool[at..at + row].copy_from_slice(&lin[p * row..(p + 1) * row]);
        }
        let mut k = vec![0f32; ctx * di];
        for (e, k) in cpu_e.chunks_exact(row).zip(k.chunks_exact_mut(di)) {
            cpu::dequantize_index_key(e, k);
        }
        keys.push(k);
    }
    let g = b.gpu();
    let lens: Vec<u32> = c.ctxs.iter().map(|&x| x as u32).collect();
    let (pool_d, tables_d, lens_d) = (
        g.upload(&pool).unwrap(),
        g.upload(&tables).unwrap(),
        g.upload(&lens).unwrap(),
    );
    let iq = rng.bf16s(n * ni * di, 0.0, 1.0);
    let iw = rng.bf16s(n * ni, 0.0, c.weight_scale);
    let qpos: Vec<u32> = c.ctxs.iter().map(|&x| x as u32 - 1).collect();
    let f = inv_freq(rot, 1e7);
    let fd = g.upload(&f).unwrap();
    let mut qi = g.zeros::<f32>(n * ni * di).unwrap();
    let mut wts = g.zeros::<f32>(n * ni).unwrap();
    let head_scale = (ni as f32).powf(-0.5) * (di as f32).powf(-0.5);
    let heads = IndexHeads {
        n_heads: ni,
        head_dim: di,
    };
    query_prep(b, (&iq, &iw), (&qpos, &fd, rot), heads, (&mut qi, &mut wts));
    let mut scores = g.zeros::<f32>(n * span).unwrap();
    let mut sel = g.zeros::<u32>(n * topk).unwrap();
    let mut counts = g.zeros::<u32>(n).unwrap();
    let queries = IndexQueries {
        qi: &qi,
        wts: &wts,
        heads,
        rows: n,
    };
    let cache = IndexCache {
        pool: &pool_d,
        tables: &tables_d,
        stride,
        block_size: bs,
    };
    g.qsa_scores_decode(&queries, &cache, &lens_d, topk, &mut scores, span)
        .unwrap();
    let rows = ScoreRows {
        scores: &scores,
        ld: span,
        rows: n,
    };
    let mut work = g.zeros::<u32>(Gpu::qsa_topk_decode_work(n, span)).unwrap();
    g.qsa_topk_decode(&rows, &lens_d, topk, (&mut sel, &mut counts), &mut work)
        .unwrap();
    // The gathered attention over the selections, K/V through the same tables.
    let (hq, hkv, d) = (c.hq, c.hkv, c.d);
    let kv_row = hkv * d;
    let kp = rng.bf16s(total * bs * kv_row, 0.0, 1.0);
    let vp = rng.bf16s(total * bs * kv_row, 0.0, 1.0);
    let q = rng.bf16s(n * hq * d, 0.0, 1.0);
    let gate = rng.bf16s(n * hq * d, 0.0, 1.0);
    let mut out = g.zeros::<bf16>(n * hq * d).unwrap();
    let dims = AttnDims {
        hq,
        hkv,
        head_dim: d,
        block_size: bs,
    };
    let (qd, gd) = (to_dev(b, &q), to_dev(b, &gate));
    let (kd, vd) = (to_dev(b, &kp), to_dev(b, &vp));
    let cache = PagedCache {
        pools: KvPools { k: &kd, v: &vd },
        tables: &tables_d,
        stride,
    };
    let selection = Selection {
        sel: &sel,
        stride: topk,
        counts: &counts,
        max_count: topk,
        rows: n,
    };
    let queries = Queries { q: &qd, gate: &gd };
    g.qsa_attention_gather_decode(dims, &queries, &cache, &selection, &mut out)
        .unwrap();
    let (scores, sel, counts) = (
        g.download(&scores).unwrap(),
        g.download(&sel).unwrap(),
        g.download(&counts).unwrap(),
    );
    let got_out: Vec<f32> = g
        .download(&out)
        .unwrap()
        .iter()
        .map(|x| x.to_f32())
        .collect();
    let mut want_out = vec![0f32; n * hq * d];
    let (mut score_diff, mut set_diff) = (0, 0);
    for (r, &ctx) in c.ctxs.iter().enumerate() {
        let mut qh = iq[r * ni * di..(r + 1) * ni * di].to_vec();
        cpu::rope_neox(&mut qh, ni, di, rot, &[(ctx - 1) as u32], &f, 1.0);
        let w: Vec<f32> = iw[r * ni..(r + 1) * ni]
            .iter()
            .map(|x| x * head_scale)
            .collect();
        let mut want = vec![0f32; ctx];
        cpu::index_scores(&qh, &w, &keys[r], di, &mut want);
        if ctx > topk {
            // Rows within topk are not scored: every position is selected.
            score_diff += bits_differing(&want, &scores[r * span..r * span + ctx]);
        }
        let want_sel = cpu::topk_positions(&want, topk);
        let got = selected(&sel, &counts, topk, r);
        if got != want_sel {
            set_diff += 1;
        }
        let rows = want_sel
            .iter()
            .map(|&p| (tables[r * stride + p / bs] as usize * bs + p % bs) * kv_row);
        let at = r * hq * d..(r + 1) * hq * d;
        let (qr, gr) = (&q[at.clone()], &gate[at.clone()]);
        cpu_attend_rows_at(
            qr,
            gr,
            rows,
            (&kp, &vp, kv_row),
            (hq, hkv, d),
            &mut want_out[at],
        );
    }
    let rel = max_rel(&got_out, &want_out);
    println!(
        "PARITY op=qsa_decode shape=ctx{:?}_topk{topk}_nI{ni}_dI{di}_span{span}_hq{hq}_hkv{hkv}_d{d} score_bits_differing={score_diff} sets_differing={set_diff} attention_max_rel={rel:.2e} tol=exact,1e-2",
        c.ctxs
    );
    assert!(rel <= 1e-2, "decode gathered attention off by {rel}");
    score_diff + set_diff
}

#[test]
fn decode_select_matches_cpu() {
    let Some(b) = backend("decode_select_matches_cpu") else {
        return;
    };
    let mut rng = Rng::new(6);
    let cases = [
        // The tiny fixtures' indexer; contexts below, at and just past topk.
        DecodeCase {
            ctxs: vec![5, 32, 33, 300],
            topk: 32,
            ni: 4,
            di: 16,
            span: 4096,
            hq: 4,
            hkv: 2,
            d: 32,
            weight_scale: 1.0,
        },
        // The full-size indexer (topk 2048, 16 heads of 64), one long context.
        DecodeCase {
            ctxs: vec![2048, 2049, 70_000, 100, 5000],
            topk: 2048,
            ni: 16,
            di: 64,
            span: 131_072,
            hq: 16,
            hkv: 2,
            d: 256,
            weight_scale: 1.0,
        },
        // Every score 0: the wide form's candidates are the whole context.
        DecodeCase {
            ctxs: vec![3000, 20_000],
            topk: 2048,
            ni: 16,
            di: 64,
            span: 32_768,
            hq: 16,
            hkv: 2,
            d: 256,
            weight_scale: 0.0,
        },
        // A small topk over a span the wide form takes, with rows below and at topk beside it.
        DecodeCase {
            ctxs: vec![40_000, 33, 5],
            topk: 32,
            ni: 4,
            di: 16,
            span: 40_960,
            hq: 4,
            hkv: 2,
            d: 32,
            weight_scale: 1.0,
        },
        // topk past the wide form's limit: one block a row.
        DecodeCase {
            ctxs: vec![9000, 4000],
            topk: 5000,
            ni: 4,
            di: 16,
            span: 16_384,
            hq: 4,
            hkv: 2,
            d: 32,
            weight_scale: 1.0,
        },
        // Odd sizes; a single sequence.
        DecodeCase {
            ctxs: vec![1001],
            topk: 100,
            ni: 3,
            di: 24,
            span: 1024,
            hq: 6,
            hkv: 3,
            d: 40,
            weight_scale: 1.0,
        },
    ];
    let bad: usize = cases.iter().map(|c| check_decode(&b, &mut rng, c)).sum();
    assert_eq!(
        bad, 0,
        "decode scores or selected sets differ from the CPU's"
    );
}
