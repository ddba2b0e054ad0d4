//! The fused GDN decode step (conv update against the ring, delta rule, gated RMSNorm) against the
//! CPU's `causal_conv1d_silu` + gates + `gdn_recurrent` (t = 1) + `gated_rms_norm`: alone, after a
//! prefill step, and after a sequence's prefill in chunks shorter than the conv window (against the
//! CPU's one pass). The CPU references mirror where the GPU rounds to bf16: the prefill path rounds the
//! conv output and the delta-rule output, the fused decode keeps both in f32.

use half::bf16;
use sanmai_cpu::ops;
use sanmai_cuda::cudarc::driver::CudaSlice;
use sanmai_cuda::{
    ConvWeight, DecodeSlots, GdnDecodeWeights, GdnDims, GdnGates, GdnPools, GdnProj, NormRows,
    SeqRows,
};

use crate::common::{check_f32, check_reduction, from_bf16, gpu, to_bf16, Rng};
use crate::conv::{state_from_ring, state_into_ring};
use crate::gdn::{cpu_inputs, NEXT};

/// The gated RMSNorm's epsilon in the model configs.
const EPS: f32 = 1e-6;

/// A random GDN layer: its shape, conv kernel size and weights (bf16 ones as the device gets them and
/// as f32).
pub(crate) struct Layer {
    dims: GdnDims,
    kk: usize,
    conv: (Vec<bf16>, Vec<f32>),
    a_log: Vec<f32>,
    dt_bias: Vec<f32>,
    norm: (Vec<bf16>, Vec<f32>),
}

impl Layer {
    pub(crate) fn random(rng: &mut Rng, dims: GdnDims, kk: usize) -> Self {
        Layer {
            dims,
            kk,
            conv: to_bf16(&rng.normals(dims.conv_dim() * kk, 0.0, 0.5)),
            a_log: (0..dims.hv).map(|_| rng.unit() * 2.0 - 1.0).collect(),
            dt_bias: rng.normals(dims.hv, 0.0, 0.5),
            norm: to_bf16(&rng.normals(dims.dv, 1.0, 0.2)),
        }
    }

    fn shape(&self) -> String {
        let GdnDims { hk, hv, dk, dv } = self.dims;
        format!("hk{hk}_hv{hv}_dk{dk}_dv{dv}_k{}", self.kk)
    }
}

/// A layer's shape, conv kernel size and weights on the device.
pub(crate) struct DevLayer {
    dims: GdnDims,
    kk: usize,
    conv: CudaSlice<bf16>,
    a_log: CudaSlice<f32>,
    dt_bias: CudaSlice<f32>,
    norm: CudaSlice<bf16>,
}

impl DevLayer {
    pub(crate) fn new(g: &sanmai_cuda::Gpu, l: &Layer) -> Self {
        DevLayer {
            dims: l.dims,
            kk: l.kk,
            conv: g.upload(&l.conv.0).unwrap(),
            a_log: g.upload(&l.a_log).unwrap(),
            dt_bias: g.upload(&l.dt_bias).unwrap(),
            norm: g.upload(&l.norm.0).unwrap(),
        }
    }

    pub(crate) fn weights(&self) -> GdnDecodeWeights<'_, CudaSlice<bf16>, CudaSlice<f32>> {
        GdnDecodeWeights {
            conv: &self.conv,
            kernel: self.kk,
            a_log: &self.a_log,
            dt_bias: &self.dt_bias,
            norm: &self.norm,
            eps: EPS,
        }
    }
}

/// A step's projections of `rows` rows: `qkv` `[rows, conv_dim]`, `z` `[rows, hv·dv]`, `a`, `b`
/// `[rows, hv]` (bf16 as uploaded, and f32).
pub(crate) struct Proj {
    rows: usize,
    pub(crate) qkv: (Vec<bf16>, Vec<f32>),
    pub(crate) z: (Vec<bf16>, Vec<f32>),
    a: (Vec<bf16>, Vec<f32>),
    b: (Vec<bf16>, Vec<f32>),
}

