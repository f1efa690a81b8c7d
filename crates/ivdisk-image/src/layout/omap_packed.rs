//! `omap-packed` (ours, not the paper's): ciphertext at the sector's own offset, as in `omap`;
//! the metadata of each run of [`SECTORS_PER_VALUE`] sectors packed into one omap value, key
//! `{run:08x}` (zeros for the sectors never written; no key: all of them unwritten).
//!
//! Why: on RADOS the metadata of a write is one more item in its operation, and what that item
//! costs the OSD depends on its kind and size. One small omap value (512 bytes with 32 bytes of
//! metadata per sector) cost less than a whole 4 KiB metadata block as a second extent (what
//! `object-end` writes from its cache) from 4 KiB to 64 KiB writes, in the RADOS bench
//! (docs/BENCHMARKS.md, "RADOS write operations"), while a key per sector (`omap`) grows with
//! the IO size.
//!
//! A write that covers a run only in part must send the run's whole value, so it needs the
//! others' metadata: images in this layout are written only through the writer's metadata
//! cache (`crate::metadata_cache`), which holds the values as blocks of a virtual metadata
//! region at [`VIRTUAL_REGION`] (never sent to a store: [`OmapPacked::lower`] turns its
//! steps into omap steps) and loads a value before a write that needs it. Reads without the
//! cache (read-only opens, snapshots) fetch the values of their runs.
//!
//! A value whose sectors' nonces count up from its first sector's (the sectors were sealed in
//! one run: a write covering the whole run, `Suite::counted_nonce_len`) is stored compact:
//! the first sector's metadata whole, then for each further sector its metadata without the
//! nonce. For AEGIS-128L that is 16 + 16 x 16 = 272 bytes instead of 512. Why: on RADOS the
//! metadata's bytes cost the OSDs in proportion to their size (docs/BENCHMARKS.md, RADOS
//! bench cases `j`, `n` and `o`), and large writes set many values. A reader tells the two
//! forms apart by length (they differ whenever the run has two sectors and the suite a counted
//! nonce); the compact form is lossless, so the cache and the cipher only ever see full
//! metadata. A changed byte of the first nonce fails every sector of the run, still detected.

use ivdisk_crypto::nonce_add;
use ivdisk_store::{OmapPairs, ReadResult, ReadStep, WriteStep};

use super::object_end::{discard_apart, write_apart};
use super::omap::{index_of, key, key_digits};
use super::{take_or_place_extents, Decoded, ObjectGeometry, ReadOutput, SectorLayout};

/// Sectors whose metadata share one omap value.
pub(crate) const SECTORS_PER_VALUE: u32 = 16;

/// The most metadata bytes per sector this layout stores compact (the longest suite has 48).
const MAX_METADATA_LEN: usize = 64;

/// The most nonce bytes per sector that count up (AEGIS-256's 32).
const MAX_NONCE_LEN: usize = 32;

/// Where the metadata cache places this layout's metadata region: past any object's data, so
/// a step there is always metadata; [`OmapPacked::lower`] maps it to omap values.
pub(crate) const VIRTUAL_REGION: u64 = 1 << 62;

#[derive(Debug)]
pub(crate) struct OmapPacked(pub ObjectGeometry);

impl OmapPacked {
    fn data_offset(&self, sector: u32) -> u64 {
        sector as u64 * self.0.sector_size as u64
    }

    /// Where the cache keeps a sector's metadata (never sent to a store).
    fn metadata_offset(&self, sector: u32) -> u64 {
        VIRTUAL_REGION + sector as u64 * self.0.metadata_len as u64
    }

    /// Bytes of one full value.
    pub(crate) fn value_len(&self) -> usize {
        SECTORS_PER_VALUE as usize * self.0.metadata_len
    }

    /// Bytes of the object's metadata region (the cache's view).
    pub(crate) fn region_len(&self) -> usize {
        self.0.sectors_per_object as usize * self.0.metadata_len
    }

    /// Bytes of run `run`'s value (the last run of an object may be shorter).
    fn value_len_of(&self, run: u32) -> usize {
        let start = run as usize * self.value_len();
        (start + self.value_len()).min(self.region_len()) - start
    }

