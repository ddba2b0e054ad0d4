//! The NCCL link between two pipeline stages (`sanmai_cuda::link`).
//!
//! - Everywhere: `nccl_library` names the NCCL it loaded, or fails with a message that names the
//!   library and how to install it.
//! - With one GPU or more: a link between two backends on one device is refused.
//! - With two GPUs or more and NCCL: tensors of known bf16 values, several shapes (an empty one and
//!   a 512 × 16384 one among them), go from a backend on cuda:0 to one on cuda:1, the sender and
//!   the receiver each on its own thread, and arrive bit for bit.
//!
//! Without a GPU (or a second one, or NCCL) each test prints `skipped: <test>: <reason>` and
//! passes, unless `SANMAI_REQUIRE_NCCL=1` (set it where NCCL is installed: a missing libnccl is
//! then a failure).

#[path = "support/options.rs"]
mod options;

use half::bf16;
use sanmai_cuda::link::{self, NcclInfo};
use sanmai_cuda::{CudaBackend, CudaError, CudaTensor};

fn backend(test: &str, ordinal: usize) -> Option<CudaBackend> {
    match CudaBackend::new(ordinal, &options::cuda_options()) {
        Ok(b) => Some(b),
        Err(e) => {
            eprintln!("skipped: {test}: {e}");
            None
        }
    }
}

/// The loaded NCCL, or `None` (printed as the test's skip) when there is none and
/// `SANMAI_REQUIRE_NCCL` is not `1`.
fn nccl(test: &str) -> Option<NcclInfo> {
    match link::nccl_library() {
        Ok(info) => Some(info),
        Err(e) => {
            assert!(
                std::env::var_os("SANMAI_REQUIRE_NCCL").is_none_or(|v| v != "1"),
                "SANMAI_REQUIRE_NCCL=1 but NCCL is not usable: {e}"
            );
            eprintln!("skipped: {test}: {e}");
            None
        }
    }
}

#[test]
fn nccl_library_names_its_version_or_how_to_install_it() {
    match link::nccl_library() {
        Ok(info) => {
            println!(
                "NCCL {} (code {}) from {:?}",
                info.version, info.code, info.library
            );
            let parts: Vec<u32> = info
                .version
                .split('.')
                .map(|p| p.parse().expect("a numeric version part"))
                .collect();
            assert_eq!(parts.len(), 3, "version {:?}", info.version);
            assert_eq!(parts[0], 2, "NCCL 2 expected, found {}", info.version);
            assert!(info.code >= 2000, "code {}", info.code);
            if let Some(path) = &info.library {
                let name = path.file_name().unwrap().to_string_lossy();
                assert!(name.starts_with("libnccl.so"), "mapped file {path:?}");
            }
        }
        Err(e) => {
            assert!(
                std::env::var_os("SANMAI_REQUIRE_NCCL").is_none_or(|v| v != "1"),
                "SANMAI_REQUIRE_NCCL=1 but NCCL is not usable: {e}"
            );
            assert!(matches!(e, CudaError::Nccl(_)), "{e:?}");
            let msg = e.to_string();
            println!("no NCCL here: {msg}");
            for needle in [
                "libnccl.so.2",
                "libnccl.so",
                "libnccl2",
                "nvidia-nccl-cu13",
                "LD_LIBRARY_PATH",
            ] {
                assert!(msg.contains(needle), "{needle:?} not in: {msg}");
            }
        }
    }
    // Later calls answer from the first load.
    assert_eq!(
        link::nccl_library().map_err(|e| e.to_string()),
        link::nccl_library().map_err(|e| e.to_string())
    );
}

#[test]
fn a_link_on_one_device_is_refused() {
    let test = "a_link_on_one_device_is_refused";
    let Some(a) = backend(test, 0) else { return };
    let Some(b) = backend(test, 0) else { return };
    for (from, to) in [(&a, &b), (&a, &a)] {
        match link::connect(from, to) {
            Err(e @ CudaError::SameDevice(0)) => {
                let msg = e.to_string();
                assert!(
                    msg.contains("cuda:0") && msg.contains("device copy"),
                    "{msg}"
                );
            }
            Err(e) => panic!("expected the same-device refusal, got {e}"),
            Ok(_) => panic!("a link on one device was accepted"),
        }
    }
}

