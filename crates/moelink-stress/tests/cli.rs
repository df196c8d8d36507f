//! The `moelink-stress` binary as a user runs it: exit codes and the JSON summary.

use std::process::{Command, Output};

fn stress(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_moelink-stress")).args(args).output().expect("the moelink-stress binary runs")
}

fn text(o: &Output) -> (String, String) {
    (String::from_utf8_lossy(&o.stdout).into_owned(), String::from_utf8_lossy(&o.stderr).into_owned())
}

fn tmp(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("moelink-stress-test-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d.join(name)
}

#[test]
fn help_lists_soak_and_chaos_and_bad_options_exit_1() {
    let o = stress(&["--help"]);
    let (out, _) = text(&o);
    assert!(o.status.success());
    assert!(out.contains("soak") && out.contains("chaos"), "{out}");
    let o = stress(&["soak", "--backend", "host", "--hidden", "100", "--rounds", "1"]);
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(1));
    assert!(err.starts_with("error: --hidden 100"), "{err}");
}

/// A host-backend LL soak frees everything it allocates: with every memory sample on an LL block boundary
/// (where the soak frees the old block before sampling), the C heap's in-use bytes stay at their first value
/// whatever the shapes drawn. The soak runs in its own process with glibc's per-thread cache off
/// (`tcache_count=0`; it keeps ~1 MiB of freed chunks counted as in use), so that a leak of 16 bytes per
/// low-latency call shows (checked by planting one); the RSS, which keeps the allocator's free chunks, is
/// not what this checks.
#[test]
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn a_host_ll_soak_frees_everything_it_allocates() {
    let json = tmp("soak-heap.json");
    let o = Command::new(env!("CARGO_BIN_EXE_moelink-stress"))
        .args(["soak", "--backend", "host", "--ranks", "4", "--families", "ll,ll-prereduced,ll-hook"])
        .args(["--rounds", "300", "--ll-block", "10", "--ll-t-max", "8", "--hidden", "256,512,1024,2048", "--seed", "2"])
        .args(["--mem-every", "50", "--progress-s", "0", "--json", json.to_str().unwrap()])
        .env("GLIBC_TUNABLES", "glibc.malloc.tcache_count=0")
        .output()
        .expect("the moelink-stress binary runs");
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}\n{err}");
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let heap = &v["host_heap_in_use"];
    let samples = heap["samples"].as_array().expect("glibc reports mallinfo2");
    assert_eq!(samples.len(), 7, "{heap}");
    let start = heap["start"].as_u64().unwrap();
    for s in samples {
        let (round, bytes) = (s[0].as_u64().unwrap(), s[1].as_u64().unwrap());
        assert!(bytes < start + (64 << 10), "heap in use grew from {start} to {bytes} bytes by round {round}: {heap}");
    }
    assert!(v["host_heap_held"]["max"].as_u64().unwrap() > v["host_heap_in_use"]["max"].as_u64().unwrap());
}
