//! ggml's reference quantisers (`quantize_row_*_ref` in ggml-quants.c, llama.cpp 0c1e57098 as
//! vendored by llama-cpp-python 0.3.36), operation for operation in f32 so the bytes are identical:
//! the same reductions in the same order, `nearest_int`'s round-half-even, C's truncating casts.
//!
//! - Q8_0: `d = amax/127`, `q = roundf(x/d)`.
//! - Q4_0: `d = max/−8` (max = the signed value of largest |x|), `q = min(15, (i8)(x/d + 8.5))`.
//! - Q4_1: `d = (max − min)/15`, `m = min`, `q = min(15, (i8)((x − min)/d + 0.5))`.
//! - Q5_0: `d = max/−16`, `q = min(31, (i8)(x/d + 16.5))`, the 5th bits packed into `qh`.
//! - Q4_K: per sub-block of 32, `make_qkx2_quants` fits `x ≈ scale·q − min` (weights `rms + |x|`,
//!   20 refinement steps); scales and mins are quantised to 6 bits against the block's largest.
//! - Q6_K: per sub-block of 16, `make_qx_quants` (weights x², 18 scale trials); scales to i8
//!   against the largest, values `q ∈ [−32, 31]`.
//! - MXFP4: `e = ⌊log₂ amax⌋ − 2 + 127` (so amax/2^(e−127) ∈ [4, 8) and saturates at E2M1's 6),
//!   each value the code of the nearest doubled E2M1 value times 2^(e − 128), ties to the lower
//!   code (so towards zero, and +0 for 0).

use super::quants::{GgmlType, KVALUES_MXFP4, dequantize, e8m0_to_f32_half};
use half::{bf16, f16};

const GROUP_MAX_EPS: f32 = 1e-15;

/// ggml's `nearest_int`: round half to even through the 1.5·2²³ trick (exact for |x| < 2²²).
fn nearest_int(x: f32) -> i32 {
    let val = x + 12_582_912.0;
    (val.to_bits() & 0x007f_ffff) as i32 - 0x0040_0000
}

fn put_f16(out: &mut Vec<u8>, x: f32) {
    out.extend_from_slice(&f16::from_f32(x).to_le_bytes());
}

fn f16_round(x: f32) -> f32 {
    f16::from_f32(x).to_f32()
}

/// The signed value of largest magnitude (the first, on ties) and that magnitude.
fn signed_max(x: &[f32]) -> (f32, f32) {
    let (mut amax, mut max) = (0.0f32, 0.0f32);
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    (max, amax)
}

fn q8_0(x: &[f32], out: &mut Vec<u8>) {
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    put_f16(out, d);
    out.extend(x.iter().map(|&v| (v * id).round() as i8 as u8));
}

fn q4_0(x: &[f32], out: &mut Vec<u8>) {
    let (max, _) = signed_max(x);
    let d = max / -8.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    put_f16(out, d);
    for j in 0..16 {
        let q = |v: f32| ((v * id + 8.5) as i8).min(15) as u8;
        out.push(q(x[j]) | (q(x[j + 16]) << 4));
    }
}

fn q4_1(x: &[f32], out: &mut Vec<u8>) {
    let (mut min, mut max) = (f32::MAX, -f32::MAX);
    for &v in x {
        if v < min {
            min = v;
        }
        if v > max {
            max = v;
        }
    }
    let d = (max - min) / 15.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    put_f16(out, d);
    put_f16(out, min);
    for j in 0..16 {
        let q = |v: f32| (((v - min) * id + 0.5) as i8).min(15) as u8;
        out.push(q(x[j]) | (q(x[j + 16]) << 4));
    }
}

