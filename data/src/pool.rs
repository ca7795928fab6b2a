//! The one worker pool k3mini runs parallel work on: requests to teacher servers (`concurrency`
//! in flight) and CPU work such as quantising tensors (one worker per core).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// Runs `work(i)` for every `i < n` with up to `concurrency` calls in flight, results in order.
/// `done` is called (on this thread) with each finished result. The first error stops new calls
/// and is returned.
pub fn run_many<T: Send, E: Send>(
    n: usize,
    concurrency: usize,
    work: &(dyn Fn(usize) -> Result<T, E> + Sync),
    done: &mut dyn FnMut(&T),
) -> Result<Vec<T>, E> {
    let next = AtomicUsize::new(0);
    let failed = AtomicBool::new(false);
    let mut slots: Vec<Option<T>> = (0..n).map(|_| None).collect();
    let mut first_error = None;
    std::thread::scope(|scope| {
        let (tx, rx) = std::sync::mpsc::channel();
        for _ in 0..concurrency.clamp(1, n.max(1)) {
            let (tx, next, failed) = (tx.clone(), &next, &failed);
            scope.spawn(move || {
                while !failed.load(Ordering::SeqCst) {
                    let i = next.fetch_add(1, Ordering::SeqCst);
                    if i >= n {
                        break;
                    }
                    let result = work(i);
                    if result.is_err() {
                        failed.store(true, Ordering::SeqCst);
                    }
                    if tx.send((i, result)).is_err() {
                        break;
                    }
                }
            });
        }
        drop(tx);
        for (i, result) in rx {
            match result {
                Ok(v) => {
                    done(&v);
                    slots[i] = Some(v);
                }
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
    });
    if let Some(e) = first_error {
        return Err(e);
    }
    Ok(slots
        .into_iter()
        .map(|s| s.expect("every input done"))
        .collect())
}
