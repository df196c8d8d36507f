//! Runtime compilation: CUDA C++ source (+ in-memory headers, `-D` constants) → NVRTC → CUBIN for the
//! device's architecture, cached on disk and in memory.
//!
//! - Target: `--gpu-architecture=sm_90a` on Hopper ([`arch_for`]); always a CUBIN, never PTX (a newer
//!   NVRTC's PTX can be too new for the installed driver).
//! - Kernel names: a kernel with a C++ name (`moelink::low_latency::dispatch`, in a namespace, as a profiler
//!   shows it) is named to NVRTC as a name expression ([`CompileRequest::name_expression`]); the compile
//!   keeps each expression's lowered (mangled) symbol ([`Compiled::lowered_name`]), and a module loaded from
//!   the result finds the kernel by its expression ([`Module::kernel`]).
//! - Options: `-std=c++17 -lineinfo --ptxas-options=-v` plus the request's `-D` constants. The ptxas
//!   report is requested on every compile (it does not change the CUBIN) so that the register/spill report
//!   ([`KernelResources`]) is always available and is cached with the CUBIN.
//! - Disk cache: [`JitSettings::cache_dir`], default `<user cache dir>/moelink/kernels`, one file per key; the key
//!   is a sha256 over the source, headers, options, NVRTC version and architecture. Writes go to a temporary
//!   file that is renamed into place, so readers never see a partial file.
//! - In-process memo: a second request for the same key in the same [`JitCache`] returns the same CUBIN
//!   without touching the disk; concurrent requests for one key compile it once.
//! - Settings ([`JitSettings`]: the disk cache directory, where compile reports go) are process-wide, set by
//!   the program with [`configure`] before its first compile; the library reads no environment variable
//!   (the `moelink` command and the Python package map `MOELINK_CACHE_DIR` / `MOELINK_JIT_VERBOSE` onto
//!   them with [`JitSettings::from_vars`]).
//!
//! ```no_run
//! use moelink_cuda::jit::{CompileRequest, JitCache};
//! let req = CompileRequest::new("fill.cu", "extern \"C\" __global__ void fill(int* p) { p[threadIdx.x] = N; }", "sm_90a")
//!     .define("N", 7);
//! let compiled = JitCache::global().compile(&req)?;
//! assert!(compiled.resources.iter().all(|r| !r.spills()));
//! # Ok::<(), moelink_cuda::Error>(())
//! ```

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use sha2::{Digest, Sha256};

use crate::device::Device;
use crate::error::{Error, Result};
use crate::module::Module;
use crate::raw::nvrtc;

/// Process-wide JIT settings ([`configure`]).
#[derive(Clone, Debug, Default)]
pub struct JitSettings {
    /// Disk cache directory of [`JitCache::global`]; `None`: [`default_cache_dir`].
    pub cache_dir: Option<PathBuf>,
    /// Receives a compile report, line by line, after every compile and disk-cache hit: the options, the
    /// compile time and each kernel's register/spill line. `None`: no reports.
    pub report: Option<fn(&str)>,
}

impl JitSettings {
    /// The programs' environment variables, read through `get`: `MOELINK_CACHE_DIR` (the disk cache
    /// directory) and `MOELINK_JIT_VERBOSE=1` (reports go to `report`). The library never reads the
    /// environment itself: the `moelink` command, the Python package and the test harnesses call this with
    /// `|k| std::env::var(k).ok()`.
    pub fn from_vars(get: impl Fn(&str) -> Option<String>, report: fn(&str)) -> JitSettings {
        JitSettings {
            cache_dir: get("MOELINK_CACHE_DIR").filter(|d| !d.is_empty()).map(PathBuf::from),
            report: (get("MOELINK_JIT_VERBOSE").as_deref().map(str::trim) == Some("1")).then_some(report),
        }
    }
}

static SETTINGS: OnceLock<JitSettings> = OnceLock::new();

/// Sets this process's JIT settings. Call it before the first compile; `Err` once settings are in effect
/// (an earlier `configure`, or a compile that took the defaults).
pub fn configure(settings: JitSettings) -> Result<()> {
    SETTINGS.set(settings).map_err(|_| Error::invalid("the JIT settings are already in effect (configure before the first compile)"))
}

