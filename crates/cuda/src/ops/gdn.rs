//! The gated delta rule on the GPU, state f32: the fused decode step of a GDN layer (conv update,
//! delta rule and gated RMSNorm in one launch); the chunked prefill is in `gdn_chunk.rs`.

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
use half::bf16;

use crate::error::{ensure, Result};
use crate::gpu::{cfg, check_len, int, Gpu};
use crate::ops::gemv::gemv_bf16_plan;

/// Head counts and sizes of a GDN layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GdnDims {
    pub hk: usize,
    pub hv: usize,
    pub dk: usize,
    pub dv: usize,
}

impl GdnDims {
    /// Width of the conv output row `[q | k | v]`.
    pub fn conv_dim(&self) -> usize {
        2 * self.hk * self.dk + self.hv * self.dv
    }

    /// f32 values of one sequence's recurrent state, `[hv, dk, dv]`.
    pub fn state_len(&self) -> usize {
        self.hv * self.dk * self.dv
    }
}

/// The largest key head size the decode kernels take (`GDN_MAX_DK` in `gdn.cu`).
const MAX_DK: usize = 256;
/// The largest value head size (`GDN_MAX_DV` in `gdn.cu`: a head's output sits in shared memory).
const MAX_DV: usize = 512;
/// The largest key head size of `gdn_decode_fused`; larger ones take `gdn_decode_fused_dk256`.
const SMALL_DK: usize = 128;
/// Threads of a `gdn_decode_fused` block (8 warps × 16 state rows each).
const THREADS: u32 = 256;
/// Threads of a `gdn_decode_fused_dk256` block (16 warps × 16 state rows each).
const THREADS_DK256: u32 = 512;
/// The weights of one GDN layer that the decode step reads besides its projections, with the conv's
/// width and the norm's epsilon.
pub struct GdnDecodeWeights<'a, B: DevicePtr<bf16>, F: DevicePtr<f32>> {
    /// `conv1d.weight` `[conv_dim, kernel]`.
    pub conv: &'a B,
    pub kernel: usize,
    /// `A_log` `[hv]`.
    pub a_log: &'a F,
    /// `dt_bias` `[hv]`.
    pub dt_bias: &'a F,
    /// The gated RMSNorm's weight `[dv]`.
    pub norm: &'a B,
    pub eps: f32,
}

/// A GDN layer's projections of a decode step's rows: `qkv` `[batch, conv_dim]` (`[q | k | v]`
/// with q, k `[hk, dk]`, v `[hv, dv]`), `z` `[batch, hv·dv]`, and the raw gate projections `a`,
/// `b` `[batch, hv]`.
pub struct GdnProj<'a, B: DevicePtr<bf16>> {
    pub qkv: &'a B,
    pub z: &'a B,
    pub a: &'a B,
    pub b: &'a B,
}

/// The gate projections a decode step of one sequence computes inside its launch
/// ([`Gpu::gdn_decode_projecting_gates`]): `b = w_b · x`, `a = w_a · x` for the layer's normed row `x`
/// `[1, k]` and the projections' weights `w_b`, `w_a` `[hv, k]` bf16.
pub struct GdnGateProj<'a, B: DevicePtr<bf16>> {
    pub x: &'a B,
    pub w_b: &'a B,
    pub w_a: &'a B,
    pub k: usize,
}

/// Where a decode launch reads its gates: given rows `a`, `b` `[batch, hv]`, or projected inside
/// the launch and written to `a`, `b` `[1, hv]`.
enum GateRows<'a, B: DevicePtr<bf16>, M: DevicePtrMut<bf16>> {
    Given {
        a: &'a B,
        b: &'a B,
    },
    Projected {
        proj: &'a GdnGateProj<'a, B>,
        a: &'a mut M,
        b: &'a mut M,
    },
}

/// A GDN layer's state pools: the conv rings `[num_slots, kernel, conv_dim]` bf16 (input `x_q` at
/// entry `q mod kernel`) and the recurrent states `[num_slots, hv, dk, dv]` f32.
pub struct GdnPools<'a, C: DevicePtrMut<bf16>, S: DevicePtrMut<f32>> {
    pub conv: &'a mut C,
    pub ssm: &'a mut S,
}

/// The sequences of a decode step: `batch` rows, row `i` sequence `i` at position `positions[i]`
/// with its state in slot `slots[i]` (device).
pub struct DecodeSlots<'a, U: DevicePtr<u32>> {
    pub slots: &'a U,
    pub positions: &'a U,
    pub batch: usize,
}

/// A step's sequences as the multi-sequence prefill kernels read them (device): sequence `i` owns
/// rows `starts[i] .. starts[i] + lens[i]` of the step's `rows` (clamped to `rows`) and state slot
/// `slots[i]` (out of range: zero outputs, no state touched); `max_len` is the longest `lens[i]`
/// (it sizes the conv's grid).
pub struct SeqRows<'a, U: DevicePtr<u32>> {
    pub starts: &'a U,
    pub lens: &'a U,
    pub slots: &'a U,
    pub rows: usize,
    pub n_seq: usize,
    pub max_len: usize,
}

