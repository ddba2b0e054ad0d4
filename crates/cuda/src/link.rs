//! The NCCL link between two pipeline stages on different GPUs of one process: [`connect`] joins
//! two [`CudaBackend`]s with a two-rank communicator (`ncclCommInitAll`; rank 0 sends, rank 1
//! receives) and hands back its halves. [`LinkSender::send`] queues `ncclSend` of a [`CudaTensor`]
//! on the sending backend's stream; [`LinkReceiver::recv`] allocates the tensor on the receiving
//! backend's stream and queues the matching `ncclRecv` there. Neither waits for the device: each
//! stage's one stream orders the hand-over with the rest of its work.
//!
//! libnccl is loaded at run time (cudarc's dynamic loading) by the first [`nccl_library`] call,
//! which [`connect`] makes: it says which NCCL was found, or why none was. Stages on one device
//! hand over with a device copy instead; [`connect`] refuses them ([`CudaError::SameDevice`]).

use std::ffi::CStr;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use cudarc::driver::CudaStream;
use cudarc::nccl::result::{self, NcclError};
use cudarc::nccl::{sys, Comm};
use half::bf16;

use crate::backend::{CudaBackend, CudaTensor};
use crate::device::guarded;
use crate::error::{ensure, CudaError, Result};

/// The NCCL library this process loaded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NcclInfo {
    /// `ncclGetVersion`'s number, e.g. 22105.
    pub code: i32,
    /// The version it stands for, e.g. `2.21.5`.
    pub version: String,
    /// The file the dynamic loader mapped (e.g. `/usr/lib/x86_64-linux-gnu/libnccl.so.2.21.5`),
    /// from the process's memory map; `None` where that cannot be read (not Linux).
    pub library: Option<PathBuf>,
}

/// Loads libnccl at the first call (later calls answer as that one did, failed or not) and returns
/// its version and file. Without a loadable libnccl: a [`CudaError::Nccl`] naming the library and
/// how to install it.
pub fn nccl_library() -> Result<NcclInfo> {
    static LOADED: OnceLock<std::result::Result<NcclInfo, String>> = OnceLock::new();
    LOADED.get_or_init(load).clone().map_err(CudaError::Nccl)
}

fn load() -> std::result::Result<NcclInfo, String> {
    // SAFETY: only tries to open the library under the names cudarc uses; no symbol is called.
    if !unsafe { sys::is_culib_present() } {
        return Err(missing_library());
    }
    // cudarc panics on a symbol the library lacks.
    let code = guarded("ncclGetVersion", || Ok(result::get_nccl_version()))
        .map_err(|e| match e {
            CudaError::NoDevice(panic) => panic,
            e => e.to_string(),
        })?
        .map_err(|e| describe("ncclGetVersion", &e))?;
    Ok(NcclInfo {
        code,
        version: version_string(code),
        library: mapped_library(),
    })
}

/// The message for a libnccl that cudarc cannot open, with the names it tries.
fn missing_library() -> String {
    // cudarc's names, its first (libnccl.so) aside, each once.
    let mut others: Vec<String> = Vec::new();
    for name in cudarc::get_lib_name_candidates("nccl").into_iter().skip(1) {
        if !others.contains(&name) {
            others.push(name);
        }
    }
    format!(
        "the NCCL library (libnccl.so.2) could not be loaded. cudarc opens it by the unversioned \
         name libnccl.so (or one of {:?}), never libnccl.so.2: install NCCL 2 with the distro's \
         libnccl2 and libnccl-dev packages (libnccl-dev adds the libnccl.so link), or the \
         nvidia-nccl-cu13 wheel (pip install nvidia-nccl-cu13; its nvidia/nccl/lib folder holds \
         only libnccl.so.2, so add the link there: ln -s libnccl.so.2 libnccl.so), and put the \
         folder holding libnccl.so on LD_LIBRARY_PATH",
        others
    )
}

/// `ncclGetVersion`'s number as a version: `major·10000 + minor·100 + patch` from NCCL 2.9 on,
/// `major·1000 + minor·100 + patch` before.
fn version_string(code: i32) -> String {
    let (major, rest) = if code >= 10_000 {
        (code / 10_000, code % 10_000)
    } else {
        (code / 1_000, code % 1_000)
    };
    format!("{major}.{}.{}", rest / 100, rest % 100)
}

/// The first mapped file of this process named `libnccl.so*`, from `/proc/self/maps`.
fn mapped_library() -> Option<PathBuf> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    maps.lines()
        .filter_map(|line| line.find('/').map(|i| PathBuf::from(&line[i..])))
        .find(|path| {
            path.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("libnccl.so"))
        })
}

