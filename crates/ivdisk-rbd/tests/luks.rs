//! librbd's LUKS encryption through our FFI, on images formatted by `rbd encryption format`,
//! with qemu's rbd driver (librbd with qemu's `encrypt.format=` options) as the judge in both
//! directions; the errors a passphrase or format mix-up gives.
//!
//! Unlocks are slow on purpose (librbd formats with Argon2id and a 2 s target, PBKDF2 for
//! LUKS1), so each test unlocks as few times as it can.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{random, secret, Model, TestImage, LUKS_SIZE, MIB, OBJECT, PASS};
use ivdisk_rbd::{Encryption, LuksFormat, RbdError, RbdImage, RbdOpenOptions, LUKS_MAGIC};

/// librbd writes into a LUKS image at any offset (its crypto layer reads, patches and
/// re-encrypts partial sectors), qemu reads it back; qemu writes, we read.
async fn round_trip(format: LuksFormat, sector: u32, data_offset: u64) {
    let name = format.name();
    let Some(rbd) = TestImage::create(name, LUKS_SIZE, Some(name)) else {
        return;
    };
    let size = LUKS_SIZE - data_offset;

    // Without a passphrase: what the header says.
    let info = RbdImage::inspect(&rbd.config(), &rbd.name, None)
        .await
        .unwrap();
    let luks = info.luks.clone().expect("a LUKS header");
    assert_eq!(
        (luks.format, luks.sector_size, luks.data_offset),
        (format, sector, data_offset)
    );
    assert_eq!(luks.cipher, "aes-xts-plain64");
    assert_eq!(luks.keyslots, vec![0]);
    assert_eq!((info.raw_size, info.size()), (LUKS_SIZE, size));

    let image = Arc::new(
        rbd.open(Encryption::Auto {
            passphrase: Some(secret(PASS)),
        })
        .await,
    );
    assert_eq!(image.encryption(), Some(format));
    assert_eq!(image.size(), size);
    let mut model = Model::new(size);
    let writes: [(u64, usize); 7] = [
        (1, 1),                    // inside the first sector
        (511, 3),                  // across a 512-byte boundary
        (4095, 4099),              // across 4 KiB sectors, unaligned both ends
        (MIB, (3 * MIB) as usize), // aligned bulk
        (OBJECT - 7, 20_000),      // across an object boundary of the data area
        (size / 2 + 1, 1),         // one byte
        (size - 1000, 1000),       // the last bytes
    ];
    for (offset, len) in writes {
        let data = random(len);
        image.write(offset, &data).await.unwrap();
        model.write(offset, &data);
    }
    // Concurrent unaligned writes of neighbouring (never overlapping) ranges inside shared
    // sectors: the crypto layer's read-modify-write must not lose any of them.
    let mut tasks = Vec::new();
    for i in 0..16u64 {
        let image = image.clone();
        let offset = 8 * MIB + i * 1000;
        let data = random(1000);
        model.write(offset, &data);
        tasks.push(tokio::spawn(async move {
            image.write(offset, &data).await.unwrap()
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    image.write_zeroes(MIB + 100, 5000, true).await.unwrap();
    model.zero(MIB + 100, 5000);
    let mut all = vec![0u8; size as usize];
    image.read(0, &mut all).await.unwrap();
    model.check(&all, &format!("{name}: our read-back"));
    Arc::try_unwrap(image).unwrap().close().await.unwrap();

    // The raw image holds no plaintext: the header at 0, ciphertext where we wrote.
    let raw = rbd.export_raw();
    assert_eq!(raw[..6], LUKS_MAGIC);
    let bulk = &raw[(data_offset + MIB) as usize..][..4096];
    assert_ne!(bulk, &model.0[MIB as usize..][..4096], "plaintext on disk");

    model.check(
        &rbd.qemu_read(name),
        &format!("{name}: qemu's read of ours"),
    );

    // qemu writes (an unaligned pattern); we read it, with the format named explicitly.
    rbd.qemu_io(name, &format!("write -P 0xab {} 10000", 2 * MIB + 3));
    model.write(2 * MIB + 3, &[0xab; 10000]);
    let options = RbdOpenOptions {
        read_only: true,
        ..rbd.options(match format {
            LuksFormat::Luks1 => Encryption::Luks1 {
                passphrase: secret(PASS),
            },
            LuksFormat::Luks2 => Encryption::Luks2 {
                passphrase: secret(PASS),
            },
        })
    };
    let image = RbdImage::open(&rbd.config(), options).await.unwrap();
    image.read(0, &mut all).await.unwrap();
    model.check(&all, &format!("{name}: our read of qemu's"));
    image.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn luks2_images_of_rbd_encryption_format_round_trip_with_qemu() {
    // librbd's LUKS2: 4096-byte sectors, data after the 16 MiB header region.
    round_trip(LuksFormat::Luks2, 4096, 16 * MIB).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn luks1_images_of_rbd_encryption_format_round_trip_with_qemu() {
    // librbd's LUKS1: 512-byte sectors, data aligned to the 4 MiB object size.
    round_trip(LuksFormat::Luks1, 512, 4 * MIB).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn passphrase_and_format_mistakes_are_typed_errors_naming_the_image() {
    let Some(rbd) = TestImage::create("luks2-errors", LUKS_SIZE, Some("luks2")) else {
        return;
    };
    let config = rbd.config();
    let open = |encryption| RbdImage::open(&config, rbd.options(encryption));

    let err = open(Encryption::Auto { passphrase: None })
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            RbdError::PassphraseRequired {
                format: LuksFormat::Luks2,
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains(&rbd.spec()), "{err}");

    // The wrong version named: refused before any key derivation.
    let err = open(Encryption::Luks1 {
        passphrase: secret(PASS),
    })
    .await
    .unwrap_err();
    expect_not_encrypted(
        err,
        LuksFormat::Luks1,
        Some(LuksFormat::Luks2),
        "it is LUKS2",
    );

    let err = open(Encryption::Auto {
        passphrase: Some(secret(b"not the passphrase")),
    })
    .await
    .unwrap_err();
    assert!(
        matches!(
            err,
            RbdError::WrongPassphrase {
                format: LuksFormat::Luks2,
                ..
            }
        ),
        "{err}"
    );
    let text = err.to_string();
    assert!(
        text.contains(&rbd.spec()) && text.contains("passphrase"),
        "{text}"
    );
    // Not advice to format it again (a new key: the data lost), as it read before.
    assert!(
        !text.contains("(`rbd encryption format") && text.contains("never run"),
        "{text}"
    );
    assert!(
        !text.contains("not the passphrase"),
        "the passphrase leaked: {text}"
    );

    // encryption=none: the raw bytes, header included (read-only: nothing to unlock).
    let options = RbdOpenOptions {
        read_only: true,
        ..rbd.options(Encryption::None)
    };
    let image = RbdImage::open(&rbd.config(), options).await.unwrap();
    assert_eq!((image.size(), image.encryption()), (LUKS_SIZE, None));
    let mut head = [0u8; 8];
    image.read(0, &mut head).await.unwrap();
    assert_eq!(head[..6], LUKS_MAGIC);
    image.close().await.unwrap();

    // A plain image named as LUKS2.
    let Some(plain) = TestImage::create("plain-as-luks", LUKS_SIZE, None) else {
        return;
    };
    let err = RbdImage::open(
        &plain.config(),
        plain.options(Encryption::Luks2 {
            passphrase: secret(PASS),
        }),
    )
    .await
    .unwrap_err();
    expect_not_encrypted(err, LuksFormat::Luks2, None, "not encrypted");
}

fn expect_not_encrypted(err: RbdError, want: LuksFormat, is: Option<LuksFormat>, says: &str) {
    let text = err.to_string();
    assert!(
        matches!(err, RbdError::NotEncrypted { expected, found, .. } if expected == want && found == is),
        "{text}"
    );
    assert!(
        text.contains(says) && text.contains("encryption=auto"),
        "{text}"
    );
}

/// An open given up by its caller (a timeout) while librbd derives the key on a helper
/// thread: the connection lives until that thread has closed the handle (dropped first, the
/// connection was shut down under librbd, which then closed a handle on a freed client). The
/// process goes on, and the image opens again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_given_up_midway_leaves_librbd_sound() {
    let Some(rbd) = TestImage::create("luks2-given-up", LUKS_SIZE, Some("luks2")) else {
        return;
    };
    let config = rbd.config();
    let with_passphrase = || {
        rbd.options(Encryption::Auto {
            passphrase: Some(secret(PASS)),
        })
    };
    for delay_ms in [1u64, 20, 100, 400] {
        let open = RbdImage::open(&config, with_passphrase());
        if let Ok(opened) = tokio::time::timeout(Duration::from_millis(delay_ms), open).await {
            opened.unwrap().close().await.unwrap();
        }
    }
    // The abandoned helper threads finish their librbd calls.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let image = RbdImage::open(&config, with_passphrase()).await.unwrap();
    let mut buf = [0u8; 4096];
    image.read(0, &mut buf).await.unwrap();
    image.close().await.unwrap();
}
