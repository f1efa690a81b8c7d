//! What crosses the object store interface: names, operations and their results.

use std::fmt;
use std::time::Duration;

use smallvec::SmallVec;

use crate::StoreError;

/// A snapshot id, allocated by [`crate::ObjectStore::snap_create`]; larger ids are newer.
pub type SnapId = u64;

/// Longest object name accepted (RADOS' default `osd_max_object_name_len` is 2048; image
/// objects are far shorter).
pub const MAX_NAME_LEN: usize = 1024;

/// Largest object size (RADOS' default `osd_max_object_size`).
pub const MAX_OBJECT_SIZE: u64 = 128 << 20;

/// Fails `OutOfRange` unless `[offset, offset + len)` ends within [`MAX_OBJECT_SIZE`]: every
/// backend checks its write steps with this before applying anything.
pub fn check_range(object: &ObjectName, offset: u64, len: u64) -> Result<(), StoreError> {
    if offset
        .checked_add(len)
        .is_none_or(|end| end > MAX_OBJECT_SIZE)
    {
        return Err(StoreError::OutOfRange {
            object: object.to_string(),
            offset,
            len,
            limit: MAX_OBJECT_SIZE,
        });
    }
    Ok(())
}

/// A validated object name: 1..=1024 bytes of printable ASCII.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ObjectName(String);

/// Why `name` cannot start an object name that will be `extra` bytes longer, if it cannot.
fn name_problem(name: &str, extra: usize) -> Option<&'static str> {
    if name.len() + extra == 0 {
        Some("it is empty")
    } else if name.len() + extra > MAX_NAME_LEN {
        Some("it is longer than 1024 bytes")
    } else if !name.bytes().all(|b| b.is_ascii_graphic()) {
        Some("only printable ASCII without spaces is allowed")
    } else {
        None
    }
}

fn invalid_name(name: &str, reason: &'static str) -> StoreError {
    StoreError::InvalidName {
        name: name.escape_debug().to_string(),
        reason,
    }
}

impl ObjectName {
    pub fn new(name: impl Into<String>) -> Result<Self, StoreError> {
        let name = name.into();
        match name_problem(&name, 0) {
            Some(reason) => Err(invalid_name(&name, reason)),
            None => Ok(ObjectName(name)),
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// The names `{prefix}{n:016x}` of a family of numbered objects (an image's data objects),
/// the prefix checked once. Why not [`ObjectName::new`] per name: data objects are named on
/// every IO, and checking each whole name again showed in the profile of 64 KiB writes; the
/// sixteen hex digits need no check.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct NumberedNames(String);

impl NumberedNames {
    const DIGITS: usize = 16;

    /// Fails unless `prefix` and sixteen digits make a valid name.
    pub fn new(prefix: impl Into<String>) -> Result<Self, StoreError> {
        let prefix = prefix.into();
        match name_problem(&prefix, Self::DIGITS) {
            Some(reason) => Err(invalid_name(&format!("{prefix}{:016x}", 0), reason)),
            None => Ok(NumberedNames(prefix)),
        }
    }

    /// Object `n`'s name.
    pub fn name(&self, n: u64) -> ObjectName {
        const HEX: &[u8; 16] = b"0123456789abcdef";
        let mut name = String::with_capacity(self.0.len() + Self::DIGITS);
        name.push_str(&self.0);
        name.extend(
            (0..Self::DIGITS)
                .rev()
                .map(|i| HEX[(n >> (4 * i)) as usize & 15] as char),
        );
        ObjectName(name)
    }

    pub fn prefix(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for ObjectName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for ObjectName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.0)
    }
}

/// RADOS' self-managed snapshot context: the newest snapshot id (`seq`) and the live
/// snapshots, newest first. A write under a context newer than the object's last write first
/// preserves the object's current state for those snapshots (copy-on-write).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SnapContext {
    pub seq: SnapId,
    pub snaps: Vec<SnapId>,
}

impl SnapContext {
    /// What librados accepts (Ceph's `SnapContext::is_valid`): `seq` at most 2^64 - 3 (the
    /// ids above are reserved), and `snaps` strictly newest first, none newer than `seq`, no
    /// 0 before the last. Every backend refuses an operation under any other context.
    pub fn is_valid(&self) -> bool {
        const MAX_SNAP: SnapId = u64::MAX - 2;
        self.seq <= MAX_SNAP
            && self.snaps.first().is_none_or(|&newest| newest <= self.seq)
            && self.snaps.windows(2).all(|w| w[0] != 0 && w[1] < w[0])
    }
}

/// Omap keys and values, packed into one buffer: the pairs a write sets and the pairs a read
/// returns.
///
/// Why not a `Vec` of owned pairs: the `omap` layout sets and reads one pair per sector, and
/// two small allocations per sector (and their frees) were most of what that layout's IO cost
/// the engine beyond the cipher (docs/BENCHMARKS.md). Every backend only reads the pairs it
/// sets (RADOS passes pointers to librados, the local backend binds them to SQL) and copies
/// the pairs it reads out of its own buffers anyway, so one buffer costs nothing there.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct OmapPairs {
    /// Each pair's key, then its value, one pair after another.
    bytes: Vec<u8>,
    /// Where each pair's key ends and its value ends in `bytes`. Inline for one pair: a
    /// write of one value (the usual `omap-packed` write) allocates nothing for it.
    ends: SmallVec<[(usize, usize); 1]>,
}

