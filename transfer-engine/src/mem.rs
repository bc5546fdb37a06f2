//! Memory the engine registers: host buffers it owns, host memory the caller owns, CUDA device memory.
//!
//! A [`MemDesc`] is the plain description a transport registers (address, length, kind). Registering
//! one directly is `unsafe` ([`Transport::register`](crate::transport::Transport::register)); the safe
//! way is a [`Pool`] moved into a [`Registration`](crate::transport::Registration), which owns the
//! memory (a [`HostBuffer`]) or carries the promise of a caller who lent their own memory through the
//! `unsafe` [`Pool::borrowed`]. Registered memory is never handed out as `&[u8]` or `&mut [u8]`,
//! since peers write into it behind Rust's back: it is read and written by copies made of 8-byte
//! atomic loads and stores ([`Pool::read_at`], [`Pool::write_at`]).

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};

/// Where a region lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum MemKind {
    /// Host memory.
    Host,
    /// CUDA device memory of the given device ordinal.
    Cuda {
        /// CUDA device ordinal.
        device: u32,
    },
}

/// A contiguous range of memory a transport can register.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemDesc {
    addr: u64,
    len: u64,
    kind: MemKind,
}

impl MemDesc {
    /// Describes caller-owned host memory. Describing is harmless; what the memory must satisfy is
    /// promised where it is used: [`Pool::borrowed`] or
    /// [`Transport::register`](crate::transport::Transport::register), both `unsafe`.
    pub fn host_raw(ptr: *mut u8, len: usize) -> Self {
        MemDesc {
            addr: ptr as u64,
            len: len as u64,
            kind: MemKind::Host,
        }
    }

    /// Describes CUDA device memory of device `device`; see [`host_raw`](Self::host_raw).
    pub fn cuda_raw(ptr: u64, len: usize, device: u32) -> Self {
        MemDesc {
            addr: ptr,
            len: len as u64,
            kind: MemKind::Cuda { device },
        }
    }

    /// Start address.
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the range is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Where the memory lives.
    pub fn kind(&self) -> MemKind {
        self.kind
    }
}

/// Faults in every page (`page` bytes) of `buf` by writing a zero into it (the bytes of a fresh
/// anonymous mapping are zero already), a large buffer in parts on threads of their own
/// ([`part_len`]).
fn prefault(buf: &mut [u8], page: usize) {
    let part = part_len(buf.len(), page);
    let touch = |p: &mut [u8]| {
        p.iter_mut().step_by(page).for_each(|b| *b = 0);
        Ok(())
    };
    // Touching memory cannot fail: the only error is a panicked thread's, which the panic reports.
    let _ = on_threads(buf.chunks_mut(part.max(1)), touch);
}

/// How long the parts of a range of `len` bytes are when the range is made (its pages faulted in)
/// on several threads, a whole number of `align` bytes each: one part per core, up to 8, each at
/// least 256 MiB; `len` itself (one part) for a shorter range. The kernel makes the pages one fault
/// at a time on the faulting thread, so a large range goes faster split.
pub(crate) fn part_len(len: usize, align: usize) -> usize {
    /// Parts at least this long get a thread each.
    const PART_MIN: usize = 256 << 20;
    /// The most threads one range is split over.
    const THREADS_MAX: usize = 8;
    let threads = std::thread::available_parallelism()
        .map_or(1, usize::from)
        .min(len / PART_MIN)
        .clamp(1, THREADS_MAX);
    if threads == 1 {
        return len;
    }
    len.div_ceil(threads).next_multiple_of(align.max(1))
}

