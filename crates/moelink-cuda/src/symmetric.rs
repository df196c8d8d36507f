//! Symmetric memory: every rank allocates the same number of bytes; every rank ends up with a table of all
//! ranks' base pointers, usable by its kernels. How each pointer was obtained (own memory, a peer GPU in the
//! same process with peer access, or a CUDA IPC mapping of another process's memory) is recorded but never
//! matters to the code using the table.

use crate::device::Device;
use crate::error::{Error, Result};
use crate::ipc::{IpcMapping, IpcMemHandle};
use crate::memory::DeviceBuffer;

/// How a rank's buffer is reached from this rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PeerAccess {
    /// This rank's own allocation.
    Local,
    /// Another rank of this process on another GPU: its pointer, with peer access enabled between the GPUs.
    SameProcess,
    /// Another rank of this process on this rank's own GPU (ranks sharing a GPU: tests, EP8 on 4 GPUs).
    SameDevice,
    /// Another process's allocation, mapped with CUDA IPC.
    Ipc,
}

/// A collective all-gather: every rank contributes bytes and receives every rank's contribution, by rank.
pub type AllGather<'a, E> = dyn Fn(&[u8]) -> Result<Vec<Vec<u8>>, E> + 'a;

/// What [`SymmetricBuffer::new`] needs from the process group, without depending on it.
pub struct Exchange<'a, E> {
    /// This rank, `0..num_ranks`.
    pub rank: usize,
    /// Number of ranks.
    pub num_ranks: usize,
    /// Equal for ranks that share an address space (raw pointers are valid between them).
    pub process_key: u64,
    /// Every rank contributes the same-sized message and receives all of them, indexed by rank. Must be
    /// collective: every rank calls it the same number of times.
    pub all_gather: &'a AllGather<'a, E>,
}

const MAGIC: u32 = 0x4d4c_5359; // "MLSY"
const VERSION: u32 = 1;
const MSG_BYTES: usize = 112;

struct PeerInfo {
    rank: usize,
    ordinal: usize,
    process_key: u64,
    len: u64,
    ptr: u64,
    handle: Option<[u8; 64]>,
}

impl PeerInfo {
    fn encode(&self) -> Vec<u8> {
        let mut m = Vec::with_capacity(MSG_BYTES);
        m.extend_from_slice(&MAGIC.to_le_bytes());
        m.extend_from_slice(&VERSION.to_le_bytes());
        m.extend_from_slice(&(self.rank as u32).to_le_bytes());
        m.extend_from_slice(&(self.ordinal as u32).to_le_bytes());
        m.extend_from_slice(&self.process_key.to_le_bytes());
        m.extend_from_slice(&self.len.to_le_bytes());
        m.extend_from_slice(&self.ptr.to_le_bytes());
        m.extend_from_slice(&(self.handle.is_some() as u32).to_le_bytes());
        m.extend_from_slice(&0u32.to_le_bytes());
        m.extend_from_slice(&self.handle.unwrap_or([0; 64]));
        debug_assert_eq!(m.len(), MSG_BYTES);
        m
    }

    fn decode(m: &[u8]) -> Option<PeerInfo> {
        if m.len() != MSG_BYTES {
            return None;
        }
        let u32_at = |o: usize| u32::from_le_bytes(m[o..o + 4].try_into().expect("4 bytes"));
        let u64_at = |o: usize| u64::from_le_bytes(m[o..o + 8].try_into().expect("8 bytes"));
        if u32_at(0) != MAGIC || u32_at(4) != VERSION {
            return None;
        }
        let handle = if u32_at(40) != 0 { Some(m[48..112].try_into().expect("64 bytes")) } else { None };
        Some(PeerInfo {
            rank: u32_at(8) as usize,
            ordinal: u32_at(12) as usize,
            process_key: u64_at(16),
            len: u64_at(24),
            ptr: u64_at(32),
            handle,
        })
    }
}

