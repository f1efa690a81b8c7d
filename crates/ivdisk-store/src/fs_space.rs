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

/// The blocks this process may still write, from statfs's counts.
///
/// Root may also use the blocks ext2/3/4 keep for it (`f_bfree` against `f_bavail`), but not
/// those ext4 keeps for itself: on a 200 MB ext4 with 1 KiB blocks, `f_bfree` said 4 MiB were
/// free when a write of 4 KiB failed with ENOSPC. Elsewhere `f_bavail` is what can be
/// written, root or not: btrfs counts the free room of its metadata chunks in `f_bfree`,
/// which file data never gets, so a store on a full btrfs kept its commit room back (the
/// disk looked roomy) and its next commit failed, losing what was acknowledged since the
/// last. (XFS and tmpfs give `f_bfree == f_bavail`.)
fn usable_blocks(root: bool, f_type: i64, f_bfree: u64, f_bavail: u64, blocks: u64) -> u64 {
    match root && f_type == EXT4_MAGIC {
        true => f_bfree
            .saturating_sub(ext4_reserved_blocks(blocks))
            .max(f_bavail),
        false => f_bavail,
    }
}

impl FsSpace {
    fn from_statfs(fs: &rustix::fs::StatFs) -> FsSpace {
        let unit = match fs.f_frsize {
            0 => fs.f_bsize as u64,
            n => n as u64,
        };
        let blocks = fs.f_blocks;
        let usable = usable_blocks(
            rustix::process::geteuid().is_root(),
            fs.f_type,
            fs.f_bfree,
            fs.f_bavail,
            blocks,
        );
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

    /// btrfs counts its metadata chunks' free room in `f_bfree`: root gets `f_bavail` there.
    #[test]
    fn only_ext4_gives_root_more_than_f_bavail() {
        const BTRFS: i64 = 0x9123_683E;
        assert_eq!(usable_blocks(true, BTRFS, 50_000, 0, 1 << 20), 0);
        assert_eq!(
            usable_blocks(false, EXT4_MAGIC, 50_000, 10_000, 1 << 20),
            10_000
        );
        assert_eq!(
            usable_blocks(true, EXT4_MAGIC, 50_000, 10_000, 1 << 20),
            50_000 - 4096
        );
    }

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
