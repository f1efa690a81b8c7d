//! Images on RADOS: the model-based randomized test (see model.rs) for the default suite on
//! every layout that holds its metadata, and `aes-xts-plain64` on `none`; and the writer lock
//! between two RADOS clients (each `Image::open` connects its own).
//!
//! The cluster comes from the environment (`CEPH_CONF`, optionally `IVDISK_RADOS_POOL`); each
//! test process works in a namespace of its own. `IVDISK_NO_CEPH=1` skips these tests, loudly.

mod common;

use std::time::Duration;

use common::{run_all, Backend, Case, PASS};
use ivdisk_crypto::Suite;
use ivdisk_header::{PbkdfKind, PbkdfRequest};
use ivdisk_image::{header_object_name, Fencing, Image, ImageError, LayoutKind, OpenOptions};
use ivdisk_store::{ObjectName, StoreError, WriteOp};

const OPS: usize = 300;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn model_rados() {
    if common::rados_uri("probe").is_none() {
        return;
    }
    let mut cases = Vec::new();
    for layout in LayoutKind::WITH_METADATA {
        assert!(layout.fits(Suite::DEFAULT.metadata_len()));
        cases.push(Case::new(
            Backend::Rados,
            Suite::DEFAULT,
            layout,
            4096,
            64 << 10,
            OPS,
        ));
    }
    cases.push(Case::new(
        Backend::Rados,
        Suite::AesXtsPlain64,
        LayoutKind::None,
        4096,
        64 << 10,
        OPS,
    ));
    // Objects whose metadata spans two 4 KiB blocks: writes of part of a block, rebuilt from
    // the writer's metadata cache.
    cases.push(Case::new(
        Backend::Rados,
        Suite::DEFAULT,
        LayoutKind::ObjectEnd,
        4096,
        1 << 20,
        OPS,
    ));
    // Small sectors and objects too, for the default layout.
    cases.push(Case::new(
        Backend::Rados,
        Suite::DEFAULT,
        LayoutKind::ObjectEnd,
        512,
        16 << 10,
        OPS,
    ));
    run_all("model_rados", cases).await;
}

/// A discard whose edge sector is partial, in an object never written: on RADOS omap removal
/// fails on a missing object, so the edge write must come first in the operation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rados_omap_discard_with_a_partial_edge_sector_in_a_missing_object() {
    let Some(uri) = common::rados_uri("discard-edge") else {
        return;
    };
    let options = common::options(1 << 20, Suite::DEFAULT, LayoutKind::Omap, 4096, 64 << 10);
    let image = Image::create(&uri, &options, PASS).await.unwrap();
    let result = image.discard(100, 3 * 4096).await;
    image.close().await.unwrap();
    Image::delete(&uri, |_, _| {}).await.unwrap();
    result.unwrap();
}

/// A 1 MiB image of the default suite in `omap-packed`, in 64 KiB objects.
fn small_image() -> ivdisk_image::CreateOptions {
    common::options(
        1 << 20,
        Suite::DEFAULT,
        LayoutKind::OmapPacked,
        4096,
        64 << 10,
    )
}

