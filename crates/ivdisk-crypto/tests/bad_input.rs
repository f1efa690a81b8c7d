//! Bad input gives a typed, matchable `CryptoError`, never a panic: unknown suite names, wrong
//! key lengths, XTS keys with equal halves, unsupported sector sizes, buffers of the wrong
//! length, sector runs past the last addressable sector, GCM's write limit; and keys never
//! show in `Debug`.

use ivdisk_crypto::{
    new_cipher, CipherParams, CryptoError, ImageId, SectorCipher, Suite, VolumeKey,
    GCM_RANDOM_NONCE_WRITE_LIMIT,
};

const IMAGE: ImageId = ImageId([0x42; 16]);

/// A random key of `len` bytes (random halves: never refused as equal-halved XTS keys).
fn random_key(len: usize) -> VolumeKey {
    VolumeKey::generate(len).unwrap()
}

fn build(suite: Suite, sector_size: usize) -> Box<dyn SectorCipher> {
    new_cipher(
        suite,
        &random_key(suite.default_key_len()),
        &CipherParams::new(sector_size, IMAGE),
    )
    .unwrap_or_else(|e| panic!("{suite}: {e}"))
}

fn metadata_for(c: &dyn SectorCipher, data_len: usize) -> Vec<u8> {
    vec![0u8; data_len / c.sector_size() * c.metadata_len()]
}

/// Encrypt then decrypt `sectors` sectors at `first`; panics (failing the test) unless the
/// plaintext comes back.
fn assert_round_trip(c: &dyn SectorCipher, first: u64, sectors: usize) {
    let mut plain = vec![0u8; sectors * c.sector_size()];
    ivdisk_crypto::fill_random(&mut plain).unwrap();
    let mut data = plain.clone();
    let mut md = metadata_for(c, data.len());
    c.encrypt_sectors(first, &mut data, &mut md)
        .unwrap_or_else(|e| panic!("{:?}: encrypt at {first}: {e}", c.suite()));
    assert_ne!(data, plain, "{:?}: nothing encrypted", c.suite());
    c.decrypt_sectors(first, &mut data, &md)
        .unwrap_or_else(|e| panic!("{:?}: decrypt at {first}: {e}", c.suite()));
    assert_eq!(data, plain, "{:?}: round trip at {first}", c.suite());
}

#[test]
fn unknown_suite_name_is_typed_and_lists_the_accepted_names() {
    for name in [
        "nope",
        "",
        "aes-xts",
        "aes-xts-plain",
        "aegis128l",
        "xts-plain64",
    ] {
        match name.parse::<Suite>() {
            Err(CryptoError::UnknownSuite {
                name: given,
                expected,
            }) => {
                assert_eq!(given, name);
                for suite in Suite::ALL {
                    assert!(
                        expected.split(", ").any(|n| n == suite.name()),
                        "'{expected}' does not list {suite}"
                    );
                }
                let message = CryptoError::UnknownSuite {
                    name: given,
                    expected,
                }
                .to_string();
                assert!(message.contains(&format!("'{name}'")), "{message}");
                for suite in Suite::ALL {
                    assert!(message.contains(suite.name()), "{message}");
                }
            }
            other => panic!("'{name}': {other:?}"),
        }
    }
}

#[test]
fn every_suite_name_round_trips_case_insensitively() {
    let mut names: Vec<&str> = Suite::ALL.iter().map(|s| s.name()).collect();
    names.sort_unstable();
    names.dedup();
    assert_eq!(names.len(), Suite::ALL.len(), "suite names are not unique");
    assert!(Suite::ALL.contains(&Suite::DEFAULT));
    for suite in Suite::ALL {
        let name = suite.name();
        assert_eq!(suite.to_string(), name);
        assert_eq!(name.parse::<Suite>().unwrap(), suite);
        assert_eq!(name.to_ascii_uppercase().parse::<Suite>().unwrap(), suite);
        let mixed: String = name
            .chars()
            .enumerate()
            .map(|(i, c)| {
                if i % 2 == 0 {
                    c.to_ascii_uppercase()
                } else {
                    c
                }
            })
            .collect();
        assert_eq!(mixed.parse::<Suite>().unwrap(), suite, "{mixed}");
    }
}

