//! How much of a file system the store may still use: the checks that keep room for the
//! metadata's commits (local.rs, `CommitRoom`) and that hold back work on a nearly full disk.

use std::os::fd::AsFd;
use std::path::Path;

/// A file system's size and the bytes of it this process may still write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FsSpace {
    pub total: u64,
    pub usable: u64,
}

/// `EXT4_SUPER_MAGIC` (also ext2 and ext3).
const EXT4_MAGIC: i64 = 0xEF53;

/// ext4 keeps this many clusters from everyone, root included (`s_resv_clusters`: 2% of the
/// file system, at most 4096 clusters, for its own metadata), and still counts them in
/// `f_bfree`.
fn ext4_reserved_blocks(blocks: u64) -> u64 {
    (blocks / 50).min(4096)
}

impl FsSpace {
    fn from_statfs(fs: &rustix::fs::StatFs) -> FsSpace {
        let unit = match fs.f_frsize {
            0 => fs.f_bsize as u64,
            n => n as u64,
        };
        let blocks = fs.f_blocks;
        // Root may also use the blocks kept for it (`f_bfree` against `f_bavail`), but not
        // those ext4 keeps for itself: on a 200 MB ext4 with 1 KiB blocks, `f_bfree` said
        // 4 MiB were free when a write of 4 KiB failed with ENOSPC.
        let usable = match rustix::process::geteuid().is_root() {
            true if fs.f_type == EXT4_MAGIC => fs
                .f_bfree
                .saturating_sub(ext4_reserved_blocks(blocks))
                .max(fs.f_bavail),
            true => fs.f_bfree,
            false => fs.f_bavail,
        };
        FsSpace {
            total: blocks.saturating_mul(unit),
            usable: usable.saturating_mul(unit),
        }
    }

    /// The file system holding the open file `fd`.
    pub(crate) fn of(fd: impl AsFd) -> Option<FsSpace> {
        rustix::fs::fstatfs(fd)
            .ok()
            .map(|fs| FsSpace::from_statfs(&fs))
    }

    /// The file system holding `path`.
    pub(crate) fn at(path: &Path) -> Option<FsSpace> {
        rustix::fs::statfs(path)
            .ok()
            .map(|fs| FsSpace::from_statfs(&fs))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ext4_keeps_two_percent_up_to_4096_blocks() {
        assert_eq!(ext4_reserved_blocks(200 << 10), 4096);
        assert_eq!(ext4_reserved_blocks(100_000), 2000);
        assert_eq!(ext4_reserved_blocks(0), 0);
    }

    #[test]
    fn a_file_system_has_a_size_and_room_within_it() {
        let dir = tempfile::tempdir().unwrap();
        let space = FsSpace::at(dir.path()).unwrap();
        assert!(space.total > 0 && space.usable <= space.total, "{space:?}");
        let file = std::fs::File::create(dir.path().join("f")).unwrap();
        assert_eq!(FsSpace::of(&file).unwrap().total, space.total);
    }
}
