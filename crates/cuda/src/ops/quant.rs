//! Packed-integer weights consumed in their packed form (`kernels/quant.cu`): compressed-tensors
//! `pack-quantized` INT4 (8 codes per u32) and INT8 (4 per u32), and INT6 gapless (32 codes in 6 u32,
//! rows padded to 32), symmetric, with f32 scales per group of `group_size` inputs or per row
//! (`group_size` 0). The layout is the one `sanmai_weights::quant::PackedTensor` holds: upload its
//! `words()` and `scales` as they are.
//!
//! - Decode: [`Gpu::gemv_packed`] / [`Gpu::gemv_packed_f32`], `y[m, :] = dequant(W) · x[m, :]` for
//!   1 ≤ m ≤ 8, f32 accumulation, one rounding per output. Batches of 2..8 rows run on the tensor cores
//!   at any n (each weight decoded once for every row of x); one row, and INT8/INT4 k or groups that
//!   are not whole k-blocks (INT6: groups only), on the FMA GEMV; one INT8 row with 1024 ≤ k ≤ 6144 runs
//!   a warp a row, as the layer launches' row phases (`gemv_q8_rows_u{GU}`), or on the choice of
//!   [`Gpu::set_packed_gemv_m1`] ([`PackedM1`]). [`Gpu::gemv_packed_many`] runs up to
//!   `GEMV_SEGS` weights of one format that read the same x in one launch (see `gemv.rs`).
//! - Prefill: [`Gpu::gemm_packed`] dequantises W tile by tile into a caller-owned bf16 workspace
//!   ([`Gpu::dequant_packed`]) and multiplies each tile with cuBLAS; no dequantised copy outlives the call.
//!
//! Shape rules (errors, never panics): bits ∈ {4, 6, 8}; `k % 32 == 0` for INT4/INT8 and `k % 8 == 0`
//! for INT6; `group_size % 8 == 0` (or 0); W, x 16-byte aligned.

use std::sync::atomic::Ordering;

use cudarc::cublas::sys;
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
use half::bf16;

use super::gemm::WxT;
use super::gemv::{
    gemv_plan, tensor_core_batch, SegAddrs, SegTable, GEMV_SEGS, GEMV_THREADS, TC_ROWS,
};
use crate::error::{ensure, Result};
use crate::gpu::{cfg, check_len, grid_u32, int, Gpu};

pub use super::packed_m1::PackedM1;
use super::packed_m1::{chunk_gemv, rows_batch, rows_blocks, rows_gemv_units};

/// Most rows of W one row slot of the packed GEMV owns (`QROWS` in quant.cu).
const QROWS: usize = 2;

/// What a packed GEMV reads as its input: `x` (`[m, k]`) with the kernel name's output suffix
/// (`""` bf16, `"_f32"`), one gate|up row (`[1, 2k]`) whose SwiGLU the kernel stages, or one row `x`
/// (`[1, k]`) whose bf16 output the kernel then adds to a residual and norms.
enum GemvInput<'a> {
    X(&'static str),
    GateUp,
    XThenAddNorm(RowAddNorm<'a>),
}

/// u32 words of one packed row of `k` inputs.
pub fn packed_words_per_row(bits: u32, k: usize) -> usize {
    match bits {
        6 => k.div_ceil(32) * 6,
        b => k.div_ceil((32 / b.max(1)) as usize),
    }
}

/// Scales per row: `ceil(k / group_size)`, or 1 for per-row scales (`group_size` 0).
pub fn packed_scale_cols(group_size: usize, k: usize) -> usize {
    if group_size == 0 {
        1
    } else {
        k.div_ceil(group_size)
    }
}

/// A packed weight's scheme: `bits` (4, 6 or 8) and one f32 scale per `group_size` inputs (0: one
/// per row).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PackedScheme {
    pub bits: u32,
    pub group_size: usize,
}

impl PackedScheme {
    /// The inputs one scale covers: `group_size`, or `k` for per-row scales.
    pub fn group(&self, k: usize) -> usize {
        if self.group_size == 0 {
            k
        } else {
            self.group_size
        }
    }
}

