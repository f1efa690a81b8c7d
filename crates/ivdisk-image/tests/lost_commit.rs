//! A local store that loses acknowledged writes while it is open: its group commit fails for
//! lack of space (SQLite rolls the transaction back), and the next flush reports the loss;
//! from then on that open refuses writes and flushes (`ImageError::WritesLost`).
//! The image on it must stay authentic: no sector may end up with metadata that does not
//! match its data. Two things could break that, and both did before they were fixed:
//! - the store punching, at a later durable commit, ranges that only the lost transaction had
//!   found dead (they are live again), zeroing data;
//! - the image's metadata cache still holding a lost write's metadata, and a later write to
//!   another sector of the same metadata block storing the whole block from it.
//!
//! The file system is a small tmpfs mounted here (root is needed), filled to the last byte
//! by a file between the write and the flush, as another program on the same disk would:
//! twice, since the first time the store gives the commit the room it keeps for it.

mod common;

use common::{options, PASS};
use ivdisk_crypto::Suite;
use ivdisk_image::{Image, ImageError, ImageUri, LayoutKind, OpenOptions};
use ivdisk_store::small_fs::SmallFileSystem;

const SECTOR: u64 = 4096;
const OBJECT: u64 = 64 << 10;

async fn sectors(image: &Image, count: u64) -> Vec<Vec<u8>> {
    let mut all = Vec::new();
    for lba in 0..count {
        let mut sector = vec![0u8; SECTOR as usize];
        image
            .read(lba * SECTOR, &mut sector)
            .await
            .unwrap_or_else(|e| panic!("sector {lba}: {e}"));
        all.push(sector);
    }
    all
}

async fn lost_commit_keeps_every_sector_authentic(layout: LayoutKind) {
    let scratch = tempfile::tempdir().unwrap();
    let fs = SmallFileSystem::mount(&scratch.path().join("small"), "16m");
    let dir = fs.path().join("disk.ivd");
    let uri = ImageUri::parse(dir.to_str().unwrap()).unwrap();
    let opts = options(4 * OBJECT, Suite::DEFAULT, layout, SECTOR as u32, OBJECT);
    Image::create(&uri, &opts, PASS)
        .await
        .unwrap()
        .close()
        .await
        .unwrap();
    let image = Image::open(&uri, PASS, &OpenOptions::default())
        .await
        .unwrap();

    // Durable: the first 16 sectors (one metadata block of `omap-packed`) hold 1s.
    image.write(0, &[1u8; 16 * SECTOR as usize]).await.unwrap();
    image.flush().await.unwrap();

    // The disk fills up a first time: the store gives the room it keeps for its commits
    // (`reserved-space`) to this one, and nothing is lost.
    image
        .write(6 * SECTOR, &[1u8; SECTOR as usize])
        .await
        .unwrap();
    let filler = fs.fill("filler-first");
    image
        .flush()
        .await
        .unwrap_or_else(|e| panic!("{layout}: the commit had no room on a full disk: {e}"));
    std::fs::remove_file(&filler).unwrap();

    // Acknowledged, not yet committed: sector 5 rewritten with 2s.
    image
        .write(5 * SECTOR, &[2u8; SECTOR as usize])
        .await
        .unwrap();

    // The disk fills up again before the commit, and the store has not taken its room back
    // (it waits for twice that much free): the flush fails, and sector 5's rewrite is lost.
    let filler = fs.fill("filler");
    let flushed = image.flush().await;
    let lost = match flushed {
        Err(e) => {
            println!("{layout}: the flush on the full disk: {e}");
            assert!(e.is_no_space(), "{e:?}");
            true
        }
        // The commit found room after all (its log had space left from before): nothing was
        // lost, and the checks below still hold.
        Ok(()) => {
            println!("{layout}: the commit fit on the full disk; nothing was lost");
            false
        }
    };
    std::fs::remove_file(&filler).unwrap();

    // Space is back. After a loss this open refuses writes and flushes (a flush that
    // succeeded now would tell a client the lost writes are durable); opened again, the
    // image starts from what was made durable.
    let image = if lost {
        let refused = image.write(3 * SECTOR, &[3u8; SECTOR as usize]).await;
        assert!(
            matches!(refused, Err(ImageError::WritesLost { .. })),
            "{layout}: a write after the loss: {refused:?}"
        );
        for _ in 0..2 {
            let flushed = image.flush().await;
            assert!(
                matches!(flushed, Err(ImageError::WritesLost { .. })),
                "{layout}: a flush after the loss, with space again: {flushed:?}"
            );
        }
        let closed = image.close().await;
        assert!(closed.is_err(), "{layout}: closed after a loss: {closed:?}");
        Image::open(&uri, PASS, &OpenOptions::default())
            .await
            .unwrap()
    } else {
        image
    };
    // A write to another sector of the same metadata block, then a flush.
    image
        .write(3 * SECTOR, &[3u8; SECTOR as usize])
        .await
        .unwrap();
    image.flush().await.unwrap();

    let mut want: Vec<Vec<u8>> = (0..16).map(|_| vec![1u8; SECTOR as usize]).collect();
    want[3] = vec![3u8; SECTOR as usize];
    if !lost {
        want[5] = vec![2u8; SECTOR as usize];
    }
    assert_eq!(sectors(&image, 16).await, want, "{layout}: while open");
    image.close().await.unwrap();

    let image = Image::open(&uri, PASS, &OpenOptions::read_only())
        .await
        .unwrap();
    assert_eq!(sectors(&image, 16).await, want, "{layout}: after a reopen");
    image.close().await.unwrap();
    assert!(
        lost,
        "{layout}: the commit never failed, so this run tested nothing of the loss"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_commit_keeps_every_sector_authentic_omap_packed() {
    lost_commit_keeps_every_sector_authentic(LayoutKind::OmapPacked).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_commit_keeps_every_sector_authentic_object_end() {
    lost_commit_keeps_every_sector_authentic(LayoutKind::ObjectEnd).await;
}
