//! Residual add, row gather, column concat, SiLU and the hyper-connection ops
//! against their f32 definitions (the CPU backend's loops).

use half::bf16;
use sanmai_cpu::ops;
use sanmai_cuda::NormRows;

use crate::common::{check_elementwise, from_bf16, gpu, to_bf16, Rng};

#[test]
fn elementwise_ops_match_cpu() {
    let Some(g) = gpu("elementwise_ops_match_cpu") else {
        return;
    };
    let mut rng = Rng::new(60);
    let (rows, cols) = (37, 200);
    let n = rows * cols;
    let (ab, af) = to_bf16(&rng.normals(n, 0.0, 1.0));
    let (yb, yf) = to_bf16(&rng.normals(n, 0.0, 1.0));
    let shape = format!("{rows}x{cols}");

    let mut acc = g.upload(&ab).unwrap();
    let y = g.upload(&yb).unwrap();
    g.add_bf16(&mut acc, &y, n).unwrap();
    let want: Vec<f32> = af.iter().zip(&yf).map(|(a, b)| a + b).collect();
    check_elementwise("add", &shape, &from_bf16(&g.download(&acc).unwrap()), &want);

    let idx: Vec<u32> = vec![3, 0, 36, 3, 17];
    let x = g.upload(&ab).unwrap();
    let di = g.upload(&idx).unwrap();
    let mut out = g.zeros::<bf16>(idx.len() * cols).unwrap();
    g.gather_rows(&x, &di, &mut out, rows, idx.len(), cols)
        .unwrap();
    let want: Vec<f32> = idx
        .iter()
        .flat_map(|&r| af[r as usize * cols..(r as usize + 1) * cols].to_vec())
        .collect();
    assert_eq!(from_bf16(&g.download(&out).unwrap()), want, "gather_rows");

    let cb = 24;
    let (bb, bf) = to_bf16(&rng.normals(rows * cb, 0.0, 1.0));
    let b = g.upload(&bb).unwrap();
    let mut out = g.zeros::<bf16>(rows * (cols + cb)).unwrap();
    g.concat_cols(&x, &b, &mut out, rows, cols, cb).unwrap();
    let want: Vec<f32> = (0..rows)
        .flat_map(|r| {
            let mut v = af[r * cols..(r + 1) * cols].to_vec();
            v.extend_from_slice(&bf[r * cb..(r + 1) * cb]);
            v
        })
        .collect();
    assert_eq!(from_bf16(&g.download(&out).unwrap()), want, "concat_cols");

    let mut out = g.zeros::<bf16>(n).unwrap();
    g.silu(&x, &mut out, n).unwrap();
    let want: Vec<f32> = af.iter().map(|&v| ops::silu(v)).collect();
    check_elementwise(
        "silu",
        &shape,
        &from_bf16(&g.download(&out).unwrap()),
        &want,
    );
    println!("PARITY op=gather_rows shape=5_of_{rows}x{cols} exact=true");
    println!("PARITY op=concat_cols shape={rows}x({cols}+{cb}) exact=true");
}

#[test]
fn hyper_connection_ops_match_cpu() {
    let Some(g) = gpu("hyper_connection_ops_match_cpu") else {
        return;
    };
    let mut rng = Rng::new(61);
    let (rows, s, h) = (6, 4, 96);
    let (sb, sf) = to_bf16(&rng.normals(rows * s * h, 0.0, 1.0));
    let pre = rng.normals(s, 0.0, 1.0);
    let (ub, uf) = to_bf16(&rng.normals(rows * s * h, 0.0, 1.0));
    let (yb, yf) = to_bf16(&rng.normals(rows * h, 0.0, 1.0));
    let shape = format!("rows{rows}_s{s}_h{h}");
    let m = pre.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    let z: f32 = pre.iter().map(|&p| (p - m).exp()).sum();
    let mut want = vec![0f32; rows * h];
    for r in 0..rows {
        for j in 0..h {
            for c in 0..s {
                want[r * h + j] += ((pre[c] - m).exp() / z) * sf[(r * s + c) * h + j];
            }
        }
    }
    let st = g.upload(&sb).unwrap();
    let p = g.upload(&pre).unwrap();
    let mut out = g.zeros::<bf16>(rows * h).unwrap();
    g.hc_premix(&st, &p, &mut out, rows, s, h).unwrap();
    check_elementwise(
        "hc_premix",
        &shape,
        &from_bf16(&g.download(&out).unwrap()),
        &want,
    );

    let mut st = g.upload(&sb).unwrap();
    let u = g.upload(&ub).unwrap();
    let y = g.upload(&yb).unwrap();
    g.hc_gated_residual(&mut st, &u, &y, rows, s, h).unwrap();
    let want: Vec<f32> = (0..rows * s * h)
        .map(|i| sf[i] + ops::sigmoid(uf[i]) * yf[(i / (s * h)) * h + i % h])
        .collect();
    check_elementwise(
        "hc_gated_residual",
        &shape,
        &from_bf16(&g.download(&st).unwrap()),
        &want,
    );
}

/// The residual add fused with the next RMSNorm: the sums rounded to bf16 as `add_bf16` leaves them,
/// the norm of the rounded sums as the CPU computes it; rows short enough for registers and longer.
#[test]
fn add_rms_norm_matches_cpu() {
    let Some(g) = gpu("add_rms_norm_matches_cpu") else {
        return;
    };
    let mut rng = Rng::new(61);
    for (rows, d) in [(1, 2048), (8, 2048), (3, 2560), (37, 200), (2, 5000)] {
        let n = rows * d;
        let (ab, af) = to_bf16(&rng.normals(n, 0.0, 1.0));
        let (yb, yf) = to_bf16(&rng.normals(n, 0.0, 0.5));
        let (wb, wf) = to_bf16(&rng.normals(d, 0.0, 0.2));
        let (eps, offset) = (1e-6, 1.0);
        let mut acc = g.upload(&ab).unwrap();
        let y = g.upload(&yb).unwrap();
        let w = g.upload(&wb).unwrap();
        let mut out = g.zeros::<bf16>(n).unwrap();
        g.add_rms_norm(
            &mut acc,
            &y,
            &w,
            &mut out,
            NormRows { rows, d, eps },
            offset,
        )
        .unwrap();
        let sums: Vec<f32> = af
            .iter()
            .zip(&yf)
            .map(|(a, b)| bf16::from_f32(a + b).to_f32())
            .collect();
        let shape = format!("{rows}x{d}");
        assert_eq!(
            from_bf16(&g.download(&acc).unwrap()),
            sums,
            "add_rms_norm sums {shape}"
        );
        let mut want = sums.clone();
        ops::rms_norm(&mut want, &wf, d, eps, offset);
        check_elementwise(
            "add_rms_norm",
            &shape,
            &from_bf16(&g.download(&out).unwrap()),
            &want,
        );
    }
}
