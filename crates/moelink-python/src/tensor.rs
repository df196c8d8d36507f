//! Tensors as Python passes them: a `torch.Tensor`, read here directly, or a description tuple
//! `(data_ptr, dtype, shape, strides, device)`.
//!
//! - `data_ptr`: address of element `[0, ...]` (torch's `data_ptr()`, numpy's `__array_interface__`).
//! - `dtype`: torch's name without the prefix (`"bfloat16"`, `"float8_e4m3fn"`, ...).
//! - `shape`, `strides`: in elements (torch's `stride()`).
//! - `device`: the CUDA device index, or `-1` for host memory.
//!
//! The package passes torch tensors as they are: reading their five facts here costs a few attribute
//! lookups, where building the tuple in Python cost a dozen bytecode-level calls per tensor. The tuples stay
//! for callers without torch (the tests drive the module with numpy arrays).

use std::sync::Mutex;

use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyTuple, PyType};
use pyo3::{intern, Py};

use moelink::{DType, Error, Layout, Location, MemMut, MemRef, TensorMut, TensorRef};

use crate::errors::type_error;

/// A tensor argument, read from a `torch.Tensor` or a description tuple.
pub(crate) struct TensorArg {
    addr: u64,
    /// The element type, or the name of one moelink does not move.
    dtype: Result<DType, String>,
    shape: Vec<usize>,
    strides: Vec<isize>,
    /// CUDA device index, -1 for host memory.
    device: i64,
}

#[derive(FromPyObject)]
struct TupleArg(u64, String, Vec<usize>, Vec<isize>, i64);

/// `torch.Tensor`, or None where torch does not import (looked up once, the first time an argument is not a
/// tuple).
static TORCH_TENSOR: PyOnceLock<Option<Py<PyType>>> = PyOnceLock::new();

/// A torch dtype object seen before: its address, a reference (so that the address cannot be reused), and what
/// it is (a moelink dtype, or the name of one moelink does not move).
type SeenDtype = (usize, Py<PyAny>, Result<DType, String>);

/// torch dtype objects seen so far. torch's dtypes are singletons that live as long as the interpreter.
static DTYPES: Mutex<Vec<SeenDtype>> = Mutex::new(Vec::new());

