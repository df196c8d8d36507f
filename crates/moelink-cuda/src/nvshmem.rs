//! NVSHMEM, the engine under the internode transport's `nvshmem` backend: where its files are and which
//! version they are ([`NvshmemToolchain`]), the process's one PE ([`Nvshmem::init`], unique-id bootstrap
//! through the caller's all-gather), symmetric-heap memory ([`NvshmemHeap`]), module registration and the
//! explicit finalize.
//!
//! Nothing here runs unless an internode buffer asks for the `nvshmem` transport; single-node use never loads
//! NVSHMEM. Facts the design rests on (NVSHMEM 3.4.5, the version torch 2.11 pins; NVSHMEM's sources):
//! - `nvshmemx_hostlib_init_attr` can return 0 without having initialised the device side: success is
//!   `nvshmemx_init_status()` of 2 (3 or 4 when PEs share a GPU, without or with CUDA MPS), checked after
//!   every init.
//! - Versions: the kernels are compiled against the headers of [`NvshmemToolchain::home`] and linked with its
//!   `libnvshmem_device.a`; the host library fills the device state they read. Its version
//!   (`nvshmemx_vendor_get_version_info`, compiled into the library and callable before init) must be the
//!   headers' (`include/non_abi/nvshmem_version.h`): [`Nvshmem::init`] checks it before anything is
//!   initialised and refuses another with [`Error::NvshmemVersion`].
//! - One PE per process at a time. Handles ([`Nvshmem`], and every [`NvshmemHeap`], which holds one) count
//!   the users; when the last goes away, after the heap memory was freed, the runtime is finalised
//!   (`nvshmemx_hostlib_finalize`, the host-library form of `nvshmem_finalize` that pairs with
//!   `nvshmemx_hostlib_init_attr`), and a later buffer initialises NVSHMEM again, with its own settings and
//!   ranks. NVSHMEM's own `atexit` handler only closes its bootstrap; it does not finalise.
//! - `nvshmem_free` and the finalize both start with a barrier of every PE that has no deadline (the device
//!   barrier `nvshmemi_barrier_all`, then, in finalize, the bootstrap's barrier): with a dead or wedged PE
//!   they never return. So memory a peer may no longer take part in freeing is leaked
//!   ([`NvshmemHeap::leak`]: a rank masked in shrink mode, a poisoned buffer, kernels that did not finish),
//!   and leaking it **pins** the runtime: it is never finalised in this process (the GPU memory and the
//!   NIC's resources go back when the process exits), and later buffers must use the same PEs.
//! - NVSHMEM reads its configuration (transport, QPs, NIC selection, ...) from `NVSHMEM_*` environment
//!   variables when it initialises: [`Nvshmem::init`] sets the ones it is given just before. A buffer that
//!   joins a runtime already initialised must ask for the same ones.
//! - It picks the GPU of the context current at init: the caller's device is bound first, and again for
//!   every later call that may touch the GPU (free, module registration, finalize), from whichever thread.

use std::collections::HashMap;
use std::ffi::c_void;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use crate::device::Device;
use crate::error::{Error, Result};
use crate::jit::CompileRequest;
use crate::module::Module;
use crate::raw::nvshmem::{self as sys, InitAttr, UniqueId};
use crate::symmetric::Exchange;

/// An NVSHMEM version, `major.minor.patch`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct NvshmemVersion {
    /// `NVSHMEM_VENDOR_MAJOR_VERSION`.
    pub major: u32,
    /// `NVSHMEM_VENDOR_MINOR_VERSION`.
    pub minor: u32,
    /// `NVSHMEM_VENDOR_PATCH_VERSION`.
    pub patch: u32,
}

impl NvshmemVersion {
    /// The oldest NVSHMEM whose host interface moelink's bindings follow (unique-id bootstrap structs of 3.4).
    pub const MIN: NvshmemVersion = NvshmemVersion { major: 3, minor: 4, patch: 0 };
    /// The version moelink is tested with (what torch 2.11 pins), the one install hints name.
    pub const TESTED: NvshmemVersion = NvshmemVersion { major: 3, minor: 4, patch: 5 };

