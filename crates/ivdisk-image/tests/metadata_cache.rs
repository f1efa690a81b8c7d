//! The writer's metadata cache of `object-end` images, seen from the store: what reads and
//! writes send once the metadata is in memory, on a store that writes in 4 KiB blocks (as
//! RADOS does). Correctness under concurrency is in concurrency.rs, tampering in tamper.rs,
//! the randomized model on RADOS in rados.rs.

mod common;

use std::sync::Arc;

use common::{BlockStore, PASS};
use ivdisk_crypto::Suite;
use ivdisk_image::{Image, LayoutKind, OpenOptions};

/// 256 sectors of 4 KiB per object: 8 KiB of metadata at the object's end (two blocks).
const OBJECT_SIZE: u64 = 1 << 20;
const SS: u64 = 4096;

fn writes_to(store: &BlockStore, object: &str) -> Vec<(u64, usize)> {
    store
        .writes
        .lock()
        .unwrap()
        .iter()
        .filter(|(o, _, _)| o == object)
        .map(|&(_, offset, len)| (offset, len))
        .collect()
}

fn read_steps(store: &BlockStore) -> Vec<usize> {
    store
        .reads
        .lock()
        .unwrap()
        .iter()
        .map(|&(_, n)| n)
        .collect()
}

fn sector(value: u8) -> Vec<u8> {
    vec![value; SS as usize]
}

async fn read_sector(image: &Image, lba: u64) -> Vec<u8> {
    let mut buf = vec![0u8; SS as usize];
    image.read(lba * SS, &mut buf).await.unwrap();
    buf
}

/// A new image of four objects in the default suite and `layout`, on a store that records
/// what it is sent.
async fn four_object_image(layout: LayoutKind, name: &str) -> (Arc<BlockStore>, Image) {
    let store = Arc::new(BlockStore::new());
    let options = common::options(
        4 * OBJECT_SIZE,
        Suite::DEFAULT,
        layout,
        SS as u32,
        OBJECT_SIZE,
    );
    let image = Image::create_on(store.clone(), name, &options, PASS)
        .await
        .unwrap();
    (store, image)
}

/// A read given up while it loads a metadata block (a caller's timeout, after its operation
/// went to the store) leaves no load behind: the next read loads the block again, and the one
/// after finds it in memory. Before, the block stayed loading for ever, so every read of it
/// fetched it again and every write added a patch to it.
#[tokio::test]
async fn a_read_given_up_while_it_loads_leaves_no_load_behind() {
    let (store, image) = four_object_image(LayoutKind::ObjectEnd, "given-up").await;
    image.write(3 * SS, &sector(3)).await.unwrap();
    image.close().await.unwrap();
    let image = Image::open_on(store.clone(), "given-up", PASS, &OpenOptions::default())
        .await
        .unwrap();
    let object = image.data_object(0).to_string();
    *store.hold_reads_of.lock().unwrap() = Some(object.clone());
    store.clear();
    let mut buf = vec![0u8; SS as usize];
    let given_up = tokio::time::timeout(
        std::time::Duration::from_millis(200),
        image.read(3 * SS, &mut buf),
    )
    .await;
    assert!(
        given_up.is_err(),
        "the read waits at the store until given up"
    );
    assert_eq!(
        read_steps(&store),
        vec![2],
        "it went out: data and the metadata block"
    );
    *store.hold_reads_of.lock().unwrap() = None;

    store.clear();
    assert_eq!(read_sector(&image, 3).await, sector(3));
    assert_eq!(read_sector(&image, 3).await, sector(3));
    assert_eq!(
        read_steps(&store),
        vec![2, 1],
        "loaded again once, then read from memory"
    );
    // A write into the block goes out whole: the block is known.
    store.clear();
    image.write(4 * SS, &sector(4)).await.unwrap();
    assert_eq!(
        writes_to(&store, &object),
        vec![(4 * SS, 4096), (OBJECT_SIZE, 4096)]
    );
    image.close().await.unwrap();
}

