//! Pipeline stages on the command line: how many (`--pipeline-parallel-size`), which layers each
//! holds (`--pp-layer-partition`, else an even split) and where each runs (`--device`, a list). The
//! same layout feeds the loader, the memory plan and `sanmai plan`.

use std::ops::Range;

use anyhow::{bail, Result};

/// A device one stage runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    Cpu,
    /// A CUDA device by ordinal.
    Cuda(usize),
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Cpu => write!(f, "cpu"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

/// Where the stages run and which layers each holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StageLayout {
    /// Contiguous, non-empty, in order, covering `0..num_layers`.
    pub ranges: Vec<Range<usize>>,
    /// One per stage.
    pub devices: Vec<Device>,
}

impl StageLayout {
    pub fn len(&self) -> usize {
        self.ranges.len()
    }
}

/// The stage flags as given (from the command line or a preset).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StageFlags<'a> {
    pub pipeline_parallel_size: Option<usize>,
    pub pp_layer_partition: Option<&'a str>,
    pub device: Option<&'a str>,
}

/// Parses one device name: `cpu`, `cuda` or `cuda:N`.
fn parse_device(text: &str) -> Result<Device> {
    let t = text.trim().to_ascii_lowercase();
    match t.as_str() {
        "cpu" => Ok(Device::Cpu),
        "cuda" => Ok(Device::Cuda(0)),
        _ => match t.strip_prefix("cuda:").map(str::parse::<usize>) {
            Some(Ok(n)) => Ok(Device::Cuda(n)),
            _ => bail!("--device {text}: expected cpu, cuda or cuda:N"),
        },
    }
}

/// The layers per stage when no partition is given, as vLLM splits them: `layers / stages` each,
/// the remainder one more on each stage before the last (the last also holds the lm_head).
pub fn even_partition(layers: usize, stages: usize) -> Vec<usize> {
    let mut parts = vec![layers / stages; stages];
    for i in 0..layers % stages {
        parts[stages - 2 - i] += 1;
    }
    parts
}

