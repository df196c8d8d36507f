//! NVSHMEM, the engine under the internode transport's `nvshmem` backend: where its files are
//! ([`NvshmemToolchain`]), the process's one PE ([`Nvshmem::init`], unique-id bootstrap through the caller's
//! all-gather), symmetric-heap memory ([`NvshmemHeap`]) and module registration.
//!
//! Nothing here runs unless an internode buffer asks for the `nvshmem` transport; single-node use never loads
//! NVSHMEM. Facts the design rests on (NVSHMEM 3.4.5, the version torch 2.11 pins):
//! - `nvshmemx_hostlib_init_attr` can return 0 without having initialised the device side: success is
//!   `nvshmemx_init_status()` of 2 (3 or 4 when PEs share a GPU, without or with CUDA MPS), checked after
//!   every init.
//! - One PE per process, for the life of the process: NVSHMEM is initialised once and never finalised here
//!   (it registers its own `atexit` teardown); a later buffer must use the same ranks.
//! - NVSHMEM reads its configuration (transport, QPs, NIC selection, ...) from `NVSHMEM_*` environment
//!   variables when it initialises: [`Nvshmem::init`] sets the ones it is given just before.
//! - It picks the GPU of the context current at init: the caller's device is bound first.

use std::collections::HashSet;
use std::ffi::c_void;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

use crate::device::Device;
use crate::error::{Error, Result};
use crate::jit::CompileRequest;
use crate::module::Module;
use crate::raw::nvshmem::{self as sys, InitAttr, UniqueId};
use crate::symmetric::Exchange;

/// Where NVSHMEM's files are: the host library, the device library the kernels link against, and the
/// headers they compile with (NVSHMEM's, the CUDA runtime's and libcu++'s).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NvshmemToolchain {
    /// The NVSHMEM installation (`include/`, `lib/`), e.g. the `nvidia/nvshmem` folder of the
    /// `nvidia-nvshmem-cu13` wheel.
    pub home: PathBuf,
    /// `-I` directories for the kernels: NVSHMEM's `include/`, the CUDA runtime headers and `cccl/`.
    pub include_dirs: Vec<PathBuf>,
    /// `lib/libnvshmem_device.a`.
    pub device_library: PathBuf,
    /// `lib/libnvshmem_host.so.3`.
    pub host_library: PathBuf,
}

impl NvshmemToolchain {
    /// Finds NVSHMEM under `home` and the CUDA headers under `cuda_home` (`include/`, `include/cccl/`), or
    /// when that is `None`, in `/usr/local/cuda` or beside a pip-installed NVSHMEM (`nvidia/cu13/include`,
    /// the `nvidia-cuda-runtime` and `nvidia-cuda-cccl` wheels). The error says what is missing and what to
    /// install.
    pub fn locate(home: &Path, cuda_home: Option<&Path>) -> Result<NvshmemToolchain> {
        let need = |p: PathBuf, what: &str| -> Result<PathBuf> {
            if p.exists() {
                Ok(p)
            } else {
                Err(Error::Nvshmem(format!(
                    "{} not found ({what}); install NVSHMEM 3.4.5 (`pip install nvidia-nvshmem-cu13==3.4.5`) and point NVSHMEM_HOME \
                     at its nvidia/nvshmem folder",
                    p.display()
                )))
            }
        };
        let include = need(home.join("include").join("nvshmem.h"), "NVSHMEM's headers")?;
        let device_library = need(home.join("lib").join("libnvshmem_device.a"), "NVSHMEM's device library")?;
        let host_library = need(home.join("lib").join("libnvshmem_host.so.3"), "NVSHMEM's host library")?;
        let candidates: Vec<PathBuf> = match cuda_home {
            Some(c) => vec![c.join("include")],
            None => {
                let mut v = vec![PathBuf::from("/usr/local/cuda/include")];
                if let Some(nvidia) = home.parent() {
                    v.push(nvidia.join("cu13").join("include"));
                }
                v
            }
        };
        let cuda_include = candidates.iter().find(|d| d.join("cuda_runtime.h").exists()).cloned().ok_or_else(|| {
            Error::Nvshmem(format!(
                "the CUDA runtime headers (cuda_runtime.h) are not in {}; internode kernels compile against them: install the CUDA \
                 toolkit headers or `pip install nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85`, and set CUDA_HOME",
                candidates.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
            ))
        })?;
        let mut include_dirs = vec![include.parent().unwrap_or(home).to_path_buf(), cuda_include.clone()];
        let cccl = cuda_include.join("cccl");
        if cccl.exists() {
            include_dirs.push(cccl);
        }
        Ok(NvshmemToolchain { home: home.to_path_buf(), include_dirs, device_library, host_library })
    }

