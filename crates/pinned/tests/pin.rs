//! Pinning in this process and in child processes (this test binary re-run in
//! child mode, see [`child`]).

use std::io::Write;
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use sanmai_pinned::{mem_available, pin, PinError, PinLock, PinRequest};

const MIB: usize = 1 << 20;
const GIB: usize = 1 << 30;

/// Selects child mode; the other `SANMAI_PINNED_*` variables give the request.
const CHILD: &str = "SANMAI_PINNED_CHILD";
/// Exit codes of a child.
const OK: i32 = 0;
const NOT_ENOUGH_RAM: i32 = 10;
const MEMLOCK: i32 = 11;
const OTHER: i32 = 12;

/// The tests here watch this process's locked memory and the machine's
/// `MemAvailable`, so they run one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn now_ms() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis()
}

/// A field of `/proc/self/status` or `/proc/meminfo`, in bytes.
fn proc_kb(file: &str, field: &str) -> usize {
    let text = std::fs::read_to_string(file).unwrap();
    let line = text
        .lines()
        .find(|l| l.starts_with(&format!("{field}:")))
        .unwrap_or_else(|| panic!("no {field} in {file}"));
    let kb: usize = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kb * 1024
}

/// Child mode: pins what the environment asks, prints one line and exits with
/// a code telling the outcome. In a normal test run it returns at once.
#[test]
fn child() {
    if std::env::var_os(CHILD).is_none() {
        return;
    }
    let var = |k: &str| std::env::var(format!("SANMAI_PINNED_{k}")).unwrap();
    let bytes: usize = var("BYTES").parse().unwrap();
    let reserve: usize = var("RESERVE").parse().unwrap();
    let hold = Duration::from_millis(var("HOLD_MS").parse().unwrap());
    let lock_path = var("LOCK");
    if let Ok(limit) = std::env::var("SANMAI_PINNED_MEMLOCK") {
        let limit: libc::rlim_t = limit.parse().unwrap();
        let rl = libc::rlimit {
            rlim_cur: limit,
            rlim_max: limit,
        };
        // SAFETY: `rl` is a valid `rlimit` for the duration of the call.
        assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &rl) }, 0);
    }
    // Written straight to stdout: libtest's capture would drop it at exit.
    let mut out = std::io::stdout().lock();
    let result = pin(&PinRequest {
        bytes,
        what: "the test pool",
        reserve,
        lock_path: Path::new(&lock_path),
    });
    let code = match result {
        Ok(pool) => {
            assert_eq!(pool.len(), bytes);
            assert!(pool.as_slice().iter().step_by(4096).all(|&b| b == 0));
            writeln!(out, "PINNED {bytes} {}", now_ms()).unwrap();
            out.flush().unwrap();
            std::thread::sleep(hold);
            writeln!(out, "RELEASED {}", now_ms()).unwrap();
            drop(pool);
            OK
        }
        Err(e) => {
            let code = match e {
                PinError::NotEnoughRam { .. } => NOT_ENOUGH_RAM,
                PinError::Memlock { .. } => MEMLOCK,
                _ => OTHER,
            };
            writeln!(out, "REFUSED {e}").unwrap();
            code
        }
    };
    out.flush().unwrap();
    std::process::exit(code);
}

/// A child process, killed and reaped if the test fails before waiting for it.
struct Kid(Option<Child>);

impl Kid {
    /// Starts this test binary in child mode, behind `wrapper` (e.g. setpriv).
    fn spawn(wrapper: &[&str], vars: &[(&str, String)]) -> Kid {
        let exe = std::env::current_exe().unwrap();
        let mut cmd = match wrapper {
            [] => Command::new(&exe),
            [program, args @ ..] => {
                let mut cmd = Command::new(program);
                cmd.args(args).arg(&exe);
                cmd
            }
        };
        cmd.args(["--exact", "child", "--nocapture", "--test-threads=1", "-q"])
            .env(CHILD, "1")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        for (k, v) in vars {
            cmd.env(format!("SANMAI_PINNED_{k}"), v);
        }
        Kid(Some(cmd.spawn().unwrap()))
    }

    fn running(&mut self) -> bool {
        self.0.as_mut().unwrap().try_wait().unwrap().is_none()
    }

    fn finish(mut self) -> Report {
        let out = self.0.take().unwrap().wait_with_output().unwrap();
        Report(out)
    }
}

impl Drop for Kid {
    fn drop(&mut self) {
        if let Some(child) = &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

struct Report(Output);

impl Report {
    fn code(&self) -> Option<i32> {
        self.0.status.code()
    }

    fn stdout(&self) -> String {
        String::from_utf8_lossy(&self.0.stdout).into_owned()
    }

    /// The rest of the first line of stdout starting with `tag `.
    fn line(&self, tag: &str) -> Option<String> {
        self.stdout()
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{tag} ")).map(str::to_owned))
    }

    /// When the child had the pool: (pinned, released) in Unix ms.
    fn held(&self) -> (u128, u128) {
        let pinned = self.line("PINNED").expect("no PINNED line");
        let released = self.line("RELEASED").expect("no RELEASED line");
        (
            pinned.split(' ').nth(1).unwrap().parse().unwrap(),
            released.parse().unwrap(),
        )
    }
}

impl std::fmt::Debug for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "exit {:?}\n--- stdout\n{}--- stderr\n{}",
            self.0.status,
            self.stdout(),
            String::from_utf8_lossy(&self.0.stderr)
        )
    }
}

