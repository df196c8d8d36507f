//! Loaded CUBIN modules, their kernels, and launches through `cuLaunchKernelEx`.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use bytemuck::NoUninit;

use crate::device::{same_device, Device};
use crate::error::{Error, Result};
use crate::raw::driver::{self as drv, CUfunction, CUmodule, FuncAttr, RawLaunch};
use crate::stream::Stream;

struct ModuleInner {
    device: Device,
    raw: CUmodule,
}

// SAFETY: module handles may be used from any thread; the module is only unloaded in Drop.
unsafe impl Send for ModuleInner {}
// SAFETY: as above.
unsafe impl Sync for ModuleInner {}

impl Drop for ModuleInner {
    fn drop(&mut self) {
        if let Ok(_g) = self.device.bind_scoped() {
            // SAFETY: loaded in Module::load; every Kernel holds an Arc to this, so none outlives the unload.
            let _ = unsafe { drv::module_unload(self.raw) };
        }
    }
}

/// A CUBIN loaded into a device's primary context. Cheap to clone.
#[derive(Clone)]
pub struct Module {
    inner: Arc<ModuleInner>,
    /// `(name expression, symbol)` of kernels with a C++ name ([`crate::jit::Compiled::lowered_names`]).
    names: Arc<Vec<(String, String)>>,
}

impl std::fmt::Debug for Module {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Module(GPU {})", self.inner.device.ordinal())
    }
}

impl Module {
    /// Loads a CUBIN (from [`crate::jit`]) on `device`, every function of it at once (not at its first
    /// launch, as lazy loading would). PTX is refused: moelink ships machine code only, because a newer
    /// NVRTC's PTX can be too new for the installed driver.
    pub fn load(device: &Device, cubin: &[u8]) -> Result<Module> {
        if cubin.len() < 4 || cubin[..4] != [0x7f, b'E', b'L', b'F'] {
            return Err(Error::invalid("Module::load expects a CUBIN (ELF) image, not PTX or other data"));
        }
        let _g = device.bind_scoped()?;
        // SAFETY: context current; `cubin` is a complete ELF image that the driver parses and copies.
        let raw = unsafe { drv::module_load_data(cubin)? };
        let module = Module { inner: Arc::new(ModuleInner { device: device.clone(), raw }), names: Arc::default() };
        // SAFETY: live module (unloaded by `module`'s drop if this fails).
        unsafe { drv::module_load_functions(raw)? };
        Ok(module)
    }

    /// Loads a CUBIN on `device` once per process: later calls with the same `key` (a digest of the image,
    /// e.g. [`crate::jit::Compiled::key`]) on the same GPU return the module loaded first, which then stays
    /// loaded until the process exits.
    ///
    /// Why: loading a module synchronises the device's context. Ranks that share a GPU in one process
    /// share its context, and a rank's collective kernel spins until its peers' kernels run; a peer that
    /// loaded its own copy of the module at that moment would wait for that kernel, and both would wait out
    /// their deadline. With one module per process, only the first rank to reach a kernel variant loads it
    /// (before its own launch), and [`Module::load`] loads every function with the module, so no launch does.
    /// `names` as in [`Module::with_names`].
    pub fn load_shared(device: &Device, key: &str, cubin: &[u8], names: &[(String, String)]) -> Result<Module> {
        type Loaded = Mutex<HashMap<(usize, String), Module>>;
        static LOADED: std::sync::OnceLock<Loaded> = std::sync::OnceLock::new();
        let mut loaded = LOADED.get_or_init(Default::default).lock().unwrap_or_else(|p| p.into_inner());
        let slot = (device.ordinal(), key.to_string());
        if let Some(m) = loaded.get(&slot) {
            return Ok(m.clone());
        }
        let m = Module::load(device, cubin)?.with_names(names);
        loaded.insert(slot, m.clone());
        Ok(m)
    }

    /// The same module, finding kernels also by the C++ names in `names` (`(name expression, symbol)`, as
    /// [`crate::jit::Compiled::lowered_names`] gives them).
    pub fn with_names(self, names: &[(String, String)]) -> Module {
        Module { inner: self.inner, names: Arc::new(names.to_vec()) }
    }