/// A packed weight `[n, k]` as the kernels read it: its `words` and `scales` as
/// `sanmai_weights::quant::PackedTensor` holds them (upload its `words()` and `scales`).
pub struct PackedMat<'a, W: DevicePtr<u32>, S: DevicePtr<f32>> {
    pub words: &'a W,
    pub scales: &'a S,
    pub scheme: PackedScheme,
    pub n: usize,
    pub k: usize,
}

/// Checks a packed weight's shape and buffer lengths; returns the effective group (k for per-row
/// scales).
fn check_mat(
    op: &'static str,
    w: &PackedMat<'_, impl DevicePtr<u32>, impl DevicePtr<f32>>,
) -> Result<usize> {
    check_packed(op, (w.words, w.scales), w.scheme, w.n, w.k)
}

/// Checks the packed shape and the lengths of `(words, scales)` of a `[n, k]` weight; returns the
/// effective group (k for per-row scales).
fn check_packed(
    op: &'static str,
    (w, scales): (&impl DevicePtr<u32>, &impl DevicePtr<f32>),
    scheme: PackedScheme,
    n: usize,
    k: usize,
) -> Result<usize> {
    let PackedScheme { bits, group_size } = scheme;
    ensure(matches!(bits, 4 | 6 | 8), op, || {
        format!("{bits}-bit weights: expected 4, 6 or 8")
    })?;
    let step = if bits == 6 { 8 } else { 32 };
    ensure(k > 0 && k.is_multiple_of(step), op, || {
        format!("k = {k} must be a positive multiple of {step} for INT{bits}")
    })?;
    ensure(group_size.is_multiple_of(8), op, || {
        format!("group_size = {group_size} must be a multiple of 8")
    })?;
    check_len(op, "W", w, n * packed_words_per_row(bits, k))?;
    check_len(op, "scales", scales, n * packed_scale_cols(group_size, k))?;
    Ok(if group_size == 0 { k } else { group_size })
}

/// Whether a packed decode GEMV of `m` rows runs on the tensor cores (`gemv_q{4,6,8}_tc`): a batch of
/// 2..8 rows at any n (`gemv::tensor_core_batch`: one mma serves every row of x, so the decode is paid
/// once per weight, not once per row) with per-row scales or groups of whole k-blocks (64 values for
/// INT8, 128 for INT4 and INT6). INT8 and INT4 also need k a whole number of k-blocks; INT6 takes any k
/// its layout allows (the kernel skips the pieces past a row's units and zeroes x past k). `group` is
/// the effective group (k for per-row scales). Depends on the shape alone.
fn tensor_core_gemv(bits: u32, group: usize, m: usize, k: usize) -> bool {
    let (kb, whole_blocks) = match bits {
        8 => (64, k.is_multiple_of(64)),
        4 => (128, k.is_multiple_of(128)),
        6 => (128, true),
        _ => return false,
    };
    tensor_core_batch(m) && whole_blocks && (group >= k || group.is_multiple_of(kb))
}

/// Rows `row0 .. row0 + rows` of a packed weight of `k` inputs, `bits` and effective `group`, as
/// one dequantisation launch covers them.
#[derive(Debug, Clone, Copy)]
struct Tile {
    bits: u32,
    group: usize,
    k: usize,
    row0: usize,
    rows: usize,
}

/// Where [`Gpu::tile_w_xt`] writes: rows of `ldy` elements of `ty` from device address `at`.
struct TileOut {
    at: u64,
    ty: sys::cudaDataType,
    ldy: i32,
}

/// One weight of a many-weight packed GEMV ([`Gpu::gemv_packed_many`]): `(W, scales, y, n)`,
/// `y[m, :] = dequant(W) · x[m, :]` with `W` packed `[n, k]` and `y` `[m, n]`.
pub type PackedPart<'a, W, S, Y> = (&'a W, &'a S, &'a mut Y, usize);