/// The settings in effect (the defaults unless [`configure`] ran first).
pub fn settings() -> &'static JitSettings {
    SETTINGS.get_or_init(JitSettings::default)
}

/// Passes one report line to [`JitSettings::report`], if any.
fn report(line: impl FnOnce() -> String) {
    if let Some(f) = settings().report {
        f(&line());
    }
}

/// NVRTC's version `(major, minor)`, or why NVRTC cannot be loaded.
pub fn nvrtc_version() -> Result<(i32, i32)> {
    nvrtc::ensure_loaded()
}

/// nvJitLink's version `(major, minor)`, or why it cannot be loaded (only internode kernels need it).
pub fn nvjitlink_version() -> Result<(u32, u32)> {
    crate::raw::nvjitlink::version()
}

/// The NVRTC architecture for a compute capability: `sm_90a` for 9.x and later (arch-specific features:
/// `setmaxnreg`, `wgmma`), `sm_XY` before.
pub fn arch_for(compute_capability: (i32, i32)) -> String {
    let (major, minor) = compute_capability;
    if major >= 9 {
        format!("sm_{major}{minor}a")
    } else {
        format!("sm_{major}{minor}")
    }
}

/// `<user cache dir>/moelink/kernels`, or none (no disk cache) where the platform has no cache dir.
pub fn default_cache_dir() -> Option<PathBuf> {
    dirs::cache_dir().map(|d| d.join("moelink").join("kernels"))
}

/// One compilation unit: a source with its headers, `-D` constants and target.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CompileRequest {
    /// Name of the source (kernel family file), used in errors, reports and cache file names.
    pub name: String,
    /// CUDA C++ source.
    pub source: String,
    /// In-memory headers `(include name, contents)`, resolvable with `#include "name"`.
    pub headers: Vec<(String, String)>,
    /// `-D name=value` constants, in order.
    pub defines: Vec<(String, String)>,
    /// Target architecture, e.g. `sm_90a`.
    pub arch: String,
    /// Further NVRTC options, appended last.
    pub extra_options: Vec<String>,
    /// Directories searched for `#include <...>` (`-I`): headers from outside moelink (NVSHMEM's and the
    /// CUDA runtime's, for the `nvshmem` transport). Empty for every header-free kernel.
    pub include_dirs: Vec<PathBuf>,
    /// Device libraries (`.a`) to link with nvJitLink (NVSHMEM's `libnvshmem_device.a`). When non-empty the
    /// source is compiled relocatable (`-rdc=true -default-device`) and then linked.
    pub device_libraries: Vec<PathBuf>,
    /// C++ names of kernels (`ns::kernel`) whose lowered symbol the compile must report.
    pub name_expressions: Vec<String>,
}

impl CompileRequest {
    /// A request for `source` named `name`, targeting `arch`.
    pub fn new(name: impl Into<String>, source: impl Into<String>, arch: impl Into<String>) -> CompileRequest {
        CompileRequest {
            name: name.into(),
            source: source.into(),
            headers: Vec::new(),
            defines: Vec::new(),
            arch: arch.into(),
            extra_options: Vec::new(),
            include_dirs: Vec::new(),
            device_libraries: Vec::new(),
            name_expressions: Vec::new(),
        }
    }

    /// Adds an include directory (`-I`).
    pub fn include_dir(mut self, dir: impl Into<PathBuf>) -> CompileRequest {
        self.include_dirs.push(dir.into());
        self
    }

    /// Links the result against device library `path` (relocatable compile + nvJitLink).
    pub fn device_library(mut self, path: impl Into<PathBuf>) -> CompileRequest {
        self.device_libraries.push(path.into());
        self
    }

    /// Adds an in-memory header.
    pub fn header(mut self, include_name: impl Into<String>, contents: impl Into<String>) -> CompileRequest {
        self.headers.push((include_name.into(), contents.into()));
        self
    }

    /// Adds `-Dname=value`.
    pub fn define(mut self, name: impl Into<String>, value: impl ToString) -> CompileRequest {
        self.defines.push((name.into(), value.to_string()));
        self
    }

