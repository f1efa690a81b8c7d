//! AEGIS-128L (draft-irtf-cfrg-aegis-aead) for four messages at once with VAES: lane i of each
//! 512-bit state register is message i's 128-bit state word.
//!
//! Why: one AEGIS-128L message is a chain of dependent AES rounds; on the CPUs measured here
//! that chain, not the AES units, sets the pace (about 10 GB/s per core with libaegis). Four
//! independent messages in the lanes of one VAES instruction keep the units busy: a run of
//! sectors is four messages at a time. Same algorithm, same output as libaegis; the suite uses
//! this for groups of four sectors of equal length and libaegis for the rest; tests hold the two
//! to each other and to the draft's vectors.

use core::arch::x86_64::*;

use super::simd::{load128, load512, store512};
use crate::io::Io;

/// Messages per call.
pub(crate) const LANES: usize = 4;

const C0: [u8; 16] = [
    0x00, 0x01, 0x01, 0x02, 0x03, 0x05, 0x08, 0x0d, 0x15, 0x22, 0x37, 0x59, 0x90, 0xe9, 0x79, 0x62,
];
const C1: [u8; 16] = [
    0xdb, 0x3d, 0x18, 0x55, 0x6d, 0xc2, 0x2f, 0xf1, 0x20, 0x11, 0x31, 0x42, 0x73, 0xb5, 0x28, 0xdd,
];

/// Whether this CPU runs the four-lane code (same features as the VAES XTS, same override).
pub(crate) fn available() -> bool {
    super::xts_vaes::available()
}

