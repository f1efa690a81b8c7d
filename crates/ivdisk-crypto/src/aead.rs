//! The AEAD suites: `aegis128l-random` (default), `aegis256-random`, `aes-gcm-random`.
//!
//! Per write: a fresh random nonce from [`crate::rng`]; AAD = image id (16 bytes) || sector
//! number (u64 little endian), so a sector moved to another place or image fails
//! authentication. Metadata per sector = nonce || tag (|| zero padding for GCM, checked on read
//! so that every metadata bit is covered).

use std::sync::atomic::{AtomicU64, Ordering};

use aegis::aegis128l::Aegis128L;
use openssl::cipher::Cipher;
use openssl::cipher_ctx::CipherCtxRef;
use zeroize::Zeroizing;

use crate::evp::{ContextPool, Direction};
#[cfg(target_arch = "x86_64")]
use crate::ffi::aegis128l_one::OneMessage;
use crate::io::Io;
use crate::rng::{NonceSource, RunNonces};
use crate::suite::{
    append_by_zeroing, append_from_slots_by_zeroing, append_slots_piecewise, check_key_len,
    check_out_of_place, check_run, check_sector_size, check_slots, check_slots_append,
    check_whole_sectors, decrypt_slots_apart, decrypt_slots_one_by_one, slots_one_by_one,
};
use crate::{CipherParams, CryptoError, ImageId, Suite};

/// Random 96-bit nonces: NIST SP 800-38D section 8.3 caps invocations under one key at 2^32 so
/// the chance of a nonce collision (which reveals GCM's authentication key) stays below 2^-32.
pub const GCM_RANDOM_NONCE_WRITE_LIMIT: u64 = 1 << 32;

const TAG_LEN: usize = 16;
const AAD_LEN: usize = 24;
const GCM_NONCE_LEN: usize = 12;

fn aad(image_id: &ImageId, sector: u64) -> [u8; AAD_LEN] {
    let mut aad = [0u8; AAD_LEN];
    aad[..16].copy_from_slice(&image_id.0);
    aad[16..].copy_from_slice(&sector.to_le_bytes());
    aad
}

enum Engine {
    Aegis128L(Zeroizing<[u8; 16]>),
    Aegis256(Zeroizing<[u8; 32]>),
    Gcm(Box<GcmEngine>),
}

struct GcmEngine {
    encrypt: ContextPool,
    decrypt: ContextPool,
    writes_used: AtomicU64,
}

pub(crate) struct AeadSuite {
    suite: Suite,
    sector_size: usize,
    image_id: ImageId,
    engine: Engine,
    nonces: NonceSource,
    /// AEGIS-128L outside groups of four: our one-message code where the CPU runs it (checked
    /// here once), libaegis otherwise.
    #[cfg(target_arch = "x86_64")]
    aegis128l_one: Option<OneMessage>,
}

impl std::fmt::Debug for AeadSuite {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AeadSuite")
            .field("suite", &self.suite)
            .field("sector_size", &self.sector_size)
            .field("image_id", &self.image_id)
            .finish_non_exhaustive()
    }
}

impl AeadSuite {
    pub(crate) fn new(
        suite: Suite,
        key: &[u8],
        params: &CipherParams,
        nonces: NonceSource,
    ) -> Result<Self, CryptoError> {
        check_key_len(suite, key)?;
        check_sector_size(params.sector_size)?;
        let engine = match suite {
            Suite::Aegis128lRandom => {
                Engine::Aegis128L(Zeroizing::new(key.try_into().expect("length checked")))
            }
            Suite::Aegis256Random => {
                crate::ffi::aegis256::ensure_init();
                Engine::Aegis256(Zeroizing::new(key.try_into().expect("length checked")))
            }
            Suite::AesGcmRandom => {
                let cipher = gcm_cipher(key);
                Engine::Gcm(Box::new(GcmEngine {
                    encrypt: ContextPool::new(cipher, key, Direction::Encrypt),
                    decrypt: ContextPool::new(cipher, key, Direction::Decrypt),
                    writes_used: AtomicU64::new(params.writes_used),
                }))
            }
            _ => unreachable!("not an AEAD suite: {suite}"),
        };
        Ok(AeadSuite {
            suite,
            sector_size: params.sector_size,
            image_id: params.image_id,
            #[cfg(target_arch = "x86_64")]
            aegis128l_one: match engine {
                Engine::Aegis128L(_) => OneMessage::here(),
                _ => None,
            },
            engine,
            nonces,
        })
    }

    fn nonce_len(&self) -> usize {
        match self.engine {
            Engine::Aegis128L(_) => 16,
            Engine::Aegis256(_) => 32,
            Engine::Gcm(_) => GCM_NONCE_LEN,
        }
    }

    /// Count `n` more writes against GCM's limit, refusing the whole run if it would pass it.
    fn reserve_writes(&self, n: u64) -> Result<(), CryptoError> {
        let Engine::Gcm(gcm) = &self.engine else {
            return Ok(());
        };
        gcm.writes_used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(n)
                    .filter(|&u| u <= GCM_RANDOM_NONCE_WRITE_LIMIT)
            })
            .map(|_| ())
            .map_err(|used| CryptoError::NonceBudgetExhausted {
                suite: self.suite,
                used,
                limit: GCM_RANDOM_NONCE_WRITE_LIMIT,
            })
    }
}

