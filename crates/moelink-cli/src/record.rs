//! One measurement as it is written to `--json FILE`: a JSON list of these records. Baseline harnesses
//! (NCCL all-to-all, DeepEP) write the same shape with their own `system`, so results from one lease can be
//! compared row by row.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

/// Outcome of one measurement.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    /// Measured, and the correctness check passed.
    Ok,
    /// Measured, but the correctness check failed (`error` says how); the time is not trustworthy.
    Incorrect,
    /// Not run: the backend or feature is not available here (`error` says why).
    Unavailable,
    /// The operation failed (`error` holds the message).
    Error,
}

/// One measurement.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Record {
    /// What was measured: `"moelink"`, or a baseline's name (`"nccl"`, `"deepep"`).
    pub system: String,
    /// `"host"` (CPU threads; times mean nothing for GPUs) or `"cuda"`.
    pub backend: String,
    /// The GPU as nvidia-smi names it (`"NVIDIA H200"`), or on the host backend the CPU model from
    /// `/proc/cpuinfo`.
    pub device: String,
    /// GPUs the measurement used (0 on the host backend).
    pub gpus: usize,
    /// When the measurement was taken, UTC, ISO-8601 (`2026-11-21T10:04:05Z`).
    pub date: String,
    /// Short git hash of the code measured: `MOELINK_COMMIT` when set, else the commit the binary was built
    /// from, else `git rev-parse --short HEAD`, else `"unknown"`.
    pub commit: String,
    /// `"ht"` (high-throughput), `"ll"` (low-latency) or `"probe"` (NVLink/barrier/JIT diagnostics).
    pub mode: String,
    /// `"dispatch"`, `"combine"`; for probes `"copy"`, `"barrier"` or `"jit"`.
    pub op: String,
    /// Payload type on the wire: `"bf16"` or `"fp8"` (FP8 E4M3 + one fp32 scale per 128 channels);
    /// null where it does not apply.
    pub dtype: Option<String>,
    /// Ranks (processes or threads, one GPU each on CUDA).
    pub ranks: usize,
    /// Tokens per rank (for LL: also `num_max_dispatch_tokens_per_rank`).
    pub tokens: Option<usize>,
    /// Hidden size (elements per token row).
    pub hidden: Option<usize>,
    /// Experts selected per token.
    pub topk: Option<usize>,
    /// Experts in total (over all ranks).
    pub experts: Option<usize>,
    /// `"uniform"` (scores |randn|+1, top-k) or `"skewed"` (90% of tokens pick experts 0..k).
    pub routing: Option<String>,
    /// SMs the kernel was allowed (`Config::num_sms`); null where the operation has no such knob (LL).
    pub num_sms: Option<usize>,
    /// Microseconds: per repetition the largest time of any rank (the slowest rank), then the median over
    /// repetitions. `time_us_min` / `time_us_max` in the extras give the range of that per-repetition series.
    pub time_us: Option<f64>,
    /// DeepEP's accounting, per rank (mean over ranks), 1e9 B/s. HT: received rows (own rank included) ×
    /// row bytes, where a BF16 row is 2·H bytes and an FP8 row H + H/128·4; combine counts the same rows
    /// sent back as BF16. LL: (token, selected expert) pairs × row bytes, where an FP8 row is
    /// H + H/128·4 + 16 bytes and a BF16 row 2·H.
    pub logical_gbps: Option<f64>,
    /// Only the rows that cross between ranks, per rank (mean), 1e9 B/s: HT rows received from other ranks;
    /// LL one row per (token, destination rank other than its own), as moelink sends them.
    pub wire_gbps: Option<f64>,
    /// The correctness check on the same inputs passed (null when not measured).
    pub correct: Option<bool>,
    /// Outcome; see [`Status`].
    pub status: Status,
    /// Why the measurement is not `ok`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Nodes the ranks were split into (internode runs; virtual nodes when they share a host).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nodes: Option<usize>,
    /// Ranks per node (internode runs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ranks_per_node: Option<usize>,
    /// The RDMA transport under internode traffic: `"nvshmem"`, `"ptr"` or `"emu-nic"` (internode runs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transport: Option<String>,
    /// Timed repetitions (after warm-up).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reps: Option<usize>,
    /// Untimed warm-up repetitions.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warmup: Option<usize>,
    /// How time was taken, each repetition in its own `Buffer::timed` region:
    /// - `"cuda-events"`: CUDA events on the operation stream behind a GPU barrier of all ranks, the end event
    ///   recorded right after the last kernel is enqueued (HT dispatch: `prepare_dispatch` + `dispatch_into`,
    ///   i.e. count exchange, host wait and dispatch kernel; HT combine: `combine_into`; outputs preallocated);
    /// - `"cuda-graph-events"`: the same events around one replay of a CUDA graph holding the call (LL;
    ///   receive-hook mode: the send and receive phases as two graphs, timed apart);
    /// - `"wall"`: the host clock around the call after a group barrier (host backend).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timer: Option<String>,
    /// Anything else: `send_us`/`recv_us` (receive-hook mode, same statistic as `time_us`), `time_us_min`/
    /// `time_us_max`, `pct_of_p2p_ceiling`, `pattern`, `method`, `bytes_per_gpu`, `kernel`, `cached_us`,
    /// `matches_host`, `pre_reduced`, ...
    #[serde(flatten)]
    pub extra: BTreeMap<String, serde_json::Value>,
}