    /// The version `nvshmem_version.h` (the text of the header) defines, if it defines all three parts.
    ///
    /// ```
    /// # use moelink_cuda::NvshmemVersion;
    /// let h = "#define NVSHMEM_VENDOR_MAJOR_VERSION 3\n#define NVSHMEM_VENDOR_MINOR_VERSION 4\n#define NVSHMEM_VENDOR_PATCH_VERSION 5\n";
    /// assert_eq!(NvshmemVersion::from_header(h).map(|v| v.to_string()), Some("3.4.5".to_string()));
    /// ```
    pub fn from_header(text: &str) -> Option<NvshmemVersion> {
        let part = |name: &str| -> Option<u32> {
            text.lines().find_map(|line| {
                let mut words = line.split_whitespace();
                (words.next() == Some("#define") && words.next() == Some(name)).then(|| words.next()?.parse().ok()).flatten()
            })
        };
        Some(NvshmemVersion {
            major: part("NVSHMEM_VENDOR_MAJOR_VERSION")?,
            minor: part("NVSHMEM_VENDOR_MINOR_VERSION")?,
            patch: part("NVSHMEM_VENDOR_PATCH_VERSION")?,
        })
    }
}

impl std::fmt::Display for NvshmemVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

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
    /// The version of the headers (`include/non_abi/nvshmem_version.h`): what the kernels are compiled and
    /// linked for, and what the host library must report.
    pub version: NvshmemVersion,
}

impl NvshmemToolchain {
    /// Finds NVSHMEM under `home` (and its version) and the CUDA headers under `cuda_home` (`include/`,
    /// `include/cccl/`), or when that is `None`, in `/usr/local/cuda` or beside a pip-installed NVSHMEM
    /// (`nvidia/cu13/include`, the `nvidia-cuda-runtime` and `nvidia-cuda-cccl` wheels). The error says what
    /// is missing and what to install.
    pub fn locate(home: &Path, cuda_home: Option<&Path>) -> Result<NvshmemToolchain> {
        let install = format!(
            "install NVSHMEM {v} (`pip install nvidia-nvshmem-cu13=={v}`) and point RdmaOptions::nvshmem_home (NVSHMEM_HOME for \
             the moelink command, moelink-stress and the Python package) at its nvidia/nvshmem folder",
            v = NvshmemVersion::TESTED
        );
        let need = |p: PathBuf, what: &str| -> Result<PathBuf> {
            if p.exists() {
                Ok(p)
            } else {
                Err(Error::Nvshmem(format!("{} not found ({what}); {install}", p.display())))
            }
        };
        let include = need(home.join("include").join("nvshmem.h"), "NVSHMEM's headers")?;
        let version_header = need(home.join("include").join("non_abi").join("nvshmem_version.h"), "NVSHMEM's version header")?;
        let device_library = need(home.join("lib").join("libnvshmem_device.a"), "NVSHMEM's device library")?;
        let host_library = need(home.join("lib").join("libnvshmem_host.so.3"), "NVSHMEM's host library")?;
        let version = std::fs::read_to_string(&version_header).map_err(|e| Error::io("reading", &version_header, e)).and_then(|text| {
            NvshmemVersion::from_header(&text).ok_or_else(|| {
                Error::Nvshmem(format!("{} does not define NVSHMEM_VENDOR_MAJOR/MINOR/PATCH_VERSION; {install}", version_header.display()))
            })
        })?;
        if version < NvshmemVersion::MIN {
            return Err(Error::Nvshmem(format!(
                "{} is NVSHMEM {version}; moelink needs {}.{} or newer: {install}",
                home.display(),
                NvshmemVersion::MIN.major,
                NvshmemVersion::MIN.minor
            )));
        }
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
        Ok(NvshmemToolchain { home: home.to_path_buf(), include_dirs, device_library, host_library, version })
    }