impl Proj {
    pub(crate) fn random(rng: &mut Rng, dims: GdnDims, rows: usize) -> Self {
        let hv = dims.hv;
        Proj {
            rows,
            qkv: to_bf16(&rng.normals(rows * dims.conv_dim(), 0.0, 1.0)),
            z: to_bf16(&rng.normals(rows * hv * dims.dv, 0.0, 1.0)),
            a: to_bf16(&rng.normals(rows * hv, 0.0, 1.0)),
            b: to_bf16(&rng.normals(rows * hv, 0.0, 1.0)),
        }
    }

    /// Rows `r0 .. r0 + n`.
    fn rows(&self, r0: usize, n: usize) -> Self {
        let cut = |x: &(Vec<bf16>, Vec<f32>)| {
            let w = x.0.len() / self.rows;
            (
                x.0[r0 * w..(r0 + n) * w].to_vec(),
                x.1[r0 * w..(r0 + n) * w].to_vec(),
            )
        };
        Proj {
            rows: n,
            qkv: cut(&self.qkv),
            z: cut(&self.z),
            a: cut(&self.a),
            b: cut(&self.b),
        }
    }
}

/// The CPU's GDN state of one sequence: the conv state `[kernel − 1, conv_dim]` and the recurrent
/// state `[hv, dk, dv]`.
struct CpuState {
    conv: Vec<f32>,
    ssm: Vec<f32>,
}

impl CpuState {
    fn zeros(l: &Layer) -> Self {
        CpuState {
            conv: vec![0f32; (l.kk - 1) * l.dims.conv_dim()],
            ssm: vec![0f32; l.dims.state_len()],
        }
    }
}

/// Rounds to bf16 in place.
fn round(x: &mut [f32]) {
    for v in x {
        *v = bf16::from_f32(*v).to_f32();
    }
}

/// The CPU layer over all rows of `x`, one sequence, advancing `st`: conv + SiLU, gates, the delta
/// rule (chunked form for more than one row), gated RMSNorm. The first `rounded` rows mirror the GPU's
/// prefill path, which rounds the conv output and the delta-rule output to bf16; the fused decode
/// keeps both in f32.
fn cpu_layer(l: &Layer, x: &Proj, st: &mut CpuState, rounded: usize) -> Vec<f32> {
    let GdnDims { hk, hv, dk, dv } = l.dims;
    let (t, cd) = (x.rows, l.dims.conv_dim());
    let mut mixed = vec![0f32; t * cd];
    ops::causal_conv1d_silu(&x.qkv.1, &l.conv.1, &mut st.conv, t, cd, l.kk, &mut mixed);
    let r = rounded * cd;
    round(&mut mixed[..r]);
    let (q, k, v, gate, beta) = cpu_inputs(l.dims, &mixed, &x.a.1, &x.b.1, &l.a_log, &l.dt_bias);
    let mut core = vec![0f32; t * hv * dv];
    let state = &mut st.ssm;
    let inputs = ops::GdnInputs {
        q: &q,
        k: &k,
        v: &v,
        g: &gate,
        beta: &beta,
    };
    let sizes = ops::GdnSizes { t, hk, hv, dk, dv };
    if t == 1 {
        ops::gdn_recurrent(&inputs, sizes, state, &mut core);
    } else {
        ops::gdn_chunked(&inputs, sizes, 64, state, &mut core);
    }
    let r = rounded * hv * dv;
    round(&mut core[..r]);
    ops::gated_rms_norm(&mut core, &x.z.1, &l.norm.1, dv, EPS);
    core
}

/// A layer's state pools on the device: conv rings `[slots, kernel, conv_dim]` and recurrent states
/// `[slots, hv, dk, dv]`.
pub(crate) struct DevPools {
    pub(crate) conv: CudaSlice<bf16>,
    pub(crate) ssm: CudaSlice<f32>,
}

impl DevPools {
    pub(crate) fn zeros(g: &sanmai_cuda::Gpu, l: &Layer, slots: usize) -> Self {
        DevPools {
            conv: g.zeros(slots * l.kk * l.dims.conv_dim()).unwrap(),
            ssm: g.zeros(slots * l.dims.state_len()).unwrap(),
        }
    }

    /// The pools as a decode launch takes them.
    pub(crate) fn launch(&mut self) -> GdnPools<'_, CudaSlice<bf16>, CudaSlice<f32>> {
        GdnPools {
            conv: &mut self.conv,
            ssm: &mut self.ssm,
        }
    }
}