/// `n` bf16 values from `seed`: every finite bit pattern may occur (both signs, zeros, subnormals),
/// never an infinity or NaN, so the f32 upload rounds none of them.
fn values(seed: u64, n: usize) -> Vec<bf16> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            s ^= s >> 12;
            s ^= s << 25;
            s ^= s >> 27;
            let bits = (s.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 48) as u16;
            // An all-ones exponent (infinity, NaN) loses its top exponent bit.
            let bits = if bits & 0x7f80 == 0x7f80 {
                bits & !0x4000
            } else {
                bits
            };
            bf16::from_bits(bits)
        })
        .collect()
}

/// A `[rows, cols]` tensor of [`values`] on `b`.
fn tensor(b: &CudaBackend, seed: u64, rows: usize, cols: usize) -> CudaTensor {
    let host: Vec<f32> = values(seed, rows * cols)
        .iter()
        .map(|v| v.to_f32())
        .collect();
    b.tensor_from_host(rows, cols, &host).unwrap()
}

/// The bits of `x`'s values.
fn bits(b: &CudaBackend, x: &CudaTensor) -> Vec<u16> {
    let all = b.gpu().download(x.buf()).unwrap();
    all[..x.rows * x.cols].iter().map(|v| v.to_bits()).collect()
}

/// Shapes handed over one after another on one link: one value, an odd one, an empty one, a few
/// rows of a hidden state, and a 512-row prefill chunk of width 16384 (16 MiB).
const SHAPES: [(usize, usize); 6] = [(1, 1), (7, 5), (0, 4096), (3, 4096), (0, 0), (512, 16384)];

#[test]
fn tensors_cross_a_link_bit_for_bit() {
    let test = "tensors_cross_a_link_bit_for_bit";
    let n = sanmai_cuda::device_count();
    if n < 2 {
        eprintln!("skipped: {test}: {n} CUDA device(s), a link needs 2");
        return;
    }
    let Some(info) = nccl(test) else { return };
    println!("NCCL {} from {:?}", info.version, info.library);
    let Some(b0) = backend(test, 0) else { return };
    let Some(b1) = backend(test, 1) else { return };
    let (tx, rx) = link::connect(&b0, &b1).unwrap();
    assert_eq!(tx.ordinals(), (0, 1));
    assert_eq!(rx.ordinals(), (0, 1));

    // A tensor of the receiving backend is not the sender's to send.
    let foreign = tensor(&b1, 99, 2, 3);
    match tx.send(&foreign) {
        Err(CudaError::Shape {
            op: "link_send",
            msg,
        }) => {
            assert!(msg.contains("cuda:1") && msg.contains("cuda:0"), "{msg}")
        }
        other => panic!("a foreign tensor was sent: {:?}", other.err()),
    }

    // Each stage on its own thread: every tensor is queued and dropped at once on the sending side
    // (its memory freed in stream order after the send); the receiving side reads each back.
    let received = std::thread::scope(|s| {
        let (b0, b1) = (&b0, &b1);
        let sender = s.spawn(move || {
            for (i, &(rows, cols)) in SHAPES.iter().enumerate() {
                tx.send(&tensor(b0, i as u64, rows, cols)).unwrap();
            }
            b0.gpu().synchronize().unwrap();
        });
        let receiver = s.spawn(move || {
            SHAPES
                .iter()
                .map(|&(rows, cols)| {
                    let x = rx.recv(rows, cols).unwrap();
                    assert_eq!((x.rows, x.cols), (rows, cols));
                    bits(b1, &x)
                })
                .collect::<Vec<_>>()
        });
        sender.join().unwrap();
        receiver.join().unwrap()
    });
    for (i, (&(rows, cols), got)) in SHAPES.iter().zip(&received).enumerate() {
        let want: Vec<u16> = values(i as u64, rows * cols)
            .iter()
            .map(|v| v.to_bits())
            .collect();
        assert_eq!(got.len(), want.len(), "[{rows}, {cols}]");
        let first_diff = got.iter().zip(&want).position(|(g, w)| g != w);
        assert_eq!(first_diff, None, "[{rows}, {cols}]: values differ");
        println!("LINK cuda:0 -> cuda:1 [{rows}, {cols}] bit-identical");
    }
}
