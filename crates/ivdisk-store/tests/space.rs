//! Dead data gives its space back: overwritten, removed and snapshot-freed extents are punched
//! out of the local store's segments, even when appends do not start on block boundaries; dead
//! whole blocks are first written again by new whole-block writes, and what is left is punched
//! once writes stop.

use std::os::unix::fs::MetadataExt;
use std::path::Path;

use ivdisk_store::{LocalStore, LocalStoreOptions, ObjectName, ObjectStore, ObjectStoreExt};

/// Bytes the data segments occupy on disk.
fn allocated(store_dir: &Path) -> u64 {
    std::fs::read_dir(store_dir.join("data"))
        .unwrap()
        .map(|e| e.unwrap().metadata().unwrap().blocks() * 512)
        .sum()
}

/// Bytes the data segments occupy once the background punches are done: dead data is
/// punched after the durable commit that freed it, without a flush waiting for it (unless
/// space ran out), so this waits until at most `bound` bytes are allocated, up to 30 s, and
/// returns what it saw last.
async fn allocated_once_punched(store_dir: &Path, bound: u64) -> u64 {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let used = allocated(store_dir);
        if used <= bound || std::time::Instant::now() > deadline {
            return used;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn overwrites_and_removals_free_space_with_misaligned_appends() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s");
    let store = LocalStore::open_with(&path, &LocalStoreOptions { create: true }).unwrap();
    // One odd-sized write first: every later append starts off a block boundary.
    store
        .write(&ObjectName::new("odd").unwrap(), 0, b"x")
        .await
        .unwrap();
    let objects: Vec<ObjectName> = (0..64)
        .map(|i| ObjectName::new(format!("o{i}")).unwrap())
        .collect();
    for pass in 0..20u8 {
        for o in &objects {
            store.write(o, 0, &[pass; 4096]).await.unwrap();
        }
        store.flush().await.unwrap();
    }
    let live = 64 * 4096;
    let used = allocated_once_punched(&path, live + 64 * 4096 + (64 << 10)).await;
    assert!(
        used <= live + 64 * 4096 + (64 << 10),
        "{used} bytes allocated for {live} live bytes"
    );
    for o in &objects {
        store.remove(o).await.unwrap();
    }
    store.flush().await.unwrap();
    let after = allocated_once_punched(&path, 16 << 10).await;
    assert!(
        after <= 16 << 10,
        "{after} bytes still allocated after removing everything"
    );
    assert_eq!(
        store
            .read(&ObjectName::new("odd").unwrap(), 0, 1)
            .await
            .unwrap(),
        b"x",
        "a live neighbour of punched blocks was damaged"
    );
}

/// The bytes the data segments span (holes included): what appends have grown them to.
fn segment_length(store_dir: &Path) -> u64 {
    std::fs::read_dir(store_dir.join("data"))
        .unwrap()
        .map(|e| e.unwrap().metadata().unwrap().len())
        .sum()
}

/// Overwrites of whole blocks go into the space earlier overwrites freed, so the segments stop
/// growing; every object reads back its last write; once writes stop, the dead space still
/// held is punched without a flush or a reclaim asking for it.
#[tokio::test]
async fn whole_block_overwrites_reuse_dead_space() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s");
    let store = LocalStore::open_with(&path, &LocalStoreOptions { create: true }).unwrap();
    const OBJECTS: usize = 32;
    const LEN: usize = 256 << 10;
    let objects: Vec<ObjectName> = (0..OBJECTS)
        .map(|i| ObjectName::new(format!("o{i}")).unwrap())
        .collect();
    let data = |pass: u8, i: usize| -> Vec<u8> {
        (0..LEN)
            .map(|b| pass ^ (i as u8) ^ (b / 4096) as u8)
            .collect()
    };
    let live = (OBJECTS * LEN) as u64;
    let mut grown_after_two = 0;
    for pass in 0..30u8 {
        for (i, o) in objects.iter().enumerate() {
            store.write(o, 0, &data(pass, i)).await.unwrap();
        }
        // A flush makes the frees durable: their blocks are reusable from here on.
        store.flush().await.unwrap();
        if pass == 1 {
            grown_after_two = segment_length(&path);
        }
    }
    let grown = segment_length(&path);
    // Without reuse the segments would span 30 x 8 MiB; with it they stay near two passes.
    assert!(
        grown <= grown_after_two + live,
        "the segments grew from {grown_after_two} to {grown} bytes under overwrites of {live} \
         live bytes: dead space was not reused"
    );
    for (i, o) in objects.iter().enumerate() {
        let read = store.read(o, 0, LEN as u64).await.unwrap();
        assert!(
            read == data(29, i),
            "object {i} does not read back its last write"
        );
    }
    // No flush, no reclaim: the held space goes back once writes stopped for a while.
    let used = allocated_once_punched(&path, live + (64 << 10)).await;
    assert!(
        used <= live + (64 << 10),
        "{used} bytes still allocated for {live} live bytes after writes stopped"
    );
    drop(store);
    let store = LocalStore::open(&path).unwrap();
    for (i, o) in objects.iter().enumerate() {
        let read = store.read(o, 0, LEN as u64).await.unwrap();
        assert!(read == data(29, i), "object {i} changed across a reopen");
    }
}

