//! Cross-check of `aes-xts-plain64` against the `openssl` command line tool.
//!
//! OpenSSL 3's `openssl enc` refuses XTS ("enc XTS ciphers not supported"; checked below), so
//! the reference composes XTS (IEEE 1619) here from the CLI's AES-ECB:
//!   T = AES-ECB(K2, LE128(byte offset / 512)),  X_j = T * x^j in GF(2^128),
//!   C = AES-ECB(K1, P xor X) xor X,  over the whole sector in one `openssl enc` call.
//! The composition itself is checked against the IEEE 1619 vectors first.
//!
//! Needs the `openssl` binary; without it these tests fail (they do not skip).

mod common;

use std::io::{ErrorKind, Write};
use std::process::{Command, Output, Stdio};

use ivdisk_crypto::{fill_random, new_cipher, CipherParams, ImageId, Suite, VolumeKey};

const MISSING: &str =
    "the `openssl` command line tool is needed by this test: install the `openssl` package \
     (e.g. `apt-get install openssl`)";

/// Run `openssl <args>` with `input` on stdin.
fn openssl(args: &[&str], input: &[u8]) -> Output {
    let mut child = Command::new("openssl")
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| match e.kind() {
            ErrorKind::NotFound => panic!("{MISSING} ({e})"),
            _ => panic!("running `openssl {}`: {e}", args.join(" ")),
        });
    let mut stdin = child.stdin.take().expect("piped stdin");
    let input = input.to_vec();
    // Write from another thread so a full stdout pipe can never deadlock us.
    let writer = std::thread::spawn(move || {
        // openssl may exit early (refused cipher) and close its stdin: not an error here.
        let _ = stdin.write_all(&input);
    });
    let output = child.wait_with_output().expect("waiting for openssl");
    writer.join().expect("stdin writer");
    output
}

/// AES-ECB without padding through `openssl enc`; the key length picks AES-128 or AES-256.
fn openssl_aes_ecb(key: &[u8], input: &[u8]) -> Vec<u8> {
    let cipher = match key.len() {
        16 => "-aes-128-ecb",
        32 => "-aes-256-ecb",
        n => panic!("no AES with a {n}-byte key here"),
    };
    let key_hex = hex::encode(key);
    let output = openssl(&["enc", cipher, "-K", &key_hex, "-nopad"], input);
    assert!(
        output.status.success(),
        "openssl enc {cipher} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert_eq!(
        output.stdout.len(),
        input.len(),
        "openssl enc {cipher} output length"
    );
    output.stdout
}

/// Multiply by x in GF(2^128), IEEE 1619's little-endian convention.
fn gf_double(t: u128) -> u128 {
    (t << 1) ^ ((t >> 127) * 0x87)
}

/// XTS-AES encryption of one data unit (a whole number of blocks) with the given 16-byte
/// tweak value, composed from `openssl enc`'s AES-ECB.
fn reference_xts_encrypt(key: &[u8], tweak: [u8; 16], unit: &[u8]) -> Vec<u8> {
    assert_eq!(unit.len() % 16, 0, "no ciphertext stealing here");
    let (k1, k2) = key.split_at(key.len() / 2);
    let t = openssl_aes_ecb(k2, &tweak);
    let mut t = u128::from_le_bytes(t.try_into().unwrap());
    let mut masks = Vec::with_capacity(unit.len() / 16);
    let mut masked = Vec::with_capacity(unit.len());
    for block in unit.chunks(16) {
        masks.push(t);
        masked.extend(block.iter().zip(t.to_le_bytes()).map(|(p, x)| p ^ x));
        t = gf_double(t);
    }
    let mut out = openssl_aes_ecb(k1, &masked);
    for (block, x) in out.chunks_mut(16).zip(&masks) {
        block
            .iter_mut()
            .zip(x.to_le_bytes())
            .for_each(|(c, x)| *c ^= x);
    }
    out
}

/// The plain64 tweak of a sector, computed without wrapping: byte offset / 512 as LE128.
fn plain64_tweak(sector: u64, sector_size: usize) -> [u8; 16] {
    (u128::from(sector) * (sector_size as u128 / 512)).to_le_bytes()
}

fn random_u64() -> u64 {
    let mut b = [0u8; 8];
    fill_random(&mut b).unwrap();
    u64::from_le_bytes(b)
}

#[test]
fn openssl_cli_is_installed() {
    let output = Command::new("openssl")
        .arg("version")
        .output()
        .unwrap_or_else(|e| panic!("{MISSING} ({e})"));
    assert!(output.status.success(), "`openssl version` failed");
    assert!(
        String::from_utf8_lossy(&output.stdout).contains("SSL"),
        "unexpected `openssl version` output: {}",
        String::from_utf8_lossy(&output.stdout)
    );
}