    /// `req` compiled against NVSHMEM: its include directories and the device library to link.
    pub fn apply(&self, mut req: CompileRequest) -> CompileRequest {
        for d in &self.include_dirs {
            req = req.include_dir(d.clone());
        }
        req.device_library(self.device_library.clone())
    }

    /// Checks that `library` (a host library, reporting `library_version`) is the NVSHMEM the kernels are
    /// compiled and linked for: the same `major.minor.patch` as this installation's headers. (NVSHMEM itself
    /// accepts a host library of a later minor version; moelink accepts the pairing it builds and tests, one
    /// version for both sides.)
    pub fn check_library_version(&self, library: &Path, library_version: NvshmemVersion) -> Result<()> {
        if library_version == self.version {
            return Ok(());
        }
        Err(Error::NvshmemVersion {
            library: library.display().to_string(),
            library_version: library_version.to_string(),
            home: self.home.display().to_string(),
            kernel_version: self.version.to_string(),
        })
    }
}

/// The process's NVSHMEM runtime, shared by every handle.
struct Runtime {
    api: sys::Api,
    /// The GPU it was initialised on (bound again for free, registration and finalize).
    device: Device,
    pe: usize,
    num_pes: usize,
    version: NvshmemVersion,
    home: PathBuf,
    host_library: PathBuf,
    /// The `NVSHMEM_*` settings it was initialised with.
    env: Vec<(String, String)>,
    /// Modules registered (`nvshmemx_cumodule_init`), by raw handle; held so that they stay loaded until
    /// they are unregistered at finalize.
    registered: Mutex<HashMap<usize, Module>>,
}

/// Who still uses the runtime, and whether it may ever be finalised.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Users {
    count: usize,
    /// Set once memory was leaked because a peer might not take part in a collective again: finalize (a
    /// barrier of every PE) could then wait forever.
    pinned: bool,
}

impl Users {
    fn acquire(&mut self) {
        self.count += 1;
    }

    fn pin(&mut self) {
        self.pinned = true;
    }

    /// One user fewer; true when that was the last and the runtime is to be finalised now.
    fn release(&mut self) -> bool {
        if self.count == 0 {
            return false;
        }
        self.count -= 1;
        self.count == 0 && !self.pinned
    }
}

/// The initialised runtime and its users; `None` before the first init and after a finalize. Held across
/// init and finalize, so that neither overlaps the other.
struct Live {
    rt: Arc<Runtime>,
    users: Users,
}

static LIVE: Mutex<Option<Live>> = Mutex::new(None);

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A handle to the process's NVSHMEM PE. Every handle (clones, and the one each [`NvshmemHeap`] holds) is a
/// user; when the last is dropped the runtime is finalised, unless it was pinned ([`Nvshmem::pin`]). Since
/// finalize is collective (it waits for every PE), drop the last handle on every PE alike, as buffers are.
pub struct Nvshmem {
    rt: Arc<Runtime>,
}

impl std::fmt::Debug for Nvshmem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Nvshmem(PE {} of {}, {})", self.rt.pe, self.rt.num_pes, self.rt.version)
    }
}

impl Clone for Nvshmem {
    fn clone(&self) -> Nvshmem {
        if let Some(live) = lock(&LIVE).as_mut().filter(|l| Arc::ptr_eq(&l.rt, &self.rt)) {
            live.users.acquire();
        }
        Nvshmem { rt: self.rt.clone() }
    }
}

impl Drop for Nvshmem {
    fn drop(&mut self) {
        let mut live = lock(&LIVE);
        let last = match live.as_mut() {
            Some(l) if Arc::ptr_eq(&l.rt, &self.rt) => l.users.release(),
            _ => false,
        };
        if last {
            *live = None;
            // Still under the lock: a new init waits until this PE has left the old job.
            finalize(&self.rt);
        }
    }
}

