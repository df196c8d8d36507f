//! # moelink-kernels
//!
//! moelink's CUDA C++ kernels and the keys they are compiled for.
//!
//! - `cuda/ptx.cuh`: PTX primitives named after the instruction they emit, the error-record ABI and the
//!   deadline wait. No source includes a CUDA header (NVRTC ≤ 13.2 bundles none), except the transport
//!   seam's NVSHMEM backend, `cuda/transport_nvshmem.cuh`, which includes NVSHMEM's.
//! - One `.cu` file per kernel family ([`Family`]); every kernel starts with a comment block giving its
//!   grid/block shape, roles, buffers and flag protocol.
//! - A [`KernelSpec`] is one compilable variant: family + `-D` constants (shapes from [`BarrierVariant`] /
//!   [`CopyVariant`], plus the ABI struct sizes the kernels `static_assert` against). [`all_variants`]
//!   lists every variant the tests and the benchmark use; `tests/compile_all.rs` compiles each for sm_90a
//!   and rejects spills in hot kernels.
//! - [`abi`]: the Rust mirror of the argument structs, the error record and the constants.
//! - Every argument struct is `moelink_cuda::KernelParams` (implemented here, beside the sources it mirrors):
//!   its device addresses are `moelink_cuda::DevPtr`s, so a launch with it is safe.
//!
//! ```
//! use moelink_kernels::{all_variants, Family};
//! let req = all_variants().into_iter().find(|v| v.family == Family::Copy).unwrap().compile_request("sm_90a");
//! assert!(req.options().contains(&"--gpu-architecture=sm_90a".to_string()));
//! assert!(req.defines.iter().any(|(k, _)| k == "TMA_CHUNK_BYTES"));
//! assert!(req.name_expressions.contains(&moelink_kernels::kernel_name::COPY_TMA.to_string()));
//! ```

#![warn(missing_docs)]

pub mod abi;
// The argument structs in `ht` and `ll` mirror, field for field, the structs documented in
// `cuda/ht*.cu` and `cuda/ll*.cu` (size-checked on both sides); their fields are documented there.
#[allow(missing_docs)]
pub mod ht;
#[allow(missing_docs)]
pub mod ht_internode;
#[allow(missing_docs)]
pub mod ll;
#[allow(missing_docs)]
pub mod ll_internode;
pub mod transport;

use moelink_cuda::jit::CompileRequest;

/// Marks each argument struct as the one parameter of its kernels.
macro_rules! kernel_params {
    ($($params:ty),* $(,)?) => {
        $(
            // SAFETY: a `#[repr(C)]` mirror, field for field, of the struct of the same name that its kernels
            // take by value (their source `static_assert`s its size against the `MOELINK_SIZEOF_*` its
            // variant passes); every device address in it is a `DevPtr` or `DevPtrs`, no address travels as
            // an integer, and the other fields are counts, offsets, sizes and flags whose bounds the
            // validating core checks before a launch.
            unsafe impl moelink_cuda::KernelParams for $params {
                fn param_sizes() -> Vec<usize> {
                    Self::one_struct_sizes()
                }
                fn args(&self) -> moelink_cuda::KernelArgs {
                    self.one_struct()
                }
            }
        )*
    };
}

kernel_params!(
    abi::BarrierArgs,
    abi::CopyArgs,
    ht::HtLayoutArgs,
    ht::HtNotifyArgs,
    ht::HtDispatchArgs,
    ht::HtCeSignalArgs,
    ht::HtCombineArgs,
    ht_internode::HtiLayoutArgs,
    ht_internode::HtiNotifyArgs,
    ht_internode::HtiDispatchArgs,
    ht_internode::HtiCombineArgs,
    ll::LlDispatchArgs,
    ll::LlCombineArgs,
    ll_internode::LliDispatchArgs,
    ll_internode::LliCombineArgs,
    transport::TransportBarrierArgs,
    transport::TransportCheckArgs,
    transport::TransportBenchArgs,
);

