//! The learning loop: every request the gateway escalated is scored once more by the remote, its
//! prompt and answer as one sequence (one prefill: the remote reads it, with its prefix cached
//! from the escalation), and written as a teacher-signal shard in the schema `teacher score`
//! writes ([`k3mini_data::shards`]): the remote's top-k at every position it read. `k3mini train`
//! distils the next student on them with `distill.mode = "traffic"`.
//!
//! One shard per request, written atomically while the request has the model, then recorded with
//! its SHA-256 by one line appended to the directory's journal (`manifest.jsonl`, synced) once the
//! answer naming it is on its way ([`Unjournaled`]): no answer waits for the journal's sync, and
//! an escalation costs the same however many came before it. A gateway killed between the two
//! leaves a shard the journal does not list; the next gateway to open the directory checks it and
//! lists it, and never reuses its name. A directory holds one remote's signals at one top-k, for
//! one tokenizer; the gateway refuses to add to another's, and stops adding (the answers still go
//! out) once its shards reach the size cap (`--traffic-max-bytes`).

use super::Ask;
use crate::error::{Result, at, refuse};
use k3mini_data::chat::Part;
use k3mini_data::digest::sha256_hex;
use k3mini_data::shards::{ShardMeta, Storage, read_shard, write_shard};
use k3mini_teacher::manifest::{
    KIND_TRAFFIC, Manifest, ShardEntry, TrafficJob, TrafficJournal, read_traffic, shard_file,
    unlisted_shards,
};
use k3mini_teacher::{LOGPROB_TEMPERATURE, Scored};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

/// A directory escalations are written into.
pub struct Traffic {
    dir: PathBuf,
    meta: ShardMeta,
    storage: Storage,
    /// The bytes its shards may hold, at most.
    max_bytes: Option<u64>,
    /// Taken only to name a shard and count its bytes, never across a write.
    names: Mutex<Names>,
    journal: Arc<Journal>,
}

/// The next shard's index, and the bytes the directory's shards hold.
struct Names {
    next: usize,
    bytes: u64,
}

/// The directory's journal, shared with the lines still owed to it ([`Unjournaled`]).
struct Journal {
    lines: Mutex<Lines>,
    /// How many lines the journal failed to take and still owes (read without the lock).
    owed: AtomicUsize,
}

struct Lines {
    journal: TrafficJournal,
    /// Shards written whose lines the journal failed to take, in the order they came.
    backlog: Vec<ShardEntry>,
    /// Held exclusively until the last line owed is written: two writers would take one index.
    _lock: std::fs::File,
}

impl Journal {
    /// Appends `entry`'s line after the backlog's, as far as the journal takes them.
    fn take(&self, entry: Option<ShardEntry>) -> Result<()> {
        let mut l = self.lines.lock().unwrap_or_else(|p| p.into_inner());
        l.backlog.extend(entry);
        let mut taken = Ok(());
        let Lines {
            journal, backlog, ..
        } = &mut *l;
        while let Some(entry) = backlog.first() {
            if let Err(e) = journal.append(entry) {
                taken = Err(e.into());
                break;
            }
            backlog.remove(0);
        }
        self.owed.store(l.backlog.len(), Ordering::SeqCst);
        taken
    }
}

/// A shard written whose journal line is not: the line is appended when this is dropped, which
/// the gateway does once hyper has taken the last of the answer naming the shard to write (or
/// its client has gone). A line the journal fails to take is owed: the next escalation retries
/// it before scoring anything, and is not written while it fails; a gateway that dies first
/// leaves the shard to the next to open the directory.
pub struct Unjournaled {
    entry: Option<ShardEntry>,
    journal: Arc<Journal>,
}

impl Unjournaled {
    /// As a gateway killed before the answer is sent leaves it: the shard written, never listed.
    #[cfg(test)]
    fn abandon(mut self) {
        self.entry = None;
    }
}

impl Drop for Unjournaled {
    fn drop(&mut self) {
        if let Some(entry) = self.entry.take() {
            // A failure leaves the line owed, for the next escalation to retry and report.
            let _ = self.journal.take(Some(entry));
        }
    }
}

/// The index after shard `index`'s in `dir`.
fn after(dir: &Path, index: usize) -> Result<usize> {
    index.checked_add(1).ok_or_else(|| {
        refuse!(
            "{}: shard {index} is the last index a traffic directory can hold",
            dir.display()
        )
    })
}

/// The journal's entry for shard `index` of `dir`, a shard written there whose line never came:
/// refused unless it is one row of this gateway's remote, top-k, tokenizer and storage.
fn adopt(dir: &Path, index: usize, meta: &ShardMeta, storage: Storage) -> Result<ShardEntry> {
    let file = shard_file(index);
    let path = dir.join(&file);
    let shard = read_shard(&path, None)?;
    if !(shard.meta == *meta && shard.storage == storage && shard.rows.len() == 1) {
        return Err(refuse!(
            "{}: the traffic journal does not list it, and it is not a shard this gateway would \
             write there ({} rows; {:?}, {:?}): move it out of the directory",
            path.display(),
            shard.rows.len(),
            shard.meta,
            shard.storage
        ));
    }
    Ok(ShardEntry {
        index,
        sha256: k3mini_data::digest::sha256_file(&path).map_err(at(path.display().to_string()))?,
        items: [index, after(dir, index)?],
        rows: 1,
        positions: shard.rows[0].positions(),
        bytes: std::fs::metadata(&path)
            .map_err(at(path.display().to_string()))?
            .len(),
        file,
        routing: None,
    })
}

