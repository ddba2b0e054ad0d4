//! K/V rows in pinned host memory (`--qsa-kv-offload`): one pool of exactly the needed size, pinned
//! by [`sanmai_pinned`] (RAM check, lock file, mlock) and registered with `cuMemHostRegister`
//! (device-mapped: under unified addressing the device pointer is the host pointer), split into
//! one range per layer's K and V. [`Rows`] is either a device buffer or such a range; the kernels
//! take either as a device pointer, so a row read from the host pool is the same bytes as one read
//! from VRAM.

use std::sync::Arc;

use cudarc::driver::{
    sys, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop,
};
use half::bf16;
use sanmai_model::backend::KvHost;
use sanmai_pinned::{HostPool, PinRequest};

use crate::error::{CudaError, Result};
use crate::gpu::Gpu;

/// The values of one K or V pool.
pub(crate) enum Rows {
    Device(CudaSlice<bf16>),
    Host(HostRows),
}

/// A range of a registered host pool; the ranges of one pool never overlap.
pub(crate) struct HostRows {
    ptr: sys::CUdeviceptr,
    len: usize,
    stream: Arc<CudaStream>,
    _pool: Arc<Registered>,
}

/// A pinned pool registered with the driver; unregistered before it is unmapped.
struct Registered {
    pool: HostPool,
    ctx: Arc<cudarc::driver::CudaContext>,
}

impl Drop for Registered {
    fn drop(&mut self) {
        if self.pool.is_empty() {
            return;
        }
        let _ = self.ctx.bind_to_thread();
        // SAFETY: the pool was registered by `pin_rows` and is still mapped; no work of this
        // context reads it any more (its owner, the backend's caches, is being dropped).
        let _ = unsafe { sys::cuMemHostUnregister(self.pool.as_ptr().cast_mut().cast()) };
    }
}

impl DeviceSlice<bf16> for Rows {
    fn len(&self) -> usize {
        match self {
            Rows::Device(s) => s.len(),
            Rows::Host(h) => h.len,
        }
    }

    fn stream(&self) -> &Arc<CudaStream> {
        match self {
            Rows::Device(s) => s.stream(),
            Rows::Host(h) => &h.stream,
        }
    }
}

impl DevicePtr<bf16> for Rows {
    fn device_ptr<'a>(&'a self, stream: &'a CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        match self {
            Rows::Device(s) => s.device_ptr(stream),
            // Host rows carry no events: their writers and readers are the kernels of the one
            // stream that owns the caches, ordered by it.
            Rows::Host(h) => (h.ptr, SyncOnDrop::Sync(None)),
        }
    }
}

impl DevicePtrMut<bf16> for Rows {
    fn device_ptr_mut<'a>(
        &'a mut self,
        stream: &'a CudaStream,
    ) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        match self {
            Rows::Device(s) => s.device_ptr_mut(stream),
            Rows::Host(h) => (h.ptr, SyncOnDrop::Sync(None)),
        }
    }
}

impl Rows {
    /// Whether the rows live in host memory.
    pub(crate) fn on_host(&self) -> bool {
        matches!(self, Rows::Host(_))
    }
}

/// Pins one pool of `count` ranges of `len` bf16 values each (zeroed) as `host` says, registers it
/// with `gpu`'s context (device-mapped) and splits it.
pub(crate) fn pin_rows(gpu: &Gpu, host: &KvHost, count: usize, len: usize) -> Result<Vec<Rows>> {
    let bytes = count * len * std::mem::size_of::<bf16>();
    let pool = sanmai_pinned::pin(&PinRequest {
        bytes,
        what: &host.what,
        reserve: host.reserve,
        lock_path: &host.lock_path,
    })
    .map_err(|e| CudaError::Shape {
        op: "init_cache",
        msg: e.to_string(),
    })?;
    let ctx = gpu.context().clone();
    let mut base: sys::CUdeviceptr = 0;
    if !pool.is_empty() {
        ctx.bind_to_thread()?;
        let p = pool.as_ptr().cast_mut().cast();
        let flags = sys::CU_MEMHOSTREGISTER_DEVICEMAP | sys::CU_MEMHOSTREGISTER_PORTABLE;
        // SAFETY: `p` is the start of the live, page-aligned mapping of `bytes` bytes the pool owns;
        // `Registered` unregisters it before the mapping goes.
        unsafe {
            sys::cuMemHostRegister_v2(p, bytes, flags).result()?;
            sys::cuMemHostGetDevicePointer_v2(&mut base, p, 0).result()?;
        }
    }
    let pool = Arc::new(Registered { pool, ctx });
    let elem = std::mem::size_of::<bf16>() as u64;
    Ok((0..count)
        .map(|i| {
            Rows::Host(HostRows {
                ptr: base + (i * len) as u64 * elem,
                len,
                stream: gpu.stream().clone(),
                _pool: pool.clone(),
            })
        })
        .collect())
}