/// `cuda/ptx.cuh`.
pub const PTX_HEADER: &str = include_str!("../cuda/ptx.cuh");
/// `cuda/barrier.cu`.
pub const BARRIER_SOURCE: &str = include_str!("../cuda/barrier.cu");
/// `cuda/copy.cu`.
pub const COPY_SOURCE: &str = include_str!("../cuda/copy.cu");
/// `cuda/ht.cuh`: what the high-throughput families share.
pub const HT_HEADER: &str = include_str!("../cuda/ht.cuh");
/// `cuda/ht_layout.cu`.
pub const HT_LAYOUT_SOURCE: &str = include_str!("../cuda/ht_layout.cu");
/// `cuda/ht_notify.cu`.
pub const HT_NOTIFY_SOURCE: &str = include_str!("../cuda/ht_notify.cu");
/// `cuda/ht_dispatch.cu`.
pub const HT_DISPATCH_SOURCE: &str = include_str!("../cuda/ht_dispatch.cu");
/// `cuda/ht_ce_signal.cu`.
pub const HT_CE_SIGNAL_SOURCE: &str = include_str!("../cuda/ht_ce_signal.cu");
/// `cuda/ht_combine.cu`.
pub const HT_COMBINE_SOURCE: &str = include_str!("../cuda/ht_combine.cu");

/// Headers every family may include, as `(include name, contents)`.
pub const HEADERS: &[(&str, &str)] = &[
    ("ptx.cuh", PTX_HEADER),
    ("ht.cuh", HT_HEADER),
    ("ll.cuh", ll::LL_HEADER),
    ("transport.cuh", transport::TRANSPORT_HEADER),
    ("transport_nvshmem.cuh", transport::TRANSPORT_NVSHMEM_HEADER),
    ("lli.cuh", ll_internode::LLI_HEADER),
    ("hti.cuh", ht_internode::HTI_HEADER),
];

/// The one header that may include headers from outside the tree (NVSHMEM's, for the `nvshmem` transport).
pub const SYSTEM_INCLUDE_HEADER: &str = "transport_nvshmem.cuh";

/// The kernels' C++ names. Every kernel lives in a namespace, `moelink::<area>::<kernel>`, so that a profiler
/// shows it as DeepEP's are shown (`deep_ep::intranode::dispatch<...>(...)`): tools that time DeepEP look
/// for the one kernel row containing `dispatch` / `combine` in a kineto table, or for `::dispatch` /
/// `::combine` in a chrome trace's event names. Each mode has exactly one kernel whose name contains
/// `dispatch` and one containing `combine` (`tests/compile_all.rs` checks the demangled symbols); the HT
/// layout and notify kernels contain neither. The JIT finds each kernel by this name (an NVRTC name
/// expression, [`KernelSpec::compile_request`]).
pub mod kernel_name {
    /// `barrier.cu`: one cross-GPU barrier.
    pub const BARRIER: &str = "moelink::barrier::gpu_barrier";
    /// `barrier.cu`: a timed loop of barriers.
    pub const BARRIER_LATENCY: &str = "moelink::barrier::gpu_barrier_latency";
    /// `copy.cu`: SM copy into peers.
    pub const COPY_SM: &str = "moelink::copy::copy_sm";
    /// `copy.cu`: TMA copy into peers.
    pub const COPY_TMA: &str = "moelink::copy::copy_tma";
    /// `copy.cu`: pattern fill.
    pub const FILL_PATTERN: &str = "moelink::copy::fill_pattern";
    /// `copy.cu`: pattern check.
    pub const VERIFY_PATTERN: &str = "moelink::copy::verify_pattern";
    /// `ht_layout.cu`: `get_dispatch_layout`.
    pub const HT_LAYOUT: &str = "moelink::intranode::layout";
    /// `ht_notify.cu`: the count exchange before a fresh high-throughput dispatch.
    pub const HT_NOTIFY: &str = "moelink::intranode::notify";
    /// `ht_dispatch.cu`: high-throughput dispatch.
    pub const HT_DISPATCH: &str = "moelink::intranode::dispatch";
    /// `ht_ce_signal.cu`: the copy-engine pieces' wait and flags.
    pub const HT_CE_SIGNAL: &str = "moelink::intranode::copy_engine_signal";
    /// `ht_combine.cu`: high-throughput combine.
    pub const HT_COMBINE: &str = "moelink::intranode::combine";
    /// `ll_dispatch.cu`: low-latency dispatch.
    pub const LL_DISPATCH: &str = "moelink::low_latency::dispatch";
    /// `ll_combine.cu`: low-latency combine.
    pub const LL_COMBINE: &str = "moelink::low_latency::combine";
    /// `lli_dispatch.cu`: low-latency dispatch across nodes.
    pub const LLI_DISPATCH: &str = "moelink::internode_ll::dispatch";
    /// `lli_combine.cu`: low-latency combine across nodes.
    pub const LLI_COMBINE: &str = "moelink::internode_ll::combine";
    /// `hti_layout.cu`: `get_dispatch_layout` across nodes.
    pub const HTI_LAYOUT: &str = "moelink::internode::layout";
    /// `hti_notify.cu`: the count exchange before a fresh high-throughput dispatch across nodes.
    pub const HTI_NOTIFY: &str = "moelink::internode::notify";
    /// `hti_dispatch.cu`: high-throughput dispatch across nodes.
    pub const HTI_DISPATCH: &str = "moelink::internode::dispatch";
    /// `hti_combine.cu`: high-throughput combine across nodes.
    pub const HTI_COMBINE: &str = "moelink::internode::combine";
}