fn torch_tensor_type(py: Python<'_>) -> Option<&Bound<'_, PyType>> {
    TORCH_TENSOR
        .get_or_init(py, || {
            let torch = py.import("torch").ok()?;
            torch.getattr("Tensor").ok()?.cast_into::<PyType>().ok().map(Bound::unbind)
        })
        .as_ref()
        .map(|t| t.bind(py))
}

/// The moelink dtype of a torch dtype object (`torch.bfloat16` → BF16), or its name when moelink does not
/// move it.
fn dtype_of(dtype: &Bound<'_, PyAny>) -> PyResult<Result<DType, String>> {
    let key = dtype.as_ptr() as usize;
    if let Ok(seen) = DTYPES.lock() {
        if let Some((_, _, d)) = seen.iter().find(|(k, _, _)| *k == key) {
            return Ok(d.clone());
        }
    }
    let text: String = dtype.str()?.extract()?;
    let name = text.strip_prefix("torch.").unwrap_or(&text).to_string();
    let d = DType::from_name(&name).ok_or(name);
    if let Ok(mut seen) = DTYPES.lock() {
        seen.push((key, dtype.clone().unbind(), d.clone()));
    }
    Ok(d)
}

/// The device string torch prints for a buffer on device `device` (-1: the CPU).
pub(crate) fn torch_device_name(device: i64) -> String {
    if device < 0 {
        "cpu".to_string()
    } else {
        format!("cuda:{device}")
    }
}

impl TensorArg {
    /// Reads argument `arg` of a call on `rank`'s buffer (on device `buffer_device`, -1 for the host): a
    /// `torch.Tensor`, or a description tuple. Anything else is a `TypeError` naming the argument; a tensor on
    /// a device that is neither the CPU nor a CUDA GPU a `ValueError`.
    pub(crate) fn read(obj: &Bound<'_, PyAny>, arg: &'static str, rank: usize, buffer_device: i64) -> PyResult<TensorArg> {
        let py = obj.py();
        if obj.is_instance_of::<PyTuple>() {
            let TupleArg(addr, name, shape, strides, device) = obj.extract().map_err(|_| {
                type_error(
                    py,
                    arg,
                    rank,
                    "expected a torch.Tensor, got tuple (not a (data_ptr, dtype, shape, strides, device) description)".into(),
                )
            })?;
            let dtype = DType::from_name(&name).ok_or(name);
            return Ok(TensorArg { addr, dtype, shape, strides, device });
        }
        let is_tensor = match torch_tensor_type(py) {
            Some(t) => obj.is_instance(t)?,
            None => false,
        };
        if !is_tensor {
            let kind = obj.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "object".into());
            return Err(type_error(py, arg, rank, format!("expected a torch.Tensor, got {kind}")));
        }
        // A plain torch.Tensor (not a subclass, whose attributes may be its own): its facts through torch's C
        // shim when that passed its check; else, or for anything the shim does not describe, the attributes.
        if let (Some(shim), Some(t)) = (crate::torch_shim::shim(py), torch_tensor_type(py)) {
            if obj.get_type().is(t) {
                if let Ok(cdata) = obj.getattr(intern!(py, "_cdata")).and_then(|c| c.extract::<usize>()) {
                    // SAFETY: `cdata` is the `_cdata` of `obj`, a torch.Tensor the caller holds during this call.
                    if let Some((addr, dtype, shape, strides, device)) = unsafe { shim.facts(cdata) } {
                        return Ok(TensorArg { addr, dtype: Ok(dtype), shape, strides, device });
                    }
                }
            }
        }
        let device = if obj.getattr(intern!(py, "is_cuda"))?.is_truthy()? {
            obj.call_method0(intern!(py, "get_device"))?.extract::<i64>()?
        } else if obj.getattr(intern!(py, "is_cpu"))?.is_truthy()? {
            -1
        } else {
            let on: String = obj.getattr(intern!(py, "device"))?.str()?.extract()?;
            let reason = format!("tensor is on {on}, the buffer works on {}", torch_device_name(buffer_device));
            return Err(crate::errors::to_pyerr(py, Error::invalid(arg, rank, reason), None));
        };
        Ok(TensorArg {
            addr: obj.call_method0(intern!(py, "data_ptr"))?.extract()?,
            dtype: dtype_of(&obj.getattr(intern!(py, "dtype"))?)?,
            shape: obj.getattr(intern!(py, "shape"))?.extract()?,
            strides: obj.call_method0(intern!(py, "stride"))?.extract()?,
            device,
        })
    }

    /// [`TensorArg::read`] for an optional argument (absent or None: `None`).
    pub(crate) fn read_opt(
        obj: Option<&Bound<'_, PyAny>>,
        arg: &'static str,
        rank: usize,
        buffer_device: i64,
    ) -> PyResult<Option<TensorArg>> {
        match obj {
            Some(o) if !o.is_none() => TensorArg::read(o, arg, rank, buffer_device).map(Some),
            _ => Ok(None),
        }
    }

    /// The strides to use: as given, except that an empty tensor (some dimension 0) gets row-major strides
    /// (numpy reports `(0, 0)` for a `(0, H)` array; what they are does not matter without elements).
    fn strides(&self) -> Vec<isize> {
        if !self.shape.contains(&0) {
            return self.strides.clone();
        }
        let mut strides = vec![0isize; self.shape.len()];
        let mut acc = 1isize;
        for (s, &d) in strides.iter_mut().zip(&self.shape).rev() {
            *s = acc;
            acc = acc.saturating_mul(d.max(1) as isize);
        }
        strides
    }

    fn parts(&self, py: Python<'_>, arg: &'static str, rank: usize) -> PyResult<(DType, Location)> {
        let dtype = match &self.dtype {
            Ok(d) => *d,
            Err(name) => {
                let moved = crate::dtype_names().join(", ");
                return Err(type_error(py, arg, rank, format!("dtype {name} is not supported (moelink moves {moved})")));
            }
        };
        let location = if self.device < 0 { Location::Host } else { Location::Cuda(self.device as usize) };
        Ok((dtype, location))
    }

    /// The facts as `read_tensor` returns them (a dtype moelink does not move: the `TypeError` naming it).
    pub(crate) fn describe(&self, py: Python<'_>) -> PyResult<ViewTuple> {
        let (dtype, _) = self.parts(py, "tensor", 0)?;
        Ok((self.addr, dtype.name(), self.shape.clone(), self.strides.clone(), self.device))
    }

    /// A read-only view of the tensor.
    ///
    /// The view is `'static` because Python owns the memory: the package keeps every tensor it passes
    /// alive for the call and, for work left on a stream, until that work completes (`EventOverlap`'s
    /// `extra_tensors`, `record_stream`).
    pub(crate) fn view(&self, py: Python<'_>, arg: &'static str, rank: usize) -> PyResult<TensorRef<'static>> {
        let (dtype, location) = self.parts(py, arg, rank)?;
        let bytes = self.span_bytes(dtype).map_err(|e| rename(py, e, arg, rank))?;
        // SAFETY: the address, shape and strides describe a live tensor (or numpy array) that the Python
        // caller keeps alive and does not write while the call that reads it runs (see above).
        let mem = unsafe { MemRef::from_raw(self.addr, bytes, location.into()) };
        TensorRef::from_memory(mem, dtype, &self.shape, &self.strides()).map_err(|e| rename(py, e, arg, rank))
    }

    /// A writable view of the tensor (an output the caller allocated).
    pub(crate) fn view_mut(&self, py: Python<'_>, arg: &'static str, rank: usize) -> PyResult<TensorMut<'static>> {
        let (dtype, location) = self.parts(py, arg, rank)?;
        let bytes = self.span_bytes(dtype).map_err(|e| rename(py, e, arg, rank))?;
        // SAFETY: as in `view`; outputs are freshly allocated by the package (or given by the caller as
        // `out=`/stats tensors it owns, or kept by the package for reuse only while nothing else references
        // them) and nothing else writes them during the call.
        let mem = unsafe { MemMut::from_raw(self.addr, bytes, location.into()) };
        TensorMut::from_memory(mem, dtype, &self.shape, &self.strides()).map_err(|e| rename(py, e, arg, rank))
    }

    /// Bytes from the first element to one past the last (the layout checked: an error names shape or strides).
    fn span_bytes(&self, dtype: DType) -> Result<usize, Error> {
        Ok(Layout::new(&self.shape, &self.strides())?.span_elems() * dtype.size_bytes())
    }
}