impl Traffic {
    /// Opens (or starts) `dir` for the remote `teacher`'s top-`k`, made with the tokenizer whose
    /// fingerprint is `tokenizer_sha256` and vocabulary `vocab`, its shards holding at most
    /// `max_bytes`; refuses a directory of another remote, top-k or tokenizer.
    pub fn open(
        dir: &Path,
        teacher: &str,
        tokenizer_sha256: &str,
        k: usize,
        vocab: usize,
        max_bytes: Option<u64>,
    ) -> Result<Self> {
        let storage = Storage::Quantised {
            step: k3mini_data::shards::DEFAULT_LOGPROB_STEP,
        };
        let job = TrafficJob {
            kind: KIND_TRAFFIC.into(),
            teacher: teacher.into(),
            tokenizer_sha256: tokenizer_sha256.into(),
            k,
            temperature: LOGPROB_TEMPERATURE as f32,
            logprob_step: storage,
        };
        std::fs::create_dir_all(dir).map_err(at(dir.display().to_string()))?;
        let lock_path = dir.join(".lock");
        let lock =
            std::fs::File::create(&lock_path).map_err(at(lock_path.display().to_string()))?;
        match lock.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => {
                return Err(refuse!(
                    "{}: another gateway is writing its traffic here (it holds {}); give each its \
                 own directory",
                    dir.display(),
                    lock_path.display()
                ));
            }
            Err(std::fs::TryLockError::Error(e)) => {
                return Err(refuse!(
                    "{}: cannot lock it for this gateway ({e}); a file system without locks (some \
                 network mounts) cannot hold a traffic directory",
                    lock_path.display()
                ));
            }
        }
        let mut manifest = match read_traffic(dir)? {
            Some(m) => {
                if !(m.job == job) {
                    return Err(refuse!(
                        "{}: holds the traffic of another remote, top-k or tokenizer ({:?}); write \
                     this gateway's into another directory",
                        dir.display(),
                        m.job
                    ));
                }
                m
            }
            None => Manifest {
                job,
                shards: Vec::new(),
            },
        };
        let meta = ShardMeta {
            teacher: teacher.into(),
            tokenizer_sha256: tokenizer_sha256.into(),
            k,
            temperature: LOGPROB_TEMPERATURE as f32,
            vocab: Some(vocab),
        };
        let mut journal = TrafficJournal::open(dir, &manifest)?;
        for index in unlisted_shards(dir, &manifest)? {
            let entry = adopt(dir, index, &meta, storage)?;
            journal.append(&entry)?;
            manifest.shards.push(entry);
        }
        let next = match manifest.shards.iter().map(|s| s.index).max() {
            Some(last) => after(dir, last)?,
            None => 0,
        };
        Ok(Self {
            dir: dir.to_path_buf(),
            meta,
            storage,
            max_bytes,
            names: Mutex::new(Names {
                next,
                bytes: manifest.bytes(),
            }),
            journal: Arc::new(Journal {
                lines: Mutex::new(Lines {
                    journal,
                    backlog: Vec::new(),
                    _lock: lock,
                }),
                owed: AtomicUsize::new(0),
            }),
        })
    }

    fn names(&self) -> MutexGuard<'_, Names> {
        self.names.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Why nothing more is written here, if so: the journal still cannot take the lines it owes
    /// (retried here), or the shards have reached the size cap.
    pub fn blocked(&self) -> Option<String> {
        let owed = self.journal.owed.load(Ordering::SeqCst);
        if owed > 0
            && let Err(e) = self.journal.take(None)
        {
            return Some(format!(
                "the traffic journal cannot take the lines of {owed} shards written ({e}); the \
                 next gateway to open {} lists them",
                self.dir.display()
            ));
        }
        let cap = self.max_bytes?;
        let bytes = self.names().bytes;
        (bytes >= cap).then(|| {
            format!(
                "the traffic directory {} is full: its shards hold {bytes} bytes of the \
                 {cap} allowed (--traffic-max-bytes)",
                self.dir.display()
            )
        })
    }

    /// The remote's top-k to ask for.
    pub fn k(&self) -> usize {
        self.meta.k
    }

    /// Writes `scored` (the remote's signals over `ask.prompt` followed by `answer`) as one
    /// shard; returns its file name and its journal line, to be dropped once the answer is sent.
    /// The prompt's ids are `Prompt` (a chat's keep their parts, markup included) and the
    /// answer's `Answer`, its closing stop id too (the model must learn to stop), so training
    /// reads the answer unless `data.train_on` says otherwise.
    pub fn record(
        &self,
        ask: &Ask,
        answer: &[u32],
        scored: Scored,
    ) -> Result<(String, Unjournaled)> {
        let n = ask.prompt.len() + answer.len();
        if !(scored.ids.len() == n
            && scored.ids[..ask.prompt.len()] == ask.prompt[..]
            && scored.ids[ask.prompt.len()..] == answer[..])
        {
            return Err(refuse!(
                "the remote scored {} ids that are not the request's {n}",
                scored.ids.len()
            ));
        }
        let mut parts = ask
            .parts
            .clone()
            .unwrap_or_else(|| vec![Part::Prompt; ask.prompt.len()]);
        parts.extend(std::iter::repeat_n(Part::Answer, answer.len()));
        // The document key the held-out split hashes: the prompt, so answers to one prompt
        // (sampled, retried) fall on one side of the split.
        let bytes: Vec<u8> = ask.prompt.iter().flat_map(|i| i.to_le_bytes()).collect();
        let doc_id = u64::from_str_radix(&sha256_hex(&bytes)[..16], 16).expect("hex");
        let row = scored.into_row(doc_id, 0, Some(parts));
        // The name is taken from here on, whether the shard is written or not.
        let index = {
            let mut names = self.names();
            let index = names.next;
            names.next = after(&self.dir, index)?;
            index
        };
        let file = shard_file(index);
        let path = self.dir.join(&file);
        let positions = row.positions();
        let bytes = write_shard(&path, &self.meta, self.storage, std::slice::from_ref(&row))?;
        self.names().bytes += bytes;
        let sha256 =
            k3mini_data::digest::sha256_file(&path).map_err(at(path.display().to_string()))?;
        let entry = ShardEntry {
            index,
            file: file.clone(),
            sha256,
            items: [index, index + 1],
            rows: 1,
            positions,
            bytes,
            routing: None,
        };
        let line = Unjournaled {
            entry: Some(entry),
            journal: self.journal.clone(),
        };
        Ok((file, line))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k3mini_teacher::GenerateParams;

    /// The remote's signals over `ids`: a top-`k` of ids below `k` at every position.
    fn scored(ids: &[u32], k: usize) -> Scored {
        let mut s = Scored::empty(ids, k);
        for _ in 1..ids.len() {
            s.target_logprobs.push(-3.0);
            for j in 0..k {
                s.top_ids.push(j as u32);
                s.top_logprobs.push(-0.5 - j as f32);
            }
        }
        s
    }

    #[test]
    fn a_shard_whose_journal_line_never_came_is_listed_by_the_next_gateway_and_keeps_its_name() {
        let dir = std::env::temp_dir().join(format!("k3mini-traffic-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let open = || Traffic::open(&dir, "remote", &"ab".repeat(32), 2, 100, None);
        let listed = || read_traffic(&dir).unwrap().unwrap().shards;
        let ask = Ask {
            prompt: vec![10, 11, 12],
            params: GenerateParams::default(),
            stop_text: Vec::new(),
            gate: None,
            parts: None,
        };
        let answer = [13, 14];
        let record = |t: &Traffic| t.record(&ask, &answer, scored(&[10, 11, 12, 13, 14], 2));

        let traffic = open().unwrap();
        let (first, line) = record(&traffic).unwrap();
        assert_eq!(first, shard_file(0));
        // Listed once the answer naming it is sent, not before.
        assert!(listed().is_empty());
        drop(line);
        assert_eq!(listed().len(), 1);
        // The gateway dies before its second answer is sent.
        let (second, line) = record(&traffic).unwrap();
        line.abandon();
        drop(traffic);
        assert_eq!(listed().len(), 1);

        // The next gateway lists it, checked, and writes on after it.
        let traffic = open().unwrap();
        let shards = listed();
        assert_eq!(shards.len(), 2);
        let path = dir.join(&second);
        assert_eq!(shards[1].file, second);
        assert_eq!(
            shards[1].sha256,
            k3mini_data::digest::sha256_file(&path).unwrap()
        );
        assert_eq!(shards[1].bytes, std::fs::metadata(&path).unwrap().len());
        assert_eq!(shards[1].positions, 4);
        read_shard(&path, Some(&shards[1].sha256)).unwrap();
        let (third, line) = record(&traffic).unwrap();
        assert_eq!(third, shard_file(2));
        drop(line);
        assert_eq!(listed().len(), 3);
        // A line still owed keeps the directory locked: no gateway could list its shard first.
        let (_, line) = record(&traffic).unwrap();
        drop(traffic);
        let err = open().err().unwrap().to_string();
        assert!(err.contains("another gateway"), "{err}");
        drop(line);
        assert_eq!(listed().len(), 4);
        drop(open().unwrap());
        assert_eq!(listed().len(), 4);

        // A file in a shard's name that is not one of this gateway's is refused by name.
        std::fs::write(dir.join(shard_file(7)), b"not a shard").unwrap();
        let err = open().err().unwrap().to_string();
        assert!(err.contains(&shard_file(7)), "{err}");
        std::fs::remove_dir_all(&dir).ok();
    }
}
