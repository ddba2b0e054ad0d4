//! The vision tower on a CUDA device: [`CudaTower`], the device copy of a multimodal checkpoint's
//! [`Vision`] tower (the CPU reference is `sanmai_vision::tower`), implementing
//! [`sanmai_model::vision::Tower`] so that an image encoder runs its images on the GPU.
//!
//! Weights: every linear's matrix in bf16, biases, norms and the learned position table in f32.
//! Activations: the residual stream is f32; each GEMM (cuBLAS, bf16 inputs, f32 accumulation and
//! output) reads a bf16 copy of its input (LayerNorm output, attention output, activation output),
//! and the kernels of `kernels/vision.cu` add biases and residuals in f32. The forward mirrors the
//! CPU reference step for step, rows in the same (merge) order:
//!
//! 1. patch embedding (one GEMM over the patch rows) + bias + the position table resampled
//!    bilinearly (taps and weights from [`positions::interpolation`], computed on the host);
//! 2. `depth` blocks: LayerNorm → qkv (+ bias, 2-D rotary on q and k, cos/sin per patch from the
//!    host as the CPU computes them; q, k, v to bf16) → bidirectional attention within each frame
//!    on tensor cores (flash-attention 2's forward: bf16 products, f32 accumulation and online
//!    softmax, one block per (64-query tile, head)) → proj → residual; LayerNorm → fc1 → the config's
//!    activation → fc2 → residual;
//! 3. the merger: LayerNorm per patch, `merge²` consecutive rows read as one row, fc1, exact-erf
//!    GELU, fc2 (+ bias) to the text model's width, downloaded as f32.
//!
//! The tower has its own stream and cuBLAS handle on the device's context; one forward runs at a
//! time (a mutex), so it may be shared between threads.

use std::sync::{Arc, Mutex};

use cudarc::cublas::{result as blas, sys as bsys, CudaBlas};
use cudarc::driver::{
    CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg,
};
use half::bf16;
use sanmai_model::vision::{Grid, ImageError, Tower, Vision};
use sanmai_vision::positions;
use sanmai_vision::tower::{self, Activation, LayerNorm, Linear, VisionConfig};

use crate::error::{CudaError, Result};
use crate::gpu::Gpu;

/// Query rows per attention block (4 warps of 16 in `vit_flash`).
const ATTN_ROWS: usize = 64;
/// Threads of an attention block: 4 warps.
const ATTN_THREADS: u32 = 128;
/// Threads of the row kernels and of the elementwise kernels' blocks.
const THREADS: u32 = 256;
/// The LayerNorm epsilon of the tower (transformers' `eps=1e-6`).
const NORM_EPS: f32 = 1e-6;
/// The largest head dimension the attention kernel takes (even, padded to a multiple of 16).
pub const MAX_HEAD_DIM: usize = 128;

/// The head dimension as the attention kernel holds it: padded with zeros to a multiple of 16.
fn padded(dim: usize) -> usize {
    dim.div_ceil(16) * 16
}

/// The activation code `kernels/vision.cu` reads.
fn act_code(a: Activation) -> i32 {
    match a {
        Activation::GeluTanh => 0,
        Activation::Gelu => 1,
        Activation::Silu => 2,
        Activation::QuickGelu => 3,
    }
}

struct DevLinear {
    w: CudaSlice<bf16>,
    b: CudaSlice<f32>,
    inputs: usize,
    outputs: usize,
}

struct DevNorm {
    g: CudaSlice<f32>,
    b: CudaSlice<f32>,
}

struct DevBlock {
    norm1: DevNorm,
    qkv: DevLinear,
    proj: DevLinear,
    norm2: DevNorm,
    fc1: DevLinear,
    fc2: DevLinear,
}

struct Funcs {
    embed_pos: CudaFunction,
    layer_norm: CudaFunction,
    qkv_rope: CudaFunction,
    attention: CudaFunction,
    bias_act: CudaFunction,
    bias_residual: CudaFunction,
    add_bias: CudaFunction,
}

/// What a forward uses exclusively: the stream, the cuBLAS handle, the kernels and the weights.
struct Inner {
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    f: Funcs,
    patch: DevLinear,
    pos: CudaSlice<f32>,
    blocks: Vec<DevBlock>,
    merger_norm: DevNorm,
    merger_fc1: DevLinear,
    merger_fc2: DevLinear,
}

