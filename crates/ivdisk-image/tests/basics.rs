//! The image lifecycle and IO path on the memory and local backends: create/open/close,
//! sub-sector IO, discard, resize, delete, the writer lock, bad input.

use std::time::Duration;

use ivdisk_crypto::Suite;
use ivdisk_header::{PbkdfKind, PbkdfRequest};
use ivdisk_image::{
    CreateOptions, Fencing, Image, ImageError, ImageUri, LayoutKind, OpenOptions, PayloadPlacement,
    WritePayload,
};

const PASS: &[u8] = b"correct horse";

fn options(size: u64, suite: Suite, layout: LayoutKind) -> CreateOptions {
    CreateOptions {
        suite,
        layout: Some(layout),
        object_size: 64 << 10,
        pbkdf: PbkdfRequest::fast_for_tests(PbkdfKind::Pbkdf2),
        ..CreateOptions::new(size)
    }
}

fn unique(prefix: &str) -> ImageUri {
    let mut b = [0u8; 6];
    getrandom::getrandom(&mut b).unwrap();
    ImageUri::parse(&format!("mem:{prefix}-{}", hex::encode(b))).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_read_partial_discard_roundtrip() {
    let uri = unique("basic");
    let image = Image::create(
        &uri,
        &options(1 << 20, Suite::DEFAULT, LayoutKind::ObjectEnd),
        PASS,
    )
    .await
    .unwrap();
    let mut buf = vec![0xAAu8; 200_000];
    image.read(1000, &mut buf).await.unwrap();
    assert!(buf.iter().all(|&b| b == 0), "a new image reads zeros");
    let data: Vec<u8> = (0..150_000u32).map(|i| (i % 251) as u8).collect();
    image.write(12345, &data).await.unwrap();
    let mut back = vec![0u8; data.len()];
    image.read(12345, &mut back).await.unwrap();
    assert_eq!(back, data);
    // Neighbouring bytes of the partial sectors stayed zero.
    let mut edge = [1u8; 4];
    image.read(12341, &mut edge).await.unwrap();
    assert_eq!(edge, [0; 4]);
    // Aligned reads land in the caller's buffer directly: unwritten sectors of a written
    // object must come out zero there, whatever the buffer held.
    let mut dirty = vec![0x5Au8; 64 << 10];
    image.read(0, &mut dirty).await.unwrap();
    let mut expect_head = vec![0u8; 64 << 10];
    expect_head[12345..].copy_from_slice(&data[..(64 << 10) - 12345]);
    assert_eq!(dirty, expect_head);
    image.discard(20_000, 100_000).await.unwrap();
    image.read(12345, &mut back).await.unwrap();
    let mut expect = data.clone();
    expect[20_000 - 12345..120_000 - 12345].fill(0);
    assert_eq!(back, expect);
    image.close().await.unwrap();

    let image = Image::open(&uri, PASS, &OpenOptions::default())
        .await
        .unwrap();
    image.read(12345, &mut back).await.unwrap();
    assert_eq!(back, expect, "data survives close and reopen");
    image.close().await.unwrap();
}

/// Large whole-sector writes handed over with the image's headroom (`omap-tail` appends a
/// whole object's tail) and payloads placed as the image asks, as the NBD server hands them
/// (`unaligned` in slots), in every layout and suite with metadata: what reads back is what
/// was written, the sectors around stay as they were, and the same data handed over without
/// headroom, or in slots the image did not ask for, reads back too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_owned_writes_with_headroom_read_back() {
    const OBJECT: u64 = 4 << 20;
    for suite in Suite::ALL.into_iter().filter(|s| s.metadata_len() > 0) {
        for layout in LayoutKind::ALL
            .into_iter()
            .filter(|l| *l != LayoutKind::None)
        {
            let case = format!("{suite}, {layout}");
            let uri = unique("owned");
            let opts = CreateOptions {
                object_size: OBJECT,
                ..options(2 * OBJECT, suite, layout)
            };
            let image = Image::create(&uri, &opts, PASS).await.unwrap();
            let mut model = vec![0u8; 2 * OBJECT as usize];
            // Inside object 0, the whole of object 1, then object 0 again without headroom.
            for (i, (offset, len, with_room)) in [
                (8192u64, 1usize << 20, true),
                (OBJECT, OBJECT as usize, true),
                (OBJECT - (768 << 10), 512 << 10, false),
            ]
            .into_iter()
            .enumerate()
            {
                let data: Vec<u8> = (0..len).map(|b| ((b * 7 + i * 13) % 253) as u8).collect();
                let room = image.write_headroom(offset, len as u64);
                let mut handed = Vec::with_capacity(len + if with_room { room } else { 0 });
                handed.extend_from_slice(&data);
                image.write_owned(offset, handed).await.unwrap();
                model[offset as usize..offset as usize + len].copy_from_slice(&data);
                let mut back = vec![0u8; model.len()];
                image.read(0, &mut back).await.unwrap();
                assert!(back == model, "{case}: write {i} did not read back");
            }
            // As the NBD server hands payloads over: placed as the image asks (in slots for
            // `unaligned`, each slot's tail holding junk), and a payload in slots the image
            // did not ask for (across two objects), which it gathers.
            let ml = suite.metadata_len();
            let in_slots = |data: &[u8]| {
                let slots = data
                    .chunks_exact(4096)
                    .flat_map(|s| s.iter().copied().chain(std::iter::repeat_n(0x5a, ml)))
                    .collect();
                WritePayload::in_slots(slots, 4096, 4096 + ml)
            };
            for (i, (offset, len)) in [(8192u64, 1usize << 20), (OBJECT, OBJECT as usize)]
                .into_iter()
                .enumerate()
            {
                let data: Vec<u8> = (0..len).map(|b| ((b * 11 + i * 3) % 251) as u8).collect();
                let payload = match image.write_placement(offset, len as u64) {
                    PayloadPlacement::Slots { sector, slot } => {
                        assert_eq!(layout, LayoutKind::Unaligned, "{case}");
                        assert_eq!((sector, slot), (4096, 4096 + ml), "{case}");
                        in_slots(&data)
                    }
                    PayloadPlacement::Contiguous { spare } => {
                        assert_ne!(layout, LayoutKind::Unaligned, "{case}");
                        let mut handed = Vec::with_capacity(len + spare);
                        handed.extend_from_slice(&data);
                        WritePayload::contiguous(handed)
                    }
                };
                image.write_payload(offset, payload).await.unwrap();
                model[offset as usize..offset as usize + len].copy_from_slice(&data);
                let mut back = vec![0u8; model.len()];
                image.read(0, &mut back).await.unwrap();
                assert!(back == model, "{case}: payload {i} did not read back");
            }
            let (offset, len) = (OBJECT - 3 * 4096, 6 * 4096);
            assert_eq!(
                image.write_placement(offset, len as u64),
                PayloadPlacement::Contiguous { spare: 0 },
                "{case}"
            );
            let data: Vec<u8> = (0..len).map(|b| (b % 249) as u8 ^ 0x33).collect();
            image.write_payload(offset, in_slots(&data)).await.unwrap();
            model[offset as usize..offset as usize + len].copy_from_slice(&data);
            let mut back = vec![0u8; model.len()];
            image.read(0, &mut back).await.unwrap();
            assert!(
                back == model,
                "{case}: slots not asked for did not read back"
            );
            image.close().await.unwrap();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn second_writer_is_refused_and_readers_are_not() {
    let uri = unique("lock");
    let writer = Image::create(
        &uri,
        &options(1 << 20, Suite::DEFAULT, LayoutKind::Omap),
        PASS,
    )
    .await
    .unwrap();
    let err = Image::open(&uri, PASS, &OpenOptions::default())
        .await
        .unwrap_err();
    assert!(matches!(err, ImageError::Locked { .. }), "{err}");
    assert!(err.to_string().contains("ivdisk lock break"), "{err}");
    let reader = Image::open(&uri, PASS, &OpenOptions::read_only())
        .await
        .unwrap();
    writer.write(0, &[7u8; 4096]).await.unwrap();
    let mut b = [0u8; 4096];
    reader.read(0, &mut b).await.unwrap();
    assert_eq!(b, [7u8; 4096]);
    assert!(matches!(
        reader.write(0, &b).await,
        Err(ImageError::ReadOnly { .. })
    ));
    assert!(matches!(
        reader.write_owned(0, b.to_vec()).await,
        Err(ImageError::ReadOnly { .. })
    ));
    // Breaking the lock makes the old writer refuse writes once its renewal notices.
    let broken = Image::break_lock(&uri, Fencing::Holder).await.unwrap();
    assert!(broken.is_some());
    let second = Image::open(&uri, PASS, &OpenOptions::default())
        .await
        .unwrap();
    second.close().await.unwrap();
    drop(writer);
    let _ = Duration::ZERO;
}

/// Payloads the NBD server hands over for ranges a client got wrong (past the end, across
/// it, where `offset + len` overflows), placed as the image asks and in slots it did not ask
/// for: refused as out of range, no panic (the server asks for the placement before it checks
/// the range), nothing written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn payloads_for_bad_ranges_are_refused() {
    let uri = unique("bad-payload");
    let suite = Suite::DEFAULT;
    let image = Image::create(&uri, &options(1 << 20, suite, LayoutKind::Unaligned), PASS)
        .await
        .unwrap();
    let slot = 4096 + suite.metadata_len();
    let in_slots =
        |len: u64| WritePayload::in_slots(vec![1u8; len as usize / 4096 * slot], 4096, slot);
    for (offset, len) in [
        (1u64 << 20, 4096u64),
        ((1 << 20) - 4096, 8192),
        (u64::MAX - 4095, 8192),
        (!4095, 4096),
        (!4095, 1 << 20),
    ] {
        let case = format!("{offset:#x} + {len}");
        let asked = match image.write_placement(offset, len) {
            PayloadPlacement::Slots { .. } => in_slots(len),
            PayloadPlacement::Contiguous { .. } => {
                WritePayload::contiguous(vec![1u8; len as usize])
            }
        };
        for payload in [asked, in_slots(len)] {
            let err = image.write_payload(offset, payload).await.unwrap_err();
            assert!(
                matches!(err, ImageError::OutOfRange { .. }),
                "{case}: {err}"
            );
        }
    }
    let mut back = vec![9u8; 1 << 20];
    image.read(0, &mut back).await.unwrap();
    assert!(
        back.iter().all(|&b| b == 0),
        "a refused payload left bytes behind"
    );
    image.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input() {
    let uri = unique("bad");
    let image = Image::create(
        &uri,
        &options(1 << 20, Suite::AesXtsPlain64, LayoutKind::None),
        PASS,
    )
    .await
    .unwrap();
    let err = image.write((1 << 20) - 10, &[1u8; 11]).await.unwrap_err();
    assert!(matches!(err, ImageError::OutOfRange { .. }), "{err}");
    // The same through `write_owned`: whole sectors inside one object past the end (the path
    // that encrypts in place), and whole sectors across the end: refused, nothing written.
    for (offset, len) in [(1 << 20, 512), ((1 << 20) - 512, 1024)] {
        let err = image.write_owned(offset, vec![1u8; len]).await.unwrap_err();
        assert!(matches!(err, ImageError::OutOfRange { .. }), "{err}");
    }
    let mut tail = vec![9u8; 512];
    image.read((1 << 20) - 512, &mut tail).await.unwrap();
    assert!(
        tail.iter().all(|&b| b == 0),
        "a refused write left bytes behind"
    );
    image.write_owned(4096, Vec::new()).await.unwrap();
    image.write(5, &[]).await.unwrap();
    let err = Image::open(&uri, b"wrong", &OpenOptions::read_only())
        .await
        .unwrap_err();
    assert!(matches!(err, ImageError::Header { .. }), "{err}");
    let err = Image::create(
        &uri,
        &options(1 << 20, Suite::DEFAULT, LayoutKind::None),
        PASS,
    )
    .await
    .unwrap_err();
    assert!(matches!(err, ImageError::InvalidParameter { .. }), "{err}");
    image.close().await.unwrap();
}
