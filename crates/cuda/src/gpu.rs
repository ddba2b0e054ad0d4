//! [`Gpu`]: one device's context, its stream, the loaded kernels and a cuBLAS handle, plus the host
//! transfers every op and test needs.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::cublas::CudaBlas;
use cudarc::driver::sys;
use cudarc::driver::{
    CudaContext, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, DeviceSlice,
    LaunchConfig, SyncOnDrop, ValidAsZeroBits,
};

use crate::device::{self, guarded, DeviceInfo};
use crate::error::{CudaError, Result};
use crate::registry::{CompileOptions, Kernel, Kernels};
use crate::timer::KernelTimer;

/// One CUDA device ready to run the kernels: context, a stream, every kernel compiled and loaded.
/// Every op and transfer is queued on [`Gpu::stream`]; buffers must not be used from another stream.
pub struct Gpu {
    info: DeviceInfo,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    kernels: Kernels,
    blas: CudaBlas,
    /// Kernels that open with the PDL prologue are launched with programmatic stream serialization.
    pdl: bool,
    /// [`GpuOptions::fp8_tensor_cores`].
    pub(crate) fp8_tc: bool,
    /// The one-row packed GEMV's kernel ([`Gpu::set_packed_gemv_m1`]), as `PackedM1::code`.
    pub(crate) m1: std::sync::atomic::AtomicUsize,
    /// Times each launch while a timed capture is in progress.
    timer: KernelTimer,
    /// cuBLASLt for the FP8 tensor-core GEMM, opened at its first use (`None`: not available).
    pub(crate) fp8_lt: std::sync::OnceLock<Option<crate::ops::Fp8Lt>>,
    /// Whether the routed FP8 experts' tensor-core GEMM passed its first-use check.
    pub(crate) fp8_mma_check: crate::ops::LtVerdict,
}

/// How a [`Gpu`] opens. This crate reads no environment variable: its caller decides (the `sanmai`
/// binary from its flags, each defaulting to an environment variable).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuOptions {
    /// Programmatic dependent launch on devices that have it (sm_90 and later); off: every kernel
    /// is launched the ordinary way.
    pub pdl: bool,
    /// FP8 prefill GEMMs on the FP8 tensor cores where the device has them (cuBLASLt's block-scaled
    /// GEMM on sm_90, the routed experts' `mma.sync` e4m3 on sm_89 and later); off (the default):
    /// the bf16 tiles, which on an H100 prefilled 3–13% faster and without the activations' e4m3
    /// rounding (`docs/gpu/fp8-2026-12-05.md`).
    pub fp8_tensor_cores: bool,
    /// One-row INT8 GEMVs cut as the layer launches' row phases, a warp a row
    /// (`PackedM1::Rows`, `kernels/gemv_rows.cu`) where the shape allows; off: the 32-value unit
    /// GEMV (`PackedM1::Units`), for A/B runs.
    pub row_gemv: bool,
    /// Where the kernels' CUDA headers and cache are.
    pub compile: CompileOptions,
}

impl Default for GpuOptions {
    /// PDL on, the FP8 tensor cores off, the row-phase one-row GEMV on, no kernel cache, the
    /// standard header folders only.
    fn default() -> Self {
        GpuOptions {
            pdl: true,
            fp8_tensor_cores: false,
            row_gemv: true,
            compile: CompileOptions::default(),
        }
    }
}

