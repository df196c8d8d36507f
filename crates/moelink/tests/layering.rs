//! The layering rules of docs/architecture.md that the compiler does not check: the validating core names no
//! backend type, and the CUDA backend picks its fabric in one place.

use std::path::Path;

fn source(rel: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("src").join(rel);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The Rust files under `src/<dir>`, with their paths relative to `src`.
fn sources_under(dir: &str) -> Vec<(String, String)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut out = Vec::new();
    let mut stack = vec![root.join(dir)];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).unwrap_or_else(|e| panic!("{}: {e}", d.display())) {
            let p = entry.expect("a directory entry").path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|e| e == "rs") {
                let rel = p.strip_prefix(&root).expect("under src").display().to_string();
                out.push((rel, std::fs::read_to_string(&p).expect("readable")));
            }
        }
    }
    out
}

#[test]
fn the_core_names_no_backend_type() {
    for file in ["ht.rs", "ll.rs", "config.rs", "layout.rs", "validate.rs", "reduce.rs", "internode.rs", "opaque.rs"] {
        let text = source(file);
        for (i, line) in text.lines().enumerate() {
            assert!(!line.contains("backend::"), "src/{file}:{}: the core names a backend item: {line}", i + 1);
        }
    }
}

#[test]
fn the_cuda_fabric_is_chosen_once() {
    let files = sources_under("backend/cuda");
    assert!(files.len() >= 10, "found {} files under backend/cuda", files.len());
    for (file, text) in &files {
        for (i, line) in text.lines().enumerate() {
            let asks = line.contains("is_internode()") || line.contains("internode.is_some()");
            assert!(!asks || file.ends_with("cuda/mod.rs"), "src/{file}:{}: a fabric switch outside backend::cuda::new: {line}", i + 1);
        }
    }
}

/// The places of this crate where `unsafe` stands, and how many (blocks, `unsafe fn`s and impls): graph
/// replay only. The rule is none: the CUDA layer (`moelink-cuda`) holds it (docs/architecture.md), and
/// `#![deny(unsafe_code)]` in lib.rs refuses any block that does not carry an `allow`. The counts are exact,
/// so none comes back unnoticed, allowed or not.
const UNSAFE_LEFT: &[(&str, usize)] = &[("backend/cuda/gpu.rs", 1)];

fn unsafe_uses(text: &str) -> usize {
    text.lines()
        .map(|l| l.trim_start())
        .filter(|l| !l.starts_with("//"))
        .map(|l| l.matches("unsafe {").count() + l.matches("unsafe fn").count() + l.matches("unsafe impl").count())
        .sum()
}

#[test]
fn unsafe_never_spreads() {
    let mut files = sources_under(".");
    files.iter_mut().for_each(|(f, _)| *f = f.trim_start_matches("./").to_string());
    for (file, text) in &files {
        let found = unsafe_uses(text);
        let allowed = UNSAFE_LEFT.iter().find(|(f, _)| f == file).map_or(0, |(_, n)| *n);
        assert!(found <= allowed, "src/{file}: {found} unsafe blocks or fns, at most {allowed} allowed (docs/architecture.md)");
        assert!(found >= allowed, "src/{file}: {found} unsafe blocks or fns, fewer than the {allowed} listed: lower UNSAFE_LEFT");
    }
    assert_eq!(unsafe_uses("let x = unsafe { f() };\n// unsafe { not code }\npub unsafe fn g() {}"), 2);
}

#[test]
fn the_compiler_refuses_unsafe_code() {
    let lib = source("lib.rs");
    assert!(lib.lines().any(|l| l.trim() == "#![deny(unsafe_code)]"), "src/lib.rs lost #![deny(unsafe_code)]");
    let allows: usize = sources_under(".").iter().map(|(_, text)| text.matches("#[allow(unsafe_code)]").count()).sum();
    let listed: usize = UNSAFE_LEFT.iter().map(|(_, n)| n).sum();
    assert!(allows <= listed, "{allows} #[allow(unsafe_code)] for the {listed} unsafe uses of UNSAFE_LEFT");
}