    /// Names a kernel by its C++ name (`ns::kernel`), so that the compiled result knows its lowered symbol
    /// ([`Compiled::lowered_name`]).
    pub fn name_expression(mut self, expression: impl Into<String>) -> CompileRequest {
        self.name_expressions.push(expression.into());
        self
    }

    /// Adds a raw NVRTC option.
    pub fn option(mut self, option: impl Into<String>) -> CompileRequest {
        self.extra_options.push(option.into());
        self
    }

    /// The exact option list handed to NVRTC.
    pub fn options(&self) -> Vec<String> {
        let mut o = vec![format!("--gpu-architecture={}", self.arch), "-std=c++17".into(), "-lineinfo".into(), "--ptxas-options=-v".into()];
        o.extend(self.defines.iter().map(|(k, v)| format!("-D{k}={v}")));
        if !self.device_libraries.is_empty() {
            o.push("-rdc=true".into());
            o.push("-default-device".into());
        }
        o.extend(self.include_dirs.iter().map(|d| format!("-I{}", d.display())));
        o.extend(self.extra_options.iter().cloned());
        o
    }

    /// Hex sha256 over everything the CUBIN depends on: source, headers, options (which include the
    /// architecture and constants), the name expressions (the cache keeps their lowered names) and the
    /// NVRTC version.
    pub fn cache_key(&self, nvrtc_version: (i32, i32)) -> String {
        let mut h = Sha256::new();
        let mut field = |b: &[u8]| {
            h.update((b.len() as u64).to_le_bytes());
            h.update(b);
        };
        field(b"moelink-jit-key-v2");
        field(self.name.as_bytes());
        field(self.source.as_bytes());
        field(&(self.headers.len() as u64).to_le_bytes());
        for (n, c) in &self.headers {
            field(n.as_bytes());
            field(c.as_bytes());
        }
        let opts = self.options();
        field(&(opts.len() as u64).to_le_bytes());
        for o in &opts {
            field(o.as_bytes());
        }
        field(&(self.name_expressions.len() as u64).to_le_bytes());
        for e in &self.name_expressions {
            field(e.as_bytes());
        }
        field(format!("nvrtc {}.{}", nvrtc_version.0, nvrtc_version.1).as_bytes());
        field(self.arch.as_bytes());
        // Linked kernels also depend on the libraries' contents: a file's identity is its path, length and
        // modification time (a reinstall recompiles). Header-free requests hash exactly as before.
        for lib in &self.device_libraries {
            let meta = std::fs::metadata(lib).ok();
            let modified = meta.as_ref().and_then(|m| m.modified().ok()).and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok());
            field(format!("lib {} {:?} {:?}", lib.display(), meta.map(|m| m.len()), modified).as_bytes());
        }
        h.finalize().iter().map(|b| format!("{b:02x}")).collect()
    }
}

/// Register, stack and spill use of one function, from ptxas's report.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KernelResources {
    /// Function name as ptxas reports it: the symbol (lowered, i.e. mangled, for kernels with a C++ name).
    pub kernel: String,
    /// A `__global__` entry point (as opposed to a non-inlined device function).
    pub is_entry: bool,
    /// Registers per thread.
    pub registers: u32,
    /// Stack frame, bytes per thread.
    pub stack_frame_bytes: u32,
    /// Spill stores, bytes per thread.
    pub spill_store_bytes: u32,
    /// Spill loads, bytes per thread.
    pub spill_load_bytes: u32,
    /// Static shared memory, bytes per block.
    pub shared_bytes: u32,
}

impl KernelResources {
    /// True when the function uses local memory: a stack frame or spills.
    pub fn spills(&self) -> bool {
        self.stack_frame_bytes > 0 || self.spill_store_bytes > 0 || self.spill_load_bytes > 0
    }
}

impl std::fmt::Display for KernelResources {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}: {} registers, {} B stack, {} B spill stores, {} B spill loads, {} B smem",
            self.kernel, self.registers, self.stack_frame_bytes, self.spill_store_bytes, self.spill_load_bytes, self.shared_bytes
        )
    }
}

