//! Tuning knobs and buffer options.

/// Performance knobs of one high-throughput operation (DeepEP's `Config`). moelink's direct-write protocol
/// uses `num_sms`; the chunk sizes are accepted for API compatibility and bound the receiver's copy-out
/// granularity where the protocol has one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Config {
    /// SMs (thread blocks, one per SM) the kernel may occupy. Must be even.
    pub num_sms: usize,
    pub num_max_nvl_chunked_send_tokens: usize,
    pub num_max_nvl_chunked_recv_tokens: usize,
    pub num_max_rdma_chunked_send_tokens: usize,
    pub num_max_rdma_chunked_recv_tokens: usize,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            num_sms: 20,
            num_max_nvl_chunked_send_tokens: 6,
            num_max_nvl_chunked_recv_tokens: 256,
            num_max_rdma_chunked_send_tokens: 6,
            num_max_rdma_chunked_recv_tokens: 256,
        }
    }
}

impl Config {
    /// A config with `num_sms` and default chunk sizes.
    pub fn with_sms(num_sms: usize) -> Self {
        Config { num_sms, ..Config::default() }
    }

    /// NVLink-domain buffer bytes this config needs for rows of `hidden_bytes` across `num_ranks`
    /// (DeepEP's `get_nvl_buffer_size_hint`): enough for `num_max_nvl_chunked_recv_tokens` rows per
    /// (channel, source) pair. moelink's own sizing is [`crate::Buffer::ht_bytes_needed`].
    pub fn get_nvl_buffer_size_hint(&self, hidden_bytes: usize, num_ranks: usize) -> usize {
        // Saturating: absurd arguments give a huge hint, never an overflow.
        let num_channels = self.num_sms / 2;
        let per_token = hidden_bytes.saturating_add((hidden_bytes / 128 + 32).saturating_mul(4));
        let rows = num_channels.saturating_mul(num_ranks).saturating_mul(self.num_max_nvl_chunked_recv_tokens);
        let bytes = rows
            .saturating_mul(per_token)
            .saturating_add(num_channels.saturating_mul(num_ranks).saturating_mul(num_ranks).saturating_mul(16));
        bytes.div_ceil(128).saturating_mul(128)
    }

    /// RDMA buffer bytes (0 within one node).
    pub fn get_rdma_buffer_size_hint(&self, _hidden_bytes: usize, num_ranks: usize) -> usize {
        if num_ranks <= 8 {
            0
        } else {
            self.num_max_rdma_chunked_recv_tokens
                .saturating_mul(_hidden_bytes)
                .saturating_mul(2)
                .saturating_mul(num_ranks / 8)
                .saturating_mul(self.num_sms)
                / 2
        }
    }
}

/// Which implementation runs the collectives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BackendKind {
    /// CUDA when a usable GPU, driver and NVRTC are present, otherwise host.
    Auto,
    /// CPU threads over the group; the reference (oracle) implementation.
    Host,
    /// CUDA kernels over NVLink.
    Cuda,
}

impl BackendKind {
    /// `Ok` when this backend can run on this machine; for [`BackendKind::Cuda`] the error says why not
    /// (no driver, no GPU, no NVRTC, not built). `Host` and `Auto` always can.
    pub fn check_available(self) -> crate::Result<()> {
        match self {
            BackendKind::Cuda => crate::backend::cuda::CudaBackend::available(),
            BackendKind::Host | BackendKind::Auto => Ok(()),
        }
    }

    /// The backend `Auto` picks on this machine (`Cuda` when available, else `Host`); `Host` and `Cuda`
    /// return themselves.
    pub fn resolve(self) -> BackendKind {
        match self {
            BackendKind::Auto if BackendKind::Cuda.check_available().is_ok() => BackendKind::Cuda,
            BackendKind::Auto => BackendKind::Host,
            other => other,
        }
    }
}

/// How to build a [`crate::Buffer`].
#[derive(Clone, Debug)]
pub struct BufferOptions {
    pub backend: BackendKind,
    /// Bytes of the NVLink-domain (high-throughput) communication buffer per rank.
    pub num_nvl_bytes: usize,
    /// Bytes of the low-latency / RDMA buffer per rank.
    pub num_rdma_bytes: usize,
    pub low_latency_mode: bool,
    /// Deadline of every wait inside a collective, in milliseconds.
    pub timeout_ms: u64,
    /// CUDA device ordinal; default: the group's local rank.
    pub device: Option<usize>,
    /// Low-latency fault tolerance: a rank that misses its deadline is masked instead of failing the call.
    pub enable_shrink: bool,
    /// How the ranks map onto nodes. `None`: the launcher's layout (ranks grouped by host,
    /// [`crate::Topology::detect`]); set it to split one host into virtual nodes.
    pub topology: Option<crate::Topology>,
    /// How ranks of different nodes reach each other (used only when the topology has several nodes).
    pub rdma: crate::RdmaOptions,
}

impl Default for BufferOptions {
    fn default() -> Self {
        BufferOptions {
            backend: BackendKind::Auto,
            num_nvl_bytes: 0,
            num_rdma_bytes: 0,
            low_latency_mode: false,
            timeout_ms: 10_000,
            device: None,
            enable_shrink: false,
            topology: None,
            rdma: crate::RdmaOptions::default(),
        }
    }
}
