//! What machine and code a result comes from: GPUs, CPU model, commit, date, and which backend runs.

use moelink::BackendKind;
use moelink_cuda::SystemInfo;

/// The CUDA layer's view of the machine, or why there is none.
pub fn cuda_info() -> Result<SystemInfo, String> {
    moelink_cuda::system_info().map_err(|e| e.to_string())
}

/// Number of GPUs the driver reports (0 without a driver).
pub fn gpu_count() -> usize {
    cuda_info().map(|i| i.devices.len()).unwrap_or(0)
}

/// The CPU model as `/proc/cpuinfo` names it (x86: "model name"; other CPUs: what they report instead).
pub fn cpu_model() -> String {
    let text = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    for key in ["model name", "Model", "Hardware", "cpu model", "Processor"] {
        let found = text.lines().find_map(|l| {
            let (k, v) = l.split_once(':')?;
            (k.trim() == key && !v.trim().is_empty()).then(|| v.trim().to_string())
        });
        if let Some(v) = found {
            return v;
        }
    }
    format!("unknown {} CPU", std::env::consts::ARCH)
}

/// This machine's memory in bytes (`MemTotal` of `/proc/meminfo`), or `None` where it cannot be read.
pub fn host_memory_bytes() -> Option<usize> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// Logical CPUs available to this process.
pub fn cpu_count() -> usize {
    std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
}

/// Short git hash of the code: `MOELINK_COMMIT` when set (the device scripts set it from the build manifest),
/// else the commit this binary was built from, else `git rev-parse --short HEAD` here, else `"unknown"`.
pub fn commit() -> String {
    commit_from(std::env::var("MOELINK_COMMIT").ok(), env!("MOELINK_BUILD_COMMIT"))
}

fn commit_from(override_: Option<String>, built_from: &str) -> String {
    if let Some(c) = override_.map(|c| c.trim().to_string()).filter(|c| !c.is_empty()) {
        return c;
    }
    if !built_from.is_empty() {
        return built_from.to_string();
    }
    std::process::Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .stderr(std::process::Stdio::null())
        .output()
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "unknown".into())
}

/// Now, UTC, ISO-8601 to the second.
pub fn utc_now() -> String {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    iso8601(secs)
}

/// Seconds since the Unix epoch as `YYYY-MM-DDTHH:MM:SSZ` (proleptic Gregorian calendar).
pub fn iso8601(secs: u64) -> String {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    // Days to civil date (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + (m <= 2) as i64;
    format!("{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z", rem / 3600, rem % 3600 / 60, rem % 60)
}

/// The backend a `--backend` choice resolves to here, and, when `auto` fell back to the host, why.
pub fn resolve_backend(kind: BackendKind) -> Result<(BackendKind, Option<String>), String> {
    match kind {
        BackendKind::Host => Ok((BackendKind::Host, None)),
        BackendKind::Cuda => match BackendKind::Cuda.check_available() {
            Ok(()) => Ok((BackendKind::Cuda, None)),
            Err(e) => Err(format!("the CUDA backend is unavailable: {e}")),
        },
        BackendKind::Auto => match BackendKind::Cuda.check_available() {
            Ok(()) => Ok((BackendKind::Cuda, None)),
            Err(e) => Ok((BackendKind::Host, Some(e.to_string()))),
        },
    }
}

/// `"host"` / `"cuda"`.
pub fn backend_name(kind: BackendKind) -> &'static str {
    match kind {
        BackendKind::Host => "host",
        BackendKind::Cuda => "cuda",
        BackendKind::Auto => "auto",
    }
}

/// The device string of a record: the first GPU's name on CUDA, the CPU model on the host.
pub fn device_name(kind: BackendKind) -> String {
    match (kind, cuda_info()) {
        (BackendKind::Cuda, Ok(info)) if !info.devices.is_empty() => info.devices[0].name.clone(),
        _ => cpu_model(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn iso8601_matches_known_dates() {
        assert_eq!(iso8601(0), "1970-01-01T00:00:00Z");
        assert_eq!(iso8601(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(iso8601(1_700_000_000), "2023-11-14T22:13:20Z");
        assert_eq!(iso8601(4_102_444_799), "2099-12-31T23:59:59Z");
    }

    #[test]
    fn cpu_model_is_never_empty() {
        assert!(!cpu_model().is_empty());
    }

    #[test]
    fn the_commit_is_the_override_then_the_builds() {
        assert_eq!(commit_from(Some(" abc1234 \n".into()), "def5678"), "abc1234");
        assert_eq!(commit_from(Some("  ".into()), "def5678"), "def5678");
        assert_eq!(commit_from(None, "def5678"), "def5678");
        // This crate is built inside its repository, so its build stamp names a commit.
        assert!(!env!("MOELINK_BUILD_COMMIT").is_empty());
    }
}
