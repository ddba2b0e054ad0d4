//! QSA on the device against the CPU oracle: the index-key write, scores, top-k selection and gathered
//! attention (prefill and decode forms), and the backend's `qsa_attention`.

use super::*;

/// CPU index-key entries of `ik` `[rows, di]` (bf16 values) at `pos`.
pub(super) fn cpu_entries(
    ik: &[f32],
    w: &[f32],
    b: &[f32],
    pos: &[u32],
    di: usize,
    rot: usize,
    f: &[f32],
) -> Vec<u8> {
    let mut k = ik.to_vec();
    cpu::layer_norm(&mut k, w, b, di, 1e-6);
    if rot > 0 {
        cpu::rope_neox(&mut k, 1, di, rot, pos, f, 1.0);
    }
    let mut out = vec![0u8; pos.len() * (di + 2)];
    for (r, e) in k.chunks_exact(di).zip(out.chunks_exact_mut(di + 2)) {
        cpu::quantize_index_key(r, e);
    }
    out
}

/// Index keys of `rows` positions written by the device into an identity-mapped pool; also returns the
/// CPU's entries.
pub(super) fn write_keys(
    b: &CudaBackend,
    ik: &[f32],
    pos: &[u32],
    di: usize,
    rot: usize,
    rng: &mut Rng,
) -> (Vec<u8>, Vec<u8>) {
    let dst: Vec<u32> = (0..pos.len() as u32).collect();
    write_keys_at(b, ik, pos, (&dst, pos.len()), di, rot, rng)
}

/// Index keys of the rows of `ik` at `pos` written by the device to pool rows `dst` of a pool of
/// `pool_rows` rows first filled with 0xA5 (a `dst` past the pool is skipped): the pool, and the CPU's
/// entries of the rows (`[rows, di + 2]`).
fn write_keys_at(
    b: &CudaBackend,
    ik: &[f32],
    pos: &[u32],
    (dst, pool_rows): (&[u32], usize),
    di: usize,
    rot: usize,
    rng: &mut Rng,
) -> (Vec<u8>, Vec<u8>) {
    let rows = pos.len();
    let w = rng.bf16s(di, 1.0, 0.3);
    let bias = rng.bf16s(di, 0.0, 0.2);
    let f = inv_freq(rot, 1e7);
    let g = b.gpu();
    let fd = g
        .upload(if f.is_empty() { &[0.0f32][..] } else { &f })
        .unwrap();
    let pd = g.upload(pos).unwrap();
    let dd = g.upload(dst).unwrap();
    let mut pool = g.upload(&vec![0xA5u8; pool_rows * (di + 2)]).unwrap();
    let (wd, bd) = (to_dev(b, &w), to_dev(b, &bias));
    let norm = KeyNorm {
        w: &wd,
        b: &bd,
        eps: 1e-6,
        dim: di,
    };
    let rope = RopeArgs {
        positions: &pd,
        inv_freq: &fd,
        rot_dim: rot,
        mscale: 1.0,
    };
    g.qsa_index_key_write(&to_dev(b, ik), &norm, &rope, &dd, &mut pool, rows)
        .unwrap();
    let got = g.download(&pool).unwrap();
    (got, cpu_entries(ik, &w, &bias, pos, di, rot, &f))
}

