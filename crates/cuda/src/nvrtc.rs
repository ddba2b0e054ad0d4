//! NVRTC: compiles one kernel source to a CUBIN for a given architecture, with in-memory headers.
//!
//! `libnvrtc` is loaded at run time. The CUDA headers the kernels include (`cuda_bf16.h`) are looked for
//! in the folders the caller names (the `sanmai` binary: `$SANMAI_CUDA_INCLUDE`, a `:`-separated list,
//! then `$CUDA_HOME/include` and `$CUDA_PATH/include`), then in `/usr/local/cuda/include` and
//! `/opt/cuda/include`, in that order.

use std::ffi::{c_char, CStr, CString};
use std::path::PathBuf;

use cudarc::nvrtc::sys;

use crate::device::guarded;
use crate::error::{CudaError, Result};

/// The NVRTC version `(major, minor)`, or why NVRTC cannot be used. Never panics.
pub fn nvrtc_version() -> Result<(i32, i32)> {
    // SAFETY: only tries to open the library.
    if !unsafe { sys::is_culib_present() } {
        return Err(CudaError::Nvrtc(
            "libnvrtc was not found (add its folder to LD_LIBRARY_PATH)".into(),
        ));
    }
    guarded("nvrtcVersion", || {
        let (mut major, mut minor) = (0, 0);
        // SAFETY: writes two ints.
        check(unsafe { sys::nvrtcVersion(&mut major, &mut minor) })?;
        Ok((major, minor))
    })
    .map_err(|e| CudaError::Nvrtc(e.to_string()))
}

/// The first include directory holding `cuda_bf16.h`: one of `dirs`, in order, else a standard one.
pub fn cuda_include_dir(dirs: &[PathBuf]) -> Result<PathBuf> {
    let mut tried = Vec::new();
    let mut candidates = dirs.to_vec();
    candidates.push("/usr/local/cuda/include".into());
    candidates.push("/opt/cuda/include".into());
    for dir in candidates {
        if dir.as_os_str().is_empty() {
            continue;
        }
        if dir.join("cuda_bf16.h").is_file() {
            return Ok(dir);
        }
        tried.push(dir);
    }
    Err(CudaError::NoHeaders { tried })
}

fn check(r: sys::nvrtcResult) -> Result<()> {
    if r == sys::nvrtcResult::NVRTC_SUCCESS {
        Ok(())
    } else {
        // SAFETY: NVRTC returns a static string for every result code.
        let msg = unsafe { CStr::from_ptr(sys::nvrtcGetErrorString(r)) };
        Err(CudaError::Nvrtc(msg.to_string_lossy().into_owned()))
    }
}

fn cstring(what: &str, s: &str) -> Result<CString> {
    CString::new(s).map_err(|_| CudaError::Nvrtc(format!("{what} contains a NUL byte")))
}

/// A program handle destroyed on drop.
struct Program(sys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: the handle came from nvrtcCreateProgram and is destroyed once.
        unsafe { sys::nvrtcDestroyProgram(&mut self.0) };
    }
}

impl Program {
    fn log(&self) -> String {
        let mut size = 0usize;
        // SAFETY: valid program; writes one usize.
        if unsafe { sys::nvrtcGetProgramLogSize(self.0, &mut size) }
            != sys::nvrtcResult::NVRTC_SUCCESS
        {
            return String::new();
        }
        let mut buf = vec![0u8; size.max(1)];
        // SAFETY: `buf` holds `size` bytes as NVRTC asked.
        unsafe { sys::nvrtcGetProgramLog(self.0, buf.as_mut_ptr() as *mut c_char) };
        String::from_utf8_lossy(&buf)
            .trim_end_matches('\0')
            .trim()
            .to_string()
    }
}

