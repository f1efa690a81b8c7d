//! Images formatted and written by librbd's own encryption (`rbd encryption format`, then
//! writes through `encryption_load`), exported raw from a real Ceph 16.2 cluster by
//! scripts/make-rbd-luks-fixtures, open and read back through ivdisk's open path.

use std::io::Read;

use ivdisk_crypto::Suite;
use ivdisk_header::{Header, MemoryHeaderIo};
use serde_json::Value;

fn fixture(name: &str) -> (MemoryHeaderIo, Value) {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures");
    let gz = std::fs::read(format!("{dir}/{name}.raw.gz")).unwrap();
    let mut raw = Vec::new();
    flate2::read::GzDecoder::new(&gz[..])
        .read_to_end(&mut raw)
        .unwrap();
    let meta: Value =
        serde_json::from_slice(&std::fs::read(format!("{dir}/{name}.json")).unwrap()).unwrap();
    assert_eq!(raw.len() as u64, meta["raw_size"].as_u64().unwrap());
    (MemoryHeaderIo(raw), meta)
}

/// The fixture's plaintext rule: 512-byte unit i is SHA-256("ivdisk-fixture:{i}") x 16.
fn expected_plaintext(offset: u64, len: u64) -> Vec<u8> {
    (offset / 512..(offset + len) / 512)
        .flat_map(|i| openssl::sha::sha256(format!("ivdisk-fixture:{i}").as_bytes()).repeat(16))
        .collect()
}

fn check(name: &str, version: u16, sector_size: u32) {
    let (device, meta) = fixture(name);
    let header = Header::read(&device).unwrap();
    assert_eq!(header.version(), version);
    let passphrase = meta["passphrase"].as_str().unwrap().as_bytes();
    let unlocked = header.unlock(&device, passphrase).unwrap();
    let data = header.open_data(&unlocked.volume_key).unwrap();
    assert_eq!(data.suite, Suite::AesXtsPlain64);
    assert_eq!(data.info.offset, meta["data_offset"].as_u64().unwrap());
    assert_eq!(data.info.sector_size, sector_size);
    // librbd aligns the data to the object size.
    assert_eq!(data.info.offset % meta["object_size"].as_u64().unwrap(), 0);
    for range in meta["written_ranges"].as_array().unwrap() {
        let (at, len) = (range[0].as_u64().unwrap(), range[1].as_u64().unwrap());
        let start = (data.info.offset + at) as usize;
        let mut buf = device.0[start..start + len as usize].to_vec();
        data.cipher
            .decrypt_sectors(data.sector_number(at), &mut buf, &[])
            .unwrap();
        assert!(
            buf == expected_plaintext(at, len),
            "{name}: logical range [{at}, +{len}) does not decrypt to librbd's plaintext"
        );
    }
}

#[test]
fn librbd_luks1_image_opens_and_reads_back() {
    check("rbd-luks1", 1, 512);
}

#[test]
fn librbd_luks2_image_opens_and_reads_back() {
    check("rbd-luks2", 2, 4096);
}
