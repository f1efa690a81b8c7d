//! Files written under a temporary name beside their target and renamed when complete
//! (`ivdisk export`'s hidden file, a backup's `FILE.partial.PID`), and what a process killed
//! outright (SIGKILL, a crash, a power cut) leaves of them.

use std::fs::File;
use std::path::{Path, PathBuf};

/// Take the lock that marks `file`, a partial file this process has just created, as being
/// written (an exclusive `flock`, held until the file is closed; also across NFS). Without
/// it a later [`remove_abandoned_partials`] would take the file for one a killed process
/// left.
pub fn mark_partial_in_progress(file: &File) {
    // Refused only where the file system has no locks: the process id still keeps the file.
    let _ = file.try_lock();
}

/// Remove the partial files that processes killed outright left in `dir`: entries named
/// `prefix` followed by a process id, other than this process', that no live process of
/// that id could be writing (`/proc/PID` is gone) and that no process holds locked
/// ([`mark_partial_in_progress`]). Both, so that neither a file between its creation and
/// its lock nor one of a process whose id was reused is taken. Returns what was removed.
pub fn remove_abandoned_partials(dir: &Path, prefix: &str) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut removed = Vec::new();
    for entry in entries.flatten() {
        let found = entry.file_name().to_string_lossy().into_owned();
        let Some(pid) = found
            .strip_prefix(prefix)
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if pid == std::process::id() || Path::new(&format!("/proc/{pid}")).exists() {
            continue;
        }
        let Ok(partial) = File::open(entry.path()) else {
            continue;
        };
        if partial.try_lock().is_ok() && std::fs::remove_file(entry.path()).is_ok() {
            removed.push(entry.path());
        }
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_unlocked_files_of_dead_processes_go() {
        let dir = tempfile::tempdir().unwrap();
        let name = |pid: u32| dir.path().join(format!("f.partial.{pid}"));
        // A process id no process has (above the kernel's largest).
        let dead = 4_194_305;
        std::fs::write(name(dead), b"left").unwrap();
        // A live process (this test's parent, say): its file stays, locked or not.
        let live = std::os::unix::process::parent_id();
        std::fs::write(name(live), b"live").unwrap();
        // A dead process' file that something still holds locked stays.
        let held_pid = dead + 1;
        std::fs::write(name(held_pid), b"held").unwrap();
        let held = File::open(name(held_pid)).unwrap();
        mark_partial_in_progress(&held);
        // Names that are not a prefix and a process id stay.
        std::fs::write(dir.path().join("f.partial.x"), b"other").unwrap();
        std::fs::write(dir.path().join("f"), b"target").unwrap();
        let removed = remove_abandoned_partials(dir.path(), "f.partial.");
        assert_eq!(removed, vec![name(dead)]);
        for kept in [name(live), name(held_pid), dir.path().join("f.partial.x")] {
            assert!(kept.exists(), "{} was removed", kept.display());
        }
    }
}
