//! [`PyGroup`]: a [`moelink::Group`] whose collectives call back into a Python object.
//!
//! The object (the package wraps a `torch.distributed` group, an mpi4py communicator, or in tests a
//! queue between threads) provides:
//! - `rank() -> int`, `size() -> int`;
//! - `all_gather(data: bytes) -> list[bytes]`: every rank's contribution, indexed by rank;
//! - optionally `local_rank() -> int` (the GPU this rank uses by default; default: `rank()`) and
//!   `process_key() -> int` (equal exactly for ranks in one address space; default: host name and pid).
//!
//! Callbacks run with the GIL re-acquired (the Rust call that needs them runs with it released).

use std::sync::Mutex;

use pyo3::prelude::*;
use pyo3::types::PyBytes;

use moelink::{Error, Group};

pub(crate) struct PyGroup {
    obj: Py<PyAny>,
    rank: usize,
    size: usize,
    local_rank: usize,
    process_key: u64,
    /// The exception the last failed callback raised, so the caller's error can chain it.
    last_error: Mutex<Option<PyErr>>,
}

impl PyGroup {
    pub(crate) fn new(obj: &Bound<'_, PyAny>) -> PyResult<PyGroup> {
        let rank: usize = obj.call_method0("rank")?.extract()?;
        let size: usize = obj.call_method0("size")?.extract()?;
        let local_rank: usize = if obj.hasattr("local_rank")? { obj.call_method0("local_rank")?.extract()? } else { rank };
        let process_key: u64 =
            if obj.hasattr("process_key")? { obj.call_method0("process_key")?.extract()? } else { moelink::group::process_key() };
        Ok(PyGroup { obj: obj.clone().unbind(), rank, size, local_rank, process_key, last_error: Mutex::new(None) })
    }

    /// The Python object behind this group.
    pub(crate) fn object(&self) -> &Py<PyAny> {
        &self.obj
    }

    /// Takes the exception of the last failed callback, if any.
    pub(crate) fn take_error(&self) -> Option<PyErr> {
        self.last_error.lock().ok().and_then(|mut e| e.take())
    }

    fn gather(&self, py: Python<'_>, bytes: &[u8]) -> PyResult<Vec<Vec<u8>>> {
        let out = self.obj.bind(py).call_method1("all_gather", (PyBytes::new(py, bytes),))?;
        let mut all = Vec::with_capacity(self.size);
        for item in out.try_iter()? {
            all.push(item?.cast::<PyBytes>()?.as_bytes().to_vec());
        }
        Ok(all)
    }
}

impl Group for PyGroup {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }
    fn local_rank(&self) -> usize {
        self.local_rank
    }
    fn process_key(&self) -> u64 {
        self.process_key
    }
    fn all_gather(&self, bytes: &[u8]) -> moelink::Result<Vec<Vec<u8>>> {
        Python::attach(|py| match self.gather(py, bytes) {
            Ok(all) if all.len() == self.size => Ok(all),
            Ok(all) => Err(Error::Group {
                rank: self.rank,
                reason: format!("the group's all_gather returned {} messages for {} ranks", all.len(), self.size),
            }),
            Err(e) => {
                let reason = format!("the group's all_gather raised {e}");
                if let Ok(mut slot) = self.last_error.lock() {
                    *slot = Some(e);
                }
                Err(Error::Group { rank: self.rank, reason })
            }
        })
    }
}
