//! `moelink info`: what this machine offers moelink. Works without a GPU (it says what is missing).

use moelink::BackendKind;

use crate::{sys, CliError};

/// Runs `moelink info`.
pub fn run() -> Result<(), CliError> {
    println!("moelink {} (commit {})", env!("CARGO_PKG_VERSION"), sys::commit());
    println!("CPU: {} ({} logical CPUs)", sys::cpu_model(), sys::cpu_count());
    match sys::cuda_info() {
        Err(why) => println!("CUDA driver: not found ({why})\nGPUs: none"),
        Ok(info) => {
            let v = info.driver_version;
            println!("CUDA driver: {}.{} ({v})", v / 1000, v % 1000 / 10);
            println!("GPUs: {}", info.devices.len());
            if !info.devices.is_empty() {
                let mut t = crate::table::Table::new(
                    &["#", "name", "SMs", "memory", "compute", "smem/block (opt-in)", "MPS"],
                    &[true, false, true, true, false, true, false],
                );
                for d in &info.devices {
                    t.row(vec![
                        d.ordinal.to_string(),
                        d.name.clone(),
                        d.multiprocessors.to_string(),
                        format!("{:.1} GiB", d.total_memory_bytes as f64 / (1u64 << 30) as f64),
                        format!("sm_{}{}", d.compute_capability.0, d.compute_capability.1),
                        format!("{} KiB", d.max_shared_memory_per_block_optin >> 10),
                        if d.mps_enabled { "client".into() } else { "-".into() },
                    ]);
                }
                print!("{}", indent(&t.render()));
                println!("peer access (row can read/write column):");
                print!("{}", indent(&peer_matrix(&info.peer_access)));
            }
            match &info.nvrtc {
                Ok((major, minor)) => println!("NVRTC: {major}.{minor}"),
                Err(why) => println!("NVRTC: unavailable ({why})"),
            }
        }
    }
    match BackendKind::Cuda.check_available() {
        Ok(()) => println!("backend auto -> cuda"),
        Err(e) => println!("backend auto -> host (cuda unavailable: {e})"),
    }
    Ok(())
}

fn indent(s: &str) -> String {
    s.lines().map(|l| format!("  {l}\n")).collect()
}

/// `y`/`n` matrix, `-` on the diagonal.
fn peer_matrix(m: &[Vec<bool>]) -> String {
    let n = m.len();
    let w = n.saturating_sub(1).to_string().len().max(1);
    let mut out = format!("{:w$} ", "");
    for j in 0..n {
        out += &format!(" {j:>w$}");
    }
    out.push('\n');
    for (i, row) in m.iter().enumerate() {
        out += &format!("{i:>w$} ");
        for j in 0..n {
            let c = if i == j {
                "-"
            } else if row.get(j).copied().unwrap_or(false) {
                "y"
            } else {
                "n"
            };
            out += &format!(" {c:>w$}");
        }
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn peer_matrix_marks_the_diagonal() {
        let m = vec![vec![false, true], vec![false, false]];
        assert_eq!(super::peer_matrix(&m), "   0 1\n0  - y\n1  n -\n");
    }
}