    /// The kernel named `name`: a name expression the module was given (`ns::kernel`), or a symbol (an
    /// `extern "C"` function's name).
    pub fn kernel(&self, name: &str) -> Result<Kernel> {
        let symbol = self.names.iter().find(|(e, _)| e == name).map_or(name, |(_, s)| s.as_str());
        let _g = self.inner.device.bind_scoped()?;
        // SAFETY: live module; function handles stay valid while the module (held by the Kernel) is loaded.
        let (raw, param_sizes, max_dynamic_smem) = unsafe {
            let f = drv::module_get_function(self.inner.raw, symbol)?;
            (f, drv::func_param_sizes(f)?, drv::func_get_attribute(f, FuncAttr::MaxDynamicSharedSizeBytes)?)
        };
        Ok(Kernel {
            module: self.inner.clone(),
            raw,
            name: name.to_string(),
            param_sizes,
            max_dynamic_smem: Arc::new(AtomicU32::new(max_dynamic_smem.max(0) as u32)),
        })
    }

    /// The device the module is loaded on.
    pub fn device(&self) -> &Device {
        &self.inner.device
    }

    /// The kernel named `name` (as [`Module::kernel`]), typed by its parameters `A`: checked here to take
    /// parameters of the sizes `A` gives ([`KernelParams::param_sizes`]), and launched safely.
    pub fn typed<A: KernelParams>(&self, name: &str) -> Result<TypedKernel<A>> {
        self.kernel(name)?.typed()
    }

    /// The raw `CUmodule` (for libraries that register modules, e.g. NVSHMEM).
    pub(crate) fn raw_handle(&self) -> CUmodule {
        self.inner.raw
    }
}

/// Resource use of a loaded kernel as the driver reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelAttributes {
    /// Registers per thread.
    pub num_regs: u32,
    /// Local memory per thread (stack frame + spills), bytes. Hot kernels must have 0.
    pub local_bytes: u32,
    /// Static shared memory, bytes.
    pub static_smem_bytes: u32,
    /// Largest block this kernel can be launched with.
    pub max_threads_per_block: u32,
}

/// One kernel of a loaded [`Module`]. Keeps the module loaded. Knows the byte size of each of its
/// parameters (from the driver), and checks every launch's arguments against them.
#[derive(Clone)]
pub struct Kernel {
    module: Arc<ModuleInner>,
    raw: CUfunction,
    name: String,
    param_sizes: Vec<usize>,
    max_dynamic_smem: Arc<AtomicU32>,
}

// SAFETY: CUfunction handles may be used from any thread while their module is loaded (held by `module`).
unsafe impl Send for Kernel {}
// SAFETY: as above; the only mutable state is an atomic.
unsafe impl Sync for Kernel {}

impl std::fmt::Debug for Kernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Kernel({} on GPU {}, params {:?})", self.name, self.module.device.ordinal(), self.param_sizes)
    }
}

impl Kernel {
    /// The kernel's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Byte sizes of the kernel's parameters, in order.
    pub fn param_sizes(&self) -> &[usize] {
        &self.param_sizes
    }

    /// The device the kernel is loaded on.
    pub fn device(&self) -> &Device {
        &self.module.device
    }

    /// Registers, local memory and limits as the driver sees them.
    pub fn attributes(&self) -> Result<KernelAttributes> {
        let _g = self.module.device.bind_scoped()?;
        // SAFETY: live function handle.
        unsafe {
            Ok(KernelAttributes {
                num_regs: drv::func_get_attribute(self.raw, FuncAttr::NumRegs)? as u32,
                local_bytes: drv::func_get_attribute(self.raw, FuncAttr::LocalSizeBytes)? as u32,
                static_smem_bytes: drv::func_get_attribute(self.raw, FuncAttr::SharedSizeBytes)? as u32,
                max_threads_per_block: drv::func_get_attribute(self.raw, FuncAttr::MaxThreadsPerBlock)? as u32,
            })
        }
    }

    /// Allows launches with up to `bytes` of dynamic shared memory (above the default 48 KiB limit, up to the
    /// device's opt-in maximum).
    pub fn set_max_dynamic_smem(&self, bytes: u32) -> Result<()> {
        let optin = self.module.device.info().max_shared_memory_per_block_optin;
        if bytes as usize > optin {
            return Err(Error::invalid(format!("{}: {bytes} bytes of dynamic shared memory, the device allows {optin}", self.name)));
        }
        let _g = self.module.device.bind_scoped()?;
        // SAFETY: live function handle; the value is within the device limit.
        unsafe { drv::func_set_attribute(self.raw, FuncAttr::MaxDynamicSharedSizeBytes, bytes as i32)? };
        self.max_dynamic_smem.store(bytes, Ordering::Relaxed);
        Ok(())
    }