#[test]
fn index_key_bytes_match_cpu() {
    let Some(b) = backend("index_key_bytes_match_cpu") else {
        return;
    };
    let mut rng = Rng::new(1);
    // Row r goes to pool row spread·(rows − 1 − r) of a pool of `rows` rows: with spread 2 every other
    // pool row stays untouched and the first half of the rows lies past the pool (skipped).
    for (rows, di, rot, spread) in [
        (37, 64, 32, 1),
        (300, 16, 8, 1),
        (5, 128, 128, 1),
        (64, 64, 0, 1),
        (40, 64, 32, 2),
        (7, 24, 12, 2),
        (9, 256, 64, 2),
        (3, 2, 2, 2),
        (1, 64, 64, 1),
    ] {
        let mut ik = Vec::new();
        for r in 0..rows {
            // Scales from tiny to huge, and an all-zero row (scale 1 after LayerNorm's bias).
            let scale = [1.0, 1e-4, 30.0, 1e3, 0.0][r % 5];
            ik.extend(rng.bf16s(di, 0.1, scale));
        }
        let pos: Vec<u32> = (0..rows).map(|_| rng.below(262_144) as u32).collect();
        let dst: Vec<u32> = (0..rows)
            .map(|r| (spread * (rows - 1 - r)) as u32)
            .collect();
        let (got, entries) = write_keys_at(&b, &ik, &pos, (&dst, rows), di, rot, &mut rng);
        let row = di + 2;
        let mut want = vec![0xA5u8; rows * row];
        for (&d, e) in dst.iter().zip(entries.chunks_exact(row)) {
            if (d as usize) < rows {
                want[d as usize * row..(d as usize + 1) * row].copy_from_slice(e);
            }
        }
        let diff = got.iter().zip(&want).filter(|(a, b)| a != b).count();
        println!(
            "PARITY op=qsa_index_key shape=rows{rows}_dI{di}_rot{rot}_spread{spread} bytes={} differing={diff} tol=exact",
            got.len()
        );
        assert_eq!(diff, 0, "index-key bytes differ (rows {rows}, dI {di})");
    }
}

#[test]
fn query_prep_matches_cpu() {
    let Some(b) = backend("query_prep_matches_cpu") else {
        return;
    };
    let g = b.gpu();
    let mut rng = Rng::new(4);
    for (rows, ni, di, rot) in [
        (1, 16, 64, 64),
        (1, 16, 64, 32),
        (9, 4, 128, 64),
        (3, 3, 24, 8),
        (5, 2, 64, 0),
        (2, 1, 256, 256),
        (70, 16, 16, 16),
    ] {
        let iq = rng.bf16s(rows * ni * di, 0.0, 1.0);
        let iw = rng.bf16s(rows * ni, 0.0, 1.0);
        let qpos: Vec<u32> = (0..rows).map(|_| rng.below(262_144) as u32).collect();
        let f = inv_freq(rot, 1e7);
        let fd = g
            .upload(if f.is_empty() { &[0.0f32][..] } else { &f })
            .unwrap();
        let mut qi = g.zeros::<f32>(rows * ni * di).unwrap();
        let mut wts = g.zeros::<f32>(rows * ni).unwrap();
        let heads = IndexHeads {
            n_heads: ni,
            head_dim: di,
        };
        query_prep(
            &b,
            (&iq, &iw),
            (&qpos, &fd, rot),
            heads,
            (&mut qi, &mut wts),
        );
        let mut want_q = iq.clone();
        cpu::rope_neox(&mut want_q, ni, di, rot, &qpos, &f, 1.0);
        let head_scale = (ni as f32).powf(-0.5) * (di as f32).powf(-0.5);
        let want_w: Vec<f32> = iw.iter().map(|x| x * head_scale).collect();
        let diff = bits_differing(&want_q, &g.download(&qi).unwrap())
            + bits_differing(&want_w, &g.download(&wts).unwrap());
        println!(
            "PARITY op=qsa_query_prep shape=rows{rows}_nI{ni}_dI{di}_rot{rot} bits_differing={diff} tol=exact"
        );
        assert_eq!(
            diff, 0,
            "indexer queries differ (nI {ni}, dI {di}, rot {rot})"
        );
    }
}

/// How many elements of `a` and `b` differ in their bits.
pub(super) fn bits_differing(a: &[f32], b: &[f32]) -> usize {
    a.iter()
        .zip(b)
        .filter(|(a, b)| a.to_bits() != b.to_bits())
        .count()
}

/// Row `r`'s selected positions: the first `counts[r]` of its `topk` slots in `sel`.
pub(super) fn selected(sel: &[u32], counts: &[u32], topk: usize, r: usize) -> Vec<usize> {
    sel[r * topk..r * topk + counts[r] as usize]
        .iter()
        .map(|&x| x as usize)
        .collect()
}

/// How a selection case draws its keys and weights.
#[derive(Clone, Copy, PartialEq)]
enum Draw {
    /// Distinct random keys at their own positions, random weights.
    Random,
    /// Only 7 distinct key rows, all at one position: equal scores abound.
    Ties,
    /// Zero weights: every score is 0.
    ZeroWeights,
}

