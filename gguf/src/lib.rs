//! GGUF v3 (llama.cpp's model format): reading metadata, tensor infos and tensors, dequantised to f32.
//!
//! Layout: `"GGUF"`, version (u32, 2 or 3), tensor count (u64), metadata count (u64); metadata as
//! (string key, u32 type, value); tensor infos as (name, n_dims u32, dims u64 × n in ggml's `ne`
//! order — fastest-varying first —, ggml type u32, offset u64); then, at the next multiple of
//! `general.alignment` (default 32), the data section the offsets point into. Strings are a u64
//! length and UTF-8 bytes; everything is little-endian. [`writer::GgufWriter`] writes the same
//! layout, [`quantize`] holds ggml's reference quantisers (byte-identical to its C), [`quants`] the
//! block formats and their dequantisers, [`mix`] llama.cpp's choice of type per tensor.

pub mod mix;
pub mod quantize;
pub mod quants;
pub mod writer;

pub use quants::GgmlType;

use std::collections::BTreeMap;
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

const MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;

#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    /// A file that cannot be read or written, or is not a GGUF k3mini reads.
    #[error("{path}: {message}")]
    File { path: PathBuf, message: String },
    /// Values that are not whole blocks of a type, or bytes that are not.
    #[error("{ty:?} holds blocks of {block} values: {problem}")]
    Blocks {
        ty: GgmlType,
        block: usize,
        problem: String,
    },
    /// A type k3mini does not write.
    #[error("k3mini does not quantise to {0:?}")]
    Unsupported(GgmlType),
    /// A type k3mini does not read.
    #[error("dequantising {0:?} is not implemented")]
    Undecodable(GgmlType),
    /// A tensor the writer refuses (name, shape, duplicate, size).
    #[error("tensor {name}: {problem}")]
    Tensor { name: String, problem: String },
    /// A ggml type id k3mini does not know.
    #[error("ggml type {0} is not supported")]
    UnknownType(u32),
    /// A file type name that is not one of k3mini's exports.
    #[error("unknown quantisation {0:?}: f32, f16, q8_0, q4_0 or q4_k_m")]
    UnknownFileType(String),
    /// A metadata value GGUF cannot hold.
    #[error("metadata {key}: {problem}")]
    Metadata { key: String, problem: String },
}

/// A metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(Vec<Value>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl Value {
    /// Any integer type as u64 (negative values and non-integers give `None`).
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v.into()),
            Value::U16(v) => Some(v.into()),
            Value::U32(v) => Some(v.into()),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v.into()),
            Value::F64(v) => Some(v),
            _ => self.as_u64().map(|v| v as f64),
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// Where a tensor lives and how it is stored.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    /// ggml `ne` order: `dims[0]` varies fastest (a `[rows, cols]` matrix is `[cols, rows]`).
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    /// From the start of the data section.
    pub offset: u64,
}

impl TensorInfo {
    pub fn elements(&self) -> u64 {
        self.dims.iter().product()
    }

    /// Bytes of the stored (possibly quantised) tensor.
    pub fn bytes(&self) -> u64 {
        self.ty.row_bytes(self.elements())
    }
}

/// An open GGUF file: metadata and tensor infos parsed, tensor data read on demand.
#[derive(Debug)]
pub struct GgufFile {
    pub path: PathBuf,
    pub version: u32,
    pub metadata: BTreeMap<String, Value>,
    /// Metadata keys in file order.
    pub keys: Vec<String>,
    pub tensors: Vec<TensorInfo>,
    data_start: u64,
    file_len: u64,
}

struct Reader<R> {
    inner: R,
    path: PathBuf,
}

impl<R: Read> Reader<R> {
    fn err(&self, message: impl Into<String>) -> GgufError {
        GgufError::File {
            path: self.path.clone(),
            message: message.into(),
        }
    }

    fn bytes<const N: usize>(&mut self) -> Result<[u8; N], GgufError> {
        let mut b = [0u8; N];
        self.inner
            .read_exact(&mut b)
            .map_err(|e| self.err(format!("truncated header: {e}")))?;
        Ok(b)
    }

