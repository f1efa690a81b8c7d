#!/usr/bin/env bash
# Run every test of ivdisk on a fresh machine: installs what the tests need (Debian packages,
# Rust components, cryptsetup for the header interoperability tests, a Ceph cluster's
# packages, qemu-system and a Debian kernel for the guest VM test), then format check, clippy (its lints run inside the test build, as errors), the
# whole test suite against a throwaway Ceph cluster (scripts/ceph-dev-cluster, started before
# the tests and stopped on exit), a bounded fuzz run of the header parser; the RADOS fault
# tests, which kill and restart its OSDs, run after the other tests.
#
#   scripts/test-all.sh
#
# Environment:
#   IVDISK_NO_CEPH=1   no Ceph cluster and no Ceph server packages: the RADOS tests are
#                      SKIPPED, so such a run is not a full CI run (it says so, loudly).
#   IVDISK_CEPH_DIR    directory of the test cluster (default /tmp/ivdisk-ceph-test-PID);
#                      only one cluster can run per host (fixed mon ports), so the run
#                      refuses to start while another one runs.
#   IVDISK_GUEST_KERNEL directory of the guest VM test's kernel (default
#                      ~/.cache/ivdisk/guest-kernel, filled by scripts/guest-kernel).
#
# Our NBD server (`ivdisk serve`) is started and stopped by the tests that use it
# (crates/ivdisk/tests/nbd_clients.rs, each test its own server, killed on failure), and by
# scripts/smoke-quickstart, which runs the README's main job (scripts/quickstart.sh) against
# real NBD clients and stops it with Ctrl-C.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
CEPH_DEV_CLUSTER=$ROOT/scripts/ceph-dev-cluster

# Each step with the time since the start (CI must stay under 30 minutes: where it goes).
START_S=$SECONDS

# A fresh clone builds everything once: incremental compilation's caches would cost time and
# disk and never be used. A checkout that has built before keeps them.
if [[ ! -d $ROOT/target/debug ]]; then
  export CARGO_INCREMENTAL=${CARGO_INCREMENTAL:-0}
fi
log() { printf '\n== [%dm%02ds] %s\n' $(((SECONDS - START_S) / 60)) $(((SECONDS - START_S) % 60)) "$*" >&2; }
die() {
  printf '\ntest-all.sh: error: %s\n' "$*" >&2
  exit 1
}

no_ceph_banner() {
  cat >&2 <<'EOF'

########################################################################################
##                                                                                    ##
##   IVDISK_NO_CEPH=1: NO CEPH CLUSTER. THE RADOS TESTS ARE SKIPPED (ivdisk-rados     ##
##   against a live cluster, its fault tests, the rados_ops bench run).               ##
##   THIS IS NOT A FULL CI RUN: run scripts/test-all.sh without IVDISK_NO_CEPH.       ##
##                                                                                    ##
########################################################################################

EOF
}

# ---------------------------------------------------------------- the test cluster

# Directory of the cluster this run started, while it may be running: the EXIT trap stops
# it. Never set for a cluster that this run did not start.
CEPH_CLUSTER_DIR=""

stop_cluster() {
  local dir=$CEPH_CLUSTER_DIR
  [[ -n $dir ]] || return 0
  CEPH_CLUSTER_DIR=""
  log "stop the Ceph test cluster in $dir"
  "$CEPH_DEV_CLUSTER" stop --dir "$dir" && return 0
  printf 'test-all.sh: error: could not stop the Ceph test cluster; try: scripts/ceph-dev-cluster stop --dir %s\n' \
    "$dir" >&2
  return 1
}

# The background build of the fuzz target while it runs (see the tests below), and the file
# its exit status goes to when it ends.
FUZZ_BUILD_PID=
FUZZ_BUILD_STATUS=