impl Gpu {
    /// One decode step of a GDN layer for `seqs.batch` sequences, in one launch (one block per
    /// sequence and value head; the head's state slice is read once into registers and written
    /// once): causal conv + SiLU of the projection row `qkv` against the conv ring of the sequence's
    /// slot, the gated delta rule with the gates from `a`, `b`, then the gated RMSNorm with `z` and
    /// `eps`, into `out` (`[batch, hv·dv]`). Sequence `i` is at position `positions[i]` in slot
    /// `slots[i]` of the pools (this token's input is stored at ring entry `positions[i] mod
    /// kernel`); a slot id out of range gives a zero output row and touches no state. Matches the CPU's `causal_conv1d_silu` (one token), gates
    /// (`g = −exp(A_log)·softplus(a + dt_bias)`, `β = sigmoid(b)`), `gdn_recurrent` with `t = 1` and
    /// `gated_rms_norm`, without rounding between them. `dk ≤ 256`, `dv ≤ 512`.
    #[allow(clippy::too_many_arguments)]
    pub fn gdn_decode(
        &self,
        dims: GdnDims,
        proj: &GdnProj<'_, impl DevicePtr<bf16>>,
        w: &GdnDecodeWeights<'_, impl DevicePtr<bf16>, impl DevicePtr<f32>>,
        pools: GdnPools<'_, impl DevicePtrMut<bf16>, impl DevicePtrMut<f32>>,
        seqs: &DecodeSlots<'_, impl DevicePtr<u32>>,
        out: &mut impl DevicePtrMut<bf16>,
    ) -> Result<()> {
        let GdnProj { qkv, z, a, b } = *proj;
        let gates: GateRows<'_, _, CudaSlice<bf16>> = GateRows::Given { a, b };
        self.gdn_decode_launch(dims, qkv, z, gates, w, pools, seqs, out)
    }

    /// Whether [`Gpu::gdn_decode_projecting_gates`] takes a layer of `dims` whose gate projections
    /// read `k` inputs: `dk ≤ 128` (the 256-thread kernel) and the one-row bf16 GEMV of the `hv`
    /// gate rows cut one row a block, 256 threads a row, which is the cut the launch computes each
    /// head's gates with (so that they are the values of [`Gpu::gemv_bf16`]).
    pub fn gdn_gates_inside_fit(&self, dims: GdnDims, k: usize) -> bool {
        let plan = gemv_bf16_plan(dims.hv, k, self.info().multiprocessors as usize);
        dims.dk <= SMALL_DK
            && k.is_multiple_of(8)
            && (plan.rps, plan.tpr_log2, plan.blocks) == (1, 8, dims.hv)
    }

    /// [`Gpu::gdn_decode`] of one sequence whose gates the launch projects itself (one launch
    /// instead of a GEMV and the step): each head's block first computes its `b` and `a` from
    /// `gates` with the arithmetic of [`Gpu::gemv_bf16`] at one row, writing them to `b`, `a`
    /// (`[1, hv]`), then runs the step on them. Needs [`Gpu::gdn_gates_inside_fit`] and
    /// `seqs.batch == 1`.
    #[allow(clippy::too_many_arguments)]
    pub fn gdn_decode_projecting_gates<B: DevicePtr<bf16>, M: DevicePtrMut<bf16>>(
        &self,
        dims: GdnDims,
        qkv: &B,
        z: &B,
        gates: &GdnGateProj<'_, B>,
        (a, b): (&mut M, &mut M),
        w: &GdnDecodeWeights<'_, impl DevicePtr<bf16>, impl DevicePtr<f32>>,
        pools: GdnPools<'_, impl DevicePtrMut<bf16>, impl DevicePtrMut<f32>>,
        seqs: &DecodeSlots<'_, impl DevicePtr<u32>>,
        out: &mut impl DevicePtrMut<bf16>,
    ) -> Result<()> {
        const OP: &str = "gdn_decode";
        ensure(seqs.batch == 1, OP, || {
            format!(
                "projecting the gates takes one sequence, not {}",
                seqs.batch
            )
        })?;
        ensure(self.gdn_gates_inside_fit(dims, gates.k), OP, || {
            format!(
                "gates of {} rows of {} inputs (dk = {}) do not fit the projecting launch",
                dims.hv, gates.k, dims.dk
            )
        })?;
        check_len(OP, "x", gates.x, gates.k)?;
        check_len(OP, "w_b", gates.w_b, dims.hv * gates.k)?;
        check_len(OP, "w_a", gates.w_a, dims.hv * gates.k)?;
        for (what, p) in [
            ("x", self.addr(gates.x)),
            ("w_b", self.addr(gates.w_b)),
            ("w_a", self.addr(gates.w_a)),
        ] {
            ensure(p.is_multiple_of(16), OP, || {
                format!("{what} must be 16-byte aligned")
            })?;
        }
        let gates = GateRows::Projected { proj: gates, a, b };
        self.gdn_decode_launch(dims, qkv, z, gates, w, pools, seqs, out)
    }

