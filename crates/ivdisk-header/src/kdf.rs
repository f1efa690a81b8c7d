//! Password-based key derivation for keyslots (Argon2id, Argon2i, PBKDF2) and the hashes LUKS
//! names, with cryptsetup's cost defaults and benchmark-driven calibration.

use std::fmt;
use std::str::FromStr;
use std::time::{Duration, Instant};

use openssl::hash::MessageDigest;

use crate::HeaderError;

/// A hash LUKS names in its headers (PBKDF2, the AF splitter, the LUKS1 digest).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hash {
    Sha1,
    Sha256,
    Sha512,
}

impl Hash {
    pub fn name(self) -> &'static str {
        match self {
            Hash::Sha1 => "sha1",
            Hash::Sha256 => "sha256",
            Hash::Sha512 => "sha512",
        }
    }
    /// Output length in bytes.
    pub fn output_len(self) -> usize {
        match self {
            Hash::Sha1 => 20,
            Hash::Sha256 => 32,
            Hash::Sha512 => 64,
        }
    }
    pub(crate) fn openssl(self) -> MessageDigest {
        match self {
            Hash::Sha1 => MessageDigest::sha1(),
            Hash::Sha256 => MessageDigest::sha256(),
            Hash::Sha512 => MessageDigest::sha512(),
        }
    }
}

impl FromStr for Hash {
    type Err = HeaderError;
    fn from_str(s: &str) -> Result<Self, HeaderError> {
        match s.to_ascii_lowercase().as_str() {
            "sha1" => Ok(Hash::Sha1),
            "sha256" => Ok(Hash::Sha256),
            "sha512" => Ok(Hash::Sha512),
            _ => Err(HeaderError::UnsupportedHash(s.to_owned())),
        }
    }
}

impl fmt::Display for Hash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// PBKDF2-HMAC with `hash`; `out.len()` bytes.
pub(crate) fn pbkdf2(
    hash: Hash,
    secret: &[u8],
    salt: &[u8],
    iterations: u32,
    out: &mut [u8],
) -> Result<(), HeaderError> {
    if iterations > PBKDF2_MAX_ITERATIONS {
        return Err(HeaderError::Kdf(format!(
            "pbkdf2-{hash}: {iterations} iterations, more than the {PBKDF2_MAX_ITERATIONS} \
             OpenSSL can count"
        )));
    }
    openssl::pkcs5::pbkdf2_hmac(secret, salt, iterations as usize, hash.openssl(), out)
        .map_err(|e| HeaderError::Kdf(format!("pbkdf2-{hash}: {e}")))
}

/// Which Argon2 variant a keyslot uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Argon2Variant {
    Argon2i,
    Argon2id,
}

/// A keyslot's key derivation with its costs, as stored in the header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pbkdf {
    Pbkdf2 {
        hash: Hash,
        iterations: u32,
    },
    Argon2 {
        variant: Argon2Variant,
        /// Passes over memory ("time" in the header).
        time: u32,
        /// Memory in KiB.
        memory_kib: u32,
        /// Lanes, computed on up to this many threads ("cpus" in the header).
        parallel: u32,
    },
}

/// Limits as cryptsetup enforces them (lib/crypto_backend: pbkdf limits), so a header we write
/// is one cryptsetup accepts, and one we read cannot make us allocate without bound.
pub const ARGON2_MIN_TIME: u32 = 4;
pub const ARGON2_MAX_TIME: u32 = u32::MAX;
pub const ARGON2_MIN_MEMORY_KIB: u32 = 32;
pub const ARGON2_MAX_MEMORY_KIB: u32 = 4 * 1024 * 1024;
pub const ARGON2_MAX_PARALLEL: u32 = 4;
pub const PBKDF2_MIN_ITERATIONS: u32 = 1000;
/// OpenSSL's PBKDF2 counts iterations in a C `int` (cryptsetup's OpenSSL backend has the same
/// bound): more is refused, never passed on.
pub const PBKDF2_MAX_ITERATIONS: u32 = i32::MAX as u32;

