//! Timing (ignored by default; `--ignored` runs it) of the dense decode GEMVs (bf16 and packed), RMSNorm at the shapes of a
//! full-size decode step. Prints `BENCH` lines.
//!
//! In a decode step every weight comes from HBM (the model is far larger than L2), so each case cycles
//! through enough copies of its weight (over 320 MB) that no call finds it in L2; `time_us` is the mean
//! per call and `GB/s` the bytes the kernel must move (weights, scales, x, y) over that time.

use half::bf16;
use sanmai_cuda::cudarc::driver::CudaSlice;
use sanmai_cuda::{Gpu, NormRows, PackedScheme, RowAddNorm};

use crate::bench::{pattern, time};
use crate::common::{gpu, packed_mat};

/// Bytes of weights cycled through so that every call streams from HBM.
const COLD_BYTES: usize = 320 << 20;

fn copies(bytes: usize) -> usize {
    (COLD_BYTES / bytes.max(1)).clamp(1, 4096) + 1
}

/// Cheap deterministic u32 words: any word is a valid packed code.
fn words(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i ^ salt).wrapping_mul(2_654_435_761).rotate_left(13))
        .collect()
}

fn line(what: &str, shape: &str, bytes: usize, t: f64) {
    println!(
        "BENCH {what} {shape} bytes={bytes} time_us={:.2} GB/s={:.0}",
        t * 1e6,
        bytes as f64 / t / 1e9
    );
}

fn bench_bf16(g: &Gpu, m: usize, n: usize, k: usize, f32_out: bool) {
    let wb = n * k * 2;
    let c = copies(wb);
    let ws: Vec<CudaSlice<bf16>> = (0..c)
        .map(|i| g.upload(&pattern(n * k, 3 + i as u32)).unwrap())
        .collect();
    let x = g.upload(&pattern(m * k, 5)).unwrap();
    let shape = format!("m={m} n={n} k={k}");
    let mut i = 0;
    if f32_out {
        let mut y = g.zeros::<f32>(m * n).unwrap();
        let t = time(g, c, 4 * c.max(25), || {
            i += 1;
            g.gemv_bf16_f32(&ws[i % c], &x, &mut y, m, n, k).unwrap()
        });
        line("gemv_bf16_f32", &shape, wb + m * k * 2 + m * n * 4, t);
    } else {
        let mut y = g.zeros::<bf16>(m * n).unwrap();
        let t = time(g, c, 4 * c.max(25), || {
            i += 1;
            g.gemv_bf16(&ws[i % c], &x, &mut y, m, n, k).unwrap()
        });
        line("gemv_bf16", &shape, wb + m * k * 2 + m * n * 2, t);
    }
}

fn bench_packed(g: &Gpu, bits: u32, group: usize, m: usize, n: usize, k: usize, f32_out: bool) {
    let wpr = if bits == 6 {
        k.div_ceil(32) * 6
    } else {
        k.div_ceil(32 / bits as usize)
    };
    let scols = if group == 0 { 1 } else { k.div_ceil(group) };
    let wb = n * wpr * 4 + n * scols * 4;
    let c = copies(wb);
    let ws: Vec<CudaSlice<u32>> = (0..c)
        .map(|i| g.upload(&words(n * wpr, 7 + i as u32)).unwrap())
        .collect();
    let s = g.upload(&vec![0.01f32; n * scols]).unwrap();
    let x = g.upload(&pattern(m * k, 9)).unwrap();
    let shape = format!("bits={bits} group={group} m={m} n={n} k={k}");
    let mut i = 0;
    if f32_out {
        let mut y = g.zeros::<f32>(m * n).unwrap();
        let t = time(g, c, 4 * c.max(25), || {
            i += 1;
            g.gemv_packed_f32(
                &packed_mat(&ws[i % c], &s, (bits, group), (n, k)),
                &x,
                &mut y,
                m,
            )
            .unwrap()
        });
        line("gemv_packed_f32", &shape, wb + m * k * 2 + m * n * 4, t);
    } else {
        let mut y = g.zeros::<bf16>(m * n).unwrap();
        let t = time(g, c, 4 * c.max(25), || {
            i += 1;
            g.gemv_packed(
                &packed_mat(&ws[i % c], &s, (bits, group), (n, k)),
                &x,
                &mut y,
                m,
            )
            .unwrap()
        });
        line("gemv_packed", &shape, wb + m * k * 2 + m * n * 2, t);
    }
}