#[cfg(target_arch = "x86_64")]
impl AeadSuite {
    /// Seal the run's leading groups of four sectors with the four-lane AEGIS-128L; returns how
    /// many sectors it did (0 where the CPU lacks VAES) and the rest of the run.
    fn seal_lanes<'a>(
        &self,
        key: &[u8; 16],
        nonces: &RunNonces,
        first_sector: u64,
        data: Io<'a>,
        metadata: &mut [u8],
    ) -> (usize, Io<'a>) {
        use crate::ffi::aegis128l_vaes::{available, LANES};
        let (ss, md_len) = (self.sector_size, self.suite.metadata_len());
        // A shift: sector sizes are powers of two (`check_run`).
        let grouped = (data.len() >> ss.trailing_zeros()) / LANES * LANES;
        if grouped == 0 || !available() {
            return (0, data);
        }
        let (head, rest) = data.split_at(grouped * ss);
        let groups = head
            .chunks(LANES * ss)
            .zip(metadata.chunks_exact_mut(LANES * md_len));
        for (g, (group, metas)) in groups.enumerate() {
            let base = first_sector + (g * LANES) as u64;
            let (nonces, tags) = self.seal_group(key, nonces, base, split_lanes(group, ss));
            for ((md, nonce), tag) in metas.chunks_exact_mut(md_len).zip(&nonces).zip(&tags) {
                md[..16].copy_from_slice(nonce);
                md[16..16 + TAG_LEN].copy_from_slice(tag);
            }
        }
        (grouped, rest)
    }

    /// Open the run's leading groups of four sectors with the four-lane AEGIS-128L, zeroing and
    /// listing in `failed` the sectors whose tag does not verify; returns how many it did and
    /// the rest of the run.
    fn open_lanes<'a>(
        &self,
        key: &[u8; 16],
        first_sector: u64,
        data: Io<'a>,
        metadata: &[u8],
        failed: &mut Vec<u64>,
    ) -> (usize, Io<'a>) {
        use crate::ffi::aegis128l_vaes::{available, LANES};
        let (ss, md_len) = (self.sector_size, self.suite.metadata_len());
        // A shift: sector sizes are powers of two (`check_run`).
        let grouped = (data.len() >> ss.trailing_zeros()) / LANES * LANES;
        if grouped == 0 || !available() {
            return (0, data);
        }
        let (head, rest) = data.split_at(grouped * ss);
        let groups = head
            .chunks(LANES * ss)
            .zip(metadata.chunks_exact(LANES * md_len));
        for (g, (group, metas)) in groups.enumerate() {
            let base = first_sector + (g * LANES) as u64;
            let aads = self.group_aads(base);
            let nonces: [&[u8; 16]; LANES] = std::array::from_fn(|i| {
                metas[i * md_len..][..16].try_into().expect("16-byte nonce")
            });
            let stored: [&[u8]; LANES] =
                std::array::from_fn(|i| &metas[i * md_len + 16..][..TAG_LEN]);
            let lanes = split_lanes(group, ss);
            open_group(key, base, nonces, &aads, stored, lanes, failed);
        }
        (grouped, rest)
    }
}

/// The nonces of the group of four sectors from `base`.
#[cfg(target_arch = "x86_64")]
fn group_nonces(nonces: &RunNonces, base: u64) -> [[u8; 16]; crate::ffi::aegis128l_vaes::LANES] {
    std::array::from_fn(|i| {
        let mut nonce = [0u8; 16];
        nonces.fill(base + i as u64, &mut nonce);
        nonce
    })
}

#[cfg(target_arch = "x86_64")]
impl AeadSuite {
    /// Seal the sectors the four-lane code left (a single-sector run, the remainder of a run)
    /// one at a time with the one-message AEGIS-128L, out of place when asked; returns how many
    /// it did (0 where that code does not seal: libaegis then does them) and the rest of the run.
    fn seal_singles<'a>(
        &self,
        key: &[u8; 16],
        nonces: &RunNonces,
        first_sector: u64,
        data: Io<'a>,
        metadata: &mut [u8],
    ) -> (usize, Io<'a>) {
        let Some(kernel) = self.aegis128l_one else {
            return (0, data);
        };
        let (ss, md_len) = (self.sector_size, self.suite.metadata_len());
        let (mut rest, mut done) = (data, 0);
        while rest.len() > 0 {
            let (sector, tail) = rest.split_at(ss);
            rest = tail;
            let number = first_sector + done as u64;
            let (nonce, md) = metadata[done * md_len..][..md_len].split_at_mut(16);
            nonces.fill(number, nonce);
            let nonce: &[u8; 16] = (&*nonce).try_into().expect("16-byte nonce");
            let tag = kernel.seal(key, nonce, &aad(&self.image_id, number), sector);
            md[..TAG_LEN].copy_from_slice(&tag);
            md[TAG_LEN..].fill(0);
            done += 1;
        }
        (done, rest)
    }

    /// Open the sectors the four-lane code left one at a time with the one-message AEGIS-128L,
    /// zeroing and listing in `failed` those whose tag does not verify; returns how many it did
    /// (0 where that code does not open) and the rest of the run.
    fn open_singles<'a>(
        &self,
        key: &[u8; 16],
        first_sector: u64,
        data: Io<'a>,
        metadata: &[u8],
        failed: &mut Vec<u64>,
    ) -> (usize, Io<'a>) {
        let Some(kernel) = self.aegis128l_one else {
            return (0, data);
        };
        let (ss, md_len) = (self.sector_size, self.suite.metadata_len());
        let (mut rest, mut done) = (data, 0);
        while rest.len() > 0 {
            let (sector, tail) = rest.split_at(ss);
            rest = tail;
            let number = first_sector + done as u64;
            let md = &metadata[done * md_len..][..md_len];
            let nonce: &[u8; 16] = md[..16].try_into().expect("16-byte nonce");
            let tag: &[u8; TAG_LEN] = md[16..16 + TAG_LEN].try_into().expect("fixed layout");
            let ok = if md[16 + TAG_LEN..].iter().all(|&b| b == 0) {
                // On a tag mismatch `open` zeroes the sector: no unauthenticated plaintext.
                kernel.open(key, nonce, &aad(&self.image_id, number), sector, tag)
            } else {
                let mut sector = sector;
                sector.clear_output();
                false
            };
            if !ok {
                failed.push(number);
            }
            done += 1;
        }
        (done, rest)
    }
}

impl AeadSuite {
    /// Whether [`AeadSuite::seal_into_slots`] writes this suite's slots: AES-GCM, AEGIS-256,
    /// and AEGIS-128L where one of our kernels runs.
    fn seals_slots_directly(&self) -> bool {
        match &self.engine {
            Engine::Gcm(_) | Engine::Aegis256(_) => true,
            Engine::Aegis128L(_) => self.aegis128l_kernels(),
        }
    }

    /// Whether AEGIS-128L runs on our own kernels here, the four-lane one (VAES) or a build
    /// of the one-message one (AES-NI and AVX at least): both read and write any buffer, so
    /// slots are sealed and opened where they are. Where neither runs, libaegis works in place
    /// only and each slot's sector is copied first.
    fn aegis128l_kernels(&self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            crate::ffi::aegis128l_vaes::available() || self.aegis128l_one.is_some()
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    }

