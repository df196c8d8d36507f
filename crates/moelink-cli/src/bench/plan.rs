//! A run's plan from the options: what a case is (mode, collective, payload, routing, SMs), the backend, ranks,
//! topology, batches of cases, and the buffer sizes they need.

use super::*;

/// `--suite`'s HT SM sweep.
const SUITE_SM_SWEEP: [usize; 6] = [8, 16, 24, 32, 48, 64];

/// Regime of a case.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// High-throughput.
    Ht,
    /// Low-latency.
    Ll,
}

impl Mode {
    pub(super) fn name(self) -> &'static str {
        match self {
            Mode::Ht => "ht",
            Mode::Ll => "ll",
        }
    }
}

/// Collective of a case.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// Tokens to the experts' ranks.
    Dispatch,
    /// Expert outputs back, summed.
    Combine,
}

impl Op {
    pub(super) fn name(self) -> &'static str {
        match self {
            Op::Dispatch => "dispatch",
            Op::Combine => "combine",
        }
    }
}

/// Payload type of a case.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dtype {
    /// bf16.
    Bf16,
    /// FP8 E4M3 + fp32 scales.
    Fp8,
}

impl Dtype {
    pub(super) fn name(self) -> &'static str {
        match self {
            Dtype::Bf16 => "bf16",
            Dtype::Fp8 => "fp8",
        }
    }
}

/// One measurement to make.
#[derive(Clone, Copy, Debug)]
pub struct Case {
    /// Regime.
    pub mode: Mode,
    /// Collective.
    pub op: Op,
    /// Payload type.
    pub dtype: Dtype,
    /// Routing of the inputs.
    pub routing: RoutingKind,
    /// HT: `Some(n)` from `--num-sms`, `None` for the backend's default. Always `None` for LL.
    pub num_sms: Option<usize>,
}

/// One (mode, shape, routing) of a run: its cases share the inputs and each rank's buffer.
#[derive(Clone, Debug)]
pub(super) struct Batch {
    pub(super) mode: Mode,
    pub(super) shape: Shape,
    pub(super) routing: RoutingKind,
    /// Dispatch payloads to measure (combine is always measured, bf16).
    pub(super) dtypes: Vec<Dtype>,
    /// HT: the SM counts to measure (`None`: the backend's default); LL: `[None]`.
    pub(super) sms: Vec<Option<usize>>,
}

/// The resolved plan of one bench run.
pub(super) struct Plan {
    pub(super) backend: BackendKind,
    pub(super) fallback_reason: Option<String>,
    pub(super) ranks: usize,
    /// Up to how many ranks share a GPU, when they do (`--topology` on fewer GPUs than ranks).
    pub(super) gpus_shared_by: Option<usize>,
    /// GPUs the ranks run on.
    pub(super) gpus: usize,
    /// `--process`: every rank a process of a torchrun launch.
    pub(super) process: bool,
    /// `--topology` across nodes, with its RDMA settings; `None` on one node.
    pub(super) internode: Option<(moelink::Topology, moelink::RdmaOptions)>,
    pub(super) reps: usize,
    pub(super) warmup: usize,
    pub(super) batches: Vec<Batch>,
}

/// Communication buffer sizes of a run, `(num_nvl_bytes, num_rdma_bytes)`: what the largest batch of each
/// mode needs on the CUDA backend ([`Buffer::ht_bytes_needed`] over the dispatch types measured, bf16
/// always since combine dispatches bf16; [`Buffer::ll_bytes_needed`]). Every batch of a mode gets the same
/// size, so the points of a curve differ only in what they measure. The host backend applies the same
/// capacity rules, so it gets the same sizes.
pub(super) fn buffer_bytes(batches: &[Batch], internode: Option<moelink::Topology>) -> (usize, usize) {
    let (mut nvl, mut rdma) = (0, 0);
    for b in batches {
        let s = &b.shape;
        match (b.mode, internode) {
            // Across nodes: one round holds every token (the kernels' rounds are then DeepEP's one pass).
            (Mode::Ht, Some(t)) => {
                for use_fp8 in [false, b.dtypes.contains(&Dtype::Fp8)] {
                    let need = moelink::internode::ht_bytes_needed(t, s.tokens.max(1), s.hidden, s.topk, use_fp8);
                    nvl = nvl.max(need.num_nvl_bytes);
                    rdma = rdma.max(need.num_rdma_bytes);
                }
            }
            (Mode::Ht, None) => {
                for use_fp8 in [false, b.dtypes.contains(&Dtype::Fp8)] {
                    nvl = nvl.max(Buffer::ht_bytes_needed(s.tokens, s.hidden, s.topk, s.ranks, use_fp8));
                }
            }
            (Mode::Ll, _) => rdma = rdma.max(Buffer::ll_bytes_needed(s.tokens, s.hidden, s.ranks, s.experts)),
        }
    }
    (nvl, rdma)
}