fn request(bytes: usize, reserve: usize, hold_ms: u64, lock: &Path) -> Vec<(&'static str, String)> {
    vec![
        ("BYTES", bytes.to_string()),
        ("RESERVE", reserve.to_string()),
        ("HOLD_MS", hold_ms.to_string()),
        ("LOCK", lock.display().to_string()),
    ]
}

#[test]
fn small_pool_is_pinned_zeroed_and_writable() {
    let _serial = serial();
    if !may_lock(8 * MIB) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let locked_before = proc_kb("/proc/self/status", "VmLck");
    let bytes = 8 * MIB;
    let mut pool = pin(&PinRequest {
        bytes,
        what: "the test pool",
        reserve: 0,
        lock_path: &dir.path().join("pin.lock"),
    })
    .unwrap();
    assert_eq!(pool.len(), bytes);
    assert!(!pool.is_empty());
    assert_eq!(pool.as_ptr() as usize % 4096, 0);
    assert_eq!(pool.as_mut_ptr().cast_const(), pool.as_ptr());
    assert!(
        proc_kb("/proc/self/status", "VmLck") >= locked_before + bytes,
        "the pool is not locked"
    );
    assert!(pool.as_slice().iter().all(|&b| b == 0));

    pool.as_mut_slice()[bytes - 1] = 7;
    assert_eq!(pool.as_slice()[bytes - 1], 7);
    let floats = pool.typed_mut::<f32>().unwrap();
    assert_eq!(floats.len(), bytes / 4);
    for (i, x) in floats.iter_mut().enumerate() {
        *x = i as f32;
    }
    let floats = pool.typed::<f32>().unwrap();
    assert_eq!(floats[12345], 12345.0);
    let halves = pool.typed::<u16>().unwrap();
    assert_eq!(halves.len(), bytes / 2);
    assert_eq!(halves[2 * 3 + 1], (3.0f32.to_bits() >> 16) as u16); // little-endian
    pool.typed_mut::<u16>().unwrap()[0] = 0x3f80; // bf16 1.0
    assert_eq!(pool.typed::<u8>().unwrap()[..2], 0x3f80u16.to_ne_bytes());

    drop(pool);
    assert_eq!(proc_kb("/proc/self/status", "VmLck"), locked_before);

    let empty = pin(&PinRequest {
        bytes: 0,
        what: "the test pool",
        reserve: 0,
        lock_path: &dir.path().join("pin.lock"),
    })
    .unwrap();
    assert!(empty.is_empty());
    assert!(empty.as_slice().is_empty());
    assert_eq!(empty.typed::<f32>().unwrap().len(), 0);
}

#[test]
fn pool_larger_than_the_machine_is_refused() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let bytes = 2 * proc_kb("/proc/meminfo", "MemTotal");
    let reserve = GIB;
    let e = pin(&PinRequest {
        bytes,
        what: "the QSA K/V pool of stage 1",
        reserve,
        lock_path: &dir.path().join("pin.lock"),
    })
    .unwrap_err();
    let PinError::NotEnoughRam {
        need, available, ..
    } = &e
    else {
        panic!("expected NotEnoughRam, got {e}");
    };
    assert_eq!(*need, bytes);
    let m = e.to_string();
    let gib = |b: usize| format!("{:.2} GiB ({b} bytes)", b as f64 / GIB as f64);
    assert!(
        m.starts_with(&format!(
            "cannot pin {} for the QSA K/V pool of stage 1: MemAvailable is {}, \
             and --host-memory-reserve keeps 1.00 GiB (1073741824 bytes) free",
            gib(bytes),
            gib(*available)
        )),
        "{m}"
    );
    // Nothing was mapped: this process never grew by the pool's size.
    assert!(proc_kb("/proc/self/status", "VmPeak") < bytes);
}

/// Whether this process has CAP_IPC_LOCK (bit 14) in its effective set.
fn has_cap_ipc_lock() -> bool {
    let text = std::fs::read_to_string("/proc/self/status").unwrap();
    let hex = text
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .unwrap()
        .trim();
    u64::from_str_radix(hex, 16).unwrap() & (1 << 14) != 0
}