/// The fused decode on the device: row `i` of `x` is sequence `i`, at position `positions[i]` in
/// slot `slots[i]`. Returns the output `[rows, hv·dv]`.
fn gpu_decode(
    g: &sanmai_cuda::Gpu,
    l: &DevLayer,
    x: &Proj,
    pools: &mut DevPools,
    (slots, positions): (&[u32], &[u32]),
) -> Vec<f32> {
    let (hv, dv) = (l.dims.hv, l.dims.dv);
    let n = x.rows;
    let (qkv, z) = (g.upload(&x.qkv.0).unwrap(), g.upload(&x.z.0).unwrap());
    let (a, b) = (g.upload(&x.a.0).unwrap(), g.upload(&x.b.0).unwrap());
    let (sd, pd) = (g.upload(slots).unwrap(), g.upload(positions).unwrap());
    let mut out = g.zeros::<bf16>(n * hv * dv).unwrap();
    let proj = GdnProj {
        qkv: &qkv,
        z: &z,
        a: &a,
        b: &b,
    };
    let state = pools.launch();
    let seqs = DecodeSlots {
        slots: &sd,
        positions: &pd,
        batch: n,
    };
    g.gdn_decode(l.dims, &proj, &l.weights(), state, &seqs, &mut out)
        .unwrap();
    from_bf16(&g.download(&out).unwrap())
}

/// The backend's prefill path on the device (conv prefill, chunked delta rule, gated RMSNorm) over
/// the rows of `x`: sequence `i` owns the next `lens[i]` rows, from position `pos0[i]`, in slot
/// `slots[i]`. Returns the output `[rows, hv·dv]`.
fn gpu_prefill(
    g: &sanmai_cuda::Gpu,
    l: &DevLayer,
    x: &Proj,
    pools: &mut DevPools,
    lens: &[usize],
    slots: &[u32],
    pos0: &[u32],
) -> Vec<f32> {
    let (hv, dv, cd) = (l.dims.hv, l.dims.dv, l.dims.conv_dim());
    let rows = x.rows;
    let (mut starts, mut positions) = (Vec::new(), Vec::new());
    for (&len, &p) in lens.iter().zip(pos0) {
        starts.push(positions.len() as u32);
        positions.extend((0..len as u32).map(|r| p + r));
    }
    assert_eq!(positions.len(), rows, "chunks cover the rows");
    let lens_u: Vec<u32> = lens.iter().map(|&v| v as u32).collect();
    let (qkv, z) = (g.upload(&x.qkv.0).unwrap(), g.upload(&x.z.0).unwrap());
    let (a, b) = (g.upload(&x.a.0).unwrap(), g.upload(&x.b.0).unwrap());
    let (pd, st, ln, sd) = (
        g.upload(&positions).unwrap(),
        g.upload(&starts).unwrap(),
        g.upload(&lens_u).unwrap(),
        g.upload(slots).unwrap(),
    );
    let mut mixed = g.zeros::<bf16>(rows * cd).unwrap();
    let mut core = g.zeros::<bf16>(rows * hv * dv).unwrap();
    let mut out = g.zeros::<bf16>(rows * hv * dv).unwrap();
    let n = lens.len();
    let max_len = lens.iter().copied().max().unwrap_or(0);
    let step = SeqRows {
        starts: &st,
        lens: &ln,
        slots: &sd,
        rows,
        n_seq: n,
        max_len,
    };
    let conv = ConvWeight {
        w: &l.conv,
        channels: cd,
        kernel: l.kk,
    };
    g.conv1d_prefill(&qkv, &conv, &mut pools.conv, &pd, &step, &mut mixed)
        .unwrap();
    let gates = GdnGates {
        a: &a,
        b: &b,
        a_log: &l.a_log,
        dt_bias: &l.dt_bias,
    };
    g.gdn_chunk_prefill(l.dims, &mixed, &gates, &mut pools.ssm, &step, &mut core)
        .unwrap();
    let shape = NormRows {
        rows: rows * hv,
        d: dv,
        eps: EPS,
    };
    g.gated_rms_norm(&core, &z, &l.norm, &mut out, shape)
        .unwrap();
    from_bf16(&g.download(&out).unwrap())
}

