//! TCP rendezvous group: one process per rank, connected in a star through rank 0.
//!
//! # Launch
//!
//! `torchrun --nproc_per_node=4 --no-python moelink selftest --process` starts four processes with
//! `MASTER_ADDR`, `MASTER_PORT`, `RANK`, `WORLD_SIZE` and `LOCAL_RANK` set; [`TcpGroup::from_env`] reads
//! them. torchrun's own agent already listens on `MASTER_PORT` (the TCPStore of its static rendezvous, which
//! `torch.distributed.init_process_group` then joins), so moelink's rank 0 listens on **`MASTER_PORT + 1`**,
//! or on `MOELINK_PORT` when that is set. `MOELINK_GROUP_TIMEOUT_MS` overrides the deadline
//! ([`DEFAULT_GROUP_TIMEOUT_MS`]).
//!
//! # Protocol (version 1; integers little-endian)
//!
//! - Handshake, client → rank 0: magic `MOELINK\0`, version `u32`, rank `u32`, size `u32`.
//!   Rank 0 → client: magic, version `u32`, status `u8` (0 = accepted), the milliseconds left of rank 0's
//!   rendezvous deadline `u64`, and a reason (`u32` length + UTF-8, empty when accepted).
//!   A connection that does not start with the magic is dropped and ignored (a port scanner, a health
//!   check); a moelink peer with another version or size, or a second process claiming the same rank, is
//!   rejected and fails the whole group at once, because a misconfigured launch never heals by waiting.
//! - When every rank has connected, rank 0 sends each client a `Ready` frame; only then does
//!   [`TcpGroup::connect`] return, so a constructed group is a complete one.
//! - Frames: kind `u8`, sequence number `u64` (collectives counted from 1), payload length `u64`, payload.
//!   Clients send their contribution to rank 0, which answers each client with what it must receive.
//!   Every frame carries its collective's kind and number, so ranks calling collectives in different orders
//!   get a protocol error naming both calls instead of garbage.
//! - When rank 0 fails (a peer timed out or closed, a protocol violation) it sends every client an `Abort`
//!   frame with the reason, so that every rank reports the same missing peer.
//!
//! Every blocking read and write has a deadline. After any error the group is broken and refuses further
//! collectives.

use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::{Group, DEFAULT_GROUP_TIMEOUT_MS};
use crate::error::{Error, Phase, Result};

/// First bytes of every handshake.
const MAGIC: [u8; 8] = *b"MOELINK\0";
/// Wire protocol version; peers must match exactly.
pub const PROTOCOL_VERSION: u32 = 1;
/// Refuse frames larger than this: a corrupted length must not look like a 2^60-byte message.
const MAX_FRAME_BYTES: u64 = 1 << 36;
/// Longest reason string accepted in a handshake reply or abort frame.
const MAX_REASON_BYTES: u32 = 64 * 1024;
/// How long rank 0 waits for the handshake of one accepted connection before dropping it, so that a silent
/// stray connection cannot stall the rendezvous.
const HANDSHAKE_READ_MS: u64 = 5_000;
/// Payloads are read in chunks of this size, so memory grows only as bytes actually arrive.
const READ_CHUNK: usize = 1 << 20;
/// Frame header: kind (1) + sequence (8) + length (8).
const HEADER_BYTES: usize = 17;

/// Frame kinds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Ready = 1,
    AllGather = 2,
    AllToAll = 3,
    Barrier = 4,
    Abort = 5,
}

impl Kind {
    fn from_u8(v: u8) -> Option<Kind> {
        Some(match v {
            1 => Kind::Ready,
            2 => Kind::AllGather,
            3 => Kind::AllToAll,
            4 => Kind::Barrier,
            5 => Kind::Abort,
            _ => return None,
        })
    }
    fn name(self) -> &'static str {
        match self {
            Kind::Ready => "rendezvous",
            Kind::AllGather => "all_gather",
            Kind::AllToAll => "all_to_all",
            Kind::Barrier => "barrier",
            Kind::Abort => "abort",
        }
    }
}

/// Where to find rank 0 and who this process is, as read from the environment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TcpConfig {
    /// Host name or address of rank 0 (`MASTER_ADDR`).
    pub addr: String,
    /// Port rank 0 listens on: `MOELINK_PORT`, or `MASTER_PORT + 1`.
    pub port: u16,
    /// `RANK`.
    pub rank: usize,
    /// `WORLD_SIZE`.
    pub size: usize,
    /// `LOCAL_RANK` (default: `RANK`).
    pub local_rank: usize,
    /// `MOELINK_GROUP_TIMEOUT_MS`, default [`DEFAULT_GROUP_TIMEOUT_MS`].
    pub timeout: Duration,
}

impl TcpConfig {
    /// Reads torchrun's variables from the process environment.
    pub fn from_env() -> Result<TcpConfig> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// Reads the variables through `get` (the environment, or a map in tests).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<TcpConfig> {
        const HINT: &str = "launch with torchrun, or set MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE";
        fn num<T: std::str::FromStr>(get: &dyn Fn(&str) -> Option<String>, name: &'static str, hint: &str) -> Result<Option<T>> {
            match get(name) {
                None => Ok(None),
                Some(v) => {
                    v.trim().parse::<T>().map(Some).map_err(|_| Error::invalid(name, 0, format!("`{v}` is not a valid value ({hint})")))
                }
            }
        }
        let get: &dyn Fn(&str) -> Option<String> = &get;
        let rank: usize = num(get, "RANK", HINT)?.ok_or_else(|| Error::invalid("RANK", 0, format!("not set ({HINT})")))?;
        let size: usize = num(get, "WORLD_SIZE", HINT)?.ok_or_else(|| Error::invalid("WORLD_SIZE", rank, format!("not set ({HINT})")))?;
        let local_rank: usize = num(get, "LOCAL_RANK", HINT)?.unwrap_or(rank);
        let addr = get("MASTER_ADDR").map(|s| s.trim().to_string()).filter(|s| !s.is_empty());
        let addr = addr.ok_or_else(|| Error::invalid("MASTER_ADDR", rank, format!("not set ({HINT})")))?;
        let port = match num::<u16>(get, "MOELINK_PORT", "a TCP port")? {
            Some(p) => p,
            None => {
                let master: u16 =
                    num(get, "MASTER_PORT", HINT)?.ok_or_else(|| Error::invalid("MASTER_PORT", rank, format!("not set ({HINT})")))?;
                master.checked_add(1).ok_or_else(|| {
                    Error::invalid("MASTER_PORT", rank, "65535 leaves no room for moelink's port (MASTER_PORT + 1); set MOELINK_PORT")
                })?
            }
        };
        let timeout_ms: u64 = num(get, "MOELINK_GROUP_TIMEOUT_MS", "milliseconds")?.unwrap_or(DEFAULT_GROUP_TIMEOUT_MS);
        if timeout_ms == 0 {
            return Err(Error::invalid("MOELINK_GROUP_TIMEOUT_MS", rank, "must be positive"));
        }
        check_rank(rank, size)?;
        Ok(TcpConfig { addr, port, rank, size, local_rank, timeout: Duration::from_millis(timeout_ms) })
    }
}

