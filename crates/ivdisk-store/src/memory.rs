//! The memory backend, for tests: the same engine as the local backend (so the same
//! semantics), with SQLite in memory and segments in vectors. Nothing survives a drop.

use std::sync::Arc;

use rusqlite::Connection;

use crate::engine::{
    delegate_object_store, random_client_id, Client, Engine, EngineHandle, Lifetime, NoDurability,
    SegmentMark, Segments,
};
use crate::StoreError;

/// Segments held in memory; "punching" zeroes the bytes so a read of freed data would show.
#[derive(Default)]
pub(crate) struct MemorySegments {
    data: Vec<u8>,
    synced: usize,
}

impl Segments for MemorySegments {
    fn append(&mut self, data: &[u8]) -> Result<(u32, u64), StoreError> {
        // Whole blocks start on a block boundary, as in the local backend's segments: a dead
        // range of whole blocks then needs no widening queries before it is freed.
        const BLOCK: usize = 4096;
        if data.len().is_multiple_of(BLOCK) && !self.data.len().is_multiple_of(BLOCK) {
            self.data.resize(self.data.len().next_multiple_of(BLOCK), 0);
        }
        let at = self.data.len() as u64;
        self.data.extend_from_slice(data);
        Ok((0, at))
    }
    fn read(&self, _segment: u32, offset: u64, buf: &mut [u8]) -> Result<(), StoreError> {
        let start = offset as usize;
        buf.copy_from_slice(&self.data[start..start + buf.len()]);
        Ok(())
    }
    fn sync(&mut self) -> Result<(), StoreError> {
        self.synced = self.data.len();
        Ok(())
    }
    fn punch(&mut self, _segment: u32, offset: u64, len: u64) -> Result<(), StoreError> {
        // The engine widens frees to whole 4 KiB blocks, which can reach past the data's end
        // (as `fallocate` on a file allows); clamp to what exists.
        let end = ((offset + len) as usize).min(self.data.len());
        let start = (offset as usize).min(end);
        self.data[start..end].fill(0);
        Ok(())
    }
    fn mark(&self) -> SegmentMark {
        SegmentMark {
            segment: 0,
            offset: self.data.len() as u64,
            reused: 0,
        }
    }
    fn rewind(&mut self, mark: SegmentMark) -> Result<(), StoreError> {
        self.data.truncate(mark.offset as usize);
        self.synced = self.synced.min(self.data.len());
        Ok(())
    }
    fn unsynced(&self) -> u64 {
        (self.data.len() - self.synced) as u64
    }
}

/// An object store in memory. Clone-free sharing: [`MemoryStore::another_client`] gives a
/// second client identity on the same store (for lock tests).
pub struct MemoryStore(Client);

impl MemoryStore {
    pub fn new() -> Result<Self, StoreError> {
        let db = Connection::open_in_memory()?;
        let engine = Engine::new(db, Box::<MemorySegments>::default(), Arc::new(NoDurability))?;
        let (handle, worker): (EngineHandle, _) = EngineHandle::spawn(engine, "ivdisk-mem-store")?;
        Ok(MemoryStore(Client {
            handle,
            id: random_client_id("mem"),
            _life: std::sync::Arc::new(Lifetime::new(worker, Box::new(()))),
        }))
    }

    pub fn another_client(&self) -> Self {
        MemoryStore(self.0.another(random_client_id("mem")))
    }
}

delegate_object_store!(MemoryStore);