fn number_before(line: &str, unit: &str) -> Option<u32> {
    let i = line.find(unit)?;
    line[..i].split(|c: char| !c.is_ascii_digit()).rfind(|s| !s.is_empty())?.parse().ok()
}

fn quoted(line: &str) -> Option<&str> {
    let a = line.find('\'')?;
    let b = line[a + 1..].find('\'')?;
    Some(&line[a + 1..a + 1 + b])
}

/// Parses ptxas's `-v` report (in NVRTC's log) into one entry per function, in order of appearance.
pub fn parse_ptxas_report(log: &str) -> Vec<KernelResources> {
    let mut out: Vec<KernelResources> = Vec::new();
    let index_of = |out: &mut Vec<KernelResources>, name: &str| -> usize {
        if let Some(i) = out.iter().position(|r| r.kernel == name) {
            return i;
        }
        out.push(KernelResources { kernel: name.to_string(), ..Default::default() });
        out.len() - 1
    };
    let (mut entry, mut props): (Option<usize>, Option<usize>) = (None, None);
    for line in log.lines() {
        if line.contains("Compiling entry function") {
            if let Some(name) = quoted(line) {
                let i = index_of(&mut out, name);
                out[i].is_entry = true;
                entry = Some(i);
            }
        } else if let Some(rest) = line.split("Function properties for ").nth(1) {
            props = Some(index_of(&mut out, rest.trim()));
        } else if line.contains("bytes stack frame") {
            if let Some(i) = props {
                out[i].stack_frame_bytes = number_before(line, "bytes stack frame").unwrap_or(0);
                out[i].spill_store_bytes = number_before(line, "bytes spill stores").unwrap_or(0);
                out[i].spill_load_bytes = number_before(line, "bytes spill loads").unwrap_or(0);
            }
        } else if line.contains("Used ") && line.contains(" registers") {
            if let Some(i) = entry {
                out[i].registers = number_before(line, " registers").unwrap_or(0);
                out[i].shared_bytes = number_before(line, " bytes smem").unwrap_or(0);
            }
        }
    }
    out
}

/// Where a compile result came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheSource {
    /// This [`JitCache`]'s in-process memo.
    Memory,
    /// The disk cache.
    Disk,
    /// A fresh NVRTC compile.
    Compiled,
}

/// A compiled CUBIN with its compile log and resource report.
#[derive(Debug)]
pub struct Compiled {
    /// The request's name.
    pub name: String,
    /// Target architecture.
    pub arch: String,
    /// Cache key (hex sha256).
    pub key: String,
    /// The CUBIN image.
    pub cubin: Vec<u8>,
    /// NVRTC's log (includes ptxas's report).
    pub log: String,
    /// Parsed register/spill report, one entry per function.
    pub resources: Vec<KernelResources>,
    /// `(name expression, lowered symbol)` of every name expression of the request.
    pub lowered_names: Vec<(String, String)>,
    /// Seconds the NVRTC compile took when this CUBIN was built (possibly in an earlier process).
    pub compile_seconds: f64,
}

impl Compiled {
    /// Loads the CUBIN on `device`; its kernels are found by name expression or symbol.
    pub fn load(&self, device: &Device) -> Result<Module> {
        Ok(Module::load(device, &self.cubin)?.with_names(&self.lowered_names))
    }

    /// Loads the CUBIN on `device` once per process ([`Module::load_shared`], keyed by [`Compiled::key`]).
    pub fn load_shared(&self, device: &Device) -> Result<Module> {
        Module::load_shared(device, &self.key, &self.cubin, &self.lowered_names)
    }

    /// The lowered symbol of name expression `expression`, if the request named it.
    pub fn lowered_name(&self, expression: &str) -> Option<&str> {
        self.lowered_names.iter().find(|(e, _)| e == expression).map(|(_, l)| l.as_str())
    }

    /// The report entry of function `kernel`: a name expression of the request, or a symbol.
    pub fn resources_of(&self, kernel: &str) -> Option<&KernelResources> {
        let symbol = self.lowered_name(kernel).unwrap_or(kernel);
        self.resources.iter().find(|r| r.kernel == symbol)
    }
}