/// Leaves the NVSHMEM job: unregisters the modules, then `nvshmemx_hostlib_finalize` (collective: a
/// barrier of every PE, then the teardown of heap, transports and bootstrap). Errors inside are NVSHMEM's
/// to report (it prints and exits the process on a failed finalize).
fn finalize(rt: &Runtime) {
    let _g = rt.device.bind_scoped();
    for (raw, _module) in lock(&rt.registered).drain() {
        // SAFETY: a module registered with this runtime, still loaded (the map held it until now).
        let _ = unsafe { (rt.api.cumodule_finalize)(raw as *mut c_void) };
    }
    // SAFETY: initialised by this runtime's init (its only init), finalised once: `LIVE` no longer names it.
    unsafe { (rt.api.hostlib_finalize)() };
}

/// `major.minor.patch` as the library reports it.
fn library_version(api: &sys::Api) -> NvshmemVersion {
    let (mut a, mut b, mut c) = (0, 0, 0);
    // SAFETY: three valid out-pointers; the function returns constants compiled into the library (no init
    // needed).
    unsafe { (api.vendor_version)(&mut a, &mut b, &mut c) };
    let part = |x: i32| u32::try_from(x).unwrap_or(0);
    NvshmemVersion { major: part(a), minor: part(b), patch: part(c) }
}

/// The toolchain's host library, loaded, if it is the toolchain's version.
fn open_checked(toolchain: &NvshmemToolchain) -> Result<sys::Api> {
    let api = sys::open(&toolchain.host_library)?;
    toolchain.check_library_version(&toolchain.host_library, library_version(&api))?;
    Ok(api)
}

impl Nvshmem {
    /// Initialises NVSHMEM for this process as PE `ex.rank` of `ex.num_ranks` (collective: every rank calls
    /// it), on `device`, with `env` (`NVSHMEM_*` settings) applied first, or joins the runtime that is
    /// already initialised (same ranks, same settings, same version). Rank 0 creates the unique id and
    /// `ex.all_gather` hands it to the others. The host library must be the toolchain's version
    /// ([`NvshmemToolchain::check_library_version`]), checked on every rank before the exchange.
    pub fn init<E: From<Error>>(
        toolchain: &NvshmemToolchain,
        device: &Device,
        env: &[(String, String)],
        ex: &Exchange<'_, E>,
    ) -> Result<Nvshmem, E> {
        let mut live = lock(&LIVE);
        if let Some(l) = live.as_mut() {
            let rt = &l.rt;
            // Why the running job cannot be left for a new one: buffers still use it, or it is pinned.
            let held = if l.users.pinned {
                "for the rest of its life (a buffer leaked its memory after a peer failed, and NVSHMEM cannot leave a job with a \
                 missing PE)"
            } else {
                "while internode buffers use it"
            };
            if rt.pe != ex.rank || rt.num_pes != ex.num_ranks {
                return Err(Error::Nvshmem(format!(
                    "this process is NVSHMEM PE {} of {} {held}; a process holds one PE at a time, so this buffer must span the same \
                     ranks (asked: rank {} of {})",
                    rt.pe, rt.num_pes, ex.rank, ex.num_ranks
                ))
                .into());
            }
            // The running library against this buffer's kernels (another installation, another version).
            toolchain.check_library_version(&rt.host_library, rt.version)?;
            if rt.env != env {
                return Err(Error::Nvshmem(format!(
                    "NVSHMEM is initialised in this process with {:?} {held}, and reads its settings only when it initialises; \
                     this buffer asks for {env:?}: give it the same RDMA options",
                    rt.env
                ))
                .into());
            }
            l.users.acquire();
            return Ok(Nvshmem { rt: rt.clone() });
        }
        let api = open_checked(toolchain);
        // Every rank takes part in the exchange even when its own load or check failed, so that nobody waits
        // for it.
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
        let rt = Arc::new(Runtime {
            version: library_version(&api),
            api,
            device: device.clone(),
            pe,
            num_pes,
            home: toolchain.home.clone(),
            host_library: toolchain.host_library.clone(),
            env: env.to_vec(),
            registered: Mutex::new(HashMap::new()),
        });
        let mut users = Users::default();
        users.acquire();
        *live = Some(Live { rt: rt.clone(), users });
        Ok(Nvshmem { rt })
    }

