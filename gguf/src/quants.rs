//! ggml tensor types: block geometry and dequantisation to f32, as in ggml's `dequantize_row_*`
//! (ggml-quants.c). Blocks are little-endian; `d`, `m`, `dmin` are f16.
//!
//! - Q8_0 (32): `d`, 32 × i8 `q`;                 x = d·q
//! - Q4_0 (32): `d`, 16 bytes of nibbles;          x_j = d·(lo_j − 8), x_{j+16} = d·(hi_j − 8)
//! - Q4_1 (32): `d`, `m`, 16 bytes of nibbles;     x = d·q + m
//! - Q5_0 (32): `d`, 32 high bits `qh`, nibbles;   x = d·((nibble | bit·16) − 16)
//! - Q4_K (256): `d`, `dmin`, 12 bytes of 6-bit (scale, min) pairs for 8 sub-blocks of 32, 128
//!   bytes of nibbles; x = d·sc·q − dmin·m
//! - Q6_K (256): 128 bytes low nibbles, 64 bytes high 2-bit pairs, 16 × i8 scales (sub-blocks of
//!   16), `d`; x = d·sc·(q − 32)
//! - MXFP4 (32, OCP MX): a UE8M0 exponent byte `e`, 16 bytes of E2M1 nibbles (low nibbles the
//!   first 16 values); x = [`KVALUES_MXFP4`]\[q]·2^(e − 128) (ggml stores E2M1 doubled, so
//!   the scale is halved: `GGML_E8M0_TO_FP32_HALF`).

use half::{bf16, f16};

/// The ggml types k3mini reads (ids as in ggml.h).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
    Q8K,
    BF16,
    MXFP4,
}

/// ggml's `kvalues_mxfp4`: the E2M1 values ±{0, 0.5, 1, 1.5, 2, 3, 4, 6}, doubled, by code.
pub const KVALUES_MXFP4: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// ggml's `ggml_e8m0_to_fp32_half`: 2^(e − 128), built from its bits (subnormal for e < 2).
pub fn e8m0_to_f32_half(e: u8) -> f32 {
    let bits = if e < 2 {
        0x0020_0000u32 << e
    } else {
        (e as u32 - 1) << 23
    };
    f32::from_bits(bits)
}

impl GgmlType {
    pub fn from_id(id: u32) -> Result<Self, crate::GgufError> {
        Ok(match id {
            0 => Self::F32,
            1 => Self::F16,
            2 => Self::Q4_0,
            3 => Self::Q4_1,
            6 => Self::Q5_0,
            7 => Self::Q5_1,
            8 => Self::Q8_0,
            9 => Self::Q8_1,
            10 => Self::Q2K,
            11 => Self::Q3K,
            12 => Self::Q4K,
            13 => Self::Q5K,
            14 => Self::Q6K,
            15 => Self::Q8K,
            30 => Self::BF16,
            39 => Self::MXFP4,
            other => return Err(crate::GgufError::UnknownType(other)),
        })
    }

    pub fn id(self) -> u32 {
        match self {
            Self::F32 => 0,
            Self::F16 => 1,
            Self::Q4_0 => 2,
            Self::Q4_1 => 3,
            Self::Q5_0 => 6,
            Self::Q5_1 => 7,
            Self::Q8_0 => 8,
            Self::Q8_1 => 9,
            Self::Q2K => 10,
            Self::Q3K => 11,
            Self::Q4K => 12,
            Self::Q5K => 13,
            Self::Q6K => 14,
            Self::Q8K => 15,
            Self::BF16 => 30,
            Self::MXFP4 => 39,
        }
    }

    /// Elements per block.
    pub fn block_size(self) -> usize {
        match self {
            Self::F32 | Self::F16 | Self::BF16 => 1,
            Self::Q4_0
            | Self::Q4_1
            | Self::Q5_0
            | Self::Q5_1
            | Self::Q8_0
            | Self::Q8_1
            | Self::MXFP4 => 32,
            Self::Q2K | Self::Q3K | Self::Q4K | Self::Q5K | Self::Q6K | Self::Q8K => 256,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::F16 | Self::BF16 => 2,
            Self::Q4_0 => 18,
            Self::Q4_1 => 20,
            Self::Q5_0 => 22,
            Self::Q5_1 => 24,
            Self::Q8_0 => 34,
            Self::Q8_1 => 36,
            Self::Q2K => 84,
            Self::Q3K => 110,
            Self::Q4K => 144,
            Self::Q5K => 176,
            Self::Q6K => 210,
            Self::Q8K => 292,
            Self::MXFP4 => 17,
        }
    }

    /// Stored bytes of `n` elements (`n` a multiple of the block size).
    pub fn row_bytes(self, n: u64) -> u64 {
        n / self.block_size() as u64 * self.block_bytes() as u64
    }
}

fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// `n` values of type `ty` from `bytes`.
pub fn dequantize(ty: GgmlType, bytes: &[u8], n: usize) -> Result<Vec<f32>, crate::GgufError> {
    let (bs, bb) = (ty.block_size(), ty.block_bytes());
    if n % bs != 0 || bytes.len() != n / bs * bb {
        return Err(crate::GgufError::Blocks {
            ty,
            block: bs,
            problem: format!("{} bytes do not hold {n} values", bytes.len()),
        });
    }
    let mut out = vec![0f32; n];
    let blocks = bytes.chunks_exact(bb).zip(out.chunks_exact_mut(bs));
    match ty {
        GgmlType::F32 => {
            blocks.for_each(|(b, y)| y[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        }
        GgmlType::F16 => blocks.for_each(|(b, y)| y[0] = f16_at(b, 0)),
        GgmlType::BF16 => {
            blocks.for_each(|(b, y)| y[0] = bf16::from_le_bytes([b[0], b[1]]).to_f32())
        }
        GgmlType::Q8_0 => blocks.for_each(|(b, y)| {
            let d = f16_at(b, 0);
            for (y, &q) in y.iter_mut().zip(&b[2..34]) {
                *y = d * (q as i8) as f32;
            }
        }),
        GgmlType::Q4_0 => blocks.for_each(|(b, y)| {
            let d = f16_at(b, 0);
            for (j, &q) in b[2..18].iter().enumerate() {
                y[j] = d * ((q & 0xF) as i32 - 8) as f32;
                y[j + 16] = d * ((q >> 4) as i32 - 8) as f32;
            }
        }),
        GgmlType::Q4_1 => blocks.for_each(|(b, y)| {
            let (d, m) = (f16_at(b, 0), f16_at(b, 2));
            for (j, &q) in b[4..20].iter().enumerate() {
                y[j] = d * (q & 0xF) as f32 + m;
                y[j + 16] = d * (q >> 4) as f32 + m;
            }
        }),
        GgmlType::Q5_0 => blocks.for_each(|(b, y)| {
            let d = f16_at(b, 0);
            let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
            for (j, &q) in b[6..22].iter().enumerate() {
                let h0 = ((qh >> j) << 4) & 0x10;
                let h1 = (qh >> (j + 12)) & 0x10;
                y[j] = d * (((q as u32 & 0xF) | h0) as i32 - 16) as f32;
                y[j + 16] = d * (((q as u32 >> 4) | h1) as i32 - 16) as f32;
            }
        }),
        GgmlType::Q4K => blocks.for_each(|(b, y)| {
            let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
            let scales = &b[4..16];
            let qs = &b[16..144];
            for (pair, (q, y)) in qs.chunks_exact(32).zip(y.chunks_exact_mut(64)).enumerate() {
                let (sc1, m1) = scale_min_k4(2 * pair, scales);
                let (sc2, m2) = scale_min_k4(2 * pair + 1, scales);
                let (d1, min1) = (d * sc1 as f32, dmin * m1 as f32);
                let (d2, min2) = (d * sc2 as f32, dmin * m2 as f32);
                for l in 0..32 {
                    y[l] = d1 * (q[l] & 0xF) as f32 - min1;
                    y[l + 32] = d2 * (q[l] >> 4) as f32 - min2;
                }
            }
        }),
        GgmlType::Q6K => blocks.for_each(|(b, y)| {
            let (ql, qh, sc) = (&b[0..128], &b[128..192], &b[192..208]);
            let d = f16_at(b, 208);
            for half in 0..2 {
                let (ql, qh) = (&ql[64 * half..], &qh[32 * half..]);
                let sc = &sc[8 * half..];
                let y = &mut y[128 * half..];
                for l in 0..32 {
                    let is = l / 16;
                    let q1 = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i32 - 32;
                    let q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
                    let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
                    let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
                    let s = |i: usize| d * (sc[is + i] as i8) as f32;
                    y[l] = s(0) * q1 as f32;
                    y[l + 32] = s(2) * q2 as f32;
                    y[l + 64] = s(4) * q3 as f32;
                    y[l + 96] = s(6) * q4 as f32;
                }
            }
        }),
        GgmlType::MXFP4 => blocks.for_each(|(b, y)| {
            let d = e8m0_to_f32_half(b[0]);
            for (j, &q) in b[1..17].iter().enumerate() {
                y[j] = KVALUES_MXFP4[(q & 0xF) as usize] as f32 * d;
                y[j + 16] = KVALUES_MXFP4[(q >> 4) as usize] as f32 * d;
            }
        }),
        other => return Err(crate::GgufError::Undecodable(other)),
    }
    Ok(out)
}

/// The 6-bit (scale, min) of sub-block `j` of a Q4_K / Q5_K block (ggml's `get_scale_min_k4`).
pub(crate) fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}