#[test]
fn wrong_key_length_is_typed() {
    for suite in Suite::ALL {
        for len in [0usize, 1, 15, 17, 24, 31, 33, 48, 63, 65, 128] {
            if suite.key_lens().contains(&len) {
                continue;
            }
            let key = VolumeKey::new((0..len).map(|i| i as u8).collect());
            match new_cipher(suite, &key, &CipherParams::new(512, IMAGE)) {
                Err(CryptoError::KeyLength {
                    suite: s,
                    expected,
                    got,
                }) => {
                    assert_eq!(s, suite);
                    assert_eq!(expected, suite.key_lens());
                    assert_eq!(got, len);
                }
                other => panic!("{suite} with a {len}-byte key: {other:?}"),
            }
        }
        // Both a bad key and a bad sector size: either is reported (which one first is not
        // specified: aes-hctr2-plain64 checks the sector size first, the others the key).
        match new_cipher(suite, &random_key(3), &CipherParams::new(100, IMAGE)) {
            Err(CryptoError::KeyLength { got: 3, .. } | CryptoError::SectorSize { got: 100 }) => {}
            other => panic!("{suite}: {other:?}"),
        }
        for &len in suite.key_lens() {
            let c = new_cipher(suite, &random_key(len), &CipherParams::new(512, IMAGE))
                .unwrap_or_else(|e| panic!("{suite} with a {len}-byte key: {e}"));
            assert_eq!(c.suite(), suite);
            assert_round_trip(&*c, 7, 2);
        }
        assert_eq!(suite.default_key_len(), suite.key_lens()[0]);
    }
}

#[test]
fn xts_key_with_equal_halves_is_refused() {
    for suite in [Suite::AesXtsPlain64, Suite::AesXtsRandom] {
        for len in [32usize, 64] {
            let half = random_key(len / 2);
            let constant = VolumeKey::new(vec![0xab; len]);
            let repeated = VolumeKey::new(half.as_bytes().repeat(2));
            for key in [constant, repeated] {
                match new_cipher(suite, &key, &CipherParams::new(4096, IMAGE)) {
                    Err(e @ CryptoError::XtsKeyHalvesEqual { .. }) => {
                        assert!(
                            matches!(e, CryptoError::XtsKeyHalvesEqual { suite: s } if s == suite)
                        );
                        assert!(e.to_string().contains(suite.name()), "{e}");
                    }
                    other => panic!("{suite} with equal {}-byte halves: {other:?}", len / 2),
                }
            }
            // One differing byte is enough.
            let mut bytes = half.as_bytes().repeat(2);
            bytes[len - 1] ^= 1;
            let c = new_cipher(
                suite,
                &VolumeKey::new(bytes),
                &CipherParams::new(4096, IMAGE),
            )
            .unwrap_or_else(|e| panic!("{suite}: {e}"));
            assert_round_trip(&*c, 0, 1);
        }
    }
    // The rule is XTS's alone: a 32-byte AES-256 key may repeat its halves.
    for suite in [
        Suite::AesGcmRandom,
        Suite::AesHctr2Plain64,
        Suite::Aegis256Random,
    ] {
        let c = new_cipher(
            suite,
            &VolumeKey::new(vec![0xab; 32]),
            &CipherParams::new(512, IMAGE),
        )
        .unwrap_or_else(|e| panic!("{suite}: {e}"));
        assert_round_trip(&*c, 0, 1);
    }
}

#[test]
fn unsupported_sector_sizes_are_refused() {
    for suite in Suite::ALL {
        let key = random_key(suite.default_key_len());
        for size in [
            0usize, 1, 16, 100, 256, 511, 513, 1000, 3000, 4095, 4097, 8192, 65536,
        ] {
            match new_cipher(suite, &key, &CipherParams::new(size, IMAGE)) {
                Err(e @ CryptoError::SectorSize { .. }) => {
                    assert!(matches!(e, CryptoError::SectorSize { got } if got == size));
                    assert!(e.to_string().contains(&size.to_string()), "{e}");
                }
                other => panic!("{suite} with {size}-byte sectors: {other:?}"),
            }
        }
        for size in [512usize, 1024, 2048, 4096] {
            let c = new_cipher(suite, &key, &CipherParams::new(size, IMAGE))
                .unwrap_or_else(|e| panic!("{suite} with {size}-byte sectors: {e}"));
            assert_eq!(c.sector_size(), size);
            assert_round_trip(&*c, 3, 2);
        }
    }
}