/// Runs `f` on each of `parts`, each on a thread of its own (scoped: all are over when this
/// returns), the first and any whose thread cannot be had on this thread; returns the first error.
pub(crate) fn on_threads<T: Send>(
    parts: impl IntoIterator<Item = T>,
    f: impl Fn(T) -> io::Result<()> + Sync,
) -> io::Result<()> {
    let slots: Vec<std::sync::Mutex<Option<T>>> = parts
        .into_iter()
        .map(|p| std::sync::Mutex::new(Some(p)))
        .collect();
    // Each slot is taken once, by whichever thread runs its part.
    let run = |i: usize| {
        let part = slots.get(i).and_then(|s| {
            s.lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .take()
        });
        part.map_or(Ok(()), &f)
    };
    std::thread::scope(|scope| {
        let run = &run;
        let mut result = Ok(());
        let mut threads = Vec::new();
        for i in 1..slots.len() {
            match std::thread::Builder::new().spawn_scoped(scope, move || run(i)) {
                Ok(h) => threads.push(h),
                Err(_) => result = result.and(run(i)),
            }
        }
        result = result.and(run(0));
        for h in threads {
            let r = h
                .join()
                .unwrap_or_else(|_| Err(io::Error::other("a thread making pages panicked")));
            result = result.and(r);
        }
        result
    })
}

/// Options for [`HostBuffer::new`].
#[derive(Clone, Copy, Debug, Default)]
pub struct HostOptions {
    /// Back the buffer with huge pages (`MAP_HUGETLB`); fails if the system has none reserved.
    pub huge_pages: bool,
    /// Fault every page in at allocation (each written once, a large buffer by several threads) so
    /// the first transfer does not pay for it.
    pub prefault: bool,
}

/// Page-aligned host memory owned by the engine (an anonymous mapping).
#[derive(Debug)]
pub struct HostBuffer {
    map: memmap2::MmapMut,
}

impl HostBuffer {
    /// Maps `len` bytes (rounded up to a multiple of 8, at least 8) of zeroed, page-aligned host
    /// memory.
    ///
    /// # Errors
    /// The operating system's error when the mapping fails (no memory, no huge pages reserved).
    pub fn new(len: usize, opts: HostOptions) -> io::Result<Self> {
        let mut o = memmap2::MmapOptions::new();
        // Whole words, so that pool copies (which move 8-byte words) reach every byte.
        o.len(len.max(1).next_multiple_of(WORD as usize));
        if opts.huge_pages {
            o.huge(None);
        }
        let mut map = o.map_anon()?;
        if opts.prefault {
            // One write per page: 2 MiB ones where the mapping has huge pages (the usual size; a
            // larger one is only written more often than it needs).
            prefault(&mut map, if opts.huge_pages { 2 << 20 } else { 4096 });
        }
        Ok(HostBuffer { map })
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        &self.map
    }

    /// The bytes, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut self.map
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// The description a transport registers. Registering it directly is `unsafe`; a
    /// [`Pool::Owned`] inside a [`Registration`](crate::transport::Registration) keeps the buffer
    /// alive for as long as the registration (and a peer's writes) need it.
    pub fn desc(&self) -> MemDesc {
        MemDesc {
            addr: self.map.as_ptr() as u64,
            len: self.map.len() as u64,
            kind: MemKind::Host,
        }
    }
}

/// Memory an engine or a [`Registration`](crate::transport::Registration) registers: owned, or the
/// caller's own.
#[derive(Debug)]
pub enum Pool {
    /// Host memory the registration owns.
    Owned(HostBuffer),
    /// Memory the caller owns (host or CUDA), made only through the `unsafe` [`Pool::borrowed`],
    /// whose promises cover the registration's whole life and every peer write after it.
    Borrowed(Borrowed),
    /// A request for `len` bytes of host memory that the transport allocates when the pool is
    /// registered, shareable with same-host peers where the backend can (see
    /// [`Transport::allocate`](crate::transport::Transport::allocate)); a backend that cannot
    /// allocate gets an owned [`HostBuffer`] instead. Holds no memory until registered.
    Shared(u64),
    /// Memory a transport allocated for a registration (what [`Pool::Shared`] becomes once
    /// registered); it lives exactly as long as that registration.
    Transport(TransportMem),
}

/// Host memory a transport allocated and frees; see [`Pool::Transport`].
#[derive(Debug)]
pub struct TransportMem(MemDesc);

impl TransportMem {
    /// Wraps what a transport's `allocate` returned (only the registration that owns it makes one).
    pub(crate) fn new(desc: MemDesc) -> Self {
        TransportMem(desc)
    }