/// One kernel entry point of a family.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelInfo {
    /// C++ name ([`kernel_name`]), without the parameter list.
    pub name: &'static str,
    /// On a performance-critical path: must compile without stack frame or spills.
    pub hot: bool,
}

/// A kernel family: one `.cu` file.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Family {
    /// `barrier.cu`: the cross-GPU barrier and its latency loop.
    Barrier,
    /// `copy.cu`: the copy primitive (SM stores, TMA) and pattern fill/verify.
    Copy,
    /// `ht_layout.cu`: `get_dispatch_layout`.
    HtLayout,
    /// `ht_notify.cu`: the count exchange before a fresh high-throughput dispatch.
    HtNotify,
    /// `ht_dispatch.cu`: high-throughput dispatch.
    HtDispatch,
    /// `ht_ce_signal.cu`: the copy-engine pieces' wait and flags.
    HtCeSignal,
    /// `ht_combine.cu`: high-throughput combine.
    HtCombine,
    /// `ll_dispatch.cu`: low-latency dispatch ([`ll`]).
    LlDispatch,
    /// `ll_combine.cu`: low-latency combine ([`ll`]).
    LlCombine,
    /// `transport.cu`: the RDMA transport seam's conformance check and micro-benchmark ([`transport`]).
    Transport,
    /// `lli_dispatch.cu`: low-latency dispatch across nodes ([`ll_internode`]).
    LliDispatch,
    /// `lli_combine.cu`: low-latency combine across nodes ([`ll_internode`]).
    LliCombine,
    /// `hti_layout.cu`: get_dispatch_layout across nodes ([`ht_internode`]).
    HtiLayout,
    /// `hti_notify.cu`: the count exchange of a high-throughput dispatch across nodes ([`ht_internode`]).
    HtiNotify,
    /// `hti_dispatch.cu`: high-throughput dispatch across nodes ([`ht_internode`]).
    HtiDispatch,
    /// `hti_combine.cu`: high-throughput combine across nodes ([`ht_internode`]).
    HtiCombine,
}