#[test]
fn data_buffer_not_whole_sectors_is_refused() {
    for suite in Suite::ALL {
        for sector_size in [512usize, 4096] {
            let c = build(suite, sector_size);
            for len in [
                0,
                1,
                16,
                sector_size - 1,
                sector_size + 1,
                2 * sector_size + 16,
            ] {
                let original: Vec<u8> = (0..len).map(|i| i as u8).collect();
                let mut md = metadata_for(&*c, len);
                let mut data = original.clone();
                let enc = c.encrypt_sectors(0, &mut data, &mut md);
                let mut data2 = original.clone();
                let dec = c.decrypt_sectors(0, &mut data2, &md);
                for (what, result) in [("encrypt", enc), ("decrypt", dec)] {
                    match result {
                        Err(CryptoError::BufferLength {
                            len: l,
                            sector_size: s,
                        }) => {
                            assert_eq!((l, s), (len, sector_size), "{suite} {what}");
                        }
                        other => {
                            panic!("{suite} {what} of {len} bytes ({sector_size}): {other:?}")
                        }
                    }
                }
                assert_eq!(data, original, "{suite}: refused encrypt touched the data");
                assert_eq!(data2, original, "{suite}: refused decrypt touched the data");
            }
        }
    }
}

#[test]
fn metadata_of_wrong_length_is_refused() {
    for suite in Suite::ALL {
        let c = build(suite, 512);
        let md_len = suite.metadata_len();
        for sectors in 1..=3usize {
            let expected = sectors * md_len;
            let mut wrong = vec![expected + 1, expected + md_len + 16, 2 * expected + 1];
            if expected > 0 {
                wrong.extend([0, expected - 1, expected - md_len]);
            }
            for got in wrong {
                let original = vec![0x5a; sectors * 512];
                let mut data = original.clone();
                let mut md = vec![0u8; got];
                let enc = c.encrypt_sectors(9, &mut data, &mut md);
                assert_eq!(data, original, "{suite}: refused encrypt touched the data");
                assert!(
                    md.iter().all(|&b| b == 0),
                    "{suite}: refused encrypt wrote metadata"
                );
                let dec = c.decrypt_sectors(9, &mut data, &md);
                assert_eq!(data, original, "{suite}: refused decrypt touched the data");
                for (what, result) in [("encrypt", enc), ("decrypt", dec)] {
                    match result {
                        Err(e @ CryptoError::MetadataLength { .. }) => {
                            let CryptoError::MetadataLength {
                                suite: s,
                                sectors: n,
                                expected: x,
                                got: g,
                            } = e
                            else {
                                unreachable!()
                            };
                            assert_eq!((s, n, x, g), (suite, sectors, expected, got), "{what}");
                        }
                        other => panic!(
                            "{suite} {what}: {sectors} sectors with {got} metadata bytes: {other:?}"
                        ),
                    }
                }
            }
        }
    }
}

/// The last sector number the suites accept, per sector size: the last whose byte offset / 512
/// (the plain64 tweak) fits 64 bits.
const LAST_ALLOWED: [(usize, u64); 4] = [
    (512, u64::MAX),
    (1024, (1 << 63) - 1),
    (2048, (1 << 62) - 1),
    (4096, (1 << 61) - 1),
];

#[test]
fn sectors_past_the_last_addressable_one_are_refused() {
    for (sector_size, last_allowed) in LAST_ALLOWED {
        // The rule itself: last_allowed's offset / 512 fits 64 bits, the next sector's does not.
        let units = sector_size as u128 / 512;
        assert!(u128::from(last_allowed) * units <= u128::from(u64::MAX));
        assert!((u128::from(last_allowed) + 1) * units > u128::from(u64::MAX));

        // Runs reaching one sector past last_allowed, or past u64::MAX.
        let mut refused = vec![
            (last_allowed, 2usize),
            (last_allowed - 2, 4),
            (u64::MAX, 2),
            (u64::MAX - 1, 3),
            (u64::MAX, 4),
        ];
        if last_allowed < u64::MAX {
            refused.extend([
                (last_allowed + 1, 1),
                (last_allowed + 1, 3),
                // Where the plain64 tweak used to wrap onto sector 5's.
                (last_allowed + 6, 1),
                (u64::MAX, 1),
            ]);
        }

        for suite in Suite::ALL {
            let c = build(suite, sector_size);
            for &(first, count) in &refused {
                let mut data = vec![1u8; count * sector_size];
                let mut md = metadata_for(&*c, data.len());
                let before = c.writes_used();
                let enc = c.encrypt_sectors(first, &mut data, &mut md);
                assert_eq!(
                    c.writes_used(),
                    before,
                    "{suite}: refused run counted writes"
                );
                assert!(
                    data.iter().all(|&b| b == 1),
                    "{suite}: refused encrypt touched the data"
                );
                assert!(
                    md.iter().all(|&b| b == 0),
                    "{suite}: refused encrypt wrote metadata"
                );
                let dec = c.decrypt_sectors(first, &mut data, &md);
                assert!(
                    data.iter().all(|&b| b == 1),
                    "{suite}: refused decrypt touched the data"
                );
                for (what, result) in [("encrypt", enc), ("decrypt", dec)] {
                    let at =
                        format!("{suite} {what} of {count} {sector_size}-byte sectors at {first}");
                    match result {
                        Err(e @ CryptoError::SectorOverflow { .. }) => {
                            assert!(
                                e.to_string().contains(&last_allowed.to_string()),
                                "{at}: {e}"
                            );
                            let CryptoError::SectorOverflow {
                                first: f,
                                count: n,
                                last_allowed: l,
                            } = e
                            else {
                                unreachable!()
                            };
                            assert_eq!((f, n, l), (first, count, last_allowed), "{at}");
                        }
                        other => panic!("{at}: {other:?}"),
                    }
                }
            }
            // The last addressable sectors themselves are fine, alone and ending a run.
            assert_round_trip(&*c, last_allowed, 1);
            assert_round_trip(&*c, last_allowed - 1, 2);
            assert_round_trip(&*c, last_allowed - 3, 4);
        }
    }
}

