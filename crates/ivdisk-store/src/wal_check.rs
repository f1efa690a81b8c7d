//! Reading SQLite's write-ahead log before SQLite does, to say what recovery will drop.
//!
//! SQLite replays its WAL up to the last commit whose frames all carry valid checksums and
//! silently ignores the rest. A store must say so: this scans the log with the same rules
//! (<https://www.sqlite.org/fileformat2.html#walformat>) and reports the bytes past the last
//! valid commit, which is exactly what a torn write or a damaged record costs.

use std::io::Read;
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

/// Scan a WAL of `len` bytes read from `wal`; `None` if there is no usable header (SQLite then
/// ignores the file).
fn scan(mut wal: impl Read, len: u64) -> std::io::Result<Option<WalScan>> {
    if len < HEADER_LEN as u64 {
        return Ok(None);
    }
    let mut header = [0u8; HEADER_LEN];
    wal.read_exact(&mut header)?;
    let be32 = |at: usize| u32::from_be_bytes(header[at..at + 4].try_into().expect("4 bytes"));
    let magic = be32(0);
    let big_endian = match magic {
        0x377f_0682 => false,
        0x377f_0683 => true,
        _ => return Ok(None),
    };
    let page_size = be32(8) as usize;
    let page_size = if page_size == 1 { 65536 } else { page_size };
    if !(512..=65536).contains(&page_size) || !page_size.is_power_of_two() {
        return Ok(None);
    }
    let (salt1, salt2) = (be32(16), be32(20));
    let (mut s0, mut s1) = checksum(&header[..24], big_endian, 0, 0);
    if (s0, s1) != (be32(24), be32(28)) {
        return Ok(None);
    }
    let frame_len = (FRAME_HEADER_LEN + page_size) as u64;
    let mut frame = vec![0u8; frame_len as usize];
    let mut scan = WalScan::default();
    let mut valid_end = HEADER_LEN as u64;
    let mut at = HEADER_LEN as u64;
    // The end of the frames written since the log last restarted (valid or not). Frames with
    // other salts are left over from before a restart (SQLite reuses the file from the start)
    // and were never part of this log: they are not "discarded".
    let mut current_end = HEADER_LEN as u64;
    let mut broken = false;
    // A frame of other salts seen: from before a restart, or damaged. Which one, the frames
    // after it tell: a frame of this log after it means it was this log's, damaged (SQLite
    // stops there and drops every commit after it), since a restarted log is written from
    // the start, in order, and everything past its end is older.
    let mut other_salts = false;
    while at < len {
        if at + frame_len > len {
            // A partial frame at the end of the file: torn while being written, unless the
            // log already ended at a bad frame.
            if !broken && !other_salts {
                current_end = len;
            }
            break;
        }
        wal.read_exact(&mut frame)?;
        let f32 = |i: usize| u32::from_be_bytes(frame[i..i + 4].try_into().expect("4 bytes"));
        at += frame_len;
        if f32(8) != salt1 || f32(12) != salt2 {
            other_salts = true;
            continue;
        }
        current_end = at;
        broken |= other_salts;
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
    scan.discarded_bytes = current_end.saturating_sub(valid_end);
    Ok(Some(scan))
}

/// Scan the WAL file at `path` (missing: nothing to replay).
///
/// Read through a 1 MiB buffer, frame by frame: read whole into one buffer, a log of 335 MB
/// (random 4 KiB writes until a SIGKILL) cost an open about a third of its time in the kernel
/// zeroing the buffer's fresh pages (docs/BENCHMARKS.md, "The reclaim after a crash off the
/// open").
pub fn scan_file(path: &Path) -> std::io::Result<Option<WalScan>> {
    let file = match std::fs::File::open(path) {
        Ok(file) => file,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    let len = file.metadata()?.len();
    scan(std::io::BufReader::with_capacity(1 << 20, file), len)
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAGE: usize = 512;

    /// A log with SQLite's header and one frame per entry of `frames` (page number, database
    /// size if the frame ends a commit, else 0); with `damage`, that frame's page is changed
    /// after its checksum was taken.
    fn log(frames: &[(u32, u32)], damage: Option<usize>, salts: (u32, u32)) -> Vec<u8> {
        let mut wal = Vec::new();
        for word in [0x377f_0682, 3_007_000, PAGE as u32, 0, salts.0, salts.1] {
            wal.extend_from_slice(&u32::to_be_bytes(word));
        }
        let (mut s0, mut s1) = checksum(&wal, false, 0, 0);
        wal.extend_from_slice(&s0.to_be_bytes());
        wal.extend_from_slice(&s1.to_be_bytes());
        for (i, &(page, commit)) in frames.iter().enumerate() {
            let mut header = Vec::new();
            for word in [page, commit, salts.0, salts.1] {
                header.extend_from_slice(&word.to_be_bytes());
            }
            let mut data = vec![i as u8 + 1; PAGE];
            (s0, s1) = checksum(&header[..8], false, s0, s1);
            (s0, s1) = checksum(&data, false, s0, s1);
            header.extend_from_slice(&s0.to_be_bytes());
            header.extend_from_slice(&s1.to_be_bytes());
            if damage == Some(i) {
                data[7] ^= 1;
            }
            wal.extend_from_slice(&header);
            wal.extend_from_slice(&data);
        }
        wal
    }

    fn scan_bytes(wal: &[u8]) -> Option<WalScan> {
        scan(wal, wal.len() as u64).unwrap()
    }

    const FRAME: u64 = (FRAME_HEADER_LEN + PAGE) as u64;

    #[test]
    fn commits_counted_and_what_follows_the_last_valid_one_reported() {
        let frames = [(1, 0), (2, 2), (3, 0), (1, 3), (2, 0)];
        let whole = log(&frames, None, (7, 9));
        assert_eq!(
            scan_bytes(&whole),
            Some(WalScan {
                valid_commits: 2,
                discarded_bytes: FRAME
            }),
            "a frame after the last commit is dropped"
        );
        // A torn tail: part of one more frame.
        let mut torn = whole.clone();
        torn.extend_from_slice(&[0u8; 100]);
        assert_eq!(scan_bytes(&torn).unwrap().discarded_bytes, FRAME + 100);
        // Damage in the second commit's first frame: only the first commit stays.
        let damaged = log(&frames, Some(2), (7, 9));
        assert_eq!(
            scan_bytes(&damaged),
            Some(WalScan {
                valid_commits: 1,
                discarded_bytes: 3 * FRAME
            })
        );
        // A torn tail after damage is part of what the damage cut off, not more.
        let mut damaged_and_torn = damaged.clone();
        damaged_and_torn.extend_from_slice(&[0u8; 100]);
        assert_eq!(
            scan_bytes(&damaged_and_torn).unwrap().discarded_bytes,
            3 * FRAME
        );
        // Frames of an earlier log (other salts) after the current ones are not this log's.
        let mut reused = log(&frames[..2], None, (7, 9));
        reused.extend_from_slice(&log(&frames, None, (5, 6))[HEADER_LEN + 2 * FRAME as usize..]);
        assert_eq!(
            scan_bytes(&reused),
            Some(WalScan {
                valid_commits: 1,
                discarded_bytes: 0
            })
        );
        // A frame of this log whose salts are damaged (a lost sector, a flipped bit): SQLite
        // stops there, and the commits after it are dropped and said to be. The scan took it
        // for the end of the log, as a frame from before a restart is, and said nothing.
        let mut bad_salt = log(&frames[..4], None, (7, 9));
        bad_salt[HEADER_LEN + 2 * FRAME as usize + 8] ^= 1;
        assert_eq!(
            scan_bytes(&bad_salt),
            Some(WalScan {
                valid_commits: 1,
                discarded_bytes: 2 * FRAME
            })
        );
        // No usable header: SQLite ignores the file.
        assert_eq!(scan_bytes(&whole[..HEADER_LEN - 1]), None);
        let mut bad_header = whole.clone();
        bad_header[17] ^= 1;
        assert_eq!(scan_bytes(&bad_header), None);
    }
}