    /// Launches the kernel on `stream`.
    ///
    /// Checked here (typed errors, nothing launched): the stream's device, the number and byte sizes of the
    /// arguments against the kernel's parameters, the launch shape, cluster divisibility and the dynamic
    /// shared memory limit.
    ///
    /// # Safety
    /// The kernel trusts its arguments: every pointer among them must be valid for every access the kernel
    /// makes, for as long as the kernel runs, and values must mean what the kernel expects.
    pub unsafe fn launch(&self, stream: &Stream, cfg: &LaunchConfig, args: &KernelArgs) -> Result<()> {
        stream.mark_unchecked();
        self.launch_checked(stream, cfg, args)
    }

    /// [`Kernel::launch`] for [`TypedKernel::launch`], whose parameters the layer checked: the stream is not
    /// marked as having run unchecked work.
    unsafe fn launch_checked(&self, stream: &Stream, cfg: &LaunchConfig, args: &KernelArgs) -> Result<()> {
        if !self.module.device.same_as(stream.device()) {
            same_device(&format!("launch of {}", self.name), &self.module.device, stream.device())?;
        }
        self.check_args(args)?;
        self.check_config(cfg)?;
        let mut ptrs = args.pointers();
        let _g = self.module.device.bind_scoped()?;
        let raw = RawLaunch {
            grid: cfg.grid,
            block: cfg.block,
            dynamic_smem_bytes: cfg.dynamic_smem_bytes,
            cooperative: cfg.cooperative,
            cluster: cfg.cluster,
        };
        let timed = launch_timing::start();
        let launched = drv::launch_kernel_ex(self.raw, stream.raw(), &raw, &mut ptrs);
        launch_timing::stop(timed);
        launched
    }

    /// [`TypedKernel::launch`] without making a `TypedKernel`: checks the parameter sizes against `A`'s as
    /// [`Kernel::typed`] does, then launches (a launch per operation call keeps this path short).
    pub fn launch_typed<A: KernelParams>(&self, stream: &Stream, cfg: &LaunchConfig, params: &A) -> Result<()> {
        self.check_params::<A>()?;
        let args = params.args();
        // SAFETY: as in `TypedKernel::launch`: the sizes match A's, and A's `KernelParams` implementation says
        // these are its parameters with only CUDA-layer addresses inside.
        unsafe { self.launch_checked(stream, cfg, &args) }
    }

    /// This kernel typed by its parameters `A` (see [`KernelParams`]): errors unless its parameters have
    /// the byte sizes `A` gives.
    pub fn typed<A: KernelParams>(&self) -> Result<TypedKernel<A>> {
        self.check_params::<A>()?;
        Ok(TypedKernel { kernel: self.clone(), _params: std::marker::PhantomData })
    }

    /// Errors unless the kernel's parameters have the byte sizes `A` gives.
    fn check_params<A: KernelParams>(&self) -> Result<()> {
        let sizes = A::param_sizes();
        if self.param_sizes == sizes {
            return Ok(());
        }
        Err(Error::invalid(format!(
            "kernel `{}` takes {} parameter(s) of {:?} bytes, not the {:?} bytes of {}",
            self.name,
            self.param_sizes.len(),
            self.param_sizes,
            sizes,
            std::any::type_name::<A>()
        )))
    }

    fn check_args(&self, args: &KernelArgs) -> Result<()> {
        if args.spans.iter().map(|&(_, len)| len).eq(self.param_sizes.iter().copied()) {
            return Ok(());
        }
        let got: Vec<usize> = args.spans.iter().map(|&(_, len)| len).collect();
        Err(Error::invalid(format!(
            "kernel `{}` takes {} parameter(s) of {:?} bytes; the launch passed {} argument(s) of {:?} bytes",
            self.name,
            self.param_sizes.len(),
            self.param_sizes,
            got.len(),
            got
        )))
    }

    fn check_config(&self, cfg: &LaunchConfig) -> Result<()> {
        let bad = |why: String| Err(Error::invalid(format!("launch of `{}`: {why}", self.name)));
        if cfg.grid.contains(&0) || cfg.block.contains(&0) {
            return bad(format!("empty grid {:?} or block {:?}", cfg.grid, cfg.block));
        }
        let threads: u64 = cfg.block.iter().map(|&b| b as u64).product();
        let limit = self.module.device.info().max_threads_per_block as u64;
        if threads > limit {
            return bad(format!("block {:?} has {threads} threads, at most {limit}", cfg.block));
        }
        let smem_limit = self.max_dynamic_smem.load(Ordering::Relaxed);
        if cfg.dynamic_smem_bytes > smem_limit {
            return bad(format!(
                "{} bytes of dynamic shared memory, the kernel allows {smem_limit} (call set_max_dynamic_smem first)",
                cfg.dynamic_smem_bytes
            ));
        }
        if let Some(cluster) = cfg.cluster {
            if cluster.contains(&0) || cfg.grid.iter().zip(cluster.iter()).any(|(g, c)| g % c != 0) {
                return bad(format!("grid {:?} is not a multiple of cluster {:?}", cfg.grid, cluster));
            }
        }
        Ok(())
    }
}