/// Small overwrites reuse small dead ranges too: 4 KiB writes at scattered blocks of one
/// object (cutting its extents, as a disk's random writes do) go into the 4 KiB blocks earlier
/// ones left dead instead of growing the segments; the object reads back its last state.
#[tokio::test]
async fn small_block_overwrites_reuse_dead_space() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s");
    let store = LocalStore::open_with(&path, &LocalStoreOptions { create: true }).unwrap();
    const BLOCKS: u64 = 256;
    let object = ObjectName::new("disk").unwrap();
    let mut model = vec![0u8; (BLOCKS * 4096) as usize];
    store.write(&object, 0, &model).await.unwrap();
    store.flush().await.unwrap();
    let live = BLOCKS * 4096;
    let mut grown_after_two = 0;
    // Every block once per pass (7 and 256 are coprime), starting elsewhere each time.
    for pass in 1..=30u64 {
        for k in 0..BLOCKS {
            let block = (k * 7 + pass * 13) % BLOCKS;
            let bytes = vec![(pass as u8) ^ (block as u8); 4096];
            let at = (block * 4096) as usize;
            model[at..at + 4096].copy_from_slice(&bytes);
            store.write(&object, block * 4096, &bytes).await.unwrap();
        }
        store.flush().await.unwrap();
        if pass == 2 {
            grown_after_two = segment_length(&path);
        }
    }
    let grown = segment_length(&path);
    // Without reuse the segments would grow by 28 x 1 MiB more; with it, by little.
    assert!(
        grown <= grown_after_two + live,
        "the segments grew from {grown_after_two} to {grown} bytes under 4 KiB overwrites of \
         {live} live bytes: dead space was not reused"
    );
    let read = store.read(&object, 0, live).await.unwrap();
    assert!(
        read == model,
        "the object does not read back its last state"
    );
    drop(store);
    let store = LocalStore::open(&path).unwrap();
    let read = store.read(&object, 0, live).await.unwrap();
    assert!(read == model, "the object changed across a reopen");
}

/// The child side of `a_crash_leaves_no_dead_data_behind`: overwrite everything once after the
/// last flush, wait for the group commit (not durable, so the dead data's release is still
/// pending), say so, and wait to be killed.
async fn crash_child(dir: &Path) -> ! {
    let store = LocalStore::open(dir).unwrap();
    for o in 0..64 {
        store
            .write(&ObjectName::new(format!("o{o}")).unwrap(), 0, &[2u8; 65536])
            .await
            .unwrap();
    }
    tokio::time::sleep(std::time::Duration::from_millis(800)).await;
    println!("ready");
    loop {
        tokio::time::sleep(std::time::Duration::from_secs(60)).await;
    }
}

