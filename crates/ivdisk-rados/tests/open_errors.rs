//! Opening a RADOS store fails with a clear, matchable error: an unreachable cluster within
//! the timeout the caller set, a missing pool, a bad keyring, a missing config file.

mod common;

use std::time::{Duration, Instant};

use ivdisk_rados::{RadosConfig, RadosError, RadosStore};

/// A config naming a monitor on a port nothing listens on.
fn unreachable_conf(dir: &std::path::Path) -> std::path::PathBuf {
    let conf = dir.join("ceph.conf");
    std::fs::write(
        &conf,
        "[global]\nmon host = [v2:127.0.0.1:9,v1:127.0.0.1:7]\nauth client required = none\n",
    )
    .unwrap();
    conf
}

#[tokio::test]
async fn unreachable_cluster_fails_within_the_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let config = RadosConfig {
        conf: Some(unreachable_conf(dir.path())),
        connect_timeout: Duration::from_secs(2),
        ..RadosConfig::new("rbd")
    };
    let started = Instant::now();
    let result = RadosStore::open(&config).await;
    let elapsed = started.elapsed();
    let Err(e) = result else {
        panic!("connecting to nothing succeeded")
    };
    assert!(
        matches!(&e, RadosError::Unreachable { timeout, .. } if *timeout == Duration::from_secs(2)),
        "{e:?}"
    );
    let message = e.to_string();
    assert!(
        message.contains("cannot reach the Ceph cluster"),
        "{message}"
    );
    assert!(
        message.contains("127.0.0.1"),
        "names the monitors: {message}"
    );
    assert!(
        elapsed >= Duration::from_millis(1500) && elapsed < Duration::from_secs(15),
        "gave up after {elapsed:?}, the timeout was 2 s"
    );
}

#[tokio::test]
async fn missing_config_file_is_named() {
    let config = RadosConfig {
        conf: Some("/nonexistent/ivdisk/ceph.conf".into()),
        ..RadosConfig::new("rbd")
    };
    let e = RadosStore::open(&config)
        .await
        .err()
        .expect("no config file");
    assert!(
        matches!(&e, RadosError::ConfigFile { path, .. } if path.contains("/nonexistent/ivdisk")),
        "{e:?}"
    );
}

#[tokio::test]
async fn bad_settings_are_refused_before_connecting() {
    for config in [
        RadosConfig {
            client_id: "".into(),
            ..RadosConfig::new("rbd")
        },
        RadosConfig {
            client_id: "client.admin with space".into(),
            ..RadosConfig::new("rbd")
        },
        RadosConfig::new(""),
    ] {
        let e = RadosStore::open(&config).await.err().expect("bad settings");
        assert!(matches!(e, RadosError::Invalid(_)), "{config:?}: {e:?}");
    }
}

#[tokio::test]
async fn missing_pool_is_named() {
    if let Some(reason) = common::skip_reason() {
        eprintln!("SKIPPED: {reason}");
        return;
    }
    let config = RadosConfig {
        pool: "ivdisk-no-such-pool".into(),
        ..common::config()
    };
    let e = RadosStore::open(&config).await.err().expect("no such pool");
    assert!(
        matches!(&e, RadosError::NoSuchPool { pool } if pool == "ivdisk-no-such-pool"),
        "{e:?}"
    );
    assert!(e.to_string().contains("ceph osd pool create"), "{e}");
}

#[tokio::test]
async fn wrong_key_is_refused_clearly() {
    if let Some(reason) = common::skip_reason() {
        eprintln!("SKIPPED: {reason}");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let keyring = dir.path().join("wrong.keyring");
    // A well-formed key that the cluster does not know for client.admin.
    std::fs::write(
        &keyring,
        "[client.admin]\n\tkey = AQBvaBFZAAAAABAA9VHgwCg3rWn8fMaX8KL01A==\n",
    )
    .unwrap();
    let config = RadosConfig {
        keyring: Some(keyring),
        connect_timeout: Duration::from_secs(10),
        ..common::config()
    };
    let started = Instant::now();
    let e = RadosStore::open(&config).await.err().expect("wrong key");
    assert!(matches!(e, RadosError::AuthFailed { .. }), "{e:?}");
    assert!(e.to_string().contains("keyring"), "{e}");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "took {:?}",
        started.elapsed()
    );
}

/// A keyring file the config names that does not exist is named, with what to do: it read as
/// "the Ceph cluster refused client.admin: No such file or directory", although no cluster
/// was asked.
#[tokio::test]
async fn a_missing_keyring_named_by_the_config_is_named() {
    if let Some(reason) = common::skip_reason() {
        eprintln!("SKIPPED: {reason}");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let base = common::config();
    let text = std::fs::read_to_string(base.conf.as_ref().unwrap()).unwrap();
    let missing = dir.path().join("absent.keyring");
    let conf: String = text
        .lines()
        .map(|line| match line.trim_start().starts_with("keyring") {
            true => format!("keyring = {}\n", missing.display()),
            false => format!("{line}\n"),
        })
        .collect();
    let conf_path = dir.path().join("ceph.conf");
    std::fs::write(&conf_path, conf).unwrap();
    let config = RadosConfig {
        conf: Some(conf_path),
        connect_timeout: Duration::from_secs(10),
        ..base
    };
    let e = RadosStore::open(&config).await.err().expect("no keyring");
    assert!(matches!(e, RadosError::NoKeyring { .. }), "{e:?}");
    let text = e.to_string();
    assert!(
        text.contains(&missing.display().to_string()) && text.contains("keyring=PATH"),
        "{text}"
    );
}

#[tokio::test]
async fn unknown_client_is_refused_clearly() {
    if let Some(reason) = common::skip_reason() {
        eprintln!("SKIPPED: {reason}");
        return;
    }
    let config = RadosConfig {
        client_id: "ivdisk-nobody".into(),
        connect_timeout: Duration::from_secs(10),
        ..common::config()
    };
    let e = RadosStore::open(&config)
        .await
        .err()
        .expect("unknown client");
    assert!(matches!(e, RadosError::AuthFailed { .. }), "{e:?}");
}

/// A keyring without a usable key for the client (a malformed `key =` line, no section for
/// the client) is named, with what the file needs: it read as "connecting to the Ceph cluster
/// as client.admin failed: Input/output error".
#[tokio::test]
async fn a_keyring_without_a_usable_key_is_named() {
    if let Some(reason) = common::skip_reason() {
        eprintln!("SKIPPED: {reason}");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    for (name, text) in [
        ("malformed.keyring", "[client.admin]\n\tkey = AQBxxxx==\n"),
        ("garbage.keyring", "garbage\n"),
    ] {
        let keyring = dir.path().join(name);
        std::fs::write(&keyring, text).unwrap();
        let config = RadosConfig {
            keyring: Some(keyring.clone()),
            connect_timeout: Duration::from_secs(10),
            ..common::config()
        };
        let e = RadosStore::open(&config)
            .await
            .err()
            .expect("no usable key");
        assert!(matches!(e, RadosError::BadKeyring { .. }), "{name}: {e:?}");
        let said = e.to_string();
        assert!(
            said.contains(&keyring.display().to_string()) && said.contains("[client."),
            "{said}"
        );
    }
}