    /// `req` compiled against NVSHMEM: its include directories and the device library to link.
    pub fn apply(&self, mut req: CompileRequest) -> CompileRequest {
        for d in &self.include_dirs {
            req = req.include_dir(d.clone());
        }
        req.device_library(self.device_library.clone())
    }
}

/// The process's NVSHMEM PE, once initialised.
pub struct Nvshmem {
    api: sys::Api,
    pe: usize,
    num_pes: usize,
    version: (i32, i32, i32),
    home: PathBuf,
    /// Modules already registered (`nvshmemx_cumodule_init`), by raw handle.
    registered: Mutex<HashSet<usize>>,
}

impl std::fmt::Debug for Nvshmem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Nvshmem(PE {} of {}, {}.{}.{})", self.pe, self.num_pes, self.version.0, self.version.1, self.version.2)
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

static RUNTIME: OnceLock<Nvshmem> = OnceLock::new();
static INIT_LOCK: Mutex<()> = Mutex::new(());

impl Nvshmem {
    /// The process's PE, if NVSHMEM was initialised.
    pub fn get() -> Option<&'static Nvshmem> {
        RUNTIME.get()
    }

    /// Initialises NVSHMEM for this process as PE `ex.rank` of `ex.num_ranks` (collective: every rank calls
    /// it), on `device`, with `env` (`NVSHMEM_*` settings) applied first. Rank 0 creates the unique id and
    /// `ex.all_gather` hands it to the others. Once initialised, later calls return the same PE and check
    /// that the ranks agree.
    pub fn init<E: From<Error>>(
        toolchain: &NvshmemToolchain,
        device: &Device,
        env: &[(String, String)],
        ex: &Exchange<'_, E>,
    ) -> Result<&'static Nvshmem, E> {
        let _serial = lock(&INIT_LOCK);
        if let Some(rt) = RUNTIME.get() {
            if rt.pe != ex.rank || rt.num_pes != ex.num_ranks {
                return Err(Error::Nvshmem(format!(
                    "this process is already NVSHMEM PE {} of {}; a process holds one PE for its lifetime, so every internode \
                     buffer must span the same ranks (asked: rank {} of {})",
                    rt.pe, rt.num_pes, ex.rank, ex.num_ranks
                ))
                .into());
            }
            return Ok(rt);
        }
        let api = sys::open(&toolchain.host_library);
        // Every rank takes part in the exchange even when its own load failed, so that nobody waits for it.
        let uid = match (&api, ex.rank) {
            (Ok(api), 0) => {
                let mut uid = UniqueId::empty();
                // SAFETY: `uid` is a valid, initialised nvshmemx_uniqueid_t.
                let rc = unsafe { (api.get_uniqueid)(&mut uid) };
                if rc == 0 {
                    uid.to_bytes().to_vec()
                } else {
                    Vec::new()
                }
            }
            _ => Vec::new(),
        };
        let gathered = (ex.all_gather)(&uid)?;
        let api = api.map_err(E::from)?;
        let root = gathered
            .first()
            .and_then(|b| UniqueId::from_bytes(b))
            .ok_or_else(|| E::from(Error::Nvshmem("rank 0 could not create NVSHMEM's unique id (see rank 0's error)".into())))?;
        for (k, v) in env {
            std::env::set_var(k, v);
        }
        device.bind_to_thread()?;
        let mut uid = Box::new(root);
        let mut attr = Box::new(InitAttr::empty());
        // SAFETY: `uid` and `attr` are valid and stay alive (boxed) until init returns; set_attr stores a
        // pointer to `uid` in `attr`.
        let rc = unsafe { (api.set_attr_uniqueid_args)(ex.rank as i32, ex.num_ranks as i32, &mut *uid, &mut *attr) };
        if rc != 0 {
            return Err(Error::Nvshmem(format!("nvshmemx_set_attr_uniqueid_args returned {rc}")).into());
        }
        // SAFETY: as above; NVSHMEM bootstraps through the unique id (a socket to rank 0's host).
        let rc = unsafe { (api.hostlib_init_attr)(sys::INIT_WITH_UNIQUEID, &mut *attr) };
        // SAFETY: plain queries of the library's state.
        let status = unsafe { (api.init_status)() };
        if rc != 0 || !(sys::STATUS_IS_INITIALIZED..=sys::STATUS_FULL_MPG).contains(&status) {
            return Err(Error::Nvshmem(format!(
                "initialisation failed on rank {} (nvshmemx_hostlib_init_attr returned {rc}, init status {status}, expected {} to {}); \
                 NVSHMEM's own messages above say why (NVSHMEM_DEBUG=INFO for more). Several PEs on one GPU need CUDA MPS",
                ex.rank,
                sys::STATUS_IS_INITIALIZED,
                sys::STATUS_FULL_MPG
            ))
            .into());
        }
        // SAFETY: initialised (checked above).
        let (pe, num_pes) = unsafe { ((api.my_pe)() as usize, (api.n_pes)() as usize) };
        if pe != ex.rank || num_pes != ex.num_ranks {
            return Err(Error::Nvshmem(format!(
                "NVSHMEM made rank {} PE {pe} of {num_pes} (expected {} of {})",
                ex.rank, ex.rank, ex.num_ranks
            ))
            .into());
        }
        let (mut a, mut b, mut c) = (0, 0, 0);
        // SAFETY: three valid out-pointers.
        unsafe { (api.vendor_version)(&mut a, &mut b, &mut c) };
        let rt = Nvshmem { api, pe, num_pes, version: (a, b, c), home: toolchain.home.clone(), registered: Mutex::new(HashSet::new()) };
        Ok(RUNTIME.get_or_init(|| rt))
    }

    /// This process's PE.
    pub fn pe(&self) -> usize {
        self.pe
    }

    /// PEs in the job.
    pub fn num_pes(&self) -> usize {
        self.num_pes
    }

    /// NVSHMEM's version `(major, minor, patch)`.
    pub fn version(&self) -> (i32, i32, i32) {
        self.version
    }

    /// The installation this PE was loaded from.
    pub fn home(&self) -> &Path {
        &self.home
    }

    /// Allocates `bytes` of symmetric heap (collective: every PE allocates the same size, in the same order).
    pub fn alloc(&'static self, bytes: usize) -> Result<NvshmemHeap> {
        // SAFETY: initialised (a `&'static Nvshmem` exists only after init succeeded); collective by contract.
        let p = unsafe { (self.api.malloc)(bytes.max(1)) };
        if p.is_null() {
            return Err(Error::Nvshmem(format!(
                "nvshmem_malloc({bytes}) failed on PE {}: the symmetric heap is too small (set NVSHMEM_SYMMETRIC_SIZE, e.g. 4G)",
                self.pe
            )));
        }
        Ok(NvshmemHeap { rt: self, ptr: p as u64, len: bytes, leaked: false })
    }

    /// Registers `module`'s NVSHMEM device state (`nvshmemx_cumodule_init`); once per module.
    pub fn register(&self, module: &Module) -> Result<()> {
        let raw = module.raw_handle() as usize;
        let mut done = lock(&self.registered);
        if done.contains(&raw) {
            return Ok(());
        }
        let _g = module.device().bind_scoped()?;
        // SAFETY: a live module of a context NVSHMEM was initialised on; registration fills its device state.
        let rc = unsafe { (self.api.cumodule_init)(raw as *mut c_void) };
        if rc != 0 {
            return Err(Error::Nvshmem(format!(
                "nvshmemx_cumodule_init returned {rc} (was the kernel linked against {}?)",
                self.home.display()
            )));
        }
        done.insert(raw);
        Ok(())
    }

    /// Host-side barrier of every PE (collective).
    pub fn barrier_all(&self) {
        // SAFETY: initialised; collective by contract.
        unsafe { (self.api.barrier_all)() }
    }

    /// The address through which this PE can load/store `pe`'s copy of the heap object at `addr` (P2P),
    /// or `None` when `pe` is reachable only through the network.
    pub fn peer_address(&self, addr: u64, pe: usize) -> Option<u64> {
        // SAFETY: initialised; `addr` is checked by NVSHMEM (NULL for non-heap addresses).
        let p = unsafe { (self.api.ptr)(addr as *const c_void, pe as i32) };
        (!p.is_null()).then_some(p as u64)
    }
}