impl Gpu {
    /// Opens device `ordinal`, compiles (or loads from the cache) every kernel for its architecture and
    /// creates a cuBLAS handle. Errors (never panics) when there is no such device or a kernel fails.
    pub fn new(ordinal: usize, options: &GpuOptions) -> Result<Self> {
        let devices = device::probe()?;
        let info = devices
            .into_iter()
            .find(|d| d.ordinal == ordinal)
            .ok_or_else(|| CudaError::NoDevice(format!("no CUDA device with ordinal {ordinal}")))?;
        let ctx = guarded("context", || Ok(CudaContext::new(ordinal)?))?;
        // Every op runs on the one stream below, in order, so cudarc's per-buffer event tracking (an
        // event record per buffer per launch, for cross-stream safety) is not needed.
        // SAFETY: no buffer exists yet; all later buffers are used on `stream` only.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream()?;
        let kernels = Kernels::load(&ctx, &info.arch(), info.driver_version, &options.compile)?;
        // SAFETY: cuBLAS is loaded on demand; a missing library surfaces as an error through `guarded`.
        let blas = guarded("cuBLAS", || Ok(CudaBlas::new(stream.clone())?))?;
        let pdl = options.pdl && info.compute_capability.0 >= 9;
        Ok(Self {
            info,
            ctx,
            stream,
            kernels,
            blas,
            pdl,
            fp8_tc: options.fp8_tensor_cores,
            m1: std::sync::atomic::AtomicUsize::new(
                crate::ops::PackedM1::of_options(options).code(),
            ),
            timer: KernelTimer::default(),
            fp8_lt: std::sync::OnceLock::new(),
            fp8_mma_check: crate::ops::LtVerdict::default(),
        })
    }

    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The stream every op of this `Gpu` is queued on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    pub fn kernels(&self) -> &Kernels {
        &self.kernels
    }

    pub(crate) fn blas(&self) -> &CudaBlas {
        &self.blas
    }

    /// The timer of the kernels launched under a timed capture.
    pub fn timer(&self) -> &KernelTimer {
        &self.timer
    }

    pub(crate) fn kernel(&self, name: &str) -> Result<&Kernel> {
        self.kernels.get(name)
    }

    /// Starts a launch of `kernel` on [`Gpu::stream`]: add its arguments in the kernel's parameter
    /// order with [`Launch::ptr`], [`Launch::ptr_mut`] (buffers) and [`Launch::arg`] (scalars), then
    /// [`Launch::launch`].
    pub(crate) fn launch<'a>(&'a self, kernel: &'a Kernel) -> Launch<'a> {
        Launch {
            stream: &self.stream,
            timer: &self.timer,
            kernel,
            pdl: self.pdl && kernel.pdl,
            cooperative: false,
            args: Vec::with_capacity(16),
            ptrs: Vec::with_capacity(12),
            guards: Vec::with_capacity(12),
        }
    }

    /// The device address of a buffer, for the alignment a kernel variant needs (a kernel's argument
    /// goes through [`Launch::ptr`]).
    pub(crate) fn addr<T>(&self, buf: &impl DevicePtr<T>) -> sys::CUdeviceptr {
        buf.device_ptr(&self.stream).0
    }

    /// [`Gpu::addr`] of a buffer the op writes.
    pub(crate) fn addr_mut<T>(&self, buf: &mut impl DevicePtrMut<T>) -> sys::CUdeviceptr {
        buf.device_ptr_mut(&self.stream).0
    }

    /// Copies host data into a new device buffer.
    pub fn upload<T: DeviceRepr>(&self, data: &[T]) -> Result<CudaSlice<T>> {
        Ok(self.stream.clone_htod(data)?)
    }

    /// Copies a device buffer back to the host (waits for the stream).
    pub fn download<T: DeviceRepr, S: DevicePtr<T>>(&self, buf: &S) -> Result<Vec<T>> {
        Ok(self.stream.clone_dtoh(buf)?)
    }

    /// A new zeroed device buffer of `len` elements.
    pub fn zeros<T: DeviceRepr + ValidAsZeroBits>(&self, len: usize) -> Result<CudaSlice<T>> {
        Ok(self.stream.alloc_zeros(len)?)
    }

