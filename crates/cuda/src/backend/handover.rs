//! The hand-over between pipeline stages on this backend: the producing stage waits for its stream
//! (so the streams it hands over are complete), and the next stage copies them into its own
//! stream-ordered memory, on the same device with an ordinary device copy and from another device
//! with a peer copy, then waits for that copy, after which the producer may free or reuse its
//! buffer in its own stream order.

use cudarc::driver::{sys, DevicePtr, DevicePtrMut};
use half::bf16;
use sanmai_model::{Handover, OpResult, StageLink, StageRecv, StageSend};

use super::{CudaBackend, CudaTensor};
use crate::error::{At, Result};
use crate::link::{connect, LinkReceiver, LinkSender};

impl StageSend<CudaTensor> for LinkSender {
    fn send(&self, x: &CudaTensor) -> OpResult<(usize, usize)> {
        LinkSender::send(self, x).at("stage link send")?;
        Ok((x.rows, x.cols))
    }
}

impl StageRecv<CudaTensor> for LinkReceiver {
    fn recv(&self, rows: usize, cols: usize) -> OpResult<CudaTensor> {
        LinkReceiver::recv(self, rows, cols).at("stage link receive")
    }
}

impl CudaBackend {
    /// An NCCL link to a backend on another device; `None` on the same device (a device copy).
    pub(super) fn link_to_impl(&self, next: &CudaBackend) -> Result<Option<StageLink<CudaTensor>>> {
        if self.gpu.info().ordinal == next.gpu.info().ordinal {
            return Ok(None);
        }
        let (send, recv) = connect(self, next)?;
        Ok(Some((Box::new(send), Box::new(recv))))
    }

    pub(super) fn hand_over_impl(&self, x: CudaTensor) -> Result<Handover<CudaTensor>> {
        self.gpu.synchronize()?;
        Ok(Handover::Tensor(x))
    }

    pub(super) fn take_over_impl(&self, h: Handover<CudaTensor>) -> Result<CudaTensor> {
        let x = match h {
            Handover::Tensor(x) => x,
            Handover::Host { rows, cols, data } => {
                return self.tensor_from_host(rows, cols, &data);
            }
        };
        let stream = self.gpu.stream();
        let n = x.buf.len();
        // SAFETY: every element is written by the copy below before any op reads it.
        let mut buf = unsafe { stream.alloc::<bf16>(n)? };
        let src_stream = x.buf.stream().clone();
        let same = src_stream.context().cu_device() == stream.context().cu_device();
        if same {
            stream.memcpy_dtod(&x.buf, &mut buf)?;
        } else {
            let (src, _g) = x.buf.device_ptr(stream);
            let (dst, _h) = buf.device_ptr_mut(stream);
            // SAFETY: both buffers hold `n` bf16 values; the source is complete (its stage waited for
            // its stream in `hand_over`) and is not freed before the copy has finished (below).
            unsafe {
                sys::cuMemcpyPeerAsync(
                    dst,
                    stream.context().cu_ctx(),
                    src,
                    src_stream.context().cu_ctx(),
                    n * std::mem::size_of::<bf16>(),
                    stream.cu_stream(),
                )
                .result()?;
            }
        }
        self.gpu.synchronize()?;
        Ok(CudaTensor {
            rows: x.rows,
            cols: x.cols,
            buf,
        })
    }
}
