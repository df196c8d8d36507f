//! The raw layer: the only code that calls `cudarc::driver::sys` and `cudarc::nvrtc::sys`.
//!
//! Like cudarc's `result` module, every function here is a thin, still-`unsafe` wrapper that turns a C
//! status into a [`crate::Error`] naming the call. No RAII, no validation: that is the safe layer's job.
//! Callers must have loaded the library ([`driver::ensure_loaded`] / [`nvrtc::ensure_loaded`]) first,
//! because cudarc panics when a symbol's library is missing.

pub(crate) mod driver;
pub(crate) mod nvjitlink;
pub(crate) mod nvrtc;
pub(crate) mod nvshmem;