fn check_rank(rank: usize, size: usize) -> Result<()> {
    if size == 0 || size > u32::MAX as usize {
        return Err(Error::invalid("WORLD_SIZE", rank, format!("{size} is not a usable group size")));
    }
    if rank >= size {
        return Err(Error::invalid("RANK", rank, format!("{rank} is not below WORLD_SIZE = {size}")));
    }
    Ok(())
}

/// Rank 0's view: one stream per client (index = rank; `None` at index 0).
/// A client's view: its stream to rank 0.
enum Links {
    Root(Vec<Option<TcpStream>>),
    Client(TcpStream),
    /// A group of one: nothing to talk to.
    Alone,
}

struct Inner {
    links: Links,
    /// Collectives started so far; frames carry it so desynchronised ranks are caught.
    seq: u64,
    /// Set after any failure: the streams may hold half a frame, so nothing later can be trusted.
    broken: Option<String>,
}

/// A group of processes connected over TCP in a star through rank 0.
///
/// Under torchrun, [`TcpGroup::from_env`] reads `MASTER_ADDR`, `MASTER_PORT`, `RANK`, `WORLD_SIZE` and
/// `LOCAL_RANK`. torchrun's own agent already listens on `MASTER_PORT`, so moelink's rank 0 listens on
/// `MASTER_PORT + 1`, or on `MOELINK_PORT` when set; `MOELINK_GROUP_TIMEOUT_MS` sets the deadline
/// (default [`DEFAULT_GROUP_TIMEOUT_MS`](super::DEFAULT_GROUP_TIMEOUT_MS)). Construction returns once every
/// rank has joined. A handshake (magic, protocol version, rank, size) rejects mismatched sizes, versions and
/// duplicate ranks with an error naming them. Every collective has the deadline: a rank that does not show up
/// becomes [`Error::Timeout`] naming it on every rank (rank 0 tells the others), a closed connection or a
/// protocol violation becomes [`Error::Group`], and the group refuses further use afterwards.
///
/// ```no_run
/// use moelink::{Group, TcpGroup};
/// // Under torchrun: every process calls this; it returns once all WORLD_SIZE ranks have connected.
/// let group = TcpGroup::from_env()?;
/// let all = group.all_gather(&[group.rank() as u8])?;
/// assert_eq!(all.len(), group.size());
/// # Ok::<(), moelink::Error>(())
/// ```
pub struct TcpGroup {
    rank: usize,
    size: usize,
    local_rank: usize,
    timeout: Duration,
    inner: Mutex<Inner>,
}

impl std::fmt::Debug for TcpGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpGroup").field("rank", &self.rank).field("size", &self.size).field("local_rank", &self.local_rank).finish()
    }
}

/// Why a read or write stopped.
enum IoFail {
    /// The deadline passed.
    Timeout,
    /// The peer closed the connection (EOF, reset, broken pipe).
    Closed,
    /// Anything else.
    Other(std::io::Error),
    /// The peer sent something that is not a valid frame.
    Protocol(String),
}

fn classify(e: std::io::Error) -> IoFail {
    match e.kind() {
        ErrorKind::WouldBlock | ErrorKind::TimedOut => IoFail::Timeout,
        ErrorKind::UnexpectedEof
        | ErrorKind::ConnectionReset
        | ErrorKind::ConnectionAborted
        | ErrorKind::BrokenPipe
        | ErrorKind::NotConnected => IoFail::Closed,
        _ => IoFail::Other(e),
    }
}

fn remaining(deadline: Instant) -> Option<Duration> {
    let left = deadline.saturating_duration_since(Instant::now());
    // A zero timeout means "block forever" to the socket API: never pass it.
    (left > Duration::ZERO).then(|| left.max(Duration::from_millis(1)))
}

/// Fills `buf` before `deadline`.
fn read_full(s: &mut TcpStream, buf: &mut [u8], deadline: Instant) -> std::result::Result<(), IoFail> {
    let mut off = 0;
    while off < buf.len() {
        let left = remaining(deadline).ok_or(IoFail::Timeout)?;
        s.set_read_timeout(Some(left)).map_err(IoFail::Other)?;
        match s.read(&mut buf[off..]) {
            Ok(0) => return Err(IoFail::Closed),
            Ok(n) => off += n,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(classify(e)),
        }
    }
    Ok(())
}

fn write_full(s: &mut TcpStream, buf: &[u8], deadline: Instant) -> std::result::Result<(), IoFail> {
    let mut off = 0;
    while off < buf.len() {
        let left = remaining(deadline).ok_or(IoFail::Timeout)?;
        s.set_write_timeout(Some(left)).map_err(IoFail::Other)?;
        match s.write(&buf[off..]) {
            Ok(0) => return Err(IoFail::Closed),
            Ok(n) => off += n,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(classify(e)),
        }
    }
    Ok(())
}

struct Frame {
    kind: Kind,
    seq: u64,
    payload: Vec<u8>,
}

fn write_frame(s: &mut TcpStream, kind: Kind, seq: u64, payload: &[u8], deadline: Instant) -> std::result::Result<(), IoFail> {
    let mut head = [0u8; HEADER_BYTES];
    head[0] = kind as u8;
    head[1..9].copy_from_slice(&seq.to_le_bytes());
    head[9..17].copy_from_slice(&(payload.len() as u64).to_le_bytes());
    write_full(s, &head, deadline)?;
    write_full(s, payload, deadline)
}

fn read_frame(s: &mut TcpStream, deadline: Instant) -> std::result::Result<Frame, IoFail> {
    let mut head = [0u8; HEADER_BYTES];
    read_full(s, &mut head, deadline)?;
    let kind = Kind::from_u8(head[0]).ok_or_else(|| IoFail::Protocol(format!("unknown frame kind {}", head[0])))?;
    let seq = u64::from_le_bytes(le8(&head[1..9]));
    let len = u64::from_le_bytes(le8(&head[9..17]));
    if len > MAX_FRAME_BYTES {
        return Err(IoFail::Protocol(format!("frame of {len} bytes exceeds the {MAX_FRAME_BYTES}-byte limit")));
    }
    let len = usize::try_from(len).map_err(|_| IoFail::Protocol(format!("frame of {len} bytes does not fit in memory")))?;
    // Grow as the bytes arrive: a bogus length then costs a timeout, not an allocation failure.
    let mut payload = Vec::new();
    while payload.len() < len {
        let start = payload.len();
        payload.resize(start + (len - start).min(READ_CHUNK), 0);
        read_full(s, &mut payload[start..], deadline)?;
    }
    Ok(Frame { kind, seq, payload })
}

fn le8(b: &[u8]) -> [u8; 8] {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    a
}

fn le4(b: &[u8]) -> [u8; 4] {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[..4]);
    a
}

/// `n` messages as `(u64 length, bytes)*`.
fn pack(msgs: &[Vec<u8>]) -> Vec<u8> {
    let mut out = Vec::with_capacity(msgs.iter().map(|m| m.len() + 8).sum());
    for m in msgs {
        out.extend_from_slice(&(m.len() as u64).to_le_bytes());
        out.extend_from_slice(m);
    }
    out
}

