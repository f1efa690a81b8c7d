//! AEGIS-128L (draft-irtf-cfrg-aegis-aead) for one message with AES-NI: the sectors that do not
//! fill a group of four for `aegis128l_vaes` (single-sector runs and the remainders of runs).
//! Same algorithm, same output as libaegis, which stays the fallback; tests hold the two to
//! each other and to the draft's vectors. Three builds: with AVX-512VL (`vpternlogq` for
//! three-input logic, one state word per register), for CPUs with 256-bit VAES but no
//! AVX-512 (`packed`: two state words per YMM register, half the instructions per round), and
//! for CPUs with AES-NI and AVX but no VAES (`aesni`: the first build's code, each three-input
//! op as two; there every sector comes here, the four-lane code does not run).
//!
//! Why not libaegis: one message is a chain of dependent AES rounds, and on the CPUs measured
//! here (Intel Xeon with AVX-512) two things other than the AES units set its pace:
//! - A value that goes from a vector logic op into AESENC and back pays about two cycles on top
//!   of the two latencies (measured: an XOR -> AESENC chain takes 6 cycles per step, an AESENC
//!   chain 3). S0 and S4 take a message word every round, S0' = AESENC(S7, S0) ^ M0, so in the
//!   textbook update (libaegis's) every round waits for that detour. Here S0 and S4 are kept as
//!   the raw AESENC output r plus an offset d, the XOR of the message words they absorbed since
//!   the start: AESENC(x, r ^ d) = AESENC(x, r) ^ d, so the raw chain r' = AESENC(S7, r) has no
//!   XOR in it, and the true word r ^ d is formed beside it for its one other use (the state
//!   operand of the next round's S1' = AESENC(S0, S1)). Two more logic ops per round, off the
//!   chain.
//! - The vector ALU ports: 8 AESENC (ports 0 and 1) and the logic ops share three ports; with
//!   `vpternlogq` the keystream and message XOR take 2 ops per 16 bytes instead of 4.
//!
//! Measured per 4 KiB sector through the suite: with AVX-512 about 1.25x libaegis encrypting,
//! 1.1x decrypting (docs/BENCHMARKS.md, "one-message AEGIS-128L on AVX-512"). On an AMD EPYC
//! (Zen 4) without AVX-512 an AVX build of the AVX-512 code (tried) encrypted about 5% slower
//! than libaegis; the packed build is faster both ways there ("packed AEGIS-128L"). On an AMD
//! EPYC without VAES the `aesni` build, with the draft's own update of S0 and S4, seals in
//! place as fast as libaegis or faster, and out of place without libaegis' copy first: the
//! library's reads and writes ("AEGIS-128L without VAES").
//!
//! The whole state stays in registers (the methods are inlined into one loop).

use core::arch::x86_64::*;

use super::aegis128l_vaes::{C0, C1};
use super::simd::{load128, store128};
use super::xts_vaes::{vaes_switched_off, width, Width};
use crate::io::Io;

/// Which build of the kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Build {
    /// AES-NI, AVX-512F and AVX-512VL.
    Avx512,
    /// AES-NI, AVX2 and 256-bit VAES, two state words per register (`packed`).
    Vaes256,
    /// AES-NI and AVX, no VAES (`aesni`).
    AesNi,
}

impl Build {
    /// The CPU's features for this build, whatever the environment says.
    fn cpu_has_features(self) -> bool {
        let base = std::arch::is_x86_feature_detected!("aes")
            && std::arch::is_x86_feature_detected!("avx");
        match self {
            Build::Avx512 => {
                base && std::arch::is_x86_feature_detected!("avx512f")
                    && std::arch::is_x86_feature_detected!("avx512vl")
            }
            Build::Vaes256 => {
                base && std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("vaes")
            }
            Build::AesNi => base,
        }
    }

    /// The build that runs where the VAES code runs at this width: AVX-512 with 512-bit VAES,
    /// the packed 256-bit build with 256-bit VAES (also when `IVDISK_CRYPTO_VAES=ymm` forces it
    /// on an AVX-512 CPU); without VAES the AES-NI build. None when `IVDISK_CRYPTO_NO_VAES`
    /// switches the kernels off.
    fn here() -> Option<Build> {
        if vaes_switched_off() {
            return None;
        }
        let build = match width() {
            Some(Width::Zmm) => Build::Avx512,
            Some(Width::Ymm) => Build::Vaes256,
            None => Build::AesNi,
        };
        build.cpu_has_features().then_some(build)
    }