/// The outcome of mapping every peer.
struct Mapped {
    peer_ptrs: Vec<u64>,
    access: Vec<PeerAccess>,
    mappings: Vec<IpcMapping>,
    peer_devices: Vec<Device>,
}

/// A buffer of the same size on every rank, plus every rank's base pointer as seen from this rank.
///
/// Creation is collective (two `all_gather` rounds). Drop is not synchronised: destroy it on every rank
/// only after a barrier that guarantees no peer kernel still writes into it.
pub struct SymmetricBuffer {
    local: DeviceBuffer,
    rank: usize,
    peer_ptrs: Vec<u64>,
    access: Vec<PeerAccess>,
    /// Device copy of `peer_ptrs` (`u64[num_ranks]`), for kernels that take the table by pointer.
    peer_table: DeviceBuffer,
    /// IPC mappings (closed on drop), kept alive for `peer_ptrs`.
    _mappings: Vec<IpcMapping>,
    /// Peer devices whose contexts must stay alive while their pointers are used.
    _peer_devices: Vec<Device>,
}

impl std::fmt::Debug for SymmetricBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SymmetricBuffer")
            .field("rank", &self.rank)
            .field("len_bytes", &self.local.len_bytes())
            .field("peer_ptrs", &self.peer_ptrs)
            .field("access", &self.access)
            .finish()
    }
}

impl SymmetricBuffer {
    /// Allocates `len_bytes` (zeroed) on `device` and maps every other rank's buffer. Collective.
    ///
    /// Errors of the exchange closure come back unchanged; CUDA errors are converted with `E::from`. If any
    /// rank fails to map its peers, every rank gets an error naming it.
    pub fn new<E: From<Error>>(device: &Device, len_bytes: usize, ex: &Exchange<'_, E>) -> Result<SymmetricBuffer, E> {
        let (rank, n) = (ex.rank, ex.num_ranks);
        if rank >= n || len_bytes == 0 {
            return Err(Error::invalid(format!("SymmetricBuffer: rank {rank} of {n}, {len_bytes} bytes")).into());
        }
        // Zero before anyone can learn the address: flags must start at 0. A rank that cannot allocate still
        // takes part in both rounds (with an empty message), so its peers fail fast instead of timing out.
        let local = DeviceBuffer::alloc_exportable(device, len_bytes).and_then(|mut l| l.memset_u8(0).map(|()| l));
        let me = local.as_ref().ok().map(|l| PeerInfo {
            rank,
            ordinal: device.ordinal(),
            process_key: ex.process_key,
            len: len_bytes as u64,
            ptr: l.device_ptr().addr(),
            handle: l.ipc_handle().ok().map(|h| h.0),
        });
        let all = (ex.all_gather)(&me.as_ref().map(PeerInfo::encode).unwrap_or_default())?;
        let mapped = match (&local, &me) {
            (Ok(_), Some(me)) => Self::map_peers(device, me, &all, n),
            (Err(e), _) => Err(e.clone()),
            (Ok(_), None) => Err(Error::Exchange { rank, reason: "no setup message was built".into() }),
        };
        // Second round: everyone learns whether everyone succeeded, so no rank runs kernels against a peer
        // that could not map it.
        let status: Vec<u8> = match &mapped {
            Ok(_) => vec![1],
            Err(e) => [&[0u8][..], e.to_string().as_bytes()].concat(),
        };
        let statuses = (ex.all_gather)(&status)?;
        let local = local?;
        let Mapped { peer_ptrs, access, mappings, peer_devices } = mapped?;
        for (r, s) in statuses.iter().enumerate() {
            if s.first() != Some(&1) {
                let why = String::from_utf8_lossy(s.get(1..).unwrap_or_default()).into_owned();
                return Err(Error::Exchange { rank, reason: format!("rank {r} could not set up symmetric memory: {why}") }.into());
            }
        }
        let table: Vec<u8> = peer_ptrs.iter().flat_map(|p| p.to_le_bytes()).collect();
        let peer_table = DeviceBuffer::from_host(device, &table)?;
        Ok(SymmetricBuffer { local, rank, peer_ptrs, access, peer_table, _mappings: mappings, _peer_devices: peer_devices })
    }