on_exit() {
  local rc=$?
  # no second Ctrl-C in the middle of the cleanup (stop is bounded: SIGKILL after 20 s)
  trap '' INT TERM HUP
  if [[ -n $FUZZ_BUILD_PID && ! -e $FUZZ_BUILD_STATUS ]]; then
    # A run that failed before the fuzz step: its build is not wanted any more. (Once its
    # status is written it has ended, and its pid may be another process's by now.) The whole
    # process group: cargo-fuzz runs cargo and rustc as children of children.
    kill -TERM -- "-$FUZZ_BUILD_PID" 2>/dev/null || true
  fi
  stop_cluster || ((rc)) || rc=1
  ((rc == 0)) || printf '\ntest-all.sh: FAILED (exit %d)\n' "$rc" >&2
  exit "$rc"
}
trap on_exit EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
trap 'exit 129' HUP

# ceph_mon_dirs: the cluster directories (dirname of `-c CONF`) of the ceph-mon daemons
# running on this host, one a line.
ceph_mon_dirs() {
  local f args i
  for f in /proc/[0-9]*/cmdline; do
    { mapfile -d '' -t args <"$f"; } 2>/dev/null || continue
    [[ ${#args[@]} -gt 0 && ${args[0]##*/} == ceph-mon ]] || continue
    for ((i = 1; i < ${#args[@]}; i++)); do
      [[ ${args[i - 1]} == -c ]] && dirname -- "${args[i]}"
    done
  done
  return 0
}

# check_ceph_ports: fail unless the mon ports are free. One cluster per host: the mon of
# scripts/ceph-dev-cluster always binds 127.0.0.1:3300 and :6789. Never reuse or stop a
# cluster someone else started; tell them what to do.
check_ceph_ports() {
  local port others
  for port in 3300 6789; do
    if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
      others=$(ceph_mon_dirs | sort -u | sed 's/^/    scripts\/ceph-dev-cluster stop --dir /')
      if [[ -n $others ]]; then
        die "a Ceph cluster is already running on this host (127.0.0.1:$port is in use); the test
run needs its own cluster on the same fixed ports. Stop that cluster first:
$others
or skip the RADOS tests (not a full CI run) with IVDISK_NO_CEPH=1."
      fi
      die "127.0.0.1:$port is in use (another Ceph cluster? see: ss -ltnp 'sport = :$port'); the
test run needs it for its own Ceph cluster. Stop what holds it (a cluster of
scripts/ceph-dev-cluster: scripts/ceph-dev-cluster stop --dir DIR), or skip the RADOS tests
(not a full CI run) with IVDISK_NO_CEPH=1."
    fi
  done
}

start_cluster() {
  local cluster_env
  IVDISK_CEPH_DIR=${IVDISK_CEPH_DIR:-/tmp/ivdisk-ceph-test-$$}
  check_ceph_ports

  log "start a Ceph test cluster in $IVDISK_CEPH_DIR (stopped on exit)"
  # From here on the EXIT trap stops it, also when start is interrupted half-way.
  CEPH_CLUSTER_DIR=$IVDISK_CEPH_DIR
  if ! cluster_env=$("$CEPH_DEV_CLUSTER" start --dir "$IVDISK_CEPH_DIR"); then
    # start refused (then it started nothing) or failed (then it killed its daemons and
    # kept the directory for its logs): nothing of ours runs, keep the logs.
    CEPH_CLUSTER_DIR=""
    local logs=""
    if [[ -f $IVDISK_CEPH_DIR/.ivdisk-ceph-dev-cluster && -d $IVDISK_CEPH_DIR/log ]]; then
      logs="; its logs are in $IVDISK_CEPH_DIR/log (then remove it: scripts/ceph-dev-cluster stop --dir $IVDISK_CEPH_DIR)"
    fi
    die "could not start the Ceph test cluster (see above)$logs"
  fi
  eval "$cluster_env" # export CEPH_CONF=$IVDISK_CEPH_DIR/ceph.conf
  export CEPH_CONF IVDISK_CEPH_DIR
}

# ---------------------------------------------------------------- the run

# Fail fast, not after a quarter of an hour of building: the full-disk and read-only tests
# mount file systems (tmpfs, a loop ext4, read-only bind mounts).
[[ $(id -u) == 0 ]] ||
  die "run the tests as root (sudo scripts/test-all.sh): the full-disk and read-only tests mount tmpfs, loop and bind file systems"

# fail fast, not only after clippy, when another Ceph cluster holds the mon ports
[[ ${IVDISK_NO_CEPH:-} == 1 ]] || check_ceph_ports

source scripts/install-deps.sh

if command -v rustup >/dev/null; then
  rustup component add rustfmt clippy >/dev/null 2>&1 || true
fi

# The fuzz target's build (a nightly toolchain, cargo-fuzz and the target: on a fresh clone
# of this 2-core machine kind about 5 minutes of one core, most of it compiling) runs in the
# background from here, at the lowest priority: the test build below leaves one core idle
# part of the time (build scripts, linking, the largest crates alone), the steps after it
# wait for Ceph, child processes, fsync, fio and OSD restarts, and it takes only what they
# leave. Started after the test build (as until 2026-12-01), its last minutes were still
# running when the fuzz step began (about 3 minutes of waiting on a fresh machine).
# Its own target directory (fuzz/target), so no lock is shared with the builds below; the
# fuzz step waits for it.
# Its exit status goes to a file, not to `wait`: a 2-core machine has pid_max 32768, the
# tests' processes and threads (Ceph's among them) go through more pids than that, and once
# the shell forks a later child with the build's pid, `wait` on that pid returns the later
# child's status (a CI run failed so with the build's log ending in `Finished`).
mkdir -p "$ROOT/target"
FUZZ_BUILD_LOG=$ROOT/target/fuzz-build.log
FUZZ_BUILD_STATUS=$ROOT/target/fuzz-build.status
rm -f "$FUZZ_BUILD_STATUS"
# In a process group of its own (job control on for this one job), so that on_exit can stop
# every process of the build, not just its first.
set -m
(
  rc=0
  nice -n 19 scripts/fuzz-header --build-only >"$FUZZ_BUILD_LOG" 2>&1 </dev/null || rc=$?
  echo "$rc" >"$FUZZ_BUILD_STATUS"
) &
FUZZ_BUILD_PID=$!
set +m

log "cargo fmt --check"
cargo fmt --all -- --check

# A message split over lines needs a `\` at each line's end; without it the next line's
# indentation becomes part of the text ("of another                  device"). rustfmt
# leaves string literals alone, so this is checked here: a run of 8+ spaces inside a string
# literal, between a word and the next.
log "string literals: no line continuation lost"
if grep -rnP '"[^"\n]*[^\s"] {8,}[A-Za-z(`{][^"\n]*"' --include='*.rs' crates; then
  die "the string literals above hold a run of spaces: a line continuation (\\) lost?"
fi

# Clippy's lints run inside the test build: `linted_cargo` compiles the workspace's own crates
# with clippy-driver, as `cargo clippy` does (RUSTC_WORKSPACE_WRAPPER, and CLIPPY_ARGS for its
# `-- -D warnings`), but with code generation, so each crate is type-checked and linted once.
# A separate `cargo clippy --workspace --all-targets` checked every dependency a second time
# (in check mode) and took 4m43 of a 29-minute CI run on this 2-core machine kind. The same
# targets are linted (--all-targets: libraries, binaries, tests, benches). Dependencies are
# compiled by rustc as before; the wrapped crates' artifacts sit beside plain ones (the wrapper
# is part of their hash), so a developer's plain `cargo test` does not rebuild after this.
CLIPPY_DRIVER=$(rustup which clippy-driver 2>/dev/null || command -v clippy-driver || true)
[[ -x $CLIPPY_DRIVER ]] ||
  die "clippy-driver not found: install clippy (rustup component add clippy) and run again"
linted_cargo() {
  RUSTC_WORKSPACE_WRAPPER=$CLIPPY_DRIVER \
    CLIPPY_ARGS=-D__CLIPPY_HACKERY__warnings__CLIPPY_HACKERY__ cargo "$@"
}

# check_lints_enforced: fail unless a build through `linted_cargo` fails on a clippy warning.
# CLIPPY_ARGS is how cargo-clippy hands its arguments to clippy-driver; if a toolchain ever
# stopped reading it, the lints would only warn and the build below would pass silently.
check_lints_enforced() {
  local probe=$ROOT/target/clippy-probe out
  rm -rf "$probe"
  mkdir -p "$probe/src"
  printf '[package]\nname = "clippy-probe"\nversion = "0.0.0"\nedition = "2021"\n[workspace]\n' \
    >"$probe/Cargo.toml"
  printf 'fn main() {\n    let v = vec![1, 2];\n    println!("{}", v.len() == 0);\n}\n' \
    >"$probe/src/main.rs"
  if out=$(cd "$probe" && linted_cargo build --offline 2>&1); then
    die "clippy's warnings do not fail a build through clippy-driver (CLIPPY_ARGS ignored?):
$out"
  fi
  grep -q 'clippy::len.zero' <<<"$out" ||
    die "the clippy probe failed, but not on clippy's lint:
$out"
  rm -rf "$probe"
}

log "cargo test's build with clippy's lints as errors (clippy-driver for the workspace)"
check_lints_enforced
# --all-targets also builds each criterion bench (run once in test mode below, no timing), so
# a broken bench is caught here.
linted_cargo test --workspace --all-targets --no-run

# Built, not only checked (as before the lints moved into the test build): in target/debug
# most of their dependencies are already built with the same features (about a minute).
log "ivdisk-rados without librados and ivdisk-rbd without librbd (--no-default-features)"
linted_cargo build -p ivdisk-rados --no-default-features
linted_cargo build -p ivdisk-rbd --no-default-features

if [[ ${IVDISK_NO_CEPH:-} == 1 ]]; then
  no_ceph_banner
  export IVDISK_NO_CEPH=1
else
  start_cluster
fi

# test_executables: "PACKAGE_DIR<TAB>EXECUTABLE<TAB>KIND" for every test binary of the build
# above, one a line, in cargo's order. KIND is the target's: lib or bin (unit tests), test, or
# bench (run once in test mode).
test_executables() {
  # "test":true in "profile": a test harness (a binary target also comes built plainly, for
  # the tests that run it).
  linted_cargo test --workspace --all-targets --no-run --message-format=json 2>/dev/null |
    grep -E '"profile":\{[^}]*"test":true\}' |
    sed -n 's/.*"manifest_path":"\([^"]*\)\/Cargo.toml","target":{"kind":\["\([a-z-]*\)"\].*"executable":"\([^"]*\)".*/\1\t\3\t\2/p'
}

# print_core_backtraces PACKAGE_DIR EXECUTABLE: after a test binary died of a signal, every
# thread's backtrace from the core it left in its directory (core_pattern "core", the kernel's
# default), then the core is removed (hundreds of MB). A crash that comes once in many runs
# (librbd's threads, say) is then told apart from the log of the run it came in.
print_core_backtraces() {
  local dir=$1 exe=$2 core pattern
  pattern=$(cat /proc/sys/kernel/core_pattern 2>/dev/null || true)
  echo
  echo "test-all.sh: $exe died of a signal; its core, if the kernel wrote one:"
  if [[ $pattern != core* ]]; then
    echo "  no core here: kernel.core_pattern is '$pattern', not a file in the working directory"
    return 0
  fi
  command -v gdb >/dev/null || {
    echo "  no gdb to read one (scripts/install-deps.sh installs it)"
    return 0
  }
  for core in "$dir"/core "$dir"/core.[0-9]*; do
    [[ -f $core ]] || continue
    gdb -batch -nx -ex 'info threads' -ex 'thread apply all bt 30' "$exe" "$core" 2>&1 |
      grep -v '^\[New LWP' | head -n 2000
    rm -f "$core"
  done
}

# run_test_binary "PACKAGE_DIR<TAB>EXECUTABLE<TAB>KIND": one test binary as `cargo test` runs it
# (in its package's directory), its output in $IVDISK_TEST_LOGS; a failure is noted there too.
run_test_binary() {
  local dir exe name log start rc=0
  IFS=$'\t' read -r dir exe _ <<<"$1"
  name=${dir##*/}/${exe##*/}
  log=$IVDISK_TEST_LOGS/${name//\//_}.log
  start=$SECONDS
  (cd "$dir" || exit; ulimit -c unlimited 2>/dev/null; CARGO_MANIFEST_DIR=$dir "$exe") >"$log" 2>&1 || rc=$?
  if ((rc)); then
    ((rc > 128)) && print_core_backtraces "$dir" "$exe" >>"$log" 2>&1
    printf '%s\n' "$log" >>"$IVDISK_TEST_LOGS/FAILED"
    printf '  FAILED %-52s %4ds (exit %d)\n' "$name" $((SECONDS - start)) "$rc"
    return 1
  fi
  printf '  ok     %-52s %4ds  %s\n' "$name" $((SECONDS - start)) \
    "$(grep '^test result:' "$log" | tail -1 | cut -d';' -f1-3)"
}

# run_test_binaries: what `cargo test --workspace --all-targets` runs, two binaries at a time.
# One after the other they took 9m44 of CI on this 2-core machine kind at 1.2 cores busy on
# average: many tests wait for Ceph, child processes (qemu-img, rbd, cryptsetup, killed
# writers) and fsync. Each binary already runs its own tests on two threads, so tests are
# written to run beside others (random image names and RADOS namespaces, their own temporary
# directories and sockets). Every binary runs even after one failed; the failed ones'
# output is printed at the end.
run_test_binaries() {
  local all first name line
  export IVDISK_TEST_LOGS=$ROOT/target/test-logs
  rm -rf "$IVDISK_TEST_LOGS"
  mkdir -p "$IVDISK_TEST_LOGS"
  all=$(test_executables)
  [[ -n $all ]] || die "found no test binaries to run (cargo test --no-run --message-format=json)"
  # The longest first (measured on 2026-11-30; nbd_clients boots a Linux guest under TCG since
  # 2026-12-01), so that both lanes end about together.
  first=""
  for name in nbd_clients model crash foreign_rbd luks power_loss snapshots cli_convert \
    concurrency tamper lifecycle; do
    first+=$(grep -E "/${name}-[0-9a-f]+"$'\t' <<<"$all")$'\n' || true
  done
  export -f run_test_binary
  if ! { printf '%s' "$first"; grep -vxF -f <(printf '%s' "$first" | sed '/^$/d') <<<"$all" || true; } |
    sed '/^$/d' | xargs -d '\n' -n 1 -P 2 bash -c 'run_test_binary "$1"' _; then
    if [[ -f $IVDISK_TEST_LOGS/FAILED ]]; then
      while read -r line; do
        printf '\n---- %s\n' "$line" >&2
        cat "$line" >&2
      done <"$IVDISK_TEST_LOGS/FAILED"
    fi
    die "test binaries failed (their output above; all logs in $IVDISK_TEST_LOGS)"
  fi
}

log "cargo test: the test binaries, two at a time"
run_test_binaries
# Doc tests run separately (--all-targets skips them).
linted_cargo test --workspace --doc

log "the README's main job: scripts/quickstart.sh serving a disk to nbdinfo and qemu-img"
scripts/smoke-quickstart


if [[ -n $CEPH_CLUSTER_DIR ]]; then
  log "scripts/bench-ceph --quick: ivdisk vs librbd LUKS2 on the test cluster (smoke run)"
  # One round (~2 minutes) on the debug build the tests just made (a release build costs ~6
  # minutes on a fresh clone; CI checks that the benchmark works, its figures are not
  # measurements): fails on a fio error or verify mismatch, a dead server, an image not fully
  # written or a missing result. Its images are deleted at exit; results in target/bench-ceph-ci/.
  scripts/bench-ceph --quick --reps 1 --size 128M --binary target/debug/ivdisk --out target/bench-ceph-ci
fi

# Runs the ivdisk-crypto unit and integration test binaries that `cargo test --workspace` built
# above, with the environment given as NAME=VALUE arguments. `cargo test -p ivdisk-crypto` would
# first rebuild its dependencies with that one package's features (2 minutes on a fresh clone).
crypto_tests_with() {
  local bins bin
  bins=$(test_executables | awk -F'\t' '$1 ~ /\/ivdisk-crypto$/ && $3 != "bench" { print $2 }')
  if [[ -z $bins ]]; then
    echo "test-all: found no ivdisk-crypto test binaries to run with $*" >&2
    return 1
  fi
  while IFS= read -r bin; do
    (cd crates/ivdisk-crypto && env "$@" "$bin" --quiet)
  done <<<"$bins"
}

log "cargo test ivdisk-crypto on its fallback engines (OpenSSL XTS instead of VAES)"
# On a CPU with VAES the suites use our VAES XTS; run the crypto tests once more on the
# OpenSSL path that CPUs without it take.
crypto_tests_with IVDISK_CRYPTO_NO_VAES=1
if grep -qw avx512f /proc/cpuinfo; then
  log "cargo test ivdisk-crypto on the 256-bit VAES code (as on CPUs without AVX-512)"
  crypto_tests_with IVDISK_CRYPTO_VAES=ymm
fi


if [[ -n $CEPH_CLUSTER_DIR ]]; then
  log "RADOS fault tests: kill and restart the OSDs of the cluster in $IVDISK_CEPH_DIR"
  # After the other tests and alone (one test at a time): they take the cluster's OSDs down.
  # The binary the workspace's test build made: `cargo test -p ivdisk-rados` would first
  # rebuild tokio and ivdisk-store with that one package's features.
  faults_exe=$(test_executables | awk -F'\t' '$1 ~ /\/ivdisk-rados$/ && $2 ~ /\/faults-[0-9a-f]+$/ { print $2 }')
  [[ -n $faults_exe ]] || die "found no test binary of crates/ivdisk-rados/tests/faults.rs to run"
  (cd crates/ivdisk-rados && "$faults_exe" --ignored --test-threads=1)
  # The same outage under `ivdisk serve rbd://` and `ivdisk info rbd://` (librbd's requests).
  rbd_exe=$(test_executables | awk -F'\t' '$1 ~ /\/crates\/ivdisk$/ && $2 ~ /\/nbd_rbd-[0-9a-f]+$/ { print $2 }')
  [[ -n $rbd_exe ]] || die "found no test binary of crates/ivdisk/tests/nbd_rbd.rs to run"
  (cd crates/ivdisk && "$rbd_exe" --ignored --exact with_every_osd_down_rbd_requests_fail_in_time_naming_the_osds)
  # The fuzz run needs no cluster: give its memory and CPU back first.
  stop_cluster
fi

log "fuzz the header parser for ${IVDISK_FUZZ_SECONDS:-60} s (cargo-fuzz, nightly)"
# Installs the nightly toolchain and cargo-fuzz when missing; a crash fails the run and leaves
# the input in fuzz/artifacts/header_parse/.
while [[ ! -s $FUZZ_BUILD_STATUS ]] && kill -0 "$FUZZ_BUILD_PID" 2>/dev/null; do
  sleep 1
done
FUZZ_BUILD_PID=
fuzz_build_rc=$(cat "$FUZZ_BUILD_STATUS" 2>/dev/null || echo "none (the build ended without one)")
if [[ $fuzz_build_rc != 0 ]]; then
  sed 's/^/  fuzz build: /' "$FUZZ_BUILD_LOG" >&2
  die "building the fuzz target failed, exit status $fuzz_build_rc (log above, and in $FUZZ_BUILD_LOG)"
fi
scripts/fuzz-header

if [[ ${IVDISK_NO_CEPH:-} == 1 ]]; then
  no_ceph_banner
  log "all tests passed, but the RADOS tests were SKIPPED (IVDISK_NO_CEPH=1): not a full CI run"
else
  log "all tests passed"
fi