    /// Bytes of run `run`'s value in compact form, if it has one (two sectors or more, and a
    /// counted nonce).
    fn compact_len_of(&self, run: u32) -> Option<usize> {
        let (ml, nl) = (self.0.metadata_len, self.0.nonce_len);
        let sectors = self.value_len_of(run) / ml;
        (nl > 0 && nl < ml && sectors >= 2 && ml <= MAX_METADATA_LEN && nl <= MAX_NONCE_LEN)
            .then(|| ml + (sectors - 1) * (ml - nl))
    }

    /// `value` (a full value of run `run`) in compact form into `out`, if its sectors' nonces
    /// count up from the first one's; the compact bytes.
    fn compact<'o>(&self, run: u32, value: &[u8], out: &'o mut [u8]) -> Option<&'o [u8]> {
        let len = self.compact_len_of(run)?;
        let (ml, nl) = (self.0.metadata_len, self.0.nonce_len);
        if !nonces_count_up(value, ml, nl) {
            return None;
        }
        let out = &mut out[..len];
        out[..ml].copy_from_slice(&value[..ml]);
        for (rest, sector) in out[ml..]
            .chunks_exact_mut(ml - nl)
            .zip(value.chunks_exact(ml).skip(1))
        {
            rest.copy_from_slice(&sector[nl..]);
        }
        Some(out)
    }

    /// The full value of run `run` from its compact form `stored` into `out`.
    fn expand(&self, run: u32, stored: &[u8], out: &mut [u8]) {
        let (ml, nl) = (self.0.metadata_len, self.0.nonce_len);
        let out = &mut out[..self.value_len_of(run)];
        out[..ml].copy_from_slice(&stored[..ml]);
        let mut nonce = [0u8; MAX_NONCE_LEN];
        let nonce = &mut nonce[..nl];
        nonce.copy_from_slice(&stored[..nl]);
        for (sector, rest) in out
            .chunks_exact_mut(ml)
            .skip(1)
            .zip(stored[ml..].chunks_exact(ml - nl))
        {
            nonce_add(nonce, 1);
            sector[..nl].copy_from_slice(nonce);
            sector[nl..].copy_from_slice(rest);
        }
    }

    /// The runs holding sectors `first..first + count`.
    fn runs(first: u32, count: u32) -> std::ops::Range<u32> {
        first / SECTORS_PER_VALUE..(first + count).div_ceil(SECTORS_PER_VALUE)
    }

    /// The read step fetching the values of the runs that hold region bytes `range` (whole
    /// values: the cache's blocks are the values).
    pub(crate) fn fetch_step(&self, range: &std::ops::Range<usize>) -> ReadStep {
        let v = self.value_len();
        ReadStep::OmapGetByKeys(
            ((range.start / v) as u32..range.end.div_ceil(v) as u32)
                .map(key)
                .collect(),
        )
    }

    /// The region bytes `range` from the result of [`OmapPacked::fetch_step`] (zeros where no
    /// value is stored).
    pub(crate) fn fetched_bytes(
        &self,
        result: Option<ReadResult>,
        range: &std::ops::Range<usize>,
    ) -> Result<Vec<u8>, String> {
        let mut out = vec![0u8; range.len()];
        self.place_values(result, range.start, &mut out)?;
        Ok(out)
    }

    /// Copy the values of an omap read into `out`, which holds region bytes from `base` on.
    fn place_values(
        &self,
        result: Option<ReadResult>,
        base: usize,
        out: &mut [u8],
    ) -> Result<(), String> {
        let Some(ReadResult::Omap { pairs, .. }) = result else {
            return Err(format!(
                "expected the pairs of an omap read, got {result:?}"
            ));
        };
        for (k, value) in &pairs {
            let run = index_of(k)
                .ok_or_else(|| format!("unexpected omap key {:?}", String::from_utf8_lossy(k)))?;
            if run >= self.0.sectors_per_object.div_ceil(SECTORS_PER_VALUE) {
                return Err(format!(
                    "omap key of run {run} lies past the object's sectors"
                ));
            }
            let expected = self.value_len_of(run);
            let mut expanded = [0u8; SECTORS_PER_VALUE as usize * MAX_METADATA_LEN];
            let value = if value.len() == expected {
                value
            } else if Some(value.len()) == self.compact_len_of(run) {
                self.expand(run, value, &mut expanded);
                &expanded[..expected]
            } else {
                let compact = match self.compact_len_of(run) {
                    Some(len) => format!(" (or {len} compact)"),
                    None => String::new(),
                };
                return Err(format!(
                    "omap value of run {run} holds {} bytes, not {expected}{compact}",
                    value.len()
                ));
            };
            let start = run as usize * self.value_len();
            let lo = start.max(base);
            let hi = (start + value.len()).min(base + out.len());
            if lo < hi {
                out[lo - base..hi - base].copy_from_slice(&value[lo - start..hi - start]);
            }
        }
        Ok(())
    }

    /// Turn the metadata steps the cache left (whole values, at [`VIRTUAL_REGION`]) into omap
    /// steps: a value of all zeros becomes a key removal (every sector of its run unwritten).
    /// A metadata step that is not a whole value cannot be stored: `Err` names it (the caller
    /// loads the values first, so this is a bug).
    pub(crate) fn lower(&self, steps: &mut Vec<WriteStep>) -> Result<(), String> {
        let removes_object = steps.iter().any(|s| matches!(s, WriteStep::Remove));
        // Room for every value whole, so the pairs are allocated once.
        let (values, bytes) = steps.iter().fold((0, 0), |(n, b), step| match step {
            WriteStep::Write { offset, data } if *offset >= VIRTUAL_REGION => {
                (n + 1, b + data.len())
            }
            _ => (n, b),
        });
        let mut set = OmapPairs::with_capacity(values, bytes + values * 8);
        let mut removed = Vec::new();
        let mut error = None;
        let mut first_metadata = None;
        let v = self.value_len() as u64;
        let mut at = 0;
        steps.retain(|step| {
            at += 1;
            let (offset, data) = match step {
                WriteStep::Write { offset, data } if *offset >= VIRTUAL_REGION => {
                    (*offset - VIRTUAL_REGION, Some(data))
                }
                WriteStep::Zero { offset, .. } if *offset >= VIRTUAL_REGION => {
                    (*offset - VIRTUAL_REGION, None)
                }
                _ => return true,
            };
            first_metadata.get_or_insert(at - 1);
            if removes_object {
                // The object goes, and its omap with it.
                return false;
            }
            let run = (offset / v) as u32;
            match data {
                Some(data) if offset.is_multiple_of(v) && data.len() == self.value_len_of(run) => {
                    let mut compact = [0u8; SECTORS_PER_VALUE as usize * MAX_METADATA_LEN];
                    // Compact first: a value whose nonces count up is never all zeros (two
                    // sectors' nonces differ), so the usual large write skips the scan.
                    if let Some(compact) = self.compact(run, data, &mut compact) {
                        set.push(&key_digits(run), compact);
                    } else if data.iter().all(|&b| b == 0) {
                        removed.push(key(run));
                    } else {
                        set.push(&key_digits(run), data);
                    }
                }
                _ => {
                    error.get_or_insert_with(|| {
                        format!("metadata step at {offset} is not one whole omap value")
                    });
                }
            }
            false
        });
        if let Some(error) = error {
            return Err(error);
        }
        let at = first_metadata.map_or(steps.len(), |at| at.min(steps.len()));
        let mut lowered = Vec::new();
        if !set.is_empty() {
            lowered.push(WriteStep::OmapSet(set));
        }
        if !removed.is_empty() {
            lowered.push(WriteStep::OmapRemoveKeys(removed));
        }
        steps.splice(at..at, lowered);
        Ok(())
    }
}

