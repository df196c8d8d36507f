//! The environment variables of the `moelink` command (and of `moelink-stress`, which starts through the
//! same [`crate::main_of`]), turned into typed options once at start-up: the library reads none of them.
//!
//! | variable | becomes |
//! |---|---|
//! | `MOELINK_HT_TRACE=1`, `MOELINK_LL_TRACE=1` | `BufferOptions::kernel_tracing` (bench: `--ll-trace` too) |
//! | `MOELINK_HT_DISPATCH_SEND_BLOCKS`, `MOELINK_HT_COMBINE_SEND_BLOCKS`, `MOELINK_HT_RELEASE_BATCH`, `MOELINK_HT_REDUCE_LOAD_VECS`, `MOELINK_HT_RELEASER`, `MOELINK_HT_SEND_CHUNK`, `MOELINK_HT_RECV_CHUNK`, `MOELINK_HT_DYNAMIC_SEND`, `MOELINK_HT_CE_PIECES`, `MOELINK_HT_CE_MIN_PIECE_BYTES`, `MOELINK_HTI_FWD_BLOCKS`, `MOELINK_HT_TIMING_EXPERIMENT`, `MOELINK_LL_SMS`, `MOELINK_LL_EXPERIMENT` | `BufferOptions::tuning` (`moelink::Tuning::from_vars` says what each takes) |
//! | `MOELINK_CACHE_DIR`, `MOELINK_JIT_VERBOSE=1` | the JIT's settings (`moelink_cuda::jit::configure`; reports go to stderr) |
//!
//! A timing experiment is announced on stderr when the command starts, and `moelink bench` writes it into
//! every record (`experiment`, with `results_wrong_by_design`), so that no measurement of one passes for a
//! real run.

use std::sync::OnceLock;

use moelink::{BufferOptions, KernelTracing, Tuning};

use crate::CliError;

/// What the environment asked for.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EnvOptions {
    /// `MOELINK_HT_TRACE`, `MOELINK_LL_TRACE`.
    pub kernel_tracing: KernelTracing,
    /// The tuning and experiment variables.
    pub tuning: Tuning,
}

static OPTIONS: OnceLock<EnvOptions> = OnceLock::new();

fn lookup(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

fn print_report(line: &str) {
    eprintln!("{line}");
}

/// Reads the variables through `get` (the process environment in [`init`]).
pub fn parse(get: impl Fn(&str) -> Option<String>) -> Result<EnvOptions, CliError> {
    Ok(EnvOptions { kernel_tracing: KernelTracing::from_vars(&get).map_err(CliError)?, tuning: Tuning::from_vars(&get).map_err(CliError)? })
}

/// Reads the environment once, configures the JIT, and announces a timing experiment on stderr. Called
/// by `main` before any subcommand runs; later calls return what the first one read.
pub fn init() -> Result<&'static EnvOptions, CliError> {
    if let Some(o) = OPTIONS.get() {
        return Ok(o);
    }
    let options = parse(lookup)?;
    // Already configured only when another caller of this library took the JIT first: keep its settings.
    let _ = moelink_cuda::jit::configure(moelink_cuda::jit::JitSettings::from_vars(lookup, print_report));
    if let Some(x) = options.tuning.experiments() {
        let what = if options.tuning.wrong_results() { "results are WRONG by design" } else { "results stay right" };
        eprintln!("moelink: timing experiment {x} (MOELINK_HT_TIMING_EXPERIMENT / MOELINK_LL_EXPERIMENT): {what}");
    }
    Ok(OPTIONS.get_or_init(|| options))
}

/// The environment's options ([`init`]; the defaults when it was never called).
pub fn options() -> &'static EnvOptions {
    OPTIONS.get_or_init(EnvOptions::default)
}

/// `BufferOptions::default()` with the environment's tracing and tuning: the base every buffer the
/// command creates starts from.
pub fn buffer_options() -> BufferOptions {
    let o = options();
    BufferOptions { kernel_tracing: o.kernel_tracing, tuning: o.tuning.clone(), ..BufferOptions::default() }
}

/// The fields a measurement carries when tuning or an experiment was set: `experiment` (e.g.
/// `"ll:local_stores"`), `results_wrong_by_design`, `tuning` (the overrides, `name=value ...`).
pub fn record_fields(tuning: &Tuning) -> Vec<(&'static str, serde_json::Value)> {
    let mut out = Vec::new();
    if let Some(x) = tuning.experiments() {
        out.push(("experiment", serde_json::json!(x)));
        out.push(("results_wrong_by_design", serde_json::json!(tuning.wrong_results())));
    }
    if let Some(o) = tuning.overrides() {
        out.push(("tuning", serde_json::json!(o)));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn variables_become_options_and_record_fields() {
        let vars =
            |pairs: &'static [(&'static str, &'static str)]| move |k: &str| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string());
        assert_eq!(parse(vars(&[])).unwrap(), EnvOptions::default());
        assert!(record_fields(&Tuning::default()).is_empty());
        let o =
            parse(vars(&[("MOELINK_LL_TRACE", "1"), ("MOELINK_LL_EXPERIMENT", "no_loads"), ("MOELINK_HT_RELEASE_BATCH", "2")])).unwrap();
        assert!(o.kernel_tracing.low_latency && !o.kernel_tracing.high_throughput);
        let fields = record_fields(&o.tuning);
        let get = |k: &str| fields.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone());
        assert_eq!(get("experiment"), Some(serde_json::json!("ll:no_loads")));
        assert_eq!(get("results_wrong_by_design"), Some(serde_json::json!(true)));
        assert_eq!(get("tuning"), Some(serde_json::json!("ht_release_batch=2")));
        let e = parse(vars(&[("MOELINK_LL_EXPERIMENT", "typo")])).unwrap_err();
        assert!(e.0.contains("MOELINK_LL_EXPERIMENT") && e.0.contains("typo"), "{e}");
    }
}
