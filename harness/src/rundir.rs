//! Run-directory safety: one writer per directory (an OS file lock that records the holder's
//! pid), no overwriting of what this invocation did not create unless `--force`, and model
//! directories that carry their tokenizer.
//!
//! The lock is `std::fs::File::try_lock` on `DIR/.lock`: the OS releases it when its holder
//! dies (even by `kill -9`), so a lock file left by a dead process is simply taken over; the
//! pid written into the file only names the live holder in the refusal message.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use rolloutpipe_backends::{ModelConfig, Weights, save_model_dir};

/// The lock file inside a run directory.
pub const LOCK_FILE: &str = ".lock";

/// Tokenizer files of a Hugging Face model directory that travel with its weights.
pub const TOKENIZER_FILES: &[&str] = &[
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
];

/// An exclusive hold on a run directory; released when dropped or when the process dies.
///
/// Dropped while the directory holds nothing but the lock (a start that failed before writing
/// anything), it removes the lock file, and the directory too when [`lock`] created it: a failed
/// start leaves the path as it found it.
#[derive(Debug)]
pub struct RunLock {
    _file: File,
    path: PathBuf,
    /// The directory did not exist before [`lock`].
    created: bool,
}

impl Drop for RunLock {
    fn drop(&mut self) {
        let Some(dir) = self.path.parent() else {
            return;
        };
        if has_contents(dir) {
            return;
        }
        // Best effort: a directory someone wrote into meanwhile stays (remove_dir refuses).
        let _ = std::fs::remove_file(&self.path);
        if self.created {
            let _ = std::fs::remove_dir(dir);
        }
    }
}

