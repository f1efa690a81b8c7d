//! Arbitrary bytes as a header device: `Header::read` and everything a reader of the header
//! does with it (dump, keyslot list, segment, image parameters) must return, never panic, and
//! never allocate without bound. Unlocking is left out: its cost is the KDF, by design.
//!
//! Each input runs twice: as given, and with the checksum of every LUKS2 binary header in it
//! recomputed, so mutations of the JSON text reach the JSON parser and the spec checks instead
//! of stopping at the checksum.

#![no_main]

use ivdisk_header::binary::{HEADER_SIZES, MAGIC_PRIMARY, MAGIC_SECONDARY};
use ivdisk_header::{Header, MemoryHeaderIo};
use libfuzzer_sys::fuzz_target;

const CSUM_OFFSET: usize = 448;
const CSUM_FIELD_LEN: usize = 64;

fuzz_target!(|data: &[u8]| {
    read_everything(data.to_vec());
    let mut fixed = data.to_vec();
    if fix_checksums(&mut fixed) {
        read_everything(fixed);
    }
});

fn read_everything(bytes: Vec<u8>) {
    let io = MemoryHeaderIo(bytes);
    let Ok(header) = Header::read(&io) else {
        return;
    };
    let _ = header.to_json();
    let _ = header.keyslots();
    let _ = header.segment().map(|s| s.suite());
    let _ = header.image_params();
    let _ = header.foreign_requirements();
    let _ = header.region_len();
    let _ = (
        header.uuid(),
        header.label(),
        header.seqid(),
        header.warning(),
    );
}

/// Recompute the checksum of each binary header (primary at 0, secondaries at the allowed
/// offsets) whose size field fits the input and whose checksum algorithm is known. Returns
/// whether anything changed.
fn fix_checksums(bytes: &mut [u8]) -> bool {
    let mut changed = false;
    for offset in std::iter::once(0).chain(HEADER_SIZES) {
        let offset = offset as usize;
        let Some(head) = bytes.get(offset..offset + 512) else {
            continue;
        };
        let magic = if offset == 0 {
            MAGIC_PRIMARY
        } else {
            MAGIC_SECONDARY
        };
        if head[..6] != magic {
            continue;
        }
        let hdr_size = u64::from_be_bytes(head[8..16].try_into().unwrap());
        if !HEADER_SIZES.contains(&hdr_size) {
            continue;
        }
        let alg_end = head[72..104].iter().position(|&b| b == 0).unwrap_or(32);
        let alg = head[72..72 + alg_end].to_ascii_lowercase();
        let Some(copy) = bytes.get_mut(offset..offset + hdr_size as usize) else {
            continue;
        };
        let old = copy[CSUM_OFFSET..CSUM_OFFSET + CSUM_FIELD_LEN].to_vec();
        copy[CSUM_OFFSET..CSUM_OFFSET + CSUM_FIELD_LEN].fill(0);
        let sum: Vec<u8> = match alg.as_slice() {
            b"sha1" => openssl::sha::sha1(copy).to_vec(),
            b"sha256" => openssl::sha::sha256(copy).to_vec(),
            b"sha512" => openssl::sha::sha512(copy).to_vec(),
            _ => {
                copy[CSUM_OFFSET..CSUM_OFFSET + CSUM_FIELD_LEN].copy_from_slice(&old);
                continue;
            }
        };
        // Keep the field's tail as it was: only the hash-sized prefix is compared.
        copy[CSUM_OFFSET..CSUM_OFFSET + CSUM_FIELD_LEN].copy_from_slice(&old);
        copy[CSUM_OFFSET..CSUM_OFFSET + sum.len()].copy_from_slice(&sum);
        changed |= copy[CSUM_OFFSET..CSUM_OFFSET + CSUM_FIELD_LEN] != old[..];
    }
    changed
}
