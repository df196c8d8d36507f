//! The GPU tests' low-latency experts: what each local expert computes from the rows a dispatch delivered,
//! and the bits of what a combine returned.

use half::bf16;
use moelink::{fp8, LlQuant, Result, Tensor};

/// Expert outputs `y [local_experts, rows, hidden]` of the rows a low-latency dispatch delivered to rank `me`
/// (`recv_x [local_experts, rows, hidden]` bf16 or FP8 bytes, FP8 `scales [local_experts, cols, rows]` as
/// bytes, `count [local_experts]`): global expert `e` multiplies its dequantised input by
/// `(e % 5) * 0.5 - 1`; rows past an expert's count stay zero.
#[allow(clippy::too_many_arguments)]
pub fn scaled_expert_outputs(
    me: usize,
    local_experts: usize,
    rows: usize,
    hidden: usize,
    quant: LlQuant,
    recv_x: &[u8],
    scales: &[u8],
    count: &[i32],
) -> Vec<bf16> {
    let (cols, h) = (quant.num_scale_cols(hidden), hidden);
    let mut y = vec![bf16::ZERO; local_experts * rows * h];
    for (el, &n) in count.iter().enumerate() {
        let f = ((me * local_experts + el) % 5) as f32 * 0.5 - 1.0;
        for slot in 0..(n.max(0) as usize).min(rows) {
            for i in 0..h {
                let v = match quant {
                    LlQuant::Bf16 => {
                        let at = 2 * ((el * rows + slot) * h + i);
                        bf16::from_le_bytes([recv_x[at], recv_x[at + 1]]).to_f32()
                    }
                    LlQuant::Fp8 { use_ue8m0, .. } => {
                        let col = if use_ue8m0 { i / 512 } else { i / 128 };
                        let at = 4 * ((el * cols + col) * rows + slot);
                        let w = [scales[at], scales[at + 1], scales[at + 2], scales[at + 3]];
                        let inv = if use_ue8m0 { fp8::ue8m0_to_f32(w[(i / 128) % 4]) } else { f32::from_le_bytes(w) };
                        fp8::e4m3_to_f32(recv_x[(el * rows + slot) * h + i]) * inv
                    }
                };
                y[(el * rows + slot) * h + i] = bf16::from_f32(v * f);
            }
        }
    }
    y
}

/// The bits of a bf16 tensor (any location), for bitwise comparisons.
pub fn bf16_bits(t: &Tensor) -> Result<Vec<u16>> {
    Ok(t.to_vec::<bf16>()?.into_iter().map(|v| v.to_bits()).collect())
}
