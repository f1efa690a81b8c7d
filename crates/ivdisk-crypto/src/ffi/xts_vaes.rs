//! XTS-AES (IEEE 1619) with VAES and VPCLMULQDQ on AVX-512: four blocks per instruction, sixteen
//! in flight, the tweak given per call.
//!
//! Why: OpenSSL 3.0's XTS runs 128-bit AES-NI and keeps the tweak inside its context, so a disk
//! pays an `EVP_CipherInit_ex` provider round trip per sector (about 8% of a 4 KiB sector). On
//! CPUs with VAES the AES units take four blocks per instruction. The suites use this when the
//! CPU has the features and OpenSSL otherwise; tests hold both to the IEEE 1619 vectors and to
//! each other.
//!
//! Tweak masks: lane i of a register holds T * x^i; the next register is the previous one
//! times x^4, computed per 128-bit lane as a 4-bit shift, the carry between the two 64-bit halves,
//! and the 4 bits that fall off reduced by a carry-less multiply with 0x87.

use core::arch::x86_64::*;

use super::simd::{load128, load512, store128, store512};
use crate::io::Io;

use zeroize::Zeroize;

/// Whether this module runs here: the CPU has the features it needs, and the environment does
/// not set `IVDISK_CRYPTO_NO_VAES` (which tests and benchmarks use to run the OpenSSL fallback
/// on a machine that has VAES). Checked when a key is set up, not per sector.
pub(crate) fn available() -> bool {
    static FORCED_OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let forced_off =
        *FORCED_OFF.get_or_init(|| std::env::var_os("IVDISK_CRYPTO_NO_VAES").is_some());
    !forced_off
        && std::arch::is_x86_feature_detected!("aes")
        && std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512bw")
        && std::arch::is_x86_feature_detected!("vaes")
        && std::arch::is_x86_feature_detected!("vpclmulqdq")
}

/// Round keys of one AES key, 11 (AES-128) or 15 (AES-256) used.
#[derive(Clone)]
struct RoundKeys {
    keys: [[u8; 16]; 15],
    rounds: usize,
}

impl Drop for RoundKeys {
    fn drop(&mut self) {
        self.keys.zeroize();
    }
}

/// An XTS key expanded for VAES: the data key both ways and the tweak key.
pub(crate) struct XtsVaes {
    encrypt: RoundKeys,
    decrypt: RoundKeys,
    tweak: RoundKeys,
}

impl XtsVaes {
    /// Expand a 32- or 64-byte XTS key (K1 || K2). `None` if the CPU lacks the features.
    pub(crate) fn new(key: &[u8]) -> Option<XtsVaes> {
        if !available() {
            return None;
        }
        let (k1, k2) = key.split_at(key.len() / 2);
        // SAFETY: the CPU has AES-NI (checked by `available` above), the feature `expand` needs.
        let (encrypt, decrypt, tweak) = unsafe { (expand(k1), expand_decrypt(k1), expand(k2)) };
        Some(XtsVaes {
            encrypt,
            decrypt,
            tweak,
        })
    }

    /// En- or decrypt `data` (a whole number of 16-byte blocks, in place or out of place) as
    /// one data unit whose tweak value (before encryption with K2) is `tweak`.
    pub(crate) fn crypt(&self, tweak: &[u8; 16], data: Io<'_>, encrypt: bool) {
        assert!(
            data.len().is_multiple_of(16),
            "XTS data units here are whole blocks"
        );
        let keys = if encrypt {
            &self.encrypt
        } else {
            &self.decrypt
        };
        // SAFETY: an `XtsVaes` exists only if `available()` held when it was built, and CPU
        // features do not disappear; `crypt_unit` needs exactly those features.
        unsafe { crypt_unit(keys, &self.tweak, tweak, data, encrypt) }
    }
}

/// One AES key expanded for AES-NI, encrypting single blocks: the map from `aes-xts-random`'s
/// stored value R to its tweak, kept here so that R -> tweak -> XTS stays in one piece of code.
pub(crate) struct AesBlockCipher(RoundKeys);

impl AesBlockCipher {
    /// Expand a 16- or 32-byte AES key. `None` if the CPU lacks the features of this module.
    pub(crate) fn new(key: &[u8]) -> Option<AesBlockCipher> {
        if !available() {
            return None;
        }
        // SAFETY: the CPU has AES-NI (checked by `available` above).
        Some(AesBlockCipher(unsafe { expand(key) }))
    }

    /// Encrypt one 16-byte block in place.
    pub(crate) fn encrypt_block(&self, block: &mut [u8; 16]) {
        // SAFETY: an `AesBlockCipher` exists only on a CPU with AES-NI (checked in `new`).
        unsafe { encrypt_block(&self.0, block) }
    }
}

