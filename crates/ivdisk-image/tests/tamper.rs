//! Tampering with what the store holds, as anyone with access to the objects can: one flipped
//! byte of a sector's ciphertext or metadata, two sectors swapped, a data object copied from
//! another image made with the same passphrase. With an AEAD suite every such sector fails
//! with `ImageError::Integrity` naming exactly it, while the rest of the request is served;
//! without a MAC (`aes-xts-random`, and the `none`-layout suites) a moved sector decrypts to
//! garbage instead.

mod common;

use common::{put_raw_object, put_raw_sector, raw_object, raw_sector, Backend, Place, Rng};
use ivdisk_crypto::Suite;
use ivdisk_image::{Image, ImageError, LayoutKind, OpenOptions};

/// Sixteen sectors per object at 4096 bytes; four objects.
const OBJECT_SIZE: u64 = 64 << 10;
const OBJECTS: u64 = 4;

#[derive(Debug, Clone, Copy)]
struct Case {
    backend: Backend,
    suite: Suite,
    layout: LayoutKind,
    sector_size: u32,
}

impl Case {
    fn ss(&self) -> u64 {
        self.sector_size as u64
    }
    fn sectors_per_object(&self) -> u64 {
        OBJECT_SIZE / self.ss()
    }
}

/// An image whose every sector holds random plaintext (returned), open for writing without
/// the metadata cache: the tampering below happens under an open writer, and a writer with the
/// cache would not read the metadata it holds in memory (see
/// `a_writer_does_not_read_the_metadata_it_holds`; the threat is tampering while the image is
/// not open, which a writer opening it afterwards reads from the store).
async fn written_image(case: &Case, seed: u64) -> (Place, Image, Vec<u8>) {
    let place = common::place(case.backend, "tamper");
    let size = OBJECTS * OBJECT_SIZE;
    let image = Image::create(
        &place.uri,
        &common::options(size, case.suite, case.layout, case.sector_size, OBJECT_SIZE),
        common::PASS,
    )
    .await
    .unwrap_or_else(|e| panic!("{case:?}: create: {e}"));
    let content = Rng::derive(seed, &format!("{case:?}")).bytes(size as usize);
    image.write(0, &content).await.unwrap();
    image.close().await.unwrap();
    let uncached = OpenOptions {
        metadata_cache_bytes: 0,
        ..OpenOptions::default()
    };
    let image = Image::open(&place.uri, common::PASS, &uncached)
        .await
        .unwrap_or_else(|e| panic!("{case:?}: open: {e}"));
    (place, image, content)
}

/// Read `[offset, offset + len)`, expecting exactly `failed` to fail authentication and every
/// other byte to be `content`'s (zeros in the failed sectors).
async fn expect_read(
    case: &Case,
    image: &Image,
    content: &[u8],
    offset: u64,
    len: u64,
    failed: &[u64],
) {
    let ss = case.ss();
    let mut buf = vec![0xA5u8; len as usize];
    let result = image.read(offset, &mut buf).await;
    match (&result, failed.is_empty()) {
        (Ok(()), true) => {}
        (
            Err(ImageError::Integrity {
                lbas,
                sector_size,
                in_write: false,
                ..
            }),
            false,
        ) => {
            assert_eq!(
                lbas, failed,
                "{case:?}: read [{offset}, +{len}) names the wrong sectors"
            );
            assert_eq!(*sector_size, ss as usize);
        }
        _ => {
            panic!("{case:?}: read [{offset}, +{len}) expected failures {failed:?}, got {result:?}")
        }
    }
    let mut expect = content[offset as usize..(offset + len) as usize].to_vec();
    for &lba in failed {
        let lo = (lba * ss).max(offset);
        let hi = ((lba + 1) * ss).min(offset + len);
        expect[(lo - offset) as usize..(hi - offset) as usize].fill(0);
    }
    if let Some(i) = common::first_difference(&buf, &expect) {
        panic!(
            "{case:?}: read [{offset}, +{len}) with failures {failed:?}: byte {} is {:#04x}, \
             expected {:#04x}",
            offset + i as u64,
            buf[i],
            expect[i]
        );
    }
    // The same range read into a buffer the image returns, as export reads (`read_owned`) and
    // as the NBD server does (`read_reply`, which may keep each sector in its slot: its pieces
    // in order): the same sectors fail, or it returns the content.
    let owned = image.read_owned(offset, len as usize).await;
    let reply = image.read_reply(offset, len as usize).await.map(|reply| {
        let sent: Vec<u8> = reply.pieces().flatten().copied().collect();
        assert!(
            reply.into_vec() == sent,
            "{case:?}: read_reply [{offset}, +{len}) gathered differs from its pieces"
        );
        sent
    });
    for (what, result) in [("read_owned", owned), ("read_reply", reply)] {
        match (result, failed.is_empty()) {
            (Ok(returned), true) => assert!(
                returned == expect,
                "{case:?}: {what} [{offset}, +{len}) returned other bytes than read"
            ),
            (Err(ImageError::Integrity { lbas, .. }), false) => assert_eq!(
                lbas, failed,
                "{case:?}: {what} [{offset}, +{len}) names the wrong sectors"
            ),
            (other, _) => panic!(
                "{case:?}: {what} [{offset}, +{len}) expected failures {failed:?}, got {:?}",
                other.map(|b| b.len())
            ),
        }
    }
}