    /// The memory's description.
    pub fn desc(&self) -> MemDesc {
        self.0
    }
}

/// Caller-owned memory inside a [`Pool`]; see [`Pool::borrowed`].
pub struct Borrowed {
    desc: MemDesc,
    /// What keeps the memory allocated ([`Pool::borrowed_with`]): dropped with the pool, so only
    /// once the pool's registration is over and no peer may still write into it; leaked with it.
    owner: Option<Box<dyn Send + Sync>>,
}

impl std::fmt::Debug for Borrowed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Borrowed")
            .field("desc", &self.desc)
            .field("owned", &self.owner.is_some())
            .finish()
    }
}

impl Borrowed {
    /// The memory's description.
    pub fn desc(&self) -> MemDesc {
        self.desc
    }
}

/// Why a copy into or out of a [`Pool`] was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CopyError {
    /// The range does not lie inside the pool.
    #[error("range {offset}+{len} is outside the pool of {pool_len} bytes")]
    OutOfBounds {
        /// Start of the range.
        offset: u64,
        /// Its length.
        len: u64,
        /// The pool's length.
        pool_len: u64,
    },
    /// The pool is device memory, which host copies cannot reach.
    #[error("the pool is device memory; copy it with the device's own API")]
    NotHost,
    /// The pool is a [`Pool::Shared`] request that no transport has allocated yet.
    #[error("the pool is not allocated until it is registered")]
    NotAllocated,
    /// The pool's start or length is not a multiple of 8 bytes, which host copies need (they move
    /// whole 8-byte words; see [`Pool::read_at`]).
    #[error("the pool at {addr:#x} of {len} bytes is not 8-byte aligned in start and length")]
    Unaligned {
        /// The pool's start.
        addr: u64,
        /// Its length.
        len: u64,
    },
}

/// Word size of the atomic copies.
const WORD: u64 = 8;

impl Pool {
    /// Memory the caller owns, to register.
    ///
    /// # Safety
    /// `desc` must describe one live allocation of its kind (host memory readable and writable; CUDA
    /// memory on that device, as `cudaMalloc` or the driver API returned it), and the caller must
    /// keep it allocated, not unmapped, freed or reused, for as long as the pool (or a
    /// [`Registration`](crate::transport::Registration) holding it) lives, and after that for as
    /// long as a peer that was given its registration may still write into it (an engine that
    /// cannot confirm its peers stopped writing leaks the pool instead of dropping it; see
    /// `DecodeEngine::shutdown`). Peers write into it at any time while it is registered, so the
    /// caller must not access it through Rust references (`&[u8]`, `&mut [u8]`) meanwhile.
    pub unsafe fn borrowed(desc: MemDesc) -> Pool {
        Pool::Borrowed(Borrowed { desc, owner: None })
    }

    /// [`borrowed`](Self::borrowed) memory together with `owner`, the value that keeps it
    /// allocated (a reference to the object the memory belongs to). The pool drops `owner` when it
    /// is dropped, which a [`Registration`](crate::transport::Registration) does only after its
    /// deregistration (and so every posted write from or into the memory) is over and no peer may
    /// still write into it; a pool that is leaked instead leaks `owner` with it.
    ///
    /// # Safety
    /// As [`borrowed`](Self::borrowed), with "the caller keeps it allocated" met by holding
    /// `owner`: `desc` stays one live allocation of its kind for as long as `owner` lives.
    pub unsafe fn borrowed_with(desc: MemDesc, owner: Box<dyn Send + Sync>) -> Pool {
        Pool::Borrowed(Borrowed {
            desc,
            owner: Some(owner),
        })
    }

    /// The description to register (for [`Pool::Shared`], only its length is meaningful).
    pub fn desc(&self) -> MemDesc {
        match self {
            Pool::Owned(b) => b.desc(),
            Pool::Borrowed(b) => b.desc,
            Pool::Shared(len) => MemDesc {
                addr: 0,
                len: *len,
                kind: MemKind::Host,
            },
            Pool::Transport(t) => t.0,
        }
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.desc().len()
    }

