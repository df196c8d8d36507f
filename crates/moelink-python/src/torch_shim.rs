//! A tensor's facts through torch's stable C shim (`aoti_torch_*`, `torch/csrc/inductor/aoti_torch/c/shim.h`,
//! the C ABI torch keeps across versions for AOTInductor), instead of seven Python-level attribute lookups and
//! method calls: a few C calls per tensor where the Python route costs ~1 µs on a serving host.
//!
//! The shim's functions take an `AtenTensorHandle`, an `at::Tensor*`; an `at::Tensor` is one pointer to its
//! `TensorImpl`, which a tensor's `_cdata` attribute gives. The route is used only after a check on a probe
//! tensor when the module first needs it: a handle torch itself allocates (`torch._C._aoti`) must hold that
//! very `TensorImpl` pointer, and every fact read through the shim must equal what the tensor's Python
//! attributes say. The symbols come from the libtorch the running torch already loaded (`RTLD_NOLOAD`), so the
//! wheel links nothing of torch's at build time. Anything missing or different: the Python route, always.

use std::ffi::c_void;

use libloading::os::unix::{Library, Symbol, RTLD_LAZY};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyList};
use pyo3::{ffi, intern};

use moelink::DType;

/// dlopen's RTLD_NOLOAD (glibc's dlfcn.h; Linux only, as the wheel): open only what is already loaded.
const RTLD_NOLOAD: std::os::raw::c_int = 0x4;

type GetPtr = unsafe extern "C" fn(*mut c_void, *mut *mut c_void) -> i32;
type GetI64 = unsafe extern "C" fn(*mut c_void, *mut i64) -> i32;
type GetI64s = unsafe extern "C" fn(*mut c_void, *mut *mut i64) -> i32;
type GetI32 = unsafe extern "C" fn(*mut c_void, *mut i32) -> i32;
type Code = unsafe extern "C" fn() -> i32;
type Delete = unsafe extern "C" fn(*mut c_void) -> i32;

/// A tensor's facts: data pointer, dtype, shape, strides (elements), CUDA device index or -1 for the CPU.
pub(crate) type Facts = (u64, DType, Vec<usize>, Vec<isize>, i64);

pub(crate) struct Shim {
    _lib: Library,
    data_ptr: GetPtr,
    dim: GetI64,
    sizes: GetI64s,
    strides: GetI64s,
    dtype: GetI32,
    device_type: GetI32,
    device_index: GetI32,
    /// The shim's dtype codes of the dtypes moelink moves.
    dtypes: Vec<(i32, DType)>,
    cpu: i32,
    cuda: i32,
}

static SHIM: PyOnceLock<Option<Shim>> = PyOnceLock::new();