/// One fused decode step of `slots.len()` sequences (sequence `i` at position `positions[i]`) over
/// pools of `num_slots` random states; checks the output, the recurrent states, the rings (exact:
/// this token's input at its entry, nothing else changed), slots not in the batch untouched and the
/// zero output of out-of-range slots.
fn decode_case(
    g: &sanmai_cuda::Gpu,
    rng: &mut Rng,
    l: &Layer,
    slots: &[u32],
    positions: &[u32],
    num_slots: usize,
) {
    let (hv, dv, cd, kk) = (l.dims.hv, l.dims.dv, l.dims.conv_dim(), l.kk);
    let (sl, rl) = (l.dims.state_len(), kk * cd);
    let b = slots.len();
    let x = Proj::random(rng, l.dims, b);
    let (ringb, ringf) = to_bf16(&rng.normals(num_slots * rl, 0.0, 1.0));
    let ssm0 = rng.normals(num_slots * sl, 0.0, 0.3);

    let mut want_ring = ringf.clone();
    let mut want_ssm = ssm0.clone();
    let mut want = vec![0f32; b * hv * dv];
    for (i, (&s, &p)) in slots.iter().zip(positions).enumerate() {
        let s = s as usize;
        if s >= num_slots {
            continue;
        }
        let ring = &mut want_ring[s * rl..(s + 1) * rl];
        let mut st = CpuState {
            conv: state_from_ring(ring, p, kk, cd),
            ssm: want_ssm[s * sl..(s + 1) * sl].to_vec(),
        };
        let o = cpu_layer(l, &x.rows(i, 1), &mut st, 0);
        want[i * hv * dv..(i + 1) * hv * dv].copy_from_slice(&o);
        state_into_ring(&st.conv, p + 1, kk, cd, ring);
        want_ssm[s * sl..(s + 1) * sl].copy_from_slice(&st.ssm);
    }

    let w = DevLayer::new(g, l);
    let mut pools = DevPools {
        conv: g.upload(&ringb).unwrap(),
        ssm: g.upload(&ssm0).unwrap(),
    };
    let got = gpu_decode(g, &w, &x, &mut pools, (slots, positions));
    let shape = format!("b{b}_{}", l.shape());
    check_reduction("gdn_decode_out", &shape, &got, &want);
    for (i, &s) in slots.iter().enumerate() {
        if s as usize >= num_slots {
            assert!(
                got[i * hv * dv..(i + 1) * hv * dv]
                    .iter()
                    .all(|&v| v == 0.0),
                "{shape}: bad slot gives zeros"
            );
        }
    }
    let got_ssm = g.download(&pools.ssm).unwrap();
    check_f32("gdn_decode_state", &shape, &got_ssm, &want_ssm);
    for s in 0..num_slots {
        if !slots.contains(&(s as u32)) {
            assert_eq!(
                got_ssm[s * sl..(s + 1) * sl],
                ssm0[s * sl..(s + 1) * sl],
                "{shape}: slot {s} is not in the batch and must be untouched"
            );
        }
    }
    assert_eq!(
        from_bf16(&g.download(&pools.conv).unwrap()),
        want_ring,
        "{shape}: conv rings"
    );
}

#[test]
fn gdn_decode_matches_cpu() {
    let Some(g) = gpu("gdn_decode_matches_cpu") else {
        return;
    };
    let mut rng = Rng::new(40);
    let d = |hk, hv, dk, dv| GdnDims { hk, hv, dk, dv };
    for (dims, kk) in [
        // Qwen3-Next-80B's and Qwen3.5-35B's layer; three value heads per key head (qwen4-exp-125b);
        // one (hv = hk).
        (NEXT, 4),
        (d(16, 48, 128, 128), 4),
        (d(4, 4, 64, 64), 4),
        // dv not a multiple of 32; dk above 128 (the dk256 kernel); dk = 256 with kernel 3; dv not a
        // multiple of 4 (scalar state access) with kernel 2; the tiny configs' shape, also with
        // kernel 1 (no ring reads or writes).
        (d(2, 6, 64, 80), 4),
        (d(2, 4, 192, 40), 4),
        (d(1, 2, 256, 32), 3),
        (d(1, 2, 48, 30), 2),
        (d(2, 4, 16, 24), 4),
        (d(2, 4, 16, 24), 1),
        // dv above one pass of 128 columns: three passes; two passes of the dk256 kernel with dv not
        // a multiple of 4 and three value heads per key head.
        (d(2, 2, 32, 300), 4),
        (d(1, 3, 200, 130), 4),
    ] {
        let l = Layer::random(&mut rng, dims, kk);
        // 11 is out of range: zero output, nothing touched; slot 1 is not in the batch. Positions
        // put this token's ring entry at different offsets.
        decode_case(g, &mut rng, &l, &[2, 0, 3, 11], &[0, 7, 1_000_003, 2], 4);
    }
}