/// `process_ranks`: the launch's world size in process mode.
pub(super) fn plan(a: &BenchArgs, process_ranks: Option<usize>) -> std::result::Result<Plan, CliError> {
    let (backend, fallback_reason) = sys::resolve_backend(a.backend.kind()).map_err(CliError)?;
    let gpus = sys::gpu_count();
    let ranks = match (process_ranks.or(a.ranks), backend) {
        (Some(r), _) => r,
        (None, BackendKind::Cuda) if gpus > 0 => gpus,
        (None, BackendKind::Cuda) => return Err(CliError("cannot tell how many GPUs there are; pass --ranks".into())),
        (None, _) => 4,
    };
    if ranks == 0 {
        return Err(CliError("--ranks must be at least 1".into()));
    }
    let internode = internode_plan(a, ranks)?;
    if a.routing.contains(&RoutingKind::NodeLimited) && internode.is_none() {
        return Err(CliError("--routing node-limited needs --topology across nodes (e.g. 2x2)".into()));
    }
    if a.max_nodes == 0 {
        return Err(CliError("--max-nodes must be at least 1".into()));
    }
    // With --topology (virtual nodes) ranks may share GPUs; otherwise one rank per GPU. In process mode the
    // ranks on this host are torchrun's LOCAL_WORLD_SIZE.
    let host_ranks = match process_ranks {
        Some(_) => std::env::var("LOCAL_WORLD_SIZE").ok().and_then(|v| v.parse().ok()).unwrap_or(ranks),
        None => ranks,
    };
    let gpus_shared_by = (backend == BackendKind::Cuda && gpus > 0 && host_ranks > gpus).then(|| host_ranks.div_ceil(gpus));
    if gpus_shared_by.is_some() && a.topology.is_none() {
        return Err(CliError(format!("--ranks {ranks} needs {ranks} GPUs, this machine has {gpus} (--topology lets ranks share them)")));
    }
    let cuda = backend == BackendKind::Cuda;
    let reps = a.reps.unwrap_or(if a.quick {
        3
    } else if cuda {
        30
    } else {
        5
    });
    let warmup = a.warmup.unwrap_or(if cuda && !a.quick { 5 } else { 1 });
    if reps == 0 {
        return Err(CliError("--reps must be at least 1".into()));
    }
    for &n in &a.num_sms {
        if n < 2 || n % 2 != 0 {
            return Err(CliError(format!("--num-sms {n}: SM counts must be even and at least 2")));
        }
    }
    let wanted: &[Mode] = match a.mode {
        ModeSel::Ht => &[Mode::Ht],
        ModeSel::Ll => &[Mode::Ll],
        ModeSel::All => &[Mode::Ht, Mode::Ll],
    };
    let mut batches = Vec::new();
    for &mode in wanted {
        let (t, e) = match (mode, a.quick) {
            (Mode::Ht, false) => (4096, 256),
            (Mode::Ll, false) => (128, 288),
            (Mode::Ht, true) => (256, 64),
            (Mode::Ll, true) => (32, 64),
        };
        let base = Shape {
            ranks,
            tokens: t,
            hidden: a.hidden.unwrap_or(if a.quick { 1024 } else { 7168 }),
            topk: a.topk.unwrap_or(8),
            experts: a.experts.unwrap_or(e),
        };
        let mode_batches = if a.suite { suite_batches(mode, base, a.quick) } else { flag_batches(mode, base, a) };
        for b in &mode_batches {
            check_shape(mode, &b.shape, &b.dtypes)?;
            check_fits_memory(mode, &b.shape, sys::host_memory_bytes(), !a.ll_tokens.is_empty())?;
        }
        batches.extend(mode_batches);
    }
    // HT first, then LL, except that the suite measures DeepEP's shapes (both modes) before its sweeps.
    if a.suite {
        let deepep = |b: &Batch| match b.mode {
            Mode::Ht => b.shape.tokens == if a.quick { 256 } else { 4096 },
            Mode::Ll => b.shape.tokens == if a.quick { 32 } else { 128 },
        };
        batches.sort_by_key(|b| !deepep(b));
    }
    let gpus = if backend == BackendKind::Cuda { gpus_shared_by.map_or(ranks, |n| host_ranks.div_ceil(n)) } else { 0 };
    Ok(Plan { backend, fallback_reason, ranks, gpus_shared_by, gpus, process: process_ranks.is_some(), internode, reps, warmup, batches })
}