/// A selection case: `n_rows` queries at the end of a `ctx`-position sequence keeping `topk`
/// positions, with `ni` index heads of `di` values.
struct SelectCase {
    ctx: usize,
    n_rows: usize,
    topk: usize,
    ni: usize,
    di: usize,
    draw: Draw,
}

/// The device's scores and selections for case `s`; returns the count of differing scores and sets.
fn check_select(b: &CudaBackend, rng: &mut Rng, s: &SelectCase) -> usize {
    let &SelectCase {
        ctx,
        n_rows,
        topk,
        ni,
        di,
        draw,
    } = s;
    let (ties, zero_weights) = (draw == Draw::Ties, draw == Draw::ZeroWeights);
    let (rot, bs) = (di / 2, 16);
    // Keys: with `ties`, only 7 distinct rows repeated, so equal scores abound.
    let distinct = if ties { 7 } else { ctx };
    let base = rng.bf16s(distinct * di, 0.0, 1.0);
    let ik: Vec<f32> = (0..ctx)
        .flat_map(|p| base[(p % distinct) * di..(p % distinct + 1) * di].to_vec())
        .collect();
    let pos: Vec<u32> = if ties {
        vec![0; ctx] // one position: equal rows give equal entries
    } else {
        (0..ctx as u32).collect()
    };
    let nb = ctx.div_ceil(bs);
    // The pool in a shuffled block order: entry of position p at block perm[p / bs].
    let mut perm: Vec<u32> = (0..nb as u32).collect();
    for i in (1..nb).rev() {
        perm.swap(i, rng.below(i + 1));
    }
    let (lin, cpu_e) = write_keys(b, &ik, &pos, di, rot, rng);
    let row = di + 2;
    let mut pool = vec![0u8; nb * bs * row];
    for p in 0..ctx {
        let at = (perm[p / bs] as usize * bs + p % bs) * row;
        pool[at..at + row].copy_from_slice(&lin[p * row..(p + 1) * row]);
    }
    let g = b.gpu();
    let pool_d = g.upload(&pool).unwrap();
    let table = g.upload(&perm).unwrap();
    let iq = rng.bf16s(n_rows * ni * di, 0.0, 1.0);
    // With `zero_weights` every score is 0: the selection is the last topk positions.
    let iw = rng.bf16s(n_rows * ni, 0.0, if zero_weights { 0.0 } else { 1.0 });
    let pos0 = ctx - n_rows;
    let qpos: Vec<u32> = (pos0..ctx).map(|p| p as u32).collect();
    let f = inv_freq(rot, 1e7);
    let fd = g.upload(&f).unwrap();
    let mut qi = g.zeros::<f32>(n_rows * ni * di).unwrap();
    let mut wts = g.zeros::<f32>(n_rows * ni).unwrap();
    let head_scale = (ni as f32).powf(-0.5) * (di as f32).powf(-0.5);
    let heads = IndexHeads {
        n_heads: ni,
        head_dim: di,
    };
    query_prep(b, (&iq, &iw), (&qpos, &fd, rot), heads, (&mut qi, &mut wts));
    let ld = ctx;
    let mut scores = g.zeros::<f32>(n_rows * ld).unwrap();
    let queries = IndexQueries {
        qi: &qi,
        wts: &wts,
        heads,
        rows: n_rows,
    };
    let keys = IndexCache {
        pool: &pool_d,
        tables: &table,
        stride: 0,
        block_size: bs,
    };
    g.qsa_scores(&queries, &keys, pos0, &mut scores, ld)
        .unwrap();
    let mut sel = g.zeros::<u32>(n_rows * topk).unwrap();
    let mut counts = g.zeros::<u32>(n_rows).unwrap();
    let rows = ScoreRows {
        scores: &scores,
        ld,
        rows: n_rows,
    };
    g.qsa_topk(&rows, pos0, topk, &mut sel, &mut counts)
        .unwrap();
    let (scores, sel, counts) = (
        g.download(&scores).unwrap(),
        g.download(&sel).unwrap(),
        g.download(&counts).unwrap(),
    );
    // The CPU oracle from its own entries.
    let mut keys = vec![0f32; ctx * di];
    for (e, k) in cpu_e.chunks_exact(row).zip(keys.chunks_exact_mut(di)) {
        cpu::dequantize_index_key(e, k);
    }
    let (mut score_diff, mut set_diff) = (0, 0);
    for r in 0..n_rows {
        let c = pos0 + r + 1;
        let mut q = iq[r * ni * di..(r + 1) * ni * di].to_vec();
        cpu::rope_neox(&mut q, ni, di, rot, &[(pos0 + r) as u32], &f, 1.0);
        let w: Vec<f32> = iw[r * ni..(r + 1) * ni]
            .iter()
            .map(|x| x * head_scale)
            .collect();
        let mut want = vec![0f32; c];
        cpu::index_scores(&q, &w, &keys[..c * di], di, &mut want);
        score_diff += bits_differing(&want, &scores[r * ld..r * ld + c]);
        let want_sel = cpu::topk_positions(&want, topk);
        let got = selected(&sel, &counts, topk, r);
        if got != want_sel {
            set_diff += 1;
        }
    }
    println!(
        "PARITY op=qsa_scores_topk shape=ctx{ctx}_rows{n_rows}_topk{topk}_nI{ni}_dI{di}{}{} score_bits_differing={score_diff} sets_differing={set_diff} tol=exact",
        if ties { "_ties" } else { "" },
        if zero_weights { "_zero_scores" } else { "" }
    );
    score_diff + set_diff
}

