//! Writing GGUF v3: metadata in insertion order, tensor infos, then the data section with every
//! tensor at a multiple of `general.alignment` (32), written atomically and durably (a temporary
//! file synced and renamed into place). The layout is the reader's (see the module above); gguf-py
//! reads what this writes. A tensor's bytes may be given, or made when the writer reaches it
//! ([`GgufWriter::add_tensor_with`]): the header needs only sizes, so a file larger than memory is
//! written holding one tensor at a time.

use super::{DEFAULT_ALIGNMENT, GgmlType, GgufError, MAGIC, Value};
use std::io::Write;
use std::path::Path;

/// ggml's limit on tensor names (`GGML_MAX_NAME` − 1).
pub const MAX_NAME: usize = 63;

/// What makes a tensor's bytes when the writer reaches it.
type MakeBytes<'a> = Box<dyn FnOnce() -> Result<Vec<u8>, GgufError> + 'a>;

/// A tensor's bytes: held, or made when they are written.
enum Data<'a> {
    Held(Vec<u8>),
    Later(MakeBytes<'a>),
}

struct PendingTensor<'a> {
    name: String,
    /// ggml's `ne`: the contiguous dimension first.
    ne: Vec<u64>,
    ty: GgmlType,
    /// Its size in bytes (`ty.row_bytes` of its values).
    len: u64,
    data: Data<'a>,
}

/// A GGUF file being assembled: metadata and tensor infos in memory, tensor bytes held or made
/// when written.
#[derive(Default)]
pub struct GgufWriter<'a> {
    metadata: Vec<(String, Value)>,
    tensors: Vec<PendingTensor<'a>>,
}

fn value_type(v: &Value) -> u32 {
    match v {
        Value::U8(_) => 0,
        Value::I8(_) => 1,
        Value::U16(_) => 2,
        Value::I16(_) => 3,
        Value::U32(_) => 4,
        Value::I32(_) => 5,
        Value::F32(_) => 6,
        Value::Bool(_) => 7,
        Value::String(_) => 8,
        Value::Array(_) => 9,
        Value::U64(_) => 10,
        Value::I64(_) => 11,
        Value::F64(_) => 12,
    }
}

fn put_string(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

/// Appends `v`'s bytes; `Err` says why GGUF cannot hold it.
fn put_value(out: &mut Vec<u8>, v: &Value) -> Result<(), &'static str> {
    match v {
        Value::U8(x) => out.push(*x),
        Value::I8(x) => out.push(*x as u8),
        Value::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::Bool(x) => out.push(*x as u8),
        Value::String(s) => put_string(out, s),
        Value::Array(items) => {
            let inner = items.first().map_or(4, value_type);
            if items.iter().any(|i| value_type(i) != inner) {
                return Err("a GGUF array holds one type of value");
            }
            if inner == 9 {
                return Err("GGUF arrays of arrays are not supported by llama.cpp");
            }
            out.extend_from_slice(&inner.to_le_bytes());
            out.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for i in items {
                put_value(out, i)?;
            }
        }
        Value::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
    }
    Ok(())
}

/// The values of a tensor of dims `ne`, `None` past `u64`.
fn element_count(ne: &[u64]) -> Option<u64> {
    ne.iter().try_fold(1u64, |n, &d| n.checked_mul(d))
}

impl<'a> GgufWriter<'a> {
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets a metadata key (replacing an earlier value, keeping its position).
    pub fn set(&mut self, key: &str, value: Value) {
        match self.metadata.iter_mut().find(|(k, _)| k == key) {
            Some(slot) => slot.1 = value,
            None => self.metadata.push((key.to_string(), value)),
        }
    }

    /// Adds a tensor: `ne` in ggml order (a `(out, in)` matrix is `[in, out]`), `data` already in
    /// `ty`'s layout.
    pub fn add_tensor(
        &mut self,
        name: &str,
        ne: &[u64],
        ty: GgmlType,
        data: Vec<u8>,
    ) -> Result<(), GgufError> {
        let len = data.len() as u64;
        self.push(name, ne, ty, len, Data::Held(data))
    }

    /// Adds a tensor whose bytes `make` returns when [`Self::write`] reaches it (and which are
    /// dropped once written): a file is written holding one such tensor at a time.
    pub fn add_tensor_with(
        &mut self,
        name: &str,
        ne: &[u64],
        ty: GgmlType,
        make: impl FnOnce() -> Result<Vec<u8>, GgufError> + 'a,
    ) -> Result<(), GgufError> {
        let len = element_count(ne).map_or(u64::MAX, |n| ty.row_bytes(n));
        self.push(name, ne, ty, len, Data::Later(Box::new(make)))
    }

