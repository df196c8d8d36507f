//! Tensor views (borrowed, with shape, strides and dtype) and owned tensors.
//!
//! A view is lent memory plus a layout; it does not own memory. Views borrow a slice (host), an owned
//! [`Tensor`], or memory owned elsewhere (torch tensors, another engine's device allocations), which enters
//! through the CUDA layer's one door for it, [`MemRef::from_raw`] / [`MemMut::from_raw`]. Strides are in
//! elements and must be non-negative; at most [`MAX_DIMS`] dimensions.

use std::fmt;

pub use moelink_cuda::{MemMut, MemRef, Place};

use crate::dtype::{DType, Element};
use crate::error::{Error, Result};

/// Maximum number of dimensions of a view.
pub const MAX_DIMS: usize = 4;

/// Largest element count or element span of a layout: its bytes fit in `isize` for every dtype (8 bytes at
/// most), so sizes computed from a layout never overflow.
pub const MAX_ELEMS: usize = isize::MAX as usize / 8;

/// Where a tensor's memory lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Location {
    /// Host (CPU) memory.
    Host,
    /// Device memory of CUDA device `ordinal`.
    Cuda(usize),
}

impl From<Place> for Location {
    fn from(place: Place) -> Location {
        match place {
            Place::Host => Location::Host,
            Place::Device(ordinal) => Location::Cuda(ordinal),
        }
    }
}

impl From<Location> for Place {
    fn from(location: Location) -> Place {
        match location {
            Location::Host => Place::Host,
            Location::Cuda(ordinal) => Place::Device(ordinal),
        }
    }
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Location::Host => f.write_str("cpu"),
            Location::Cuda(d) => write!(f, "cuda:{d}"),
        }
    }
}

/// Shape and strides (in elements) of a view.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    shape: [usize; MAX_DIMS],
    strides: [isize; MAX_DIMS],
    ndim: u8,
}

impl Layout {
    /// A contiguous (row-major) layout.
    pub fn contiguous(shape: &[usize]) -> Result<Layout> {
        let mut strides = [0isize; MAX_DIMS];
        if shape.len() > MAX_DIMS {
            return Err(Error::invalid("shape", 0, format!("{} dimensions, at most {MAX_DIMS}", shape.len())));
        }
        let mut acc: isize = 1;
        for i in (0..shape.len()).rev() {
            strides[i] = acc;
            acc = acc.saturating_mul(isize::try_from(shape[i].max(1)).unwrap_or(isize::MAX));
        }
        Layout::new(shape, &strides[..shape.len()])
    }

