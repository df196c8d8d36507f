//! FP8 E4M3 conversion and the per-128-channel quantiser of low-latency dispatch.
//!
//! This module is the **oracle** the GPU kernels must match bit for bit (see `docs/oracle.md`).
//!
//! # The format
//! OCP FP8 E4M3 "fn" (`torch.float8_e4m3fn`): sign, 4 exponent bits (bias 7), 3 mantissa bits. No
//! infinities; `S.1111.111` (0x7F / 0xFF) is NaN, so the largest finite value is `S.1111.110` = 448.
//! Exponent field 0 holds subnormals `m * 2^-9` (m = 1..7), the smallest being 2^-9.
//!
//! # Rounding: `cvt.rn.satfinite.e4m3x2.f32`
//! [`f32_to_e4m3`] does what that PTX instruction does. The PTX ISA (`cvt`, "Saturation modifier")
//! says: *".satfinite: ... if the input value is NaN, then the result is NaN in the specified destination
//! format. If the absolute value of input (ignoring sign) is greater than MAX_NORM of the specified
//! destination format, then the result is sign-preserved MAX_NORM of the destination format."* With
//! `.rn` the in-range values round to nearest, ties to even. So:
//! - finite values round to nearest-even; everything whose magnitude exceeds 448, including the exact
//!   midpoint 464 (which rounds to 448 anyway: 448 has the even mantissa), 480, 1e9 and ±inf, becomes ±448;
//! - values at or below 2^-10 (half the smallest subnormal) become a zero of the input's sign;
//! - NaN becomes the canonical NaN 0x7F. PTX only promises "NaN"; we drop the sign because on the GPU
//!   the quantiser's `x * scale` (an `fmul`) returns NVIDIA's canonical f32 NaN 0x7FFFFFFF (positive)
//!   for any NaN operand, so the quantiser can only produce 0x7F. (Not yet confirmed on our GPUs; a GPU
//!   test feeding a negative NaN would pin it.)
//!
//! The `float8` crate (a port of the host emulation in CUDA's `cuda_fp8.hpp`, `__NV_SATFINITE`) agrees
//! with [`f32_to_e4m3`] on every non-NaN input we sweep (see the tests), including saturation of ±inf to
//! ±448; it differs only on negative NaN, where it keeps the sign (0xFF). We use our own function either
//! way, so the oracle does not depend on another crate's choices.
//!
//! # The quantiser
//! [`quantize_token`] implements `crate::ll`'s FP8 rule per 128-channel group:
//! `amax = max(max_c |x_c|, 1e-4)` in f32 (`max` ignores NaN, as the GPU's `fmaxf`);
//! without `round_scale`: `scale = 448 / amax`, `scale_inv = amax / 448` (two IEEE f32 divisions — a GPU
//! kernel must use `__fdiv_rn`, not a multiply by a rounded reciprocal);
//! with `round_scale`: `scale_inv = 2^ceil(log2(amax / 448))`, computed exactly from the bits of the f32
//! quotient ([`ceil_log2`]), and `scale = 2^-e` exactly;
//! then `q_c = f32_to_e4m3(x_c * scale)`, one f32 multiply (no fused operations).
//! UE8M0 scales store [`ue8m0_byte`]`(scale_inv)`, four per int32, group `4j` in the low byte
//! ([`pack_ue8m0`]).

use half::bf16;

/// Largest finite E4M3 value.
pub const E4M3_MAX: f32 = 448.0;
/// Encoding of +448 (`0.1111.110`).
pub const E4M3_MAX_BITS: u8 = 0x7E;
/// The canonical E4M3 NaN (`0.1111.111`).
pub const E4M3_NAN_BITS: u8 = 0x7F;
/// Channels per quantisation group (one scale each).
pub const GROUP: usize = 128;
/// Floor of a group's amax, so that an all-zero group still gets a finite scale.
pub const AMAX_FLOOR: f32 = 1e-4;
/// UE8M0 scales pack this many groups into one int32.
pub const UE8M0_PER_INT: usize = 4;