/// Sector `lba` (only) fails: alone, in part, next to its neighbours, and inside a read of
/// many sectors (across an object boundary, unaligned at both ends); and a partial write to
/// it is refused (its other bytes cannot be kept).
async fn expect_only_sector_fails(case: &Case, image: &Image, content: &[u8], lba: u64) {
    let ss = case.ss();
    expect_read(case, image, content, lba * ss, ss, &[lba]).await;
    expect_read(case, image, content, lba * ss + 3, ss / 2, &[lba]).await;
    expect_read(case, image, content, (lba - 1) * ss, ss, &[]).await;
    expect_read(case, image, content, (lba + 1) * ss, ss, &[]).await;
    // The neighbours' bytes right up to the edge of the failed sector.
    expect_read(case, image, content, lba * ss - 10, 10, &[]).await;
    expect_read(case, image, content, (lba + 1) * ss, 10, &[]).await;
    let start = (lba / case.sectors_per_object()) * OBJECT_SIZE - 2 * ss + 5;
    let end = (lba + 3) * ss - 7;
    expect_read(case, image, content, start, end - start, &[lba]).await;
    let err = image.write(lba * ss + 1, &[1, 2, 3]).await.unwrap_err();
    assert!(
        matches!(&err, ImageError::Integrity { lbas, in_write: true, .. } if lbas == &[lba]),
        "{case:?}: a partial write of a sector that fails authentication: {err}"
    );
    assert!(err.to_string().contains("nothing was written"), "{err}");
    expect_read(case, image, content, lba * ss, ss, &[lba]).await;
}

fn flip(bytes: &mut [u8], at: usize) {
    bytes[at] ^= 0x01;
}

/// One flipped byte of a sector's stored ciphertext (at its start, middle and end).
async fn flipped_ciphertext(case: &Case, image: &Image, content: &mut [u8]) {
    let ss = case.ss();
    // A sector in the middle of the second object.
    let lba = case.sectors_per_object() + 5;
    let (data, metadata) = raw_sector(image, lba).await;
    for at in [0, ss as usize / 2 + 1, ss as usize - 1] {
        let mut bad = data.clone();
        flip(&mut bad, at);
        put_raw_sector(image, lba, &bad, &metadata).await;
        expect_only_sector_fails(case, image, content, lba).await;
    }
    // Put back, it reads again.
    put_raw_sector(image, lba, &data, &metadata).await;
    expect_read(case, image, content, 0, OBJECTS * OBJECT_SIZE, &[]).await;
    // A whole-sector write replaces a damaged sector (no read-modify-write needed).
    let mut bad = data.clone();
    flip(&mut bad, 7);
    put_raw_sector(image, lba, &bad, &metadata).await;
    let fresh = vec![0x3Cu8; ss as usize];
    image.write(lba * ss, &fresh).await.unwrap();
    content[(lba * ss) as usize..((lba + 1) * ss) as usize].copy_from_slice(&fresh);
    expect_read(case, image, content, 0, OBJECTS * OBJECT_SIZE, &[]).await;
}

