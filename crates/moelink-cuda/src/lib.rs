//! moelink's CUDA layer (placeholder; being implemented). The signatures below are the contract the rest
//! of the workspace codes against.

/// Errors of the CUDA layer.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("no CUDA driver found ({0})")]
    NoDriver(String),
}

/// One GPU as the driver reports it.
#[derive(Clone, Debug)]
pub struct DeviceInfo {
    pub ordinal: usize,
    /// As nvidia-smi names it, e.g. "NVIDIA H200".
    pub name: String,
    pub compute_capability: (i32, i32),
    pub multiprocessors: usize,
    pub total_memory_bytes: usize,
    pub max_shared_memory_per_block_optin: usize,
}

/// What the CUDA layer found on this machine.
#[derive(Clone, Debug)]
pub struct SystemInfo {
    /// `cuDriverGetVersion`, e.g. 13000.
    pub driver_version: i32,
    pub devices: Vec<DeviceInfo>,
    /// `[i][j]`: device i can access device j's memory.
    pub peer_access: Vec<Vec<bool>>,
    /// NVRTC (major, minor), or why it is unavailable.
    pub nvrtc: Result<(i32, i32), String>,
}

/// Probes the driver, the devices and NVRTC. Errors only when no driver can be loaded.
pub fn system_info() -> Result<SystemInfo, Error> {
    Err(Error::NoDriver("placeholder".into()))
}

/// Device memory.
pub struct DeviceBuffer {
    ptr: u64,
    len: usize,
    ordinal: usize,
}

impl DeviceBuffer {
    pub fn len_bytes(&self) -> usize {
        self.len
    }
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }
    pub fn device_ordinal(&self) -> usize {
        self.ordinal
    }
    pub fn copy_to_host(&self, _dst: &mut [u8]) -> Result<(), Error> {
        Err(Error::NoDriver("placeholder".into()))
    }
}
