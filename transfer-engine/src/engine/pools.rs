//! An engine's pool as one or more registrations: the layout's buffer split into equal, consecutive
//! segments, each registered on its own. One segment is the usual packed pool; servers that keep one
//! buffer per layer (and per K and V, as SGLang does) give one pool per buffer, in layout order.

use super::EngineError;
use crate::mem::{CopyError, MemDesc, Pool};
use crate::transport::{RegionId, Registration, RemoteRegion, Transport};
use std::sync::Arc;

/// Where the bytes `[offset, offset + len)` of a segmented buffer lie: pieces of at most one
/// segment each, as `(segment, offset in it, length, position in the range)`.
pub(crate) fn split(
    offset: u64,
    len: u64,
    seg: u64,
) -> impl Iterator<Item = (usize, u64, u64, u64)> {
    let mut pos = 0u64;
    std::iter::from_fn(move || {
        if pos >= len {
            return None;
        }
        let at = offset.checked_add(pos)?;
        let (i, off) = (at / seg, at % seg);
        let n = (seg - off).min(len - pos);
        let piece = (usize::try_from(i).ok()?, off, n, pos);
        pos += n;
        Some(piece)
    })
}

/// The segment length of a buffer of `buffer_len` bytes in `regions` registrations of `region_len`
/// bytes each (the smallest): the whole first region when there is one.
///
/// # Errors
/// No region, a buffer that does not split evenly, or a region shorter than its segment.
pub(crate) fn segment(
    buffer_len: u64,
    regions: usize,
    region_len: u64,
) -> Result<u64, EngineError> {
    let n = u64::try_from(regions).unwrap_or(u64::MAX);
    match n {
        0 => Err(EngineError::Config(
            "a pool needs at least one region".into(),
        )),
        1 => Ok(region_len.max(buffer_len)),
        _ if !buffer_len.is_multiple_of(n) || buffer_len == 0 => Err(EngineError::Config(format!(
            "a layout of {buffer_len} bytes does not split into {n} equal regions"
        ))),
        _ if region_len < buffer_len / n => Err(EngineError::Config(format!(
            "a region of {region_len} bytes is shorter than its {} bytes of the layout",
            buffer_len / n
        ))),
        _ => Ok(buffer_len / n),
    }
}

/// An engine's registered pool.
#[derive(Debug)]
pub(crate) struct Pools {
    regs: Vec<Registration>,
    seg: u64,
}

impl Pools {
    /// Registers `pools` (in layout order) as the segments of a buffer of `buffer_len` bytes.
    ///
    /// # Errors
    /// Regions that do not split the layout evenly, of different kinds, or a transport failure (the
    /// registrations made so far are dropped with it; none was handed out yet).
    pub(crate) fn register(
        transport: &Arc<dyn Transport>,
        pools: Vec<Pool>,
        buffer_len: u64,
    ) -> Result<Self, EngineError> {
        let shortest = pools.iter().map(|p| p.desc().len()).min().unwrap_or(0);
        let seg = segment(buffer_len, pools.len(), shortest)?;
        if let Some(first) = pools.first()
            && pools.iter().any(|p| p.desc().kind() != first.desc().kind())
        {
            return Err(EngineError::Config(
                "every region of a pool must be the same kind of memory".into(),
            ));
        }
        let mut regs = Vec::with_capacity(pools.len());
        for p in pools {
            regs.push(Registration::new(transport, p)?);
        }
        Ok(Pools { regs, seg })
    }

    /// [`register`](Self::register) on a thread for blocking work, not the runtime's: making a
    /// large pool's pages takes seconds (6.3 to 7.5 s for 16 GiB here), which would hold one of the
    /// runtime's workers meanwhile.
    ///
    /// # Errors
    /// As [`register`](Self::register).
    pub(crate) async fn register_blocking(
        transport: &Arc<dyn Transport>,
        pools: Vec<Pool>,
        buffer_len: u64,
    ) -> Result<Self, EngineError> {
        let transport = transport.clone();
        tokio::task::spawn_blocking(move || Self::register(&transport, pools, buffer_len))
            .await
            .map_err(|e| EngineError::Config(format!("registering the pool: {e}")))?
    }

    /// Bytes of one segment.
    pub(crate) fn segment_len(&self) -> u64 {
        self.seg
    }

