//! SwiGLU, the embedding gather, the decode GEMV and the cuBLAS GEMM against the CPU ops.

use half::bf16;
use sanmai_cpu::ops;

use crate::common::{check_elementwise, check_reduction, from_bf16, gpu, to_bf16, Rng};

#[test]
fn swiglu_matches_cpu() {
    let Some(g) = gpu("swiglu_matches_cpu") else {
        return;
    };
    let mut rng = Rng::new(10);
    for &(t, i) in &[(1, 512), (37, 1536), (3, 100)] {
        let (gub, guf) = to_bf16(&rng.normals(t * 2 * i, 0.0, 3.0));
        let mut want = vec![0f32; t * i];
        ops::swiglu(&guf, t, i, &mut want);
        let gu = g.upload(&gub).unwrap();
        let mut out = g.zeros(t * i).unwrap();
        g.swiglu(&gu, &mut out, t, i).unwrap();
        let got = from_bf16(&g.download(&out).unwrap());
        check_elementwise("swiglu", &format!("{t}x{i}"), &got, &want);
    }
}

#[test]
fn embed_gathers_rows_and_zeroes_bad_ids() {
    let Some(g) = gpu("embed_gathers_rows_and_zeroes_bad_ids") else {
        return;
    };
    let mut rng = Rng::new(11);
    for &(vocab, hidden) in &[(1000, 2048), (300, 100)] {
        let (tb, tf) = to_bf16(&rng.normals(vocab * hidden, 0.0, 1.0));
        let ids: Vec<u32> = vec![0, 5, vocab as u32 - 1, vocab as u32, 7, u32::MAX, 5];
        let table = g.upload(&tb).unwrap();
        let idb = g.upload(&ids).unwrap();
        let mut out = g.zeros(ids.len() * hidden).unwrap();
        g.embed(&table, &idb, &mut out, vocab, hidden, ids.len())
            .unwrap();
        let got = from_bf16(&g.download(&out).unwrap());
        for (row, &id) in got.chunks_exact(hidden).zip(&ids) {
            let id = id as usize;
            if id < vocab {
                assert_eq!(row, &tf[id * hidden..(id + 1) * hidden], "row of id {id}");
            } else {
                assert!(row.iter().all(|&v| v == 0.0), "id {id} is out of range");
            }
        }
        println!("PARITY op=embed shape={vocab}x{hidden} exact=true");
    }
}

fn gemv_case(g: &sanmai_cuda::Gpu, rng: &mut Rng, m: usize, n: usize, k: usize) {
    let (wb, wf) = to_bf16(&rng.normals(n * k, 0.0, 0.05));
    let (xb, xf) = to_bf16(&rng.normals(m * k, 0.0, 1.0));
    let mut want = vec![0f32; m * n];
    ops::matmul_t(&xf, &wf, m, k, n, &mut want);
    let (w, x) = (g.upload(&wb).unwrap(), g.upload(&xb).unwrap());
    let mut y = g.zeros::<bf16>(m * n).unwrap();
    g.gemv_bf16(&w, &x, &mut y, m, n, k).unwrap();
    let got = from_bf16(&g.download(&y).unwrap());
    check_reduction("gemv_bf16", &format!("m{m}_n{n}_k{k}"), &got, &want);
    let mut y32 = g.zeros::<f32>(m * n).unwrap();
    g.gemv_bf16_f32(&w, &x, &mut y32, m, n, k).unwrap();
    let got = g.download(&y32).unwrap();
    check_reduction("gemv_bf16_f32", &format!("m{m}_n{n}_k{k}"), &got, &want);
}