#[test]
fn gdn_decode_batches_match_cpu() {
    let Some(g) = gpu("gdn_decode_batches_match_cpu") else {
        return;
    };
    let mut rng = Rng::new(42);
    // Qwen3-Next's layer at decode batch 1, 3 and 8, slots out of order over a larger pool, the
    // batch of 8 with one out-of-range slot (13).
    let l = Layer::random(&mut rng, NEXT, 4);
    for (slots, num_slots) in [
        (&[5u32][..], 8),
        (&[4, 1, 2][..], 6),
        (&[7, 0, 3, 9, 1, 4, 13, 2][..], 12),
    ] {
        let positions: Vec<u32> = slots.iter().map(|_| rng.below(5000)).collect();
        decode_case(g, &mut rng, &l, slots, &positions, num_slots);
    }
}

/// A prefill step of `lens.len()` sequences from position 0 (sequence `i` in slot `slots[i]` of
/// fresh pools of `num_slots`) through the backend's prefill path, then `steps` fused decode steps of
/// all of them (the rings wrap), each checked against the CPU; at the end the recurrent states and
/// the rings' last `kernel − 1` inputs.
fn prefill_then_decode_case(
    g: &sanmai_cuda::Gpu,
    rng: &mut Rng,
    l: &Layer,
    lens: &[usize],
    slots: &[u32],
    num_slots: usize,
    steps: usize,
) {
    let (hv, dv, cd, kk) = (l.dims.hv, l.dims.dv, l.dims.conv_dim(), l.kk);
    let n = lens.len();
    let w = DevLayer::new(g, l);
    let mut pools = DevPools::zeros(g, l, num_slots);
    let mut cpu: Vec<CpuState> = (0..n).map(|_| CpuState::zeros(l)).collect();
    let lens_s: Vec<String> = lens.iter().map(|l| l.to_string()).collect();
    let shape = format!("t{}_{}", lens_s.join("+"), l.shape());

    let rows: usize = lens.iter().sum();
    let x = Proj::random(rng, l.dims, rows);
    let mut want = Vec::with_capacity(rows * hv * dv);
    let mut r0 = 0;
    for (st, &t) in cpu.iter_mut().zip(lens) {
        want.extend(cpu_layer(l, &x.rows(r0, t), st, t));
        r0 += t;
    }
    let got = gpu_prefill(g, &w, &x, &mut pools, lens, slots, &vec![0; n]);
    check_reduction("gdn_prefill_out", &shape, &got, &want);

    let mut pos: Vec<u32> = lens.iter().map(|&t| t as u32).collect();
    for step in 0..steps {
        let x = Proj::random(rng, l.dims, n);
        let mut want = Vec::with_capacity(n * hv * dv);
        for (i, st) in cpu.iter_mut().enumerate() {
            want.extend(cpu_layer(l, &x.rows(i, 1), st, 0));
        }
        let got = gpu_decode(g, &w, &x, &mut pools, (slots, &pos));
        check_reduction(
            "gdn_decode_after_prefill",
            &format!("{shape}_step{step}"),
            &got,
            &want,
        );
        for p in &mut pos {
            *p += 1;
        }
    }

    let (sl, rl) = (l.dims.state_len(), kk * cd);
    let got_ssm = g.download(&pools.ssm).unwrap();
    let got_ring = from_bf16(&g.download(&pools.conv).unwrap());
    for ((st, &s), &p) in cpu.iter().zip(slots).zip(&pos) {
        let s = s as usize;
        check_f32(
            "gdn_decode_after_prefill_state",
            &format!("{shape}_slot{s}"),
            &got_ssm[s * sl..(s + 1) * sl],
            &st.ssm,
        );
        assert_eq!(
            state_from_ring(&got_ring[s * rl..(s + 1) * rl], p, kk, cd),
            st.conv,
            "{shape}: ring of slot {s}"
        );
    }
}