    #[allow(clippy::too_many_arguments)]
    fn gdn_decode_launch<B: DevicePtr<bf16>, M: DevicePtrMut<bf16>>(
        &self,
        dims: GdnDims,
        qkv: &B,
        z: &B,
        gates: GateRows<'_, B, M>,
        w: &GdnDecodeWeights<'_, impl DevicePtr<bf16>, impl DevicePtr<f32>>,
        pools: GdnPools<'_, impl DevicePtrMut<bf16>, impl DevicePtrMut<f32>>,
        seqs: &DecodeSlots<'_, impl DevicePtr<u32>>,
        out: &mut impl DevicePtrMut<bf16>,
    ) -> Result<()> {
        const OP: &str = "gdn_decode";
        let GdnPools {
            conv: conv_pool,
            ssm: ssm_pool,
        } = pools;
        let DecodeSlots {
            slots,
            positions,
            batch,
        } = *seqs;
        let (kernel, eps) = (w.kernel, w.eps);
        let GdnDims { hk, hv, dk, dv } = dims;
        ensure(hk > 0 && hv > 0 && hv % hk == 0, OP, || {
            format!("hv = {hv} must be a positive multiple of hk = {hk}")
        })?;
        ensure(dk > 0 && dk <= MAX_DK && dv > 0 && dv <= MAX_DV, OP, || {
            format!("dk = {dk} must be in 1..={MAX_DK}, dv = {dv} in 1..={MAX_DV}")
        })?;
        ensure(kernel >= 1, OP, || {
            "conv kernel size must be at least 1".into()
        })?;
        ensure(batch <= 65535, OP, || "batch exceeds 65535".into())?;
        let cd = dims.conv_dim();
        check_len(OP, "qkv", qkv, batch * cd)?;
        check_len(OP, "z", z, batch * hv * dv)?;
        match &gates {
            GateRows::Given { a, b } => {
                check_len(OP, "a", *a, batch * hv)?;
                check_len(OP, "b", *b, batch * hv)?;
            }
            GateRows::Projected { a, b, .. } => {
                check_len(OP, "a", &**a, batch * hv)?;
                check_len(OP, "b", &**b, batch * hv)?;
            }
        }
        check_len(OP, "conv weight", w.conv, cd * kernel)?;
        check_len(OP, "a_log", w.a_log, hv)?;
        check_len(OP, "dt_bias", w.dt_bias, hv)?;
        check_len(OP, "norm weight", w.norm, dv)?;
        check_len(OP, "slots", slots, batch)?;
        check_len(OP, "positions", positions, batch)?;
        check_len(OP, "out", out, batch * hv * dv)?;
        if batch == 0 {
            return Ok(());
        }
        // A slot must lie inside both pools.
        let num_slots = (conv_pool.len() / (kernel * cd)).min(ssm_pool.len() / dims.state_len());
        let num_slots = u32::try_from(num_slots).unwrap_or(u32::MAX);
        let q_scale = (dk as f64).powf(-0.5) as f32;
        let (hki, hvi, dki, dvi, ki) = (
            int(OP, "hk", hk)?,
            int(OP, "hv", hv)?,
            dk as i32,
            dv as i32,
            int(OP, "kernel", kernel)?,
        );
        let projected = matches!(gates, GateRows::Projected { .. });
        let (name, threads) = match projected {
            true => ("gdn_decode_fused_gates", THREADS),
            false if dk <= SMALL_DK => ("gdn_decode_fused", THREADS),
            false => ("gdn_decode_fused_dk256", THREADS_DK256),
        };
        let proj = match &gates {
            GateRows::Given { .. } => None,
            GateRows::Projected { proj, .. } => Some((*proj, int(OP, "k", proj.k)?)),
        };
        let grid = (hvi as u32, batch as u32, 1);
        let mut l = self.launch(self.kernel(name)?);
        l.ptr(qkv).ptr(z);
        match gates {
            GateRows::Given { a, b } => l.ptr(a).ptr(b),
            GateRows::Projected { a, b, .. } => l.ptr_mut(a).ptr_mut(b),
        };
        l.ptr(w.conv)
            .ptr(w.a_log)
            .ptr(w.dt_bias)
            .ptr(w.norm)
            .ptr_mut(conv_pool)
            .ptr_mut(ssm_pool)
            .ptr(slots)
            .ptr(positions)
            .ptr_mut(out)
            .arg(&hki)
            .arg(&hvi)
            .arg(&dki)
            .arg(&dvi)
            .arg(&ki)
            .arg(&q_scale)
            .arg(&eps)
            .arg(&num_slots);
        if let Some((p, k)) = &proj {
            l.ptr(p.x).ptr(p.w_b).ptr(p.w_a).arg(k);
        }
        // SAFETY: argument types match the kernel; lengths checked above; slot ids at or beyond
        // `num_slots` (which both pools hold) are skipped by the kernel; the block size is the one the
        // chosen kernel requires and dk, dv are within its limits; a projecting launch has one
        // sequence, x and the gate weights checked (lengths, alignment, the GEMV cut) by its caller.
        unsafe { l.launch(cfg(grid, threads, 0)) }?;
        Ok(())
    }
}
