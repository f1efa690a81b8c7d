//! Keyslot management on ivdisk's own: limits, numbering, wiping, crash-safe header writes.

use ivdisk_crypto::{Suite, VolumeKey};
use ivdisk_header::{
    FormatSpec, Header, HeaderError, HeaderIo, MemoryHeaderIo, PbkdfKind, PbkdfRequest,
};

fn fast() -> PbkdfRequest {
    PbkdfRequest::fast_for_tests(PbkdfKind::Pbkdf2)
}

fn formatted(suite: Suite) -> (MemoryHeaderIo, Header, VolumeKey) {
    let mut io = MemoryHeaderIo::default();
    let mut spec = FormatSpec::new(suite, 4096);
    spec.pbkdf = fast();
    spec.digest_iterations = Some(1000);
    let key = VolumeKey::generate(suite.default_key_len()).unwrap();
    let header = Header::format(&mut io, &spec, &key, b"slot 0").unwrap();
    (io, header, key)
}

#[test]
fn thirty_two_keyslots_then_a_clear_refusal() {
    let (mut io, mut header, key) = formatted(Suite::Aegis128lRandom);
    for i in 1..32u32 {
        let slot = header
            .add_keyslot(&mut io, &key, format!("slot {i}").as_bytes(), None, &fast())
            .unwrap();
        assert_eq!(slot, i);
    }
    let err = header
        .add_keyslot(&mut io, &key, b"one too many", None, &fast())
        .unwrap_err();
    assert!(matches!(err, HeaderError::KeyslotsFull(32)), "{err}");
    let reread = Header::read(&io).unwrap();
    assert_eq!(reread.keyslots().len(), 32);
    assert_eq!(
        reread
            .unlock_keyslot(&io, 31, b"slot 31")
            .unwrap()
            .as_bytes(),
        key.as_bytes()
    );
}

#[test]
fn large_keys_fill_the_keyslots_area_before_32_slots() {
    // A 64-byte key takes 252 KiB per keyslot; 16 MiB of keyslots area holds 64 of them, so
    // shrink the area to show the error.
    let mut io = MemoryHeaderIo::default();
    let mut spec = FormatSpec::new(Suite::AesXtsPlain64, 512);
    spec.pbkdf = fast();
    spec.digest_iterations = Some(1000);
    spec.keyslots_size = 3 * 258048;
    let key = VolumeKey::generate(64).unwrap();
    let mut header = Header::format(&mut io, &spec, &key, b"a").unwrap();
    header
        .add_keyslot(&mut io, &key, b"b", None, &fast())
        .unwrap();
    header
        .add_keyslot(&mut io, &key, b"c", None, &fast())
        .unwrap();
    let err = header
        .add_keyslot(&mut io, &key, b"d", None, &fast())
        .unwrap_err();
    assert!(matches!(err, HeaderError::KeyslotAreaFull { .. }), "{err}");
    // Removing one frees its area for the next.
    header.remove_keyslot(&mut io, 1, false).unwrap();
    assert_eq!(
        header
            .add_keyslot(&mut io, &key, b"d", None, &fast())
            .unwrap(),
        1
    );
}

#[test]
fn a_key_that_is_not_the_volume_key_cannot_add_a_keyslot() {
    let (mut io, mut header, _) = formatted(Suite::Aegis256Random);
    let stranger = VolumeKey::generate(32).unwrap();
    let err = header
        .add_keyslot(&mut io, &stranger, b"x", None, &fast())
        .unwrap_err();
    assert!(matches!(err, HeaderError::VolumeKeyMismatch), "{err}");
}

#[test]
fn slot_numbers_are_checked() {
    let (mut io, mut header, key) = formatted(Suite::Aegis128lRandom);
    assert!(matches!(
        header.add_keyslot(&mut io, &key, b"x", Some(0), &fast()),
        Err(HeaderError::KeyslotInUse(0))
    ));
    assert!(matches!(
        header.add_keyslot(&mut io, &key, b"x", Some(32), &fast()),
        Err(HeaderError::InvalidParameter(_))
    ));
    assert!(matches!(
        header.remove_keyslot(&mut io, 7, false),
        Err(HeaderError::NoSuchKeyslot(7))
    ));
    assert!(matches!(
        header.unlock_keyslot(&io, 7, b"slot 0"),
        Err(HeaderError::NoSuchKeyslot(7))
    ));
}

