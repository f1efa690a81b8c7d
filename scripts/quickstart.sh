#!/usr/bin/env bash
# The main job on one machine: build ivdisk, create an encrypted disk on the local backend and
# serve it over NBD on a Unix socket, in the foreground, until Ctrl-C (or SIGTERM): then the
# requests in flight finish, the disk is flushed, its writer lock released, and the script
# exits 0.
#
#   scripts/quickstart.sh [IMAGE] [SIZE]
#
#   IMAGE  a directory path (the local backend); default target/quickstart/demo.ivd in this
#          repository (git-ignored; `cargo clean` removes it). A relative path is taken from
#          the directory you run the script in.
#   SIZE   default 1G.
#
# The passphrase: a random one generated into IMAGE.passphrase (mode 0600, next to the image,
# never inside it), kept and reused by later runs; IVDISK_PASSPHRASE_FILE=FILE uses yours.
#
# Run it again: an existing disk is reused as it is (the script says so); IVDISK_RECREATE=1
# deletes it and creates a new one (new volume key, new passphrase file if generated, its
# data gone).
#
# The socket: IMAGE.sock next to the disk (or /tmp/ivdisk-quickstart-UID.sock when that path
# is too long for a Unix socket); IVDISK_SOCKET=PATH picks another. The server prints how to
# attach the disk (nbdinfo, nbdfuse, qemu, nbd-client).
#
# IVDISK_BUILD_PROFILE=dev builds and runs the debug binary (CI's smoke run of this script;
# default release).
set -euo pipefail
CALLER_DIR=$PWD
cd "$(dirname "$0")/.."
ROOT=$PWD

IMAGE=${1:-$ROOT/target/quickstart/demo.ivd}
SIZE=${2:-1G}
case "$IMAGE" in
  *://* | mem:*)
    echo "quickstart.sh runs the local backend: IMAGE is a directory path, not $IMAGE" >&2
    exit 1
    ;;
  file:*) IMAGE=${IMAGE#file:} ;;
esac
case "$IMAGE" in
  /*) ;;
  *) IMAGE=$CALLER_DIR/$IMAGE ;;
esac
IMAGE=$(realpath -m "$IMAGE")
PASSPHRASE_FILE=${IVDISK_PASSPHRASE_FILE:-$IMAGE.passphrase}

# The local backend needs no Ceph cluster: skip its server packages (librados-dev, which the
# build links, is installed either way), and the guest VM test's qemu-system and kernel.
IVDISK_NO_CEPH=${IVDISK_NO_CEPH:-1} IVDISK_NO_GUEST=${IVDISK_NO_GUEST:-1} source scripts/install-deps.sh

if [ "${IVDISK_BUILD_PROFILE:-release}" = dev ]; then
  cargo build -p ivdisk
  IVDISK=$ROOT/target/debug/ivdisk
else
  cargo build --release -p ivdisk
  IVDISK=$ROOT/target/release/ivdisk
fi
"$IVDISK" suites

echo
echo "== the disk: $IMAGE (local backend: a directory)"
mkdir -p "$(dirname "$IMAGE")"

exists=0
if info_err=$("$IVDISK" info "$IMAGE" 2>&1 >/dev/null); then
  exists=1
elif [[ "$info_err" != *"does not exist"* ]]; then
  echo "$info_err" >&2
  exit 1
fi
if [ "$exists" = 1 ] && [ "${IVDISK_RECREATE:-}" = 1 ]; then
  echo "IVDISK_RECREATE=1: deleting the existing disk and creating a new one"
  "$IVDISK" delete "$IMAGE" --yes
  if [ -z "${IVDISK_PASSPHRASE_FILE:-}" ]; then
    rm -f "$PASSPHRASE_FILE"
  fi
  exists=0
fi

if [ "$exists" = 1 ]; then
  echo "reusing the disk an earlier run created (IVDISK_RECREATE=1 deletes it and creates a new one)"
  if [ ! -f "$PASSPHRASE_FILE" ]; then
    echo "warning: its passphrase file $PASSPHRASE_FILE is missing; without it (or another" \
      "keyslot's passphrase) the disk cannot be opened: IVDISK_RECREATE=1 starts over" >&2
  fi
  current=$("$IVDISK" info "$IMAGE" | sed -n 's/^size: *//p')
  echo "(its size is $current; SIZE=$SIZE applies to new disks only, \`ivdisk resize\` changes it)"
else
  if [ -n "${IVDISK_PASSPHRASE_FILE:-}" ]; then
    echo "passphrase: from $PASSPHRASE_FILE (IVDISK_PASSPHRASE_FILE)"
  elif [ -f "$PASSPHRASE_FILE" ]; then
    echo "passphrase: reusing $PASSPHRASE_FILE"
  else
    (umask 077 && head -c 32 /dev/urandom | base64 >"$PASSPHRASE_FILE")
    echo "passphrase: generated into $PASSPHRASE_FILE (mode 0600): whoever reads it can open" \
      "the disk; keep it safe, and keep it: it is the disk's only passphrase"
  fi
  echo "creating a $SIZE disk (the key derivation is tuned to take about 2 s by design)"
  "$IVDISK" create "$IMAGE" --size "$SIZE" --passphrase-file "$PASSPHRASE_FILE"
fi

echo
"$IVDISK" info "$IMAGE"

SOCKET=${IVDISK_SOCKET:-$IMAGE.sock}
if ((${#SOCKET} > 100)); then
  SOCKET=/tmp/ivdisk-quickstart-$(id -u).sock
fi

echo
echo "== serving it over NBD on $SOCKET (Ctrl-C stops; the disk is flushed and closed)"
echo "   later: $IVDISK serve $IMAGE --socket $SOCKET --passphrase-file $PASSPHRASE_FILE"
echo
exec "$IVDISK" serve "$IMAGE" --socket "$SOCKET" --passphrase-file "$PASSPHRASE_FILE"
