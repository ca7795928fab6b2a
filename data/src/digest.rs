//! SHA-256 as k3mini records it (lowercase hex): of bytes, of a file streamed, and the hex of a
//! finished hasher (tokenizer fingerprints, the hash of a job's inputs).

pub use sha2::{Digest, Sha256};

/// The lowercase hex of a finished hasher.
pub fn hex(hasher: Sha256) -> String {
    hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// SHA-256 (hex) of `data`.
pub fn sha256_hex(data: &[u8]) -> String {
    hex(Sha256::new_with_prefix(data))
}

/// SHA-256 (hex) of a file, streamed.
pub fn sha256_file(path: &std::path::Path) -> std::io::Result<String> {
    let mut hasher = Sha256::new();
    std::io::copy(&mut std::fs::File::open(path)?, &mut hasher)?;
    Ok(hex(hasher))
}