    /// This process's PE.
    pub fn pe(&self) -> usize {
        self.rt.pe
    }

    /// PEs in the job.
    pub fn num_pes(&self) -> usize {
        self.rt.num_pes
    }

    /// NVSHMEM's version, as the host library reports it (the toolchain's: checked at init).
    pub fn version(&self) -> NvshmemVersion {
        self.rt.version
    }

    /// The installation this PE was loaded from.
    pub fn home(&self) -> &Path {
        &self.rt.home
    }

    /// Keeps the runtime initialised for the rest of the process: it is never finalised, whatever handles
    /// are dropped. For when a peer may be gone or wedged (finalize would wait for it forever);
    /// [`NvshmemHeap::leak`] calls it.
    pub fn pin(&self) {
        if let Some(live) = lock(&LIVE).as_mut().filter(|l| Arc::ptr_eq(&l.rt, &self.rt)) {
            live.users.pin();
        }
    }

    /// Allocates `bytes` of symmetric heap (collective: every PE allocates the same size, in the same order).
    /// The allocation holds a handle: the runtime outlives it.
    pub fn alloc(&self, bytes: usize) -> Result<NvshmemHeap> {
        let _g = self.rt.device.bind_scoped()?;
        // SAFETY: initialised (a handle exists only after init succeeded, and keeps it from being finalised);
        // collective by contract.
        let p = unsafe { (self.rt.api.malloc)(bytes.max(1)) };
        if p.is_null() {
            return Err(Error::Nvshmem(format!(
                "nvshmem_malloc({bytes}) failed on PE {}: the symmetric heap is too small (set NVSHMEM_SYMMETRIC_SIZE, e.g. 4G)",
                self.rt.pe
            )));
        }
        Ok(NvshmemHeap { nvshmem: self.clone(), ptr: p as u64, len: bytes, leaked: false })
    }

    /// Registers `module`'s NVSHMEM device state (`nvshmemx_cumodule_init`); once per module and runtime
    /// (a module registered with a runtime since finalised is registered again).
    pub fn register(&self, module: &Module) -> Result<()> {
        let raw = module.raw_handle() as usize;
        let mut done = lock(&self.rt.registered);
        if done.contains_key(&raw) {
            return Ok(());
        }
        let _g = module.device().bind_scoped()?;
        // SAFETY: a live module of a context NVSHMEM was initialised on; registration fills its device state.
        let rc = unsafe { (self.rt.api.cumodule_init)(raw as *mut c_void) };
        if rc != 0 {
            return Err(Error::Nvshmem(format!(
                "nvshmemx_cumodule_init returned {rc} (was the kernel linked against {}?)",
                self.rt.home.display()
            )));
        }
        done.insert(raw, module.clone());
        Ok(())
    }

    /// Host-side barrier of every PE (collective).
    pub fn barrier_all(&self) {
        let _g = self.rt.device.bind_scoped();
        // SAFETY: initialised; collective by contract.
        unsafe { (self.rt.api.barrier_all)() }
    }

    /// The address through which this PE can load/store `pe`'s copy of the heap object at `addr` (P2P),
    /// or `None` when `pe` is reachable only through the network.
    pub fn peer_address(&self, addr: crate::DevPtr, pe: usize) -> Option<crate::DevPtr> {
        // SAFETY: initialised; `addr` is checked by NVSHMEM (NULL for non-heap addresses).
        let p = unsafe { (self.rt.api.ptr)(addr.addr() as *const c_void, pe as i32) };
        (!p.is_null()).then_some(crate::DevPtr::from_raw(p as u64))
    }
}