    /// Each sector's ciphertext and then its metadata written into `spare`, exactly the
    /// run's slots (the run checked), for a suite [`AeadSuite::seals_slots_directly`].
    fn seal_into_slots(
        &self,
        first_sector: u64,
        plaintext: &[u8],
        spare: &mut [std::mem::MaybeUninit<u8>],
    ) -> Result<(), CryptoError> {
        match &self.engine {
            Engine::Gcm(gcm) => {
                self.reserve_writes((plaintext.len() / self.sector_size) as u64)?;
                let nonces = self.nonces.run(first_sector, self.nonce_len())?;
                gcm.encrypt.with(|ctx| {
                    self.seal_each_slot(first_sector, plaintext, spare, |number, sector, md| {
                        self.gcm_seal_sector(gcm, ctx, &nonces, number, sector, md)
                    })
                })
            }
            Engine::Aegis256(key) => {
                let nonces = self.nonces.run(first_sector, self.nonce_len())?;
                self.seal_each_slot(first_sector, plaintext, spare, |number, sector, md| {
                    self.aegis256_seal_sector(key, &nonces, number, sector, md)
                })
            }
            #[cfg(target_arch = "x86_64")]
            Engine::Aegis128L(key) => self.seal_slots(key, first_sector, plaintext, spare),
            #[cfg(not(target_arch = "x86_64"))]
            Engine::Aegis128L(_) => unreachable!("AEGIS-128L seals slots only on x86_64"),
        }
    }
}

#[cfg(target_arch = "x86_64")]
impl AeadSuite {
    /// AEGIS-128L straight into slots (`encrypt_sectors_append_slots`): groups of four
    /// sectors through the four-lane kernel with each lane's output at its slot (where it
    /// runs), the rest one sector at a time through `seal_run` (the one-message kernel, out
    /// of place); each slot's metadata after its ciphertext. The caller checked the run and
    /// that one of the kernels runs here ([`AeadSuite::aegis128l_kernels`]).
    fn seal_slots(
        &self,
        key: &[u8; 16],
        first_sector: u64,
        plaintext: &[u8],
        slots: &mut [std::mem::MaybeUninit<u8>],
    ) -> Result<(), CryptoError> {
        let nonces = self.nonces.run(first_sector, self.nonce_len())?;
        use crate::ffi::aegis128l_vaes::LANES;
        use crate::ffi::spare::write_copy;
        let (ss, md_len) = (self.sector_size, self.suite.metadata_len());
        let sectors = plaintext.len() / ss;
        let grouped = four_lane_groups(sectors);
        let mut inputs = plaintext.chunks_exact(ss);
        let mut outputs = slots.chunks_exact_mut(ss + md_len);
        for g in 0..grouped / LANES {
            let base = first_sector + (g * LANES) as u64;
            let [(l0, m0), (l1, m1), (l2, m2), (l3, m3)] = std::array::from_fn(|_| {
                let input = inputs.next().expect("a whole group of sectors");
                let (data, meta) = outputs.next().expect("a slot per sector").split_at_mut(ss);
                (Io::fresh(input, data), meta)
            });
            let (nonces, tags) = self.seal_group(key, &nonces, base, [l0, l1, l2, l3]);
            for ((meta, nonce), tag) in [m0, m1, m2, m3].into_iter().zip(&nonces).zip(&tags) {
                write_copy(&mut meta[..16], nonce);
                write_copy(&mut meta[16..16 + TAG_LEN], tag);
                for padding in &mut meta[16 + TAG_LEN..] {
                    padding.write(0);
                }
            }
        }
        for (i, (input, output)) in inputs.zip(outputs).enumerate() {
            let (data, meta) = output.split_at_mut(ss);
            let mut md = [0u8; 64];
            let md = &mut md[..md_len];
            let number = first_sector + (grouped + i) as u64;
            self.seal_run_with(&nonces, number, Io::fresh(input, data), md)?;
            write_copy(meta, md);
        }
        Ok(())
    }
}

/// The nonces and tags of a group of four sectors the four-lane AEGIS-128L sealed.
#[cfg(target_arch = "x86_64")]
type GroupSealed = (
    [[u8; 16]; crate::ffi::aegis128l_vaes::LANES],
    [[u8; 16]; crate::ffi::aegis128l_vaes::LANES],
);

#[cfg(target_arch = "x86_64")]
impl AeadSuite {
    /// Seal the group of four sectors from `base` (each lane its sector's run) with the
    /// four-lane AEGIS-128L; returns their nonces and tags for the caller to store.
    #[inline]
    fn seal_group(
        &self,
        key: &[u8; 16],
        nonces: &RunNonces,
        base: u64,
        mut lanes: [Io<'_>; crate::ffi::aegis128l_vaes::LANES],
    ) -> GroupSealed {
        use crate::ffi::aegis128l_vaes::crypt4;
        let aads = self.group_aads(base);
        let nonces = group_nonces(nonces, base);
        let tags = crypt4(
            key,
            nonces.each_ref(),
            aads.each_ref().map(|a| &a[..]),
            &mut lanes,
            true,
        )
        .expect("VAES is available and sectors are multiples of 64 bytes");
        (nonces, tags)
    }
}

#[cfg(target_arch = "x86_64")]
impl AeadSuite {
    /// AEGIS-128L in place in slots (`encrypt_sectors_in_slots`): the leading groups of four
    /// of the run's `sectors` through the four-lane kernel, each lane in place at its slot,
    /// the metadata after it. Returns how many sectors it sealed; the caller seals the rest,
    /// and checked the run and that the four-lane kernel runs here.
    fn seal_lanes_in_slots(
        &self,
        key: &[u8; 16],
        nonces: &RunNonces,
        first_sector: u64,
        sectors: usize,
        slots: &mut [u8],
    ) -> usize {
        use crate::ffi::aegis128l_vaes::LANES;
        let (ss, md_len) = (self.sector_size, self.suite.metadata_len());
        let grouped = sectors / LANES * LANES;
        let mut each = slots.chunks_exact_mut(ss + md_len);
        for g in 0..grouped / LANES {
            let base = first_sector + (g * LANES) as u64;
            let [(l0, m0), (l1, m1), (l2, m2), (l3, m3)] = std::array::from_fn(|_| {
                let (data, meta) = each.next().expect("a slot per sector").split_at_mut(ss);
                (Io::in_place(data), meta)
            });
            let (nonces, tags) = self.seal_group(key, nonces, base, [l0, l1, l2, l3]);
            for ((meta, nonce), tag) in [m0, m1, m2, m3].into_iter().zip(&nonces).zip(&tags) {
                meta[..16].copy_from_slice(nonce);
                meta[16..16 + TAG_LEN].copy_from_slice(tag);
                meta[16 + TAG_LEN..].fill(0);
            }
        }
        grouped
    }
}

#[cfg(target_arch = "x86_64")]
impl AeadSuite {
    /// AEGIS-128L from slots (`decrypt_sectors_from_slots`, `decrypt_sectors_in_slots`):
    /// groups of four sectors through the four-lane kernel with each lane's input at its slot
    /// (where it runs), the rest one sector at a time through `open_run` (the one-message
    /// kernel); sectors whose tag does not verify are zeroed and named in the error.
    /// `next_slot` gives each of the `sectors` slots in order: the run from its ciphertext to
    /// where its plaintext goes (in place, or elsewhere), and its metadata. The caller checked
    /// the run and that one of the kernels runs here ([`AeadSuite::aegis128l_kernels`]).
    fn open_slots<'o>(
        &self,
        key: &[u8; 16],
        first_sector: u64,
        sectors: usize,
        mut next_slot: impl FnMut() -> (Io<'o>, &'o [u8]),
    ) -> Result<(), CryptoError> {
        use crate::ffi::aegis128l_vaes::LANES;
        let grouped = four_lane_groups(sectors);
        let mut failed = Vec::new();
        for g in 0..grouped / LANES {
            let base = first_sector + (g * LANES) as u64;
            let [(l0, m0), (l1, m1), (l2, m2), (l3, m3)] = std::array::from_fn(|_| next_slot());
            let metas = [m0, m1, m2, m3];
            let nonces: [&[u8; 16]; LANES] =
                std::array::from_fn(|i| metas[i][..16].try_into().expect("16-byte nonce"));
            let stored = metas.map(|m| &m[16..16 + TAG_LEN]);
            let aads = self.group_aads(base);
            open_group(
                key,
                base,
                nonces,
                &aads,
                stored,
                [l0, l1, l2, l3],
                &mut failed,
            );
        }
        for i in grouped..sectors {
            let number = first_sector + i as u64;
            let (data, meta) = next_slot();
            match self.open_run(number, data, meta) {
                Ok(()) => {}
                Err(CryptoError::Authentication { sectors }) => failed.extend(sectors),
                Err(e) => return Err(e),
            }
        }
        authenticated(failed)
    }
}

