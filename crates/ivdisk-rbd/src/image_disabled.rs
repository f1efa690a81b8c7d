//! Without the `librbd` feature: an image type that cannot be opened, so that code using it
//! builds the same way either way.

use std::convert::Infallible;

use ivdisk_rados::RadosConfig;

use crate::{LuksFormat, RbdError, RbdInfo, RbdOpenOptions};

/// An open librbd image; in this build (no `librbd` feature) none can be opened.
#[derive(Debug)]
pub struct RbdImage {
    never: Infallible,
}

impl RbdImage {
    pub async fn open(_: &RadosConfig, _: RbdOpenOptions) -> Result<RbdImage, RbdError> {
        Err(RbdError::NotBuilt)
    }

    pub async fn inspect(_: &RadosConfig, _: &str, _: Option<&str>) -> Result<RbdInfo, RbdError> {
        Err(RbdError::NotBuilt)
    }

    pub fn name(&self) -> &str {
        match self.never {}
    }

    pub fn size(&self) -> u64 {
        match self.never {}
    }

    pub fn encryption(&self) -> Option<LuksFormat> {
        match self.never {}
    }

    pub fn is_read_only(&self) -> bool {
        match self.never {}
    }

    pub async fn read(&self, _: u64, _: &mut [u8]) -> Result<(), RbdError> {
        match self.never {}
    }

    pub async fn write(&self, _: u64, _: &[u8]) -> Result<(), RbdError> {
        match self.never {}
    }

    pub async fn discard(&self, _: u64, _: u64) -> Result<(), RbdError> {
        match self.never {}
    }

    pub async fn write_zeroes(&self, _: u64, _: u64, _: bool) -> Result<(), RbdError> {
        match self.never {}
    }

    pub async fn flush(&self) -> Result<(), RbdError> {
        match self.never {}
    }

    pub async fn close(self) -> Result<(), RbdError> {
        match self.never {}
    }
}
