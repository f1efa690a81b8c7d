//! Object stores for ivdisk: objects with byte extents and an ordered key/value map (omap),
//! where one operation on one object applies all its writes and key/value changes atomically
//! (the RADOS property the design of docs/ARCHITECTURE.md rests on), plus self-managed
//! snapshots and advisory locks.
//!
//! One trait, [`ObjectStore`] (the minimal surface every backend implements), conveniences in
//! [`ObjectStoreExt`], one conformance suite (`conformance` feature) every backend runs.
//! Backends: [`MemoryStore`] (tests), [`LocalStore`] (the embedded default: one directory),
//! RADOS (its own crate feature, later).

#![deny(unsafe_code)]

mod coalesce;
mod engine;
mod error;
mod ext;
#[cfg(feature = "fault-io")]
pub mod fault_io;
#[cfg(not(feature = "fault-io"))]
mod fault_io;
mod ffi_heap;
mod ffi_range_lock;
#[cfg(feature = "fault-io")]
pub mod ffi_vfs;
mod ffi_writeback;
mod file_ranges;
mod free_space;
mod fs_space;
mod held_extents;
mod local;
mod memory;
mod omap_overlay;
mod partial_index;
pub mod process_flock;
pub mod reader_marks;
#[cfg(test)]
mod test_rng;
mod types;
mod wal_check;

#[cfg(feature = "conformance")]
pub mod conformance;
#[cfg(feature = "conformance")]
pub mod small_fs;

pub use coalesce::CoalescingStore;
pub use error::StoreError;
pub use ext::ObjectStoreExt;
pub use file_ranges::{all_zero, data_runs, file_data_ranges};
pub use local::{DiskUsage, LocalStore, LocalStoreOptions, RecoveryReport, LOCAL_STORE_FILES};
pub use memory::MemoryStore;
pub use types::*;

/// An object store. Many operations may be in flight at once (the methods take `&self`);
/// operations on one object apply in the order they were submitted, where an operation counts
/// as submitted when its future is first polled (a backend queues it during that poll).
///
/// Snapshots follow RADOS' self-managed model: a write carrying a [`SnapContext`] newer than
/// the object's last one preserves the object's state for those snapshots first; a write
/// without a context preserves nothing, so a read at a snapshot with no preserved state returns
/// the object as it is now. Objects that exist only in snapshots are not listed at the head.
#[async_trait::async_trait]
pub trait ObjectStore: Send + Sync {
    /// Apply a write operation to one object, atomically.
    async fn write_op(&self, object: &ObjectName, op: WriteOp) -> Result<WriteOutcome, StoreError>;

    /// Run a read operation on one object; one result per step.
    async fn read_op(&self, object: &ObjectName, op: ReadOp)
        -> Result<Vec<ReadResult>, StoreError>;

    /// The names of the existing objects that start with `prefix`, sorted.
    async fn list(&self, prefix: &str) -> Result<Vec<ObjectName>, StoreError>;

    /// The names of the objects that start with `prefix` and existed at snapshot `snap` (those
    /// a read at `snap` finds, removed ones included), sorted; `NoSuchSnapshot` for a snapshot
    /// that does not exist where the store can tell. A store that cannot list at a snapshot
    /// keeps this default, which refuses with `InvalidOperation`: callers then read at the
    /// snapshot object by object.
    async fn list_at(&self, prefix: &str, snap: SnapId) -> Result<Vec<ObjectName>, StoreError> {
        Err(StoreError::InvalidOperation {
            object: prefix.to_owned(),
            reason: format!("this store cannot list objects at a snapshot ({snap})"),
        })
    }

    /// Allocate a new snapshot id (newer than every earlier one).
    async fn snap_create(&self) -> Result<SnapId, StoreError>;

    /// Forget a snapshot: its preserved object states are freed.
    async fn snap_remove(&self, snap: SnapId) -> Result<(), StoreError>;

    /// Take (or, with `renew`, extend) an advisory exclusive lock on an object.
    async fn lock_exclusive(
        &self,
        object: &ObjectName,
        request: LockRequest,
    ) -> Result<(), StoreError>;

