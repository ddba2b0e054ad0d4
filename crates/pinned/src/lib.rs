//! Host memory pools for caches kept out of VRAM.
//!
//! The K and V rows of sparse-attention (QSA) layers live in host RAM that the
//! GPU reads through UVA. A [`HostPool`] is one anonymous mapping of exactly the
//! size asked for, locked into RAM with `mlock` (the CUDA backend then registers
//! it with `cuMemHostRegister`), and it lives as long as its owner. [`pin`] takes
//! a file lock ([`PinLock`]) and checks `MemAvailable` first, so that pipeline
//! stages pinning at once (threads or processes) cannot all pass the check and
//! then run out of memory together.

use std::fmt;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::time::Instant;

use memmap2::MmapMut;
use tracing::info;

/// What to pin, and under which rules.
#[derive(Debug, Clone, Copy)]
pub struct PinRequest<'a> {
    /// The exact size of the pool in bytes (no rounding up).
    pub bytes: usize,
    /// What the pool is for, e.g. "the QSA K/V pool of stage 1"; used in messages.
    pub what: &'a str,
    /// Bytes of RAM to leave available after pinning (they serve the page cache,
    /// e.g. of the PLE table); the operator flag `--host-memory-reserve`.
    pub reserve: usize,
    /// The lock file that serialises pinning; created if missing.
    pub lock_path: &'a Path,
}

/// Why a pool could not be pinned. Each message is one line naming the flag or
/// limit involved, with the numbers.
#[derive(Debug, thiserror::Error)]
pub enum PinError {
    /// `bytes + reserve` is more than `MemAvailable`; nothing was mapped.
    #[error(
        "cannot pin {} for {what}: MemAvailable is {}, and --host-memory-reserve keeps {} free; \
         free host RAM or lower --host-memory-reserve",
        size(*need as u64),
        size(*available as u64),
        size(*reserve as u64)
    )]
    NotEnoughRam {
        /// What the pool was for.
        what: String,
        /// The size of the pool in bytes.
        need: usize,
        /// `MemAvailable` in bytes, read under the lock.
        available: usize,
        /// The reserve in bytes (`--host-memory-reserve`).
        reserve: usize,
    },
    /// `mlock` refused to lock the pool.
    #[error("{}", memlock_message(what, *need, *limit, *cap_ipc_lock, source))]
    Memlock {
        /// What the pool was for.
        what: String,
        /// The size of the pool in bytes.
        need: usize,
        /// The soft `RLIMIT_MEMLOCK` in bytes, `None` when unlimited.
        limit: Option<u64>,
        /// Whether the process had CAP_IPC_LOCK, which lifts the limit.
        cap_ipc_lock: bool,
        /// The error `mlock` returned.
        source: io::Error,
    },
    /// The lock file could not be opened or locked.
    #[error("cannot take the pin lock {}: {source}", path.display())]
    Lock {
        /// The lock file.
        path: PathBuf,
        /// The error from `open` or `flock`.
        source: io::Error,
    },
    /// The anonymous mapping failed.
    #[error("cannot map {} of host memory for {what}: {source}", size(*need as u64))]
    Map {
        /// What the pool was for.
        what: String,
        /// The size of the pool in bytes.
        need: usize,
        /// The error from `mmap`.
        source: io::Error,
    },
    /// `MemAvailable` could not be read from `/proc/meminfo`.
    #[error("cannot read MemAvailable from /proc/meminfo: {0}")]
    Meminfo(String),
}

const GIB: f64 = (1u64 << 30) as f64;

/// "12.00 GiB (12884901888 bytes)".
fn size(bytes: u64) -> String {
    format!("{:.2} GiB ({bytes} bytes)", bytes as f64 / GIB)
}

fn memlock_message(
    what: &str,
    need: usize,
    limit: Option<u64>,
    cap_ipc_lock: bool,
    source: &io::Error,
) -> String {
    let head = format!(
        "cannot pin {} for {what}: mlock failed ({source})",
        size(need as u64)
    );
    match limit {
        _ if cap_ipc_lock => format!(
            "{head} although CAP_IPC_LOCK lifts the memlock limit (RLIMIT_MEMLOCK); the kernel or \
             a cgroup memory limit would not lock that much RAM"
        ),
        Some(limit) => {
            let counts = if limit >= need as u64 {
                ", which counts all memory this process has locked"
            } else {
                ""
            };
            format!(
                "{head} under the memlock limit (soft RLIMIT_MEMLOCK) of {}{counts}; raise it with \
                 `ulimit -l unlimited`, `--ulimit memlock=-1` for a container, or grant CAP_IPC_LOCK",
                size(limit)
            )
        }
        None => format!(
            "{head} although the memlock limit (RLIMIT_MEMLOCK) is unlimited; the kernel or a \
             cgroup memory limit would not lock that much RAM"
        ),
    }
}

