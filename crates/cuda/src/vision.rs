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
//!
//! Blocks on the host ([`CudaTower::new`] with `blocks_on_host`, the server's `--vit-on-host`):
//! the blocks' weights stay in pinned host memory, in the same bf16/f32 forms, and two device slots
//! hold block i and i + 1. The copy of block i + 1 runs on a second stream while block i computes;
//! events order a slot's copy after the compute that last read it and its compute after its copy.
//! The kernels and their inputs are the ones of resident weights, so the output is bit-identical.

use std::sync::{Arc, Mutex};

use cudarc::cublas::{result as blas, sys as bsys, CudaBlas};
use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr,
    DevicePtrMut, DeviceRepr, LaunchConfig, PinnedHostSlice, PushKernelArg, ValidAsZeroBits,
};
use half::bf16;
use sanmai_model::vision::{Grid, ImageError, Tower, Vision, TOWER_CHUNK_ROWS as CHUNK_ROWS};
use sanmai_vision::positions;
use sanmai_vision::tower::{self, Activation, Block, LayerNorm, Linear, VisionConfig};

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

impl DevBlock {
    /// The block's matrices and vectors, in the order of [`host_parts`].
    fn parts_mut(&mut self) -> ([&mut CudaSlice<bf16>; 4], [&mut CudaSlice<f32>; 8]) {
        (
            [
                &mut self.qkv.w,
                &mut self.proj.w,
                &mut self.fc1.w,
                &mut self.fc2.w,
            ],
            [
                &mut self.qkv.b,
                &mut self.proj.b,
                &mut self.fc1.b,
                &mut self.fc2.b,
                &mut self.norm1.g,
                &mut self.norm1.b,
                &mut self.norm2.g,
                &mut self.norm2.b,
            ],
        )
    }
}

/// A block's matrices (bf16, as the device holds them) and vectors.
fn host_parts(b: &Block) -> ([Vec<bf16>; 4], [&[f32]; 8]) {
    let mat = |l: &Linear| {
        l.weight
            .iter()
            .map(|&v| bf16::from_f32(v))
            .collect::<Vec<_>>()
    };
    (
        [mat(&b.qkv), mat(&b.proj), mat(&b.fc1), mat(&b.fc2)],
        [
            &b.qkv.bias,
            &b.proj.bias,
            &b.fc1.bias,
            &b.fc2.bias,
            &b.norm1.weight,
            &b.norm1.bias,
            &b.norm2.weight,
            &b.norm2.bias,
        ],
    )
}

/// A block's weights in pinned host memory.
struct HostBlock {
    mats: Vec<PinnedHostSlice<bf16>>,
    vecs: Vec<PinnedHostSlice<f32>>,
}

fn pinned_copy<T: DeviceRepr + ValidAsZeroBits + Copy>(
    ctx: &Arc<CudaContext>,
    v: &[T],
) -> Result<PinnedHostSlice<T>> {
    // SAFETY: every element is written below before any copy reads the buffer.
    let mut p = unsafe { ctx.alloc_pinned::<T>(v.len().max(1)) }?;
    p.as_mut_slice()?[..v.len()].copy_from_slice(v);
    Ok(p)
}

/// The blocks streamed from the host: two device slots, the copy stream, and per slot the event
/// of its last copy and of the last compute that read it.
struct Streamed {
    host: Vec<HostBlock>,
    slots: [DevBlock; 2],
    copy: Arc<CudaStream>,
    loaded: [CudaEvent; 2],
    freed: [CudaEvent; 2],
}

impl Streamed {
    /// Copies block `i` into its slot (`i % 2`) on the copy stream, after the compute that last
    /// read the slot.
    fn prefetch(&mut self, i: usize) -> Result<()> {
        let slot = i % 2;
        self.copy.wait(&self.freed[slot])?;
        let (mats, vecs) = self.slots[slot].parts_mut();
        let h = &self.host[i];
        for (src, dst) in h.mats.iter().zip(mats) {
            self.copy.memcpy_htod(src, dst)?;
        }
        for (src, dst) in h.vecs.iter().zip(vecs) {
            self.copy.memcpy_htod(src, dst)?;
        }
        self.loaded[slot].record(&self.copy)?;
        Ok(())
    }
}