impl Pbkdf {
    /// The `kdf.type` name in a LUKS2 keyslot.
    pub fn type_name(&self) -> &'static str {
        match self {
            Pbkdf::Pbkdf2 { .. } => "pbkdf2",
            Pbkdf::Argon2 {
                variant: Argon2Variant::Argon2id,
                ..
            } => "argon2id",
            Pbkdf::Argon2 {
                variant: Argon2Variant::Argon2i,
                ..
            } => "argon2i",
        }
    }

    /// Derive `out.len()` bytes from `secret` and `salt`.
    pub fn derive(&self, secret: &[u8], salt: &[u8], out: &mut [u8]) -> Result<(), HeaderError> {
        match *self {
            Pbkdf::Pbkdf2 { hash, iterations } => pbkdf2(hash, secret, salt, iterations, out),
            Pbkdf::Argon2 {
                variant,
                time,
                memory_kib,
                parallel,
            } => {
                let params = argon2::Params::new(memory_kib, time, parallel, Some(out.len()))
                    .map_err(|e| HeaderError::Kdf(format!("argon2 parameters: {e}")))?;
                let algorithm = match variant {
                    Argon2Variant::Argon2i => argon2::Algorithm::Argon2i,
                    Argon2Variant::Argon2id => argon2::Algorithm::Argon2id,
                };
                argon2::Argon2::new(algorithm, argon2::Version::V0x13, params)
                    .hash_password_into(secret, salt, out)
                    .map_err(|e| HeaderError::Kdf(format!("{}: {e}", self.type_name())))
            }
        }
    }

    /// Check costs against the limits before deriving (a header is untrusted input).
    pub(crate) fn check_limits(&self) -> Result<(), HeaderError> {
        match *self {
            Pbkdf::Pbkdf2 { iterations: 0, .. } => Err(HeaderError::Metadata(
                "pbkdf2 iterations must be at least 1".into(),
            )),
            Pbkdf::Pbkdf2 { iterations, .. } if iterations > PBKDF2_MAX_ITERATIONS => {
                Err(HeaderError::Metadata(format!(
                    "pbkdf2 iterations out of range: {iterations} (at most {PBKDF2_MAX_ITERATIONS})"
                )))
            }
            Pbkdf::Pbkdf2 { .. } => Ok(()),
            Pbkdf::Argon2 {
                time,
                memory_kib,
                parallel,
                ..
            } => {
                if time == 0
                    || !(ARGON2_MIN_MEMORY_KIB..=ARGON2_MAX_MEMORY_KIB).contains(&memory_kib)
                    || !(1..=ARGON2_MAX_PARALLEL).contains(&parallel)
                {
                    return Err(HeaderError::Metadata(format!(
                        "argon2 costs out of range: time {time}, memory {memory_kib} KiB, \
                         cpus {parallel} (allowed: time >= 1, memory {ARGON2_MIN_MEMORY_KIB}..=\
                         {ARGON2_MAX_MEMORY_KIB} KiB, cpus 1..={ARGON2_MAX_PARALLEL})"
                    )));
                }
                Ok(())
            }
        }
    }
}

/// The KDF family a new keyslot uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PbkdfKind {
    #[default]
    Argon2id,
    Argon2i,
    Pbkdf2,
}

impl FromStr for PbkdfKind {
    type Err = HeaderError;
    fn from_str(s: &str) -> Result<Self, HeaderError> {
        match s.to_ascii_lowercase().as_str() {
            "argon2id" => Ok(PbkdfKind::Argon2id),
            "argon2i" => Ok(PbkdfKind::Argon2i),
            "pbkdf2" => Ok(PbkdfKind::Pbkdf2),
            _ => Err(HeaderError::UnsupportedKdf(s.to_owned())),
        }
    }
}

/// What the user asks of a new keyslot's KDF. The defaults are cryptsetup's LUKS2 defaults:
/// Argon2id, 2 s, up to 1 GiB (at most half the RAM), up to 4 threads (at most the CPUs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PbkdfRequest {
    pub kind: PbkdfKind,
    /// Target unlock time on this machine (`--iter-time`).
    pub iter_time: Duration,
    /// Upper bound for Argon2 memory in KiB (`--pbkdf-memory`).
    pub max_memory_kib: u32,
    /// Upper bound for Argon2 threads (`--pbkdf-parallel`).
    pub max_parallel: u32,
    /// Skip the benchmark: Argon2 time cost or PBKDF2 iterations (`--pbkdf-force-iterations`).
    pub forced_iterations: Option<u32>,
    /// PBKDF2's hash.
    pub hash: Hash,
}

impl Default for PbkdfRequest {
    fn default() -> Self {
        PbkdfRequest {
            kind: PbkdfKind::Argon2id,
            iter_time: Duration::from_millis(2000),
            max_memory_kib: 1024 * 1024,
            max_parallel: 4,
            forced_iterations: None,
            hash: Hash::Sha256,
        }
    }
}

impl PbkdfRequest {
    /// Cheap costs for tests: the minimum cryptsetup accepts, no benchmark.
    pub fn fast_for_tests(kind: PbkdfKind) -> Self {
        PbkdfRequest {
            kind,
            max_memory_kib: 8 * 1024,
            max_parallel: 1,
            forced_iterations: Some(match kind {
                PbkdfKind::Pbkdf2 => PBKDF2_MIN_ITERATIONS,
                _ => ARGON2_MIN_TIME,
            }),
            ..PbkdfRequest::default()
        }
    }

