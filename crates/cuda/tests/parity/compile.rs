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
    for arch in ["sm_86", "sm_90"] {
        for src in registry::SOURCES {
            let t0 = std::time::Instant::now();
            let cubin =
                nvrtc::compile_cubin(src, registry::HEADERS, arch, std::slice::from_ref(&include))
                    .unwrap_or_else(|e| panic!("{} for {arch}: {e}", src.name));
            assert!(
                cubin.starts_with(b"\x7fELF"),
                "{}: not an ELF cubin",
                src.name
            );
            println!(
                "COMPILE {} {arch} {} bytes in {:.2}s",
                src.name,
                cubin.len(),
                t0.elapsed().as_secs_f32()
            );
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
