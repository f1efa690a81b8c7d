//! The LUKS anti-forensic splitter: a key is stored as `stripes` blocks, all of which are
//! needed to recover it, so that destroying any part of a keyslot destroys the key even on
//! media that remap sectors. Defined in the LUKS1 on-disk format specification, section 2.4;
//! LUKS2 keyslots use the same ("af": {"type": "luks1"}).

use openssl::hash::Hasher;
use zeroize::Zeroizing;

use crate::kdf::Hash;
use crate::HeaderError;

/// The stripe count cryptsetup writes and the only one it accepts in LUKS2.
pub const STRIPES: u32 = 4000;

/// XOR `src` into `dst`.
fn xor_into(dst: &mut [u8], src: &[u8]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d ^= s;
    }
}

/// The diffusion function H: each digest-sized chunk j becomes hash(BE32(j) || chunk), the
/// last partial chunk keeps only as many output bytes as it had.
fn diffuse(hash: Hash, block: &mut [u8]) -> Result<(), HeaderError> {
    let chunk_len = hash.output_len();
    for (j, chunk) in block.chunks_mut(chunk_len).enumerate() {
        let mut hasher = Hasher::new(hash.openssl()).map_err(openssl_error)?;
        hasher
            .update(&(j as u32).to_be_bytes())
            .map_err(openssl_error)?;
        hasher.update(chunk).map_err(openssl_error)?;
        let digest = hasher.finish().map_err(openssl_error)?;
        let n = chunk.len();
        chunk.copy_from_slice(&digest[..n]);
    }
    Ok(())
}

fn openssl_error(e: openssl::error::ErrorStack) -> HeaderError {
    HeaderError::Kdf(format!("hash: {e}"))
}

/// Split `key` into `stripes * key.len()` bytes of anti-forensic material.
pub fn split(key: &[u8], stripes: u32, hash: Hash) -> Result<Zeroizing<Vec<u8>>, HeaderError> {
    let n = key.len();
    let stripes = stripes as usize;
    let mut material = Zeroizing::new(vec![0u8; n * stripes]);
    crate::random_bytes(&mut material[..n * (stripes - 1)])?;
    let mut acc = Zeroizing::new(vec![0u8; n]);
    for i in 0..stripes - 1 {
        xor_into(&mut acc, &material[i * n..(i + 1) * n]);
        diffuse(hash, &mut acc)?;
    }
    let last = &mut material[(stripes - 1) * n..];
    last.copy_from_slice(key);
    xor_into(last, &acc);
    Ok(material)
}

/// Recover a `key_len`-byte key from its anti-forensic material.
pub fn merge(
    material: &[u8],
    key_len: usize,
    stripes: u32,
    hash: Hash,
) -> Result<Zeroizing<Vec<u8>>, HeaderError> {
    let stripes = stripes as usize;
    if stripes == 0 || material.len() < key_len * stripes {
        return Err(HeaderError::Metadata(format!(
            "anti-forensic material of {} bytes is too short for {stripes} stripes of {key_len}",
            material.len()
        )));
    }
    let mut acc = Zeroizing::new(vec![0u8; key_len]);
    for i in 0..stripes - 1 {
        xor_into(&mut acc, &material[i * key_len..(i + 1) * key_len]);
        diffuse(hash, &mut acc)?;
    }
    xor_into(
        &mut acc,
        &material[(stripes - 1) * key_len..stripes * key_len],
    );
    Ok(acc)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_then_merge_recovers_the_key() {
        for (len, hash) in [(16, Hash::Sha256), (64, Hash::Sha256), (33, Hash::Sha1)] {
            let key: Vec<u8> = (0..len as u8).collect();
            let material = split(&key, STRIPES, hash).unwrap();
            assert_eq!(material.len(), len * STRIPES as usize);
            assert_eq!(&merge(&material, len, STRIPES, hash).unwrap()[..], &key[..]);
        }
    }

    #[test]
    fn one_damaged_stripe_destroys_the_key() {
        let key = [7u8; 32];
        let mut material = split(&key, STRIPES, Hash::Sha256).unwrap();
        material[100 * 32] ^= 1;
        assert_ne!(
            &merge(&material, 32, STRIPES, Hash::Sha256).unwrap()[..],
            &key[..]
        );
    }

    // The diffusion of a 40-byte block with SHA-1 (20-byte chunks) written out by hand from the
    // specification's definition, so a wrong chunk counter or byte order fails here.
    #[test]
    fn diffuse_matches_the_specification() {
        let mut block: Vec<u8> = (0..40).collect();
        let original = block.clone();
        diffuse(Hash::Sha1, &mut block).unwrap();
        for j in 0..2u32 {
            let mut input = j.to_be_bytes().to_vec();
            input.extend_from_slice(&original[j as usize * 20..(j as usize + 1) * 20]);
            let expected = openssl::sha::sha1(&input);
            assert_eq!(
                &block[j as usize * 20..(j as usize + 1) * 20],
                &expected[..]
            );
        }
    }
}
