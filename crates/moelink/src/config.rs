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
    /// The names [`BackendKind::from_name`] accepts, in the order the messages list them.
    pub const NAMES: &'static [&'static str] = &["auto", "host", "cuda"];

    /// The backend a name selects: exactly `"auto"`, `"host"` or `"cuda"` (what `MOELINK_BACKEND` and the
    /// CLI's `--backend` take); `None` otherwise, for the edge to report with [`BackendKind::NAMES`].
    ///
    /// ```
    /// use moelink::BackendKind;
    /// assert_eq!(BackendKind::from_name("host"), Some(BackendKind::Host));
    /// assert_eq!(BackendKind::from_name("cpu"), None);
    /// ```
    pub fn from_name(name: &str) -> Option<BackendKind> {
        match name {
            "auto" => Some(BackendKind::Auto),
            "host" => Some(BackendKind::Host),
            "cuda" => Some(BackendKind::Cuda),
            _ => None,
        }
    }

    /// The name [`BackendKind::from_name`] reads back.
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Auto => "auto",
            BackendKind::Host => "host",
            BackendKind::Cuda => "cuda",
        }
    }
}

/// The longest deadline a buffer takes (`BufferOptions::timeout_ms`): one day. The kernels count it in
/// nanoseconds and the waits add it to the clock, so an unbounded value would overflow into a deadline that
/// has already passed; nobody means a wait longer than a day.
pub const MAX_TIMEOUT_MS: u64 = 24 * 60 * 60 * 1000;

/// How to build a [`crate::Buffer`].
#[derive(Clone, Debug)]
pub struct BufferOptions {
    pub backend: BackendKind,
    /// Bytes of the NVLink-domain (high-throughput) communication buffer per rank.
    pub num_nvl_bytes: usize,
    /// Bytes of the low-latency / RDMA buffer per rank.
    pub num_rdma_bytes: usize,
    pub low_latency_mode: bool,
    /// Deadline of every wait inside a collective, in milliseconds: 1 to [`MAX_TIMEOUT_MS`].
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
    /// Which kernels record timing traces ([`crate::Buffer::kernel_traces`]); off by default.
    pub kernel_tracing: KernelTracing,
    /// Tuning overrides and timing experiments of the CUDA kernels, for measurements (`moelink bench`);
    /// the default is what every real run uses.
    #[doc(hidden)]
    pub tuning: Tuning,
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
            kernel_tracing: KernelTracing::default(),
            tuning: Tuning::default(),
        }
    }
}

/// Reads `name` through `get` as a number; `Err` names the variable and the value.
fn number<T: std::str::FromStr>(get: &dyn Fn(&str) -> Option<String>, name: &str) -> Result<Option<T>, String> {
    match get(name) {
        None => Ok(None),
        Some(v) if v.trim().is_empty() => Ok(None),
        Some(v) => v.trim().parse::<T>().map(Some).map_err(|_| format!("{name}={v:?} is not a number")),
    }
}

/// `0`/`1` (unset or empty: `false`).
fn switch(get: &dyn Fn(&str) -> Option<String>, name: &str) -> Result<bool, String> {
    match get(name).as_deref().map(str::trim) {
        None | Some("") | Some("0") => Ok(false),
        Some("1") => Ok(true),
        Some(v) => Err(format!("{name}={v:?}: expected 0 or 1")),
    }
}

/// Which kernels stamp `%globaltimer` at each protocol step, for [`crate::Buffer::kernel_traces`] (CUDA
/// backend; the host backend has no kernels to trace). Tracing costs a few stores per block and step.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KernelTracing {
    /// High-throughput dispatch and combine: per block and warp, when each role started and finished its
    /// work (host-mapped stamps, read after each synchronous call; not in asynchronous calls or graph
    /// captures).
    pub high_throughput: bool,
    /// Low-latency dispatch and combine: per block, when it passed each step of the protocol (device
    /// memory, every launch, also in CUDA graphs; read when [`crate::Buffer::kernel_traces`] is called).
    pub low_latency: bool,
}

