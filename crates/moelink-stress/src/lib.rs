//! The `moelink-stress` command's implementation: long randomized runs that check moelink against its host
//! backend, and runs that kill a rank mid-collective. Test tools, kept out of the `moelink` binary.
//!
//! - [`soak`] — `moelink-stress soak`: randomized rounds of every kernel family, each compared with the host
//!   backend, with device and host memory sampled.
//! - [`chaos`] — `moelink-stress chaos`: in process mode one rank SIGKILLs itself mid-collective; the
//!   survivors must time out naming it, and rebuild (or mask it, in shrink mode).
//! - [`memory`] — the process's memory as the soak samples it.

pub mod chaos;
pub mod memory;
pub mod soak;