/// The soft `RLIMIT_MEMLOCK` in bytes; `None` when unlimited or unreadable.
fn memlock_limit() -> Option<u64> {
    let mut rl = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `rl` is a valid, writable `rlimit` for the duration of the call.
    let r = unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut rl) };
    (r == 0 && rl.rlim_cur != libc::RLIM_INFINITY).then_some(rl.rlim_cur)
}

/// Whether the calling thread has CAP_IPC_LOCK (bit 14 of `CapEff`).
fn has_cap_ipc_lock() -> bool {
    let text = std::fs::read_to_string("/proc/thread-self/status")
        .or_else(|_| std::fs::read_to_string("/proc/self/status"))
        .unwrap_or_default();
    text.lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
        .is_some_and(|caps| caps & (1 << 14) != 0)
}

/// `MemAvailable` from `/proc/meminfo`, in bytes.
pub fn mem_available() -> Result<usize, PinError> {
    let text =
        std::fs::read_to_string("/proc/meminfo").map_err(|e| PinError::Meminfo(e.to_string()))?;
    parse_meminfo(&text, "MemAvailable")
}

/// The value of `field` (in kB in the file) from the text of `/proc/meminfo`, in bytes.
fn parse_meminfo(text: &str, field: &str) -> Result<usize, PinError> {
    let line = text
        .lines()
        .find(|l| l.split(':').next() == Some(field))
        .ok_or_else(|| PinError::Meminfo(format!("no {field} line")))?;
    let bad = || PinError::Meminfo(format!("cannot parse the line {line:?}"));
    let mut words = line[field.len() + 1..].split_whitespace();
    let value: usize = words.next().and_then(|v| v.parse().ok()).ok_or_else(bad)?;
    let unit = match words.next() {
        None => 1,
        Some("kB") => 1024,
        Some(_) => return Err(bad()),
    };
    value.checked_mul(unit).ok_or_else(bad)
}

/// An exclusive `flock` on a lock file that serialises pinning across threads
/// and processes; released on drop.
///
/// Each [`PinLock`] opens the file afresh, so two locks on the same path
/// exclude each other even within one process.
#[derive(Debug)]
pub struct PinLock {
    file: File,
    path: PathBuf,
}

impl PinLock {
    /// Takes the lock, waiting as long as another holder keeps it (logged at
    /// info when it has to wait). Creates the file if it is missing.
    pub fn acquire(path: &Path) -> Result<PinLock, PinError> {
        Self::acquire_for(path, "host memory")
    }

    /// Takes the lock if it is free, `Ok(None)` if another holder has it.
    pub fn try_acquire(path: &Path) -> Result<Option<PinLock>, PinError> {
        let file = open_lock_file(path)?;
        match flock(&file, libc::LOCK_EX | libc::LOCK_NB) {
            Ok(()) => Ok(Some(PinLock {
                file,
                path: path.to_owned(),
            })),
            Err(e) if e.raw_os_error() == Some(libc::EWOULDBLOCK) => Ok(None),
            Err(source) => Err(PinError::Lock {
                path: path.to_owned(),
                source,
            }),
        }
    }

    /// The lock file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn acquire_for(path: &Path, what: &str) -> Result<PinLock, PinError> {
        if let Some(lock) = Self::try_acquire(path)? {
            return Ok(lock);
        }
        info!(
            "waiting for the pin lock {} to pin {what}: another stage or process is pinning host memory",
            path.display()
        );
        let start = Instant::now();
        let file = open_lock_file(path)?;
        flock(&file, libc::LOCK_EX).map_err(|source| PinError::Lock {
            path: path.to_owned(),
            source,
        })?;
        info!(
            "took the pin lock {} after {:.2} s",
            path.display(),
            start.elapsed().as_secs_f64()
        );
        Ok(PinLock {
            file,
            path: path.to_owned(),
        })
    }
}

