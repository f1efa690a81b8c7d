//! AEGIS-128L (draft-irtf-cfrg-aegis-aead) for four messages at once with VAES: lane i of each
//! 512-bit state register is message i's 128-bit state word. Where the CPU has VAES but no
//! AVX-512 (AMD Zen 3, or Zen 4 behind a hypervisor that hides AVX-512) the four go as two pairs
//! through 256-bit registers, lane i of each holding message i of the pair.
//!
//! Why: one AEGIS-128L message is a chain of dependent AES rounds; on the CPUs measured here
//! that chain, not the AES units, sets the pace (about 10 GB/s per core with libaegis). Four
//! independent messages in the lanes of one VAES instruction keep the units busy: a run of
//! sectors is four messages at a time. Same algorithm, same output as libaegis; the suite uses
//! this for groups of four sectors of equal length and libaegis for the rest; tests hold the two
//! to each other and to the draft's vectors.

use core::arch::x86_64::*;

use super::simd::{load128, load256, load512, store256, store512};
use super::xts_vaes::{width, Width};
use crate::io::Io;

/// Messages per call.
pub(crate) const LANES: usize = 4;

/// AEGIS-128L's constants (also used by `aegis128l_one`).
pub(super) const C0: [u8; 16] = [
    0x00, 0x01, 0x01, 0x02, 0x03, 0x05, 0x08, 0x0d, 0x15, 0x22, 0x37, 0x59, 0x90, 0xe9, 0x79, 0x62,
];
pub(super) const C1: [u8; 16] = [
    0xdb, 0x3d, 0x18, 0x55, 0x6d, 0xc2, 0x2f, 0xf1, 0x20, 0x11, 0x31, 0x42, 0x73, 0xb5, 0x28, 0xdd,
];

/// Whether this CPU runs the four-lane code: where the VAES XTS runs (same features at either
/// width, same overrides).
pub(crate) fn available() -> bool {
    width().is_some()
}

