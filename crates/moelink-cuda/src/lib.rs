//! moelink's CUDA layer (placeholder; being implemented).

/// Errors of the CUDA layer.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("no CUDA driver found ({0})")]
    NoDriver(String),
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