#[test]
fn removal_wipes_the_material_and_the_last_slot_needs_force() {
    let (mut io, mut header, key) = formatted(Suite::Aegis128lRandom);
    header
        .add_keyslot(&mut io, &key, b"slot 1", None, &fast())
        .unwrap();
    let area = header.keyslots()[1].clone();
    let mut before = vec![0u8; area.area_size as usize];
    io.read_at(area.area_offset, &mut before).unwrap();
    header.remove_keyslot(&mut io, 1, false).unwrap();
    let mut after = vec![0u8; area.area_size as usize];
    io.read_at(area.area_offset, &mut after).unwrap();
    let same = before.iter().zip(&after).filter(|(a, b)| a == b).count();
    assert!(
        same < before.len() / 100,
        "{same} bytes of removed material survive"
    );

    assert!(matches!(
        header.remove_keyslot(&mut io, 0, false),
        Err(HeaderError::LastKeyslot(0))
    ));
    header.remove_keyslot(&mut io, 0, true).unwrap();
    let reread = Header::read(&io).unwrap();
    assert!(reread.keyslots().is_empty());
    assert!(matches!(
        reread.unlock(&io, b"slot 0"),
        Err(HeaderError::WrongPassphrase { tried: 0, .. })
    ));
    // The volume key still opens the data (recovery).
    reread.unlock_with_volume_key(key.as_bytes()).unwrap();
}

#[test]
fn change_keeps_the_slot_number_and_moves_the_material() {
    let (mut io, mut header, key) = formatted(Suite::Aegis128lRandom);
    header
        .add_keyslot(&mut io, &key, b"slot 1", None, &fast())
        .unwrap();
    let old_area = header.keyslots()[1].area_offset;
    let slot = header
        .change_passphrase(&mut io, b"slot 1", b"renewed", None, &fast())
        .unwrap();
    assert_eq!(slot, 1);
    let reread = Header::read(&io).unwrap();
    assert_ne!(reread.keyslots()[1].area_offset, old_area);
    assert_eq!(reread.unlock(&io, b"renewed").unwrap().keyslot, 1);
    assert!(reread.unlock(&io, b"slot 1").is_err());
    assert!(matches!(
        header.change_passphrase(&mut io, b"wrong", b"x", None, &fast()),
        Err(HeaderError::WrongPassphrase { tried: 2, .. })
    ));
}

#[test]
fn every_write_bumps_seqid_and_repairs_a_damaged_copy() {
    let (mut io, mut header, key) = formatted(Suite::Aegis128lRandom);
    let seqid = Header::read(&io).unwrap().seqid();
    // Damage the secondary copy; the next write rewrites both.
    io.0[16384 + 4096 + 10] ^= 0xff;
    let damaged = Header::read(&io).unwrap();
    assert!(damaged.warning().unwrap().contains("secondary"));
    header
        .add_keyslot(&mut io, &key, b"slot 1", None, &fast())
        .unwrap();
    let repaired = Header::read(&io).unwrap();
    assert_eq!(repaired.warning(), None);
    assert_eq!(repaired.seqid(), seqid + 1);
}

#[test]
fn luks1_volumes_are_read_only() {
    // A LUKS1 header is refused for changes with a typed error (opening is tested against
    // cryptsetup and librbd volumes in the other test files).
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("v1");
    std::fs::File::create(&path)
        .unwrap()
        .set_len(4 << 20)
        .unwrap();
    let key = dir.path().join("k");
    std::fs::write(&key, b"pw").unwrap();
    let status = std::process::Command::new("cryptsetup")
        .args([
            "luksFormat",
            "-q",
            "--type",
            "luks1",
            "--pbkdf-force-iterations",
            "1000",
        ])
        .args(["--key-file", key.to_str().unwrap(), path.to_str().unwrap()])
        .status()
        .expect("cryptsetup must be installed");
    assert!(status.success());
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .unwrap();
    let mut header = Header::read(&file).unwrap();
    let unlocked = header.unlock(&file, b"pw").unwrap();
    let err = header
        .add_keyslot(
            &mut file.try_clone().unwrap(),
            &unlocked.volume_key,
            b"x",
            None,
            &fast(),
        )
        .unwrap_err();
    assert!(matches!(err, HeaderError::Luks1ReadOnly), "{err}");
    // What to do instead.
    assert!(err.to_string().contains("cryptsetup luksAddKey"), "{err}");
}
