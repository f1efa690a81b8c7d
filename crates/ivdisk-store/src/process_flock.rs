//! An exclusive `flock` taken by this process, that tells a lock another open of this process
//! holds apart from one a child process shares for a moment.
//!
//! A `flock` belongs to the open file description. A child forked by any thread of the
//! process shares every description until it `exec`s (close-on-exec closes them only then),
//! so a lock released and taken again in that window is found still held, by no one but the
//! child. Test suites hit this all the time (one test spawns `cryptsetup` while another
//! closes and reopens a store); so does any program that spawns helpers. Such a lock is
//! waited for, [`INHERITED_LOCK_WAIT`] at most; a lock held by another open of this process,
//! or by another process, is refused at once.

use std::collections::BTreeSet;
use std::fs::File;
use std::os::unix::fs::MetadataExt;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// The longest wait for a lock that only a child between its fork and its `exec` can hold.
/// A child that holds it longer does not `exec` at all.
pub const INHERITED_LOCK_WAIT: Duration = Duration::from_secs(5);

/// The files (device, inode) whose lock a [`HeldFlock`] of this process holds.
static HELD_HERE: Mutex<BTreeSet<(u64, u64)>> = Mutex::new(BTreeSet::new());

fn held_here() -> MutexGuard<'static, BTreeSet<(u64, u64)>> {
    HELD_HERE.lock().unwrap_or_else(|e| e.into_inner())
}

/// The lock, released when this is dropped (with the descriptor).
#[derive(Debug)]
pub struct HeldFlock {
    file: File,
    key: (u64, u64),
}

impl HeldFlock {
    /// The descriptor the lock is held on.
    pub fn file(&self) -> &File {
        &self.file
    }
}

impl Drop for HeldFlock {
    fn drop(&mut self) {
        // The descriptor, and with it the lock, is closed after this.
        held_here().remove(&self.key);
    }
}

/// The process that took the exclusive `flock` held on the file (or directory) `meta`
/// describes, as `/proc/locks` shows it; `None` if no such lock is held.
pub fn exclusive_holder(meta: &std::fs::Metadata) -> std::io::Result<Option<u32>> {
    let file = format!(
        "{:02x}:{:02x}:{}",
        libc::major(meta.dev()),
        libc::minor(meta.dev()),
        meta.ino()
    );
    let locks = std::fs::read_to_string("/proc/locks")?;
    // "1: FLOCK  ADVISORY  WRITE 19203 fe:00:10289510 0 EOF"
    Ok(locks.lines().find_map(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        (fields.get(1) == Some(&"FLOCK")
            && fields.get(3) == Some(&"WRITE")
            && fields.get(5) == Some(&file.as_str()))
        .then(|| fields.get(4)?.parse().ok())
        .flatten()
    }))
}

/// Why [`lock_exclusive`] did not take the lock.
#[derive(Debug)]
pub enum FlockRefused {
    /// Another open of the file in this process holds it.
    HeldHere,
    /// Another process holds it (or a child of ours that did not `exec` in time).
    HeldElsewhere,
    /// Reading the file's identity or locking failed.
    Io(std::io::Error),
}

/// Take an exclusive `flock` on `file` without blocking. When it is busy and no open of this
/// process holds it, `last_taken_here` says whether this process was the last to take it
/// (from a pid the file records, or `/proc/locks`): then the holder is a forked child of ours
/// and the lock is tried again until [`INHERITED_LOCK_WAIT`] has passed.
pub fn lock_exclusive(
    file: File,
    mut last_taken_here: impl FnMut(&mut File) -> bool,
) -> Result<HeldFlock, (File, FlockRefused)> {
    let key = match file.metadata() {
        Ok(meta) => (meta.dev(), meta.ino()),
        Err(e) => return Err((file, FlockRefused::Io(e))),
    };
    let mut file = file;
    let deadline = Instant::now() + INHERITED_LOCK_WAIT;
    loop {
        let mut here = held_here();
        match file.try_lock() {
            Ok(()) => {
                here.insert(key);
                return Ok(HeldFlock { file, key });
            }
            Err(std::fs::TryLockError::WouldBlock) => {}
            Err(std::fs::TryLockError::Error(e)) => return Err((file, FlockRefused::Io(e))),
        }
        if here.contains(&key) {
            return Err((file, FlockRefused::HeldHere));
        }
        drop(here);
        if Instant::now() >= deadline || !last_taken_here(&mut file) {
            return Err((file, FlockRefused::HeldElsewhere));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_open_here_is_refused_at_once_and_a_released_lock_taken() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let open = || File::create(&path).unwrap();
        let held = lock_exclusive(open(), |_| true).unwrap();
        let started = Instant::now();
        match lock_exclusive(open(), |_| panic!("not asked: the holder is known")) {
            Err((_, FlockRefused::HeldHere)) => {}
            other => panic!("expected HeldHere, got {other:?}"),
        }
        assert!(started.elapsed() < INHERITED_LOCK_WAIT);
        drop(held);
        lock_exclusive(open(), |_| false).expect("released with its holder");
    }

    #[test]
    fn a_lock_of_another_description_is_refused_unless_it_was_last_taken_here() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        // A description of the file that no HeldFlock knows of: a child's, or another
        // process's.
        let other = File::create(&path).unwrap();
        other.try_lock().unwrap();
        let mut asked = 0;
        match lock_exclusive(File::open(&path).unwrap(), |_| {
            asked += 1;
            false
        }) {
            Err((_, FlockRefused::HeldElsewhere)) => assert_eq!(asked, 1),
            other => panic!("expected HeldElsewhere, got {other:?}"),
        }
        let release = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(200));
            drop(other);
        });
        lock_exclusive(File::open(&path).unwrap(), |_| true)
            .expect("waited for while the child has not exec'd");
        release.join().unwrap();
    }
}
