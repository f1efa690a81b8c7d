//! Known-answer tests from the standards: IEEE 1619 (XTS-AES), the GCM specification's test
//! cases (NIST SP 800-38D), the AEGIS draft (AEGIS-128L, AEGIS-256) and the HCTR2 reference
//! vectors. Vector files and their sources: tests/vectors/.

mod common;

use common::read_vectors;
use ivdisk_crypto::primitives::*;
use ivdisk_crypto::{new_cipher, CipherParams, CryptoError, ImageId, Suite, VolumeKey};

#[test]
fn xts_ieee1619_vectors() {
    let vectors = read_vectors("xts_ieee1619.txt");
    let (mut short, mut unit512_k256, mut unit512_k512) = (0, 0, 0);
    for v in &vectors {
        let (key, pt, ct) = (v.bytes("key"), v.bytes("pt"), v.bytes("ct"));
        let tweak: [u8; 16] = v.bytes("tweak").try_into().expect("16-byte tweak");
        let (k1, k2) = key.split_at(key.len() / 2);
        if k1 == k2 {
            // Vector 1 has two equal (all-zero) key halves: OpenSSL and our suites refuse such
            // keys, as IEEE 1619-2018 asks.
            let err = new_cipher(
                Suite::AesXtsPlain64,
                &VolumeKey::from_slice(&key),
                &CipherParams::new(512, ImageId::default()),
            )
            .unwrap_err();
            assert!(
                matches!(err, CryptoError::XtsKeyHalvesEqual { .. }),
                "{}: {err}",
                v.label
            );
            continue;
        }
        // Both engines: the one the suites use on this CPU (VAES where present) and OpenSSL's.
        for (engine, openssl_only) in [("suite engine", false), ("openssl", true)] {
            let mut buf = pt.clone();
            xts_crypt_unit(&key, &tweak, &mut buf, true, openssl_only).unwrap();
            assert_eq!(
                hex::encode(&buf),
                hex::encode(&ct),
                "{} {engine}: encrypt",
                v.label
            );
            xts_crypt_unit(&key, &tweak, &mut buf, false, openssl_only).unwrap();
            assert_eq!(buf, pt, "{} {engine}: decrypt", v.label);
        }
        match (pt.len(), key.len()) {
            (512, 32) => unit512_k256 += 1,
            (512, 64) => unit512_k512 += 1,
            _ => short += 1,
        }

        // The suite path: a 512-byte data unit whose sequence number fits the sector number is
        // exactly sector `dusn` of an aes-xts-plain64 disk with 512-byte sectors.
        let dusn = u128::from_le_bytes(tweak);
        if pt.len() == 512 && dusn <= u64::MAX as u128 {
            let cipher = new_cipher(
                Suite::AesXtsPlain64,
                &VolumeKey::from_slice(&key),
                &CipherParams::new(512, ImageId::default()),
            )
            .unwrap();
            let mut sector = pt.clone();
            cipher
                .encrypt_sectors(dusn as u64, &mut sector, &mut [])
                .unwrap();
            assert_eq!(sector, ct, "{}: suite encrypt", v.label);
            cipher
                .decrypt_sectors(dusn as u64, &mut sector, &[])
                .unwrap();
            assert_eq!(sector, pt, "{}: suite decrypt", v.label);
        }
    }
    // Vector 1 is the refused one; 2 and 3 remain of the 32-byte units.
    assert!(
        short >= 2 && unit512_k256 >= 2 && unit512_k512 >= 2,
        "vector coverage: {short} {unit512_k256} {unit512_k512}"
    );
}

