//! `moelink._native`: the Python extension module, a thin adapter over the Rust API.
//!
//! Nothing here links libtorch. The Python package passes tensors as `(data_ptr, dtype name, shape,
//! strides in elements, device index or -1 for CPU)` tuples, allocates every output with torch and hands
//! raw stream handles over as integers; this module turns them into [`moelink::TensorRef`]s, runs the
//! Rust call with the GIL released, and turns [`moelink::Error`]s into Python exceptions that name the
//! argument. The process group is a Python object (see `group::PyGroup`).
//!
//! The two-phase shape of the Rust API is kept: `prepare_dispatch` returns the sizes, Python allocates,
//! `dispatch_into` moves the data.

mod buffer;
mod errors;
mod group;
mod tensor;
mod torch_shim;

use pyo3::prelude::*;
use pyo3::types::PyDict;

/// `Config`'s knobs as Python passes them: `(num_sms, nvl send, nvl recv, rdma send, rdma recv)`.
pub(crate) type ConfigTuple = (usize, usize, usize, usize, usize);

pub(crate) fn config_from(t: ConfigTuple) -> moelink::Config {
    moelink::Config {
        num_sms: t.0,
        num_max_nvl_chunked_send_tokens: t.1,
        num_max_nvl_chunked_recv_tokens: t.2,
        num_max_rdma_chunked_send_tokens: t.3,
        num_max_rdma_chunked_recv_tokens: t.4,
    }
}

/// NVLink-domain buffer bytes a config needs for rows of `hidden_bytes` (DeepEP's
/// `Config.get_nvl_buffer_size_hint`).
#[pyfunction]
fn nvl_buffer_size_hint(config: ConfigTuple, hidden_bytes: usize, num_ranks: usize) -> usize {
    config_from(config).get_nvl_buffer_size_hint(hidden_bytes, num_ranks)
}

/// What the native module reads from tensor argument `tensor`: `(data_ptr, dtype, shape, strides, device)`
/// (device -1: host memory), as every call reads its tensors (through torch's C shim where it passed its
/// check, else the tensor's attributes). For tests and diagnostics.
#[pyfunction]
fn read_tensor(py: Python<'_>, tensor: &Bound<'_, PyAny>) -> PyResult<tensor::ViewTuple> {
    let t = tensor::TensorArg::read(tensor, "tensor", 0, -1)?;
    t.describe(py)
}

/// How the native module reads torch tensors: `"shim"` (torch's stable C shim, checked on a probe tensor when
/// first needed) or `"attributes"` (the tensor's Python attributes; also the route for tensor subclasses).
#[pyfunction]
fn tensor_route(py: Python<'_>) -> &'static str {
    if torch_shim::shim(py).is_some() {
        "shim"
    } else {
        "attributes"
    }
}

/// RDMA buffer bytes a config needs (0 within one node).
#[pyfunction]
fn rdma_buffer_size_hint(config: ConfigTuple, hidden_bytes: usize, num_ranks: usize) -> usize {
    config_from(config).get_rdma_buffer_size_hint(hidden_bytes, num_ranks)
}

/// Low-latency buffer bytes (`num_rdma_bytes`) for these sizes: what every backend requires of a buffer
/// for low-latency calls of this shape, zero-copy combine included (`moelink::Buffer::ll_bytes_needed`).
#[pyfunction]
fn low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: usize, hidden: usize, num_ranks: usize, num_experts: usize) -> usize {
    moelink::Buffer::ll_bytes_needed(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)
}

/// `num_nvl_bytes` for high-throughput calls of up to `num_tokens` tokens per rank
/// (`moelink::Buffer::ht_bytes_needed`).
#[pyfunction]
fn ht_bytes_needed(num_tokens: usize, hidden: usize, topk: usize, num_ranks: usize, fp8: bool) -> usize {
    moelink::Buffer::ht_bytes_needed(num_tokens, hidden, topk, num_ranks, fp8)
}

/// `(num_nvl_bytes, num_rdma_bytes)` for high-throughput calls on a buffer whose ranks span nodes
/// (`topology`: `"NODESxRANKS_PER_NODE"`), in rounds of up to `round_tokens` tokens per rank
/// (`moelink::internode::ht_bytes_needed`): a call of more tokens runs more rounds; smaller sizes mean smaller
/// rounds, down to one token.
#[pyfunction]
fn ht_internode_bytes_needed(
    py: Python<'_>,
    topology: &str,
    round_tokens: usize,
    hidden: usize,
    topk: usize,
    fp8: bool,
) -> PyResult<(usize, usize)> {
    let t = topology.parse::<moelink::Topology>().map_err(|e| errors::unranked(py, "topology", e))?;
    let b = moelink::internode::ht_bytes_needed(t, round_tokens, hidden, topk, fp8);
    Ok((b.num_nvl_bytes, b.num_rdma_bytes))
}

