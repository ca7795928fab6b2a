//! The model's queue. A model uses every core already, so model requests take turns: one runs,
//! at most `capacity` are admitted (running, waiting, or being tokenized before they wait), and
//! one more is refused ([`Busy`], a 503 with `Retry-After`). A request is admitted before its
//! prompt is tokenized, so no more prompts than the queue holds are tokenized at once.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, TryLockError};
use std::time::Duration;

pub struct Queue {
    compute: Mutex<()>,
    admitted: Arc<AtomicUsize>,
    capacity: usize,
}

/// The queue is full: worth a retry shortly.
#[derive(Debug)]
pub struct Busy(pub String);

impl std::fmt::Display for Busy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// A model request's place among the admitted, given back when dropped.
#[derive(Debug)]
pub struct Admitted(Arc<AtomicUsize>);

impl Drop for Admitted {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A model request's turn: the compute lock, and its place among the admitted.
pub struct Turn<'a> {
    _compute: std::sync::MutexGuard<'a, ()>,
    _admitted: Admitted,
}

impl Queue {
    /// At most `capacity` (at least 1) requests admitted.
    pub fn new(capacity: usize) -> Self {
        Self {
            compute: Mutex::new(()),
            admitted: Arc::new(AtomicUsize::new(0)),
            capacity: capacity.max(1),
        }
    }

    /// A place among the admitted, or [`Busy`] when the queue is full.
    pub fn admit(&self) -> Result<Admitted, Busy> {
        let before = self.admitted.fetch_add(1, Ordering::SeqCst);
        let admitted = Admitted(self.admitted.clone());
        if before >= self.capacity {
            return Err(Busy(format!(
                "the model is busy: {before} requests are running or queued (at most {}); retry \
                 shortly",
                self.capacity
            )));
        }
        Ok(admitted)
    }

    /// Waits for the model with an admitted request's place; a waiting request leaves the
    /// queue with `wait`'s error once it gives one (its deadline passed, its client left).
    pub fn turn<E>(
        &self,
        admitted: Admitted,
        wait: impl Fn() -> Result<(), E>,
    ) -> Result<Turn<'_>, E> {
        let compute = loop {
            match self.compute.try_lock() {
                Ok(guard) => break guard,
                Err(TryLockError::Poisoned(p)) => break p.into_inner(),
                Err(TryLockError::WouldBlock) => {
                    wait()?;
                    std::thread::sleep(Duration::from_millis(5));
                }
            }
        };
        Ok(Turn {
            _compute: compute,
            _admitted: admitted,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_queue_admits_its_capacity_and_gives_places_back() {
        let q = Queue::new(2);
        let a = q.admit().unwrap();
        let b = q.admit().unwrap();
        assert!(q.admit().unwrap_err().0.contains("at most 2"));
        drop(a);
        let turn = q.turn(q.admit().unwrap(), || Ok::<(), ()>(())).unwrap();
        // The model is taken: a waiting request leaves with its own reason.
        assert_eq!(q.turn(b, || Err("gone")).err(), Some("gone"));
        drop(turn);
        assert!(q.admit().is_ok());
    }
}
