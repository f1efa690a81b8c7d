//! A file system that fills up, for the tests of what a full disk does (the local store's own,
//! the image layer's, the NBD server's): a small tmpfs (or ext4 on a loop device), mounted
//! until dropped. Public behind
//! the `conformance` feature, like the conformance suite, so every crate's tests use the same
//! one. Mounting needs root (CAP_SYS_ADMIN); without it the test fails and says so.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

/// A tmpfs of a given size mounted at a directory (made if missing) until dropped, then lazily
/// unmounted (also when a test fails).
pub struct SmallFileSystem {
    at: PathBuf,
    /// The file an ext4 file system lives in (`mount_ext4`), removed after the unmount.
    image: Option<PathBuf>,
}

impl SmallFileSystem {
    /// Mount a tmpfs of `size` (`mount -o size=`: "16m", say) at `at`.
    pub fn mount(at: &Path, size: &str) -> SmallFileSystem {
        std::fs::create_dir_all(at).unwrap();
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(at)
            .output();
        match out {
            Ok(out) if out.status.success() => SmallFileSystem {
                at: at.to_owned(),
                image: None,
            },
            Ok(out) => panic!(
                "this test needs root (CAP_SYS_ADMIN) to mount a {size} tmpfs that fills up: \
                 `mount -t tmpfs` failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ),
            Err(e) => panic!(
                "this test needs root (CAP_SYS_ADMIN) and mount(8) to mount a {size} tmpfs that \
                 fills up: {e}"
            ),
        }
    }

    /// Mount a fresh ext4 of `mib` MiB at `at` (made if missing): `mkfs.ext4` on the file
    /// `image`, mounted through a loop device. Why besides tmpfs: ext4 keeps 2% of itself
    /// (at most 4096 blocks) from every writer, root included, and still counts it as free.
    pub fn mount_ext4(at: &Path, image: &Path, mib: u64) -> SmallFileSystem {
        Self::mount_made(
            at,
            image,
            mib,
            ("mkfs.ext4", &["-q", "-F"]),
            "ext4",
            "e2fsprogs",
        )
    }

    /// Mount a fresh exFAT of `mib` MiB at `at`, as [`SmallFileSystem::mount_ext4`] does, through
    /// FUSE (exfat-fuse: kernels without the exfat module have it too): a file system with
    /// neither hard links nor `RENAME_NOREPLACE`, as on the usual USB stick.
    pub fn mount_exfat(at: &Path, image: &Path, mib: u64) -> SmallFileSystem {
        let packages = "exfatprogs, exfat-fuse";
        Self::mount_made(at, image, mib, ("mkfs.exfat", &[]), "exfat-fuse", packages)
    }

    /// `mkfs ARGS IMAGE` on a new file `image` of `mib` MiB, mounted at `at` as `fs_type`
    /// through a loop device; `packages` are where the tools come from.
    fn mount_made(
        at: &Path,
        image: &Path,
        mib: u64,
        (mkfs, args): (&str, &[&str]),
        fs_type: &str,
        packages: &str,
    ) -> SmallFileSystem {
        std::fs::create_dir_all(at).unwrap();
        std::fs::File::create(image)
            .and_then(|f| f.set_len(mib << 20))
            .unwrap_or_else(|e| panic!("making {}: {e}", image.display()));
        let run = |cmd: &mut Command, what: &str| match cmd.output() {
            Ok(out) if out.status.success() => {}
            Ok(out) => panic!(
                "this test needs root and {packages} to make and mount a {mib} MiB {fs_type}: \
                 {what} failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ),
            Err(e) => panic!("this test needs {what} (root, {packages}, mount(8)): {e}"),
        };
        run(Command::new(mkfs).args(args).arg(image), mkfs);
        run(
            Command::new("mount")
                .args(["-o", "loop", "-t", fs_type])
                .arg(image)
                .arg(at),
            "mount -o loop",
        );
        SmallFileSystem {
            at: at.to_owned(),
            image: Some(image.to_owned()),
        }
    }

    pub fn path(&self) -> &Path {
        &self.at
    }

    /// Fill the file system to the last byte with a new file, `name`, as another program on
    /// the same disk would; returns its path (remove it to give the space back).
    pub fn fill(&self, name: &str) -> PathBuf {
        let path = self.at.join(name);
        let mut file = std::fs::File::create(&path).unwrap();
        while file.write_all(&[7u8; 64 << 10]).is_ok() {}
        // The last chunk may have gone in part: single bytes until nothing fits.
        while file.write_all(&[7]).is_ok() {}
        path
    }
}

impl Drop for SmallFileSystem {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.at).status();
        if let Some(image) = &self.image {
            let _ = std::fs::remove_file(image);
        }
    }
}