#[target_feature(enable = "aes")]
fn encrypt_block(keys: &RoundKeys, block: &mut [u8; 16]) {
    let mut b = _mm_xor_si128(load128(block), load128(&keys.keys[0]));
    for k in &keys.keys[1..keys.rounds] {
        b = _mm_aesenc_si128(b, load128(k));
    }
    b = _mm_aesenclast_si128(b, load128(&keys.keys[keys.rounds]));
    store128(block, b);
}

/// One step of the AES key schedule (FIPS 197 5.2) on four words at once: `prev` xor its
/// shifted copies, xor the broadcast word of `assist`.
#[inline]
#[target_feature(enable = "aes")]
fn schedule_step(prev: __m128i, assist: __m128i) -> __m128i {
    let mut k = prev;
    k = _mm_xor_si128(k, _mm_slli_si128::<4>(k));
    k = _mm_xor_si128(k, _mm_slli_si128::<4>(k));
    k = _mm_xor_si128(k, _mm_slli_si128::<4>(k));
    _mm_xor_si128(k, assist)
}

macro_rules! assist {
    ($k:expr, $rcon:literal, $shuffle:literal) => {
        _mm_shuffle_epi32::<$shuffle>(_mm_aeskeygenassist_si128::<$rcon>($k))
    };
}

#[target_feature(enable = "aes")]
fn expand(key: &[u8]) -> RoundKeys {
    let mut rk = [_mm_setzero_si128(); 15];
    let rounds = match key.len() {
        16 => {
            rk[0] = load128(key);
            rk[1] = schedule_step(rk[0], assist!(rk[0], 0x01, 0xff));
            rk[2] = schedule_step(rk[1], assist!(rk[1], 0x02, 0xff));
            rk[3] = schedule_step(rk[2], assist!(rk[2], 0x04, 0xff));
            rk[4] = schedule_step(rk[3], assist!(rk[3], 0x08, 0xff));
            rk[5] = schedule_step(rk[4], assist!(rk[4], 0x10, 0xff));
            rk[6] = schedule_step(rk[5], assist!(rk[5], 0x20, 0xff));
            rk[7] = schedule_step(rk[6], assist!(rk[6], 0x40, 0xff));
            rk[8] = schedule_step(rk[7], assist!(rk[7], 0x80, 0xff));
            rk[9] = schedule_step(rk[8], assist!(rk[8], 0x1b, 0xff));
            rk[10] = schedule_step(rk[9], assist!(rk[9], 0x36, 0xff));
            10
        }
        32 => {
            rk[0] = load128(&key[..16]);
            rk[1] = load128(&key[16..]);
            // Even round keys take RotWord+SubWord+rcon of the previous odd key's last word
            // (shuffle 0xff); odd ones take SubWord alone of the previous even key (0xaa).
            rk[2] = schedule_step(rk[0], assist!(rk[1], 0x01, 0xff));
            rk[3] = schedule_step(rk[1], assist!(rk[2], 0x00, 0xaa));
            rk[4] = schedule_step(rk[2], assist!(rk[3], 0x02, 0xff));
            rk[5] = schedule_step(rk[3], assist!(rk[4], 0x00, 0xaa));
            rk[6] = schedule_step(rk[4], assist!(rk[5], 0x04, 0xff));
            rk[7] = schedule_step(rk[5], assist!(rk[6], 0x00, 0xaa));
            rk[8] = schedule_step(rk[6], assist!(rk[7], 0x08, 0xff));
            rk[9] = schedule_step(rk[7], assist!(rk[8], 0x00, 0xaa));
            rk[10] = schedule_step(rk[8], assist!(rk[9], 0x10, 0xff));
            rk[11] = schedule_step(rk[9], assist!(rk[10], 0x00, 0xaa));
            rk[12] = schedule_step(rk[10], assist!(rk[11], 0x20, 0xff));
            rk[13] = schedule_step(rk[11], assist!(rk[12], 0x00, 0xaa));
            rk[14] = schedule_step(rk[12], assist!(rk[13], 0x40, 0xff));
            14
        }
        n => unreachable!("AES key of {n} bytes was not checked"),
    };
    let mut keys = [[0u8; 16]; 15];
    for (k, r) in keys.iter_mut().zip(&rk) {
        store128(k, *r);
    }
    RoundKeys { keys, rounds }
}

/// Round keys for the equivalent inverse cipher (FIPS 197 5.3.5): reversed, with InvMixColumns
/// applied to all but the first and last.
#[target_feature(enable = "aes")]
fn expand_decrypt(key: &[u8]) -> RoundKeys {
    let enc = expand(key);
    let n = enc.rounds;
    let mut dec = enc.clone();
    for i in 0..=n {
        let k = load128(&enc.keys[n - i]);
        let k = if i == 0 || i == n {
            k
        } else {
            _mm_aesimc_si128(k)
        };
        store128(&mut dec.keys[i], k);
    }
    dec
}

