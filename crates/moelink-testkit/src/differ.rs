//! Comparing a result against the host backend's (the host twin): which outputs differ, and how.
//!
//! Dispatch outputs compare byte for byte over the valid rows (in no-sync mode the tail of `-1` ids and
//! zero weights too), combine outputs bit for bit (the summation order is part of the contract).

use moelink::{DispatchLayout, DispatchResult, Result, Tensor};

/// Differences found, one line each (empty: everything matched).
#[derive(Clone, Debug, Default)]
pub struct Diffs(pub Vec<String>);

impl Diffs {
    /// Two byte strings: their lengths, or how many bytes differ and where the first is.
    pub fn bytes(&mut self, what: &str, want: &[u8], got: &[u8]) {
        if want.len() != got.len() {
            self.0.push(format!("{what}: {} bytes from the host backend, {} from the primary", want.len(), got.len()));
        } else if let Some(i) = want.iter().zip(got).position(|(a, b)| a != b) {
            let n = want.iter().zip(got).filter(|(a, b)| a != b).count();
            self.0.push(format!("{what}: {n} of {} bytes differ, first at byte {i} ({:#04x} vs {:#04x})", want.len(), want[i], got[i]));
        }
    }

    /// Two values.
    pub fn eq<T: PartialEq + std::fmt::Debug>(&mut self, what: &str, want: T, got: T) {
        if want != got {
            self.0.push(format!("{what}: host {want:?}, primary {got:?}"));
        }
    }

    /// A difference described by the caller.
    pub fn note(&mut self, s: String) {
        self.0.push(s);
    }

    /// True when nothing differed.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// A tensor's bytes on the host.
pub fn bytes_of(t: &Tensor) -> Result<Vec<u8>> {
    t.to_host_bytes()
}

/// High-throughput dispatch outputs, downloaded.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SeenDispatch {
    /// Rows of `recv_x`.
    pub rows: usize,
    pub x: Vec<u8>,
    pub scales: Vec<u8>,
    pub idx: Vec<i64>,
    pub w: Vec<f32>,
}

impl SeenDispatch {
    /// The outputs of `r`.
    pub fn of(r: &DispatchResult) -> Result<SeenDispatch> {
        Ok(SeenDispatch {
            rows: r.recv_x.shape()[0],
            x: bytes_of(&r.recv_x)?,
            scales: r.recv_x_scales.as_ref().map(bytes_of).transpose()?.unwrap_or_default(),
            idx: r.recv_topk_idx.as_ref().map(|t| t.to_vec()).transpose()?.unwrap_or_default(),
            w: r.recv_topk_weights.as_ref().map(|t| t.to_vec()).transpose()?.unwrap_or_default(),
        })
    }
}

/// Compares a primary dispatch (CPU-sync, or no-sync with `worst` rows) against the host's (CPU-sync), whose
/// rows all are received ones; `k` is the top-k width (0 when no top-k travelled).
pub fn compare_dispatch(d: &mut Diffs, what: &str, host: &SeenDispatch, prim: &SeenDispatch, worst: usize, k: usize) {
    let n = host.rows;
    if worst == 0 {
        d.eq(&format!("{what} rows"), n, prim.rows);
    } else if prim.rows != worst || n > worst {
        d.note(format!("{what}: {} rows from the primary, {worst} expected ({n} received)", prim.rows));
        return;
    }
    if prim.rows < n {
        d.note(format!("{what}: {} rows from the primary, {n} from the host", prim.rows));
        return;
    }
    let row = host.x.len().checked_div(n).unwrap_or(0);
    d.bytes(&format!("{what} recv_x"), &host.x, &prim.x[..(n * row).min(prim.x.len())]);
    let srow = host.scales.len().checked_div(n).unwrap_or(0);
    d.bytes(&format!("{what} recv_x_scales"), &host.scales, &prim.scales[..(n * srow).min(prim.scales.len())]);
    if k > 0 {
        d.eq(&format!("{what} recv_topk_idx"), &host.idx[..], &prim.idx[..(n * k).min(prim.idx.len())]);
        let hw: Vec<u32> = host.w.iter().map(|v| v.to_bits()).collect();
        let pw: Vec<u32> = prim.w[..(n * k).min(prim.w.len())].iter().map(|v| v.to_bits()).collect();
        d.eq(&format!("{what} recv_topk_weights"), hw, pw);
        if worst > 0 {
            if prim.idx[(n * k).min(prim.idx.len())..].iter().any(|&e| e != -1) {
                d.note(format!("{what}: no-sync tail rows carry top-k ids other than -1"));
            }
            if prim.w[(n * k).min(prim.w.len())..].iter().any(|&w| w.to_bits() != 0) {
                d.note(format!("{what}: no-sync tail rows carry nonzero weights"));
            }
        }
    }
}

/// `get_dispatch_layout`'s three outputs, as bytes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SeenLayout {
    pub num_tokens_per_rank: Vec<u8>,
    pub num_tokens_per_expert: Vec<u8>,
    pub is_token_in_rank: Vec<u8>,
}

impl SeenLayout {
    /// The outputs of `l`.
    pub fn of(l: &DispatchLayout) -> Result<SeenLayout> {
        SeenLayout::from_tensors(&l.num_tokens_per_rank, &l.num_tokens_per_expert, &l.is_token_in_rank)
    }