impl KernelTracing {
    /// The programs' environment variables `MOELINK_HT_TRACE` and `MOELINK_LL_TRACE` (`1`: on), read
    /// through `get`. The library never reads the environment: the `moelink` command, the Python package
    /// and the test harnesses call this with `|k| std::env::var(k).ok()`.
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<KernelTracing, String> {
        Ok(KernelTracing { high_throughput: switch(&get, "MOELINK_HT_TRACE")?, low_latency: switch(&get, "MOELINK_LL_TRACE")? })
    }
}

/// Tuning overrides and timing experiments of the CUDA kernels: what `moelink bench` and the device
/// scripts vary to find where time goes. `None` / 0 everywhere is the default every real run uses; the
/// host backend ignores all of it. Timing experiments ([`Tuning::experiments`]) are separate kernel builds
/// (JIT constants), and [`Tuning::wrong_results`] says when they make the results wrong.
#[doc(hidden)]
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Tuning {
    /// HT dispatch sender blocks (clamped to `[1, num_sms - 1]`).
    pub ht_dispatch_send_blocks: Option<usize>,
    /// HT combine sender blocks (clamped to `[1, num_sms - 1]`).
    pub ht_combine_send_blocks: Option<usize>,
    /// Rows an HT sender warp releases per fence (clamped to 1..=64).
    pub ht_release_batch: Option<u32>,
    /// The last warp of each HT sender block releases the other warps' rows (`HT_RELEASER`).
    pub ht_releaser: Option<bool>,
    /// HT combine reducers' 16-byte loads in flight (clamped to 1..=64).
    pub ht_reduce_load_vecs: Option<u32>,
    /// HT sender work chunk (0: one contiguous part per warp; else rounded up to whole release batches).
    pub ht_send_chunk: Option<u32>,
    /// HT receiver work chunk (0: one contiguous part per warp).
    pub ht_recv_chunk: Option<u32>,
    /// HT sender warps take their chunks from a per-call counter (default) or a fixed interleaved share.
    pub ht_dynamic_send: Option<bool>,
    /// Copy-engine pieces of a cached HT dispatch and a combine with two ranks on one node
    /// (`MOELINK_HT_CE_PIECES`; 0 or unset: the SM senders): each rank's copy engines push its rows into the
    /// peer's slab in this many pieces (clamped to 1..=64), and every block of the kernel receives
    /// (`moelink_kernels::ht::ce_staging`).
    pub ht_ce_pieces: Option<u32>,
    /// Bytes below which a copy-engine piece is merged with the next (`MOELINK_HT_CE_MIN_PIECE_BYTES`; default
    /// 4 MiB; 0 keeps every piece, as the tests do to exercise many).
    pub ht_ce_min_piece_bytes: Option<usize>,
    /// Forwarder blocks of the internode HT kernels (default a third of `num_sms`; clamped to what the
    /// other roles leave).
    pub hti_fwd_blocks: Option<usize>,
    /// HT timing experiment bits (`ht.cuh`'s `HT_EXP_*`: 1 no copy-out, 2 no remote payload, 4 no per-expert
    /// checks, 8 no own-row payload); results are wrong with bits 1, 2 and 8.
    pub ht_timing_experiment: u32,
    /// Blocks per low-latency launch (default: this rank's share of the GPU's SMs; at most that).
    pub ll_sms: Option<usize>,
    /// Low-latency timing experiment bits (`moelink_kernels::ll::experiment`).
    pub ll_experiment: u32,
}