/// One flipped byte of a sector's stored metadata: its nonce, middle, and last byte (tag, or
/// GCM's padding).
async fn flipped_metadata(case: &Case, image: &Image, content: &[u8]) {
    let lba = 2 * case.sectors_per_object() + 3;
    let (data, metadata) = raw_sector(image, lba).await;
    assert_eq!(metadata.len(), case.suite.metadata_len());
    assert!(
        metadata.iter().any(|&b| b != 0),
        "{case:?}: metadata stored"
    );
    let ml = metadata.len();
    for at in [0, ml / 2, ml - 1] {
        let mut bad = metadata.clone();
        flip(&mut bad, at);
        put_raw_sector(image, lba, &data, &bad).await;
        expect_only_sector_fails(case, image, content, lba).await;
    }
    put_raw_sector(image, lba, &data, &metadata).await;
    expect_read(case, image, content, 0, OBJECTS * OBJECT_SIZE, &[]).await;
}

/// Two sectors' ciphertext and metadata swapped: within one object, and between objects (at
/// the same index, and at different ones).
async fn swapped_sectors(case: &Case, image: &Image, content: &[u8]) {
    let (ss, spo) = (case.ss(), case.sectors_per_object());
    for (a, b) in [(spo + 2, spo + 6), (3, 2 * spo + 3), (1, 3 * spo + 9)] {
        let (data_a, meta_a) = raw_sector(image, a).await;
        let (data_b, meta_b) = raw_sector(image, b).await;
        put_raw_sector(image, a, &data_b, &meta_b).await;
        put_raw_sector(image, b, &data_a, &meta_a).await;
        expect_read(case, image, content, a * ss, ss, &[a]).await;
        expect_read(case, image, content, b * ss, ss, &[b]).await;
        // One read over both: exactly the two fail, everything between is served.
        let (lo, hi) = (a.min(b) - 1, a.max(b) + 2);
        expect_read(
            case,
            image,
            content,
            lo * ss + 1,
            (hi - lo) * ss - 2,
            &[a, b],
        )
        .await;
        put_raw_sector(image, a, &data_a, &meta_a).await;
        put_raw_sector(image, b, &data_b, &meta_b).await;
        expect_read(case, image, content, 0, OBJECTS * OBJECT_SIZE, &[]).await;
    }
}

/// A data object copied from another image made with the same passphrase, parameters and
/// plaintext (only the volume key and image id, chosen at create, differ) into the same
/// object number: every sector of it fails.
async fn object_from_another_image(
    case: &Case,
    victim: &Image,
    content: &[u8],
    donor: &Image,
    donor_content: &[u8],
) {
    // Same plaintext in the object copied (the third: the first tampering rewrote a sector of
    // the second).
    let spo = case.sectors_per_object();
    let n = 2;
    let object = (n * OBJECT_SIZE) as usize..((n + 1) * OBJECT_SIZE) as usize;
    assert!(content[object.clone()] == donor_content[object]);
    assert_ne!(victim.image_id(), donor.image_id(), "{case:?}");
    let original = raw_object(victim, &victim.data_object(n)).await;
    let raw = raw_object(donor, &donor.data_object(n)).await;
    assert!(
        !raw.extents.is_empty(),
        "{case:?}: the donor object holds data"
    );
    put_raw_object(victim, &victim.data_object(n), &raw).await;
    let failed: Vec<u64> = (n * spo..(n + 1) * spo).collect();
    expect_read(case, victim, content, 0, OBJECTS * OBJECT_SIZE, &failed).await;
    for lba in [n * spo, n * spo + spo / 2, (n + 1) * spo - 1] {
        expect_read(case, victim, content, lba * case.ss(), case.ss(), &[lba]).await;
    }
    // The donor itself is untouched; the victim's own object put back reads again.
    expect_read(case, donor, donor_content, 0, OBJECTS * OBJECT_SIZE, &[]).await;
    put_raw_object(victim, &victim.data_object(n), &original).await;
    expect_read(case, victim, content, 0, OBJECTS * OBJECT_SIZE, &[]).await;
}