/// Whether the nonces (the first `nl` bytes of each `ml`-byte sector's metadata in `value`)
/// count up by one from the first, as [`nonce_add`] counts (little-endian, wrapping). Why not
/// `nonce_add` and a slice compare per sector: a `memcmp` call per sector showed in the
/// profile of 64 KiB writes; the 16- and 32-byte nonces of the AEGIS suites compare as
/// integers.
fn nonces_count_up(value: &[u8], ml: usize, nl: usize) -> bool {
    let word = |b: &[u8]| u128::from_le_bytes(b.try_into().expect("16 bytes"));
    match nl {
        16 => {
            let first = word(&value[..16]);
            (1u128..)
                .zip(value.chunks_exact(ml).skip(1))
                .all(|(i, s)| word(&s[..16]) == first.wrapping_add(i))
        }
        32 => {
            let (lo, hi) = (word(&value[..16]), word(&value[16..32]));
            (1u128..).zip(value.chunks_exact(ml).skip(1)).all(|(i, s)| {
                let (next_lo, carry) = lo.overflowing_add(i);
                word(&s[..16]) == next_lo && word(&s[16..32]) == hi.wrapping_add(carry as u128)
            })
        }
        _ => {
            let mut nonce = [0u8; MAX_NONCE_LEN];
            let nonce = &mut nonce[..nl];
            nonce.copy_from_slice(&value[..nl]);
            value.chunks_exact(ml).skip(1).all(|sector| {
                nonce_add(nonce, 1);
                sector[..nl] == *nonce
            })
        }
    }
}