    /// # Safety
    /// The CPU has this build's features (`cpu_has_features`).
    unsafe fn crypt<const ENCRYPT: bool>(
        self,
        key: &[u8; 16],
        nonce: &[u8; 16],
        aad: &[u8],
        data: &mut Io<'_>,
    ) -> [u8; 16] {
        // SAFETY: the caller guarantees the build's features, those of its `crypt`.
        unsafe {
            match self {
                Build::Avx512 => avx512::crypt::<ENCRYPT>(key, nonce, aad, data),
                Build::Vaes256 => packed::crypt::<ENCRYPT>(key, nonce, aad, data),
                Build::AesNi => aesni::crypt::<ENCRYPT>(key, nonce, aad, data),
            }
        }
    }
}

/// Proof that this code runs here: the CPU has the features and the VAES engines are not
/// switched off (`IVDISK_CRYPTO_NO_VAES` forces the portable engines everywhere). Checked once,
/// when a key is set up; only [`OneMessage::here`] makes one.
#[derive(Debug, Clone, Copy)]
pub(crate) struct OneMessage(Build);

impl OneMessage {
    /// The kernel for this CPU; `None` where libaegis does the work.
    pub(crate) fn here() -> Option<OneMessage> {
        Build::here().map(OneMessage)
    }

    /// Encrypt one message (in place or out of place) and return its 128-bit tag.
    pub(crate) fn seal(
        self,
        key: &[u8; 16],
        nonce: &[u8; 16],
        aad: &[u8],
        mut data: Io<'_>,
    ) -> [u8; 16] {
        // SAFETY: a `OneMessage` exists only where the CPU has its build's features (`here`).
        unsafe { self.0.crypt::<true>(key, nonce, aad, &mut data) }
    }

    /// Decrypt one message (in place or out of place) and check its tag: false when it does
    /// not verify, and then the output holds zeros, never unauthenticated plaintext.
    pub(crate) fn open(
        self,
        key: &[u8; 16],
        nonce: &[u8; 16],
        aad: &[u8],
        mut data: Io<'_>,
        tag: &[u8; 16],
    ) -> bool {
        // SAFETY: as in `seal`.
        let computed = unsafe { self.0.crypt::<false>(key, nonce, aad, &mut data) };
        // Constant time: the comparison must not say how many tag bytes matched.
        let diff = computed
            .iter()
            .zip(tag)
            .fold(0u8, |acc, (a, b)| acc | (a ^ b));
        if diff != 0 {
            data.clear_output();
        }
        diff == 0
    }
}

/// The associated data as the 32-byte blocks the state absorbs, the last one zero padded.
fn aad_blocks(aad: &[u8]) -> impl Iterator<Item = [u8; 32]> + '_ {
    aad.chunks(32).map(|chunk| {
        let mut block = [0u8; 32];
        block[..chunk.len()].copy_from_slice(chunk);
        block
    })
}

