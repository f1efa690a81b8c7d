//! `ivdisk`: the command line. Today it lists the cipher suites, manages LUKS2-format headers
//! and their keyslots (`header`, `key`), and validates `create`'s options; images, serving over
//! NBD and the rest arrive with the image and NBD layers (see README "Status" and
//! docs/ARCHITECTURE.md).

mod keys;

use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use ivdisk_crypto::{Suite, GCM_RANDOM_NONCE_WRITE_LIMIT};

/// Exit code of a command that exists in the interface but whose layer has not landed yet.
const EXIT_NOT_AVAILABLE: u8 = 2;

#[derive(Parser)]
#[command(
    name = "ivdisk",
    version,
    about = "Client-side encrypted virtual disks with a fresh random IV (and a MAC) per sector write",
    long_about = None,
    after_help = "Logs: set IVDISK_LOG (e.g. IVDISK_LOG=debug); they go to stderr and never contain secrets."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

fn suites_help() -> String {
    let mut text = String::from("Cipher suites (--cipher):\n");
    for suite in Suite::ALL {
        text.push_str(&format!("  {:<18} {}\n", suite.name(), suite.summary()));
    }
    text.push_str(&format!(
        "\naes-gcm-random draws a random 96-bit nonce per write; NIST SP 800-38D caps such nonces at \
         {GCM_RANDOM_NONCE_WRITE_LIMIT} (2^32) writes per key. The suite counts writes per key (continuing \
         from the count kept with the image) and refuses writes past that bound: re-encrypt to a new key, or prefer aegis128l-random/aegis256-random \
         whose nonces have no practical limit.\n"
    ));
    text
}

#[derive(Subcommand)]
enum Command {
    /// List the cipher suites with their metadata size, key sizes and properties.
    #[command(after_help = "Example:\n  ivdisk suites\n  ivdisk suites --json | jq '.[].name'")]
    Suites {
        /// Print JSON (one object per suite) instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// LUKS2-format headers: format, dump, backup, restore.
    #[command(subcommand)]
    Header(keys::HeaderCommand),
    /// Keyslots: add, remove, change and test passphrases, key files and volume keys.
    #[command(subcommand)]
    Key(keys::KeyCommand),
    /// Create an encrypted image (not available yet: arrives with the image layer).
    #[command(after_help = format!("Example:\n  ivdisk create disk.ivd --size 10G --cipher aegis128l-random\n\n{}", suites_help()))]
    Create {
        /// Where the image goes: PATH (local backend), rados://POOL/IMAGE, mem:NAME.
        image: String,
        /// Size, e.g. 10G, 512M (binary units).
        #[arg(long)]
        size: String,
        /// Cipher suite.
        #[arg(long, default_value = Suite::DEFAULT.name())]
        cipher: String,
        /// Sector size in bytes: 4096 or 512.
        #[arg(long, default_value_t = 4096)]
        sector_size: usize,
    },
}

pub(crate) fn parse_size(text: &str) -> Result<u64> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (digits, unit) = text.split_at(split);
    let n: u64 = digits.parse().with_context(|| {
        format!("size '{text}': expected a number with an optional unit K, M, G, T")
    })?;
    let shift = match unit
        .trim()
        .to_ascii_uppercase()
        .trim_end_matches("IB")
        .trim_end_matches('B')
    {
        "" => 0,
        "K" => 10,
        "M" => 20,
        "G" => 30,
        "T" => 40,
        other => bail!("size '{text}': unknown unit '{other}', expected K, M, G or T"),
    };
    n.checked_mul(1 << shift)
        .with_context(|| format!("size '{text}' is too large"))
}

fn list_suites(json: bool) {
    if json {
        let list: Vec<_> = Suite::ALL
            .iter()
            .map(|s| {
                serde_json::json!({
                    "name": s.name(),
                    "metadata_bytes": s.metadata_len(),
                    "key_bytes": s.key_lens(),
                    "authenticated": s.is_authenticated(),
                    "randomized": s.is_randomized(),
                    "write_limit": s.write_limit(),
                    "default": *s == Suite::DEFAULT,
                })
            })
            .collect();
        println!("{}", serde_json::Value::Array(list));
    } else {
        println!(
            "{:<18} {:>8} {:>10}  summary",
            "suite", "metadata", "key bytes"
        );
        for s in Suite::ALL {
            let keys = s
                .key_lens()
                .iter()
                .map(|k| k.to_string())
                .collect::<Vec<_>>()
                .join("/");
            println!(
                "{:<18} {:>7}B {:>10}  {}",
                s.name(),
                s.metadata_len(),
                keys,
                s.summary()
            );
        }
    }
}

fn run(cli: Cli) -> Result<ExitCode> {
    match cli.command {
        Command::Header(command) => {
            keys::run_header(command)?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Key(command) => {
            keys::run_key(command)?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Suites { json } => {
            list_suites(json);
            Ok(ExitCode::SUCCESS)
        }
        Command::Create {
            image,
            size,
            cipher,
            sector_size,
        } => {
            let suite: Suite = cipher.parse()?;
            let bytes = parse_size(&size)?;
            if sector_size != 512 && sector_size != 4096 {
                bail!("--sector-size {sector_size}: expected 4096 or 512");
            }
            tracing::debug!(%image, bytes, %suite, sector_size, "create requested");
            eprintln!(
                "ivdisk create: not available yet. The cipher suites ({suite} checked), the LUKS2 \
                 header (`ivdisk header`, `ivdisk key`) and the object stores are in place; images \
                 (the IO path over them) arrive with the next layer. See README 'Status'."
            );
            Ok(ExitCode::from(EXIT_NOT_AVAILABLE))
        }
    }
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("IVDISK_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    match run(Cli::parse()) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("ivdisk: {e:#}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_binary_units() {
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("10G").unwrap(), 10 << 30);
        assert_eq!(parse_size("512MiB").unwrap(), 512 << 20);
        assert_eq!(parse_size("1t").unwrap(), 1 << 40);
        assert!(parse_size("12X")
            .unwrap_err()
            .to_string()
            .contains("unknown unit"));
        assert!(parse_size("G").is_err());
        assert!(parse_size("99999999999T")
            .unwrap_err()
            .to_string()
            .contains("too large"));
    }

    #[test]
    fn help_names_every_suite_and_the_gcm_bound() {
        let help = suites_help();
        for s in Suite::ALL {
            assert!(help.contains(s.name()), "{s} missing from --help");
        }
        assert!(help.contains("4294967296"));
    }
}