/// Memory of the NVSHMEM symmetric heap: the same offset on every PE. Freed on drop (`nvshmem_free` is
/// collective: drop it on every PE), unless leaked ([`NvshmemHeap::leak`]). Holds a handle to the runtime,
/// released after the free.
pub struct NvshmemHeap {
    nvshmem: Nvshmem,
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
    pub fn device_ptr(&self) -> crate::DevPtr {
        crate::DevPtr::from_raw(self.ptr)
    }

    /// Bytes.
    pub fn len_bytes(&self) -> usize {
        self.len
    }

    /// Bytes `[offset, offset + bytes)` of this PE's copy on `device`, borrowed mutably.
    pub fn span_mut(&mut self, device: &Device, offset: usize, bytes: usize) -> Result<crate::memory::DeviceSpanMut<'_>> {
        crate::memory::span_of("span_mut", self.ptr, self.len, device.ordinal(), offset, bytes)
    }

    /// Fills this PE's copy with zeros (on a private stream; done when it returns).
    pub fn zero(&self, device: &Device) -> Result<()> {
        let stream = crate::stream::Stream::new(device)?;
        let _g = device.bind_scoped()?;
        // SAFETY: `[ptr, ptr + len)` is this PE's heap allocation on `device`, alive while `self` is.
        unsafe { crate::raw::driver::memset_d8_async(self.ptr, 0, self.len, stream.raw())? };
        stream.synchronize()
    }

    /// Copies `dst.len()` bytes of this PE's copy from byte `offset` (on a private stream; done when it
    /// returns). For diagnostics: it races with kernels still writing there.
    pub fn copy_to_host_at(&self, device: &Device, offset: usize, dst: &mut [u8]) -> Result<()> {
        if offset.checked_add(dst.len()).is_none_or(|end| end > self.len) {
            return Err(crate::Error::InvalidArgument(format!(
                "copy_to_host_at: {} bytes at {offset} outside the heap's {} bytes",
                dst.len(),
                self.len
            )));
        }
        let stream = crate::stream::Stream::new(device)?;
        let _g = device.bind_scoped()?;
        // SAFETY: `[ptr + offset, + dst.len())` lies in this PE's heap allocation (checked above), alive while
        // `self` is; `dst` outlives the copy, which is synchronised before returning.
        unsafe { crate::raw::driver::memcpy_dtoh_async(dst.as_mut_ptr(), self.ptr + offset as u64, dst.len(), stream.raw())? };
        stream.synchronize()
    }

    /// Keeps the memory when dropped (a peer may still write into it, or a collective free could wait for a
    /// dead PE), and pins the runtime ([`Nvshmem::pin`]): its finalize would wait for that PE too.
    pub fn leak(&mut self) {
        self.leaked = true;
        self.nvshmem.pin();
    }
}