    /// Refuse forced costs out of range, without deriving anything: what [`Self::calibrate`]
    /// would refuse, for a caller that checks its arguments before it makes anything.
    pub fn check_forced(&self) -> Result<(), HeaderError> {
        match (self.kind, self.forced_iterations) {
            (PbkdfKind::Pbkdf2, Some(n))
                if !(PBKDF2_MIN_ITERATIONS..=PBKDF2_MAX_ITERATIONS).contains(&n) =>
            {
                Err(HeaderError::InvalidParameter(format!(
                    "pbkdf2 needs {PBKDF2_MIN_ITERATIONS}..={PBKDF2_MAX_ITERATIONS} iterations \
                     (got {n})"
                )))
            }
            (PbkdfKind::Argon2id | PbkdfKind::Argon2i, Some(time)) if time < ARGON2_MIN_TIME => {
                Err(HeaderError::InvalidParameter(format!(
                    "argon2 needs a time cost of at least {ARGON2_MIN_TIME} (got {time})"
                )))
            }
            _ => Ok(()),
        }
    }

    /// Turn the request into concrete costs, benchmarking this machine unless forced. `key_len`
    /// is the derived key's length.
    pub fn calibrate(&self, key_len: usize) -> Result<Pbkdf, HeaderError> {
        self.check_forced()?;
        match self.kind {
            PbkdfKind::Pbkdf2 => {
                let iterations = match self.forced_iterations {
                    Some(n) => n,
                    None => calibrate_pbkdf2(self.hash, key_len, self.iter_time)?,
                };
                Ok(Pbkdf::Pbkdf2 {
                    hash: self.hash,
                    iterations,
                })
            }
            PbkdfKind::Argon2id | PbkdfKind::Argon2i => {
                let variant = if self.kind == PbkdfKind::Argon2id {
                    Argon2Variant::Argon2id
                } else {
                    Argon2Variant::Argon2i
                };
                let parallel = self
                    .max_parallel
                    .clamp(1, ARGON2_MAX_PARALLEL)
                    .min(available_cpus());
                let max_memory = self
                    .max_memory_kib
                    .min(half_of_ram_kib())
                    .clamp(ARGON2_MIN_MEMORY_KIB, ARGON2_MAX_MEMORY_KIB);
                if let Some(time) = self.forced_iterations {
                    return Ok(Pbkdf::Argon2 {
                        variant,
                        time,
                        memory_kib: max_memory,
                        parallel,
                    });
                }
                calibrate_argon2(variant, parallel, max_memory, key_len, self.iter_time)
            }
        }
    }
}

fn available_cpus() -> u32 {
    std::thread::available_parallelism()
        .map(|n| n.get() as u32)
        .unwrap_or(1)
}

fn half_of_ram_kib() -> u32 {
    // std has no portable RAM query; /proc/meminfo is on every Linux this runs on.
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kib| kib.parse::<u64>().ok())
        })
        .map(|kib| (kib / 2).min(u32::MAX as u64) as u32)
        .unwrap_or(ARGON2_MAX_MEMORY_KIB)
}

fn time_derive(pbkdf: &Pbkdf, key_len: usize) -> Result<Duration, HeaderError> {
    let mut out = zeroize::Zeroizing::new(vec![0u8; key_len]);
    let start = Instant::now();
    pbkdf.derive(b"ivdisk benchmark passphrase", &[0x5a; 32], &mut out)?;
    Ok(start.elapsed())
}

fn calibrate_pbkdf2(hash: Hash, key_len: usize, target: Duration) -> Result<u32, HeaderError> {
    // Grow the trial until it runs long enough to measure, then scale linearly.
    let mut trial = 1u32 << 14;
    loop {
        let elapsed = time_derive(
            &Pbkdf::Pbkdf2 {
                hash,
                iterations: trial,
            },
            key_len,
        )?;
        if elapsed >= Duration::from_millis(50) || trial >= 1 << 30 {
            let per_iteration = elapsed.as_secs_f64() / trial as f64;
            let iterations =
                (target.as_secs_f64() / per_iteration).min(PBKDF2_MAX_ITERATIONS as f64) as u32;
            return Ok(iterations.max(PBKDF2_MIN_ITERATIONS));
        }
        trial *= 4;
    }
}