/// A vision tower on a CUDA device (see the module docs).
pub struct CudaTower {
    cfg: VisionConfig,
    inner: Mutex<Inner>,
}

impl CudaTower {
    /// Uploads `vision`'s weights to `gpu`'s device (its context; the tower gets its own stream and
    /// cuBLAS handle) and takes the tower's kernels from `gpu`'s registry.
    pub fn new(vision: &Vision, gpu: &Gpu) -> Result<Self> {
        let cfg = vision.config.clone();
        let w = &vision.weights;
        let d = cfg.head_dim();
        let shape = |msg: String| CudaError::Shape {
            op: "vision tower",
            msg,
        };
        if d == 0
            || !d.is_multiple_of(2)
            || d > MAX_HEAD_DIM
            || d * cfg.num_heads != cfg.hidden_size
        {
            return Err(shape(format!(
                "head dimension {d} ({} / {} heads): the attention kernel takes even ones up to {MAX_HEAD_DIM}",
                cfg.hidden_size, cfg.num_heads
            )));
        }
        if w.blocks.len() != cfg.depth || w.patch_embed.inputs != cfg.patch_len() {
            return Err(shape(
                "the weights were loaded for another vision config".into(),
            ));
        }
        let stream = gpu.context().new_stream()?;
        let blas = CudaBlas::new(stream.clone())?;
        let func =
            |name: &str| -> Result<CudaFunction> { Ok(gpu.kernels().get(name)?.func.clone()) };
        let f = Funcs {
            embed_pos: func("vit_embed_pos")?,
            layer_norm: func("vit_layer_norm")?,
            qkv_rope: func("vit_qkv_rope")?,
            attention: func(&format!("vit_flash_dp{}", padded(d)))?,
            bias_act: func("vit_bias_act")?,
            bias_residual: func("vit_bias_residual")?,
            add_bias: func("vit_add_bias")?,
        };
        let linear = |l: &Linear| -> Result<DevLinear> {
            let wb: Vec<bf16> = l.weight.iter().map(|&v| bf16::from_f32(v)).collect();
            Ok(DevLinear {
                w: stream.clone_htod(&wb)?,
                b: stream.clone_htod(&l.bias)?,
                inputs: l.inputs,
                outputs: l.outputs,
            })
        };
        let norm = |n: &LayerNorm| -> Result<DevNorm> {
            Ok(DevNorm {
                g: stream.clone_htod(&n.weight)?,
                b: stream.clone_htod(&n.bias)?,
            })
        };
        let blocks = w
            .blocks
            .iter()
            .map(|b| {
                Ok(DevBlock {
                    norm1: norm(&b.norm1)?,
                    qkv: linear(&b.qkv)?,
                    proj: linear(&b.proj)?,
                    norm2: norm(&b.norm2)?,
                    fc1: linear(&b.fc1)?,
                    fc2: linear(&b.fc2)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let inner = Inner {
            patch: linear(&w.patch_embed)?,
            pos: stream.clone_htod(&w.pos_embed)?,
            blocks,
            merger_norm: norm(&w.merger.norm)?,
            merger_fc1: linear(&w.merger.fc1)?,
            merger_fc2: linear(&w.merger.fc2)?,
            f,
            blas,
            stream: stream.clone(),
        };
        stream.synchronize()?;
        Ok(CudaTower {
            cfg,
            inner: Mutex::new(inner),
        })
    }

    /// Bytes of the tower's weights on the device.
    pub fn weight_bytes(&self) -> usize {
        let inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let lin = |l: &DevLinear| 2 * l.w.len() + 4 * l.b.len();
        let norm = |n: &DevNorm| 4 * (n.g.len() + n.b.len());
        lin(&inner.patch)
            + 4 * inner.pos.len()
            + inner
                .blocks
                .iter()
                .map(|b| {
                    norm(&b.norm1)
                        + lin(&b.qkv)
                        + lin(&b.proj)
                        + norm(&b.norm2)
                        + lin(&b.fc1)
                        + lin(&b.fc2)
                })
                .sum::<usize>()
            + norm(&inner.merger_norm)
            + lin(&inner.merger_fc1)
            + lin(&inner.merger_fc2)
    }

    /// The merged tokens `[Σ t·h·w / merge², out_hidden_size]` of the images of `grids` whose patch
    /// rows are `pixels` (as [`Vision::forward`]).
    pub fn run(&self, pixels: &[f32], grids: &[Grid]) -> std::result::Result<Vec<f32>, ImageError> {
        let frames = tower::frames(&self.cfg, pixels, grids)?;
        let inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        inner
            .forward(&self.cfg, pixels, grids, &frames)
            .map_err(|e| ImageError::Backend(e.at("vision tower")))
    }
}

impl Tower for CudaTower {
    fn forward(&self, pixels: &[f32], grids: &[Grid]) -> std::result::Result<Vec<f32>, ImageError> {
        self.run(pixels, grids)
    }
}

/// Each patch's rotary cos and sin over the head dimension (`[patches, head_dim]` each), computed as
/// the CPU tower's `Rope` does: f32 angles, their cos and sin through f64.
fn rope_tables(cfg: &VisionConfig, rows_cols: &[[usize; 2]]) -> (Vec<f32>, Vec<f32>) {
    let half = cfg.head_dim() / 2;
    let inv_freq: Vec<f32> = (0..half / 2)
        .map(|i| 1.0 / (cfg.rope_theta as f32).powf((2 * i) as f32 / half as f32))
        .collect();
    let (mut cos, mut sin) = (Vec::new(), Vec::new());
    for &[row, col] in rows_cols {
        let angles: Vec<f32> = [row, col]
            .iter()
            .flat_map(|&p| inv_freq.iter().map(move |f| p as f32 * f))
            .collect();
        for _ in 0..2 {
            cos.extend(angles.iter().map(|&a| (a as f64).cos() as f32));
            sin.extend(angles.iter().map(|&a| (a as f64).sin() as f32));
        }
    }
    (cos, sin)
}

/// A grid-stride launch over `n` elements.
fn elementwise(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(THREADS as usize).clamp(1, 8192) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// One block per row.
fn per_row(rows: usize, shared: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: shared,
    }
}

fn int(what: &str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| CudaError::Shape {
        op: "vision tower",
        msg: format!("{what} = {v} does not fit an int"),
    })
}

impl Inner {
    /// `y[m, outputs] = x[m, inputs] · Wᵀ` (no bias), bf16 in, f32 out.
    fn gemm(
        &self,
        x: &CudaSlice<bf16>,
        l: &DevLinear,
        y: &mut CudaSlice<f32>,
        m: usize,
    ) -> Result<()> {
        let (n, k) = (l.outputs, l.inputs);
        debug_assert!(x.len() >= m * k && y.len() >= m * n);
        let (mi, ni, ki) = (int("m", m)?, int("n", n)?, int("k", k)?);
        let s = &self.stream;
        let (xp, _gx) = x.device_ptr(s);
        let (wp, _gw) = l.w.device_ptr(s);
        let (yp, _gy) = y.device_ptr_mut(s);
        let (alpha, beta) = (1.0f32, 0.0f32);
        // SAFETY: W holds n·k, x at least m·k and y at least m·n elements, all on this stream; in
        // cuBLAS's column-major view yᵀ [n, m] = W [k, n]ᵀ · xᵀ [k, m].
        unsafe {
            blas::gemm_ex(
                *self.blas.handle(),
                bsys::cublasOperation_t::CUBLAS_OP_T,
                bsys::cublasOperation_t::CUBLAS_OP_N,
                ni,
                mi,
                ki,
                (&alpha) as *const f32 as *const _,
                wp as *const _,
                bsys::cudaDataType::CUDA_R_16BF,
                ki,
                xp as *const _,
                bsys::cudaDataType::CUDA_R_16BF,
                ki,
                (&beta) as *const f32 as *const _,
                yp as *mut _,
                bsys::cudaDataType::CUDA_R_32F,
                ni,
                bsys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                bsys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }?;
        Ok(())
    }

    fn layer_norm(
        &self,
        x: &CudaSlice<f32>,
        n: &DevNorm,
        y: &mut CudaSlice<bf16>,
        rows: usize,
        cols: usize,
    ) -> Result<()> {
        let (r, c) = (int("rows", rows)?, int("cols", cols)?);
        let mut b = self.stream.launch_builder(&self.f.layer_norm);
        b.arg(x)
            .arg(&n.g)
            .arg(&n.b)
            .arg(y)
            .arg(&r)
            .arg(&c)
            .arg(&NORM_EPS);
        // SAFETY: x and y hold rows·cols values, g and b cols (the kernel's parameters in order).
        unsafe { b.launch(per_row(rows, 0)) }?;
        Ok(())
    }

    /// y (f32 GEMM output) + bias, activated, into `out` (bf16).
    fn bias_act(
        &self,
        y: &CudaSlice<f32>,
        bias: &CudaSlice<f32>,
        out: &mut CudaSlice<bf16>,
        rows: usize,
        cols: usize,
        act: Activation,
    ) -> Result<()> {
        let (r, c, a) = (int("rows", rows)?, int("cols", cols)?, act_code(act));
        let mut b = self.stream.launch_builder(&self.f.bias_act);
        b.arg(y).arg(bias).arg(out).arg(&r).arg(&c).arg(&a);
        // SAFETY: y and out hold rows·cols values, bias cols.
        unsafe { b.launch(elementwise(rows * cols)) }?;
        Ok(())
    }

    /// x += y + bias.
    fn bias_residual(
        &self,
        x: &mut CudaSlice<f32>,
        y: &CudaSlice<f32>,
        bias: &CudaSlice<f32>,
        rows: usize,
        cols: usize,
    ) -> Result<()> {
        let (r, c) = (int("rows", rows)?, int("cols", cols)?);
        let mut b = self.stream.launch_builder(&self.f.bias_residual);
        b.arg(x).arg(y).arg(bias).arg(&r).arg(&c);
        // SAFETY: x and y hold rows·cols values, bias cols.
        unsafe { b.launch(elementwise(rows * cols)) }?;
        Ok(())
    }

    fn forward(
        &self,
        cfg: &VisionConfig,
        pixels: &[f32],
        grids: &[Grid],
        frames: &[(usize, usize)],
    ) -> Result<Vec<f32>> {
        let s = self.stream.clone();
        s.context().bind_to_thread()?;
        let n: usize = frames.iter().map(|&(_, len)| len).sum();
        let (hid, heads, dim) = (cfg.hidden_size, cfg.num_heads, cfg.head_dim());
        let inter = cfg.intermediate_size;
        let merge = cfg.spatial_merge_size;
        let unit = cfg.merge_unit();
        let out_w = cfg.out_hidden_size;
        let rows = n / unit;

        // Host-side tables: pixels in bf16, the position taps, the rotary tables, the query tiles.
        let px: Vec<bf16> = pixels.iter().map(|&v| bf16::from_f32(v)).collect();
        let taps = positions::interpolation(grids, cfg.position_side(), merge);
        let mut idx = Vec::with_capacity(4 * n);
        let mut wts = Vec::with_capacity(4 * n);
        for t in &taps {
            for k in 0..4 {
                idx.push(int("position index", t.index[k])?);
                wts.push(t.weight[k]);
            }
        }
        let (cos, sin) = rope_tables(cfg, &positions::rotary_positions(grids, merge));
        let mut tiles = Vec::new();
        for &(start, len) in frames {
            for q0 in (0..len).step_by(ATTN_ROWS) {
                tiles.extend([int("start", start)?, int("len", len)?, int("q0", q0)?]);
            }
        }
        let px = s.clone_htod(&px)?;
        let idx = s.clone_htod(&idx)?;
        let wts = s.clone_htod(&wts)?;
        let cos = s.clone_htod(&cos)?;
        let sin = s.clone_htod(&sin)?;
        let n_tiles = tiles.len() / 3;
        let tiles = s.clone_htod(&tiles)?;

        // Patch embedding + bias + positions.
        let mut x = s.alloc_zeros::<f32>(n * hid)?;
        self.gemm(&px, &self.patch, &mut x, n)?;
        {
            let (r, c) = (int("rows", n)?, int("cols", hid)?);
            let mut b = s.launch_builder(&self.f.embed_pos);
            b.arg(&mut x)
                .arg(&self.patch.b)
                .arg(&self.pos)
                .arg(&idx)
                .arg(&wts)
                .arg(&r)
                .arg(&c);
            // SAFETY: x holds n·hid values, the table side² rows of hid, idx and wts 4·n entries.
            unsafe { b.launch(elementwise(n * hid)) }?;
        }

        let mut xn = s.alloc_zeros::<bf16>(n * hid)?;
        let mut qkv = s.alloc_zeros::<f32>(n * 3 * hid)?;
        // q, k and v in bf16, head-major, the head dimension padded with zeros.
        let dp = padded(dim);
        let mut qb = s.alloc_zeros::<bf16>(heads * n * dp)?;
        let mut kb = s.alloc_zeros::<bf16>(heads * n * dp)?;
        let mut vb = s.alloc_zeros::<bf16>(heads * n * dp)?;
        let mut att = s.alloc_zeros::<bf16>(n * hid)?;
        let mut y = s.alloc_zeros::<f32>(n * hid)?;
        let mut h1 = s.alloc_zeros::<f32>(n * inter)?;
        let mut h1b = s.alloc_zeros::<bf16>(n * inter)?;
        let scale_log2 = (1.0 / (dim as f64).sqrt() * std::f64::consts::LOG2_E) as f32;
        let (ni, hi, di) = (int("rows", n)?, int("hidden", hid)?, int("head_dim", dim)?);
        let dpi = int("padded head_dim", dp)?;
        for blk in &self.blocks {
            self.layer_norm(&x, &blk.norm1, &mut xn, n, hid)?;
            self.gemm(&xn, &blk.qkv, &mut qkv, n)?;
            {
                let mut b = s.launch_builder(&self.f.qkv_rope);
                b.arg(&qkv)
                    .arg(&blk.qkv.b)
                    .arg(&cos)
                    .arg(&sin)
                    .arg(&mut qb)
                    .arg(&mut kb)
                    .arg(&mut vb)
                    .arg(&ni)
                    .arg(&hi)
                    .arg(&di)
                    .arg(&dpi);
                // SAFETY: qkv holds n rows of 3·hid, the bias 3·hid, cos and sin n·dim values, qb, kb
                // and vb heads·n·dp; the block's shared memory holds 2·hid floats.
                unsafe { b.launch(per_row(n, (8 * hid) as u32)) }?;
            }
            {
                let mut b = s.launch_builder(&self.f.attention);
                b.arg(&qb)
                    .arg(&kb)
                    .arg(&vb)
                    .arg(&mut att)
                    .arg(&tiles)
                    .arg(&ni)
                    .arg(&hi)
                    .arg(&di)
                    .arg(&scale_log2);
                let c = LaunchConfig {
                    grid_dim: (n_tiles as u32, heads as u32, 1),
                    block_dim: (ATTN_THREADS, 1, 1),
                    shared_mem_bytes: 0,
                };
                // SAFETY: every tile's frame lies within the n rows of qb, kb, vb and att; the
                // kernel's padded head dimension is dp (chosen at construction).
                unsafe { b.launch(c) }?;
            }
            self.gemm(&att, &blk.proj, &mut y, n)?;
            self.bias_residual(&mut x, &y, &blk.proj.b, n, hid)?;
            self.layer_norm(&x, &blk.norm2, &mut xn, n, hid)?;
            self.gemm(&xn, &blk.fc1, &mut h1, n)?;
            self.bias_act(&h1, &blk.fc1.b, &mut h1b, n, inter, cfg.hidden_act)?;
            self.gemm(&h1b, &blk.fc2, &mut y, n)?;
            self.bias_residual(&mut x, &y, &blk.fc2.b, n, hid)?;
        }

        // The merger: norm each patch, `merge²` consecutive rows as one row.
        self.layer_norm(&x, &self.merger_norm, &mut xn, n, hid)?;
        let wide = unit * hid;
        let mut g1 = s.alloc_zeros::<f32>(rows * wide)?;
        let mut g1b = s.alloc_zeros::<bf16>(rows * wide)?;
        self.gemm(&xn, &self.merger_fc1, &mut g1, rows)?;
        self.bias_act(
            &g1,
            &self.merger_fc1.b,
            &mut g1b,
            rows,
            wide,
            Activation::Gelu,
        )?;
        let mut out = s.alloc_zeros::<f32>(rows * out_w)?;
        self.gemm(&g1b, &self.merger_fc2, &mut out, rows)?;
        {
            let (r, c) = (int("rows", rows)?, int("cols", out_w)?);
            let mut b = s.launch_builder(&self.f.add_bias);
            b.arg(&mut out).arg(&self.merger_fc2.b).arg(&r).arg(&c);
            // SAFETY: out holds rows·out_w values, the bias out_w.
            unsafe { b.launch(elementwise(rows * out_w)) }?;
        }
        Ok(s.clone_dtoh(&out)?)
    }
}
