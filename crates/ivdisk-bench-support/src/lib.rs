//! What ivdisk's harness-less benchmarks (`crates/*/benches/`) share: describing the machine,
//! medians and ranges of interleaved rounds, hand-written JSON (no serde in the bench path),
//! environment knobs and a seeded RNG for reproducible offsets and payloads.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// The machine a benchmark ran on, for the record in docs/BENCHMARKS.md.
pub struct Machine {
    pub cpus: usize,
    pub cpu_model: String,
    pub kernel: String,
    /// Total RAM, e.g. "23.5 GiB RAM".
    pub memory: String,
}

impl Machine {
    /// The machine as a JSON object (`cpus`, `cpu_model`, `kernel`, `memory`), as the bench
    /// result files record it.
    pub fn to_json(&self) -> String {
        format!(
            "{{\"cpus\": {}, \"cpu_model\": {}, \"kernel\": {}, \"memory\": {}}}",
            self.cpus,
            json_str(&self.cpu_model),
            json_str(&self.kernel),
            json_str(&self.memory)
        )
    }
}

pub fn machine() -> Machine {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let cpu_model = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .and_then(|l| l.split_once(':'))
        .map(|(_, m)| m.trim().to_owned())
        .unwrap_or_else(|| "unknown".into());
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|k| k.trim().to_owned())
        .unwrap_or_else(|_| "unknown".into());
    let memory = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            let kib: u64 = m
                .lines()
                .find_map(|l| l.strip_prefix("MemTotal:"))?
                .trim()
                .trim_end_matches("kB")
                .trim()
                .parse()
                .ok()?;
            Some(format!("{:.1} GiB RAM", kib as f64 / (1 << 20) as f64))
        })
        .unwrap_or_else(|| "unknown RAM".into());
    Machine {
        cpus: std::thread::available_parallelism().map_or(0, |n| n.get()),
        cpu_model,
        kernel,
        memory,
    }
}

/// The file system holding `dir`: the mount with the longest mount point that contains it,
/// as "TYPE (DEVICE on MOUNTPOINT, OPTIONS)".
pub fn filesystem_of(dir: &Path) -> String {
    let dir = dir.canonicalize().unwrap_or_else(|_| dir.to_owned());
    let mounts = std::fs::read_to_string("/proc/mounts").unwrap_or_default();
    mounts
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.len() >= 4 && dir.starts_with(f[1])).then(|| (f[1].len(), f))
        })
        .max_by_key(|(len, _)| *len)
        .map(|(_, f)| format!("{} ({} on {}, {})", f[2], f[0], f[1], f[3]))
        .unwrap_or_else(|| "unknown".into())
}

pub fn median(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

pub fn min_max(values: &[f64]) -> (f64, f64) {
    values
        .iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &v| {
            (lo.min(v), hi.max(v))
        })
}

/// "4 KiB", "1 MiB".
pub fn size_label(size: usize) -> String {
    if size >= 1 << 20 {
        format!("{} MiB", size >> 20)
    } else {
        format!("{} KiB", size >> 10)
    }
}

/// A JSON number with `decimals` digits after the point, or `null` for what JSON cannot hold
/// (a window in which no IO completed gives an infinite time per IO).
pub fn json_num(value: f64, decimals: usize) -> String {
    if value.is_finite() {
        format!("{value:.decimals$}")
    } else {
        "null".into()
    }
}

/// A JSON array of numbers with `decimals` digits after the point (`null` where not finite).
pub fn json_list(values: &[f64], decimals: usize) -> String {
    let items: Vec<String> = values.iter().map(|&v| json_num(v, decimals)).collect();
    format!("[{}]", items.join(", "))
}

/// A JSON string literal.
pub fn json_str(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// The workspace's target directory (where benches leave their JSON samples).
pub fn target_dir(manifest_dir: &str) -> PathBuf {
    let dir = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(manifest_dir).join("../../target"));
    dir.canonicalize().unwrap_or(dir)
}

/// An environment knob: its parsed value, or `default` when unset (a bad value panics,
/// naming the variable).
pub fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    match std::env::var(name) {
        Ok(v) => v
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("{name}={v:?} is not a valid value")),
        Err(_) => default,
    }
}

/// SplitMix64: seeded, so that a run's offsets and payloads can be reproduced.
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }

    /// Incompressible-looking bytes (zero pages would flatter a store).
    pub fn bytes(&mut self, len: usize) -> Vec<u8> {
        let mut buf = Vec::with_capacity(len + 8);
        while buf.len() < len {
            buf.extend_from_slice(&self.next_u64().to_le_bytes());
        }
        buf.truncate(len);
        buf
    }
}

/// The IO sizes of `IVDISK_BENCH_SIZES` (comma-separated KiB, powers of two from 4 to 4096),
/// or `None` when it is unset.
pub fn sizes_from_env() -> Option<Vec<usize>> {
    let list = std::env::var("IVDISK_BENCH_SIZES").ok()?;
    Some(
        list.split(',')
            .map(|s| {
                let kib: usize = s.trim().parse().expect("IVDISK_BENCH_SIZES: KiB numbers");
                assert!(
                    (4..=4096).contains(&kib) && kib.is_power_of_two(),
                    "sizes are powers of two from 4 KiB to 4 MiB"
                );
                kib << 10
            })
            .collect(),
    )
}

/// One measured run: operations done and the time they took.
#[derive(Clone, Copy)]
pub struct Run {
    pub ops: u64,
    pub elapsed: std::time::Duration,
}

impl Run {
    pub fn ops_per_s(&self) -> f64 {
        self.ops as f64 / self.elapsed.as_secs_f64()
    }

    /// Data throughput for operations of `size` bytes, in MB/s (10^6 bytes).
    pub fn mb_per_s(&self, size: usize) -> f64 {
        self.ops as f64 * size as f64 / self.elapsed.as_secs_f64() / 1e6
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_json_cannot_hold_become_null() {
        assert_eq!(
            json_list(&[1.25, f64::INFINITY, f64::NAN, -0.5], 1),
            "[1.2, null, null, -0.5]"
        );
        assert_eq!(json_num(f64::NEG_INFINITY, 3), "null");
        assert_eq!(json_num(2.0, 0), "2");
    }
}