    fn map_peers(device: &Device, me: &PeerInfo, all: &[Vec<u8>], n: usize) -> Result<Mapped> {
        let rank = me.rank;
        let bad = |reason: String| Error::Exchange { rank, reason };
        if all.len() != n {
            return Err(bad(format!("all_gather returned {} messages for {n} ranks", all.len())));
        }
        let mut peer_ptrs = vec![0u64; n];
        let mut access = vec![PeerAccess::Local; n];
        let mut mappings = Vec::new();
        let mut peer_devices = Vec::new();
        for (r, m) in all.iter().enumerate() {
            if m.is_empty() {
                return Err(bad(format!("rank {r} failed before the exchange (see its own error)")));
            }
            let p = PeerInfo::decode(m).ok_or_else(|| bad(format!("malformed setup message from rank {r}")))?;
            if p.rank != r {
                return Err(bad(format!("message at index {r} claims to be from rank {}", p.rank)));
            }
            if p.len != me.len {
                return Err(bad(format!(
                    "rank {r} allocated {} bytes, this rank {}; every rank must ask for the same size",
                    p.len, me.len
                )));
            }
            if r == rank {
                peer_ptrs[r] = me.ptr;
                access[r] = PeerAccess::Local;
            } else if p.process_key == me.process_key && p.ordinal == device.ordinal() {
                peer_ptrs[r] = p.ptr;
                access[r] = PeerAccess::SameDevice;
            } else if p.process_key == me.process_key {
                let peer_dev = Device::new(p.ordinal)?;
                device.enable_peer_access(&peer_dev)?;
                peer_devices.push(peer_dev);
                peer_ptrs[r] = p.ptr;
                access[r] = PeerAccess::SameProcess;
            } else {
                let h = p
                    .handle
                    .ok_or_else(|| bad(format!("rank {r} lives in another process but could not export its buffer over CUDA IPC")))?;
                let mapping = IpcMapping::open(device, &IpcMemHandle(h), me.len as usize)?;
                peer_ptrs[r] = mapping.device_ptr().addr();
                access[r] = PeerAccess::Ipc;
                mappings.push(mapping);
            }
        }
        Ok(Mapped { peer_ptrs, access, mappings, peer_devices })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn num_ranks(&self) -> usize {
        self.peer_ptrs.len()
    }

    /// Bytes per rank.
    pub fn len_bytes(&self) -> usize {
        self.local.len_bytes()
    }

    /// This rank's own allocation.
    pub fn local(&self) -> &DeviceBuffer {
        &self.local
    }

    /// This rank's own allocation, mutably (host copies, memsets).
    pub fn local_mut(&mut self) -> &mut DeviceBuffer {
        &mut self.local
    }

    /// Base address of rank `r`'s buffer, usable by kernels on this rank's device.
    pub fn peer_ptr(&self, r: usize) -> crate::DevPtr {
        crate::DevPtr::from_raw(self.peer_ptrs[r])
    }

    /// Device address of byte `offset` of rank `r`'s buffer (at most its length), usable by kernels on
    /// this rank's device.
    pub fn peer_ptr_at(&self, r: usize, offset: usize) -> Result<crate::DevPtr> {
        if offset > self.len_bytes() {
            return Err(crate::Error::invalid(format!("peer_ptr_at: byte {offset} of a {}-byte buffer", self.len_bytes())));
        }
        Ok(self.peer_ptr(r).byte_add(offset))
    }

    /// All ranks' base addresses as numbers, indexed by rank (own rank included).
    pub fn peer_addrs(&self) -> &[u64] {
        &self.peer_ptrs
    }

    /// Device address of a `u64[num_ranks]` copy of [`peer_addrs`](Self::peer_addrs).
    pub fn peer_table_ptr(&self) -> crate::DevPtr {
        self.peer_table.device_ptr()
    }

    /// How rank `r`'s buffer is reached (for diagnostics only).
    pub fn peer_access(&self, r: usize) -> PeerAccess {
        self.access[r]
    }

    /// Ranks of this process whose buffers live on this rank's GPU, this rank included (1 unless ranks
    /// share a GPU). Their kernels must fit on the GPU together: each waits for the others'.
    pub fn ranks_on_device(&self) -> usize {
        self.access.iter().filter(|a| matches!(a, PeerAccess::Local | PeerAccess::SameDevice)).count()
    }

    /// The device holding this rank's allocation.
    pub fn device(&self) -> &Device {
        self.local.device()
    }

    /// Copies bytes `[src_offset, src_offset + bytes)` of `src` (device memory of this rank's GPU) into rank
    /// `r`'s buffer at `offset`, in `stream`'s order (a stream of this rank's GPU): a copy-engine copy, which
    /// takes no SM. The bytes of rank `r`'s buffer are the protocol's: the caller writes only where `r`
    /// expects this rank to write, after `r` handed that part back.
    pub fn copy_to_peer_async(
        &self,
        r: usize,
        offset: usize,
        src: &crate::MemRef<'_>,
        src_offset: usize,
        bytes: usize,
        stream: &crate::Stream,
    ) -> Result<()> {
        let ordinal = self.device().ordinal();
        if r >= self.peer_ptrs.len() {
            return Err(Error::invalid(format!("copy_to_peer_async: rank {r} of {}", self.peer_ptrs.len())));
        }
        if src.place() != crate::Place::Device(ordinal) || stream.device().ordinal() != ordinal {
            return Err(Error::invalid(format!(
                "copy_to_peer_async: the source ({:?}) and the stream (GPU {}) must be on this rank's GPU {ordinal}",
                src.place(),
                stream.device().ordinal()
            )));
        }
        let within = |start: usize, len: usize| start.checked_add(bytes).is_some_and(|end| end <= len);
        if !within(offset, self.len_bytes()) || !within(src_offset, src.len()) {
            return Err(Error::invalid(format!(
                "copy_to_peer_async: {bytes} bytes from byte {src_offset} of {} to byte {offset} of {}",
                src.len(),
                self.len_bytes()
            )));
        }
        // SAFETY: the destination lies inside rank r's buffer, mapped here for as long as `self` lives (its drop
        // waits for this rank's streams); the source lies inside lent device memory of this GPU, which its
        // lender keeps valid until the stream work that reads it has completed (`MemRef::from_raw`).
        unsafe { stream.copy_dtod(self.peer_ptrs[r] + offset as u64, src.addr() + src_offset as u64, bytes) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn setup_message_round_trips() {
        let p = PeerInfo { rank: 3, ordinal: 2, process_key: 0xdead_beef_1234, len: 1 << 30, ptr: 0x7f00_1234_0000, handle: Some([7; 64]) };
        let m = p.encode();
        assert_eq!(m.len(), MSG_BYTES);
        let q = PeerInfo::decode(&m).unwrap();
        assert_eq!(
            (q.rank, q.ordinal, q.process_key, q.len, q.ptr, q.handle),
            (3, 2, 0xdead_beef_1234, 1 << 30, 0x7f00_1234_0000, Some([7; 64]))
        );
        let none = PeerInfo { handle: None, ..p };
        assert_eq!(PeerInfo::decode(&none.encode()).unwrap().handle, None);
        assert!(PeerInfo::decode(&m[..100]).is_none());
        let mut wrong = m.clone();
        wrong[0] ^= 1;
        assert!(PeerInfo::decode(&wrong).is_none());
    }
}