#[test]
fn gdn_prefill_then_decode_matches_cpu() {
    let Some(g) = gpu("gdn_prefill_then_decode_matches_cpu") else {
        return;
    };
    let mut rng = Rng::new(45);
    // Three sequences (prompts of 5, 1 and 70 tokens, slots out of order, slot 1 unused), then
    // six decode steps: every ring entry is written and read back in each of the kernel's offsets.
    for (dims, kk) in [
        (NEXT, 4),
        (
            GdnDims {
                hk: 2,
                hv: 6,
                dk: 192,
                dv: 40,
            },
            3,
        ),
    ] {
        let l = Layer::random(&mut rng, dims, kk);
        prefill_then_decode_case(g, &mut rng, &l, &[5, 1, 70], &[2, 0, 3], 4, 6);
    }
}

/// One sequence (slot 1 of fresh pools of 3) prefilled in `chunks` through the backend's prefill
/// path, one step per chunk, then `decodes` fused decode steps, against the CPU's single pass over
/// all its tokens (chunked form, its conv over all rows at once); checks every output row, the final
/// recurrent state and ring, and the other slots untouched.
fn chunks_then_decode_case(
    g: &sanmai_cuda::Gpu,
    rng: &mut Rng,
    l: &Layer,
    chunks: &[usize],
    decodes: usize,
) {
    let (cd, kk) = (l.dims.conv_dim(), l.kk);
    let prefill: usize = chunks.iter().sum();
    let t = prefill + decodes;
    let x = Proj::random(rng, l.dims, t);
    let mut cpu = CpuState::zeros(l);
    let want = cpu_layer(l, &x, &mut cpu, prefill);

    let w = DevLayer::new(g, l);
    let mut pools = DevPools::zeros(g, l, 3);
    let mut got = Vec::with_capacity(want.len());
    let mut p = 0usize;
    for &len in chunks {
        got.extend(gpu_prefill(
            g,
            &w,
            &x.rows(p, len),
            &mut pools,
            &[len],
            &[1],
            &[p as u32],
        ));
        p += len;
    }
    for _ in 0..decodes {
        got.extend(gpu_decode(
            g,
            &w,
            &x.rows(p, 1),
            &mut pools,
            (&[1], &[p as u32]),
        ));
        p += 1;
    }
    let chunks_s: Vec<String> = chunks.iter().map(|l| l.to_string()).collect();
    let shape = format!("t{}+{decodes}dec_{}", chunks_s.join("+"), l.shape());
    check_reduction("gdn_chunks_then_decode_out", &shape, &got, &want);
    let (sl, rl) = (l.dims.state_len(), kk * cd);
    let got_ssm = g.download(&pools.ssm).unwrap();
    check_f32(
        "gdn_chunks_then_decode_state",
        &shape,
        &got_ssm[sl..2 * sl],
        &cpu.ssm,
    );
    let got_ring = from_bf16(&g.download(&pools.conv).unwrap());
    assert_eq!(
        state_from_ring(&got_ring[rl..2 * rl], t as u32, kk, cd),
        cpu.conv,
        "{shape}: ring"
    );
    assert!(
        got_ssm[..sl]
            .iter()
            .chain(&got_ssm[2 * sl..])
            .all(|&v| v == 0.0)
            && got_ring[..rl]
                .iter()
                .chain(&got_ring[2 * rl..])
                .all(|&v| v == 0.0),
        "{shape}: other slots untouched"
    );
}

#[test]
fn gdn_short_chunks_then_decode_match_one_pass() {
    let Some(g) = gpu("gdn_short_chunks_then_decode_match_one_pass") else {
        return;
    };
    let mut rng = Rng::new(46);
    // Chunks shorter than kernel − 1 = 3 (each leaves part of the ring from before it), then decodes
    // past a wrap of the ring.
    for dims in [
        NEXT,
        GdnDims {
            hk: 2,
            hv: 4,
            dk: 16,
            dv: 24,
        },
    ] {
        let l = Layer::random(&mut rng, dims, 4);
        chunks_then_decode_case(g, &mut rng, &l, &[2, 1, 2, 1], 5);
    }
}