/// A layout error from the tensor constructors names "shape"/"strides" on rank 0; name the argument.
fn rename(py: Python<'_>, e: Error, arg: &'static str, rank: usize) -> PyErr {
    let e = match e {
        Error::InvalidArgument { reason, .. } => Error::invalid(arg, rank, reason),
        other => other,
    };
    crate::errors::to_pyerr(py, e, None)
}

pub(crate) fn opt_view(py: Python<'_>, t: &Option<TensorArg>, arg: &'static str, rank: usize) -> PyResult<Option<TensorRef<'static>>> {
    t.as_ref().map(|t| t.view(py, arg, rank)).transpose()
}

pub(crate) fn opt_view_mut(py: Python<'_>, t: &Option<TensorArg>, arg: &'static str, rank: usize) -> PyResult<Option<TensorMut<'static>>> {
    t.as_ref().map(|t| t.view_mut(py, arg, rank)).transpose()
}

/// A view's description for Python: `(data_ptr, dtype, shape, strides, device)`.
pub(crate) type ViewTuple = (u64, &'static str, Vec<usize>, Vec<isize>, i64);

pub(crate) fn describe(t: &TensorMut<'_>) -> ViewTuple {
    let device = match t.location() {
        Location::Host => -1,
        Location::Cuda(d) => d as i64,
    };
    (t.addr(), t.dtype().name(), t.shape().to_vec(), t.strides().to_vec(), device)
}