/// A mixer's output projection and the next norm at one row: the INT8 GEMV (80B out_proj, 2048 x
/// 4096) then `add_rms_norm`, against both in the GEMV's launch (`gemv_packed_add_rms_norm`).
#[test]
#[ignore = "timing; run with --ignored on a GPU host"]
fn bench_gemv_add_norm() {
    let Some(g) = gpu("bench_gemv_add_norm") else {
        return;
    };
    let (bits, n, k) = (8u32, 2048usize, 4096usize);
    let scheme = PackedScheme {
        bits,
        group_size: 0,
    };
    if !g.gemv_packed_norm_fits(scheme, n, k) {
        println!("BENCH gemv_add_norm skipped: the one-row chunk GEMV is chosen");
        return;
    }
    let wpr = k / 4;
    let wb = n * wpr * 4 + n * 4;
    let c = copies(wb);
    let ws: Vec<CudaSlice<u32>> = (0..c)
        .map(|i| g.upload(&words(n * wpr, 11 + i as u32)).unwrap())
        .collect();
    let s = g.upload(&vec![0.01f32; n]).unwrap();
    let x = g.upload(&pattern(k, 12)).unwrap();
    let nw = g.upload(&pattern(n, 13)).unwrap();
    let mut y = g.zeros::<bf16>(n).unwrap();
    let mut acc = g.zeros::<bf16>(n).unwrap();
    let mut normed = g.zeros::<bf16>(n).unwrap();
    let mut ticket = g.zeros::<u32>(1).unwrap();
    let rows = NormRows {
        rows: 1,
        d: n,
        eps: 1e-6,
    };
    let mut i = 0;
    let apart = time(g, c, 4 * c.max(25), || {
        i += 1;
        let mat = packed_mat(&ws[i % c], &s, (bits, 0), (n, k));
        g.gemv_packed(&mat, &x, &mut y, 1).unwrap();
        g.add_rms_norm(&mut acc, &y, &nw, &mut normed, rows, 1.0)
            .unwrap()
    });
    let fused = time(g, c, 4 * c.max(25), || {
        i += 1;
        let then = RowAddNorm {
            acc: &mut acc,
            w: &nw,
            normed: &mut normed,
            eps: 1e-6,
            offset: 1.0,
            ticket: &mut ticket,
        };
        let mat = packed_mat(&ws[i % c], &s, (bits, 0), (n, k));
        g.gemv_packed_add_rms_norm(&mat, &x, &mut y, then).unwrap()
    });
    println!(
        "BENCH gemv_add_norm bits={bits} n={n} k={k} gemv_then_add_rms_norm_us={:.2} \
         fused_us={:.2}",
        apart * 1e6,
        fused * 1e6
    );
}

#[test]
#[ignore = "timing; run with --ignored on a GPU host"]
fn bench_dense_gemv() {
    let Some(g) = gpu("bench_dense_gemv") else {
        return;
    };
    // bf16: the shared expert's gate (n = 1), the GDN b|a projection (64), the router (512, f32 out),
    // mid-size projections and a bf16 lm_head.
    for m in [1usize, 8] {
        for (n, k) in [
            (1usize, 2048usize),
            (64, 2048),
            (512, 2048),
            (2048, 2048),
            (4096, 2048),
            (2048, 512),
            (2048, 4096),
            (12_288, 2048),
        ] {
            bench_bf16(g, m, n, k, false);
        }
        bench_bf16(g, m, 512, 2048, true);
    }
    bench_bf16(g, 1, 151_936, 2048, true);
    bench_bf16(g, 1, 248_320, 2560, false);

    // Packed: INT8 per row (the dense projections), INT6 per row (the shared expert), INT4 group 128.
    for (bits, group) in [(8u32, 0usize), (6, 0), (4, 128)] {
        for m in [1usize, 8] {
            for (n, k) in [
                (64usize, 2048usize),
                (512, 2048),
                (1024, 2048),
                (2048, 512),
                (2048, 2048),
                (2048, 4096),
                (4096, 2048),
                (8192, 2048),
                (12_288, 2048),
            ] {
                bench_packed(g, bits, group, m, n, k, false);
            }
        }
    }
    // Batches between 1 and 8 (the tensor-core GEMV from m = 2) at in_proj_qkv / in_proj_z and the
    // INT6 shared expert.
    for m in [2usize, 4] {
        bench_packed(g, 8, 0, m, 8192, 2048, false);
        bench_packed(g, 4, 128, m, 4096, 2048, false);
        bench_packed(g, 6, 0, m, 2048, 2048, false);
        bench_bf16(g, m, 4096, 2048, false);
    }
    // An INT8 lm_head, f32 logits.
    bench_packed(g, 8, 0, 1, 151_936, 2048, true);
    bench_packed(g, 8, 0, 8, 151_936, 2048, true);
}