#[test]
fn scores_and_topk_match_cpu() {
    let Some(b) = backend("scores_and_topk_match_cpu") else {
        return;
    };
    let mut rng = Rng::new(2);
    let mut bad = 0;
    for (ctx, n_rows, topk, ni, di, draw) in [
        (300, 300, 32, 4, 16, Draw::Random),
        (5000, 8, 256, 16, 64, Draw::Random),
        (70_000, 3, 2048, 16, 64, Draw::Random),
        (3000, 4, 100, 16, 64, Draw::Ties),
        (3000, 2, 100, 4, 32, Draw::ZeroWeights),
        (40, 40, 64, 4, 16, Draw::Random),
        (2000, 13, 128, 8, 128, Draw::Random),
        (500, 5, 64, 4, 24, Draw::Random),
    ] {
        let s = SelectCase {
            ctx,
            n_rows,
            topk,
            ni,
            di,
            draw,
        };
        bad += check_select(&b, &mut rng, &s);
    }
    assert_eq!(bad, 0, "scores or selected sets differ from the CPU's");
}

#[test]
fn gathered_attention_matches_cpu() {
    let Some(b) = backend("gathered_attention_matches_cpu") else {
        return;
    };
    let g = b.gpu();
    let mut rng = Rng::new(3);
    for (hq, hkv, d, ctx, n_rows, topk) in [
        (4usize, 2usize, 32usize, 300usize, 5usize, 32usize),
        (16, 2, 256, 5000, 3, 2048),
        (8, 8, 128, 1000, 4, 700),
        // Head groups: 12 heads of a KV head in two blocks; 17 in three of 6, 6 and 5 with a head
        // size the 16-byte loads do not take.
        (24, 2, 256, 3000, 2, 2048),
        (17, 1, 20, 400, 3, 100),
    ] {
        let bs = 16;
        let nb = ctx.div_ceil(bs);
        let row = hkv * d;
        let kp = rng.bf16s(nb * bs * row, 0.0, 1.0);
        let vp = rng.bf16s(nb * bs * row, 0.0, 1.0);
        let mut perm: Vec<u32> = (0..nb as u32).collect();
        for i in (1..nb).rev() {
            perm.swap(i, rng.below(i + 1));
        }
        let q = rng.bf16s(n_rows * hq * d, 0.0, 1.0);
        let gate = rng.bf16s(n_rows * hq * d, 0.0, 1.0);
        let mut sel = vec![0u32; n_rows * topk];
        let mut counts = vec![0u32; n_rows];
        for r in 0..n_rows {
            let mut all: Vec<u32> = (0..ctx as u32).collect();
            for i in (1..ctx).rev() {
                all.swap(i, rng.below(i + 1));
            }
            let n = topk - r; // different counts per row
            let mut pick = all[..n].to_vec();
            pick.sort_unstable();
            sel[r * topk..r * topk + n].copy_from_slice(&pick);
            counts[r] = n as u32;
        }
        let mut out = g.zeros::<bf16>(n_rows * hq * d).unwrap();
        let dims = AttnDims {
            hq,
            hkv,
            head_dim: d,
            block_size: bs,
        };
        let (qd, gd) = (to_dev(&b, &q), to_dev(&b, &gate));
        let (kd, vd) = (to_dev(&b, &kp), to_dev(&b, &vp));
        let table = g.upload(&perm).unwrap();
        let (sel_d, counts_d) = (g.upload(&sel).unwrap(), g.upload(&counts).unwrap());
        let cache = PagedCache {
            pools: KvPools { k: &kd, v: &vd },
            tables: &table,
            stride: 0,
        };
        let selection = Selection {
            sel: &sel_d,
            stride: topk,
            counts: &counts_d,
            max_count: topk,
            rows: n_rows,
        };
        let queries = Queries { q: &qd, gate: &gd };
        g.qsa_attention_gather(dims, &queries, &cache, &selection, &mut out)
            .unwrap();
        let got: Vec<f32> = g
            .download(&out)
            .unwrap()
            .iter()
            .map(|x| x.to_f32())
            .collect();
        let mut want = vec![0f32; n_rows * hq * d];
        for r in 0..n_rows {
            let n = counts[r] as usize;
            let rows = sel[r * topk..r * topk + n]
                .iter()
                .map(|&p| (perm[p as usize / bs] as usize * bs + p as usize % bs) * row);
            let at = r * hq * d..(r + 1) * hq * d;
            let (qr, gr) = (&q[at.clone()], &gate[at.clone()]);
            cpu_attend_rows_at(qr, gr, rows, (&kp, &vp, row), (hq, hkv, d), &mut want[at]);
        }
        let rel = max_rel(&got, &want);
        println!(
            "PARITY op=qsa_attention_gather shape=hq{hq}_hkv{hkv}_d{d}_ctx{ctx}_topk{topk} max_rel={rel:.2e} tol=1e-2"
        );
        assert!(rel <= 1e-2, "gathered attention off by {rel}");
    }
}