/// Inverse of [`pack`]; `None` unless `p` holds exactly `n` well-formed messages.
fn unpack(p: &[u8], n: usize) -> Option<Vec<Vec<u8>>> {
    let mut out = Vec::with_capacity(n);
    let mut off = 0usize;
    for _ in 0..n {
        let len = usize::try_from(u64::from_le_bytes(p.get(off..off.checked_add(8)?)?.try_into().ok()?)).ok()?;
        off += 8;
        out.push(p.get(off..off.checked_add(len)?)?.to_vec());
        off += len;
    }
    (off == p.len()).then_some(out)
}

/// Why rank 0 aborted: encoded in an `Abort` frame.
enum AbortReason {
    Timeout { peer: usize, waited_ms: u64 },
    Other(String),
}

impl AbortReason {
    fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        match self {
            AbortReason::Timeout { peer, waited_ms } => {
                out.push(1);
                out.extend_from_slice(&(*peer as u64).to_le_bytes());
                out.extend_from_slice(&waited_ms.to_le_bytes());
            }
            AbortReason::Other(msg) => {
                out.push(0);
                out.extend_from_slice(&0u64.to_le_bytes());
                out.extend_from_slice(&0u64.to_le_bytes());
                let cut = msg.len().min(MAX_REASON_BYTES as usize);
                out.extend_from_slice(&msg.as_bytes()[..cut]);
            }
        }
        out
    }

    /// The error a client reports for rank 0's abort.
    fn into_client_error(p: &[u8], me: usize) -> Error {
        if p.len() < 17 {
            return Error::Group { rank: me, reason: "rank 0 aborted the group (malformed abort frame)".into() };
        }
        let peer = u64::from_le_bytes(le8(&p[1..9]));
        let waited_ms = u64::from_le_bytes(le8(&p[9..17]));
        match p[0] {
            1 if peer == me as u64 => {
                Error::Group { rank: me, reason: format!("rank 0 gave up waiting for this rank after {waited_ms} ms") }
            }
            1 => Error::Timeout { rank: me, peer: usize::try_from(peer).unwrap_or(usize::MAX), phase: Phase::Group, waited_ms },
            _ => Error::Group { rank: me, reason: format!("rank 0 aborted the group: {}", String::from_utf8_lossy(&p[17..])) },
        }
    }
}

/// Extra time a client waits for rank 0's answer beyond its own deadline, so that when rank 0 gives up on
/// a missing rank, its abort (naming that rank) reaches the clients before they give up on rank 0.
fn client_grace(timeout: Duration) -> Duration {
    timeout.min(Duration::from_secs(1))
}

fn ms(d: Duration) -> u64 {
    d.as_millis().try_into().unwrap_or(u64::MAX)
}

/// The address rank 0 listens on for rendezvous address `ip`: loopback stays loopback (tests, one host);
/// anything else listens on every interface of that family, as torch's TCPStore does, because the name
/// other hosts use may map to an interface this host cannot bind by that name.
fn bind_ip(ip: IpAddr) -> IpAddr {
    match ip {
        ip if ip.is_loopback() => ip,
        IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
    }
}

fn resolve(addr: &str, port: u16) -> std::io::Result<Vec<SocketAddr>> {
    Ok((addr, port).to_socket_addrs()?.collect())
}

impl TcpGroup {
    /// Connects using torchrun's `MASTER_ADDR`, `MASTER_PORT` (+1, or `MOELINK_PORT`), `RANK`,
    /// `WORLD_SIZE`, `LOCAL_RANK` and the optional `MOELINK_GROUP_TIMEOUT_MS`. Returns when every rank has
    /// joined.
    pub fn from_env() -> Result<TcpGroup> {
        let c = TcpConfig::from_env()?;
        Self::connect(&c.addr, c.port, c.rank, c.size, c.local_rank, c.timeout)
    }

    /// Joins the group whose rank 0 listens on `addr:port`. Rank 0 binds that port (on every interface
    /// unless `addr` is a loopback address) and waits for the others; the others connect, retrying until
    /// `timeout`. `timeout` is also the deadline of every later collective.
    pub fn connect(addr: &str, port: u16, rank: usize, size: usize, local_rank: usize, timeout: Duration) -> Result<TcpGroup> {
        check_rank(rank, size)?;
        if timeout.is_zero() {
            return Err(Error::invalid("timeout", rank, "must be positive"));
        }
        if size == 1 {
            return Ok(Self::alone(local_rank, timeout));
        }
        if rank == 0 {
            let ips = resolve(addr, port).map_err(|e| Error::Group { rank, reason: format!("cannot resolve `{addr}`: {e}") })?;
            let ip = ips.first().map(|a| a.ip()).ok_or_else(|| Error::Group { rank, reason: format!("`{addr}` resolves to nothing") })?;
            let bind = SocketAddr::new(bind_ip(ip), port);
            let listener = TcpListener::bind(bind).map_err(|e| Error::Group {
                rank,
                reason: format!("rank 0 cannot listen on {bind}: {e} (moelink uses MASTER_PORT + 1; set MOELINK_PORT to a free port)"),
            })?;
            return Self::serve(listener, size, local_rank, timeout);
        }
        Self::join(addr, port, rank, size, local_rank, timeout)
    }

    /// Rank 0 of a `size`-rank group, accepting the others on an already bound `listener` (tests bind port 0
    /// and hand the chosen port to the other ranks).
    pub fn serve(listener: TcpListener, size: usize, local_rank: usize, timeout: Duration) -> Result<TcpGroup> {
        check_rank(0, size)?;
        if timeout.is_zero() {
            return Err(Error::invalid("timeout", 0, "must be positive"));
        }
        if size == 1 {
            return Ok(Self::alone(local_rank, timeout));
        }
        let start = Instant::now();
        let deadline = start + timeout;
        let mut peers: Vec<Option<TcpStream>> = (0..size).map(|_| None).collect();
        let group_err = |reason: String| Error::Group { rank: 0, reason };
        listener.set_nonblocking(true).map_err(|e| group_err(format!("cannot poll the listening socket: {e}")))?;
        while let Some(missing) = (1..size).find(|&r| peers[r].is_none()) {
            match listener.accept() {
                Ok((stream, from)) => match Self::admit(stream, &peers, size, deadline) {
                    Admit::Accepted(r, s) => peers[r] = Some(s),
                    // Not a moelink peer: ignore it and keep waiting for the real ones.
                    Admit::Stray => {}
                    Admit::Fatal(reason) => {
                        let reason = format!("{reason} (connection from {from})");
                        abort_all(&mut peers, &AbortReason::Other(reason.clone()));
                        return Err(group_err(reason));
                    }
                },
                Err(e) if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted => {
                    if Instant::now() >= deadline {
                        let waited_ms = ms(start.elapsed());
                        abort_all(&mut peers, &AbortReason::Timeout { peer: missing, waited_ms });
                        return Err(Error::Timeout { rank: 0, peer: missing, phase: Phase::Group, waited_ms });
                    }
                    // Polling keeps the deadline exact without a thread per connection; 2 ms is noise
                    // next to process start-up.
                    std::thread::sleep(Duration::from_millis(2));
                }
                // A connection that died between SYN and accept: not ours to worry about.
                Err(e) if matches!(e.kind(), ErrorKind::ConnectionAborted | ErrorKind::ConnectionReset) => {}
                Err(e) => {
                    let reason = format!("accept failed: {e}");
                    abort_all(&mut peers, &AbortReason::Other(reason.clone()));
                    return Err(group_err(reason));
                }
            }
        }
        for r in 1..size {
            let sent = match peers[r].as_mut() {
                Some(s) => write_frame(s, Kind::Ready, 0, &[], deadline.max(Instant::now() + Duration::from_millis(100))),
                None => Ok(()),
            };
            if let Err(f) = sent {
                let e = io_error(0, r, f, Kind::Ready, 0, start);
                abort_all(&mut peers, &AbortReason::Other(e.to_string()));
                return Err(e);
            }
        }
        Ok(TcpGroup { rank: 0, size, local_rank, timeout, inner: Mutex::new(Inner { links: Links::Root(peers), seq: 0, broken: None }) })
    }

