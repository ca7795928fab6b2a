//! PyTorch's c10d across processes and machines: a process group meeting in a file store or a
//! TCP store, through `shim/c10d.cpp`: Gloo's (host buffers; what CPU runs use), or with the
//! `nccl` feature NCCL's on one CUDA device, the host buffers copied through the device and back
//! in pieces of at most 256 MiB (NCCL's transports, NVLink and InfiniBand, at the cost of a copy
//! each way). The shim catches every C++ exception and hands back its message, named here by the
//! operation; after one, the group refuses every further operation (what its peers did is
//! unknown). An operation returns only once the backend is done with its buffers. Gloo's timeout
//! bounds each transfer, not the whole operation, so a large one may take longer than it and
//! still succeed; NCCL's (in blocking-wait mode, which the shim sets unless told otherwise) bounds
//! each staged piece.
//!
//! Gloo has no reduce-scatter of its own: c10d's all-reduces the whole input and keeps this
//! rank's piece (`world` times the traffic of a ring reduce-scatter). All-gather and broadcast
//! are Gloo's.

use crate::launch::{Device, Rendezvous, Store};
use crate::{Collective, DistError, Result, pieces, root_in};
use std::ffi::{CString, c_char, c_int, c_longlong, c_void};

unsafe extern "C" {
    #[allow(clippy::too_many_arguments)]
    fn k3_group_new(
        path: *const c_char,
        host: *const c_char,
        port: c_int,
        is_server: c_int,
        prefix: *const c_char,
        device_kind: c_int,
        device: *const c_char,
        cuda: c_int,
        rank: c_int,
        world: c_int,
        timeout_ms: c_longlong,
        piece_bytes: c_longlong,
        err: *mut c_char,
        err_len: usize,
    ) -> *mut c_void;
    fn k3_group_free(group: *mut c_void);
    fn k3_all_reduce(
        group: *mut c_void,
        data: *mut c_void,
        n: usize,
        dtype: c_int,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    fn k3_between(
        group: *mut c_void,
        gather: c_int,
        input: *const c_void,
        output: *mut c_void,
        n: usize,
        dtype: c_int,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    fn k3_broadcast(
        group: *mut c_void,
        data: *mut c_void,
        n: usize,
        dtype: c_int,
        root: c_int,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    fn k3_barrier(group: *mut c_void, err: *mut c_char, err_len: usize) -> c_int;
}

/// The shim's dtype codes.
const F32: c_int = 0;
const F64: c_int = 1;

/// Which of c10d's backends a group runs on.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Backend {
    /// Gloo, on the CPU (TCP between processes).
    Gloo,
    /// NCCL on CUDA device `cuda` (the `nccl` feature).
    Nccl { cuda: usize },
}

/// The most NCCL stages on its device at once: the host buffers pass through it in pieces, so
/// the staging costs a bounded slice of GPU memory, not a model's gradients.
pub const NCCL_PIECE_BYTES: usize = 256 << 20;

/// A rank of a c10d process group.
pub struct Group {
    group: *mut c_void,
    rank: usize,
    world: usize,
}

// SAFETY: the group is used from one thread at a time (`&mut self`); c10d's process group is
// not tied to the thread that made it.
unsafe impl Send for Group {}

/// Room for the shim's error messages.
const ERR_LEN: usize = 4096;

fn message(err: &[u8]) -> String {
    let end = err.iter().position(|&b| b == 0).unwrap_or(err.len());
    String::from_utf8_lossy(&err[..end]).into_owned()
}

fn c_string(op: &'static str, what: &str, s: &str) -> Result<CString> {
    CString::new(s).map_err(|_| DistError::Shape {
        op,
        message: format!("the {what} holds a NUL byte: {s:?}"),
    })
}

impl Group {
    /// Joins the group `r` describes on `backend`: returns once every rank has, or fails naming
    /// why (a rank that does not come within the timeout, a store that cannot be reached, no
    /// CUDA device for NCCL). Gloo works on whole buffers in place; NCCL stages at most
    /// [`NCCL_PIECE_BYTES`] on its device at once.
    pub fn join(r: &Rendezvous, backend: Backend) -> Result<Self> {
        let piece_bytes = match backend {
            Backend::Gloo => 0,
            Backend::Nccl { .. } => NCCL_PIECE_BYTES,
        };
        Self::join_in_pieces(r, backend, piece_bytes)
    }

    /// [`Group::join`], every operation moving at most `piece_bytes` of each rank's buffer at
    /// once (0: whole buffers, one operation each).
    pub fn join_in_pieces(r: &Rendezvous, backend: Backend, piece_bytes: usize) -> Result<Self> {
        const OP: &str = "join";
        let bad = |message: String| DistError::Shape { op: OP, message };
        if r.world == 0 || r.rank >= r.world || r.world > c_int::MAX as usize {
            return Err(bad(format!(
                "rank {} of a group of {} ranks",
                r.rank, r.world
            )));
        }
        let (path, host, port, server) = match &r.store {
            Store::File(path) => {
                let path = path
                    .to_str()
                    .ok_or_else(|| bad(format!("{}: not UTF-8", path.display())))?;
                (Some(c_string(OP, "store path", path)?), None, 0, false)
            }
            Store::Tcp { host, port, server } => (
                None,
                Some(c_string(OP, "store host", host)?),
                *port,
                *server,
            ),
        };
        let prefix = c_string(OP, "key prefix", &r.prefix)?;
        let (device_kind, device) = match &r.device {
            Device::Default => (0, None),
            Device::Host(h) => (1, Some(c_string(OP, "device host", h)?)),
            Device::Interface(i) => (2, Some(c_string(OP, "device interface", i)?)),
        };
        let cuda = match backend {
            Backend::Gloo => -1,
            Backend::Nccl { cuda } => {
                c_int::try_from(cuda).map_err(|_| bad(format!("CUDA device {cuda}")))?
            }
        };
        let timeout_ms = crate::bounded(r.timeout).as_millis() as c_longlong;
        let piece_bytes = c_longlong::try_from(piece_bytes)
            .map_err(|_| bad(format!("pieces of {piece_bytes} bytes")))?;
        let mut err = vec![0u8; ERR_LEN];
        // SAFETY: every pointer is valid for the call (CStrings and a buffer of ERR_LEN bytes).
        let group = unsafe {
            k3_group_new(
                path.as_ref().map_or(std::ptr::null(), |p| p.as_ptr()),
                host.as_ref().map_or(std::ptr::null(), |h| h.as_ptr()),
                c_int::from(port),
                c_int::from(server),
                prefix.as_ptr(),
                device_kind,
                device.as_ref().map_or(std::ptr::null(), |d| d.as_ptr()),
                cuda,
                r.rank as c_int,
                r.world as c_int,
                timeout_ms,
                piece_bytes,
                err.as_mut_ptr().cast(),
                ERR_LEN,
            )
        };
        if group.is_null() {
            return Err(DistError::Backend {
                op: OP,
                message: message(&err),
            });
        }
        Ok(Self {
            group,
            rank: r.rank,
            world: r.world,
        })
    }

    /// Runs a shim call, naming its failure by `op`.
    fn call(
        &mut self,
        op: &'static str,
        f: impl FnOnce(*mut c_void, *mut c_char) -> c_int,
    ) -> Result<()> {
        let mut err = vec![0u8; ERR_LEN];
        match f(self.group, err.as_mut_ptr().cast()) {
            0 => Ok(()),
            _ => Err(DistError::Backend {
                op,
                message: message(&err),
            }),
        }
    }
}

impl Group {
    /// A reduce-scatter, or an all-gather (`gather`), from `input` into `output`: `n` a rank's
    /// piece, the whole `world` pieces (the caller has checked the lengths).
    fn between(
        &mut self,
        op: &'static str,
        gather: bool,
        input: &[f32],
        output: &mut [f32],
        n: usize,
    ) -> Result<()> {
        let (inp, out) = (input.as_ptr().cast(), output.as_mut_ptr().cast());
        // SAFETY: the buffers hold what the shim reads and writes for n, checked by the caller.
        self.call(op, |g, e| unsafe {
            k3_between(g, c_int::from(gather), inp, out, n, F32, e, ERR_LEN)
        })
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        // SAFETY: made by k3_group_new, freed once.
        unsafe { k3_group_free(self.group) }
    }
}

impl Collective for Group {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn all_reduce(&mut self, data: &mut [f32]) -> Result<()> {
        let (ptr, n) = (data.as_mut_ptr().cast(), data.len());
        // SAFETY: `data` is valid for n elements for the call; the shim returns after waiting.
        self.call("all_reduce", |g, e| unsafe {
            k3_all_reduce(g, ptr, n, F32, e, ERR_LEN)
        })
    }

    fn all_reduce_f64(&mut self, data: &mut [f64]) -> Result<()> {
        let (ptr, n) = (data.as_mut_ptr().cast(), data.len());
        // SAFETY: as all_reduce.
        self.call("all_reduce_f64", |g, e| unsafe {
            k3_all_reduce(g, ptr, n, F64, e, ERR_LEN)
        })
    }

    fn reduce_scatter(&mut self, input: &[f32], output: &mut [f32]) -> Result<()> {
        let n = output.len();
        pieces("reduce_scatter", self.world, input.len(), n)?;
        self.between("reduce_scatter", false, input, output, n)
    }

    fn all_gather(&mut self, input: &[f32], output: &mut [f32]) -> Result<()> {
        let n = input.len();
        pieces("all_gather", self.world, output.len(), n)?;
        self.between("all_gather", true, input, output, n)
    }

    fn broadcast(&mut self, data: &mut [f32], root: usize) -> Result<()> {
        const OP: &str = "broadcast";
        root_in(OP, self.world, root)?;
        let (ptr, n) = (data.as_mut_ptr().cast(), data.len());
        // SAFETY: as all_reduce; root is a rank of the group.
        self.call(OP, |g, e| unsafe {
            k3_broadcast(g, ptr, n, F32, root as c_int, e, ERR_LEN)
        })
    }

    fn barrier(&mut self) -> Result<()> {
        // SAFETY: the group is live.
        self.call("barrier", |g, e| unsafe { k3_barrier(g, e, ERR_LEN) })
    }
}