impl OmapPairs {
    pub fn new() -> Self {
        Self::default()
    }

    /// Room for `pairs` pairs of `bytes` key and value bytes in all, without reallocating.
    pub fn with_capacity(pairs: usize, bytes: usize) -> Self {
        OmapPairs {
            bytes: Vec::with_capacity(bytes),
            ends: SmallVec::with_capacity(pairs),
        }
    }

    pub fn push(&mut self, key: &[u8], value: &[u8]) {
        self.bytes.extend_from_slice(key);
        let key_end = self.bytes.len();
        self.bytes.extend_from_slice(value);
        self.ends.push((key_end, self.bytes.len()));
    }

    /// One pair, from `bytes`: its key, the first `key_len` bytes (all of them if fewer),
    /// then its value. The buffer becomes the pairs' own, so a caller that built the pair in
    /// place copies and allocates nothing more.
    pub fn one(bytes: Vec<u8>, key_len: usize) -> Self {
        let ends = smallvec::smallvec![(key_len.min(bytes.len()), bytes.len())];
        OmapPairs { bytes, ends }
    }

    /// Push a pair whose value is `parts` one after another, without assembling it first.
    pub fn push_parts<'p>(&mut self, key: &[u8], parts: impl IntoIterator<Item = &'p [u8]>) {
        self.bytes.extend_from_slice(key);
        let key_end = self.bytes.len();
        for part in parts {
            self.bytes.extend_from_slice(part);
        }
        self.ends.push((key_end, self.bytes.len()));
    }

    pub fn len(&self) -> usize {
        self.ends.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ends.is_empty()
    }

    pub fn first(&self) -> Option<(&[u8], &[u8])> {
        self.iter().next()
    }

    pub fn last(&self) -> Option<(&[u8], &[u8])> {
        let &(key_end, end) = self.ends.last()?;
        let start = self.ends.len().checked_sub(2).map_or(0, |i| self.ends[i].1);
        Some((&self.bytes[start..key_end], &self.bytes[key_end..end]))
    }

    /// Keep the first `len` pairs.
    pub fn truncate(&mut self, len: usize) {
        if len < self.ends.len() {
            self.ends.truncate(len);
            self.bytes
                .truncate(self.ends.last().map_or(0, |&(_, end)| end));
        }
    }

    /// The pairs as owned keys and values, for callers that keep them apart.
    pub fn to_vec(&self) -> Vec<(Vec<u8>, Vec<u8>)> {
        self.iter().map(|(k, v)| (k.to_vec(), v.to_vec())).collect()
    }

    /// The pairs in the order they were pushed.
    pub fn iter(&self) -> OmapPairsIter<'_> {
        OmapPairsIter {
            bytes: &self.bytes,
            ends: self.ends.iter(),
            start: 0,
        }
    }
}

