//! A Mixture-of-Experts layer written in candle whose experts are spread over ranks with moelink: a router
//! (a linear layer, softmax, top-k), experts as candle layers (`w2(silu(w1(x)))`), and the tokens moved with
//! moelink's Rust API — high-throughput `dispatch` to the ranks that host each token's experts, the experts
//! run on the rows each rank received, `combine` sums their outputs back on the token's home rank.
//! [`MoeLayer::forward_dense`] computes the same layer on one rank without moelink, which the tests compare
//! against.
//!
//! On moelink's CUDA backend ([`MoeLayer::forward_expert_parallel_on_gpu`]) the same layer runs with the
//! tokens moved by moelink's GPU kernels while candle, built here without its `cuda` feature, keeps its
//! tensors on the CPU: they cross by copies at the boundary (README.md says how candle's own CUDA tensors
//! would meet moelink's without them).
//!
//! Where candle's tensors and moelink's meet on the host backend, without copies:
//! - Into moelink: [`with_host_view`] borrows a contiguous CPU tensor's storage as a [`moelink::TensorRef`]
//!   (the tokens, their top-k ids and weights, the expert outputs).
//! - Out of moelink: the two-phase calls (`prepare_dispatch` says how many rows arrive, then
//!   `dispatch_into`; `combine_into`) write into `Vec`s this code allocates, viewed as
//!   [`moelink::TensorMut`]s, and each `Vec` then becomes a candle tensor's storage
//!   ([`Tensor::from_storage`]) as it is.

use candle_core::op::BackpropOp;
use candle_core::{CpuStorage, DType, Device, Module, Storage, Tensor, D};
use candle_nn::Linear;
use moelink::{bf16, Buffer, CombineArgs, CombineOutputs, DispatchArgs, DispatchOutputs, Location, Payload, Routing, TensorMut, TensorRef};

/// Errors of this example: candle's or moelink's.
#[derive(Debug)]
pub enum Error {
    Candle(candle_core::Error),
    Moelink(moelink::Error),
    /// Something this example does not do (e.g. candle tensors on a GPU: see README.md).
    Unsupported(String),
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Error::Candle(e) => write!(f, "candle: {e}"),
            Error::Moelink(e) => write!(f, "moelink: {e}"),
            Error::Unsupported(why) => f.write_str(why),
        }
    }
}

impl std::error::Error for Error {}

impl From<candle_core::Error> for Error {
    fn from(e: candle_core::Error) -> Self {
        Error::Candle(e)
    }
}

impl From<moelink::Error> for Error {
    fn from(e: moelink::Error) -> Self {
        Error::Moelink(e)
    }
}

pub type Result<T> = std::result::Result<T, Error>;

/// Sizes of the layer.
#[derive(Clone, Copy, Debug)]
pub struct MoeConfig {
    pub hidden: usize,
    pub ffn: usize,
    pub num_experts: usize,
    pub topk: usize,
}

/// One expert: `w2(silu(w1(x)))`.
pub struct Expert {
    w1: Linear,
    w2: Linear,
}

impl Module for Expert {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.w2.forward(&candle_nn::ops::silu(&self.w1.forward(x)?)?)
    }
}

/// The layer's weights. Every rank builds the same weights from the same seed; a rank runs only the experts
/// it hosts ([`MoeLayer::local_experts`]: expert `e` lives on rank `e / (num_experts / num_ranks)`, moelink's
/// placement). A real engine would load only those.
pub struct MoeLayer {
    pub config: MoeConfig,
    router: Linear,
    experts: Vec<Expert>,
}

/// A small seeded generator (splitmix64), so that every rank draws the same weights.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed ^ 0x9E37_79B9_7F4A_7C15)
    }
    /// Uniform in [-1, 1).
    pub fn next_f32(&mut self) -> f32 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    /// A `[rows, cols]` f32 tensor of uniform values scaled by `scale`.
    pub fn tensor(&mut self, rows: usize, cols: usize, scale: f32, device: &Device) -> candle_core::Result<Tensor> {
        let v: Vec<f32> = (0..rows * cols).map(|_| scale * self.next_f32()).collect();
        Tensor::from_vec(v, (rows, cols), device)
    }
}

