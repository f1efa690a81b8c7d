#!/usr/bin/env bash
# Install the Debian packages ivdisk builds and tests with, if missing. Sourced by
# scripts/quickstart.sh and scripts/test-all.sh; runnable alone.
#
# openssl, libssl-dev: the cipher suites' and TLS's library, and the command line of the
# cross-checks and of scripts/tls-creds;
# gcc, make, pkg-config: the crates that build C (libaegis, openssl-sys);
# cryptsetup-bin: the header interoperability tests run cryptsetup itself;
# qemu-utils: qemu-img/qemu-io, the independent LUKS implementation the foreign-LUKS tests
# (crates/ivdisk-image/tests/foreign_luks_file.rs) read and write volumes with;
# libnbd-bin (nbdinfo, nbdcopy), fio (its nbd engine), nbdfuse: the NBD clients the serve
# tests (crates/ivdisk/tests/nbd_clients.rs) and the NBD benchmark drive `ivdisk serve` with;
# qemu-system-x86, busybox-static: the guest VM test boots Linux (scripts/guest-kernel fetches
# Debian's kernel package, unpacked, not installed) on an image `ivdisk serve` exports;
# (both left out with IVDISK_NO_GUEST=1, as scripts/quickstart.sh does);
# librados-dev, librbd-dev: ivdisk-rados links librados (its default feature "librados");
# ceph, ceph-mon, ceph-osd, ceph-mgr, jq: the throwaway test cluster of scripts/ceph-dev-cluster,
# qemu-block-extra: qemu's rbd driver (librbd's encryption in tests/foreign_rbd.rs),
# left out with IVDISK_NO_CEPH=1 (which also skips the RADOS tests);
# e2fsprogs (mkfs.ext4): the full-disk tests fill small ext4 file systems on loop devices
# (ivdisk-store's small_fs.rs; Debian has it in the base system, listed for slimmer images);
# exfatprogs, exfat-fuse: export onto a file system without hard links (tests/cli_transfer.rs);
# gdb: a test binary killed by a signal gets every thread's backtrace printed from its core
# (scripts/test-all.sh), so that a rare crash in CI can be told apart without a rerun.
set -euo pipefail
IVDISK_PACKAGES=(openssl libssl-dev pkg-config gcc make cryptsetup-bin qemu-utils libnbd-bin fio librados-dev librbd-dev e2fsprogs exfatprogs exfat-fuse gdb)
# nbdfuse comes with libnbd-bin on Debian 12 (where the nbdfuse package is only a name
# libnbd-bin provides, which dpkg never lists as installed) and is a package of its own later.
command -v nbdfuse >/dev/null || IVDISK_PACKAGES+=(nbdfuse)
if [ "${IVDISK_NO_GUEST:-}" != 1 ]; then
  IVDISK_PACKAGES+=(qemu-system-x86 busybox-static)
fi
if [ "${IVDISK_NO_CEPH:-}" != 1 ]; then
  IVDISK_PACKAGES+=(ceph ceph-mon ceph-osd ceph-mgr jq qemu-block-extra)
fi
missing=()
for p in "${IVDISK_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "installing Debian packages: ${missing[*]}" >&2
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
fi
if [ "${IVDISK_NO_GUEST:-}" != 1 ]; then
  "$(dirname "${BASH_SOURCE[0]}")/guest-kernel"
fi
if ! command -v cargo >/dev/null; then
  echo "cargo not found: install a stable Rust toolchain (rustup) first" >&2
  exit 1
fi