/// The pairs of an [`OmapPairs`], borrowed.
pub struct OmapPairsIter<'a> {
    bytes: &'a [u8],
    ends: std::slice::Iter<'a, (usize, usize)>,
    /// Where the next pair's key starts.
    start: usize,
}

impl<'a> Iterator for OmapPairsIter<'a> {
    type Item = (&'a [u8], &'a [u8]);

    fn next(&mut self) -> Option<Self::Item> {
        let &(key_end, end) = self.ends.next()?;
        let start = std::mem::replace(&mut self.start, end);
        Some((&self.bytes[start..key_end], &self.bytes[key_end..end]))
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        self.ends.size_hint()
    }
}

impl ExactSizeIterator for OmapPairsIter<'_> {}

impl<'a> IntoIterator for &'a OmapPairs {
    type Item = (&'a [u8], &'a [u8]);
    type IntoIter = OmapPairsIter<'a>;

    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

impl fmt::Debug for OmapPairs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

impl<K: AsRef<[u8]>, V: AsRef<[u8]>> FromIterator<(K, V)> for OmapPairs {
    fn from_iter<I: IntoIterator<Item = (K, V)>>(pairs: I) -> Self {
        let mut out = OmapPairs::new();
        for (k, v) in pairs {
            out.push(k.as_ref(), v.as_ref());
        }
        out
    }
}

impl<K: AsRef<[u8]>, V: AsRef<[u8]>> Extend<(K, V)> for OmapPairs {
    fn extend<I: IntoIterator<Item = (K, V)>>(&mut self, pairs: I) {
        for (k, v) in pairs {
            self.push(k.as_ref(), v.as_ref());
        }
    }
}

impl<K: AsRef<[u8]>, V: AsRef<[u8]>> From<Vec<(K, V)>> for OmapPairs {
    fn from(pairs: Vec<(K, V)>) -> Self {
        pairs.into_iter().collect()
    }
}

/// One step of a write operation. The steps of one [`WriteOp`] apply in order and atomically:
/// all of them or, if any fails, none.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WriteStep {
    /// Fail with `Exists` if the object exists; create it (empty) otherwise.
    CreateExclusive,
    /// Fail with `NotFound` unless the object exists.
    AssertExists,
    /// Fail with `VersionMismatch` unless the object's version is this.
    AssertVersion(u64),
    /// Write bytes at an offset (creates the object; grows it).
    Write { offset: u64, data: Vec<u8> },
    /// Replace the whole content (RADOS `write_full`).
    WriteFull(Vec<u8>),
    /// Make a range a hole again: reads as zeros, costs no space, and sparse reads skip it.
    /// The size stays, except that a range reaching the end may cut the object to the
    /// range's start instead (RADOS turns such a zero into a truncate); reads are the same.
    Zero { offset: u64, len: u64 },
    /// Set the size; bytes past it are dropped.
    Truncate(u64),
    /// Delete the object (with its omap).
    Remove,
    /// Set omap keys (later pairs win over earlier ones with the same key).
    OmapSet(OmapPairs),
    /// Remove omap keys (missing keys are fine).
    OmapRemoveKeys(Vec<Vec<u8>>),
    /// Remove the omap keys in `[start, end)`.
    OmapRemoveRange { start: Vec<u8>, end: Vec<u8> },
    /// Remove every omap key of the object (RADOS `omap_clear`, which costs nothing on an
    /// object whose omap is already empty, where a key range removal still searches it).
    OmapClear,
    /// Put the object back to its state at a snapshot (deleting it if it did not exist then).
    Rollback(SnapId),
}