impl MoeLayer {
    /// The layer with weights drawn from `seed`.
    pub fn new(config: MoeConfig, seed: u64, device: &Device) -> Result<MoeLayer> {
        let mut rng = Rng::new(seed);
        let (h, f) = (config.hidden, config.ffn);
        let router = Linear::new(rng.tensor(config.num_experts, h, 1.0, device)?, None);
        let experts = (0..config.num_experts)
            .map(|_| {
                Ok(Expert {
                    w1: Linear::new(rng.tensor(f, h, 1.0 / (h as f32).sqrt(), device)?, None),
                    w2: Linear::new(rng.tensor(h, f, 1.0 / (f as f32).sqrt(), device)?, None),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(MoeLayer { config, router, experts })
    }

    /// The router: for `x` `[T, H]`, each token's `topk` experts (`int64 [T, K]`) and their softmax
    /// probabilities (`f32 [T, K]`), as DeepSeek-style gating without renormalisation.
    pub fn route(&self, x: &Tensor) -> Result<(Tensor, Tensor)> {
        let probs = candle_nn::ops::softmax_last_dim(&self.router.forward(&x.to_dtype(DType::F32)?)?)?;
        let order = probs.arg_sort_last_dim(false)?.narrow(D::Minus1, 0, self.config.topk)?.contiguous()?;
        let weights = probs.gather(&order, D::Minus1)?.contiguous()?;
        Ok((order.to_dtype(DType::I64)?, weights))
    }

    /// The experts rank `rank` of `num_ranks` hosts: `[first, first + count)`.
    pub fn local_experts(&self, rank: usize, num_ranks: usize) -> std::ops::Range<usize> {
        let per_rank = self.config.num_experts / num_ranks;
        rank * per_rank..(rank + 1) * per_rank
    }

    /// `sum over (row, expert, weight) of weight * expert(x[row])` into `[rows, H]` f32: each expert runs
    /// once, on the rows routed to it (`index_select`, the expert, `index_add`).
    fn run_experts(&self, x: &Tensor, assignments: &[(u32, usize, f32)], first_expert: usize) -> Result<Tensor> {
        let x = x.to_dtype(DType::F32)?;
        let mut y = Tensor::zeros(x.dims(), DType::F32, x.device())?;
        for (e, expert) in self.experts.iter().enumerate() {
            let mine: Vec<&(u32, usize, f32)> = assignments.iter().filter(|a| a.1 + first_expert == e).collect();
            if mine.is_empty() {
                continue;
            }
            let rows = Tensor::from_vec(mine.iter().map(|a| a.0).collect::<Vec<u32>>(), mine.len(), x.device())?;
            let w = Tensor::from_vec(mine.iter().map(|a| a.2).collect::<Vec<f32>>(), (mine.len(), 1), x.device())?;
            let out = expert.forward(&x.index_select(&rows, 0)?)?.broadcast_mul(&w)?;
            y = y.index_add(&rows, &out, 0)?;
        }
        Ok(y)
    }

    /// The whole layer on this rank's tokens, without expert parallelism (every expert here), in f32 from the
    /// bf16-rounded tokens that dispatch would send.
    pub fn forward_dense(&self, x: &Tensor) -> Result<Tensor> {
        let (idx, w) = self.route(x)?;
        let (idx, w) = (idx.to_vec2::<i64>()?, w.to_vec2::<f32>()?);
        let mut assignments = Vec::new();
        for (t, (ids, ws)) in idx.iter().zip(&w).enumerate() {
            for (&e, &wv) in ids.iter().zip(ws) {
                assignments.push((t as u32, e as usize, wv));
            }
        }
        self.run_experts(&x.to_dtype(DType::BF16)?, &assignments, 0)
    }

    /// Per received row: its local experts and gate weights, from the received top-k ids (`-1`: an expert
    /// of another rank) and weights, `[N, K]` each.
    fn assignments(&self, recv_idx: &[i64], recv_w: &[f32]) -> Vec<(u32, usize, f32)> {
        let k = self.config.topk;
        let mut out = Vec::new();
        for row in 0..recv_idx.len() / k {
            for j in 0..k {
                if recv_idx[row * k + j] >= 0 {
                    out.push((row as u32, recv_idx[row * k + j] as usize, recv_w[row * k + j]));
                }
            }
        }
        out
    }

    /// [`MoeLayer::forward_expert_parallel`] on moelink's CUDA backend with candle on the CPU: the routed
    /// tokens, ids and weights go up to the GPU, moelink's kernels dispatch them, the received rows come down
    /// for candle's experts, their outputs go up, moelink's kernels combine them, and the result comes down.
    /// Four host↔device copies each way per layer, which candle's CUDA tensors would avoid (README.md).
    pub fn forward_expert_parallel_on_gpu(&self, buf: &mut Buffer, x: &Tensor) -> Result<Tensor> {
        if !matches!(buf.location(), Location::Cuda(_)) || !x.device().is_cpu() {
            return Err(Error::Unsupported("this path takes CPU candle tensors and a CUDA-backend buffer".into()));
        }
        let (t, h) = x.dims2()?;
        let (e, k) = (self.config.num_experts, self.config.topk);
        let (idx, w) = self.route(x)?;
        let up = |data: moelink::Tensor| buf.upload(&data);
        let x_dev = up(moelink::Tensor::from_vec(x.to_dtype(DType::BF16)?.flatten_all()?.to_vec1::<half::bf16>()?, &[t, h])?)?;
        let idx_dev = up(moelink::Tensor::from_vec(idx.flatten_all()?.to_vec1::<i64>()?, &[t, k])?)?;
        let w_dev = up(moelink::Tensor::from_vec(w.flatten_all()?.to_vec1::<f32>()?, &[t, k])?)?;
        let layout = buf.get_dispatch_layout(idx_dev.view(), e)?;
        let args = DispatchArgs {
            x: Payload::Bf16(x_dev.view()),
            routing: Routing::Fresh { layout: layout.as_ref(), topk_idx: Some(idx_dev.view()), topk_weights: Some(w_dev.view()) },
            expert_alignment: 1,
            num_worst_tokens: 0,
            config: None,
        };
        let d = buf.dispatch(&args)?;
        let n = d.recv_x.shape()[0];
        let missing = || Error::Unsupported("the dispatch returned no top-k outputs".into());
        let recv_idx: Vec<i64> = d.recv_topk_idx.as_ref().ok_or_else(missing)?.to_vec()?;
        let recv_w: Vec<f32> = d.recv_topk_weights.as_ref().ok_or_else(missing)?.to_vec()?;
        let recv_x = Tensor::from_vec(d.recv_x.to_vec::<bf16>()?, (n, h), &Device::Cpu)?;
        let first = self.local_experts(buf.rank(), buf.num_ranks()).start;
        let y = self.run_experts(&recv_x, &self.assignments(&recv_idx, &recv_w), first)?.to_dtype(DType::BF16)?;
        let y_dev = buf.upload(&moelink::Tensor::from_vec(y.flatten_all()?.to_vec1::<half::bf16>()?, &[n, h])?)?;
        let args = CombineArgs { x: y_dev.view(), handle: &d.handle, topk_weights: None, bias: [None, None], config: None };
        let combined = buf.combine(&args)?.combined_x.to_vec::<bf16>()?;
        Ok(Tensor::from_vec(combined, (t, h), &Device::Cpu)?)
    }

    /// The layer with experts spread over `buf`'s ranks (collective: every rank calls it with its own
    /// tokens): route, dispatch the bf16 tokens with their top-k ids and weights, run the local experts on
    /// the received rows (each output scaled by its gate weight), combine back. Returns `[T, H]` bf16.
    /// Host backend, CPU tensors, no copies; [`MoeLayer::forward_expert_parallel_on_gpu`] for the CUDA one.
    pub fn forward_expert_parallel(&self, buf: &mut Buffer, x: &Tensor) -> Result<Tensor> {
        if buf.location() != Location::Host || !x.device().is_cpu() {
            return Err(Error::Unsupported(
                "this path moves CPU tensors on moelink's host backend; forward_expert_parallel_on_gpu takes a CUDA-backend buffer".into(),
            ));
        }
        let (t, h) = x.dims2()?;
        let (idx, w) = self.route(x)?;
        let x = x.to_dtype(DType::BF16)?.contiguous()?;
        let e = self.config.num_experts;
        let k = self.config.topk;
        // Dispatch from views of candle's storage into Vecs that become candle's storage.
        let (recv_x, recv_idx, recv_w, handle) = with_host_view::<bf16, _>(&x, |xv| {
            with_host_view::<i64, _>(&idx, |iv| {
                with_host_view::<f32, _>(&w, |wv| {
                    let layout = buf.get_dispatch_layout(iv, e)?;
                    let args = DispatchArgs {
                        x: Payload::Bf16(xv),
                        routing: Routing::Fresh { layout: layout.as_ref(), topk_idx: Some(iv), topk_weights: Some(wv) },
                        expert_alignment: 1,
                        num_worst_tokens: 0,
                        config: None,
                    };
                    let plan = buf.prepare_dispatch(&args)?;
                    let n = plan.num_recv_rows();
                    let (mut rx, mut ri, mut rw) = (vec![bf16::ZERO; n * h], vec![0i64; n * k], vec![0f32; n * k]);
                    let out = DispatchOutputs {
                        recv_x: TensorMut::from_slice(&mut rx, &[n, h])?,
                        recv_scales: None,
                        recv_topk_idx: Some(TensorMut::from_slice(&mut ri, &[n, k])?),
                        recv_topk_weights: Some(TensorMut::from_slice(&mut rw, &[n, k])?),
                        rank_prefix_matrix: None,
                        recv_src_idx: None,
                        channels: None,
                    };
                    let handle = buf.dispatch_into(plan, &args, out)?;
                    Ok((rx, ri, rw, handle))
                })
            })
        })?;
        let n = recv_idx.len() / k;
        let assignments = self.assignments(&recv_idx, &recv_w);
        let recv_x = wrap_cpu(CpuStorage::BF16(recv_x), (n, h));
        let first = self.local_experts(buf.rank(), buf.num_ranks()).start;
        let y = self.run_experts(&recv_x, &assignments, first)?.to_dtype(DType::BF16)?.contiguous()?;
        // Combine from candle's storage of the expert outputs into a Vec that becomes the result's storage.
        let mut combined = vec![bf16::ZERO; t * h];
        with_host_view::<bf16, _>(&y, |yv| {
            let args = CombineArgs { x: yv, handle: &handle, topk_weights: None, bias: [None, None], config: None };
            let out = CombineOutputs { combined_x: TensorMut::from_slice(&mut combined, &[t, h])?, combined_topk_weights: None };
            Ok(buf.combine_into(&args, out)?)
        })?;
        Ok(wrap_cpu(CpuStorage::BF16(combined), (t, h)))
    }
}

/// A candle tensor owning `storage` as it is (no copy), contiguous, outside autograd.
fn wrap_cpu(storage: CpuStorage, shape: (usize, usize)) -> Tensor {
    Tensor::from_storage(Storage::Cpu(storage), shape, BackpropOp::none(), false)
}

/// Runs `f` with a moelink view of a contiguous CPU candle tensor's storage: no copy; the view lives as long
/// as candle's read lock on the storage.
pub fn with_host_view<T, R>(t: &Tensor, f: impl FnOnce(TensorRef<'_>) -> Result<R>) -> Result<R>
where
    T: candle_core::WithDType + moelink::Element,
{
    let (storage, layout) = t.storage_and_layout();
    let (start, end) =
        layout.contiguous_offsets().ok_or_else(|| Error::Unsupported("a moelink view needs a contiguous candle tensor".into()))?;
    let data: &[T] = match &*storage {
        candle_core::Storage::Cpu(cpu) => &cpu.as_slice::<T>()?[start..end],
        _ => return Err(Error::Unsupported("a host view needs a CPU tensor".into())),
    };
    f(TensorRef::from_slice(data, t.dims())?)
}

/// The largest `|a - b|` over the elements, and the largest `|b|`: the tests' tolerance is relative to it.
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> Result<(f32, f32)> {
    let (a, b) = (a.to_dtype(DType::F32)?, b.to_dtype(DType::F32)?);
    let diff = (a - &b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
    let scale = b.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
    Ok((diff, scale))
}