    /// Device-to-device copy bandwidth: the best of five copies of 1 GiB timed by CUDA events, in
    /// bytes moved (read + written) per second (what `sanmai bench`'s roofline and the GEMV benches
    /// compare against).
    pub fn copy_bandwidth(&self) -> Result<f64> {
        const BYTES: usize = 1 << 30;
        let timed = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
        let src = self.zeros::<u8>(BYTES)?;
        let mut dst = self.zeros::<u8>(BYTES)?;
        let s = &self.stream;
        s.memcpy_dtod(&src, &mut dst)?;
        let mut best = f32::INFINITY;
        for _ in 0..5 {
            let a = s.record_event(timed)?;
            s.memcpy_dtod(&src, &mut dst)?;
            let b = s.record_event(timed)?;
            b.synchronize()?;
            best = best.min(a.elapsed_ms(&b)?);
        }
        Ok(2.0 * BYTES as f64 / (best as f64 * 1e-3))
    }

    /// Waits until every queued op has finished.
    pub fn synchronize(&self) -> Result<()> {
        Ok(self.stream.synchronize()?)
    }

    /// Keeps memory the stream-ordered allocator has freed in its pool instead of handing it back to
    /// the driver at each synchronisation: the next step's tensors reuse it without a round trip to the
    /// driver, and after a profiling step the device's free memory shows the step's peak.
    pub fn keep_pool_memory(&self) -> Result<()> {
        self.ctx.bind_to_thread()?;
        let mut pool = std::ptr::null_mut();
        let mut keep = u64::MAX;
        // SAFETY: plain driver calls on this context's device with valid out-pointers.
        unsafe {
            cudarc::driver::sys::cuDeviceGetDefaultMemPool(&mut pool, self.ctx.cu_device())
                .result()?;
            cudarc::driver::sys::cuMemPoolSetAttribute(
                pool,
                cudarc::driver::sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                (&mut keep as *mut u64).cast(),
            )
            .result()?;
        }
        Ok(())
    }
}

/// `(free, total)` bytes of the device `ctx` belongs to, as the driver reports them (every process).
pub fn device_memory(ctx: &CudaContext) -> Result<(usize, usize)> {
    ctx.bind_to_thread()?;
    Ok(cudarc::driver::result::mem_get_info()?)
}

/// A kernel launch being assembled (see [`Gpu::launch`]). A kernel that opens with the PDL prologue
/// is launched with programmatic stream serialization (on sm_90 and later): its blocks may be scheduled
/// while the kernel ahead of it finishes, and its prologue waits for that kernel's results. Under
/// stream capture this becomes a programmatic edge of the graph.
pub(crate) struct Launch<'a> {
    stream: &'a Arc<CudaStream>,
    timer: &'a KernelTimer,
    kernel: &'a Kernel,
    pdl: bool,
    /// Launched cooperatively: every block resident at once (a kernel with grid-wide barriers).
    cooperative: bool,
    /// One pointer per kernel parameter, to its value; the slots of the buffer arguments are filled
    /// in from `ptrs` at the launch.
    args: Vec<*mut c_void>,
    /// The device pointers of the buffer arguments, each with its slot in `args`.
    ptrs: Vec<(usize, sys::CUdeviceptr)>,
    /// The buffers' access guards, held until the launch is dropped (after the kernel is queued).
    guards: Vec<SyncOnDrop<'a>>,
}

impl<'a> Launch<'a> {
    /// Appends a kernel argument: a device pointer (`u64`) or a scalar, borrowed until the launch.
    pub fn arg<T: DeviceRepr>(&mut self, value: &'a T) -> &mut Self {
        self.args.push(value as *const T as *mut c_void);
        self
    }

    /// Appends a buffer the kernel reads: its device pointer on the launch's stream.
    pub fn ptr<T>(&mut self, buf: &'a impl DevicePtr<T>) -> &mut Self {
        let (p, guard) = buf.device_ptr(self.stream);
        self.push_ptr(p, guard)
    }