/// Converts f32 to E4M3 bits exactly as `cvt.rn.satfinite.e4m3x2.f32`: round-to-nearest-even,
/// magnitudes beyond 448 (and ±inf) saturate to ±448, NaN becomes 0x7F.
pub fn f32_to_e4m3(x: f32) -> u8 {
    let bits = x.to_bits();
    let sign = ((bits >> 24) & 0x80) as u8;
    let abs = bits & 0x7FFF_FFFF;
    if abs > 0x7F80_0000 {
        return E4M3_NAN_BITS;
    }
    if f32::from_bits(abs) > E4M3_MAX {
        return sign | E4M3_MAX_BITS;
    }
    // f32 subnormals (< 2^-126) are far below half the smallest E4M3 subnormal (2^-10): they round to zero.
    let biased = (abs >> 23) as i32;
    if biased == 0 {
        return sign;
    }
    let exp = biased - 127;
    // value = significand * 2^(exp - 23)
    let significand = u64::from((abs & 0x7F_FFFF) | 0x80_0000);
    // The quantum at this magnitude: 3 mantissa bits below the leading one, but never finer than the
    // subnormal spacing 2^-9 (the leading one of the smallest normal is 2^-6).
    let quantum_exp = exp.max(-6) - 3;
    let shift = (23 + quantum_exp - exp) as u32; // >= 20
    let n = round_shift_nearest_even(significand, shift);
    // Value = n * 2^quantum_exp with n <= 16; re-normalise a carry out of the mantissa (n == 16).
    let (n, quantum_exp) = if n >= 16 { (n >> 1, quantum_exp + 1) } else { (n, quantum_exp) };
    let code = if n >= 8 {
        // Normal: n = 8 + mantissa, value = 2^(quantum_exp + 3) * (1 + mantissa / 8).
        (((quantum_exp + 3 + 7) as u64) << 3) | (n - 8)
    } else {
        // Subnormal (quantum_exp is -9 here): value = n * 2^-9.
        n
    };
    sign | code as u8
}

/// `v >> shift`, rounded to nearest, ties to even (`shift` may exceed the width: the result is then 0).
fn round_shift_nearest_even(v: u64, shift: u32) -> u64 {
    if shift == 0 {
        return v;
    }
    if shift > 63 {
        return 0;
    }
    let kept = v >> shift;
    let rest = v & ((1u64 << shift) - 1);
    let half = 1u64 << (shift - 1);
    if rest > half || (rest == half && kept & 1 == 1) {
        kept + 1
    } else {
        kept
    }
}

/// Decodes E4M3 bits to f32 (exact). `0x7F`/`0xFF` decode to NaN.
pub fn e4m3_to_f32(b: u8) -> f32 {
    let negative = b & 0x80 != 0;
    let exp = i32::from((b >> 3) & 0xF);
    let mantissa = i32::from(b & 0x7);
    let magnitude = if exp == 0xF && mantissa == 0x7 {
        f32::NAN
    } else if exp == 0 {
        mantissa as f32 * exp2i(-9)
    } else {
        (8 + mantissa) as f32 * exp2i(exp - 10)
    };
    if negative {
        -magnitude
    } else {
        magnitude
    }
}

/// `2^e` as f32, exactly: subnormal below 2^-126, 0 below 2^-149, +inf above 2^127.
pub fn exp2i(e: i32) -> f32 {
    if e > 127 {
        f32::INFINITY
    } else if e >= -126 {
        f32::from_bits(((e + 127) as u32) << 23)
    } else if e >= -149 {
        f32::from_bits(1u32 << (e + 149))
    } else {
        0.0
    }
}

/// `ceil(log2(x))` for a positive f32, exactly from its bits: the exponent, plus one when the
/// significand has any bit below the leading one. Subnormals are handled (`x = m * 2^-149`). Returns 128
/// for +inf. `x` must be positive and not NaN (the quantiser's quotient always is).
pub fn ceil_log2(x: f32) -> i32 {
    let bits = x.to_bits() & 0x7FFF_FFFF;
    let biased = (bits >> 23) as i32;
    let mantissa = bits & 0x7F_FFFF;
    if biased == 0 {
        // Subnormal: x = mantissa * 2^-149, and ceil(log2(m)) = bit length of (m - 1).
        if mantissa == 0 {
            return -149; // x == 0 has no logarithm; the smallest exponent keeps callers finite
        }
        return -149 + (32 - (mantissa - 1).leading_zeros()) as i32;
    }
    biased - 127 + i32::from(mantissa != 0)
}

/// The group scale pair `(scale, scale_inv)` for a group whose largest magnitude is `amax` (already
/// floored at [`AMAX_FLOOR`]).
pub fn group_scales(amax: f32, round_scale: bool) -> (f32, f32) {
    if round_scale {
        let e = ceil_log2(amax / E4M3_MAX);
        (exp2i(-e), exp2i(e))
    } else {
        (E4M3_MAX / amax, amax / E4M3_MAX)
    }
}