    /// The registration of segment `i`.
    pub(crate) fn id(&self, i: usize) -> Option<RegionId> {
        self.regs.get(i).map(Registration::id)
    }

    /// Every segment's remote description, in order (each is then exported: see
    /// [`Registration::remote`]).
    pub(crate) fn remotes(&self) -> Vec<RemoteRegion> {
        self.regs.iter().map(|r| r.remote().clone()).collect()
    }

    /// Marks every segment exported, as [`remotes`](Self::remotes) does, for peers that learn the
    /// pool another way (an external rank, told by its server): from now on it is leaked rather
    /// than freed unless the engine shows that no write can still land.
    pub(crate) fn mark_exported(&self) {
        for r in &self.regs {
            let _ = r.remote();
        }
    }

    /// The first segment, for callers that can hand out only one.
    pub(crate) fn single(&self) -> Option<&Registration> {
        match self.regs.as_slice() {
            [one] => Some(one),
            _ => None,
        }
    }

    /// The memory of the first segment (all are of its kind).
    pub(crate) fn desc(&self) -> Option<MemDesc> {
        self.regs.first().and_then(Registration::desc)
    }

    /// No peer writes into any segment any more.
    pub(crate) fn mark_quiesced(&self) {
        for r in &self.regs {
            r.mark_quiesced();
        }
    }

    fn each(
        &self,
        offset: u64,
        len: u64,
        mut f: impl FnMut(&Registration, u64, u64, u64) -> Result<(), CopyError>,
    ) -> Result<(), CopyError> {
        let total = self.seg.saturating_mul(self.regs.len() as u64);
        if offset.checked_add(len).is_none_or(|end| end > total) {
            return Err(CopyError::OutOfBounds {
                offset,
                len,
                pool_len: total,
            });
        }
        for (i, off, n, pos) in split(offset, len, self.seg) {
            let r = self.regs.get(i).ok_or(CopyError::OutOfBounds {
                offset,
                len,
                pool_len: total,
            })?;
            f(r, off, n, pos)?;
        }
        Ok(())
    }

    /// Copies `dst.len()` bytes at `offset` out of the pool.
    pub(crate) fn read_at(&self, offset: u64, dst: &mut [u8]) -> Result<(), CopyError> {
        self.each(offset, dst.len() as u64, |r, off, n, pos| {
            r.read_at(off, &mut dst[pos as usize..(pos + n) as usize])
        })
    }

    /// Copies `src` into the pool at `offset`.
    pub(crate) fn write_at(&self, offset: u64, src: &[u8]) -> Result<(), CopyError> {
        self.each(offset, src.len() as u64, |r, off, n, pos| {
            r.write_at(off, &src[pos as usize..(pos + n) as usize])
        })
    }

    /// Copies `len` bytes at `src_offset` of `src` into the pool at `offset`.
    pub(crate) fn copy_from(
        &self,
        offset: u64,
        src: &Registration,
        src_offset: u64,
        len: u64,
    ) -> Result<(), CopyError> {
        self.each(offset, len, |r, off, n, pos| {
            src.copy_to(src_offset + pos, r, off, n)
        })
    }

    /// Hands `f` the bytes at `offset..offset + len`, in order, piece by piece.
    pub(crate) fn read_pieces(
        &self,
        offset: u64,
        len: u64,
        mut f: impl FnMut(&[u8]),
    ) -> Result<(), CopyError> {
        self.each(offset, len, |r, off, n, _| r.read_pieces(off, n, &mut f))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// The pieces cover the range exactly, in order, none crossing a segment boundary.
        #[test]
        fn split_covers_the_range(offset in 0u64..10_000, len in 0u64..10_000, seg in 1u64..3000) {
            let mut next = offset;
            let mut pos = 0;
            for (i, off, n, p) in split(offset, len, seg) {
                prop_assert!(n > 0 && off + n <= seg);
                prop_assert_eq!(i as u64 * seg + off, next);
                prop_assert_eq!(p, pos);
                next += n;
                pos += n;
            }
            prop_assert_eq!(pos, len);
        }
    }

    #[test]
    fn segments_must_split_the_layout() {
        assert_eq!(segment(1000, 1, 4096).ok(), Some(4096));
        assert_eq!(segment(1000, 4, 250).ok(), Some(250));
        assert!(segment(1000, 3, 400).is_err());
        assert!(segment(1000, 4, 249).is_err());
        assert!(segment(1000, 0, 0).is_err());
    }
}