    /// The three tensors' bytes.
    pub fn from_tensors(per_rank: &Tensor, per_expert: &Tensor, in_rank: &Tensor) -> Result<SeenLayout> {
        Ok(SeenLayout {
            num_tokens_per_rank: bytes_of(per_rank)?,
            num_tokens_per_expert: bytes_of(per_expert)?,
            is_token_in_rank: bytes_of(in_rank)?,
        })
    }
}

/// Compares the primary's layout against the host's, byte for byte; `what` (may be empty) prefixes the
/// output names.
pub fn compare_layout(d: &mut Diffs, what: &str, host: &SeenLayout, prim: &SeenLayout) {
    let name = |field: &str| if what.is_empty() { field.to_string() } else { format!("{what} {field}") };
    d.bytes(&name("num_tokens_per_rank"), &host.num_tokens_per_rank, &prim.num_tokens_per_rank);
    d.bytes(&name("num_tokens_per_expert"), &host.num_tokens_per_expert, &prim.num_tokens_per_expert);
    d.bytes(&name("is_token_in_rank"), &host.is_token_in_rank, &prim.is_token_in_rank);
}

/// What a low-latency dispatch defines in its packed outputs: the count per local expert, then for each
/// expert its first `count` rows (`row_bytes` each, of `rows` per expert) and their scales (`cols` 4-byte
/// words per row, stored column-major `[E_local, cols, rows]`). Rows past the counts are unspecified.
pub fn ll_valid_part(count: &[i32], recv_x: &[u8], scales: &[u8], rows: usize, row_bytes: usize, cols: usize) -> (Vec<u8>, Vec<u8>) {
    let (mut r, mut s) = (Vec::new(), Vec::new());
    for (e, &n) in count.iter().enumerate() {
        let n = (n.max(0) as usize).min(rows);
        r.extend_from_slice(&recv_x[e * rows * row_bytes..(e * rows + n) * row_bytes]);
        for col in 0..cols {
            let at = 4 * ((e * cols + col) * rows);
            s.extend_from_slice(&scales[at..at + 4 * n]);
        }
    }
    (r, s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn comparisons_catch_every_kind_of_difference() {
        let host = SeenDispatch { rows: 2, x: vec![1, 2, 3, 4], scales: vec![], idx: vec![0, -1, 3, 1], w: vec![0.5, 0.0, 0.25, 1.0] };
        let check = |prim: &SeenDispatch, worst: usize| {
            let mut d = Diffs::default();
            compare_dispatch(&mut d, "dispatch", &host, prim, worst, 2);
            d.0
        };
        assert!(check(&host, 0).is_empty());
        let mut x = host.clone();
        x.x[3] ^= 1;
        assert!(check(&x, 0)[0].contains("recv_x"), "{:?}", check(&x, 0));
        let mut w = host.clone();
        w.w[1] = -0.0; // a different bit pattern of zero is a difference
        assert!(!check(&w, 0).is_empty());
        let mut i = host.clone();
        i.idx[1] = 2;
        assert!(!check(&i, 0).is_empty());
        // No-sync: worst-case rows, a tail of -1 ids and zero weights; payload past the count is free.
        let tail = SeenDispatch {
            rows: 3,
            x: vec![1, 2, 3, 4, 9, 9],
            scales: vec![],
            idx: vec![0, -1, 3, 1, -1, -1],
            w: vec![0.5, 0.0, 0.25, 1.0, 0.0, 0.0],
        };
        assert!(check(&tail, 3).is_empty(), "{:?}", check(&tail, 3));
        let mut bad_tail = tail.clone();
        bad_tail.idx[5] = 0;
        assert!(!check(&bad_tail, 3).is_empty());
        assert!(!check(&tail, 4).is_empty(), "rows must equal num_worst_tokens");
    }

    #[test]
    fn byte_diffs_name_the_first_difference() {
        let mut d = Diffs::default();
        d.bytes("x", &[1, 2, 3], &[1, 9, 3]);
        d.bytes("y", &[1], &[1, 2]);
        d.eq("n", 1, 1);
        assert_eq!(d.0.len(), 2);
        assert!(d.0[0].contains("1 of 3 bytes differ, first at byte 1"), "{:?}", d.0);
        assert!(d.0[1].contains("1 bytes from the host backend, 2 from the primary"), "{:?}", d.0);
    }

    #[test]
    fn the_valid_part_skips_rows_past_the_counts() {
        // Two experts of 3 rows, 2-byte rows, one scale column.
        let recv: Vec<u8> = (0..12).collect();
        let scales: Vec<u8> = (100..124).collect();
        let (rows, sc) = ll_valid_part(&[2, 1], &recv, &scales, 3, 2, 1);
        assert_eq!(rows, vec![0, 1, 2, 3, 6, 7]);
        assert_eq!(sc, vec![100, 101, 102, 103, 104, 105, 106, 107, 112, 113, 114, 115]);
        // A count past the buffer is clamped, a negative one reads nothing.
        let (rows, _) = ll_valid_part(&[9, -1], &recv, &scales, 3, 2, 0);
        assert_eq!(rows, (0..6).collect::<Vec<u8>>());
    }
}