/// Facts shared by every record of one run.
#[derive(Clone, Debug)]
pub struct RunFacts {
    /// See [`Record::system`].
    pub system: String,
    /// See [`Record::backend`].
    pub backend: String,
    /// See [`Record::device`].
    pub device: String,
    /// See [`Record::gpus`].
    pub gpus: usize,
    /// See [`Record::date`].
    pub date: String,
    /// See [`Record::commit`].
    pub commit: String,
}

impl Record {
    /// A record with the run's facts and nothing measured yet.
    pub fn new(facts: &RunFacts, mode: &str, op: &str, ranks: usize) -> Record {
        Record {
            system: facts.system.clone(),
            backend: facts.backend.clone(),
            device: facts.device.clone(),
            gpus: facts.gpus,
            date: facts.date.clone(),
            commit: facts.commit.clone(),
            mode: mode.into(),
            op: op.into(),
            dtype: None,
            ranks,
            tokens: None,
            hidden: None,
            topk: None,
            experts: None,
            routing: None,
            num_sms: None,
            time_us: None,
            logical_gbps: None,
            wire_gbps: None,
            correct: None,
            status: Status::Unavailable,
            error: None,
            nodes: None,
            ranks_per_node: None,
            transport: None,
            reps: None,
            warmup: None,
            timer: None,
            extra: BTreeMap::new(),
        }
    }
}

/// Writes `records` to `path` as a pretty-printed JSON list (replacing the file).
pub fn write_json(path: &Path, records: &[Record]) -> Result<(), String> {
    let text = serde_json::to_string_pretty(records).map_err(|e| format!("cannot encode results: {e}"))?;
    std::fs::write(path, text + "\n").map_err(|e| format!("cannot write {}: {e}", path.display()))
}

/// Checks, before anything is measured, that the file `flag` names (`--json`, `--plot`) can be written:
/// that it has the extension `ext` when one is required (`png`: the plot's encoder picks the format by it),
/// is not a directory, and can be opened for writing there (a file created by the probe is removed again).
/// The error is one line naming the flag, the path and the reason.
pub fn check_output(flag: &str, path: &Path, ext: Option<&str>) -> Result<(), String> {
    let shown = path.display();
    if let Some(ext) = ext {
        let has = path.extension().and_then(|e| e.to_str()).is_some_and(|e| e.eq_ignore_ascii_case(ext));
        if !has {
            return Err(format!("{flag} {shown}: the file is written as {}, so its name must end in .{ext}", ext.to_uppercase()));
        }
    }
    if path.is_dir() {
        return Err(format!("{flag} {shown}: is a directory, not a file"));
    }
    let existed = path.exists();
    std::fs::OpenOptions::new().append(true).create(true).open(path).map_err(|e| format!("{flag} {shown}: cannot write there: {e}"))?;
    if !existed {
        let _ = std::fs::remove_file(path);
    }
    Ok(())
}

/// Reads a file written by [`write_json`].
pub fn read_json(path: &Path) -> Result<Vec<Record>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    serde_json::from_str(&text).map_err(|e| format!("{} is not a list of records: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outputs_are_checked_before_anything_runs() {
        let dir = std::env::temp_dir().join(format!("moelink-check-output-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let ok = dir.join("plot.PNG");
        assert_eq!(check_output("--plot", &ok, Some("png")), Ok(()));
        assert!(!ok.exists(), "the probe leaves no file behind");
        let e = check_output("--plot", &dir.join("plot.jpg"), Some("png")).unwrap_err();
        assert!(e.starts_with("--plot ") && e.contains("plot.jpg") && e.contains("must end in .png"), "{e}");
        let e = check_output("--json", &dir, None).unwrap_err();
        assert!(e.contains("is a directory"), "{e}");
        let e = check_output("--json", &dir.join("missing/x.json"), None).unwrap_err();
        assert!(e.contains("missing/x.json: cannot write there: ") && !e.contains('\n') && !e.contains("Os {"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn records_round_trip_with_extras_flattened() {
        let facts = RunFacts {
            system: "moelink".into(),
            backend: "host".into(),
            device: "cpu".into(),
            gpus: 0,
            date: "2026-01-01T00:00:00Z".into(),
            commit: "abc1234".into(),
        };
        let mut r = Record::new(&facts, "ht", "dispatch", 4);
        r.time_us = Some(12.5);
        r.status = Status::Ok;
        r.extra.insert("send_us".into(), serde_json::json!(3.0));
        let v = serde_json::to_value(&r).unwrap();
        assert_eq!(v["send_us"], serde_json::json!(3.0));
        assert_eq!(v["status"], "ok");
        assert!(v.get("error").is_none());
        assert_eq!(v["num_sms"], serde_json::Value::Null);
        let back: Record = serde_json::from_value(v).unwrap();
        assert_eq!(back, r);
        let dir = std::env::temp_dir().join(format!("moelink-record-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("r.json");
        write_json(&f, std::slice::from_ref(&r)).unwrap();
        assert_eq!(read_json(&f).unwrap(), vec![r]);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