/// The XTS engine the suites use on this CPU (VAES on CPUs that have it) and OpenSSL's agree on
/// random keys, tweaks and data units of every whole-block length up to 4 KiB and beyond.
#[test]
fn xts_engines_agree_on_random_units() {
    let mut lengths: Vec<usize> = (1..=40).map(|blocks| blocks * 16).collect();
    lengths.extend([512, 1008, 2048, 4096, 4112, 8192]);
    for key_len in [32, 64] {
        for &len in &lengths {
            let mut key = vec![0u8; key_len];
            let mut tweak = [0u8; 16];
            let mut data = vec![0u8; len];
            ivdisk_crypto::fill_random(&mut key).unwrap();
            ivdisk_crypto::fill_random(&mut tweak).unwrap();
            ivdisk_crypto::fill_random(&mut data).unwrap();
            let (mut ours, mut theirs) = (data.clone(), data.clone());
            xts_crypt_unit(&key, &tweak, &mut ours, true, false).unwrap();
            xts_crypt_unit(&key, &tweak, &mut theirs, true, true).unwrap();
            assert_eq!(
                ours, theirs,
                "encrypt, key {key_len} bytes, unit {len} bytes"
            );
            xts_crypt_unit(&key, &tweak, &mut ours, false, false).unwrap();
            assert_eq!(ours, data, "decrypt, key {key_len} bytes, unit {len} bytes");
        }
    }
}

#[test]
fn gcm_nist_vectors() {
    let vectors = read_vectors("gcm_nist.txt");
    for v in &vectors {
        let (key, iv, aad, pt, ct) = (
            v.bytes("key"),
            v.bytes("iv"),
            v.bytes("aad"),
            v.bytes("pt"),
            v.bytes("ct"),
        );
        let tag: [u8; 16] = v.bytes("tag").try_into().expect("16-byte tag");
        let mut buf = pt.clone();
        let got = gcm_seal_once(&key, &iv, &aad, &mut buf).unwrap();
        assert_eq!(
            hex::encode(&buf),
            hex::encode(&ct),
            "{}: ciphertext",
            v.label
        );
        assert_eq!(got, tag, "{}: tag", v.label);
        assert!(
            gcm_open_once(&key, &iv, &aad, &mut buf, &tag).unwrap(),
            "{}: open",
            v.label
        );
        assert_eq!(buf, pt, "{}: plaintext", v.label);
        let mut bad = tag;
        bad[15] ^= 1;
        let mut buf = ct.clone();
        assert!(
            !gcm_open_once(&key, &iv, &aad, &mut buf, &bad).unwrap(),
            "{}: forged tag",
            v.label
        );
    }
    for key_len in [16, 32] {
        assert!(vectors
            .iter()
            .any(|v| v.bytes("key").len() == key_len && !v.bytes("aad").is_empty()));
    }
}

#[test]
fn aegis_draft_vectors() {
    let vectors = read_vectors("aegis.txt");
    let mut checked = [0usize; 2];
    for v in &vectors {
        let (key, nonce, ad, ct) = (
            v.bytes("key"),
            v.bytes("nonce"),
            v.bytes("ad"),
            v.bytes("ct"),
        );
        let tag: [u8; 16] = v.bytes("tag128").try_into().expect("16-byte tag");
        let valid = v.text("valid") != Some("false");
        let alg = v.text("alg").expect("alg field");
        let mut buf = ct.clone();
        let opened = match alg {
            "aegis128l" => aegis128l_open(
                &key.clone().try_into().unwrap(),
                &nonce,
                &ad,
                &mut buf,
                &tag,
            ),
            "aegis256" => aegis256_open(
                &key.clone().try_into().unwrap(),
                &nonce,
                &ad,
                &mut buf,
                &tag,
            ),
            other => panic!("{}: unknown alg {other}", v.label),
        };
        assert_eq!(opened, valid, "{}: open", v.label);
        if valid {
            let msg = v.bytes("msg");
            assert_eq!(buf, msg, "{}: plaintext", v.label);
            let mut buf = msg.clone();
            let got = match alg {
                "aegis128l" => {
                    aegis128l_seal(&key.clone().try_into().unwrap(), &nonce, &ad, &mut buf)
                }
                _ => aegis256_seal(&key.clone().try_into().unwrap(), &nonce, &ad, &mut buf),
            };
            assert_eq!(
                hex::encode(&buf),
                hex::encode(&ct),
                "{}: ciphertext",
                v.label
            );
            assert_eq!(got, tag, "{}: tag", v.label);
        }
        checked[(alg == "aegis256") as usize] += 1;
    }
    assert!(
        checked[0] >= 5 && checked[1] >= 5,
        "vector coverage {checked:?}"
    );
}

