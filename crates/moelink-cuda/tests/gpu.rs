//! GPU tests of the CUDA layer. Ignored unless included (`--include-ignored`, on a machine with a driver and
//! a GPU); NVRTC must be loadable (`LD_LIBRARY_PATH=/usr/local/cuda/lib64` on the GPU box).
//!
//! ```text
//! LD_LIBRARY_PATH=/usr/local/cuda/lib64 cargo test -p moelink-cuda --test gpu -- --include-ignored --test-threads 1
//! ```

use std::sync::{Arc, Mutex};
use std::time::Duration;

use moelink_cuda::jit::{CacheSource, CompileRequest, JitCache};
use moelink_cuda::{
    Device, DeviceBuffer, Error, Event, Exchange, HostMapped, IpcMapping, IpcMemHandle, Kernel, KernelArgs, LaunchConfig, Module,
    PeerAccess, Stream, SymmetricBuffer,
};

/// The device to test on (the tests that call this were included to run on a GPU: no GPU is a failure).
fn gpu() -> Device {
    Device::new(0).unwrap_or_else(|e| panic!("this test runs on a GPU machine: {e}"))
}

const TEST_KERNELS: &str = r#"
typedef unsigned int u32;
typedef unsigned long long u64;

__device__ __forceinline__ u64 now_ns() { u64 t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t; }

extern "C" __global__ void add_one(u32* p, u32 n) {
  const u32 i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) p[i] += 1;
}

// Writes 3i+1 into host-mapped memory.
extern "C" __global__ void write_host(u32* p, u32 n) {
  const u32 i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) p[i] = 3 * i + 1;
}

// out[block] = the block's rank inside its cluster.
extern "C" __global__ void cluster_ranks(u32* out) {
  u32 r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  if (threadIdx.x == 0) out[blockIdx.x] = r;
}

// Grid-wide rendezvous that only terminates when every block is resident at once (cooperative launch);
// bails out after 2 s instead of hanging. out[block] = number of blocks seen arriving.
extern "C" __global__ void grid_rendezvous(u32* counter, u32* out) {
  if (threadIdx.x != 0) return;
  atomicAdd(counter, 1u);
  const u64 start = now_ns();
  u32 seen = 0;
  while ((seen = atomicAdd(counter, 0u)) < gridDim.x && now_ns() - start < 2000000000ull) {}
  out[blockIdx.x] = seen;
}

// Spins until *flag is non-zero, at most 2 s: *out = 1 when it saw the flag, 2 when it gave up.
extern "C" __global__ void wait_for_flag(const volatile u32* flag, u32* out) {
  const u64 start = now_ns();
  while (*flag == 0) {
    if (now_ns() - start > 2000000000ull) { *out = 2; return; }
  }
  *out = 1;
}

extern "C" __global__ void set_flag(volatile u32* flag) { *flag = 1; }
"#;

fn test_module(device: &Device) -> Module {
    let req = CompileRequest::new("gpu_test_kernels.cu", TEST_KERNELS, device.info().arch());
    JitCache::new(None).compile(&req).expect("test kernels compile").load(device).expect("test module loads")
}

fn bytes_of(words: &[u32]) -> Vec<u8> {
    words.iter().flat_map(|w| w.to_le_bytes()).collect()
}

