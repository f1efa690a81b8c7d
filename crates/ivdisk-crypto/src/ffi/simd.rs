//! Unaligned SIMD loads and stores from byte slices, bounds-checked, for the `core::arch` code
//! of this module.

use core::arch::x86_64::*;

#[inline]
#[target_feature(enable = "sse2")]
pub(super) fn load128(bytes: &[u8]) -> __m128i {
    assert!(bytes.len() >= 16);
    // SAFETY: 16 readable bytes (asserted); unaligned load.
    unsafe { _mm_loadu_si128(bytes.as_ptr().cast()) }
}

#[inline]
#[target_feature(enable = "sse2")]
pub(super) fn store128(bytes: &mut [u8], v: __m128i) {
    assert!(bytes.len() >= 16);
    // SAFETY: 16 writable bytes (asserted); unaligned store.
    unsafe { _mm_storeu_si128(bytes.as_mut_ptr().cast(), v) }
}

#[inline]
#[target_feature(enable = "avx")]
pub(super) fn load256(bytes: &[u8]) -> __m256i {
    assert!(bytes.len() >= 32);
    // SAFETY: 32 readable bytes (asserted); unaligned load.
    unsafe { _mm256_loadu_si256(bytes.as_ptr().cast()) }
}

#[inline]
#[target_feature(enable = "avx")]
pub(super) fn store256(bytes: &mut [u8], v: __m256i) {
    assert!(bytes.len() >= 32);
    // SAFETY: 32 writable bytes (asserted); unaligned store.
    unsafe { _mm256_storeu_si256(bytes.as_mut_ptr().cast(), v) }
}

#[inline]
#[target_feature(enable = "avx512f")]
pub(super) fn load512(bytes: &[u8]) -> __m512i {
    assert!(bytes.len() >= 64);
    // SAFETY: 64 readable bytes (asserted); unaligned load.
    unsafe { _mm512_loadu_si512(bytes.as_ptr().cast()) }
}

#[inline]
#[target_feature(enable = "avx512f")]
pub(super) fn store512(bytes: &mut [u8], v: __m512i) {
    assert!(bytes.len() >= 64);
    // SAFETY: 64 writable bytes (asserted); unaligned store.
    unsafe { _mm512_storeu_si512(bytes.as_mut_ptr().cast(), v) }
}