    /// Reads and checks one connection's handshake (rank 0).
    fn admit(mut s: TcpStream, peers: &[Option<TcpStream>], size: usize, deadline: Instant) -> Admit {
        // Accepted sockets inherit non-blocking mode on some platforms.
        if s.set_nonblocking(false).is_err() {
            return Admit::Stray;
        }
        let _ = s.set_nodelay(true);
        let hs_deadline =
            deadline.min(Instant::now() + Duration::from_millis(HANDSHAKE_READ_MS)).max(Instant::now() + Duration::from_millis(50));
        let mut hello = [0u8; 20];
        if read_full(&mut s, &mut hello, hs_deadline).is_err() || hello[..8] != MAGIC {
            return Admit::Stray;
        }
        let version = u32::from_le_bytes(le4(&hello[8..12]));
        let rank = u32::from_le_bytes(le4(&hello[12..16])) as usize;
        let their_size = u32::from_le_bytes(le4(&hello[16..20])) as usize;
        let problem = if version != PROTOCOL_VERSION {
            Some(format!("rank {rank} speaks moelink group protocol {version}, rank 0 speaks {PROTOCOL_VERSION} (mixed moelink builds?)"))
        } else if their_size != size {
            Some(format!("rank {rank} was started with WORLD_SIZE = {their_size}, rank 0 with WORLD_SIZE = {size}"))
        } else if rank == 0 || rank >= size {
            Some(format!("a process claims rank {rank}, which is not a client rank of this {size}-rank group"))
        } else if peers[rank].is_some() {
            Some(format!("two processes claim rank {rank} (check RANK of every process)"))
        } else {
            None
        };
        let left_ms = ms(deadline.saturating_duration_since(Instant::now()));
        let reply_deadline = Instant::now() + Duration::from_millis(HANDSHAKE_READ_MS);
        let reply = handshake_reply(problem.as_deref(), left_ms);
        match problem {
            Some(reason) => {
                let _ = write_full(&mut s, &reply, reply_deadline);
                Admit::Fatal(reason)
            }
            None => match write_full(&mut s, &reply, reply_deadline) {
                Ok(()) => Admit::Accepted(rank, s),
                // It hung up before hearing back: let it reconnect (clients retry until their deadline).
                Err(_) => Admit::Stray,
            },
        }
    }

    /// A client's side of the rendezvous.
    fn join(addr: &str, port: u16, rank: usize, size: usize, local_rank: usize, timeout: Duration) -> Result<TcpGroup> {
        let start = Instant::now();
        let deadline = start + timeout;
        let group_err = |reason: String| Error::Group { rank, reason };
        let timed_out = || Error::Timeout { rank, peer: 0, phase: Phase::Group, waited_ms: ms(start.elapsed()) };
        // Rank 0 may start later than us (or its host name may not resolve yet): retry until the deadline.
        let mut stream = loop {
            let attempt = resolve(addr, port).and_then(|addrs| {
                let mut last = std::io::Error::new(ErrorKind::NotFound, format!("`{addr}` resolves to nothing"));
                for a in addrs {
                    let Some(left) = remaining(deadline) else { break };
                    match TcpStream::connect_timeout(&a, left.min(Duration::from_secs(2))) {
                        Ok(s) => return Ok(s),
                        Err(e) => last = e,
                    }
                }
                Err(last)
            });
            match attempt {
                Ok(s) => break s,
                Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
                Err(_) => return Err(timed_out()),
            }
        };
        let _ = stream.set_nodelay(true);
        let mut hello = Vec::with_capacity(20);
        hello.extend_from_slice(&MAGIC);
        hello.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
        hello.extend_from_slice(&(rank as u32).to_le_bytes());
        hello.extend_from_slice(&(size as u32).to_le_bytes());
        let io = |f: IoFail| io_error(rank, 0, f, Kind::Ready, 0, start);
        write_full(&mut stream, &hello, deadline).map_err(io)?;
        let mut head = [0u8; 25];
        read_full(&mut stream, &mut head, deadline).map_err(|f| match f {
            IoFail::Closed => group_err(format!("{addr}:{port} closed the connection during the handshake (not a moelink rank 0?)")),
            f => io(f),
        })?;
        if head[..8] != MAGIC {
            return Err(group_err(format!(
                "{addr}:{port} is not a moelink rank 0 (bad handshake reply); is another program using the port? set MOELINK_PORT"
            )));
        }
        let status = head[12];
        let root_left = Duration::from_millis(u64::from_le_bytes(le8(&head[13..21])));
        let reason_len = u32::from_le_bytes(le4(&head[21..25]));
        if reason_len > MAX_REASON_BYTES {
            return Err(group_err(format!("rank 0 sent a {reason_len}-byte handshake reason (protocol error)")));
        }
        let mut reason = vec![0u8; reason_len as usize];
        read_full(&mut stream, &mut reason, deadline).map_err(io)?;
        if status != 0 {
            return Err(group_err(format!("rank 0 rejected this rank: {}", String::from_utf8_lossy(&reason))));
        }
        // Wait for everybody else as long as rank 0 does (it told us its deadline), plus a grace period so
        // that its verdict, naming the missing rank, arrives before we give up on it.
        let ready_deadline = Instant::now() + root_left + client_grace(timeout);
        let frame = read_frame(&mut stream, ready_deadline).map_err(io)?;
        match frame.kind {
            Kind::Ready => {}
            Kind::Abort => return Err(AbortReason::into_client_error(&frame.payload, rank)),
            k => return Err(group_err(format!("rank 0 sent {} during the rendezvous (protocol error)", k.name()))),
        }
        Ok(TcpGroup { rank, size, local_rank, timeout, inner: Mutex::new(Inner { links: Links::Client(stream), seq: 0, broken: None }) })
    }

    fn alone(local_rank: usize, timeout: Duration) -> TcpGroup {
        TcpGroup { rank: 0, size: 1, local_rank, timeout, inner: Mutex::new(Inner { links: Links::Alone, seq: 0, broken: None }) }
    }