impl Drop for NvshmemHeap {
    fn drop(&mut self) {
        if !self.leaked {
            let _g = self.nvshmem.rt.device.bind_scoped();
            // SAFETY: allocated by nvshmem_malloc of this runtime, which `self.nvshmem` keeps initialised;
            // freed once; collective by contract.
            unsafe { (self.nvshmem.rt.api.free)(self.ptr as *mut c_void) };
        }
        // `self.nvshmem` is released after this: the last user finalises after the free.
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

    /// NVSHMEM's `nvshmem_version.h` for `v` (the defines moelink reads, among others it ignores).
    fn version_header(v: &str) -> String {
        let p: Vec<&str> = v.split('.').collect();
        format!(
            "#pragma once\n#define NVSHMEM_VENDOR_MAJOR_VERSION {}\n#define NVSHMEM_VENDOR_MINOR_VERSION {}\n\
             #define NVSHMEM_VENDOR_PATCH_VERSION {}\n#define NVSHMEM_VENDOR_PACKAGE_VERSION 0\n\
             #define NVSHMEM_TRANSPORT_PLUGIN_MAJOR_VERSION 3\n",
            p[0], p[1], p[2]
        )
    }

    /// A pip-style layout (`nvidia/nvshmem`, `nvidia/cu13/include`) of NVSHMEM `version` under a fresh folder.
    fn pip_layout(tag: &str, version: &str) -> (PathBuf, PathBuf, PathBuf) {
        let root = std::env::temp_dir().join(format!("moelink-nvshmem-{tag}-{}", std::process::id()));
        let home = root.join("nvidia").join("nvshmem");
        let cu13 = root.join("nvidia").join("cu13").join("include");
        for d in [home.join("include/non_abi"), home.join("lib"), cu13.join("cccl")] {
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
        std::fs::write(home.join("include/non_abi/nvshmem_version.h"), version_header(version)).unwrap();
        (root, home, cu13)
    }

    #[test]
    fn locate_finds_a_pip_layout() {
        let (root, home, cu13) = pip_layout("layout", "3.4.5");
        let t = NvshmemToolchain::locate(&home, Some(&root.join("nvidia").join("cu13"))).unwrap();
        assert_eq!(t.include_dirs, vec![home.join("include"), cu13.clone(), cu13.join("cccl")]);
        assert_eq!(t.device_library, home.join("lib/libnvshmem_device.a"));
        assert_eq!(t.version, NvshmemVersion { major: 3, minor: 4, patch: 5 });
        let req = t.apply(CompileRequest::new("k.cu", "", "sm_90a"));
        let opts = req.options();
        assert!(opts.contains(&"-rdc=true".to_string()) && opts.contains(&"-default-device".to_string()), "{opts:?}");
        assert!(opts.contains(&format!("-I{}", home.join("include").display())), "{opts:?}");
        let missing_cuda = NvshmemToolchain::locate(&home, Some(Path::new("/nonexistent/cuda"))).unwrap_err().to_string();
        assert!(missing_cuda.contains("cuda_runtime.h"), "{missing_cuda}");
        let _ = std::fs::remove_dir_all(&root);
    }

    #[test]
    fn versions_are_read_from_the_headers_and_checked() {
        let (root, home, _) = pip_layout("versions", "3.4.5");
        let cuda = Some(root.join("nvidia").join("cu13"));
        let t = NvshmemToolchain::locate(&home, cuda.as_deref()).unwrap();
        // The same version: accepted.
        t.check_library_version(&t.host_library, NvshmemVersion::TESTED).unwrap();
        // A host library of a later release (PyPI has them): a typed error naming both versions and the fix.
        let later = NvshmemVersion { major: 3, minor: 5, patch: 19 };
        let e = t.check_library_version(Path::new("/elsewhere/libnvshmem_host.so.3"), later).unwrap_err();
        match &e {
            Error::NvshmemVersion { library, library_version, home: h, kernel_version } => {
                assert_eq!(
                    (library.as_str(), library_version.as_str(), kernel_version.as_str()),
                    ("/elsewhere/libnvshmem_host.so.3", "3.5.19", "3.4.5")
                );
                assert_eq!(h, &home.display().to_string());
            }
            other => panic!("not a version error: {other:?}"),
        }
        let msg = e.to_string();
        assert!(msg.contains("pip install nvidia-nvshmem-cu13==3.4.5") && msg.contains("3.5.19") && msg.contains("nvshmem_home"), "{msg}");
        // An older patch release differs too: one version for both sides.
        assert!(t.check_library_version(&t.host_library, NvshmemVersion { major: 3, minor: 4, patch: 1 }).is_err());

        // Headers older than moelink's bindings, or without the version defines: refused at locate.
        std::fs::write(home.join("include/non_abi/nvshmem_version.h"), version_header("3.3.9")).unwrap();
        let e = NvshmemToolchain::locate(&home, cuda.as_deref()).unwrap_err().to_string();
        assert!(e.contains("3.3.9") && e.contains("3.4 or newer") && e.contains("nvidia-nvshmem-cu13==3.4.5"), "{e}");
        std::fs::write(home.join("include/non_abi/nvshmem_version.h"), "#pragma once\n").unwrap();
        let e = NvshmemToolchain::locate(&home, cuda.as_deref()).unwrap_err().to_string();
        assert!(e.contains("NVSHMEM_VENDOR_MAJOR/MINOR/PATCH_VERSION"), "{e}");
        std::fs::remove_file(home.join("include/non_abi/nvshmem_version.h")).unwrap();
        let e = NvshmemToolchain::locate(&home, cuda.as_deref()).unwrap_err().to_string();
        assert!(e.contains("nvshmem_version.h not found"), "{e}");
        let _ = std::fs::remove_dir_all(&root);

        assert_eq!(NvshmemVersion::from_header(&version_header("3.10.2")).map(|v| v.to_string()), Some("3.10.2".into()));
        assert!(NvshmemVersion { major: 3, minor: 10, patch: 0 } > NvshmemVersion { major: 3, minor: 4, patch: 5 });
    }

    #[test]
    fn the_last_user_finalises_unless_the_runtime_is_pinned() {
        // Two users (a buffer's domain and its heap): the first release keeps the runtime, the last finalises.
        let mut u = Users::default();
        u.acquire();
        u.acquire();
        assert!(!u.release());
        assert!(u.release(), "the last user finalises");
        // Reused after a finalize: counts from zero again.
        u = Users::default();
        u.acquire();
        assert!(u.release());
        // A leaked heap pins it: no release finalises, not even the last, however many come and go after.
        let mut u = Users::default();
        u.acquire();
        u.acquire();
        u.pin();
        assert!(!u.release());
        assert!(!u.release());
        u.acquire();
        assert!(!u.release());
        assert_eq!(u, Users { count: 0, pinned: true });
        // A release too many (never by the handles, which pair acquire and release) finalises nothing.
        let mut none = Users::default();
        assert!(!none.release());
        assert_eq!(none.count, 0);
    }

    /// The real host library (`NVSHMEM_HOME`, as `scripts/ci-nvrtc-env.sh` installs it from PyPI) loads
    /// without a GPU and reports its headers' version; a toolchain that claims another version is refused
    /// with the typed error. Skipped without `NVSHMEM_HOME`, unless `MOELINK_REQUIRE_NVSHMEM=1`.
    #[test]
    fn the_installed_host_library_reports_its_headers_version() {
        let required = std::env::var("MOELINK_REQUIRE_NVSHMEM").as_deref() == Ok("1");
        let Some(home) = std::env::var_os("NVSHMEM_HOME").map(PathBuf::from) else {
            assert!(!required, "MOELINK_REQUIRE_NVSHMEM=1 but NVSHMEM_HOME is not set");
            eprintln!("skipped: NVSHMEM_HOME is not set");
            return;
        };
        // MOELINK_TEST_CUDA_HOME: what scripts/ci-nvrtc-env.sh sets in place of CUDA_HOME (compile_all.rs says why).
        let cuda = std::env::var_os("MOELINK_TEST_CUDA_HOME").or_else(|| std::env::var_os("CUDA_HOME")).map(PathBuf::from);
        let t = NvshmemToolchain::locate(&home, cuda.as_deref()).unwrap();
        let api = open_checked(&t).unwrap();
        assert_eq!(library_version(&api), t.version, "{}", t.host_library.display());
        let newer = NvshmemToolchain { version: NvshmemVersion { minor: t.version.minor + 1, ..t.version }, ..t.clone() };
        match open_checked(&newer) {
            Err(Error::NvshmemVersion { library_version, kernel_version, .. }) => {
                assert_eq!((library_version, kernel_version), (t.version.to_string(), newer.version.to_string()));
            }
            Err(e) => panic!("not a version error: {e}"),
            Ok(_) => panic!("a toolchain of NVSHMEM {} accepted a {} library", newer.version, t.version),
        }
    }
}
