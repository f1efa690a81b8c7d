//! What the crash tests share (SIGKILL in crash.rs, power cuts in power_loss.rs): operations
//! that are a deterministic function of (object, generation), so a verifier can recompute
//! them, the in-memory model that replays them, and the check of a store's object against it.
//! Each test crate sets the workload's size with `SPAN`, `MAX_WRITE`, `SMALL_WRITE` and names
//! its objects with `OBJECT_PREFIX` (constants at its root).

#![allow(dead_code)]

use std::collections::BTreeMap;

use ivdisk_store::{
    LocalStore, ObjectName, ObjectStore, ObjectStoreExt, ReadOp, ReadResult, ReadStep, StoreError,
    WriteOp, WriteStep,
};

use crate::{MAX_WRITE, OBJECT_PREFIX, SMALL_WRITE, SPAN};

// ---------------------------------------------------------------------------------------------
// Deterministic pseudo-randomness.

/// The splitmix64 finaliser: a good 64-bit mixing function.
pub fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// splitmix64.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        mix(self.0)
    }
    /// Uniform in `0..n` (n > 0; the modulo bias is irrelevant here).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    /// Uniform in `lo..=hi`.
    pub fn between(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo + 1)
    }
}

pub fn op_seed(k: usize, g: u64) -> u64 {
    mix(mix(0x6976_6469_736b_0000 ^ k as u64) ^ g)
}

pub fn object_name(k: usize) -> ObjectName {
    ObjectName::new(format!("{OBJECT_PREFIX}/o{k}")).unwrap()
}

pub fn gen_key(g: u64) -> Vec<u8> {
    format!("g/{g:010}").into_bytes()
}

/// The value of key "g/<g>" of object `k`: 8..=3000 bytes (the larger ones take SQLite
/// overflow pages and grow the metadata log quickly).
pub fn gen_value(k: usize, g: u64) -> Vec<u8> {
    let seed = mix(op_seed(k, g) ^ 0x0a11);
    let len = 8 + seed % 2993;
    (0..len.div_ceil(8))
        .flat_map(|i| mix(seed ^ i).to_le_bytes())
        .take(len as usize)
        .collect()
}

/// The bytes step `step` of operation (k, g) writes at object offsets `[offset, offset + len)`:
/// a function of (k, g, step, offset) (an xorshift stream seeded from them: cheap even in an
/// unoptimised test build).
pub fn content(k: usize, g: u64, step: usize, offset: u64, len: u64) -> Vec<u8> {
    let mut x =
        mix(op_seed(k, g) ^ (step as u64 + 1).wrapping_mul(0x5851_F42D_4C95_7F2D) ^ offset) | 1;
    let mut out = vec![0u8; len as usize];
    for chunk in out.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        chunk.copy_from_slice(&x.to_le_bytes()[..chunk.len()]);
    }
    out
}

/// Operation `g` (1, 2, 3, ...) on object `k`.
pub fn object_op(k: usize, g: u64) -> WriteOp {
    let mut rng = Rng(op_seed(k, g));
    let mut steps = Vec::new();
    let writes = rng.between(2, 3) as usize;
    for i in 0..writes {
        let mut len = if rng.below(2) == 0 {
            rng.between(1, SMALL_WRITE)
        } else {
            rng.between(SMALL_WRITE + 1, MAX_WRITE)
        };
        // A third in whole blocks, half of those as long as can be: the writes the local
        // store puts into reused dead space (and their deaths, dead ranges long enough to be
        // held for reuse).
        if rng.below(3) == 0 {
            len = match rng.below(2) {
                0 => MAX_WRITE,
                _ => len.next_multiple_of(4096).min(MAX_WRITE),
            };
        }
        let mut offset = rng.below(SPAN - len + 1);
        if rng.below(4) == 0 {
            offset &= !4095;
        }
        steps.push(WriteStep::Write {
            offset,
            data: content(k, g, i, offset, len),
        });
    }
    // Sometimes a hole punch or a truncation, anywhere after the first write (so the object
    // exists: zeroing a missing object fails).
    let extra = match rng.below(10) {
        0..=2 => {
            let len = rng.between(1, MAX_WRITE);
            Some(WriteStep::Zero {
                offset: rng.below(SPAN - len + 1),
                len,
            })
        }
        3 | 4 => Some(WriteStep::Truncate(rng.below(SPAN + 1))),
        _ => None,
    };
    if let Some(extra) = extra {
        let at = rng.between(1, steps.len() as u64) as usize;
        steps.insert(at, extra);
    }
    let mut pairs = vec![
        (b"gen".to_vec(), g.to_be_bytes().to_vec()),
        (gen_key(g), gen_value(k, g)),
    ];
    if rng.below(2) == 0 {
        pairs.reverse();
    }
    let at = rng.below(steps.len() as u64 + 1) as usize;
    steps.insert(at, WriteStep::OmapSet(pairs.into()));
    if g.is_multiple_of(10) {
        // Forget old per-generation keys (keep the last few).
        let start = gen_key(rng.below(g - 5));
        let at = rng.below(steps.len() as u64 + 1) as usize;
        steps.insert(
            at,
            WriteStep::OmapRemoveRange {
                start,
                end: gen_key(g - 5),
            },
        );
    }
    if g % 10 == 5 {
        // Now and then the object is removed and made again in one operation (never with a
        // range removal, which would find it missing): a removal drops its node's held omap
        // changes, and older pending rows that hold them must not bring them back.
        steps.insert(0, WriteStep::Remove);
    }
    WriteOp {
        steps,
        ..WriteOp::default()
    }
}

