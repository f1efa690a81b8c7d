#!/usr/bin/env bash
# Run every test of ivdisk on a fresh machine: installs what the tests need (Debian packages,
# Rust components), then format check, clippy, and the whole test suite.
#
#   scripts/test-all.sh
#
# Later layers add the servers their tests use (a Ceph cluster, our NBD server) here, started
# before the tests and stopped on exit.
set -euo pipefail
cd "$(dirname "$0")/.."

log() { printf '\n== %s\n' "$*" >&2; }

# Debian packages: OpenSSL (library for the cipher suites, command line for the cross-checks),
# a C compiler and pkg-config for the crates that build C (libaegis, openssl-sys).
PACKAGES=(openssl libssl-dev pkg-config gcc make)
missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  log "installing Debian packages: ${missing[*]}"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}"
fi

if ! command -v cargo >/dev/null; then
  echo "cargo not found: install Rust (stable) with rustup first" >&2
  exit 1
fi
if command -v rustup >/dev/null; then
  rustup component add rustfmt clippy >/dev/null 2>&1 || true
fi

log "cargo fmt --check"
cargo fmt --all -- --check

log "cargo clippy (warnings are errors)"
cargo clippy --workspace --all-targets -- -D warnings

log "cargo test"
# --all-targets also runs each criterion bench once in test mode (no timing), so a broken
# bench is caught here; doc tests run separately (--all-targets skips them).
cargo test --workspace --all-targets
cargo test --workspace --doc
