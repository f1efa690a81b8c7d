//! Which parts of an image hold data (`Image::allocation`, what NBD block status, `export` and
//! `verify` use): exact extents on a huge sparse image without a stat per object, sub-ranges
//! that start and end inside objects, and snapshots (listed at the snapshot, not the head),
//! on every backend.

mod common;

use std::sync::Arc;

use common::{place, Backend, BlockStore, PASS};
use ivdisk_crypto::Suite;
use ivdisk_image::{AllocationExtent, Image, LayoutKind, OpenOptions};

const MIB: u64 = 1 << 20;

fn extent(offset: u64, len: u64, allocated: bool) -> AllocationExtent {
    AllocationExtent {
        offset,
        len,
        allocated,
    }
}

/// A 1 TiB image (262144 objects of 4 MiB) with three 4 KiB writes: its allocation, whole, in
/// a range that starts and ends inside objects, and at a snapshot, takes a handful of store
/// reads, not one per object (262144 stats before: 8 s on the local store, 12 s on RADOS).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_huge_sparse_image_is_mapped_without_a_stat_per_object() {
    const OBJECT: u64 = 4 * MIB;
    let size = 1 << 40;
    let store = Arc::new(BlockStore::new());
    let options = common::options(size, Suite::DEFAULT, LayoutKind::OmapPacked, 4096, OBJECT);
    let image = Image::create_on(store.clone(), "huge", &options, PASS)
        .await
        .unwrap();
    for at in [0, 5 * OBJECT + 4096, size - 4096] {
        image.write(at, &[0x5a; 4096]).await.unwrap();
    }
    image.flush().await.unwrap();
    let last = size - OBJECT;

    store.clear();
    let whole = image.allocation(0, size).await.unwrap();
    assert_eq!(
        whole,
        [
            extent(0, OBJECT, true),
            extent(OBJECT, 4 * OBJECT, false),
            extent(5 * OBJECT, OBJECT, true),
            extent(6 * OBJECT, last - 6 * OBJECT, false),
            extent(last, OBJECT, true),
        ]
    );
    let reads = store.reads.lock().unwrap().len();
    assert!(reads < 8, "{reads} store reads to map the image");

    // From the middle of object 0 to the middle of object 3000.
    let (from, len) = (OBJECT / 2, 3000 * OBJECT);
    assert_eq!(
        image.allocation(from, len).await.unwrap(),
        [
            extent(from, OBJECT / 2, true),
            extent(OBJECT, 4 * OBJECT, false),
            extent(5 * OBJECT, OBJECT, true),
            extent(6 * OBJECT, from + len - 6 * OBJECT, false),
        ]
    );
    // A few objects (an NBD request's worth): the writer stats only the one it may have.
    store.clear();
    assert_eq!(
        image.allocation(OBJECT + 512, 5 * OBJECT).await.unwrap(),
        [
            extent(OBJECT + 512, 4 * OBJECT - 512, false),
            extent(5 * OBJECT, OBJECT, true),
            extent(6 * OBJECT, 512, false),
        ]
    );
    assert_eq!(store.reads.lock().unwrap().len(), 1);

    // A snapshot, then object 5 discarded at the head: the snapshot still maps it, from a
    // listing at the snapshot.
    image.create_snapshot("s").await.unwrap();
    image.discard(5 * OBJECT, OBJECT).await.unwrap();
    image.flush().await.unwrap();
    let at_s = Image::open_on(
        store.clone(),
        "huge",
        PASS,
        &OpenOptions {
            snapshot: Some("s".to_owned()),
            ..OpenOptions::read_only()
        },
    )
    .await
    .unwrap();
    store.clear();
    assert_eq!(at_s.allocation(0, size).await.unwrap(), whole);
    let reads = store.reads.lock().unwrap().len();
    assert!(reads < 8, "{reads} store reads to map the snapshot");
    assert_eq!(
        image.allocation(0, size).await.unwrap(),
        [
            extent(0, OBJECT, true),
            extent(OBJECT, last - OBJECT, false),
            extent(last, OBJECT, true),
        ]
    );
}