/// Multiply each 128-bit lane (a GF(2^128) element, little endian) by x^4.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,vpclmulqdq")]
fn mul_x4(t: __m512i, poly: __m512i) -> __m512i {
    let top = _mm512_srli_epi64::<60>(t);
    let carry = _mm512_bslli_epi128::<8>(top);
    let overflow = _mm512_bsrli_epi128::<8>(top);
    let reduced = _mm512_clmulepi64_epi128::<0x00>(overflow, poly);
    _mm512_xor_si512(_mm512_xor_si512(_mm512_slli_epi64::<4>(t), carry), reduced)
}

/// Multiply a GF(2^128) element (little endian) by x.
fn mul_x(t: u128) -> u128 {
    (t << 1) ^ ((t >> 127) * 0x87)
}

#[inline]
#[target_feature(enable = "avx512f,vaes")]
fn aes4(blocks: &mut [__m512i; 4], rk: &[__m512i; 15], rounds: usize, encrypt: bool) {
    for b in blocks.iter_mut() {
        *b = _mm512_xor_si512(*b, rk[0]);
    }
    if encrypt {
        for k in &rk[1..rounds] {
            for b in blocks.iter_mut() {
                *b = _mm512_aesenc_epi128(*b, *k);
            }
        }
        for b in blocks.iter_mut() {
            *b = _mm512_aesenclast_epi128(*b, rk[rounds]);
        }
    } else {
        for k in &rk[1..rounds] {
            for b in blocks.iter_mut() {
                *b = _mm512_aesdec_epi128(*b, *k);
            }
        }
        for b in blocks.iter_mut() {
            *b = _mm512_aesdeclast_epi128(*b, rk[rounds]);
        }
    }
}

#[target_feature(enable = "aes,avx512f,avx512bw,vaes,vpclmulqdq")]
fn crypt_unit(
    keys: &RoundKeys,
    tweak_keys: &RoundKeys,
    tweak: &[u8; 16],
    mut data: Io<'_>,
    encrypt: bool,
) {
    // T = AES(K2, tweak), with 128-bit AES-NI.
    let mut t_bytes = *tweak;
    encrypt_block(tweak_keys, &mut t_bytes);
    let t0 = u128::from_le_bytes(t_bytes);
    let (t1, t2) = (mul_x(t0), mul_x(mul_x(t0)));
    let t3 = mul_x(t2);
    let mut lanes = [0u8; 64];
    for (lane, v) in lanes.chunks_exact_mut(16).zip([t0, t1, t2, t3]) {
        lane.copy_from_slice(&v.to_le_bytes());
    }
    let mut tw = load512(&lanes);
    lanes.zeroize();
    t_bytes.zeroize();
    let poly = _mm512_set_epi64(0, 0x87, 0, 0x87, 0, 0x87, 0, 0x87);

    let mut rk = [_mm512_setzero_si512(); 15];
    for (r, k) in rk.iter_mut().zip(&keys.keys).take(keys.rounds + 1) {
        *r = _mm512_broadcast_i32x4(load128(k));
    }

    let len = data.len();
    let whole = len - len % 256;
    for at in (0..whole).step_by(256) {
        let m1 = mul_x4(tw, poly);
        let m2 = mul_x4(m1, poly);
        let masks = [tw, m1, m2, mul_x4(m2, poly)];
        let mut x = [_mm512_setzero_si512(); 4];
        for i in 0..4 {
            x[i] = _mm512_xor_si512(load512(&data.src()[at + i * 64..]), masks[i]);
        }
        aes4(&mut x, &rk, keys.rounds, encrypt);
        for i in 0..4 {
            store512(
                &mut data.dst()[at + i * 64..],
                _mm512_xor_si512(x[i], masks[i]),
            );
        }
        tw = mul_x4(masks[3], poly);
    }
    // The rest (data units of 32 or 48 bytes in the IEEE vectors, never for disk sectors):
    // one block at a time with 128-bit AES-NI.
    let mut lanes = [0u8; 64];
    store512(&mut lanes, tw);
    let mut m = u128::from_le_bytes(lanes[..16].try_into().expect("16 bytes"));
    for at in (whole..len).step_by(16) {
        let mask = load128(&m.to_le_bytes());
        let mut b = _mm_xor_si128(load128(&data.src()[at..]), mask);
        b = _mm_xor_si128(b, load128(&keys.keys[0]));
        for k in &keys.keys[1..keys.rounds] {
            b = if encrypt {
                _mm_aesenc_si128(b, load128(k))
            } else {
                _mm_aesdec_si128(b, load128(k))
            };
        }
        let last = load128(&keys.keys[keys.rounds]);
        b = if encrypt {
            _mm_aesenclast_si128(b, last)
        } else {
            _mm_aesdeclast_si128(b, last)
        };
        store128(&mut data.dst()[at..], _mm_xor_si128(b, mask));
        m = mul_x(m);
    }
    lanes.zeroize();
    m.zeroize();
    // Wipe the broadcast round keys from the stack; black_box keeps the stores from being
    // optimised away as dead.
    rk = [_mm512_setzero_si512(); 15];
    std::hint::black_box(&mut rk);
}