    /// Whether the pool is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The pool's start, after checking that `offset..offset+len` lies inside it and that host copies
    /// can reach it.
    fn host_range(&self, offset: u64, len: u64) -> Result<u64, CopyError> {
        let d = self.desc();
        if d.kind != MemKind::Host {
            return Err(CopyError::NotHost);
        }
        if let Pool::Shared(_) = self {
            return Err(CopyError::NotAllocated);
        }
        if !d.addr.is_multiple_of(WORD) || !d.len.is_multiple_of(WORD) {
            return Err(CopyError::Unaligned {
                addr: d.addr,
                len: d.len,
            });
        }
        match offset.checked_add(len) {
            Some(end) if end <= d.len => Ok(d.addr),
            _ => Err(CopyError::OutOfBounds {
                offset,
                len,
                pool_len: d.len,
            }),
        }
    }

    /// The pool's word that holds byte `at` of the pool.
    ///
    /// # Safety
    /// `base` is the start of this pool (8-byte aligned, a multiple of 8 long, checked by
    /// `host_range`) and `at` lies inside it.
    unsafe fn word(&self, base: u64, at: u64) -> &AtomicU64 {
        let ptr = (base + at / WORD * WORD) as usize as *mut u64;
        // SAFETY: `ptr` is 8-aligned and lies inside the pool, which is live host memory for as long
        // as the pool exists (owned, or promised by `Pool::borrowed`'s caller); the reference is used
        // only for the duration of one copy, while `&self` keeps the pool alive. Every access this
        // crate makes to pool memory goes through 8-byte atomics (here), so Rust-side accesses never
        // mix sizes or race non-atomically; peers write from outside the process or through the
        // library, never through Rust references.
        unsafe { AtomicU64::from_ptr(ptr) }
    }

    /// Copies `dst.len()` bytes at `offset` out of the pool.
    ///
    /// The pool is read with relaxed 8-byte atomic loads: peers (and other threads of ours) may
    /// write into it at any time, so only the caller knows which pages are settled (for instance
    /// after a request completed). A copy that races a write holds a mix of old and new bytes,
    /// never more than that.
    ///
    /// # Errors
    /// [`CopyError`] for a range outside the pool, a device pool, or an unaligned one.
    pub fn read_at(&self, offset: u64, dst: &mut [u8]) -> Result<(), CopyError> {
        let base = self.host_range(offset, dst.len() as u64)?;
        let mut at = offset;
        let mut out = &mut dst[..];
        while !out.is_empty() {
            let skip = (at % WORD) as usize;
            if skip == 0 && out.len() >= WORD as usize {
                // Whole words: one load each, a copy of a constant size.
                let (words, rest) = out.split_at_mut(out.len() / WORD as usize * WORD as usize);
                for w in words.chunks_exact_mut(WORD as usize) {
                    // SAFETY: `at` lies inside the pool checked above.
                    let v = unsafe { self.word(base, at) }.load(Ordering::Relaxed);
                    w.copy_from_slice(&v.to_ne_bytes());
                    at += WORD;
                }
                out = rest;
                continue;
            }
            let n = (WORD as usize - skip).min(out.len());
            // SAFETY: `at` lies inside the pool checked above.
            let w = unsafe { self.word(base, at) }.load(Ordering::Relaxed);
            out[..n].copy_from_slice(&w.to_ne_bytes()[skip..skip + n]);
            out = &mut out[n..];
            at += n as u64;
        }
        Ok(())
    }

