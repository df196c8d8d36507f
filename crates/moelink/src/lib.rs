//! # moelink
//!
//! Expert-parallel communication for Mixture-of-Experts models: **dispatch** (send each token to the ranks
//! hosting its selected experts) and **combine** (bring the expert outputs back and sum them), in a
//! high-throughput form for training/prefill and a low-latency form for decoding.
//!
//! Layers: [`moelink_cuda`] (the only `unsafe` CUDA code) → this crate's validating core ([`ht`], [`ll`],
//! `validate`) → [`Buffer`], the safe public API, running on a backend: `host` (CPU
//! threads, the reference every GPU kernel is tested against) or `cuda`.
//!
//! ```
//! use std::sync::Arc;
//! use moelink::{group::run_ranks, Group, BackendKind, Buffer, BufferOptions, Payload, DispatchArgs, Routing, Tensor, TensorRef};
//! use half::bf16;
//!
//! let results = run_ranks(2, |group| {
//!     let rank = group.rank();
//!     // 3 tokens of hidden size 8, top-2 of 4 experts (2 per rank); the buffer sized for them, as on a GPU.
//!     let options = BufferOptions {
//!         backend: BackendKind::Host,
//!         num_nvl_bytes: Buffer::ht_bytes_needed(3, 8, 2, 2, false),
//!         ..Default::default()
//!     };
//!     let mut buf = Buffer::new(Arc::new(group), options)?;
//!     let x = Tensor::from_vec(vec![bf16::from_f32(rank as f32); 3 * 8], &[3, 8])?;
//!     let topk = Tensor::from_vec(vec![0i64, 3, 1, -1, 2, 3], &[3, 2])?;
//!     let layout = buf.get_dispatch_layout(topk.view(), 4)?;
//!     let out = buf.dispatch(&DispatchArgs {
//!         x: Payload::Bf16(x.view()),
//!         routing: Routing::Fresh { layout: layout.as_ref(), topk_idx: None, topk_weights: None },
//!         expert_alignment: 1,
//!         num_worst_tokens: 0,
//!         config: None,
//!     })?;
//!     Ok(out.recv_x.shape()[0])
//! });
//! // rank 0 hosts experts 0,1: tokens 0 and 1 of both ranks; rank 1 hosts 2,3: tokens 0 and 2 of both.
//! assert!(results.iter().all(|r| matches!(r, Ok(4))));
//! ```

// `unsafe` belongs to the CUDA layer (docs/architecture.md).
#![forbid(unsafe_code)]

mod backend;
pub mod buffer;
pub mod config;
pub mod diag;
pub mod dtype;
pub mod error;
pub mod fp8;
pub mod graph;
pub mod group;
pub mod ht;
pub mod internode;
pub mod layout;
pub mod ll;
mod opaque;
pub mod rdma_probe;
pub mod reduce;
pub mod stream;
pub mod tensor;
pub mod trace;
pub(crate) mod validate;

pub use backend::LayoutOutputs;
pub use buffer::{fresh, Buffer, CombineResult, DispatchLayout, DispatchResult, LlDispatchResult, RecvHook};
#[doc(hidden)]
pub use config::Tuning;
pub use config::{BackendKind, BufferOptions, Config, KernelTracing, MAX_TIMEOUT_MS};
pub use dtype::{DType, Element, Fp8E4M3};
pub use error::{Error, Phase, Result};
pub use graph::{HtGraph, HtGraphSpec, LlGraph, LlGraphCombine, LlGraphSpec, LlGraphSplit};
pub use group::{Group, TcpGroup, ThreadGroup};
pub use ht::{
    ChannelOutputs, CombineArgs, CombineOutputs, DispatchArgs, DispatchOutputs, DispatchPlan, HtHandle, LayoutRef, Payload, Routing,
};
pub use internode::{EmuNicOptions, RdmaOptions, Topology, Transport};
pub use ll::{LlCombineArgs, LlCombineOutputs, LlDispatchArgs, LlDispatchOutputs, LlHandle, LlQuant};
pub use stream::{ForeignStream, StreamScope};
pub use tensor::{Layout, Location, MemMut, MemRef, Place, Tensor, TensorMut, TensorRef};

/// Re-export of the bf16 type used for hidden states.
pub use half::bf16;