#[test]
fn qsa_backend_matches_cpu() {
    let Some(gpu) = backend("qsa_backend_matches_cpu") else {
        return;
    };
    let p = Pair {
        gpu,
        cpu: CpuBackend::new(),
    };
    let (nh, nkv, d, hidden) = (4, 2, 32, 64);
    let (ni, di, topk) = (4, 16, 48);
    let mut rng = Rng::new(4);
    p.init(&spec(true, di, None));
    let (qn_g, qn_c) = p.weight(rng.bf16s(d, 0.0, 0.1), &[d]);
    let (kn_g, kn_c) = p.weight(rng.bf16s(d, 0.0, 0.1), &[d]);
    let (lw_g, lw_c) = p.weight(rng.bf16s(di, 1.0, 0.2), &[di]);
    let (lb_g, lb_c) = p.weight(rng.bf16s(di, 0.0, 0.2), &[di]);
    // Projections are not used by the op (inputs come projected); tiny placeholders of the right shape.
    let mk = |rows: usize, cols: usize, rng: &mut Rng| {
        p.weight(rng.bf16s(rows * cols, 0.0, 0.1), &[rows, cols])
    };
    let (qp_g, qp_c) = mk(2 * nh * d, hidden, &mut rng);
    let (kp_g, kp_c) = mk(nkv * d, hidden, &mut rng);
    let (vp_g, vp_c) = mk(nkv * d, hidden, &mut rng);
    let (op_g, op_c) = mk(hidden, nh * d, &mut rng);
    let (wq_g, wq_c) = mk(ni * di, hidden, &mut rng);
    let (wk_g, wk_c) = mk(di, hidden, &mut rng);
    let (wp_g, wp_c) = mk(ni, hidden, &mut rng);
    let aw_g = AttnWeights {
        q_proj: qp_g,
        k_proj: kp_g,
        v_proj: vp_g,
        o_proj: op_g,
        q_norm: qn_g,
        k_norm: kn_g,
    };
    let aw_c = AttnWeights {
        q_proj: qp_c,
        k_proj: kp_c,
        v_proj: vp_c,
        o_proj: op_c,
        q_norm: qn_c,
        k_norm: kn_c,
    };
    let iw_g = IndexerWeights {
        wq: wq_g,
        wk: wk_g,
        k_norm: lw_g,
        k_norm_bias: lb_g,
        weights_proj: wp_g,
    };
    let iw_c = IndexerWeights {
        wq: wq_c,
        wk: wk_c,
        k_norm: lw_c,
        k_norm_bias: lb_c,
        weights_proj: wp_c,
    };
    let shape = AttnShape {
        num_heads: nh,
        num_kv_heads: nkv,
        head_dim: d,
        eps: 1e-6,
    };
    let rope = Rope {
        rot_dim: 16,
        inv_freq: inv_freq(16, 1e7),
        mscale: 1.0,
    };
    let qsa = QsaShape {
        n_heads: ni,
        head_dim: di,
        topk,
        rope: Rope {
            rot_dim: 8,
            inv_freq: inv_freq(8, 1e7),
            mscale: 1.0,
        },
    };
    let blocks_a: Vec<u32> = (0..40).collect();
    let blocks_b: Vec<u32> = (40..80).rev().collect();
    let (sa_g, sb_g) = (p.gpu.alloc_state().unwrap(), p.gpu.alloc_state().unwrap());
    let (sa_c, sb_c) = (p.cpu.alloc_state().unwrap(), p.cpu.alloc_state().unwrap());
    assert_eq!((sa_g, sb_g), (sa_c, sb_c), "slot ids agree");
    // Steps: (a_len, b_len) with positions advancing; a prefills 30 (dense) then 100 (selecting),
    // b decodes and prefills around the topk boundary, then both decode.
    let steps: [(usize, usize); 7] = [
        (30, 20),
        (100, 27),
        (1, 1),
        (1, 40),
        (1, 1),
        (64, 1),
        (1, 1),
    ];
    let (mut pa, mut pb) = (0, 0);
    p.gpu.trace_qsa(true);
    p.cpu.trace_qsa(true);
    let mut worst = 0f32;
    for (la, lb) in steps {
        let rows = la + lb;
        let seqs = [
            SeqChunk {
                start: 0,
                len: la,
                pos0: pa,
                state: sa_g,
                blocks: &blocks_a,
            },
            SeqChunk {
                start: la,
                len: lb,
                pos0: pb,
                state: sb_g,
                blocks: &blocks_b,
            },
        ];
        let data = |cols: usize, rng: &mut Rng| rng.bf16s(rows * cols, 0.0, 1.0);
        let (qg, kk, vv) = (
            data(2 * nh * d, &mut rng),
            data(nkv * d, &mut rng),
            data(nkv * d, &mut rng),
        );
        let (iq, ik, iw) = (
            data(ni * di, &mut rng),
            data(di, &mut rng),
            data(ni, &mut rng),
        );
        let step = QsaStep {
            shape: &shape,
            rope: &rope,
            qsa: &qsa,
            seqs: &seqs,
            rows,
            inputs: [&qg, &kk, &vv, &iq, &ik, &iw],
        };
        let g = qsa_step(&p.gpu, &step, &aw_g, &iw_g);
        let c = qsa_step(&p.cpu, &step, &aw_c, &iw_c);
        let rel = max_rel(&g, &c);
        worst = worst.max(rel);
        pa += la;
        pb += lb;
    }
    let tg = p.gpu.take_qsa_trace();
    let mut tc: Vec<_> = p
        .cpu
        .take_qsa_trace()
        .into_iter()
        .map(|s| (s.layer, s.state, s.pos, s.selected))
        .collect();
    tc.sort_by_key(|r| (r.0, r.1, r.2));
    let selecting = tc.iter().filter(|r| r.3.len() < r.2 + 1).count();
    let differing = tg.iter().zip(&tc).filter(|(a, b)| a != b).count();
    println!(
        "PARITY op=qsa_attention shape=two_seqs_ctx{pa}+{pb}_topk{topk} max_rel={worst:.2e} rows={} selecting_rows={selecting} sets_differing={differing} tol=1e-2",
        tc.len()
    );
    assert_eq!(tg.len(), tc.len(), "one selection per query row on both");
    assert!(selecting > 100, "the schedule exercises selection");
    assert_eq!(differing, 0, "selected sets differ from the CPU's");
    assert!(worst <= 1e-2, "QSA attention off by {worst}");
}