    /// Deadline of every collective.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// One collective. `up` is this rank's contribution (already packed); rank 0 turns the contributions
    /// into each rank's answer with `route(contributions) -> answers`, both indexed by rank.
    /// `timeout` is the deadline of this collective (the group's own, or a caller's through the `_within`
    /// methods).
    fn collective(
        &self,
        kind: Kind,
        up: Vec<u8>,
        timeout: Duration,
        route: impl FnOnce(Vec<Vec<u8>>) -> Result<Vec<Vec<u8>>>,
    ) -> Result<Vec<u8>> {
        let me = self.rank;
        let mut inner =
            self.inner.lock().map_err(|_| Error::Group { rank: me, reason: "group state poisoned by a panicking thread".into() })?;
        if let Some(why) = &inner.broken {
            return Err(Error::Group { rank: me, reason: format!("group is broken after an earlier error: {why}") });
        }
        inner.seq += 1;
        let seq = inner.seq;
        let start = Instant::now();
        let deadline = start + timeout;
        let result = match &mut inner.links {
            Links::Alone => route(vec![up]).map(|mut v| v.pop().unwrap_or_default()),
            Links::Client(s) => Self::client_round(s, me, kind, seq, &up, start, deadline + client_grace(timeout)),
            Links::Root(peers) => Self::root_round(peers, self.size, kind, seq, up, route, start, deadline),
        };
        if let Err(e) = &result {
            inner.broken = Some(e.to_string());
        }
        result
    }

    fn client_round(s: &mut TcpStream, me: usize, kind: Kind, seq: u64, up: &[u8], start: Instant, deadline: Instant) -> Result<Vec<u8>> {
        let io = |f: IoFail| io_error(me, 0, f, kind, seq, start);
        // Rank 0 never speaks first except to abort: if it already did (it gave up on us while we were
        // busy), report its reason rather than whatever writing into a closed socket would say.
        if let Some(e) = pending_abort(s, me) {
            return Err(e);
        }
        write_frame(s, kind, seq, up, deadline).map_err(io)?;
        let f = read_frame(s, deadline).map_err(io)?;
        if f.kind == Kind::Abort {
            return Err(AbortReason::into_client_error(&f.payload, me));
        }
        if f.kind != kind || f.seq != seq {
            return Err(desync(me, 0, kind, seq, f.kind, f.seq));
        }
        Ok(f.payload)
    }

    #[allow(clippy::too_many_arguments)]
    fn root_round(
        peers: &mut [Option<TcpStream>],
        size: usize,
        kind: Kind,
        seq: u64,
        up: Vec<u8>,
        route: impl FnOnce(Vec<Vec<u8>>) -> Result<Vec<Vec<u8>>>,
        start: Instant,
        deadline: Instant,
    ) -> Result<Vec<u8>> {
        let outcome = (|| {
            let mut contributions = Vec::with_capacity(size);
            contributions.push(up);
            // Sequential reads are fine: clients only write then read, and each has its own socket buffer.
            for (r, peer) in peers.iter_mut().enumerate().skip(1) {
                let s = peer.as_mut().ok_or_else(|| Error::Group { rank: 0, reason: format!("no connection to rank {r}") })?;
                let f = read_frame(s, deadline).map_err(|f| io_error(0, r, f, kind, seq, start))?;
                if f.kind != kind || f.seq != seq {
                    return Err(desync(0, r, kind, seq, f.kind, f.seq));
                }
                contributions.push(f.payload);
            }
            let mut answers = route(contributions)?;
            if answers.len() != size {
                return Err(Error::Group { rank: 0, reason: format!("internal: {} answers for {size} ranks", answers.len()) });
            }
            for (r, peer) in peers.iter_mut().enumerate().skip(1) {
                let s = peer.as_mut().ok_or_else(|| Error::Group { rank: 0, reason: format!("no connection to rank {r}") })?;
                write_frame(s, kind, seq, &answers[r], deadline).map_err(|f| io_error(0, r, f, kind, seq, start))?;
            }
            Ok(std::mem::take(&mut answers[0]))
        })();
        if let Err(e) = &outcome {
            let reason = match e {
                Error::Timeout { peer, waited_ms, .. } => AbortReason::Timeout { peer: *peer, waited_ms: *waited_ms },
                other => AbortReason::Other(other.to_string()),
            };
            abort_all(peers, &reason);
        }
        outcome
    }
}

enum Admit {
    Accepted(usize, TcpStream),
    Stray,
    Fatal(String),
}

fn handshake_reply(problem: Option<&str>, left_ms: u64) -> Vec<u8> {
    let reason = problem.unwrap_or("").as_bytes();
    let reason = &reason[..reason.len().min(MAX_REASON_BYTES as usize)];
    let mut out = Vec::with_capacity(25 + reason.len());
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    out.push(problem.is_some() as u8);
    out.extend_from_slice(&left_ms.to_le_bytes());
    out.extend_from_slice(&(reason.len() as u32).to_le_bytes());
    out.extend_from_slice(reason);
    out
}

/// An abort (or hang-up) from rank 0 that is already waiting in a client's socket.
fn pending_abort(s: &mut TcpStream, me: usize) -> Option<Error> {
    let mut probe = [0u8; 1];
    s.set_nonblocking(true).ok()?;
    let peeked = s.peek(&mut probe);
    s.set_nonblocking(false).ok()?;
    match peeked {
        Ok(0) => Some(Error::Group { rank: me, reason: "rank 0 closed its connection (did the process exit or crash?)".into() }),
        Ok(_) => match read_frame(s, Instant::now() + Duration::from_millis(500)) {
            Ok(f) if f.kind == Kind::Abort => Some(AbortReason::into_client_error(&f.payload, me)),
            Ok(f) => Some(Error::Group { rank: me, reason: format!("rank 0 sent an unexpected {} frame (protocol error)", f.kind.name()) }),
            Err(_) => Some(Error::Group { rank: me, reason: "rank 0 sent a truncated frame (protocol error)".into() }),
        },
        Err(_) => None,
    }
}

/// Best effort: tell every connected client why the group is over, then hang up.
fn abort_all(peers: &mut [Option<TcpStream>], reason: &AbortReason) {
    let payload = reason.encode();
    let deadline = Instant::now() + Duration::from_millis(200);
    for s in peers.iter_mut().flatten() {
        let _ = write_frame(s, Kind::Abort, 0, &payload, deadline);
        let _ = s.shutdown(std::net::Shutdown::Write);
    }
}

fn io_error(me: usize, peer: usize, f: IoFail, kind: Kind, seq: u64, start: Instant) -> Error {
    let what = if seq == 0 { kind.name().to_string() } else { format!("{} #{seq}", kind.name()) };
    match f {
        IoFail::Timeout => Error::Timeout { rank: me, peer, phase: Phase::Group, waited_ms: ms(start.elapsed()) },
        IoFail::Closed => {
            Error::Group { rank: me, reason: format!("rank {peer} closed its connection during {what} (did the process exit or crash?)") }
        }
        IoFail::Other(e) => Error::Group { rank: me, reason: format!("socket error talking to rank {peer} during {what}: {e}") },
        IoFail::Protocol(p) => Error::Group { rank: me, reason: format!("protocol error from rank {peer} during {what}: {p}") },
    }
}

