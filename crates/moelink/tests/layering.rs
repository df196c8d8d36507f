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

/// `unsafe` blocks, `unsafe fn`s and `unsafe impl`s in `text`, comments left out.
fn unsafe_uses(text: &str) -> usize {
    text.lines()
        .map(|l| l.trim_start())
        .filter(|l| !l.starts_with("//"))
        .map(|l| l.matches("unsafe {").count() + l.matches("unsafe fn").count() + l.matches("unsafe impl").count())
        .sum()
}

/// The rule of docs/architecture.md: no `unsafe` in this crate, the CUDA layer (`moelink-cuda`) holds it.
/// `#![forbid(unsafe_code)]` makes the compiler refuse it (no `allow` can lift a forbid); this test keeps the
/// forbid in place and finds any `unsafe` that a macro or a cfg might hide from it.
#[test]
fn no_unsafe_in_this_crate() {
    let lib = source("lib.rs");
    assert!(lib.lines().any(|l| l.trim() == "#![forbid(unsafe_code)]"), "src/lib.rs lost #![forbid(unsafe_code)]");
    for (file, text) in sources_under(".") {
        assert_eq!(unsafe_uses(&text), 0, "src/{}: unsafe outside the CUDA layer (docs/architecture.md)", file.trim_start_matches("./"));
        assert!(!text.contains("allow(unsafe_code)"), "src/{file}: allows unsafe code");
    }
    assert_eq!(unsafe_uses("let x = unsafe { f() };\n// unsafe { not code }\npub unsafe fn g() {}"), 2);
}