impl Drop for PinLock {
    fn drop(&mut self) {
        // Closing the file releases the lock too; unlocking first makes it explicit.
        let _ = flock(&self.file, libc::LOCK_UN);
    }
}

/// Opens (creating if needed) the lock file; read-only if another user owns it
/// (`flock` works on a read-only descriptor).
fn open_lock_file(path: &Path) -> Result<File, PinError> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o666)
        .open(path)
        .or_else(|e| match e.kind() {
            io::ErrorKind::PermissionDenied => File::open(path),
            _ => Err(e),
        })
        .map_err(|source| PinError::Lock {
            path: path.to_owned(),
            source,
        })
}

fn flock(file: &File, op: libc::c_int) -> io::Result<()> {
    loop {
        // SAFETY: the descriptor is open for the lifetime of `file`; flock takes no pointers.
        if unsafe { libc::flock(file.as_raw_fd(), op) } == 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Pins a pool: under the lock at `req.lock_path`, checks that `MemAvailable`
/// covers `req.bytes + req.reserve`, maps exactly `req.bytes` of anonymous
/// memory and locks it into RAM with `mlock` (which faults the pages in, so the
/// next pinner's `MemAvailable` already sees them), then releases the lock.
///
/// The pool is zeroed. `req.bytes == 0` gives an empty pool without a mapping
/// or the lock.
pub fn pin(req: &PinRequest<'_>) -> Result<HostPool, PinError> {
    if req.bytes == 0 {
        return Ok(HostPool { map: None });
    }
    let lock = PinLock::acquire_for(req.lock_path, req.what)?;
    let available = mem_available()?;
    if req.bytes.saturating_add(req.reserve) > available {
        return Err(PinError::NotEnoughRam {
            what: req.what.to_owned(),
            need: req.bytes,
            available,
            reserve: req.reserve,
        });
    }
    let map = MmapMut::map_anon(req.bytes).map_err(|source| PinError::Map {
        what: req.what.to_owned(),
        need: req.bytes,
        source,
    })?;
    // SAFETY: the range is exactly the live mapping `map` owns; mlock does not
    // touch its contents.
    if unsafe { libc::mlock(map.as_ptr().cast(), map.len()) } != 0 {
        let source = io::Error::last_os_error();
        return Err(PinError::Memlock {
            what: req.what.to_owned(),
            need: req.bytes,
            limit: memlock_limit(),
            cap_ipc_lock: has_cap_ipc_lock(),
            source,
        });
    }
    drop(lock);
    info!(
        "pinned {:.2} GiB for {} (MemAvailable was {:.2} GiB)",
        req.bytes as f64 / GIB,
        req.what,
        available as f64 / GIB
    );
    Ok(HostPool { map: Some(map) })
}

/// A pool of host memory locked into RAM; unlocked and unmapped on drop.
///
/// The memory starts zeroed and is page-aligned. A pool of zero bytes has no
/// mapping.
pub struct HostPool {
    map: Option<MmapMut>,
}

impl fmt::Debug for HostPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostPool")
            .field("ptr", &self.as_ptr())
            .field("len", &self.len())
            .finish()
    }
}

impl HostPool {
    /// The size in bytes, exactly as requested.
    pub fn len(&self) -> usize {
        self.map.as_ref().map_or(0, |m| m.len())
    }

    /// Whether the pool has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The start of the pool (page-aligned; dangling when empty).
    pub fn as_ptr(&self) -> *const u8 {
        self.map
            .as_ref()
            .map_or(NonNull::dangling().as_ptr(), |m| m.as_ptr())
    }