/// An NCCL error as a message: the call, the result code and NCCL's text for it (which says which
/// `NCCL_DEBUG` level prints NCCL's own reason).
fn describe(what: &str, e: &NcclError) -> String {
    let text = guarded("ncclGetErrorString", || {
        // SAFETY: NCCL returns a pointer to a static NUL-terminated string for every result code
        // (checked for null all the same).
        let p = unsafe { sys::ncclGetErrorString(e.0) };
        Ok(if p.is_null() {
            String::new()
        } else {
            // SAFETY: non-null, NUL-terminated and static (above).
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        })
    })
    .unwrap_or_default();
    format!("{what} failed: {:?}: {text}", e.0)
}

/// Runs an NCCL call: its error, and a panic of cudarc's loader (a symbol this libnccl lacks), as a
/// [`CudaError::Nccl`] naming the call.
fn nccl_call<T>(
    what: &'static str,
    f: impl FnOnce() -> std::result::Result<T, NcclError>,
) -> Result<T> {
    guarded(what, || {
        f().map_err(|e| CudaError::Nccl(describe(what, &e)))
    })
    .map_err(|e| match e {
        CudaError::NoDevice(panic) => CudaError::Nccl(panic),
        e => e,
    })
}

/// One rank of a link's communicator and the stream its transfers are queued on (its backend's).
struct Rank {
    comm: Comm,
    stream: Arc<CudaStream>,
}

// SAFETY: `Comm` is not `Send` only because it holds NCCL's raw communicator handle. An NCCL
// communicator may be called from any thread as long as no two threads call into it at once (NCCL
// is not thread-safe per communicator, and needs no thread affinity). Each `Rank` owns its own
// communicator (rank 0 or 1 of one `ncclCommInitAll`), each half owns one `Rank`, and the halves
// are `Send` but not `Sync` (`Comm` is not `Sync`), so every call into a communicator comes from
// the one thread that holds its half at the time. The stream is `Send` and `Sync`.
unsafe impl Send for Rank {}

impl Rank {
    fn ordinal(&self) -> usize {
        self.stream.context().ordinal()
    }
}

impl Drop for Rank {
    /// cudarc's `Comm` aborts the communicator when dropped, which cancels transfers still queued
    /// on the device (the peer would then wait for them forever): wait for this rank's transfers
    /// first, so a hand-over queued just before the drop completes.
    fn drop(&mut self) {
        if let Err(e) = self.stream.synchronize() {
            tracing::warn!(
                "link on cuda:{}: waiting for queued transfers before closing: {e}",
                self.ordinal()
            );
        }
    }
}

/// The sending half of a link (rank 0): moves to the sending stage's thread.
pub struct LinkSender {
    rank: Rank,
    peer: usize,
}

/// The receiving half of a link (rank 1): moves to the receiving stage's thread.
pub struct LinkReceiver {
    rank: Rank,
    peer: usize,
}

// The halves move to their stages' threads.
const _: fn() = || {
    fn send<T: Send>() {}
    send::<LinkSender>();
    send::<LinkReceiver>();
};

/// Joins `from` (the sending stage) and `to` (the receiving stage), on two different devices, with
/// a two-rank NCCL communicator on their streams, and checks it by moving one value across (both
/// ranks from this thread, in one NCCL group), which also sets up the pair's connection. Errors:
/// the two backends on one device ([`CudaError::SameDevice`], before NCCL is touched), no loadable
/// libnccl or a failed NCCL call ([`CudaError::Nccl`]).
///
/// Each hand-over is one [`LinkSender::send`] on the sending stage's thread and one
/// [`LinkReceiver::recv`] of the same shape on the receiving stage's: NCCL pairs them in order and
/// cannot check that the shapes agree, and a send or receive without its partner never completes
/// (the stream that holds it stalls). Call each half from its own thread: an NCCL call may wait on
/// the host for its peer to be posted.
pub fn connect(from: &CudaBackend, to: &CudaBackend) -> Result<(LinkSender, LinkReceiver)> {
    let (a, b) = (from.gpu().info().ordinal, to.gpu().info().ordinal);
    if a == b {
        return Err(CudaError::SameDevice(a));
    }
    nccl_library()?;
    let streams = vec![from.gpu().stream().clone(), to.gpu().stream().clone()];
    let comms = nccl_call("ncclCommInitAll", || Comm::from_devices(streams))?;
    let n = comms.len();
    let [c0, c1]: [Comm; 2] = comms.try_into().map_err(|_| {
        CudaError::Nccl(format!(
            "ncclCommInitAll over cuda:{a} and cuda:{b} gave {n} communicators"
        ))
    })?;
    let tx = LinkSender {
        rank: Rank {
            comm: c0,
            stream: from.gpu().stream().clone(),
        },
        peer: b,
    };
    let rx = LinkReceiver {
        rank: Rank {
            comm: c1,
            stream: to.gpu().stream().clone(),
        },
        peer: a,
    };
    check_link(&tx, &rx)?;
    Ok((tx, rx))
}