/// Quantises one token (`x.len()` a multiple of 128) per 128-channel group, as documented in
/// [`crate::ll`]: writes `q[c] = f32_to_e4m3(x[c] * scale)` and `scale_inv[g]`.
///
/// # Panics
/// When `x.len()` is not a multiple of 128, `q.len() != x.len()` or `scale_inv.len() != x.len() / 128`.
pub fn quantize_token(x: &[bf16], round_scale: bool, q: &mut [u8], scale_inv: &mut [f32]) {
    assert!(x.len() % GROUP == 0 && q.len() == x.len() && scale_inv.len() == x.len() / GROUP, "quantize_token: mismatched lengths");
    for ((xg, qg), si) in x.chunks_exact(GROUP).zip(q.chunks_exact_mut(GROUP)).zip(scale_inv.iter_mut()) {
        let amax = xg.iter().fold(0.0f32, |m, v| m.max(v.to_f32().abs())).max(AMAX_FLOOR);
        let (scale, inv) = group_scales(amax, round_scale);
        *si = inv;
        for (o, v) in qg.iter_mut().zip(xg) {
            *o = f32_to_e4m3(v.to_f32() * scale);
        }
    }
}

/// Dequantises one token: `out[c] = e4m3_to_f32(q[c]) * scale_inv[c / 128]` (one f32 multiply).
///
/// # Panics
/// When the lengths do not match as in [`quantize_token`].
pub fn dequantize_token(q: &[u8], scale_inv: &[f32], out: &mut [f32]) {
    assert!(q.len() % GROUP == 0 && out.len() == q.len() && scale_inv.len() == q.len() / GROUP, "dequantize_token: mismatched lengths");
    for ((qg, og), si) in q.chunks_exact(GROUP).zip(out.chunks_exact_mut(GROUP)).zip(scale_inv) {
        for (o, b) in og.iter_mut().zip(qg) {
            *o = e4m3_to_f32(*b) * *si;
        }
    }
}

/// The UE8M0 byte of a power-of-two scale: its biased f32 exponent, `log2(scale_inv) + 127`. Only
/// meaningful for normal powers of two (what `round_scale` produces); other values lose their mantissa.
pub fn ue8m0_byte(scale_inv: f32) -> u8 {
    ((scale_inv.to_bits() >> 23) & 0xFF) as u8
}

/// The power of two a UE8M0 byte stands for (`2^(b - 127)`; 255 is NaN in the OCP format, here +inf).
pub fn ue8m0_to_f32(b: u8) -> f32 {
    exp2i(i32::from(b) - 127)
}

/// Packs four UE8M0 bytes into one int32, group `4j` in the low byte (little-endian).
pub fn pack_ue8m0(bytes: [u8; 4]) -> i32 {
    i32::from_le_bytes(bytes)
}