/// The indexer queries and head weights of the rows of `iq` / `iw` (bf16 values) at positions
/// `qpos` (rotated dims `rot`, frequencies `fd` on the device), head weights scaled by
/// `nI^-0.5 · dI^-0.5`, into `qi` and `wts`.
pub(super) fn query_prep(
    b: &CudaBackend,
    (iq, iw): (&[f32], &[f32]),
    (qpos, fd, rot): (&[u32], &CudaSlice<f32>, usize),
    heads: IndexHeads,
    (qi, wts): (&mut CudaSlice<f32>, &mut CudaSlice<f32>),
) {
    let g = b.gpu();
    let (ni, di) = (heads.n_heads, heads.head_dim);
    let head_scale = (ni as f32).powf(-0.5) * (di as f32).powf(-0.5);
    let (iq, iw) = (to_dev(b, iq), to_dev(b, iw));
    let proj = IndexProj {
        iq: &iq,
        iw: &iw,
        rows: qpos.len(),
    };
    let pos = g.upload(qpos).unwrap();
    let rope = RopeArgs {
        positions: &pos,
        inv_freq: fd,
        rot_dim: rot,
        mscale: 1.0,
    };
    g.qsa_query_prep(&proj, &rope, heads, head_scale, qi, wts)
        .unwrap();
}