/// Sends one known value from rank 0 to rank 1 in one NCCL group and reads it back.
fn check_link(tx: &LinkSender, rx: &LinkReceiver) -> Result<()> {
    let (a, b) = tx.ordinals();
    let probe = bf16::from_f32(-1.5);
    let src = tx.rank.stream.clone_htod(&[probe])?;
    let mut dst = rx.rank.stream.alloc_zeros::<bf16>(1)?;
    nccl_call("ncclGroupStart", result::group_start)?;
    let queued = nccl_call("ncclSend", || tx.rank.comm.send(&src, 1))
        .and_then(|()| nccl_call("ncclRecv", || rx.rank.comm.recv(&mut dst, 0).map(drop)));
    // The group is closed whatever happened inside it.
    let ended = nccl_call("ncclGroupEnd", result::group_end);
    queued?;
    ended?;
    let got = rx.rank.stream.clone_dtoh(&dst)?;
    tx.rank.stream.synchronize()?;
    ensure(got[0].to_bits() == probe.to_bits(), "link", || {
        format!(
            "link check cuda:{a} -> cuda:{b}: sent {probe}, received {}",
            got[0]
        )
    })
}

impl LinkSender {
    /// Queues the send of `x`'s `rows·cols` values to the receiving stage on the sending backend's
    /// stream; an empty tensor sends nothing (its partner [`LinkReceiver::recv`] receives nothing).
    /// `x` must be the sending backend's (allocated on its stream), else a shape error; it may be
    /// dropped at once (its memory is freed in stream order, after the send).
    pub fn send(&self, x: &CudaTensor) -> Result<()> {
        let n = x.len();
        let own = Arc::ptr_eq(x.buf.stream(), &self.rank.stream);
        ensure(own, "link_send", || {
            let (on, from) = (x.buf.ordinal(), self.rank.ordinal());
            format!(
                "the tensor is on a stream of cuda:{on}, not the sending backend's (cuda:{from})"
            )
        })?;
        ensure(x.buf.len() >= n, "link_send", || {
            format!(
                "[{}, {}] tensor holds {} values",
                x.rows,
                x.cols,
                x.buf.len()
            )
        })?;
        if n == 0 {
            return Ok(());
        }
        let values = x.buf.slice(..n);
        nccl_call("ncclSend", || self.rank.comm.send(&values, 1))
    }

    /// `(sending device, receiving device)` ordinals.
    pub fn ordinals(&self) -> (usize, usize) {
        (self.rank.ordinal(), self.peer)
    }
}

impl LinkReceiver {
    /// A new `[rows, cols]` tensor on the receiving backend's stream, and the receive of its values
    /// from the sending stage queued there: the stage's next ops on it run after it has arrived. An
    /// empty tensor receives nothing (its partner send sends nothing).
    pub fn recv(&self, rows: usize, cols: usize) -> Result<CudaTensor> {
        let n = rows.checked_mul(cols).ok_or_else(|| CudaError::Shape {
            op: "link_recv",
            msg: format!("[{rows}, {cols}] overflows"),
        })?;
        // SAFETY: the receive below writes all `n` values before any later op on this stream reads
        // them; an empty tensor's one value is never read.
        let mut buf = unsafe { self.rank.stream.alloc::<bf16>(n.max(1)) }?;
        if n > 0 {
            nccl_call("ncclRecv", || self.rank.comm.recv(&mut buf, 0).map(drop))?;
        }
        Ok(CudaTensor { rows, cols, buf })
    }

    /// `(sending device, receiving device)` ordinals.
    pub fn ordinals(&self) -> (usize, usize) {
        (self.peer, self.rank.ordinal())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_numbers_read_both_schemes() {
        assert_eq!(version_string(22105), "2.21.5");
        assert_eq!(version_string(23004), "2.30.4");
        assert_eq!(version_string(2804), "2.8.4");
    }
}