#[test]
fn gcm_refuses_writes_past_its_limit() {
    let limit = GCM_RANDOM_NONCE_WRITE_LIMIT;
    assert_eq!(limit, 1 << 32);
    assert_eq!(Suite::AesGcmRandom.write_limit(), Some(limit));
    let key = random_key(32);
    let params = CipherParams {
        writes_used: limit - 2,
        ..CipherParams::new(512, IMAGE)
    };
    let c = new_cipher(Suite::AesGcmRandom, &key, &params).unwrap();
    assert_eq!(c.writes_used(), Some(limit - 2));

    let expect_exhausted = |result: Result<(), CryptoError>, used: u64, what: &str| match result {
        Err(e @ CryptoError::NonceBudgetExhausted { .. }) => {
            let CryptoError::NonceBudgetExhausted {
                suite,
                used: u,
                limit: l,
            } = e
            else {
                unreachable!()
            };
            assert_eq!((suite, u, l), (Suite::AesGcmRandom, used, limit), "{what}");
        }
        other => panic!("{what}: {other:?}"),
    };

    // A run of 3 sectors when 2 remain is refused whole; the counter does not move.
    let mut three = vec![3u8; 3 * 512];
    let mut md3 = vec![0u8; 3 * 32];
    expect_exhausted(
        c.encrypt_sectors(0, &mut three, &mut md3),
        limit - 2,
        "3 of 2",
    );
    assert_eq!(c.writes_used(), Some(limit - 2));
    assert!(
        three.iter().all(|&b| b == 3),
        "refused run touched the data"
    );
    assert!(md3.iter().all(|&b| b == 0), "refused run wrote metadata");

    // The last 2 writes work and use the budget up.
    let plain: Vec<u8> = (0..2 * 512).map(|i| i as u8).collect();
    let mut data = plain.clone();
    let mut md = vec![0u8; 2 * 32];
    c.encrypt_sectors(100, &mut data, &mut md).unwrap();
    assert_eq!(c.writes_used(), Some(limit));

    // Any further write is refused, even one sector.
    let mut one = vec![0u8; 512];
    let mut md1 = vec![0u8; 32];
    expect_exhausted(c.encrypt_sectors(5, &mut one, &mut md1), limit, "1 past");
    assert_eq!(c.writes_used(), Some(limit));

    // Reading is not limited: the last writes still decrypt.
    c.decrypt_sectors(100, &mut data, &md).unwrap();
    assert_eq!(data, plain);

    // A header already at or past the limit (or absurdly far past it) refuses the first write.
    for used in [limit, limit + 1, u64::MAX] {
        let params = CipherParams {
            writes_used: used,
            ..CipherParams::new(4096, IMAGE)
        };
        let c = new_cipher(Suite::AesGcmRandom, &key, &params).unwrap();
        let mut one = vec![0u8; 4096];
        let mut md1 = vec![0u8; 32];
        expect_exhausted(
            c.encrypt_sectors(0, &mut one, &mut md1),
            used,
            "from header",
        );
        assert_eq!(c.writes_used(), Some(used));
    }

    // The other suites have no limit and count nothing, whatever the header says.
    for suite in Suite::ALL.into_iter().filter(|&s| s != Suite::AesGcmRandom) {
        assert_eq!(suite.write_limit(), None, "{suite}");
        let params = CipherParams {
            writes_used: u64::MAX,
            ..CipherParams::new(512, IMAGE)
        };
        let c = new_cipher(suite, &random_key(suite.default_key_len()), &params).unwrap();
        assert_eq!(c.writes_used(), None, "{suite}");
        assert_round_trip(&*c, 0, 3);
        assert_eq!(c.writes_used(), None, "{suite}");
    }
}

