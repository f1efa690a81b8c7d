//! An image's life on the memory and local backends: resize (grow; shrink only with the
//! flag), delete, the writer lock (refusal naming the holder, readers alongside, expiry of a
//! dead holder's lock, renewal, breaking), and bad input.

mod common;

use std::time::{Duration, Instant};

use common::{Backend, Rng, PASS};
use ivdisk_crypto::Suite;
use ivdisk_image::{
    data_object_prefix, header_object_name, CreateOptions, Fencing, Image, ImageError, ImageUri,
    LayoutKind, OpenOptions, WRITER_LOCK,
};
use ivdisk_store::{LockRequest, ObjectName, ObjectStore, ObjectStoreExt};

const MIB: u64 = 1 << 20;
const OBJECT_SIZE: u64 = 64 << 10;

fn opts(size: u64) -> CreateOptions {
    common::options(
        size,
        Suite::DEFAULT,
        LayoutKind::ObjectEnd,
        4096,
        OBJECT_SIZE,
    )
}

/// The image's data objects, by number.
async fn data_objects(image: &Image) -> Vec<u64> {
    let prefix = data_object_prefix(&image.image_id());
    image
        .store()
        .list(&prefix)
        .await
        .unwrap()
        .iter()
        .map(|o| u64::from_str_radix(&o.as_str()[prefix.len()..], 16).unwrap())
        .collect()
}

fn header_object(uri: &ImageUri) -> ObjectName {
    ObjectName::new(header_object_name(uri.image_name())).unwrap()
}

async fn read(image: &Image, offset: u64, len: u64) -> Vec<u8> {
    let mut buf = vec![0xEEu8; len as usize];
    image
        .read(offset, &mut buf)
        .await
        .unwrap_or_else(|e| panic!("read [{offset}, +{len}): {e}"));
    buf
}

fn is_zero(bytes: &[u8]) -> bool {
    bytes.iter().all(|&b| b == 0)
}

fn out_of_range(result: Result<(), ImageError>, what: &str) {
    match result {
        Err(ImageError::OutOfRange { .. }) => {}
        other => panic!("{what}: expected OutOfRange, got {other:?}"),
    }
}

// ---------------------------------------------------------------------------------------------
// Resize