type Slot = Arc<Mutex<Option<Arc<Compiled>>>>;

/// A compile cache: an optional disk directory plus an in-process memo.
pub struct JitCache {
    dir: Option<PathBuf>,
    memo: Mutex<HashMap<String, Slot>>,
}

impl std::fmt::Debug for JitCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "JitCache({:?})", self.dir)
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A panic while holding one of these locks cannot leave the data half-updated (single assignments).
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// NVRTC programs are compiled one at a time per process.
static NVRTC_LOCK: Mutex<()> = Mutex::new(());

const FILE_MAGIC: &[u8; 8] = b"MLCUBIN2";

impl JitCache {
    /// The process-wide cache, at [`JitSettings::cache_dir`] (else [`default_cache_dir`]).
    pub fn global() -> &'static JitCache {
        static GLOBAL: OnceLock<JitCache> = OnceLock::new();
        GLOBAL.get_or_init(|| JitCache::new(settings().cache_dir.clone().or_else(default_cache_dir)))
    }

    /// A cache at `dir` (created on first write), or memory-only when `None`.
    pub fn new(dir: Option<PathBuf>) -> JitCache {
        JitCache { dir, memo: Mutex::new(HashMap::new()) }
    }

    /// The disk directory, if any.
    pub fn dir(&self) -> Option<&Path> {
        self.dir.as_deref()
    }

    /// Compiles `req`, or returns the cached CUBIN.
    pub fn compile(&self, req: &CompileRequest) -> Result<Arc<Compiled>> {
        self.compile_traced(req).map(|(c, _)| c)
    }

    /// As [`compile`](Self::compile), also saying where the result came from.
    pub fn compile_traced(&self, req: &CompileRequest) -> Result<(Arc<Compiled>, CacheSource)> {
        let version = nvrtc::ensure_loaded()?;
        let key = req.cache_key(version);
        let slot = lock(&self.memo).entry(key.clone()).or_default().clone();
        let mut slot = lock(&slot);
        if let Some(c) = slot.as_ref() {
            return Ok((c.clone(), CacheSource::Memory));
        }
        let t0 = Instant::now();
        if let Some(c) = self.read_disk(req, &key) {
            report(|| {
                format!("[moelink jit] {} {} {}: disk cache hit in {:.4} s", req.name, req.arch, &key[..12], t0.elapsed().as_secs_f64())
            });
            let c = Arc::new(c);
            *slot = Some(c.clone());
            return Ok((c, CacheSource::Disk));
        }
        let c = Arc::new(compile_uncached(req, key)?);
        if let Err(e) = self.write_disk(&c) {
            report(|| format!("[moelink jit] could not write the disk cache: {e}"));
        }
        *slot = Some(c.clone());
        Ok((c, CacheSource::Compiled))
    }

    fn file_for(&self, name: &str, key: &str) -> Option<PathBuf> {
        let stem: String = name.chars().map(|c| if c.is_ascii_alphanumeric() { c } else { '_' }).collect();
        self.dir.as_ref().map(|d| d.join(format!("{stem}-{key}.mlcubin")))
    }

    fn read_disk(&self, req: &CompileRequest, key: &str) -> Option<Compiled> {
        let bytes = std::fs::read(self.file_for(&req.name, key)?).ok()?;
        let CacheFile { log, cubin, compile_seconds, lowered_names } = decode_cache_file(&bytes, key)?;
        // A file whose names do not cover the request's expressions is not this request's result.
        if !req.name_expressions.iter().all(|e| lowered_names.iter().any(|(n, _)| n == e)) {
            return None;
        }
        Some(Compiled {
            name: req.name.clone(),
            arch: req.arch.clone(),
            key: key.to_string(),
            resources: parse_ptxas_report(&log),
            log,
            cubin,
            compile_seconds,
            lowered_names,
        })
    }

    fn write_disk(&self, c: &Compiled) -> Result<()> {
        let Some(path) = self.file_for(&c.name, &c.key) else { return Ok(()) };
        let dir = path.parent().unwrap_or(Path::new("."));
        std::fs::create_dir_all(dir).map_err(|e| Error::io("creating the JIT cache directory", dir, e))?;
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let tmp = path.with_extension(format!("tmp-{}-{}", std::process::id(), COUNTER.fetch_add(1, Ordering::Relaxed)));
        let body = encode_cache_file(&c.key, &c.log, &c.cubin, c.compile_seconds, &c.lowered_names);
        let write = || -> std::io::Result<()> {
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(&body)?;
            f.sync_all()?;
            std::fs::rename(&tmp, &path)
        };
        write().map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            Error::io("writing the JIT cache file", &path, e)
        })
    }
}