/// A write given up while its operation waits at the store (never applied, as a coalescing
/// store drops a queued operation whose caller is gone) leaves the cache as a failed write
/// does: forgotten, so the sector reads as the store holds it. Before, the cache kept the
/// write's metadata, and the old data read as failing authentication.
#[tokio::test]
async fn a_write_given_up_at_the_store_leaves_the_cache_as_the_store_is() {
    for layout in [LayoutKind::ObjectEnd, LayoutKind::OmapPacked] {
        let (store, image) = four_object_image(layout, "given-up-write").await;
        image.write(5 * SS, &sector(5)).await.unwrap();
        assert_eq!(read_sector(&image, 5).await, sector(5));
        let object = image.data_object(0).to_string();
        *store.hold_writes_of.lock().unwrap() = Some(object.clone());
        let given_up = tokio::time::timeout(
            std::time::Duration::from_millis(200),
            image.write(5 * SS, &sector(6)),
        )
        .await;
        assert!(
            given_up.is_err(),
            "{layout:?}: the write waits at the store until given up"
        );
        *store.hold_writes_of.lock().unwrap() = None;
        assert_eq!(read_sector(&image, 5).await, sector(5), "{layout:?}");
        image.write(6 * SS, &sector(7)).await.unwrap();
        assert_eq!(read_sector(&image, 5).await, sector(5), "{layout:?}");
        assert_eq!(read_sector(&image, 6).await, sector(7), "{layout:?}");
        image.close().await.unwrap();
    }
}

#[tokio::test]
async fn small_ios_send_whole_metadata_blocks_and_read_data_alone() {
    let (store, image) = four_object_image(LayoutKind::ObjectEnd, "cached").await;
    let object = image.data_object(0).to_string();
    let region = OBJECT_SIZE;

    // First small write to a block not in memory: its exact 32 bytes, then a read of the
    // block (once).
    store.clear();
    image.write(3 * SS, &sector(3)).await.unwrap();
    assert_eq!(
        writes_to(&store, &object),
        vec![(3 * SS, 4096), (region + 3 * 32, 32)]
    );
    assert_eq!(read_steps(&store), vec![1], "one read loads the block");

    // Now the block is known: the next write in it sends the whole 4 KiB block, and reads of
    // written sectors fetch the data alone.
    store.clear();
    image.write(5 * SS, &sector(5)).await.unwrap();
    assert_eq!(
        writes_to(&store, &object),
        vec![(5 * SS, 4096), (region, 4096)]
    );
    assert!(read_steps(&store).is_empty());
    assert_eq!(read_sector(&image, 3).await, sector(3));
    assert_eq!(read_sector(&image, 5).await, sector(5));
    assert_eq!(read_sector(&image, 4).await, sector(0));
    assert_eq!(read_steps(&store), vec![1, 1, 1]);

    // A sector in the second metadata block (sector 128 on): not in memory yet.
    store.clear();
    assert_eq!(read_sector(&image, 200).await, sector(0));
    assert_eq!(read_steps(&store), vec![2], "data and the metadata block");
    image.write(200 * SS, &sector(7)).await.unwrap();
    assert_eq!(
        writes_to(&store, &object),
        vec![(200 * SS, 4096), (region + 4096, 4096)]
    );

    // A write covering whole blocks needs no load; discards keep the neighbours' metadata.
    store.clear();
    let big = vec![9u8; 128 * SS as usize];
    image.write(OBJECT_SIZE, &big).await.unwrap();
    let second = image.data_object(1).to_string();
    assert_eq!(
        writes_to(&store, &second),
        vec![(0, 128 * 4096), (region, 4096)]
    );
    image.discard(OBJECT_SIZE + 10 * SS, SS).await.unwrap();
    assert!(read_steps(&store).is_empty());
    let mut back = vec![0u8; 128 * SS as usize];
    image.read(OBJECT_SIZE, &mut back).await.unwrap();
    let mut expected = big.clone();
    expected[10 * SS as usize..11 * SS as usize].fill(0);
    assert!(back == expected, "discarded sector zero, the others intact");
    image.close().await.unwrap();

    // Opened again the cache starts empty: the first read of a block fetches it, the next
    // ones do not.
    let image = Image::open_on(store.clone(), "cached", PASS, &OpenOptions::default())
        .await
        .unwrap();
    store.clear();
    assert_eq!(read_sector(&image, 3).await, sector(3));
    assert_eq!(read_sector(&image, 5).await, sector(5));
    assert_eq!(read_steps(&store), vec![2, 1]);
    image.close().await.unwrap();

    // Read-only openers have no cache (another process may write); nor has a writer with
    // the cache turned off, whose writes send the exact metadata bytes.
    let reader = Image::open_on(store.clone(), "cached", PASS, &OpenOptions::read_only())
        .await
        .unwrap();
    store.clear();
    assert_eq!(read_sector(&reader, 3).await, sector(3));
    assert_eq!(read_sector(&reader, 3).await, sector(3));
    assert_eq!(read_steps(&store), vec![2, 2]);
    reader.close().await.unwrap();
    let uncached = OpenOptions {
        metadata_cache_bytes: 0,
        ..OpenOptions::default()
    };
    let image = Image::open_on(store.clone(), "cached", PASS, &uncached)
        .await
        .unwrap();
    store.clear();
    image.write(6 * SS, &sector(6)).await.unwrap();
    assert_eq!(
        writes_to(&store, &object),
        vec![(6 * SS, 4096), (region + 6 * 32, 32)]
    );
    assert_eq!(read_sector(&image, 6).await, sector(6));
    assert_eq!(read_steps(&store), vec![2]);
    image.close().await.unwrap();
}

