//! Concurrent writers: 32 tokio tasks, each with its own clone of one `Image`, write distinct
//! byte values to random overlapping sub-sector ranges within a few sectors that straddle an
//! object boundary, while readers read the same sectors. The final content must be that of
//! SOME serial order of the writes (consistent with each task's own order); every byte a
//! reader sees must be zero or the value of a write covering it, and no read may fail
//! authentication (data and metadata change in one atomic operation).
//!
//! The check: each byte's final value names the write that was applied last there; every other
//! write covering that byte must come before it. Together with each task's program order
//! these edges must form an acyclic graph (then a topological order is a serial order that
//! explains every byte, and without one no serial order does). A byte covered by no write
//! must be zero, and a covered byte must hold the value of a write covering it.

mod common;

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use common::{Backend, Rng};
use ivdisk_crypto::Suite;
use ivdisk_image::{Image, LayoutKind};

const TASKS: usize = 32;
const WRITES_PER_TASK: usize = 4;
const READERS: usize = 4;
const WINDOW_SECTORS: u64 = 4;

/// One write of a round: `len` bytes of `value` at `offset` (relative to the window), the
/// `seq`-th write of task `task`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct W {
    task: usize,
    seq: usize,
    value: u8,
    offset: u64,
    len: u64,
}

impl W {
    fn covers(&self, at: u64) -> bool {
        (self.offset..self.offset + self.len).contains(&at)
    }
}

/// Whether `content` (the window after all `writes`, which started as zeros) is the result
/// of some serial order of the writes consistent with each task's order. `Err` explains why
/// not.
fn check_serializable(writes: &[W], content: &[u8]) -> Result<(), String> {
    let n = writes.len();
    let index_of_value = |v: u8| writes.iter().position(|w| w.value == v);
    let mut edges: Vec<BTreeSet<usize>> = vec![BTreeSet::new(); n];
    for (at, &byte) in content.iter().enumerate() {
        let at = at as u64;
        let covering: Vec<usize> = (0..n).filter(|&i| writes[i].covers(at)).collect();
        if covering.is_empty() {
            if byte != 0 {
                return Err(format!(
                    "byte {at} holds {byte:#04x} but no write covers it"
                ));
            }
            continue;
        }
        let winner = index_of_value(byte)
            .filter(|i| covering.contains(i))
            .ok_or_else(|| {
                format!(
                    "byte {at} holds {byte:#04x}, which none of the writes covering it wrote \
                     (covering values: {:?})",
                    covering
                        .iter()
                        .map(|&i| writes[i].value)
                        .collect::<Vec<_>>()
                )
            })?;
        for &other in &covering {
            if other != winner {
                edges[other].insert(winner);
            }
        }
    }
    // Each task's writes happened in its order.
    for a in 0..n {
        for b in 0..n {
            if writes[a].task == writes[b].task && writes[a].seq < writes[b].seq {
                edges[a].insert(b);
            }
        }
    }
    // Kahn: what cannot be ordered lies on a cycle.
    let mut indegree = vec![0usize; n];
    for targets in &edges {
        for &t in targets {
            indegree[t] += 1;
        }
    }
    let mut ready: Vec<usize> = (0..n).filter(|&i| indegree[i] == 0).collect();
    let mut ordered = 0;
    while let Some(i) = ready.pop() {
        ordered += 1;
        for &t in &edges[i] {
            indegree[t] -= 1;
            if indegree[t] == 0 {
                ready.push(t);
            }
        }
    }
    if ordered < n {
        let stuck: Vec<String> = (0..n)
            .filter(|&i| indegree[i] > 0)
            .map(|i| format!("{:?}", writes[i]))
            .collect();
        return Err(format!(
            "no serial order of the writes explains the content: these writes' last-writer \
             relations form a cycle: {}",
            stuck.join(", ")
        ));
    }
    Ok(())
}

/// The writes of one round, in a window of `window` bytes: values 1.. (unique), ranges mostly
/// within a sector, some across sector boundaries.
fn round_writes(rng: &mut Rng, window: u64, ss: u64) -> Vec<W> {
    let mut writes = Vec::new();
    let mut value = 1u8;
    for task in 0..TASKS {
        for seq in 0..WRITES_PER_TASK {
            let offset = rng.below(window);
            let longest = if rng.chance(3, 4) { ss - 1 } else { 2 * ss };
            let len = rng.range(1, longest.min(window - offset));
            writes.push(W {
                task,
                seq,
                value,
                offset,
                len,
            });
            value += 1;
        }
    }
    writes
}