/// The composed reference reproduces IEEE 1619's vectors (all of them, including the two
/// equal-halves vector the suites refuse: plain ECB does not care).
#[test]
fn composed_reference_matches_ieee1619_vectors() {
    let vectors = common::read_vectors("xts_ieee1619.txt");
    for v in &vectors {
        let tweak: [u8; 16] = v.bytes("tweak").try_into().expect("16-byte tweak");
        let got = reference_xts_encrypt(&v.bytes("key"), tweak, &v.bytes("pt"));
        assert_eq!(hex::encode(got), hex::encode(v.bytes("ct")), "{}", v.label);
    }
    assert!(vectors.len() >= 10, "only {} vectors", vectors.len());
}

#[test]
fn aes_xts_plain64_matches_openssl_cli() {
    let mut checked = 0;
    for key_len in [32usize, 64] {
        for sector_size in [512usize, 1024, 2048, 4096] {
            let key = VolumeKey::generate(key_len).unwrap();
            let cipher = new_cipher(
                Suite::AesXtsPlain64,
                &key,
                &CipherParams::new(sector_size, ImageId([9; 16])),
            )
            .unwrap();
            // The largest sector whose offset / 512 fits the 64-bit plain64 tweak: the last one
            // the suites accept (u64::MAX for 512-byte sectors).
            let top = ((1u128 << 64) / (sector_size as u128 / 512) - 1) as u64;
            let mut sectors = vec![0, 1, top, top - 1, 1 << 32];
            while sectors.len() < 8 {
                sectors.push(random_u64() % top);
            }
            for &s in &sectors {
                let mut plain = vec![0u8; sector_size];
                fill_random(&mut plain).unwrap();
                let expected =
                    reference_xts_encrypt(key.as_bytes(), plain64_tweak(s, sector_size), &plain);
                let mut data = plain.clone();
                cipher.encrypt_sectors(s, &mut data, &mut []).unwrap();
                assert!(
                    data == expected,
                    "AES-{}-XTS, {sector_size}-byte sector {s}: differs from openssl enc",
                    key_len * 4
                );
                cipher.decrypt_sectors(s, &mut data, &[]).unwrap();
                assert!(data == plain, "sector {s}: decrypt does not invert");
                checked += 1;
            }
            // A run of several sectors is the same as its sectors one by one, also the run
            // that ends at the last sector.
            for first in [sectors[7].min(top - 2), top - 2] {
                let mut plain = vec![0u8; 3 * sector_size];
                fill_random(&mut plain).unwrap();
                let mut data = plain.clone();
                cipher.encrypt_sectors(first, &mut data, &mut []).unwrap();
                for (i, (got, p)) in data
                    .chunks(sector_size)
                    .zip(plain.chunks(sector_size))
                    .enumerate()
                {
                    let expected = reference_xts_encrypt(
                        key.as_bytes(),
                        plain64_tweak(first + i as u64, sector_size),
                        p,
                    );
                    assert!(
                        got == expected,
                        "{sector_size}-byte sectors: run at {first}, sector {i}"
                    );
                }
            }
        }
    }
    assert_eq!(checked, 64);
}

/// `openssl enc` refuses XTS, which is why the reference above is composed from ECB. Should a
/// future OpenSSL accept it, the suite is compared with it directly instead.
#[test]
fn openssl_enc_refuses_xts() {
    let key = VolumeKey::generate(64).unwrap();
    let cipher = new_cipher(
        Suite::AesXtsPlain64,
        &key,
        &CipherParams::new(512, ImageId::default()),
    )
    .unwrap();
    let sector = 12345u64;
    let mut plain = vec![0u8; 512];
    fill_random(&mut plain).unwrap();
    let output = openssl(
        &[
            "enc",
            "-aes-256-xts",
            "-K",
            &hex::encode(key.as_bytes()),
            "-iv",
            &hex::encode(plain64_tweak(sector, 512)),
            "-nopad",
        ],
        &plain,
    );
    if output.status.success() {
        let mut data = plain.clone();
        cipher.encrypt_sectors(sector, &mut data, &mut []).unwrap();
        assert_eq!(
            hex::encode(&output.stdout),
            hex::encode(&data),
            "openssl enc -aes-256-xts now works (update the comment in this file) but differs"
        );
    } else {
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            stderr.contains("XTS") && stderr.contains("not supported"),
            "openssl enc -aes-256-xts failed for another reason: {stderr}"
        );
    }
}
