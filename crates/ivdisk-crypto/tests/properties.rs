//! Property tests over every suite in `Suite::ALL`, with 512- to 4096-byte sectors: round
//! trips, tamper and move detection of the AEAD suites, nonce freshness of the randomized
//! suites, the determinism (and its leak) of the plain64 suites, and HCTR2's wide-block
//! diffusion against XTS's 16-byte locality.
//!
//! Every case loops over all suites, all their key lengths and all sector sizes, so each
//! combination sees every generated case. Keys, image ids and plaintexts follow from one
//! generated seed (SplitMix64), which keeps cases cheap to generate and failures replayable.
//! Sector numbers are generated as a [`Place`] and resolved per sector size into the valid
//! range (the last sector of a run at most [`last_allowed`]), so every size sees its own top
//! edge. Runs past it are refused: see `sectors_past_the_last_addressable_one_are_refused` in
//! `bad_input.rs`.

use ivdisk_crypto::{
    insecure_cipher_with_sector_number_nonces, new_cipher, CipherParams, CryptoError, ImageId,
    SectorCipher, Suite, VolumeKey,
};
use proptest::prelude::*;
use proptest::sample::Index;

const SECTOR_SIZES: [usize; 4] = [512, 1024, 2048, 4096];
const BLOCK: usize = 16;

/// `len` pseudo-random bytes from `seed` (SplitMix64).
fn bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut state = seed;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        out.extend_from_slice(&(z ^ (z >> 31)).to_le_bytes());
    }
    out.truncate(len);
    out
}

/// One combination a property runs over.
#[derive(Debug, Clone, Copy)]
struct Config {
    suite: Suite,
    key_len: usize,
    sector_size: usize,
}

/// Every suite with every key length it accepts, at every sector size.
fn configs() -> impl Iterator<Item = Config> {
    Suite::ALL.into_iter().flat_map(|suite| {
        suite.key_lens().iter().flat_map(move |&key_len| {
            SECTOR_SIZES.into_iter().map(move |sector_size| Config {
                suite,
                key_len,
                sector_size,
            })
        })
    })
}

fn key(config: Config, seed: u64) -> VolumeKey {
    VolumeKey::new(bytes(seed ^ 0x006b_6579, config.key_len))
}

fn image_id(seed: u64) -> ImageId {
    ImageId(bytes(seed ^ 0x1d, 16).try_into().unwrap())
}

fn cipher(config: Config, key: &VolumeKey, image: ImageId) -> Box<dyn SectorCipher> {
    new_cipher(
        config.suite,
        key,
        &CipherParams::new(config.sector_size, image),
    )
    .unwrap_or_else(|e| panic!("{config:?}: building the cipher failed: {e}"))
}

fn encrypt(c: &dyn SectorCipher, first: u64, plain: &[u8]) -> (Vec<u8>, Vec<u8>) {
    let mut data = plain.to_vec();
    let mut metadata = vec![0u8; plain.len() / c.sector_size() * c.metadata_len()];
    c.encrypt_sectors(first, &mut data, &mut metadata)
        .unwrap_or_else(|e| panic!("{:?}: encrypt at {first} failed: {e}", c.suite()));
    (data, metadata)
}

fn decrypt(
    c: &dyn SectorCipher,
    first: u64,
    ciphertext: &[u8],
    metadata: &[u8],
) -> (Vec<u8>, Result<(), CryptoError>) {
    let mut data = ciphertext.to_vec();
    let result = c.decrypt_sectors(first, &mut data, metadata);
    (data, result)
}

fn is_plain64(suite: Suite) -> bool {
    matches!(suite, Suite::AesXtsPlain64 | Suite::AesHctr2Plain64)
}

/// The last sector number the suites accept with `sector_size`-byte sectors: the last whose
/// byte offset / 512 (the plain64 tweak) is below 2^64. u64::MAX for 512-byte sectors,
/// 2^63 - 1, 2^62 - 1 and 2^61 - 1 for 1024-, 2048- and 4096-byte ones.
fn last_allowed(sector_size: usize) -> u64 {
    ((1u128 << 64) / (sector_size as u128 / 512) - 1) as u64
}

/// Where a generated run lies. The valid range depends on the sector size, so a place is
/// resolved per configuration by [`Place::first`].
#[derive(Debug, Clone, Copy)]
enum Place {
    /// This sector number, or the last valid start of the run if it lies beyond.
    At(u64),
    /// Anywhere in the valid range: the value modulo the number of valid starts.
    Anywhere(u64),
    /// This many sectors below the last valid start: the run ends that close to the top.
    BelowTop(u64),
}

impl Place {
    /// The first sector of a run of `count` sectors of `sector_size` bytes at this place;
    /// the run's last sector is at most `last_allowed(sector_size)`.
    fn first(self, sector_size: usize, count: usize) -> u64 {
        let max_first = last_allowed(sector_size) - (count as u64 - 1);
        match self {
            Place::At(s) => s.min(max_first),
            Place::Anywhere(r) => max_first.checked_add(1).map_or(r, |starts| r % starts),
            Place::BelowTop(k) => max_first - k.min(max_first),
        }
    }
}