    /// A layout with explicit strides (elements). Strides must be non-negative.
    pub fn new(shape: &[usize], strides: &[isize]) -> Result<Layout> {
        if shape.len() > MAX_DIMS || shape.len() != strides.len() {
            return Err(Error::invalid(
                "shape",
                0,
                format!("{} dims with {} strides (at most {MAX_DIMS} dims)", shape.len(), strides.len()),
            ));
        }
        if let Some(s) = strides.iter().find(|s| **s < 0) {
            return Err(Error::invalid("strides", 0, format!("negative stride {s} is not supported")));
        }
        // Every size derived from a layout (element count, span, bytes for any dtype) must be computable
        // without overflow: refuse layouts whose element count or span exceeds what `isize` bytes can hold.
        let numel = if shape.contains(&0) { Some(0) } else { shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d)) };
        if numel.is_none_or(|n| n > MAX_ELEMS) {
            return Err(Error::invalid("shape", 0, format!("{shape:?} has more elements than memory can hold")));
        }
        if numel != Some(0) {
            let span = shape.iter().zip(strides).try_fold(1usize, |a, (&n, &s)| a.checked_add((n - 1).checked_mul(s as usize)?));
            if span.is_none_or(|n| n > MAX_ELEMS) {
                return Err(Error::invalid(
                    "strides",
                    0,
                    format!("shape {shape:?} with strides {strides:?} reaches past any addressable memory"),
                ));
            }
        }
        let mut l = Layout { shape: [0; MAX_DIMS], strides: [0; MAX_DIMS], ndim: shape.len() as u8 };
        l.shape[..shape.len()].copy_from_slice(shape);
        l.strides[..shape.len()].copy_from_slice(strides);
        Ok(l)
    }

    pub fn shape(&self) -> &[usize] {
        &self.shape[..self.ndim as usize]
    }
    pub fn strides(&self) -> &[isize] {
        &self.strides[..self.ndim as usize]
    }
    pub fn ndim(&self) -> usize {
        self.ndim as usize
    }
    pub fn numel(&self) -> usize {
        // An empty tensor may have a huge other dimension (`[2, usize::MAX, 0]`): the product of the others
        // would overflow before the zero. Layout::new bounds every non-empty product.
        if self.shape().contains(&0) {
            0
        } else {
            self.shape().iter().product()
        }
    }
    /// True when elements are densely packed in row-major order (size-1 dims may have any stride). A tensor
    /// without elements is contiguous whatever its strides, as torch says: there is nothing to lay out.
    pub fn is_contiguous(&self) -> bool {
        if self.numel() == 0 {
            return true;
        }
        let mut expect: isize = 1;
        for i in (0..self.ndim()).rev() {
            if self.shape[i] != 1 && self.strides[i] != expect {
                return false;
            }
            // Past isize (an empty tensor's huge other dimension): no stride can match any more.
            match isize::try_from(self.shape[i]).ok().and_then(|n| expect.checked_mul(n)) {
                Some(e) => expect = e,
                None => return self.shape[..i].iter().all(|&n| n == 1),
            }
        }
        true
    }
    /// Number of elements spanned from the first to one past the last element (0 when empty).
    pub fn span_elems(&self) -> usize {
        if self.numel() == 0 {
            return 0;
        }
        1 + self.shape().iter().zip(self.strides()).map(|(&n, &s)| (n - 1) * s as usize).sum::<usize>()
    }
    /// Element offset of a multi-index.
    #[inline]
    pub fn offset(&self, idx: &[usize]) -> usize {
        idx.iter().zip(self.strides()).map(|(&i, &s)| i * s as usize).sum()
    }
}

impl fmt::Debug for Layout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?} strides {:?}", self.shape(), self.strides())
    }
}

macro_rules! view_common {
    () => {
        pub fn dtype(&self) -> DType {
            self.dtype
        }
        pub fn location(&self) -> Location {
            self.mem.place().into()
        }
        pub fn layout(&self) -> &Layout {
            &self.layout
        }
        pub fn shape(&self) -> &[usize] {
            self.layout.shape()
        }
        pub fn strides(&self) -> &[isize] {
            self.layout.strides()
        }
        pub fn ndim(&self) -> usize {
            self.layout.ndim()
        }
        pub fn numel(&self) -> usize {
            self.layout.numel()
        }
        pub fn is_contiguous(&self) -> bool {
            self.layout.is_contiguous()
        }
        /// Base address (host or device) of element `[0, 0, ...]`.
        pub fn addr(&self) -> u64 {
            self.mem.addr()
        }
        /// Device address of element `[0, 0, ...]` for a kernel; null for a host view, which validation
        /// keeps away from every kernel.
        pub(crate) fn device_ptr(&self) -> moelink_cuda::DevPtr {
            self.mem.dev_ptr().unwrap_or(moelink_cuda::DevPtr::NULL)
        }
        /// Bytes from the first element to one past the last.
        pub fn span_bytes(&self) -> usize {
            self.layout.span_elems() * self.dtype.size_bytes()
        }
    };
}

/// A read-only view of a tensor.
#[derive(Clone, Copy)]
pub struct TensorRef<'a> {
    mem: MemRef<'a>,
    dtype: DType,
    layout: Layout,
}

/// A writable view of a tensor.
pub struct TensorMut<'a> {
    mem: MemMut<'a>,
    dtype: DType,
    layout: Layout,
}

