//! The learning loop: every request the gateway escalated is scored once more by the remote, its
//! prompt and answer as one sequence (one prefill: the remote reads it, with its prefix cached
//! from the escalation), and written as a teacher-signal shard in the schema `teacher score`
//! writes ([`k3mini_data::shards`]): the remote's top-k at every position it read. `k3mini train`
//! distils the next student on them with `distill.mode = "traffic"`.
//!
//! One shard per request, each written atomically and then recorded with its SHA-256 in the
//! directory's `manifest.json` (replaced atomically), so a gateway killed at any moment loses at
//! most the request in flight. A directory holds one remote's signals at one top-k, for one
//! tokenizer; the gateway refuses to add to another's.

use super::Ask;
use crate::error::{Context, Result};
use k3mini_data::chat::Part;
use k3mini_data::digest::sha256_hex;
use k3mini_data::shards::{ShardMeta, Storage, write_shard};
use k3mini_teacher::manifest::{MANIFEST, Manifest, ShardEntry, write_manifest};
use k3mini_teacher::{LOGPROB_TEMPERATURE, Scored};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// What a traffic directory holds (its manifest's `job`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrafficJob {
    /// Always `"traffic"`: what tells this manifest from `teacher score`'s.
    pub kind: String,
    pub teacher: String,
    pub tokenizer_sha256: String,
    pub k: usize,
    pub temperature: f32,
    pub logprob_step: Storage,
}

pub const KIND: &str = "traffic";

/// A directory escalations are written into.
pub struct Traffic {
    dir: PathBuf,
    meta: ShardMeta,
    storage: Storage,
    manifest: Mutex<Manifest<TrafficJob>>,
}

/// A shard's index in the manifest (the next free one).
fn next_index(m: &Manifest<TrafficJob>) -> usize {
    m.shards.iter().map(|s| s.index + 1).max().unwrap_or(0)
}

impl Traffic {
    /// Opens (or starts) `dir` for the remote `teacher`'s top-`k`, made with the tokenizer whose
    /// fingerprint is `tokenizer_sha256` and vocabulary `vocab`; refuses a directory of another
    /// remote, top-k or tokenizer.
    pub fn open(
        dir: &Path,
        teacher: &str,
        tokenizer_sha256: &str,
        k: usize,
        vocab: usize,
    ) -> Result<Self> {
        let storage = Storage::Quantised {
            step: k3mini_data::shards::DEFAULT_LOGPROB_STEP,
        };
        let job = TrafficJob {
            kind: KIND.into(),
            teacher: teacher.into(),
            tokenizer_sha256: tokenizer_sha256.into(),
            k,
            temperature: LOGPROB_TEMPERATURE as f32,
            logprob_step: storage,
        };
        std::fs::create_dir_all(dir).with_context(|| dir.display().to_string())?;
        let path = dir.join(MANIFEST);
        let manifest = match std::fs::read(&path) {
            Ok(bytes) => {
                let m: Manifest<TrafficJob> = serde_json::from_slice(&bytes)
                    .with_context(|| format!("{}: not a traffic manifest", path.display()))?;
                crate::ensure!(
                    m.job == job,
                    "{}: holds the traffic of another remote, top-k or tokenizer ({:?}); write \
                     this gateway's into another directory",
                    path.display(),
                    m.job
                );
                m
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Manifest {
                job,
                shards: Vec::new(),
            },
            Err(e) => return Err(e).with_context(|| path.display().to_string()),
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
            manifest: Mutex::new(manifest),
        })
    }

    /// The remote's top-k to ask for.
    pub fn k(&self) -> usize {
        self.meta.k
    }

    /// Writes `scored` (the remote's signals over `ask.prompt` followed by `answer`) as one
    /// shard; returns its file name. A chat's prompt keeps its parts, the answer is `Answer`
    /// (a stop id ending it, `Markup`), so training reads the answer by default.
    pub fn record(&self, ask: &Ask, answer: &[u32], scored: Scored) -> Result<String> {
        let n = ask.prompt.len() + answer.len();
        crate::ensure!(
            scored.ids.len() == n && scored.ids[..ask.prompt.len()] == ask.prompt[..],
            "the remote scored {} ids, not the request's {n}",
            scored.ids.len()
        );
        let parts = ask.parts.as_ref().map(|prompt| {
            let mut parts = prompt.clone();
            parts.extend(answer.iter().map(|id| {
                if ask.params.stop.contains(id) {
                    Part::Markup
                } else {
                    Part::Answer
                }
            }));
            parts
        });
        // The document key the held-out split hashes: the sequence itself.
        let digest = sha256_hex(
            &scored
                .ids
                .iter()
                .flat_map(|i| i.to_le_bytes())
                .collect::<Vec<u8>>(),
        );
        let doc_id = u64::from_str_radix(&digest[..16], 16).expect("hex");
        let row = scored.into_row(doc_id, 0, parts);
        let mut m = self.manifest.lock().unwrap_or_else(|p| p.into_inner());
        let index = next_index(&m);
        let file = format!("shard-{index:05}.parquet");
        let path = self.dir.join(&file);
        let positions = row.positions();
        let bytes = write_shard(&path, &self.meta, self.storage, std::slice::from_ref(&row))?;
        let sha256 =
            k3mini_data::digest::sha256_file(&path).with_context(|| path.display().to_string())?;
        m.shards.push(ShardEntry {
            index,
            file: file.clone(),
            sha256,
            items: [index, index + 1],
            rows: 1,
            positions,
            bytes,
            routing: None,
        });
        write_manifest(&self.dir, &m)?;
        Ok(file)
    }
}