    /// The start of the pool, writable (page-aligned; dangling when empty).
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.map
            .as_mut()
            .map_or(NonNull::dangling().as_ptr(), |m| m.as_mut_ptr())
    }

    /// The pool as bytes.
    pub fn as_slice(&self) -> &[u8] {
        self.map.as_deref().unwrap_or(&[])
    }

    /// The pool as writable bytes.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        self.map.as_deref_mut().unwrap_or(&mut [])
    }

    /// The pool as elements of `T` (`f32` for the CPU backend, `u16` bf16 bits
    /// for CUDA); `None` if the size is not a multiple of `T`'s.
    pub fn typed<T: PoolElem>(&self) -> Option<&[T]> {
        let bytes = self.as_slice();
        let n = elems::<T>(bytes.as_ptr(), bytes.len())?;
        // SAFETY: `elems` checked that the pointer is aligned for `T` (or that
        // the slice is empty) and that `n` elements fill exactly `bytes`; every
        // bit pattern is a valid `T` (sealed to plain numbers); the borrow of
        // `self` keeps the memory alive and unaliased by writers.
        Some(unsafe { std::slice::from_raw_parts(ptr_or_dangling(bytes.as_ptr(), n), n) })
    }

    /// The pool as writable elements of `T`; `None` if the size is not a
    /// multiple of `T`'s.
    pub fn typed_mut<T: PoolElem>(&mut self) -> Option<&mut [T]> {
        let bytes = self.as_mut_slice();
        let n = elems::<T>(bytes.as_ptr(), bytes.len())?;
        let ptr = ptr_or_dangling::<T>(bytes.as_mut_ptr(), n).cast_mut();
        // SAFETY: as in `typed`; the exclusive borrow of `self` makes this the
        // only reference to the memory, and any bit pattern written through a
        // `T` is valid as bytes.
        Some(unsafe { std::slice::from_raw_parts_mut(ptr, n) })
    }
}

/// How many `T` fill `len` bytes at `ptr`; `None` if misaligned or not a multiple.
fn elems<T: PoolElem>(ptr: *const u8, len: usize) -> Option<usize> {
    let size = std::mem::size_of::<T>();
    if !len.is_multiple_of(size) || (len != 0 && !ptr.cast::<T>().is_aligned()) {
        return None;
    }
    Some(len / size)
}

/// `ptr` as `*const T`, or a dangling aligned pointer for an empty view.
fn ptr_or_dangling<T: PoolElem>(ptr: *const u8, n: usize) -> *const T {
    if n == 0 {
        NonNull::<T>::dangling().as_ptr()
    } else {
        ptr.cast()
    }
}

impl Drop for HostPool {
    fn drop(&mut self) {
        if let Some(map) = &self.map {
            // SAFETY: the range is exactly the live mapping; munlock does not
            // touch its contents. Unmapping (when `map` drops) would unlock it
            // too.
            unsafe { libc::munlock(map.as_ptr().cast(), map.len()) };
        }
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for u8 {}
    impl Sealed for u16 {}
    impl Sealed for f32 {}
}

/// Element types a [`HostPool`] can be viewed as: plain numbers for which every
/// bit pattern is valid (`u8`, `u16` for bf16/f16 bits, `f32`). Sealed.
pub trait PoolElem: sealed::Sealed + Copy + 'static {}
impl PoolElem for u8 {}
impl PoolElem for u16 {}
impl PoolElem for f32 {}

#[cfg(test)]
mod tests {
    use super::*;

    fn lock_dir() -> tempfile::TempDir {
        tempfile::tempdir().unwrap()
    }

    #[test]
    fn parses_meminfo() {
        let text =
            "MemTotal:       24683584 kB\nMemFree:        1000 kB\nMemAvailable:   24312248 kB\n";
        assert_eq!(
            parse_meminfo(text, "MemAvailable").unwrap(),
            24312248 * 1024
        );
        assert_eq!(parse_meminfo(text, "MemTotal").unwrap(), 24683584 * 1024);
        assert!(matches!(
            parse_meminfo("MemFree: 1 kB\n", "MemAvailable"),
            Err(PinError::Meminfo(_))
        ));
        assert!(matches!(
            parse_meminfo("MemAvailable: x kB\n", "MemAvailable"),
            Err(PinError::Meminfo(_))
        ));
        assert!(mem_available().unwrap() > 0);
    }

    #[test]
    fn not_enough_ram_message() {
        let e = PinError::NotEnoughRam {
            what: "the QSA K/V pool of stage 1".into(),
            need: 12 << 30,
            available: 10 * (1 << 30) + (1 << 29),
            reserve: 2 << 30,
        };
        assert_eq!(
            e.to_string(),
            "cannot pin 12.00 GiB (12884901888 bytes) for the QSA K/V pool of stage 1: \
             MemAvailable is 10.50 GiB (11274289152 bytes), and --host-memory-reserve keeps \
             2.00 GiB (2147483648 bytes) free; free host RAM or lower --host-memory-reserve"
        );
    }

