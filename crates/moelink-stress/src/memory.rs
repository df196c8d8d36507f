//! The process's memory as the soak samples it: the resident set, glibc's heap statistics, and returning the
//! heap's free memory to the system.

/// The process's resident set (`VmRSS` of `/proc/self/status`) in bytes; 0 where there is none.
pub fn rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("VmRSS:")).and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok()))
        .map_or(0, |kb| kb * 1024)
}

/// What the C heap (glibc malloc, which Rust's global allocator uses here) holds, over all its arenas.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeapStats {
    /// Bytes in live allocations (`uordblks + hblkhd` of `mallinfo2`): grows with a leak.
    pub in_use: u64,
    /// Bytes malloc holds from the system (`arena + hblkhd`): in use plus free chunks kept for reuse.
    pub held: u64,
}

/// glibc's heap statistics (`mallinfo2`), or `None` on another C library or a glibc older than 2.33. The
/// symbol is looked up at run time, so the binary does not require glibc 2.33 to start.
pub fn heap_stats() -> Option<HeapStats> {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        type Mallinfo2 = unsafe extern "C" fn() -> libc::mallinfo2;
        // SAFETY: dlsym with a NUL-terminated name; a non-null result is glibc's `mallinfo2`, whose C type
        // is `struct mallinfo2 mallinfo2(void)`, as `Mallinfo2` declares (libc's struct mirrors it).
        let f = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"mallinfo2".as_ptr()) };
        if f.is_null() {
            return None;
        }
        // SAFETY: see above; `mallinfo2` takes the arenas' locks itself and has no other precondition.
        let m = unsafe { std::mem::transmute::<*mut libc::c_void, Mallinfo2>(f)() };
        Some(HeapStats { in_use: (m.uordblks + m.hblkhd) as u64, held: (m.arena + m.hblkhd) as u64 })
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        None
    }
}

/// Returns the C heap's free memory to the system (`malloc_trim(0)`: the top of every arena, and the free
/// pages inside them); false where there is no glibc.
pub fn trim_heap() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: malloc_trim has no preconditions; it takes the arenas' locks itself.
        unsafe { libc::malloc_trim(0) };
        true
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    fn heap_stats_see_a_live_allocation_and_trim_runs() {
        let before = heap_stats().expect("glibc >= 2.33 has mallinfo2");
        assert!(before.held >= before.in_use);
        let block = std::hint::black_box(vec![1u8; 64 << 20]);
        let during = heap_stats().unwrap();
        // Other tests of this binary allocate and free concurrently: leave them 16 MiB of slack.
        assert!(during.in_use >= before.in_use + (48 << 20), "{before:?} -> {during:?}");
        drop(block);
        assert!(trim_heap());
        assert!(rss_bytes() > 0);
    }
}