/// The file and line of the first `file(line): error` in an NVRTC log (the first error line if none).
pub(crate) fn first_error(log: &str, default_file: &str) -> (String, Option<u32>) {
    let parsed = log.lines().find_map(|l| {
        let (head, _) = l.split_once("): error")?;
        let (file, line) = head.rsplit_once('(')?;
        Some((file.trim().to_string(), line.parse::<u32>().ok()))
    });
    parsed.unwrap_or_else(|| (default_file.to_string(), None))
}

/// A source to compile: its file name (used in diagnostics) and text.
#[derive(Debug, Clone, Copy)]
pub struct Source {
    pub name: &'static str,
    pub text: &'static str,
}

/// Compiles `src` to a CUBIN for `arch` (e.g. `sm_90`), with `headers` available to `#include "..."`.
/// A compile error names the file and line of the first error, with the whole log.
pub fn compile_cubin(
    src: &Source,
    headers: &[Source],
    arch: &str,
    include_dirs: &[PathBuf],
) -> Result<Vec<u8>> {
    nvrtc_version()?;
    let text = cstring(src.name, src.text)?;
    let name = cstring("kernel name", src.name)?;
    let hdr_text = headers
        .iter()
        .map(|h| cstring(h.name, h.text))
        .collect::<Result<Vec<_>>>()?;
    let hdr_name = headers
        .iter()
        .map(|h| cstring("header name", h.name))
        .collect::<Result<Vec<_>>>()?;
    let mut opts = vec![
        format!("--gpu-architecture={arch}"),
        "--std=c++17".to_string(),
        "-lineinfo".to_string(),
    ];
    for d in include_dirs {
        opts.push(format!("--include-path={}", d.display()));
    }
    let opts = opts
        .iter()
        .map(|o| cstring("option", o))
        .collect::<Result<Vec<_>>>()?;
    guarded("nvrtc", || {
        let hp: Vec<*const c_char> = hdr_text.iter().map(|c| c.as_ptr()).collect();
        let hn: Vec<*const c_char> = hdr_name.iter().map(|c| c.as_ptr()).collect();
        let op: Vec<*const c_char> = opts.iter().map(|c| c.as_ptr()).collect();
        let mut raw: sys::nvrtcProgram = std::ptr::null_mut();
        // SAFETY: every pointer refers to a live NUL-terminated string; the arrays have the given counts.
        check(unsafe {
            sys::nvrtcCreateProgram(
                &mut raw,
                text.as_ptr(),
                name.as_ptr(),
                hp.len() as i32,
                hp.as_ptr(),
                hn.as_ptr(),
            )
        })?;
        let prog = Program(raw);
        // SAFETY: valid program; `op` holds `op.len()` option strings.
        let r = unsafe { sys::nvrtcCompileProgram(prog.0, op.len() as i32, op.as_ptr()) };
        if r != sys::nvrtcResult::NVRTC_SUCCESS {
            let log = prog.log();
            let (file, line) = first_error(&log, src.name);
            return Err(CudaError::Compile { file, line, log });
        }
        let mut size = 0usize;
        // SAFETY: valid compiled program; writes one usize.
        check(unsafe { sys::nvrtcGetCUBINSize(prog.0, &mut size) })?;
        let mut cubin = vec![0u8; size];
        // SAFETY: `cubin` holds the size NVRTC reported.
        check(unsafe { sys::nvrtcGetCUBIN(prog.0, cubin.as_mut_ptr() as *mut c_char) })?;
        Ok(cubin)
    })
    .map_err(|e| match e {
        CudaError::NoDevice(m) => CudaError::Nvrtc(m),
        e => e,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_error_finds_file_and_line() {
        let log =
            "norm.cu(12): warning: unused\nnorm.cu(40): error: identifier \"x\" is undefined\n\
                   common.cuh(3): error: later";
        assert_eq!(first_error(log, "z.cu"), ("norm.cu".to_string(), Some(40)));
        assert_eq!(first_error("garbage", "z.cu"), ("z.cu".to_string(), None));
    }
}