impl<'a> TensorRef<'a> {
    /// The lent memory under the view (a copy-engine copy reads it whole).
    pub(crate) fn mem(&self) -> MemRef<'a> {
        self.mem
    }

    view_common!();

    /// A contiguous view of a host slice.
    pub fn from_slice<T: Element>(data: &'a [T], shape: &[usize]) -> Result<Self> {
        Self::from_slice_strided(data, shape, Layout::contiguous(shape)?.strides())
    }

    /// A strided view of a host slice; every addressed element must lie inside `data`.
    pub fn from_slice_strided<T: Element>(data: &'a [T], shape: &[usize], strides: &[isize]) -> Result<Self> {
        let layout = Layout::new(shape, strides)?;
        check_fits(&layout, data.len())?;
        Ok(TensorRef { mem: MemRef::host(bytemuck::cast_slice(data)), dtype: T::DTYPE, layout })
    }

    /// A view of a host slice of `bool` (torch.bool).
    pub fn from_bools(data: &'a [bool], shape: &[usize]) -> Result<Self> {
        let layout = Layout::contiguous(shape)?;
        check_fits(&layout, data.len())?;
        Ok(TensorRef { mem: MemRef::host(bytemuck::cast_slice(data)), dtype: DType::Bool, layout })
    }

    /// A view of lent memory (host or device), which must hold every element the layout addresses: memory
    /// owned elsewhere enters through [`MemRef::from_raw`].
    ///
    /// ```
    /// use moelink::{DType, MemRef, TensorRef};
    /// let data = [1u8, 2, 3, 4, 5, 6];
    /// let t = TensorRef::from_memory(MemRef::host(&data), DType::U8, &[2, 2], &[3, 1])?;
    /// assert_eq!(t.get::<u8>(&[1, 1]), Some(5));
    /// assert!(TensorRef::from_memory(MemRef::host(&data), DType::U8, &[2, 4], &[4, 1]).is_err());
    /// # Ok::<(), moelink::Error>(())
    /// ```
    pub fn from_memory(mem: MemRef<'a>, dtype: DType, shape: &[usize], strides: &[isize]) -> Result<Self> {
        let layout = Layout::new(shape, strides)?;
        check_memory(&layout, dtype, mem.len())?;
        Ok(TensorRef { mem, dtype, layout })
    }

    /// The bytes spanned by this view, when it lives in host memory.
    pub fn host_bytes(&self) -> Option<&'a [u8]> {
        // The lent memory holds the span (every constructor checks).
        self.mem.host_bytes().map(|b| &b[..self.span_bytes()])
    }

    /// Reads one element (host views only); `None` when the view is not on the host or the type differs.
    pub fn get<T: Element>(&self, idx: &[usize]) -> Option<T> {
        if T::DTYPE.size_bytes() != self.dtype.size_bytes() || idx.len() != self.ndim() {
            return None;
        }
        let bytes = self.host_bytes()?;
        let off = self.layout.offset(idx) * self.dtype.size_bytes();
        Some(bytemuck::pod_read_unaligned(&bytes[off..off + std::mem::size_of::<T>()]))
    }

    /// Same view with another shape/strides over the same base (used for transposed/column-major scales).
    pub fn with_layout(&self, shape: &[usize], strides: &[isize]) -> Result<TensorRef<'a>> {
        let layout = Layout::new(shape, strides)?;
        if layout.span_elems() > self.layout.span_elems() {
            return Err(Error::invalid("shape", 0, format!("{layout:?} reaches past the viewed memory {:?}", self.layout)));
        }
        Ok(TensorRef { layout, ..*self })
    }
}

impl<'a> TensorMut<'a> {
    view_common!();

    /// A contiguous writable view of a host slice.
    pub fn from_slice<T: Element>(data: &'a mut [T], shape: &[usize]) -> Result<Self> {
        let layout = Layout::contiguous(shape)?;
        check_fits(&layout, data.len())?;
        Ok(TensorMut { mem: MemMut::host(bytemuck::cast_slice_mut(data)), dtype: T::DTYPE, layout })
    }