    #[test]
    fn memlock_message_names_the_limit_and_the_fix() {
        let e = PinError::Memlock {
            what: "the QSA K/V pool of stage 0".into(),
            need: 64 << 20,
            limit: Some(65536),
            cap_ipc_lock: false,
            source: io::Error::from_raw_os_error(libc::ENOMEM),
        };
        let m = e.to_string();
        assert!(m.starts_with("cannot pin 0.06 GiB (67108864 bytes) for the QSA K/V pool of stage 0: mlock failed"), "{m}");
        assert!(
            m.contains("memlock limit (soft RLIMIT_MEMLOCK) of 0.00 GiB (65536 bytes)"),
            "{m}"
        );
        assert!(m.contains("`ulimit -l unlimited`, `--ulimit memlock=-1` for a container, or grant CAP_IPC_LOCK"), "{m}");
        assert!(!m.contains('\n'));
        let e = PinError::Memlock {
            what: "x".into(),
            need: 1 << 30,
            limit: None,
            cap_ipc_lock: false,
            source: io::Error::from_raw_os_error(libc::ENOMEM),
        };
        assert!(e.to_string().contains("RLIMIT_MEMLOCK) is unlimited"));
        let e = PinError::Memlock {
            what: "x".into(),
            need: 1 << 30,
            limit: Some(8 << 20),
            cap_ipc_lock: true,
            source: io::Error::from_raw_os_error(libc::ENOMEM),
        };
        let m = e.to_string();
        assert!(
            m.contains("although CAP_IPC_LOCK lifts the memlock limit"),
            "{m}"
        );
        assert!(!m.contains("ulimit"), "{m}");
    }

    #[test]
    fn overflowing_request_is_refused() {
        let dir = lock_dir();
        let e = pin(&PinRequest {
            bytes: usize::MAX / 2,
            what: "test",
            reserve: usize::MAX,
            lock_path: &dir.path().join("lock"),
        })
        .unwrap_err();
        assert!(matches!(e, PinError::NotEnoughRam { .. }), "{e}");
    }

    #[test]
    fn empty_pool() {
        let dir = lock_dir();
        let mut pool = pin(&PinRequest {
            bytes: 0,
            what: "test",
            reserve: 0,
            lock_path: &dir.path().join("lock"),
        })
        .unwrap();
        assert!(pool.is_empty());
        assert_eq!(pool.as_slice(), &[] as &[u8]);
        assert!(pool.as_mut_slice().is_empty());
        assert_eq!(pool.typed::<f32>(), Some(&[][..]));
        assert_eq!(pool.typed_mut::<u16>().map(|s| s.len()), Some(0));
        // The empty pool takes no lock, so the lock file is not even created.
        assert!(!dir.path().join("lock").exists());
    }

    #[test]
    fn typed_views_check_the_size() {
        let dir = lock_dir();
        let mut pool = pin(&PinRequest {
            bytes: 6,
            what: "test",
            reserve: 0,
            lock_path: &dir.path().join("lock"),
        })
        .unwrap();
        assert_eq!(pool.len(), 6);
        assert!(pool.typed::<f32>().is_none());
        assert!(pool.typed_mut::<f32>().is_none());
        assert_eq!(pool.typed::<u16>().unwrap(), &[0, 0, 0]);
        pool.typed_mut::<u16>().unwrap()[1] = 0xABCD;
        let mut expect = [0u8; 6];
        expect[2..4].copy_from_slice(&0xABCDu16.to_ne_bytes());
        assert_eq!(pool.as_slice(), &expect);
        assert_eq!(pool.typed::<u8>().unwrap().len(), 6);
    }

    #[test]
    fn lock_excludes_a_second_holder_in_the_same_process() {
        let dir = lock_dir();
        let path = dir.path().join("lock");
        let first = PinLock::acquire(&path).unwrap();
        assert_eq!(first.path(), path);
        assert!(PinLock::try_acquire(&path).unwrap().is_none());
        drop(first);
        let again = PinLock::try_acquire(&path).unwrap();
        assert!(again.is_some());
    }

    #[test]
    fn lock_error_names_the_path() {
        let e = PinLock::acquire(Path::new("/nonexistent-dir/sanmai-pin.lock")).unwrap_err();
        assert!(matches!(e, PinError::Lock { .. }));
        assert!(
            e.to_string()
                .starts_with("cannot take the pin lock /nonexistent-dir/sanmai-pin.lock: "),
            "{e}"
        );
    }

    #[test]
    fn pool_is_send_and_sync() {
        fn check<T: Send + Sync>() {}
        check::<HostPool>();
        check::<PinLock>();
    }
}
