//! Without the `librados` feature: a store type that cannot be opened, so that code using it
//! builds the same way either way.

use std::convert::Infallible;

use ivdisk_store::{
    LockRequest, Locker, ObjectName, ObjectStore, ReadOp, ReadResult, SnapId, StoreError, WriteOp,
    WriteOutcome,
};

use crate::{RadosConfig, RadosError};

/// A RADOS store; in this build (no `librados` feature) none can be opened.
pub struct RadosStore {
    never: Infallible,
}

impl RadosStore {
    pub async fn open(_config: &RadosConfig) -> Result<RadosStore, RadosError> {
        Err(RadosError::NotBuilt)
    }
}

#[async_trait::async_trait]
impl ObjectStore for RadosStore {
    async fn write_op(&self, _: &ObjectName, _: WriteOp) -> Result<WriteOutcome, StoreError> {
        match self.never {}
    }
    async fn read_op(&self, _: &ObjectName, _: ReadOp) -> Result<Vec<ReadResult>, StoreError> {
        match self.never {}
    }
    async fn list(&self, _: &str) -> Result<Vec<ObjectName>, StoreError> {
        match self.never {}
    }
    async fn snap_create(&self) -> Result<SnapId, StoreError> {
        match self.never {}
    }
    async fn snap_remove(&self, _: SnapId) -> Result<(), StoreError> {
        match self.never {}
    }
    async fn lock_exclusive(&self, _: &ObjectName, _: LockRequest) -> Result<(), StoreError> {
        match self.never {}
    }
    async fn unlock(&self, _: &ObjectName, _: &str, _: &str) -> Result<(), StoreError> {
        match self.never {}
    }
    async fn list_lockers(&self, _: &ObjectName, _: &str) -> Result<Vec<Locker>, StoreError> {
        match self.never {}
    }
    async fn break_lock(
        &self,
        _: &ObjectName,
        _: &str,
        _: &str,
        _: &str,
    ) -> Result<(), StoreError> {
        match self.never {}
    }
    async fn flush(&self) -> Result<(), StoreError> {
        match self.never {}
    }
    fn client_id(&self) -> &str {
        match self.never {}
    }
}