    fn u32(&mut self) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.bytes()?))
    }

    fn u64(&mut self) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.bytes()?))
    }

    /// A length that must fit what is left of the file (a corrupt length must not allocate terabytes).
    fn len(&mut self, limit: u64, what: &str) -> Result<usize, GgufError> {
        let n = self.u64()?;
        if n > limit {
            return Err(self.err(format!(
                "{what} {n} is more than a file of {limit} bytes can hold: the file is truncated \
                 (or not a GGUF)"
            )));
        }
        Ok(n as usize)
    }

    fn string(&mut self, limit: u64) -> Result<String, GgufError> {
        let n = self.len(limit, "string")?;
        let mut b = vec![0u8; n];
        self.inner
            .read_exact(&mut b)
            .map_err(|e| self.err(format!("truncated header: {e}")))?;
        String::from_utf8(b).map_err(|_| self.err("a metadata string is not UTF-8"))
    }

    fn value(&mut self, ty: u32, limit: u64) -> Result<Value, GgufError> {
        Ok(match ty {
            0 => Value::U8(u8::from_le_bytes(self.bytes()?)),
            1 => Value::I8(i8::from_le_bytes(self.bytes()?)),
            2 => Value::U16(u16::from_le_bytes(self.bytes()?)),
            3 => Value::I16(i16::from_le_bytes(self.bytes()?)),
            4 => Value::U32(self.u32()?),
            5 => Value::I32(i32::from_le_bytes(self.bytes()?)),
            6 => Value::F32(f32::from_le_bytes(self.bytes()?)),
            7 => Value::Bool(self.bytes::<1>()?[0] != 0),
            8 => Value::String(self.string(limit)?),
            9 => {
                let inner = self.u32()?;
                let n = self.len(limit, "array")?;
                let mut items = Vec::with_capacity(n.min(1 << 20));
                for _ in 0..n {
                    items.push(self.value(inner, limit)?);
                }
                Value::Array(items)
            }
            10 => Value::U64(self.u64()?),
            11 => Value::I64(i64::from_le_bytes(self.bytes()?)),
            12 => Value::F64(f64::from_le_bytes(self.bytes()?)),
            other => return Err(self.err(format!("unknown metadata value type {other}"))),
        })
    }
}

impl GgufFile {
    /// Parses the header, metadata and tensor infos, and checks every tensor lies inside the file.
    pub fn open(path: &Path) -> Result<Self, GgufError> {
        let err = |message: String| GgufError::File {
            path: path.to_path_buf(),
            message,
        };
        let file = std::fs::File::open(path).map_err(|e| err(e.to_string()))?;
        let meta = file.metadata().map_err(|e| err(e.to_string()))?;
        if meta.is_dir() {
            return Err(err("is a directory, not a GGUF file".into()));
        }
        let file_len = meta.len();
        let mut r = Reader {
            inner: BufReader::new(file),
            path: path.to_path_buf(),
        };
        if &r.bytes::<4>()? != MAGIC {
            return Err(err("not a GGUF file (bad magic)".into()));
        }
        let version = r.u32()?;
        if !(2..=3).contains(&version) {
            return Err(err(format!(
                "GGUF version {version} is not supported (2 or 3)"
            )));
        }
        let n_tensors = r.len(file_len, "tensor count")?;
        let n_kv = r.len(file_len, "metadata count")?;
        let (mut metadata, mut keys) = (BTreeMap::new(), Vec::with_capacity(n_kv.min(1 << 16)));
        for _ in 0..n_kv {
            let key = r.string(file_len)?;
            let ty = r.u32()?;
            let value = r.value(ty, file_len)?;
            keys.push(key.clone());
            metadata.insert(key, value);
        }
        let mut tensors = Vec::with_capacity(n_tensors);
        for _ in 0..n_tensors {
            let name = r.string(file_len)?;
            let n_dims = r.u32()?;
            if n_dims == 0 || n_dims > 4 {
                return Err(err(format!("tensor {name}: {n_dims} dimensions")));
            }
            let dims = (0..n_dims)
                .map(|_| r.u64())
                .collect::<Result<Vec<_>, _>>()?;
            let ty = GgmlType::from_id(r.u32()?).map_err(|m| err(format!("tensor {name}: {m}")))?;
            let offset = r.u64()?;
            tensors.push(TensorInfo {
                name,
                dims,
                ty,
                offset,
            });
        }
        let alignment = metadata
            .get("general.alignment")
            .and_then(Value::as_u64)
            .unwrap_or(DEFAULT_ALIGNMENT);
        if alignment == 0 || !alignment.is_power_of_two() {
            return Err(err(format!(
                "general.alignment {alignment} is not a power of two"
            )));
        }
        let header_end = r.inner.stream_position().map_err(|e| err(e.to_string()))?;
        let data_start = header_end.div_ceil(alignment) * alignment;
        for t in &tensors {
            if t.dims[0] % t.ty.block_size() as u64 != 0 {
                return Err(err(format!(
                    "tensor {}: row of {} is not a multiple of {:?}'s block of {}",
                    t.name,
                    t.dims[0],
                    t.ty,
                    t.ty.block_size()
                )));
            }
            let end = data_start + t.offset + t.bytes();
            if end > file_len {
                return Err(err(format!(
                    "tensor {} ends at byte {end} but the file has {file_len} (truncated?)",
                    t.name
                )));
            }
        }
        Ok(Self {
            path: path.to_path_buf(),
            version,
            metadata,
            keys,
            tensors,
            data_start,
            file_len,
        })
    }