/// Memory of the NVSHMEM symmetric heap: the same offset on every PE. Freed on drop (`nvshmem_free` is
/// collective: drop it on every PE), unless leaked ([`NvshmemHeap::leak`]).
pub struct NvshmemHeap {
    rt: &'static Nvshmem,
    ptr: u64,
    len: usize,
    leaked: bool,
}

impl std::fmt::Debug for NvshmemHeap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NvshmemHeap({:#x}, {} B)", self.ptr, self.len)
    }
}

impl NvshmemHeap {
    /// Device address of this PE's copy.
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }

    /// Bytes.
    pub fn len_bytes(&self) -> usize {
        self.len
    }

    /// Fills this PE's copy with zeros (on a private stream; done when it returns).
    pub fn zero(&self, device: &Device) -> Result<()> {
        let stream = crate::stream::Stream::new(device)?;
        let _g = device.bind_scoped()?;
        // SAFETY: `[ptr, ptr + len)` is this PE's heap allocation on `device`, alive while `self` is.
        unsafe { crate::raw::driver::memset_d8_async(self.ptr, 0, self.len, stream.raw())? };
        stream.synchronize()
    }

    /// Keeps the memory when dropped (a peer may still write into it, or a collective free could wait for a
    /// dead PE).
    pub fn leak(&mut self) {
        self.leaked = true;
    }
}