/// A partial-sector write reads the old sector first (through the cache) and every sector
/// of a block written one by one after a reopen reads back.
#[tokio::test]
async fn sectors_written_one_by_one_after_a_reopen_read_back() {
    let store = Arc::new(BlockStore::new());
    let options = common::options(
        2 * OBJECT_SIZE,
        Suite::AesXtsRandom,
        LayoutKind::ObjectEnd,
        SS as u32,
        OBJECT_SIZE,
    );
    let image = Image::create_on(store.clone(), "one-by-one", &options, PASS)
        .await
        .unwrap();
    let all: Vec<u8> = (0..2 * OBJECT_SIZE).map(|i| (i / SS) as u8).collect();
    image.write(0, &all).await.unwrap();
    image.close().await.unwrap();
    let image = Image::open_on(store.clone(), "one-by-one", PASS, &OpenOptions::default())
        .await
        .unwrap();
    let mut expected = all;
    // Interleaved across the two objects and both blocks of each, with partial sectors.
    for i in 0..300u64 {
        let lba = (i * 37) % (2 * OBJECT_SIZE / SS);
        let at = lba * SS + (i % 3) * 100;
        let len = (1000 + (i % 2) * 3096).min(2 * OBJECT_SIZE - at);
        let data = vec![(i % 251) as u8 + 1; len as usize];
        image.write(at, &data).await.unwrap();
        expected[at as usize..at as usize + data.len()].copy_from_slice(&data);
    }
    let mut back = vec![0u8; expected.len()];
    image.read(0, &mut back).await.unwrap();
    assert!(back == expected, "read back through the cache");
    image.close().await.unwrap();
    let reader = Image::open_on(store, "one-by-one", PASS, &OpenOptions::read_only())
        .await
        .unwrap();
    reader.read(0, &mut back).await.unwrap();
    assert!(back == expected, "read back from the store alone");
}

/// `omap-packed`: one omap value per 16 sectors (512 bytes with the default suite), written
/// whole through the cache.
#[tokio::test]
async fn omap_packed_writes_one_whole_value_per_run_and_loads_it_first() {
    let (store, image) = four_object_image(LayoutKind::OmapPacked, "packed").await;
    let object = image.data_object(0).to_string();

    // A first small write: its run's value is read first, then the data and the whole
    // value go out together; nothing at an offset past the data.
    store.clear();
    image.write(3 * SS, &sector(3)).await.unwrap();
    assert_eq!(writes_to(&store, &object), vec![(3 * SS, 4096)]);
    assert_eq!(
        store.omap_of(&object),
        vec!["get 00000000", "set 00000000:512"]
    );

    // The value is known now: no read before the next write in the run.
    store.clear();
    image.write(5 * SS, &sector(5)).await.unwrap();
    assert_eq!(store.omap_of(&object), vec!["set 00000000:512"]);
    assert!(read_steps(&store).is_empty());
    // Reads of known runs fetch the data alone.
    assert_eq!(read_sector(&image, 3).await, sector(3));
    assert_eq!(read_sector(&image, 5).await, sector(5));
    assert_eq!(read_sector(&image, 4).await, sector(0));
    assert!(store.omap_of(&object).len() == 1, "no omap reads");

    // Whole runs need no load, and their sectors, sealed in one run, are stored compact
    // (their nonces count up: 32 + 15 x 16 bytes); a run discarded whole loses its key; a
    // discarded sector zeroes its part of the value and keeps the others (in full form).
    let second = image.data_object(1).to_string();
    store.clear();
    let run = vec![9u8; 16 * SS as usize];
    image.write(OBJECT_SIZE + 32 * SS, &run).await.unwrap();
    image.write(OBJECT_SIZE + 48 * SS, &run).await.unwrap();
    assert_eq!(
        store.omap_of(&second),
        vec!["set 00000002:272", "set 00000003:272"]
    );
    store.clear();
    image.discard(OBJECT_SIZE + 32 * SS, 16 * SS).await.unwrap();
    image.discard(OBJECT_SIZE + 50 * SS, SS).await.unwrap();
    assert_eq!(
        store.omap_of(&second),
        vec!["remove 00000002", "set 00000003:512"]
    );
    image.close().await.unwrap();

    // A read-only open has no cache: each read fetches its runs' values.
    let ro = Image::open_on(store.clone(), "packed", PASS, &OpenOptions::read_only())
        .await
        .unwrap();
    store.clear();
    let mut back = vec![0u8; 32 * SS as usize];
    ro.read(OBJECT_SIZE + 32 * SS, &mut back).await.unwrap();
    assert_eq!(store.omap_of(&second), vec!["get 00000002,00000003"]);
    let mut expected = vec![0u8; 16 * SS as usize];
    expected.extend_from_slice(&run);
    expected[18 * SS as usize..19 * SS as usize].fill(0);
    assert!(back == expected, "discarded run and sector read as zeros");
    assert_eq!(read_sector(&ro, 3).await, sector(3));
    assert_eq!(read_sector(&ro, 5).await, sector(5));
    ro.close().await.unwrap();
}