/// Run four messages of equal length (a multiple of 64 bytes) through AEGIS-128L (in place or
/// out of place, per message) under one key, with their own nonces and associated data of 32
/// bytes or less. Encrypting returns the four tags; decrypting returns each tag as computed
/// from the recovered plaintext, for the caller to compare with the stored one (and to zero the
/// messages that do not match). `None` when the CPU lacks the features or the shapes do not
/// fit: the caller then goes one message at a time.
pub(crate) fn crypt4(
    key: &[u8; 16],
    nonces: [&[u8; 16]; LANES],
    aads: [&[u8]; LANES],
    data: &mut [Io<'_>; LANES],
    encrypt: bool,
) -> Option<[[u8; 16]; LANES]> {
    if !fits(&aads, data) {
        return None;
    }
    match width()? {
        // SAFETY: width Zmm means the CPU has AVX-512F/BW, VAES and AES-NI, the features of
        // `crypt4_vaes`; the shapes it relies on were checked by `fits`.
        Width::Zmm => {
            Some(unsafe { crypt4_zmm(key, nonces, aads, data, encrypt, joined_stores()) })
        }
        // SAFETY: width Ymm means the CPU has AVX2, VAES and AES-NI, the features of
        // `crypt4_ymm`; the shapes it relies on were checked by `fits`.
        Width::Ymm => Some(unsafe { crypt4_ymm(key, nonces, aads, data, encrypt) }),
    }
}

/// The four messages as two pairs through `crypt2_ymm`, each pair in the variant for where
/// its outputs start: out of place, when both start 16 bytes past a 32-byte boundary (slots
/// of a buffer from glibc's `malloc`, which starts 16 bytes into a line), the one whose
/// stores cross no line.
///
/// # Safety
/// The CPU must have AVX2, VAES and AES-NI.
#[target_feature(enable = "aes,avx2,vaes")]
unsafe fn crypt4_ymm(
    key: &[u8; 16],
    nonces: [&[u8; 16]; LANES],
    aads: [&[u8]; LANES],
    data: &mut [Io<'_>; LANES],
    encrypt: bool,
) -> [[u8; 16]; LANES] {
    let [n0, n1, n2, n3] = nonces;
    let [a0, a1, a2, a3] = aads;
    let [d0, d1, d2, d3] = data;
    let pair = |nonces, aads, mut data: [&mut Io<'_>; 2]| {
        let joined = data.iter_mut().all(|d| {
            let (s, t) = d.as_ptrs();
            s != t.cast_const() && t as usize % 32 == 16
        });
        if joined {
            crypt2_ymm::<true>(key, nonces, aads, data, encrypt)
        } else {
            crypt2_ymm::<false>(key, nonces, aads, data, encrypt)
        }
    };
    let t01 = pair([n0, n1], [a0, a1], [d0, d1]);
    let t23 = pair([n2, n3], [a2, a3], [d2, d3]);
    [t01[0], t01[1], t23[0], t23[1]]
}

/// Whether the 512-bit kernel stores out-of-place outputs that start inside a cache line in
/// whole lines (`crypt4_vaes::<true>`): on Intel CPUs; `IVDISK_CRYPTO_JOINED_STORES=1` or `=0`
/// decides instead (benchmarks). Decided once per process.
///
/// Why by vendor: measured on the two CPUs this project runs on, the joining pays on one and
/// costs on the other (docs/BENCHMARKS.md, "joined stores only on Intel"). On an Intel Xeon,
/// 64 KiB into `unaligned` slots took 3.5-4.0 us joined against 5.3-5.7 us with stores across
/// two lines; on an AMD EPYC (Zen 4) it took 3.2-3.3 us joined against 2.7-2.8 us, and a 1 MiB
/// decryption into a buffer 16 bytes into a line 51-55 us against 43-44 us.
pub(crate) fn joined_stores() -> bool {
    static JOINED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *JOINED.get_or_init(
        || match std::env::var("IVDISK_CRYPTO_JOINED_STORES").as_deref() {
            Ok("1") => true,
            Ok("0") => false,
            _ => super::xts_vaes::cpu_vendor_is_intel(),
        },
    )
}

/// `crypt4_vaes` in the variant for where the outputs start: out of place, when one starts
/// inside a cache line (every other slot of an `unaligned` run, 4096 + 32 bytes each, does)
/// and `prefer_joined` ([`joined_stores`]), the one whose stores cross no line.
///
/// # Safety
/// The CPU must have AVX-512F/BW, VAES and AES-NI.
#[target_feature(enable = "aes,avx512f,avx512bw,vaes")]
unsafe fn crypt4_zmm(
    key: &[u8; 16],
    nonces: [&[u8; 16]; LANES],
    aads: [&[u8]; LANES],
    data: &mut [Io<'_>; LANES],
    encrypt: bool,
    prefer_joined: bool,
) -> [[u8; 16]; LANES] {
    let ptrs = data.each_mut().map(|d| d.as_ptrs());
    let starts = ptrs.map(|(_, t)| t as usize % 64);
    // In place, the lines a row is stored into were just loaded, and a store across two of them
    // costs less than the joining (1 MiB in place 16 bytes into a line: 51-54 us joined, 43-46
    // us not). Joined rows move whole 8-byte words: outputs at odd places keep the plain
    // stores too.
    let in_place = ptrs.iter().all(|&(s, t)| s == t.cast_const());
    if !prefer_joined
        || in_place
        || starts.iter().all(|&s| s == 0)
        || starts.iter().any(|s| !s.is_multiple_of(8))
    {
        crypt4_vaes::<false>(key, nonces, aads, data, encrypt)
    } else {
        crypt4_vaes::<true>(key, nonces, aads, data, encrypt)
    }
}

/// How one output's rows go out in whole cache lines ([`crypt4_vaes`] with `JOINED`): line
/// `i` of the output holds the end of row `i - 1` and the start of row `i`.
#[derive(Clone, Copy)]
struct JoinedRows {
    /// Bytes from the output's start back to the line it starts in (a multiple of 8).
    back: usize,
    /// Picks, from the previous row (words 0-7) and this one (8-15), the line's words.
    join: __m512i,
    /// The words of the first line that are the output's (its last ones).
    first: __mmask8,
    /// The words of the line after the last row that are the output's (its first ones).
    last: __mmask8,
}

impl JoinedRows {
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn new(output: *mut u8) -> JoinedRows {
        let back = output as usize % 64;
        let words = (back / 8) as i64;
        // Line word j is word `8 - words + j` of the two rows side by side.
        let join = _mm512_setr_epi64(
            8 - words,
            9 - words,
            10 - words,
            11 - words,
            12 - words,
            13 - words,
            14 - words,
            15 - words,
        );
        JoinedRows {
            back,
            join,
            first: 0xffu8 << words,
            last: !(0xffu8 << words),
        }
    }
}

fn fits(aads: &[&[u8]; LANES], data: &[Io<'_>; LANES]) -> bool {
    let len = data[0].len();
    let aad_len = aads[0].len();
    len > 0
        && len.is_multiple_of(64)
        && data.iter().all(|d| d.len() == len)
        && aad_len <= 32
        && aads.iter().all(|a| a.len() == aad_len)
}

/// Each message's associated data (at most 32 bytes, checked by `fits`) as one zero-padded
/// block.
fn padded<const N: usize>(aads: [&[u8]; N]) -> [[u8; 32]; N] {
    let mut blocks = [[0u8; 32]; N];
    for (block, aad) in blocks.iter_mut().zip(aads) {
        block[..aad.len()].copy_from_slice(aad);
    }
    blocks
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

/// The AEGIS-128L state of several messages in registers of one width, lane i of each word
/// message i's: `$name([$reg; 8])` with the draft's Update and the keystream of the next block.
macro_rules! lane_state {
    ($name:ident, $reg:ty, $features:literal, $aesenc:ident, $xor:ident, $and:ident) => {
        struct $name([$reg; 8]);

        impl $name {
            /// Update(M0, M1): S'i = AESRound(S(i-1), Si), then M0 into S0 and M1 into S4.
            #[inline]
            #[target_feature(enable = $features)]
            fn update(&mut self, m0: $reg, m1: $reg) {
                let s = &mut self.0;
                let t = s[7];
                s[7] = $aesenc(s[6], s[7]);
                s[6] = $aesenc(s[5], s[6]);
                s[5] = $aesenc(s[4], s[5]);
                s[4] = $xor($aesenc(s[3], s[4]), m1);
                s[3] = $aesenc(s[2], s[3]);
                s[2] = $aesenc(s[1], s[2]);
                s[1] = $aesenc(s[0], s[1]);
                s[0] = $xor($aesenc(t, s[0]), m0);
            }

            /// Initialize(key, nonce) of the draft, given the key, the nonces and the constants
            /// C0 and C1 in every lane.
            #[inline]
            #[target_feature(enable = $features)]
            fn init(k: $reg, n: $reg, c0: $reg, c1: $reg) -> $name {
                let kn = $xor(k, n);
                let kc0 = $xor(k, c0);
                let kc1 = $xor(k, c1);
                let mut st = $name([kn, c1, c0, c1, kn, kc0, kc1, kc0]);
                for _ in 0..10 {
                    st.update(n, k);
                }
                st
            }

            /// Finalize of the draft, given each lane's (ad_len_bits, msg_len_bits): the
            /// 128-bit tags, lane i message i's.
            #[inline]
            #[target_feature(enable = $features)]
            fn finalize(mut self, lens: $reg) -> $reg {
                let t = $xor(self.0[2], lens);
                for _ in 0..7 {
                    self.update(t, t);
                }
                let s = &self.0;
                $xor(
                    $xor($xor(s[0], s[1]), $xor(s[2], s[3])),
                    $xor($xor(s[4], s[5]), s[6]),
                )
            }

            /// Keystream words z0, z1 of the next 32-byte block of each message.
            #[inline]
            #[target_feature(enable = $features)]
            fn keystream(&self) -> ($reg, $reg) {
                let s = &self.0;
                let z0 = $xor($xor(s[6], s[1]), $and(s[2], s[3]));
                let z1 = $xor($xor(s[2], s[5]), $and(s[6], s[7]));
                (z0, z1)
            }
        }
    };
}

lane_state!(
    State,
    __m512i,
    "avx512f,vaes",
    _mm512_aesenc_epi128,
    _mm512_xor_si512,
    _mm512_and_si512
);
lane_state!(
    State2,
    __m256i,
    "avx2,vaes",
    _mm256_aesenc_epi128,
    _mm256_xor_si256,
    _mm256_and_si256
);

/// `JOINED`: every output's rows go out in whole cache lines ([`JoinedRows`]), each line the
/// end of one row and the start of the next, joined in a register. A 512-bit store that
/// crosses a line costs about as much as two, and with every other output 32 bytes into a line
/// a 64 KiB run into slots took 4.6-7.3 us against 2.9-4.0 us into one aligned buffer
/// (docs/BENCHMARKS.md, "`unaligned` writes: four-lane stores that cross no cache line").
#[target_feature(enable = "aes,avx512f,avx512bw,vaes")]
fn crypt4_vaes<const JOINED: bool>(
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
    let mut st = State::init(k, n, c0, c1);

    // Associated data: at most one 32-byte block, zero padded.
    let aad_len = aads[0].len();
    if aad_len > 0 {
        let padded = padded(aads);
        let m0 = lanes(padded.each_ref().map(|p| &p[..16]));
        let m1 = lanes(padded.each_ref().map(|p| &p[16..]));
        st.update(m0, m1);
    }

    let len = data[0].len();
    // What the loads and stores below rely on (`crypt4` checked it; this is a safe function).
    assert!(len >= 64 && len.is_multiple_of(64) && data.iter().all(|d| d.len() == len));
    // Raw pointers, as in `crypt2_ymm`: a fresh output (`Io::fresh`) is written, never read.
    let [(s0, t0), (s1, t1), (s2, t2), (s3, t3)] = data.each_mut().map(|d| d.as_ptrs());
    let outputs = [t0, t1, t2, t3];
    let joined = outputs.map(|t| JoinedRows::new(t));
    // The last row of each output, whose end is not stored yet (`JOINED`).
    let mut carry = [_mm512_setzero_si512(); LANES];
    // Row i: 64 bytes of message i at `off`.
    // SAFETY (of each use): `off + 64 <= len`, the length of every message's input; unaligned.
    let load = |off: usize| unsafe {
        [
            _mm512_loadu_si512(s0.add(off).cast()),
            _mm512_loadu_si512(s1.add(off).cast()),
            _mm512_loadu_si512(s2.add(off).cast()),
            _mm512_loadu_si512(s3.add(off).cast()),
        ]
    };
    let mut rows = load(0);
    for off in (0..len).step_by(64) {
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
        // The next block's loads before this block's stores: through raw pointers the compiler
        // may not move a load above a store (in place they could alias, as far as it knows;
        // they do not: the next block starts where this one ends), and the four-lane loop ran
        // 4% slower than on slices while the chain of AES rounds waited for the loads.
        if off + 64 < len {
            rows = load(off + 64);
        }
        let outs = transpose(out);
        for lane in 0..LANES {
            let at = outputs[lane].wrapping_add(off);
            let j = &joined[lane];
            // SAFETY (of each store): each message's output holds `len` bytes and `off + 64
            // <= len`. A joined store covers the line from `back` bytes before row `off` to
            // `back` bytes before its end: inside the output once `off > 0`, and the first
            // line's store writes only the output's words. Unaligned stores (joined ones are
            // aligned). In place, this block's loads came before, and the next block's.
            unsafe {
                if !JOINED {
                    _mm512_storeu_si512(at.cast(), outs[lane]);
                } else if off == 0 {
                    // The first line: this row's start, at the output's start.
                    let line = at.wrapping_sub(j.back);
                    let words = _mm512_permutex2var_epi64(carry[lane], j.join, outs[lane]);
                    _mm512_mask_storeu_epi64(line.cast(), j.first, words);
                } else {
                    let line = at.wrapping_sub(j.back);
                    let words = _mm512_permutex2var_epi64(carry[lane], j.join, outs[lane]);
                    _mm512_storeu_si512(line.cast(), words);
                }
            }
            carry[lane] = outs[lane];
        }
    }
    if JOINED {
        for lane in 0..LANES {
            let j = &joined[lane];
            // The line after the last row: that row's end.
            let line = outputs[lane].wrapping_add(len).wrapping_sub(j.back);
            let words = _mm512_permutex2var_epi64(carry[lane], j.join, _mm512_setzero_si512());
            // SAFETY: only the words inside the output, whose last `j.back` bytes these are.
            unsafe { _mm512_mask_storeu_epi64(line.cast(), j.last, words) };
        }
    }

    let mut lens = [0u8; 16];
    lens[..8].copy_from_slice(&((aad_len as u64) * 8).to_le_bytes());
    lens[8..].copy_from_slice(&((len as u64) * 8).to_le_bytes());
    let tag = st.finalize(_mm512_broadcast_i32x4(load128(&lens)));
    let mut bytes = [0u8; 64];
    store512(&mut bytes, tag);
    let mut tags = [[0u8; 16]; LANES];
    for (t, b) in tags.iter_mut().zip(bytes.chunks_exact(16)) {
        t.copy_from_slice(b);
    }
    tags
}

/// Two 16-byte values into the two lanes of a 256-bit register.
#[inline]
#[target_feature(enable = "avx2")]
fn lanes2(v: [&[u8]; 2]) -> __m256i {
    let mut buf = [0u8; 32];
    buf[..16].copy_from_slice(&v[0][..16]);
    buf[16..].copy_from_slice(&v[1][..16]);
    load256(&buf)
}

/// Two messages of equal length (a multiple of 64 bytes) with associated data of 32 bytes or
/// less, as `crypt4_vaes` does four.
///
/// `JOINED` (both outputs 16 bytes past a 32-byte boundary, out of place): each 32-byte store
/// is the end of the previous row and the start of this one, joined in a register, so no store
/// crosses a cache line; the first row's start and the last row's end go out as 16-byte
/// stores. Forced onto this kernel on an AVX-512 machine, 64 KiB into slots 16 bytes past a
/// line took 4.3-4.6 us with plain stores, 4.0 us joined, 3.9 us from a line's start (docs/
/// BENCHMARKS.md, "The 256-bit AEGIS-128L kernel's stores cross no line either").
#[target_feature(enable = "aes,avx2,vaes")]
fn crypt2_ymm<const JOINED: bool>(
    key: &[u8; 16],
    nonces: [&[u8; 16]; 2],
    aads: [&[u8]; 2],
    data: [&mut Io<'_>; 2],
    encrypt: bool,
) -> [[u8; 16]; 2] {
    let k = _mm256_broadcastsi128_si256(load128(key));
    let n = lanes2(nonces.map(|n| &n[..]));
    let c0 = _mm256_broadcastsi128_si256(load128(&C0));
    let c1 = _mm256_broadcastsi128_si256(load128(&C1));
    let mut st = State2::init(k, n, c0, c1);

    let aad_len = aads[0].len();
    if aad_len > 0 {
        let padded = padded(aads);
        let m0 = lanes2(padded.each_ref().map(|p| &p[..16]));
        let m1 = lanes2(padded.each_ref().map(|p| &p[16..]));
        st.update(m0, m1);
    }

    let len = data[0].len();
    // What the loads and stores below rely on (`crypt4` checked it; this is a safe function).
    assert!(len.is_multiple_of(64) && data[1].len() == len);
    let [(s0, t0), (s1, t1)] = data.map(|d| d.as_ptrs());
    // Each output's last row, whose end is not stored yet (`JOINED`).
    let mut carry = [_mm256_setzero_si256(); 2];
    // 32 bytes of each message per iteration: with 64 the compiler ran out of the 16 YMM
    // registers and spilled a state word onto the chain (`perf annotate`).
    for off in (0..len).step_by(32) {
        // Row i: the block pair of message i; columns: the words both messages absorb together.
        // SAFETY: both messages' input holds `len` bytes, a multiple of 64 (asserted above), so
        // `off + 32 <= len`; unaligned loads.
        let (r0, r1) = unsafe {
            (
                _mm256_loadu_si256(s0.add(off).cast()),
                _mm256_loadu_si256(s1.add(off).cast()),
            )
        };
        let a = _mm256_permute2x128_si256::<0x20>(r0, r1);
        let b = _mm256_permute2x128_si256::<0x31>(r0, r1);
        let (z0, z1) = st.keystream();
        let (o0, o1) = (_mm256_xor_si256(a, z0), _mm256_xor_si256(b, z1));
        // The state absorbs the plaintext: the input when encrypting, the output when not.
        if encrypt {
            st.update(a, b);
        } else {
            st.update(o0, o1);
        }
        let rows = [
            _mm256_permute2x128_si256::<0x20>(o0, o1),
            _mm256_permute2x128_si256::<0x31>(o0, o1),
        ];
        for (lane, t) in [t0, t1].into_iter().enumerate() {
            // SAFETY (of each store): both messages' output holds `len` bytes and `off + 32 <=
            // len`. A joined store covers the 32 bytes from 16 before row `off`, inside the
            // output once `off > 0`; the first row's start is 16 bytes at the output's start.
            // Unaligned stores. In place (never joined), this iteration's loads came before.
            unsafe {
                if !JOINED {
                    _mm256_storeu_si256(t.add(off).cast(), rows[lane]);
                } else if off == 0 {
                    _mm_storeu_si128(t.cast(), _mm256_castsi256_si128(rows[lane]));
                } else {
                    let line = _mm256_permute2x128_si256::<0x21>(carry[lane], rows[lane]);
                    _mm256_storeu_si256(t.add(off - 16).cast(), line);
                }
            }
            carry[lane] = rows[lane];
        }
    }
    if JOINED {
        for (lane, t) in [t0, t1].into_iter().enumerate() {
            // SAFETY: the last 16 bytes of an output of `len` bytes.
            unsafe {
                _mm_storeu_si128(
                    t.add(len - 16).cast(),
                    _mm256_extracti128_si256::<1>(carry[lane]),
                )
            };
        }
    }

    let mut lens = [0u8; 16];
    lens[..8].copy_from_slice(&((aad_len as u64) * 8).to_le_bytes());
    lens[8..].copy_from_slice(&((len as u64) * 8).to_le_bytes());
    let tag = st.finalize(_mm256_broadcastsi128_si256(load128(&lens)));
    let mut bytes = [0u8; 32];
    store256(&mut bytes, tag);
    [
        bytes[..16].try_into().expect("16 bytes"),
        bytes[16..].try_into().expect("16 bytes"),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use aegis::aegis128l::Aegis128L;

    /// The four-lane code (run directly, whatever the environment says) gives libaegis's
    /// ciphertext, plaintext and tags with each output at any place in a cache line, each
    /// lane's own (every alignment the dispatch picks a variant for, and others), in place
    /// and out of place, and writes nothing outside the outputs.
    #[test]
    fn four_lanes_store_outputs_at_any_alignment() {
        if super::super::xts_vaes::cpu_has_zmm() {
            // Both store variants, whichever this CPU's vendor gets.
            for joined in [true, false] {
                // SAFETY: the CPU has AVX-512F/BW, VAES and AES-NI (checked).
                outputs_at_any_alignment(|k, n, a, d, e| unsafe {
                    crypt4_zmm(k, n, a, d, e, joined)
                });
            }
        } else {
            eprintln!("512-bit kernel skipped: the CPU lacks AVX-512/VAES");
        }
        if super::super::xts_vaes::cpu_has_ymm() {
            // SAFETY: the CPU has AVX2, VAES and AES-NI (checked).
            outputs_at_any_alignment(|k, n, a, d, e| unsafe { crypt4_ymm(k, n, a, d, e) });
        } else {
            eprintln!("256-bit kernel skipped: the CPU lacks VAES");
        }
    }

    /// The four lanes through `kernel`, each output at each offset of `offsets_of_lanes`.
    fn outputs_at_any_alignment(
        kernel: impl Fn(
            &[u8; 16],
            [&[u8; 16]; LANES],
            [&[u8]; LANES],
            &mut [Io<'_>; LANES],
            bool,
        ) -> [[u8; 16]; LANES],
    ) {
        const GUARD: u8 = 0xa5;
        let mut bytes = super::super::test_bytes(0x4a11);
        let key: [u8; 16] = bytes(16).try_into().unwrap();
        let nonces: [[u8; 16]; LANES] = std::array::from_fn(|_| bytes(16).try_into().unwrap());
        let aads: [Vec<u8>; LANES] = std::array::from_fn(|_| bytes(24));
        // Slots from a buffer at each place a 16-byte aligned allocation can start, one
        // contiguous output 8 bytes into a line, a mix, and an output at an odd address.
        let offsets_of_lanes = [
            [0, 0, 0, 0],
            [0, 32, 0, 32],
            [32, 0, 32, 0],
            [16, 48, 16, 48],
            [48, 16, 48, 16],
            [8, 8, 8, 8],
            [56, 0, 24, 40],
            [0, 33, 0, 32],
        ];
        for len in [64usize, 128, 512, 4096] {
            let plain: [Vec<u8>; LANES] = std::array::from_fn(|_| bytes(len));
            let expected: [(Vec<u8>, [u8; 16]); LANES] = std::array::from_fn(|i| {
                let mut c = plain[i].clone();
                let tag = Aegis128L::<16>::new(&key, &nonces[i]).encrypt_in_place(&mut c, &aads[i]);
                (c, tag)
            });
            for offsets in offsets_of_lanes {
                for (encrypt, in_place) in
                    [(true, false), (true, true), (false, false), (false, true)]
                {
                    let case = format!(
                        "len {len}, offsets {offsets:?}, encrypt {encrypt}, in place {in_place}"
                    );
                    let (input, output) = if encrypt {
                        (plain.clone(), expected.clone().map(|e| e.0))
                    } else {
                        (expected.clone().map(|e| e.0), plain.clone())
                    };
                    // Each output at its offset past a 64-byte boundary, guards around it.
                    let mut buffers: [Vec<u8>; LANES] =
                        std::array::from_fn(|_| vec![GUARD; len + 256]);
                    let starts: [usize; LANES] = std::array::from_fn(|i| {
                        let at = buffers[i].as_ptr() as usize;
                        (64 - at % 64) % 64 + 64 + offsets[i]
                    });
                    let mut ios = Vec::new();
                    for ((buffer, &start), input) in buffers.iter_mut().zip(&starts).zip(&input) {
                        let out = &mut buffer[start..start + len];
                        if in_place {
                            out.copy_from_slice(input);
                            ios.push(Io::in_place(out));
                        } else {
                            ios.push(Io::copy(input, out));
                        }
                    }
                    let mut ios: [Io<'_>; LANES] = ios.try_into().ok().unwrap();
                    let aad_refs = aads.each_ref().map(|a| &a[..]);
                    // Equal lengths, a multiple of 64; associated data of 24 bytes.
                    let tags = kernel(&key, nonces.each_ref(), aad_refs, &mut ios, encrypt);
                    for i in 0..LANES {
                        let (buffer, start) = (&buffers[i], starts[i]);
                        assert_eq!(
                            &buffer[start..start + len],
                            &output[i][..],
                            "{case}: lane {i}"
                        );
                        assert_eq!(tags[i], expected[i].1, "{case}: tag {i}");
                        assert!(
                            buffer[..start]
                                .iter()
                                .chain(&buffer[start + len..])
                                .all(|&b| b == GUARD),
                            "{case}: lane {i} wrote outside its output"
                        );
                    }
                }
            }
        }
    }

    /// The two-lane code (run directly, whatever the environment says) gives libaegis's
    /// ciphertext and tags both ways, in place and out of place, with and without associated
    /// data, at the lengths of disk sectors.
    #[test]
    fn two_lanes_equal_libaegis() {
        if !super::super::xts_vaes::cpu_has_ymm() {
            eprintln!("skipped: the CPU lacks AVX2/VAES");
            return;
        }
        let mut bytes = super::super::test_bytes(0xae615);
        for (len, aad_len) in [
            (64usize, 0usize),
            (512, 24),
            (4096, 24),
            (4096, 32),
            (128, 7),
        ] {
            let key: [u8; 16] = bytes(16).try_into().unwrap();
            let nonces: [[u8; 16]; 2] = std::array::from_fn(|_| bytes(16).try_into().unwrap());
            let aads: [Vec<u8>; 2] = std::array::from_fn(|_| bytes(aad_len));
            let plain: [Vec<u8>; 2] = std::array::from_fn(|_| bytes(len));
            let expected: [(Vec<u8>, [u8; 16]); 2] = std::array::from_fn(|i| {
                let mut c = plain[i].clone();
                let tag = Aegis128L::<16>::new(&key, &nonces[i]).encrypt_in_place(&mut c, &aads[i]);
                (c, tag)
            });

            let [mut p0, mut p1] = plain.clone();
            let (mut io0, mut io1) = (Io::in_place(&mut p0), Io::in_place(&mut p1));
            // SAFETY: the features of `crypt2_ymm` are checked first; equal lengths, a multiple
            // of 32, associated data of at most 32 bytes.
            let tags = unsafe {
                crypt2_ymm::<false>(
                    &key,
                    [&nonces[0], &nonces[1]],
                    [&aads[0], &aads[1]],
                    [&mut io0, &mut io1],
                    true,
                )
            };
            for (i, got) in [&p0, &p1].into_iter().enumerate() {
                assert_eq!(got, &expected[i].0, "len {len}: ciphertext {i}");
                assert_eq!(tags[i], expected[i].1, "len {len}: tag {i}");
            }

            let (mut o0, mut o1) = (vec![0u8; len], vec![0u8; len]);
            let (mut io0, mut io1) = (
                Io::copy(&expected[0].0, &mut o0),
                Io::copy(&expected[1].0, &mut o1),
            );
            // SAFETY: as above.
            let tags = unsafe {
                crypt2_ymm::<false>(
                    &key,
                    [&nonces[0], &nonces[1]],
                    [&aads[0], &aads[1]],
                    [&mut io0, &mut io1],
                    false,
                )
            };
            assert_eq!([o0, o1], plain, "len {len}: decrypted");
            assert_eq!(tags, [expected[0].1, expected[1].1], "len {len}: tags");
        }
    }
}