    /// Release a lock this client holds with `cookie`.
    async fn unlock(&self, object: &ObjectName, lock: &str, cookie: &str)
        -> Result<(), StoreError>;

    /// The current holders of a lock (expired ones are not listed).
    async fn list_lockers(
        &self,
        object: &ObjectName,
        lock: &str,
    ) -> Result<Vec<Locker>, StoreError>;

    /// Remove another client's lock (after deciding that client is gone).
    async fn break_lock(
        &self,
        object: &ObjectName,
        lock: &str,
        client: &str,
        cookie: &str,
    ) -> Result<(), StoreError>;

    /// Cut `client`, at `address` (a [`Locker::address`]), off from the store, so that nothing
    /// it sends from now on is applied, and only then return. Called before a lock is broken
    /// or taken over from a holder that may still run (hung, cut off by the network), it
    /// keeps that holder from writing beside the next one. `Ok(true)`: cut off. `Ok(false)`:
    /// this store needs no fencing (the local store's lock holders are processes on this
    /// machine, which it tells apart itself) and keeps this default. `CannotFence` when the
    /// store refuses.
    async fn fence_client(&self, _client: &str, _address: &str) -> Result<bool, StoreError> {
        Ok(false)
    }

    /// Make every operation completed before this call durable.
    async fn flush(&self) -> Result<(), StoreError>;

    /// Register this client as a watcher of `object` (which must exist) that answers every
    /// [`ObjectStore::notify`] on it with `reply`, until the returned [`Watch`] is dropped; a
    /// watcher whose client dies stops counting after the store's watch timeout. `None`: this
    /// store keeps no watchers, so a notify finds none (the local and memory backends keep
    /// this default: within one machine, `reader_marks` does the job watches do on RADOS).
    async fn watch(
        &self,
        _object: &ObjectName,
        _reply: Vec<u8>,
    ) -> Result<Option<Watch>, StoreError> {
        Ok(None)
    }

    /// Ask every watcher of `object` for its reply, waiting up to `timeout` for the slow.
    async fn notify(
        &self,
        _object: &ObjectName,
        _timeout: std::time::Duration,
    ) -> Result<NotifyReplies, StoreError> {
        Ok(NotifyReplies::default())
    }

    /// This client's identity, as lock holders are named.
    fn client_id(&self) -> &str;

    /// Whether read steps tell holes from written zeros. A backend that cannot (RADOS through
    /// librados' C API, which has no sparse read) returns every byte up to the object's size
    /// as written data, holes as zeros: callers that care whether a range was ever written
    /// (the image layer) must not rely on holes there.
    fn distinguishes_holes(&self) -> bool {
        true
    }

    /// The unit of the store's own block writes: a write that is not whole, aligned blocks
    /// of this size costs the store more than one that is (BlueStore, 4 KiB: a
    /// read-modify-write; the local and memory backends, 512 bytes: a split of the piece it
    /// lands in, which they keep in their index, where a whole piece is rewritten in place).
    /// Callers that know the rest of a block (the image layer's metadata cache) send whole
    /// blocks, one write step each, instead of a few bytes. 1: writes of any size and place
    /// cost the same.
    fn write_unit(&self) -> u64 {
        1
    }

    /// Whether concurrent write operations on one object may be applied as one operation
    /// ([`CoalescingStore`]), so that they report the same version. `false`: every
    /// operation gets a version of its own.
    fn merges_operations(&self) -> bool {
        false
    }

    /// How many times this store has lost operations it had acknowledged, while open (the
    /// local and memory backends: a group commit that failed, on a full disk say, takes every
    /// operation since the commit before with it; the next flush reports it). Callers that
    /// build operations from what earlier ones wrote put the count into
    /// [`WriteOp::unless_lost_since`] and drop what they remember when it changes. `None`: the
    /// store never loses an acknowledged operation while it runs (RADOS).
    fn lost_transactions(&self) -> Option<u64> {
        None
    }
}