/// Run four messages of equal length (a multiple of 64 bytes) through AEGIS-128L (in place or
/// out of place, per message) under one key, with their own nonces and associated data of 32 bytes or less. Encrypting returns
/// the four tags; decrypting returns each tag as computed from the recovered plaintext, for the
/// caller to compare with the stored one (and to zero the messages that do not match). `None`
/// when the CPU lacks the features or the shapes do not fit: the caller then goes one message at
/// a time.
pub(crate) fn crypt4(
    key: &[u8; 16],
    nonces: [&[u8; 16]; LANES],
    aads: [&[u8]; LANES],
    data: &mut [Io<'_>; LANES],
    encrypt: bool,
) -> Option<[[u8; 16]; LANES]> {
    if !available() || !fits(&aads, data) {
        return None;
    }
    // SAFETY: the CPU has AVX-512F/BW, VAES and AES-NI (`available` above), the features of
    // `crypt4_vaes`; the shapes it relies on were checked by `fits`.
    Some(unsafe { crypt4_vaes(key, nonces, aads, data, encrypt) })
}

fn fits(aads: &[&[u8]; LANES], data: &[Io<'_>; LANES]) -> bool {
    let len = data[0].len();
    let aad_len = aads[0].len();
    len.is_multiple_of(64)
        && data.iter().all(|d| d.len() == len)
        && aad_len <= 32
        && aads.iter().all(|a| a.len() == aad_len)
}

/// Four 16-byte values into the four lanes of a register.
#[inline]
#[target_feature(enable = "avx512f,aes")]
fn lanes(v: [&[u8]; LANES]) -> __m512i {
    let mut buf = [0u8; 64];
    for (lane, b) in buf.chunks_exact_mut(16).zip(v) {
        lane.copy_from_slice(&b[..16]);
    }
    load512(&buf)
}

/// Transpose a 4x4 matrix of 128-bit blocks: row i = four consecutive blocks of message i in,
/// row j = block j of the four messages out (and back: the transpose is its own inverse).
#[inline]
#[target_feature(enable = "avx512f")]
fn transpose(r: [__m512i; 4]) -> [__m512i; 4] {
    let t0 = _mm512_shuffle_i64x2::<0x44>(r[0], r[1]);
    let t1 = _mm512_shuffle_i64x2::<0xee>(r[0], r[1]);
    let t2 = _mm512_shuffle_i64x2::<0x44>(r[2], r[3]);
    let t3 = _mm512_shuffle_i64x2::<0xee>(r[2], r[3]);
    [
        _mm512_shuffle_i64x2::<0x88>(t0, t2),
        _mm512_shuffle_i64x2::<0xdd>(t0, t2),
        _mm512_shuffle_i64x2::<0x88>(t1, t3),
        _mm512_shuffle_i64x2::<0xdd>(t1, t3),
    ]
}

struct State([__m512i; 8]);

impl State {
    #[inline]
    #[target_feature(enable = "avx512f,vaes")]
    fn update(&mut self, m0: __m512i, m1: __m512i) {
        let s = &mut self.0;
        let t = s[7];
        s[7] = _mm512_aesenc_epi128(s[6], s[7]);
        s[6] = _mm512_aesenc_epi128(s[5], s[6]);
        s[5] = _mm512_aesenc_epi128(s[4], s[5]);
        s[4] = _mm512_xor_si512(_mm512_aesenc_epi128(s[3], s[4]), m1);
        s[3] = _mm512_aesenc_epi128(s[2], s[3]);
        s[2] = _mm512_aesenc_epi128(s[1], s[2]);
        s[1] = _mm512_aesenc_epi128(s[0], s[1]);
        s[0] = _mm512_xor_si512(_mm512_aesenc_epi128(t, s[0]), m0);
    }

    /// Keystream words z0, z1 of the next 32-byte block of each message.
    #[inline]
    #[target_feature(enable = "avx512f,vaes")]
    fn keystream(&self) -> (__m512i, __m512i) {
        let s = &self.0;
        let z0 = _mm512_xor_si512(_mm512_xor_si512(s[6], s[1]), _mm512_and_si512(s[2], s[3]));
        let z1 = _mm512_xor_si512(_mm512_xor_si512(s[2], s[5]), _mm512_and_si512(s[6], s[7]));
        (z0, z1)
    }
}

#[target_feature(enable = "aes,avx512f,avx512bw,vaes")]
fn crypt4_vaes(
    key: &[u8; 16],
    nonces: [&[u8; 16]; LANES],
    aads: [&[u8]; LANES],
    data: &mut [Io<'_>; LANES],
    encrypt: bool,
) -> [[u8; 16]; LANES] {
    let k = _mm512_broadcast_i32x4(load128(key));
    let n = lanes(nonces.map(|n| &n[..]));
    let c0 = _mm512_broadcast_i32x4(load128(&C0));
    let c1 = _mm512_broadcast_i32x4(load128(&C1));
    let kn = _mm512_xor_si512(k, n);
    let kc0 = _mm512_xor_si512(k, c0);
    let kc1 = _mm512_xor_si512(k, c1);
    let mut st = State([kn, c1, c0, c1, kn, kc0, kc1, kc0]);
    for _ in 0..10 {
        st.update(n, k);
    }

    // Associated data: at most one 32-byte block, zero padded.
    let aad_len = aads[0].len();
    if aad_len > 0 {
        let mut padded = [[0u8; 32]; LANES];
        for (p, a) in padded.iter_mut().zip(aads) {
            p[..a.len()].copy_from_slice(a);
        }
        let m0 = lanes(padded.each_ref().map(|p| &p[..16]));
        let m1 = lanes(padded.each_ref().map(|p| &p[16..]));
        st.update(m0, m1);
    }

    let len = data[0].len();
    let [d0, d1, d2, d3] = data;
    for off in (0..len).step_by(64) {
        let rows = [
            load512(&d0.src()[off..]),
            load512(&d1.src()[off..]),
            load512(&d2.src()[off..]),
            load512(&d3.src()[off..]),
        ];
        let x = transpose(rows);
        let mut out = [_mm512_setzero_si512(); 4];
        for step in 0..2 {
            let (z0, z1) = st.keystream();
            let (a, b) = (x[2 * step], x[2 * step + 1]);
            let (o0, o1) = (_mm512_xor_si512(a, z0), _mm512_xor_si512(b, z1));
            out[2 * step] = o0;
            out[2 * step + 1] = o1;
            // The state absorbs the plaintext: the input when encrypting, the output when not.
            if encrypt {
                st.update(a, b);
            } else {
                st.update(o0, o1);
            }
        }
        let rows = transpose(out);
        store512(&mut d0.dst()[off..], rows[0]);
        store512(&mut d1.dst()[off..], rows[1]);
        store512(&mut d2.dst()[off..], rows[2]);
        store512(&mut d3.dst()[off..], rows[3]);
    }

    let mut lens = [0u8; 16];
    lens[..8].copy_from_slice(&((aad_len as u64) * 8).to_le_bytes());
    lens[8..].copy_from_slice(&((len as u64) * 8).to_le_bytes());
    let t = _mm512_xor_si512(st.0[2], _mm512_broadcast_i32x4(load128(&lens)));
    for _ in 0..7 {
        st.update(t, t);
    }
    let s = &st.0;
    let tag = _mm512_xor_si512(
        _mm512_xor_si512(_mm512_xor_si512(s[0], s[1]), _mm512_xor_si512(s[2], s[3])),
        _mm512_xor_si512(_mm512_xor_si512(s[4], s[5]), s[6]),
    );
    let mut bytes = [0u8; 64];
    store512(&mut bytes, tag);
    let mut tags = [[0u8; 16]; LANES];
    for (t, b) in tags.iter_mut().zip(bytes.chunks_exact(16)) {
        t.copy_from_slice(b);
    }
    tags
}
