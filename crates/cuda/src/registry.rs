//! The kernel registry: every `kernels/*.cu` file is embedded in the binary, compiled with NVRTC for the
//! device's architecture once (cached on disk, see [`crate::cache`]), loaded once, and its entry points
//! (`extern "C" __global__` functions, one per line) looked up by name.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, CudaModule};
use cudarc::nvrtc::Ptx;

use crate::cache::{self, KeyHasher};
use crate::error::{CudaError, Result};
use crate::nvrtc::{self, Source};

macro_rules! source {
    ($file:literal) => {
        Source {
            name: $file,
            text: include_str!(concat!("../../../kernels/", $file)),
        }
    };
}

/// Where the kernel compiler finds the CUDA headers and keeps compiled kernels. This crate reads no
/// environment variable for them: its caller names the folders.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CompileOptions {
    /// The kernel cache root (a `kernels/` folder inside, see [`crate::cache`]); `None` compiles every
    /// kernel at every start.
    pub cache_dir: Option<PathBuf>,
    /// Folders searched for the CUDA headers before the standard ones
    /// ([`nvrtc::cuda_include_dir`]).
    pub include_dirs: Vec<PathBuf>,
    /// A folder holding every file of [`SOURCES`] and [`HEADERS`] to compile in place of the
    /// embedded texts ([`sources_of`]): kernel variants compared with one build. `None`: the
    /// embedded kernels.
    pub source_dir: Option<PathBuf>,
}

impl CompileOptions {
    /// The folders the caller's variables name, each looked up through `var` (a caller passes its
    /// environment; this crate reads none): the kernel cache `SANMAI_CACHE_DIR` (else
    /// `XDG_CACHE_HOME/sanmai`, else `HOME/.cache/sanmai`), the CUDA header folders
    /// `SANMAI_CUDA_INCLUDE` (`:`-separated), then `CUDA_HOME/include` and `CUDA_PATH/include`, and
    /// the kernel sources' folder `SANMAI_KERNEL_SOURCES` (unset: the embedded kernels).
    pub fn from_vars(var: impl Fn(&str) -> Option<std::ffi::OsString>) -> Self {
        let nonempty = |name: &str| var(name).filter(|v| !v.is_empty()).map(PathBuf::from);
        let mut include_dirs: Vec<PathBuf> =
            std::env::split_paths(&var("SANMAI_CUDA_INCLUDE").unwrap_or_default())
                .filter(|d| !d.as_os_str().is_empty())
                .collect();
        for name in ["CUDA_HOME", "CUDA_PATH"] {
            if let Some(root) = nonempty(name) {
                include_dirs.push(root.join("include"));
            }
        }
        CompileOptions {
            cache_dir: nonempty("SANMAI_CACHE_DIR")
                .or_else(|| nonempty("XDG_CACHE_HOME").map(|p| p.join("sanmai")))
                .or_else(|| nonempty("HOME").map(|p| p.join(".cache").join("sanmai"))),
            include_dirs,
            source_dir: nonempty("SANMAI_KERNEL_SOURCES"),
        }
    }
}

/// The kernel sources and headers `options` name: [`SOURCES`] and [`HEADERS`], or (with
/// [`CompileOptions::source_dir`]) the files of the same names read from that folder. A file
/// missing there is an error that names it.
pub fn sources_of(options: &CompileOptions) -> Result<(Vec<Source>, Vec<Source>)> {
    let Some(dir) = &options.source_dir else {
        return Ok((SOURCES.to_vec(), HEADERS.to_vec()));
    };
    // `Source` holds 'static text: the files are read and leaked at each load (a GPU context loads
    // its kernels once; the folder is a development switch, off by default).
    let read = |set: &[Source]| -> Result<Vec<Source>> {
        set.iter()
            .map(|s| {
                let path = dir.join(s.name);
                let text = std::fs::read_to_string(&path).map_err(|e| {
                    CudaError::Nvrtc(format!(
                        "kernel source {} (SANMAI_KERNEL_SOURCES): {e}",
                        path.display()
                    ))
                })?;
                Ok(Source {
                    name: s.name,
                    text: Box::leak(text.into_boxed_str()),
                })
            })
            .collect()
    };
    Ok((read(SOURCES)?, read(HEADERS)?))
}