    /// A writable view of lent memory (host or device, a [`moelink_cuda::DeviceSpanMut`] too), which must
    /// hold every element the layout addresses: memory owned elsewhere enters through [`MemMut::from_raw`].
    pub fn from_memory(mem: impl Into<MemMut<'a>>, dtype: DType, shape: &[usize], strides: &[isize]) -> Result<Self> {
        let mem = mem.into();
        let layout = Layout::new(shape, strides)?;
        check_memory(&layout, dtype, mem.len())?;
        Ok(TensorMut { mem, dtype, layout })
    }

    /// Read-only reborrow.
    pub fn as_ref(&self) -> TensorRef<'_> {
        TensorRef { mem: self.mem.as_ref(), dtype: self.dtype, layout: self.layout }
    }

    /// Writable reborrow.
    pub fn reborrow(&mut self) -> TensorMut<'_> {
        TensorMut { mem: self.mem.reborrow(), dtype: self.dtype, layout: self.layout }
    }

    /// The bytes spanned by this view, when it lives in host memory.
    pub fn host_bytes_mut(&mut self) -> Option<&mut [u8]> {
        let n = self.span_bytes();
        self.mem.host_bytes_mut().map(|b| &mut b[..n])
    }

    /// The bytes spanned by this view, when it lives on a GPU: what stream-ordered fills and copies into it
    /// take.
    pub fn device_span_mut(&mut self) -> Result<moelink_cuda::DeviceSpanMut<'_>> {
        let n = self.span_bytes();
        self.mem.device_span_mut(0, n).map_err(|e| Error::invalid("tensor", 0, e.to_string()))
    }
}

fn check_memory(layout: &Layout, dtype: DType, len: usize) -> Result<()> {
    let bytes = layout.span_elems() * dtype.size_bytes();
    if bytes > len {
        return Err(Error::invalid("shape", 0, format!("{layout:?} of {dtype:?} spans {bytes} bytes, the memory {len}")));
    }
    Ok(())
}

fn check_fits(layout: &Layout, len: usize) -> Result<()> {
    if layout.span_elems() > len {
        return Err(Error::invalid(
            "data",
            0,
            format!("layout {layout:?} addresses {} elements but the slice has {len}", layout.span_elems()),
        ));
    }
    Ok(())
}

/// Owned storage of a [`Tensor`].
enum Storage {
    /// 16-byte aligned host bytes.
    Host(Vec<u128>),
    /// Device memory.
    Cuda(moelink_cuda::DeviceBuffer),
}

/// An owned, contiguous tensor in host or device memory.
pub struct Tensor {
    storage: Storage,
    dtype: DType,
    layout: Layout,
}

impl Tensor {
    /// A zero-filled host tensor.
    ///
    /// A shape whose bytes overflow or that this machine cannot allocate is an [`Error::InvalidArgument`]
    /// about `shape` saying how many bytes it needs (never an abort); [`crate::Buffer`]'s allocating calls
    /// name the argument the shape came from instead.
    pub fn zeros(dtype: DType, shape: &[usize]) -> Result<Tensor> {
        let layout = Layout::contiguous(shape)?;
        let too_big = |bytes: String| {
            Error::invalid("shape", 0, format!("{dtype:?} {shape:?} needs {bytes} bytes, more than this machine can allocate"))
        };
        let bytes = layout.numel().checked_mul(dtype.size_bytes()).ok_or_else(|| too_big(format!("more than {}", usize::MAX)))?;
        let mut words: Vec<u128> = Vec::new();
        words.try_reserve_exact(bytes.div_ceil(16)).map_err(|_| too_big(bytes.to_string()))?;
        words.resize(bytes.div_ceil(16), 0);
        Ok(Tensor { storage: Storage::Host(words), dtype, layout })
    }

    /// A host tensor holding `data` (row-major, `shape.iter().product() == data.len()`).
    pub fn from_vec<T: Element>(data: Vec<T>, shape: &[usize]) -> Result<Tensor> {
        // Check the size before allocating: a shape that does not match must not cost an allocation.
        if Layout::contiguous(shape)?.numel() != data.len() {
            return Err(Error::invalid("data", 0, format!("{} elements for shape {shape:?}", data.len())));
        }
        let mut t = Tensor::zeros(T::DTYPE, shape)?;
        t.host_bytes_mut().copy_from_slice(bytemuck::cast_slice(&data));
        Ok(t)
    }