impl Tuning {
    /// The programs' environment variables, read through `get` (as [`KernelTracing::from_vars`]):
    /// `MOELINK_HT_DISPATCH_SEND_BLOCKS`, `MOELINK_HT_COMBINE_SEND_BLOCKS`, `MOELINK_HT_RELEASE_BATCH`,
    /// `MOELINK_HT_REDUCE_LOAD_VECS`, `MOELINK_HT_RELEASER` (0/1), `MOELINK_HT_SEND_CHUNK`, `MOELINK_HT_RECV_CHUNK`,
    /// `MOELINK_HT_DYNAMIC_SEND` (0/1), `MOELINK_HT_CE_PIECES`, `MOELINK_HT_CE_MIN_PIECE_BYTES`, `MOELINK_HTI_FWD_BLOCKS`, `MOELINK_HT_TIMING_EXPERIMENT` (bits 0..=15), `MOELINK_LL_SMS`,
    /// `MOELINK_LL_EXPERIMENT` (comma-separated: `local_stores`, `no_loads`, `last_arrives`). `Err` names a
    /// variable whose value is not what it takes.
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Tuning, String> {
        let get: &dyn Fn(&str) -> Option<String> = &get;
        let ht_timing_experiment = number::<u32>(get, "MOELINK_HT_TIMING_EXPERIMENT")?.unwrap_or(0);
        if ht_timing_experiment > 15 {
            return Err(format!("MOELINK_HT_TIMING_EXPERIMENT={ht_timing_experiment}: the experiments are bits 1, 2, 4 and 8 (0..=15)"));
        }
        let mut ll_experiment = 0;
        for word in get("MOELINK_LL_EXPERIMENT").unwrap_or_default().split(',').map(str::trim).filter(|w| !w.is_empty()) {
            let Some((_, bit)) = moelink_kernels::ll::experiment::NAMES.iter().find(|(n, _)| *n == word) else {
                let known: Vec<&str> = moelink_kernels::ll::experiment::NAMES.iter().map(|(n, _)| *n).collect();
                return Err(format!("MOELINK_LL_EXPERIMENT: unknown experiment {word:?} (known: {})", known.join(", ")));
            };
            ll_experiment |= bit;
        }
        let ll_sms = number::<usize>(get, "MOELINK_LL_SMS")?;
        if ll_sms == Some(0) {
            return Err("MOELINK_LL_SMS=0: a low-latency launch needs at least one block".into());
        }
        Ok(Tuning {
            ht_dispatch_send_blocks: number(get, "MOELINK_HT_DISPATCH_SEND_BLOCKS")?,
            ht_combine_send_blocks: number(get, "MOELINK_HT_COMBINE_SEND_BLOCKS")?,
            ht_release_batch: number(get, "MOELINK_HT_RELEASE_BATCH")?,
            ht_reduce_load_vecs: number(get, "MOELINK_HT_REDUCE_LOAD_VECS")?,
            ht_releaser: match get("MOELINK_HT_RELEASER") {
                None => None,
                Some(_) => Some(switch(get, "MOELINK_HT_RELEASER")?),
            },
            ht_send_chunk: number(get, "MOELINK_HT_SEND_CHUNK")?,
            ht_recv_chunk: number(get, "MOELINK_HT_RECV_CHUNK")?,
            ht_dynamic_send: match get("MOELINK_HT_DYNAMIC_SEND") {
                None => None,
                Some(_) => Some(switch(get, "MOELINK_HT_DYNAMIC_SEND")?),
            },
            ht_ce_pieces: number(get, "MOELINK_HT_CE_PIECES")?,
            ht_ce_min_piece_bytes: number(get, "MOELINK_HT_CE_MIN_PIECE_BYTES")?,
            hti_fwd_blocks: number(get, "MOELINK_HTI_FWD_BLOCKS")?,
            ht_timing_experiment,
            ll_sms,
            ll_experiment,
        })
    }

    /// The timing experiments set, as `ht:<bits>` / `ll:<names>` joined by spaces (`None` when none is):
    /// what a measurement must carry along so that nobody takes it for a real run.
    pub fn experiments(&self) -> Option<String> {
        let mut parts = Vec::new();
        if self.ht_timing_experiment != 0 {
            parts.push(format!("ht:{}", self.ht_timing_experiment));
        }
        if self.ll_experiment != 0 {
            parts.push(format!("ll:{}", moelink_kernels::ll::experiment::names(self.ll_experiment)));
        }
        (!parts.is_empty()).then(|| parts.join(" "))
    }

    /// True when an experiment makes the results of its mode wrong by design (HT's bits 1, 2 and 8; LL's
    /// `local_stores` and `no_loads`). HT's bit 4 (no per-expert layout checks) leaves them right.
    pub fn wrong_results(&self) -> bool {
        self.ht_timing_experiment & 11 != 0 || self.ll_experiment & moelink_kernels::ll::experiment::WRONG_RESULTS != 0
    }