/// Where the blocks' weights live.
enum Blocks {
    Resident(Vec<DevBlock>),
    Streamed(Box<Streamed>),
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

/// The stream, the cuBLAS handle and the kernels a forward launches with.
struct Ops {
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    f: Funcs,
}

/// What a forward uses exclusively: the launch state and the weights.
struct Inner {
    ops: Ops,
    patch: DevLinear,
    pos: CudaSlice<f32>,
    blocks: Blocks,
    merger_norm: DevNorm,
    merger_fc1: DevLinear,
    merger_fc2: DevLinear,
}

/// A vision tower on a CUDA device (see the module docs).
pub struct CudaTower {
    cfg: VisionConfig,
    blocks_on_host: bool,
    inner: Mutex<Inner>,
}

impl CudaTower {
    /// Uploads `vision`'s weights to `gpu`'s device (its context; the tower gets its own stream and
    /// cuBLAS handle) and takes the tower's kernels from `gpu`'s registry. With `blocks_on_host`
    /// the blocks' weights go to pinned host memory instead, streamed through two device slots.
    pub fn new(vision: &Vision, gpu: &Gpu, blocks_on_host: bool) -> Result<Self> {
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
        if w.blocks.len() != cfg.depth || cfg.depth == 0 || w.patch_embed.inputs != cfg.patch_len()
        {
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
        let block = |b: &Block| -> Result<DevBlock> {
            Ok(DevBlock {
                norm1: norm(&b.norm1)?,
                qkv: linear(&b.qkv)?,
                proj: linear(&b.proj)?,
                norm2: norm(&b.norm2)?,
                fc1: linear(&b.fc1)?,
                fc2: linear(&b.fc2)?,
            })
        };
        let blocks = if blocks_on_host {
            let ctx = gpu.context();
            let host = w
                .blocks
                .iter()
                .map(|b| {
                    let (mats, vecs) = host_parts(b);
                    Ok(HostBlock {
                        mats: mats
                            .iter()
                            .map(|m| pinned_copy(ctx, m))
                            .collect::<Result<_>>()?,
                        vecs: vecs
                            .iter()
                            .map(|v| pinned_copy(ctx, v))
                            .collect::<Result<_>>()?,
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            // Every block has the first one's shapes (the config's).
            let slots = [block(&w.blocks[0])?, block(&w.blocks[0])?];
            Blocks::Streamed(Box::new(Streamed {
                host,
                slots,
                copy: ctx.new_stream()?,
                loaded: [ctx.new_event(None)?, ctx.new_event(None)?],
                freed: [ctx.new_event(None)?, ctx.new_event(None)?],
            }))
        } else {
            Blocks::Resident(w.blocks.iter().map(block).collect::<Result<Vec<_>>>()?)
        };
        let inner = Inner {
            patch: linear(&w.patch_embed)?,
            pos: stream.clone_htod(&w.pos_embed)?,
            blocks,
            merger_norm: norm(&w.merger.norm)?,
            merger_fc1: linear(&w.merger.fc1)?,
            merger_fc2: linear(&w.merger.fc2)?,
            ops: Ops {
                f,
                blas,
                stream: stream.clone(),
            },
        };
        stream.synchronize()?;
        Ok(CudaTower {
            cfg,
            blocks_on_host,
            inner: Mutex::new(inner),
        })
    }

    /// Bytes of the tower's weights on the device (with the blocks on the host: the two slots).
    pub fn weight_bytes(&self) -> usize {
        let inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let lin = |l: &DevLinear| 2 * l.w.len() + 4 * l.b.len();
        let norm = |n: &DevNorm| 4 * (n.g.len() + n.b.len());
        let block = |b: &DevBlock| {
            norm(&b.norm1) + lin(&b.qkv) + lin(&b.proj) + norm(&b.norm2) + lin(&b.fc1) + lin(&b.fc2)
        };
        let blocks: usize = match &inner.blocks {
            Blocks::Resident(v) => v.iter().map(block).sum(),
            Blocks::Streamed(st) => st.slots.iter().map(block).sum(),
        };
        lin(&inner.patch)
            + 4 * inner.pos.len()
            + blocks
            + norm(&inner.merger_norm)
            + lin(&inner.merger_fc1)
            + lin(&inner.merger_fc2)
    }

    /// Bytes of the blocks' weights in pinned host memory (0 when they are on the device).
    pub fn host_bytes(&self) -> usize {
        let inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        match &inner.blocks {
            Blocks::Resident(_) => 0,
            Blocks::Streamed(st) => st
                .host
                .iter()
                .map(|h| {
                    h.mats.iter().map(|m| 2 * m.len()).sum::<usize>()
                        + h.vecs.iter().map(|v| 4 * v.len()).sum::<usize>()
                })
                .sum(),
        }
    }

    /// The merged tokens `[Σ t·h·w / merge², out_hidden_size]` of the images of `grids` whose patch
    /// rows are `pixels` (as [`Vision::forward`]).
    pub fn run(&self, pixels: &[f32], grids: &[Grid]) -> std::result::Result<Vec<f32>, ImageError> {
        let frames = tower::frames(&self.cfg, pixels, grids)?;
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        inner
            .forward(&self.cfg, pixels, grids, &frames)
            .map_err(|e| ImageError::Backend(e.at("vision tower")))
    }
}

impl Tower for CudaTower {
    fn forward(&self, pixels: &[f32], grids: &[Grid]) -> std::result::Result<Vec<f32>, ImageError> {
        self.run(pixels, grids)
    }

    fn blocks_on_host(&self) -> bool {
        self.blocks_on_host
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

impl Ops {
    /// `y[m, outputs] = x[m, inputs] · Wᵀ` (no bias), bf16 in, f32 out.
    fn gemm(
        &self,
        x: &CudaView<bf16>,
        l: &DevLinear,
        y: &mut CudaViewMut<f32>,
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
        x: &CudaView<f32>,
        n: &DevNorm,
        y: &mut CudaViewMut<bf16>,
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
        y: &CudaView<f32>,
        bias: &CudaSlice<f32>,
        out: &mut CudaViewMut<bf16>,
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
        x: &mut CudaViewMut<f32>,
        y: &CudaView<f32>,
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
}

/// The row ranges of `n` rows in pieces of at most [`CHUNK_ROWS`].
fn chunks(n: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..n)
        .step_by(CHUNK_ROWS)
        .map(move |r0| (r0, (r0 + CHUNK_ROWS).min(n)))
}

impl Inner {
    fn forward(
        &mut self,
        cfg: &VisionConfig,
        pixels: &[f32],
        grids: &[Grid],
        frames: &[(usize, usize)],
    ) -> Result<Vec<f32>> {
        let s = self.ops.stream.clone();
        let ops = &self.ops;
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
        let idx = s.clone_htod(&idx)?;
        let wts = s.clone_htod(&wts)?;
        let cos = s.clone_htod(&cos)?;
        let sin = s.clone_htod(&sin)?;
        let n_tiles = tiles.len() / 3;
        let tiles = s.clone_htod(&tiles)?;

        // Patch embedding + bias + positions.
        let mut x = s.alloc_zeros::<f32>(n * hid)?;
        {
            let px = s.clone_htod(&px)?;
            ops.gemm(&px.as_view(), &self.patch, &mut x.as_view_mut(), n)?;
            let (r, c) = (int("rows", n)?, int("cols", hid)?);
            let mut b = s.launch_builder(&ops.f.embed_pos);
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

        // Whole-image buffers: the normed rows, q, k and v in bf16 (head-major, the head dimension
        // padded with zeros) and the attention output. The row-wise work in between (the qkv and
        // MLP GEMMs and their epilogues) goes in pieces of CHUNK_ROWS rows through smaller buffers.
        let c_rows = n.min(CHUNK_ROWS);
        let mut xn = s.alloc_zeros::<bf16>(n * hid)?;
        let dp = padded(dim);
        let mut qb = s.alloc_zeros::<bf16>(heads * n * dp)?;
        let mut kb = s.alloc_zeros::<bf16>(heads * n * dp)?;
        let mut vb = s.alloc_zeros::<bf16>(heads * n * dp)?;
        let mut att = s.alloc_zeros::<bf16>(n * hid)?;
        let mut qkv = s.alloc_zeros::<f32>(c_rows * 3 * hid)?;
        let mut y = s.alloc_zeros::<f32>(c_rows * hid)?;
        let mut h1 = s.alloc_zeros::<f32>(c_rows * inter)?;
        let mut h1b = s.alloc_zeros::<bf16>(c_rows * inter)?;
        let scale_log2 = (1.0 / (dim as f64).sqrt() * std::f64::consts::LOG2_E) as f32;
        let (ni, hi, di) = (int("rows", n)?, int("hidden", hid)?, int("head_dim", dim)?);
        let dpi = int("padded head_dim", dp)?;
        if let Blocks::Streamed(st) = &mut self.blocks {
            st.prefetch(0)?;
        }
        for i in 0..cfg.depth {
            let blk = match &mut self.blocks {
                Blocks::Resident(v) => &v[i],
                Blocks::Streamed(st) => {
                    if i + 1 < cfg.depth {
                        st.prefetch(i + 1)?;
                    }
                    s.wait(&st.loaded[i % 2])?;
                    &st.slots[i % 2]
                }
            };
            ops.layer_norm(&x.as_view(), &blk.norm1, &mut xn.as_view_mut(), n, hid)?;
            for (r0, r1) in chunks(n) {
                let m = r1 - r0;
                let xs = xn.slice(r0 * hid..r1 * hid);
                ops.gemm(&xs, &blk.qkv, &mut qkv.as_view_mut(), m)?;
                let (r0i, mi) = (int("row", r0)?, int("rows", m)?);
                let mut b = s.launch_builder(&ops.f.qkv_rope);
                b.arg(&qkv)
                    .arg(&blk.qkv.b)
                    .arg(&cos)
                    .arg(&sin)
                    .arg(&mut qb)
                    .arg(&mut kb)
                    .arg(&mut vb)
                    .arg(&ni)
                    .arg(&r0i)
                    .arg(&mi)
                    .arg(&hi)
                    .arg(&di)
                    .arg(&dpi);
                // SAFETY: qkv holds m rows of 3·hid, the bias 3·hid, cos and sin n·dim values, qb,
                // kb and vb heads·n·dp, rows r0..r1 of which are written; the block's shared memory
                // holds 2·hid floats.
                unsafe { b.launch(per_row(m, (8 * hid) as u32)) }?;
            }
            {
                let mut b = s.launch_builder(&ops.f.attention);
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
            for (r0, r1) in chunks(n) {
                let (m, rows) = (r1 - r0, r0 * hid..r1 * hid);
                ops.gemm(&att.slice(rows.clone()), &blk.proj, &mut y.as_view_mut(), m)?;
                let mut xs = x.slice_mut(rows.clone());
                ops.bias_residual(&mut xs, &y.as_view(), &blk.proj.b, m, hid)?;
                let mut xns = xn.slice_mut(rows.clone());
                ops.layer_norm(&xs.as_view(), &blk.norm2, &mut xns, m, hid)?;
                ops.gemm(&xns.as_view(), &blk.fc1, &mut h1.as_view_mut(), m)?;
                let act = cfg.hidden_act;
                ops.bias_act(
                    &h1.as_view(),
                    &blk.fc1.b,
                    &mut h1b.as_view_mut(),
                    m,
                    inter,
                    act,
                )?;
                ops.gemm(&h1b.as_view(), &blk.fc2, &mut y.as_view_mut(), m)?;
                ops.bias_residual(&mut xs, &y.as_view(), &blk.fc2.b, m, hid)?;
            }
            if let Blocks::Streamed(st) = &self.blocks {
                st.freed[i % 2].record(&s)?;
            }
        }
        drop((qkv, y, h1, h1b, qb, kb, vb, att));

        // The merger: norm each patch, `merge²` consecutive rows as one row.
        ops.layer_norm(
            &x.as_view(),
            &self.merger_norm,
            &mut xn.as_view_mut(),
            n,
            hid,
        )?;
        let wide = unit * hid;
        let mut g1 = s.alloc_zeros::<f32>(rows * wide)?;
        let mut g1b = s.alloc_zeros::<bf16>(rows * wide)?;
        ops.gemm(&xn.as_view(), &self.merger_fc1, &mut g1.as_view_mut(), rows)?;
        let gelu = Activation::Gelu;
        let b1 = &self.merger_fc1.b;
        ops.bias_act(&g1.as_view(), b1, &mut g1b.as_view_mut(), rows, wide, gelu)?;
        let mut out = s.alloc_zeros::<f32>(rows * out_w)?;
        ops.gemm(
            &g1b.as_view(),
            &self.merger_fc2,
            &mut out.as_view_mut(),
            rows,
        )?;
        {
            let (r, c) = (int("rows", rows)?, int("cols", out_w)?);
            let mut b = s.launch_builder(&ops.f.add_bias);
            b.arg(&mut out).arg(&self.merger_fc2.b).arg(&r).arg(&c);
            // SAFETY: out holds rows·out_w values, the bias out_w.
            unsafe { b.launch(elementwise(rows * out_w)) }?;
        }
        Ok(s.clone_dtoh(&out)?)
    }
}