async fn grow(backend: Backend) {
    let place = common::place(backend, "grow");
    let image = Image::create(&place.uri, &opts(MIB), PASS).await.unwrap();
    let tail = Rng::new(1).bytes(5000);
    image.write(MIB - 5000, &tail).await.unwrap();
    let new_size = MIB + MIB / 2 + 3 * 4096;
    image.resize(new_size, false).await.unwrap();
    assert_eq!(image.size(), new_size);
    assert_eq!(Image::info(&place.uri).await.unwrap().size, new_size);
    assert_eq!(read(&image, MIB - 5000, 5000).await, tail);
    assert!(is_zero(&read(&image, MIB, new_size - MIB).await));
    // IO across the old end and up to the new one.
    let across = Rng::new(2).bytes(10_000);
    image.write(MIB - 3000, &across).await.unwrap();
    image.write(new_size - 1, &[9]).await.unwrap();
    out_of_range(image.write(new_size, &[9]).await, "write at the new end");
    // Not a sector multiple, or zero: refused, nothing changes.
    for bad in [new_size + 100, 0] {
        let err = image.resize(bad, true).await.unwrap_err();
        assert!(matches!(err, ImageError::InvalidParameter { .. }), "{err}");
    }
    assert_eq!(image.size(), new_size);
    image.close().await.unwrap();

    let image = Image::open(&place.uri, PASS, &OpenOptions::default())
        .await
        .unwrap();
    assert_eq!(image.size(), new_size);
    assert_eq!(read(&image, MIB - 3000, 10_000).await, across);
    assert_eq!(read(&image, MIB - 5000, 2000).await, tail[..2000]);
    assert_eq!(read(&image, new_size - 1, 1).await, [9]);
    image.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grow_keeps_data_and_reads_zeros_past_the_old_end_memory() {
    grow(Backend::Memory).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grow_keeps_data_and_reads_zeros_past_the_old_end_local() {
    grow(Backend::Local).await;
}

async fn shrink(backend: Backend) {
    let place = common::place(backend, "shrink");
    let image = Image::create(&place.uri, &opts(MIB), PASS).await.unwrap();
    let content = Rng::new(3).bytes(MIB as usize);
    image.write(0, &content).await.unwrap();
    assert_eq!(data_objects(&image).await, (0..16).collect::<Vec<_>>());

    // Not an object multiple: object 4 keeps its first 11 sectors.
    let new_size = 4 * OBJECT_SIZE + 11 * 4096;
    let err = image.resize(new_size, false).await.unwrap_err();
    assert!(
        matches!(&err, ImageError::InvalidParameter { reason, .. } if reason.contains("shrink")),
        "{err}"
    );
    assert_eq!(image.size(), MIB, "a refused shrink changes nothing");
    assert_eq!(Image::info(&place.uri).await.unwrap().size, MIB);
    assert_eq!(read(&image, 0, MIB).await, content);

    image.resize(new_size, true).await.unwrap();
    assert_eq!(image.size(), new_size);
    assert_eq!(Image::info(&place.uri).await.unwrap().size, new_size);
    assert_eq!(
        read(&image, 0, new_size).await,
        content[..new_size as usize]
    );
    out_of_range(
        image.read(new_size - 1, &mut [0; 2]).await,
        "read past the new end",
    );
    out_of_range(image.write(new_size, &[1]).await, "write past the new end");
    // The objects wholly past the end are gone.
    assert_eq!(data_objects(&image).await, (0..5).collect::<Vec<_>>());

    // Growing again does not bring the old data back.
    image.resize(MIB, false).await.unwrap();
    assert_eq!(
        read(&image, 0, new_size).await,
        content[..new_size as usize]
    );
    assert!(is_zero(&read(&image, new_size, MIB - new_size).await));
    image.close().await.unwrap();
    let image = Image::open(&place.uri, PASS, &OpenOptions::read_only())
        .await
        .unwrap();
    assert_eq!(image.size(), MIB);
    assert_eq!(
        read(&image, 0, new_size).await,
        content[..new_size as usize]
    );
    assert!(is_zero(&read(&image, new_size, MIB - new_size).await));
    // A read-only image cannot be resized.
    let err = image.resize(2 * MIB, false).await.unwrap_err();
    assert!(matches!(err, ImageError::ReadOnly { .. }), "{err}");
    image.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shrink_needs_the_flag_and_discards_what_lies_past_the_new_end_memory() {
    shrink(Backend::Memory).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shrink_needs_the_flag_and_discards_what_lies_past_the_new_end_local() {
    shrink(Backend::Local).await;
}

// ---------------------------------------------------------------------------------------------
// Delete

async fn delete(backend: Backend) {
    let place = common::place(backend, "delete");
    let uri = &place.uri;
    let image = Image::create(uri, &opts(MIB), PASS).await.unwrap();
    for object in [0, 3, 7, 15] {
        image
            .write(object * OBJECT_SIZE + 100, b"data")
            .await
            .unwrap();
    }
    assert_eq!(data_objects(&image).await, [0, 3, 7, 15]);
    let prefix = data_object_prefix(&image.image_id());
    let old_id = image.image_id();

    // Refused while a writer has it; nothing is removed.
    let err = Image::delete(uri, |_, _| {}).await.unwrap_err();
    assert!(matches!(err, ImageError::Locked { .. }), "{err}");
    assert_eq!(data_objects(&image).await, [0, 3, 7, 15]);
    assert_eq!(read(&image, 7 * OBJECT_SIZE + 100, 4).await, b"data");
    image.close().await.unwrap();

    let mut progress = Vec::new();
    Image::delete(uri, |done, all| progress.push((done, all)))
        .await
        .unwrap();
    assert_eq!(progress.last(), Some(&(4, 4)), "{progress:?}");
    let store = uri.open_store(false).await.unwrap();
    assert_eq!(store.list(&prefix).await.unwrap(), vec![]);
    assert_eq!(store.stat(&header_object(uri)).await.unwrap(), None);
    drop(store);
    for result in [
        Image::open(uri, PASS, &OpenOptions::default())
            .await
            .map(drop),
        Image::open(uri, PASS, &OpenOptions::read_only())
            .await
            .map(drop),
        Image::info(uri).await.map(drop),
        Image::lock_holder(uri).await.map(drop),
        Image::delete(uri, |_, _| {}).await,
    ] {
        assert!(
            matches!(result, Err(ImageError::NotFound { .. })),
            "{result:?}"
        );
    }
    // The name can be used again: a new image, with nothing of the old one.
    let image = Image::create(uri, &opts(MIB), PASS).await.unwrap();
    assert_ne!(image.image_id(), old_id);
    assert!(is_zero(&read(&image, 0, MIB).await));
    image.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delete_removes_every_object_and_the_header_memory() {
    delete(Backend::Memory).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delete_removes_every_object_and_the_header_local() {
    delete(Backend::Local).await;
}

/// An image made to be filled (an import) opens nowhere else until it is marked filled: one
/// whose filler stopped part-way (killed) is refused by every open, a snapshot's included, with
/// what filled it named; `delete` removes it. Once marked, it opens as any other.
async fn fill(backend: Backend) {
    let place = common::place(backend, "fill");
    let uri = &place.uri;
    let what = "an import of disk.raw";
    let image = Image::create_to_fill(uri, &opts(MIB), PASS, what)
        .await
        .unwrap();
    image.write(0, b"half").await.unwrap();
    image.close().await.unwrap();
    for result in [
        Image::open(uri, PASS, &OpenOptions::default())
            .await
            .map(drop),
        Image::open(uri, PASS, &OpenOptions::read_only())
            .await
            .map(drop),
    ] {
        match result {
            Err(e @ ImageError::FillUnfinished { .. }) => {
                let ImageError::FillUnfinished { what: named, .. } = &e else {
                    unreachable!()
                };
                assert_eq!(named, what);
                // The check cannot tell a killed command from one still running (its writer
                // lock tells): the message says how to tell, and what to do in each case.
                let text = e.to_string();
                assert!(
                    text.contains("if that command is still running (`ivdisk lock status")
                        && text.contains("wait for it")
                        && text.contains("ivdisk delete"),
                    "{text}"
                );
            }
            other => panic!("{other:?}"),
        }
    }
    Image::delete(uri, |_, _| {}).await.unwrap();

    let image = Image::create_to_fill(uri, &opts(MIB), PASS, what)
        .await
        .unwrap();
    image.write(0, b"full").await.unwrap();
    image.mark_filled().await.unwrap();
    image.close().await.unwrap();
    let image = Image::open(uri, PASS, &OpenOptions::read_only())
        .await
        .unwrap();
    assert_eq!(read(&image, 0, 4).await, b"full");
    image.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_image_being_filled_opens_only_once_filled_memory() {
    fill(Backend::Memory).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_image_being_filled_opens_only_once_filled_local() {
    fill(Backend::Local).await;
}

/// On RADOS the writer lock lives in the header object, and `delete` removes that object while
/// it holds the lock: the unlock after it finds nothing, which must not fail the delete.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delete_removes_every_object_and_the_header_rados() {
    if common::rados_uri("probe").is_none() {
        return;
    }
    delete(Backend::Rados).await;
}

// ---------------------------------------------------------------------------------------------
// The writer lock

async fn second_writer(backend: Backend) {
    let place = common::place(backend, "writer");
    let uri = &place.uri;
    let writer = Image::create(uri, &opts(MIB), PASS).await.unwrap();
    let client = writer.store().client_id().to_owned();
    match Image::open(uri, PASS, &OpenOptions::default()).await {
        Err(ImageError::Locked {
            holder, expires_in, ..
        }) => {
            assert!(holder.contains(&client), "{holder} does not name {client}");
            let left = expires_in.expect("the writer lock expires unless renewed");
            assert!(left <= Duration::from_secs(30), "{left:?}");
        }
        other => panic!("a second writer: {other:?}"),
    }
    let holder = Image::lock_holder(uri).await.unwrap().expect("a holder");
    assert_eq!(holder.client, client);
    assert!(
        holder
            .description
            .contains(&format!("pid {}", std::process::id())),
        "{holder:?}"
    );

    // Readers open alongside, see the writer's writes, and cannot write.
    let r1 = Image::open(uri, PASS, &OpenOptions::read_only())
        .await
        .unwrap();
    let r2 = Image::open(uri, PASS, &OpenOptions::read_only())
        .await
        .unwrap();
    assert!(r1.is_read_only() && !writer.is_read_only());
    writer.write(4000, &[7u8; 300]).await.unwrap();
    assert_eq!(read(&r1, 4000, 300).await, [7u8; 300]);
    assert_eq!(read(&r2, 3999, 302).await[1..301], [7u8; 300]);
    for result in [
        r1.write(0, &[1]).await,
        r1.discard(0, 4096).await,
        r1.write_zeroes(0, 4096, false).await,
        r1.resize(2 * MIB, false).await,
    ] {
        assert!(
            matches!(result, Err(ImageError::ReadOnly { .. })),
            "{result:?}"
        );
    }
    // Still only the one writer.
    assert!(matches!(
        Image::open(uri, PASS, &OpenOptions::default()).await,
        Err(ImageError::Locked { .. })
    ));

    // Closing the writer frees the lock; a new writer opens while the readers stay open.
    let clone = writer.clone();
    writer.close().await.unwrap();
    assert_eq!(Image::lock_holder(uri).await.unwrap(), None);
    let err = clone.write(0, &[1]).await.unwrap_err();
    assert!(matches!(err, ImageError::LockLost { .. }), "{err}");
    assert_eq!(
        read(&clone, 4000, 300).await,
        [7u8; 300],
        "a closed clone still reads"
    );
    drop(clone);
    let second = Image::open(uri, PASS, &OpenOptions::default())
        .await
        .unwrap_or_else(|e| panic!("a writer after the first closed: {e}"));
    second.write(0, &[5]).await.unwrap();
    assert_eq!(read(&r1, 0, 1).await, [5]);
    second.close().await.unwrap();
    r1.close().await.unwrap();
    r2.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn second_writer_is_refused_naming_the_holder_and_readers_open_alongside_memory() {
    second_writer(Backend::Memory).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn second_writer_is_refused_naming_the_holder_and_readers_open_alongside_local() {
    second_writer(Backend::Local).await;
}

/// A local image's store is shared by everything in the process that opened it; opening a
/// writer must work whichever of the earlier openers is still open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_writer_reopens_while_a_reader_outlives_the_first_opener() {
    let local = common::local_dir();
    let writer = Image::create(&local.uri, &opts(MIB), PASS).await.unwrap();
    let reader = Image::open(&local.uri, PASS, &OpenOptions::read_only())
        .await
        .unwrap();
    writer.close().await.unwrap();
    let again = Image::open(&local.uri, PASS, &OpenOptions::default())
        .await
        .unwrap_or_else(|e| panic!("reopening for writing while a reader is open: {e}"));
    again.write(0, b"x").await.unwrap();
    assert_eq!(read(&reader, 0, 1).await, b"x");
    again.close().await.unwrap();
    reader.close().await.unwrap();
}

/// What a writer that died leaves: its lock, not renewed. Taken here directly on the store
/// by another client, as that writer would have.
async fn expired_lock(backend: Backend) {
    let place = common::place(backend, "expiry");
    let uri = &place.uri;
    Image::create(uri, &opts(MIB), PASS)
        .await
        .unwrap()
        .close()
        .await
        .unwrap();
    let dead = uri.open_store(false).await.unwrap();
    let duration = Duration::from_secs(4);
    let taken = Instant::now();
    dead.lock_exclusive(
        &header_object(uri),
        LockRequest {
            name: WRITER_LOCK.into(),
            cookie: "dead-writer".into(),
            description: "an ivdisk that crashed".into(),
            duration: Some(duration),
            renew: false,
        },
    )
    .await
    .unwrap();
    for _ in 0..2 {
        match Image::open(uri, PASS, &OpenOptions::default()).await {
            Err(ImageError::Locked {
                holder, expires_in, ..
            }) => {
                assert!(holder.contains(dead.client_id()), "{holder}");
                assert!(holder.contains("crashed"), "{holder}");
                assert!(expires_in.is_some_and(|d| d <= duration), "{expires_in:?}");
            }
            other => panic!("open while a dead writer's lock lives: {other:?}"),
        }
        // Well before the expiry: still refused.
        tokio::time::sleep_until((taken + Duration::from_millis(1500)).into()).await;
    }
    assert!(
        taken.elapsed() < duration,
        "the machine is too slow for this test"
    );
    // Past the expiry (with a generous margin).
    tokio::time::sleep_until((taken + duration + Duration::from_millis(1500)).into()).await;
    let writer = Image::open(uri, PASS, &OpenOptions::default())
        .await
        .unwrap_or_else(|e| panic!("open after the dead writer's lock expired: {e}"));
    let holder = Image::lock_holder(uri).await.unwrap().unwrap();
    assert_eq!(holder.client, writer.store().client_id());
    writer.write(0, b"mine").await.unwrap();
    writer.close().await.unwrap();
    drop(dead);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_writers_lock_refuses_writers_until_it_expires_memory() {
    expired_lock(Backend::Memory).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_writers_lock_refuses_writers_until_it_expires_local() {
    expired_lock(Backend::Local).await;
}

/// A lock of 3 s renewed every second outlives 7 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_writer_lock_is_renewed_while_the_image_is_open() {
    let uri = common::mem_uri("renew");
    Image::create(&uri, &opts(MIB), PASS)
        .await
        .unwrap()
        .close()
        .await
        .unwrap();
    let options = OpenOptions {
        lock_duration: Duration::from_secs(3),
        // Refused at once while the lock is not renewed (these tests look for that).
        stalled_write_wait: Duration::ZERO,
        ..OpenOptions::default()
    };
    let writer = Image::open(&uri, PASS, &options).await.unwrap();
    tokio::time::sleep(Duration::from_secs(7)).await;
    match Image::open(&uri, PASS, &OpenOptions::default()).await {
        Err(ImageError::Locked { holder, .. }) => {
            assert!(holder.contains(writer.store().client_id()), "{holder}")
        }
        other => panic!("a second writer 7 s into a renewed 3 s lock: {other:?}"),
    }
    let holder = Image::lock_holder(&uri).await.unwrap().expect("still held");
    assert_eq!(holder.client, writer.store().client_id());
    assert!(holder
        .expires_in
        .is_some_and(|d| d <= Duration::from_secs(3)));
    writer.write(0, b"still the writer").await.unwrap();
    writer.close().await.unwrap();
    Image::open(&uri, PASS, &OpenOptions::default())
        .await
        .unwrap()
        .close()
        .await
        .unwrap();
}

/// Poll `writer` with writes until one fails `LockLost`; panics past `deadline`.
async fn wait_for_lock_lost(writer: &Image, deadline: Duration) -> Duration {
    let start = Instant::now();
    loop {
        match writer.write(8192, b"old writer").await {
            Err(ImageError::LockLost { .. }) => return start.elapsed(),
            Ok(()) if start.elapsed() < deadline => {}
            other => panic!(
                "the old writer after {:?} (deadline {deadline:?}): {other:?}",
                start.elapsed()
            ),
        }
        // Timing, not synchronization: the renewal thread runs every lock_duration / 3.
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

const SHORT_LOCK: Duration = Duration::from_secs(3);

async fn writer_with_short_lock(prefix: &str) -> (ImageUri, Image) {
    let uri = common::mem_uri(prefix);
    Image::create(&uri, &opts(MIB), PASS)
        .await
        .unwrap()
        .close()
        .await
        .unwrap();
    let options = OpenOptions {
        lock_duration: SHORT_LOCK,
        // Refused at once while the lock is not renewed (these tests look for that).
        stalled_write_wait: Duration::ZERO,
        ..OpenOptions::default()
    };
    let writer = Image::open(&uri, PASS, &options).await.unwrap();
    writer.write(0, b"before").await.unwrap();
    (uri, writer)
}

/// `break_lock` of `writer`'s lock, which a memory store breaks without fencing.
async fn break_writer_lock(uri: &ImageUri, writer: &Image) {
    let broken = Image::break_lock(uri, Fencing::Holder)
        .await
        .unwrap()
        .expect("a holder");
    assert_eq!(broken.holder.client, writer.store().client_id());
    assert_eq!(broken.fenced_at, None, "a memory store needs no fencing");
}

/// `break_lock` alone (no new writer yet): the old writer's next renewal must notice, and its
/// writes fail from then on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_lock_makes_the_old_writer_refuse_writes() {
    let (uri, writer) = writer_with_short_lock("break").await;
    break_writer_lock(&uri, &writer).await;
    let took = wait_for_lock_lost(&writer, SHORT_LOCK / 3 + Duration::from_secs(2)).await;
    eprintln!("the old writer noticed after {took:?}");
    assert_eq!(read(&writer, 0, 6).await, b"before", "reads still work");
    assert_eq!(
        Image::lock_holder(&uri).await.unwrap(),
        None,
        "the old writer did not take the lock back"
    );
    writer.close().await.unwrap();
}

/// `break_lock`, then a new writer: the old one's writes fail once its renewal notices; the
/// new writer keeps the lock, also after the old one closes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_lock_taken_by_a_new_writer_makes_the_old_writer_refuse_writes() {
    let (uri, writer) = writer_with_short_lock("break-new").await;
    break_writer_lock(&uri, &writer).await;
    let second = Image::open(&uri, PASS, &OpenOptions::default())
        .await
        .unwrap();
    let took = wait_for_lock_lost(&writer, SHORT_LOCK / 3 + Duration::from_secs(2)).await;
    eprintln!("the old writer noticed after {took:?}");
    for result in [
        writer.write(0, b"x").await,
        writer.discard(0, 4096).await,
        writer.write_zeroes(0, 4096, true).await,
        writer.resize(2 * MIB, false).await,
    ] {
        assert!(
            matches!(result, Err(ImageError::LockLost { .. })),
            "{result:?}"
        );
    }
    second.write(0, b"second").await.unwrap();
    assert_eq!(
        read(&writer, 0, 6).await,
        b"second",
        "the old writer still reads"
    );
    writer.close().await.unwrap();
    let holder = Image::lock_holder(&uri).await.unwrap().expect("held");
    assert_eq!(holder.client, second.store().client_id());
    second.close().await.unwrap();
    assert_eq!(Image::lock_holder(&uri).await.unwrap(), None);
    // Nothing to break now.
    assert_eq!(
        Image::break_lock(&uri, Fencing::Holder).await.unwrap(),
        None
    );
}

/// A lock break confirmed for one holder does not break a lock that changed hands meanwhile
/// (a restarted server took it over while `ivdisk lock break` asked): the new holder is a
/// live writer. It was fenced and broken whoever held the lock by then.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_break_confirmed_for_one_holder_spares_the_next() {
    let (uri, writer) = writer_with_short_lock("break-confirmed").await;
    let first = Image::lock_holder(&uri).await.unwrap().expect("held");
    break_writer_lock(&uri, &writer).await;
    // (Its lock is gone: its close says so.)
    let _ = writer.close().await;
    let second = Image::open(&uri, PASS, &OpenOptions::default())
        .await
        .unwrap();
    match Image::break_lock_of(&uri, Fencing::Holder, Some(&first)).await {
        Err(ImageError::Locked { holder, .. }) => {
            assert!(holder.contains(second.store().client_id()), "{holder}")
        }
        other => panic!("breaking the first holder's lock, now the second's: {other:?}"),
    }
    second.write(0, b"still the writer").await.unwrap();
    let now = Image::lock_holder(&uri).await.unwrap().expect("held");
    assert_eq!(now.client, second.store().client_id());
    // Confirmed for the holder it has: broken.
    let broken = Image::break_lock_of(&uri, Fencing::Holder, Some(&now))
        .await
        .unwrap()
        .expect("a holder");
    assert_eq!(broken.holder.cookie, now.cookie);
    let _ = second.close().await;
}

// ---------------------------------------------------------------------------------------------
// Bad input

async fn io_past_the_end(backend: Backend) {
    let place = common::place(backend, "range");
    let size = MIB;
    let image = Image::create(&place.uri, &opts(size), PASS).await.unwrap();
    let tail = Rng::new(4).bytes(OBJECT_SIZE as usize);
    image.write(size - OBJECT_SIZE, &tail).await.unwrap();
    for (offset, len) in [
        (size - 10, 11),
        (size - 1, 2),
        (size, 1),
        (size + 4096, 4096),
        (0, size + 1),
        (u64::MAX - 5, 10),
        (u64::MAX, 1),
    ] {
        let what = format!("[{offset}, +{len})");
        match image.write(offset, &vec![0xAB; len as usize]).await {
            Err(ImageError::OutOfRange {
                offset: o,
                len: l,
                size: s,
                ..
            }) => assert_eq!((o, l, s), (offset, len, size), "{what}"),
            other => panic!("write {what}: {other:?}"),
        }
        out_of_range(image.discard(offset, len).await, &format!("discard {what}"));
        out_of_range(
            image.write_zeroes(offset, len, true).await,
            &format!("write_zeroes unmap {what}"),
        );
        out_of_range(
            image.write_zeroes(offset, len, false).await,
            &format!("write_zeroes {what}"),
        );
        out_of_range(
            image.read(offset, &mut vec![0; len as usize]).await,
            &format!("read {what}"),
        );
    }
    assert_eq!(read(&image, size - OBJECT_SIZE, OBJECT_SIZE).await, tail);
    image.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn io_past_the_end_is_refused_and_changes_nothing_memory() {
    io_past_the_end(Backend::Memory).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn io_past_the_end_is_refused_and_changes_nothing_local() {
    io_past_the_end(Backend::Local).await;
}

/// Discarding a range whose first (or last) sector is partial in an object that was never
/// written: the edge sector is zeroed in place and the whole sectors are already unwritten.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn discard_with_a_partial_edge_sector_in_a_missing_object() {
    for backend in Backend::LOCAL {
        for layout in LayoutKind::WITH_METADATA {
            let place = common::place(backend, "discard-edge");
            let image = Image::create(
                &place.uri,
                &common::options(MIB, Suite::DEFAULT, layout, 4096, OBJECT_SIZE),
                PASS,
            )
            .await
            .unwrap();
            // Head partial (sector 0), whole sectors 1..3, all in missing object 0.
            for (offset, len, may_unmap) in [
                (100, 3 * 4096, None),
                (OBJECT_SIZE + 5, 2 * 4096, Some(true)),
            ] {
                let result = match may_unmap {
                    None => image.discard(offset, len).await,
                    Some(unmap) => image.write_zeroes(offset, len, unmap).await,
                };
                result.unwrap_or_else(|e| panic!("{backend:?}/{layout}: [{offset}, +{len}): {e}"));
            }
            // Tail partial too, after data was written around it.
            image
                .write(2 * OBJECT_SIZE, &[7u8; 3 * 4096])
                .await
                .unwrap();
            image
                .discard(2 * OBJECT_SIZE + 4096, 4096 + 10)
                .await
                .unwrap();
            let back = read(&image, 2 * OBJECT_SIZE, 3 * 4096).await;
            assert!(back[..4096].iter().all(|&b| b == 7));
            assert!(is_zero(&back[4096..2 * 4096 + 10]));
            assert!(back[2 * 4096 + 10..].iter().all(|&b| b == 7));
            assert!(is_zero(&read(&image, 0, 2 * OBJECT_SIZE).await));
            image.close().await.unwrap();
        }
    }
}

/// The memory store (behind every `mem:` image of a process) must survive freeing the data it
/// appended last. Checked on a private store, so that the failure kills only it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_store_survives_freeing_its_newest_data() {
    use ivdisk_store::{MemoryStore, WriteOp, WriteStep};
    let store = MemoryStore::new().unwrap();
    let object = ObjectName::new("newest").unwrap();
    store.write(&object, 0, &[1u8; 100]).await.unwrap();
    store
        .write_op(&object, WriteOp::new().step(WriteStep::Remove))
        .await
        .unwrap();
    store.flush().await.unwrap();
    store
        .write(&object, 0, &[2u8; 100])
        .await
        .unwrap_or_else(|e| panic!("the store after freeing its newest data: {e}"));
    assert_eq!(store.read(&object, 0, 100).await.unwrap(), [2u8; 100]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zero_length_io_is_a_no_op() {
    let uri = common::mem_uri("empty-io");
    let image = Image::create(&uri, &opts(MIB), PASS).await.unwrap();
    for offset in [0, 5, 4096, MIB - 1, MIB] {
        image.write(offset, &[]).await.unwrap();
        image.discard(offset, 0).await.unwrap();
        image.write_zeroes(offset, 0, true).await.unwrap();
        image.write_zeroes(offset, 0, false).await.unwrap();
        image.read(offset, &mut []).await.unwrap();
    }
    assert_eq!(
        data_objects(&image).await,
        Vec::<u64>::new(),
        "nothing stored"
    );
    image.write(100, b"abc").await.unwrap();
    let before = common::raw_sector(&image, 0).await;
    image.write(101, &[]).await.unwrap();
    image.discard(101, 0).await.unwrap();
    image.write_zeroes(101, 0, false).await.unwrap();
    assert_eq!(
        common::raw_sector(&image, 0).await,
        before,
        "sector 0 not rewritten"
    );
    assert_eq!(read(&image, 99, 5).await, [0, b'a', b'b', b'c', 0]);
    image.close().await.unwrap();
}

async fn misaligned(backend: Backend, sector_size: u32) {
    let place = common::place(backend, "misaligned");
    let size = 8 * OBJECT_SIZE;
    let image = Image::create(
        &place.uri,
        &common::options(
            size,
            Suite::AesGcmRandom,
            LayoutKind::Unaligned,
            sector_size,
            OBJECT_SIZE,
        ),
        PASS,
    )
    .await
    .unwrap();
    let mut model = vec![0u8; size as usize];
    let mut rng = Rng::new(sector_size as u64);
    let ss = sector_size as u64;
    for (offset, len) in [
        (1, 1),
        (ss - 1, 2),
        (3, ss - 6),
        (ss + 1, 3 * ss),
        (OBJECT_SIZE - 3, 7),
        (OBJECT_SIZE - ss - 1, ss + 2),
        (12345, 3 * OBJECT_SIZE + 777),
        (size - 5, 5),
        (size - ss - 1, ss + 1),
    ] {
        let data = rng.bytes(len as usize);
        image.write(offset, &data).await.unwrap();
        model[offset as usize..(offset + len) as usize].copy_from_slice(&data);
        // Read back exactly, and with a byte more on each side.
        assert_eq!(read(&image, offset, len).await, data, "[{offset}, +{len})");
        let (lo, hi) = (offset.saturating_sub(1), (offset + len + 1).min(size));
        assert!(read(&image, lo, hi - lo).await == model[lo as usize..hi as usize]);
    }
    image.discard(OBJECT_SIZE - 3, 7).await.unwrap();
    model[(OBJECT_SIZE - 3) as usize..(OBJECT_SIZE + 4) as usize].fill(0);
    image
        .write_zeroes(12346, 2 * OBJECT_SIZE, false)
        .await
        .unwrap();
    model[12346..12346 + 2 * OBJECT_SIZE as usize].fill(0);
    assert!(read(&image, 0, size).await == model);
    image.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn misaligned_io_works_memory() {
    misaligned(Backend::Memory, 4096).await;
    misaligned(Backend::Memory, 512).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn misaligned_io_works_local() {
    misaligned(Backend::Local, 4096).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_create_and_open_parameters_are_refused() {
    let uri = common::mem_uri("params");
    let base = opts(MIB);
    let bad = [
        CreateOptions {
            sector_size: 1024,
            ..base.clone()
        },
        CreateOptions {
            object_size: 48 << 10,
            ..base.clone()
        },
        CreateOptions {
            object_size: 2048,
            ..base.clone()
        },
        CreateOptions {
            object_size: 128 << 20,
            ..base.clone()
        },
        CreateOptions {
            size: 0,
            ..base.clone()
        },
        CreateOptions {
            size: MIB + 512,
            ..base.clone()
        },
        CreateOptions {
            layout: Some(LayoutKind::None),
            ..base.clone()
        },
        CreateOptions {
            suite: Suite::AesXtsPlain64,
            layout: Some(LayoutKind::ObjectEnd),
            ..base.clone()
        },
    ];
    for options in bad {
        let err = Image::create(&uri, &options, PASS).await.unwrap_err();
        assert!(
            matches!(err, ImageError::InvalidParameter { .. }),
            "{options:?}: {err}"
        );
    }
    // None of them left anything behind.
    assert!(matches!(
        Image::info(&uri).await,
        Err(ImageError::NotFound { .. })
    ));
    let image = Image::create(&uri, &base, PASS).await.unwrap();
    let err = Image::create(&uri, &base, PASS).await.unwrap_err();
    assert!(matches!(err, ImageError::Exists { .. }), "{err}");
    let err = Image::open(&uri, b"not the passphrase", &OpenOptions::read_only())
        .await
        .unwrap_err();
    assert!(matches!(err, ImageError::Header { .. }), "{err}");
    image.close().await.unwrap();
    // Nothing there: memory, and a local directory that does not exist.
    let missing = common::mem_uri("missing");
    let err = Image::open(&missing, PASS, &OpenOptions::default())
        .await
        .unwrap_err();
    assert!(matches!(err, ImageError::NotFound { .. }), "{err}");
    let local = common::local_dir();
    let err = Image::open(&local.uri, PASS, &OpenOptions::read_only())
        .await
        .unwrap_err();
    assert!(matches!(err, ImageError::NotFound { .. }), "{err}");
}

/// A memory store whose lock calls fail while `away` is set, as when the cluster cannot be
/// reached for a while (an OSD down, a monitor election); everything else works.
struct AwayForLocks {
    inner: ivdisk_store::MemoryStore,
    away: std::sync::atomic::AtomicBool,
    /// Set: the next read of a data object waits until `hold_next_read` is cleared again.
    hold_next_read: std::sync::atomic::AtomicBool,
    /// Set while that read waits.
    read_held: std::sync::atomic::AtomicBool,
    /// While set, lock renewals wait (a call that does not come back, where `away` fails).
    hang_renewals: std::sync::atomic::AtomicBool,
    /// Set: fencing takes this long, then is refused (monitors that do not answer).
    slow_fence: std::sync::Mutex<Option<Duration>>,
    /// Set: the next renewal is applied, and its answer comes back this much later.
    late_renewal_reply: std::sync::Mutex<Option<Duration>>,
    /// When the late renewal was applied.
    late_renewal_applied: std::sync::Mutex<Option<Instant>>,
    /// Set: the next flush fails.
    fail_next_flush: std::sync::atomic::AtomicBool,
}

#[async_trait::async_trait]
impl ObjectStore for AwayForLocks {
    async fn write_op(
        &self,
        object: &ObjectName,
        op: ivdisk_store::WriteOp,
    ) -> Result<ivdisk_store::WriteOutcome, ivdisk_store::StoreError> {
        self.inner.write_op(object, op).await
    }
    async fn read_op(
        &self,
        object: &ObjectName,
        op: ivdisk_store::ReadOp,
    ) -> Result<Vec<ivdisk_store::ReadResult>, ivdisk_store::StoreError> {
        use std::sync::atomic::Ordering::SeqCst;
        let data = object.as_str() != header_object_name("away");
        if data && self.hold_next_read.load(SeqCst) && !self.read_held.swap(true, SeqCst) {
            while self.hold_next_read.load(SeqCst) {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
        self.inner.read_op(object, op).await
    }
    async fn list(&self, prefix: &str) -> Result<Vec<ObjectName>, ivdisk_store::StoreError> {
        self.inner.list(prefix).await
    }
    async fn snap_create(&self) -> Result<ivdisk_store::SnapId, ivdisk_store::StoreError> {
        self.inner.snap_create().await
    }
    async fn snap_remove(
        &self,
        snap: ivdisk_store::SnapId,
    ) -> Result<(), ivdisk_store::StoreError> {
        self.inner.snap_remove(snap).await
    }
    async fn lock_exclusive(
        &self,
        object: &ObjectName,
        request: LockRequest,
    ) -> Result<(), ivdisk_store::StoreError> {
        while request.renew && self.hang_renewals.load(std::sync::atomic::Ordering::SeqCst) {
            std::thread::sleep(Duration::from_millis(20));
        }
        if request.renew {
            let late = self.late_renewal_reply.lock().unwrap().take();
            if let Some(late) = late {
                let renewed = self.inner.lock_exclusive(object, request).await;
                *self.late_renewal_applied.lock().unwrap() = Some(Instant::now());
                std::thread::sleep(late);
                return renewed;
            }
        }
        if self.away.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(ivdisk_store::StoreError::Io {
                context: "locking: the store is away (test)".into(),
                source: std::io::ErrorKind::TimedOut.into(),
            });
        }
        self.inner.lock_exclusive(object, request).await
    }
    async fn unlock(
        &self,
        object: &ObjectName,
        lock: &str,
        cookie: &str,
    ) -> Result<(), ivdisk_store::StoreError> {
        self.inner.unlock(object, lock, cookie).await
    }
    async fn list_lockers(
        &self,
        object: &ObjectName,
        lock: &str,
    ) -> Result<Vec<ivdisk_store::Locker>, ivdisk_store::StoreError> {
        self.inner.list_lockers(object, lock).await
    }
    async fn break_lock(
        &self,
        object: &ObjectName,
        lock: &str,
        client: &str,
        cookie: &str,
    ) -> Result<(), ivdisk_store::StoreError> {
        self.inner.break_lock(object, lock, client, cookie).await
    }
    async fn flush(&self) -> Result<(), ivdisk_store::StoreError> {
        if self
            .fail_next_flush
            .swap(false, std::sync::atomic::Ordering::SeqCst)
        {
            return Err(ivdisk_store::StoreError::Io {
                context: "flushing (test)".into(),
                source: std::io::ErrorKind::Other.into(),
            });
        }
        self.inner.flush().await
    }
    async fn fence_client(
        &self,
        _client: &str,
        _address: &str,
    ) -> Result<bool, ivdisk_store::StoreError> {
        let slow = *self.slow_fence.lock().unwrap();
        match slow {
            Some(slow) => {
                tokio::time::sleep(slow).await;
                Err(ivdisk_store::StoreError::CannotFence {
                    holder: "client.dead".into(),
                    reason: "the monitors do not answer (test)".into(),
                })
            }
            None => Ok(false),
        }
    }
    fn client_id(&self) -> &str {
        self.inner.client_id()
    }
}

/// Who holds the writer lock of the image "away".
async fn lock_client(store: &dyn ObjectStore) -> Option<String> {
    let header = ObjectName::new(header_object_name("away")).unwrap();
    let lockers = store.list_lockers(&header, WRITER_LOCK).await.unwrap();
    lockers.into_iter().next().map(|l| l.client)
}

/// Poll `writer` with writes until one succeeds; panics past `deadline`.
async fn wait_for_writes_back(writer: &Image, deadline: Duration) -> Duration {
    let start = Instant::now();
    loop {
        match writer.write(8192, b"writer is back").await {
            Ok(()) => return start.elapsed(),
            Err(ImageError::LockLost { .. }) if start.elapsed() < deadline => {}
            other => panic!("the writer after {:?}: {other:?}", start.elapsed()),
        }
        // Timing, not synchronization: the renewal thread runs every lock_duration / 3.
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The image "away" on an [`AwayForLocks`] over `memory`, open for writing with a short lock
/// and written once; writes are refused at once while the lock is not renewed (these tests
/// look for that).
async fn away_store_and_writer(
    memory: &ivdisk_store::MemoryStore,
) -> (std::sync::Arc<AwayForLocks>, Image) {
    away_store_and_writer_waiting(memory, Duration::ZERO).await
}

/// [`away_store_and_writer`], with writes waiting up to `stalled_write_wait` while the lock is
/// not renewed.
async fn away_store_and_writer_waiting(
    memory: &ivdisk_store::MemoryStore,
    stalled_write_wait: Duration,
) -> (std::sync::Arc<AwayForLocks>, Image) {
    let store = std::sync::Arc::new(AwayForLocks {
        inner: memory.another_client(),
        away: false.into(),
        hold_next_read: false.into(),
        read_held: false.into(),
        hang_renewals: false.into(),
        slow_fence: None.into(),
        late_renewal_reply: None.into(),
        late_renewal_applied: None.into(),
        fail_next_flush: false.into(),
    });
    Image::create_on(store.clone(), "away", &opts(MIB), PASS)
        .await
        .unwrap()
        .close()
        .await
        .unwrap();
    let short = OpenOptions {
        lock_duration: SHORT_LOCK,
        stalled_write_wait,
        ..OpenOptions::default()
    };
    let writer = Image::open_on(store.clone(), "away", PASS, &short)
        .await
        .unwrap();
    writer.write(0, b"before").await.unwrap();
    (store, writer)
}

/// Renewals that fail for a while (an OSD of the header's placement group stalled for 16 s):
/// writes wait, as librbd holds them while it cannot renew its lock, and go through once a
/// renewal succeeds again. They failed with EIO, and fio and guests' file systems stopped on
/// it. If another writer takes the lock meanwhile, the waiting writes fail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_wait_while_the_store_is_away_and_go_through_once_the_lock_is_renewed() {
    use std::sync::atomic::Ordering::SeqCst;
    let memory = ivdisk_store::MemoryStore::new().unwrap();
    let (store, writer) = away_store_and_writer_waiting(&memory, Duration::from_secs(60)).await;

    store.away.store(true, SeqCst);
    // Past two thirds of the lock's life without a renewal: writes are held from now on.
    tokio::time::sleep(SHORT_LOCK).await;
    let waiting = tokio::spawn({
        let writer = writer.clone();
        async move { writer.write(8192, b"held").await }
    });
    tokio::time::sleep(SHORT_LOCK).await;
    assert!(
        !waiting.is_finished(),
        "the write did not wait for the lock"
    );
    store.away.store(false, SeqCst);
    tokio::time::timeout(SHORT_LOCK * 3, waiting)
        .await
        .expect("the write went on once the lock was renewed")
        .unwrap()
        .unwrap();
    assert_eq!(read(&writer, 8192, 4).await, b"held");

    // Away again, and another client takes the lock once it has expired: the write waiting
    // meanwhile fails, and wrote nothing.
    store.away.store(true, SeqCst);
    tokio::time::sleep(SHORT_LOCK).await;
    let waiting = tokio::spawn({
        let writer = writer.clone();
        async move { writer.write(8192, b"late").await }
    });
    let other = std::sync::Arc::new(memory.another_client());
    let second = open_once_expired(&other).await;
    store.away.store(false, SeqCst);
    let refused = tokio::time::timeout(SHORT_LOCK * 3, waiting)
        .await
        .expect("the waiting write was answered once the lock was lost")
        .unwrap();
    assert!(
        matches!(refused, Err(ImageError::LockLost { .. })),
        "{refused:?}"
    );
    assert_eq!(read(&second, 8192, 4).await, b"held");
    writer.close().await.unwrap();
    second.close().await.unwrap();
}

/// A renewal call that hangs (an OSD that does not answer; RADOS gives up after 60 s, twice
/// a lock's life): writes are refused once two thirds of the lock's duration passed since the
/// last renewal sent, while the call still hangs, and go on once it comes back and the lock
/// is renewed (taken again: nobody held it meanwhile). They went on until the call returned,
/// past the lock's expiry, beside any writer that took it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_stop_while_a_renewal_hangs_past_the_locks_life() {
    let memory = ivdisk_store::MemoryStore::new().unwrap();
    let (store, writer) = away_store_and_writer(&memory).await;
    store
        .hang_renewals
        .store(true, std::sync::atomic::Ordering::SeqCst);
    tokio::time::sleep(SHORT_LOCK + SHORT_LOCK / 6).await;
    let during = writer.write(0, b"while it hangs").await;
    store
        .hang_renewals
        .store(false, std::sync::atomic::Ordering::SeqCst);
    match during {
        Err(ImageError::LockLost { reason, .. }) => {
            assert!(reason.contains("not renewed"), "{reason}")
        }
        other => panic!("a write while the renewal hangs: {other:?}"),
    }
    wait_for_writes_back(&writer, SHORT_LOCK * 3).await;
    writer.close().await.unwrap();
}

/// An open whose fencing of an unclosed writer takes longer than the lock lives (monitors
/// that do not answer: RADOS waits 30 s, the lock lives 30 s) fails and gives the lock back.
/// Before, it went on with a lock that had expired meanwhile: it wrote its holder record over
/// the record of a writer that had taken the lock, and wrote for up to a third of a duration
/// beside it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_that_outlives_its_lock_fails_and_gives_it_back() {
    let memory = ivdisk_store::MemoryStore::new().unwrap();
    let (store, writer) = away_store_and_writer(&memory).await;
    writer.close().await.unwrap();
    let header = ObjectName::new(header_object_name("away")).unwrap();
    let unclosed = vec![(
        b"ivdisk.last_writer_client".to_vec(),
        b"client.dead 10.0.0.9:0/1".to_vec(),
    )];
    let op = ivdisk_store::WriteOp::new().omap_set(unclosed);
    store.inner.write_op(&header, op).await.unwrap();
    *store.slow_fence.lock().unwrap() = Some(SHORT_LOCK + SHORT_LOCK / 5);
    let short = OpenOptions {
        lock_duration: SHORT_LOCK,
        // Refused at once while the lock is not renewed (these tests look for that).
        stalled_write_wait: Duration::ZERO,
        ..OpenOptions::default()
    };
    let err = Image::open_on(store.clone(), "away", PASS, &short)
        .await
        .unwrap_err();
    assert!(matches!(err, ImageError::LockLost { .. }), "{err}");
    assert!(
        err.to_string()
            .contains("longer than the writer lock lives"),
        "{err}"
    );
    assert_eq!(lock_client(store.as_ref()).await, None);
    // Fencing that answers in time: the open goes through.
    *store.slow_fence.lock().unwrap() = Some(SHORT_LOCK / 10);
    let image = Image::open_on(store.clone(), "away", PASS, &short)
        .await
        .unwrap();
    image.write(0, b"after").await.unwrap();
    image.close().await.unwrap();
}

/// A renewal the store applied but answered late (after two thirds of the lock's duration:
/// a network that delays replies) keeps writes refused until a renewal comes back in time;
/// the next goes out at once. Before, the late answer resumed writes, and the next renewal
/// came a third of a duration later, past the lock's expiry: a second writer could take the
/// lock while the first still wrote.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewal_answered_late_does_not_let_writes_outlive_the_lock() {
    let memory = ivdisk_store::MemoryStore::new().unwrap();
    let (store, writer) = away_store_and_writer(&memory).await;
    *store.late_renewal_reply.lock().unwrap() = Some(SHORT_LOCK * 4 / 5);
    let started = Instant::now();
    let applied = loop {
        if let Some(at) = *store.late_renewal_applied.lock().unwrap() {
            break at;
        }
        assert!(started.elapsed() < SHORT_LOCK * 2, "no renewal");
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    tokio::time::sleep_until((applied + SHORT_LOCK + SHORT_LOCK / 20).into()).await;
    let other = std::sync::Arc::new(memory.another_client());
    let second = Image::open_on(other, "away", PASS, &OpenOptions::default()).await;
    let first = writer.write(0, b"the first writer").await;
    assert!(
        !(second.is_ok() && first.is_ok()),
        "two writers: the first still writes while the second holds the lock"
    );
    if let Ok(second) = second {
        second.close().await.unwrap();
    }
    let _ = writer.close().await;
}

/// An open that fails after it took the lock (its first flush fails) gives the lock back: the
/// next open goes through at once. Before, the lock stayed until it expired.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_that_fails_after_taking_the_lock_gives_it_back() {
    let memory = ivdisk_store::MemoryStore::new().unwrap();
    let (store, writer) = away_store_and_writer(&memory).await;
    writer.close().await.unwrap();
    store
        .fail_next_flush
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let err = Image::open_on(store.clone(), "away", PASS, &OpenOptions::default())
        .await
        .unwrap_err();
    assert!(err.to_string().contains("flushing (test)"), "{err}");
    assert_eq!(lock_client(store.as_ref()).await, None);
    let image = Image::open_on(store.clone(), "away", PASS, &OpenOptions::default())
        .await
        .unwrap();
    image.close().await.unwrap();
}

/// Open the image "away" for writing through `store` as soon as its writer lock has expired.
async fn open_once_expired(store: &std::sync::Arc<ivdisk_store::MemoryStore>) -> Image {
    let started = Instant::now();
    loop {
        match Image::open_on(store.clone(), "away", PASS, &OpenOptions::default()).await {
            Ok(image) => return image,
            Err(ImageError::Locked { .. }) if started.elapsed() < SHORT_LOCK * 2 => {}
            Err(e) => panic!("the second writer: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Renewals that fail for a while (the store away) do not lose the lock for good: writes are
/// refused once it may have expired, and resume when a renewal succeeds again, the lock
/// taken again if it expired meanwhile. If another client took it meanwhile, the old writer
/// stays refused and the new one keeps it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_away_for_a_while_pauses_writes_and_a_lock_taken_meanwhile_stays_taken() {
    let memory = ivdisk_store::MemoryStore::new().unwrap();
    let (store, writer) = away_store_and_writer(&memory).await;

    // Away longer than the lock lives: refused, then back (the lock was taken again).
    store.away.store(true, std::sync::atomic::Ordering::SeqCst);
    wait_for_lock_lost(&writer, SHORT_LOCK + Duration::from_secs(2)).await;
    let e = writer.write(0, b"x").await.unwrap_err();
    assert!(e.to_string().contains("writes resume once it is"), "{e}");
    tokio::time::sleep(SHORT_LOCK).await;
    store.away.store(false, std::sync::atomic::Ordering::SeqCst);
    wait_for_writes_back(&writer, SHORT_LOCK + Duration::from_secs(2)).await;
    assert_eq!(
        lock_client(store.as_ref()).await,
        Some(store.client_id().to_owned())
    );

    // Away again, and another client opens the image once the lock has expired.
    store.away.store(true, std::sync::atomic::Ordering::SeqCst);
    wait_for_lock_lost(&writer, SHORT_LOCK + Duration::from_secs(2)).await;
    let other = std::sync::Arc::new(memory.another_client());
    let second = open_once_expired(&other).await;
    store.away.store(false, std::sync::atomic::Ordering::SeqCst);
    // A few renewal rounds: the old writer stays refused.
    tokio::time::sleep(SHORT_LOCK).await;
    assert!(matches!(
        writer.write(0, b"old").await,
        Err(ImageError::LockLost { .. })
    ));
    second.write(0, b"second").await.unwrap();
    assert_eq!(read(&writer, 0, 6).await, b"second");
    writer.close().await.unwrap();
    assert_eq!(
        lock_client(other.as_ref()).await,
        Some(other.client_id().to_owned())
    );
    second.close().await.unwrap();
}

/// A write admitted while the lock was held, whose operation goes out only after renewals
/// began failing, still goes through the metadata cache: once the lock is renewed again, the
/// sector it wrote reads back. (It went around the cache, which kept the sector's metadata
/// from before: the sector read as tampered.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_admitted_before_writes_were_refused_keeps_the_metadata_cache_right() {
    use std::sync::atomic::Ordering::SeqCst;
    let memory = ivdisk_store::MemoryStore::new().unwrap();
    let (store, writer) = away_store_and_writer(&memory).await;
    writer.write(8192, b"first").await.unwrap();
    assert_eq!(read(&writer, 8192, 5).await, b"first");

    // A partial sector: admitted, then held in its read of the old sector.
    store.hold_next_read.store(true, SeqCst);
    let pending = tokio::spawn({
        let writer = writer.clone();
        async move { writer.write(8193, b"second").await }
    });
    while !store.read_held.load(SeqCst) {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Renewals fail until writes are refused (whole sectors elsewhere: nothing to read).
    store.away.store(true, SeqCst);
    let started = Instant::now();
    loop {
        match writer.write(0, &[7; 4096]).await {
            Err(ImageError::LockLost { .. }) => break,
            Ok(()) if started.elapsed() < SHORT_LOCK * 2 => {}
            other => panic!(
                "writes not refused after {:?}: {other:?}",
                started.elapsed()
            ),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The admitted write goes on.
    store.hold_next_read.store(false, SeqCst);
    pending.await.unwrap().unwrap();

    // The store is back and the lock renewed: the sector reads as written.
    store.away.store(false, SeqCst);
    let started = Instant::now();
    loop {
        match writer.write(0, &[8; 4096]).await {
            Ok(()) => break,
            Err(ImageError::LockLost { .. }) if started.elapsed() < SHORT_LOCK * 2 => {}
            other => panic!("writes not back after {:?}: {other:?}", started.elapsed()),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(read(&writer, 8192, 7).await, b"fsecond");
    writer.close().await.unwrap();
}

/// A lock that expired while the store was away is not taken back if another writer held it
/// meanwhile, even one that has closed since: the old writer's memory (its metadata cache, its
/// clients' caches) no longer matches the image, so its writes stay refused and it gives the
/// lock back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_another_writer_held_and_released_meanwhile_is_not_taken_back() {
    let memory = ivdisk_store::MemoryStore::new().unwrap();
    let (store, writer) = away_store_and_writer(&memory).await;

    store.away.store(true, std::sync::atomic::Ordering::SeqCst);
    wait_for_lock_lost(&writer, SHORT_LOCK + Duration::from_secs(2)).await;
    // Another client opens once the lock has expired, writes and closes.
    let other = std::sync::Arc::new(memory.another_client());
    let second = open_once_expired(&other).await;
    second.write(0, b"second").await.unwrap();
    second.close().await.unwrap();
    assert_eq!(lock_client(store.as_ref()).await, None);

    // The store is back; a few renewal rounds later the old writer is still refused, for good.
    store.away.store(false, std::sync::atomic::Ordering::SeqCst);
    tokio::time::sleep(SHORT_LOCK).await;
    // A whole sector next to the second writer's: with the old writer's stale metadata cache
    // this rewrote the metadata block of both, and the second writer's sector read as
    // tampered.
    match writer.write(4096, &[7; 4096]).await {
        Err(e @ ImageError::LockLost { .. }) => {
            assert!(
                e.to_string().contains("another writer held it meanwhile"),
                "{e}"
            )
        }
        other => panic!("the old writer wrote after another one had: {other:?}"),
    }
    assert_eq!(read(&writer, 0, 6).await, b"second");
    // It gave the lock back: a new writer opens at once.
    assert_eq!(lock_client(store.as_ref()).await, None);
    writer.close().await.unwrap();
    let third = Image::open_on(other.clone(), "away", PASS, &OpenOptions::default())
        .await
        .unwrap();
    assert_eq!(read(&third, 0, 6).await, b"second");
    third.close().await.unwrap();
}

/// A delete stopped after it began removing data objects (here: its task panics after the
/// first batch, as a kill would stop it) leaves an image no open accepts, and a second delete
/// finishes it. It opened, served and verified, reading zeros where objects were gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interrupted_delete_leaves_no_image_that_opens() {
    for backend in [Backend::Local, Backend::Memory] {
        let place = common::place(backend, "half-deleted");
        let uri = place.uri.clone();
        let image = Image::create(&uri, &opts(64 * OBJECT_SIZE), PASS)
            .await
            .unwrap();
        image
            .write(0, &vec![7u8; 64 * OBJECT_SIZE as usize])
            .await
            .unwrap();
        image.close().await.unwrap();
        let deleting = uri.clone();
        let stopped = tokio::spawn(async move {
            Image::delete(&deleting, |done, _| {
                if done >= 32 {
                    panic!("stopped after the first batch");
                }
            })
            .await
        })
        .await;
        assert!(stopped.is_err(), "{backend:?}: the delete went on");
        for options in [OpenOptions::default(), OpenOptions::read_only()] {
            match Image::open(&uri, PASS, &options).await {
                Err(ImageError::DeleteUnfinished { .. }) => {}
                Err(e) => panic!("{backend:?}: expected DeleteUnfinished, got {e}"),
                Ok(_) => panic!("{backend:?}: a half-deleted image opened"),
            }
        }
        Image::delete(&uri, |_, _| {}).await.unwrap();
        assert!(matches!(
            Image::info(&uri).await,
            Err(ImageError::NotFound { .. })
        ));
    }
}

/// A header whose data size lies past the largest image (its JSON's checksum is anyone's to
/// recompute) is refused as corrupt at the open: it opened, and the last object's range
/// overflowed in block status, export and verify.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_header_size_past_the_largest_image_is_corrupt() {
    let store: std::sync::Arc<dyn ObjectStore> =
        std::sync::Arc::new(ivdisk_store::MemoryStore::new().unwrap());
    let image = Image::create_on(store.clone(), "big", &opts(4 * OBJECT_SIZE), PASS)
        .await
        .unwrap();
    image.close().await.unwrap();
    let object = ObjectName::new(header_object_name("big")).unwrap();
    let len = store.stat(&object).await.unwrap().unwrap().size;
    let mut io = ivdisk_header::MemoryHeaderIo(store.read(&object, 0, len).await.unwrap());
    let mut header = ivdisk_header::Header::read(&io).unwrap();
    header
        .set_data_size(&mut io, Some(u64::MAX - 4095))
        .unwrap();
    store.write(&object, 0, &io.0).await.unwrap();
    for options in [OpenOptions::default(), OpenOptions::read_only()] {
        match Image::open_on(store.clone(), "big", PASS, &options).await {
            Err(ImageError::Corrupt { reason, .. }) => {
                assert!(reason.contains("data size"), "{reason}")
            }
            Err(e) => panic!("expected Corrupt, got {e}"),
            Ok(_) => panic!("an image of 2^64 bytes opened"),
        }
    }
}

/// What the store of `ChangedWhileUnlocking` does to image "x" just before a writer's first
/// lock request: what another client could do while the opening one derived its key.
#[derive(Clone, Copy)]
enum WhileUnlocking {
    /// Delete the image and create another under the same name, with another passphrase.
    ReplaceImage,
    /// Start a delete (its marker) and remove data object 0, then stop (a dead deleter).
    StartDelete,
    /// Delete the image (its header object last).
    Delete,
}

/// The memory store, doing `hook` once before the first writer-lock request that is no
/// renewal.
struct ChangedWhileUnlocking {
    inner: std::sync::Arc<dyn ObjectStore>,
    hook: std::sync::Mutex<Option<WhileUnlocking>>,
}

#[async_trait::async_trait]
impl ObjectStore for ChangedWhileUnlocking {
    async fn write_op(
        &self,
        object: &ObjectName,
        op: ivdisk_store::WriteOp,
    ) -> Result<ivdisk_store::WriteOutcome, ivdisk_store::StoreError> {
        self.inner.write_op(object, op).await
    }
    async fn read_op(
        &self,
        object: &ObjectName,
        op: ivdisk_store::ReadOp,
    ) -> Result<Vec<ivdisk_store::ReadResult>, ivdisk_store::StoreError> {
        self.inner.read_op(object, op).await
    }
    async fn list(&self, prefix: &str) -> Result<Vec<ObjectName>, ivdisk_store::StoreError> {
        self.inner.list(prefix).await
    }
    async fn snap_create(&self) -> Result<ivdisk_store::SnapId, ivdisk_store::StoreError> {
        self.inner.snap_create().await
    }
    async fn snap_remove(
        &self,
        snap: ivdisk_store::SnapId,
    ) -> Result<(), ivdisk_store::StoreError> {
        self.inner.snap_remove(snap).await
    }
    async fn lock_exclusive(
        &self,
        object: &ObjectName,
        request: LockRequest,
    ) -> Result<(), ivdisk_store::StoreError> {
        let hook = match request.renew {
            true => None,
            false => self.hook.lock().unwrap().take(),
        };
        let header = ObjectName::new(header_object_name("x")).unwrap();
        match hook {
            None => {}
            Some(WhileUnlocking::ReplaceImage) => {
                let old = Image::open_on(self.inner.clone(), "x", PASS, &OpenOptions::read_only())
                    .await
                    .unwrap();
                let prefix = data_object_prefix(&old.image_id());
                drop(old);
                for data in self.inner.list(&prefix).await.unwrap() {
                    self.inner.remove(&data).await.unwrap();
                }
                self.inner.remove(&header).await.unwrap();
                let other = Image::create_on(self.inner.clone(), "x", &opts(MIB), b"other")
                    .await
                    .unwrap();
                other.write(0, &[0x77; 4096]).await.unwrap();
                other.close().await.unwrap();
            }
            Some(WhileUnlocking::Delete) => {
                for data in self.inner.list("ivdisk_data.").await.unwrap() {
                    self.inner.remove(&data).await.unwrap();
                }
                self.inner.remove(&header).await.unwrap();
            }
            Some(WhileUnlocking::StartDelete) => {
                let op = ivdisk_store::WriteOp::new()
                    .omap_set(vec![(b"ivdisk.deleting".to_vec(), b"1".to_vec())]);
                self.inner.write_op(&header, op).await.unwrap();
                let old =
                    Image::open_on(self.inner.clone(), "x", PASS, &OpenOptions::read_only()).await;
                assert!(old.is_err(), "the marker is not seen by a new open");
                let any = self.inner.list("ivdisk_data.").await.unwrap();
                self.inner.remove(&any[0]).await.unwrap();
            }
        }
        self.inner.lock_exclusive(object, request).await
    }
    async fn unlock(
        &self,
        object: &ObjectName,
        lock: &str,
        cookie: &str,
    ) -> Result<(), ivdisk_store::StoreError> {
        self.inner.unlock(object, lock, cookie).await
    }
    async fn list_lockers(
        &self,
        object: &ObjectName,
        lock: &str,
    ) -> Result<Vec<ivdisk_store::Locker>, ivdisk_store::StoreError> {
        self.inner.list_lockers(object, lock).await
    }
    async fn break_lock(
        &self,
        object: &ObjectName,
        lock: &str,
        client: &str,
        cookie: &str,
    ) -> Result<(), ivdisk_store::StoreError> {
        self.inner.break_lock(object, lock, client, cookie).await
    }
    async fn flush(&self) -> Result<(), ivdisk_store::StoreError> {
        self.inner.flush().await
    }
    fn client_id(&self) -> &str {
        self.inner.client_id()
    }
}

/// A writer checks, once it holds the lock, that the image it unlocked is still the one under
/// the name (and there at all) and that no delete began meanwhile (the key derivation takes seconds). It went on
/// with the other image's header and the first image's key (every sector it wrote failed
/// authentication, and the other's read as integrity errors), or opened a half-deleted image
/// that read zeros where objects were removed.
#[tokio::test(flavor = "multi_thread")]
async fn a_writer_sees_the_image_replaced_or_deleted_while_it_unlocked() {
    for (hook, what) in [
        (WhileUnlocking::ReplaceImage, "replaced"),
        (WhileUnlocking::StartDelete, "half deleted"),
        (WhileUnlocking::Delete, "deleted"),
    ] {
        let inner: std::sync::Arc<dyn ObjectStore> =
            std::sync::Arc::new(ivdisk_store::MemoryStore::new().unwrap());
        let first = Image::create_on(inner.clone(), "x", &opts(MIB), PASS)
            .await
            .unwrap();
        first.write(0, &[0x11; 2 * 65536]).await.unwrap();
        first.close().await.unwrap();
        let store = std::sync::Arc::new(ChangedWhileUnlocking {
            inner: inner.clone(),
            hook: std::sync::Mutex::new(Some(hook)),
        });
        match (
            hook,
            Image::open_on(store.clone(), "x", PASS, &OpenOptions::default()).await,
        ) {
            (WhileUnlocking::ReplaceImage, Err(ImageError::HeaderChanged { .. })) => {
                // The image under the name now is untouched, and opens with its passphrase.
                let other = Image::open_on(inner.clone(), "x", b"other", &OpenOptions::default())
                    .await
                    .unwrap();
                let mut sector = [0u8; 4096];
                other.read(0, &mut sector).await.unwrap();
                assert_eq!(sector, [0x77; 4096]);
                other.close().await.unwrap();
            }
            (WhileUnlocking::StartDelete, Err(ImageError::DeleteUnfinished { .. })) => {}
            (WhileUnlocking::Delete, Err(ImageError::NotFound { .. })) => {
                // Nothing left under the name: it was left an empty header object holding
                // the writer's record, which no command opened, deleted or created over.
                let header = ObjectName::new(header_object_name("x")).unwrap();
                assert_eq!(inner.stat(&header).await.unwrap(), None, "{what}");
                Image::create_on(inner.clone(), "x", &opts(MIB), PASS)
                    .await
                    .unwrap()
                    .close()
                    .await
                    .unwrap();
            }
            (_, Err(e)) => panic!("{what}: unexpected error {e}"),
            (_, Ok(_)) => panic!("{what}: the writer opened"),
        }
        assert!(
            inner
                .list_lockers(
                    &ObjectName::new(header_object_name("x")).unwrap(),
                    WRITER_LOCK
                )
                .await
                .unwrap()
                .is_empty(),
            "{what}: the refused open left the lock held"
        );
    }
}

/// The memory store; once armed, the next version-asserted write of image "x"'s header object
/// is preceded by a change of an unrelated omap key there (as a RADOS lock renewal or a nonce
/// reservation moves the object's version without changing the header's bytes).
struct MovedBeforeHeaderWrite {
    inner: ivdisk_store::MemoryStore,
    armed: std::sync::atomic::AtomicBool,
}

ivdisk_store::object_store_forwarding_to_inner!(MovedBeforeHeaderWrite {
    async fn write_op(
        &self,
        object: &ObjectName,
        op: ivdisk_store::WriteOp,
    ) -> Result<ivdisk_store::WriteOutcome, ivdisk_store::StoreError> {
        let asserts = matches!(op.steps.first(), Some(ivdisk_store::WriteStep::AssertVersion(_)));
        if asserts
            && object.as_str() == header_object_name("x")
            && self.armed.swap(false, std::sync::atomic::Ordering::SeqCst)
        {
            let moved = ivdisk_store::WriteOp::new()
                .omap_set(vec![(b"test.moved".to_vec(), b"1".to_vec())]);
            self.inner.write_op(object, moved).await?;
        }
        self.inner.write_op(object, op).await
    }
    async fn read_op(
        &self,
        object: &ObjectName,
        op: ivdisk_store::ReadOp,
    ) -> Result<Vec<ivdisk_store::ReadResult>, ivdisk_store::StoreError> {
        self.inner.read_op(object, op).await
    }
});

/// A resize whose header object moved between its read and its write without a header byte
/// changing goes in: it failed with a bare "version mismatch" from the store.
#[tokio::test(flavor = "multi_thread")]
async fn a_resize_goes_in_when_only_the_header_objects_version_moved() {
    let store = std::sync::Arc::new(MovedBeforeHeaderWrite {
        inner: ivdisk_store::MemoryStore::new().unwrap(),
        armed: false.into(),
    });
    let image = Image::create_on(store.clone(), "x", &opts(MIB), PASS)
        .await
        .unwrap();
    store.armed.store(true, std::sync::atomic::Ordering::SeqCst);
    image.resize(2 * MIB, false).await.unwrap();
    assert!(
        !store.armed.load(std::sync::atomic::Ordering::SeqCst),
        "not exercised"
    );
    assert_eq!(image.size(), 2 * MIB);
    image.close().await.unwrap();
    let again = Image::open_on(store.clone(), "x", PASS, &OpenOptions::read_only())
        .await
        .unwrap();
    assert_eq!(again.size(), 2 * MIB);
}

/// A shrink stopped part-way (here a store failure at its second discard; a kill stops it
/// there too) leaves an image no open accepts, naming the resize that finishes it; a resize
/// to another size is refused, and the resize to that size finishes it. Such an image kept
/// its old size over partly discarded objects, and opened, exported and verified as whole,
/// reading zeros there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shrink_stopped_part_way_is_refused_until_a_resize_finishes_it() {
    let store = std::sync::Arc::new(common::FailingStore::new());
    let size = 8 * OBJECT_SIZE;
    let image = Image::create_on(store.clone(), "img", &opts(size), PASS)
        .await
        .unwrap();
    let data = Rng::new(5).bytes(size as usize);
    image.write(0, &data).await.unwrap();
    image.flush().await.unwrap();
    // Write 1 marks the shrink, 2 discards the last object, 3 fails.
    store.fail_nth_write(3);
    let failed = image.resize(2 * OBJECT_SIZE, true).await;
    store.arm(false);
    assert!(failed.is_err(), "the shrink went through: {failed:?}");
    drop(image.close().await);
    let new_size = (2 * OBJECT_SIZE).to_string();
    for options in [OpenOptions::default(), OpenOptions::read_only()] {
        match Image::open_on(store.clone(), "img", PASS, &options).await {
            Err(e @ ImageError::ShrinkUnfinished { .. }) => {
                assert!(e.to_string().contains("--allow-shrink"), "{e}");
                let ImageError::ShrinkUnfinished { size, .. } = e else {
                    unreachable!()
                };
                assert_eq!(size, new_size);
            }
            Err(e) => panic!("expected ShrinkUnfinished, got {e}"),
            Ok(_) => panic!("a half-shrunk image opened"),
        }
    }
    let finishing = OpenOptions {
        finishing_shrink: true,
        ..OpenOptions::default()
    };
    let image = Image::open_on(store.clone(), "img", PASS, &finishing)
        .await
        .unwrap();
    match image.resize(4 * OBJECT_SIZE, true).await {
        Err(ImageError::ShrinkUnfinished { size, .. }) => assert_eq!(size, new_size),
        other => panic!("a resize to another size: {other:?}"),
    }
    image.resize(2 * OBJECT_SIZE, true).await.unwrap();
    image.close().await.unwrap();
    let image = Image::open_on(store.clone(), "img", PASS, &OpenOptions::default())
        .await
        .unwrap();
    assert_eq!(image.size(), 2 * OBJECT_SIZE);
    let mut kept = vec![0u8; (2 * OBJECT_SIZE) as usize];
    image.read(0, &mut kept).await.unwrap();
    assert!(kept == data[..kept.len()], "the data before the new end");
    // Grown again: zeros past the old cut, nothing of what was discarded.
    image.resize(size, false).await.unwrap();
    let mut past = vec![0xaau8; (size - 2 * OBJECT_SIZE) as usize];
    image.read(2 * OBJECT_SIZE, &mut past).await.unwrap();
    assert!(past.iter().all(|&b| b == 0), "discarded data came back");
    image.close().await.unwrap();
}
