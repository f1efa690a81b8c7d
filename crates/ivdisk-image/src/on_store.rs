//! Images in a store the caller opened: any [`ObjectStore`] implementation, not only those an
//! [`crate::ImageUri`] names (benchmarks and tests run the engine on stores of their own).

use std::sync::Arc;

use ivdisk_store::ObjectStore;

use crate::{CreateOptions, Image, ImageError, OpenOptions};

impl Image {
    /// [`Image::create`] in `store`: the image `name` (its header object is
    /// [`crate::header_object_name`]`(name)`), opened for writing. Messages call it `name`.
    pub async fn create_on(
        store: Arc<dyn ObjectStore>,
        name: &str,
        options: &CreateOptions,
        passphrase: &[u8],
    ) -> Result<Image, ImageError> {
        Image::create_with(name.to_owned(), name, options, passphrase, None, || async {
            Ok(store)
        })
        .await
    }

    /// [`Image::open`] of the image `name` in `store`.
    pub async fn open_on(
        store: Arc<dyn ObjectStore>,
        name: &str,
        passphrase: &[u8],
        options: &OpenOptions,
    ) -> Result<Image, ImageError> {
        Image::open_in(name.to_owned(), store, name, passphrase, options).await
    }
}
