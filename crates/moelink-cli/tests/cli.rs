//! The `moelink` binary as a user runs it: exit codes, error format, JSON records, process mode.

use std::net::TcpListener;
use std::process::{Command, Output};

fn moelink(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_moelink"))
        .args(args)
        .env_remove("RANK")
        .env_remove("WORLD_SIZE")
        .env_remove("MASTER_ADDR")
        .env_remove("MASTER_PORT")
        .output()
        .expect("the moelink binary runs")
}

fn text(o: &Output) -> (String, String) {
    (String::from_utf8_lossy(&o.stdout).into_owned(), String::from_utf8_lossy(&o.stderr).into_owned())
}

fn tmp(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("moelink-cli-test-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d.join(name)
}

#[test]
fn quick_bench_on_the_host_writes_correct_records() {
    let json = tmp("bench.json");
    let o = moelink(&["bench", "--quick", "--backend", "host", "--routing", "uniform,skewed", "--hook", "--json", json.to_str().unwrap()]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "stdout:\n{out}\nstderr:\n{err}");
    assert!(out.contains("backend: host"), "{out}");
    assert!(out.contains("not GPU performance"), "{out}");
    let records: Vec<serde_json::Value> = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    // HT: bf16 + fp8 dispatch + combine; LL: fp8 dispatch + combine; for each of two routings.
    assert_eq!(records.len(), 10);
    let required = [
        "system",
        "backend",
        "device",
        "gpus",
        "date",
        "commit",
        "mode",
        "op",
        "dtype",
        "ranks",
        "tokens",
        "hidden",
        "topk",
        "experts",
        "routing",
        "num_sms",
        "time_us",
        "logical_gbps",
        "wire_gbps",
        "correct",
    ];
    for r in &records {
        for k in required {
            assert!(r.get(k).is_some(), "record lacks `{k}`: {r}");
        }
        assert_eq!(r["system"], "moelink");
        assert_eq!(r["backend"], "host");
        assert_eq!(r["gpus"], 0);
        assert!(r["date"].as_str().unwrap().ends_with('Z'));
        assert!(r["status"] != "ok" || r["timer"] == "wall", "{r}");
    }
    let ht: Vec<_> = records.iter().filter(|r| r["mode"] == "ht").collect();
    assert_eq!(ht.len(), 6);
    for r in ht {
        assert_eq!(r["status"], "ok", "{r}");
        assert_eq!(r["correct"], true);
        assert!(r["time_us"].as_f64().unwrap() > 0.0);
        assert!(r["logical_gbps"].as_f64().unwrap() >= r["wire_gbps"].as_f64().unwrap());
        assert_eq!(
            (r["tokens"].as_u64(), r["hidden"].as_u64(), r["topk"].as_u64(), r["experts"].as_u64()),
            (Some(256), Some(1024), Some(8), Some(64))
        );
    }
    // LL runs on the host backend too: measured, correct, and split into send / receive by `--hook`.
    let ll: Vec<_> = records.iter().filter(|r| r["mode"] == "ll").collect();
    assert_eq!(ll.len(), 4);
    for r in ll {
        assert_eq!(r["status"], "ok", "{r}");
        assert_eq!(r["correct"], true, "{r}");
        assert!(r["send_us"].as_f64().is_some() && r["recv_us"].as_f64().is_some(), "--hook adds send/recv times: {r}");
    }
}

#[test]
fn an_sm_sweep_gives_one_row_per_sm_count() {
    let json = tmp("sweep.json");
    let o = moelink(&[
        "bench",
        "--quick",
        "--mode",
        "ht",
        "--dtype",
        "bf16",
        "--num-sms",
        "8,16",
        "--ranks",
        "2",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{:?}", text(&o));
    let records: Vec<serde_json::Value> = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let sms: Vec<u64> = records.iter().map(|r| r["num_sms"].as_u64().unwrap()).collect();
    assert_eq!(sms, vec![8, 8, 16, 16]);
    assert!(records.iter().all(|r| r["ranks"] == 2 && r["correct"] == true));
}

#[test]
fn the_suite_runs_every_curve_into_one_table() {
    let json = tmp("suite.json");
    let o = moelink(&["bench", "--suite", "--quick", "--hook", "--reps", "1", "--warmup", "0", "--json", json.to_str().unwrap()]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "stdout:\n{out}\nstderr:\n{err}");
    let records: Vec<serde_json::Value> = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    // HT: 6 SM counts at the base shape + skewed + 3 token counts, 3 cases each; LL: 2 + 3 batches, 2 cases each.
    assert_eq!(records.len(), (6 + 1 + 3) * 3 + (2 + 3) * 2);
    let tokens = |mode: &str| {
        let mut t: Vec<u64> = records.iter().filter(|r| r["mode"] == mode).map(|r| r["tokens"].as_u64().unwrap()).collect();
        t.dedup();
        t
    };
    assert_eq!(tokens("ht"), vec![256, 64, 128, 512]);
    assert_eq!(tokens("ll"), vec![32, 1, 8, 64]);
    for r in &records {
        assert!(r["status"] == "ok" || r["status"] == "unavailable", "{r}");
    }
    // One table, a row per record, with every unit explained under it; no SMs column on the host backend.
    let table: Vec<&str> = out.lines().skip_while(|l| !l.starts_with("mode ")).collect();
    assert!(table[0].contains("wire GB/s") && table[0].contains("send+recv µs") && !table[0].contains("SMs"), "{out}");
    let rows = table.iter().skip(2).take_while(|l| !l.starts_with("  ")).count();
    assert_eq!(rows, records.len(), "{out}");
    for unit in ["time µs: ", "logical GB/s: ", "wire GB/s: ", "send+recv µs: ", "cached µs: "] {
        assert!(out.contains(&format!("\n  {unit}")), "{unit} is not explained:\n{out}");
    }
    assert_eq!(out.lines().filter(|l| l.starts_with("mode ")).count(), 1, "one table:\n{out}");
}

#[test]
fn user_errors_print_error_and_exit_1() {
    for args in [
        vec!["bench", "--ranks", "3", "--quick"],
        vec!["bench", "--num-sms", "7"],
        vec!["bench", "--suite", "--tokens", "512"],
        vec!["bench", "--quick", "--ll-tokens", "0"],
        vec!["bench", "--mode", "sideways"],
        vec!["bench", "--quick", "--hidden", "1000", "--dtype", "fp8"],
        vec!["selftest", "--process"],
        vec!["selftest", "--ranks", "1000"],
        vec!["bench", "--num-sms", "100000"],
        vec!["bench", "--timeout-s", "0"],
        vec!["no-such-command"],
    ] {
        let o = moelink(&args);
        let (out, err) = text(&o);
        assert_eq!(o.status.code(), Some(1), "{args:?}\n{out}\n{err}");
        assert!(err.starts_with("error: "), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
}

#[test]
fn output_paths_are_checked_before_anything_is_measured() {
    let dir = tmp("outputs");
    for (args, want) in [
        (vec!["--json", "/proc/moelink-nowhere/x.json"], "--json /proc/moelink-nowhere/x.json: cannot write there: "),
        (vec!["--plot", "/tmp/moelink-plot.jpg"], "--plot /tmp/moelink-plot.jpg: the file is written as PNG, so its name must end in .png"),
        (vec!["--plot", dir.to_str().unwrap()], "is"),
    ] {
        // The full-size host bench would take a minute: a refusal must come before it starts.
        let t0 = std::time::Instant::now();
        let o = moelink(&[&["bench", "--backend", "host", "--mode", "ht"][..], &args].concat());
        let (out, err) = text(&o);
        assert_eq!(o.status.code(), Some(1), "{args:?}\n{out}\n{err}");
        assert!(err.starts_with(&format!("error: {}", args.join(" "))) && err.contains(want), "{args:?}: {err}");
        assert_eq!(err.lines().count(), 1, "one line: {err}");
        assert!(!out.contains("batch "), "nothing was measured: {out}");
        assert!(t0.elapsed() < std::time::Duration::from_secs(10), "{args:?} took {:?}", t0.elapsed());
    }
}

#[test]
fn selftest_without_a_gpu_skips_the_gpu_checks_and_says_why_once() {
    let o = moelink(&["selftest", "--ranks", "2"]);
    let (out, err) = text(&o);
    if !out.contains("no GPU found") {
        return; // a GPU machine runs the GPU checks
    }
    assert!(o.status.success(), "{out}\n{err}");
    assert_eq!(out.matches("could not be loaded").count().max(out.matches("no GPU found").count()), 1, "{out}");
    assert!(out.lines().filter(|l| l.starts_with("SKIP")).all(|l| l.ends_with("skipped: no usable GPU (see above)")), "{out}");
    assert!(!out.contains("FAIL"), "{out}");
}

#[test]
fn the_top_level_help_lists_every_command() {
    let o = moelink(&["--help"]);
    let (out, _) = text(&o);
    for cmd in ["bench ", "bench nvlink", "bench transport", "bench bytes", "selftest", "info"] {
        assert!(out.contains(&format!("moelink {cmd}")), "{cmd} missing:\n{out}");
    }
}

#[test]
fn info_works_without_a_gpu() {
    let o = moelink(&["info"]);
    let (out, _) = text(&o);
    assert!(o.status.success());
    assert!(out.contains("CUDA driver:") && out.contains("backend auto ->"), "{out}");
}

#[test]
fn selftest_in_thread_mode_passes_the_group_check() {
    let o = moelink(&["selftest", "--ranks", "3"]);
    let (out, err) = text(&o);
    assert!(out.contains("PASS group"), "{out}\n{err}");
    assert!(!out.contains("FAIL"), "{out}");
}

/// What torchrun does: `ranks` processes of the moelink binary with its variables (moelink listens on
/// MOELINK_PORT here), each set up by `args`; their outputs in rank order.
fn torchrun_like(ranks: usize, args: impl Fn(&mut Command) -> &mut Command) -> Vec<Output> {
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port().to_string();
    let children: Vec<_> = (0..ranks)
        .map(|r| {
            let mut c = Command::new(env!("CARGO_BIN_EXE_moelink"));
            args(&mut c)
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", "1")
                .env("MOELINK_PORT", &port)
                .env("RANK", r.to_string())
                .env("LOCAL_RANK", r.to_string())
                .env("WORLD_SIZE", ranks.to_string())
                .env("LOCAL_WORLD_SIZE", ranks.to_string())
                .env("MOELINK_GROUP_TIMEOUT_MS", "60000")
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    children.into_iter().map(|c| c.wait_with_output().unwrap()).collect()
}

#[test]
fn selftest_in_process_mode_joins_over_tcp() {
    let outputs = torchrun_like(4, |c| c.args(["selftest", "--process"]));
    let (out0, err0) = text(&outputs[0]);
    assert!(out0.contains("process mode | 4 ranks"), "{out0}\n{err0}");
    assert!(out0.contains("PASS group") && out0.contains("over 4 ranks"), "{out0}\n{err0}");
    // Only rank 0 reports; every rank reaches the same exit status.
    for o in &outputs[1..] {
        let (out, err) = text(o);
        assert!(out.is_empty(), "{out}");
        assert_eq!(o.status.code(), outputs[0].status.code(), "{err}");
    }
}

#[test]
fn bench_in_process_mode_gathers_every_ranks_outcomes_at_rank_0() {
    // Two torchrun-like processes on the host backend, across 2 virtual nodes: rank 0 writes the records.
    let dir = std::env::temp_dir().join(format!("moelink-bench-process-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let json = dir.join("records.json");
    let outputs = torchrun_like(2, |c| {
        c.args(["bench", "--process", "--backend", "host", "--mode", "ht", "--quick", "--tokens", "32", "--topology", "2x1"])
            .args(["--transport", "ptr", "--json"])
            .arg(&json)
    });
    let (out0, err0) = text(&outputs[0]);
    assert_eq!(outputs[0].status.code(), Some(0), "{out0}\n{err0}");
    let records: Vec<serde_json::Value> = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(records.len(), 3, "{out0}");
    for r in &records {
        assert_eq!(r["ranks"], 2, "{r}");
        assert_eq!(r["status"], "ok", "{r}");
        assert!(r["time_us"].as_f64().is_some_and(|t| t > 0.0), "{r}");
    }
    let (out1, err1) = text(&outputs[1]);
    assert!(out1.is_empty() && outputs[1].status.success(), "rank 1 reports nothing: {out1}\n{err1}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Soak and chaos are `moelink-stress`'s: the product binary refuses them.
#[test]
fn the_stress_tools_are_not_subcommands_of_moelink() {
    for cmd in ["soak", "chaos"] {
        let o = moelink(&[cmd]);
        let (_, err) = text(&o);
        assert_eq!(o.status.code(), Some(1), "moelink {cmd}: {err}");
        assert!(err.contains("unrecognized subcommand"), "moelink {cmd}: {err}");
    }
}

#[test]
fn a_backend_typo_in_the_environment_gets_moelinks_message() {
    for value in ["cpu", "HOST", "gpu"] {
        let o = Command::new(env!("CARGO_BIN_EXE_moelink"))
            .args(["bench", "--quick"])
            .env("MOELINK_BACKEND", value)
            .output()
            .expect("the moelink binary runs");
        let (out, err) = text(&o);
        assert_eq!(o.status.code(), Some(1), "stdout:\n{out}\nstderr:\n{err}");
        assert!(err.contains("MOELINK_BACKEND") && err.contains(value), "{err}");
        assert!(["auto", "host", "cuda"].iter().all(|n| err.contains(n)), "{err}");
        assert!(out.is_empty(), "nothing runs: {out}");
    }
}

#[test]
fn a_size_the_machine_cannot_hold_is_an_error_naming_the_flag() {
    for (flag, value) in [("--tokens", "99999999999"), ("--ll-tokens", "99999999999"), ("--tokens", "18446744073709551615")] {
        let o = moelink(&["bench", "--quick", "--backend", "host", flag, value]);
        let (out, err) = text(&o);
        assert_eq!(o.status.code(), Some(1), "{flag} {value}: stdout:\n{out}\nstderr:\n{err}");
        assert!(err.starts_with("error: ") && err.contains(&format!("{flag} {value}")) && err.contains("bytes"), "{err}");
        assert!(!err.contains("memory allocation of"), "an abort, not an error: {err}");
    }
}

#[test]
fn bench_plot_writes_a_png_of_the_expected_size() {
    let png = tmp("bench.png");
    let o =
        moelink(&["bench", "--quick", "--backend", "host", "--tokens", "32,64", "--ll-tokens", "8,16", "--plot", png.to_str().unwrap()]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "stdout:\n{out}\nstderr:\n{err}");
    assert!(out.contains("wrote the plot to"), "{out}");
    let bytes = std::fs::read(&png).expect("the plot was written");
    // PNG signature, then the IHDR chunk: width and height (big-endian) at bytes 16..24.
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
    assert_eq!(&bytes[12..16], b"IHDR");
    let width = u32::from_be_bytes(bytes[16..20].try_into().unwrap());
    let height = u32::from_be_bytes(bytes[20..24].try_into().unwrap());
    assert_eq!((width, height), (1280, 720));
    // Lines, labels and two panels compress to far more than a blank picture's few hundred bytes.
    assert!(bytes.len() > 20_000, "{} bytes", bytes.len());
}