impl Drop for NvshmemHeap {
    fn drop(&mut self) {
        if !self.leaked {
            // SAFETY: allocated by nvshmem_malloc of this runtime, freed once; collective by contract.
            unsafe { (self.rt.api.free)(self.ptr as *mut c_void) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn locate_names_what_is_missing() {
        let e = NvshmemToolchain::locate(Path::new("/nonexistent/nvshmem"), None).unwrap_err().to_string();
        assert!(e.contains("/nonexistent/nvshmem/include/nvshmem.h") && e.contains("nvidia-nvshmem-cu13"), "{e}");
    }

    #[test]
    fn locate_finds_a_pip_layout() {
        let root = std::env::temp_dir().join(format!("moelink-nvshmem-layout-{}", std::process::id()));
        let home = root.join("nvidia").join("nvshmem");
        let cu13 = root.join("nvidia").join("cu13").join("include");
        for d in [home.join("include"), home.join("lib"), cu13.join("cccl")] {
            std::fs::create_dir_all(d).unwrap();
        }
        for f in [
            home.join("include/nvshmem.h"),
            home.join("lib/libnvshmem_device.a"),
            home.join("lib/libnvshmem_host.so.3"),
            cu13.join("cuda_runtime.h"),
        ] {
            std::fs::write(f, b"").unwrap();
        }
        let t = NvshmemToolchain::locate(&home, Some(&root.join("nvidia").join("cu13"))).unwrap();
        assert_eq!(t.include_dirs, vec![home.join("include"), cu13.clone(), cu13.join("cccl")]);
        assert_eq!(t.device_library, home.join("lib/libnvshmem_device.a"));
        let req = t.apply(CompileRequest::new("k.cu", "", "sm_90a"));
        let opts = req.options();
        assert!(opts.contains(&"-rdc=true".to_string()) && opts.contains(&"-default-device".to_string()), "{opts:?}");
        assert!(opts.contains(&format!("-I{}", home.join("include").display())), "{opts:?}");
        let missing_cuda = NvshmemToolchain::locate(&home, Some(Path::new("/nonexistent/cuda"))).unwrap_err().to_string();
        assert!(missing_cuda.contains("cuda_runtime.h"), "{missing_cuda}");
        let _ = std::fs::remove_dir_all(&root);
    }
}
