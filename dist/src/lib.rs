//! Collectives across the ranks of a training run: one [`Collective`] trait on host buffers,
//! implemented by ranks that are threads of one process ([`threads`]) and, with the `c10d`
//! feature, by PyTorch's distributed engine across processes and machines ([`c10d`]: Gloo, what
//! torchrun and SLURM jobs already run), its ranks found from the launcher's variables
//! ([`launch`]).
//!
//! Every operation is called by every rank of the group, in the same order, with the same lengths
//! (and root). The thread ranks check all of it; Gloo sees only byte counts, so a call the ranks
//! disagree on may fail or may mix their bytes: the caller keeps the order. A rank that dies, or
//! one that never comes, ends the others' call with an error within the group's timeout, never a
//! hang.

#[cfg(feature = "c10d")]
pub mod c10d;
pub mod launch;
pub mod threads;

use std::time::Duration;

#[derive(Debug, thiserror::Error)]
pub enum DistError {
    /// A buffer of the wrong length for the operation.
    #[error("{op}: {message}")]
    Shape { op: &'static str, message: String },
    /// A rank did not arrive within the group's timeout.
    #[error("{op}: rank {rank} waited {timeout:?} for the others: {why}")]
    Timeout {
        op: &'static str,
        rank: usize,
        timeout: Duration,
        why: String,
    },
    /// The backend failed (c10d's message).
    #[error("{op}: {message}")]
    Backend { op: &'static str, message: String },
    /// The launcher's variables do not describe a rank.
    #[error("launcher: {0}")]
    Launch(String),
}

pub type Result<T, E = DistError> = std::result::Result<T, E>;

/// The longest a group waits for its ranks, and the shortest (a zero timeout means "forever" to
/// c10d and Gloo): a group's timeout is held within them.
pub const WAIT_BOUNDS: (Duration, Duration) =
    (Duration::from_millis(1), Duration::from_secs(24 * 3600));

fn bounded(timeout: Duration) -> Duration {
    timeout.clamp(WAIT_BOUNDS.0, WAIT_BOUNDS.1)
}

/// One rank's handle on a group of `world` ranks. Sums are element-wise.
pub trait Collective: Send {
    fn rank(&self) -> usize;
    fn world(&self) -> usize;

    /// Every rank's `data` becomes the sum over ranks of `data`. The order of the sum is the
    /// backend's (a ring's differs from a fixed order in the last bits): [`all_reduce_ordered`]
    /// sums in rank order.
    fn all_reduce(&mut self, data: &mut [f32]) -> Result<()>;

    /// [`Collective::all_reduce`] of f64 figures (losses, counts, norms).
    fn all_reduce_f64(&mut self, data: &mut [f64]) -> Result<()>;

    /// `input` is `world` pieces of `output.len()`: rank r's `output` becomes the sum over ranks
    /// of their piece r.
    fn reduce_scatter(&mut self, input: &[f32], output: &mut [f32]) -> Result<()>;

    /// `output` (`world` pieces of `input.len()`) becomes every rank's `input`, in rank order.
    fn all_gather(&mut self, input: &[f32], output: &mut [f32]) -> Result<()>;

    /// Every rank's `data` becomes rank `root`'s.
    fn broadcast(&mut self, data: &mut [f32], root: usize) -> Result<()>;

    /// Returns once every rank has called it.
    fn barrier(&mut self) -> Result<()>;
}

/// [`Collective::all_reduce`] summed in rank order, `((d_0 + d_1) + d_2) + …`, whatever the
/// backend: the same bits on every rank, and the bits one process summing the ranks' buffers in
/// that order gets. Costs an all-gather (`world` times the buffer on every rank).
pub fn all_reduce_ordered(c: &mut dyn Collective, data: &mut [f32]) -> Result<()> {
    let n = data.len();
    let mut all = vec![0.0f32; n * c.world()];
    c.all_gather(data, &mut all)?;
    data.copy_from_slice(&all[..n]);
    for piece in all[n..].chunks_exact(n.max(1)) {
        for (d, x) in data.iter_mut().zip(piece) {
            *d += x;
        }
    }
    Ok(())
}

/// Refuses buffers whose lengths do not fit `op` in a group of `world`: `input` must be `world`
/// times `output` (`scatter`) or `output` `world` times `input` (a gather).
fn pieces(op: &'static str, world: usize, whole: usize, piece: usize) -> Result<()> {
    if piece.checked_mul(world) == Some(whole) {
        return Ok(());
    }
    Err(DistError::Shape {
        op,
        message: format!(
            "a buffer of {whole} elements is not {world} pieces of {piece} (one per rank)"
        ),
    })
}

fn root_in(op: &'static str, world: usize, root: usize) -> Result<()> {
    if root < world {
        return Ok(());
    }
    Err(DistError::Shape {
        op,
        message: format!("root rank {root} is not one of the group's {world}"),
    })
}