impl Family {
    /// The source file's name.
    pub fn file_name(self) -> &'static str {
        match self {
            Family::Barrier => "barrier.cu",
            Family::Copy => "copy.cu",
            Family::HtLayout => "ht_layout.cu",
            Family::HtNotify => "ht_notify.cu",
            Family::HtDispatch => "ht_dispatch.cu",
            Family::HtCeSignal => "ht_ce_signal.cu",
            Family::HtCombine => "ht_combine.cu",
            Family::LlDispatch => "ll_dispatch.cu",
            Family::LlCombine => "ll_combine.cu",
            Family::Transport => "transport.cu",
            Family::LliDispatch => "lli_dispatch.cu",
            Family::LliCombine => "lli_combine.cu",
            Family::HtiLayout => "hti_layout.cu",
            Family::HtiNotify => "hti_notify.cu",
            Family::HtiDispatch => "hti_dispatch.cu",
            Family::HtiCombine => "hti_combine.cu",
        }
    }

    /// The source text.
    pub fn source(self) -> &'static str {
        match self {
            Family::Barrier => BARRIER_SOURCE,
            Family::Copy => COPY_SOURCE,
            Family::HtLayout => HT_LAYOUT_SOURCE,
            Family::HtNotify => HT_NOTIFY_SOURCE,
            Family::HtDispatch => HT_DISPATCH_SOURCE,
            Family::HtCeSignal => HT_CE_SIGNAL_SOURCE,
            Family::HtCombine => HT_COMBINE_SOURCE,
            Family::LlDispatch => ll::LL_DISPATCH_SOURCE,
            Family::LlCombine => ll::LL_COMBINE_SOURCE,
            Family::Transport => transport::TRANSPORT_SOURCE,
            Family::LliDispatch => ll_internode::LLI_DISPATCH_SOURCE,
            Family::LliCombine => ll_internode::LLI_COMBINE_SOURCE,
            Family::HtiLayout => ht_internode::HTI_LAYOUT_SOURCE,
            Family::HtiNotify => ht_internode::HTI_NOTIFY_SOURCE,
            Family::HtiDispatch => ht_internode::HTI_DISPATCH_SOURCE,
            Family::HtiCombine => ht_internode::HTI_COMBINE_SOURCE,
        }
    }

    /// The family's own headers (`ht.cuh`, `ll.cuh`, `transport.cuh`, `lli.cuh`, `hti.cuh`), which the
    /// source includes.
    pub fn headers(self) -> &'static [&'static str] {
        match self {
            Family::Barrier | Family::Copy => &[],
            Family::HtLayout | Family::HtNotify | Family::HtDispatch | Family::HtCeSignal | Family::HtCombine => &[HT_HEADER],
            Family::LlDispatch | Family::LlCombine => &[ll::LL_HEADER],
            Family::Transport => &[transport::TRANSPORT_HEADER],
            Family::LliDispatch | Family::LliCombine => &[ll::LL_HEADER, ll_internode::LLI_HEADER],
            Family::HtiLayout | Family::HtiNotify | Family::HtiDispatch | Family::HtiCombine => &[ht_internode::HTI_HEADER],
        }
    }

    /// The entry points the file defines.
    pub fn kernels(self) -> &'static [KernelInfo] {
        match self {
            Family::Barrier => {
                &[KernelInfo { name: kernel_name::BARRIER, hot: true }, KernelInfo { name: kernel_name::BARRIER_LATENCY, hot: true }]
            }
            Family::Copy => &[
                KernelInfo { name: kernel_name::COPY_SM, hot: true },
                KernelInfo { name: kernel_name::COPY_TMA, hot: true },
                KernelInfo { name: kernel_name::FILL_PATTERN, hot: true },
                KernelInfo { name: kernel_name::VERIFY_PATTERN, hot: true },
            ],
            Family::HtLayout => &[KernelInfo { name: kernel_name::HT_LAYOUT, hot: true }],
            Family::HtNotify => &[KernelInfo { name: kernel_name::HT_NOTIFY, hot: true }],
            Family::HtDispatch => &[KernelInfo { name: kernel_name::HT_DISPATCH, hot: true }],
            Family::HtCeSignal => &[KernelInfo { name: kernel_name::HT_CE_SIGNAL, hot: false }],
            Family::HtCombine => &[KernelInfo { name: kernel_name::HT_COMBINE, hot: true }],
            Family::LlDispatch => &[KernelInfo { name: kernel_name::LL_DISPATCH, hot: true }],
            Family::LlCombine => &[KernelInfo { name: kernel_name::LL_COMBINE, hot: true }],
            Family::Transport => &[
                KernelInfo { name: "transport_barrier", hot: false },
                KernelInfo { name: "transport_check", hot: false },
                KernelInfo { name: "transport_bench", hot: false },
            ],
            // Not hot: the nvshmem variants call into NVSHMEM's transfer functions, which keep a stack frame.
            Family::LliDispatch => &[KernelInfo { name: kernel_name::LLI_DISPATCH, hot: false }],
            Family::LliCombine => &[KernelInfo { name: kernel_name::LLI_COMBINE, hot: false }],
            // Not hot, for the same reason.
            Family::HtiLayout => &[KernelInfo { name: kernel_name::HTI_LAYOUT, hot: false }],
            Family::HtiNotify => &[KernelInfo { name: kernel_name::HTI_NOTIFY, hot: false }],
            Family::HtiDispatch => &[KernelInfo { name: kernel_name::HTI_DISPATCH, hot: false }],
            Family::HtiCombine => &[KernelInfo { name: kernel_name::HTI_COMBINE, hot: false }],
        }
    }
}