/// The topology and RDMA settings of `--topology`/`--transport`/`--no-nvlink-in-node`; `None` for one node.
pub(super) fn internode_plan(
    a: &BenchArgs,
    ranks: usize,
) -> std::result::Result<Option<(moelink::Topology, moelink::RdmaOptions)>, CliError> {
    let Some(t) = &a.topology else {
        if a.no_nvlink_in_node {
            return Err(CliError("--no-nvlink-in-node needs --topology".into()));
        }
        return Ok(None);
    };
    let topology = t.parse::<moelink::Topology>().map_err(|e| CliError(format!("--topology: {e}")))?;
    if topology.num_ranks() != ranks {
        return Err(CliError(format!("--topology {topology} is {} ranks, not --ranks {ranks}", topology.num_ranks())));
    }
    if !topology.is_internode() {
        return Ok(None);
    }
    let transport = a.transport.parse::<moelink::Transport>().map_err(|e| CliError(format!("--transport: {e}")))?;
    if transport == moelink::Transport::Nvshmem && !a.process {
        return Err(CliError("--transport nvshmem needs one process per rank: launch with torchrun and pass --process".into()));
    }
    let rdma = moelink::RdmaOptions {
        transport,
        allow_nvlink_for_low_latency_mode: !a.no_nvlink_in_node,
        // Where NVSHMEM is (the nvshmem transport), as `bench transport` and moelink-stress find it.
        nvshmem_home: std::env::var_os("NVSHMEM_HOME").map(PathBuf::from),
        ..Default::default()
    };
    Ok(Some((topology, rdma)))
}

/// Batches of one mode from the flags: every combination of token count and routing, each with every SM
/// count.
pub(super) fn flag_batches(mode: Mode, base: Shape, a: &BenchArgs) -> Vec<Batch> {
    let tokens = match mode {
        Mode::Ll if !a.ll_tokens.is_empty() => a.ll_tokens.clone(),
        _ if !a.tokens.is_empty() => a.tokens.clone(),
        _ => vec![base.tokens],
    };
    let dtypes = match (a.dtype, mode) {
        (Some(DtypeSel::Bf16), _) => vec![Dtype::Bf16],
        (Some(DtypeSel::Fp8), _) | (None, Mode::Ll) => vec![Dtype::Fp8],
        (Some(DtypeSel::All), _) | (None, Mode::Ht) => vec![Dtype::Bf16, Dtype::Fp8],
    };
    let sms = match mode {
        Mode::Ht if !a.num_sms.is_empty() => a.num_sms.iter().map(|&n| Some(n)).collect(),
        _ => vec![None],
    };
    let mut routings = a.routing.clone();
    routings.dedup();
    let mut out = Vec::new();
    for &t in &tokens {
        for &routing in &routings {
            out.push(Batch { mode, shape: Shape { tokens: t, ..base }, routing, dtypes: dtypes.clone(), sms: sms.clone() });
        }
    }
    out
}