/// Packs the power-of-two scales of one token (`4 * out.len()` of them) into int32 UE8M0 words.
///
/// # Panics
/// When `scale_inv.len() != 4 * out.len()`.
pub fn pack_ue8m0_scales(scale_inv: &[f32], out: &mut [i32]) {
    assert_eq!(scale_inv.len(), UE8M0_PER_INT * out.len(), "pack_ue8m0_scales: mismatched lengths");
    for (o, s) in out.iter_mut().zip(scale_inv.chunks_exact(UE8M0_PER_INT)) {
        *o = pack_ue8m0([ue8m0_byte(s[0]), ue8m0_byte(s[1]), ue8m0_byte(s[2]), ue8m0_byte(s[3])]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The value of an encoding straight from the format definition, in f64.
    fn definition_value(b: u8) -> Option<f64> {
        let s = if b & 0x80 != 0 { -1.0 } else { 1.0 };
        let e = ((b >> 3) & 0xF) as i32;
        let m = (b & 7) as f64;
        match (e, b & 7) {
            (15, 7) => None,
            (0, _) => Some(s * (m / 8.0) * 2f64.powi(-6)),
            _ => Some(s * (1.0 + m / 8.0) * 2f64.powi(e - 7)),
        }
    }

    /// The next f32 above a non-negative `x` (`f32::next_up` needs Rust 1.86; the MSRV is 1.85).
    fn up(x: f32) -> f32 {
        f32::from_bits(x.to_bits() + 1)
    }
    /// The next f32 below a positive `x`.
    fn down(x: f32) -> f32 {
        f32::from_bits(x.to_bits() - 1)
    }

    /// Non-negative finite values in increasing order with their codes (0x00..=0x7E).
    fn positive_values() -> Vec<(u8, f32)> {
        (0u8..=0x7E).map(|b| (b, definition_value(b).unwrap_or(f64::NAN) as f32)).collect()
    }

    #[test]
    fn all_256_encodings_decode_to_their_definition() {
        for b in 0..=255u8 {
            let got = e4m3_to_f32(b);
            match definition_value(b) {
                None => assert!(got.is_nan(), "{b:#04x}"),
                Some(v) => {
                    assert_eq!(got as f64, v, "{b:#04x}");
                    assert_eq!(got.is_sign_negative(), b & 0x80 != 0, "{b:#04x} sign");
                }
            }
        }
        assert_eq!(e4m3_to_f32(0x7E), 448.0);
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9));
        assert_eq!(e4m3_to_f32(0x07), 7.0 * 2f32.powi(-9));
        assert_eq!(e4m3_to_f32(0x08), 2f32.powi(-6));
        assert_eq!(e4m3_to_f32(0x38), 1.0);
    }

    #[test]
    fn every_value_round_trips() {
        for b in 0..=255u8 {
            if b & 0x7F == 0x7F {
                continue;
            }
            assert_eq!(f32_to_e4m3(e4m3_to_f32(b)), b, "{b:#04x}");
        }
    }

    #[test]
    fn midpoints_round_to_even_and_neighbours_round_to_nearest() {
        let vals = positive_values();
        for w in vals.windows(2) {
            let ((ca, a), (cb, b)) = (w[0], w[1]);
            let mid = (a + b) / 2.0; // exact: both are short dyadic fractions
            assert_eq!(mid as f64, (a as f64 + b as f64) / 2.0);
            let even = if ca % 2 == 0 { ca } else { cb };
            for sign in [0u8, 0x80] {
                let s = if sign == 0 { 1.0 } else { -1.0 };
                assert_eq!(f32_to_e4m3(s * mid), sign | even, "midpoint {mid}");
                assert_eq!(f32_to_e4m3(s * up(mid)), sign | cb, "just above {mid}");
                assert_eq!(f32_to_e4m3(s * down(mid)), sign | ca, "just below {mid}");
                assert_eq!(f32_to_e4m3(s * up(a)), sign | ca);
                assert_eq!(f32_to_e4m3(s * down(b)), sign | cb);
            }
        }
    }

    #[test]
    fn subnormal_boundaries() {
        let tiny = 2f32.powi(-9);
        assert_eq!(f32_to_e4m3(tiny / 2.0), 0x00, "2^-10 ties to the even zero");
        assert_eq!(f32_to_e4m3(up(tiny / 2.0)), 0x01);
        assert_eq!(f32_to_e4m3(-up(tiny / 2.0)), 0x81);
        assert_eq!(f32_to_e4m3(-(tiny / 2.0)), 0x80, "negative underflow keeps the sign");
        assert_eq!(f32_to_e4m3(1.5 * tiny), 0x02, "1.5 * 2^-9 ties to 2 * 2^-9");
        assert_eq!(f32_to_e4m3(2.5 * tiny), 0x02);
        // Largest subnormal to smallest normal: 7.5 * 2^-9 ties to 8 * 2^-9 = 2^-6 (code 0x08, even).
        assert_eq!(f32_to_e4m3(7.5 * tiny), 0x08);
        assert_eq!(f32_to_e4m3(7.5 * tiny - tiny / 64.0), 0x07);
        assert_eq!(f32_to_e4m3(f32::from_bits(1)), 0x00, "f32 subnormal");
        assert_eq!(f32_to_e4m3(-f32::from_bits(1)), 0x80);
        assert_eq!(f32_to_e4m3(f32::MIN_POSITIVE), 0x00);
    }

    #[test]
    fn saturation_signed_zero_and_nan() {
        for (v, code) in [
            (448.0f32, 0x7E),
            (449.0, 0x7E),
            (464.0, 0x7E),
            (up(464.0f32), 0x7E),
            (480.0, 0x7E),
            (1e9, 0x7E),
            (f32::MAX, 0x7E),
            (f32::INFINITY, 0x7E),
            (416.0, 0x7D),
            (432.0, 0x7E), // midpoint 416..448: 0x7D is odd, rounds up to 0x7E
            (0.0, 0x00),
        ] {
            assert_eq!(f32_to_e4m3(v), code, "{v}");
            assert_eq!(f32_to_e4m3(-v), code | 0x80, "-{v}");
        }
        assert_eq!(f32_to_e4m3(f32::NAN), 0x7F);
        assert_eq!(f32_to_e4m3(-f32::NAN), 0x7F);
        assert_eq!(f32_to_e4m3(f32::from_bits(0x7F80_0001)), 0x7F);
        assert!(e4m3_to_f32(0xFF).is_nan());
    }

    /// The `float8` crate follows `cuda_fp8.hpp`'s host emulation with `__NV_SATFINITE`. Over this sweep
    /// it matches our conversion on every non-NaN f32 (±inf saturate to ±448 there too); for NaN it keeps
    /// the sign (0xFF for a negative NaN), where we return the canonical 0x7F (see the module docs).
    #[test]
    fn matches_float8_crate_except_nan_sign() {
        let check = |x: f32| {
            let theirs = float8::F8E4M3::from_f32(x).to_bits();
            let ours = f32_to_e4m3(x);
            if x.is_nan() {
                assert_eq!(ours, 0x7F);
                assert_eq!(theirs & 0x7F, 0x7F);
            } else {
                assert_eq!(ours, theirs, "x = {x:e} ({:#010x})", x.to_bits());
            }
            // Decoding agrees on every non-NaN code.
            if ours & 0x7F != 0x7F {
                assert_eq!(e4m3_to_f32(ours).to_bits(), float8::F8E4M3::from_bits(ours).to_f32().to_bits());
            }
        };
        // A stride through every f32 bit pattern (both signs, all exponents, NaN and inf included).
        let mut bits = 0u32;
        loop {
            check(f32::from_bits(bits));
            match bits.checked_add(65_521) {
                Some(b) => bits = b,
                None => break,
            }
        }
        // Dense around the E4M3 range: every f32 between 2^-11 and 512 with 12 low mantissa bits dropped.
        let (lo, hi) = ((2f32.powi(-11)).to_bits(), 512f32.to_bits());
        for b in (lo..=hi).step_by(1 << 12) {
            check(f32::from_bits(b));
            check(-f32::from_bits(b));
            check(f32::from_bits(b + 1));
        }
        for special in [0.0, -0.0, f32::INFINITY, f32::NEG_INFINITY, 464.0, -464.0, 448.0, 480.0] {
            check(special);
        }
    }

    #[test]
    fn ceil_log2_is_exact_including_subnormals() {
        assert_eq!(ceil_log2(1.0), 0);
        assert_eq!(ceil_log2(up(1.0f32)), 1);
        assert_eq!(ceil_log2(down(1.0f32)), 0);
        assert_eq!(ceil_log2(0.5), -1);
        assert_eq!(ceil_log2(3.0), 2);
        assert_eq!(ceil_log2(4.0), 2);
        assert_eq!(ceil_log2(f32::MIN_POSITIVE), -126);
        assert_eq!(ceil_log2(down(f32::MIN_POSITIVE)), -126, "largest subnormal");
        assert_eq!(ceil_log2(f32::from_bits(1)), -149);
        assert_eq!(ceil_log2(f32::from_bits(2)), -148);
        assert_eq!(ceil_log2(f32::from_bits(3)), -147);
        assert_eq!(ceil_log2(f32::from_bits(4)), -147);
        assert_eq!(ceil_log2(f32::MAX), 128);
        assert_eq!(ceil_log2(f32::INFINITY), 128);
        for e in -149..=127 {
            let p = exp2i(e);
            assert_eq!(ceil_log2(p), e, "2^{e}");
            assert_eq!(p as f64, 2f64.powi(e));
        }
    }

    #[test]
    fn ue8m0_bytes_and_packing() {
        assert_eq!(ue8m0_byte(1.0), 127);
        assert_eq!(ue8m0_byte(2f32.powi(-20)), 107);
        assert_eq!(ue8m0_byte(2f32.powi(10)), 137);
        for e in -126..=127 {
            assert_eq!(ue8m0_to_f32(ue8m0_byte(exp2i(e))), exp2i(e));
        }
        assert_eq!(pack_ue8m0([1, 2, 3, 4]), 0x0403_0201);
        let mut out = [0i32; 2];
        pack_ue8m0_scales(&[1.0, 2.0, 0.5, 4.0, 1.0, 1.0, 1.0, 2f32.powi(-128 + 2)], &mut out);
        assert_eq!(out[0], i32::from_le_bytes([127, 128, 126, 129]));
        assert_eq!(out[1], i32::from_le_bytes([127, 127, 127, 1]));
    }

    fn bf(v: f32) -> bf16 {
        bf16::from_f32(v)
    }

    #[test]
    fn quantiser_plain_scale() {
        // Group 0: amax 3.5 -> scale_inv = 3.5/448, scale = 448/3.5 = 128; group 1: all zero -> floor.
        let mut x = vec![bf(0.0); 256];
        x[0] = bf(-3.5);
        x[1] = bf(1.0);
        x[2] = bf(0.01);
        let (mut q, mut s) = (vec![0u8; 256], vec![0f32; 2]);
        quantize_token(&x, false, &mut q, &mut s);
        assert_eq!(s[0].to_bits(), (3.5f32 / 448.0).to_bits());
        assert_eq!(s[1].to_bits(), (1e-4f32 / 448.0).to_bits());
        assert_eq!(q[0], 0xFE, "-amax maps to -448");
        assert_eq!(q[1], f32_to_e4m3(1.0 * (448.0 / 3.5)));
        assert_eq!(q[2], f32_to_e4m3(bf(0.01).to_f32() * (448.0 / 3.5)));
        assert!(q[3..].iter().all(|&b| b == 0));
    }

    #[test]
    fn plain_scales_are_ieee_divisions() {
        // `amax / 448` and `448 / amax`, not `amax * (1/448)`: the two differ in the last bit for some
        // amax, and a kernel that multiplies by a rounded reciprocal would not match the oracle there.
        let mut differs = 0;
        for bits in (0x3800u16..0x4400).step_by(3) {
            let amax = bf16::from_bits(bits).to_f32();
            let (scale, inv) = group_scales(amax, false);
            assert_eq!(inv.to_bits(), (amax / 448.0).to_bits());
            assert_eq!(scale.to_bits(), (448.0 / amax).to_bits());
            differs += usize::from(inv.to_bits() != (amax * (1.0 / 448.0)).to_bits());
        }
        assert!(differs > 0);
    }

    #[test]
    fn quantiser_round_scale_is_a_power_of_two_covering_amax() {
        let mut x = vec![bf(0.0); 512];
        let amaxes = [1.0f32, 448.0, 500.0, 3e-3];
        for (g, a) in amaxes.iter().enumerate() {
            x[g * 128 + 5] = bf(*a);
            x[g * 128 + 6] = bf(-a / 3.0);
        }
        let (mut q, mut s) = (vec![0u8; 512], vec![0f32; 4]);
        quantize_token(&x, true, &mut q, &mut s);
        for (g, a) in amaxes.iter().enumerate() {
            let a = bf(*a).to_f32();
            let e = (a as f64 / 448.0).log2().ceil() as i32;
            assert_eq!(s[g], exp2i(e), "group {g}");
            assert!(a / s[g] <= 448.0);
            assert_eq!(q[g * 128 + 5], f32_to_e4m3(a * exp2i(-e)));
        }
        // 448 / 448 = 1 exactly: scale_inv 1, the value maps to 448 itself.
        assert_eq!(s[1], 1.0);
        assert_eq!(q[128 + 5], 0x7E);
        let mut packed = [0i32; 1];
        pack_ue8m0_scales(&s, &mut packed);
        assert_eq!(
            packed[0].to_le_bytes(),
            [(127 + ceil_log2(1.0 / 448.0)) as u8, 127, 128, (127 + ceil_log2(bf(3e-3).to_f32() / 448.0)) as u8]
        );
    }

    #[test]
    fn quantise_dequantise_error_is_within_e4m3_precision() {
        let x: Vec<bf16> = (0..1024).map(|i| bf(((i * 37 % 101) as f32 - 50.0) * 0.173)).collect();
        for round_scale in [false, true] {
            let (mut q, mut s, mut d) = (vec![0u8; 1024], vec![0f32; 8], vec![0f32; 1024]);
            quantize_token(&x, round_scale, &mut q, &mut s);
            dequantize_token(&q, &s, &mut d);
            for (g, (xg, dg)) in x.chunks(128).zip(d.chunks(128)).enumerate() {
                let amax = xg.iter().map(|v| v.to_f32().abs()).fold(0.0, f32::max);
                for (a, b) in xg.iter().zip(dg) {
                    let a = a.to_f32();
                    // Relative 2^-4 for normals, absolute half a subnormal step below them.
                    let tol = (a.abs() / 16.0).max(s[g] * 2f32.powi(-10)) * 1.0001;
                    assert!((a - b).abs() <= tol, "group {g}: {a} vs {b} (amax {amax}, round_scale {round_scale})");
                }
            }
        }
    }
}