/// The residual add and the next RMSNorm a one-row packed GEMV also does
/// ([`Gpu::gemv_packed_add_rms_norm`]): `acc` (`[1, n]`) plus the output row, then `normed` (`[1,
/// n]`) its RMSNorm with weight `w` (`[n]`; `eps`, `offset` as [`Gpu::rms_norm`]). `ticket`: one
/// `u32`, 0 and left 0, which the launch's blocks count themselves on.
pub struct RowAddNorm<'a> {
    pub acc: &'a mut CudaSlice<bf16>,
    pub w: &'a CudaSlice<bf16>,
    pub normed: &'a mut CudaSlice<bf16>,
    pub eps: f32,
    pub offset: f32,
    pub ticket: &'a mut CudaSlice<u32>,
}

/// The longest row [`Gpu::gemv_packed_add_rms_norm`] norms (its shared memory holds the row).
pub const NORM_MAX_D: usize = 16384;

/// The most f32 values the per-row-scale prefill GEMM keeps between cuBLAS and its scale kernel
/// (64 MiB).
pub const PER_ROW_SCRATCH: usize = 16 << 20;

impl Gpu {
    /// `y[m, :] = dequant(W) · x[m, :]`: W packed `[n, k]` (see the module doc), `x`: `[m, k]` bf16,
    /// `y`: `[m, n]` bf16, `1 ≤ m ≤ 8`.
    pub fn gemv_packed(
        &self,
        w: &PackedMat<'_, impl DevicePtr<u32>, impl DevicePtr<f32>>,
        x: &impl DevicePtr<bf16>,
        y: &mut impl DevicePtrMut<bf16>,
        m: usize,
    ) -> Result<()> {
        let part = (w.words, w.scales, y, w.n);
        self.gemv_q(GemvInput::X(""), w.scheme, x, &mut [part], m, w.k)
    }

    /// An MLP's down projection of one row without the activation launch: `y[0, :] = dequant(W) ·
    /// swiglu(gu)` for a gate|up row `gu` (`[1, 2k]`), `swiglu(gu)[j] = bf16(silu(gu[j]) ·
    /// gu[k + j])` computed inside the GEMV as [`Gpu::swiglu`] computes it, so `y` equals
    /// [`Gpu::swiglu`] then [`Gpu::gemv_packed`] bit for bit.
    pub fn gemv_packed_swiglu(
        &self,
        w: &PackedMat<'_, impl DevicePtr<u32>, impl DevicePtr<f32>>,
        gu: &impl DevicePtr<bf16>,
        y: &mut impl DevicePtrMut<bf16>,
    ) -> Result<()> {
        let part = (w.words, w.scales, y, w.n);
        self.gemv_q(GemvInput::GateUp, w.scheme, gu, &mut [part], 1, w.k)
    }

    /// [`Gpu::gemv_packed`] of one row followed by the residual add and the next RMSNorm of the
    /// output `y` (`[1, n]`): `then.acc += y`, `then.normed = rms_norm(then.acc)`, the values
    /// [`Gpu::add_rms_norm`] gives, bit for bit, in the GEMV's launch (its last block to finish does
    /// them). `y` is written as [`Gpu::gemv_packed`] writes it. Only where
    /// [`Gpu::gemv_packed_norm_fits`].
    pub fn gemv_packed_add_rms_norm(
        &self,
        w: &PackedMat<'_, impl DevicePtr<u32>, impl DevicePtr<f32>>,
        x: &impl DevicePtr<bf16>,
        y: &mut impl DevicePtrMut<bf16>,
        then: RowAddNorm<'_>,
    ) -> Result<()> {
        let part = (w.words, w.scales, y, w.n);
        let input = GemvInput::XThenAddNorm(then);
        self.gemv_q(input, w.scheme, x, &mut [part], 1, w.k)
    }

    /// Whether [`Gpu::gemv_packed_add_rms_norm`] takes a weight of `scheme` with `k` inputs and `n`
    /// outputs: the one-row GEMV of 32-value units (not the 16-byte chunk or row-phase one that [`Gpu::set_packed_gemv_m1`] may choose), and the row fits shared memory.
    pub fn gemv_packed_norm_fits(&self, scheme: PackedScheme, n: usize, k: usize) -> bool {
        let group = if scheme.group_size == 0 {
            k
        } else {
            scheme.group_size
        };
        let other = match self.packed_gemv_m1() {
            PackedM1::Units => false,
            PackedM1::Chunks(_) => chunk_gemv(scheme.bits, group, 1, k),
            PackedM1::Rows => rows_gemv_units(scheme.bits, group, 1, k).is_some(),
        };
        matches!(scheme.bits, 4 | 6 | 8)
            && !tensor_core_gemv(scheme.bits, group, 1, k)
            && !other
            && (1..=NORM_MAX_D).contains(&n)
    }