fn q5_0(x: &[f32], out: &mut Vec<u8>) {
    let (max, _) = signed_max(x);
    let d = max / -16.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    put_f16(out, d);
    let q = |v: f32| ((v * id + 16.5) as i8).min(31) as u8;
    let mut qh = 0u32;
    let mut qs = [0u8; 16];
    for j in 0..16 {
        let (a, b) = (q(x[j]), q(x[j + 16]));
        qs[j] = (a & 0x0F) | ((b & 0x0F) << 4);
        qh |= (((a & 0x10) as u32) >> 4) << j;
        qh |= (((b & 0x10) as u32) >> 4) << (j + 16);
    }
    out.extend_from_slice(&qh.to_le_bytes());
    out.extend_from_slice(&qs);
}

/// `make_qkx2_quants`: `x ≈ scale·L − min`, `L ∈ [0, nmax]`, by weighted least squares over
/// `nstep + 1` candidate inverse scales. Returns `(scale, min)` (min ≥ 0, as ggml stores it).
#[allow(clippy::too_many_arguments)]
fn make_qkx2_quants(
    nmax: i32,
    x: &[f32],
    weights: &[f32],
    l_out: &mut [u8],
    rmin: f32,
    rdelta: f32,
    nstep: i32,
    use_mad: bool,
) -> (f32, f32) {
    let n = x.len();
    let mut laux = [0u8; 32];
    let (mut min, mut max) = (x[0], x[0]);
    let mut sum_w = weights[0];
    let mut sum_x = sum_w * x[0];
    for i in 1..n {
        if x[i] < min {
            min = x[i];
        }
        if x[i] > max {
            max = x[i];
        }
        let w = weights[i];
        sum_w += w;
        sum_x += w * x[i];
    }
    if min > 0.0 {
        min = 0.0;
    }
    if max == min {
        l_out[..n].fill(0);
        return (0.0, -min);
    }
    let err = |d: f32| if use_mad { d.abs() } else { d * d };
    let mut iscale = nmax as f32 / (max - min);
    let mut scale = 1.0 / iscale;
    let mut best_error = 0.0f32;
    for i in 0..n {
        let l = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
        l_out[i] = l as u8;
        let diff = scale * l_out[i] as f32 + min - x[i];
        best_error += weights[i] * err(diff);
    }
    if nstep < 1 {
        return (scale, -min);
    }
    for is in 0..=nstep {
        iscale = (rmin + rdelta * is as f32 + nmax as f32) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0.0f32, 0.0f32, 0.0f32);
        for i in 0..n {
            let l = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
            laux[i] = l as u8;
            let (w, l) = (weights[i], l as f32);
            sum_l += w * l;
            sum_l2 += w * l * l;
            sum_xl += w * l * x[i];
        }
        let d = sum_w * sum_l2 - sum_l * sum_l;
        if d > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / d;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / d;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let mut cur_error = 0.0f32;
            for i in 0..n {
                let diff = this_scale * laux[i] as f32 + this_min - x[i];
                cur_error += weights[i] * err(diff);
            }
            if cur_error < best_error {
                l_out[..n].copy_from_slice(&laux[..n]);
                best_error = cur_error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    (scale, -min)
}

fn q4_k(x: &[f32], out: &mut Vec<u8>) {
    let mut l = [0u8; 256];
    let (mut scales, mut mins) = ([0f32; 8], [0f32; 8]);
    let (mut max_scale, mut max_min) = (0.0f32, 0.0f32);
    for j in 0..8 {
        let xs = &x[32 * j..32 * j + 32];
        let mut sum_x2 = 0.0f32;
        for &v in xs {
            sum_x2 += v * v;
        }
        let av_x = (sum_x2 / 32.0).sqrt();
        let weights: Vec<f32> = xs.iter().map(|v| av_x + v.abs()).collect();
        let (s, m) = make_qkx2_quants(
            15,
            xs,
            &weights,
            &mut l[32 * j..32 * j + 32],
            -1.0,
            0.1,
            20,
            false,
        );
        scales[j] = s;
        mins[j] = m;
        if s > max_scale {
            max_scale = s;
        }
        if m > max_min {
            max_min = m;
        }
    }
    let inv_scale = if max_scale > 0.0 {
        63.0 / max_scale
    } else {
        0.0
    };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    let mut packed = [0u8; 12];
    for j in 0..8 {
        let ls = (nearest_int(inv_scale * scales[j]) as u8).min(63);
        let lm = (nearest_int(inv_min * mins[j]) as u8).min(63);
        if j < 4 {
            packed[j] = ls;
            packed[j + 4] = lm;
        } else {
            packed[j + 4] = (ls & 0xF) | ((lm & 0xF) << 4);
            packed[j - 4] |= (ls >> 4) << 6;
            packed[j] |= (lm >> 4) << 6;
        }
    }
    let (d, dmin) = (f16_round(max_scale / 63.0), f16_round(max_min / 63.0));
    for j in 0..8 {
        let (sc, m) = super::quants::scale_min_k4(j, &packed);
        let dj = d * sc as f32;
        if dj == 0.0 {
            continue; // ggml keeps make_qkx2_quants's levels here
        }
        let dm = dmin * m as f32;
        for ii in 0..32 {
            l[32 * j + ii] = nearest_int((x[32 * j + ii] + dm) / dj).clamp(0, 15) as u8;
        }
    }
    put_f16(out, max_scale / 63.0);
    put_f16(out, max_min / 63.0);
    out.extend_from_slice(&packed);
    for chunk in l.chunks_exact(64) {
        out.extend((0..32).map(|i| chunk[i] | (chunk[i + 32] << 4)));
    }
}

/// `make_qx_quants` with `rmse_type` 1 (weights x²): `x ≈ scale·(L − nmax)`, `L ∈ [0, 2·nmax)`.
fn make_qx_quants(nmax: i32, x: &[f32], l_out: &mut [i8]) -> f32 {
    let (max, amax) = signed_max(x);
    if amax < GROUP_MAX_EPS {
        l_out.fill(0);
        return 0.0;
    }
    let level = |iscale: f32, v: f32| nearest_int(iscale * v).clamp(-nmax, nmax - 1);
    let mut iscale = -nmax as f32 / max;
    let (mut sumlx, mut suml2) = (0.0f32, 0.0f32);
    for (i, &v) in x.iter().enumerate() {
        let l = level(iscale, v);
        l_out[i] = (l + nmax) as i8;
        let w = v * v;
        sumlx += w * v * l as f32;
        suml2 += w * l as f32 * l as f32;
    }
    let mut scale = if suml2 != 0.0 { sumlx / suml2 } else { 0.0 };
    let mut best = scale * sumlx;
    for is in -9..=9 {
        if is == 0 {
            continue;
        }
        iscale = -(nmax as f32 + 0.1 * is as f32) / max;
        sumlx = 0.0;
        suml2 = 0.0;
        for &v in x {
            let l = level(iscale, v) as f32;
            let w = v * v;
            sumlx += w * v * l;
            suml2 += w * l * l;
        }
        if suml2 > 0.0 && sumlx * sumlx > best * suml2 {
            for (i, &v) in x.iter().enumerate() {
                l_out[i] = (nmax + level(iscale, v)) as i8;
            }
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    scale
}

fn q6_k(x: &[f32], out: &mut Vec<u8>) {
    let mut l = [0i8; 256];
    let mut scales = [0f32; 16];
    let (mut max_scale, mut max_abs_scale) = (0.0f32, 0.0f32);
    for ib in 0..16 {
        let s = make_qx_quants(32, &x[16 * ib..16 * ib + 16], &mut l[16 * ib..16 * ib + 16]);
        scales[ib] = s;
        if s.abs() > max_abs_scale {
            max_abs_scale = s.abs();
            max_scale = s;
        }
    }
    if max_abs_scale < GROUP_MAX_EPS {
        out.extend(std::iter::repeat_n(0u8, 210));
        return;
    }
    let iscale = -128.0 / max_scale;
    let d = 1.0 / iscale;
    let sc: Vec<i8> = scales
        .iter()
        .map(|&s| nearest_int(iscale * s).min(127) as i8)
        .collect();
    for j in 0..16 {
        let dj = f16_round(d) * sc[j] as f32;
        if dj == 0.0 {
            continue;
        }
        for ii in 0..16 {
            l[16 * j + ii] = (nearest_int(x[16 * j + ii] / dj).clamp(-32, 31) + 32) as i8;
        }
    }
    let (mut ql, mut qh) = ([0u8; 128], [0u8; 64]);
    for (h, chunk) in l.chunks_exact(128).enumerate() {
        let q = |i: usize| chunk[i] as u8;
        for i in 0..32 {
            ql[64 * h + i] = (q(i) & 0xF) | ((q(i + 64) & 0xF) << 4);
            ql[64 * h + i + 32] = (q(i + 32) & 0xF) | ((q(i + 96) & 0xF) << 4);
            qh[32 * h + i] = (q(i) >> 4)
                | ((q(i + 32) >> 4) << 2)
                | ((q(i + 64) >> 4) << 4)
                | ((q(i + 96) >> 4) << 6);
        }
    }
    out.extend_from_slice(&ql);
    out.extend_from_slice(&qh);
    out.extend(sc.iter().map(|&s| s as u8));
    put_f16(out, d);
}

/// ggml's `best_index_mxfp4`: the first code whose value is nearest to `x` at scale `d`.
fn best_index_mxfp4(x: f32, d: f32) -> u8 {
    let mut best = (0, (KVALUES_MXFP4[0] as f32 * d - x).abs());
    for (i, &k) in KVALUES_MXFP4.iter().enumerate().skip(1) {
        let err = (k as f32 * d - x).abs();
        if err < best.1 {
            best = (i as u8, err);
        }
    }
    best.0
}

fn mxfp4(x: &[f32], out: &mut Vec<u8>) {
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    // C's `(uint8_t)` of the float: through an int and its low byte, as x86 compilers emit it
    // (an amax below 2^−125, where the value is negative, is out of C's defined range anyway).
    let e = if amax > 0.0 {
        (amax.log2().floor() - 2.0 + 127.0) as i32 as u8
    } else {
        0
    };
    let d = e8m0_to_f32_half(e);
    out.push(e);
    for j in 0..16 {
        out.push(best_index_mxfp4(x[j], d) | (best_index_mxfp4(x[j + 16], d) << 4));
    }
}

/// Quantises `x` (a whole number of blocks) to `ty`'s bytes, as ggml's reference quantiser does.
pub fn quantize(ty: GgmlType, x: &[f32]) -> Result<Vec<u8>, crate::GgufError> {
    let bs = ty.block_size();
    if x.len() % bs != 0 {
        return Err(crate::GgufError::Blocks {
            ty,
            block: bs,
            problem: format!("{} values are not whole blocks", x.len()),
        });
    }
    let mut out = Vec::with_capacity(x.len() / bs * ty.block_bytes());
    let block: fn(&[f32], &mut Vec<u8>) = match ty {
        GgmlType::F32 => |b, o| o.extend_from_slice(&b[0].to_le_bytes()),
        GgmlType::F16 => |b, o| put_f16(o, b[0]),
        GgmlType::BF16 => |b, o| o.extend_from_slice(&bf16::from_f32(b[0]).to_le_bytes()),
        GgmlType::Q8_0 => q8_0,
        GgmlType::Q4_0 => q4_0,
        GgmlType::Q4_1 => q4_1,
        GgmlType::Q5_0 => q5_0,
        GgmlType::Q4K => q4_k,
        GgmlType::Q6K => q6_k,
        GgmlType::MXFP4 => mxfp4,
        other => return Err(crate::GgufError::Unsupported(other)),
    };
    for b in x.chunks_exact(bs) {
        block(b, &mut out);
    }
    Ok(out)
}

/// `x` as `ty` stores it, back in f32: what a forward through the quantised file computes with.
pub fn fake_quantize(ty: GgmlType, x: &[f32]) -> Result<Vec<f32>, crate::GgufError> {
    dequantize(ty, &quantize(ty, x)?, x.len())
}