/// As cryptsetup: keep the time cost at its minimum and spend the budget on memory up to the
/// limit; only when the memory limit is reached, raise the time cost.
fn calibrate_argon2(
    variant: Argon2Variant,
    parallel: u32,
    max_memory_kib: u32,
    key_len: usize,
    target: Duration,
) -> Result<Pbkdf, HeaderError> {
    let target = target.as_secs_f64().max(0.001);
    let mut memory_kib = (max_memory_kib / 16).max(ARGON2_MIN_MEMORY_KIB);
    let mut time = ARGON2_MIN_TIME;
    loop {
        let pbkdf = Pbkdf::Argon2 {
            variant,
            time,
            memory_kib,
            parallel,
        };
        let elapsed = time_derive(&pbkdf, key_len)?.as_secs_f64().max(1e-6);
        let scale = target / elapsed;
        tracing::debug!(time, memory_kib, elapsed, "argon2 calibration trial");
        if (0.8..=1.25).contains(&scale) || (scale < 0.8 && memory_kib == ARGON2_MIN_MEMORY_KIB) {
            return Ok(pbkdf);
        }
        if scale < 0.8 {
            memory_kib = ((memory_kib as f64 * scale) as u32).max(ARGON2_MIN_MEMORY_KIB);
            continue;
        }
        if memory_kib < max_memory_kib {
            // Memory first; a trial at the full target is only run once the estimate is close.
            let next = (memory_kib as f64 * scale.min(16.0)) as u64;
            memory_kib = next.min(max_memory_kib as u64) as u32;
            continue;
        }
        let next = (time as f64 * scale).round() as u64;
        if next <= time as u64 {
            return Ok(pbkdf);
        }
        time = next.min(ARGON2_MAX_TIME as u64) as u32;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // RFC 9106 section 5.3 inputs are with secret and AD; the plain Argon2id vector of the
    // reference implementation's test.c ("password", "somesalt", t=2, m=65536, p=1) is used
    // here instead, since LUKS uses neither secret nor AD.
    #[test]
    fn argon2id_reference_vector() {
        let pbkdf = Pbkdf::Argon2 {
            variant: Argon2Variant::Argon2id,
            time: 2,
            memory_kib: 65536,
            parallel: 1,
        };
        let mut out = [0u8; 32];
        pbkdf.derive(b"password", b"somesalt", &mut out).unwrap();
        assert_eq!(
            hex::encode(out),
            "09316115d5cf24ed5a15a31a3ba326e5cf32edc24702987c02b6566f61913cf7"
        );
    }

    // RFC 7914 section 11 (PBKDF2-HMAC-SHA256, "passwd"/"salt", c=1, 64 bytes).
    #[test]
    fn pbkdf2_sha256_rfc7914_vector() {
        let mut out = [0u8; 64];
        pbkdf2(Hash::Sha256, b"passwd", b"salt", 1, &mut out).unwrap();
        assert_eq!(
            hex::encode(out),
            "55ac046e56e3089fec1691c22544b605f94185216dde0465e68b9d57c20dacbc\
             49ca9cccf179b645991664b39d77ef317c71b845b1e30bd509112041d3a19783"
        );
    }

    #[test]
    fn limits_reject_absurd_costs() {
        let too_much = Pbkdf::Argon2 {
            variant: Argon2Variant::Argon2id,
            time: 4,
            memory_kib: u32::MAX,
            parallel: 4,
        };
        assert!(matches!(
            too_much.check_limits(),
            Err(HeaderError::Metadata(_))
        ));
        let zero = Pbkdf::Pbkdf2 {
            hash: Hash::Sha256,
            iterations: 0,
        };
        assert!(zero.check_limits().is_err());
        // OpenSSL's count is a C int: a header asking for more is refused, not a panic.
        let too_many = Pbkdf::Pbkdf2 {
            hash: Hash::Sha256,
            iterations: PBKDF2_MAX_ITERATIONS + 1,
        };
        assert!(matches!(
            too_many.check_limits(),
            Err(HeaderError::Metadata(_))
        ));
        let mut out = [0u8; 32];
        assert!(matches!(
            too_many.derive(b"pw", b"salt", &mut out),
            Err(HeaderError::Kdf(_))
        ));
        let forced = PbkdfRequest {
            kind: PbkdfKind::Pbkdf2,
            forced_iterations: Some(u32::MAX),
            ..PbkdfRequest::default()
        };
        assert!(matches!(
            forced.calibrate(32),
            Err(HeaderError::InvalidParameter(_))
        ));
    }

    #[test]
    fn calibration_hits_a_short_target() {
        let request = PbkdfRequest {
            iter_time: Duration::from_millis(100),
            max_memory_kib: 64 * 1024,
            ..PbkdfRequest::default()
        };
        let pbkdf = request.calibrate(64).unwrap();
        let elapsed = time_derive(&pbkdf, 64).unwrap();
        // Generous bounds: this is a shared machine. The point is that the result is in the
        // right order of magnitude, not 10x off.
        assert!(
            elapsed > Duration::from_millis(20) && elapsed < Duration::from_millis(1000),
            "{pbkdf:?} took {elapsed:?}"
        );
    }
}