/// Block status as an NBD client asks for it (4 GiB at a time) of a 1 TiB image a writer
/// serves: one listing, then a stat per object it may hold, not 262144 stats (`qemu-img
/// convert` of an empty 1 TiB image from RADOS took 25 s). What it writes after the listing
/// is mapped at once, a discarded object is a hole at once, and objects written while the
/// listing runs are not missed. A snapshot answers from its listing alone; a read-only open
/// of the head (which another writer may change) stats every object and agrees.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writer_maps_nbd_requests_from_the_objects_it_may_hold() {
    const OBJECT: u64 = 4 * MIB;
    const REQUEST: u64 = 4 << 30;
    let size = 1 << 40;
    let store = Arc::new(BlockStore::new());
    let options = common::options(size, Suite::DEFAULT, LayoutKind::OmapPacked, 4096, OBJECT);
    Image::create_on(store.clone(), "served", &options, PASS)
        .await
        .unwrap()
        .close()
        .await
        .unwrap();
    let image = Image::open_on(store.clone(), "served", PASS, &OpenOptions::default())
        .await
        .unwrap();
    // Written while the first block status lists the objects.
    let early = [0u64, 5, 1023, 1024, 200_000];
    let writes = early.map(|n| {
        let image = image.clone();
        tokio::spawn(async move { image.write(n * OBJECT + 4096, &[3; 4096]).await })
    });
    let first = image.allocation(0, REQUEST).await.unwrap();
    for write in writes {
        write.await.unwrap().unwrap();
    }
    assert!(first.iter().all(|e| e.offset + e.len <= REQUEST));

    let map = |image: &Image| {
        let image = image.clone();
        async move {
            let mut objects = Vec::new();
            for at in (0..size).step_by(REQUEST as usize) {
                let extents = image.allocation(at, REQUEST).await.unwrap();
                assert_eq!(extents.iter().map(|e| e.len).sum::<u64>(), REQUEST);
                objects.extend(
                    extents
                        .iter()
                        .filter(|e| e.allocated)
                        .flat_map(|e| e.offset / OBJECT..(e.offset + e.len) / OBJECT),
                );
            }
            objects
        }
    };
    store.clear();
    assert_eq!(map(&image).await, early);
    let reads = store.reads.lock().unwrap().len();
    assert!(reads <= early.len(), "{reads} store reads for 256 requests");

    // Written after the listing, and discarded: both seen at once.
    image.write(7000 * OBJECT, &[4; 4096]).await.unwrap();
    image.discard(5 * OBJECT, OBJECT).await.unwrap();
    assert_eq!(map(&image).await, [0, 1023, 1024, 7000, 200_000]);
    image.write(5 * OBJECT, &[5; 512]).await.unwrap();
    assert_eq!(map(&image).await, [0, 5, 1023, 1024, 7000, 200_000]);

    image.create_snapshot("s").await.unwrap();
    image.discard(0, OBJECT).await.unwrap();
    let snapshot = OpenOptions {
        snapshot: Some("s".to_owned()),
        ..OpenOptions::read_only()
    };
    let at_s = Image::open_on(store.clone(), "served", PASS, &snapshot)
        .await
        .unwrap();
    at_s.allocation(0, REQUEST).await.unwrap();
    store.clear();
    assert_eq!(map(&at_s).await, [0, 5, 1023, 1024, 7000, 200_000]);
    assert_eq!(store.reads.lock().unwrap().len(), 0);

    let reader = Image::open_on(store.clone(), "served", PASS, &OpenOptions::read_only())
        .await
        .unwrap();
    store.clear();
    let (from_writer, from_reader) = (map(&image).await, map(&reader).await);
    assert_eq!(from_writer, [5, 1023, 1024, 7000, 200_000]);
    assert_eq!(from_reader, from_writer);
    let reads = store.reads.lock().unwrap().len() as u64;
    assert!(
        reads >= size / OBJECT,
        "the reader stats every object: {reads} reads"
    );
    for image in [image, at_s, reader] {
        image.close().await.unwrap();
    }
}