#[test]
fn hctr2_reference_vectors() {
    let vectors = read_vectors("hctr2.txt");
    let mut lengths = std::collections::BTreeSet::new();
    for v in &vectors {
        let (key, pt, ct) = (v.bytes("key"), v.bytes("pt"), v.bytes("ct"));
        let tweak: [u8; HCTR2_TWEAK_LEN] = v.bytes("tweak").try_into().expect("32-byte tweak");
        let hctr2 = Hctr2::new(&key).unwrap();
        let mut buf = pt.clone();
        hctr2.encrypt(&tweak, &mut buf);
        assert_eq!(hex::encode(&buf), hex::encode(&ct), "{}: encrypt", v.label);
        hctr2.decrypt(&tweak, &mut buf);
        assert_eq!(buf, pt, "{}: decrypt", v.label);
        lengths.insert((key.len(), pt.len()));
    }
    assert!(lengths.contains(&(32, 16)) && lengths.iter().any(|&(k, l)| k == 32 && l % 16 != 0));
    assert!(lengths.iter().any(|&(k, l)| k == 32 && l >= 256));
}

/// The AEAD suites' construction is the documented one (docs/CRYPTO.md): each sector of a run,
/// whichever engine sealed it (the four-lane AEGIS-128L for groups of four where the CPU has
/// VAES, libaegis otherwise), opens with the plain primitive under nonce = the metadata's first
/// bytes, tag = the 16 after, AAD = image id || LE64(sector).
#[test]
fn aead_sectors_open_with_the_documented_construction() {
    let image = ImageId(*b"construction-id!");
    for (suite, nonce_len) in [(Suite::Aegis128lRandom, 16), (Suite::Aegis256Random, 32)] {
        for run in [1usize, 3, 4, 8, 9] {
            let key = VolumeKey::generate(suite.default_key_len()).unwrap();
            let cipher = new_cipher(suite, &key, &CipherParams::new(4096, image)).unwrap();
            let mut plain = vec![0u8; run * 4096];
            ivdisk_crypto::fill_random(&mut plain).unwrap();
            let mut data = plain.clone();
            let mut md = vec![0u8; run * suite.metadata_len()];
            let first = 77u64;
            cipher.encrypt_sectors(first, &mut data, &mut md).unwrap();
            for i in 0..run {
                let m = &md[i * suite.metadata_len()..][..suite.metadata_len()];
                let (nonce, tag) = (&m[..nonce_len], &m[nonce_len..nonce_len + 16]);
                let mut aad = image.0.to_vec();
                aad.extend_from_slice(&(first + i as u64).to_le_bytes());
                let mut sector = data[i * 4096..][..4096].to_vec();
                let tag: &[u8; 16] = tag.try_into().unwrap();
                let ok = match suite {
                    Suite::Aegis128lRandom => aegis128l_open(
                        key.as_bytes().try_into().unwrap(),
                        nonce,
                        &aad,
                        &mut sector,
                        tag,
                    ),
                    _ => aegis256_open(
                        key.as_bytes().try_into().unwrap(),
                        nonce,
                        &aad,
                        &mut sector,
                        tag,
                    ),
                };
                assert!(ok, "{suite} run {run}: sector {i} does not open");
                assert_eq!(
                    sector,
                    &plain[i * 4096..][..4096],
                    "{suite} run {run} sector {i}"
                );
            }
        }
    }
}