/// What a cache file holds besides its key.
#[derive(Debug, PartialEq)]
struct CacheFile {
    log: String,
    cubin: Vec<u8>,
    compile_seconds: f64,
    lowered_names: Vec<(String, String)>,
}

/// `expression \t symbol` lines (neither contains a tab or a newline: C++ names and their symbols).
fn encode_names(names: &[(String, String)]) -> String {
    names.iter().map(|(e, l)| format!("{e}\t{l}\n")).collect()
}

fn decode_names(text: &str) -> Option<Vec<(String, String)>> {
    text.lines().map(|l| l.split_once('\t').map(|(e, s)| (e.to_string(), s.to_string()))).collect()
}

fn encode_cache_file(key: &str, log: &str, cubin: &[u8], compile_seconds: f64, lowered_names: &[(String, String)]) -> Vec<u8> {
    let names = encode_names(lowered_names);
    let mut b = Vec::with_capacity(96 + log.len() + names.len() + cubin.len());
    b.extend_from_slice(FILE_MAGIC);
    b.extend_from_slice(&(log.len() as u64).to_le_bytes());
    b.extend_from_slice(&(cubin.len() as u64).to_le_bytes());
    b.extend_from_slice(&compile_seconds.to_le_bytes());
    b.extend_from_slice(&(key.len() as u64).to_le_bytes());
    b.extend_from_slice(&(names.len() as u64).to_le_bytes());
    b.extend_from_slice(key.as_bytes());
    b.extend_from_slice(log.as_bytes());
    b.extend_from_slice(names.as_bytes());
    b.extend_from_slice(cubin);
    b
}

/// The contents when `b` is a complete cache file for `key`.
fn decode_cache_file(b: &[u8], key: &str) -> Option<CacheFile> {
    let u64_at = |o: usize| -> Option<u64> { Some(u64::from_le_bytes(b.get(o..o + 8)?.try_into().ok()?)) };
    if b.get(..8)? != FILE_MAGIC {
        return None;
    }
    let log_len = u64_at(8)? as usize;
    let cubin_len = u64_at(16)? as usize;
    let compile_seconds = f64::from_le_bytes(b.get(24..32)?.try_into().ok()?);
    let key_len = u64_at(32)? as usize;
    let names_len = u64_at(40)? as usize;
    let mut o: usize = 48;
    if b.get(o..o.checked_add(key_len)?)? != key.as_bytes() {
        return None;
    }
    o += key_len;
    let log = std::str::from_utf8(b.get(o..o.checked_add(log_len)?)?).ok()?.to_string();
    o += log_len;
    let lowered_names = decode_names(std::str::from_utf8(b.get(o..o.checked_add(names_len)?)?).ok()?)?;
    o += names_len;
    let cubin = b.get(o..o.checked_add(cubin_len)?)?.to_vec();
    if o + cubin_len != b.len() || cubin.get(..4)? != [0x7f, b'E', b'L', b'F'] {
        return None;
    }
    Some(CacheFile { log, cubin, compile_seconds, lowered_names })
}

/// `(name expression, lowered symbol)` pairs.
type LoweredNames = Vec<(String, String)>;