/// One compilable variant: a family and its `-D` constants.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelSpec {
    /// Which file.
    pub family: Family,
    /// Short human-readable variant name, e.g. `copy[sm512x8,tma8192x4x4]`.
    pub variant: String,
    /// `-D name=value` constants, in order.
    pub defines: Vec<(String, String)>,
}

impl KernelSpec {
    /// The value of constant `name`, if defined.
    pub fn define(&self, name: &str) -> Option<&str> {
        self.defines.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
    }

    /// The entry points of the family.
    pub fn kernels(&self) -> &'static [KernelInfo] {
        self.family.kernels()
    }

    /// What to hand to [`moelink_cuda::jit::JitCache::compile`] for target `arch` (e.g. `sm_90a`): the
    /// source, the headers, the constants, and each namespaced kernel's C++ name as a name expression (a
    /// name without `::`, such as the transport check's, is an `extern "C"` symbol and needs none).
    pub fn compile_request(&self, arch: &str) -> CompileRequest {
        let mut req = CompileRequest::new(self.family.file_name(), self.family.source(), arch);
        for k in self.kernels().iter().filter(|k| k.name.contains("::")) {
            req = req.name_expression(k.name);
        }
        for (name, contents) in HEADERS {
            req = req.header(*name, *contents);
        }
        for (k, v) in &self.defines {
            req = req.define(k.clone(), v);
        }
        req
    }
}

/// Shape of the barrier family.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BarrierVariant;

impl BarrierVariant {
    /// The compile key.
    pub fn spec(&self) -> KernelSpec {
        KernelSpec {
            family: Family::Barrier,
            variant: format!("barrier[r{}]", abi::MAX_RANKS),
            defines: vec![
                ("MAX_RANKS".into(), abi::MAX_RANKS.to_string()),
                ("MOELINK_SIZEOF_BARRIER_ARGS".into(), std::mem::size_of::<abi::BarrierArgs>().to_string()),
            ],
        }
    }

    /// Threads per block of the barrier kernels (one warp).
    pub const THREADS: u32 = 32;
}

/// Shape of the copy family.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CopyVariant {
    /// Threads per block of `copy_sm`.
    pub sm_threads: u32,
    /// 16-byte vectors in flight per `copy_sm` thread.
    pub sm_unroll: u32,
    /// Bytes per TMA bulk copy.
    pub tma_chunk_bytes: u32,
    /// Shared-memory slots per TMA pipeline.
    pub tma_stages: u32,
    /// Warps (pipelines) per `copy_tma` block.
    pub tma_warps: u32,
    /// Threads per block of the pattern kernels.
    pub pattern_threads: u32,
}

impl Default for CopyVariant {
    /// 512 threads × 8 vectors in flight; TMA 8 KiB × 4 stages × 4 warps. On 4×H200 it reaches, per GPU in
    /// an all-to-all at 8 SMs, 349 GB/s with SM stores and 340 with TMA
    /// (bench/results/2026-11-21-4xnvidia-h200-2d0b9a7/nvlink.json).
    fn default() -> Self {
        CopyVariant { sm_threads: 512, sm_unroll: 8, tma_chunk_bytes: 8192, tma_stages: 4, tma_warps: 4, pattern_threads: 256 }
    }
}