#[cfg(target_arch = "x86_64")]
impl AeadSuite {
    /// The associated data of the four sectors from `base`.
    fn group_aads(&self, base: u64) -> [[u8; AAD_LEN]; 4] {
        std::array::from_fn(|i| aad(&self.image_id, base + i as u64))
    }
}

/// Open one group of four sectors from `base` with the four-lane AEGIS-128L, zeroing and
/// listing in `failed` the sectors whose tag is not the `stored` one.
#[cfg(target_arch = "x86_64")]
fn open_group(
    key: &[u8; 16],
    base: u64,
    nonces: [&[u8; 16]; 4],
    aads: &[[u8; AAD_LEN]; 4],
    stored: [&[u8]; 4],
    mut lanes: [Io<'_>; 4],
    failed: &mut Vec<u64>,
) {
    use crate::ffi::aegis128l_vaes::crypt4;
    let tags = crypt4(
        key,
        nonces,
        aads.each_ref().map(|a| &a[..]),
        &mut lanes,
        false,
    )
    .expect("VAES is available and sectors are multiples of 64 bytes");
    for (i, ((sector, tag), stored)) in lanes.iter_mut().zip(&tags).zip(stored).enumerate() {
        // Constant time: the comparison must not say how many tag bytes matched.
        let diff = stored
            .iter()
            .zip(tag)
            .fold(0u8, |acc, (a, b)| acc | (a ^ b));
        if diff != 0 {
            sector.clear_output();
            failed.push(base + i as u64);
        }
    }
}

/// How many of a run's `sectors` go through the four-lane AEGIS-128L in groups of four: none
/// where it does not run (the one-message kernel then takes every sector).
#[cfg(target_arch = "x86_64")]
fn four_lane_groups(sectors: usize) -> usize {
    use crate::ffi::aegis128l_vaes::{available, LANES};
    match available() {
        true => sectors / LANES * LANES,
        false => 0,
    }
}

/// Four consecutive sectors of a group as four runs.
#[cfg(target_arch = "x86_64")]
fn split_lanes(group: Io<'_>, sector_size: usize) -> [Io<'_>; 4] {
    let (a, rest) = group.split_at(sector_size);
    let (b, rest) = rest.split_at(sector_size);
    let (c, d) = rest.split_at(sector_size);
    [a, b, c, d]
}

impl AeadSuite {
    /// Seal a run of consecutive sectors, their nonces counting up from one random value.
    fn seal_run(
        &self,
        first_sector: u64,
        data: Io<'_>,
        metadata: &mut [u8],
    ) -> Result<(), CryptoError> {
        let nonces = self.nonces.run(first_sector, self.nonce_len())?;
        self.seal_run_with(&nonces, first_sector, data, metadata)
    }

    /// [`AeadSuite::seal_run`] with the nonces of the run this one is part of.
    fn seal_run_with(
        &self,
        nonces: &RunNonces,
        first_sector: u64,
        data: Io<'_>,
        metadata: &mut [u8],
    ) -> Result<(), CryptoError> {
        let n = check_run(
            self.suite,
            self.sector_size,
            first_sector,
            data.len(),
            metadata.len(),
        )?;
        self.reserve_writes(n as u64)?;
        let md_len = self.suite.metadata_len();
        let nonce_len = self.nonce_len();
        // GCM goes through OpenSSL out of place. Groups of four sectors go through the four-lane
        // AEGIS-128L where the CPU has it, the other AEGIS-128L sectors through the
        // one-message code (both out of place when asked); whatever is left one sector at a
        // time, in place.
        let (done, rest) = match &self.engine {
            Engine::Gcm(gcm) => {
                return gcm.encrypt.with(|ctx| {
                    self.seal_each(first_sector, data, metadata, |number, sector, md| {
                        self.gcm_seal_sector(gcm, ctx, nonces, number, sector, md)
                    })
                });
            }
            Engine::Aegis256(key) => {
                return self.seal_each(first_sector, data, metadata, |number, sector, md| {
                    self.aegis256_seal_sector(key, nonces, number, sector, md)
                });
            }
            #[cfg(target_arch = "x86_64")]
            Engine::Aegis128L(key) => {
                let (lanes, rest) = self.seal_lanes(key, nonces, first_sector, data, metadata);
                // Wraps only when no sector is left (a run ending at u64::MAX).
                let (singles, rest) = self.seal_singles(
                    key,
                    nonces,
                    first_sector.wrapping_add(lanes as u64),
                    rest,
                    &mut metadata[lanes * md_len..],
                );
                (lanes + singles, rest)
            }
            #[cfg(not(target_arch = "x86_64"))]
            Engine::Aegis128L(_) => (0, data),
        };
        if rest.len() == 0 {
            return Ok(());
        }
        let rest = rest.into_in_place();
        let sectors = rest.chunks_exact_mut(self.sector_size);
        let metas = metadata[done * md_len..].chunks_exact_mut(md_len);
        for (i, (sector, md)) in sectors.zip(metas).enumerate() {
            let number = first_sector + (done + i) as u64;
            let aad = aad(&self.image_id, number);
            let (nonce, rest) = md.split_at_mut(nonce_len);
            nonces.fill(number, nonce);
            let tag = match &self.engine {
                Engine::Aegis128L(key) => aegis128l_seal(key, nonce, &aad, sector),
                Engine::Aegis256(_) | Engine::Gcm(_) => {
                    unreachable!("AEGIS-256 and GCM run apart, in seal_each")
                }
            };
            put_tag(rest, &tag);
        }
        Ok(())
    }

    /// Seal each sector of a contiguous run with `seal` (the sector's number, its run, its
    /// metadata): for the suites that seal one sector at a time (AEGIS-256, AES-GCM).
    fn seal_each(
        &self,
        first_sector: u64,
        data: Io<'_>,
        metadata: &mut [u8],
        mut seal: impl FnMut(u64, &mut Io<'_>, &mut [u8]) -> Result<(), CryptoError>,
    ) -> Result<(), CryptoError> {
        let metas = metadata.chunks_exact_mut(self.suite.metadata_len());
        for (i, (mut sector, md)) in data.chunks(self.sector_size).zip(metas).enumerate() {
            seal(first_sector + i as u64, &mut sector, md)?;
        }
        Ok(())
    }

    /// [`AeadSuite::seal_each`] straight into slots (`encrypt_sectors_append_slots`): each
    /// sector sealed from the plaintext into its slot, its metadata after it. The caller
    /// checked the run.
    fn seal_each_slot(
        &self,
        first_sector: u64,
        plaintext: &[u8],
        slots: &mut [std::mem::MaybeUninit<u8>],
        mut seal: impl FnMut(u64, &mut Io<'_>, &mut [u8]) -> Result<(), CryptoError>,
    ) -> Result<(), CryptoError> {
        let (ss, md_len) = (self.sector_size, self.suite.metadata_len());
        let slots = slots.chunks_exact_mut(ss + md_len);
        for (i, (input, slot)) in plaintext.chunks_exact(ss).zip(slots).enumerate() {
            let (data, meta) = slot.split_at_mut(ss);
            let mut md = [0u8; 64];
            let md = &mut md[..md_len];
            seal(first_sector + i as u64, &mut Io::fresh(input, data), md)?;
            crate::ffi::spare::write_copy(meta, md);
        }
        Ok(())
    }

    /// [`AeadSuite::seal_each`] in place in slots (`encrypt_sectors_in_slots`): each sector
    /// sealed where it lies, its metadata written after it. The caller checked the run.
    fn seal_each_in_slots(
        &self,
        first_sector: u64,
        slots: &mut [u8],
        mut seal: impl FnMut(u64, Io<'_>, &mut [u8]) -> Result<(), CryptoError>,
    ) -> Result<(), CryptoError> {
        let ss = self.sector_size;
        let slots = slots.chunks_exact_mut(ss + self.suite.metadata_len());
        for (i, slot) in slots.enumerate() {
            let (data, metadata) = slot.split_at_mut(ss);
            seal(first_sector + i as u64, Io::in_place(data), metadata)?;
        }
        Ok(())
    }

    /// Open each sector of a contiguous run with `open` (the sector's number, its run, its
    /// metadata; it zeroes and lists the sectors that fail, [`opened`]).
    fn open_each(
        &self,
        first_sector: u64,
        data: Io<'_>,
        metadata: &[u8],
        mut open: impl FnMut(u64, &mut Io<'_>, &[u8]) -> Result<(), CryptoError>,
    ) -> Result<(), CryptoError> {
        let metas = metadata.chunks_exact(self.suite.metadata_len());
        for (i, (mut sector, md)) in data.chunks(self.sector_size).zip(metas).enumerate() {
            open(first_sector + i as u64, &mut sector, md)?;
        }
        Ok(())
    }

    /// [`AeadSuite::open_each`] straight from slots (`decrypt_sectors_from_slots`). The
    /// caller checked the run.
    fn open_each_slot(
        &self,
        first_sector: u64,
        slots: &[u8],
        plaintext: &mut [u8],
        mut open: impl FnMut(u64, &mut Io<'_>, &[u8]) -> Result<(), CryptoError>,
    ) -> Result<(), CryptoError> {
        let (ss, md_len) = (self.sector_size, self.suite.metadata_len());
        let sectors = plaintext.chunks_exact_mut(ss);
        for (i, (slot, output)) in slots.chunks_exact(ss + md_len).zip(sectors).enumerate() {
            let (data, md) = slot.split_at(ss);
            open(first_sector + i as u64, &mut Io::copy(data, output), md)?;
        }
        Ok(())
    }

    /// Seal one sector with AEGIS-256 from `sector`'s input into its output (`ffi::aegis256`:
    /// one pass, no copy first); its metadata (nonce, tag) into `md`.
    fn aegis256_seal_sector(
        &self,
        key: &[u8; 32],
        nonces: &RunNonces,
        number: u64,
        sector: &mut Io<'_>,
        md: &mut [u8],
    ) -> Result<(), CryptoError> {
        let (nonce, rest) = md.split_at_mut(32);
        nonces.fill(number, nonce);
        let nonce: &[u8; 32] = (&*nonce).try_into().expect("AEGIS-256 nonce is 32 bytes");
        let tag = crate::ffi::aegis256::seal(key, nonce, &aad(&self.image_id, number), sector);
        put_tag(rest, &tag);
        Ok(())
    }

    /// Open one sector with AEGIS-256 from `sector`'s input into its output; a sector whose
    /// tag does not verify is zeroed and listed in `failed`.
    fn aegis256_open_sector(
        &self,
        key: &[u8; 32],
        number: u64,
        sector: &mut Io<'_>,
        md: &[u8],
        failed: &mut Vec<u64>,
    ) {
        let (nonce, rest) = md.split_at(32);
        let nonce: &[u8; 32] = nonce.try_into().expect("AEGIS-256 nonce is 32 bytes");
        let (tag, padding_clean) = tag_of(rest);
        let aad = aad(&self.image_id, number);
        let ok = padding_clean && crate::ffi::aegis256::open(key, nonce, &aad, sector, tag);
        opened(ok, number, sector, failed);
    }

    /// Seal one sector with AES-GCM from `sector`'s input into its output; its metadata
    /// (nonce, tag, zero padding) into `md`.
    fn gcm_seal_sector(
        &self,
        gcm: &GcmEngine,
        ctx: &mut CipherCtxRef,
        nonces: &RunNonces,
        number: u64,
        sector: &mut Io<'_>,
        md: &mut [u8],
    ) -> Result<(), CryptoError> {
        let (nonce, rest) = md.split_at_mut(GCM_NONCE_LEN);
        nonces.fill(number, nonce);
        let aad = aad(&self.image_id, number);
        let tag = gcm_seal(&gcm.encrypt, ctx, nonce, &aad, sector)?;
        put_tag(rest, &tag);
        Ok(())
    }

    /// Open one sector with AES-GCM from `sector`'s input into its output; a sector whose tag
    /// (or zero padding) does not verify is zeroed and listed in `failed`.
    fn gcm_open_sector(
        &self,
        gcm: &GcmEngine,
        ctx: &mut CipherCtxRef,
        number: u64,
        sector: &mut Io<'_>,
        md: &[u8],
        failed: &mut Vec<u64>,
    ) -> Result<(), CryptoError> {
        let (nonce, rest) = md.split_at(GCM_NONCE_LEN);
        let (tag, padding_clean) = tag_of(rest);
        let aad = aad(&self.image_id, number);
        let ok = padding_clean && gcm_open(&gcm.decrypt, ctx, nonce, &aad, sector, tag)?;
        opened(ok, number, sector, failed);
        Ok(())
    }

    fn open_run(
        &self,
        first_sector: u64,
        data: Io<'_>,
        metadata: &[u8],
    ) -> Result<(), CryptoError> {
        check_run(
            self.suite,
            self.sector_size,
            first_sector,
            data.len(),
            metadata.len(),
        )?;
        let md_len = self.suite.metadata_len();
        let nonce_len = self.nonce_len();
        let mut failed = Vec::new();
        let (done, rest) = match &self.engine {
            Engine::Gcm(gcm) => {
                gcm.decrypt.with(|ctx| {
                    self.open_each(first_sector, data, metadata, |number, sector, md| {
                        self.gcm_open_sector(gcm, ctx, number, sector, md, &mut failed)
                    })
                })?;
                return authenticated(failed);
            }
            Engine::Aegis256(key) => {
                self.open_each(first_sector, data, metadata, |number, sector, md| {
                    self.aegis256_open_sector(key, number, sector, md, &mut failed);
                    Ok(())
                })?;
                return authenticated(failed);
            }
            #[cfg(target_arch = "x86_64")]
            Engine::Aegis128L(key) => {
                let (lanes, rest) = self.open_lanes(key, first_sector, data, metadata, &mut failed);
                // Wraps only when no sector is left (a run ending at u64::MAX).
                let singles = self.open_singles(
                    key,
                    first_sector.wrapping_add(lanes as u64),
                    rest,
                    &metadata[lanes * md_len..],
                    &mut failed,
                );
                (lanes + singles.0, singles.1)
            }
            #[cfg(not(target_arch = "x86_64"))]
            Engine::Aegis128L(_) => (0, data),
        };
        if rest.len() == 0 {
            return authenticated(failed);
        }
        let rest = rest.into_in_place();
        for (i, (sector, md)) in rest
            .chunks_exact_mut(self.sector_size)
            .zip(metadata[done * md_len..].chunks_exact(md_len))
            .enumerate()
        {
            let number = first_sector + (done + i) as u64;
            let aad = aad(&self.image_id, number);
            let (nonce, rest) = md.split_at(nonce_len);
            let (tag, padding_clean) = tag_of(rest);
            let ok = padding_clean
                && match &self.engine {
                    Engine::Aegis128L(key) => aegis128l_open(key, nonce, &aad, sector, tag),
                    Engine::Aegis256(_) | Engine::Gcm(_) => {
                        unreachable!("AEGIS-256 and GCM run apart, in open_each")
                    }
                };
            if !ok {
                // Never hand out unauthenticated plaintext.
                sector.fill(0);
                failed.push(number);
            }
        }
        authenticated(failed)
    }
}

/// A sealed sector's metadata after its nonce: the tag, then zero padding.
fn put_tag(rest: &mut [u8], tag: &[u8; TAG_LEN]) {
    rest[..TAG_LEN].copy_from_slice(tag);
    rest[TAG_LEN..].fill(0);
}

/// A stored sector's tag (after its nonce) and whether its padding is all zeros.
fn tag_of(rest: &[u8]) -> (&[u8; TAG_LEN], bool) {
    let tag = rest[..TAG_LEN].try_into().expect("fixed layout");
    (tag, rest[TAG_LEN..].iter().all(|&b| b == 0))
}

/// After opening one sector: one that did not verify is zeroed (never hand out
/// unauthenticated plaintext) and listed in `failed`.
fn opened(ok: bool, number: u64, sector: &mut Io<'_>, failed: &mut Vec<u64>) {
    if !ok {
        sector.clear_output();
        failed.push(number);
    }
}

/// The outcome of opening a run: an error naming the sectors whose tag did not verify, if any.
fn authenticated(failed: Vec<u64>) -> Result<(), CryptoError> {
    if failed.is_empty() {
        Ok(())
    } else {
        Err(CryptoError::Authentication { sectors: failed })
    }
}

impl crate::SectorCipher for AeadSuite {
    fn suite(&self) -> Suite {
        self.suite
    }

    fn sector_size(&self) -> usize {
        self.sector_size
    }

    fn encrypt_sectors(
        &self,
        first_sector: u64,
        data: &mut [u8],
        metadata: &mut [u8],
    ) -> Result<(), CryptoError> {
        self.seal_run(first_sector, Io::in_place(data), metadata)
    }

    fn decrypt_sectors(
        &self,
        first_sector: u64,
        data: &mut [u8],
        metadata: &[u8],
    ) -> Result<(), CryptoError> {
        self.open_run(first_sector, Io::in_place(data), metadata)
    }

    fn encrypt_sectors_to(
        &self,
        first_sector: u64,
        plaintext: &[u8],
        ciphertext: &mut [u8],
        metadata: &mut [u8],
    ) -> Result<(), CryptoError> {
        check_out_of_place(plaintext, ciphertext)?;
        self.seal_run(first_sector, Io::copy(plaintext, ciphertext), metadata)
    }

    fn decrypt_sectors_to(
        &self,
        first_sector: u64,
        ciphertext: &[u8],
        plaintext: &mut [u8],
        metadata: &[u8],
    ) -> Result<(), CryptoError> {
        check_out_of_place(ciphertext, plaintext)?;
        self.open_run(first_sector, Io::copy(ciphertext, plaintext), metadata)
    }

    fn encrypt_sectors_append(
        &self,
        first_sector: u64,
        plaintext: &[u8],
        ciphertext: &mut Vec<u8>,
        metadata: &mut [u8],
    ) -> Result<(), CryptoError> {
        // AEGIS-128L's kernels store through pointers, and OpenSSL's GCM is handed them
        // (`ffi::stream_update`): straight into the spare capacity.
        #[cfg(target_arch = "x86_64")]
        let direct = true;
        #[cfg(not(target_arch = "x86_64"))]
        let direct = matches!(self.engine, Engine::Aegis256(_) | Engine::Gcm(_));
        if direct {
            return crate::ffi::spare::append_written(ciphertext, plaintext.len(), |spare| {
                let run = Io::fresh(plaintext, spare);
                self.seal_run(first_sector, run, metadata)
            });
        }
        append_by_zeroing(self, first_sector, plaintext, ciphertext, metadata)
    }

    fn encrypt_sectors_append_slots(
        &self,
        first_sector: u64,
        plaintext: &[u8],
        slots: &mut Vec<u8>,
    ) -> Result<(), CryptoError> {
        if self.seals_slots_directly() {
            let slot = self.sector_size + self.suite.metadata_len();
            let len = check_whole_sectors(self, first_sector, plaintext)? * slot;
            return crate::ffi::spare::append_written(slots, len, |spare| {
                self.seal_into_slots(first_sector, plaintext, spare)
            });
        }
        append_slots_piecewise(self, first_sector, plaintext, slots)
    }

    fn encrypt_sectors_to_slots(
        &self,
        first_sector: u64,
        plaintext: &[u8],
        slots: &mut [u8],
    ) -> Result<(), CryptoError> {
        check_slots(self, first_sector, slots, plaintext)?;
        if self.seals_slots_directly() {
            return crate::ffi::spare::write_over(slots, |spare| {
                self.seal_into_slots(first_sector, plaintext, spare)
            });
        }
        slots_one_by_one(self, first_sector, plaintext, slots)
    }

    fn decrypt_sectors_from_slots(
        &self,
        first_sector: u64,
        slots: &[u8],
        plaintext: &mut [u8],
    ) -> Result<(), CryptoError> {
        check_slots(self, first_sector, slots, plaintext)?;
        let mut failed = Vec::new();
        if let Engine::Gcm(gcm) = &self.engine {
            gcm.decrypt.with(|ctx| {
                self.open_each_slot(first_sector, slots, plaintext, |number, sector, md| {
                    self.gcm_open_sector(gcm, ctx, number, sector, md, &mut failed)
                })
            })?;
            return authenticated(failed);
        }
        if let Engine::Aegis256(key) = &self.engine {
            self.open_each_slot(first_sector, slots, plaintext, |number, sector, md| {
                self.aegis256_open_sector(key, number, sector, md, &mut failed);
                Ok(())
            })?;
            return authenticated(failed);
        }
        #[cfg(target_arch = "x86_64")]
        if let Engine::Aegis128L(key) = &self.engine {
            if self.aegis128l_kernels() {
                let ss = self.sector_size;
                let mut inputs = slots.chunks_exact(ss + self.suite.metadata_len());
                let mut outputs = plaintext.chunks_exact_mut(ss);
                let sectors = inputs.len();
                return self.open_slots(key, first_sector, sectors, || {
                    let (data, meta) = inputs.next().expect("a slot per sector").split_at(ss);
                    (
                        Io::copy(data, outputs.next().expect("a sector per slot")),
                        meta,
                    )
                });
            }
        }
        decrypt_slots_apart(self, first_sector, slots, plaintext)
    }

    fn decrypt_sectors_from_slots_append(
        &self,
        first_sector: u64,
        slots: &[u8],
        plaintext: &mut Vec<u8>,
    ) -> Result<(), CryptoError> {
        #[cfg(target_arch = "x86_64")]
        if let Engine::Aegis128L(key) = &self.engine {
            if self.aegis128l_kernels() {
                let len = check_slots_append(self, first_sector, slots)? * self.sector_size;
                let mut failed = None;
                crate::ffi::spare::append_written(plaintext, len, |spare| {
                    let ss = self.sector_size;
                    let mut inputs = slots.chunks_exact(ss + self.suite.metadata_len());
                    let mut outputs = spare.chunks_exact_mut(ss);
                    let sectors = inputs.len();
                    let opened = self.open_slots(key, first_sector, sectors, || {
                        let (data, meta) = inputs.next().expect("a slot per sector").split_at(ss);
                        (
                            Io::fresh(data, outputs.next().expect("a sector per slot")),
                            meta,
                        )
                    });
                    match opened {
                        // Every sector was written: its plaintext, or zeros where its tag
                        // did not verify.
                        Err(e @ CryptoError::Authentication { .. }) => {
                            failed = Some(e);
                            Ok(())
                        }
                        other => other,
                    }
                })?;
                return failed.map_or(Ok(()), Err);
            }
        }
        append_from_slots_by_zeroing(self, first_sector, slots, plaintext)
    }

    fn encrypt_sectors_in_slots(
        &self,
        first_sector: u64,
        slots: &mut [u8],
    ) -> Result<(), CryptoError> {
        let sectors = check_slots_append(self, first_sector, slots)?;
        self.reserve_writes(sectors as u64)?;
        // One draw of nonces for the run, as `seal_run` makes for a contiguous one.
        let nonces = self.nonces.run(first_sector, self.nonce_len())?;
        let (ss, md_len) = (self.sector_size, self.suite.metadata_len());
        match &self.engine {
            // One OpenSSL context for the run, as `seal_run` takes.
            Engine::Gcm(gcm) => gcm.encrypt.with(|ctx| {
                self.seal_each_in_slots(first_sector, slots, |number, mut sector, md| {
                    self.gcm_seal_sector(gcm, ctx, &nonces, number, &mut sector, md)
                })
            }),
            Engine::Aegis256(key) => {
                self.seal_each_in_slots(first_sector, slots, |number, mut sector, md| {
                    self.aegis256_seal_sector(key, &nonces, number, &mut sector, md)
                })
            }
            Engine::Aegis128L(_key) => {
                #[allow(unused_mut)]
                let mut done = 0;
                #[cfg(target_arch = "x86_64")]
                if crate::ffi::aegis128l_vaes::available() {
                    done = self.seal_lanes_in_slots(_key, &nonces, first_sector, sectors, slots);
                }
                // Wraps only when no sector is left (a run ending at sector 2^64 - 1).
                let rest = first_sector.wrapping_add(done as u64);
                let slots = &mut slots[done * (ss + md_len)..];
                self.seal_each_in_slots(rest, slots, |number, sector, md| {
                    self.seal_run_with(&nonces, number, sector, md)
                })
            }
        }
    }

    fn decrypt_sectors_in_slots(
        &self,
        first_sector: u64,
        slots: &mut [u8],
    ) -> Result<(), CryptoError> {
        #[cfg(target_arch = "x86_64")]
        if let Engine::Aegis128L(key) = &self.engine {
            if self.aegis128l_kernels() {
                let sectors = check_slots_append(self, first_sector, slots)?;
                let ss = self.sector_size;
                let mut slots = slots.chunks_exact_mut(ss + self.suite.metadata_len());
                return self.open_slots(key, first_sector, sectors, || {
                    let (data, meta) = slots.next().expect("a slot per sector").split_at_mut(ss);
                    (Io::in_place(data), &*meta)
                });
            }
        }
        decrypt_slots_one_by_one(self, first_sector, slots)
    }

    fn writes_used(&self) -> Option<u64> {
        match &self.engine {
            Engine::Gcm(gcm) => Some(gcm.writes_used.load(Ordering::Acquire)),
            _ => None,
        }
    }
}

fn gcm_cipher(key: &[u8]) -> &'static openssl::cipher::CipherRef {
    match key.len() {
        32 => Cipher::aes_256_gcm(),
        24 => Cipher::aes_192_gcm(),
        _ => Cipher::aes_128_gcm(),
    }
}

/// AEGIS-128L seal of `data` in place (libaegis, AES-NI where the CPU has it); returns the
/// 128-bit tag.
pub fn aegis128l_seal(key: &[u8; 16], nonce: &[u8], aad: &[u8], data: &mut [u8]) -> [u8; TAG_LEN] {
    let nonce: &[u8; 16] = nonce.try_into().expect("AEGIS-128L nonce is 16 bytes");
    Aegis128L::<TAG_LEN>::new(key, nonce).encrypt_in_place(data, aad)
}

/// AEGIS-128L open of `data` in place; false if the tag does not verify.
pub fn aegis128l_open(
    key: &[u8; 16],
    nonce: &[u8],
    aad: &[u8],
    data: &mut [u8],
    tag: &[u8; TAG_LEN],
) -> bool {
    let nonce: &[u8; 16] = nonce.try_into().expect("AEGIS-128L nonce is 16 bytes");
    Aegis128L::<TAG_LEN>::new(key, nonce)
        .decrypt_in_place(data, tag, aad)
        .is_ok()
}

/// AEGIS-256 seal of `data` in place; returns the 128-bit tag. The suite's code path
/// (`ffi::aegis256`), so the known-answer tests hold it to the specification.
pub fn aegis256_seal(key: &[u8; 32], nonce: &[u8], aad: &[u8], data: &mut [u8]) -> [u8; TAG_LEN] {
    let nonce: &[u8; 32] = nonce.try_into().expect("AEGIS-256 nonce is 32 bytes");
    crate::ffi::aegis256::ensure_init();
    crate::ffi::aegis256::seal(key, nonce, aad, &mut Io::in_place(data))
}

/// AEGIS-256 open of `data` in place; false if the tag does not verify.
pub fn aegis256_open(
    key: &[u8; 32],
    nonce: &[u8],
    aad: &[u8],
    data: &mut [u8],
    tag: &[u8; TAG_LEN],
) -> bool {
    let nonce: &[u8; 32] = nonce.try_into().expect("AEGIS-256 nonce is 32 bytes");
    crate::ffi::aegis256::ensure_init();
    crate::ffi::aegis256::open(key, nonce, aad, &mut Io::in_place(data), tag)
}

fn gcm_seal(
    pool: &ContextPool,
    ctx: &mut CipherCtxRef,
    nonce: &[u8],
    aad: &[u8],
    data: &mut Io<'_>,
) -> Result<[u8; TAG_LEN], CryptoError> {
    pool.set_iv(ctx, nonce)?;
    ctx.cipher_update(aad, None)?;
    crate::ffi::stream_update(ctx, data)?;
    ctx.cipher_final(&mut [0u8; 16])?;
    let mut tag = [0u8; TAG_LEN];
    ctx.tag(&mut tag)?;
    Ok(tag)
}

/// Ok(false) when the tag does not verify; Err only for OpenSSL failures.
fn gcm_open(
    pool: &ContextPool,
    ctx: &mut CipherCtxRef,
    nonce: &[u8],
    aad: &[u8],
    data: &mut Io<'_>,
    tag: &[u8; TAG_LEN],
) -> Result<bool, CryptoError> {
    pool.set_iv(ctx, nonce)?;
    ctx.cipher_update(aad, None)?;
    crate::ffi::stream_update(ctx, data)?;
    ctx.set_tag(tag)?;
    // EVP_DecryptFinal fails exactly when the tag does not match.
    Ok(ctx.cipher_final(&mut [0u8; 16]).is_ok())
}

/// AES-GCM seal with a 96-bit nonce, for the NIST known-answer tests: the same code path as
/// the suite's, with the context built for one call.
#[doc(hidden)]
pub fn gcm_seal_once(
    key: &[u8],
    nonce: &[u8],
    aad: &[u8],
    data: &mut [u8],
) -> Result<[u8; TAG_LEN], CryptoError> {
    let pool = ContextPool::new(gcm_cipher(key), key, Direction::Encrypt);
    pool.with(|ctx| gcm_seal(&pool, ctx, nonce, aad, &mut Io::in_place(data)))
}

/// Inverse of [`gcm_seal_once`]; false when the tag does not verify.
#[doc(hidden)]
pub fn gcm_open_once(
    key: &[u8],
    nonce: &[u8],
    aad: &[u8],
    data: &mut [u8],
    tag: &[u8; TAG_LEN],
) -> Result<bool, CryptoError> {
    let pool = ContextPool::new(gcm_cipher(key), key, Direction::Decrypt);
    pool.with(|ctx| gcm_open(&pool, ctx, nonce, aad, &mut Io::in_place(data), tag))
}