#[test]
fn gemv_matches_cpu() {
    let Some(g) = gpu("gemv_matches_cpu") else {
        return;
    };
    let mut rng = Rng::new(12);
    for &(m, n, k) in &[
        (1, 4096, 2048),
        (2, 1003, 2560),
        (3, 515, 512),
        (4, 2048, 512),
        (5, 64, 8),
        (8, 777, 4096),
        (1, 151_936, 1024),
        // Two rows per slot (n = 1024, k = 4096) and slots narrower than a warp (k = 64, 128).
        (1, 1024, 4096),
        (6, 300, 64),
        (8, 1000, 128),
    ] {
        gemv_case(g, &mut rng, m, n, k);
    }
}

/// The decode shapes of a full-size model at batch 1 and 8: every row count from one (the shared
/// expert's gate) to 12288 (the GDN input projection), the router's 512, the narrow down projection
/// (k = 512) and the wide output projection (k = 4096). Each cut of the GEMV (slots of a whole block
/// reduced through shared memory, of one warp, of several rows) appears among them.
#[test]
fn gemv_matches_cpu_at_decode_shapes() {
    let Some(g) = gpu("gemv_matches_cpu_at_decode_shapes") else {
        return;
    };
    let mut rng = Rng::new(14);
    for m in [1usize, 8] {
        for n in [1usize, 64, 512, 2048, 12_288] {
            for k in [512usize, 2048, 4096] {
                if n == 12_288 && k != 2048 {
                    continue;
                }
                gemv_case(g, &mut rng, m, n, k);
            }
        }
    }
}

/// Small n at batches: the shared expert's gate (n = 1), the GDN b / a projections (n = 32 each, 64
/// fused), partial 16-row tiles (100, 255) on the tensor cores, and on the FMA GEMV (k off the 32 grid)
/// with k split over a whole block and its cross-warp sums spread over the slot's threads.
#[test]
fn gemv_small_n_batches_match_cpu() {
    let Some(g) = gpu("gemv_small_n_batches_match_cpu") else {
        return;
    };
    let mut rng = Rng::new(16);
    for &(m, n, k) in &[
        (8, 1, 2048),
        (8, 32, 2048),
        (8, 64, 2048),
        (8, 100, 4096),
        (8, 255, 512),
        (2, 1, 2048),
        (3, 32, 2048),
        (5, 64, 1000),
        (8, 1, 1000),
        (8, 64, 2056),
    ] {
        gemv_case(g, &mut rng, m, n, k);
    }
}

/// The tensor-core GEMV (2 ≤ m ≤ 8, k % 32 == 0, any n): every batch size at the in_proj_z shape,
/// in_proj_qkv and out_proj at batch 8 and 3, partial 16-row tiles (255, 257), a k of one 32-value
/// block per warp and less (k = 32: 7 idle warps) and a k off the 32 grid (the FMA GEMV).
#[test]
fn gemv_tensor_core_matches_cpu() {
    let Some(g) = gpu("gemv_tensor_core_matches_cpu") else {
        return;
    };
    let mut rng = Rng::new(15);
    for m in 2..=8usize {
        gemv_case(g, &mut rng, m, 4096, 2048);
    }
    for &(m, n, k) in &[
        (8, 8192, 2048),
        (3, 2048, 4096),
        (8, 255, 2048),
        (8, 256, 2048),
        (2, 257, 2048),
        (7, 1000, 256),
        (8, 300, 32),
        (8, 300, 40),
    ] {
        gemv_case(g, &mut rng, m, n, k);
    }
}

/// Several weights that read one x in one launch (`gemv_bf16_many`): each output against the CPU
/// product with its own weight. 2, 3 and 4 segments of different n (n = 1, n off the 16-row tiles and
/// the row-slot blocks), at m = 1 (row slots, a different cut per segment), 2, 5 and 8 (tensor cores),
/// and a k off the 32 grid (row slots at m = 5).
#[test]
fn gemv_many_matches_cpu() {
    let Some(g) = gpu("gemv_many_matches_cpu") else {
        return;
    };
    let mut rng = Rng::new(17);
    let sets: [&[usize]; 4] = [
        &[4096, 32],
        &[1, 513, 64],
        &[8192, 2048, 32, 32],
        &[7, 1, 300, 1003],
    ];
    for m in [1usize, 2, 5, 8] {
        for (i, ns) in sets.iter().enumerate() {
            let k = if m == 5 && i == 1 { 1000 } else { 2048 };
            gemv_many_case(g, &mut rng, m, ns, k);
        }
    }
}

