//! Errors of the CUDA layer. Every driver or NVRTC failure names the call that failed and the status's
//! readable name, so that a user can search for it.

/// Result alias of the CUDA layer.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Errors of the CUDA layer.
#[derive(Clone, Debug, thiserror::Error)]
pub enum Error {
    /// `libcuda` could not be loaded, or it does not initialise. Holds the reason.
    #[error("no CUDA driver found ({0})")]
    NoDriver(String),

    /// The driver is older than the CUDA version moelink needs.
    #[error("the CUDA driver supports CUDA {found}, moelink needs at least {required}; update the NVIDIA driver")]
    DriverTooOld {
        /// `cuDriverGetVersion`, formatted `major.minor`.
        found: String,
        /// The minimum, formatted `major.minor`.
        required: String,
    },

    /// The driver is present but the requested device does not exist.
    #[error("CUDA device {ordinal} requested, but the driver sees {count} device(s)")]
    NoDevice {
        /// The ordinal asked for.
        ordinal: usize,
        /// Devices the driver reports (after `CUDA_VISIBLE_DEVICES`).
        count: usize,
    },

    /// A CUDA driver call failed.
    #[error("{call} failed: {name} ({description})")]
    Driver {
        /// The driver function, e.g. `cuMemAlloc_v2`.
        call: &'static str,
        /// Numeric `CUresult`.
        code: u32,
        /// The `CUresult`'s name, e.g. `CUDA_ERROR_OUT_OF_MEMORY`.
        name: String,
        /// The driver's description of the status (`cuGetErrorString`).
        description: String,
    },

    /// `libnvrtc` could not be loaded.
    #[error(
        "NVRTC not found: set LD_LIBRARY_PATH to the directory holding libnvrtc.so.13 (e.g. /usr/local/cuda/lib64, or \
         the nvidia/cu13/lib folder of `pip install nvidia-cuda-nvrtc==13.0.88`){0}"
    )]
    NvrtcNotFound(String),

    /// An NVRTC call failed for a reason other than the source itself (e.g. `libnvrtc-builtins` missing).
    #[error("{call} failed: {name}{}", if log.is_empty() { String::new() } else { format!("\n{log}") })]
    Nvrtc {
        /// The NVRTC function.
        call: &'static str,
        /// The `nvrtcResult`'s name.
        name: String,
        /// NVRTC's program log, when there is one.
        log: String,
    },

    /// NVRTC rejected a kernel source.
    #[error("NVRTC failed to compile `{kernel}` for {arch}:\n{log}")]
    Compile {
        /// The source's name (kernel family file).
        kernel: String,
        /// The target architecture, e.g. `sm_90a`.
        arch: String,
        /// NVRTC's log.
        log: String,
    },

    /// nvJitLink (needed to link kernels against NVSHMEM's device library) could not be loaded.
    #[error(
        "nvJitLink not found: set LD_LIBRARY_PATH to the directory holding libnvJitLink.so.13 (e.g. /usr/local/cuda/lib64, \
         or the nvidia/cu13/lib folder of `pip install nvidia-nvjitlink==13.0.88`){0}"
    )]
    NvJitLinkNotFound(String),

    /// nvJitLink failed to link a kernel against a device library.
    #[error("nvJitLink failed to link `{kernel}` ({call}, status {status}):\n{log}")]
    Link {
        /// The source's name (kernel family file).
        kernel: String,
        /// The nvJitLink function that failed.
        call: &'static str,
        /// Its `nvJitLinkResult`.
        status: i32,
        /// nvJitLink's error and info logs.
        log: String,
    },

    /// NVSHMEM (needed for internode transport) is missing, the wrong version, or failed.
    #[error("NVSHMEM: {0}")]
    Nvshmem(String),

    /// The NVSHMEM host library is another version than the one the internode kernels are compiled and
    /// linked for (the headers and `libnvshmem_device.a` of the NVSHMEM installation they were built
    /// against): its device state would not match theirs.
    #[error(
        "NVSHMEM version mismatch: {library} is NVSHMEM {library_version}, but the internode kernels are compiled against the \
         headers and linked with the device library of {home}, NVSHMEM {kernel_version}; use one NVSHMEM for both: \
         `pip install nvidia-nvshmem-cu13=={kernel_version}` and point RdmaOptions::nvshmem_home (NVSHMEM_HOME for the moelink \
         command, moelink-stress and the Python package) at its nvidia/nvshmem folder"
    )]
    NvshmemVersion {
        /// The host library that reported `library_version`.
        library: String,
        /// What it reports (`nvshmemx_vendor_get_version_info`), `major.minor.patch`.
        library_version: String,
        /// The installation the kernels compile against.
        home: String,
        /// Its version (`include/non_abi/nvshmem_version.h`), `major.minor.patch`.
        kernel_version: String,
    },

    /// A caller-supplied value is unusable (wrong size, mismatched device, bad launch shape...).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),

    /// Peer exchange during symmetric-memory setup returned something malformed.
    #[error("symmetric memory setup on rank {rank}: {reason}")]
    Exchange {
        /// This rank.
        rank: usize,
        /// What was wrong.
        reason: String,
    },

    /// A file-system operation of the JIT cache failed.
    #[error("{what} {path}: {reason}")]
    Io {
        /// What was attempted.
        what: &'static str,
        /// The path involved.
        path: String,
        /// The OS error.
        reason: String,
    },
}

impl Error {
    /// The failing driver status's name (`CUDA_ERROR_…`), when this is a driver error.
    pub fn driver_status(&self) -> Option<&str> {
        match self {
            Error::Driver { name, .. } => Some(name),
            _ => None,
        }
    }

    /// True when the error means CUDA is not usable on this machine at all (no driver, no device, old
    /// driver), as opposed to a failure of one operation.
    pub fn is_unavailable(&self) -> bool {
        matches!(
            self,
            Error::NoDriver(_)
                | Error::DriverTooOld { .. }
                | Error::NoDevice { .. }
                | Error::NvrtcNotFound(_)
                | Error::NvJitLinkNotFound(_)
        )
    }

    pub(crate) fn invalid(msg: impl Into<String>) -> Error {
        Error::InvalidArgument(msg.into())
    }

    pub(crate) fn io(what: &'static str, path: &std::path::Path, e: std::io::Error) -> Error {
        Error::Io { what, path: path.display().to_string(), reason: e.to_string() }
    }
}