/// Headers the kernels include with `#include "name"`.
pub const HEADERS: &[Source] = &[
    source!("common.cuh"),
    source!("packed.cuh"),
    source!("sample.cuh"),
    source!("moe_route.cuh"),
    source!("fp8.cuh"),
    source!("moe_gemm.cuh"),
    source!("gemv.cuh"),
    source!("add_norm.cuh"),
    source!("layer.cuh"),
];

/// The kernel sources, one file per op family.
pub const SOURCES: &[Source] = &[
    source!("norm.cu"),
    source!("rope.cu"),
    source!("act.cu"),
    source!("embed.cu"),
    source!("gemv.cu"),
    source!("quant.cu"),
    source!("gemv_rows.cu"),
    source!("fp8.cu"),
    source!("embed_packed.cu"),
    source!("router.cu"),
    source!("moe_route.cu"),
    source!("conv.cu"),
    source!("gdn.cu"),
    source!("gdn_chunk.cu"),
    source!("gdn_layer.cu"),
    source!("attn_layer.cu"),
    source!("attention.cu"),
    source!("attention_prefill.cu"),
    source!("kv.cu"),
    source!("moe.cu"),
    source!("moe_layer.cu"),
    source!("moe_gemm.cu"),
    source!("moe_gemm_f8.cu"),
    source!("elementwise.cu"),
    source!("qsa.cu"),
    source!("qsa_topk.cu"),
    source!("qsa_cache.cu"),
    source!("qsa_staged.cu"),
    source!("ple.cu"),
    source!("hc.cu"),
    source!("sample.cu"),
    source!("sample_draw.cu"),
    source!("vision.cu"),
];

/// The statements a kernel may open with to take part in programmatic dependent launch
/// (`common.cuh`): the plain prologue, or the one that first asks L2 for the block's weights.
pub const PDL_PROLOGUES: [&str; 2] = ["pdl_prologue();", "pdl_prologue_prefetch("];

/// Whether the kernel `name` of `src` opens its body with one of [`PDL_PROLOGUES`]: only such kernels
/// may be launched before the kernel ahead of them on the stream has finished (their first statement
/// waits for it), so only they get the launch attribute.
pub fn opens_with_pdl_prologue(src: &Source, name: &str) -> bool {
    // The declaring line's byte offset (lines are slices of the text), then the body after its `{`.
    let Some(line) = src.text.lines().find(|l| {
        l.trim_start().starts_with("extern \"C\" __global__")
            && entry_point_of_line(l) == Some(name)
    }) else {
        return false;
    };
    let rest = &src.text[line.as_ptr() as usize - src.text.as_ptr() as usize..];
    let Some(open) = rest.find('{') else {
        return false;
    };
    let body = rest[open + 1..].trim_start();
    PDL_PROLOGUES.iter().any(|p| body.starts_with(p))
}

/// The entry point an `extern "C" __global__ ... name(` line declares.
fn entry_point_of_line(l: &str) -> Option<&str> {
    // The identifier before the first `(` that does not open `__launch_bounds__(..)`.
    l.match_indices('(').find_map(|(i, _)| {
        let name = l[..i]
            .rsplit(|c: char| !(c.is_alphanumeric() || c == '_'))
            .next()?;
        (!name.is_empty() && name != "__launch_bounds__").then_some(name)
    })
}

/// The entry points a source declares: every `extern "C" __global__ ... name(` line.
pub fn entry_points(src: &Source) -> Vec<String> {
    src.text
        .lines()
        .filter(|l| l.trim_start().starts_with("extern \"C\" __global__"))
        .filter_map(|l| entry_point_of_line(l).map(str::to_string))
        .collect()
}

/// The cache key of `src` (with `headers`) for `arch` under the given driver version.
fn cache_key(
    src: &Source,
    headers: &[Source],
    arch: &str,
    driver: i32,
    nvrtc: (i32, i32),
) -> String {
    let mut h = KeyHasher::default();
    h.field(env!("CARGO_PKG_VERSION").as_bytes())
        .field(src.name.as_bytes())
        .field(src.text.as_bytes())
        .field(arch.as_bytes())
        .field(&driver.to_le_bytes())
        .field(&nvrtc.0.to_le_bytes())
        .field(&nvrtc.1.to_le_bytes());
    for hd in headers {
        h.field(hd.name.as_bytes()).field(hd.text.as_bytes());
    }
    h.hex()
}