/// Sector numbers: small, anywhere, at the top of each sector size's valid range, next to
/// 2^32, and next to 2^61, 2^62 and 2^63, one past the last valid sector of 4096-, 2048- and
/// 1024-byte sectors (where the plain64 tweak used to wrap), well inside the range of the
/// smaller sizes.
fn place() -> impl Strategy<Value = Place> {
    prop_oneof![
        1 => (0u64..4096).prop_map(Place::At),
        1 => any::<u64>().prop_map(Place::Anywhere),
        2 => (0u64..16).prop_map(Place::BelowTop),
        1 => ((1u64 << 32) - 8..(1u64 << 32) + 8).prop_map(Place::At),
        1 => ((1u64 << 61) - 8..(1u64 << 61) + 8).prop_map(Place::At),
        1 => ((1u64 << 62) - 8..(1u64 << 62) + 8).prop_map(Place::At),
        1 => ((1u64 << 63) - 8..(1u64 << 63) + 8).prop_map(Place::At),
    ]
}

/// A run of 1..=`max` sectors: (place, count, seed); `place.first(sector_size, count)` gives
/// its first sector.
fn run(max: usize) -> impl Strategy<Value = (Place, usize, u64)> {
    (place(), 1..=max, any::<u64>())
}

fn sector(buf: &[u8], sector_size: usize, i: usize) -> &[u8] {
    &buf[i * sector_size..][..sector_size]
}

fn differing_blocks(a: &[u8], b: &[u8]) -> Vec<usize> {
    a.chunks(BLOCK)
        .zip(b.chunks(BLOCK))
        .enumerate()
        .filter(|(_, (x, y))| x != y)
        .map(|(i, _)| i)
        .collect()
}