/// The backend a name selects (`"auto"`, `"host"` or `"cuda"`, exactly), checked before anything touches
/// CUDA; a `ValueError` naming `source` (e.g. `MOELINK_BACKEND`) and listing the names otherwise.
#[pyfunction]
#[pyo3(signature = (name, source="backend"))]
fn check_backend(py: Python<'_>, name: &str, source: &str) -> PyResult<&'static str> {
    match moelink::BackendKind::from_name(name) {
        Some(kind) => Ok(kind.name()),
        None => Err(errors::invalid_name(py, source, name, moelink::BackendKind::NAMES)),
    }
}

/// What the CUDA layer finds on this machine, without creating a context: a dict with `available`
/// (bool), `reason` (why not, or ""), `driver_version`, `nvrtc` (`"major.minor"` or the error) and
/// `devices` (a list of dicts: `name`, `compute_capability` as `(major, minor)`, `multiprocessors`).
#[pyfunction]
fn cuda_info(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let d = PyDict::new(py);
    match moelink_cuda::system_info() {
        Ok(info) => {
            let devices = info
                .devices
                .iter()
                .map(|dev| {
                    let e = PyDict::new(py);
                    e.set_item("name", &dev.name)?;
                    e.set_item("compute_capability", dev.compute_capability)?;
                    e.set_item("multiprocessors", dev.multiprocessors)?;
                    Ok(e)
                })
                .collect::<PyResult<Vec<_>>>()?;
            let reason = match (&info.nvrtc, devices.is_empty()) {
                (_, true) => "the CUDA driver reports no GPU".to_string(),
                (Err(e), false) => format!("NVRTC is unavailable: {e}"),
                (Ok(_), false) => String::new(),
            };
            d.set_item("available", reason.is_empty())?;
            d.set_item("reason", reason)?;
            d.set_item("driver_version", info.driver_version)?;
            d.set_item("nvrtc", info.nvrtc.map(|(a, b)| format!("{a}.{b}")).unwrap_or_else(|e| e))?;
            d.set_item("devices", devices)?;
        }
        Err(e) => {
            d.set_item("available", false)?;
            d.set_item("reason", e.to_string())?;
            d.set_item("driver_version", py.None())?;
            d.set_item("nvrtc", py.None())?;
            d.set_item("devices", Vec::<i32>::new())?;
        }
    }
    Ok(d)
}

/// The dtype names tensors may carry (torch's spelling, without the `torch.` prefix).
#[pyfunction]
fn dtype_names() -> Vec<&'static str> {
    use moelink::DType::*;
    [Bool, U8, I32, I64, F32, BF16, Fp8E4M3].iter().map(|d| d.name()).collect()
}

/// Where compile reports go when `MOELINK_JIT_VERBOSE=1`.
fn print_jit_report(line: &str) {
    eprintln!("{line}");
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    // The JIT's settings from the environment (`MOELINK_CACHE_DIR`, `MOELINK_JIT_VERBOSE`), before any
    // compile; the library reads none. Already set only when this process configured the JIT otherwise.
    let _ = moelink_cuda::jit::configure(moelink_cuda::jit::JitSettings::from_vars(|k| std::env::var(k).ok(), print_jit_report));
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    // The commit the module was built from ("" when built outside a git checkout).
    m.add("__build_commit__", env!("MOELINK_BUILD_COMMIT"))?;
    // QPs per peer the kernels use at most across nodes (a larger `num_qps_per_rank` is capped to it).
    m.add("MAX_QPS_PER_RANK", moelink::RdmaOptions::MAX_QPS_PER_RANK)?;
    m.add("TimeoutError", m.py().get_type::<errors::TimeoutError>())?;
    m.add_class::<buffer::PyBuffer>()?;
    m.add_class::<buffer::PyDispatchPlan>()?;
    m.add_class::<buffer::PyHtHandle>()?;
    m.add_class::<buffer::PyLlHandle>()?;
    m.add_class::<buffer::PyRecvHook>()?;
    m.add_function(wrap_pyfunction!(nvl_buffer_size_hint, m)?)?;
    m.add_function(wrap_pyfunction!(rdma_buffer_size_hint, m)?)?;
    m.add_function(wrap_pyfunction!(low_latency_rdma_size_hint, m)?)?;
    m.add_function(wrap_pyfunction!(ht_bytes_needed, m)?)?;
    m.add_function(wrap_pyfunction!(read_tensor, m)?)?;
    m.add_function(wrap_pyfunction!(tensor_route, m)?)?;
    m.add_function(wrap_pyfunction!(ht_internode_bytes_needed, m)?)?;
    m.add_function(wrap_pyfunction!(check_backend, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_info, m)?)?;
    m.add_function(wrap_pyfunction!(dtype_names, m)?)?;
    Ok(())
}