/// Where the image of [`concurrent_writers`] lives.
#[derive(Debug, Clone, Copy)]
enum Target {
    On(Backend),
    /// The memory store behind [`common::BlockStore`]: metadata goes out in whole blocks.
    MemoryWholeBlocks,
}

async fn concurrent_writers(
    test: &str,
    target: Target,
    suite: Suite,
    layout: LayoutKind,
    sector_size: u32,
    rounds: u64,
) {
    let (seed, _guard) = common::seed(test);
    let mut rng = Rng::derive(seed, test);
    let ss = sector_size as u64;
    // Two sectors per object at 4096, eight at 512: the window of four sectors straddles an
    // object boundary, so some writes are two store operations.
    let object_size = (2 * ss).max(4096);
    let size = rounds * 4 * object_size + 2 * object_size;
    let options = common::options(size, suite, layout, sector_size, object_size);
    let (_place, image) = match target {
        Target::On(backend) => {
            let place = common::place(backend, "concurrency");
            let image = Image::create(&place.uri, &options, common::PASS)
                .await
                .unwrap();
            (Some(place), image)
        }
        Target::MemoryWholeBlocks => {
            let store = std::sync::Arc::new(common::BlockStore::new());
            let image = Image::create_on(store, "concurrency", &options, common::PASS)
                .await
                .unwrap();
            (None, image)
        }
    };
    let window = WINDOW_SECTORS * ss;
    for round in 0..rounds {
        // A fresh (zero) region each round.
        let base = round * 4 * object_size + 2 * object_size - 2 * ss;
        let writes = Arc::new(round_writes(&mut rng, window, ss));
        let done = Arc::new(AtomicBool::new(false));
        let readers: Vec<_> = (0..READERS)
            .map(|_| {
                let (image, writes, done) = (image.clone(), writes.clone(), done.clone());
                tokio::spawn(async move {
                    let mut reads = 0;
                    loop {
                        let finished = done.load(Ordering::Acquire);
                        let mut buf = vec![0u8; window as usize];
                        image
                            .read(base, &mut buf)
                            .await
                            .map_err(|e| format!("a read during the writes failed: {e}"))?;
                        for (at, &byte) in buf.iter().enumerate() {
                            let ok = byte == 0
                                || writes
                                    .iter()
                                    .any(|w| w.value == byte && w.covers(at as u64));
                            if !ok {
                                return Err(format!(
                                    "a read during the writes saw {byte:#04x} at byte {at}, \
                                     which no write covering it wrote"
                                ));
                            }
                        }
                        reads += 1;
                        if finished {
                            return Ok::<_, String>(reads);
                        }
                        tokio::task::yield_now().await;
                    }
                })
            })
            .collect();
        let writers: Vec<_> = (0..TASKS)
            .map(|task| {
                let image = image.clone();
                let mine: Vec<W> = writes.iter().filter(|w| w.task == task).copied().collect();
                tokio::spawn(async move {
                    for w in mine {
                        let data = vec![w.value; w.len as usize];
                        image.write(base + w.offset, &data).await?;
                        tokio::task::yield_now().await;
                    }
                    Ok::<_, ivdisk_image::ImageError>(())
                })
            })
            .collect();
        for writer in writers {
            writer.await.unwrap().unwrap();
        }
        done.store(true, Ordering::Release);
        for reader in readers {
            let reads = reader
                .await
                .unwrap()
                .unwrap_or_else(|e| panic!("{test} round {round} (seed {seed:#x}): {e}"));
            assert!(reads >= 1);
        }
        let mut content = vec![0u8; window as usize];
        image.read(base, &mut content).await.unwrap();
        check_serializable(&writes, &content)
            .unwrap_or_else(|e| panic!("{test} round {round} (seed {seed:#x}): {e}"));
        // The sectors around the window were not touched.
        let mut around = vec![0xFFu8; ss as usize];
        image.read(base - ss, &mut around).await.unwrap();
        assert!(around.iter().all(|&b| b == 0), "{test}: the sector before");
        image.read(base + window, &mut around).await.unwrap();
        assert!(around.iter().all(|&b| b == 0), "{test}: the sector after");
    }
    image.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_overlapping_writes_serialize_memory() {
    concurrent_writers(
        "concurrent_overlapping_writes_serialize_memory",
        Target::On(Backend::Memory),
        Suite::DEFAULT,
        LayoutKind::ObjectEnd,
        4096,
        12,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_overlapping_writes_serialize_memory_512_omap() {
    concurrent_writers(
        "concurrent_overlapping_writes_serialize_memory_512_omap",
        Target::On(Backend::Memory),
        Suite::AesGcmRandom,
        LayoutKind::Omap,
        512,
        12,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_overlapping_writes_serialize_memory_omap_packed() {
    concurrent_writers(
        "concurrent_overlapping_writes_serialize_memory_omap_packed",
        Target::On(Backend::Memory),
        Suite::DEFAULT,
        LayoutKind::OmapPacked,
        4096,
        12,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_overlapping_writes_serialize_local() {
    concurrent_writers(
        "concurrent_overlapping_writes_serialize_local",
        Target::On(Backend::Local),
        Suite::DEFAULT,
        LayoutKind::Unaligned,
        4096,
        12,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_overlapping_writes_serialize_local_xts_none() {
    concurrent_writers(
        "concurrent_overlapping_writes_serialize_local_xts_none",
        Target::On(Backend::Local),
        Suite::AesXtsPlain64,
        LayoutKind::None,
        512,
        12,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_overlapping_writes_serialize_memory_whole_metadata_blocks() {
    concurrent_writers(
        "concurrent_overlapping_writes_serialize_memory_whole_metadata_blocks",
        Target::MemoryWholeBlocks,
        Suite::DEFAULT,
        LayoutKind::ObjectEnd,
        4096,
        12,
    )
    .await;
}

/// On RADOS (whole metadata blocks, the writes of one object ordered by the OSD).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_overlapping_writes_serialize_rados() {
    if common::rados_uri("probe").is_none() {
        return;
    }
    concurrent_writers(
        "concurrent_overlapping_writes_serialize_rados",
        Target::On(Backend::Rados),
        Suite::DEFAULT,
        LayoutKind::ObjectEnd,
        4096,
        6,
    )
    .await;
}

// The checker itself: it accepts what a serial order gives and rejects what none gives.

fn w(task: usize, seq: usize, value: u8, offset: u64, len: u64) -> W {
    W {
        task,
        seq,
        value,
        offset,
        len,
    }
}

/// Apply `writes` in `order` to a zero window.
fn apply(writes: &[W], order: &[usize], window: usize) -> Vec<u8> {
    let mut content = vec![0u8; window];
    for &i in order {
        let w = writes[i];
        content[w.offset as usize..(w.offset + w.len) as usize].fill(w.value);
    }
    content
}

#[test]
fn the_checker_accepts_serial_orders_and_rejects_the_rest() {
    let writes = [
        w(0, 0, 1, 0, 10),
        w(1, 0, 2, 5, 10),
        w(2, 0, 3, 8, 4),
        w(0, 1, 4, 30, 2),
    ];
    for order in [[0, 1, 2, 3], [2, 1, 0, 3], [1, 0, 3, 2], [3, 2, 0, 1]] {
        let content = apply(&writes, &order, 40);
        check_serializable(&writes, &content)
            .unwrap_or_else(|e| panic!("order {order:?} rejected: {e}"));
    }
    // Random rounds applied in random serial orders.
    let mut random = Rng::new(7);
    for _ in 0..50 {
        let writes = round_writes(&mut random, 64, 16);
        // A random interleaving of the tasks, each in its own order.
        let mut next = vec![0usize; TASKS];
        let mut order = Vec::new();
        while order.len() < writes.len() {
            let task = random.below(TASKS as u64) as usize;
            if next[task] < WRITES_PER_TASK {
                order.push(task * WRITES_PER_TASK + next[task]);
                next[task] += 1;
            }
        }
        let content = apply(&writes, &order, 64);
        check_serializable(&writes, &content).unwrap();
    }

    // A lost update: byte 0 is covered by write 1 but holds zero.
    let mut content = apply(&writes, &[0, 1, 2, 3], 40);
    content[0] = 0;
    assert!(check_serializable(&writes, &content).is_err());
    // A byte nobody wrote.
    let mut content = apply(&writes, &[0, 1, 2, 3], 40);
    content[20] = 9;
    assert!(check_serializable(&writes, &content).is_err());
    // A value from a write that does not cover the byte.
    let mut content = apply(&writes, &[0, 1, 2, 3], 40);
    content[1] = 4;
    assert!(check_serializable(&writes, &content).is_err());
    // Torn: in the overlap [5, 10) of writes 1 and 2, byte 5 says 2 after 1, byte 6 says 1
    // after 2.
    let mut content = apply(&writes, &[0, 1, 2, 3], 40);
    content[6] = 1;
    let err = check_serializable(&writes, &content).unwrap_err();
    assert!(err.contains("cycle"), "{err}");
    // Against a task's own order: its earlier write wins where the two overlap.
    let same_task = [w(0, 0, 1, 0, 4), w(0, 1, 2, 2, 4)];
    let content = apply(&same_task, &[1, 0], 8);
    assert!(check_serializable(&same_task, &content).is_err());
    assert!(check_serializable(&same_task, &apply(&same_task, &[0, 1], 8)).is_ok());
}

/// The memory store, its data object writes taking a millisecond (a disk's or a network's
/// wait, during which other writes run).
struct SlowDataStore {
    inner: ivdisk_store::MemoryStore,
}

ivdisk_store::object_store_forwarding_to_inner!(SlowDataStore {
    async fn write_op(
        &self,
        object: &ivdisk_store::ObjectName,
        op: ivdisk_store::WriteOp,
    ) -> Result<ivdisk_store::WriteOutcome, ivdisk_store::StoreError> {
        if object.as_str().starts_with("ivdisk_data.") {
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
        self.inner.write_op(object, op).await
    }
    async fn read_op(
        &self,
        object: &ivdisk_store::ObjectName,
        op: ivdisk_store::ReadOp,
    ) -> Result<Vec<ivdisk_store::ReadResult>, ivdisk_store::StoreError> {
        self.inner.read_op(object, op).await
    }
});

/// The nonce count of an `aes-gcm-random` image saved in its header object covers every
/// sector encrypted, however many writes run at once when the reservation runs out: each
/// checked the cipher's count before any of them encrypted, all fit under the reservation,
/// and together they passed it (a crash then restarted the count below what was used).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_writes_never_outrun_the_saved_nonce_count() {
    use ivdisk_store::{ObjectName, ObjectStoreExt};
    const MIB: u64 = 1 << 20;
    const SECTORS_PER_MIB: u64 = MIB / 4096;
    let store: Arc<dyn ivdisk_store::ObjectStore> = Arc::new(SlowDataStore {
        inner: ivdisk_store::MemoryStore::new().unwrap(),
    });
    // Objects of 16 KiB: each 1 MiB write is 64 objects, encrypted in batches of 16 with
    // waits between them, and the others' checks run meanwhile.
    let options = common::options(
        512 * MIB,
        Suite::AesGcmRandom,
        LayoutKind::Omap,
        4096,
        16 << 10,
    );
    let image = Image::create_on(store.clone(), "gcm", &options, common::PASS)
        .await
        .unwrap();
    let header = ObjectName::new(ivdisk_image::header_object_name("gcm")).unwrap();
    let saved = || async {
        let (_, v) = store
            .omap_all(&header)
            .await
            .unwrap()
            .into_iter()
            .find(|(k, _)| k == b"ivdisk.nonce_writes_reserved")
            .expect("a saved nonce count");
        std::str::from_utf8(&v).unwrap().parse::<u64>().unwrap()
    };
    let data = vec![0x42u8; MIB as usize];
    // The first write saves the first count.
    image.write(0, &data).await.unwrap();
    let mut written = SECTORS_PER_MIB;
    let mut next = 1u64;
    for round in 0..3 {
        // Written one at a time up to a few MiB below the saved count...
        while written + (round + 3) * SECTORS_PER_MIB < saved().await {
            image.write(next % 512 * MIB, &data).await.unwrap();
            written += SECTORS_PER_MIB;
            next += 1;
        }
        // ...then many at once, together past it.
        let writes: Vec<_> = (0..16)
            .map(|i| {
                let (image, data) = (image.clone(), data.clone());
                tokio::spawn(async move { image.write((next + i) % 512 * MIB, &data).await })
            })
            .collect();
        for write in writes {
            write.await.unwrap().unwrap();
        }
        written += 16 * SECTORS_PER_MIB;
        next += 16;
        let saved = saved().await;
        assert!(
            saved >= written,
            "round {round}: {written} sectors encrypted, {saved} saved"
        );
    }
    image.close().await.unwrap();
}