/// `--suite`'s batches of one mode. HT: DeepEP's shape with uniform routing at the SM sweep (24 first: the
/// DeepEP-shape row), the same with skewed routing at 24 SMs, then the token sweep at 24 SMs; LL (FP8):
/// DeepEP's shape with uniform and skewed routing, then the token sweep. Each point is measured once.
pub(super) fn suite_batches(mode: Mode, base: Shape, quick: bool) -> Vec<Batch> {
    let at = |tokens: usize, routing: RoutingKind, dtypes: &[Dtype], sms: Vec<Option<usize>>| Batch {
        mode,
        shape: Shape { tokens, ..base },
        routing,
        dtypes: dtypes.to_vec(),
        sms,
    };
    let sweep: &[usize] = match (mode, quick) {
        (Mode::Ht, false) => &[512, 1024, 2048, 8192, 16384],
        (Mode::Ht, true) => &[64, 128, 512],
        (Mode::Ll, false) => &[1, 16, 64, 256],
        (Mode::Ll, true) => &[1, 8, 64],
    };
    let mut out = Vec::new();
    match mode {
        Mode::Ht => {
            let both = [Dtype::Bf16, Dtype::Fp8];
            let mut sm_sweep = vec![Some(SUITE_SMS)];
            sm_sweep.extend(SUITE_SM_SWEEP.iter().filter(|&&n| n != SUITE_SMS).map(|&n| Some(n)));
            out.push(at(base.tokens, RoutingKind::Uniform, &both, sm_sweep));
            out.push(at(base.tokens, RoutingKind::Skewed, &both, vec![Some(SUITE_SMS)]));
            out.extend(sweep.iter().map(|&t| at(t, RoutingKind::Uniform, &both, vec![Some(SUITE_SMS)])));
        }
        Mode::Ll => {
            out.push(at(base.tokens, RoutingKind::Uniform, &[Dtype::Fp8], vec![None]));
            out.push(at(base.tokens, RoutingKind::Skewed, &[Dtype::Fp8], vec![None]));
            out.extend(sweep.iter().map(|&t| at(t, RoutingKind::Uniform, &[Dtype::Fp8], vec![None])));
        }
    }
    out
}

pub(super) fn check_shape(mode: Mode, s: &Shape, dtypes: &[Dtype]) -> std::result::Result<(), CliError> {
    let m = mode.name();
    let err = |msg: String| Err(CliError(format!("{m}: {msg}")));
    if s.tokens == 0 {
        return err("--tokens must be at least 1".into());
    }
    if s.topk == 0 || s.topk > s.experts {
        return err(format!("--topk {} must be between 1 and the number of experts ({})", s.topk, s.experts));
    }
    if s.experts % s.ranks != 0 {
        return err(format!("--experts {} must be a multiple of the {} ranks", s.experts, s.ranks));
    }
    if s.hidden == 0 || s.hidden % 8 != 0 {
        return err(format!("--hidden {} must be a positive multiple of 8 (rows of 16-byte multiples)", s.hidden));
    }
    if dtypes.contains(&Dtype::Fp8) && s.hidden % 128 != 0 {
        return err(format!("--hidden {} must be a multiple of 128 for FP8 (one scale per 128 channels)", s.hidden));
    }
    Ok(())
}

/// Refuses a shape whose inputs cannot fit this machine's memory (`memory`: bytes, when known) before
/// anything is allocated: the bench generates every rank's bf16 tokens on the host, `ranks x tokens x hidden x
/// 2` bytes at least (checked arithmetic: an overflow is "more than any machine"). The error names the token
/// flag (`ll_flag`: the LL sizes came from `--ll-tokens`) and the bytes needed.
pub(super) fn check_fits_memory(mode: Mode, s: &Shape, memory: Option<usize>, ll_flag: bool) -> std::result::Result<(), CliError> {
    let flag = if mode == Mode::Ll && ll_flag { "--ll-tokens" } else { "--tokens" };
    let needed = s.ranks.checked_mul(s.tokens).and_then(|n| n.checked_mul(s.hidden)).and_then(|n| n.checked_mul(2));
    let what = format!(
        "{}: {flag} {} needs at least {} bytes of host memory for the inputs alone ({} ranks x {} tokens x hidden {} x 2 bytes)",
        mode.name(),
        s.tokens,
        needed.map_or_else(|| format!("more than {}", usize::MAX), |n| n.to_string()),
        s.ranks,
        s.tokens,
        s.hidden
    );
    match (needed, memory) {
        (None, _) => Err(CliError(format!("{what}; no machine has that much"))),
        (Some(n), Some(m)) if n > m => Err(CliError(format!("{what}; this machine has {m} bytes"))),
        _ => Ok(()),
    }
}

