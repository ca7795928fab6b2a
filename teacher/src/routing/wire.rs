//! Routed experts as served engines return them (SPEC §10): expert ids only, `[tokens, layers, k]`
//! with every hidden layer on the layer axis (a dense layer's row means nothing), logical ids.
//!
//! - vLLM (`--enable-return-routed-experts`): `choices[i].routed_experts` is the base64 of an
//!   `np.save` file; its dtype is whatever the header says (int32, or uint8 / uint16 in newer
//!   outputs). Version 0.21 sent nested int16 lists instead: `prompt_routed_experts` at the
//!   response's top level and `choices[i].routed_experts` for the generated tokens.
//! - SGLang (`"return_routed_experts": true`): `meta_info.routed_experts` is the base64 of raw
//!   little-endian int32, `reshape(-1, layers, k)`.
//!
//! Everything here is read, checked, and refused with a [`WireError`] that says what was wrong:
//! a payload that is not what it claims never becomes a routing record.

pub use crate::routing::RoutingShape;
use crate::routing::{LayerRouting, Routing};
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;

/// Expert ids as a server sent them: `[tokens, layers, k]` row-major.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RoutedExperts {
    pub tokens: usize,
    pub layers: usize,
    pub k: usize,
    pub ids: Vec<u32>,
}

#[derive(Debug, PartialEq, thiserror::Error)]
pub enum WireError {
    #[error("routed experts: not base64: {0}")]
    Base64(String),
    #[error("routed experts: not an .npy file: {0}")]
    Npy(String),
    #[error("routed experts: dtype {0:?} is not a little-endian integer type")]
    Dtype(String),
    #[error("routed experts: {0}")]
    Malformed(String),
    #[error("routed experts: shape {got:?} where the teacher's routing is {want}")]
    Shape { got: Vec<usize>, want: String },
    #[error(
        "routed experts: expert {id} at token {token}, layer {layer} is outside the teacher's \
         {experts} experts"
    )]
    Expert {
        id: i64,
        token: usize,
        layer: usize,
        experts: usize,
    },
}

/// The `.npy` header's magic (format versions 1 to 3).
const NPY_MAGIC: &[u8] = b"\x93NUMPY";

/// The integer dtypes the servers send, as `.npy` writes them: bytes per element, signed.
fn npy_dtype(descr: &str) -> Result<(usize, bool), WireError> {
    Ok(match descr {
        "|u1" | "<u1" => (1, false),
        "|i1" | "<i1" => (1, true),
        "<u2" => (2, false),
        "<i2" => (2, true),
        "<u4" => (4, false),
        "<i4" => (4, true),
        "<i8" => (8, true),
        "<u8" => (8, false),
        _ => return Err(WireError::Dtype(descr.into())),
    })
}

/// One value of a Python dict literal as `np.save` writes its header: `'key': value`.
fn header_field<'a>(header: &'a str, key: &str) -> Result<&'a str, WireError> {
    let at = header
        .find(&format!("'{key}':"))
        .ok_or_else(|| WireError::Npy(format!("its header has no {key:?}: {header}")))?;
    Ok(header[at + key.len() + 3..].trim_start())
}

/// What lies between `open` at the start of `v` and the next `close`.
fn enclosed(v: &str, open: char, close: char) -> Option<&str> {
    v.strip_prefix(open)?
        .split_once(close)
        .map(|(inner, _)| inner)
}