    /// Appends a buffer the kernel writes: its device pointer on the launch's stream.
    pub fn ptr_mut<T>(&mut self, buf: &'a mut impl DevicePtrMut<T>) -> &mut Self {
        let (p, guard) = buf.device_ptr_mut(self.stream);
        self.push_ptr(p, guard)
    }

    /// Launches the kernel cooperatively: the driver runs its blocks only all at once, as a kernel
    /// whose blocks wait for each other needs (the grid must fit what the multiprocessors hold).
    pub fn cooperative(&mut self) -> &mut Self {
        self.cooperative = true;
        self
    }

    fn push_ptr(&mut self, p: sys::CUdeviceptr, guard: SyncOnDrop<'a>) -> &mut Self {
        self.ptrs.push((self.args.len(), p));
        self.args.push(std::ptr::null_mut());
        self.guards.push(guard);
        self
    }

    /// Queues the kernel on the stream.
    ///
    /// # Safety
    /// The arguments must match the kernel's parameters in number, order and type, and every buffer
    /// must hold what the kernel reads and writes under `c`.
    pub unsafe fn launch(&mut self, c: LaunchConfig) -> Result<()> {
        // SAFETY: an all-zero attribute is a valid value of this plain C struct.
        let mut attrs: [sys::CUlaunchAttribute; 2] = unsafe { std::mem::zeroed() };
        let mut n = 0;
        if self.pdl {
            attrs[n].id =
                sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
            attrs[n].value.programmaticStreamSerializationAllowed = 1;
            n += 1;
        }
        if self.cooperative {
            attrs[n].id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_COOPERATIVE;
            attrs[n].value.cooperative = 1;
            n += 1;
        }
        let config = sys::CUlaunchConfig {
            gridDimX: c.grid_dim.0,
            gridDimY: c.grid_dim.1,
            gridDimZ: c.grid_dim.2,
            blockDimX: c.block_dim.0,
            blockDimY: c.block_dim.1,
            blockDimZ: c.block_dim.2,
            sharedMemBytes: c.shared_mem_bytes,
            hStream: self.stream.cu_stream(),
            attrs: if n > 0 {
                attrs.as_mut_ptr()
            } else {
                std::ptr::null_mut()
            },
            numAttrs: n as u32,
        };
        for (slot, p) in &self.ptrs {
            self.args[*slot] = p as *const sys::CUdeviceptr as *mut c_void;
        }
        self.stream.context().bind_to_thread()?;
        // SAFETY: `config` and the argument pointers live across the call (`ptrs` is not touched
        // until it returns); the caller vouches for the arguments (see above).
        unsafe {
            sys::cuLaunchKernelEx(
                &config,
                self.kernel.func.cu_function(),
                self.args.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()?;
        self.timer.mark(self.stream, &self.kernel.name)
    }
}

/// A launch configuration of `grid` blocks of `block` threads with `smem` bytes of dynamic shared memory.
pub(crate) fn cfg(grid: (u32, u32, u32), block: u32, smem: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: grid,
        block_dim: (block, 1, 1),
        shared_mem_bytes: smem,
    }
}

/// Checks that a buffer holds at least `need` elements.
pub(crate) fn check_len<T>(
    op: &'static str,
    what: &str,
    buf: &impl DeviceSlice<T>,
    need: usize,
) -> Result<()> {
    crate::error::ensure(buf.len() >= need, op, || {
        format!("{what} holds {} elements, needs {need}", buf.len())
    })
}

/// A grid dimension that fits the hardware limit of `u32` blocks.
pub(crate) fn grid_u32(op: &'static str, blocks: usize) -> Result<u32> {
    u32::try_from(blocks).map_err(|_| CudaError::Shape {
        op,
        msg: format!("{blocks} blocks exceed the grid limit"),
    })
}

/// An `i32` kernel argument.
pub(crate) fn int(op: &'static str, what: &str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| CudaError::Shape {
        op,
        msg: format!("{what} = {v} does not fit a 32-bit int"),
    })
}
