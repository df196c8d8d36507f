//! Rust errors as Python exceptions.
//!
//! | Rust | Python |
//! |---|---|
//! | `InvalidArgument` about a dtype | `TypeError` |
//! | `InvalidArgument`, `RankMismatch` | `ValueError` |
//! | `Timeout` | `moelink.TimeoutError` (a `RuntimeError`) with `rank`, `peer`, `phase`, `waited_ms` |
//! | `Poisoned`, `BufferTooSmall`, `Unavailable`, `Group`, `Cuda` | `RuntimeError` |
//! | `Io` | `OSError` |
//!
//! Argument errors carry `argument` (the name) and `rank`; every message names the argument too.

use pyo3::exceptions::{PyOSError, PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;

use moelink::Error;

pyo3::create_exception!(
    moelink,
    TimeoutError,
    PyRuntimeError,
    "A peer did not arrive within the deadline. Attributes: `rank` (this rank), `peer` (the rank waited for, or None \
     when unknown), `phase` (the step that was running), `waited_ms`. The buffer is unusable afterwards."
);

/// Sets `name = value` on the exception instance (best effort: a failure leaves the message intact).
fn annotate<'py>(py: Python<'py>, err: &PyErr, items: &[(&str, Bound<'py, PyAny>)]) {
    let value = err.value(py);
    for (name, v) in items {
        let _ = value.setattr(*name, v);
    }
}

/// Converts a core error. `group_cause` is the Python exception a group callback raised, if the error
/// came from one; it becomes the `__cause__`.
pub(crate) fn to_pyerr(py: Python<'_>, e: Error, group_cause: Option<PyErr>) -> PyErr {
    let msg = e.to_string();
    let none = || py.None().into_bound(py);
    let int = |v: usize| v.into_pyobject(py).map(|o| o.into_any()).unwrap_or_else(|_| none());
    let text = |s: &str| s.into_pyobject(py).map(|o| o.into_any()).unwrap_or_else(|_| none());
    let err = match &e {
        Error::InvalidArgument { arg, rank, reason } => {
            let err = if reason.starts_with("dtype is") { PyTypeError::new_err(msg) } else { PyValueError::new_err(msg) };
            annotate(py, &err, &[("argument", text(arg)), ("rank", int(*rank))]);
            err
        }
        Error::RankMismatch { what, rank, peer, .. } => {
            let err = PyValueError::new_err(msg);
            annotate(py, &err, &[("argument", text(what)), ("rank", int(*rank)), ("peer", int(*peer))]);
            err
        }
        Error::Timeout { rank, peer, phase, waited_ms } => {
            let err = TimeoutError::new_err(msg);
            let peer = if *peer == usize::MAX { none() } else { int(*peer) };
            let waited = waited_ms.into_pyobject(py).map(|o| o.into_any()).unwrap_or_else(|_| none());
            annotate(py, &err, &[("rank", int(*rank)), ("peer", peer), ("phase", text(&phase.to_string())), ("waited_ms", waited)]);
            err
        }
        Error::Poisoned { .. } | Error::BufferTooSmall { .. } | Error::Unavailable(_) | Error::Group { .. } | Error::Cuda(_) => {
            PyRuntimeError::new_err(msg)
        }
        Error::Io(_) => PyOSError::new_err(msg),
    };
    if let Some(cause) = group_cause {
        err.set_cause(py, Some(cause));
    }
    err
}

/// A `ValueError` for a name that is not one of `names` (an environment variable's value, a backend name),
/// with `argument` set to `source` and `rank` to -1: nothing has a rank yet.
pub(crate) fn invalid_name(py: Python<'_>, source: &str, value: &str, names: &[&str]) -> PyErr {
    let err = PyValueError::new_err(format!("invalid argument `{source}`: {value:?} is not one of {}", names.join(", ")));
    let none = || py.None().into_bound(py);
    let name = source.into_pyobject(py).map(|o| o.into_any()).unwrap_or_else(|_| none());
    let rank = (-1i64).into_pyobject(py).map(|o| o.into_any()).unwrap_or_else(|_| none());
    annotate(py, &err, &[("argument", name), ("rank", rank)]);
    err
}

/// A `ValueError` about argument `arg` of a call that involves no buffer (`rank` -1, as `invalid_name`).
pub(crate) fn unranked(py: Python<'_>, arg: &str, reason: String) -> PyErr {
    let err = PyValueError::new_err(format!("invalid argument `{arg}`: {reason}"));
    let none = || py.None().into_bound(py);
    let name = arg.into_pyobject(py).map(|o| o.into_any()).unwrap_or_else(|_| none());
    let rank = (-1i64).into_pyobject(py).map(|o| o.into_any()).unwrap_or_else(|_| none());
    annotate(py, &err, &[("argument", name), ("rank", rank)]);
    err
}

/// An argument error raised before the core sees the call (e.g. a dtype the core does not know).
pub(crate) fn type_error(py: Python<'_>, arg: &str, rank: usize, reason: String) -> PyErr {
    let err = PyTypeError::new_err(format!("invalid argument `{arg}` on rank {rank}: {reason}"));
    let none = || py.None().into_bound(py);
    let name = arg.into_pyobject(py).map(|o| o.into_any()).unwrap_or_else(|_| none());
    let rank = rank.into_pyobject(py).map(|o| o.into_any()).unwrap_or_else(|_| none());
    annotate(py, &err, &[("argument", name), ("rank", rank)]);
    err
}
