//! Marks that keep an image, or one of its snapshots, from being removed while another open
//! reads it.
//!
//! A read-only open of a local store writes nothing and takes no writer lock (so it works on a
//! read-only mount and beside a writer in another process); a removal cannot see it in the
//! store. Without these marks, `ivdisk delete` or `ivdisk snap rm` in another process
//! succeeded under a reader, which then read zeros or failed every read.
//!
//! A reader holds a shared byte-range lock on one byte of the store's `LOCK` file, opened
//! read-only (so this too works on a read-only mount): byte 0 for the image, byte 1 + ID for
//! snapshot ID. A removal holds exclusive locks: deleting the image every byte, removing a
//! snapshot that snapshot's byte. Each side refuses while the other holds what it needs, and
//! the locks go away with the process that held them, however it ended. The locks belong to
//! the open file description (`F_OFD_SETLK`), not the process: a removal refuses a reader in
//! its own process too. (`flock`s on the same file, the writer's, are a separate kind.)
//!
//! A child forked by any thread shares the description until it `exec`s, so for a moment it
//! holds a mark its parent already released; such a lock is waited for (at most
//! [`INHERITED_LOCK_WAIT`]), as in [`crate::process_flock`].

use std::fs::{File, OpenOptions};
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::time::{Duration, Instant};

use crate::ffi_range_lock::{try_lock_range, RangeLockKind};
use crate::process_flock::INHERITED_LOCK_WAIT;
use crate::{SnapId, StoreError};

/// The file in a store directory that holds the marks (and the writer's `flock`).
const LOCK_FILE: &str = "LOCK";

/// What a reader reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadTarget {
    /// The image as it is now.
    Head,
    /// One of its snapshots.
    Snapshot(SnapId),
}

impl ReadTarget {
    /// The byte of `LOCK` that stands for this target.
    fn byte(self) -> u64 {
        match self {
            ReadTarget::Head => 0,
            // Store snapshot ids count up from 1; off_t ends at i64::MAX.
            ReadTarget::Snapshot(id) => 1 + id.min(i64::MAX as u64 - 2),
        }
    }

    fn describe(self) -> String {
        match self {
            ReadTarget::Head => "the image".into(),
            ReadTarget::Snapshot(id) => format!("snapshot {id}"),
        }
    }
}

/// A reader's mark; released when dropped.
#[derive(Debug)]
pub struct ReaderMark {
    _lock: File,
}

/// A removal's hold, which refuses new readers of what it removes; released when dropped.
#[derive(Debug)]
pub struct RemovalHold {
    _lock: File,
}

/// Mark that this open reads `target` of the store in `dir`. `None` for a store without a
/// `LOCK` file (never opened for writing, so nothing could remove from it without making one).
/// Refused with [`StoreError::RemovalUnderway`] while a removal holds the target.
pub fn mark_reader(dir: &Path, target: ReadTarget) -> Result<Option<ReaderMark>, StoreError> {
    let path = dir.join(LOCK_FILE);
    let file = match File::open(&path) {
        Ok(file) => file,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(StoreError::io(format!("opening {}", path.display()))(e)),
    };
    match take(&path, &file, RangeLockKind::Shared, target.byte(), 1)? {
        Ok(()) => Ok(Some(ReaderMark { _lock: file })),
        Err(_) => Err(StoreError::RemovalUnderway {
            path: dir.display().to_string(),
            what: target.describe(),
        }),
    }
}

/// Hold off every reader of `target` of the store in `dir` (`None`: of the image and all its
/// snapshots) for a removal, which must have the store open for writing (that makes `LOCK`).
/// Refused with [`StoreError::OpenByReaders`] while a reader has it open.
pub fn hold_off_readers(dir: &Path, target: Option<ReadTarget>) -> Result<RemovalHold, StoreError> {
    let path = dir.join(LOCK_FILE);
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .map_err(StoreError::io(format!("opening {}", path.display())))?;
    let (start, len) = target.map_or((0, 0), |t| (t.byte(), 1));
    match take(&path, &file, RangeLockKind::Exclusive, start, len)? {
        Ok(()) => Ok(RemovalHold { _lock: file }),
        Err(pids) => Err(StoreError::OpenByReaders {
            path: dir.display().to_string(),
            what: target.map_or("the image".into(), ReadTarget::describe),
            pids,
        }),
    }
}