/// Compiles (or takes from the cache under `options.cache_dir`) every source `options` name
/// ([`sources_of`]) for `arch`, with the CUDA headers found from `options.include_dirs`; returns
/// each source with its cubin. `driver` is the driver version (0 when compiling without a device).
/// Sources compile in parallel.
pub fn compile_all(
    arch: &str,
    driver: i32,
    options: &CompileOptions,
) -> Result<Vec<(Source, Vec<u8>)>> {
    let (sources, headers) = sources_of(options)?;
    let headers = &headers;
    let nvrtc_v = nvrtc::nvrtc_version()?;
    let include = vec![nvrtc::cuda_include_dir(&options.include_dirs)?];
    let dir = options.cache_dir.as_ref().map(|d| d.join("kernels"));
    let one = |src: &Source| -> Result<(Source, Vec<u8>)> {
        let stem = src.name.trim_end_matches(".cu");
        let path: Option<PathBuf> = dir.as_ref().map(|d| {
            d.join(format!(
                "{stem}-{arch}-{}.cubin",
                cache_key(src, headers, arch, driver, nvrtc_v)
            ))
        });
        if let Some(bytes) = path.as_deref().and_then(cache::load) {
            tracing::debug!("kernel cache hit: {}", src.name);
            return Ok((*src, bytes));
        }
        let t0 = std::time::Instant::now();
        let cubin = nvrtc::compile_cubin(src, headers, arch, &include)?;
        tracing::debug!("compiled {} for {arch} in {:?}", src.name, t0.elapsed());
        if let Some(p) = &path {
            cache::store(p, &cubin);
        }
        Ok((*src, cubin))
    };
    std::thread::scope(|s| {
        let handles: Vec<_> = sources
            .iter()
            .map(|src| s.spawn(move || one(src)))
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(CudaError::Nvrtc("compile thread panicked".into())))
            })
            .collect()
    })
}

/// A loaded kernel and whether it opens with the PDL prologue ([`opens_with_pdl_prologue`]).
pub struct Kernel {
    pub func: CudaFunction,
    pub pdl: bool,
    /// The entry point's name (what [`crate::timer`] reports).
    pub name: Arc<str>,
}

impl std::ops::Deref for Kernel {
    type Target = CudaFunction;
    fn deref(&self) -> &CudaFunction {
        &self.func
    }
}

/// Every kernel of every source, loaded into one context.
pub struct Kernels {
    functions: HashMap<String, Kernel>,
    _modules: Vec<Arc<CudaModule>>,
}

impl Kernels {
    /// Compiles (or takes from the cache) and loads every source for `arch` into `ctx`.
    pub fn load(
        ctx: &Arc<CudaContext>,
        arch: &str,
        driver: i32,
        options: &CompileOptions,
    ) -> Result<Self> {
        let cubins = compile_all(arch, driver, options)?;
        let mut functions = HashMap::new();
        let mut modules = Vec::new();
        for (src, cubin) in cubins {
            let name = src.name;
            let module = ctx.load_module(Ptx::from_binary(cubin))?;
            for f in entry_points(&src) {
                let func = module.load_function(&f).map_err(|e| {
                    CudaError::Nvrtc(format!("{name}: kernel {f} not in the module: {e}"))
                })?;
                let pdl = opens_with_pdl_prologue(&src, &f);
                let name = Arc::from(f.as_str());
                functions.insert(f, Kernel { func, pdl, name });
            }
            modules.push(module);
        }
        Ok(Self {
            functions,
            _modules: modules,
        })
    }

    /// The kernel called `name`.
    pub fn get(&self, name: &str) -> Result<&Kernel> {
        self.functions
            .get(name)
            .ok_or_else(|| CudaError::UnknownKernel(name.to_string()))
    }