#[tokio::test]
async fn a_crash_leaves_no_dead_data_behind() {
    if let Ok(dir) = std::env::var("IVDISK_SPACE_CHILD") {
        crash_child(Path::new(&dir)).await;
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s");
    {
        let store = LocalStore::open_with(&path, &LocalStoreOptions { create: true }).unwrap();
        for o in 0..64 {
            store
                .write(&ObjectName::new(format!("o{o}")).unwrap(), 0, &[1u8; 65536])
                .await
                .unwrap();
        }
        store.flush().await.unwrap();
    }
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "a_crash_leaves_no_dead_data_behind",
            "--nocapture",
        ])
        .env("IVDISK_SPACE_CHILD", &path)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    while !line.contains("ready") {
        line.clear();
        assert!(
            std::io::BufRead::read_line(&mut out, &mut line).unwrap() > 0,
            "the child ended before it was ready"
        );
    }
    child.kill().unwrap();
    child.wait().unwrap();

    let before = allocated(&path);
    let store = LocalStore::open(&path).unwrap();
    // The reclaim's search and punches run in the background; `reclaim_space` waits for them.
    store.reclaim_space().await.unwrap();
    let report = store.recovery_report();
    let after = allocated(&path);
    // The overwrite committed (its group commit ran before the kill) but the first pass's data
    // was never released; opening after the crash finds and punches it.
    assert_eq!(
        store
            .read(&ObjectName::new("o7").unwrap(), 0, 65536)
            .await
            .unwrap(),
        vec![2u8; 65536]
    );
    assert!(report.reclaimed_bytes >= 64 * 65536, "{report:?}");
    let live = 64 * 65536;
    assert!(
        before >= 2 * live,
        "the test did not leave dead data: {before} bytes"
    );
    assert!(
        after <= live + (64 << 10),
        "{after} bytes allocated for {live} live"
    );
}

