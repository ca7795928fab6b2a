//! The learning loop: every request the gateway escalated is scored once more by the remote, its
//! prompt and answer as one sequence (one prefill: the remote reads it, with its prefix cached
//! from the escalation), and written as a teacher-signal shard in the schema `teacher score`
//! writes ([`k3mini_data::shards`]): the remote's top-k at every position it read. `k3mini train`
//! distils the next student on them with `distill.mode = "traffic"`.
//!
//! One shard per request, each written atomically and then recorded with its SHA-256 by one line
//! appended to the directory's journal (`manifest.jsonl`, synced), so a gateway killed at any
//! moment loses at most the request in flight, and an escalation costs the same however many came
//! before it. A directory holds one remote's signals at one top-k, for one tokenizer; the gateway
//! refuses to add to another's, and stops adding (the answers still go out) once its shards reach
//! the size cap (`--traffic-max-bytes`).

use super::Ask;
use crate::error::{Result, at, refuse};
use k3mini_data::chat::Part;
use k3mini_data::digest::sha256_hex;
use k3mini_data::shards::{ShardMeta, Storage, write_shard};
use k3mini_teacher::manifest::{
    KIND_TRAFFIC, Manifest, ShardEntry, TrafficJob, TrafficJournal, read_traffic,
};
use k3mini_teacher::{LOGPROB_TEMPERATURE, Scored};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// A directory escalations are written into.
pub struct Traffic {
    dir: PathBuf,
    meta: ShardMeta,
    storage: Storage,
    /// The bytes its shards may hold, at most.
    max_bytes: Option<u64>,
    written: Mutex<Written>,
    /// Held exclusively while this gateway writes here: two writers would take the same index.
    _lock: std::fs::File,
}

/// What the directory holds so far, and its journal.
struct Written {
    journal: TrafficJournal,
    /// The next shard's index.
    next: usize,
    /// Its shards' bytes.
    bytes: u64,
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
        let manifest = match read_traffic(dir)? {
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
        let written = Written {
            journal: TrafficJournal::open(dir, &manifest)?,
            next: manifest
                .shards
                .iter()
                .map(|s| s.index + 1)
                .max()
                .unwrap_or(0),
            bytes: manifest.bytes(),
        };
        Ok(Self {
            dir: dir.to_path_buf(),
            meta: ShardMeta {
                teacher: teacher.into(),
                tokenizer_sha256: tokenizer_sha256.into(),
                k,
                temperature: LOGPROB_TEMPERATURE as f32,
                vocab: Some(vocab),
            },
            storage,
            max_bytes,
            written: Mutex::new(written),
            _lock: lock,
        })
    }

    fn written(&self) -> std::sync::MutexGuard<'_, Written> {
        self.written.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Why nothing more is written here, when the shards have reached the size cap.
    pub fn full(&self) -> Option<String> {
        let cap = self.max_bytes?;
        let bytes = self.written().bytes;
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
    /// shard; returns its file name. The prompt's ids are `Prompt` (a chat's keep their parts,
    /// markup included) and the answer's `Answer`, its closing stop id too (the model must learn
    /// to stop), so training reads the answer unless `data.train_on` says otherwise.
    pub fn record(&self, ask: &Ask, answer: &[u32], scored: Scored) -> Result<String> {
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
        let mut w = self.written();
        let index = w.next;
        let file = format!("shard-{index:05}.parquet");
        let path = self.dir.join(&file);
        let positions = row.positions();
        let bytes = write_shard(&path, &self.meta, self.storage, std::slice::from_ref(&row))?;
        let sha256 =
            k3mini_data::digest::sha256_file(&path).map_err(at(path.display().to_string()))?;
        w.journal.append(&ShardEntry {
            index,
            file: file.clone(),
            sha256,
            items: [index, index + 1],
            rows: 1,
            positions,
            bytes,
            routing: None,
        })?;
        w.next += 1;
        w.bytes += bytes;
        Ok(file)
    }
}