/// The checked shim, or None (not found, or it disagreed with the Python route on the probe).
pub(crate) fn shim(py: Python<'_>) -> Option<&'static Shim> {
    SHIM.get_or_init(py, || Shim::load(py).ok().flatten()).as_ref()
}

impl Shim {
    fn load(py: Python<'_>) -> PyResult<Option<Shim>> {
        let torch = py.import("torch")?;
        let file: String = torch.getattr("__file__")?.extract()?;
        let Some(dir) = std::path::Path::new(&file).parent() else { return Ok(None) };
        let path = dir.join("lib").join("libtorch_cpu.so");
        // SAFETY: RTLD_NOLOAD opens the library only if torch already loaded it (no initialisers run again).
        let Ok(lib) = (unsafe { Library::open(Some(&path), RTLD_NOLOAD | RTLD_LAZY) }) else { return Ok(None) };
        // SAFETY: the names and signatures are shim.h's; a missing symbol ends the attempt.
        let shim = unsafe {
            let sym = |name: &[u8]| -> Option<*mut c_void> { lib.get::<*mut c_void>(name).ok().map(|s: Symbol<*mut c_void>| *s) };
            let (Some(data_ptr), Some(dim), Some(sizes), Some(strides), Some(dtype), Some(device_type), Some(device_index)) = (
                sym(b"aoti_torch_get_data_ptr\0"),
                sym(b"aoti_torch_get_dim\0"),
                sym(b"aoti_torch_get_sizes\0"),
                sym(b"aoti_torch_get_strides\0"),
                sym(b"aoti_torch_get_dtype\0"),
                sym(b"aoti_torch_get_device_type\0"),
                sym(b"aoti_torch_get_device_index\0"),
            ) else {
                return Ok(None);
            };
            let code = |name: &[u8]| -> Option<i32> { sym(name).map(|f| std::mem::transmute::<*mut c_void, Code>(f)()) };
            let mut dtypes = Vec::new();
            for (name, d) in [
                (&b"aoti_torch_dtype_bfloat16\0"[..], DType::BF16),
                (b"aoti_torch_dtype_float8_e4m3fn\0", DType::Fp8E4M3),
                (b"aoti_torch_dtype_float32\0", DType::F32),
                (b"aoti_torch_dtype_int32\0", DType::I32),
                (b"aoti_torch_dtype_int64\0", DType::I64),
                (b"aoti_torch_dtype_bool\0", DType::Bool),
                (b"aoti_torch_dtype_uint8\0", DType::U8),
            ] {
                let Some(c) = code(name) else { return Ok(None) };
                dtypes.push((c, d));
            }
            let (Some(cpu), Some(cuda)) = (code(b"aoti_torch_device_type_cpu\0"), code(b"aoti_torch_device_type_cuda\0")) else {
                return Ok(None);
            };
            Shim {
                data_ptr: std::mem::transmute::<*mut c_void, GetPtr>(data_ptr),
                dim: std::mem::transmute::<*mut c_void, GetI64>(dim),
                sizes: std::mem::transmute::<*mut c_void, GetI64s>(sizes),
                strides: std::mem::transmute::<*mut c_void, GetI64s>(strides),
                dtype: std::mem::transmute::<*mut c_void, GetI32>(dtype),
                device_type: std::mem::transmute::<*mut c_void, GetI32>(device_type),
                device_index: std::mem::transmute::<*mut c_void, GetI32>(device_index),
                dtypes,
                cpu,
                cuda,
                _lib: lib,
            }
        };
        Ok(shim.probe(py, &torch)?.then_some(shim))
    }

    /// The check on a probe tensor (a strided view with an offset): torch's own handle holds `_cdata`, and the
    /// shim's facts equal the Python attributes'.
    fn probe(&self, py: Python<'_>, torch: &Bound<'_, PyModule>) -> PyResult<bool> {
        let kwargs = PyDict::new(py);
        kwargs.set_item("dtype", torch.getattr("float32")?)?;
        kwargs.set_item("device", "cpu")?;
        let base = torch.call_method("empty", ((3, 4),), Some(&kwargs))?;
        let probe = base.call_method1("__getitem__", ((py.Ellipsis(), pyo3::types::PySlice::new(py, 1, 4, 1)),))?;
        let cdata: usize = probe.getattr(intern!(py, "_cdata"))?.extract()?;
        let aoti = torch.getattr("_C")?.getattr("_aoti")?;
        // torch's handle API has changed names: one handle (a capsule), or a list of them (capsules or ints).
        let handle = if let Ok(f) = aoti.getattr("unsafe_alloc_void_ptr_from_tensor") {
            f.call1((&probe,))?
        } else {
            let list = aoti.getattr("unsafe_alloc_void_ptrs_from_tensors")?.call1((PyList::new(py, [&probe])?,))?;
            list.get_item(0)?
        };
        let raw = if let Ok(v) = handle.extract::<usize>() {
            v
        } else if let Ok(v) = handle.getattr("value").and_then(|v| v.extract::<usize>()) {
            v
        } else {
            // SAFETY: a capsule without a name (torch's); PyCapsule_GetPointer checks the type and sets an error otherwise.
            let p = unsafe { ffi::PyCapsule_GetPointer(handle.as_ptr(), std::ptr::null()) };
            if p.is_null() {
                let _ = PyErr::take(py);
                return Ok(false);
            }
            p as usize
        };
        if raw == 0 {
            return Ok(false);
        }
        // SAFETY: `raw` is an at::Tensor* torch just allocated for the probe (alive: the probe is referenced);
        // its first word is the TensorImpl pointer.
        let same_impl = unsafe { *(raw as *const usize) } == cdata;
        if let Ok(delete) = unsafe { self._lib.get::<Delete>(b"aoti_torch_delete_tensor_object\0") } {
            // SAFETY: the handle was allocated for us and is deleted once.
            unsafe { delete(raw as *mut c_void) };
        }
        if !same_impl {
            return Ok(false);
        }
        // SAFETY: `cdata` is the probe's TensorImpl (checked above), alive while `probe` is.
        let Some((addr, dtype, shape, strides, device)) = (unsafe { self.facts(cdata) }) else { return Ok(false) };
        let want_addr: u64 = probe.call_method0("data_ptr")?.extract()?;
        let want_shape: Vec<usize> = probe.getattr("shape")?.extract()?;
        let want_strides: Vec<isize> = probe.call_method0("stride")?.extract()?;
        Ok(addr == want_addr && dtype == DType::F32 && shape == want_shape && strides == want_strides && device == -1)
    }

    /// The facts of the tensor whose `TensorImpl` is at `cdata`; None for what the shim reports as an error, a
    /// dtype moelink does not move or a device other than the CPU and CUDA (the Python route explains those).
    ///
    /// # Safety
    /// `cdata` is the `_cdata` of a `torch.Tensor` the caller keeps alive during the call.
    pub(crate) unsafe fn facts(&self, cdata: usize) -> Option<Facts> {
        let word = cdata as *mut c_void;
        let handle = &word as *const *mut c_void as *mut c_void;
        let (mut ptr, mut dim, mut sizes, mut strides) = (std::ptr::null_mut(), 0i64, std::ptr::null_mut(), std::ptr::null_mut());
        let (mut dtype, mut device_type, mut device_index) = (0i32, 0i32, 0i32);
        // SAFETY (all calls): `handle` points at a word holding a live TensorImpl pointer, i.e. it is an
        // at::Tensor* for the duration of the call; the out-pointers are valid locals.
        unsafe {
            if (self.data_ptr)(handle, &mut ptr) != 0
                || (self.dim)(handle, &mut dim) != 0
                || (self.sizes)(handle, &mut sizes) != 0
                || (self.strides)(handle, &mut strides) != 0
                || (self.dtype)(handle, &mut dtype) != 0
                || (self.device_type)(handle, &mut device_type) != 0
                || (self.device_index)(handle, &mut device_index) != 0
            {
                return None;
            }
        }
        let dtype = self.dtypes.iter().find(|(c, _)| *c == dtype).map(|(_, d)| *d)?;
        let device = if device_type == self.cuda {
            device_index as i64
        } else if device_type == self.cpu {
            -1
        } else {
            return None;
        };
        let dim = usize::try_from(dim).ok()?;
        if dim > 0 && (sizes.is_null() || strides.is_null()) {
            return None;
        }
        // SAFETY: the shim returns the tensor's own size and stride arrays of `dim` elements, valid while it lives.
        let (sizes, strides) = unsafe {
            if dim == 0 {
                (&[][..], &[][..])
            } else {
                (std::slice::from_raw_parts(sizes, dim), std::slice::from_raw_parts(strides, dim))
            }
        };
        let shape = sizes.iter().map(|&s| usize::try_from(s).ok()).collect::<Option<Vec<_>>>()?;
        let strides = strides.iter().map(|&s| s as isize).collect();
        Some((ptr as u64, dtype, shape, strides, device))
    }
}