    /// A host bool tensor.
    pub fn from_bools(data: &[bool], shape: &[usize]) -> Result<Tensor> {
        if Layout::contiguous(shape)?.numel() != data.len() {
            return Err(Error::invalid("data", 0, format!("{} elements for shape {shape:?}", data.len())));
        }
        let mut t = Tensor::zeros(DType::Bool, shape)?;
        t.host_bytes_mut().copy_from_slice(bytemuck::cast_slice(data));
        Ok(t)
    }

    /// Wraps device memory allocated by the CUDA layer (contiguous).
    pub fn from_device(buf: moelink_cuda::DeviceBuffer, dtype: DType, shape: &[usize]) -> Result<Tensor> {
        let layout = Layout::contiguous(shape)?;
        if layout.numel() * dtype.size_bytes() > buf.len_bytes() {
            return Err(Error::invalid("shape", 0, format!("{shape:?} x {dtype} does not fit {} bytes", buf.len_bytes())));
        }
        Ok(Tensor { storage: Storage::Cuda(buf), dtype, layout })
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }
    pub fn shape(&self) -> &[usize] {
        self.layout.shape()
    }
    pub fn numel(&self) -> usize {
        self.layout.numel()
    }
    pub fn location(&self) -> Location {
        match &self.storage {
            Storage::Host(_) => Location::Host,
            Storage::Cuda(b) => Location::Cuda(b.device_ordinal()),
        }
    }
    fn memory(&self) -> MemRef<'_> {
        match &self.storage {
            Storage::Host(v) => MemRef::host(bytemuck::cast_slice(v)),
            Storage::Cuda(b) => MemRef::device(b),
        }
    }

    fn memory_mut(&mut self) -> MemMut<'_> {
        match &mut self.storage {
            Storage::Host(v) => MemMut::host(bytemuck::cast_slice_mut(v)),
            Storage::Cuda(b) => MemMut::device(b),
        }
    }

    /// A read-only view.
    pub fn view(&self) -> TensorRef<'_> {
        TensorRef { mem: self.memory(), dtype: self.dtype, layout: self.layout }
    }

    /// A writable view.
    pub fn view_mut(&mut self) -> TensorMut<'_> {
        let (dtype, layout) = (self.dtype, self.layout);
        TensorMut { mem: self.memory_mut(), dtype, layout }
    }

    fn nbytes(&self) -> usize {
        self.numel() * self.dtype.size_bytes()
    }

    fn host_bytes_mut(&mut self) -> &mut [u8] {
        let n = self.nbytes();
        match &mut self.storage {
            Storage::Host(v) => &mut bytemuck::cast_slice_mut::<u128, u8>(v)[..n],
            Storage::Cuda(_) => &mut [],
        }
    }

    /// A writable view with another shape/strides over this tensor's memory (e.g. a column-major view of
    /// scales stored transposed). Every addressed element must lie inside the tensor.
    pub fn view_mut_strided(&mut self, shape: &[usize], strides: &[isize]) -> Result<TensorMut<'_>> {
        let layout = Layout::new(shape, strides)?;
        if layout.span_elems() > self.numel() {
            return Err(Error::invalid("strides", 0, format!("{layout:?} reaches past the tensor's {} elements", self.numel())));
        }
        let dtype = self.dtype;
        Ok(TensorMut { mem: self.memory_mut(), dtype, layout })
    }

    /// Copies `src`'s elements into this tensor (same dtype and shape; either may live on the host or a
    /// device). Device copies are complete when this returns and are not ordered after work on any stream:
    /// call it once the work that uses the tensor has finished (every synchronous [`crate::Buffer`]
    /// operation has when it returns). Used to feed new inputs to tensors whose addresses a captured CUDA
    /// graph replays.
    ///
    /// ```
    /// use moelink::{DType, Tensor};
    /// let mut a = Tensor::zeros(DType::F32, &[2])?;
    /// a.copy_from(&Tensor::from_vec(vec![1f32, 2.0], &[2])?)?;
    /// assert_eq!(a.to_vec::<f32>()?, vec![1.0, 2.0]);
    /// assert!(a.copy_from(&Tensor::zeros(DType::F32, &[3])?).is_err());
    /// # Ok::<(), moelink::Error>(())
    /// ```
    pub fn copy_from(&mut self, src: &Tensor) -> Result<()> {
        if src.dtype != self.dtype || src.shape() != self.shape() {
            return Err(Error::invalid(
                "src",
                0,
                format!("copying a {} {:?} tensor into a {} {:?} one", src.dtype, src.shape(), self.dtype, self.shape()),
            ));
        }
        let n = self.nbytes();
        match (&mut self.storage, &src.storage) {
            (Storage::Host(d), Storage::Host(s)) => {
                bytemuck::cast_slice_mut::<u128, u8>(d)[..n].copy_from_slice(&bytemuck::cast_slice::<u128, u8>(s)[..n]);
            }
            (Storage::Cuda(d), Storage::Host(s)) => d.copy_from_host(0, &bytemuck::cast_slice::<u128, u8>(s)[..n])?,
            (Storage::Host(d), Storage::Cuda(s)) => s.copy_to_host(&mut bytemuck::cast_slice_mut::<u128, u8>(d)[..n])?,
            (Storage::Cuda(d), Storage::Cuda(s)) => d.copy_from_device(0, s, 0, n)?,
        }
        Ok(())
    }

    /// The tensor's bytes, copied to the host if it lives on a device (not ordered after work on any stream,
    /// like [`Tensor::copy_from`]).
    pub fn to_host_bytes(&self) -> Result<Vec<u8>> {
        match &self.storage {
            Storage::Host(v) => Ok(bytemuck::cast_slice::<u128, u8>(v)[..self.nbytes()].to_vec()),
            Storage::Cuda(b) => {
                let mut out = vec![0u8; self.nbytes()];
                b.copy_to_host(&mut out)?;
                Ok(out)
            }
        }
    }

    /// Overwrites the tensor's contents with `bytes` (its exact size, row-major), copying to the device if it
    /// lives there (complete on return; not ordered after work on any stream, like [`Tensor::copy_from`]).
    pub fn write_bytes(&mut self, bytes: &[u8]) -> Result<()> {
        let n = self.nbytes();
        if bytes.len() != n {
            return Err(Error::invalid("bytes", 0, format!("{} bytes for a tensor of {n}", bytes.len())));
        }
        match &mut self.storage {
            Storage::Host(_) => self.host_bytes_mut().copy_from_slice(bytes),
            Storage::Cuda(b) => b.copy_from_host(0, bytes)?,
        }
        Ok(())
    }

    /// A host copy of this tensor.
    pub fn to_host(&self) -> Result<Tensor> {
        let bytes = self.to_host_bytes()?;
        let mut t = Tensor::zeros(self.dtype, self.shape())?;
        t.host_bytes_mut().copy_from_slice(&bytes);
        Ok(t)
    }

    /// The elements as a `Vec<T>` (copied to the host if needed). `T` must have the tensor's element size.
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>> {
        if T::DTYPE.size_bytes() != self.dtype.size_bytes() {
            return Err(Error::invalid("T", 0, format!("reading a {} tensor as {}", self.dtype, T::DTYPE)));
        }
        let bytes = self.to_host_bytes()?;
        Ok(bytes.chunks_exact(std::mem::size_of::<T>()).map(bytemuck::pod_read_unaligned).collect())
    }

    /// The elements of a bool tensor.
    pub fn to_bools(&self) -> Result<Vec<bool>> {
        Ok(self.to_host_bytes()?.into_iter().map(|b| b != 0).collect())
    }
}

impl fmt::Debug for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Tensor({} {:?} on {})", self.dtype, self.shape(), self.location())
    }
}