/// A build with one state word per XMM register: its `State` and `crypt`, for the logic
/// helpers `xor3` and `and_xor` and the target `$features` of the module that invokes it.
/// `$textbook`: S0 and S4 updated as the draft writes it (`AESENC(S7, S0) ^ M0`), without the
/// raw output and offset of the module docs. Without three-input logic the offset costs four
/// more XORs per round, and on an AMD EPYC without VAES the textbook update sealed a 4 KiB
/// sector in place about 10% faster (on par with libaegis).
macro_rules! one_word_per_register {
    ($features:literal, $textbook:literal) => {
        /// The draft's update of S0 and S4 (the macro's docs); the offsets then stay zero.
        const TEXTBOOK: bool = $textbook;

        /// The AEGIS-128L state, with S0 and S4 also as raw AESENC output and offset (module docs).
        #[derive(Clone, Copy)]
        struct State {
            /// S0..S7, each its true value.
            s: [__m128i; 8],
            /// The last AESENC outputs for S0 and S4: the next round's round keys for them.
            raw: [__m128i; 2],
            /// What separates `raw` from the true S0 and S4: the XOR of the message words absorbed.
            offset: [__m128i; 2],
        }

        impl State {
            #[inline]
            #[target_feature(enable = $features)]
            fn new(key: &[u8; 16], nonce: &[u8; 16]) -> State {
                let (k, n) = (load128(key), load128(nonce));
                let (c0, c1) = (load128(&C0), load128(&C1));
                let kn = _mm_xor_si128(k, n);
                let kc0 = _mm_xor_si128(k, c0);
                let kc1 = _mm_xor_si128(k, c1);
                let zero = _mm_setzero_si128();
                let mut st = State {
                    s: [kn, c1, c0, c1, kn, kc0, kc1, kc0],
                    raw: [kn, kn],
                    offset: [zero, zero],
                };
                for _ in 0..10 {
                    st.update(n, k);
                }
                st
            }

            /// Update(M0, M1) of the draft: S'i = AESRound(S(i-1), Si), then M0 into S0 and M1
            /// into S4.
            #[inline]
            #[target_feature(enable = $features)]
            fn update(&mut self, m0: __m128i, m1: __m128i) {
                let [s0, s1, s2, s3, s4, s5, s6, s7] = self.s;
                let [d0, d4] = self.offset;
                // AESRound(S7, S0 ^ M0) = AESENC(S7, raw0) ^ d0 ^ M0: the raw chains stay pure
                // AESENC.
                let r0 = _mm_aesenc_si128(s7, self.raw[0]);
                let r4 = _mm_aesenc_si128(s3, self.raw[1]);
                self.s = [
                    xor3(r0, d0, m0),
                    _mm_aesenc_si128(s0, s1),
                    _mm_aesenc_si128(s1, s2),
                    _mm_aesenc_si128(s2, s3),
                    xor3(r4, d4, m1),
                    _mm_aesenc_si128(s4, s5),
                    _mm_aesenc_si128(s5, s6),
                    _mm_aesenc_si128(s6, s7),
                ];
                if TEXTBOOK {
                    self.raw = [self.s[0], self.s[4]];
                } else {
                    self.raw = [r0, r4];
                    self.offset = [_mm_xor_si128(d0, m0), _mm_xor_si128(d4, m1)];
                }
            }

            /// The 32-byte block `x0 || x1` XOR the keystream of the current state:
            /// z0 = S1 ^ S6 ^ (S2 & S3), z1 = S2 ^ S5 ^ (S6 & S7).
            #[inline]
            #[target_feature(enable = $features)]
            fn xor_keystream(&self, x0: __m128i, x1: __m128i) -> (__m128i, __m128i) {
                let s = &self.s;
                (
                    xor3(and_xor(s[2], s[3], s[1]), s[6], x0),
                    xor3(and_xor(s[6], s[7], s[2]), s[5], x1),
                )
            }

            /// Encrypt one full block; the state absorbs the plaintext.
            #[inline]
            #[target_feature(enable = $features)]
            fn encrypt(&mut self, m0: __m128i, m1: __m128i) -> (__m128i, __m128i) {
                let c = self.xor_keystream(m0, m1);
                self.update(m0, m1);
                c
            }

            /// Decrypt one full block; the state absorbs the recovered plaintext.
            #[inline]
            #[target_feature(enable = $features)]
            fn decrypt(&mut self, c0: __m128i, c1: __m128i) -> (__m128i, __m128i) {
                let (m0, m1) = self.xor_keystream(c0, c1);
                self.update(m0, m1);
                (m0, m1)
            }

            /// The last `input.len()` (< 32) bytes of the message: zero padded in, truncated
            /// out. The state absorbs the zero-padded plaintext (for decryption: the recovered
            /// bytes, zeros after them, as the draft's DecPartial says).
            #[inline]
            #[target_feature(enable = $features)]
            fn crypt_partial<const ENCRYPT: bool>(&mut self, input: &[u8], output: &mut [u8]) {
                let n = input.len();
                debug_assert!(n < 32 && output.len() == n);
                let mut pad = [0u8; 32];
                pad[..n].copy_from_slice(input);
                let (x0, x1) = (load128(&pad), load128(&pad[16..]));
                let (y0, y1) = self.xor_keystream(x0, x1);
                let mut out = [0u8; 32];
                store128(&mut out, y0);
                store128(&mut out[16..], y1);
                output.copy_from_slice(&out[..n]);
                if ENCRYPT {
                    self.update(x0, x1);
                } else {
                    out[n..].fill(0);
                    self.update(load128(&out), load128(&out[16..]));
                }
            }

            /// Finalize(ad_len_bits, msg_len_bits) of the draft with a 128-bit tag.
            #[inline]
            #[target_feature(enable = $features)]
            fn finalize(mut self, aad_len: usize, msg_len: usize) -> [u8; 16] {
                let mut lens = [0u8; 16];
                lens[..8].copy_from_slice(&(aad_len as u64 * 8).to_le_bytes());
                lens[8..].copy_from_slice(&(msg_len as u64 * 8).to_le_bytes());
                let t = _mm_xor_si128(self.s[2], load128(&lens));
                for _ in 0..7 {
                    self.update(t, t);
                }
                let s = self.s;
                let tag = xor3(xor3(s[0], s[1], s[2]), xor3(s[3], s[4], s[5]), s[6]);
                let mut out = [0u8; 16];
                store128(&mut out, tag);
                out
            }
        }

        /// Encrypt (`ENCRYPT`) or decrypt one message with its associated data; returns the tag
        /// of the plaintext (for decryption: computed from the recovered plaintext, for the
        /// caller to compare).
        #[target_feature(enable = $features)]
        pub(super) fn crypt<const ENCRYPT: bool>(
            key: &[u8; 16],
            nonce: &[u8; 16],
            aad: &[u8],
            data: &mut Io<'_>,
        ) -> [u8; 16] {
            let mut st = State::new(key, nonce);
            for b in aad_blocks(aad) {
                st.update(load128(&b), load128(&b[16..]));
            }

            let len = data.len();
            let full = len / 32 * 32;
            // Through pointers: a fresh output is written, never read (nor zeroed first).
            let (src, dst) = data.as_ptrs();
            let mut at = 0;
            while at < full {
                // SAFETY: `at + 32 <= full <= len`: 32 bytes readable at `src + at` and
                // writable at `dst + at` (`as_ptrs`: both span `len` bytes; they are equal or
                // do not overlap).
                let (x0, x1) = unsafe {
                    (
                        _mm_loadu_si128(src.add(at).cast()),
                        _mm_loadu_si128(src.add(at + 16).cast()),
                    )
                };
                let (y0, y1) = if ENCRYPT {
                    st.encrypt(x0, x1)
                } else {
                    st.decrypt(x0, x1)
                };
                // SAFETY: as for the loads.
                unsafe {
                    _mm_storeu_si128(dst.add(at).cast(), y0);
                    _mm_storeu_si128(dst.add(at + 16).cast(), y1);
                }
                at += 32;
            }
            if full < len {
                data.tail_through(full, |input, output| {
                    st.crypt_partial::<ENCRYPT>(input, output)
                });
            }
            st.finalize(aad.len(), len)
        }
    };
}