/// Every tampering on one AEAD case, on the same two images (creating images dominates).
async fn tamper_case(case: Case, seed: u64) {
    let (_victim_place, victim, mut content) = written_image(&case, seed).await;
    let (_donor_place, donor, donor_content) = written_image(&case, seed).await;
    flipped_ciphertext(&case, &victim, &mut content).await;
    flipped_metadata(&case, &victim, &content).await;
    swapped_sectors(&case, &victim, &content).await;
    object_from_another_image(&case, &victim, &content, &donor, &donor_content).await;
    victim.close().await.unwrap();
    donor.close().await.unwrap();
}

/// Run `cases` concurrently; panics name the case.
async fn run_cases<F, Fut>(test: &str, cases: Vec<Case>, run: F)
where
    F: Fn(Case, u64) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (seed, _guard) = common::seed(test);
    let tasks: Vec<_> = cases
        .into_iter()
        .map(|case| (case, tokio::spawn(run(case, seed))))
        .collect();
    let mut failed = Vec::new();
    for (case, task) in tasks {
        if let Err(e) = task.await {
            failed.push(format!("{case:?}: {e}"));
        }
    }
    assert!(failed.is_empty(), "failed cases:\n{}", failed.join("\n"));
}

fn cases(
    backends: &[Backend],
    suite: Suite,
    layouts: &[LayoutKind],
    sector_size: u32,
) -> Vec<Case> {
    let mut out = Vec::new();
    for &backend in backends {
        for &layout in layouts {
            out.push(Case {
                backend,
                suite,
                layout,
                sector_size,
            });
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aegis128l_random_tampering_fails_exactly_the_sectors_touched() {
    run_cases(
        "aegis128l_random_tampering_fails_exactly_the_sectors_touched",
        cases(
            &Backend::LOCAL,
            Suite::Aegis128lRandom,
            &LayoutKind::WITH_METADATA,
            4096,
        ),
        tamper_case,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aegis128l_random_512_byte_sectors_tampering_fails_exactly_the_sectors_touched() {
    run_cases(
        "aegis128l_random_512_byte_sectors_tampering_fails_exactly_the_sectors_touched",
        cases(
            &[Backend::Memory],
            Suite::Aegis128lRandom,
            &LayoutKind::WITH_METADATA,
            512,
        ),
        tamper_case,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aegis256_random_tampering_fails_exactly_the_sectors_touched() {
    run_cases(
        "aegis256_random_tampering_fails_exactly_the_sectors_touched",
        cases(
            &[Backend::Memory],
            Suite::Aegis256Random,
            &LayoutKind::WITH_METADATA,
            4096,
        ),
        tamper_case,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aes_gcm_random_tampering_fails_exactly_the_sectors_touched() {
    run_cases(
        "aes_gcm_random_tampering_fails_exactly_the_sectors_touched",
        cases(
            &[Backend::Memory],
            Suite::AesGcmRandom,
            &LayoutKind::WITH_METADATA,
            4096,
        ),
        tamper_case,
    )
    .await;
}

/// Without a MAC nothing fails, but a sector moved to another place (or from another image)
/// does not decrypt to what was written there: the IV/tweak binds it to its sector, the key
/// to its image. A flipped byte garbles (at least) its cipher block, silently.
async fn no_mac_case(case: Case, seed: u64) {
    let (_place, image, content) = written_image(&case, seed).await;
    let (ss, spo) = (case.ss(), case.sectors_per_object());
    let sector = |lba: u64| &content[(lba * ss) as usize..((lba + 1) * ss) as usize];
    let mut got = vec![0u8; ss as usize];

    let (from, to) = (spo + 2, 2 * spo + 7);
    let (data, metadata) = raw_sector(&image, from).await;
    put_raw_sector(&image, to, &data, &metadata).await;
    image
        .read(to * ss, &mut got)
        .await
        .unwrap_or_else(|e| panic!("{case:?}: no MAC, so no error: {e}"));
    assert_ne!(
        got,
        sector(from),
        "{case:?}: a moved sector decrypted to its plaintext"
    );
    assert_ne!(got, sector(to), "{case:?}");
    // The sector it came from still reads right.
    expect_read(&case, &image, &content, from * ss, ss, &[]).await;

    let (_donor_place, donor, _) = written_image(&case, seed).await;
    let lba = 3;
    let (data, metadata) = raw_sector(&donor, lba).await;
    put_raw_sector(&image, lba, &data, &metadata).await;
    image.read(lba * ss, &mut got).await.unwrap();
    assert_ne!(
        got,
        sector(lba),
        "{case:?}: another image's sector decrypted"
    );

    let lba = 5;
    let (mut data, metadata) = raw_sector(&image, lba).await;
    flip(&mut data, 100);
    put_raw_sector(&image, lba, &data, &metadata).await;
    image.read(lba * ss, &mut got).await.unwrap();
    let differing = got.iter().zip(sector(lba)).filter(|(a, b)| a != b).count();
    assert!(differing >= 8, "{case:?}: {differing} bytes changed");
    donor.close().await.unwrap();
    image.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_mac_moved_sectors_decrypt_to_garbage() {
    let mut all = Vec::new();
    for (suite, layout) in common::combinations() {
        if !common::AEAD_SUITES.contains(&suite) {
            all.extend(cases(&[Backend::Memory], suite, &[layout], 4096));
        }
    }
    assert_eq!(
        all.len(),
        7,
        "aes-xts-random × 5 layouts, 2 suites × none: {all:?}"
    );
    all.extend(cases(
        &[Backend::Local],
        Suite::AesXtsRandom,
        &[LayoutKind::ObjectEnd],
        4096,
    ));
    run_cases(
        "without_a_mac_moved_sectors_decrypt_to_garbage",
        all,
        no_mac_case,
    )
    .await;
}

/// With the metadata cache (the default for `object-end` writers), tampered ciphertext still
/// fails exactly its sector; metadata changed under the writer is not read while the writer
/// holds it in memory (no one else may write while the writer lock is held); opened again,
/// the writer reads the store and the tampered sector fails.
async fn cached_case(case: Case, seed: u64) {
    let place = common::place(case.backend, "tamper-cached");
    let size = OBJECTS * OBJECT_SIZE;
    let options = common::options(size, case.suite, case.layout, case.sector_size, OBJECT_SIZE);
    let image = Image::create(&place.uri, &options, common::PASS)
        .await
        .unwrap_or_else(|e| panic!("{case:?}: create: {e}"));
    let content = Rng::derive(seed, &format!("{case:?}")).bytes(size as usize);
    image.write(0, &content).await.unwrap();
    let lba = case.sectors_per_object() + 5;
    let (data, metadata) = raw_sector(&image, lba).await;
    let mut bad = data.clone();
    flip(&mut bad, 9);
    put_raw_sector(&image, lba, &bad, &metadata).await;
    expect_read(&case, &image, &content, 0, size, &[lba]).await;
    put_raw_sector(&image, lba, &data, &metadata).await;
    expect_read(&case, &image, &content, 0, size, &[]).await;
    let mut bad = metadata.clone();
    flip(&mut bad, 0);
    put_raw_sector(&image, lba, &data, &bad).await;
    expect_read(&case, &image, &content, 0, size, &[]).await;
    image.close().await.unwrap();
    let image = Image::open(&place.uri, common::PASS, &OpenOptions::default())
        .await
        .unwrap_or_else(|e| panic!("{case:?}: open: {e}"));
    expect_read(&case, &image, &content, 0, size, &[lba]).await;
    // A whole-sector write repairs it, and the neighbours' metadata (in the same block)
    // stays intact.
    let fresh = vec![0x5Au8; case.ss() as usize];
    image.write(lba * case.ss(), &fresh).await.unwrap();
    let mut content = content;
    content[(lba * case.ss()) as usize..((lba + 1) * case.ss()) as usize].copy_from_slice(&fresh);
    expect_read(&case, &image, &content, 0, size, &[]).await;
    image.close().await.unwrap();
    let image = Image::open(&place.uri, common::PASS, &OpenOptions::read_only())
        .await
        .unwrap_or_else(|e| panic!("{case:?}: open read-only: {e}"));
    expect_read(&case, &image, &content, 0, size, &[]).await;
    image.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writer_does_not_read_the_metadata_it_holds() {
    run_cases(
        "a_writer_does_not_read_the_metadata_it_holds",
        cases(
            &Backend::LOCAL,
            Suite::Aegis128lRandom,
            &[LayoutKind::ObjectEnd],
            4096,
        ),
        cached_case,
    )
    .await;
}

/// `unaligned` reads of 512 KiB and more into a buffer the image returns (as the NBD server
/// reads) are decrypted in the store's buffer, the first sectors of a run moved down and
/// decrypted in place, the rest decrypted straight down (`Inner::decrypt_slots_down`). A
/// read over a whole 4 MiB object with unwritten sectors in both parts returns what `read`
/// does; with a sector tampered in each part (AEAD suites), exactly those two fail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_unaligned_reads_fail_exactly_the_sectors_touched() {
    const BIG_OBJECT: u64 = 4 << 20;
    let (seed, _guard) = common::seed("large_unaligned_reads_fail_exactly_the_sectors_touched");
    for suite in Suite::ALL.into_iter().filter(|s| s.metadata_len() > 0) {
        for sector_size in [4096u32, 512] {
            let case = Case {
                backend: Backend::Memory,
                suite,
                layout: LayoutKind::Unaligned,
                sector_size,
            };
            let (ss, per_object) = (case.ss(), BIG_OBJECT / case.ss());
            let place = common::place(case.backend, "tamper-large");
            let size = 2 * BIG_OBJECT;
            let options = common::options(size, suite, case.layout, sector_size, BIG_OBJECT);
            let image = Image::create(&place.uri, &options, common::PASS)
                .await
                .unwrap_or_else(|e| panic!("{case:?}: create: {e}"));
            let mut content = Rng::derive(seed, &format!("{case:?}")).bytes(size as usize);
            // Unwritten sectors of the second object: at its start, in the part moved down
            // (the first 128 sectors of 4 KiB, 16 of 512 bytes) and in the part decrypted
            // straight down, next to each other and alone, and its last.
            let holes: Vec<u64> = [0, 3, 4, per_object / 2, per_object / 2 + 1, per_object - 1]
                .into_iter()
                .map(|i| per_object + i)
                .collect();
            for &lba in &holes {
                content[(lba * ss) as usize..((lba + 1) * ss) as usize].fill(0);
            }
            let mut start = 0;
            for end in holes.iter().copied().chain([size / ss]) {
                if end > start {
                    let bytes = &content[(start * ss) as usize..(end * ss) as usize];
                    image.write(start * ss, bytes).await.unwrap();
                }
                start = end + 1;
            }
            // The whole object (one piece: the store's buffer is returned), its first 1 MiB,
            // and a read that starts in the first object (two pieces, into one new buffer).
            let reads = [
                (BIG_OBJECT, BIG_OBJECT),
                (BIG_OBJECT, 1 << 20),
                (BIG_OBJECT - 3 * ss, BIG_OBJECT + 3 * ss),
            ];
            for (offset, len) in reads {
                expect_read(&case, &image, &content, offset, len, &[]).await;
            }
            if suite.is_authenticated() {
                let victims = [per_object + 6, per_object + per_object * 3 / 4];
                for &lba in &victims {
                    let (mut data, metadata) = raw_sector(&image, lba).await;
                    flip(&mut data, ss as usize / 3);
                    put_raw_sector(&image, lba, &data, &metadata).await;
                }
                for (offset, len) in reads {
                    let failed: Vec<u64> = victims
                        .into_iter()
                        .filter(|&lba| lba * ss < offset + len)
                        .collect();
                    expect_read(&case, &image, &content, offset, len, &failed).await;
                }
            }
            image.close().await.unwrap();
        }
    }
}

/// Set one omap pair on data object `object` behind the image's back (`rados setomapval`).
async fn set_omap_value(image: &Image, object: u64, key: &[u8], value: &[u8]) {
    let mut pairs = ivdisk_store::OmapPairs::new();
    pairs.push(key, value);
    let op = ivdisk_store::WriteOp::new().omap_set(pairs);
    image
        .store()
        .write_op(&image.data_object(object), op)
        .await
        .unwrap();
}

/// An omap value of the wrong length (set with `rados setomapval`, say) is damage to the
/// metadata of the sectors it holds: exactly those fail (`verify` lists them, the NBD server
/// answers EIO for them), the rest of the object reads, and a write of a whole sector heals it.
async fn value_of_the_wrong_length(case: Case, seed: u64) {
    let (_place, image, mut content) = written_image(&case, seed).await;
    let spo = case.sectors_per_object();
    // `omap`: one value per sector (key = its index); `omap-packed`: one per 16 sectors.
    let (key, damaged): (&[u8], Vec<u64>) = match case.layout {
        LayoutKind::Omap => (b"00000003", vec![spo + 3]),
        _ => (b"00000000", (spo..spo + 16).collect()),
    };
    set_omap_value(&image, 1, key, &[7u8; 7]).await;
    expect_read(&case, &image, &content, 0, OBJECTS * OBJECT_SIZE, &damaged).await;
    // A whole sector written over one of them reads back; the others still fail.
    let ss = case.ss();
    let healed = damaged[damaged.len() / 2];
    let data = Rng::derive(seed, "heal").bytes(ss as usize);
    image.write(healed * ss, &data).await.unwrap();
    content[(healed * ss) as usize..((healed + 1) * ss) as usize].copy_from_slice(&data);
    let still: Vec<u64> = damaged.into_iter().filter(|&l| l != healed).collect();
    expect_read(&case, &image, &content, 0, OBJECTS * OBJECT_SIZE, &still).await;
    image.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_omap_value_of_the_wrong_length_fails_exactly_its_sectors() {
    run_cases(
        "an_omap_value_of_the_wrong_length_fails_exactly_its_sectors",
        cases(
            &Backend::LOCAL,
            Suite::DEFAULT,
            &[LayoutKind::Omap, LayoutKind::OmapPacked],
            4096,
        ),
        value_of_the_wrong_length,
    )
    .await;
}

/// An omap key that is no sector's (another tool's, `0000000A` in upper case) among an
/// object's metadata keys fails nothing: every sector reads. It failed the whole read of every
/// range around it (`Corrupt`), sectors that authenticate included.
async fn a_foreign_key(case: Case, seed: u64) {
    let (_place, image, content) = written_image(&case, seed).await;
    set_omap_value(&image, 1, b"0000000A", &[1u8; 32]).await;
    expect_read(&case, &image, &content, 0, OBJECTS * OBJECT_SIZE, &[]).await;
    let ss = case.ss();
    let spo = case.sectors_per_object();
    expect_read(&case, &image, &content, (spo + 9) * ss, ss, &[]).await;
    image.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_omap_key_of_no_sector_fails_nothing() {
    run_cases(
        "an_omap_key_of_no_sector_fails_nothing",
        cases(&Backend::LOCAL, Suite::DEFAULT, &[LayoutKind::Omap], 4096),
        a_foreign_key,
    )
    .await;
}

/// A store that lists fewer omap pairs per read than the `omap` layout asks (a Ceph OSD with
/// `osd_max_omap_entries_per_request` lowered below 1024) must not make the sectors past the
/// cut read with zero metadata: for `aes-xts-random` that decrypted to garbage returned as
/// data (and a partial write then merged it in for good); for the AEAD suites to integrity
/// errors on sectors nobody touched. The read fails instead, naming the setting; reads of
/// fewer keys than the store lists work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_omap_listing_is_an_error_not_garbage() {
    let mut rng = Rng::new(0x5eed_0a1a);
    for suite in [Suite::AesXtsRandom, Suite::Aegis128lRandom] {
        let store = std::sync::Arc::new(common::ShortListings::new(100));
        let options = common::options(8 << 20, suite, LayoutKind::Omap, 4096, 4 << 20);
        let image = Image::create_on(store.clone(), "img", &options, common::PASS)
            .await
            .unwrap();
        let data = rng.bytes(1 << 20);
        image.write(0, &data).await.unwrap();
        let mut small = vec![0u8; 64 << 10];
        image.read(0, &mut small).await.unwrap();
        assert!(small == data[..64 << 10], "{suite}: 16 sectors read back");
        let mut all = vec![0u8; 1 << 20];
        let err = image.read(0, &mut all).await.unwrap_err();
        let text = err.to_string();
        assert!(
            matches!(err, ImageError::Corrupt { .. })
                && text.contains("osd_max_omap_entries_per_request"),
            "{suite}: {text}"
        );
        image.close().await.unwrap();
    }
}