impl SectorLayout for OmapPacked {
    fn write(
        &self,
        steps: &mut Vec<WriteStep>,
        first: u32,
        ciphertext: Vec<u8>,
        metadata: Vec<u8>,
    ) {
        // The metadata into the virtual region, as `object-end` writes its region; the cache
        // makes whole values of it and `lower` omap steps.
        write_apart(
            steps,
            (self.data_offset(first), ciphertext),
            (self.metadata_offset(first), metadata),
        );
    }

    fn discard(&self, steps: &mut Vec<WriteStep>, first: u32, count: u32) {
        let offsets = (self.data_offset(first), self.metadata_offset(first));
        discard_apart(steps, &self.0, offsets, count);
    }

    fn read(&self, steps: &mut Vec<ReadStep>, first: u32, count: u32) {
        let ss = self.0.sector_size as u64;
        steps.push(ReadStep::Read {
            offset: first as u64 * ss,
            len: count as u64 * ss,
        });
        steps.push(ReadStep::OmapGetByKeys(
            Self::runs(first, count).map(key).collect(),
        ));
    }

    fn decode(
        &self,
        results: &mut dyn Iterator<Item = ReadResult>,
        first: u32,
        count: u32,
        ciphertext: &mut ReadOutput<'_>,
        metadata: &mut [u8],
    ) -> Result<Decoded, String> {
        let taken = take_or_place_extents(
            results.next(),
            first as u64 * self.0.sector_size as u64,
            ciphertext,
        )?;
        let ml = self.0.metadata_len;
        debug_assert_eq!(metadata.len(), count as usize * ml);
        self.place_values(results.next(), first as usize * ml, metadata)?;
        Ok(taken.into())
    }

    fn needs_metadata_cache(&self) -> bool {
        true
    }

    fn lower_cached_steps(&self, steps: &mut Vec<WriteStep>) -> Result<(), String> {
        self.lower(steps)
    }

    fn cached_fetch_step(&self, _region_offset: u64, range: &std::ops::Range<usize>) -> ReadStep {
        self.fetch_step(range)
    }