/// The weights `ns` (`[n, k]` bf16 each) that read one x: one launch of all (`gemv_bf16_many`) against
/// one launch each.
fn bench_bf16_many(g: &Gpu, m: usize, ns: &[usize], k: usize) {
    let wb: usize = ns.iter().map(|n| n * k * 2).sum();
    let c = copies(wb);
    let ws: Vec<Vec<CudaSlice<bf16>>> = (0..c)
        .map(|i| {
            ns.iter()
                .map(|&n| g.upload(&pattern(n * k, 3 + i as u32)).unwrap())
                .collect()
        })
        .collect();
    let x = g.upload(&pattern(m * k, 5)).unwrap();
    let mut ys: Vec<_> = ns
        .iter()
        .map(|&n| g.zeros::<bf16>(m * n).unwrap())
        .collect();
    let bytes = wb + ns.iter().map(|n| m * n * 2 + m * k * 2).sum::<usize>();
    let shape = format!("m={m} ns={ns:?} k={k}");
    let mut i = 0;
    let t = time(g, c, 4 * c.max(25), || {
        i += 1;
        for ((w, y), &n) in ws[i % c].iter().zip(ys.iter_mut()).zip(ns) {
            g.gemv_bf16(w, &x, y, m, n, k).unwrap();
        }
    });
    line("gemv_bf16_each", &shape, bytes, t);
    let t = time(g, c, 4 * c.max(25), || {
        i += 1;
        let mut parts: Vec<_> = ws[i % c]
            .iter()
            .zip(ys.iter_mut())
            .zip(ns)
            .map(|((w, y), &n)| (w, y, n))
            .collect();
        g.gemv_bf16_many(&x, &mut parts, m, k).unwrap();
    });
    line("gemv_bf16_many", &shape, bytes, t);
}

/// As [`bench_bf16_many`] for packed weights of one format (`gemv_packed_many`).
fn bench_packed_many(g: &Gpu, bits: u32, group: usize, m: usize, ns: &[usize], k: usize) {
    let wpr = if bits == 6 {
        k.div_ceil(32) * 6
    } else {
        k.div_ceil(32 / bits as usize)
    };
    let scols = if group == 0 { 1 } else { k.div_ceil(group) };
    let wb: usize = ns.iter().map(|n| n * (wpr + scols) * 4).sum();
    let c = copies(wb);
    let ws: Vec<Vec<CudaSlice<u32>>> = (0..c)
        .map(|i| {
            ns.iter()
                .map(|&n| g.upload(&words(n * wpr, 7 + i as u32)).unwrap())
                .collect()
        })
        .collect();
    let ss: Vec<_> = ns
        .iter()
        .map(|&n| g.upload(&vec![0.01f32; n * scols]).unwrap())
        .collect();
    let x = g.upload(&pattern(m * k, 9)).unwrap();
    let mut ys: Vec<_> = ns
        .iter()
        .map(|&n| g.zeros::<bf16>(m * n).unwrap())
        .collect();
    let bytes = wb + ns.iter().map(|n| m * n * 2 + m * k * 2).sum::<usize>();
    let shape = format!("bits={bits} group={group} m={m} ns={ns:?} k={k}");
    let mut i = 0;
    let t = time(g, c, 4 * c.max(25), || {
        i += 1;
        for (((w, s), y), &n) in ws[i % c].iter().zip(&ss).zip(ys.iter_mut()).zip(ns) {
            g.gemv_packed(&packed_mat(w, s, (bits, group), (n, k)), &x, y, m)
                .unwrap();
        }
    });
    line("gemv_packed_each", &shape, bytes, t);
    let t = time(g, c, 4 * c.max(25), || {
        i += 1;
        let mut parts: Vec<_> = ws[i % c]
            .iter()
            .zip(&ss)
            .zip(ys.iter_mut())
            .zip(ns)
            .map(|(((w, s), y), &n)| (w, s, y, n))
            .collect();
        g.gemv_packed_many(
            PackedScheme {
                bits,
                group_size: group,
            },
            &x,
            &mut parts,
            m,
            k,
        )
        .unwrap();
    });
    line("gemv_packed_many", &shape, bytes, t);
}