/// Reads an `np.save` file of a 3-D integer array.
pub fn from_npy(bytes: &[u8]) -> Result<RoutedExperts, WireError> {
    let bad = |why: &str| WireError::Npy(why.into());
    if !bytes.starts_with(NPY_MAGIC) || bytes.len() < 10 {
        return Err(bad("no \\x93NUMPY magic"));
    }
    let (header_len, start) = match bytes[6] {
        1 => (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10),
        2 | 3 if bytes.len() >= 12 => (
            u32::from_le_bytes(bytes[8..12].try_into().expect("4 bytes")) as usize,
            12,
        ),
        v => return Err(WireError::Npy(format!("format version {v}"))),
    };
    let header = bytes
        .get(start..start + header_len)
        .and_then(|h| std::str::from_utf8(h).ok())
        .ok_or_else(|| bad("its header is cut short or not text"))?;
    let descr = enclosed(header_field(header, "descr")?, '\'', '\'')
        .ok_or_else(|| bad("its descr is not a string"))?;
    let (width, signed) = npy_dtype(descr)?;
    if !header_field(header, "fortran_order")?.starts_with("False") {
        return Err(bad("Fortran order (servers write C order)"));
    }
    let shape = enclosed(header_field(header, "shape")?, '(', ')')
        .ok_or_else(|| bad("its shape is not a tuple"))?;
    let shape: Vec<usize> = shape
        .split(',')
        .map(str::trim)
        .filter(|d| !d.is_empty())
        .map(|d| d.parse().map_err(|_| bad("its shape is not integers")))
        .collect::<Result<_, _>>()?;
    let [tokens, layers, k] = shape[..] else {
        return Err(WireError::Shape {
            got: shape,
            want: "[tokens, layers, k]".into(),
        });
    };
    let data = &bytes[start + header_len..];
    let n = tokens
        .checked_mul(layers)
        .and_then(|n| n.checked_mul(k))
        .ok_or_else(|| bad("its shape overflows"))?;
    if data.len() != n * width {
        return Err(WireError::Npy(format!(
            "{} data bytes for shape {shape:?} of {descr}",
            data.len()
        )));
    }
    let ids = data
        .chunks_exact(width)
        .map(|b| {
            let mut le = [0u8; 8];
            le[..width].copy_from_slice(b);
            let negative = signed && b[width - 1] & 0x80 != 0;
            if negative {
                le[width..].fill(0xff);
            }
            i64::from_le_bytes(le)
        })
        .collect::<Vec<_>>();
    experts(tokens, layers, k, ids)
}

/// `values` `[tokens, layers, k]` as ids, a negative one refused.
fn experts(
    tokens: usize,
    layers: usize,
    k: usize,
    values: Vec<i64>,
) -> Result<RoutedExperts, WireError> {
    let ids = values
        .iter()
        .enumerate()
        .map(|(i, &v)| {
            u32::try_from(v).map_err(|_| {
                WireError::Malformed(format!(
                    "expert id {v} at token {}, layer {}",
                    i / (layers * k),
                    i / k % layers
                ))
            })
        })
        .collect::<Result<_, _>>()?;
    Ok(RoutedExperts {
        tokens,
        layers,
        k,
        ids,
    })
}

