//! [`PyGroup`]: a [`moelink::Group`] whose collectives call back into a Python object.
//!
//! The object (the package wraps a `torch.distributed` group, an mpi4py communicator, or in tests a
//! queue between threads) provides:
//! - `rank() -> int`, `size() -> int`;
//! - `all_gather(data: bytes) -> list[bytes]`: every rank's contribution, indexed by rank;
//! - optionally `local_rank() -> int` (the GPU this rank uses by default; default: `rank()`) and
//!   `process_key() -> int` (equal exactly for ranks in one address space; default: host name and pid);
//! - optionally `all_gather_within(data: bytes, timeout_ms: int) -> list[bytes]` and
//!   `all_to_all_within(send: list[bytes], timeout_ms: int) -> list[bytes]` (`send[r]` goes to rank `r`; the
//!   result is indexed by source): the same exchanges, waiting at most `timeout_ms`. A rank that does not
//!   arrive in time raises the built-in `TimeoutError` with a `peer` attribute naming it, which becomes
//!   `moelink::Error::Timeout`. The host backend exchanges through these with the buffer's deadline; a group
//!   without them keeps its own deadline (`all_gather`, and `all_to_all` packed into it).
//!
//! Callbacks run with the GIL re-acquired (the Rust call that needs them runs with it released).

use std::sync::Mutex;
use std::time::{Duration, Instant};

use pyo3::exceptions::PyTimeoutError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};

use moelink::{Error, Group, Phase};

pub(crate) struct PyGroup {
    obj: Py<PyAny>,
    rank: usize,
    size: usize,
    local_rank: usize,
    process_key: u64,
    /// The exception the last failed callback raised, so the caller's error can chain it.
    last_error: Mutex<Option<PyErr>>,
    /// Whether the object has `all_gather_within` / `all_to_all_within`.
    gather_within: bool,
    all_to_all_within: bool,
}

impl PyGroup {
    pub(crate) fn new(obj: &Bound<'_, PyAny>) -> PyResult<PyGroup> {
        let rank: usize = obj.call_method0("rank")?.extract()?;
        let size: usize = obj.call_method0("size")?.extract()?;
        let local_rank: usize = if obj.hasattr("local_rank")? { obj.call_method0("local_rank")?.extract()? } else { rank };
        let process_key: u64 =
            if obj.hasattr("process_key")? { obj.call_method0("process_key")?.extract()? } else { moelink::group::process_key() };
        let gather_within = obj.hasattr("all_gather_within")?;
        let all_to_all_within = obj.hasattr("all_to_all_within")?;
        Ok(PyGroup {
            obj: obj.clone().unbind(),
            rank,
            size,
            local_rank,
            process_key,
            last_error: Mutex::new(None),
            gather_within,
            all_to_all_within,
        })
    }

    /// The Python object behind this group.
    pub(crate) fn object(&self) -> &Py<PyAny> {
        &self.obj
    }

    /// Takes the exception of the last failed callback, if any.
    pub(crate) fn take_error(&self) -> Option<PyErr> {
        self.last_error.lock().ok().and_then(|mut e| e.take())
    }

    fn gather(&self, py: Python<'_>, bytes: &[u8], timeout: Option<Duration>) -> PyResult<Vec<Vec<u8>>> {
        let data = PyBytes::new(py, bytes);
        let out = match timeout {
            Some(t) => self.obj.bind(py).call_method1("all_gather_within", (data, millis(t)))?,
            None => self.obj.bind(py).call_method1("all_gather", (data,))?,
        };
        Self::byte_list(out)
    }

    fn exchange(&self, py: Python<'_>, send: &[Vec<u8>], timeout: Duration) -> PyResult<Vec<Vec<u8>>> {
        let send = PyList::new(py, send.iter().map(|m| PyBytes::new(py, m)))?;
        Self::byte_list(self.obj.bind(py).call_method1("all_to_all_within", (send, millis(timeout)))?)
    }

    fn byte_list(out: Bound<'_, PyAny>) -> PyResult<Vec<Vec<u8>>> {
        let mut all = Vec::new();
        for item in out.try_iter()? {
            all.push(item?.cast::<PyBytes>()?.as_bytes().to_vec());
        }
        Ok(all)
    }

    /// Runs one callback and turns its outcome into the group's: the right number of messages, or a
    /// `Timeout` naming the peer the callback's `TimeoutError` names, or a group error chaining the exception.
    fn call(&self, what: &str, f: impl FnOnce(Python<'_>) -> PyResult<Vec<Vec<u8>>>) -> moelink::Result<Vec<Vec<u8>>> {
        let start = Instant::now();
        Python::attach(|py| match f(py) {
            Ok(all) if all.len() == self.size => Ok(all),
            Ok(all) => Err(Error::Group {
                rank: self.rank,
                reason: format!("the group's {what} returned {} messages for {} ranks", all.len(), self.size),
            }),
            Err(e) => {
                let peer = if e.is_instance_of::<PyTimeoutError>(py) {
                    e.value(py).getattr("peer").ok().and_then(|p| p.extract::<usize>().ok()).filter(|&p| p < self.size)
                } else {
                    None
                };
                let reason = format!("the group's {what} raised {e}");
                if let Ok(mut slot) = self.last_error.lock() {
                    *slot = Some(e);
                }
                match peer {
                    Some(peer) => {
                        Err(Error::Timeout { rank: self.rank, peer, phase: Phase::Group, waited_ms: start.elapsed().as_millis() as u64 })
                    }
                    None => Err(Error::Group { rank: self.rank, reason }),
                }
            }
        })
    }
}

fn millis(d: Duration) -> u64 {
    d.as_millis().try_into().unwrap_or(u64::MAX).max(1)
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
        self.call("all_gather", |py| self.gather(py, bytes, None))
    }
    fn all_gather_within(&self, bytes: &[u8], timeout: Duration) -> moelink::Result<Vec<Vec<u8>>> {
        if !self.gather_within {
            return self.all_gather(bytes);
        }
        self.call("all_gather_within", |py| self.gather(py, bytes, Some(timeout)))
    }
    fn all_to_all_within(&self, send: Vec<Vec<u8>>, timeout: Duration) -> moelink::Result<Vec<Vec<u8>>> {
        if send.len() != self.size {
            return Err(Error::invalid("send", self.rank, format!("{} messages for {} ranks", send.len(), self.size)));
        }
        if !self.all_to_all_within {
            // The packed fallback over all_gather_within keeps the deadline.
            let mut packed = Vec::new();
            for m in &send {
                packed.extend_from_slice(&(m.len() as u64).to_le_bytes());
                packed.extend_from_slice(m);
            }
            let all = self.all_gather_within(&packed, timeout)?;
            return all
                .iter()
                .enumerate()
                .map(|(src, p)| {
                    unpack_nth(p, self.rank)
                        .ok_or_else(|| Error::Group { rank: self.rank, reason: format!("malformed all_to_all message from rank {src}") })
                })
                .collect();
        }
        self.call("all_to_all_within", |py| self.exchange(py, &send, timeout))
    }
}

/// Message `n` of a packed list (`u64` length, bytes; repeated).
fn unpack_nth(p: &[u8], n: usize) -> Option<Vec<u8>> {
    let mut off = 0usize;
    for i in 0.. {
        let len = usize::try_from(u64::from_le_bytes(p.get(off..off.checked_add(8)?)?.try_into().ok()?)).ok()?;
        off += 8;
        let body = p.get(off..off.checked_add(len)?)?;
        if i == n {
            return Some(body.to_vec());
        }
        off += len;
    }
    None
}