/// The largest size a byte offset allows (2^63 bytes less a sector): the last sector is
/// written, read and mapped without an overflow, and a shrink takes no time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_image_of_8_eib_maps_its_last_sector() {
    const OBJECT: u64 = 4 * MIB;
    let size = (1u64 << 63) - 4096;
    let store = Arc::new(BlockStore::new());
    let options = common::options(size, Suite::DEFAULT, LayoutKind::OmapPacked, 4096, OBJECT);
    let image = Image::create_on(store.clone(), "largest", &options, PASS)
        .await
        .unwrap();
    image.write(size - 4096, &[7; 4096]).await.unwrap();
    let mut back = [0u8; 4096];
    image.read(size - 4096, &mut back).await.unwrap();
    assert_eq!(back, [7; 4096]);
    let last = size / OBJECT * OBJECT;
    assert_eq!(
        image.allocation(0, size).await.unwrap(),
        [extent(0, last, false), extent(last, size - last, true)]
    );
    assert!(image.write(size, &[1; 4096]).await.is_err());
    assert!(image.allocation(size - 4096, 8192).await.is_err());

    // A shrink frees only the objects that exist (it went through all 2^41 before), and the
    // data past the new end is gone when the image grows again.
    image.write(MIB - 4096, &[9; 8192]).await.unwrap();
    image.resize(MIB, true).await.unwrap();
    image.resize(size, false).await.unwrap();
    // (The last object, which the image's end cuts short, keeps existing with nothing
    // written in it: a discard removes only whole objects.)
    let data: Vec<u64> = image
        .allocation(0, size)
        .await
        .unwrap()
        .iter()
        .filter(|e| e.allocated)
        .map(|e| e.offset)
        .collect();
    assert!(data == [0] || data == [0, last], "{data:?}");
    let mut two = [0u8; 8192];
    image.read(MIB - 4096, &mut two).await.unwrap();
    assert_eq!(
        (&two[..4096], &two[4096..]),
        (&[9; 4096][..], &[0; 4096][..])
    );
    image.read(size - 4096, &mut back).await.unwrap();
    assert_eq!(back, [0; 4096]);
}

/// At a snapshot an object discarded since still holds data, and one written since does not:
/// the head's listing must not answer for it; a rollback brings the one back and removes the
/// other. 1100 objects, more than are stat'ed one by one.
async fn snapshots_are_mapped_as_they_were(backend: Backend) {
    const OBJECT: u64 = 64 << 10;
    let place = place(backend, "alloc");
    let size = 1100 * OBJECT;
    let options = common::options(size, Suite::DEFAULT, LayoutKind::ObjectEnd, 4096, OBJECT);
    let image = Image::create(&place.uri, &options, PASS).await.unwrap();
    for n in [0, 5, 1099] {
        image.write(n * OBJECT, &[1; 4096]).await.unwrap();
    }
    image.create_snapshot("before").await.unwrap();
    image.discard(5 * OBJECT, OBJECT).await.unwrap();
    image.write(7 * OBJECT, &[2; 4096]).await.unwrap();
    image.flush().await.unwrap();

    let objects = |extents: Vec<AllocationExtent>| -> Vec<u64> {
        assert_eq!(extents.iter().map(|e| e.len).sum::<u64>(), size);
        extents
            .iter()
            .filter(|e| e.allocated)
            .flat_map(|e| e.offset / OBJECT..(e.offset + e.len) / OBJECT)
            .collect()
    };
    assert_eq!(
        objects(image.allocation(0, size).await.unwrap()),
        [0, 7, 1099]
    );
    let before = Image::open(
        &place.uri,
        PASS,
        &OpenOptions {
            snapshot: Some("before".to_owned()),
            ..OpenOptions::read_only()
        },
    )
    .await
    .unwrap();
    assert_eq!(
        objects(before.allocation(0, size).await.unwrap()),
        [0, 5, 1099]
    );

    // A rollback visits the objects listed at the head and at the snapshot: object 5 comes
    // back, object 7 goes.
    image.close().await.unwrap();
    Image::rollback_snapshot(&place.uri, "before", |_, _| {})
        .await
        .unwrap();
    let image = Image::open(&place.uri, PASS, &OpenOptions::default())
        .await
        .unwrap();
    assert_eq!(
        objects(image.allocation(0, size).await.unwrap()),
        [0, 5, 1099]
    );
    let mut back = vec![0u8; 4096];
    image.read(5 * OBJECT, &mut back).await.unwrap();
    assert_eq!(back, [1; 4096]);
    image.read(7 * OBJECT, &mut back).await.unwrap();
    assert_eq!(back, [0; 4096]);
    image.close().await.unwrap();
    before.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshots_are_mapped_as_they_were_memory() {
    snapshots_are_mapped_as_they_were(Backend::Memory).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshots_are_mapped_as_they_were_local() {
    snapshots_are_mapped_as_they_were(Backend::Local).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshots_are_mapped_as_they_were_rados() {
    if common::rados_uri("probe").is_none() {
        return;
    }
    snapshots_are_mapped_as_they_were(Backend::Rados).await;
}
