//! The K and V pools the row cache fronts in its tests: in VRAM, or in host memory registered with
//! the driver and mapped for the device (as the backend's offloaded K/V pools are).

use std::sync::Arc;

use sanmai_cuda::cudarc::driver::{sys, CudaStream, DevicePtr, DeviceSlice, SyncOnDrop};
use sanmai_cuda::Gpu;

use super::*;

/// Host memory registered with the driver, device-mapped (as the backend's offloaded K/V pools):
/// under unified addressing the kernels read it through its device pointer.
pub(super) struct HostRegistered {
    ptr: *mut bf16,
    len: usize,
    layout: std::alloc::Layout,
    dptr: sys::CUdeviceptr,
    stream: Arc<CudaStream>,
}

impl HostRegistered {
    /// `len` zeroed bf16 values, page-aligned, registered with `g`'s context.
    pub(super) fn new(g: &Gpu, len: usize) -> Self {
        let bytes = (len * 2).div_ceil(4096).max(1) * 4096;
        let layout = std::alloc::Layout::from_size_align(bytes, 4096).unwrap();
        // SAFETY: a non-zero size; freed in Drop with the same layout.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) }.cast::<bf16>();
        assert!(!ptr.is_null(), "host allocation of {bytes} bytes failed");
        g.context().bind_to_thread().unwrap();
        let mut dptr: sys::CUdeviceptr = 0;
        let flags = sys::CU_MEMHOSTREGISTER_DEVICEMAP | sys::CU_MEMHOSTREGISTER_PORTABLE;
        // SAFETY: `ptr` is a live page-aligned allocation of `bytes` bytes, unregistered in Drop
        // before it is freed.
        unsafe {
            sys::cuMemHostRegister_v2(ptr.cast(), bytes, flags)
                .result()
                .unwrap();
            sys::cuMemHostGetDevicePointer_v2(&mut dptr, ptr.cast(), 0)
                .result()
                .unwrap();
        }
        Self {
            ptr,
            len,
            layout,
            dptr,
            stream: g.stream().clone(),
        }
    }

    /// The values; write only while no queued kernel reads them.
    pub(super) fn host_mut(&mut self) -> &mut [bf16] {
        // SAFETY: `len` values of the live allocation, borrowed mutably through `self`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for HostRegistered {
    fn drop(&mut self) {
        let _ = self.stream.synchronize();
        // SAFETY: registered in `new`; no queued work reads it any more (synchronised above).
        unsafe {
            let _ = sys::cuMemHostUnregister(self.ptr.cast());
            std::alloc::dealloc(self.ptr.cast(), self.layout);
        }
    }
}

impl DeviceSlice<bf16> for HostRegistered {
    fn len(&self) -> usize {
        self.len
    }
    fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
}

impl DevicePtr<bf16> for HostRegistered {
    fn device_ptr<'a>(&'a self, _stream: &'a CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        (self.dptr, SyncOnDrop::Sync(None))
    }
}

/// A K or V pool in VRAM or in host-registered memory.
pub(super) enum Pool {
    Device(CudaSlice<bf16>),
    Host(HostRegistered),
}

impl Pool {
    pub(super) fn new(g: &Gpu, len: usize, host: bool) -> Self {
        if host {
            Pool::Host(HostRegistered::new(g, len))
        } else {
            Pool::Device(g.zeros(len).unwrap())
        }
    }

    /// Writes `data` at element `at` (the stream must be idle for a host pool).
    pub(super) fn write(&mut self, g: &Gpu, at: usize, data: &[bf16]) {
        match self {
            Pool::Device(s) => g
                .stream()
                .memcpy_htod(data, &mut s.slice_mut(at..at + data.len()))
                .unwrap(),
            Pool::Host(h) => h.host_mut()[at..at + data.len()].copy_from_slice(data),
        }
    }
}

impl DeviceSlice<bf16> for Pool {
    fn len(&self) -> usize {
        match self {
            Pool::Device(s) => s.len(),
            Pool::Host(h) => h.len,
        }
    }
    fn stream(&self) -> &Arc<CudaStream> {
        match self {
            Pool::Device(s) => s.stream(),
            Pool::Host(h) => &h.stream,
        }
    }
}

impl DevicePtr<bf16> for Pool {
    fn device_ptr<'a>(&'a self, stream: &'a CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        match self {
            Pool::Device(s) => s.device_ptr(stream),
            Pool::Host(h) => h.device_ptr(stream),
        }
    }
}