/// Whether this process may lock `bytes` more: it has CAP_IPC_LOCK, or its
/// memlock limit allows it. Prints a skip reason when not.
fn may_lock(bytes: usize) -> bool {
    if has_cap_ipc_lock() {
        return true;
    }
    let mut rl = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `rl` is a valid, writable `rlimit` for the duration of the call.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut rl) }, 0);
    let locked = proc_kb("/proc/self/status", "VmLck") as u64;
    if rl.rlim_cur == libc::RLIM_INFINITY || rl.rlim_cur >= locked + bytes as u64 {
        return true;
    }
    eprintln!(
        "skipped: no CAP_IPC_LOCK and the memlock limit ({} bytes) is under {bytes} bytes",
        rl.rlim_cur
    );
    false
}

#[test]
fn small_memlock_limit_is_reported() {
    let _serial = serial();
    const DROP_IPC_LOCK: [&str; 3] = [
        "setpriv",
        "--inh-caps=-ipc_lock",
        "--bounding-set=-ipc_lock",
    ];
    // The limit does not bind a process with CAP_IPC_LOCK (e.g. root): drop it.
    let wrapper: &[&str] = if has_cap_ipc_lock() {
        let works = Command::new(DROP_IPC_LOCK[0])
            .args(&DROP_IPC_LOCK[1..])
            .arg("true")
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !works {
            eprintln!("skipped: this process has CAP_IPC_LOCK and `setpriv` cannot drop it");
            return;
        }
        &DROP_IPC_LOCK
    } else {
        &[]
    };
    let dir = tempfile::tempdir().unwrap();
    let mut vars = request(64 * MIB, 0, 0, &dir.path().join("pin.lock"));
    vars.push(("MEMLOCK", "65536".into()));
    let out = Kid::spawn(wrapper, &vars).finish();
    assert_eq!(out.code(), Some(MEMLOCK), "{out:?}");
    let m = out.line("REFUSED").unwrap();
    for part in [
        "cannot pin 0.06 GiB (67108864 bytes) for the test pool: mlock failed",
        "memlock limit (soft RLIMIT_MEMLOCK) of 0.00 GiB (65536 bytes)",
        "`ulimit -l unlimited`",
        "CAP_IPC_LOCK",
    ] {
        assert!(m.contains(part), "{part:?} missing from {m:?}");
    }
}

#[test]
fn lock_serialises_pinning() {
    let _serial = serial();
    if !may_lock(MIB) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("pin.lock");
    let lock = PinLock::acquire(&path).unwrap();
    let mut kid = Kid::spawn(&[], &request(MIB, 0, 0, &path));
    std::thread::sleep(Duration::from_millis(300));
    assert!(kid.running(), "the child pinned while the lock was held");
    let released = now_ms();
    drop(lock);
    let out = kid.finish();
    assert_eq!(out.code(), Some(OK), "{out:?}");
    assert!(out.held().0 >= released, "{out:?}");
}

#[test]
fn two_pools_that_fit_are_both_pinned() {
    let _serial = serial();
    if !may_lock(256 * MIB) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let vars = request(256 * MIB, 0, 1000, &dir.path().join("pin.lock"));
    let kids = [Kid::spawn(&[], &vars), Kid::spawn(&[], &vars)];
    let [a, b] = kids.map(Kid::finish);
    assert_eq!(a.code(), Some(OK), "{a:?}");
    assert_eq!(b.code(), Some(OK), "{b:?}");
    let ((a0, a1), (b0, b1)) = (a.held(), b.held());
    assert!(a0.max(b0) < a1.min(b1), "the pools were not held at once");
}

#[test]
fn only_one_of_two_pools_fits() {
    let _serial = serial();
    if !may_lock(GIB) {
        return;
    }
    let available = mem_available().unwrap();
    if available < 3 * GIB {
        eprintln!(
            "skipped: MemAvailable is {:.2} GiB, under the 3 GiB this test needs",
            available as f64 / GIB as f64
        );
        return;
    }
    // Either pool fits with 0.5 GiB to spare; after one is pinned the other
    // misses by 0.5 GiB.
    let pool = GIB;
    let reserve = available.saturating_sub(3 * GIB / 2);
    let dir = tempfile::tempdir().unwrap();
    let vars = request(pool, reserve, 2000, &dir.path().join("pin.lock"));
    let start = Instant::now();
    let kids = [Kid::spawn(&[], &vars), Kid::spawn(&[], &vars)];
    let mut reports = kids.map(Kid::finish);
    reports.sort_by_key(|r| r.code());
    let [won, lost] = reports;
    assert_eq!(won.code(), Some(OK), "{won:?}\n{lost:?}");
    assert_eq!(lost.code(), Some(NOT_ENOUGH_RAM), "{won:?}\n{lost:?}");
    let m = lost.line("REFUSED").unwrap();
    for part in [
        "cannot pin 1.00 GiB (1073741824 bytes) for the test pool: MemAvailable is ".to_owned(),
        format!(
            "--host-memory-reserve keeps {:.2} GiB ({reserve} bytes) free",
            reserve as f64 / GIB as f64
        ),
    ] {
        assert!(m.contains(&part), "{part:?} missing from {m:?}");
    }
    assert!(start.elapsed() < Duration::from_secs(10));
}