/// `omap-tail`: a write of a whole object stores its metadata as one extent after its data
/// and removes its values; smaller writes and discards set values, which win over the tail
/// (an empty value: a run discarded whole); reads without the cache fetch both; a byte
/// changed in the tail fails the sectors it belongs to, and nothing else.
#[tokio::test]
async fn omap_tail_puts_whole_objects_at_their_end_and_values_win_over_it() {
    let (store, image) = four_object_image(LayoutKind::OmapTail, "tail").await;
    let object = image.data_object(1).to_string();
    // 16 runs of 16 sectors, each 32 + 15 x 16 bytes compact, padded to a multiple of 4 KiB.
    let tail_len = (16 * 272usize).next_multiple_of(4096);
    let mut content: Vec<u8> = (0..OBJECT_SIZE).map(|i| (i % 251) as u8).collect();
    store.clear();
    image.write(OBJECT_SIZE, &content).await.unwrap();
    // One extent, the data and then the tail (one checksum pass on a replicating OSD).
    assert_eq!(
        writes_to(&store, &object),
        vec![(0, OBJECT_SIZE as usize + tail_len)]
    );
    assert_eq!(store.omap_of(&object), vec!["clear"]);
    // The NBD server's payload buffer gets room for the tail, for a whole object only.
    assert_eq!(image.write_headroom(OBJECT_SIZE, OBJECT_SIZE), tail_len);
    assert_eq!(image.write_headroom(OBJECT_SIZE, OBJECT_SIZE - SS), 0);
    assert_eq!(image.write_headroom(OBJECT_SIZE + SS, OBJECT_SIZE), 0);

    // A sector of run 2 rewritten: the writer knows the run's value from the whole write and
    // sets it whole; run 3 discarded whole: an empty value, so the tail does not show through.
    store.clear();
    image
        .write(OBJECT_SIZE + 37 * SS, &sector(7))
        .await
        .unwrap();
    image.discard(OBJECT_SIZE + 48 * SS, 16 * SS).await.unwrap();
    assert_eq!(
        store.omap_of(&object),
        vec!["set 00000002:512", "set 00000003:0"]
    );
    content[37 * SS as usize..38 * SS as usize].copy_from_slice(&sector(7));
    content[48 * SS as usize..64 * SS as usize].fill(0);
    let mut back = vec![0u8; OBJECT_SIZE as usize];
    image.read(OBJECT_SIZE, &mut back).await.unwrap();
    assert!(back == content, "the writer reads its object back");
    image.close().await.unwrap();

    // Without the cache (a read-only open), reads fetch the values and the tail's slots.
    let ro = Image::open_on(store.clone(), "tail", PASS, &OpenOptions::read_only())
        .await
        .unwrap();
    store.clear();
    ro.read(OBJECT_SIZE, &mut back).await.unwrap();
    assert!(back == content, "read back from the store alone");
    // Two extents (the data, the tail's slots) and the values, in one operation.
    let reads = store.reads.lock().unwrap().clone();
    assert_eq!(reads, vec![(object.clone(), 2)], "the data and the tail");
    let runs: Vec<String> = (0..16).map(|r| format!("{r:08x}")).collect();
    assert_eq!(
        store.omap_of(&object),
        vec![format!("get {}", runs.join(","))]
    );

    // A byte of sector 70's tag in the tail (run 4: its slot at 4 x 272; sector 6 of the
    // run: bytes 32 + 5 x 16 on) fails that sector alone; a byte of run 5's first nonce fails
    // its 16 sectors.
    let ivdisk_image::ImageError::Integrity { .. } = (async {
        flip_stored(&store, &object, OBJECT_SIZE + 4 * 272 + 32 + 5 * 16 + 3).await;
        let mut back = vec![0u8; OBJECT_SIZE as usize];
        ro.read(OBJECT_SIZE, &mut back).await.unwrap_err()
    })
    .await
    else {
        panic!("not an integrity error")
    };
    let failed = |e: ivdisk_image::ImageError| match e {
        ivdisk_image::ImageError::Integrity { lbas, .. } => lbas,
        other => panic!("{other}"),
    };
    let err = ro.read(OBJECT_SIZE, &mut back).await.unwrap_err();
    assert_eq!(failed(err), vec![256 + 70]);
    flip_stored(&store, &object, OBJECT_SIZE + 4 * 272 + 32 + 5 * 16 + 3).await;
    flip_stored(&store, &object, OBJECT_SIZE + 5 * 272).await;
    let err = ro.read(OBJECT_SIZE, &mut back).await.unwrap_err();
    assert_eq!(failed(err), (256 + 80..256 + 96).collect::<Vec<u64>>());
    flip_stored(&store, &object, OBJECT_SIZE + 5 * 272).await;
    ro.close().await.unwrap();

    // A new writer knows nothing: a write into run 6 loads its value and its tail slot first.
    let image = Image::open_on(store.clone(), "tail", PASS, &OpenOptions::default())
        .await
        .unwrap();
    store.clear();
    image
        .write(OBJECT_SIZE + 100 * SS, &sector(8))
        .await
        .unwrap();
    assert_eq!(
        store.omap_of(&object),
        vec!["get 00000006", "set 00000006:512"]
    );
    let reads = store.reads.lock().unwrap().clone();
    assert_eq!(
        reads,
        vec![(object.clone(), 1)],
        "the tail's slot, with the value"
    );
    content[100 * SS as usize..101 * SS as usize].copy_from_slice(&sector(8));
    image.read(OBJECT_SIZE, &mut back).await.unwrap();
    assert!(back == content, "run 6 merged from its tail slot");

    // The object written whole again: its values go, the tail holds it all.
    store.clear();
    let fresh = vec![0x42u8; OBJECT_SIZE as usize];
    image.write(OBJECT_SIZE, &fresh).await.unwrap();
    assert_eq!(store.omap_of(&object), vec!["clear"]);
    image.close().await.unwrap();
    let ro = Image::open_on(store.clone(), "tail", PASS, &OpenOptions::read_only())
        .await
        .unwrap();
    ro.read(OBJECT_SIZE, &mut back).await.unwrap();
    assert!(back == fresh, "the new tail, no stale value");
    ro.close().await.unwrap();
}