/// The AVX-512VL build: three-input logic in one `vpternlogq`; the state stays in registers
/// (the methods below are inlined into one loop).
mod avx512 {
    use super::*;

    /// `a ^ b ^ c` in one instruction.
    #[inline]
    #[target_feature(enable = "avx512f,avx512vl")]
    fn xor3(a: __m128i, b: __m128i, c: __m128i) -> __m128i {
        _mm_ternarylogic_epi64::<0x96>(a, b, c)
    }

    /// `(a & b) ^ c` in one instruction.
    #[inline]
    #[target_feature(enable = "avx512f,avx512vl")]
    fn and_xor(a: __m128i, b: __m128i, c: __m128i) -> __m128i {
        _mm_ternarylogic_epi64::<0x6a>(a, b, c)
    }

    one_word_per_register!("aes,avx512f,avx512vl", false);
}

/// The build for CPUs with AES-NI and AVX but no VAES (AMD Zen 2, Intel before Ice Lake): the
/// AVX-512 build's code with each three-input logic op as two. It seals and opens out of place,
/// where libaegis works in place only, after a copy of the sector into the output.
mod aesni {
    use super::*;

    /// `a ^ b ^ c`.
    #[inline]
    #[target_feature(enable = "avx")]
    fn xor3(a: __m128i, b: __m128i, c: __m128i) -> __m128i {
        _mm_xor_si128(_mm_xor_si128(a, b), c)
    }

    /// `(a & b) ^ c`.
    #[inline]
    #[target_feature(enable = "avx")]
    fn and_xor(a: __m128i, b: __m128i, c: __m128i) -> __m128i {
        _mm_xor_si128(_mm_and_si128(a, b), c)
    }

