//! Reading SQLite's write-ahead log before SQLite does, to say what recovery will drop.
//!
//! SQLite replays its WAL up to the last commit whose frames all carry valid checksums and
//! silently ignores the rest. A store must say so: this scans the log with the same rules
//! (<https://www.sqlite.org/fileformat2.html#walformat>) and reports the bytes past the last
//! valid commit, which is exactly what a torn write or a damaged record costs.

use std::path::Path;

const HEADER_LEN: usize = 32;
const FRAME_HEADER_LEN: usize = 24;

/// What the scan found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct WalScan {
    /// Commits SQLite will replay.
    pub valid_commits: u64,
    /// Bytes after the last valid commit that SQLite will ignore (a torn tail or damage).
    pub discarded_bytes: u64,
}

fn checksum(data: &[u8], big_endian: bool, mut s0: u32, mut s1: u32) -> (u32, u32) {
    for pair in data.chunks_exact(8) {
        let word = |b: &[u8]| {
            let b: [u8; 4] = b.try_into().expect("4 bytes");
            if big_endian {
                u32::from_be_bytes(b)
            } else {
                u32::from_le_bytes(b)
            }
        };
        s0 = s0.wrapping_add(word(&pair[..4])).wrapping_add(s1);
        s1 = s1.wrapping_add(word(&pair[4..])).wrapping_add(s0);
    }
    (s0, s1)
}

/// Scan the WAL bytes; `None` if there is no usable header (SQLite then ignores the file).
pub fn scan(wal: &[u8]) -> Option<WalScan> {
    if wal.len() < HEADER_LEN {
        return None;
    }
    let be32 = |at: usize| u32::from_be_bytes(wal[at..at + 4].try_into().expect("4 bytes"));
    let magic = be32(0);
    let big_endian = match magic {
        0x377f_0682 => false,
        0x377f_0683 => true,
        _ => return None,
    };
    let page_size = be32(8) as usize;
    let page_size = if page_size == 1 { 65536 } else { page_size };
    if !(512..=65536).contains(&page_size) || !page_size.is_power_of_two() {
        return None;
    }
    let (salt1, salt2) = (be32(16), be32(20));
    let (mut s0, mut s1) = checksum(&wal[..24], big_endian, 0, 0);
    if (s0, s1) != (be32(24), be32(28)) {
        return None;
    }
    let frame_len = FRAME_HEADER_LEN + page_size;
    let mut scan = WalScan::default();
    let mut valid_end = HEADER_LEN;
    let mut at = HEADER_LEN;
    // The end of the frames written since the log last restarted (valid or not). Frames with
    // other salts are left over from before a restart (SQLite reuses the file from the start)
    // and were never part of this log: they are not "discarded".
    let mut current_end = HEADER_LEN;
    let mut broken = false;
    while at < wal.len() {
        if at + frame_len > wal.len() {
            // A partial frame at the end of the file: torn while being written, unless the
            // log already ended at a bad frame.
            if !broken {
                current_end = wal.len();
            }
            break;
        }
        let frame = &wal[at..at + frame_len];
        let f32 = |i: usize| u32::from_be_bytes(frame[i..i + 4].try_into().expect("4 bytes"));
        if f32(8) != salt1 || f32(12) != salt2 {
            break;
        }
        current_end = at + frame_len;
        at += frame_len;
        if broken {
            continue;
        }
        let (c0, c1) = checksum(&frame[..8], big_endian, s0, s1);
        let (c0, c1) = checksum(&frame[FRAME_HEADER_LEN..], big_endian, c0, c1);
        if (c0, c1) != (f32(16), f32(20)) {
            broken = true;
            continue;
        }
        (s0, s1) = (c0, c1);
        if f32(4) != 0 {
            scan.valid_commits += 1;
            valid_end = at;
        }
    }
    scan.discarded_bytes = current_end.saturating_sub(valid_end) as u64;
    Some(scan)
}

/// Scan the WAL file at `path` (missing: nothing to replay).
pub fn scan_file(path: &Path) -> std::io::Result<Option<WalScan>> {
    match std::fs::read(path) {
        Ok(bytes) => Ok(scan(&bytes)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}