    /// Names of every loaded kernel, sorted.
    pub fn names(&self) -> Vec<&str> {
        let mut v: Vec<&str> = self.functions.keys().map(String::as_str).collect();
        v.sort_unstable();
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_source_declares_entry_points() {
        let mut all = Vec::new();
        for src in SOURCES {
            let eps = entry_points(src);
            assert!(!eps.is_empty(), "{} declares no kernel", src.name);
            // Every `__global__` function is found: its name on its `extern "C" __global__` line.
            let globals = src.text.matches("__global__").count();
            assert_eq!(
                eps.len(),
                globals,
                "{}: {globals} __global__ functions, {} entry points read (a kernel's name must be on its extern \"C\" __global__ line)",
                src.name,
                eps.len()
            );
            all.extend(eps);
        }
        let n = all.len();
        all.sort();
        all.dedup();
        assert_eq!(all.len(), n, "kernel names must be unique across files");
        assert!(all.iter().any(|k| k == "gemv_bf16_m1"));
    }

    #[test]
    fn a_source_folder_replaces_the_embedded_texts_and_names_a_missing_file() {
        let embedded = CompileOptions::default();
        let (src, hdr) = sources_of(&embedded).unwrap();
        assert_eq!(src.len(), SOURCES.len());
        assert_eq!(hdr.len(), HEADERS.len());
        // The repository's own kernels folder: the same texts as the embedded ones.
        let repo = CompileOptions {
            source_dir: Some(PathBuf::from(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../../kernels"
            ))),
            ..CompileOptions::default()
        };
        let (src, hdr) = sources_of(&repo).unwrap();
        for (a, b) in src.iter().chain(&hdr).zip(SOURCES.iter().chain(HEADERS)) {
            assert_eq!((a.name, a.text), (b.name, b.text));
        }
        // A folder without them: the error names the first file looked for.
        let empty = std::env::temp_dir().join(format!("sanmai-no-kernels-{}", std::process::id()));
        std::fs::create_dir_all(&empty).unwrap();
        let bad = CompileOptions {
            source_dir: Some(empty.clone()),
            ..CompileOptions::default()
        };
        let err = sources_of(&bad).unwrap_err().to_string();
        assert!(err.contains(SOURCES[0].name), "{err}");
        assert!(err.contains("SANMAI_KERNEL_SOURCES"), "{err}");
        std::fs::remove_dir(&empty).unwrap();
        // The variable names the folder.
        let vars = CompileOptions::from_vars(|v| {
            (v == "SANMAI_KERNEL_SOURCES").then(|| std::ffi::OsString::from("/k"))
        });
        assert_eq!(vars.source_dir, Some(PathBuf::from("/k")));
    }

    #[test]
    fn entry_point_parser_reads_names() {
        let src = Source {
            name: "x.cu",
            text: "extern \"C\" __global__ void foo(int a) {}\n  extern \"C\" __global__ void __launch_bounds__(256) bar(float* x)\n// extern \"C\" __global__ void no(",
        };
        assert_eq!(entry_points(&src), vec!["foo", "bar"]);
    }

    #[test]
    fn pdl_prologue_is_found_only_as_the_first_statement() {
        let src = Source {
            name: "x.cu",
            text: "extern \"C\" __global__ void a(int n)\n{\n    pdl_prologue();\n}\nextern \"C\" __global__ void b(int n) {\n    int i = 0;\n    pdl_prologue();\n}\nextern \"C\" __global__ void d(const int* w) {\n    pdl_prologue_prefetch(w, 64);\n}\n",
        };
        assert!(opens_with_pdl_prologue(&src, "a"));
        assert!(!opens_with_pdl_prologue(&src, "b"));
        assert!(opens_with_pdl_prologue(&src, "d"));
        assert!(!opens_with_pdl_prologue(&src, "c"));
    }

    /// Every kernel takes part in programmatic dependent launch: one without the prologue would be
    /// launched the ordinary way (correct, but it would stall the chain of early launches).
    #[test]
    fn every_kernel_opens_with_the_pdl_prologue() {
        let missing: Vec<String> = SOURCES
            .iter()
            .flat_map(|src| {
                entry_points(src)
                    .into_iter()
                    .filter(|k| !opens_with_pdl_prologue(src, k))
                    .map(|k| format!("{}: {k}", src.name))
            })
            .collect();
        assert!(
            missing.is_empty(),
            "kernels without a PDL prologue: {missing:?}"
        );
    }
}