    one_word_per_register!("aes,avx", true);
}
/// The 256-bit VAES build for CPUs with AVX2 and VAES but not AVX-512: two state words per
/// YMM register, R_j = (S_j, S_j+4), so a round is four VAESENC instead of eight AESENC and the
/// keystream and message XORs go 32 bytes at a time:
/// - R'1..R'3 = AESENC(R_j-1, R_j) lane by lane, exactly the draft's S'1..S'3 and S'5..S'7;
/// - R'0 = (S'0, S'4) = AESENC((S7, S3), R0 ^ (M0, M1)), where (S7, S3) is R3 with its lanes
///   swapped. The swap sits on the ring R0 -> R1 -> R2 -> R3 -> R0, which spans four rounds, so
///   its latency is spread over them; each round waits only for one VAESENC per register.
/// - keystream (S1 ^ S6 ^ (S2 & S3), S5 ^ S2 ^ (S6 & S7)) = R1 ^ swap(R2) ^ (R2 & R3).
mod packed {
    use super::*;
    use crate::ffi::simd::{load256, store256};

    /// The AEGIS-128L state as four registers (module docs), with R0 also as raw VAESENC
    /// output and offset, as S0 and S4 in the other builds.
    #[derive(Clone, Copy)]
    struct State([__m256i; 4], __m256i, __m256i);