fn desync(me: usize, peer: usize, kind: Kind, seq: u64, got: Kind, got_seq: u64) -> Error {
    Error::Group {
        rank: me,
        reason: format!(
            "rank {peer} is in {} #{got_seq} while rank {me} is in {} #{seq}: every rank must call the same collectives in the same order",
            got.name(),
            kind.name()
        ),
    }
}

impl Group for TcpGroup {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }
    fn local_rank(&self) -> usize {
        self.local_rank
    }
    fn all_gather(&self, bytes: &[u8]) -> Result<Vec<Vec<u8>>> {
        self.all_gather_within(bytes, self.timeout)
    }
    fn all_to_all(&self, send: Vec<Vec<u8>>) -> Result<Vec<Vec<u8>>> {
        self.all_to_all_within(send, self.timeout)
    }
    fn all_gather_within(&self, bytes: &[u8], timeout: Duration) -> Result<Vec<Vec<u8>>> {
        let n = self.size;
        let down = self.collective(Kind::AllGather, bytes.to_vec(), timeout, |all| {
            let packed = pack(&all);
            Ok(vec![packed; n])
        })?;
        unpack(&down, n).ok_or_else(|| Error::Group { rank: self.rank, reason: "malformed all_gather answer from rank 0".into() })
    }
    fn all_to_all_within(&self, send: Vec<Vec<u8>>, timeout: Duration) -> Result<Vec<Vec<u8>>> {
        let n = self.size;
        if send.len() != n {
            return Err(Error::invalid("send", self.rank, format!("{} messages for {n} ranks", send.len())));
        }
        let down = self.collective(Kind::AllToAll, pack(&send), timeout, |ups| {
            // ups[src] = src's n messages; answer[dst] = the messages addressed to dst, by source.
            let mut by_src = Vec::with_capacity(n);
            for (src, up) in ups.iter().enumerate() {
                by_src.push(
                    unpack(up, n)
                        .ok_or_else(|| Error::Group { rank: 0, reason: format!("rank {src} sent a malformed all_to_all contribution") })?,
                );
            }
            Ok((0..n).map(|dst| pack(&by_src.iter_mut().map(|m| std::mem::take(&mut m[dst])).collect::<Vec<_>>())).collect())
        })?;
        unpack(&down, n).ok_or_else(|| Error::Group { rank: self.rank, reason: "malformed all_to_all answer from rank 0".into() })
    }
    fn barrier(&self) -> Result<()> {
        let n = self.size;
        self.collective(Kind::Barrier, Vec::new(), self.timeout, |_| Ok(vec![Vec::new(); n])).map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    const T: Duration = Duration::from_millis(500);

    fn listener() -> (TcpListener, u16) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        (l, port)
    }

    /// Runs rank 0 on `serve` and ranks 1.. on `connect`, each in a thread, with `f` after the rendezvous.
    fn run<R: Send>(size: usize, timeout: Duration, f: impl Fn(TcpGroup) -> Result<R> + Sync) -> Vec<Result<R>> {
        let (l, port) = listener();
        let f = &f;
        std::thread::scope(|s| {
            let mut hs = vec![s.spawn(move || TcpGroup::serve(l, size, 0, timeout).and_then(f))];
            for r in 1..size {
                hs.push(s.spawn(move || TcpGroup::connect("127.0.0.1", port, r, size, r, timeout).and_then(f)));
            }
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn collectives_deliver_by_rank() {
        let out = run(4, Duration::from_secs(10), |g| {
            let me = g.rank();
            assert_eq!(g.local_rank(), me);
            let gathered = g.all_gather(&[me as u8; 3])?;
            let sent: Vec<Vec<u8>> = (0..4).map(|dst| vec![(10 * me + dst) as u8; dst]).collect();
            let recv = g.all_to_all(sent)?;
            g.barrier()?;
            // Empty and large messages, many rounds back to back.
            let big: Vec<u8> = (0..3_000_000u32).map(|i| (i as usize * 31 + me) as u8).collect();
            let big_all = g.all_gather(&big)?;
            let mut sums = Vec::new();
            for round in 0..100u32 {
                let all = g.all_gather(&(round * 7 + me as u32).to_le_bytes())?;
                sums.push(all.iter().map(|b| u32::from_le_bytes(b[..4].try_into().unwrap())).sum::<u32>());
            }
            let empty = g.all_gather(&[])?;
            Ok((gathered, recv, big_all, sums, empty))
        });
        for (rank, r) in out.into_iter().enumerate() {
            let (gathered, recv, big_all, sums, empty) = r.unwrap();
            assert_eq!(gathered, (0..4u8).map(|s| vec![s; 3]).collect::<Vec<_>>());
            assert_eq!(recv, (0..4).map(|src| vec![(10 * src + rank) as u8; rank]).collect::<Vec<_>>());
            for (src, b) in big_all.iter().enumerate() {
                assert_eq!(b.len(), 3_000_000);
                assert!(b.iter().enumerate().all(|(i, &v)| v == (i * 31 + src) as u8));
            }
            for (round, s) in sums.iter().enumerate() {
                assert_eq!(*s, 4 * 7 * round as u32 + 6);
            }
            assert_eq!(empty, vec![Vec::<u8>::new(); 4]);
        }
    }

    #[test]
    fn a_group_of_one_needs_no_network() {
        let g = TcpGroup::connect("no-such-host.invalid", 1, 0, 1, 0, T).unwrap();
        assert_eq!(g.all_gather(b"x").unwrap(), vec![b"x".to_vec()]);
        assert_eq!(g.all_to_all(vec![b"y".to_vec()]).unwrap(), vec![b"y".to_vec()]);
        g.barrier().unwrap();
    }

    #[test]
    fn a_rank_that_never_connects_is_a_timeout_naming_it() {
        let (l, port) = listener();
        let out: Vec<Result<TcpGroup>> = std::thread::scope(|s| {
            let mut hs = vec![s.spawn(move || TcpGroup::serve(l, 4, 0, T))];
            for r in 1..3 {
                hs.push(s.spawn(move || TcpGroup::connect("127.0.0.1", port, r, 4, r, T)));
            }
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (r, res) in out.iter().enumerate() {
            match res {
                Err(Error::Timeout { rank, peer: 3, phase: Phase::Group, .. }) => assert_eq!(*rank, r),
                other => panic!("rank {r}: expected a timeout naming rank 3, got {other:?}"),
            }
        }
    }

    #[test]
    fn a_rank_missing_from_a_collective_is_a_timeout_naming_it() {
        let out = run(4, T, |g| {
            if g.rank() == 3 {
                // Stay connected but skip the barrier until the others gave up, then try it late.
                std::thread::sleep(T * 3);
                return g.barrier().map(|_| ());
            }
            g.barrier()
        });
        for (r, res) in out[..3].iter().enumerate() {
            assert!(matches!(res, Err(Error::Timeout { peer: 3, .. })), "rank {r}: {res:?}");
        }
        // The late rank hears that it was given up on.
        match &out[3] {
            Err(Error::Group { reason, .. }) => assert!(reason.contains("gave up waiting for this rank"), "{reason}"),
            other => panic!("rank 3: {other:?}"),
        }
    }

    #[test]
    fn no_rank_zero_is_a_timeout_naming_rank_zero() {
        let (l, port) = listener();
        drop(l); // nobody listens there any more
        let t0 = Instant::now();
        let r = TcpGroup::connect("127.0.0.1", port, 1, 2, 1, T);
        assert!(matches!(r, Err(Error::Timeout { rank: 1, peer: 0, .. })), "{r:?}");
        assert!(t0.elapsed() < T * 3);
    }

    #[test]
    fn a_world_size_mismatch_fails_both_sides_clearly() {
        let (l, port) = listener();
        let (root, client) = std::thread::scope(|s| {
            let root = s.spawn(move || TcpGroup::serve(l, 3, 0, Duration::from_secs(5)));
            let client = s.spawn(move || TcpGroup::connect("127.0.0.1", port, 1, 2, 1, Duration::from_secs(5)));
            (root.join().unwrap(), client.join().unwrap())
        });
        match root {
            Err(Error::Group { rank: 0, reason }) => {
                assert!(reason.contains("WORLD_SIZE = 2") && reason.contains("WORLD_SIZE = 3"), "{reason}")
            }
            other => panic!("{other:?}"),
        }
        match client {
            Err(Error::Group { rank: 1, reason }) => assert!(reason.contains("rejected") && reason.contains("WORLD_SIZE"), "{reason}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_duplicate_rank_fails_the_group() {
        let (l, port) = listener();
        let out: Vec<Result<TcpGroup>> = std::thread::scope(|s| {
            let mut hs = vec![s.spawn(move || TcpGroup::serve(l, 3, 0, Duration::from_secs(5)))];
            for _ in 0..2 {
                hs.push(s.spawn(move || TcpGroup::connect("127.0.0.1", port, 1, 3, 1, Duration::from_secs(5))));
            }
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        match &out[0] {
            Err(Error::Group { reason, .. }) => assert!(reason.contains("two processes claim rank 1"), "{reason}"),
            other => panic!("{other:?}"),
        }
        // One of the two was accepted and then told about the abort, the other was rejected.
        for r in &out[1..] {
            match r {
                Err(Error::Group { reason, .. }) => assert!(reason.contains("two processes claim rank 1"), "{reason}"),
                other => panic!("{other:?}"),
            }
        }
    }

    #[test]
    fn stray_connections_are_ignored() {
        let (l, port) = listener();
        let out: Vec<Result<usize>> = std::thread::scope(|s| {
            let root = s.spawn(move || TcpGroup::serve(l, 2, 0, Duration::from_secs(5)).and_then(|g| g.all_gather(b"a").map(|v| v.len())));
            // Something that is not moelink connects first and talks HTTP, another connects and hangs up.
            let mut junk = TcpStream::connect(("127.0.0.1", port)).unwrap();
            junk.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
            drop(TcpStream::connect(("127.0.0.1", port)).unwrap());
            let client = s.spawn(move || {
                TcpGroup::connect("127.0.0.1", port, 1, 2, 1, Duration::from_secs(5)).and_then(|g| g.all_gather(b"b").map(|v| v.len()))
            });
            vec![root.join().unwrap(), client.join().unwrap()]
        });
        assert!(out.iter().all(|r| matches!(r, Ok(2))), "{out:?}");
    }

    #[test]
    fn a_server_that_is_not_moelink_is_reported() {
        let (l, port) = listener();
        let server = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let mut buf = [0u8; 20];
            s.read_exact(&mut buf).unwrap();
            s.write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n").unwrap();
        });
        let r = TcpGroup::connect("127.0.0.1", port, 1, 2, 1, Duration::from_secs(5));
        server.join().unwrap();
        match r {
            Err(Error::Group { reason, .. }) => assert!(reason.contains("not a moelink rank 0"), "{reason}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn garbage_frames_are_protocol_errors_not_panics() {
        let (l, port) = listener();
        std::thread::scope(|s| {
            let root = s.spawn(move || {
                let g = TcpGroup::serve(l, 2, 0, Duration::from_secs(5))?;
                g.barrier()
            });
            // A hand-made client: valid handshake, then a frame claiming an absurd length.
            let mut c = TcpStream::connect(("127.0.0.1", port)).unwrap();
            let mut hello = MAGIC.to_vec();
            hello.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
            hello.extend_from_slice(&1u32.to_le_bytes());
            hello.extend_from_slice(&2u32.to_le_bytes());
            c.write_all(&hello).unwrap();
            let mut reply = [0u8; 25];
            c.read_exact(&mut reply).unwrap();
            let mut ready = [0u8; HEADER_BYTES];
            c.read_exact(&mut ready).unwrap();
            let mut bad = vec![Kind::Barrier as u8];
            bad.extend_from_slice(&1u64.to_le_bytes());
            bad.extend_from_slice(&u64::MAX.to_le_bytes());
            c.write_all(&bad).unwrap();
            match root.join().unwrap() {
                Err(Error::Group { reason, .. }) => assert!(reason.contains("protocol error from rank 1"), "{reason}"),
                other => panic!("{other:?}"),
            }
        });
    }

    /// A rank that has met the others (its frame's header is in) and stalls halfway through its bytes, as
    /// under SIGSTOP: rank 0's read of the rest has the deadline, and every other rank hears whom it was.
    #[test]
    fn a_rank_stalled_halfway_through_its_frame_is_a_timeout_naming_it() {
        let (l, port) = listener();
        std::thread::scope(|s| {
            let t0 = Instant::now();
            let root = s.spawn(move || TcpGroup::serve(l, 3, 0, T).and_then(|g| g.all_gather(&[0; 100])));
            let other = s.spawn(move || TcpGroup::connect("127.0.0.1", port, 2, 3, 2, T).and_then(|g| g.all_gather(&[2; 100])));
            // Rank 1 by hand: a valid handshake, then an all_gather frame of 100 bytes of which 10 arrive.
            let mut c = TcpStream::connect(("127.0.0.1", port)).unwrap();
            let mut hello = MAGIC.to_vec();
            hello.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
            hello.extend_from_slice(&1u32.to_le_bytes());
            hello.extend_from_slice(&3u32.to_le_bytes());
            c.write_all(&hello).unwrap();
            let mut reply = [0u8; 25];
            c.read_exact(&mut reply).unwrap();
            let mut ready = [0u8; HEADER_BYTES];
            c.read_exact(&mut ready).unwrap();
            let mut frame = vec![Kind::AllGather as u8];
            frame.extend_from_slice(&1u64.to_le_bytes());
            frame.extend_from_slice(&100u64.to_le_bytes());
            frame.extend_from_slice(&[1; 10]);
            c.write_all(&frame).unwrap();
            for (rank, r) in [(0, root.join().unwrap()), (2, other.join().unwrap())] {
                match r {
                    Err(Error::Timeout { rank: got, peer: 1, .. }) => assert_eq!(got, rank),
                    other => panic!("rank {rank}: expected a timeout naming rank 1, got {other:?}"),
                }
            }
            // Within the deadline, plus the grace a client gives rank 0's verdict.
            assert!(t0.elapsed() < T + client_grace(T) + Duration::from_millis(500), "{:?}", t0.elapsed());
            drop(c);
        });
    }

    #[test]
    fn a_closed_peer_is_a_group_error_naming_it() {
        let out = run(3, Duration::from_secs(5), |g| {
            if g.rank() == 2 {
                drop(g);
                return Ok(());
            }
            g.barrier()
        });
        match &out[0] {
            Err(Error::Group { rank: 0, reason }) => assert!(reason.contains("rank 2 closed its connection"), "{reason}"),
            other => panic!("{other:?}"),
        }
        match &out[1] {
            Err(Error::Group { reason, .. }) => assert!(reason.contains("rank 2 closed its connection"), "{reason}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn mismatched_collectives_are_reported_and_break_the_group() {
        let out = run(2, Duration::from_secs(5), |g| {
            let first = if g.rank() == 0 { g.barrier() } else { g.all_gather(b"x").map(|_| ()) };
            let second = g.barrier();
            Ok((first, second))
        });
        let (first, second) = out.into_iter().next().unwrap().unwrap();
        match first {
            Err(Error::Group { reason, .. }) => assert!(reason.contains("all_gather #1") && reason.contains("barrier #1"), "{reason}"),
            other => panic!("{other:?}"),
        }
        assert!(matches!(second, Err(Error::Group { reason, .. }) if reason.contains("broken")));
    }

    #[test]
    fn env_parsing() {
        let env = |pairs: &[(&str, &str)]| {
            let m: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
            TcpConfig::from_lookup(move |k| m.get(k).cloned())
        };
        let base = [("MASTER_ADDR", "node0"), ("MASTER_PORT", "29500"), ("RANK", "2"), ("WORLD_SIZE", "4"), ("LOCAL_RANK", "1")];
        let c = env(&base).unwrap();
        assert_eq!(
            c,
            TcpConfig {
                addr: "node0".into(),
                port: 29501,
                rank: 2,
                size: 4,
                local_rank: 1,
                timeout: Duration::from_millis(DEFAULT_GROUP_TIMEOUT_MS)
            }
        );
        let mut with_port = base.to_vec();
        with_port.push(("MOELINK_PORT", "40000"));
        with_port.push(("MOELINK_GROUP_TIMEOUT_MS", "1500"));
        let c = env(&with_port).unwrap();
        assert_eq!((c.port, c.timeout), (40000, Duration::from_millis(1500)));
        // LOCAL_RANK defaults to RANK.
        assert_eq!(env(&base[..4]).unwrap().local_rank, 2);
        for (missing, name) in [(0, "MASTER_ADDR"), (1, "MASTER_PORT"), (2, "RANK"), (3, "WORLD_SIZE")] {
            let v: Vec<_> = base.iter().enumerate().filter(|(i, _)| *i != missing).map(|(_, p)| *p).collect();
            assert_eq!(env(&v).unwrap_err().argument(), Some(name));
        }
        let bad = |k: &'static str, v: &'static str| {
            let mut x = base.to_vec();
            x.retain(|(kk, _)| *kk != k);
            x.push((k, v));
            env(&x).unwrap_err()
        };
        assert_eq!(bad("RANK", "two").argument(), Some("RANK"));
        assert_eq!(bad("RANK", "4").argument(), Some("RANK"));
        assert_eq!(bad("WORLD_SIZE", "0").argument(), Some("WORLD_SIZE"));
        assert_eq!(bad("MASTER_PORT", "65535").argument(), Some("MASTER_PORT"));
        assert_eq!(bad("MASTER_PORT", "70000").argument(), Some("MASTER_PORT"));
        assert_eq!(bad("MOELINK_PORT", "-1").argument(), Some("MOELINK_PORT"));
    }

    #[test]
    fn pack_and_unpack_are_inverse_and_reject_garbage() {
        let msgs = vec![vec![], vec![1, 2, 3], vec![7; 1000]];
        assert_eq!(unpack(&pack(&msgs), 3).unwrap(), msgs);
        assert!(unpack(&pack(&msgs), 2).is_none());
        assert!(unpack(&pack(&msgs), 4).is_none());
        assert!(unpack(&[255; 8], 1).is_none());
        assert!(unpack(&[1, 0, 0, 0, 0, 0, 0, 0], 1).is_none());
    }

    /// Env var that turns [`child_rank`] into a real rank of a cross-process test group.
    const CHILD_ENV: &str = "MOELINK_TCP_TEST_CHILD";

    /// Not a test on its own: a no-op unless [`ranks_in_separate_processes`] starts this test binary with
    /// `CHILD_ENV` set, in which case it joins the group from torchrun-style variables and contributes its
    /// process key.
    #[test]
    fn child_rank() {
        if std::env::var(CHILD_ENV).is_err() {
            return;
        }
        let g = TcpGroup::from_env().unwrap();
        let keys = g.all_gather(&g.process_key().to_le_bytes()).unwrap();
        let total = g.all_to_all((0..g.size()).map(|d| vec![d as u8, g.rank() as u8]).collect()).unwrap();
        assert_eq!(total, (0..g.size()).map(|s| vec![g.rank() as u8, s as u8]).collect::<Vec<_>>());
        assert_eq!(keys.len(), g.size());
        g.barrier().unwrap();
    }

    #[test]
    fn ranks_in_separate_processes() {
        let (l, port) = listener();
        let exe = std::env::current_exe().unwrap();
        let children: Vec<_> = (1..3)
            .map(|r| {
                std::process::Command::new(&exe)
                    .args(["--exact", "group::tcp::tests::child_rank", "--test-threads=1", "--quiet"])
                    .env(CHILD_ENV, "1")
                    .env("MASTER_ADDR", "127.0.0.1")
                    .env("MASTER_PORT", "1")
                    .env("MOELINK_PORT", port.to_string())
                    .env("RANK", r.to_string())
                    .env("WORLD_SIZE", "3")
                    .env("LOCAL_RANK", r.to_string())
                    .env("MOELINK_GROUP_TIMEOUT_MS", "20000")
                    .stdout(std::process::Stdio::null())
                    .spawn()
                    .unwrap()
            })
            .collect();
        let g = TcpGroup::serve(l, 3, 0, Duration::from_secs(20)).unwrap();
        let keys: Vec<u64> = g.all_gather(&g.process_key().to_le_bytes()).unwrap().iter().map(|k| u64::from_le_bytes(le8(k))).collect();
        g.all_to_all((0..3).map(|d| vec![d as u8, 0]).collect()).unwrap();
        g.barrier().unwrap();
        for mut c in children {
            assert!(c.wait().unwrap().success());
        }
        // Three processes, three different keys: ranks must not exchange raw pointers.
        assert!(keys[0] != keys[1] && keys[1] != keys[2] && keys[0] != keys[2], "{keys:?}");
    }
}
