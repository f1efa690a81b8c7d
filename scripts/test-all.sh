#!/usr/bin/env bash
# Run every test of ivdisk on a fresh machine: installs what the tests need (Debian packages,
# Rust components, cryptsetup for the header interoperability tests), then format check,
# clippy, the whole test suite, and a bounded fuzz run of the header parser.
#
#   scripts/test-all.sh
#
# Later layers add the servers their tests use (a Ceph cluster, our NBD server) here, started
# before the tests and stopped on exit.
set -euo pipefail
cd "$(dirname "$0")/.."

log() { printf '\n== %s\n' "$*" >&2; }

source scripts/install-deps.sh

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

log "cargo test ivdisk-crypto on its fallback engines (OpenSSL XTS instead of VAES)"
# On a CPU with VAES the suites use our VAES XTS; run the crypto tests once more on the
# OpenSSL path that CPUs without it take.
IVDISK_CRYPTO_NO_VAES=1 cargo test -p ivdisk-crypto --tests

log "fuzz the header parser for ${IVDISK_FUZZ_SECONDS:-60} s (cargo-fuzz, nightly)"
# Installs the nightly toolchain and cargo-fuzz when missing; a crash fails the run and leaves
# the input in fuzz/artifacts/header_parse/.
scripts/fuzz-header
