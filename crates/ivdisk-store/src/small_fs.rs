//! A file system that fills up, for the tests of what a full disk does (the local store's own,
//! the image layer's, the NBD server's): a small tmpfs, mounted until dropped. Public behind
//! the `conformance` feature, like the conformance suite, so every crate's tests use the same
//! one. Mounting needs root (CAP_SYS_ADMIN); without it the test fails and says so.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

/// A tmpfs of a given size mounted at a directory (made if missing) until dropped, then lazily
/// unmounted (also when a test fails).
pub struct SmallFileSystem {
    at: PathBuf,
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
            Ok(out) if out.status.success() => SmallFileSystem { at: at.to_owned() },
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
    }
}