/// The `np.save` (format 1.0, int32) file of `r`: what k3mini's server sends as vLLM does.
pub fn to_npy(r: &RoutedExperts) -> Vec<u8> {
    let dict = format!(
        "{{'descr': '<i4', 'fortran_order': False, 'shape': ({}, {}, {}), }}",
        r.tokens, r.layers, r.k
    );
    // Magic, version, length, then the header padded with spaces to a 64-byte boundary, as
    // numpy aligns it, ending in a newline.
    let unpadded = NPY_MAGIC.len() + 4 + dict.len() + 1;
    let header = format!(
        "{dict}{}\n",
        " ".repeat(unpadded.next_multiple_of(64) - unpadded)
    );
    let mut out = Vec::with_capacity(unpadded + r.ids.len() * 4 + 64);
    out.extend_from_slice(NPY_MAGIC);
    out.extend_from_slice(&[1, 0]);
    out.extend_from_slice(&(header.len() as u16).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    for &id in &r.ids {
        out.extend_from_slice(&(id as i32).to_le_bytes());
    }
    out
}

/// vLLM's `routed_experts`: base64 of an `np.save` file.
pub fn from_vllm(b64: &str) -> Result<RoutedExperts, WireError> {
    from_npy(&decode_base64(b64)?)
}

/// vLLM 0.21's nested lists `[tokens][layers][k]` (`prompt_routed_experts`, or a choice's
/// `routed_experts`); an empty list is no tokens of the teacher's `layers` and `k`.
pub fn from_vllm_lists(
    rows: &[Vec<Vec<i64>>],
    layers: usize,
    k: usize,
) -> Result<RoutedExperts, WireError> {
    let mut values = Vec::with_capacity(rows.len() * layers * k);
    for row in rows {
        if row.len() != layers {
            return Err(WireError::Shape {
                got: vec![rows.len(), row.len()],
                want: format!("{layers} layers"),
            });
        }
        for cell in row {
            if cell.len() != k {
                return Err(WireError::Shape {
                    got: vec![rows.len(), layers, cell.len()],
                    want: format!("k = {k}"),
                });
            }
            values.extend_from_slice(cell);
        }
    }
    experts(rows.len(), layers, k, values)
}

/// SGLang's `meta_info.routed_experts`: base64 of raw little-endian int32 `[-1, layers, k]`.
pub fn from_sglang(b64: &str, layers: usize, k: usize) -> Result<RoutedExperts, WireError> {
    let bytes = decode_base64(b64)?;
    let row = 4 * layers * k;
    if row == 0 || bytes.len() % row != 0 {
        return Err(WireError::Malformed(format!(
            "{} bytes are not whole int32 rows of {layers} layers × k = {k}",
            bytes.len()
        )));
    }
    let values = bytes
        .chunks_exact(4)
        .map(|b| i32::from_le_bytes(b.try_into().expect("4 bytes")) as i64)
        .collect();
    experts(bytes.len() / row, layers, k, values)
}

/// The base64 of raw little-endian int32: what k3mini's server sends as SGLang does.
pub fn to_sglang(r: &RoutedExperts) -> String {
    let bytes: Vec<u8> = r
        .ids
        .iter()
        .flat_map(|&id| (id as i32).to_le_bytes())
        .collect();
    STANDARD.encode(bytes)
}

fn decode_base64(b64: &str) -> Result<Vec<u8>, WireError> {
    STANDARD
        .decode(b64.trim())
        .map_err(|e| WireError::Base64(e.to_string()))
}

impl RoutedExperts {
    /// Checks this payload against the teacher: `tokens` tokens, its layer count and k, and every
    /// MoE layer's ids among its experts.
    pub fn check(&self, tokens: usize, shape: &RoutingShape) -> Result<(), WireError> {
        if (self.tokens, self.layers, self.k) != (tokens, shape.layers, shape.k) {
            return Err(WireError::Shape {
                got: vec![self.tokens, self.layers, self.k],
                want: format!(
                    "[{tokens} tokens, {} layers, k = {}]",
                    shape.layers, shape.k
                ),
            });
        }
        if let Some(&l) = shape.moe_layers.iter().find(|&&l| l >= shape.layers) {
            return Err(WireError::Malformed(format!(
                "MoE layer {l} of a teacher with {} layers",
                shape.layers
            )));
        }
        for t in 0..self.tokens {
            for &layer in &shape.moe_layers {
                if let Some(&id) = self
                    .layer(t, layer)
                    .iter()
                    .find(|&&e| e as usize >= shape.experts)
                {
                    return Err(WireError::Expert {
                        id: id as i64,
                        token: t,
                        layer,
                        experts: shape.experts,
                    });
                }
            }
        }
        Ok(())
    }

    /// Its MoE layers' first `tokens` tokens (it was [`RoutedExperts::check`]ed against `shape`).
    pub fn routing(&self, shape: &RoutingShape, tokens: usize) -> Routing {
        let layers = shape
            .moe_layers
            .iter()
            .map(|&layer| LayerRouting {
                layer,
                k: shape.k,
                experts: (0..tokens.min(self.tokens))
                    .flat_map(|t| self.layer(t, layer).iter().copied())
                    .collect(),
                weights: None,
                norms: None,
            })
            .collect();
        Routing { layers }
    }

    /// `routing` as a server returns it: `[tokens, shape.layers, k]`, a dense layer's rows zero.
    pub fn of(routing: &Routing, shape: &RoutingShape) -> Self {
        let (tokens, k) = (routing.tokens(), shape.k);
        let mut ids = vec![0; tokens * shape.layers * k];
        for l in &routing.layers {
            for (t, row) in l.experts.chunks_exact(k).enumerate() {
                let at = (t * shape.layers + l.layer) * k;
                ids[at..at + k].copy_from_slice(row);
            }
        }
        Self {
            tokens,
            layers: shape.layers,
            k,
            ids,
        }
    }

    /// Token `t`'s `k` experts at `layer`.
    pub fn layer(&self, t: usize, layer: usize) -> &[u32] {
        let at = (t * self.layers + layer) * self.k;
        &self.ids[at..at + self.k]
    }

    /// This payload followed by `next`'s tokens (vLLM 0.21 sent the prompt's and the generated
    /// tokens' routing apart).
    pub fn then(mut self, next: RoutedExperts) -> Result<RoutedExperts, WireError> {
        if (next.layers, next.k) != (self.layers, self.k) && next.tokens > 0 {
            return Err(WireError::Shape {
                got: vec![next.tokens, next.layers, next.k],
                want: format!("[_, {} layers, k = {}]", self.layers, self.k),
            });
        }
        self.tokens += next.tokens;
        self.ids.extend(next.ids);
        Ok(self)
    }
}