impl CopyVariant {
    /// The compile key.
    pub fn spec(&self) -> KernelSpec {
        KernelSpec {
            family: Family::Copy,
            variant: format!(
                "copy[sm{}x{},tma{}x{}x{}]",
                self.sm_threads, self.sm_unroll, self.tma_chunk_bytes, self.tma_stages, self.tma_warps
            ),
            defines: vec![
                ("MAX_PEERS".into(), abi::MAX_RANKS.to_string()),
                ("COPY_SM_THREADS".into(), self.sm_threads.to_string()),
                ("COPY_SM_UNROLL".into(), self.sm_unroll.to_string()),
                ("TMA_CHUNK_BYTES".into(), self.tma_chunk_bytes.to_string()),
                ("TMA_STAGES".into(), self.tma_stages.to_string()),
                ("TMA_WARPS".into(), self.tma_warps.to_string()),
                ("PATTERN_THREADS".into(), self.pattern_threads.to_string()),
                ("MOELINK_SIZEOF_COPY_ARGS".into(), std::mem::size_of::<abi::CopyArgs>().to_string()),
            ],
        }
    }

    /// Bytes one `copy_sm` work unit moves (`sm_threads × sm_unroll × 16`).
    pub fn sm_unit_bytes(&self) -> usize {
        self.sm_threads as usize * self.sm_unroll as usize * 16
    }

    /// Threads per block of `copy_tma`.
    pub fn tma_threads(&self) -> u32 {
        self.tma_warps * 32
    }

    /// Dynamic shared memory `copy_tma` needs (mbarriers padded to 128 bytes, then the slots); mirrors
    /// `TMA_BARRIER_REGION` + slots in `copy.cu`.
    pub fn tma_smem_bytes(&self) -> u32 {
        let barriers = (self.tma_warps * self.tma_stages * 8).div_ceil(128) * 128;
        barriers + self.tma_warps * self.tma_stages * self.tma_chunk_bytes
    }
}

/// Every variant the tests and the benchmark compile.
pub fn all_variants() -> Vec<KernelSpec> {
    let mut v = vec![BarrierVariant.spec(), CopyVariant::default().spec()];
    v.extend(ht::variants());
    v.extend(ll::LlVariant::all().iter().flat_map(|l| [l.dispatch_spec(), l.combine_spec()]));
    v.extend(transport::TransportVariant::all().iter().map(transport::TransportVariant::spec));
    v.extend(ll_internode::LliVariant::all().iter().flat_map(|l| [l.dispatch_spec(), l.combine_spec()]));
    v.extend(ht_internode::HtiVariant::all_specs());
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sources_are_header_free_and_documented() {
        for spec in all_variants() {
            let src = spec.family.source();
            let headers = HEADERS.iter().filter(|(name, _)| *name != SYSTEM_INCLUDE_HEADER);
            for line in src.lines().chain(headers.flat_map(|(_, h)| h.lines())) {
                let l = line.trim_start();
                if l.starts_with("#include") {
                    let allowed = HEADERS.iter().any(|(name, _)| l == format!("#include \"{name}\""));
                    assert!(allowed, "{}: only the in-memory headers may be included: {l}", spec.family.file_name());
                }
                assert!(!l.contains("trap;"), "{}: kernels must never trap", spec.family.file_name());
            }
            for k in spec.kernels() {
                // Namespaced (kernel_name): defined in its namespace; else an `extern "C"` test kernel.
                let function = match k.name.rsplit_once("::") {
                    Some((namespace, function)) => {
                        assert!(src.contains(&format!("namespace {namespace} {{")), "{} must be in namespace {namespace}", k.name);
                        function
                    }
                    None => k.name,
                };
                let decl = format!(" {function}(");
                let at = src.find(&decl).unwrap_or_else(|| panic!("{} is not defined in {}", k.name, spec.family.file_name()));
                let before = &src[..at];
                assert!(
                    before.trim_end().lines().rev().nth(1).is_some_and(|l| l.starts_with("//")),
                    "{} must start with a comment block",
                    k.name
                );
            }
        }
    }

    #[test]
    fn variants_define_every_constant_the_sources_require() {
        for spec in all_variants() {
            let src = spec.family.source();
            let headers = spec.family.headers();
            for (k, _) in &spec.defines {
                assert!(
                    src.contains(k.as_str()) || headers.iter().any(|h| h.contains(k.as_str())),
                    "{} defines {k} but neither {} nor its header uses it",
                    spec.variant,
                    spec.family.file_name()
                );
            }
        }
        let copy = CopyVariant::default();
        assert_eq!(copy.sm_unit_bytes(), 64 * 1024);
        assert_eq!(copy.tma_smem_bytes(), 128 + 4 * 4 * 8192);
    }
}