/// The projections of one input in one launch against one launch each, at batch 1 and 8: a GDN layer's
/// INT8 in_proj_qkv | in_proj_z (8192 and 4096 rows) and bf16 in_proj_b | in_proj_a (32 rows each), an
/// attention layer's q | k | v (bf16 and INT8), k = 2048.
#[test]
#[ignore = "timing; run with --ignored on a GPU host"]
fn bench_many_gemv() {
    let Some(g) = gpu("bench_many_gemv") else {
        return;
    };
    for m in [1usize, 8] {
        bench_packed_many(g, 8, 0, m, &[8192, 4096], 2048);
        bench_bf16_many(g, m, &[32, 32], 2048);
        bench_bf16_many(g, m, &[8192, 512, 512], 2048);
        bench_packed_many(g, 8, 0, m, &[8192, 512, 512], 2048);
    }
}

/// Small n at batch 1 (the FMA GEMV) and 8 (the tensor cores): the shared expert's gate (n = 1), the
/// GDN b / a projections (32, 64 fused), partial and whole 16-row tiles up to 512 rows, bf16 and packed
/// (INT8 and INT6 per row, INT4 group 128), k = 2048.
#[test]
#[ignore = "timing; run with --ignored on a GPU host"]
fn bench_small_n_gemv() {
    let Some(g) = gpu("bench_small_n_gemv") else {
        return;
    };
    for m in [1usize, 8] {
        for n in [1usize, 32, 64, 128, 255, 256, 512] {
            bench_bf16(g, m, n, 2048, false);
            for (bits, group) in [(8u32, 0usize), (6, 0), (4, 128)] {
                bench_packed(g, bits, group, m, n, 2048, false);
            }
        }
    }
}

#[test]
#[ignore = "timing; run with --ignored on a GPU host"]
fn bench_norms() {
    let Some(g) = gpu("bench_norms") else {
        return;
    };
    for (rows, d) in [
        (1usize, 2048usize),
        (8, 2048),
        (1, 2560),
        (4096, 2048),
        (16, 256),
        (2, 100),
    ] {
        let x = g.upload(&pattern(rows * d, 1)).unwrap();
        let w = g.upload(&pattern(d, 2)).unwrap();
        let mut y = g.zeros::<bf16>(rows * d).unwrap();
        let t = time(g, 10, 200, || {
            let shape = NormRows { rows, d, eps: 1e-6 };
            g.rms_norm(&x, &w, &mut y, shape, 1.0).unwrap()
        });
        line(
            "rms_norm",
            &format!("rows={rows} d={d}"),
            (2 * rows * d + d) * 2,
            t,
        );
    }
    for (rows, d) in [(32usize, 128usize), (256, 128), (131_072, 128)] {
        let x = g.upload(&pattern(rows * d, 3)).unwrap();
        let z = g.upload(&pattern(rows * d, 4)).unwrap();
        let w = g.upload(&pattern(d, 5)).unwrap();
        let mut y = g.zeros::<bf16>(rows * d).unwrap();
        let t = time(g, 10, 200, || {
            let shape = NormRows { rows, d, eps: 1e-6 };
            g.gated_rms_norm(&x, &z, &w, &mut y, shape).unwrap()
        });
        line(
            "gated_rms_norm",
            &format!("rows={rows} d={d}"),
            (3 * rows * d + d) * 2,
            t,
        );
    }
}
