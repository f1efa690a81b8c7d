//! XTS-AES (IEEE 1619) with VAES and VPCLMULQDQ: on AVX-512 four blocks per instruction, on
//! AVX2 (CPUs with VAES but without AVX-512, such as AMD Zen 3, or Zen 4 behind a hypervisor
//! that hides AVX-512) two; sixteen blocks in flight either way, the tweak given per call.
//!
//! Why: OpenSSL 3.0's XTS runs 128-bit AES-NI and keeps the tweak inside its context, so a disk
//! pays an `EVP_CipherInit_ex` provider round trip per sector (about 8% of a 4 KiB sector). On
//! CPUs with VAES the AES units take two or four blocks per instruction. The suites use this
//! when the CPU has the features and OpenSSL otherwise; tests hold every width to the IEEE 1619
//! vectors and to OpenSSL.
//!
//! Tweak masks: lane i of a register holds T * x^i; the next register is the previous one
//! times x^lanes, computed per 128-bit lane as a shift by 2 or 4 bits, the carry between the two
//! 64-bit halves, and the bits that fall off reduced by a carry-less multiply with 0x87.

use core::arch::x86_64::*;

use super::simd::{load128, load256, load512, store128, store256, store512};
use crate::io::Io;

use zeroize::Zeroize;

/// How wide the VAES code runs on this CPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Width {
    /// 512-bit registers (AVX-512F/BW): four blocks per instruction.
    Zmm,
    /// 256-bit registers (AVX2): two blocks per instruction.
    Ymm,
}

/// The width of this module's code here, `None` where it does not run: the CPU lacks AES-NI,
/// VAES or VPCLMULQDQ, or the environment sets `IVDISK_CRYPTO_NO_VAES` (tests and benchmarks
/// use it to run the OpenSSL fallback on a machine that has VAES). `IVDISK_CRYPTO_VAES=ymm`
/// runs the 256-bit code on an AVX-512 CPU, as on one without (tests, benchmarks). Decided once
/// per process; checked when a key is set up, not per sector.
pub(crate) fn width() -> Option<Width> {
    static WIDTH: std::sync::OnceLock<Option<Width>> = std::sync::OnceLock::new();
    *WIDTH.get_or_init(|| {
        let forced_off = vaes_switched_off();
        let force_ymm = std::env::var("IVDISK_CRYPTO_VAES").is_ok_and(|v| v == "ymm");
        if forced_off {
            return None;
        }
        let zmm = cpu_has_zmm();
        if zmm && !force_ymm {
            Some(Width::Zmm)
        } else if cpu_has_ymm() {
            Some(Width::Ymm)
        } else {
            None
        }
    })
}

/// Whether the environment switches the VAES code off (`IVDISK_CRYPTO_NO_VAES`, see [`width`]),
/// and with it the AES-NI kernel of `aegis128l_one`.
pub(crate) fn vaes_switched_off() -> bool {
    std::env::var_os("IVDISK_CRYPTO_NO_VAES").is_some()
}

/// Whether this module runs here (at either width).
pub(crate) fn available() -> bool {
    width().is_some()
}

/// Whether CPUID names Intel as the CPU's maker (choices measured to differ between makers).
pub(super) fn cpu_vendor_is_intel() -> bool {
    &cpu_vendor() == b"GenuineIntel"
}

/// The CPU maker's name from CPUID leaf 0 ("GenuineIntel", "AuthenticAMD", ...).
fn cpu_vendor() -> [u8; 12] {
    let leaf = std::arch::x86_64::__cpuid(0);
    // In EBX, EDX, ECX, in that order.
    let mut name = [0u8; 12];
    name[..4].copy_from_slice(&leaf.ebx.to_le_bytes());
    name[4..8].copy_from_slice(&leaf.edx.to_le_bytes());
    name[8..].copy_from_slice(&leaf.ecx.to_le_bytes());
    name
}