impl StageFlags<'_> {
    /// The layout for a model of `num_layers` layers; `default_device` is where one stage runs when
    /// `--device` is not given (stage `i` of several goes to `cuda:i`, or the CPU). Each error is
    /// one line naming its flag.
    pub fn layout(&self, num_layers: usize, default_device: Device) -> Result<StageLayout> {
        let n = self.pipeline_parallel_size.unwrap_or(1);
        if n == 0 {
            bail!("--pipeline-parallel-size must be at least 1");
        }
        if n > num_layers {
            bail!(
                "--pipeline-parallel-size {n} is more stages than the model's {num_layers} layers"
            );
        }
        let parts = match self.pp_layer_partition {
            None => even_partition(num_layers, n),
            Some(text) => {
                let parts = text
                    .split(',')
                    .map(|p| p.trim().parse::<usize>())
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|_| {
                        anyhow::anyhow!(
                            "--pp-layer-partition {text:?}: expected comma-separated layer counts, e.g. 16,17,15"
                        )
                    })?;
                if parts.len() != n {
                    bail!(
                        "--pp-layer-partition {text:?} has {} stages but --pipeline-parallel-size is {n}",
                        parts.len()
                    );
                }
                if parts.contains(&0) {
                    bail!("--pp-layer-partition {text:?}: every stage needs at least one layer");
                }
                let sum: usize = parts.iter().sum();
                if sum != num_layers {
                    bail!(
                        "--pp-layer-partition {text:?} sums to {sum} layers but the model has {num_layers}"
                    );
                }
                parts
            }
        };
        let mut ranges = Vec::with_capacity(n);
        let mut start = 0;
        for p in parts {
            ranges.push(start..start + p);
            start += p;
        }
        let devices = match self.device {
            None if n == 1 => vec![default_device],
            None => match default_device {
                Device::Cpu => vec![Device::Cpu; n],
                Device::Cuda(first) => (first..first + n).map(Device::Cuda).collect(),
            },
            Some(text) => {
                let list = text
                    .split(',')
                    .map(parse_device)
                    .collect::<Result<Vec<_>>>()?;
                match list.as_slice() {
                    [Device::Cpu] => vec![Device::Cpu; n],
                    l if l.len() == n => list,
                    _ => bail!(
                        "--device {text:?} names {} devices but --pipeline-parallel-size is {n}: give one \
                         per stage (e.g. cuda:0,cuda:0,cuda:0 for stages sharing one GPU)",
                        list.len()
                    ),
                }
            }
        };
        if devices.contains(&Device::Cpu) && devices.iter().any(|d| *d != Device::Cpu) {
            bail!(
                "--device {:?}: stages run all on the CPU or all on CUDA devices",
                self.device
            );
        }
        Ok(StageLayout { ranges, devices })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flags<'a>(n: usize, part: Option<&'a str>, dev: Option<&'a str>) -> StageFlags<'a> {
        StageFlags {
            pipeline_parallel_size: Some(n),
            pp_layer_partition: part,
            device: dev,
        }
    }

    #[test]
    fn even_splits_give_the_remainder_to_the_stages_before_the_last() {
        assert_eq!(even_partition(48, 3), vec![16, 16, 16]);
        assert_eq!(even_partition(49, 3), vec![16, 17, 16]);
        assert_eq!(even_partition(50, 3), vec![17, 17, 16]);
        assert_eq!(even_partition(4, 1), vec![4]);
        assert_eq!(even_partition(5, 2), vec![3, 2]);
    }

    #[test]
    fn layouts_from_flags() {
        let l = flags(3, Some("16,17,15"), Some("cuda:0,cuda:0,cuda:0"))
            .layout(48, Device::Cuda(0))
            .unwrap();
        assert_eq!(l.ranges, vec![0..16, 16..33, 33..48]);
        assert_eq!(l.devices, vec![Device::Cuda(0); 3]);
        let l = flags(3, None, None).layout(48, Device::Cuda(1)).unwrap();
        assert_eq!(l.ranges, vec![0..16, 16..32, 32..48]);
        assert_eq!(
            l.devices,
            vec![Device::Cuda(1), Device::Cuda(2), Device::Cuda(3)]
        );
        let l = flags(2, None, Some("cpu"))
            .layout(4, Device::Cuda(0))
            .unwrap();
        assert_eq!(l.devices, vec![Device::Cpu; 2]);
        let l = StageFlags::default().layout(4, Device::Cpu).unwrap();
        assert_eq!(l.ranges, vec![0..4]);
        assert_eq!(l.devices, vec![Device::Cpu]);
    }

    #[test]
    fn bad_layouts_name_their_flag() {
        let cases: [(StageFlags<'_>, &str); 8] = [
            (flags(0, None, None), "--pipeline-parallel-size"),
            (
                flags(5, None, None),
                "--pipeline-parallel-size 5 is more stages",
            ),
            (flags(3, Some("16,16,15"), None), "sums to 47"),
            (flags(3, Some("24,24"), None), "has 2 stages"),
            (flags(3, Some("a,b,c"), None), "--pp-layer-partition"),
            (flags(2, Some("0,48"), None), "at least one layer"),
            (flags(3, None, Some("cuda:0,cuda:1")), "names 2 devices"),
            (flags(2, None, Some("cuda:0,tpu")), "--device"),
        ];
        for (f, want) in cases {
            let layers = if f.pipeline_parallel_size == Some(5) {
                4
            } else {
                48
            };
            let e = f.layout(layers, Device::Cuda(0)).unwrap_err().to_string();
            assert!(e.contains(want), "{e:?} should contain {want:?}");
            assert!(!e.contains('\n'), "one line: {e:?}");
        }
        let e = flags(2, None, Some("cpu,cuda:0"))
            .layout(4, Device::Cpu)
            .unwrap_err()
            .to_string();
        assert!(e.contains("all on the CPU"), "{e}");
    }
}