    /// The overrides set, `name=value` joined by spaces (`None` when none is): for records.
    pub fn overrides(&self) -> Option<String> {
        fn show<T: std::fmt::Display>(name: &str, v: Option<T>) -> Option<String> {
            v.map(|v| format!("{name}={v}"))
        }
        let parts: Vec<String> = [
            show("ht_dispatch_send_blocks", self.ht_dispatch_send_blocks),
            show("ht_combine_send_blocks", self.ht_combine_send_blocks),
            show("ht_release_batch", self.ht_release_batch),
            show("ht_reduce_load_vecs", self.ht_reduce_load_vecs),
            show("ht_releaser", self.ht_releaser),
            show("ht_send_chunk", self.ht_send_chunk),
            show("ht_recv_chunk", self.ht_recv_chunk),
            show("ht_dynamic_send", self.ht_dynamic_send),
            show("ht_ce_pieces", self.ht_ce_pieces),
            show("ht_ce_min_piece_bytes", self.ht_ce_min_piece_bytes),
            show("ll_sms", self.ll_sms),
        ]
        .into_iter()
        .flatten()
        .collect();
        (!parts.is_empty()).then(|| parts.join(" "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())
    }

    #[test]
    fn tracing_and_tuning_from_variables() {
        assert_eq!(KernelTracing::from_vars(vars(&[])), Ok(KernelTracing::default()));
        let t = KernelTracing::from_vars(vars(&[("MOELINK_LL_TRACE", "1"), ("MOELINK_HT_TRACE", "0")])).unwrap();
        assert_eq!(t, KernelTracing { high_throughput: false, low_latency: true });
        assert!(KernelTracing::from_vars(vars(&[("MOELINK_HT_TRACE", "yes")])).unwrap_err().contains("MOELINK_HT_TRACE"));

        let none = Tuning::from_vars(vars(&[])).unwrap();
        assert_eq!(none, Tuning::default());
        assert_eq!((none.experiments(), none.wrong_results(), none.overrides()), (None, false, None));
        let t = Tuning::from_vars(vars(&[
            ("MOELINK_HT_DISPATCH_SEND_BLOCKS", "10"),
            ("MOELINK_HT_RELEASE_BATCH", " 4 "),
            ("MOELINK_HT_DYNAMIC_SEND", "0"),
            ("MOELINK_HT_SEND_CHUNK", "0"),
            ("MOELINK_LL_SMS", "64"),
            ("MOELINK_LL_EXPERIMENT", "last_arrives"),
        ]))
        .unwrap();
        assert_eq!(
            (t.ht_dispatch_send_blocks, t.ht_release_batch, t.ht_dynamic_send, t.ht_send_chunk, t.ll_sms),
            (Some(10), Some(4), Some(false), Some(0), Some(64))
        );
        assert_eq!(t.experiments().as_deref(), Some("ll:last_arrives"));
        assert!(!t.wrong_results(), "last_arrives keeps results right");
        assert_eq!(
            t.overrides().as_deref(),
            Some("ht_dispatch_send_blocks=10 ht_release_batch=4 ht_send_chunk=0 ht_dynamic_send=false ll_sms=64")
        );
        let x =
            Tuning::from_vars(vars(&[("MOELINK_HT_TIMING_EXPERIMENT", "2"), ("MOELINK_LL_EXPERIMENT", "no_loads,local_stores")])).unwrap();
        assert_eq!((x.ht_timing_experiment, x.ll_experiment), (2, 3));
        assert_eq!(x.experiments().as_deref(), Some("ht:2 ll:local_stores,no_loads"));
        assert!(x.wrong_results());
        for (name, value) in [
            ("MOELINK_LL_EXPERIMENT", "local_store"),
            ("MOELINK_HT_TIMING_EXPERIMENT", "16"),
            ("MOELINK_HT_RELEASE_BATCH", "four"),
            ("MOELINK_LL_SMS", "0"),
            ("MOELINK_HT_DYNAMIC_SEND", "2"),
        ] {
            let e = Tuning::from_vars(vars(&[(name, value)])).unwrap_err();
            assert!(e.contains(name), "{e}");
        }
    }
}