#[test]
fn gcm_counts_every_sector_written() {
    let c = build(Suite::AesGcmRandom, 512);
    assert_eq!(c.writes_used(), Some(0));
    assert_round_trip(&*c, 0, 3);
    assert_round_trip(&*c, 10, 1);
    // Decrypts (inside assert_round_trip) count nothing.
    assert_eq!(c.writes_used(), Some(4));
}

/// Every 4-byte window of `key` as the text a careless `Debug` would print.
fn key_renderings(key: &[u8]) -> Vec<String> {
    let mut out = Vec::new();
    for w in key.windows(4) {
        out.push(hex::encode(w));
        out.push(hex::encode_upper(w));
        out.push(format!("{w:?}")[1..].trim_end_matches(']').to_owned()); // "17, 18, 19, 20"
        out.push(format!("{w:x?}")[1..].trim_end_matches(']').to_owned()); // "11, 12, 13, 14"
        out.push(format!("{w:#x?}")); // multi-line hex
        out.push(w.iter().map(|b| format!("\\x{b:02x}")).collect::<String>());
    }
    // The printable stretch 0x20..=0x50 as a byte string would show.
    for w in key.windows(6) {
        if w.iter().all(|b| (0x21..0x7f).contains(b)) {
            out.push(String::from_utf8(w.to_vec()).unwrap());
        }
    }
    out
}

#[test]
fn debug_output_never_shows_key_bytes() {
    let all: Vec<u8> = (0x11..=0x50).collect();
    assert_eq!(all.len(), 64);
    for suite in Suite::ALL {
        for &len in suite.key_lens() {
            let bytes = &all[..len];
            let key = VolumeKey::from_slice(bytes);
            let c = new_cipher(suite, &key, &CipherParams::new(512, IMAGE))
                .unwrap_or_else(|e| panic!("{suite}: {e}"));
            // The cipher in use (contexts warm) as well as fresh.
            assert_round_trip(&*c, 1, 1);
            let texts = [
                format!("{c:?}"),
                format!("{c:#?}"),
                format!("{key:?}"),
                format!("{key:#?}"),
            ];
            assert!(texts[0].contains("512"), "{}", texts[0]);
            assert!(texts[2].contains(&len.to_string()), "{}", texts[2]);
            for text in &texts {
                for shown in key_renderings(bytes) {
                    assert!(
                        !text.contains(&shown),
                        "{suite}: Debug output shows key bytes '{shown}': {text}"
                    );
                }
            }
        }
    }
    // Nor do the errors about a key.
    let key = VolumeKey::from_slice(&all[..20]);
    let err = new_cipher(Suite::AesGcmRandom, &key, &CipherParams::new(512, IMAGE)).unwrap_err();
    for text in [format!("{err:?}"), err.to_string()] {
        for shown in key_renderings(&all[..20]) {
            assert!(!text.contains(&shown), "error shows key bytes: {text}");
        }
    }
}

#[test]
fn wrong_key_fails_every_sector() {
    for suite in Suite::ALL {
        let right = build_with(suite, &random_key(suite.default_key_len()));
        let wrong = build_with(suite, &random_key(suite.default_key_len()));
        let mut plain = vec![0u8; 3 * 512];
        ivdisk_crypto::fill_random(&mut plain).unwrap();
        let mut data = plain.clone();
        let mut md = metadata_for(&*right, data.len());
        right.encrypt_sectors(100, &mut data, &mut md).unwrap();
        let result = wrong.decrypt_sectors(100, &mut data, &md);
        if suite.is_authenticated() {
            match result {
                Err(e @ CryptoError::Authentication { .. }) => {
                    assert!(
                        matches!(&e, CryptoError::Authentication { sectors } if sectors == &[100, 101, 102]),
                        "{suite}: {e:?}"
                    );
                    assert!(e.to_string().contains("3 sector"), "{e}");
                }
                other => panic!("{suite} with the wrong key: {other:?}"),
            }
            assert!(
                data.iter().all(|&b| b == 0),
                "{suite}: failed sectors not zeroed"
            );
        } else {
            // No integrity: the wrong key gives garbage, undetected.
            assert!(result.is_ok(), "{suite}: {result:?}");
            for (i, (got, want)) in data.chunks(512).zip(plain.chunks(512)).enumerate() {
                assert_ne!(
                    got, want,
                    "{suite}: sector {i} decrypted under the wrong key"
                );
            }
        }
    }
}