/// Flip one bit of the byte at `offset` of `object`, as an attacker with the store could.
async fn flip_stored(store: &BlockStore, object: &str, offset: u64) {
    use ivdisk_store::{ObjectStore, ReadOp, ReadResult, ReadStep, WriteOp};
    let object = ivdisk_store::ObjectName::new(object).unwrap();
    let read = ReadOp::new().step(ReadStep::Read { offset, len: 1 });
    let Ok(results) = store.read_op(&object, read).await else {
        panic!("read {object}")
    };
    let [ReadResult::Extents(extents)] = &results[..] else {
        panic!("{results:?}")
    };
    let byte = extents[0].data[0] ^ 0x01;
    store
        .write_op(&object, WriteOp::new().write(offset, vec![byte]))
        .await
        .unwrap();
}

/// An `omap-packed` image of `objects` objects on a store of its own, open for writing with the
/// smallest cache (asked for none: it keeps one value per shard).
async fn omap_packed_with_the_smallest_cache(
    name: &str,
    objects: u64,
) -> (Arc<BlockStore>, Arc<Image>) {
    let store = Arc::new(BlockStore::new());
    let options = common::options(
        objects * OBJECT_SIZE,
        Suite::DEFAULT,
        LayoutKind::OmapPacked,
        SS as u32,
        OBJECT_SIZE,
    );
    Image::create_on(store.clone(), name, &options, PASS)
        .await
        .unwrap()
        .close()
        .await
        .unwrap();
    let uncached = OpenOptions {
        metadata_cache_bytes: 0,
        ..OpenOptions::default()
    };
    let image = Image::open_on(store.clone(), name, PASS, &uncached)
        .await
        .unwrap();
    (store, Arc::new(image))
}