impl RunLock {
    /// The lock file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Creates `dir` if needed and takes its lock, or fails naming the pid that holds it.
pub fn lock(dir: &Path) -> anyhow::Result<RunLock> {
    let created = !dir.exists();
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let path = dir.join(LOCK_FILE);
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .with_context(|| format!("opening the lock {}", path.display()))?;
    match file.try_lock() {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => {
            let mut holder = String::new();
            let _ = file.read_to_string(&mut holder);
            let holder = holder.trim();
            let who = if holder.is_empty() {
                "another process".to_owned()
            } else {
                format!("another rolloutpipe process (pid {holder})")
            };
            bail!(
                "{} is in use by {who}; wait for it to finish or pick another directory",
                dir.display()
            );
        }
        Err(std::fs::TryLockError::Error(e)) => {
            return Err(e).with_context(|| format!("locking {}", path.display()));
        }
    }
    // Ours now (a pid left here by a dead holder is stale: the OS dropped its lock).
    file.set_len(0)?;
    file.seek(SeekFrom::Start(0))?;
    write!(file, "{}", std::process::id())?;
    file.flush()?;
    Ok(RunLock {
        _file: file,
        path,
        created,
    })
}

/// True when `dir` exists and holds anything besides our lock file.
pub fn has_contents(dir: &Path) -> bool {
    match std::fs::read_dir(dir) {
        Ok(entries) => entries
            .flatten()
            .any(|e| e.file_name() != std::ffi::OsStr::new(LOCK_FILE)),
        Err(_) => false,
    }
}

/// Refuses to write into `dir` when it already holds something, unless `force`.
pub fn ensure_empty_dir(dir: &Path, force: bool, what: &str) -> anyhow::Result<()> {
    if dir.is_file() {
        bail!(
            "{what} {} is a file, not a directory; pick another path",
            dir.display()
        );
    }
    if !force && has_contents(dir) {
        bail!(
            "{what} {} already exists and is not empty; pass --force to write into it (files of the same names are replaced) or pick another path",
            dir.display()
        );
    }
    Ok(())
}

/// Takes `dir`'s lock for this invocation's writes and checks it may write there: `dir` must be
/// empty (besides the lock) unless `force`. Refused, it leaves the path as it found it: the
/// check runs before the lock file is made, and again once it is held.
pub fn claim_dir(dir: &Path, force: bool, what: &str) -> anyhow::Result<RunLock> {
    ensure_empty_dir(dir, force, what)?;
    let lock = lock(dir)?;
    ensure_empty_dir(dir, force, what)?;
    Ok(lock)
}

/// Refuses to replace the file `path` unless `force`.
pub fn ensure_new_file(path: &Path, force: bool, what: &str) -> anyhow::Result<()> {
    if path.is_dir() {
        bail!("{what} {} is a directory; give a file path", path.display());
    }
    if !force && path.exists() {
        bail!(
            "{what} {} already exists; pass --force to replace it or pick another path",
            path.display()
        );
    }
    Ok(())
}

/// Copies the tokenizer files of model directory `src` (those it has) into `dst`.
pub fn copy_tokenizer(src: Option<&Path>, dst: &Path) -> anyhow::Result<()> {
    let Some(src) = src else { return Ok(()) };
    for name in TOKENIZER_FILES {
        let from = src.join(name);
        if from.is_file() {
            let to = dst.join(name);
            if std::fs::canonicalize(&from).ok() == std::fs::canonicalize(&to).ok() {
                continue;
            }
            std::fs::copy(&from, &to)
                .with_context(|| format!("copying {} to {}", from.display(), to.display()))?;
        }
    }
    Ok(())
}

/// `save_model_dir` plus the tokenizer of the model the weights came from (`tok_src`), so the
/// written directory decodes the same way its source did.
pub fn save_model(
    dst: &Path,
    cfg: &ModelConfig,
    w: &Weights,
    tok_src: Option<&Path>,
) -> anyhow::Result<()> {
    save_model_dir(dst, cfg, w)
        .with_context(|| format!("saving the model to {}", dst.display()))?;
    copy_tokenizer(tok_src, dst)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("rp-rundir-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn a_second_lock_is_refused_naming_the_holder_and_freed_on_drop() {
        let d = scratch("lock");
        let held = lock(&d).unwrap();
        let err = lock(&d).unwrap_err().to_string();
        assert!(
            err.contains(&format!("pid {}", std::process::id())),
            "{err}"
        );
        drop(held);
        let again = lock(&d).unwrap();
        assert_eq!(
            std::fs::read_to_string(again.path()).unwrap(),
            std::process::id().to_string()
        );
    }

    #[test]
    fn a_stale_lock_file_of_a_dead_pid_is_taken_over() {
        let d = scratch("stale");
        std::fs::create_dir_all(&d).unwrap();
        // A pid far above any pid_max: its holder cannot be alive, and no OS lock is held.
        std::fs::write(d.join(LOCK_FILE), "999999999").unwrap();
        let l = lock(&d).unwrap();
        assert_eq!(
            std::fs::read_to_string(l.path()).unwrap(),
            std::process::id().to_string()
        );
    }

    #[test]
    fn a_start_that_wrote_nothing_leaves_the_path_as_it_found_it() {
        // A directory the lock created goes away with it...
        let d = scratch("unused");
        drop(lock(&d).unwrap());
        assert!(!d.exists());
        // ...one that existed keeps everything but the lock file...
        std::fs::create_dir_all(&d).unwrap();
        drop(lock(&d).unwrap());
        assert!(d.is_dir() && !d.join(LOCK_FILE).exists());
        // ...and a run that wrote something keeps it all.
        let l = lock(&d).unwrap();
        std::fs::write(d.join("metrics.jsonl"), "{}").unwrap();
        drop(l);
        assert!(d.join("metrics.jsonl").is_file());
    }

    #[test]
    fn existing_contents_need_force() {
        let d = scratch("force");
        ensure_empty_dir(&d, false, "--out").unwrap();
        let _l = lock(&d).unwrap();
        // Only the lock: still empty.
        ensure_empty_dir(&d, false, "--out").unwrap();
        std::fs::write(d.join("x"), "1").unwrap();
        let err = ensure_empty_dir(&d, false, "--out")
            .unwrap_err()
            .to_string();
        assert!(err.contains("--force"), "{err}");
        ensure_empty_dir(&d, true, "--out").unwrap();
        let f = d.join("x");
        assert!(ensure_new_file(&f, false, "--out").is_err());
        ensure_new_file(&f, true, "--out").unwrap();
        ensure_new_file(&d.join("y"), false, "--out").unwrap();
        assert!(ensure_new_file(&d, true, "--out").is_err());
    }

    #[test]
    fn tokenizer_files_are_copied() {
        let src = scratch("tok-src");
        let dst = scratch("tok-dst");
        std::fs::create_dir_all(&src).unwrap();
        std::fs::create_dir_all(&dst).unwrap();
        std::fs::write(src.join("tokenizer.json"), "{}").unwrap();
        std::fs::write(src.join("tokenizer_config.json"), "{\"a\":1}").unwrap();
        copy_tokenizer(Some(&src), &dst).unwrap();
        assert_eq!(
            std::fs::read_to_string(dst.join("tokenizer_config.json")).unwrap(),
            "{\"a\":1}"
        );
        assert!(dst.join("tokenizer.json").is_file());
        assert!(!dst.join("merges.txt").exists());
        // Copying onto itself is a no-op, not a truncation.
        copy_tokenizer(Some(&src), &src).unwrap();
        assert_eq!(
            std::fs::read_to_string(src.join("tokenizer.json")).unwrap(),
            "{}"
        );
    }
}