// ---------------------------------------------------------------------------------------------
// The in-memory model.

#[derive(Clone)]
pub struct Model {
    /// Generations applied.
    pub gen: u64,
    pub exists: bool,
    pub size: u64,
    /// `[0, SPAN)`; bytes at or past `size` are zero.
    pub data: Vec<u8>,
    pub omap: BTreeMap<Vec<u8>, Vec<u8>>,
}

impl Model {
    pub fn new() -> Self {
        Model {
            gen: 0,
            exists: false,
            size: 0,
            data: vec![0; SPAN as usize],
            omap: BTreeMap::new(),
        }
    }

    pub fn apply(&mut self, op: &WriteOp) {
        for step in &op.steps {
            match step {
                WriteStep::Write { offset, data } => {
                    let at = *offset as usize;
                    self.data[at..at + data.len()].copy_from_slice(data);
                    self.size = self.size.max(offset + data.len() as u64);
                }
                WriteStep::Zero { offset, len } => {
                    self.data[*offset as usize..(offset + len) as usize].fill(0);
                }
                WriteStep::Truncate(size) => {
                    self.data[*size as usize..].fill(0);
                    self.size = *size;
                }
                WriteStep::OmapSet(pairs) => {
                    for (key, value) in pairs {
                        self.omap.insert(key.to_vec(), value.to_vec());
                    }
                }
                WriteStep::OmapRemoveRange { start, end } => {
                    self.omap
                        .retain(|key, _| !(key.as_slice() >= start.as_slice() && key < end));
                }
                WriteStep::Remove => {
                    let gen = self.gen;
                    *self = Model::new();
                    self.gen = gen;
                    continue;
                }
                other => unreachable!("the test does not generate {other:?}"),
            }
            self.exists = true;
        }
    }

    /// Bring the model to generation `g` of object `k` (from scratch if it is past it).
    pub fn advance_to(&mut self, k: usize, g: u64) {
        if g < self.gen {
            *self = Model::new();
        }
        while self.gen < g {
            self.gen += 1;
            self.apply(&object_op(k, self.gen));
        }
    }
}

pub async fn current_gen(store: &LocalStore, k: usize) -> u64 {
    let op = ReadOp::new().step(ReadStep::OmapGetByKeys(vec![b"gen".to_vec()]));
    match store.read_op(&object_name(k), op).await {
        Ok(mut results) => match results.pop() {
            Some(ReadResult::Omap { pairs, .. }) => match pairs.first() {
                Some((_, v)) => u64::from_be_bytes(v.try_into().expect("8-byte gen")),
                None => 0,
            },
            other => panic!("an omap read returned {other:?}"),
        },
        Err(StoreError::NotFound { .. }) => 0,
        Err(e) => panic!("reading the generation of object {k}: {e}"),
    }
}

/// Compare the store's state of object `k` with the model; describe the first difference.
pub async fn check_object(store: &LocalStore, k: usize, model: &Model) -> Result<(), String> {
    let name = object_name(k);
    let stat = store.stat(&name).await.map_err(|e| format!("stat: {e}"))?;
    let Some(stat) = stat else {
        return if model.exists {
            Err("the object is missing".into())
        } else {
            Ok(())
        };
    };
    if !model.exists {
        return Err(format!(
            "the object exists ({stat:?}) but no operation on it committed"
        ));
    }
    if stat.size != model.size {
        return Err(format!(
            "size {} but the model says {}",
            stat.size, model.size
        ));
    }
    let data = store
        .read(&name, 0, SPAN)
        .await
        .map_err(|e| format!("read: {e}"))?;
    let expected = &model.data[..model.size as usize];
    if data != expected {
        let first = data
            .iter()
            .zip(expected)
            .position(|(a, b)| a != b)
            .unwrap_or(data.len().min(expected.len()));
        return Err(format!(
            "content differs first at offset {first} (read {} bytes, model {} bytes)",
            data.len(),
            expected.len()
        ));
    }
    let omap = store
        .omap_all(&name)
        .await
        .map_err(|e| format!("omap: {e}"))?;
    let expected: Vec<(Vec<u8>, Vec<u8>)> = model
        .omap
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    if omap != expected {
        let show = |pairs: &[(Vec<u8>, Vec<u8>)]| -> Vec<String> {
            pairs
                .iter()
                .map(|(k, v)| format!("{}={}", String::from_utf8_lossy(k), v.len()))
                .collect()
        };
        return Err(format!(
            "omap differs: store {:?}, model {:?}",
            show(&omap),
            show(&expected)
        ));
    }
    Ok(())
}
