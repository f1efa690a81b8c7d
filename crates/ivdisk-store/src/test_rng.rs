//! A seeded random source for the randomized unit tests: the same draws on every run, so a
//! failure comes back with the same sequence.

/// Draws below `n` from a xorshift64 generator started at `seed` (not zero).
pub(crate) fn draws_below(seed: u64) -> impl FnMut(u64) -> u64 {
    let mut state = seed;
    move |n| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state % n
    }
}