    fn cached_fetched(
        &self,
        result: Option<ReadResult>,
        _region_offset: u64,
        range: &std::ops::Range<usize>,
    ) -> Result<Vec<u8>, String> {
        self.fetched_bytes(result, range)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> OmapPacked {
        OmapPacked(ObjectGeometry {
            sector_size: 4096,
            metadata_len: 32,
            nonce_len: 16,
            sectors_per_object: 40,
        })
    }

    #[test]
    fn whole_values_become_omap_steps_in_place_of_the_metadata_steps() {
        let l = layout();
        let mut steps = vec![
            WriteStep::AssertExists,
            WriteStep::Write {
                offset: 0,
                data: vec![1; 4096],
            },
            WriteStep::Write {
                offset: VIRTUAL_REGION,
                data: vec![2; 512],
            },
            WriteStep::Write {
                offset: VIRTUAL_REGION + 512,
                data: vec![0; 512],
            },
            // The last run of a 40-sector object holds 8 sectors: 256 bytes.
            WriteStep::Write {
                offset: VIRTUAL_REGION + 1024,
                data: vec![3; 256],
            },
        ];
        l.lower(&mut steps).expect("whole values");
        assert_eq!(steps.len(), 4);
        assert!(matches!(steps[0], WriteStep::AssertExists));
        assert!(matches!(steps[1], WriteStep::Write { offset: 0, .. }));
        let WriteStep::OmapSet(set) = &steps[2] else {
            panic!("{:?}", steps[2])
        };
        let set = set.to_vec();
        assert_eq!(set.len(), 2);
        assert_eq!(set[0], (b"00000000".to_vec(), vec![2; 512]));
        assert_eq!(set[1], (b"00000002".to_vec(), vec![3; 256]));
        assert!(
            matches!(&steps[3], WriteStep::OmapRemoveKeys(k) if k == &vec![b"00000001".to_vec()])
        );
    }

    /// Full metadata of `sectors` sectors sealed in one run: nonces counting up from one that
    /// carries into its second byte, tags that differ per sector.
    fn one_run(sectors: usize) -> Vec<u8> {
        let mut value = Vec::new();
        for i in 0..sectors {
            let mut nonce = [0xf0u8; 16];
            nonce[0] = 0xf8;
            nonce_add(&mut nonce, i as u64);
            value.extend_from_slice(&nonce);
            value.extend_from_slice(&[i as u8 + 1; 16]);
        }
        value
    }

    fn stored_values(steps: &[WriteStep]) -> Vec<(Vec<u8>, Vec<u8>)> {
        let [WriteStep::OmapSet(set)] = steps else {
            panic!("{steps:?}")
        };
        set.to_vec()
    }

    #[test]
    fn a_run_sealed_at_once_is_stored_compact_and_reads_back_whole() {
        let l = layout();
        let full = one_run(16);
        let mut steps = vec![WriteStep::Write {
            offset: VIRTUAL_REGION + 512,
            data: full.clone(),
        }];
        l.lower(&mut steps).expect("a whole value");
        let stored = stored_values(&steps);
        assert_eq!(stored[0].0, b"00000001");
        let compact = &stored[0].1;
        assert_eq!(
            compact.len(),
            32 + 15 * 16,
            "first sector whole, then tags only"
        );
        assert_eq!(compact[..32], full[..32]);
        assert_eq!(
            compact[32..48],
            [2u8; 16],
            "the second sector's tag follows"
        );
        // Read back: any part of the run, from the compact value, is the full metadata.
        let mut pairs = OmapPairs::new();
        pairs.push(b"00000001", compact);
        let result = || {
            Some(ReadResult::Omap {
                pairs: pairs.clone(),
                more: false,
            })
        };
        assert_eq!(l.fetched_bytes(result(), &(512..1024)).unwrap(), full);
        let mut part = vec![0u8; 3 * 32];
        l.place_values(result(), 512 + 5 * 32, &mut part).unwrap();
        assert_eq!(part, full[5 * 32..8 * 32]);

        // The last run's 8 sectors: compact too (32 + 7 x 16 bytes).
        let mut steps = vec![WriteStep::Write {
            offset: VIRTUAL_REGION + 1024,
            data: one_run(8),
        }];
        l.lower(&mut steps).unwrap();
        assert_eq!(stored_values(&steps)[0].1.len(), 32 + 7 * 16);
    }

    #[test]
    fn a_run_whose_nonces_do_not_count_up_is_stored_whole() {
        let l = layout();
        // One sector rewritten later (another nonce), or one never written (zeros).
        for changed in [3usize, 0, 15] {
            let mut value = one_run(16);
            value[changed * 32] ^= 0x55;
            let mut steps = vec![WriteStep::Write {
                offset: VIRTUAL_REGION,
                data: value.clone(),
            }];
            l.lower(&mut steps).unwrap();
            assert_eq!(
                stored_values(&steps)[0].1,
                value,
                "sector {changed} changed"
            );
        }
        let mut value = one_run(16);
        value[7 * 32..8 * 32].fill(0);
        let mut steps = vec![WriteStep::Write {
            offset: VIRTUAL_REGION,
            data: value.clone(),
        }];
        l.lower(&mut steps).unwrap();
        assert_eq!(stored_values(&steps)[0].1, value);
        // Suites without a counted nonce never compact.
        let xts = OmapPacked(ObjectGeometry {
            metadata_len: 16,
            nonce_len: 0,
            ..l.0
        });
        assert_eq!(xts.compact_len_of(0), None);
        // A value of neither length is refused, naming both.
        let mut pairs = OmapPairs::new();
        pairs.push(b"00000000", &[1u8; 300]);
        let err = l
            .fetched_bytes(Some(ReadResult::Omap { pairs, more: false }), &(0..512))
            .unwrap_err();
        assert!(err.contains("300 bytes, not 512 (or 272 compact)"), "{err}");
    }

    #[test]
    fn a_partial_value_is_refused_and_a_removed_object_takes_its_values_along() {
        let l = layout();
        let mut partial = vec![WriteStep::Write {
            offset: VIRTUAL_REGION + 32,
            data: vec![1; 32],
        }];
        assert!(l.lower(&mut partial).is_err());
        let mut remove = vec![
            WriteStep::Zero {
                offset: VIRTUAL_REGION + 32,
                len: 32,
            },
            WriteStep::Remove,
        ];
        l.lower(&mut remove).expect("removal");
        assert!(matches!(remove[..], [WriteStep::Remove]));
    }

    #[test]
    fn reads_place_values_and_zeros_for_missing_runs() {
        let l = layout();
        let mut pairs = OmapPairs::new();
        pairs.push(b"00000001", &[7u8; 512]);
        let result = Some(ReadResult::Omap { pairs, more: false });
        // Sectors 14..18: two of run 0 (absent), two of run 1.
        let mut metadata = vec![9u8; 4 * 32];
        l.place_values(result, 14 * 32, &mut metadata)
            .expect("well formed");
        // place_values copies values only; the caller's buffer arrives zeroed.
        assert_eq!(&metadata[64..], &[7u8; 64][..]);
        let mut bad = OmapPairs::new();
        bad.push(b"00000001", &[7u8; 100]);
        let result = Some(ReadResult::Omap {
            pairs: bad,
            more: false,
        });
        assert!(l.place_values(result, 0, &mut metadata).is_err());
        assert_eq!(
            l.fetched_bytes(
                Some(ReadResult::Omap {
                    pairs: OmapPairs::new(),
                    more: false
                }),
                &(512..1024)
            )
            .expect("empty"),
            vec![0u8; 512]
        );
    }

    /// The integer comparisons agree with counting by `nonce_add` for every nonce length,
    /// across byte carries and the wrap at the top, and see a single wrong bit.
    #[test]
    fn nonces_count_up_agrees_with_nonce_add() {
        for nl in [12usize, 16, 24, 32] {
            let ml = nl + 16;
            for start in [[0u8; 32], [0xff; 32], {
                let mut s = [0x5au8; 32];
                s[0] = 0xfd;
                s[16] = 0xff;
                s
            }] {
                let mut value = vec![0u8; 16 * ml];
                let mut nonce = start[..nl].to_vec();
                for sector in value.chunks_exact_mut(ml) {
                    sector[..nl].copy_from_slice(&nonce);
                    sector[nl..].fill(0x33);
                    nonce_add(&mut nonce, 1);
                }
                assert!(
                    nonces_count_up(&value, ml, nl),
                    "nl {nl}, start {:02x?}",
                    &start[..4]
                );
                for bit in [0, 7, 8 * nl - 1] {
                    let mut bad = value.clone();
                    bad[5 * ml + bit / 8] ^= 1 << (bit % 8);
                    assert!(!nonces_count_up(&bad, ml, nl), "nl {nl}, bit {bit}");
                }
            }
        }
    }
}