/// Cases of one batch, in the order the rank workers run them.
pub(super) fn cases(b: &Batch) -> Vec<Case> {
    let (mode, routing) = (b.mode, b.routing);
    let mut out = Vec::new();
    match mode {
        Mode::Ht => {
            for &num_sms in &b.sms {
                for &dtype in &b.dtypes {
                    out.push(Case { mode, op: Op::Dispatch, dtype, routing, num_sms });
                }
                out.push(Case { mode, op: Op::Combine, dtype: Dtype::Bf16, routing, num_sms });
            }
        }
        Mode::Ll => {
            for &dtype in &b.dtypes {
                out.push(Case { mode, op: Op::Dispatch, dtype, routing, num_sms: None });
            }
            out.push(Case { mode, op: Op::Combine, dtype: Dtype::Bf16, routing, num_sms: None });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: BenchArgs,
    }

    fn args(flags: &[&str]) -> BenchArgs {
        let mut argv = vec!["bench", "--backend", "host"];
        argv.extend_from_slice(flags);
        Cli::try_parse_from(argv).expect("valid flags").args
    }

    #[test]
    fn shapes_beyond_memory_are_refused_naming_the_flag() {
        let s = Shape { ranks: 4, tokens: 256, hidden: 1024, topk: 8, experts: 64 };
        assert!(check_fits_memory(Mode::Ht, &s, Some(1 << 30), false).is_ok());
        let e = check_fits_memory(Mode::Ht, &Shape { tokens: 1 << 20, ..s }, Some(1 << 30), false).unwrap_err().0;
        assert!(e.contains("--tokens 1048576") && e.contains(&format!("{} bytes", 4usize << 31)), "{e}");
        let e = check_fits_memory(Mode::Ll, &Shape { tokens: usize::MAX / 2, ..s }, None, true).unwrap_err().0;
        assert!(e.contains("--ll-tokens") && e.contains("no machine"), "{e}");
    }

    #[test]
    fn across_nodes_the_plan_takes_the_topology_and_bad_flags_are_refused() {
        let p = plan(&args(&["--mode", "ll", "--ranks", "4", "--topology", "2x2", "--transport", "emu-nic"]), None).unwrap();
        let (t, rdma) = p.internode.expect("2x2 spans nodes");
        assert_eq!((t.num_nodes, t.ranks_per_node, rdma.transport.name()), (2, 2, "emu-nic"));
        assert!(plan(&args(&["--mode", "ll", "--ranks", "4", "--topology", "1x4"]), None).unwrap().internode.is_none());
        // Both families run across nodes.
        assert!(plan(&args(&["--mode", "ht", "--ranks", "4", "--topology", "2x2"]), None).unwrap().internode.is_some());
        assert!(plan(&args(&["--ranks", "4", "--topology", "2x2"]), None).unwrap().internode.is_some());
        for (flags, says) in [
            (&["--mode", "ll", "--ranks", "4", "--topology", "2x3"][..], "--topology"),
            (&["--mode", "ll", "--ranks", "4", "--topology", "2x2", "--transport", "nvshmem"][..], "one process per rank"),
            (&["--mode", "ll", "--ranks", "4", "--topology", "2x2", "--transport", "tcp"][..], "--transport"),
            (&["--mode", "ll", "--no-nvlink-in-node"][..], "--topology"),
            (&["--mode", "ll", "--routing", "node-limited"][..], "--topology across nodes"),
        ] {
            let e = plan(&args(flags), None).err().expect("refused").0;
            assert!(e.contains(says), "{flags:?}: {e}");
        }
    }

    #[test]
    fn the_default_plan_is_deepeps_shapes() {
        let p = plan(&args(&[]), None).unwrap();
        let shapes: Vec<(Mode, usize, usize, usize, usize)> =
            p.batches.iter().map(|b| (b.mode, b.shape.tokens, b.shape.hidden, b.shape.topk, b.shape.experts)).collect();
        assert_eq!(shapes, vec![(Mode::Ht, 4096, 7168, 8, 256), (Mode::Ll, 128, 7168, 8, 288)]);
        assert_eq!(p.batches[0].dtypes, vec![Dtype::Bf16, Dtype::Fp8]);
        assert_eq!(p.batches[1].dtypes, vec![Dtype::Fp8]);
        assert!(p.batches.iter().all(|b| b.routing == RoutingKind::Uniform && b.sms == vec![None]));
    }

    #[test]
    fn token_lists_sweep_each_mode() {
        let p = plan(&args(&["--tokens", "512,1024", "--ll-tokens", "1,16,64", "--routing", "uniform,skewed"]), None).unwrap();
        let ht: Vec<(usize, RoutingKind)> = p.batches.iter().filter(|b| b.mode == Mode::Ht).map(|b| (b.shape.tokens, b.routing)).collect();
        assert_eq!(
            ht,
            [512, 512, 1024, 1024].into_iter().zip([RoutingKind::Uniform, RoutingKind::Skewed].into_iter().cycle()).collect::<Vec<_>>()
        );
        let ll: Vec<usize> = p.batches.iter().filter(|b| b.mode == Mode::Ll).map(|b| b.shape.tokens).collect();
        assert_eq!(ll, vec![1, 1, 16, 16, 64, 64]);
        // Without --ll-tokens, --tokens applies to LL too.
        let p = plan(&args(&["--mode", "ll", "--tokens", "8,32"]), None).unwrap();
        assert_eq!(p.batches.iter().map(|b| b.shape.tokens).collect::<Vec<_>>(), vec![8, 32]);
    }

    #[test]
    fn buffers_fit_the_largest_shape_of_each_mode() {
        let p = plan(&args(&["--tokens", "512,16384", "--ll-tokens", "1,256"]), None).unwrap();
        let (nvl, rdma) = buffer_bytes(&p.batches, None);
        for fp8 in [false, true] {
            assert!(nvl >= Buffer::ht_bytes_needed(16384, 7168, 8, 4, fp8));
        }
        assert_eq!(rdma, Buffer::ll_bytes_needed(256, 7168, 4, 288));
        // DeepEP's shapes: exactly what the CUDA backend asks for.
        let (nvl, rdma) = buffer_bytes(&plan(&args(&[]), None).unwrap().batches, None);
        assert_eq!(nvl, Buffer::ht_bytes_needed(4096, 7168, 8, 4, false).max(Buffer::ht_bytes_needed(4096, 7168, 8, 4, true)));
        assert_eq!(rdma, Buffer::ll_bytes_needed(128, 7168, 4, 288));
    }

    #[test]
    fn the_suite_measures_deepeps_shapes_first_then_the_sweeps() {
        let p = plan(&args(&["--suite"]), None).unwrap();
        let b: Vec<(Mode, usize, RoutingKind, Vec<Option<usize>>)> =
            p.batches.iter().map(|b| (b.mode, b.shape.tokens, b.routing, b.sms.clone())).collect();
        let s24 = vec![Some(24)];
        let u = RoutingKind::Uniform;
        assert_eq!(b[0], (Mode::Ht, 4096, u, [24, 8, 16, 32, 48, 64].map(Some).to_vec()));
        assert_eq!(b[1], (Mode::Ht, 4096, RoutingKind::Skewed, s24.clone()));
        assert_eq!(b[2], (Mode::Ll, 128, u, vec![None]));
        assert_eq!(b[3], (Mode::Ll, 128, RoutingKind::Skewed, vec![None]));
        let ht_sweep: Vec<usize> = b[4..].iter().filter(|x| x.0 == Mode::Ht).map(|x| x.1).collect();
        assert_eq!(ht_sweep, vec![512, 1024, 2048, 8192, 16384]);
        let ll_sweep: Vec<usize> = b[4..].iter().filter(|x| x.0 == Mode::Ll).map(|x| x.1).collect();
        assert_eq!(ll_sweep, vec![1, 16, 64, 256]);
        assert!(p.batches.iter().all(|b| b.mode == Mode::Ll || b.dtypes == vec![Dtype::Bf16, Dtype::Fp8]));
        assert!(p.batches.iter().all(|b| b.mode == Mode::Ht || b.dtypes == vec![Dtype::Fp8]));
        assert!(Cli::try_parse_from(["bench", "--suite", "--tokens", "8"]).is_err());
    }
}