/// One QSA call on backend `b`: the inputs (q|gate, k, v, iq, ik, iw, each `[rows, ·]`, their widths
/// from their lengths) uploaded, `call` run on them, the output on the host.
fn qsa_call<B: Backend>(
    b: &B,
    rows: usize,
    inputs: [&[f32]; 6],
    call: impl FnOnce([&B::Tensor; 6]) -> OpResult<B::Tensor>,
) -> Vec<f32> {
    let ts = inputs.map(|x| b.upload(rows, x.len() / rows, x.to_vec()).unwrap());
    let out = call(ts.each_ref()).unwrap();
    b.to_host(out).unwrap().2
}

/// One step of a backend's `qsa_attention` (layer 0): the shapes, the sequences and the six inputs
/// (`q_gate`, `k`, `v`, `iq`, `ik`, `iw`, `[rows, ·]` each).
struct QsaStep<'a> {
    shape: &'a AttnShape,
    rope: &'a Rope,
    qsa: &'a QsaShape,
    seqs: &'a [SeqChunk<'a>],
    rows: usize,
    inputs: [&'a [f32]; 6],
}

/// `b`'s `qsa_attention` of `step` with the attention weights `w` and the indexer's, on the host.
fn qsa_step<B: Backend>(
    b: &B,
    step: &QsaStep<'_>,
    w: &AttnWeights<B::Weight>,
    indexer: &IndexerWeights<B::Weight>,
) -> Vec<f32> {
    qsa_call(b, step.rows, step.inputs, |[q_gate, k, v, iq, ik, iw]| {
        b.qsa_attention(&QsaCall {
            attn: AttnCall {
                layer: 0,
                shape: step.shape,
                rope: step.rope,
                q_gate,
                k,
                v,
                w,
                seqs: step.seqs,
                mrope: None,
            },
            qsa: step.qsa,
            iq,
            ik,
            iw,
            indexer,
        })
    })
}

/// The CPU's gated attention of one query row (`q`, `gate`: `[hq·d]`) over the K/V rows starting at the
/// offsets `rows` of the pools (`kv`: K pool, V pool, values a row), into `out`.
pub(super) fn cpu_attend_rows_at(
    q: &[f32],
    gate: &[f32],
    rows: impl Iterator<Item = usize>,
    (kp, vp, row): (&[f32], &[f32], usize),
    (hq, hkv, d): (usize, usize, usize),
    out: &mut [f32],
) {
    let (mut kr, mut vr) = (Vec::new(), Vec::new());
    for at in rows {
        kr.extend_from_slice(&kp[at..at + row]);
        vr.extend_from_slice(&vp[at..at + row]);
    }
    let heads = cpu::Heads {
        hq,
        hkv,
        d,
        scale: (d as f32).powf(-0.5),
    };
    cpu::attend_rows(q, gate, &kr, &vr, &heads, out);
}