/// The image's metadata pattern (`object-end` layout): one append holding many small records
/// (the metadata extent of a sequential fill), then records overwritten one at a time (a random
/// 4 KiB write's 32 bytes, kept inline). Each overwrite leaves a dead range smaller than a
/// block; once every record of a block is dead the block is punched, while a block with one
/// live record stays allocated and reads back intact. The records of each block are
/// overwritten in two flushes (even ones, then odd ones), so that the second flush's dead
/// ranges do not merge into whole blocks: only the look-up of what else a block holds
/// (`Engine::referenced`) can free them. With `snapshot`, a snapshot taken before the
/// overwrites keeps the old records (two nodes share their bytes): nothing is freed until it is
/// removed.
async fn records_overwritten_one_by_one(snapshot: bool) {
    use ivdisk_store::{SnapContext, WriteOp};
    const RECORD: usize = 32;
    const BLOCKS: usize = 64;
    const BLOCK: usize = 4096;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s");
    let store = LocalStore::open_with(&path, &LocalStoreOptions { create: true }).unwrap();
    let object = ObjectName::new("metadata").unwrap();
    let original: Vec<u8> = (0..BLOCKS * BLOCK).map(|i| (i % 251) as u8).collect();
    store.write(&object, 0, &original).await.unwrap();
    store.reclaim_space().await.unwrap();
    let full = allocated(&path);
    assert!(full >= (BLOCKS * BLOCK) as u64, "{full} bytes allocated");
    let context = if snapshot {
        let snap = store.snap_create().await.unwrap();
        Some(SnapContext {
            seq: snap,
            snaps: vec![snap],
        })
    } else {
        None
    };
    // Odd blocks keep their last record.
    let keeps =
        |r: usize| (r * RECORD / BLOCK) % 2 == 1 && ((r + 1) * RECORD).is_multiple_of(BLOCK);
    let mut expected = original.clone();
    for parity in [0, 1] {
        for r in (parity..BLOCKS * BLOCK / RECORD).step_by(2) {
            if keeps(r) {
                continue;
            }
            let record = [(r % 200) as u8 + 1; RECORD];
            let mut op = WriteOp::new().write((r * RECORD) as u64, record.to_vec());
            if let Some(context) = &context {
                op = op.with_snap_context(context.clone());
            }
            store.write_op(&object, op).await.unwrap();
            expected[r * RECORD..(r + 1) * RECORD].copy_from_slice(&record);
        }
        store.flush().await.unwrap();
    }
    store.reclaim_space().await.unwrap();
    let overwritten = allocated(&path);
    let half = (BLOCKS / 2 * BLOCK) as u64;
    if let Some(context) = &context {
        assert!(
            overwritten >= full,
            "{} bytes punched while a snapshot still holds them",
            full - overwritten
        );
        assert_eq!(
            store
                .read_op(
                    &object,
                    ivdisk_store::ReadOp::new().at_snap(context.seq).step(
                        ivdisk_store::ReadStep::Read {
                            offset: 0,
                            len: (BLOCKS * BLOCK) as u64,
                        }
                    ),
                )
                .await
                .unwrap()
                .len(),
            1
        );
        store.snap_remove(context.seq).await.unwrap();
        store.reclaim_space().await.unwrap();
    }
    let freed = allocated(&path);
    // Slack: a file with many holes needs extent-tree blocks of its own, counted in its blocks.
    let slack = 16 << 10;
    assert!(
        freed + half <= full + slack,
        "{full} bytes allocated before the overwrites, {freed} after: the {} blocks whose \
         records all died were not punched",
        BLOCKS / 2
    );
    assert!(
        freed >= half,
        "{freed} bytes allocated: blocks with a live record were punched"
    );
    assert_eq!(
        store
            .read(&object, 0, (BLOCKS * BLOCK) as u64)
            .await
            .unwrap(),
        expected,
        "the records read back wrong"
    );
}

#[tokio::test]
async fn records_overwritten_one_by_one_free_their_blocks() {
    records_overwritten_one_by_one(false).await;
}

#[tokio::test]
async fn records_under_a_snapshot_are_freed_when_it_is_removed() {
    records_overwritten_one_by_one(true).await;
}

/// Dead bytes at the end of the active segment are widened over the rest of their block (not
/// written yet when their commit widens them); appends made into that block after the commit,
/// before the punch is queued, must survive it.
#[tokio::test]
async fn appends_after_a_commit_survive_the_punch_of_the_block_they_share() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s");
    let store = LocalStore::open_with(&path, &LocalStoreOptions { create: true }).unwrap();
    for round in 0..50u32 {
        let dead = ObjectName::new(format!("dead{round}")).unwrap();
        let live = ObjectName::new(format!("live{round}")).unwrap();
        // 1.5 KiB: past the inline limit, in the segments, off block boundaries.
        store.write(&dead, 0, &[1u8; 1536]).await.unwrap();
        store.remove(&dead).await.unwrap();
        // Off block boundaries, and long enough to reach past the dead bytes' block.
        let payload = vec![round as u8 + 2; 3000];
        // Sent once the flush's commit is likely done, and its log sync not yet.
        let delay = std::time::Duration::from_micros(200 * (round as u64 % 10));
        let (flushed, written) = tokio::join!(store.flush(), async {
            std::thread::sleep(delay);
            store.write(&live, 0, &payload).await
        });
        flushed.unwrap();
        written.unwrap();
        store.flush().await.unwrap();
        // Let the punch thread run.
        tokio::time::sleep(std::time::Duration::from_millis(30)).await;
        assert_eq!(
            store.read(&live, 0, 3000).await.unwrap(),
            payload,
            "round {round}: a live append was punched out"
        );
    }
}