fn gemv_many_case(g: &sanmai_cuda::Gpu, rng: &mut Rng, m: usize, ns: &[usize], k: usize) {
    let (xb, xf) = to_bf16(&rng.normals(m * k, 0.0, 1.0));
    let x = g.upload(&xb).unwrap();
    let mut ws = Vec::new();
    let mut wants = Vec::new();
    for &n in ns {
        let (wb, wf) = to_bf16(&rng.normals(n * k, 0.0, 0.05));
        let mut want = vec![0f32; m * n];
        ops::matmul_t(&xf, &wf, m, k, n, &mut want);
        ws.push(g.upload(&wb).unwrap());
        wants.push(want);
    }
    let mut ys: Vec<_> = ns
        .iter()
        .map(|&n| g.zeros::<bf16>(m * n).unwrap())
        .collect();
    let mut parts: Vec<_> = ws
        .iter()
        .zip(ys.iter_mut())
        .zip(ns)
        .map(|((w, y), &n)| (w, y, n))
        .collect();
    g.gemv_bf16_many(&x, &mut parts, m, k).unwrap();
    drop(parts);
    for (i, ((y, want), n)) in ys.iter().zip(&wants).zip(ns).enumerate() {
        let got = from_bf16(&g.download(y).unwrap());
        let shape = format!("m{m}_k{k}_segs{}_seg{i}_n{n}", ns.len());
        check_reduction("gemv_bf16_many", &shape, &got, want);
    }
}

#[test]
fn gemv_rejects_bad_shapes() {
    let Some(g) = gpu("gemv_rejects_bad_shapes") else {
        return;
    };
    let w = g.zeros::<bf16>(64 * 24).unwrap();
    let x = g.zeros::<bf16>(9 * 24).unwrap();
    let mut y = g.zeros::<bf16>(9 * 64).unwrap();
    assert!(g.gemv_bf16(&w, &x, &mut y, 9, 64, 24).is_err(), "m > 8");
    assert!(g.gemv_bf16(&w, &x, &mut y, 1, 64, 20).is_err(), "k % 8");
    assert!(
        g.gemv_bf16(&w, &x, &mut y, 1, 65, 24).is_err(),
        "W too short"
    );
    // A view starting 2 bytes in is misaligned for 16-byte loads.
    let wv = w.slice(1..);
    assert!(
        g.gemv_bf16(&wv, &x, &mut y, 1, 32, 24).is_err(),
        "alignment"
    );
}

#[test]
fn gemm_matches_cpu() {
    let Some(g) = gpu("gemm_matches_cpu") else {
        return;
    };
    let mut rng = Rng::new(13);
    for &(m, n, k) in &[
        (64, 1024, 2048),
        (300, 512, 768),
        (1, 256, 64),
        (129, 100, 36),
    ] {
        let (xb, xf) = to_bf16(&rng.normals(m * k, 0.0, 1.0));
        let (wb, wf) = to_bf16(&rng.normals(n * k, 0.0, 0.05));
        let mut want = vec![0f32; m * n];
        ops::matmul_t(&xf, &wf, m, k, n, &mut want);
        let (x, w) = (g.upload(&xb).unwrap(), g.upload(&wb).unwrap());
        let mut y = g.zeros::<bf16>(m * n).unwrap();
        g.gemm_bf16(&x, &w, &mut y, m, n, k).unwrap();
        let got = from_bf16(&g.download(&y).unwrap());
        check_reduction("gemm_bf16", &format!("m{m}_n{n}_k{k}"), &got, &want);
    }
}
