//! Random payloads: finite bf16 and FP8 values, top-k weights.

use half::bf16;
use moelink::Fp8E4M3;

use crate::rng::Rng;

/// `n` bf16 values with exponents in [-7, 7] and random signs and mantissas (never zero, NaN or infinite),
/// four per draw.
pub fn random_bf16(rng: &mut Rng, n: usize) -> Vec<bf16> {
    let mut v = Vec::with_capacity(n);
    while v.len() < n {
        let bits = rng.next_u64();
        for j in 0..4 {
            if v.len() == n {
                break;
            }
            let r = (bits >> (16 * j)) as u16;
            let sign = r & 0x8000;
            let exp = 120 + (r >> 7 & 0xff) % 15;
            v.push(bf16::from_bits(sign | (exp << 7) | (r & 0x7f)));
        }
    }
    v
}

/// `n` FP8 E4M3 values, never NaN (`0x7f`/`0xff` become `0x7e`/`0xfe`), eight per draw.
pub fn random_fp8(rng: &mut Rng, n: usize) -> Vec<Fp8E4M3> {
    let mut v = Vec::with_capacity(n);
    while v.len() < n {
        for b in rng.next_u64().to_le_bytes() {
            if v.len() < n {
                v.push(Fp8E4M3(if b & 0x7f == 0x7f { b & 0xfe } else { b }));
            }
        }
    }
    v
}

/// Positive weights in [0.01, 1.01).
pub fn random_weights(rng: &mut Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.uniform() as f32 + 0.01).collect()
}

/// FP8 E4M3 byte → bf16 bits (exact: every finite E4M3 value is a bf16 value).
pub fn fp8_to_bf16_table() -> [u16; 256] {
    let mut t = [0u16; 256];
    for (b, v) in t.iter_mut().enumerate() {
        *v = bf16::from_f32(moelink::fp8::e4m3_to_f32(b as u8)).to_bits();
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_values_are_finite() {
        let mut r = Rng::new(9);
        assert!(random_bf16(&mut r, 1001).iter().all(|v| v.to_f32().is_finite() && v.to_f32() != 0.0));
        assert!(random_fp8(&mut r, 1001).iter().all(|b| b.0 & 0x7f != 0x7f));
        assert!(random_weights(&mut r, 100).iter().all(|w| (0.01..1.01).contains(w)));
        let lut = fp8_to_bf16_table();
        assert_eq!(lut[0x38], bf16::ONE.to_bits());
        assert_eq!(bf16::from_bits(lut[0x7e]).to_f32(), 448.0);
    }
}