/// `omap-packed` with the smallest cache (asked for none: it keeps one value per shard):
/// concurrent writes of single sectors over more runs than it holds, so values are evicted
/// and loaded again before writes, read back after a reopen.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn omap_packed_with_the_smallest_cache_loses_no_write() {
    let objects = 8;
    let (store, image) = omap_packed_with_the_smallest_cache("small", objects).await;
    // 8 objects x 16 runs = 128 runs, against 64 values in memory. Every task writes its
    // own sectors (t, t + 16, ...), two passes, so the runs it shares with the others see
    // writes from several tasks in flight at once.
    let sectors = objects * OBJECT_SIZE / SS;
    let tasks: Vec<_> = (0..16u64)
        .map(|t| {
            let image = image.clone();
            tokio::spawn(async move {
                for pass in 0..2u8 {
                    for lba in (t..sectors).step_by(16 * 3) {
                        let value = (lba as u8).wrapping_mul(7).wrapping_add(pass);
                        image.write(lba * SS, &sector(value)).await.unwrap();
                    }
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    Arc::into_inner(image).unwrap().close().await.unwrap();
    let image = Image::open_on(store.clone(), "small", PASS, &OpenOptions::read_only())
        .await
        .unwrap();
    for lba in 0..sectors {
        let expected = if (lba % 48) < 16 {
            sector((lba as u8).wrapping_mul(7).wrapping_add(1))
        } else {
            sector(0)
        };
        assert!(
            read_sector(&image, lba).await == expected,
            "sector {lba} does not hold its last write"
        );
    }
    image.close().await.unwrap();
}

/// Writes across several values (the end of one, a whole one, the start of the next) with the
/// smallest cache: each needs its two partial values known while its whole one goes in. Evicting
/// one of them in between made the write fail (a partial value cannot be stored) or load for
/// ever; a timeout turns the second into a failure here.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn omap_packed_writes_across_values_with_the_smallest_cache() {
    let objects = 8;
    let (store, image) = omap_packed_with_the_smallest_cache("across", objects).await;
    // Sectors 8..44 of every stride of 64: half of value 0, value 1, three quarters of value
    // 2. Each of 8 tasks takes every eighth stride, three passes.
    const STRIDE: u64 = 64;
    const FIRST: u64 = 8;
    const COUNT: u64 = 36;
    let value = |lba: u64, pass: u8| (lba as u8).wrapping_mul(5).wrapping_add(pass + 1);
    let strides = objects * OBJECT_SIZE / SS / STRIDE;
    let tasks: Vec<_> = (0..8u64)
        .map(|t| {
            let image = image.clone();
            tokio::spawn(async move {
                for pass in 0..3u8 {
                    for stride in (t..strides).step_by(8) {
                        let lba = stride * STRIDE + FIRST;
                        let data: Vec<u8> = (lba..lba + COUNT)
                            .flat_map(|l| sector(value(l, pass)))
                            .collect();
                        image.write(lba * SS, &data).await.unwrap();
                    }
                }
            })
        })
        .collect();
    let all = async {
        for task in tasks {
            task.await.unwrap();
        }
    };
    tokio::time::timeout(std::time::Duration::from_secs(120), all)
        .await
        .expect("every write ends");
    Arc::into_inner(image).unwrap().close().await.unwrap();
    let image = Image::open_on(store.clone(), "across", PASS, &OpenOptions::read_only())
        .await
        .unwrap();
    for lba in 0..strides * STRIDE {
        let written = (FIRST..FIRST + COUNT).contains(&(lba % STRIDE));
        let expected = sector(if written { value(lba, 2) } else { 0 });
        assert!(
            read_sector(&image, lba).await == expected,
            "sector {lba} does not hold its last write"
        );
    }
    image.close().await.unwrap();
}