/// A write of a fenced writer: refused by the store, or by its renewal, which saw that first.
fn assert_fenced(write: Result<(), ImageError>) {
    match write {
        Err(ImageError::Store {
            source: StoreError::Fenced { .. },
            ..
        }) => {}
        Err(ImageError::LockLost { reason, .. }) if reason.contains("fenced") => {}
        other => panic!("the fenced writer wrote: {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writer_lock_between_two_rados_clients() {
    let Some(uri) = common::rados_uri("lock") else {
        return;
    };
    let options = common::options(
        1 << 20,
        Suite::DEFAULT,
        LayoutKind::ObjectEnd,
        4096,
        64 << 10,
    );
    let writer = Image::create(&uri, &options, PASS).await.unwrap();
    let client = writer.store().client_id().to_owned();
    match Image::open(&uri, PASS, &OpenOptions::default()).await {
        Err(ImageError::Locked { holder, .. }) => {
            assert!(holder.contains(&client), "{holder} does not name {client}")
        }
        other => panic!("a second RADOS writer: {other:?}"),
    }
    let holder = Image::lock_holder(&uri).await.unwrap().expect("held");
    assert_eq!(holder.client, client);

    // A reader on a third client sees what the writer wrote, and cannot write.
    let reader = Image::open(&uri, PASS, &OpenOptions::read_only())
        .await
        .unwrap();
    assert_ne!(reader.store().client_id(), client);
    writer.write(70_000, b"from the writer").await.unwrap();
    let mut buf = [0u8; 15];
    reader.read(70_000, &mut buf).await.unwrap();
    assert_eq!(&buf, b"from the writer");
    assert!(matches!(
        reader.write(0, b"x").await,
        Err(ImageError::ReadOnly { .. })
    ));

    // Closing frees the lock for another client.
    writer.close().await.unwrap();
    assert_eq!(Image::lock_holder(&uri).await.unwrap(), None);
    let short = OpenOptions {
        lock_duration: Duration::from_secs(3),
        // Refused at once while the lock is not renewed (these tests look for that).
        stalled_write_wait: Duration::ZERO,
        ..OpenOptions::default()
    };
    let second = Image::open(&uri, PASS, &short).await.unwrap();
    let second_client = second.store().client_id().to_owned();
    assert_ne!(second_client, client);
    assert_eq!(
        Image::lock_holder(&uri).await.unwrap().unwrap().client,
        second_client
    );

    // Broken and taken by a third client: the second was fenced first (blocklisted), so from
    // the third's first write on, nothing the second sends is applied.
    let broken = Image::break_lock(&uri, Fencing::Holder)
        .await
        .unwrap()
        .expect("a holder");
    assert_eq!(broken.holder.client, second_client);
    let fenced_at = broken.fenced_at.expect("a RADOS writer is fenced");
    let blocklist = common::ceph(&["osd", "blocklist", "ls"]);
    assert!(
        blocklist.contains(&fenced_at),
        "{fenced_at} not in the blocklist: {blocklist}"
    );
    let third = Image::open(&uri, PASS, &OpenOptions::default())
        .await
        .unwrap();
    third.write(0, b"new").await.unwrap();
    // Without fencing the second's writes would be applied until its renewal noticed. The
    // store refuses them, or the renewal (every second here) has seen that already.
    assert_fenced(second.write(0, b"old").await);
    // Its close has no lock to release, and says nothing failed that it could have done.
    second.close().await.unwrap();
    assert_eq!(
        Image::lock_holder(&uri).await.unwrap().unwrap().client,
        third.store().client_id()
    );
    let mut buf = [0u8; 3];
    reader.read(0, &mut buf).await.unwrap();
    assert_eq!(&buf, b"new");
    third.close().await.unwrap();
    reader.close().await.unwrap();
    Image::delete(&uri, |_, _| {}).await.unwrap();
    assert!(matches!(
        Image::info(&uri).await,
        Err(ImageError::NotFound { .. })
    ));
}

/// A writer whose lock went away without a close (here broken unfenced, as an expiry after a
/// pause or a network cut leaves it) is fenced by the next writer before that one writes; a
/// writer that closed is not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_next_writer_fences_one_that_did_not_close() {
    let Some(uri) = common::rados_uri("unclosed") else {
        return;
    };
    let options = small_image();
    Image::create(&uri, &options, PASS)
        .await
        .unwrap()
        .close()
        .await
        .unwrap();
    let address = |holder: Option<ivdisk_store::Locker>| {
        holder
            .expect("held")
            .address
            .expect("RADOS names the holder's address")
    };

    // Closed: the next writer fences nothing.
    let closed = Image::open(&uri, PASS, &OpenOptions::default())
        .await
        .unwrap();
    let closed_at = address(Image::lock_holder(&uri).await.unwrap());
    closed.close().await.unwrap();
    let first = Image::open(&uri, PASS, &OpenOptions::default())
        .await
        .unwrap();
    assert!(
        !common::ceph(&["osd", "blocklist", "ls"]).contains(&closed_at),
        "a writer that closed was fenced"
    );

    // Gone without a close: fenced when the next writer takes the lock.
    let first_at = address(Image::lock_holder(&uri).await.unwrap());
    first.write(0, b"first").await.unwrap();
    let broken = Image::break_lock(&uri, Fencing::Skip).await.unwrap();
    assert_eq!(broken.expect("a holder").fenced_at, None);
    assert!(!common::ceph(&["osd", "blocklist", "ls"]).contains(&first_at));
    let second = Image::open(&uri, PASS, &OpenOptions::default())
        .await
        .unwrap();
    assert!(
        common::ceph(&["osd", "blocklist", "ls"]).contains(&first_at),
        "the writer that did not close is not fenced"
    );
    assert_fenced(first.write(0, b"stale").await);
    second.write(5, b"second").await.unwrap();
    let mut buf = [0u8; 11];
    second.read(0, &mut buf).await.unwrap();
    assert_eq!(&buf, b"firstsecond");
    first.close().await.unwrap();
    second.close().await.unwrap();
    Image::delete(&uri, |_, _| {}).await.unwrap();
}

/// Keyslot changes on RADOS while the image's writer runs on another client: each reads the
/// header without the writer lock and stores one version-asserted operation; the writer goes
/// on, and the image opens with the passphrases now in it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn passphrases_change_while_the_writer_runs() {
    let Some(uri) = common::rados_uri("keys") else {
        return;
    };
    let options = small_image();
    let fast = PbkdfRequest::fast_for_tests(PbkdfKind::Pbkdf2);
    let writer = Image::create(&uri, &options, PASS).await.unwrap();
    writer.write(0, &[0x3c; 8192]).await.unwrap();
    assert_eq!(Image::check_passphrase(&uri, PASS).await.unwrap(), 0);
    let added = Image::add_passphrase(&uri, PASS, b"second", &fast)
        .await
        .unwrap();
    assert_eq!(added, 1);
    // Made from the header before that addition: refused, not overwriting it.
    let (_, stale) = Image::prepare_change_passphrase(&uri, PASS, b"late", None, &fast)
        .await
        .unwrap();
    assert_eq!(
        Image::change_passphrase(&uri, b"second", b"third", None, &fast)
            .await
            .unwrap(),
        1
    );
    assert!(matches!(
        stale.store().await,
        Err(ImageError::HeaderChanged { .. })
    ));
    assert_eq!(
        Image::remove_passphrase(&uri, b"third", Some(0), false)
            .await
            .unwrap(),
        0
    );
    writer.write(8192, &[0x4d; 4096]).await.unwrap();
    writer.close().await.unwrap();

    assert_eq!(Image::info(&uri).await.unwrap().keyslots, vec![1]);
    assert!(Image::check_passphrase(&uri, PASS).await.is_err());
    assert!(Image::check_passphrase(&uri, b"late").await.is_err());
    let reopened = Image::open(&uri, b"third", &OpenOptions::read_only())
        .await
        .unwrap();
    let mut back = vec![0u8; 12288];
    reopened.read(0, &mut back).await.unwrap();
    assert!(back[..8192].iter().all(|&b| b == 0x3c) && back[8192..].iter().all(|&b| b == 0x4d));
    reopened.close().await.unwrap();
    Image::delete(&uri, |_, _| {}).await.unwrap();
}

