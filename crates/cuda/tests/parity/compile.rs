//! Every kernel source compiles with NVRTC for sm_86 (RTX 3090) and sm_90 (H100/H200). Needs only
//! libnvrtc and the CUDA headers, no GPU; skipped with the reason when either is missing, unless
//! `SANMAI_REQUIRE_NVRTC=1` (CI sets it after installing NVRTC: a skip there is a failure).

use sanmai_cuda::{nvrtc, registry};

#[test]
fn every_kernel_compiles_for_sm86_and_sm90() {
    let include = match nvrtc::nvrtc_version()
        .and_then(|_| nvrtc::cuda_include_dir(&crate::options::compile_options().include_dirs))
    {
        Ok(dir) => dir,
        Err(e) => {
            assert!(
                std::env::var_os("SANMAI_REQUIRE_NVRTC").is_none_or(|v| v != "1"),
                "SANMAI_REQUIRE_NVRTC=1 but NVRTC is not usable: {e}"
            );
            eprintln!("skipped: every_kernel_compiles_for_sm86_and_sm90: {e}");
            return;
        }
    };
    // Every (architecture, source) pair, compiled by as many workers as the machine has cores (NVRTC
    // compiles programs concurrently, as `registry::compile_all` does), then checked in order.
    let jobs: Vec<(&str, &nvrtc::Source)> = ["sm_86", "sm_90"]
        .into_iter()
        .flat_map(|arch| registry::SOURCES.iter().map(move |src| (arch, src)))
        .collect();
    let next = std::sync::atomic::AtomicUsize::new(0);
    let workers = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut done: Vec<(usize, Vec<u8>, f32)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..workers.min(jobs.len()))
            .map(|_| {
                s.spawn(|| {
                    let mut out = Vec::new();
                    loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some(&(arch, src)) = jobs.get(i) else {
                            return out;
                        };
                        let t0 = std::time::Instant::now();
                        let cubin = nvrtc::compile_cubin(
                            src,
                            registry::HEADERS,
                            arch,
                            std::slice::from_ref(&include),
                        )
                        .unwrap_or_else(|e| panic!("{} for {arch}: {e}", src.name));
                        out.push((i, cubin, t0.elapsed().as_secs_f32()));
                    }
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().expect("a compile worker panicked"))
            .collect()
    });
    done.sort_by_key(|(i, _, _)| *i);
    assert_eq!(done.len(), jobs.len());
    for ((arch, src), (_, cubin, secs)) in jobs.iter().zip(&done) {
        assert!(
            cubin.starts_with(b"\x7fELF"),
            "{}: not an ELF cubin",
            src.name
        );
        println!(
            "COMPILE {} {arch} {} bytes in {secs:.2}s",
            src.name,
            cubin.len()
        );
        // Each entry point's machine code, as the `.text.NAME` section of the cubin: every declared
        // kernel is there, and its size is printed (a short decode launch spends much of its time
        // fetching its code into each multiprocessor's instruction cache).
        let code = text_sections(cubin);
        for name in registry::entry_points(src) {
            let bytes = code
                .iter()
                .find(|(n, _)| *n == name)
                .map(|(_, b)| *b)
                .unwrap_or_else(|| panic!("{}: no code for entry point {name} ({arch})", src.name));
            println!("CODE {name} {arch} {bytes}");
        }
    }
}

#[test]
fn a_compile_error_names_file_and_line() {
    let include = match nvrtc::nvrtc_version()
        .and_then(|_| nvrtc::cuda_include_dir(&crate::options::compile_options().include_dirs))
    {
        Ok(dir) => dir,
        Err(e) => {
            eprintln!("skipped: a_compile_error_names_file_and_line: {e}");
            return;
        }
    };
    let bad = nvrtc::Source {
        name: "broken.cu",
        text: "#include \"common.cuh\"\n\nextern \"C\" __global__ void k(float* x) {\n  x[0] = undefined_name;\n}\n",
    };
    match nvrtc::compile_cubin(&bad, registry::HEADERS, "sm_90", &[include]) {
        Err(sanmai_cuda::CudaError::Compile { file, line, log }) => {
            assert_eq!(file, "broken.cu");
            assert_eq!(line, Some(4), "log: {log}");
            assert!(log.contains("undefined_name"));
        }
        other => panic!("expected a compile error, got {:?}", other.map(|b| b.len())),
    }
}

/// The `.text.NAME` sections of an ELF64 little-endian cubin: (NAME, size in bytes).
fn text_sections(elf: &[u8]) -> Vec<(String, u64)> {
    let u16_at = |o: usize| u16::from_le_bytes(elf[o..o + 2].try_into().unwrap()) as usize;
    let u32_at = |o: usize| u32::from_le_bytes(elf[o..o + 4].try_into().unwrap()) as usize;
    let u64_at = |o: usize| u64::from_le_bytes(elf[o..o + 8].try_into().unwrap());
    assert_eq!(elf[4], 2, "a 64-bit ELF");
    let (shoff, shentsize, shnum, shstrndx) = (
        u64_at(0x28) as usize,
        u16_at(0x3a),
        u16_at(0x3c),
        u16_at(0x3e),
    );
    let section = |i: usize| shoff + i * shentsize;
    let strtab = u64_at(section(shstrndx) + 0x18) as usize;
    let name_at = |o: usize| {
        let end = elf[strtab + o..].iter().position(|&b| b == 0).unwrap();
        String::from_utf8_lossy(&elf[strtab + o..strtab + o + end]).into_owned()
    };
    (0..shnum)
        .filter_map(|i| {
            let name = name_at(u32_at(section(i)));
            let size = u64_at(section(i) + 0x20);
            name.strip_prefix(".text.").map(|n| (n.to_string(), size))
        })
        .collect()
}