/// A kernel's parameters as one Rust value: what [`TypedKernel::launch`] passes. Usually a `#[repr(C)]`
/// mirror of the one struct the kernel takes by value, whose methods are then [`KernelParams::one_struct_sizes`]
/// and [`KernelParams::one_struct`].
///
/// What a safe launch rests on, split between this layer and the kernel's:
/// - this layer checks the kernel's parameter list against the type ([`Kernel::typed`]: the byte size of
///   each parameter), the stream's device and the launch shape;
/// - every address in the type is a [`crate::DevPtr`] (or a [`crate::DevPtrs`] table), which only this layer
///   makes, from memory it allocated, mapped or was lent; so a kernel never receives an address that safe
///   code made up from a number;
/// - the owners of that memory keep it alive while work that uses it runs (device memory is freed in
///   stream order or after the device is idle; lent memory by the contract of [`crate::MemRef::from_raw`]);
/// - offsets, lengths and counts within the memory are the validating core's to check before a launch, and
///   the kernel's to respect.
///
/// # Safety
/// Implement it only for a type whose [`KernelParams::args`] are, in order and meaning, the parameters of the
/// kernels launched with it (for a struct passed by value: a `#[repr(C)]` mirror, field for field, whose
/// size the kernel source checks, e.g. with a `static_assert`), in which every device address is a `DevPtr`
/// or `DevPtrs` and no address travels as an integer.
pub unsafe trait KernelParams: Copy {
    /// Byte size of each kernel parameter, in order.
    fn param_sizes() -> Vec<usize>;
    /// The values of the parameters, in order.
    fn args(&self) -> KernelArgs;

    /// [`KernelParams::param_sizes`] of a kernel that takes `Self` as its one parameter.
    fn one_struct_sizes() -> Vec<usize>
    where
        Self: NoUninit,
    {
        vec![std::mem::size_of::<Self>()]
    }

    /// [`KernelParams::args`] of a kernel that takes `Self` as its one parameter.
    fn one_struct(&self) -> KernelArgs
    where
        Self: NoUninit,
    {
        KernelArgs::new().arg(*self)
    }
}

/// A [`Kernel`] checked to take one parameter of type `A` ([`Kernel::typed`]); its launches are safe.
pub struct TypedKernel<A> {
    kernel: Kernel,
    _params: std::marker::PhantomData<fn(&A)>,
}

impl<A> Clone for TypedKernel<A> {
    fn clone(&self) -> TypedKernel<A> {
        TypedKernel { kernel: self.kernel.clone(), _params: std::marker::PhantomData }
    }
}

impl<A> std::fmt::Debug for TypedKernel<A> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TypedKernel<{}>({:?})", std::any::type_name::<A>(), self.kernel)
    }
}

impl<A: KernelParams> TypedKernel<A> {
    /// The kernel underneath (attributes, shared memory limit).
    pub fn kernel(&self) -> &Kernel {
        &self.kernel
    }

    /// Launches the kernel on `stream` with `params`, after the checks of [`Kernel::launch`].
    pub fn launch(&self, stream: &Stream, cfg: &LaunchConfig, params: &A) -> Result<()> {
        let args = params.args();
        // SAFETY: `typed` checked the kernel's parameter sizes against A's, and A's `KernelParams`
        // implementation says these are its parameters with only CUDA-layer addresses inside (see the trait).
        unsafe { self.kernel.launch_checked(stream, cfg, &args) }
    }
}

/// Launch shape: grid and block dimensions, dynamic shared memory, and the optional cooperative and
/// thread-block-cluster attributes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchConfig {
    /// Blocks in x, y, z.
    pub grid: [u32; 3],
    /// Threads per block in x, y, z.
    pub block: [u32; 3],
    /// Dynamic shared memory per block, bytes.
    pub dynamic_smem_bytes: u32,
    /// Cooperative launch (all blocks co-resident; grid-wide sync allowed).
    pub cooperative: bool,
    /// Thread-block cluster dimensions (Hopper), or none.
    pub cluster: Option<[u32; 3]>,
}

impl LaunchConfig {
    /// `grid` blocks of `block` threads, one-dimensional, no shared memory.
    pub fn linear(grid: u32, block: u32) -> LaunchConfig {
        LaunchConfig { grid: [grid, 1, 1], block: [block, 1, 1], dynamic_smem_bytes: 0, cooperative: false, cluster: None }
    }