/// RADOS images send the writes that queue on one object as one operation
/// (`ivdisk_store::CoalescingStore`): many concurrent writes into one object, with reads among
/// them, read back as written, from the writer and after reopening (the metadata the merged
/// operations stored, not only the writer's cache).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_writes_in_one_object_read_back_after_merging() {
    let Some(uri) = common::rados_uri("merged") else {
        return;
    };
    const SECTOR: usize = 4096;
    let options = common::options(
        2 << 20,
        Suite::DEFAULT,
        LayoutKind::ObjectEnd,
        SECTOR as u32,
        1 << 20,
    );
    let image = Image::create(&uri, &options, PASS).await.unwrap();
    assert!(image.store().merges_operations());
    let mut expected = vec![0u8; 2 << 20];

    // Wave 1: 256 single-sector writes at once, all of object 0 (and its metadata blocks).
    let wave: Vec<(usize, Vec<u8>)> = (0..256)
        .map(|i| (i * SECTOR, vec![(i % 251) as u8 + 1; SECTOR]))
        .collect();
    // Wave 2: two-sector writes over the second half of object 0 and into object 1, and a
    // sub-sector write in each of their sectors' middles, with reads of wave 1's first half.
    let wave2: Vec<(usize, Vec<u8>)> = (0..96)
        .map(|i| {
            (
                128 * SECTOR + i * 2 * SECTOR,
                vec![0xa0 ^ i as u8; 2 * SECTOR],
            )
        })
        .collect();
    let wave3: Vec<(usize, Vec<u8>)> = (0..192)
        .map(|i| (128 * SECTOR + i * SECTOR + 1000, vec![0x5c ^ i as u8; 100]))
        .collect();
    for batch in [&wave, &wave2, &wave3] {
        let image = &image;
        let writes = futures_util::future::join_all(
            batch.iter().map(|(at, data)| image.write(*at as u64, data)),
        );
        let reads = futures_util::future::join_all((0..32).map(|i| async move {
            let mut buf = vec![0u8; SECTOR];
            image.read((i * SECTOR) as u64, &mut buf).await.map(|_| buf)
        }));
        let (written, read) = tokio::join!(writes, reads);
        for result in written {
            result.unwrap();
        }
        for buf in read {
            // Wave 1's sectors, or zeros while wave 1 is still going.
            let buf = buf.unwrap();
            assert!(buf.iter().all(|&b| b == buf[0]), "a torn sector");
        }
        for (at, data) in batch.iter() {
            expected[*at..*at + data.len()].copy_from_slice(data);
        }
    }
    let mut all = vec![0u8; expected.len()];
    image.read(0, &mut all).await.unwrap();
    assert!(all == expected, "the writer reads back something else");
    image.close().await.unwrap();

    let reopened = Image::open(&uri, PASS, &OpenOptions::read_only())
        .await
        .unwrap();
    let mut all = vec![0u8; expected.len()];
    reopened.read(0, &mut all).await.unwrap();
    assert!(
        all == expected,
        "the reopened image reads back something else"
    );
}