/// Implements [`ObjectStore`] for a wrapper around another store held in a field `inner`: the
/// wrapper's own methods go in the braces (at least `write_op` and `read_op`), and every other
/// required method is passed to `inner` unchanged, so each wrapper spells out only what it
/// changes. Generic wrappers put their parameters first: `impl[S: ObjectStore] Wrapper<S> {
/// ... }`; a store in another field names it after the type: `impl[] Newtype, 0 { ... }`.
/// The provided methods (`distinguishes_holes`, `write_unit`, `merges_operations`)
/// keep their defaults unless the braces define them; `lost_transactions`, `list_at`, `watch`,
/// `notify` and `fence_client` are passed on.
// `async_trait` rewrites the methods it sees before inner macros expand, so the macro emits the
// whole impl (the wrapper's own methods first, then the forwarded ones) under the attribute.
#[macro_export]
macro_rules! object_store_forwarding_to_inner {
    ($store:ty { $($own:tt)* }) => {
        $crate::object_store_forwarding_to_inner!(impl[] $store, inner { $($own)* });
    };
    (impl[$($generics:tt)*] $store:ty { $($own:tt)* }) => {
        $crate::object_store_forwarding_to_inner!(impl[$($generics)*] $store, inner { $($own)* });
    };
    // The store is in field `$inner` (a name, or 0 for a newtype).
    (impl[$($generics:tt)*] $store:ty, $inner:tt { $($own:tt)* }) => {
        #[$crate::__private::async_trait]
        impl<$($generics)*> $crate::ObjectStore for $store {
        $($own)*
        async fn list(
            &self,
            prefix: &str,
        ) -> Result<Vec<$crate::ObjectName>, $crate::StoreError> {
            self.$inner.list(prefix).await
        }
        async fn list_at(
            &self,
            prefix: &str,
            snap: $crate::SnapId,
        ) -> Result<Vec<$crate::ObjectName>, $crate::StoreError> {
            self.$inner.list_at(prefix, snap).await
        }
        async fn snap_create(&self) -> Result<$crate::SnapId, $crate::StoreError> {
            self.$inner.snap_create().await
        }
        async fn snap_remove(&self, snap: $crate::SnapId) -> Result<(), $crate::StoreError> {
            self.$inner.snap_remove(snap).await
        }
        async fn lock_exclusive(
            &self,
            object: &$crate::ObjectName,
            request: $crate::LockRequest,
        ) -> Result<(), $crate::StoreError> {
            self.$inner.lock_exclusive(object, request).await
        }
        async fn unlock(
            &self,
            object: &$crate::ObjectName,
            lock: &str,
            cookie: &str,
        ) -> Result<(), $crate::StoreError> {
            self.$inner.unlock(object, lock, cookie).await
        }
        async fn list_lockers(
            &self,
            object: &$crate::ObjectName,
            lock: &str,
        ) -> Result<Vec<$crate::Locker>, $crate::StoreError> {
            self.$inner.list_lockers(object, lock).await
        }
        async fn break_lock(
            &self,
            object: &$crate::ObjectName,
            lock: &str,
            client: &str,
            cookie: &str,
        ) -> Result<(), $crate::StoreError> {
            self.$inner.break_lock(object, lock, client, cookie).await
        }
        async fn fence_client(
            &self,
            client: &str,
            address: &str,
        ) -> Result<bool, $crate::StoreError> {
            self.$inner.fence_client(client, address).await
        }
        async fn flush(&self) -> Result<(), $crate::StoreError> {
            self.$inner.flush().await
        }
        async fn watch(
            &self,
            object: &$crate::ObjectName,
            reply: Vec<u8>,
        ) -> Result<Option<$crate::Watch>, $crate::StoreError> {
            self.$inner.watch(object, reply).await
        }
        async fn notify(
            &self,
            object: &$crate::ObjectName,
            timeout: std::time::Duration,
        ) -> Result<$crate::NotifyReplies, $crate::StoreError> {
            self.$inner.notify(object, timeout).await
        }
        fn client_id(&self) -> &str {
            self.$inner.client_id()
        }
        fn lost_transactions(&self) -> Option<u64> {
            self.$inner.lost_transactions()
        }
        }
    };
}

/// What [`object_store_forwarding_to_inner!`] needs from this crate's dependencies.
#[doc(hidden)]
pub mod __private {
    pub use async_trait::async_trait;
}
