//! Tensors as Python passes them: `(data_ptr, dtype, shape, strides, device)`.
//!
//! - `data_ptr`: address of element `[0, ...]` (torch's `data_ptr()`, numpy's `__array_interface__`).
//! - `dtype`: torch's name without the prefix (`"bfloat16"`, `"float8_e4m3fn"`, ...).
//! - `shape`, `strides`: in elements (torch's `stride()`).
//! - `device`: the CUDA device index, or `-1` for host memory.

use pyo3::prelude::*;

use moelink::{DType, Error, Location, TensorMut, TensorRef};

use crate::errors::type_error;

#[derive(FromPyObject)]
pub(crate) struct TensorArg(u64, String, Vec<usize>, Vec<isize>, i64);

impl TensorArg {
    /// The strides to use: as given, except that an empty tensor (some dimension 0) gets row-major strides
    /// (numpy reports `(0, 0)` for a `(0, H)` array; what they are does not matter without elements).
    fn strides(&self) -> Vec<isize> {
        if !self.2.contains(&0) {
            return self.3.clone();
        }
        let mut strides = vec![0isize; self.2.len()];
        let mut acc = 1isize;
        for (s, &d) in strides.iter_mut().zip(&self.2).rev() {
            *s = acc;
            acc = acc.saturating_mul(d.max(1) as isize);
        }
        strides
    }

    fn parts(&self, py: Python<'_>, arg: &'static str, rank: usize) -> PyResult<(DType, Location)> {
        let dtype = DType::from_name(&self.1).ok_or_else(|| {
            type_error(py, arg, rank, format!("dtype {} is not supported (moelink moves {})", self.1, crate::dtype_names().join(", ")))
        })?;
        let location = if self.4 < 0 { Location::Host } else { Location::Cuda(self.4 as usize) };
        Ok((dtype, location))
    }

    /// A read-only view of the tensor.
    ///
    /// The view is `'static` because Python owns the memory: the package keeps every tensor it passes
    /// alive for the call and, for work left on a stream, until that work completes (`EventOverlap`'s
    /// `extra_tensors`, `record_stream`).
    pub(crate) fn view(&self, py: Python<'_>, arg: &'static str, rank: usize) -> PyResult<TensorRef<'static>> {
        let (dtype, location) = self.parts(py, arg, rank)?;
        // SAFETY: the address, shape and strides describe a live tensor (or numpy array) that the Python
        // caller keeps alive and does not write while the call that reads it runs (see above).
        let view = unsafe { TensorRef::from_raw_parts(self.0, location, dtype, &self.2, &self.strides()) };
        view.map_err(|e| rename(py, e, arg, rank))
    }

    /// A writable view of the tensor (an output the caller allocated).
    pub(crate) fn view_mut(&self, py: Python<'_>, arg: &'static str, rank: usize) -> PyResult<TensorMut<'static>> {
        let (dtype, location) = self.parts(py, arg, rank)?;
        // SAFETY: as in `view`; outputs are freshly allocated by the package (or given by the caller as
        // `out=`/stats tensors it owns) and nothing else writes them during the call.
        let view = unsafe { TensorMut::from_raw_parts(self.0, location, dtype, &self.2, &self.strides()) };
        view.map_err(|e| rename(py, e, arg, rank))
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