/// The features of the 512-bit code, whatever the environment says.
pub(super) fn cpu_has_zmm() -> bool {
    cpu_has_ymm()
        && std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512bw")
}

/// The features of the 256-bit code, whatever the environment says.
pub(super) fn cpu_has_ymm() -> bool {
    std::arch::is_x86_feature_detected!("aes")
        && std::arch::is_x86_feature_detected!("avx2")
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

/// An XTS key expanded for VAES: the data key both ways and the tweak key, and the width the
/// rounds run at.
pub(crate) struct XtsVaes {
    encrypt: RoundKeys,
    decrypt: RoundKeys,
    tweak: RoundKeys,
    width: Width,
}

impl XtsVaes {
    /// Expand a 32- or 64-byte XTS key (K1 || K2). `None` if the CPU lacks the features.
    pub(crate) fn new(key: &[u8]) -> Option<XtsVaes> {
        XtsVaes::with_width(key, width()?)
    }

    /// As [`XtsVaes::new`] at a given width, `None` if the CPU cannot run it (tests use this
    /// to run both widths on an AVX-512 CPU).
    fn with_width(key: &[u8], width: Width) -> Option<XtsVaes> {
        let runs = match width {
            Width::Zmm => cpu_has_zmm(),
            Width::Ymm => cpu_has_ymm(),
        };
        if !runs {
            return None;
        }
        let (k1, k2) = key.split_at(key.len() / 2);
        // SAFETY: the CPU has AES-NI (checked above), the feature `expand` needs.
        let (encrypt, decrypt, tweak) = unsafe { (expand(k1), expand_decrypt(k1), expand(k2)) };
        Some(XtsVaes {
            encrypt,
            decrypt,
            tweak,
            width,
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
        match self.width {
            // SAFETY: an `XtsVaes` of width Zmm exists only where the CPU has the features of
            // the 512-bit code (`with_width`), the features `crypt_unit_zmm` needs.
            Width::Zmm => unsafe { crypt_unit_zmm(keys, &self.tweak, tweak, data, encrypt) },
            // SAFETY: likewise for the 256-bit code and `crypt_unit_ymm`.
            Width::Ymm => unsafe { crypt_unit_ymm(keys, &self.tweak, tweak, data, encrypt) },
        }
    }
}

/// One AES key expanded for AES-NI, for single blocks both ways: the map between
/// `aes-xts-random`'s stored value R and its tweak, kept here so that R -> tweak -> XTS stays
/// in one piece of code.
pub(crate) struct AesBlockCipher {
    encrypt: RoundKeys,
    decrypt: RoundKeys,
}

impl AesBlockCipher {
    /// Expand a 16- or 32-byte AES key. `None` if the CPU lacks the features of this module.
    pub(crate) fn new(key: &[u8]) -> Option<AesBlockCipher> {
        if !available() {
            return None;
        }
        // SAFETY: the CPU has AES-NI (`available` above checks it at either width).
        let (encrypt, decrypt) = unsafe { (expand(key), expand_decrypt(key)) };
        Some(AesBlockCipher { encrypt, decrypt })
    }

    /// Encrypt one block in place: one chain of rounds, no batch set-up.
    pub(crate) fn encrypt_one(&self, block: &mut [u8; 16]) {
        // SAFETY: an `AesBlockCipher` exists only on a CPU with AES-NI (checked in `new`).
        unsafe { encrypt_block(&self.encrypt, block) }
    }

    /// Encrypt up to eight 16-byte blocks in place, their rounds interleaved: one block is a
    /// chain of 14 dependent AESENC (AES-256), eight fill the AES units.
    pub(crate) fn encrypt_blocks(&self, blocks: &mut [[u8; 16]]) {
        assert!(blocks.len() <= 8, "at most eight blocks per call");
        // SAFETY: an `AesBlockCipher` exists only on a CPU with AES-NI (checked in `new`).
        unsafe { encrypt_blocks(&self.encrypt, blocks) }
    }

    /// Decrypt one block in place.
    pub(crate) fn decrypt_one(&self, block: &mut [u8; 16]) {
        // SAFETY: as in `encrypt_one`.
        unsafe { decrypt_block(&self.decrypt, block) }
    }

    /// Decrypt up to eight 16-byte blocks in place, their rounds interleaved.
    pub(crate) fn decrypt_blocks(&self, blocks: &mut [[u8; 16]]) {
        assert!(blocks.len() <= 8, "at most eight blocks per call");
        // SAFETY: as in `encrypt_blocks`.
        unsafe { decrypt_blocks(&self.decrypt, blocks) }
    }
}

/// One block, and up to eight with their rounds interleaved, through AES rounds `round` and
/// `last` (AESENC/AESENCLAST with encryption keys, AESDEC/AESDECLAST with the equivalent
/// inverse cipher's keys).
macro_rules! block_functions {
    ($one:ident, $many:ident, $round:ident, $last:ident) => {
        #[target_feature(enable = "aes")]
        fn $one(keys: &RoundKeys, block: &mut [u8; 16]) {
            let mut b = _mm_xor_si128(load128(block), load128(&keys.keys[0]));
            for k in &keys.keys[1..keys.rounds] {
                b = $round(b, load128(k));
            }
            b = $last(b, load128(&keys.keys[keys.rounds]));
            store128(block, b);
        }

        #[target_feature(enable = "aes")]
        fn $many(keys: &RoundKeys, blocks: &mut [[u8; 16]]) {
            let n = blocks.len();
            let mut b = [_mm_setzero_si128(); 8];
            let k0 = load128(&keys.keys[0]);
            for (reg, block) in b.iter_mut().zip(blocks.iter()) {
                *reg = _mm_xor_si128(load128(block), k0);
            }
            for k in &keys.keys[1..keys.rounds] {
                let k = load128(k);
                for reg in &mut b[..n] {
                    *reg = $round(*reg, k);
                }
            }
            let last = load128(&keys.keys[keys.rounds]);
            for (reg, block) in b.iter().zip(blocks.iter_mut()) {
                store128(block, $last(*reg, last));
            }
        }
    };
}

block_functions!(
    encrypt_block,
    encrypt_blocks,
    _mm_aesenc_si128,
    _mm_aesenclast_si128
);
block_functions!(
    decrypt_block,
    decrypt_blocks,
    _mm_aesdec_si128,
    _mm_aesdeclast_si128
);

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
    // Wipe the schedule from the stack (round key 0 is the key itself), as the kernels wipe
    // their broadcast copies; black_box keeps the stores from being optimised away as dead.
    rk = [_mm_setzero_si128(); 15];
    std::hint::black_box(&mut rk);
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

/// Multiply each 128-bit lane (a GF(2^128) element, little endian) by x^2.
#[inline]
#[target_feature(enable = "avx2,vpclmulqdq")]
fn mul_x2(t: __m256i, poly: __m256i) -> __m256i {
    let top = _mm256_srli_epi64::<62>(t);
    let carry = _mm256_bslli_epi128::<8>(top);
    let overflow = _mm256_bsrli_epi128::<8>(top);
    let reduced = _mm256_clmulepi64_epi128::<0x00>(overflow, poly);
    _mm256_xor_si256(_mm256_xor_si256(_mm256_slli_epi64::<2>(t), carry), reduced)
}

/// Multiply a GF(2^128) element (little endian) by x.
fn mul_x(t: u128) -> u128 {
    (t << 1) ^ ((t >> 127) * 0x87)
}

/// `$name(blocks, round_keys, rounds, encrypt)`: `$n` registers of blocks through all rounds of
/// AES, for one register width.
macro_rules! aes_rounds {
    ($name:ident, $reg:ty, $n:literal, $features:literal, $xor:ident,
     $enc:ident, $enclast:ident, $dec:ident, $declast:ident) => {
        #[inline]
        #[target_feature(enable = $features)]
        fn $name(blocks: &mut [$reg; $n], rk: &[$reg; 15], rounds: usize, encrypt: bool) {
            for b in blocks.iter_mut() {
                *b = $xor(*b, rk[0]);
            }
            if encrypt {
                for k in &rk[1..rounds] {
                    for b in blocks.iter_mut() {
                        *b = $enc(*b, *k);
                    }
                }
                for b in blocks.iter_mut() {
                    *b = $enclast(*b, rk[rounds]);
                }
            } else {
                for k in &rk[1..rounds] {
                    for b in blocks.iter_mut() {
                        *b = $dec(*b, *k);
                    }
                }
                for b in blocks.iter_mut() {
                    *b = $declast(*b, rk[rounds]);
                }
            }
        }
    };
}

// Four 512-bit registers (sixteen blocks).
aes_rounds!(
    aes4,
    __m512i,
    4,
    "avx512f,vaes",
    _mm512_xor_si512,
    _mm512_aesenc_epi128,
    _mm512_aesenclast_epi128,
    _mm512_aesdec_epi128,
    _mm512_aesdeclast_epi128
);
// Eight 256-bit registers (sixteen blocks).
aes_rounds!(
    aes8,
    __m256i,
    8,
    "avx2,vaes",
    _mm256_xor_si256,
    _mm256_aesenc_epi128,
    _mm256_aesenclast_epi128,
    _mm256_aesdec_epi128,
    _mm256_aesdeclast_epi128
);

/// `T = AES(K2, tweak)` as a little-endian number, with 128-bit AES-NI.
#[inline]
#[target_feature(enable = "aes")]
fn first_mask(tweak_keys: &RoundKeys, tweak: &[u8; 16]) -> u128 {
    let mut t_bytes = *tweak;
    encrypt_block(tweak_keys, &mut t_bytes);
    let t = u128::from_le_bytes(t_bytes);
    t_bytes.zeroize();
    t
}

/// The blocks from `from` on (the data units of 32 or 48 bytes in the IEEE vectors, never disk
/// sectors), one at a time with 128-bit AES-NI; `m` is the mask of the first of them.
#[target_feature(enable = "aes")]
fn crypt_rest(keys: &RoundKeys, mut m: u128, data: &mut Io<'_>, from: usize, encrypt: bool) {
    let len = data.len();
    // What the loads and stores below rely on (`crypt` asserted it; this is a safe function).
    assert!(len.is_multiple_of(16));
    let (src, dst) = data.as_ptrs();
    for at in (from..len).step_by(16) {
        let mask = load128(&m.to_le_bytes());
        // SAFETY: `at + 16 <= len` (whole blocks, asserted); unaligned load.
        let x = unsafe { _mm_loadu_si128(src.add(at).cast()) };
        let mut b = _mm_xor_si128(x, mask);
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
        // SAFETY: as for the load; the output spans `len` bytes too (`as_ptrs`).
        unsafe { _mm_storeu_si128(dst.add(at).cast(), _mm_xor_si128(b, mask)) };
        m = mul_x(m);
    }
    m.zeroize();
}

#[target_feature(enable = "aes,avx2,vaes,vpclmulqdq")]
fn crypt_unit_ymm(
    keys: &RoundKeys,
    tweak_keys: &RoundKeys,
    tweak: &[u8; 16],
    mut data: Io<'_>,
    encrypt: bool,
) {
    let t0 = first_mask(tweak_keys, tweak);
    let mut lanes = [0u8; 32];
    lanes[..16].copy_from_slice(&t0.to_le_bytes());
    lanes[16..].copy_from_slice(&mul_x(t0).to_le_bytes());
    let mut tw = load256(&lanes);
    lanes.zeroize();
    let poly = _mm256_set_epi64x(0, 0x87, 0, 0x87);

    let mut rk = [_mm256_setzero_si256(); 15];
    for (r, k) in rk.iter_mut().zip(&keys.keys).take(keys.rounds + 1) {
        *r = _mm256_broadcastsi128_si256(load128(k));
    }

    let len = data.len();
    let whole = len - len % 256;
    // Raw pointers, not slices: a fresh output (`Io::fresh`) is written, never read, and the
    // loop has no bounds check per block.
    let (src, dst) = data.as_ptrs();
    for at in (0..whole).step_by(256) {
        let mut masks = [tw; 8];
        for i in 1..8 {
            masks[i] = mul_x2(masks[i - 1], poly);
        }
        let mut x = [_mm256_setzero_si256(); 8];
        for i in 0..8 {
            // SAFETY: `at + 256 <= whole <= len`, the length of input and output; unaligned.
            let block = unsafe { _mm256_loadu_si256(src.add(at + i * 32).cast()) };
            x[i] = _mm256_xor_si256(block, masks[i]);
        }
        aes8(&mut x, &rk, keys.rounds, encrypt);
        for i in 0..8 {
            // SAFETY: as for the loads; in place, they came before.
            unsafe {
                _mm256_storeu_si256(
                    dst.add(at + i * 32).cast(),
                    _mm256_xor_si256(x[i], masks[i]),
                )
            };
        }
        tw = mul_x2(masks[7], poly);
    }
    let mut lanes = [0u8; 32];
    store256(&mut lanes, tw);
    let m = u128::from_le_bytes(lanes[..16].try_into().expect("16 bytes"));
    lanes.zeroize();
    crypt_rest(keys, m, &mut data, whole, encrypt);
    // Wipe the broadcast round keys from the stack; black_box keeps the stores from being
    // optimised away as dead.
    rk = [_mm256_setzero_si256(); 15];
    std::hint::black_box(&mut rk);
}

#[target_feature(enable = "aes,avx512f,avx512bw,vaes,vpclmulqdq")]
fn crypt_unit_zmm(
    keys: &RoundKeys,
    tweak_keys: &RoundKeys,
    tweak: &[u8; 16],
    mut data: Io<'_>,
    encrypt: bool,
) {
    let t0 = first_mask(tweak_keys, tweak);
    let (t1, t2) = (mul_x(t0), mul_x(mul_x(t0)));
    let t3 = mul_x(t2);
    let mut lanes = [0u8; 64];
    for (lane, v) in lanes.chunks_exact_mut(16).zip([t0, t1, t2, t3]) {
        lane.copy_from_slice(&v.to_le_bytes());
    }
    let mut tw = load512(&lanes);
    lanes.zeroize();
    let poly = _mm512_set_epi64(0, 0x87, 0, 0x87, 0, 0x87, 0, 0x87);

    let mut rk = [_mm512_setzero_si512(); 15];
    for (r, k) in rk.iter_mut().zip(&keys.keys).take(keys.rounds + 1) {
        *r = _mm512_broadcast_i32x4(load128(k));
    }

    let len = data.len();
    let whole = len - len % 256;
    // Raw pointers, as in `crypt_unit_ymm`.
    let (src, dst) = data.as_ptrs();
    for at in (0..whole).step_by(256) {
        let m1 = mul_x4(tw, poly);
        let m2 = mul_x4(m1, poly);
        let masks = [tw, m1, m2, mul_x4(m2, poly)];
        let mut x = [_mm512_setzero_si512(); 4];
        for i in 0..4 {
            // SAFETY: `at + 256 <= whole <= len`, the length of input and output; unaligned.
            let block = unsafe { _mm512_loadu_si512(src.add(at + i * 64).cast()) };
            x[i] = _mm512_xor_si512(block, masks[i]);
        }
        aes4(&mut x, &rk, keys.rounds, encrypt);
        for i in 0..4 {
            // SAFETY: as for the loads; in place, they came before.
            unsafe {
                _mm512_storeu_si512(
                    dst.add(at + i * 64).cast(),
                    _mm512_xor_si512(x[i], masks[i]),
                )
            };
        }
        tw = mul_x4(masks[3], poly);
    }
    let mut lanes = [0u8; 64];
    store512(&mut lanes, tw);
    let m = u128::from_le_bytes(lanes[..16].try_into().expect("16 bytes"));
    lanes.zeroize();
    crypt_rest(keys, m, &mut data, whole, encrypt);
    // Wipe the broadcast round keys from the stack; black_box keeps the stores from being
    // optimised away as dead.
    rk = [_mm512_setzero_si512(); 15];
    std::hint::black_box(&mut rk);
}

#[cfg(test)]
mod tests {
    use super::*;
    use openssl::symm::{Cipher, Crypter, Mode};

    #[test]
    fn cpu_vendor_matches_proc_cpuinfo() {
        let Ok(cpuinfo) = std::fs::read_to_string("/proc/cpuinfo") else {
            eprintln!("skipped: no /proc/cpuinfo");
            return;
        };
        let vendor = cpuinfo
            .lines()
            .find_map(|l| l.strip_prefix("vendor_id"))
            .and_then(|rest| rest.split(':').nth(1))
            .map(str::trim)
            .expect("a vendor_id line in /proc/cpuinfo");
        assert_eq!(&cpu_vendor(), vendor.as_bytes());
        assert_eq!(cpu_vendor_is_intel(), vendor == "GenuineIntel");
    }

    /// OpenSSL's XTS of one data unit.
    fn openssl_xts(key: &[u8], tweak: &[u8; 16], data: &[u8], encrypt: bool) -> Vec<u8> {
        let cipher = if key.len() == 32 {
            Cipher::aes_128_xts()
        } else {
            Cipher::aes_256_xts()
        };
        let mode = if encrypt {
            Mode::Encrypt
        } else {
            Mode::Decrypt
        };
        let mut c = Crypter::new(cipher, mode, key, Some(tweak)).unwrap();
        let mut out = vec![0u8; data.len() + 16];
        let n = c.update(data, &mut out).unwrap();
        let m = c.finalize(&mut out[n..]).unwrap();
        out.truncate(n + m);
        out
    }

    /// Every width this CPU runs (whatever the environment says) gives OpenSSL's output, both
    /// ways, in place and out of place, for both key sizes and the data-unit lengths of disks
    /// and of the IEEE vectors (the 128-bit rest path).
    #[test]
    fn every_width_equals_openssl() {
        let mut bytes = super::super::test_bytes(0x5eed);
        let mut ran = 0;
        for width in [Width::Zmm, Width::Ymm] {
            for key_len in [32usize, 64] {
                let key = bytes(key_len);
                let Some(xts) = XtsVaes::with_width(&key, width) else {
                    eprintln!("{width:?}: not on this CPU");
                    continue;
                };
                for len in [32usize, 48, 256, 512, 512 + 48, 4096] {
                    let tweak: [u8; 16] = bytes(16).try_into().unwrap();
                    let plain = bytes(len);
                    let expected = openssl_xts(&key, &tweak, &plain, true);

                    let mut out = vec![0u8; len];
                    xts.crypt(&tweak, Io::copy(&plain, &mut out), true);
                    assert_eq!(out, expected, "{width:?} key {key_len} len {len}: encrypt");
                    let mut buf = expected.clone();
                    xts.crypt(&tweak, Io::in_place(&mut buf), false);
                    assert_eq!(buf, plain, "{width:?} key {key_len} len {len}: decrypt");
                    assert_eq!(openssl_xts(&key, &tweak, &expected, false), plain);
                    ran += 1;
                }
            }
        }
        if ran == 0 {
            eprintln!("skipped: no VAES on this CPU");
        }
    }
}