fn flip_bit(buf: &mut [u8], bit: usize) {
    buf[bit / 8] ^= 1 << (bit % 8);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    /// decrypt(encrypt(x)) == x, with exactly `sectors * metadata_len` bytes of metadata.
    #[test]
    fn round_trip((place, count, seed) in run(4)) {
        for config in configs() {
            let ss = config.sector_size;
            let first = place.first(ss, count);
            let c = cipher(config, &key(config, seed), image_id(seed));
            prop_assert_eq!(c.suite(), config.suite);
            prop_assert_eq!(c.sector_size(), ss);
            prop_assert_eq!(c.metadata_len(), config.suite.metadata_len());

            let plain = bytes(seed, count * ss);
            let (ct, md) = encrypt(&*c, first, &plain);
            prop_assert_eq!(md.len(), count * config.suite.metadata_len());
            for i in 0..count {
                prop_assert_ne!(sector(&ct, ss, i), sector(&plain, ss, i), "{:?}: sector {} not encrypted", config, i);
            }
            if config.suite.is_randomized() {
                prop_assert!(md.iter().any(|&b| b != 0), "{:?}: metadata left empty", config);
            }
            // The metadata buffer must be exactly that long: one byte more is refused.
            let mut data = plain.clone();
            let mut longer = vec![0u8; md.len() + 1];
            match c.encrypt_sectors(first, &mut data, &mut longer) {
                Err(CryptoError::MetadataLength { expected, got, sectors, .. }) => {
                    prop_assert_eq!(expected, md.len());
                    prop_assert_eq!(got, md.len() + 1);
                    prop_assert_eq!(sectors, count);
                }
                other => prop_assert!(false, "{:?}: metadata of {} bytes: {:?}", config, md.len() + 1, other),
            }

            let (back, result) = decrypt(&*c, first, &ct, &md);
            prop_assert!(result.is_ok(), "{:?}: decrypt at {}: {:?}", config, first, result);
            prop_assert!(back == plain, "{:?}: round trip at {} changed the data", config, first);
        }
    }

    /// AEAD suites: one flipped bit in the ciphertext or metadata of one sector fails exactly
    /// that sector (zeroed); the others of the run decrypt. The other suites detect nothing,
    /// but the damage stays in that sector.
    #[test]
    fn one_flipped_bit((place, count, seed) in run(4), victim in any::<Index>(), bit in any::<Index>(), metadata in any::<bool>()) {
        for config in configs() {
            let ss = config.sector_size;
            let first = place.first(ss, count);
            let md_len = config.suite.metadata_len();
            let c = cipher(config, &key(config, seed), image_id(seed));
            let plain = bytes(seed, count * ss);
            let (mut ct, mut md) = encrypt(&*c, first, &plain);

            let v = victim.index(count);
            // Half the cases hit the (much smaller) metadata, where there is any.
            let in_metadata = metadata && md_len > 0;
            let bit = if in_metadata {
                let bit = bit.index(md_len * 8);
                flip_bit(&mut md[v * md_len..][..md_len], bit);
                bit
            } else {
                let bit = bit.index(ss * 8);
                flip_bit(&mut ct[v * ss..][..ss], bit);
                bit
            };
            let (back, result) = decrypt(&*c, first, &ct, &md);
            let victim_sector = first + v as u64;
            if config.suite.is_authenticated() {
                match result {
                    Err(CryptoError::Authentication { sectors }) => prop_assert_eq!(
                        sectors, vec![victim_sector],
                        "{:?}: bit {} (metadata: {}) of sector {}", config, bit, in_metadata, victim_sector
                    ),
                    other => prop_assert!(false, "{:?}: bit {} (metadata: {}) of sector {}: {:?}", config, bit, in_metadata, victim_sector, other),
                }
                prop_assert!(sector(&back, ss, v).iter().all(|&b| b == 0), "{:?}: failed sector not zeroed", config);
            } else {
                prop_assert!(result.is_ok(), "{:?}: {:?}", config, result);
                prop_assert_ne!(sector(&back, ss, v), sector(&plain, ss, v), "{:?}: flipped bit had no effect", config);
            }
            for i in (0..count).filter(|&i| i != v) {
                prop_assert_eq!(sector(&back, ss, i), sector(&plain, ss, i), "{:?}: untouched sector {} of the run", config, i);
            }
        }
    }

    /// Randomized suites: the same plaintext written twice to the same sector shares no
    /// 16-byte block at the same position, and gets different metadata.
    #[test]
    fn randomized_suites_never_repeat((place, count, seed) in run(4)) {
        for config in configs().filter(|c| c.suite.is_randomized()) {
            let ss = config.sector_size;
            let first = place.first(ss, count);
            let md_len = config.suite.metadata_len();
            let c = cipher(config, &key(config, seed), image_id(seed));
            let plain = bytes(seed, count * ss);
            let (ct1, md1) = encrypt(&*c, first, &plain);
            let (ct2, md2) = encrypt(&*c, first, &plain);
            let same: Vec<usize> = ct1.chunks(BLOCK).zip(ct2.chunks(BLOCK)).enumerate()
                .filter(|(_, (a, b))| a == b).map(|(i, _)| i).collect();
            prop_assert!(same.is_empty(), "{:?}: equal ciphertext blocks at {:?}", config, same);
            for i in 0..count {
                prop_assert_ne!(&md1[i * md_len..][..md_len], &md2[i * md_len..][..md_len], "{:?}: metadata of sector {} repeated", config, i);
            }
            // Both writes stay readable.
            prop_assert!(decrypt(&*c, first, &ct1, &md1).0 == plain);
            prop_assert!(decrypt(&*c, first, &ct2, &md2).0 == plain);
        }
    }

    /// Deterministic suites: the same plaintext at the same sector gives the same ciphertext
    /// (the leak these suites accept), while at any two different valid sectors it gives
    /// different ones (no two valid sector numbers share a plain64 tweak).
    #[test]
    fn deterministic_suites_depend_on_sector_only((place, count, seed) in run(4), other in place()) {
        for config in configs().filter(|c| !c.suite.is_randomized()) {
            prop_assert!(is_plain64(config.suite));
            let ss = config.sector_size;
            let first = place.first(ss, count);
            let other = other.first(ss, count);
            let c = cipher(config, &key(config, seed), image_id(seed));
            // One sector's plaintext repeated over the run: every sector holds the same data.
            let plain = bytes(seed, ss).repeat(count);
            let (ct1, md1) = encrypt(&*c, first, &plain);
            let (ct2, _) = encrypt(&*c, first, &plain);
            prop_assert!(md1.is_empty());
            prop_assert!(ct1 == ct2, "{:?}: rewrite at {} changed the ciphertext", config, first);

            let (ct3, _) = encrypt(&*c, other, &plain);
            let numbered = (0..count).map(|i| (first + i as u64, sector(&ct1, ss, i)))
                .chain((0..count).map(|i| (other + i as u64, sector(&ct3, ss, i))));
            let numbered: Vec<(u64, &[u8])> = numbered.collect();
            for (x, &(sx, cx)) in numbered.iter().enumerate() {
                for &(sy, cy) in &numbered[x + 1..] {
                    if sx == sy {
                        prop_assert_eq!(cx, cy, "{:?}: sector {} encrypted twice", config, sx);
                    } else {
                        let same = cx.chunks(BLOCK).zip(cy.chunks(BLOCK)).filter(|(a, b)| a == b).count();
                        prop_assert_eq!(same, 0, "{:?}: sectors {} and {} share ciphertext blocks", config, sx, sy);
                    }
                }
            }
        }
    }

    /// A sector's (ciphertext, metadata) read back at another sector number, or into another
    /// image (same key, other image id), does not give the plaintext; AEAD suites refuse it.
    /// Also two sectors of a run swapped.
    #[test]
    fn moved_sectors_do_not_decrypt((place, count, seed) in run(4), victim in any::<Index>(), target in place(), image_bit in 0usize..128) {
        for config in configs() {
            let ss = config.sector_size;
            let first = place.first(ss, count);
            let md_len = config.suite.metadata_len();
            let key = key(config, seed);
            let image = image_id(seed);
            let c = cipher(config, &key, image);
            let plain = bytes(seed, count * ss);
            let (ct, md) = encrypt(&*c, first, &plain);
            let v = victim.index(count);
            let source = first + v as u64;
            let one_ct = sector(&ct, ss, v);
            let one_md = &md[v * md_len..][..md_len];
            let one_plain = sector(&plain, ss, v);

            // Another valid place in the same image.
            let target = match target.first(ss, 1) {
                t if t != source => t,
                _ if source < last_allowed(ss) => source + 1,
                _ => source - 1,
            };
            let (back, result) = decrypt(&*c, target, one_ct, one_md);
            if config.suite.is_authenticated() {
                match result {
                    Err(CryptoError::Authentication { sectors }) => prop_assert_eq!(sectors, vec![target]),
                    other => prop_assert!(false, "{:?}: sector {} read as {}: {:?}", config, source, target, other),
                }
                prop_assert!(back.iter().all(|&b| b == 0));
            } else {
                prop_assert!(result.is_ok(), "{:?}: {:?}", config, result);
                prop_assert_ne!(&back[..], one_plain, "{:?}: sector {} read as {} gave the plaintext", config, source, target);
            }

            // The same place in another image: same key, image id differing in one bit.
            let mut other_image = image;
            other_image.0[image_bit / 8] ^= 1 << (image_bit % 8);
            let foreign = cipher(config, &key, other_image);
            let (back, result) = decrypt(&*foreign, source, one_ct, one_md);
            if config.suite.is_authenticated() {
                match result {
                    Err(CryptoError::Authentication { sectors }) => prop_assert_eq!(sectors, vec![source]),
                    other => prop_assert!(false, "{:?}: sector {} in another image: {:?}", config, source, other),
                }
                prop_assert!(back.iter().all(|&b| b == 0));
            } else if config.suite == Suite::AesXtsRandom {
                prop_assert!(result.is_ok(), "{:?}: {:?}", config, result);
                prop_assert_ne!(&back[..], one_plain, "{:?}: sector {} decrypted in another image", config, source);
            } else {
                // Documents: the plain64 suites do not bind the image (LUKS2 compatible).
                prop_assert!(is_plain64(config.suite));
                prop_assert_eq!(&back[..], one_plain);
            }

            // Two sectors of the run swapped, with their metadata.
            if count >= 2 {
                let (a, b) = (v, (v + 1) % count);
                let (mut ct_swapped, mut md_swapped) = (ct.clone(), md.clone());
                ct_swapped[a * ss..][..ss].copy_from_slice(sector(&ct, ss, b));
                ct_swapped[b * ss..][..ss].copy_from_slice(sector(&ct, ss, a));
                md_swapped[a * md_len..][..md_len].copy_from_slice(&md[b * md_len..][..md_len]);
                md_swapped[b * md_len..][..md_len].copy_from_slice(&md[a * md_len..][..md_len]);
                let (back, result) = decrypt(&*c, first, &ct_swapped, &md_swapped);
                if config.suite.is_authenticated() {
                    let mut expected = vec![first + a as u64, first + b as u64];
                    expected.sort_unstable();
                    match result {
                        Err(CryptoError::Authentication { sectors }) => prop_assert_eq!(sectors, expected),
                        other => prop_assert!(false, "{:?}: swapped sectors: {:?}", config, other),
                    }
                } else {
                    prop_assert!(result.is_ok());
                }
                for i in 0..count {
                    if i == a || i == b {
                        prop_assert_ne!(sector(&back, ss, i), sector(&plain, ss, i), "{:?}: swapped sector {}", config, i);
                    } else {
                        prop_assert_eq!(sector(&back, ss, i), sector(&plain, ss, i));
                    }
                }
            }
        }
    }

    /// aes-hctr2-plain64 is a wide-block cipher: one flipped ciphertext bit garbles (nearly)
    /// every 16-byte block of the sector. XTS, for contrast, garbles exactly the one block.
    #[test]
    fn hctr2_garbles_the_sector_xts_one_block((place, count, seed) in run(4), victim in any::<Index>(), bit in any::<Index>()) {
        for config in configs().filter(|c| matches!(c.suite, Suite::AesHctr2Plain64 | Suite::AesXtsPlain64 | Suite::AesXtsRandom)) {
            let ss = config.sector_size;
            let first = place.first(ss, count);
            let c = cipher(config, &key(config, seed), image_id(seed));
            let plain = bytes(seed, count * ss);
            let (mut ct, md) = encrypt(&*c, first, &plain);
            let v = victim.index(count);
            let bit = bit.index(ss * 8);
            flip_bit(&mut ct[v * ss..][..ss], bit);
            let (back, result) = decrypt(&*c, first, &ct, &md);
            prop_assert!(result.is_ok());
            let differing = differing_blocks(sector(&back, ss, v), sector(&plain, ss, v));
            if config.suite == Suite::AesHctr2Plain64 {
                let blocks = ss / BLOCK;
                prop_assert!(
                    differing.len() * 10 >= blocks * 9,
                    "{:?}: bit {} changed only {} of {} blocks", config, bit, differing.len(), blocks
                );
            } else {
                prop_assert_eq!(differing, vec![bit / 128], "{:?}: bit {}", config, bit);
            }
            for i in (0..count).filter(|&i| i != v) {
                prop_assert_eq!(sector(&back, ss, i), sector(&plain, ss, i));
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(12))]

    /// A run is its sectors: runs longer than the four-sector groups of the four-lane AEGIS-128L
    /// engine and the eight-sector tweak batches of aes-xts-random (with remainders) decrypt
    /// sector by sector, single-sector writes decrypt as one run, and the deterministic suites
    /// give the same ciphertext either way.
    #[test]
    fn runs_are_their_sectors((place, count, seed) in run(40)) {
        for config in configs() {
            let ss = config.sector_size;
            let first = place.first(ss, count);
            let md_len = config.suite.metadata_len();
            let c = cipher(config, &key(config, seed), image_id(seed));
            let plain = bytes(seed, count * ss);
            let (ct, md) = encrypt(&*c, first, &plain);
            let mut single_ct = Vec::with_capacity(ct.len());
            let mut single_md = Vec::with_capacity(md.len());
            for i in 0..count {
                let s = first + i as u64;
                let (back, result) = decrypt(&*c, s, sector(&ct, ss, i), &md[i * md_len..][..md_len]);
                prop_assert!(result.is_ok(), "{:?}: sector {} of a run of {}: {:?}", config, i, count, result);
                prop_assert_eq!(&back[..], sector(&plain, ss, i), "{:?}: sector {} of a run of {}", config, i, count);
                let (one_ct, one_md) = encrypt(&*c, s, sector(&plain, ss, i));
                single_ct.extend_from_slice(&one_ct);
                single_md.extend_from_slice(&one_md);
            }
            if !config.suite.is_randomized() {
                prop_assert!(single_ct == ct, "{:?}: a run of {} differs from its sectors", config, count);
            }
            let (back, result) = decrypt(&*c, first, &single_ct, &single_md);
            prop_assert!(result.is_ok(), "{:?}: {:?}", config, result);
            prop_assert!(back == plain, "{:?}: single-sector writes read as a run of {}", config, count);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(12))]

    /// Out of place is in place without the copy: with nonces fixed per sector (the insecure
    /// test-only cipher, so the two can be compared byte for byte) `encrypt_sectors_to` gives
    /// exactly `encrypt_sectors`' ciphertext and metadata, for runs with and without four-sector
    /// groups; `decrypt_sectors_to` gives the plaintext and leaves its input alone; a tampered
    /// sector fails alone, zeroed in the output; an output of another length is refused.
    #[test]
    fn out_of_place_equals_in_place((place, count, seed) in run(11), victim in any::<Index>()) {
        for config in configs() {
            let ss = config.sector_size;
            let first = place.first(ss, count);
            let params = CipherParams::new(ss, image_id(seed));
            let c = insecure_cipher_with_sector_number_nonces(config.suite, &key(config, seed), &params).unwrap();
            let plain = bytes(seed, count * ss);
            let (ct, md) = encrypt(&*c, first, &plain);
            let mut ct2 = vec![0xeeu8; plain.len()];
            let mut md2 = vec![0u8; md.len()];
            c.encrypt_sectors_to(first, &plain, &mut ct2, &mut md2).unwrap();
            prop_assert!(ct2 == ct && md2 == md, "{:?}: out-of-place encryption of {} sectors differs", config, count);

            // Appended to a buffer that already holds bytes, with spare capacity (what the
            // image layer hands over): the same ciphertext after the old bytes.
            let mut appended = Vec::with_capacity(3 + plain.len() + 100);
            appended.extend_from_slice(b"old");
            let mut md3 = vec![0u8; md.len()];
            c.encrypt_sectors_append(first, &plain, &mut appended, &mut md3).unwrap();
            prop_assert!(&appended[..3] == b"old" && appended[3..] == ct[..] && md3 == md, "{:?}: appended encryption of {} sectors differs", config, count);
            let mut one_too_many = vec![0u8; md.len() + 1];
            let refused = c.encrypt_sectors_append(first, &plain, &mut appended, &mut one_too_many);
            prop_assert!(matches!(refused, Err(CryptoError::MetadataLength { .. })), "{:?}: {:?}", config, refused);
            prop_assert_eq!(appended.len(), 3 + plain.len(), "{:?}: a refused append changed the buffer", config);

            let mut back = vec![0x11u8; plain.len()];
            c.decrypt_sectors_to(first, &ct, &mut back, &md).unwrap();
            prop_assert!(back == plain, "{:?}: out-of-place decryption of {} sectors", config, count);

            let mut short = vec![0u8; plain.len() - 1];
            let refused = c.encrypt_sectors_to(first, &plain, &mut short, &mut md2);
            prop_assert!(matches!(refused, Err(CryptoError::OutputLength { .. })), "{:?}: {:?}", config, refused);
            let refused = c.decrypt_sectors_to(first, &ct, &mut short, &md);
            prop_assert!(matches!(refused, Err(CryptoError::OutputLength { .. })), "{:?}: {:?}", config, refused);

            if config.suite.is_authenticated() {
                let v = victim.index(count);
                let mut tampered = ct.clone();
                tampered[v * ss + ss / 2] ^= 1;
                let mut out = vec![0x11u8; plain.len()];
                let result = c.decrypt_sectors_to(first, &tampered, &mut out, &md);
                match result {
                    Err(CryptoError::Authentication { sectors }) => prop_assert_eq!(sectors, vec![first + v as u64]),
                    other => prop_assert!(false, "{:?}: tampered sector {}: {:?}", config, v, other),
                }
                for i in 0..count {
                    let expect: &[u8] = if i == v { &[0u8; 4096][..ss] } else { sector(&plain, ss, i) };
                    prop_assert_eq!(sector(&out, ss, i), expect, "{:?}: sector {} after tampering {}", config, i, v);
                }
            }
        }
        // The real (random-nonce) ciphers too: round trip out of place.
        for config in configs() {
            let ss = config.sector_size;
            let first = place.first(ss, count);
            let c = cipher(config, &key(config, seed), image_id(seed));
            let plain = bytes(seed ^ 5, count * ss);
            let mut ct = vec![0u8; plain.len()];
            let mut md = vec![0u8; count * c.metadata_len()];
            c.encrypt_sectors_to(first, &plain, &mut ct, &mut md).unwrap();
            let (back, result) = decrypt(&*c, first, &ct, &md);
            prop_assert!(result.is_ok() && back == plain, "{:?}: {:?}", config, result);
        }
    }
}

/// Appending runs longer than one step of the zeroing fallback (64 KiB) and than the
/// four-lane groups, at both ends of the sector sizes: byte for byte what `encrypt_sectors`
/// gives, for every suite, onto an empty buffer and onto one that must grow.
#[test]
fn long_appended_runs_equal_in_place() {
    for config in configs().filter(|c| c.sector_size == 512 || c.sector_size == 4096) {
        let ss = config.sector_size;
        for count in [1, 3, 4, 17, 131, 303]
            .into_iter()
            .filter(|n| n * ss <= 600 << 10)
        {
            let seed = (count * ss) as u64;
            let params = CipherParams::new(ss, image_id(seed));
            let c = insecure_cipher_with_sector_number_nonces(
                config.suite,
                &key(config, seed),
                &params,
            )
            .unwrap();
            let plain = bytes(seed, count * ss);
            let (ct, md) = encrypt(&*c, 77, &plain);
            for mut out in [Vec::new(), vec![9u8; 5]] {
                let before = out.clone();
                let mut md2 = vec![0u8; md.len()];
                c.encrypt_sectors_append(77, &plain, &mut out, &mut md2)
                    .unwrap();
                assert!(
                    out[..before.len()] == before[..] && out[before.len()..] == ct[..] && md2 == md,
                    "{config:?}: {count} sectors appended after {} bytes differ",
                    before.len()
                );
            }
            // As slots (each sector's ciphertext, then its metadata): the same bytes
            // interleaved, after what the buffer held; a refused run leaves it alone.
            let ml = c.metadata_len();
            let slots: Vec<u8> = (0..count)
                .flat_map(|i| ct[i * ss..][..ss].iter().chain(&md[i * ml..][..ml]))
                .copied()
                .collect();
            for mut out in [Vec::new(), vec![9u8; 5]] {
                let before = out.clone();
                c.encrypt_sectors_append_slots(77, &plain, &mut out)
                    .unwrap();
                assert!(
                    out[..before.len()] == before[..] && out[before.len()..] == slots[..],
                    "{config:?}: {count} sectors appended as slots after {} bytes differ",
                    before.len()
                );
                let len = out.len();
                let refused = c.encrypt_sectors_append_slots(77, &plain[1..], &mut out);
                assert!(
                    matches!(refused, Err(CryptoError::BufferLength { .. })),
                    "{config:?}: {refused:?}"
                );
                assert_eq!(
                    out.len(),
                    len,
                    "{config:?}: a refused run changed the buffer"
                );
            }
            // Into slots the caller has (`encrypt_sectors_to_slots`): the same bytes over
            // what the buffer held; a buffer of another length is refused.
            let mut over = vec![0x5au8; slots.len()];
            c.encrypt_sectors_to_slots(77, &plain, &mut over).unwrap();
            assert!(
                over == slots,
                "{config:?}: {count} sectors encrypted into slots differ"
            );
            let refused = c.encrypt_sectors_to_slots(77, &plain, &mut over[1..]);
            assert!(
                matches!(refused, Err(CryptoError::SlotsLength { .. })),
                "{config:?}: {refused:?}"
            );
            // And back from slots; a tampered slot fails alone and reads as zeros.
            let mut back = vec![0x11u8; plain.len()];
            c.decrypt_sectors_from_slots(77, &slots, &mut back).unwrap();
            assert!(
                back == plain,
                "{config:?}: {count} sectors back from slots differ"
            );
            let refused = c.decrypt_sectors_from_slots(77, &slots[1..], &mut back);
            assert!(
                matches!(refused, Err(CryptoError::SlotsLength { .. })),
                "{config:?}: {refused:?}"
            );
            // In place in the slots: each sector's plaintext where its ciphertext was, its
            // metadata left as it was; a run of another length is refused.
            let mut in_slots = slots.clone();
            c.decrypt_sectors_in_slots(77, &mut in_slots).unwrap();
            let expected_in_slots: Vec<u8> = (0..count)
                .flat_map(|i| plain[i * ss..][..ss].iter().chain(&md[i * ml..][..ml]))
                .copied()
                .collect();
            assert!(
                in_slots == expected_in_slots,
                "{config:?}: {count} sectors decrypted in their slots differ"
            );
            let mut short = slots[1..].to_vec();
            let refused = c.decrypt_sectors_in_slots(77, &mut short);
            assert!(
                matches!(refused, Err(CryptoError::SlotsLength { .. })),
                "{config:?}: {refused:?}"
            );
            // Encrypted in place in slots (`encrypt_sectors_in_slots`): each sector's
            // plaintext at the start of its slot and anything in the slot's tail give the same
            // slots; a run of another length is refused and left as it was.
            let mut received: Vec<u8> = (0..count)
                .flat_map(|i| {
                    let tail = std::iter::repeat_n(0xa5u8, ml);
                    plain[i * ss..][..ss].iter().copied().chain(tail)
                })
                .collect();
            c.encrypt_sectors_in_slots(77, &mut received).unwrap();
            assert!(
                received == slots,
                "{config:?}: {count} sectors encrypted in their slots differ"
            );
            let mut short = received[1..].to_vec();
            let before = short.clone();
            let refused = c.encrypt_sectors_in_slots(77, &mut short);
            assert!(
                matches!(
                    refused,
                    Err(CryptoError::SlotsLength { .. } | CryptoError::BufferLength { .. })
                ),
                "{config:?}: {refused:?}"
            );
            assert!(
                short == before,
                "{config:?}: a refused run changed the slots"
            );
            // Appended from slots: the same plaintext after what the buffer held; a refused
            // run leaves it alone.
            for mut out in [Vec::new(), vec![9u8; 5]] {
                let before = out.clone();
                c.decrypt_sectors_from_slots_append(77, &slots, &mut out)
                    .unwrap();
                assert!(
                    out[..before.len()] == before[..] && out[before.len()..] == plain[..],
                    "{config:?}: {count} sectors appended from slots after {} bytes differ",
                    before.len()
                );
                let len = out.len();
                let refused = c.decrypt_sectors_from_slots_append(77, &slots[1..], &mut out);
                assert!(
                    matches!(refused, Err(CryptoError::SlotsLength { .. })),
                    "{config:?}: {refused:?}"
                );
                assert_eq!(
                    out.len(),
                    len,
                    "{config:?}: a refused run changed the buffer"
                );
            }
            if config.suite.is_authenticated() {
                let victim = count * 2 / 3;
                let mut tampered = slots.clone();
                tampered[victim * (ss + ml) + ss / 3] ^= 4;
                let mut back = vec![0x11u8; plain.len()];
                let result = c.decrypt_sectors_from_slots(77, &tampered, &mut back);
                // Appended, the run comes out the same: every sector, the victim as zeros.
                let mut appended = vec![0x22u8; 3];
                let appended_result =
                    c.decrypt_sectors_from_slots_append(77, &tampered, &mut appended);
                assert_eq!(appended[..3], [0x22; 3], "{config:?}");
                assert!(
                    appended[3..] == back[..],
                    "{config:?}: appended from tampered slots differs"
                );
                // In place: the same, the victim's plaintext zeros in its slot.
                let mut in_slots = tampered.clone();
                let in_slots_result = c.decrypt_sectors_in_slots(77, &mut in_slots);
                for i in 0..count {
                    assert!(
                        in_slots[i * (ss + ml)..][..ss] == back[i * ss..][..ss],
                        "{config:?}: sector {i} decrypted in its tampered slot"
                    );
                }
                for result in [result, appended_result, in_slots_result] {
                    match result {
                        Err(CryptoError::Authentication { sectors }) => {
                            assert_eq!(sectors, vec![77 + victim as u64], "{config:?}")
                        }
                        other => panic!("{config:?}: tampered slot {victim}: {other:?}"),
                    }
                }
                for i in 0..count {
                    let sector = &back[i * ss..][..ss];
                    if i == victim {
                        assert!(sector.iter().all(|&b| b == 0), "{config:?}: {i} not zeroed");
                    } else {
                        assert!(sector == &plain[i * ss..][..ss], "{config:?}: sector {i}");
                    }
                }
            }
        }
    }
}

/// AEAD suites: every single metadata bit (nonce, tag, and GCM's zero padding) is covered.
#[test]
fn every_metadata_bit_is_authenticated() {
    for config in configs().filter(|c| c.suite.is_authenticated() && c.sector_size == 512) {
        let c = cipher(config, &key(config, 3), image_id(3));
        let plain = bytes(4, 2 * 512);
        let (ct, md) = encrypt(&*c, 77, &plain);
        let md_len = config.suite.metadata_len();
        for bit in 0..md_len * 8 {
            let mut tampered = md.clone();
            flip_bit(&mut tampered[md_len..], bit);
            let (back, result) = decrypt(&*c, 77, &ct, &tampered);
            assert!(
                matches!(&result, Err(CryptoError::Authentication { sectors }) if sectors == &[78]),
                "{config:?}: metadata bit {bit}: {result:?}"
            );
            assert_eq!(back[..512], plain[..512], "{config:?}: untouched sector");
            assert!(
                back[512..].iter().all(|&b| b == 0),
                "{config:?}: not zeroed"
            );
        }
    }
}

/// The plain64 suites give every valid sector its own tweak up to the very last one: the same
/// plaintext at the first sectors, around 2^32 and at the top of the range (where the tweak
/// used to wrap onto the first sectors for 1024..4096-byte sectors) never shares a block.
#[test]
fn plain64_sectors_up_to_the_last_one_have_their_own_tweak() {
    for config in configs().filter(|c| is_plain64(c.suite)) {
        let ss = config.sector_size;
        let last = last_allowed(ss);
        let c = cipher(config, &key(config, 5), image_id(5));
        let plain = bytes(6, ss);
        let mut sectors = vec![
            0,
            1,
            2,
            3,
            8,
            (1 << 32) - 1,
            1 << 32,
            last - 8,
            last - 1,
            last,
        ];
        sectors.sort_unstable();
        sectors.dedup();
        let encrypted: Vec<(u64, Vec<u8>)> = sectors
            .iter()
            .map(|&s| (s, encrypt(&*c, s, &plain).0))
            .collect();
        for (x, (sx, cx)) in encrypted.iter().enumerate() {
            let (back, result) = decrypt(&*c, *sx, cx, &[]);
            assert!(result.is_ok() && back == plain, "{config:?}: sector {sx}");
            for (sy, cy) in &encrypted[x + 1..] {
                let same = cx
                    .chunks(BLOCK)
                    .zip(cy.chunks(BLOCK))
                    .filter(|(a, b)| a == b)
                    .count();
                assert_eq!(same, 0, "{config:?}: sectors {sx} and {sy} share blocks");
            }
        }
    }
}

/// The sectors of one run get consecutive nonces (`Suite::counted_nonce_len`): the first
/// sector's nonce plus the sector's place in the run, in place, out of place and appended, and
/// across the four-lane groups; another run starts elsewhere. Into slots (the `unaligned`
/// layout, which stores each nonce anyway) the same where the four-lane kernel runs; without
/// it the slots are sealed 32 KiB at a time, each piece a run of its own.
#[test]
fn a_runs_nonces_count_up() {
    for config in configs().filter(|c| c.suite.counted_nonce_len() > 0) {
        let (ss, ml) = (config.sector_size, config.suite.metadata_len());
        let nl = config.suite.counted_nonce_len();
        let c = cipher(config, &key(config, 7), image_id(7));
        for count in [1usize, 3, 4, 5, 17, 64] {
            let first = 1000 + count as u64;
            let plain = bytes(count as u64, count * ss);
            let mut runs: Vec<(&str, Vec<u8>)> = vec![("in place", encrypt(&*c, first, &plain).1)];
            let (mut ct, mut md) = (vec![0u8; plain.len()], vec![0u8; count * ml]);
            c.encrypt_sectors_to(first, &plain, &mut ct, &mut md)
                .unwrap();
            runs.push(("out of place", md));
            let mut md = vec![0u8; count * ml];
            c.encrypt_sectors_append(first, &plain, &mut Vec::new(), &mut md)
                .unwrap();
            runs.push(("appended", md));
            let mut slots = Vec::new();
            c.encrypt_sectors_append_slots(first, &plain, &mut slots)
                .unwrap();
            let md = slots
                .chunks_exact(ss + ml)
                .flat_map(|s| s[ss..].to_vec())
                .collect();
            runs.push(("slots", md));
            let piece = (32 << 10) / ss;
            for (how, md) in &runs {
                for i in 0..count {
                    // Where the run starts: slots without the four-lane kernel start a new
                    // one every 32 KiB (seen as a nonce that does not follow the last one).
                    let start = match *how == "slots" && vaes_off() {
                        true => i / piece * piece,
                        false => 0,
                    };
                    let mut expected = md[start * ml..][..nl].to_vec();
                    ivdisk_crypto::nonce_add(&mut expected, (i - start) as u64);
                    assert_eq!(
                        &md[i * ml..][..nl],
                        &expected[..],
                        "{config:?} {how}: nonce of sector {i} of {count}"
                    );
                }
            }
            let firsts: std::collections::HashSet<&[u8]> =
                runs.iter().map(|(_, md)| &md[..nl]).collect();
            assert_eq!(
                firsts.len(),
                runs.len(),
                "{config:?}: two runs began at one nonce"
            );
        }
    }
}

/// Whether the tests run without the four-lane AEGIS-128L kernel: switched off
/// (`scripts/test-all.sh` runs them both ways), or a CPU without VAES.
fn vaes_off() -> bool {
    #[cfg(target_arch = "x86_64")]
    let cpu_has_vaes = std::arch::is_x86_feature_detected!("aes")
        && std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("vaes")
        && std::arch::is_x86_feature_detected!("vpclmulqdq");
    #[cfg(not(target_arch = "x86_64"))]
    let cpu_has_vaes = false;
    std::env::var_os("IVDISK_CRYPTO_NO_VAES").is_some() || !cpu_has_vaes
}