fn build_with(suite: Suite, key: &VolumeKey) -> Box<dyn SectorCipher> {
    new_cipher(suite, key, &CipherParams::new(512, IMAGE)).unwrap()
}

#[test]
fn errors_are_std_errors() {
    fn assert_error<E: std::error::Error + Send + Sync + 'static>(_: &E) {}
    let err = "nope".parse::<Suite>().unwrap_err();
    assert_error(&err);
    // Into the usual boxed error, and back down to the typed one.
    let boxed: Box<dyn std::error::Error + Send + Sync> = Box::new(err);
    assert!(matches!(
        boxed.downcast_ref::<CryptoError>(),
        Some(CryptoError::UnknownSuite { .. })
    ));
}

/// The slot paths at the last addressable sectors (512-byte sectors end at u64::MAX): every
/// suite encrypts and decrypts a run of two ending there. The one-by-one helpers numbered
/// sectors by zipping with `first_sector..`, which steps once past the last and panicked on
/// the overflow where overflow checks are on (debug and test builds).
#[test]
fn slots_at_the_last_sectors_round_trip() {
    // 4 and 8 sectors: runs the four-lane kernels seal whole (none left for one at a time).
    for count in [2usize, 4, 8] {
        for suite in Suite::ALL {
            let c = build(suite, 512);
            let first = u64::MAX - (count as u64 - 1);
            let plain: Vec<u8> = (0..512 * count as u32).map(|i| (i % 251) as u8).collect();
            let mut slots = Vec::new();
            c.encrypt_sectors_append_slots(first, &plain, &mut slots)
                .unwrap();
            let mut again = slots.clone();
            c.decrypt_sectors_in_slots(first, &mut again).unwrap();
            let slot = 512 + c.metadata_len();
            for (i, s) in again.chunks(slot).enumerate() {
                assert!(
                    s[..512] == plain[i * 512..(i + 1) * 512],
                    "{suite}, {count} sectors: sector {i}"
                );
            }
            let mut inplace = Vec::with_capacity(slots.len());
            for i in 0..count {
                inplace.extend_from_slice(&plain[i * 512..(i + 1) * 512]);
                inplace.extend(std::iter::repeat_n(0u8, c.metadata_len()));
            }
            c.encrypt_sectors_in_slots(first, &mut inplace).unwrap();
            c.decrypt_sectors_in_slots(first, &mut inplace).unwrap();
            let mut to = vec![0u8; slots.len()];
            c.encrypt_sectors_to_slots(first, &plain, &mut to).unwrap();
            c.decrypt_sectors_in_slots(first, &mut to).unwrap();
            for run in [&inplace, &to] {
                for (i, s) in run.chunks(slot).enumerate() {
                    assert!(
                        s[..512] == plain[i * 512..(i + 1) * 512],
                        "{suite}, {count} sectors: sector {i}"
                    );
                }
            }
        }
    }
}

/// A slotted run of the wrong length says what length it should have (a slot per sector,
/// each sector and its metadata): it said "output buffer of 4096 bytes for an input of 4096
/// bytes: expected the same length" for slots with no room for the metadata.
#[test]
fn slots_of_the_wrong_length_name_the_length_they_need() {
    for suite in Suite::ALL.into_iter().filter(|s| s.metadata_len() > 0) {
        let c = build(suite, 4096);
        let slot = 4096 + c.metadata_len();
        let mut slots = vec![0u8; 4096];
        match c.encrypt_sectors_to_slots(0, &[0u8; 4096], &mut slots) {
            Err(CryptoError::SlotsLength {
                got: 4096,
                expected,
                slot: s,
            }) if expected == slot && s == slot => {}
            other => panic!("{suite}: {other:?}"),
        }
        let refused = c.decrypt_sectors_in_slots(0, &mut slots).unwrap_err();
        let text = refused.to_string();
        assert!(
            text.contains(&format!("expected {slot} bytes")) && !text.contains("same length"),
            "{suite}: {text}"
        );
    }
}