fn words_of(bytes: &[u8]) -> Vec<u32> {
    bytes.chunks_exact(4).map(|c| u32::from_le_bytes(c.try_into().unwrap())).collect()
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored"]
fn alloc_copy_round_trip() {
    let dev = gpu();
    let n = 1 << 18;
    let data: Vec<u32> = (0..n as u32).map(|i| i.wrapping_mul(2654435761)).collect();
    let mut a = DeviceBuffer::from_host(&dev, &bytes_of(&data)).unwrap();
    let mut back = vec![0u8; 4 * n];
    a.copy_to_host(&mut back).unwrap();
    assert_eq!(words_of(&back), data);

    // device -> device, sync and async, at offsets
    let mut b = DeviceBuffer::zeroed(&dev, 4 * n).unwrap();
    b.copy_from_device(16, &a, 0, 4 * n - 16).unwrap();
    let mut out = vec![0u8; 4 * n];
    b.copy_to_host(&mut out).unwrap();
    assert_eq!(&out[..16], &[0u8; 16]);
    assert_eq!(&out[16..], &bytes_of(&data)[..4 * n - 16]);
    let stream = Stream::new(&dev).unwrap();
    b.copy_from_device_async(0, &a, 0, 4 * n, &stream).unwrap();
    stream.synchronize().unwrap();
    b.copy_to_host(&mut out).unwrap();
    assert_eq!(words_of(&out), data);

    // async host copies and memsets
    let mut host = vec![0u8; 4 * n];
    // SAFETY: `host` lives until after the synchronize below and is not touched meanwhile.
    unsafe { a.copy_to_host_async(0, &mut host, &stream).unwrap() };
    stream.synchronize().unwrap();
    assert_eq!(words_of(&host), data);
    a.memset_u32(0xabcd_ef01).unwrap();
    a.copy_to_host_at(4 * 100, &mut out[..8]).unwrap();
    assert_eq!(words_of(&out[..8]), vec![0xabcd_ef01; 2]);
    a.memset_u8_async(7, &stream).unwrap();
    stream.synchronize().unwrap();
    a.copy_to_host(&mut out).unwrap();
    assert!(out.iter().all(|&x| x == 7));

    // bounds are checked
    assert!(matches!(a.copy_to_host_at(4 * n - 4, &mut out[..8]), Err(Error::InvalidArgument(_))));
    assert!(matches!(b.copy_from_host(1, &out), Err(Error::InvalidArgument(_))));
    let (free, total) = dev.memory_info().unwrap();
    assert!(free > 0 && free <= total);
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored"]
fn host_mapped_memory_is_written_by_kernels() {
    let dev = gpu();
    let module = test_module(&dev);
    let k = module.kernel("write_host").unwrap();
    let mut hm = HostMapped::<u32>::new(&dev, 1000).unwrap();
    assert!(hm.read_all().iter().all(|&v| v == 0));
    hm.write(5, 99);
    assert_eq!(hm.read(5), 99);
    let stream = Stream::new(&dev).unwrap();
    let args = KernelArgs::new().arg(hm.device_ptr()).arg(1000u32);
    // SAFETY: the kernel writes 1000 u32 into the mapping, which holds 1000.
    unsafe { k.launch(&stream, &LaunchConfig::linear(4, 256), &args).unwrap() };
    stream.synchronize().unwrap();
    assert_eq!(hm.read_all(), (0..1000u32).map(|i| 3 * i + 1).collect::<Vec<_>>());
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored"]
fn module_load_launch_and_argument_checks() {
    let dev = gpu();
    let module = test_module(&dev);
    let k: Kernel = module.kernel("add_one").unwrap();
    assert_eq!(k.param_sizes(), &[8, 4]);
    let attrs = k.attributes().unwrap();
    assert_eq!(attrs.local_bytes, 0);
    assert!(attrs.num_regs > 0);
    assert!(matches!(module.kernel("no_such_kernel"), Err(Error::Driver { .. })));
    assert!(matches!(Module::load(&dev, b"// PTX is refused"), Err(Error::InvalidArgument(_))));

    let n = 10_000u32;
    let buf = DeviceBuffer::zeroed(&dev, 4 * n as usize).unwrap();
    let stream = Stream::new(&dev).unwrap();
    let cfg = LaunchConfig::linear(n.div_ceil(256), 256);
    // SAFETY: add_one touches n u32 of `buf`, which has exactly n.
    unsafe {
        k.launch(&stream, &cfg, &KernelArgs::new().arg(buf.device_ptr()).arg(n)).unwrap();
        // Wrong argument list: refused before anything is launched.
        let e = k.launch(&stream, &cfg, &KernelArgs::new().arg(buf.device_ptr())).unwrap_err();
        assert!(e.to_string().contains("add_one"), "{e}");
        let e = k.launch(&stream, &cfg, &KernelArgs::new().arg(buf.device_ptr()).arg(n as u64)).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)));
        // Bad shapes are refused too.
        assert!(k.launch(&stream, &LaunchConfig::linear(1, 2048), &KernelArgs::new().arg(buf.device_ptr()).arg(n)).is_err());
        assert!(k.launch(&stream, &cfg.with_dynamic_smem(1 << 20), &KernelArgs::new().arg(buf.device_ptr()).arg(n)).is_err());
    }
    stream.synchronize().unwrap();
    let mut out = vec![0u8; 4 * n as usize];
    buf.copy_to_host(&mut out).unwrap();
    assert!(words_of(&out).iter().all(|&v| v == 1));
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored"]
fn cooperative_and_cluster_launches() {
    let dev = gpu();
    let module = test_module(&dev);
    let stream = Stream::new(&dev).unwrap();

    let clusters = module.kernel("cluster_ranks").unwrap();
    let out = DeviceBuffer::zeroed(&dev, 4 * 8).unwrap();
    let cfg = LaunchConfig::linear(8, 32).with_cluster([2, 1, 1]);
    // SAFETY: 8 blocks write one u32 each into `out` (8 u32).
    unsafe { clusters.launch(&stream, &cfg, &KernelArgs::new().arg(out.device_ptr())).unwrap() };
    // SAFETY: as above; 3 does not divide 8, so this launch is refused before reaching the driver.
    let refused =
        unsafe { clusters.launch(&stream, &LaunchConfig::linear(8, 32).with_cluster([3, 1, 1]), &KernelArgs::new().arg(out.device_ptr())) };
    assert!(matches!(refused, Err(Error::InvalidArgument(_))));
    stream.synchronize().unwrap();
    let mut host = vec![0u8; 32];
    out.copy_to_host(&mut host).unwrap();
    assert_eq!(words_of(&host), vec![0, 1, 0, 1, 0, 1, 0, 1]);

    let rendezvous = module.kernel("grid_rendezvous").unwrap();
    let blocks = dev.info().multiprocessors as u32;
    let counter = DeviceBuffer::zeroed(&dev, 4).unwrap();
    let seen = DeviceBuffer::zeroed(&dev, 4 * blocks as usize).unwrap();
    let cfg = LaunchConfig::linear(blocks, 32).with_cooperative();
    // SAFETY: one counter word; one u32 per block in `seen`.
    unsafe { rendezvous.launch(&stream, &cfg, &KernelArgs::new().arg(counter.device_ptr()).arg(seen.device_ptr())).unwrap() };
    stream.synchronize().unwrap();
    let mut host = vec![0u8; 4 * blocks as usize];
    seen.copy_to_host(&mut host).unwrap();
    assert!(words_of(&host).iter().all(|&s| s == blocks), "every block saw all {blocks} blocks arrive");
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored"]
fn graph_capture_and_replay() {
    let dev = gpu();
    let module = test_module(&dev);
    let k = module.kernel("add_one").unwrap();
    let n = 4096u32;
    let buf = DeviceBuffer::zeroed(&dev, 4 * n as usize).unwrap();
    let stream = Stream::new(&dev).unwrap();
    let args = KernelArgs::new().arg(buf.device_ptr()).arg(n);
    let graph = stream
        .capture(|s| {
            // SAFETY: n u32 in `buf`, which outlives every replay below.
            unsafe { k.launch(s, &LaunchConfig::linear(n / 256, 256), &args)? };
            unsafe { k.launch(s, &LaunchConfig::linear(n / 256, 256), &args) }
        })
        .unwrap();
    let exec = graph.instantiate().unwrap();
    // Capture only recorded the work.
    let mut out = vec![0u8; 4 * n as usize];
    buf.copy_to_host(&mut out).unwrap();
    assert!(words_of(&out).iter().all(|&v| v == 0));
    // Raw launches were captured: the safe replay refuses the graph.
    assert!(!exec.is_checked());
    assert!(exec.launch(&stream).unwrap_err().to_string().contains("launch_unchecked"));
    for _ in 0..3 {
        // SAFETY: `buf` is alive; the graph adds 2 to each of its n words.
        unsafe { exec.launch_unchecked(&stream).unwrap() };
    }
    stream.synchronize().unwrap();
    buf.copy_to_host(&mut out).unwrap();
    assert!(words_of(&out).iter().all(|&v| v == 6));
    // A capture of checked work only (a buffer fill) replays through the safe launch.
    let mut filled = DeviceBuffer::zeroed(&dev, 4 * n as usize).unwrap();
    let checked = stream.capture(|s| filled.memset_u32_async(7, s)).unwrap().instantiate().unwrap();
    assert!(checked.is_checked());
    checked.launch(&stream).unwrap();
    stream.synchronize().unwrap();
    filled.copy_to_host(&mut out).unwrap();
    assert!(words_of(&out).iter().all(|&v| v == 7));
    // A failing capture body ends the capture and reports the body's error.
    let e = stream.capture(|_| Err(Error::InvalidArgument("body failed".into()))).unwrap_err();
    assert!(e.to_string().contains("body failed"));
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored"]
fn events_order_streams_and_time_work() {
    let dev = gpu();
    let module = test_module(&dev);
    let k = module.kernel("add_one").unwrap();
    let n = 1 << 20;
    let buf = DeviceBuffer::zeroed(&dev, 4 * n as usize).unwrap();
    let (s1, s2) = (Stream::new(&dev).unwrap(), Stream::new(&dev).unwrap());
    let (start, end) = (Event::new(&dev, true).unwrap(), Event::new(&dev, true).unwrap());
    start.record(&s1).unwrap();
    // SAFETY: n u32 in `buf`.
    unsafe { k.launch(&s1, &LaunchConfig::linear(n / 256, 256), &KernelArgs::new().arg(buf.device_ptr()).arg(n)).unwrap() };
    end.record(&s1).unwrap();
    s2.wait_event(&end).unwrap();
    // SAFETY: as above; ordered after the first launch by the event.
    unsafe { k.launch(&s2, &LaunchConfig::linear(n / 256, 256), &KernelArgs::new().arg(buf.device_ptr()).arg(n)).unwrap() };
    assert!(s2.synchronize_timeout(Duration::from_secs(10)).unwrap());
    assert!(end.query().unwrap());
    let ms = start.elapsed_ms(&end).unwrap();
    assert!(ms > 0.0 && ms < 1000.0, "{ms} ms");
    let mut out = vec![0u8; 4 * n as usize];
    buf.copy_to_host(&mut out).unwrap();
    assert!(words_of(&out).iter().all(|&v| v == 2));
    assert!(matches!(Event::new(&dev, false).unwrap().elapsed_ms(&end), Err(Error::InvalidArgument(_))));
    assert_ne!(s1.raw_handle(), 0);
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored"]
fn jit_cache_hits() {
    let dev = gpu();
    let dir = std::env::temp_dir().join(format!("moelink-gpu-jit-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let req = CompileRequest::new("gpu_test_kernels.cu", TEST_KERNELS, dev.info().arch()).define("UNUSED_CONSTANT", 1);
    let t0 = std::time::Instant::now();
    let (a, s1) = JitCache::new(Some(dir.clone())).compile_traced(&req).unwrap();
    let cold = t0.elapsed();
    let cache = JitCache::new(Some(dir.clone()));
    let t1 = std::time::Instant::now();
    let (b, s2) = cache.compile_traced(&req).unwrap();
    let warm = t1.elapsed();
    let (_, s3) = cache.compile_traced(&req).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!((s1, s2, s3), (CacheSource::Compiled, CacheSource::Disk, CacheSource::Memory));
    assert_eq!(a.cubin, b.cubin);
    b.load(&dev).unwrap().kernel("add_one").unwrap();
    eprintln!("JIT: cold {cold:?}, disk hit {warm:?}");
}

/// A minimal in-process all-gather for thread-mode tests. Waits at most 60 s for the other ranks, so a rank
/// that panicked turns into an error on the others instead of a hung test binary.
/// (completed rounds, arrivals in this round, this round's messages, the last round's result).
type GatherState = (u64, usize, Vec<Vec<u8>>, Arc<Vec<Vec<u8>>>);

struct ThreadGather {
    n: usize,
    state: Mutex<GatherState>,
    cv: std::sync::Condvar,
}

impl ThreadGather {
    fn new(n: usize) -> Arc<ThreadGather> {
        Arc::new(ThreadGather { n, state: Mutex::new((0, 0, vec![Vec::new(); n], Arc::new(Vec::new()))), cv: std::sync::Condvar::new() })
    }
    fn all_gather(&self, rank: usize, bytes: &[u8]) -> Result<Vec<Vec<u8>>, Error> {
        let broken = |why: &str| Error::Exchange { rank, reason: format!("test all_gather: {why}") };
        let mut st = self.state.lock().map_err(|_| broken("a rank panicked"))?;
        let generation = st.0;
        st.2[rank] = bytes.to_vec();
        st.1 += 1;
        if st.1 == self.n {
            st.3 = Arc::new(std::mem::replace(&mut st.2, vec![Vec::new(); self.n]));
            st.1 = 0;
            st.0 += 1;
            self.cv.notify_all();
            return Ok(st.3.as_ref().clone());
        }
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while st.0 == generation {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return Err(broken("timed out waiting for the other ranks (did one fail?)"));
            }
            st = self.cv.wait_timeout(st, left).map_err(|_| broken("a rank panicked"))?.0;
        }
        Ok(st.3.as_ref().clone())
    }
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored"]
fn symmetric_memory_over_all_gpus_in_thread_mode() {
    gpu();
    let n = Device::count().unwrap();
    let bytes_per_peer = 1 << 20;
    let gather = ThreadGather::new(n);
    let results: Vec<Result<(), String>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..n)
            .map(|rank| {
                let gather = gather.clone();
                s.spawn(move || -> Result<(), String> {
                    let dev = Device::new(rank).map_err(|e| e.to_string())?;
                    let f = |b: &[u8]| gather.all_gather(rank, b);
                    let ex = Exchange { rank, num_ranks: n, process_key: 42, all_gather: &f };
                    let sym = SymmetricBuffer::new(&dev, n * bytes_per_peer, &ex).map_err(|e| e.to_string())?;
                    for r in 0..n {
                        let want = if r == rank { PeerAccess::Local } else { PeerAccess::SameProcess };
                        assert_eq!(sym.peer_access(r), want);
                    }
                    assert_eq!(sym.ranks_on_device(), 1);
                    // Write slot `rank` of every peer through its pointer (copy engine over NVLink).
                    let pattern: Vec<u8> = (0..bytes_per_peer).map(|i| (i * 7 + rank * 31 + 1) as u8).collect();
                    let src = DeviceBuffer::from_host(&dev, &pattern).map_err(|e| e.to_string())?;
                    let stream = Stream::new(&dev).map_err(|e| e.to_string())?;
                    for dst in 0..n {
                        // SAFETY: slot `rank` of rank dst's buffer has bytes_per_peer bytes; the buffers live
                        // until after the final all_gather below.
                        unsafe {
                            stream
                                .memcpy_dtod_async(
                                    sym.peer_ptr(dst).byte_add(rank * bytes_per_peer).addr(),
                                    src.device_ptr().addr(),
                                    bytes_per_peer,
                                )
                                .map_err(|e| e.to_string())?
                        };
                    }
                    stream.synchronize().map_err(|e| e.to_string())?;
                    gather.all_gather(rank, &[]).map_err(|e| e.to_string())?;
                    let mut got = vec![0u8; n * bytes_per_peer];
                    sym.local().copy_to_host(&mut got).map_err(|e| e.to_string())?;
                    for src_rank in 0..n {
                        let want: Vec<u8> = (0..bytes_per_peer).map(|i| (i * 7 + src_rank * 31 + 1) as u8).collect();
                        if got[src_rank * bytes_per_peer..(src_rank + 1) * bytes_per_peer] != want[..] {
                            return Err(format!("rank {rank}: slot of rank {src_rank} is wrong"));
                        }
                    }
                    // The device table holds the same pointers.
                    let mut table = vec![0u8; 8 * n];
                    // SAFETY: the table has n u64; the copy completes before `table` is read.
                    unsafe {
                        stream.memcpy_dtod_async(src.device_ptr().addr(), sym.peer_table_ptr().addr(), 8 * n).map_err(|e| e.to_string())?;
                    }
                    stream.synchronize().map_err(|e| e.to_string())?;
                    src.copy_to_host_at(0, &mut table).map_err(|e| e.to_string())?;
                    let ptrs: Vec<u64> = table.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().unwrap())).collect();
                    assert_eq!(ptrs, sym.peer_addrs());
                    gather.all_gather(rank, &[]).map_err(|e| e.to_string())?;
                    Ok(())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (rank, r) in results.into_iter().enumerate() {
        assert!(r.is_ok(), "rank {rank}: {r:?}");
    }
}

/// Ranks that share a GPU in one process share its context, and loading a module synchronises the
/// context: a rank loading its own copy of a module while a peer's kernel spins until this rank's kernel
/// runs would wait for that kernel, and the peer would wait out its deadline. `load_shared` gives the second
/// rank the module the first one loaded (functions included), so nothing is loaded while the kernel spins.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored"]
fn ranks_sharing_a_gpu_load_each_module_once() {
    let dev = gpu();
    let req = CompileRequest::new("gpu_test_kernels.cu", TEST_KERNELS, dev.info().arch()).define("SHARED_MODULE_TEST", 1);
    let compiled = JitCache::new(None).compile(&req).unwrap();
    let flag = DeviceBuffer::zeroed(&dev, 4).unwrap();
    let out = DeviceBuffer::zeroed(&dev, 4).unwrap();
    let (spinning, spinning_rx) = std::sync::mpsc::channel();
    let (compiled, dev, flag, out) = (&compiled, &dev, &flag, &out);
    std::thread::scope(|s| {
        s.spawn(move || {
            let module = compiled.load_shared(dev).unwrap();
            let wait = module.kernel("wait_for_flag").unwrap();
            let stream = Stream::new(dev).unwrap();
            // SAFETY: one flag word and one output word, both alive until the scope ends.
            unsafe {
                wait.launch(&stream, &LaunchConfig::linear(1, 1), &KernelArgs::new().arg(flag.device_ptr()).arg(out.device_ptr())).unwrap()
            };
            std::thread::sleep(Duration::from_millis(50)); // let the kernel start spinning
            spinning.send(()).unwrap();
            stream.synchronize().unwrap();
        });
        s.spawn(move || {
            spinning_rx.recv().unwrap();
            let module = compiled.load_shared(dev).unwrap();
            let set = module.kernel("set_flag").unwrap();
            let stream = Stream::new(dev).unwrap();
            // SAFETY: one flag word, alive until the scope ends.
            unsafe { set.launch(&stream, &LaunchConfig::linear(1, 1), &KernelArgs::new().arg(flag.device_ptr())).unwrap() };
            stream.synchronize().unwrap();
        });
    });
    let mut host = vec![0u8; 4];
    out.copy_to_host(&mut host).unwrap();
    assert_eq!(words_of(&host), vec![1], "1: the spinning kernel saw the peer's flag; 2: it waited out 2 s for the peer");
}

/// What a rank does on the host between its collective kernels must not wait for a peer's kernel on the
/// same GPU (that kernel may be waiting for this rank): each operation runs while a kernel on another
/// stream spins until a flag that is set only after the operation returned.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored"]
fn host_operations_do_not_wait_for_other_streams() {
    let dev = gpu();
    let module = test_module(&dev);
    let (wait, set) = (module.kernel("wait_for_flag").unwrap(), module.kernel("set_flag").unwrap());
    let (spinner, setter) = (Stream::new(&dev).unwrap(), Stream::new(&dev).unwrap());
    let while_a_kernel_spins = |name: &str, op: &mut dyn FnMut()| {
        let flag = DeviceBuffer::zeroed(&dev, 4).unwrap();
        let out = DeviceBuffer::zeroed(&dev, 4).unwrap();
        // SAFETY: one flag word and one output word, alive until both streams are synchronised below.
        unsafe {
            wait.launch(&spinner, &LaunchConfig::linear(1, 1), &KernelArgs::new().arg(flag.device_ptr()).arg(out.device_ptr())).unwrap()
        };
        std::thread::sleep(Duration::from_millis(20));
        op();
        // SAFETY: as above.
        unsafe { set.launch(&setter, &LaunchConfig::linear(1, 1), &KernelArgs::new().arg(flag.device_ptr())).unwrap() };
        spinner.synchronize().unwrap();
        setter.synchronize().unwrap();
        let mut host = vec![0u8; 4];
        out.copy_to_host(&mut host).unwrap();
        assert_eq!(words_of(&host), vec![1], "{name} waited for a kernel on another stream (2: the kernel gave up after 2 s)");
    };
    let compiled = JitCache::new(None).compile(&CompileRequest::new("gpu_test_kernels.cu", TEST_KERNELS, dev.info().arch())).unwrap();
    compiled.load_shared(&dev).unwrap();
    let mut buf = DeviceBuffer::zeroed(&dev, 1 << 20).unwrap();
    let mut fresh = Vec::new();
    while_a_kernel_spins("DeviceBuffer::alloc", &mut || fresh.push(DeviceBuffer::alloc(&dev, 64 << 20).unwrap()));
    while_a_kernel_spins("DeviceBuffer::memset_u8", &mut || buf.memset_u8(3).unwrap());
    while_a_kernel_spins("DeviceBuffer::copy_from_host", &mut || buf.copy_from_host(16, &[5u8; 16]).unwrap());
    let mut host = vec![0u8; 48];
    while_a_kernel_spins("DeviceBuffer::copy_to_host", &mut || buf.copy_to_host(&mut host).unwrap());
    assert_eq!(host, [[3u8; 16], [5; 16], [3; 16]].concat());
    while_a_kernel_spins("Stream::new", &mut || drop(Stream::new(&dev).unwrap()));
    while_a_kernel_spins("Module::load_shared (loaded before)", &mut || drop(compiled.load_shared(&dev).unwrap()));
    while_a_kernel_spins("drop(DeviceBuffer)", &mut || fresh.clear());
}

/// Two ranks of one process on the same GPU: each reaches the other's buffer by its plain pointer.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored"]
fn symmetric_memory_of_ranks_sharing_a_gpu() {
    let dev = gpu();
    let gather = ThreadGather::new(2);
    std::thread::scope(|s| {
        for rank in 0..2 {
            let (gather, dev) = (gather.clone(), dev.clone());
            s.spawn(move || {
                let f = |b: &[u8]| gather.all_gather(rank, b);
                let ex = Exchange { rank, num_ranks: 2, process_key: 7, all_gather: &f };
                let mut sym = SymmetricBuffer::new(&dev, 1 << 20, &ex).unwrap();
                assert_eq!(sym.peer_access(rank), PeerAccess::Local);
                assert_eq!(sym.peer_access(1 - rank), PeerAccess::SameDevice);
                assert_eq!(sym.ranks_on_device(), 2);
                sym.local_mut().copy_from_host(0, &[rank as u8 + 1; 16]).unwrap();
                gather.all_gather(rank, &[]).unwrap();
                let stream = Stream::new(&dev).unwrap();
                let peer = DeviceBuffer::zeroed(&dev, 16).unwrap();
                // SAFETY: 16 bytes of the peer's live buffer (it waits at the gather below) into `peer`.
                unsafe { stream.memcpy_dtod_async(peer.device_ptr().addr(), sym.peer_ptr(1 - rank).addr(), 16).unwrap() };
                stream.synchronize().unwrap();
                let mut host = [0u8; 16];
                peer.copy_to_host(&mut host).unwrap();
                assert_eq!(host, [2 - rank as u8; 16]);
                gather.all_gather(rank, &[]).unwrap();
            });
        }
    });
}

const IPC_CHILD_ENV: &str = "MOELINK_TEST_IPC_CHILD";
const IPC_BYTES: usize = 64 << 20;

/// Parent side: exports a buffer, lets a child process (this test binary, re-executed) map it over IPC,
/// check the first half and write the second half.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored"]
fn ipc_across_processes() {
    let dev = gpu();
    let half = IPC_BYTES / 2;
    let first: Vec<u8> = (0..half).map(|i| (i % 251) as u8).collect();
    assert!(DeviceBuffer::zeroed(&dev, IPC_BYTES).unwrap().ipc_handle().is_err(), "pool memory is not exportable");
    let mut buf = DeviceBuffer::alloc_exportable(&dev, IPC_BYTES).unwrap();
    buf.memset_u8(0).unwrap();
    buf.copy_from_host(0, &first).unwrap();
    let handle = buf.ipc_handle().unwrap();
    let hex: String = handle.as_bytes().iter().map(|b| format!("{b:02x}")).collect();
    let child_device = if Device::count().unwrap() > 1 { 1 } else { 0 };
    let status = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "ipc_child_entry", "--nocapture", "--test-threads", "1"])
        .env(IPC_CHILD_ENV, format!("{hex}:{child_device}"))
        .status()
        .unwrap();
    assert!(status.success(), "IPC child failed: {status:?}");
    let mut second = vec![0u8; half];
    buf.copy_to_host_at(half, &mut second).unwrap();
    assert!(second.iter().enumerate().all(|(i, &b)| b == (i % 241) as u8), "the child's writes arrived");
    // A handle of this very process cannot be opened here: the error is typed.
    assert!(IpcMapping::open(&dev, &handle, IPC_BYTES).is_err());
}

/// Child side of `ipc_across_processes`; does nothing unless started by it.
#[test]
fn ipc_child_entry() {
    let Ok(spec) = std::env::var(IPC_CHILD_ENV) else { return };
    let (hex, device) = spec.split_once(':').unwrap();
    let bytes: Vec<u8> = (0..64).map(|i| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap()).collect();
    let handle = IpcMemHandle::from_bytes(&bytes).unwrap();
    let dev = Device::new(device.parse().unwrap()).unwrap();
    let mapping = IpcMapping::open(&dev, &handle, IPC_BYTES).unwrap();
    assert!(IpcMapping::open(&dev, &handle, IPC_BYTES * 2).is_err(), "a size larger than the allocation is refused");
    let half = IPC_BYTES / 2;
    let local = DeviceBuffer::zeroed(&dev, half).unwrap();
    let second: Vec<u8> = (0..half).map(|i| (i % 241) as u8).collect();
    let staging = DeviceBuffer::from_host(&dev, &second).unwrap();
    let stream = Stream::new(&dev).unwrap();
    // SAFETY: both ranges lie inside the 64 MiB mapping and the local buffers, all alive until synchronized.
    unsafe {
        stream.memcpy_dtod_async(local.device_ptr().addr(), mapping.device_ptr().addr(), half).unwrap();
        stream.memcpy_dtod_async(mapping.device_ptr().byte_add(half).addr(), staging.device_ptr().addr(), half).unwrap();
    }
    stream.synchronize().unwrap();
    let mut got = vec![0u8; half];
    local.copy_to_host(&mut got).unwrap();
    assert!(got.iter().enumerate().all(|(i, &b)| b == (i % 251) as u8), "the parent's data is visible");
}
