//! Device selection (`cpu`, `cuda`, `cuda:N`) and GPU detection that never panics.
//!
//! The CUDA driver library is loaded at run time: on a machine without it every probe answers "no
//! device" with the reason, and nothing else in this crate is touched.

use std::fmt;
use std::str::FromStr;

use cudarc::driver::{result, sys};

use crate::error::{CudaError, Result};

/// Where a model runs, as given on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceSelection {
    Cpu,
    /// A CUDA device by ordinal (`cuda` is ordinal 0).
    Cuda(usize),
}

impl FromStr for DeviceSelection {
    type Err = CudaError;

    /// Parses `cpu`, `cuda` or `cuda:N` (case-insensitive, surrounding spaces ignored).
    fn from_str(s: &str) -> Result<Self> {
        let t = s.trim().to_ascii_lowercase();
        match t.as_str() {
            "cpu" => Ok(Self::Cpu),
            "cuda" => Ok(Self::Cuda(0)),
            _ => t
                .strip_prefix("cuda:")
                .and_then(|n| n.parse::<usize>().ok())
                .map(Self::Cuda)
                .ok_or_else(|| CudaError::BadDevice(s.to_string())),
        }
    }
}

impl fmt::Display for DeviceSelection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Cpu => write!(f, "cpu"),
            Self::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

impl DeviceSelection {
    /// The default device: `cuda:0` when a GPU is found, else `cpu`.
    pub fn default_available() -> Self {
        if gpu_present() {
            Self::Cuda(0)
        } else {
            Self::Cpu
        }
    }
}

/// What the driver says about one device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    pub ordinal: usize,
    pub name: String,
    /// Compute capability `(major, minor)`.
    pub compute_capability: (u32, u32),
    pub total_memory: usize,
    pub multiprocessors: u32,
    /// Whether the device runs cooperative launches (every block of a grid resident at once).
    pub cooperative_launch: bool,
    /// The most shared memory a block may opt into, in bytes.
    pub max_shared_per_block: usize,
    /// Driver version as the driver reports it (e.g. 13000 for 13.0).
    pub driver_version: i32,
}

impl DeviceInfo {
    /// The NVRTC architecture name of the device, e.g. `sm_90`.
    pub fn arch(&self) -> String {
        let (major, minor) = self.compute_capability;
        format!("sm_{major}{minor}")
    }
}

/// Runs `f`, turning a panic (cudarc panics when a library or symbol is missing) into an error.
pub(crate) fn guarded<T>(what: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|p| {
        let msg = p
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "panic".into());
        Err(CudaError::NoDevice(format!("{what}: {msg}")))
    })
}

/// Loads the driver library and calls `cuInit`.
pub(crate) fn init_driver() -> Result<()> {
    // SAFETY: only tries to open the library; no symbol is called.
    if !unsafe { sys::is_culib_present() } {
        return Err(CudaError::NoDevice(
            "the CUDA driver library (libcuda) was not found".into(),
        ));
    }
    guarded("cuInit", || {
        result::init().map_err(|e| CudaError::NoDevice(format!("cuInit failed: {e}")))
    })
}

/// The driver's version number (e.g. 13000), or an error when no driver is loadable.
pub fn driver_version() -> Result<i32> {
    init_driver()?;
    guarded("cuDriverGetVersion", || {
        let mut v = 0;
        // SAFETY: writes one int.
        unsafe { sys::cuDriverGetVersion(&mut v) }.result()?;
        Ok(v)
    })
}

/// Number of CUDA devices; 0 when there is no driver or no device. Never panics.
pub fn device_count() -> usize {
    probe().map(|d| d.len()).unwrap_or(0)
}

/// Whether at least one CUDA device is usable. Never panics.
pub fn gpu_present() -> bool {
    device_count() > 0
}

/// Every CUDA device with its properties, or the reason there is none. Never panics.
pub fn probe() -> Result<Vec<DeviceInfo>> {
    init_driver()?;
    let driver = driver_version()?;
    guarded("device probe", || {
        let n = result::device::get_count()?;
        let mut out = Vec::with_capacity(n.max(0) as usize);
        for i in 0..n.max(0) {
            let dev = result::device::get(i)?;
            let attr = |a| {
                // SAFETY: `dev` is a valid device handle from `get`.
                unsafe { result::device::get_attribute(dev, a) }
            };
            use sys::CUdevice_attribute as A;
            out.push(DeviceInfo {
                ordinal: i as usize,
                name: result::device::get_name(dev)?,
                compute_capability: (
                    attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)? as u32,
                    attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)? as u32,
                ),
                // SAFETY: as above.
                total_memory: unsafe { result::device::total_mem(dev) }?,
                multiprocessors: attr(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as u32,
                cooperative_launch: attr(A::CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH)? != 0,
                max_shared_per_block: attr(
                    A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
                )? as usize,
                driver_version: driver,
            });
        }
        if out.is_empty() {
            return Err(CudaError::NoDevice("the driver reports no device".into()));
        }
        Ok(out)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_device_strings() {
        assert_eq!(
            "cpu".parse::<DeviceSelection>().unwrap(),
            DeviceSelection::Cpu
        );
        assert_eq!(
            "cuda".parse::<DeviceSelection>().unwrap(),
            DeviceSelection::Cuda(0)
        );
        assert_eq!(
            " CUDA:3 ".parse::<DeviceSelection>().unwrap(),
            DeviceSelection::Cuda(3)
        );
        for bad in ["", "cuda:", "cuda:-1", "cuda:x", "tpu", "cuda:1:2", "cuda0"] {
            assert!(
                matches!(bad.parse::<DeviceSelection>(), Err(CudaError::BadDevice(_))),
                "{bad:?} should not parse"
            );
        }
        assert_eq!(DeviceSelection::Cuda(2).to_string(), "cuda:2");
        assert_eq!(
            DeviceSelection::Cuda(2)
                .to_string()
                .parse::<DeviceSelection>()
                .unwrap(),
            DeviceSelection::Cuda(2)
        );
    }

    #[test]
    fn probing_never_panics() {
        // On a machine without a GPU this must answer "none" with a reason; with one, list it.
        match probe() {
            Ok(devs) => {
                assert_eq!(device_count(), devs.len());
                assert!(gpu_present());
                assert_eq!(
                    DeviceSelection::default_available(),
                    DeviceSelection::Cuda(0)
                );
                for d in &devs {
                    assert!(d.arch().starts_with("sm_"));
                }
            }
            Err(e) => {
                eprintln!("no GPU here: {e}");
                assert_eq!(device_count(), 0);
                assert!(!gpu_present());
                assert_eq!(DeviceSelection::default_available(), DeviceSelection::Cpu);
            }
        }
    }
}