    /// Copies `src` into the pool at `offset` (filling a prefill's pages, poisoning a decode's pages
    /// before they are handed out), with relaxed 8-byte atomic stores; a word only partly covered is
    /// merged with a compare-and-swap, so bytes outside the range are never written.
    ///
    /// # Errors
    /// As [`read_at`](Self::read_at).
    pub fn write_at(&self, offset: u64, src: &[u8]) -> Result<(), CopyError> {
        let base = self.host_range(offset, src.len() as u64)?;
        let mut at = offset;
        let mut rest = src;
        while !rest.is_empty() {
            let skip = (at % WORD) as usize;
            if skip == 0 && rest.len() >= WORD as usize {
                // Whole words: one store each.
                let (words, tail) = rest.split_at(rest.len() / WORD as usize * WORD as usize);
                for w in words.chunks_exact(WORD as usize) {
                    let mut b = [0u8; WORD as usize];
                    b.copy_from_slice(w);
                    // SAFETY: `at` lies inside the pool checked above.
                    unsafe { self.word(base, at) }.store(u64::from_ne_bytes(b), Ordering::Relaxed);
                    at += WORD;
                }
                rest = tail;
                continue;
            }
            let n = (WORD as usize - skip).min(rest.len());
            // SAFETY: `at` lies inside the pool checked above.
            let word = unsafe { self.word(base, at) };
            if n == WORD as usize {
                let mut b = [0u8; WORD as usize];
                b.copy_from_slice(&rest[..n]);
                word.store(u64::from_ne_bytes(b), Ordering::Relaxed);
            } else {
                let _ = word.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |w| {
                    let mut b = w.to_ne_bytes();
                    b[skip..skip + n].copy_from_slice(&rest[..n]);
                    Some(u64::from_ne_bytes(b))
                });
            }
            rest = &rest[n..];
            at += n as u64;
        }
        Ok(())
    }

    /// Copies `len` bytes at `offset` into `dst` at `dst_offset`, with the atomics of
    /// [`read_at`](Self::read_at) and [`write_at`](Self::write_at): word by word where both ranges
    /// are whole words, through a small buffer otherwise.
    ///
    /// # Errors
    /// As [`read_at`](Self::read_at), for either range.
    pub fn copy_to(
        &self,
        offset: u64,
        dst: &Pool,
        dst_offset: u64,
        len: u64,
    ) -> Result<(), CopyError> {
        let from = self.host_range(offset, len)?;
        let to = dst.host_range(dst_offset, len)?;
        if (offset | dst_offset | len).is_multiple_of(WORD) {
            for i in (0..len).step_by(WORD as usize) {
                // SAFETY: `offset + i` and `dst_offset + i` lie inside their pools, checked above.
                let v = unsafe { self.word(from, offset + i) }.load(Ordering::Relaxed);
                // SAFETY: as above.
                unsafe { dst.word(to, dst_offset + i) }.store(v, Ordering::Relaxed);
            }
            return Ok(());
        }
        let mut buf = [0u8; 4096];
        let mut at = 0;
        while at < len {
            let n = (len - at).min(buf.len() as u64) as usize;
            self.read_at(offset + at, &mut buf[..n])?;
            dst.write_at(dst_offset + at, &buf[..n])?;
            at += n as u64;
        }
        Ok(())
    }

    /// Copies `rows` rows of `len` bytes, packed from `offset`, into `dst` from `dst_offset`, row
    /// `i` at `dst_offset + i * dst_stride`, as [`copy_to`](Self::copy_to) copies each.
    ///
    /// # Errors
    /// As [`copy_to`](Self::copy_to), checked for every row before any is copied.
    pub fn copy_rows_to(
        &self,
        offset: u64,
        dst: &Pool,
        dst_offset: u64,
        len: u64,
        rows: u64,
        dst_stride: u64,
    ) -> Result<(), CopyError> {
        let packed = len.checked_mul(rows).ok_or(CopyError::OutOfBounds {
            offset,
            len: u64::MAX,
            pool_len: self.len(),
        })?;
        // The destination's span: from the first row's start to the last row's end (nothing for
        // no rows); a span that overflows is out of any pool.
        let spread = match rows.checked_sub(1) {
            None => Some(0),
            Some(r) => r.checked_mul(dst_stride).and_then(|o| o.checked_add(len)),
        }
        .ok_or(CopyError::OutOfBounds {
            offset: dst_offset,
            len: u64::MAX,
            pool_len: dst.len(),
        })?;
        let from = self.host_range(offset, packed)?;
        let to = dst.host_range(dst_offset, spread)?;
        if !(offset | dst_offset | len | dst_stride).is_multiple_of(WORD) {
            for i in 0..rows {
                self.copy_to(offset + i * len, dst, dst_offset + i * dst_stride, len)?;
            }
            return Ok(());
        }
        for i in 0..rows {
            let (s, d) = (offset + i * len, dst_offset + i * dst_stride);
            let mut at = 0;
            while at < len {
                // SAFETY: `s + at` and `d + at` lie inside their pools: every row's range was
                // checked above.
                let v = unsafe { self.word(from, s + at) }.load(Ordering::Relaxed);
                // SAFETY: as above.
                unsafe { dst.word(to, d + at) }.store(v, Ordering::Relaxed);
                at += WORD;
            }
        }
        Ok(())
    }

    /// Hands `offset..offset+len` to `f` piece by piece, each piece copied out first (see
    /// [`read_at`](Self::read_at)), for hashing or comparing a range without a second buffer as large
    /// as the range.
    ///
    /// # Errors
    /// As [`read_at`](Self::read_at); `f` is not called then.
    pub fn read_pieces(
        &self,
        offset: u64,
        len: u64,
        mut f: impl FnMut(&[u8]),
    ) -> Result<(), CopyError> {
        const PIECE: u64 = 64 << 10;
        self.host_range(offset, len)?;
        let mut buf = [0u8; PIECE as usize];
        let mut at = 0;
        while at < len {
            let n = (len - at).min(PIECE) as usize;
            self.read_at(offset + at, &mut buf[..n])?;
            f(&buf[..n]);
            at += n as u64;
        }
        Ok(())
    }

    /// Sets `len` bytes at `offset` to `byte`.
    ///
    /// # Errors
    /// As [`write_at`](Self::write_at).
    pub fn fill_at(&self, offset: u64, len: usize, byte: u8) -> Result<(), CopyError> {
        self.host_range(offset, len as u64)?;
        let chunk = [byte; 4096];
        let mut at = 0;
        while at < len {
            let n = (len - at).min(chunk.len());
            self.write_at(offset + at as u64, &chunk[..n])?;
            at += n;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every part runs exactly once, on whichever thread, and the first error comes back.
    #[test]
    fn on_threads_runs_every_part_once() {
        let seen = std::sync::Mutex::new(Vec::new());
        on_threads(0..9u32, |i| {
            seen.lock().unwrap_or_else(|e| e.into_inner()).push(i);
            Ok(())
        })
        .unwrap_or_else(|e| panic!("{e}"));
        let mut seen = seen.into_inner().unwrap_or_else(|e| e.into_inner());
        seen.sort_unstable();
        assert_eq!(seen, (0..9).collect::<Vec<_>>());
        let err = on_threads(0..4u32, |i| {
            if i == 2 {
                Err(io::Error::other("part 2"))
            } else {
                Ok(())
            }
        });
        assert_eq!(err.map_err(|e| e.to_string()), Err("part 2".to_string()));
        assert!(on_threads(std::iter::empty::<u32>(), |_| Ok(())).is_ok());
    }

    /// Parts are whole multiples of the alignment and cover the range; a short range is one part.
    #[test]
    fn parts_cover_the_range_in_aligned_pieces() {
        assert_eq!(part_len(100 << 20, 4096), 100 << 20);
        let len = (3 << 30) + 12_288;
        let part = part_len(len, 2 << 20);
        // One part on a machine of one core.
        assert!(
            part == len || (part.is_multiple_of(2 << 20) && part >= 256 << 20),
            "{part}"
        );
        assert!(part * 8 >= len);
    }

    /// A prefaulted buffer reads zero everywhere.
    #[test]
    fn a_prefaulted_buffer_is_zero() {
        let b = HostBuffer::new(
            3 << 20,
            HostOptions {
                prefault: true,
                ..HostOptions::default()
            },
        )
        .unwrap_or_else(|e| panic!("{e}"));
        assert!(b.as_slice().iter().all(|&x| x == 0));
    }
}
