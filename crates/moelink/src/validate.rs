//! Argument checks shared by every operation. Each check names the argument and the rank; they run once,
//! in the core, before any backend sees the call.

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::{Location, TensorMut, TensorRef};

/// Largest hidden size any call accepts (the kernels' cross-rank call signatures carry it in 24 bits).
pub(crate) const MAX_HIDDEN: usize = 1 << 20;
/// Largest top-k (the HT call signature carries it in 12 bits).
pub(crate) const MAX_TOPK: usize = 1024;
/// Largest number of experts per rank (the LL kernels index local experts in 15 bits).
pub(crate) const MAX_LOCAL_EXPERTS: usize = (1 << 15) - 1;
/// Largest row count argument (`num_worst_tokens`, `expert_alignment`; DeepEP passes them as C `int`).
pub(crate) const MAX_ROWS: usize = i32::MAX as usize;

/// Rejects a size argument above `max`.
pub(crate) fn check_at_most(value: usize, max: usize, arg: &'static str, rank: usize) -> Result<()> {
    if value > max {
        return Err(Error::invalid(arg, rank, format!("{value} exceeds the supported maximum {max}")));
    }
    Ok(())
}

/// Rejects a `topk_idx` without columns: every token needs at least one top-k slot (`-1` where it selects no
/// expert), so `[T, 0]` is a malformed routing rather than one that sends nothing.
pub(crate) fn check_topk_columns(topk: usize, arg: &'static str, rank: usize) -> Result<()> {
    if topk == 0 {
        return Err(Error::invalid(arg, rank, "has 0 columns: each token needs at least one top-k slot (-1 where it selects no expert)"));
    }
    check_at_most(topk, MAX_TOPK, arg, rank)
}

/// What a tensor argument must look like.
pub(crate) struct Expect<'s> {
    pub arg: &'static str,
    pub rank: usize,
    pub location: Location,
    pub dtypes: &'s [DType],
    /// Expected size per dimension; `None` accepts any size (the caller reads it back).
    pub shape: &'s [Option<usize>],
    /// Require row-major contiguity.
    pub contiguous: bool,
}

impl Expect<'_> {
    fn check(&self, dtype: DType, location: Location, shape: &[usize], contiguous: bool) -> Result<()> {
        let Expect { arg, rank, .. } = *self;
        if !self.dtypes.contains(&dtype) {
            let want: Vec<&str> = self.dtypes.iter().map(|d| d.name()).collect();
            return Err(Error::invalid(arg, rank, format!("dtype is {dtype}, expected {}", want.join(" or "))));
        }
        if location != self.location {
            return Err(Error::invalid(arg, rank, format!("tensor is on {location}, the buffer works on {}", self.location)));
        }
        if shape.len() != self.shape.len() {
            return Err(Error::invalid(arg, rank, format!("has {} dimensions {shape:?}, expected {}", shape.len(), fmt_shape(self.shape))));
        }
        for (i, (&got, want)) in shape.iter().zip(self.shape).enumerate() {
            if let Some(w) = want {
                if got != *w {
                    return Err(Error::invalid(
                        arg,
                        rank,
                        format!("shape is {shape:?}, expected {} (dimension {i})", fmt_shape(self.shape)),
                    ));
                }
            }
        }
        if self.contiguous && !contiguous {
            return Err(Error::invalid(arg, rank, format!("must be contiguous (shape {shape:?})")));
        }
        Ok(())
    }

    /// Checks a read-only view; returns its shape.
    pub fn view<'t>(&self, t: &'t TensorRef<'_>) -> Result<&'t [usize]> {
        self.check(t.dtype(), t.location(), t.shape(), t.is_contiguous())?;
        Ok(t.shape())
    }

    /// Checks a writable view; returns its shape.
    pub fn view_mut<'t>(&self, t: &'t TensorMut<'_>) -> Result<&'t [usize]> {
        self.check(t.dtype(), t.location(), t.shape(), t.is_contiguous())?;
        Ok(t.shape())
    }
}

fn fmt_shape(s: &[Option<usize>]) -> String {
    let parts: Vec<String> = s.iter().map(|d| d.map_or("*".to_string(), |n| n.to_string())).collect();
    format!("[{}]", parts.join(", "))
}

/// Checks `topk_idx` values on the host: every entry in `-1..num_experts`, no expert twice in a row.
/// `idx` is row-major `[num_tokens, topk]`.
pub(crate) fn check_topk_values(idx: &[i64], topk: usize, num_experts: usize, arg: &'static str, rank: usize) -> Result<()> {
    if topk == 0 {
        return Ok(());
    }
    for (t, row) in idx.chunks_exact(topk).enumerate() {
        for (k, &e) in row.iter().enumerate() {
            if e < -1 || e >= num_experts as i64 {
                return Err(Error::invalid(arg, rank, format!("entry [{t}, {k}] = {e} is outside [-1, {num_experts})")));
            }
            if e >= 0 && row[..k].contains(&e) {
                return Err(Error::invalid(arg, rank, format!("token {t} selects expert {e} twice")));
            }
        }
    }
    Ok(())
}

/// Reads a host `int64 [T, K]` view (any strides) into a row-major vector.
pub(crate) fn read_i64_matrix(t: &TensorRef<'_>) -> Option<Vec<i64>> {
    read_matrix(t)
}

/// Reads a host 2-D view of `T` (any strides) into a row-major vector.
pub(crate) fn read_matrix<T: crate::dtype::Element>(t: &TensorRef<'_>) -> Option<Vec<T>> {
    let bytes = t.host_bytes()?;
    let (rows, cols) = (t.shape()[0], t.shape().get(1).copied().unwrap_or(1));
    let strides = t.strides();
    let (s0, s1) = (strides[0] as usize, strides.get(1).copied().unwrap_or(1) as usize);
    let es = std::mem::size_of::<T>();
    let mut out = Vec::with_capacity(rows * cols);
    for r in 0..rows {
        for c in 0..cols {
            let off = (r * s0 + c * s1) * es;
            out.push(bytemuck::pod_read_unaligned(&bytes[off..off + es]));
        }
    }
    Some(out)
}