/// Runs NVRTC (no caches).
fn compile_uncached(req: &CompileRequest, key: String) -> Result<Compiled> {
    let options = req.options();
    let _serial = lock(&NVRTC_LOCK);
    let t0 = Instant::now();
    // SAFETY: NVRTC was loaded by the caller (ensure_loaded); the program is destroyed on every path below.
    let (ok, log, cubin, lowered_names) = unsafe {
        let mut prog = nvrtc::create_program(&req.source, &req.name, &req.headers)?;
        let result = (|| -> Result<(bool, String, Vec<u8>, LoweredNames)> {
            for e in &req.name_expressions {
                nvrtc::add_name_expression(prog, e)?;
            }
            let status = nvrtc::compile_program(prog, &options);
            let log = nvrtc::program_log(prog).unwrap_or_default();
            let ok = match status {
                Ok(ok) => ok,
                // e.g. NVRTC_ERROR_BUILTIN_OPERATION_FAILURE: libnvrtc-builtins not found; the log says which.
                Err(Error::Nvrtc { call, name, .. }) => return Err(Error::Nvrtc { call, name, log: log.trim().to_string() }),
                Err(e) => return Err(e),
            };
            if !ok {
                return Ok((false, log, Vec::new(), Vec::new()));
            }
            let names = req.name_expressions.iter().map(|e| Ok((e.clone(), nvrtc::lowered_name(prog, e)?))).collect::<Result<_>>()?;
            Ok((true, log, nvrtc::program_cubin(prog)?, names))
        })();
        let _ = nvrtc::destroy_program(&mut prog);
        result?
    };
    if !ok {
        return Err(Error::Compile { kernel: req.name.clone(), arch: req.arch.clone(), log: log.trim().to_string() });
    }
    let (cubin, log) = if req.device_libraries.is_empty() {
        (cubin, log)
    } else {
        let libraries: Vec<&Path> = req.device_libraries.iter().map(PathBuf::as_path).collect();
        let (linked, link_log) = crate::raw::nvjitlink::link(&req.name, &req.arch, &cubin, &libraries)?;
        (linked, if link_log.is_empty() { log } else { format!("{log}\nnvJitLink: {link_log}") })
    };
    let secs = t0.elapsed().as_secs_f64();
    let resources = parse_ptxas_report(&log);
    report(|| format!("[moelink jit] {} {} {}: compiled in {secs:.3} s, {} B cubin", req.name, req.arch, &key[..12], cubin.len()));
    report(|| format!("[moelink jit]   options: {}", options.join(" ")));
    for r in resources.iter().filter(|r| r.is_entry) {
        report(|| format!("[moelink jit]   {r}"));
    }
    Ok(Compiled { name: req.name.clone(), arch: req.arch.clone(), key, cubin, log, resources, compile_seconds: secs, lowered_names })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req() -> CompileRequest {
        CompileRequest::new("copy.cu", "extern \"C\" __global__ void k() {}", "sm_90a")
            .header("ptx.cuh", "// header")
            .define("MAX_RANKS", 8)
    }

    #[test]
    fn cache_key_is_stable_and_covers_every_input() {
        let base = req().cache_key((13, 0));
        // Pinned: a change here means every user's cache is invalidated; bump deliberately.
        assert_eq!(base.len(), 64);
        assert_eq!(base, "75900930ff58aedbb42d4cd037a572d46d57ab02d26d2e45a59d2fec2747ba32");
        assert_eq!(base, req().cache_key((13, 0)));
        let variants = [
            req().define("X", 1).cache_key((13, 0)),
            CompileRequest { source: "extern \"C\" __global__ void k() { }".into(), ..req() }.cache_key((13, 0)),
            CompileRequest { headers: vec![("ptx.cuh".into(), "// other".into())], ..req() }.cache_key((13, 0)),
            CompileRequest { arch: "sm_100a".into(), ..req() }.cache_key((13, 0)),
            req().option("-G").cache_key((13, 0)),
            req().name_expression("ns::k").cache_key((13, 0)),
            req().cache_key((13, 2)),
            CompileRequest { defines: vec![("MAX_RANKS".into(), "4".into())], ..req() }.cache_key((13, 0)),
        ];
        for (i, v) in variants.iter().enumerate() {
            assert_ne!(*v, base, "variant {i} must change the key");
        }
        // Field boundaries matter: moving bytes between name and source changes the key.
        let a = CompileRequest::new("ab", "c", "sm_90a").cache_key((13, 0));
        let b = CompileRequest::new("a", "bc", "sm_90a").cache_key((13, 0));
        assert_ne!(a, b);
    }

    #[test]
    fn settings_from_variables() {
        fn sink(_: &str) {}
        let vars =
            |pairs: &'static [(&'static str, &'static str)]| move |k: &str| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string());
        let none = JitSettings::from_vars(vars(&[]), sink);
        assert_eq!((none.cache_dir, none.report.is_some()), (None, false));
        let s = JitSettings::from_vars(vars(&[("MOELINK_CACHE_DIR", "/tmp/x"), ("MOELINK_JIT_VERBOSE", "1")]), sink);
        assert_eq!(s.cache_dir, Some(PathBuf::from("/tmp/x")));
        assert!(s.report.is_some());
        let s = JitSettings::from_vars(vars(&[("MOELINK_CACHE_DIR", ""), ("MOELINK_JIT_VERBOSE", "0")]), sink);
        assert_eq!((s.cache_dir, s.report.is_some()), (None, false), "empty directory: the default; 0: no reports");
    }

    #[test]
    fn options_are_what_nvrtc_gets() {
        assert_eq!(req().options(), vec!["--gpu-architecture=sm_90a", "-std=c++17", "-lineinfo", "--ptxas-options=-v", "-DMAX_RANKS=8"]);
    }

    #[test]
    fn arch_names() {
        assert_eq!(arch_for((9, 0)), "sm_90a");
        assert_eq!(arch_for((10, 0)), "sm_100a");
        assert_eq!(arch_for((8, 0)), "sm_80");
    }

    #[test]
    fn ptxas_report_is_parsed() {
        let log = "ptxas info    : 0 bytes gmem\n\
ptxas info    : Compiling entry function 'k3' for 'sm_90a'\n\
ptxas info    : Function properties for k3\n\
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n\
ptxas info    : Used 10 registers, used 1 barriers, 1024 bytes smem\n\
ptxas info    : Compile time = 3.071 ms\n\
ptxas info    : Compiling entry function 'k1' for 'sm_90a'\n\
ptxas info    : Function properties for k1\n\
ptxas         .     1408 bytes stack frame, 1376 bytes spill stores, 1556 bytes spill loads\n\
ptxas info    : Used 24 registers, used 0 barriers, 1408 bytes cumulative stack size\n";
        let r = parse_ptxas_report(log);
        assert_eq!(r.len(), 2);
        assert_eq!(
            r[0],
            KernelResources {
                kernel: "k3".into(),
                is_entry: true,
                registers: 10,
                stack_frame_bytes: 0,
                spill_store_bytes: 0,
                spill_load_bytes: 0,
                shared_bytes: 1024
            }
        );
        assert!(!r[0].spills());
        assert_eq!((r[1].registers, r[1].stack_frame_bytes, r[1].spill_store_bytes, r[1].spill_load_bytes), (24, 1408, 1376, 1556));
        assert!(r[1].spills());
    }

    #[test]
    fn cache_file_round_trips_and_rejects_damage() {
        let cubin = [0x7f, b'E', b'L', b'F', 1, 2, 3];
        let names = vec![("ns::k".to_string(), "_ZN2ns1kEv".to_string()), ("k2".to_string(), "k2".to_string())];
        let f = encode_cache_file("abc", "log text", &cubin, 0.25, &names);
        let want = CacheFile { log: "log text".into(), cubin: cubin.to_vec(), compile_seconds: 0.25, lowered_names: names };
        assert_eq!(decode_cache_file(&f, "abc"), Some(want));
        let none = encode_cache_file("abc", "", &cubin, 0.0, &[]);
        assert_eq!(decode_cache_file(&none, "abc").map(|c| c.lowered_names), Some(vec![]));
        assert_eq!(decode_cache_file(&f, "abd"), None);
        assert_eq!(decode_cache_file(&f[..f.len() - 1], "abc"), None);
        let mut longer = f.clone();
        longer.push(0);
        assert_eq!(decode_cache_file(&longer, "abc"), None);
    }
}
