//! Where an engine runs: `cpu`, or `cuda:N`, a GPU of a build with the `cuda` feature.
//!
//! [`DeviceSpec`] is what the configuration names (`--device`, `SWARMGATE_DEVICE`, `device` in
//! the file's `[engine]`); [`DeviceSpec::open`] turns it into candle's device at start-up, or
//! fails with a message that says why: a build without the feature, or no such GPU (candle's
//! driver error, which names the cause). Nothing here panics on a machine without a GPU.

use std::fmt;
use std::str::FromStr;

use candle_core::Device;

use crate::{EngineError, Result};

/// A device as the configuration names it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum DeviceSpec {
    #[default]
    Cpu,
    /// The GPU of this ordinal.
    Cuda(usize),
}

impl FromStr for DeviceSpec {
    type Err = String;

    fn from_str(text: &str) -> std::result::Result<Self, String> {
        let refused = || format!("{text:?} is not a device: `cpu`, `cuda` or `cuda:N`");
        match text.trim().to_ascii_lowercase().as_str() {
            "cpu" => Ok(Self::Cpu),
            "cuda" => Ok(Self::Cuda(0)),
            other => {
                let ordinal = other.strip_prefix("cuda:").ok_or_else(refused)?;
                ordinal.parse().map(Self::Cuda).map_err(|_| refused())
            }
        }
    }
}

impl fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Cpu => f.write_str("cpu"),
            Self::Cuda(ordinal) => write!(f, "cuda:{ordinal}"),
        }
    }
}

impl TryFrom<String> for DeviceSpec {
    type Error = String;

    fn try_from(text: String) -> std::result::Result<Self, String> {
        text.parse()
    }
}

impl From<DeviceSpec> for String {
    fn from(device: DeviceSpec) -> String {
        device.to_string()
    }
}

impl DeviceSpec {
    /// candle's device for this one; an error naming the device and the cause when it cannot be
    /// opened.
    pub fn open(self) -> Result<Device> {
        match self {
            Self::Cpu => Ok(Device::Cpu),
            Self::Cuda(ordinal) => cuda(ordinal),
        }
    }
}

/// Free and total bytes of a GPU's memory; `None` for the CPU.
pub fn memory(device: &Device) -> Result<Option<(usize, usize)>> {
    match device {
        #[cfg(feature = "cuda")]
        Device::Cuda(gpu) => gpu
            .cuda_stream()
            .context()
            .mem_get_info()
            .map(Some)
            .map_err(|e| EngineError::Device(format!("reading the GPU's free memory: {e}"))),
        _ => Ok(None),
    }
}

/// The GPU with one compute stream of its own, which every thread's operations queue on (the
/// model loads on one thread and runs on another), and no per-use event tracking: with one
/// compute stream nothing needs it, and the KV transfers' copy stream orders itself against that
/// stream with events of its own (`kv_cache::transfer`).
#[cfg(feature = "cuda")]
fn cuda(ordinal: usize) -> Result<Device> {
    let gpu = candle_core::CudaDevice::new_with_stream(ordinal)
        .map_err(|e| EngineError::Device(format!("cuda:{ordinal}: {e}")))?;
    // SAFETY: called before any tensor exists on this device; every operation on it runs on
    // its one stream, except the KV transfers, which synchronise by events.
    unsafe { gpu.disable_event_tracking() };
    Ok(Device::Cuda(gpu))
}

#[cfg(not(feature = "cuda"))]
fn cuda(ordinal: usize) -> Result<Device> {
    Err(EngineError::Device(format!(
        "cuda:{ordinal}: this binary was built without the `cuda` feature (`make build-cuda` \
         builds one with it)"
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_parse_and_print_back() {
        for (text, device) in [
            ("cpu", DeviceSpec::Cpu),
            ("CPU", DeviceSpec::Cpu),
            ("cuda", DeviceSpec::Cuda(0)),
            ("cuda:0", DeviceSpec::Cuda(0)),
            (" cuda:3 ", DeviceSpec::Cuda(3)),
        ] {
            assert_eq!(text.parse::<DeviceSpec>(), Ok(device), "{text}");
            assert_eq!(device.to_string().parse::<DeviceSpec>(), Ok(device));
        }
        for bad in ["", "gpu", "cuda:", "cuda:-1", "cuda:x", "cuda:0:1", "metal"] {
            let error = bad.parse::<DeviceSpec>().unwrap_err();
            assert!(error.contains("cuda:N"), "{bad}: {error}");
        }
    }

    #[test]
    fn the_cpu_opens_and_a_missing_gpu_is_a_clear_error() {
        assert!(DeviceSpec::Cpu.open().unwrap().is_cpu());
        // Without the feature, or on a machine without a GPU, a GPU is an error, not a panic.
        if cfg!(not(feature = "cuda")) || DeviceSpec::Cuda(0).open().is_err() {
            let error = DeviceSpec::Cuda(7).open().unwrap_err();
            assert!(matches!(error, EngineError::Device(_)), "{error}");
            assert!(error.to_string().contains("cuda:7"), "{error}");
        }
    }
}