    fn push(
        &mut self,
        name: &str,
        ne: &[u64],
        ty: GgmlType,
        len: u64,
        data: Data<'a>,
    ) -> Result<(), GgufError> {
        let refuse = |problem: String| {
            Err(GgufError::Tensor {
                name: name.to_string(),
                problem,
            })
        };
        if name.len() > MAX_NAME {
            return refuse(format!("the name is longer than ggml's {MAX_NAME} bytes"));
        }
        if self.tensors.iter().any(|t| t.name == name) {
            return refuse("added twice".into());
        }
        let Some(n) = element_count(ne) else {
            return refuse(format!("dims {ne:?} hold more values than 64 bits count"));
        };
        if ne.is_empty() || n % ty.block_size() as u64 != 0 {
            return refuse(format!(
                "{n} values are not whole {ty:?} blocks of {}",
                ty.block_size()
            ));
        }
        if ne[0] % ty.block_size() as u64 != 0 {
            return refuse(format!(
                "rows of {} values are not whole {ty:?} blocks of {}",
                ne[0],
                ty.block_size()
            ));
        }
        if len != ty.row_bytes(n) {
            return refuse(format!(
                "{len} bytes for {n} {ty:?} values (expected {})",
                ty.row_bytes(n)
            ));
        }
        self.tensors.push(PendingTensor {
            name: name.to_string(),
            ne: ne.to_vec(),
            ty,
            len,
            data,
        });
        Ok(())
    }

    /// Writes the file atomically and durably, making each later tensor's bytes as it is reached;
    /// returns its size.
    pub fn write(self, path: &Path) -> Result<u64, GgufError> {
        let err = |message: String| GgufError::File {
            path: path.to_path_buf(),
            message,
        };
        let align = match self.metadata.iter().find(|(k, _)| k == "general.alignment") {
            Some((_, v)) => v
                .as_u64()
                .filter(|a| a.is_power_of_two())
                .ok_or_else(|| err("general.alignment must be a power of two".into()))?,
            None => DEFAULT_ALIGNMENT,
        };
        let pad = |n: u64| n.div_ceil(align) * align;
        let mut head = Vec::new();
        head.extend_from_slice(MAGIC);
        head.extend_from_slice(&3u32.to_le_bytes());
        head.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        head.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (k, v) in &self.metadata {
            put_string(&mut head, k);
            head.extend_from_slice(&value_type(v).to_le_bytes());
            put_value(&mut head, v).map_err(|problem| GgufError::Metadata {
                key: k.clone(),
                problem: problem.into(),
            })?;
        }
        let mut offset = 0u64;
        for t in &self.tensors {
            put_string(&mut head, &t.name);
            head.extend_from_slice(&(t.ne.len() as u32).to_le_bytes());
            for d in &t.ne {
                head.extend_from_slice(&d.to_le_bytes());
            }
            head.extend_from_slice(&t.ty.id().to_le_bytes());
            head.extend_from_slice(&offset.to_le_bytes());
            offset = pad(offset + t.len);
        }
        head.resize(pad(head.len() as u64) as usize, 0);
        // A tensor that cannot be made stops the write (the temporary file is removed) and is
        // reported as itself, not as an I/O error.
        let mut failed = None;
        k3mini_durable::write_with(path, |file| {
            let mut f = std::io::BufWriter::new(file);
            f.write_all(&head)?;
            for t in self.tensors {
                let made = match t.data {
                    Data::Held(bytes) => Ok(bytes),
                    Data::Later(make) => make(),
                };
                let bytes = match made {
                    Ok(b) if b.len() as u64 == t.len => b,
                    Ok(b) => {
                        let problem = format!("{} bytes were made, {} announced", b.len(), t.len);
                        failed = Some(GgufError::Tensor {
                            name: t.name,
                            problem,
                        });
                        return Err(std::io::Error::other("a tensor failed"));
                    }
                    Err(e) => {
                        failed = Some(e);
                        return Err(std::io::Error::other("a tensor failed"));
                    }
                };
                f.write_all(&bytes)?;
                f.write_all(&vec![0u8; (pad(t.len) - t.len) as usize])?;
            }
            f.flush()
        })
        .map_err(|e| failed.take().unwrap_or_else(|| err(e.to_string())))?;
        Ok(head.len() as u64 + offset)
    }
}