/// An atomic write operation on one object.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct WriteOp {
    pub steps: Vec<WriteStep>,
    /// The snapshot context the write runs under (`None`: no snapshots to preserve).
    pub snap_context: Option<SnapContext>,
    /// Refuse the operation (not applied) unless the store's
    /// [`ObjectStore::lost_transactions`](crate::ObjectStore::lost_transactions) still has
    /// this value: for an operation built from what earlier acknowledged operations wrote (the
    /// image layer's metadata cache), which are gone if the store lost them meanwhile.
    /// `None`: applied whatever the store lost.
    pub unless_lost_since: Option<u64>,
}

impl WriteOp {
    pub fn new() -> Self {
        Self::default()
    }
    pub fn step(mut self, step: WriteStep) -> Self {
        self.steps.push(step);
        self
    }
    pub fn write(self, offset: u64, data: impl Into<Vec<u8>>) -> Self {
        self.step(WriteStep::Write {
            offset,
            data: data.into(),
        })
    }
    pub fn omap_set(self, pairs: impl Into<OmapPairs>) -> Self {
        self.step(WriteStep::OmapSet(pairs.into()))
    }
    pub fn with_snap_context(mut self, context: SnapContext) -> Self {
        self.snap_context = Some(context);
        self
    }
}

/// What a write operation reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WriteOutcome {
    /// The object's version after the operation (0 if it removed the object).
    pub version: u64,
}

/// One step of a read operation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReadStep {
    /// The written extents within `[offset, offset + len)`, clipped to the object size.
    Read { offset: u64, len: u64 },
    /// Size and version.
    Stat,
    /// The values of these keys, in key order (absent keys are left out).
    OmapGetByKeys(Vec<Vec<u8>>),
    /// Up to `max` pairs with `start <= key < end` (no `end`: to the last key), in key order,
    /// and whether more are in range. A store may return fewer than `max` with `more` (RADOS
    /// lists at most `osd_max_omap_entries_per_request`, 1024 by default, per operation, even
    /// for `max: usize::MAX`): callers that want them all page on from the last key.
    /// Portable callers start ranges at keys without NUL bytes: RADOS (librados' C API)
    /// reaches a NUL-holding start only near its NUL-free prefix (see `ivdisk-rados`).
    OmapGetRange {
        start: Vec<u8>,
        end: Option<Vec<u8>>,
        max: usize,
    },
}

/// A read operation on one object, at the head or at a snapshot. It fails with `NotFound` if
/// the object does not exist (at that snapshot).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ReadOp {
    pub steps: Vec<ReadStep>,
    pub snap: Option<SnapId>,
}

impl ReadOp {
    pub fn new() -> Self {
        Self::default()
    }
    pub fn step(mut self, step: ReadStep) -> Self {
        self.steps.push(step);
        self
    }
    pub fn at_snap(mut self, snap: SnapId) -> Self {
        self.snap = Some(snap);
        self
    }
}

/// A written range: bytes that were written (zeros included), as opposed to a hole.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Extent {
    pub offset: u64,
    pub data: Vec<u8>,
}

/// Size and version of an object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stat {
    pub size: u64,
    pub version: u64,
}

/// The result of one read step, in the order of the steps.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReadResult {
    Extents(Vec<Extent>),
    Stat(Stat),
    Omap {
        pairs: OmapPairs,
        /// More pairs were in range than `max`.
        more: bool,
    },
}

/// A registration made by [`crate::ObjectStore::watch`]: the watcher counts while this value
/// lives and stops counting when it is dropped.
pub struct Watch(Box<dyn WatchRegistration>);

/// A backend's watch registration: it ends the watch when dropped, and says whether the store
/// holds it now.
pub trait WatchRegistration: Send + Sync + 'static {
    /// Whether the store holds the watch now, and since when without a break.
    fn status(&self) -> WatchStatus;
}