    /// With `bytes` of dynamic shared memory per block.
    pub fn with_dynamic_smem(mut self, bytes: u32) -> LaunchConfig {
        self.dynamic_smem_bytes = bytes;
        self
    }

    /// As a cooperative launch.
    pub fn with_cooperative(mut self) -> LaunchConfig {
        self.cooperative = true;
        self
    }

    /// With thread-block clusters of `dims`.
    pub fn with_cluster(mut self, dims: [u32; 3]) -> LaunchConfig {
        self.cluster = Some(dims);
        self
    }
}

/// A kernel's arguments: a list of values without padding (device pointers, integers, floats, and
/// `#[repr(C)]` structs deriving [`bytemuck::NoUninit`]), copied at push time. References cannot be pushed
/// (they are not `NoUninit`), and [`Kernel::launch`] checks count and sizes against the kernel.
///
/// ```
/// use moelink_cuda::KernelArgs;
/// let ptr: u64 = 0x7f00_0000_0000;
/// let args = KernelArgs::new().arg(ptr).arg(1024u32).arg(0.5f32);
/// assert_eq!(args.len(), 3);
/// ```
#[derive(Clone, Debug, Default)]
pub struct KernelArgs {
    /// Argument bytes, each argument starting at a 16-byte aligned offset.
    storage: Vec<u128>,
    /// (byte offset, byte length) of each argument in `storage`.
    spans: Vec<(usize, usize)>,
}

impl KernelArgs {
    /// No arguments.
    pub fn new() -> KernelArgs {
        KernelArgs::default()
    }

    /// Appends `value` (builder style).
    pub fn arg<T: NoUninit>(mut self, value: T) -> KernelArgs {
        self.push(&value);
        self
    }

    /// Appends a copy of `value`.
    pub fn push<T: NoUninit>(&mut self, value: &T) {
        let bytes = bytemuck::bytes_of(value);
        let offset = self.storage.len() * 16;
        let words = bytes.len().div_ceil(16).max(1);
        self.storage.resize(self.storage.len() + words, 0);
        bytemuck::cast_slice_mut::<u128, u8>(&mut self.storage)[offset..offset + bytes.len()].copy_from_slice(bytes);
        self.spans.push((offset, bytes.len()));
    }

    /// Number of arguments.
    pub fn len(&self) -> usize {
        self.spans.len()
    }

    /// True when there are none.
    pub fn is_empty(&self) -> bool {
        self.spans.is_empty()
    }

    /// The bytes of argument `i`.
    pub fn bytes(&self, i: usize) -> Option<&[u8]> {
        let &(off, len) = self.spans.get(i)?;
        Some(&bytemuck::cast_slice::<u128, u8>(&self.storage)[off..off + len])
    }

    /// Pointers to each argument's bytes, as `cuLaunchKernelEx` wants them. Valid while `self` is borrowed.
    fn pointers(&self) -> Vec<*mut c_void> {
        let base = self.storage.as_ptr() as *const u8;
        // The driver only reads through these pointers (it copies the argument bytes at launch).
        self.spans.iter().map(|&(off, _)| base.wrapping_add(off) as *mut c_void).collect()
    }
}

/// Host time spent inside the driver's launch call on this thread, summed while switched on: how much of an
/// operation's host cost is the driver's (the Python package's host-cost split reads it). Off, a launch pays
/// one thread-local read.
pub mod launch_timing {
    use std::cell::Cell;
    use std::time::Instant;

    thread_local! {
        static ON: Cell<bool> = const { Cell::new(false) };
        static SUM: Cell<(u64, u64)> = const { Cell::new((0, 0)) };
    }

    /// Switches the timing on or off for this thread and clears its sums.
    pub fn set_enabled(on: bool) {
        ON.with(|c| c.set(on));
        SUM.with(|c| c.set((0, 0)));
    }

    /// `(launches, nanoseconds)` in the driver's launch call since the last `take` (or since switched on).
    pub fn take() -> (u64, u64) {
        SUM.with(|c| c.replace((0, 0)))
    }

    pub(crate) fn start() -> Option<Instant> {
        ON.with(|c| c.get()).then(Instant::now)
    }

    pub(crate) fn stop(started: Option<Instant>) {
        if let Some(t) = started {
            let ns = t.elapsed().as_nanos() as u64;
            SUM.with(|c| {
                let (n, sum) = c.get();
                c.set((n + 1, sum + ns));
            });
        }
    }
}