/// Take the lock; `Ok(Err(pids))` when others hold a conflicting one (the processes found).
fn take(
    path: &Path,
    file: &File,
    kind: RangeLockKind,
    start: u64,
    len: u64,
) -> Result<Result<(), Vec<u32>>, StoreError> {
    let locking = |e| StoreError::io(format!("locking {}", path.display()))(e);
    let id = file.metadata().map_err(locking)?;
    let deadline = Instant::now() + INHERITED_LOCK_WAIT;
    loop {
        if try_lock_range(file, kind, start, len).map_err(locking)? {
            return Ok(Ok(()));
        }
        let holders = holders((id.dev(), id.ino()), kind, start, len);
        let inherited = !holders.is_empty() && holders.iter().all(|&p| unexeced_child(p));
        if !inherited || Instant::now() >= deadline {
            return Ok(Err(holders));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The processes that hold a byte-range lock on the file `id` (device, inode) that conflicts
/// with taking `kind` on `len` bytes from `start`, as their `/proc/PID/fdinfo` shows; those
/// this process may not look into are missed.
fn holders(id: (u64, u64), kind: RangeLockKind, start: u64, len: u64) -> Vec<u32> {
    let file = format!(
        "{:02x}:{:02x}:{}",
        libc::major(id.0),
        libc::minor(id.0),
        id.1
    );
    let end = match len {
        0 => u64::MAX,
        len => start.saturating_add(len - 1),
    };
    let mut pids = Vec::new();
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return pids;
    };
    for proc in procs.flatten() {
        let Some(pid) = proc
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(fds) = std::fs::read_dir(proc.path().join("fd")) else {
            continue;
        };
        let holds = fds.flatten().any(|fd| {
            // Following the link: the open file.
            let same = std::fs::metadata(fd.path()).is_ok_and(|m| (m.dev(), m.ino()) == id);
            let info = proc.path().join("fdinfo").join(fd.file_name());
            same && std::fs::read_to_string(info).is_ok_and(|info| {
                info.lines()
                    .filter_map(|l| l.strip_prefix("lock:"))
                    .any(|l| conflicts(l, &file, kind, start, end))
            })
        });
        if holds {
            pids.push(pid);
        }
    }
    pids
}

/// Whether a lock line of fdinfo ("1: OFDLCK ADVISORY  READ -1 fe:00:10289510 5 5") is a
/// byte-range lock on `file` that conflicts with taking `kind` on `start..=end`.
fn conflicts(line: &str, file: &str, kind: RangeLockKind, start: u64, end: u64) -> bool {
    let fields: Vec<&str> = line.split_whitespace().collect();
    let [_, class, _, access, _, on, from, to, ..] = fields[..] else {
        return false;
    };
    let (Ok(from), to) = (from.parse::<u64>(), to.parse::<u64>()) else {
        return false;
    };
    let to = match (to, fields[7]) {
        (Ok(to), _) => to,
        (Err(_), "EOF") => u64::MAX,
        (Err(_), _) => return false,
    };
    class != "FLOCK"
        && on == file
        && (kind == RangeLockKind::Exclusive || access == "WRITE")
        && from <= end
        && start <= to
}

/// Whether `pid` is a child of this process that runs this program still: forked and not yet
/// `exec`'d, so it holds what this process held at the fork.
fn unexeced_child(pid: u32) -> bool {
    let parent = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|stat| {
            // "PID (COMM) STATE PPID ...": COMM may hold spaces and parentheses.
            let after = &stat[stat.rfind(')')? + 1..];
            after.split_whitespace().nth(1)?.parse::<u32>().ok()
        });
    parent == Some(std::process::id())
        && std::fs::read_link(format!("/proc/{pid}/exe")).ok()
            == std::fs::read_link("/proc/self/exe").ok()
}

/// "process 12", "processes 12, 34", or "another process" when none could be told.
pub fn describe_processes(pids: &[u32]) -> String {
    match pids {
        [] => "another process".into(),
        [pid] => format!("process {}", with_command(*pid)),
        pids => format!(
            "processes {}",
            pids.iter()
                .map(|pid| with_command(*pid))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

/// `1234 (ivdisk serve disk.ivd@monday --socket /run/d.sock)`: which reader it is, so the
/// user stops the right one (a hint naming `serve --read-only` misled where a snapshot's
/// server held the image). The pid alone where its command line cannot be read.
fn with_command(pid: u32) -> String {
    const MOST: usize = 160;
    let Ok(raw) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
        return pid.to_string();
    };
    let mut command = raw
        .split(|b| *b == 0)
        .filter(|arg| !arg.is_empty())
        .map(|arg| String::from_utf8_lossy(arg).into_owned())
        .collect::<Vec<_>>()
        .join(" ");
    if command.is_empty() {
        return pid.to_string();
    }
    if command.chars().count() > MOST {
        command = command.chars().take(MOST).collect::<String>() + "...";
    }
    format!("{pid} ({command})")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn store_dir() -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(LOCK_FILE), b"").unwrap();
        dir
    }

    #[test]
    fn a_reader_keeps_off_the_removal_of_what_it_reads_only() {
        let dir = store_dir();
        let head = mark_reader(dir.path(), ReadTarget::Head).unwrap().unwrap();
        let snap = mark_reader(dir.path(), ReadTarget::Snapshot(3))
            .unwrap()
            .unwrap();
        let started = Instant::now();
        match hold_off_readers(dir.path(), None) {
            Err(StoreError::OpenByReaders { pids, what, .. }) => {
                assert_eq!(pids, vec![std::process::id()]);
                assert_eq!(what, "the image");
            }
            other => panic!("expected OpenByReaders, got {other:?}"),
        }
        // A reader in this process is no forked child: refused at once.
        assert!(started.elapsed() < INHERITED_LOCK_WAIT);
        match hold_off_readers(dir.path(), Some(ReadTarget::Snapshot(3))) {
            Err(e @ StoreError::OpenByReaders { .. }) => {
                let text = e.to_string();
                assert!(text.contains("snapshot 3"), "{text}");
                assert!(
                    text.contains(&format!("process {}", std::process::id())),
                    "{text}"
                );
            }
            other => panic!("expected OpenByReaders, got {other:?}"),
        }
        let other = hold_off_readers(dir.path(), Some(ReadTarget::Snapshot(4))).unwrap();
        // While a removal holds snapshot 4, it has no new readers; others still do.
        assert!(matches!(
            mark_reader(dir.path(), ReadTarget::Snapshot(4)),
            Err(StoreError::RemovalUnderway { .. })
        ));
        mark_reader(dir.path(), ReadTarget::Snapshot(5))
            .unwrap()
            .unwrap();
        drop(other);
        drop(snap);
        hold_off_readers(dir.path(), Some(ReadTarget::Snapshot(3))).unwrap();
        drop(head);
        hold_off_readers(dir.path(), None).unwrap();
    }

    #[test]
    fn a_store_without_a_lock_file_has_no_marks() {
        let dir = tempfile::tempdir().unwrap();
        assert!(mark_reader(dir.path(), ReadTarget::Head).unwrap().is_none());
    }

    #[test]
    fn lock_lines_are_read_as_the_kernel_writes_them() {
        let file = "fe:00:77";
        let line = " 1: OFDLCK ADVISORY  READ -1 fe:00:77 5 5";
        assert!(conflicts(line, file, RangeLockKind::Exclusive, 0, u64::MAX));
        assert!(conflicts(line, file, RangeLockKind::Exclusive, 5, 5));
        assert!(!conflicts(line, file, RangeLockKind::Exclusive, 6, 6));
        assert!(!conflicts(line, file, RangeLockKind::Shared, 5, 5));
        assert!(!conflicts(line, "fe:00:78", RangeLockKind::Exclusive, 5, 5));
        let to_eof = " 2: OFDLCK ADVISORY  WRITE -1 fe:00:77 0 EOF";
        assert!(conflicts(to_eof, file, RangeLockKind::Shared, 9, 9));
        let flock = " 3: FLOCK  ADVISORY  WRITE 123 fe:00:77 0 EOF";
        assert!(!conflicts(flock, file, RangeLockKind::Exclusive, 0, 0));
        assert_eq!(describe_processes(&[]), "another process");
        assert_eq!(describe_processes(&[7, 8]), "processes 7, 8");
    }
}