/// Whether the store holds a watch, as its watcher can tell. A store drops the watch of a
/// client it has not heard from for its watch timeout (a client cut off from it, or stopped),
/// and then a notify does not reach that watcher: a removal that asks the watchers goes on
/// without it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WatchStatus {
    /// The store holds the watch, without a break since its registration number
    /// `registration` (0: the first; each registration again after a loss counts one up).
    Held { registration: u64 },
    /// The store may have dropped the watch (it was not confirmed within the watch timeout,
    /// or the store said it dropped it) and it is not registered again yet.
    Lost,
    /// The watched object is gone: the watch cannot be registered again.
    ObjectGone,
}

impl Watch {
    /// Wrap a backend's registration, which ends the watch when dropped.
    pub fn new(registration: impl WatchRegistration) -> Watch {
        Watch(Box::new(registration))
    }

    /// Whether the store holds this watch now (see [`WatchStatus`]).
    pub fn status(&self) -> WatchStatus {
        self.0.status()
    }
}

impl std::fmt::Debug for Watch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Watch")
    }
}

/// The answers to [`crate::ObjectStore::notify`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NotifyReplies {
    /// Each watcher that answered: its client (as [`crate::ObjectStore::client_id`] names
    /// clients) and its reply.
    pub replies: Vec<(String, Vec<u8>)>,
    /// The clients of the watchers that did not answer in time (dead, or cut off).
    pub unanswered: Vec<String>,
}

/// An advisory lock holder.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Locker {
    /// The store client that holds it ([`crate::ObjectStore::client_id`]).
    pub client: String,
    pub cookie: String,
    pub description: String,
    /// Time left before the lock expires by itself (`None`: held until unlocked or broken).
    pub expires_in: Option<Duration>,
    /// Where the holder's client is, as [`crate::ObjectStore::fence_client`] takes it (RADOS:
    /// `IP:PORT/NONCE`); `None` where the store has no such thing (local, memory).
    pub address: Option<String>,
}

/// How to take an advisory exclusive lock.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LockRequest {
    pub name: String,
    pub cookie: String,
    pub description: String,
    /// The lock expires this long after it is taken or renewed (`None`: never).
    pub duration: Option<Duration>,
    /// Renew a lock this client holds with this cookie. The lock must still be held: if it
    /// expired or was broken, renewal fails `NotLocked` instead of taking it again (librados'
    /// `LIBRADOS_LOCK_FLAG_MUST_RENEW`), so a holder learns it lost the lock.
    pub renew: bool,
}

#[cfg(test)]
mod tests {

    /// The contexts librados accepts and refuses (Ceph's `SnapContext::is_valid`).
    #[test]
    fn snapshot_contexts_are_valid_as_librados_says() {
        let ctx = |seq, snaps: &[u64]| SnapContext {
            seq,
            snaps: snaps.to_vec(),
        };
        assert!(ctx(0, &[]).is_valid());
        assert!(ctx(5, &[5, 3, 1]).is_valid());
        assert!(ctx(7, &[5]).is_valid());
        assert!(ctx(u64::MAX - 2, &[]).is_valid());
        assert!(!ctx(u64::MAX - 1, &[]).is_valid(), "a reserved id");
        assert!(!ctx(4, &[5]).is_valid(), "newer than seq");
        assert!(!ctx(5, &[3, 5]).is_valid(), "oldest first");
        assert!(!ctx(5, &[3, 3]).is_valid(), "twice");
        assert!(!ctx(5, &[0, 0]).is_valid(), "0 before the last");
    }

    use super::{NumberedNames, ObjectName, OmapPairs, SnapContext, MAX_NAME_LEN};
    use crate::StoreError;

