//! Stamps the binary (and the Python extension module, whose crate names this script too) with the commit it
//! was built from (`MOELINK_BUILD_COMMIT`), so that records name the code that ran wherever the binary or the
//! wheel is carried, whatever checkout (or none) sits beside it there.

use std::path::{Path, PathBuf};
use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok().filter(|o| o.status.success())?;
    let text = String::from_utf8(out.stdout).ok()?.trim().to_string();
    (!text.is_empty()).then_some(text)
}

fn main() {
    let commit = git(&["rev-parse", "--short", "HEAD"]).unwrap_or_default();
    println!("cargo:rustc-env=MOELINK_BUILD_COMMIT={commit}");
    // Rebuilt when HEAD moves: HEAD itself (a checkout), the branch it names (a commit), packed refs.
    if let Some(dir) = git(&["rev-parse", "--git-dir"]).map(PathBuf::from) {
        // Only files that exist: cargo reruns a build script on every build for a missing one.
        let watch = |p: &Path| {
            if p.exists() {
                println!("cargo:rerun-if-changed={}", p.display());
            }
        };
        watch(&dir.join("HEAD"));
        watch(&dir.join("packed-refs"));
        if let Some(branch) = git(&["symbolic-ref", "-q", "HEAD"]) {
            watch(&dir.join(branch));
        }
    }
}