    fn err(&self, message: String) -> GgufError {
        GgufError::File {
            path: self.path.clone(),
            message,
        }
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    /// A required metadata value, with a clear error when it is missing or of the wrong kind.
    pub fn require<'a, T>(
        &'a self,
        key: &str,
        convert: impl Fn(&'a Value) -> Option<T>,
    ) -> Result<T, GgufError> {
        let v = self
            .get(key)
            .ok_or_else(|| self.err(format!("metadata {key} is missing")))?;
        convert(v).ok_or_else(|| self.err(format!("metadata {key} has the wrong type ({v:?})")))
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The stored bytes of a tensor.
    pub fn raw(&self, info: &TensorInfo) -> Result<Vec<u8>, GgufError> {
        self.raw_range(info, 0, info.bytes())
    }

    /// `len` bytes of a tensor's data from byte `from` of it (one expert's slice, say).
    pub fn raw_range(&self, info: &TensorInfo, from: u64, len: u64) -> Result<Vec<u8>, GgufError> {
        if from.checked_add(len).is_none_or(|end| end > info.bytes()) {
            return Err(self.err(format!(
                "tensor {}: bytes {from}..+{len} are past its {}",
                info.name,
                info.bytes()
            )));
        }
        let mut f = std::fs::File::open(&self.path).map_err(|e| self.err(e.to_string()))?;
        let start = self.data_start + info.offset + from;
        debug_assert!(start + len <= self.file_len);
        f.seek(SeekFrom::Start(start))
            .map_err(|e| self.err(e.to_string()))?;
        let mut bytes = vec![0u8; len as usize];
        f.read_exact(&mut bytes)
            .map_err(|e| self.err(format!("reading tensor {}: {e}", info.name)))?;
        Ok(bytes)
    }

    /// A tensor dequantised to f32, in ggml order (`dims[0]` fastest: row-major `[.., dims[1], dims[0]]`).
    pub fn dequantize(&self, name: &str) -> Result<(Vec<f32>, Vec<u64>), GgufError> {
        let info = self
            .tensor(name)
            .ok_or_else(|| self.err(format!("no tensor {name}")))?;
        let raw = self.raw(info)?;
        let values = quants::dequantize(info.ty, &raw, info.elements() as usize)
            .map_err(|e| self.err(format!("tensor {name}: {e}")))?;
        Ok((values, info.dims.clone()))
    }
}