    #[test]
    fn numbered_names_are_the_prefix_and_sixteen_hex_digits() {
        let names = NumberedNames::new("rbd_data.ab12.").unwrap();
        for n in [0, 1, 0xa, 0xff, 0x1234_5678_9abc_def0, u64::MAX] {
            let name = names.name(n);
            assert_eq!(name.as_str(), format!("rbd_data.ab12.{n:016x}"));
            assert_eq!(ObjectName::new(name.as_str()).unwrap(), name);
        }
        // The prefix may be empty (the digits make the name) and as long as leaves room for
        // them; anything a name may not hold is refused once, here.
        assert_eq!(
            NumberedNames::new("").unwrap().name(7).as_str(),
            "0000000000000007"
        );
        let longest = "p".repeat(MAX_NAME_LEN - 16);
        assert_eq!(
            NumberedNames::new(longest.as_str())
                .unwrap()
                .name(0)
                .as_str()
                .len(),
            1024
        );
        for bad in [format!("{longest}p"), "a b.".into(), "x\n.".into()] {
            assert!(
                matches!(
                    NumberedNames::new(bad.as_str()),
                    Err(StoreError::InvalidName { .. })
                ),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn pairs_pushed_in_parts_or_given_whole_read_back() {
        let mut pairs = OmapPairs::new();
        pairs.push_parts(b"k", [&b"ab"[..], b"", b"cde"]);
        pairs.push_parts(b"", std::iter::empty());
        pairs.push(b"z", b"last");
        assert_eq!(
            OmapPairs::one(b"keyvalue".to_vec(), 3).to_vec(),
            [(b"key".to_vec(), b"value".to_vec())]
        );
        assert_eq!(
            OmapPairs::one(b"k".to_vec(), 3).to_vec(),
            [(b"k".to_vec(), vec![])]
        );
        assert_eq!(
            pairs.to_vec(),
            [
                (b"k".to_vec(), b"abcde".to_vec()),
                (vec![], vec![]),
                (b"z".to_vec(), b"last".to_vec())
            ]
        );
    }

    #[test]
    fn omap_pairs_give_back_what_was_pushed_in_order() {
        let given: Vec<(Vec<u8>, Vec<u8>)> = vec![
            (b"k1".to_vec(), b"value".to_vec()),
            (Vec::new(), b"empty key".to_vec()),
            (b"empty value".to_vec(), Vec::new()),
            (b"k1".to_vec(), b"again".to_vec()),
            (vec![0, 255], vec![7; 100]),
        ];
        let pairs = OmapPairs::from(given.clone());
        assert_eq!(pairs.len(), given.len());
        assert_eq!(pairs.iter().len(), given.len());
        let back: Vec<(Vec<u8>, Vec<u8>)> = pairs
            .iter()
            .map(|(k, v)| (k.to_vec(), v.to_vec()))
            .collect();
        assert_eq!(back, given);
        assert_eq!(pairs.to_vec(), given);
        assert_eq!(pairs.first(), Some((&b"k1"[..], &b"value"[..])));
        assert_eq!(pairs.last(), Some((&[0, 255][..], &[7; 100][..])));
        for keep in (0..=given.len() + 1).rev() {
            let mut cut = pairs.clone();
            cut.truncate(keep);
            assert_eq!(cut.to_vec(), given[..keep.min(given.len())], "keep {keep}");
            assert_eq!(
                cut.last().map(|(k, v)| (k.to_vec(), v.to_vec())),
                given[..keep.min(given.len())].last().cloned()
            );
            // Pushing after a cut starts where the kept pairs end.
            cut.extend([(b"new", b"pair")]);
            assert_eq!(cut.last(), Some((&b"new"[..], &b"pair"[..])), "keep {keep}");
        }
        let mut pushed = OmapPairs::with_capacity(given.len(), 1);
        for (k, v) in &given {
            pushed.push(k, v);
        }
        assert_eq!(pushed, pairs);
        assert!(OmapPairs::new().is_empty());
        assert_eq!(OmapPairs::new().iter().next(), None);
        assert_eq!(
            format!("{:?}", OmapPairs::from(vec![(b"a", b"b")])),
            "{[97]: [98]}"
        );
    }
}