/// A reader that opens while a removal is recorded in the header (as `delete` and `snap rm`
/// record theirs before asking the watchers) gives up; a record whose writer lock is gone (a
/// removal that failed or crashed) counts for nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_gives_up_while_a_removal_is_recorded() {
    let Some(uri) = common::rados_uri("removing") else {
        return;
    };
    let options = small_image();
    let writer = Image::create(&uri, &options, PASS).await.unwrap();
    let holder = Image::lock_holder(&uri).await.unwrap().expect("held");
    let header = ObjectName::new(header_object_name(uri.image_name())).unwrap();
    let record = |what: &str| {
        WriteOp::new().omap_set(vec![(
            b"ivdisk.removing".to_vec(),
            format!("{} {what}", holder.cookie).into_bytes(),
        )])
    };
    let snapshot = writer.create_snapshot("kept").await.unwrap();
    let at_snapshot = OpenOptions {
        snapshot: Some("kept".into()),
        ..OpenOptions::read_only()
    };

    // The removal of another snapshot keeps no one from reading this one or the head.
    let other = format!("snap:{}", snapshot.id + 1);
    writer
        .store()
        .write_op(&header, record(&other))
        .await
        .unwrap();
    let reader = Image::open(&uri, PASS, &at_snapshot).await.unwrap();
    reader.close().await.unwrap();
    // The removal of this snapshot does.
    let this = format!("snap:{}", snapshot.id);
    writer
        .store()
        .write_op(&header, record(&this))
        .await
        .unwrap();
    let refused = Image::open(&uri, PASS, &at_snapshot).await;
    assert!(
        matches!(&refused, Err(ImageError::RemovalUnderway { image }) if image == &uri.at_snapshot("kept")),
        "{refused:?}"
    );
    Image::open(&uri, PASS, &OpenOptions::read_only())
        .await
        .unwrap()
        .close()
        .await
        .unwrap();
    // The removal of the image refuses every reader.
    writer
        .store()
        .write_op(&header, record("head"))
        .await
        .unwrap();
    for options in [&at_snapshot, &OpenOptions::read_only()] {
        let refused = Image::open(&uri, PASS, options).await;
        assert!(
            matches!(refused, Err(ImageError::RemovalUnderway { .. })),
            "{refused:?}"
        );
    }

    // The writer lock the record names is gone: the record is void.
    writer.close().await.unwrap();
    let reader = Image::open(&uri, PASS, &OpenOptions::read_only())
        .await
        .unwrap();
    reader.close().await.unwrap();
    Image::remove_snapshot(&uri, "kept").await.unwrap();
    Image::delete(&uri, |_, _| {}).await.unwrap();
}
