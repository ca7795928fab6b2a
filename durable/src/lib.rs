//! Files that survive a crash of the machine, not only of the process. A file is written beside
//! its destination, its data synced to disk, renamed into place, and the directory synced, so that
//! after a power cut the path holds the old file or the new one, whole — never a renamed file whose
//! data never reached the disk (the rename's directory entry can reach it first). Every write
//! k3mini publishes (checkpoints, shards, manifests, exports, reports) goes through here.
//!
//! std is enough for the writes (`File::sync_all` is fsync, and a directory opened read-only
//! syncs its entries on Unix); libc gives [`read_small`] its `O_NONBLOCK`.

use std::fs::File;
use std::io::{self, Write};
use std::path::{Path, PathBuf};

/// A small text file a user names (a recipe, a policy, a bench file): refused, without reading,
/// when it is not a regular file (a FIFO would block, `/dev/zero` never end) or holds more than
/// `max_bytes`, and read no further than that should it grow meanwhile.
pub fn read_small(path: &Path, max_bytes: u64) -> io::Result<String> {
    use std::io::Read;
    // Opened without waiting (a FIFO's open would block for a writer), then asked what it is:
    // the file read is the file checked.
    let mut options = std::fs::OpenOptions::new();
    options.read(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::custom_flags(&mut options, libc::O_NONBLOCK);
    let file = options.open(path)?;
    let meta = file.metadata()?;
    if !meta.is_file() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "not a regular file (a FIFO, a device or a directory)",
        ));
    }
    let too_big = |n: u64| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{n} bytes: more than the {max_bytes} such a file may hold"),
        )
    };
    if meta.len() > max_bytes {
        return Err(too_big(meta.len()));
    }
    let mut text = String::new();
    file.take(max_bytes + 1).read_to_string(&mut text)?;
    if text.len() as u64 > max_bytes {
        return Err(too_big(text.len() as u64));
    }
    Ok(text)
}

/// Where a write of `path` goes before it is published: `NAME.tmp` beside it.
pub fn temp_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".tmp");
    path.with_file_name(name)
}

/// Syncs a directory's entries (the names created, renamed or removed in it) to disk. A no-op
/// where directories cannot be opened as files (Windows) and on filesystems that refuse to sync a
/// directory (EINVAL, ENOTSUP or EBADF from some FUSE, 9p, CIFS and NFS mounts), as PostgreSQL
/// treats them: there the rename is as durable as the filesystem makes it.
pub fn sync_dir(dir: &Path) -> io::Result<()> {
    const EBADF: i32 = 9;
    const EINVAL: i32 = 22;
    const ENOTSUP: i32 = 95;
    let refused = |e: &io::Error| matches!(e.raw_os_error(), Some(EBADF | EINVAL | ENOTSUP));
    match File::open(dir).and_then(|d| d.sync_all()) {
        Err(_) if cfg!(windows) => Ok(()),
        Err(e) if refused(&e) => Ok(()),
        other => other,
    }
}

/// The directory `path` is in (`.` for a bare name).
fn parent(path: &Path) -> &Path {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

/// Renames `from` (a file or directory whose contents are already synced) to `to` and syncs the
/// directories of both, so the new name is on disk when this returns.
pub fn rename(from: &Path, to: &Path) -> io::Result<()> {
    std::fs::rename(from, to)?;
    sync_dir(parent(to))?;
    if parent(from) != parent(to) {
        sync_dir(parent(from))?;
    }
    Ok(())
}

/// Writes `path` through `fill`, which writes the file's contents (streaming, so nothing need be
/// whole in memory): to [`temp_path`], synced, then renamed into place durably. A failure leaves
/// `path` as it was and removes the temporary file.
pub fn write_with<T>(path: &Path, fill: impl FnOnce(&mut File) -> io::Result<T>) -> io::Result<T> {
    let tmp = temp_path(path);
    let result = (|| {
        let mut file = File::create(&tmp)?;
        let out = fill(&mut file)?;
        file.flush()?;
        file.sync_all()?;
        drop(file);
        rename(&tmp, path)?;
        Ok(out)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// Writes `bytes` to `path` atomically and durably (see [`write_with`]).
pub fn write(path: &Path, bytes: &[u8]) -> io::Result<()> {
    write_with(path, |f| f.write_all(bytes))
}

/// Syncs a file already written (one a library wrote through its own handle) to disk. (Windows
/// flushes only through a handle that may write.)
pub fn sync_file(path: &Path) -> io::Result<()> {
    std::fs::OpenOptions::new()
        .read(true)
        .write(cfg!(windows))
        .open(path)?
        .sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_write_replaces_the_file_whole_and_leaves_no_temporary() {
        let dir = std::env::temp_dir().join(format!("k3mini-durable-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("a.json");
        write(&path, b"old").unwrap();
        write(&path, b"new").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"new");
        assert!(!temp_path(&path).exists());
        // A fill that fails leaves the old file and no temporary.
        let e = write_with(&path, |f| {
            f.write_all(b"half")?;
            Err::<(), _>(io::Error::other("disk full"))
        });
        assert!(e.is_err());
        assert_eq!(std::fs::read(&path).unwrap(), b"new");
        assert!(!temp_path(&path).exists());
        std::fs::remove_dir_all(&dir).ok();
    }
}