    /// As [`Gpu::gemv_packed`] with an f32 output (an INT8 lm_head's logits).
    pub fn gemv_packed_f32(
        &self,
        w: &PackedMat<'_, impl DevicePtr<u32>, impl DevicePtr<f32>>,
        x: &impl DevicePtr<bf16>,
        y: &mut impl DevicePtrMut<f32>,
        m: usize,
    ) -> Result<()> {
        let part = (w.words, w.scales, y, w.n);
        self.gemv_q(GemvInput::X("_f32"), w.scheme, x, &mut [part], m, w.k)
    }

    /// [`Gpu::gemv_packed`] for up to `GEMV_SEGS` (4) weights of one scheme that read the same `x`
    /// (`[m, k]`), in one launch: each part's `y` gets `dequant(W) · x` exactly as its own
    /// [`Gpu::gemv_packed`] computes it.
    pub fn gemv_packed_many<W: DevicePtr<u32>, S: DevicePtr<f32>, Y: DevicePtrMut<bf16>>(
        &self,
        scheme: PackedScheme,
        x: &impl DevicePtr<bf16>,
        parts: &mut [PackedPart<'_, W, S, Y>],
        m: usize,
        k: usize,
    ) -> Result<()> {
        self.gemv_q(GemvInput::X(""), scheme, x, parts, m, k)
    }

    /// Chooses the kernel of this device's one-row packed GEMVs ([`PackedM1`]; `Chunks` takes 1, 2
    /// or 4 rows a slot, other counts are ignored). It opens with
    /// [`GpuOptions::row_gemv`](crate::GpuOptions::row_gemv)'s choice. Set it before recording CUDA
    /// graphs: a recorded step keeps the kernels it recorded.
    pub fn set_packed_gemv_m1(&self, choice: PackedM1) {
        if !matches!(choice, PackedM1::Chunks(r) if !matches!(r, 1 | 2 | 4)) {
            self.m1.store(choice.code(), Ordering::Relaxed);
        }
    }

    /// The current choice of [`Gpu::set_packed_gemv_m1`].
    pub fn packed_gemv_m1(&self) -> PackedM1 {
        PackedM1::of_code(self.m1.load(Ordering::Relaxed))
    }

    fn gemv_q<O, W: DevicePtr<u32>, S: DevicePtr<f32>, Y: DevicePtrMut<O>>(
        &self,
        input: GemvInput<'_>,
        scheme: PackedScheme,
        x: &impl DevicePtr<bf16>,
        parts: &mut [PackedPart<'_, W, S, Y>],
        m: usize,
        k: usize,
    ) -> Result<()> {
        const OP: &str = "gemv_packed";
        let PackedScheme { bits, group_size } = scheme;
        ensure((1..=8).contains(&m), OP, || {
            format!("m = {m} rows, expected 1..=8")
        })?;
        ensure(parts.len() <= GEMV_SEGS, OP, || {
            format!("{} weights, at most {GEMV_SEGS} a launch", parts.len())
        })?;
        let group = if group_size == 0 { k } else { group_size };
        for (w, sc, y, n) in parts.iter() {
            check_packed(OP, (*w, *sc), scheme, *n, k)?;
            check_len(OP, "y", &**y, m * n)?;
        }
        let (suffix, x_cols) = match input {
            GemvInput::X(suffix) => (suffix, k),
            GemvInput::XThenAddNorm(_) => ("", k),
            GemvInput::GateUp => {
                ensure(m == 1, OP, || {
                    format!("m = {m}: the staged SwiGLU takes one row")
                })?;
                ("_sw", 2 * k)
            }
        };
        check_len(OP, "x", x, m * x_cols)?;
        let (ki, gi, mi) = (int(OP, "k", k)?, int(OP, "group", group)?, int(OP, "m", m)?);
        let staged = matches!(input, GemvInput::GateUp);
        let tc = !staged && tensor_core_gemv(bits, group, m, k);
        let choice = self.packed_gemv_m1();
        // The row-phase GEMV's units a lane (bf16 output only), else the 16-byte chunk GEMV's rows a
        // slot (0: the unit GEMV or the tensor cores).
        let row_units = match (choice, &input) {
            (PackedM1::Rows, GemvInput::X("")) if !tc => rows_gemv_units(bits, group, m, k),
            _ => None,
        };
        let chunk = match choice {
            PackedM1::Chunks(r) if !tc && !staged && chunk_gemv(bits, group, m, k) => r,
            _ => 0,
        };
        // The row a following add and norm takes (one part).
        let n = parts.first().map_or(0, |p| p.3);
        if let GemvInput::XThenAddNorm(t) = &input {
            ensure(
                m == 1 && parts.len() == 1 && !tc && chunk == 0 && row_units.is_none(),
                OP,
                || "the add and norm follow one bf16 row of the 32-value unit GEMV".into(),
            )?;
            ensure((1..=NORM_MAX_D).contains(&n), OP, || {
                format!("a row of {n} values to norm, at most {NORM_MAX_D}")
            })?;
            check_len(OP, "acc", &*t.acc, n)?;
            check_len(OP, "norm weight", t.w, n)?;
            check_len(OP, "normed", &*t.normed, n)?;
            check_len(OP, "ticket", &*t.ticket, 1)?;
        }
        let sms = self.info().multiprocessors as usize;
        ensure(self.addr(x).is_multiple_of(16), OP, || {
            "x must be 16-byte aligned".into()
        })?;
        let s = self.stream();
        let mut table = SegTable::new();
        let mut guards = Vec::with_capacity(3 * parts.len());
        let total_rows: usize = parts.iter().map(|p| p.3).sum();
        for (w, sc, y, n) in parts.iter_mut().filter(|p| p.3 > 0) {
            let (wp, gw) = w.device_ptr(s);
            let (sp, gs) = sc.device_ptr(s);
            let (yp, gy) = y.device_ptr_mut(s);
            guards.extend([gw, gs, gy]);
            ensure(wp % 16 == 0, OP, || "W must be 16-byte aligned".into())?;
            if tc {
                let addrs = SegAddrs {
                    w: wp,
                    s: sp,
                    y: yp,
                };
                table.push(OP, addrs, *n, n.div_ceil(TC_ROWS), None)?;
            } else if let Some(gu) = row_units {
                let blocks = rows_blocks(*n, total_rows, rows_batch(gu), sms);
                let addrs = SegAddrs {
                    w: wp,
                    s: sp,
                    y: yp,
                };
                table.push(OP, addrs, *n, blocks, None)?;
            } else if chunk > 0 {
                // Work items of a row: 16-byte chunks.
                let plan = gemv_plan(*n, k * bits as usize / 128, chunk, sms);
                let addrs = SegAddrs {
                    w: wp,
                    s: sp,
                    y: yp,
                };
                table.push(OP, addrs, *n, plan.blocks, Some(plan))?;
            } else {
                // Work items of a row: units of 32 values.
                let plan = gemv_plan(*n, k.div_ceil(32), QROWS, sms);
                let addrs = SegAddrs {
                    w: wp,
                    s: sp,
                    y: yp,
                };
                table.push(OP, addrs, *n, plan.blocks, Some(plan))?;
            }
        }
        let grid = table.grid(OP)?;
        if grid == 0 {
            return Ok(());
        }
        let segs = table.segs();
        if tc {
            let mut b = self.launch(self.kernel(&format!("gemv_q{bits}_tc{suffix}"))?);
            b.arg(segs).ptr(x).arg(&ki).arg(&gi).arg(&mi);
            // SAFETY: argument types match the kernel; every segment's lengths and alignment and the
            // kernel's k and group rules (tensor_core_gemv) checked above; 2 ≤ m ≤ 8, each segment's
            // blocks cover its n ≥ 1.
            unsafe { b.launch(cfg((grid, 1, 1), GEMV_THREADS as u32, 0)) }?;
        } else if let Some(gu) = row_units {
            let mut b = self.launch(self.kernel(&format!("gemv_q8_rows_u{gu}"))?);
            b.arg(segs).ptr(x).arg(&ki).arg(&gi);
            // SAFETY: argument types match the kernel; lengths and alignment checked above, and the
            // row kernel's k, group and output rules (rows_gemv_units: k % 32 == 0, k ≤ 1024 · gu,
            // whole-unit groups, bf16 y); each segment's blocks own its rows grid-stride.
            unsafe { b.launch(cfg((grid, 1, 1), GEMV_THREADS as u32, 0)) }?;
        } else if chunk > 0 {
            let mut b = self.launch(self.kernel(&format!("gemv_q{bits}v{chunk}{suffix}_m1"))?);
            b.arg(segs).ptr(x).arg(&ki).arg(&gi);
            // SAFETY: argument types match the kernel; lengths, alignment and the chunk kernel's k and
            // group rules (chunk_gemv) checked above; each segment's plan has rps ≤ the kernel's R
            // (`chunk`), slots of at most the block and blocks covering its n.
            unsafe { b.launch(cfg((grid, 1, 1), GEMV_THREADS as u32, 0)) }?;
        } else if let GemvInput::XThenAddNorm(t) = input {
            let mut b = self.launch(self.kernel(&format!("gemv_q{bits}_m1_norm"))?);
            b.arg(segs)
                .ptr(x)
                .arg(&ki)
                .arg(&gi)
                .ptr_mut(t.acc)
                .ptr(t.w)
                .ptr_mut(t.normed)
                .ptr_mut(t.ticket)
                .arg(&t.eps)
                .arg(&t.offset);
            // SAFETY: as the plain launch below, m = 1 and one segment; acc, w and normed hold the
            // segment's n values, the ticket one u32 (checked above); the dynamic shared memory
            // holds the row of n bf16 (n ≤ NORM_MAX_D).
            unsafe { b.launch(cfg((grid, 1, 1), GEMV_THREADS as u32, 2 * n as u32)) }?;
        } else {
            let mut b = self.launch(self.kernel(&format!("gemv_q{bits}{suffix}_m{m}"))?);
            b.arg(segs).ptr(x).arg(&ki).arg(&gi);
            // SAFETY: argument types match the kernel; lengths, k and group rules and alignment checked
            // above; each segment's plan has rps ≤ QROWS, slots of at most the block and blocks
            // covering its n.
            unsafe { b.launch(cfg((grid, 1, 1), GEMV_THREADS as u32, 0)) }?;
        }
        drop(guards);
        Ok(())
    }

    /// Rows `[row0, row0 + rows)` of `dequant(W)` as bf16 into `out` (`[rows, k]`, row-major).
    pub fn dequant_packed(
        &self,
        w: &PackedMat<'_, impl DevicePtr<u32>, impl DevicePtr<f32>>,
        out: &mut impl DevicePtrMut<bf16>,
        row0: usize,
        rows: usize,
    ) -> Result<()> {
        const OP: &str = "dequant_packed";
        let group = check_mat(OP, w)?;
        let (n, k) = (w.n, w.k);
        ensure(row0 + rows <= n, OP, || {
            format!("rows {row0}..{} past n = {n}", row0 + rows)
        })?;
        check_len(OP, "out", out, rows * k)?;
        if rows == 0 {
            return Ok(());
        }
        let s = self.stream();
        let (sp, _gs) = w.scales.device_ptr(s);
        let tile = Tile {
            bits: w.scheme.bits,
            group,
            k,
            row0,
            rows,
        };
        self.dequant_tile(w.words, sp, tile, out)
    }

    /// Launches `dequant_q{bits}` for the tile's rows into `out`; `sp` 0: the integer codes without
    /// their scales. Lengths are the caller's to check.
    fn dequant_tile(
        &self,
        w: &impl DevicePtr<u32>,
        sp: u64,
        tile: Tile,
        out: &mut impl DevicePtrMut<bf16>,
    ) -> Result<()> {
        const OP: &str = "dequant_packed";
        let Tile {
            bits,
            group,
            k,
            row0,
            rows,
        } = tile;
        ensure(self.addr_mut(out).is_multiple_of(16), OP, || {
            "out must be 16-byte aligned".into()
        })?;
        ensure(self.addr(w).is_multiple_of(16), OP, || {
            "W must be 16-byte aligned".into()
        })?;
        let threads = rows * k.div_ceil(32);
        let grid = grid_u32(OP, threads.div_ceil(256))?;
        let (r0, ri, ki, gi) = (
            int(OP, "row0", row0)?,
            int(OP, "rows", rows)?,
            int(OP, "k", k)?,
            int(OP, "group", group)?,
        );
        let mut b = self.launch(self.kernel(&format!("dequant_q{bits}"))?);
        b.ptr(w)
            .arg(&sp)
            .ptr_mut(out)
            .arg(&r0)
            .arg(&ri)
            .arg(&ki)
            .arg(&gi);
        // SAFETY: argument types match the kernel; W, scales and out lengths and the row range checked.
        unsafe { b.launch(cfg((grid, 1, 1), 256, 0)) }?;
        Ok(())
    }

    /// Rows of W one [`Gpu::gemm_packed`] tile holds with a workspace of `ws_len` bf16 elements.
    pub fn packed_tile_rows(ws_len: usize, n: usize, k: usize) -> usize {
        (ws_len / k.max(1)).min(n)
    }

    /// `y[m, n] = x[m, k] · dequant(W)ᵀ` for prefill: W packed `[n, k]`, bf16 in and out, f32
    /// accumulation. W is dequantised [`Gpu::packed_tile_rows`] rows at a time into `ws` (bf16, caller
    /// owned, at least `k` elements; 8–32 MiB makes the cuBLAS tiles large enough) and each tile
    /// multiplied by cuBLAS into its columns of y.
    pub fn gemm_packed(
        &self,
        x: &impl DevicePtr<bf16>,
        w: &PackedMat<'_, impl DevicePtr<u32>, impl DevicePtr<f32>>,
        y: &mut impl DevicePtrMut<bf16>,
        ws: &mut impl DevicePtrMut<bf16>,
        m: usize,
    ) -> Result<()> {
        const OP: &str = "gemm_packed";
        check_mat(OP, w)?;
        let (n, k, group_size) = (w.n, w.k, w.scheme.group_size);
        check_len(OP, "x", x, m * k)?;
        check_len(OP, "y", y, m * n)?;
        let tile = Self::packed_tile_rows(ws.len(), n, k);
        ensure(tile > 0 || n == 0, OP, || {
            format!("workspace of {} elements holds no row of k = {k}", ws.len())
        })?;
        if m == 0 || n == 0 {
            return Ok(());
        }
        let (mi, ni, ki) = (int(OP, "m", m)?, int(OP, "n", n)?, int(OP, "k", k)?);
        if group_size == 0 || group_size >= k {
            return self.gemm_packed_per_row(x, w, y, ws, m, tile);
        }
        let mut row0 = 0;
        while row0 < n {
            let rows = tile.min(n - row0);
            self.dequant_packed(w, &mut *ws, row0, rows)?;
            let (yp, _gy) = y.device_ptr_mut(self.stream());
            let out = TileOut {
                at: yp + (row0 * 2) as u64,
                ty: sys::cudaDataType::CUDA_R_16BF,
                ldy: ni,
            };
            // Columns row0..row0 + rows of y (ld n) = x · tileᵀ.
            // SAFETY: the tile holds rows·k elements, x m·k, y's columns row0..row0 + rows of m rows
            // with ld n lie inside the checked m·n.
            unsafe { self.tile_w_xt(x, &mut *ws, int(OP, "rows", rows)?, (mi, ki), out) }?;
            row0 += rows;
        }
        Ok(())
    }

    /// [`Gpu::gemm_packed`] for per-row scales, exactly as the GEMV computes: the tile holds the integer
    /// codes (exact in bf16), cuBLAS multiplies them into an f32 scratch, and each column is scaled in
    /// f32 before its one bf16 rounding (no `bf16(q·s)` weights). The scratch holds at most
    /// [`PER_ROW_SCRATCH`] values, which bounds the rows per cuBLAS call.
    fn gemm_packed_per_row(
        &self,
        x: &impl DevicePtr<bf16>,
        w: &PackedMat<'_, impl DevicePtr<u32>, impl DevicePtr<f32>>,
        y: &mut impl DevicePtrMut<bf16>,
        ws: &mut impl DevicePtrMut<bf16>,
        m: usize,
        tile: usize,
    ) -> Result<()> {
        const OP: &str = "gemm_packed";
        let (n, k, bits) = (w.n, w.k, w.scheme.bits);
        let scales = w.scales;
        let tile = tile.min((PER_ROW_SCRATCH / m).max(32)).min(n);
        // SAFETY: cuBLAS writes every element of each [m, rows] block before the scale kernel reads it.
        let mut yt = unsafe { self.stream().alloc::<f32>(m * tile) }?;
        let (mi, ni, ki) = (int(OP, "m", m)?, int(OP, "n", n)?, int(OP, "k", k)?);
        let mut row0 = 0;
        while row0 < n {
            let rows = tile.min(n - row0);
            let codes = Tile {
                bits,
                group: k,
                k,
                row0,
                rows,
            };
            self.dequant_tile(w.words, 0, codes, &mut *ws)?;
            let ri = int(OP, "rows", rows)?;
            let (ytp, _gyt) = yt.device_ptr_mut(self.stream());
            let out = TileOut {
                at: ytp,
                ty: sys::cudaDataType::CUDA_R_32F,
                ldy: ri,
            };
            // yt [m, rows] = x · tileᵀ (the codes), f32.
            // SAFETY: the tile holds rows·k codes, x m·k values, yt m·tile values.
            unsafe { self.tile_w_xt(x, &mut *ws, ri, (mi, ki), out) }?;
            let r0 = int(OP, "row0", row0)?;
            let grid = grid_u32(OP, (m * rows).div_ceil(256))?;
            let mut b = self.launch(self.kernel("scale_cols_bf16")?);
            b.arg(&ytp)
                .ptr(scales)
                .ptr_mut(y)
                .arg(&mi)
                .arg(&ni)
                .arg(&r0)
                .arg(&ri);
            // SAFETY: argument types match the kernel; yt holds m·rows values, scales n (one per
            // row, checked by the caller), y m·n with row0 + rows ≤ n.
            unsafe { b.launch(cfg((grid, 1, 1), 256, 0)) }?;
            row0 += rows;
        }
        Ok(())
    }

    /// `out = x · tileᵀ` through cuBLAS ([`Gpu::blas_w_xt`]): the tile is the `rows` rows of W
    /// dequantised into `ws` (bf16 `[rows, k]`), x bf16 `[m, k]` with `(m, k) = mk`.
    ///
    /// # Safety
    /// `ws` must hold rows·k and `x` m·k elements, and `out` m rows of `ldy` from its address with
    /// the first `rows` columns inside the buffer.
    unsafe fn tile_w_xt(
        &self,
        x: &impl DevicePtr<bf16>,
        ws: &mut impl DevicePtrMut<bf16>,
        rows: i32,
        mk: (i32, i32),
        out: TileOut,
    ) -> Result<()> {
        let s = self.stream();
        let (xp, _gx) = x.device_ptr(s);
        let (wsp, _gws) = ws.device_ptr_mut(s);
        // SAFETY: the caller vouches for the extents; every buffer is used on this stream.
        unsafe {
            self.blas_w_xt(WxT {
                rows,
                m: mk.0,
                k: mk.1,
                w: wsp,
                x: xp,
                y: out.at,
                y_type: out.ty,
                ldy: out.ldy,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn int6_batches_take_the_tensor_cores_on_any_k() {
        assert!(tensor_core_gemv(6, 2048, 8, 2048));
        assert!(tensor_core_gemv(6, 1000, 2, 1000));
        assert!(tensor_core_gemv(6, 128, 5, 1000));
        assert!(!tensor_core_gemv(6, 64, 8, 512));
        assert!(!tensor_core_gemv(6, 2048, 1, 2048));
        assert!(!tensor_core_gemv(8, 96, 8, 96));
        assert!(!tensor_core_gemv(4, 32, 8, 512));
    }
}