    /// The two 128-bit lanes of `x` exchanged, by `vperm2i128`: 3 cycles on AMD Zen 4, where
    /// the `vpermq` that LLVM turns `_mm256_permute2x128_si256` into takes 6 (measured by
    /// dependent chains), on the ring above. Written out so that the compiler keeps it.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn swap(x: __m256i) -> __m256i {
        let out: __m256i;
        // SAFETY: `vperm2i128` reads and writes registers only (AVX2, enabled here).
        unsafe {
            core::arch::asm!(
                "vperm2i128 {out}, {x}, {x}, 1",
                out = lateout(ymm_reg) out,
                x = in(ymm_reg) x,
                options(pure, nomem, nostack, preserves_flags),
            );
        }
        out
    }

    impl State {
        #[inline]
        #[target_feature(enable = "aes,avx2,vaes")]
        fn new(key: &[u8; 16], nonce: &[u8; 16]) -> State {
            let (k, n) = (load128(key), load128(nonce));
            let (c0, c1) = (load128(&C0), load128(&C1));
            let kn = _mm_xor_si128(k, n);
            let kc0 = _mm_xor_si128(k, c0);
            let kc1 = _mm_xor_si128(k, c1);
            // S = [K^N, C1, C0, C1, K^N, K^C0, K^C1, K^C0], paired as (S_j, S_j+4).
            let knkn = _mm256_set_m128i(kn, kn);
            let mut st = State(
                [
                    knkn,
                    _mm256_set_m128i(kc0, c1),
                    _mm256_set_m128i(kc1, c0),
                    _mm256_set_m128i(kc0, c1),
                ],
                knkn,
                _mm256_setzero_si256(),
            );
            let nk = _mm256_set_m128i(k, n);
            for _ in 0..10 {
                st.update(nk);
            }
            st
        }

        /// Update(M0, M1) of the draft with `m` = (M0, M1).
        #[inline]
        #[target_feature(enable = "aes,avx2,vaes")]
        fn update(&mut self, m: __m256i) {
            let [r0, r1, r2, r3] = self.0;
            let raw = _mm256_aesenc_epi128(swap(r3), self.1);
            let d = _mm256_xor_si256(self.2, m);
            self.0 = [
                _mm256_xor_si256(raw, d),
                _mm256_aesenc_epi128(r0, r1),
                _mm256_aesenc_epi128(r1, r2),
                _mm256_aesenc_epi128(r2, r3),
            ];
            self.1 = raw;
            self.2 = d;
        }

        /// The 32-byte block `x` XOR the keystream of the current state.
        #[inline]
        #[target_feature(enable = "aes,avx2,vaes")]
        fn xor_keystream(&self, x: __m256i) -> __m256i {
            let [_, r1, r2, r3] = self.0;
            let z = _mm256_xor_si256(_mm256_and_si256(r2, r3), swap(r2));
            _mm256_xor_si256(_mm256_xor_si256(z, r1), x)
        }

        /// The last `input.len()` (< 32) bytes of the message, as in the other builds.
        #[inline]
        #[target_feature(enable = "aes,avx2,vaes")]
        fn crypt_partial<const ENCRYPT: bool>(&mut self, input: &[u8], output: &mut [u8]) {
            let n = input.len();
            debug_assert!(n < 32 && output.len() == n);
            let mut pad = [0u8; 32];
            pad[..n].copy_from_slice(input);
            let x = load256(&pad);
            let mut out = [0u8; 32];
            store256(&mut out, self.xor_keystream(x));
            output.copy_from_slice(&out[..n]);
            if ENCRYPT {
                self.update(x);
            } else {
                out[n..].fill(0);
                self.update(load256(&out));
            }
        }

        /// Finalize with a 128-bit tag: S0 ^ .. ^ S6.
        #[inline]
        #[target_feature(enable = "aes,avx2,vaes")]
        fn finalize(mut self, aad_len: usize, msg_len: usize) -> [u8; 16] {
            let mut lens = [0u8; 16];
            lens[..8].copy_from_slice(&(aad_len as u64 * 8).to_le_bytes());
            lens[8..].copy_from_slice(&(msg_len as u64 * 8).to_le_bytes());
            let t = _mm_xor_si128(_mm256_castsi256_si128(self.0[2]), load128(&lens));
            let tt = _mm256_set_m128i(t, t);
            for _ in 0..7 {
                self.update(tt);
            }
            let [r0, r1, r2, r3] = self.0;
            // (S0^S1^S2^S3, S4^S5^S6^S7); S7 (R3's high lane) is not in the tag.
            let x = _mm256_xor_si256(_mm256_xor_si256(r0, r1), _mm256_xor_si256(r2, r3));
            let tag = _mm_xor_si128(
                _mm_xor_si128(_mm256_castsi256_si128(x), _mm256_extracti128_si256::<1>(x)),
                _mm256_extracti128_si256::<1>(r3),
            );
            let mut out = [0u8; 16];
            store128(&mut out, tag);
            out
        }
    }

    /// As the other builds' `crypt`.
    #[target_feature(enable = "aes,avx2,vaes")]
    pub(super) fn crypt<const ENCRYPT: bool>(
        key: &[u8; 16],
        nonce: &[u8; 16],
        aad: &[u8],
        data: &mut Io<'_>,
    ) -> [u8; 16] {
        let mut st = State::new(key, nonce);
        for b in aad_blocks(aad) {
            st.update(load256(&b));
        }

        let len = data.len();
        let full = len / 32 * 32;
        let (src, dst) = data.as_ptrs();
        let mut at = 0;
        while at < full {
            // SAFETY: `at + 32 <= full <= len`: 32 bytes readable at `src + at` and writable at
            // `dst + at` (`as_ptrs`: both span `len` bytes; they are equal or do not overlap).
            let x = unsafe { _mm256_loadu_si256(src.add(at).cast()) };
            let y = st.xor_keystream(x);
            st.update(if ENCRYPT { x } else { y });
            // SAFETY: as for the load.
            unsafe { _mm256_storeu_si256(dst.add(at).cast(), y) };
            at += 32;
        }
        if full < len {
            data.tail_through(full, |input, output| {
                st.crypt_partial::<ENCRYPT>(input, output)
            });
        }
        st.finalize(aad.len(), len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use aegis::aegis128l::Aegis128L;

    /// The builds this CPU can run, whatever the environment says.
    fn builds() -> Vec<Build> {
        let builds: Vec<Build> = [Build::Avx512, Build::Vaes256, Build::AesNi]
            .into_iter()
            .filter(|b| b.cpu_has_features())
            .collect();
        if builds.is_empty() {
            eprintln!("skipped: the CPU lacks AES-NI/AVX");
        }
        builds
    }

    /// Run a build directly, bypassing `IVDISK_CRYPTO_NO_VAES` (so that the CI run with the
    /// override still tests it); `None` on a CPU without its features.
    fn direct_seal(
        build: Build,
        key: &[u8; 16],
        nonce: &[u8; 16],
        aad: &[u8],
        data: Io<'_>,
    ) -> Option<[u8; 16]> {
        let mut data = data;
        // SAFETY: the build's features are checked first.
        build
            .cpu_has_features()
            .then(|| unsafe { build.crypt::<true>(key, nonce, aad, &mut data) })
    }

    fn direct_open(
        build: Build,
        key: &[u8; 16],
        nonce: &[u8; 16],
        aad: &[u8],
        data: Io<'_>,
        tag: &[u8; 16],
    ) -> Option<bool> {
        let mut data = data;
        // SAFETY: the build's features are checked first.
        let computed = build
            .cpu_has_features()
            .then(|| unsafe { build.crypt::<false>(key, nonce, aad, &mut data) })?;
        if &computed != tag {
            data.clear_output();
        }
        Some(&computed == tag)
    }

    /// Deterministic bytes (SplitMix64) for reproducible random cases.
    struct Bytes(u64);

    impl Bytes {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        }
        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
        fn fill(&mut self, out: &mut [u8]) {
            for b in out {
                *b = self.next() as u8;
            }
        }
        fn vec(&mut self, len: usize) -> Vec<u8> {
            let mut v = vec![0u8; len];
            self.fill(&mut v);
            v
        }
        fn array(&mut self) -> [u8; 16] {
            let mut a = [0u8; 16];
            self.fill(&mut a);
            a
        }
    }

    fn unhex(s: &str) -> Vec<u8> {
        hex::decode(s).expect("hex in the vector file")
    }

    /// The draft's AEGIS-128L vectors (tests/vectors/aegis.txt) through this kernel, in place
    /// and out of place: valid ones seal to the ciphertext and tag and open to the message, the
    /// invalid ones fail to open and leave zeros.
    #[test]
    fn draft_vectors() {
        for build in builds() {
            let text = include_str!("../../tests/vectors/aegis.txt");
            let mut checked = [0usize; 2];
            for record in text.split("\n\n") {
                let fields: std::collections::HashMap<&str, &str> = record
                    .lines()
                    .filter(|l| !l.trim_start().starts_with('#'))
                    .filter_map(|l| l.split_once('='))
                    .map(|(k, v)| (k.trim(), v.trim()))
                    .collect();
                if fields.get("alg") != Some(&"aegis128l") {
                    continue;
                }
                let label = fields["vector"];
                let key: [u8; 16] = unhex(fields["key"]).try_into().unwrap();
                let nonce: [u8; 16] = unhex(fields["nonce"]).try_into().unwrap();
                let (ad, ct) = (unhex(fields["ad"]), unhex(fields["ct"]));
                let tag: [u8; 16] = unhex(fields["tag128"]).try_into().unwrap();
                let valid = fields.get("valid") != Some(&"false");

                let mut buf = ct.clone();
                let opened =
                    direct_open(build, &key, &nonce, &ad, Io::in_place(&mut buf), &tag).unwrap();
                assert_eq!(opened, valid, "{build:?} {label}: open in place");
                let mut out = vec![0x55u8; ct.len()];
                let opened_to =
                    direct_open(build, &key, &nonce, &ad, Io::copy(&ct, &mut out), &tag).unwrap();
                assert_eq!(opened_to, valid, "{build:?} {label}: open out of place");
                if !valid {
                    assert!(
                        buf.iter().chain(&out).all(|&b| b == 0),
                        "{build:?} {label}: output left"
                    );
                    checked[1] += 1;
                    continue;
                }
                let msg = unhex(fields["msg"]);
                assert_eq!(buf, msg, "{build:?} {label}: plaintext in place");
                assert_eq!(out, msg, "{build:?} {label}: plaintext out of place");

                let mut buf = msg.clone();
                let got = direct_seal(build, &key, &nonce, &ad, Io::in_place(&mut buf)).unwrap();
                assert_eq!(
                    hex::encode(&buf),
                    hex::encode(&ct),
                    "{build:?} {label}: ciphertext in place"
                );
                assert_eq!(got, tag, "{build:?} {label}: tag in place");
                let mut out = vec![0x55u8; msg.len()];
                let got = direct_seal(build, &key, &nonce, &ad, Io::copy(&msg, &mut out)).unwrap();
                assert_eq!(out, ct, "{build:?} {label}: ciphertext out of place");
                assert_eq!(got, tag, "{build:?} {label}: tag out of place");
                checked[0] += 1;
            }
            assert!(
                checked[0] >= 5 && checked[1] >= 2,
                "vector coverage {checked:?}"
            );
        }
    }

    /// Same ciphertext and tag as libaegis on random keys, nonces, associated data and lengths
    /// (multiples of 32 bytes and not, up to 8 KiB), in place and out of place, both ways.
    #[test]
    fn equals_libaegis() {
        for build in builds() {
            let mut rng = Bytes(0x1d15_c0de);
            let mut lens: Vec<usize> = vec![0, 1, 15, 16, 17, 31, 32, 33, 64, 127, 128, 129, 160];
            lens.extend([512, 4096, 4096 + 32, 8192, 8191]);
            lens.extend((0..40).map(|_| rng.below(8193)));
            lens.extend((0..20).map(|_| rng.below(257) * 32));
            for (case, &len) in lens.iter().enumerate() {
                let key = rng.array();
                let nonce = rng.array();
                let aad_len = if case % 5 == 0 { 0 } else { rng.below(100) };
                let aad = rng.vec(aad_len);
                let plain = rng.vec(len);

                let mut reference = plain.clone();
                let ref_tag =
                    Aegis128L::<16>::new(&key, &nonce).encrypt_in_place(&mut reference, &aad);

                let mut in_place = plain.clone();
                let tag =
                    direct_seal(build, &key, &nonce, &aad, Io::in_place(&mut in_place)).unwrap();
                assert!(
                    in_place == reference && tag == ref_tag,
                    "{build:?} len {len}: seal in place"
                );
                let mut out = vec![0xeeu8; len];
                let tag =
                    direct_seal(build, &key, &nonce, &aad, Io::copy(&plain, &mut out)).unwrap();
                assert!(
                    out == reference && tag == ref_tag,
                    "{build:?} len {len}: seal out of place"
                );

                let mut back = reference.clone();
                assert!(
                    direct_open(build, &key, &nonce, &aad, Io::in_place(&mut back), &ref_tag)
                        .unwrap()
                );
                assert!(back == plain, "{build:?} len {len}: open in place");
                let mut back = vec![0xeeu8; len];
                let ok = direct_open(
                    build,
                    &key,
                    &nonce,
                    &aad,
                    Io::copy(&reference, &mut back),
                    &ref_tag,
                );
                assert!(
                    ok.unwrap() && back == plain,
                    "{build:?} len {len}: open out of place"
                );
            }
        }
    }

    /// A flipped bit in the ciphertext, the tag or the associated data fails to open and leaves
    /// zeros in the output (in place: the buffer; out of place: the output, input untouched).
    #[test]
    fn tampering_fails_and_leaves_no_plaintext() {
        for build in builds() {
            let mut rng = Bytes(7);
            for len in [1usize, 31, 32, 100, 4096] {
                let (key, nonce) = (rng.array(), rng.array());
                let aad = rng.vec(24);
                let plain = rng.vec(len);
                let mut ct = plain.clone();
                let tag = direct_seal(build, &key, &nonce, &aad, Io::in_place(&mut ct)).unwrap();
                let bit = rng.below(len * 8);
                for what in ["ciphertext", "tag", "aad"] {
                    let (mut c, mut t, mut a) = (ct.clone(), tag, aad.clone());
                    match what {
                        "ciphertext" => c[bit / 8] ^= 1 << (bit % 8),
                        "tag" => t[bit % 16] ^= 1,
                        _ => a[bit % 24] ^= 1,
                    }
                    let mut buf = c.clone();
                    assert!(
                        !direct_open(build, &key, &nonce, &a, Io::in_place(&mut buf), &t).unwrap()
                    );
                    assert!(
                        buf.iter().all(|&b| b == 0),
                        "{build:?} len {len}, {what}: plaintext left in place"
                    );
                    let mut out = vec![0x55u8; len];
                    assert!(
                        !direct_open(build, &key, &nonce, &a, Io::copy(&c, &mut out), &t).unwrap()
                    );
                    assert!(
                        out.iter().all(|&b| b == 0),
                        "{build:?} len {len}, {what}: plaintext left"
                    );
                }
            }
        }
    }

    /// The suite's kernel follows the environment: with `IVDISK_CRYPTO_NO_VAES` set there is
    /// none (the suite then runs libaegis); otherwise the AVX-512 build where the 512-bit VAES
    /// code runs, the packed build where the 256-bit code runs, the AES-NI build elsewhere.
    #[test]
    fn kernel_follows_the_override() {
        let forced_off = std::env::var_os("IVDISK_CRYPTO_NO_VAES").is_some();
        let kernel = OneMessage::here();
        let expected = match width() {
            _ if forced_off => None,
            Some(Width::Zmm) => Some(Build::Avx512),
            Some(Width::Ymm) => Some(Build::Vaes256),
            None => Some(Build::AesNi),
        }
        .filter(|b| b.cpu_has_features());
        assert_eq!(kernel.map(|k| k.0), expected);
        if let Some(kernel) = kernel {
            let (key, nonce) = ([1u8; 16], [2u8; 16]);
            let mut data = [3u8; 64];
            let tag = kernel.seal(&key, &nonce, b"ad", Io::in_place(&mut data));
            let reference =
                Aegis128L::<16>::new(&key, &nonce).encrypt_in_place(&mut [3u8; 64], b"ad");
            assert_eq!(tag, reference);
            assert!(kernel.open(&key, &nonce, b"ad", Io::in_place(&mut data), &tag));
            assert_eq!(data, [3u8; 64]);
        }
    }
}
