//! `bench_qsa_select` (ignored; `--ignored` runs it): the 125B shape's lightning-indexer selection
//! (nI 16, dI 64, topk 2048) at contexts of 8,192, 65,536 and 245,760 positions: the prefill scores
//! and top-k of a group of query rows at the end of the context (the group the backend takes: its
//! score budget over the context, at most 1,024 rows), and the decode form for one row. Prints
//! `BENCH qsa_select ...` lines, with the whole-prompt estimate `per row × ctx / 2 × QSA layers`.

use super::qsa::{cpu_entries, query_prep};
use super::*;
use sanmai_cuda::Gpu;

/// The backend's score scratch per group of query rows, in f32 values.
const SCORE_BUDGET: usize = 32 << 20;

#[test]
#[ignore = "timing; run with --ignored on a GPU host"]
fn bench_qsa_select() {
    let Some(b) = backend("bench_qsa_select") else {
        return;
    };
    let g = b.gpu();
    let super::Q125 {
        topk,
        qsa_layers,
        ni,
        di,
        ..
    } = super::q125();
    let (bs, rot, max_ctx) = (16usize, di / 2, 245_760usize);
    let mut rng = Rng::new(11);
    let ik = rng.bf16s(max_ctx * di, 0.0, 1.0);
    let pos: Vec<u32> = (0..max_ctx as u32).collect();
    let f = inv_freq(rot, 1e7);
    let (w, bias) = (rng.bf16s(di, 1.0, 0.3), rng.bf16s(di, 0.0, 0.2));
    let pool = g
        .upload(&cpu_entries(&ik, &w, &bias, &pos, di, rot, &f))
        .unwrap();
    let table = g
        .upload(&(0..(max_ctx / bs) as u32).collect::<Vec<_>>())
        .unwrap();
    let fd = g.upload(&f).unwrap();
    let heads = IndexHeads {
        n_heads: ni,
        head_dim: di,
    };
    for ctx in [8_192usize, 65_536, max_ctx] {
        let n = (SCORE_BUDGET / ctx).clamp(1, 1024);
        let pos0 = ctx - n;
        let iq = rng.bf16s(n * ni * di, 0.0, 1.0);
        let iw = rng.bf16s(n * ni, 0.0, 1.0);
        let qpos: Vec<u32> = (pos0..ctx).map(|p| p as u32).collect();
        let mut qi = g.zeros::<f32>(n * ni * di).unwrap();
        let mut wts = g.zeros::<f32>(n * ni).unwrap();
        query_prep(
            &b,
            (&iq, &iw),
            (&qpos, &fd, rot),
            heads,
            (&mut qi, &mut wts),
        );
        let queries = IndexQueries {
            qi: &qi,
            wts: &wts,
            heads,
            rows: n,
        };
        let keys = IndexCache {
            pool: &pool,
            tables: &table,
            stride: 0,
            block_size: bs,
        };
        let mut scores = g.zeros::<f32>(n * ctx).unwrap();
        let t_scores = time(g, 1, 3, |_| {
            g.qsa_scores(&queries, &keys, pos0, &mut scores, ctx)
                .unwrap()
        });
        let mut sel = g.zeros::<u32>(n * topk).unwrap();
        let mut counts = g.zeros::<u32>(n).unwrap();
        let rows = ScoreRows {
            scores: &scores,
            ld: ctx,
            rows: n,
        };
        let t_topk = time(g, 1, 3, |_| {
            g.qsa_topk(&rows, pos0, topk, &mut sel, &mut counts)
                .unwrap()
        });
        // The decode form: the group's last row as the one query of a sequence of ctx positions.
        let one = IndexQueries {
            qi: &qi.slice((n - 1) * ni * di..),
            wts: &wts.slice((n - 1) * ni..),
            heads,
            rows: 1,
        };
        let dec_keys = IndexCache {
            pool: &pool,
            tables: &table,
            stride: max_ctx / bs,
            block_size: bs,
        };
        let lens = g.upload(&[ctx as u32]).unwrap();
        let mut dscores = g.zeros::<f32>(ctx).unwrap();
        let t_dscores = time(g, 2, 20, |_| {
            g.qsa_scores_decode(&one, &dec_keys, &lens, topk, &mut dscores, ctx)
                .unwrap()
        });
        let drows = ScoreRows {
            scores: &dscores,
            ld: ctx,
            rows: 1,
        };
        let mut work = g.zeros::<u32>(Gpu::qsa_topk_decode_work(1, ctx)).unwrap();
        let t_dtopk = time(g, 2, 20, |_| {
            g.qsa_topk_decode(&drows, &lens, topk, (&mut sel, &mut counts), &mut work)
                .unwrap()
        });
        let per_row = (t_scores + t_topk) / n as f64;
        println!(
            "BENCH qsa_select ctx={ctx} rows={n} scores_ms={:.3} topk_ms={:.3} per_row_us={:.2} \
             decode_scores_us={:.1} decode_topk_us={:.1} est_prompt_s={:.1} (per row x ctx/2 x {qsa_layers} layers)",
            t_scores * 1e3,
            t_topk * 1e3,
            per_row * 1e6,
            t_dscores * 1e6,
            t_dtopk * 1e6,
            per_row * (ctx / 2) as f64 * qsa_layers as f64,
        );
    }
}
