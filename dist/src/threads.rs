//! Ranks that are threads of one process. Each operation puts every rank's buffer in a shared
//! table; once all have, each rank computes its own result from the table, summing in rank order,
//! so every rank gets the same bits and a sum equals [`all_reduce_ordered`](crate::all_reduce_ordered)'s.
//! The reference the cross-process backends are tested against, and the group of a run whose
//! ranks share one process.

use crate::{Collective, DistError, Result, pieces, root_in};
use std::any::Any;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// One rank's contribution to an operation: its name (every rank must call the same) and buffer.
type Piece = (&'static str, Arc<dyn Any + Send + Sync>);

/// The `world` ranks of a new group, each waiting at most `timeout` for the others.
pub fn group(world: usize, timeout: Duration) -> Vec<ThreadRank> {
    let shared = Arc::new(Shared {
        state: Mutex::new(State {
            generation: 0,
            slots: vec![None; world],
            published: Ok(Arc::new(Vec::new())),
            broken: None,
        }),
        changed: Condvar::new(),
    });
    (0..world)
        .map(|rank| ThreadRank {
            rank,
            world,
            timeout: crate::bounded(timeout),
            shared: shared.clone(),
        })
        .collect()
}

/// A rank of a [`group`]; dropping it breaks the group (the others' calls fail at once).
pub struct ThreadRank {
    rank: usize,
    world: usize,
    timeout: Duration,
    shared: Arc<Shared>,
}

struct Shared {
    state: Mutex<State>,
    changed: Condvar,
}

struct State {
    /// Operations completed.
    generation: u64,
    /// This operation's pieces so far, by rank.
    slots: Vec<Option<Piece>>,
    /// The last operation's pieces, by rank, or why it failed.
    published: std::result::Result<Arc<Vec<Piece>>, String>,
    /// Why the group can no longer run an operation.
    broken: Option<String>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl ThreadRank {
    /// Every rank's `mine` for operation `op`, by rank.
    fn exchange<T: Any + Send + Sync>(&self, op: &'static str, mine: T) -> Result<Vec<Arc<T>>> {
        let broken = |why: &str| DistError::Backend {
            op,
            message: format!("the group is broken: {why}"),
        };
        let mut s = self.shared.lock();
        if let Some(why) = &s.broken {
            return Err(broken(why));
        }
        let generation = s.generation;
        s.slots[self.rank] = Some((op, Arc::new(mine)));
        if s.slots.iter().all(Option::is_some) {
            let table: Vec<Piece> = s
                .slots
                .iter_mut()
                .map(|p| p.take().expect("all in"))
                .collect();
            s.published = match table.iter().find(|(o, _)| *o != table[0].0) {
                None => Ok(Arc::new(table)),
                Some(_) => Err(format!(
                    "the ranks called different operations: {:?}",
                    table.iter().map(|p| p.0).collect::<Vec<_>>()
                )),
            };
            s.generation += 1;
            self.shared.changed.notify_all();
        } else {
            let deadline = Instant::now() + self.timeout;
            while s.generation == generation && s.broken.is_none() {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    let missing: Vec<usize> =
                        (0..self.world).filter(|&r| s.slots[r].is_none()).collect();
                    let why = format!("ranks {missing:?} did not arrive");
                    s.broken = Some(format!("rank {} timed out: {why}", self.rank));
                    self.shared.changed.notify_all();
                    return Err(DistError::Timeout {
                        op,
                        rank: self.rank,
                        timeout: self.timeout,
                        why,
                    });
                }
                s = self
                    .shared
                    .changed
                    .wait_timeout(s, left)
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
            }
            if s.generation == generation {
                let why = s.broken.clone().unwrap_or_default();
                return Err(broken(&why));
            }
        }
        let table = s
            .published
            .clone()
            .map_err(|message| DistError::Backend { op, message })?;
        table
            .iter()
            .map(|(_, p)| p.clone().downcast::<T>().expect("one operation, one type"))
            .map(Ok)
            .collect()
    }

    /// Every rank's buffer, each `n` long.
    fn same_length<T: Any + Send + Sync + Copy>(
        &self,
        op: &'static str,
        mine: &[T],
    ) -> Result<Vec<Arc<Vec<T>>>> {
        let table = self.exchange(op, mine.to_vec())?;
        if table.iter().any(|t| t.len() != mine.len()) {
            let lengths: Vec<usize> = table.iter().map(|t| t.len()).collect();
            return Err(DistError::Shape {
                op,
                message: format!("the ranks sent buffers of different lengths: {lengths:?}"),
            });
        }
        Ok(table)
    }
}

impl ThreadRank {
    /// `data` ← Σ over the ranks' `data`, in rank order.
    fn sum<T: Any + Send + Sync + Copy + std::ops::AddAssign>(
        &self,
        op: &'static str,
        data: &mut [T],
    ) -> Result<()> {
        let table = self.same_length(op, data)?;
        sum_into(data, table.iter().map(|t| &t[..]));
        Ok(())
    }
}

/// `data` ← Σ over `pieces`, in rank order.
fn sum_into<'a, T: Copy + std::ops::AddAssign + 'a>(
    data: &mut [T],
    mut pieces: impl Iterator<Item = &'a [T]>,
) {
    data.copy_from_slice(pieces.next().expect("a group has a rank"));
    for piece in pieces {
        for (d, &x) in data.iter_mut().zip(piece) {
            *d += x;
        }
    }
}

impl Collective for ThreadRank {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn all_reduce(&mut self, data: &mut [f32]) -> Result<()> {
        self.sum("all_reduce", data)
    }

    fn all_reduce_f64(&mut self, data: &mut [f64]) -> Result<()> {
        self.sum("all_reduce_f64", data)
    }

    fn reduce_scatter(&mut self, input: &[f32], output: &mut [f32]) -> Result<()> {
        const OP: &str = "reduce_scatter";
        pieces(OP, self.world, input.len(), output.len())?;
        let table = self.same_length(OP, input)?;
        let n = output.len();
        let mine = n * self.rank..n * (self.rank + 1);
        sum_into(output, table.iter().map(|t| &t[mine.clone()]));
        Ok(())
    }

    fn all_gather(&mut self, input: &[f32], output: &mut [f32]) -> Result<()> {
        const OP: &str = "all_gather";
        pieces(OP, self.world, output.len(), input.len())?;
        let table = self.same_length(OP, input)?;
        for (out, piece) in output.chunks_exact_mut(input.len().max(1)).zip(&table) {
            out.copy_from_slice(piece);
        }
        Ok(())
    }

    fn broadcast(&mut self, data: &mut [f32], root: usize) -> Result<()> {
        const OP: &str = "broadcast";
        root_in(OP, self.world, root)?;
        let roots = self.exchange("broadcast root", root)?;
        if roots.iter().any(|r| **r != root) {
            let roots: Vec<usize> = roots.iter().map(|r| **r).collect();
            return Err(DistError::Shape {
                op: OP,
                message: format!("the ranks named different roots: {roots:?}"),
            });
        }
        let table = self.same_length(OP, data)?;
        data.copy_from_slice(&table[root]);
        Ok(())
    }

    fn barrier(&mut self) -> Result<()> {
        self.exchange("barrier", ()).map(drop)
    }
}

impl Drop for ThreadRank {
    fn drop(&mut self) {
        let mut s = self.shared.lock();
        if s.broken.is_none() {
            s.broken = Some(format!("rank {} left the group", self.rank));
        }
        self.shared.changed.notify_all();
    }
}
