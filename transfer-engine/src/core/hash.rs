//! The chunk checksum: xxh3-64 over the chunk's bytes, in the order they were planned.

use xxhash_rust::xxh3::Xxh3;

/// Hashes a sequence of byte slices as if they were one concatenated buffer (xxh3-64, seed 0).
///
/// The slices are hashed in order and never copied, so a chunk scattered over many pages is
/// hashed exactly as its writes lay it out. Splitting the same bytes differently gives the same
/// value.
pub fn checksum<'a, I>(parts: I) -> u64
where
    I: IntoIterator<Item = &'a [u8]>,
{
    let mut h = ChunkHasher::new();
    for p in parts {
        h.update(p);
    }
    h.finish()
}

/// Streaming form of [`checksum`], for bytes that arrive piece by piece.
#[derive(Clone)]
pub struct ChunkHasher {
    inner: Xxh3,
}

impl std::fmt::Debug for ChunkHasher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChunkHasher").finish_non_exhaustive()
    }
}

impl Default for ChunkHasher {
    fn default() -> Self {
        Self::new()
    }
}

impl ChunkHasher {
    /// A hasher that has seen no bytes.
    pub fn new() -> Self {
        Self { inner: Xxh3::new() }
    }

    /// Feeds the next bytes.
    pub fn update(&mut self, bytes: &[u8]) {
        self.inner.update(bytes);
    }

    /// The hash of everything fed so far; the hasher can keep going afterwards.
    pub fn finish(&self) -> u64 {
        self.inner.digest()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_does_not_matter() {
        let data: Vec<u8> = (0..=255u8).cycle().take(5000).collect();
        let whole = xxhash_rust::xxh3::xxh3_64(&data);
        assert_eq!(checksum([data.as_slice()]), whole);
        assert_eq!(checksum([&data[..1], &data[1..4000], &data[4000..]]), whole);
        assert_eq!(checksum(data.chunks(7)), whole);
        assert_eq!(
            checksum(std::iter::empty()),
            xxhash_rust::xxh3::xxh3_64(&[])
        );
    }
}
