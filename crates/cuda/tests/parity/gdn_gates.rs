//! The GDN decode launch that projects its own gates from the layer's normed row, against the bf16
//! GEMV of the gates then the plain decode launch it replaces.

use half::bf16;
use sanmai_cuda::cudarc::driver::CudaSlice;
use sanmai_cuda::{DecodeSlots, GdnDims, GdnGateProj, GdnProj};

use crate::common::{gpu, to_bf16, Rng};
use crate::gdn_decode::{DevLayer, DevPools, Layer, Proj};

/// The decode launch that projects its own gates (one sequence) against the bf16 GEMV of the gates
/// then the plain decode launch, which it replaces: the same bits (the output, `a` and `b`, both state
/// pools), at the 80B's GDN shape (hidden 2,048; 16 key and 32 value heads of 128) over a few steps;
/// a batch of two is refused.
#[test]
fn gdn_decode_projecting_gates_equals_gemv_then_step() {
    let Some(g) = gpu("gdn_decode_projecting_gates_equals_gemv_then_step") else {
        return;
    };
    let mut rng = Rng::new(0x9a7e5);
    let dims = GdnDims {
        hk: 16,
        hv: 32,
        dk: 128,
        dv: 128,
    };
    let (k, hv, dv) = (2048, dims.hv, dims.dv);
    assert!(g.gdn_gates_inside_fit(dims, k), "the 80B's gates fit");
    let l = Layer::random(&mut rng, dims, 4);
    let dl = DevLayer::new(g, &l);
    let w_b = g
        .upload(&to_bf16(&rng.normals(hv * k, 0.0, 0.05)).0)
        .unwrap();
    let w_a = g
        .upload(&to_bf16(&rng.normals(hv * k, 0.0, 0.05)).0)
        .unwrap();
    let (mut apart, mut fused) = (DevPools::zeros(g, &l, 2), DevPools::zeros(g, &l, 2));
    let slots = g.upload(&[1u32]).unwrap();
    let bits = |x: &CudaSlice<bf16>| -> Vec<u16> {
        g.download(x).unwrap().iter().map(|v| v.to_bits()).collect()
    };
    for step in 0..5u32 {
        let x = g.upload(&to_bf16(&rng.normals(k, 0.0, 1.0)).0).unwrap();
        let p = Proj::random(&mut rng, dims, 1);
        let (qkv, z) = (g.upload(&p.qkv.0).unwrap(), g.upload(&p.z.0).unwrap());
        let positions = g.upload(&[step]).unwrap();
        let seqs = DecodeSlots {
            slots: &slots,
            positions: &positions,
            batch: 1,
        };
        let (mut b1, mut a1) = (g.zeros::<bf16>(hv).unwrap(), g.zeros::<bf16>(hv).unwrap());
        g.gemv_bf16(&w_b, &x, &mut b1, 1, hv, k).unwrap();
        g.gemv_bf16(&w_a, &x, &mut a1, 1, hv, k).unwrap();
        let mut out1 = g.zeros::<bf16>(hv * dv).unwrap();
        let proj = GdnProj {
            qkv: &qkv,
            z: &z,
            a: &a1,
            b: &b1,
        };
        let pools = apart.launch();
        g.gdn_decode(dims, &proj, &dl.weights(), pools, &seqs, &mut out1)
            .unwrap();
        let (mut b2, mut a2) = (g.zeros::<bf16>(hv).unwrap(), g.zeros::<bf16>(hv).unwrap());
        let mut out2 = g.zeros::<bf16>(hv * dv).unwrap();
        let gates = gate_proj(&x, (&w_b, &w_a));
        let pools = fused.launch();
        let ab = (&mut a2, &mut b2);
        g.gdn_decode_projecting_gates(
            dims,
            &qkv,
            &z,
            &gates,
            ab,
            &dl.weights(),
            pools,
            &seqs,
            &mut out2,
        )
        .unwrap();
        assert_eq!(bits(&b1), bits(&b2), "step {step}: b");
        assert_eq!(bits(&a1), bits(&a2), "step {step}: a");
        assert_eq!(bits(&out1), bits(&out2), "step {step}: output");
    }
    assert_eq!(bits(&apart.conv), bits(&fused.conv), "conv rings");
    let ssm = |s: &CudaSlice<f32>| -> Vec<u32> {
        g.download(s).unwrap().iter().map(|v| v.to_bits()).collect()
    };
    assert_eq!(ssm(&apart.ssm), ssm(&fused.ssm), "recurrent states");

    let two = g.upload(&[0u32, 1]).unwrap();
    let seqs = DecodeSlots {
        slots: &two,
        positions: &two,
        batch: 2,
    };
    let x = g.zeros::<bf16>(k).unwrap();
    let (qkv, z) = (
        g.zeros::<bf16>(2 * dims.conv_dim()).unwrap(),
        g.zeros::<bf16>(2 * hv * dv).unwrap(),
    );
    let (mut b, mut a, mut out) = (
        g.zeros::<bf16>(2 * hv).unwrap(),
        g.zeros::<bf16>(2 * hv).unwrap(),
        g.zeros::<bf16>(2 * hv * dv).unwrap(),
    );
    let gates = gate_proj(&x, (&w_b, &w_a));
    let pools = fused.launch();
    let err = g
        .gdn_decode_projecting_gates(
            dims,
            &qkv,
            &z,
            &gates,
            (&mut a, &mut b),
            &dl.weights(),
            pools,
            &seqs,
            &mut out,
        )
        .unwrap_err();
    assert!(err.to_string().contains("one sequence"), "{err}");
}

/// The gate projections of the normed row `x` with weights `(w_b, w_a)`.
fn gate_proj<'a>(
    x: &'a CudaSlice<bf16>,
    (w_b, w_a): (&'a CudaSlice<bf16>, &'a CudaSlice<bf16>),
) -> GdnGateProj<'a, CudaSlice<bf16>> {
    GdnGateProj {
        x,
        w_b,
        w_a,
        k: x.len(),
    }
}
