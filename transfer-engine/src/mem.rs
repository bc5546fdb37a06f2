//! Memory the engine registers: host buffers it owns, host memory the caller owns, CUDA device memory.
//!
//! A [`MemDesc`] is the plain description a transport registers (address, length, kind). Registering
//! one directly is `unsafe` ([`Transport::register`](crate::transport::Transport::register)); the safe
//! way is a [`Pool`] moved into a [`Registration`](crate::transport::Registration), which owns the
//! memory (a [`HostBuffer`]) or carries the promise of a caller who described their own memory through
//! the `unsafe` constructors below. Registered memory is never handed out as `&[u8]` or `&mut [u8]`,
//! since peers write into it behind Rust's back: it is read and written by copies ([`Pool::read_at`],
//! [`Pool::write_at`]).

use std::io;

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
    /// Describes caller-owned host memory.
    ///
    /// # Safety
    /// `ptr..ptr+len` must be one live allocation of readable and writable host memory that stays
    /// allocated, and is not unmapped or freed, for as long as any registration made from this
    /// description lives, and after that for as long as a peer may still write into it (an engine
    /// that cannot confirm its peers stopped writing never gives the memory back; see
    /// `DecodeEngine::shutdown`). Remote peers may write into it at any time while it is registered,
    /// so the caller must not hold Rust references (`&[u8]`, `&mut [u8]`) to it during that time.
    pub unsafe fn host_raw(ptr: *mut u8, len: usize) -> Self {
        MemDesc {
            addr: ptr as u64,
            len: len as u64,
            kind: MemKind::Host,
        }
    }

    /// Describes CUDA device memory.
    ///
    /// # Safety
    /// `ptr..ptr+len` must be one live device allocation on CUDA device `device` (as returned by
    /// `cudaMalloc` or the driver API on that device), kept allocated for as long as any registration
    /// made from this description lives and, after that, for as long as a peer may still write into
    /// it (as for [`host_raw`](Self::host_raw)).
    pub unsafe fn cuda_raw(ptr: u64, len: usize, device: u32) -> Self {
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

/// Options for [`HostBuffer::new`].
#[derive(Clone, Copy, Debug, Default)]
pub struct HostOptions {
    /// Back the buffer with huge pages (`MAP_HUGETLB`); fails if the system has none reserved.
    pub huge_pages: bool,
    /// Fault every page in at allocation (`MAP_POPULATE`) so the first transfer does not pay for it.
    pub prefault: bool,
}

/// Page-aligned host memory owned by the engine (an anonymous mapping).
#[derive(Debug)]
pub struct HostBuffer {
    map: memmap2::MmapMut,
}

impl HostBuffer {
    /// Maps `len` bytes of zeroed, page-aligned host memory.
    ///
    /// # Errors
    /// The operating system's error when the mapping fails (no memory, no huge pages reserved).
    pub fn new(len: usize, opts: HostOptions) -> io::Result<Self> {
        let mut o = memmap2::MmapOptions::new();
        o.len(len.max(1));
        if opts.huge_pages {
            o.huge(None);
        }
        if opts.prefault {
            o.populate();
        }
        Ok(HostBuffer { map: o.map_anon()? })
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
    /// Memory the caller owns (host or CUDA), described through `MemDesc`'s `unsafe` constructors,
    /// whose promises cover the registration's whole life and every peer write after it.
    Borrowed(MemDesc),
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
}

impl Pool {
    /// The description to register.
    pub fn desc(&self) -> MemDesc {
        match self {
            Pool::Owned(b) => b.desc(),
            Pool::Borrowed(d) => *d,
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

    /// The host address of `offset..offset+len`, checked against the pool.
    fn host_range(&self, offset: u64, len: usize) -> Result<*mut u8, CopyError> {
        let d = self.desc();
        if d.kind != MemKind::Host {
            return Err(CopyError::NotHost);
        }
        let len64 = len as u64;
        match offset.checked_add(len64) {
            Some(end) if end <= d.len => Ok((d.addr + offset) as usize as *mut u8),
            _ => Err(CopyError::OutOfBounds {
                offset,
                len: len64,
                pool_len: d.len,
            }),
        }
    }

    /// Copies `dst.len()` bytes at `offset` out of the pool.
    ///
    /// A peer may be writing into the range while it is copied (only the caller knows which pages
    /// are settled, for instance after a request completed); the copy then holds a mix of old and
    /// new bytes, never more than that.
    ///
    /// # Errors
    /// [`CopyError`] for a range outside the pool or a device pool.
    pub fn read_at(&self, offset: u64, dst: &mut [u8]) -> Result<(), CopyError> {
        let src = self.host_range(offset, dst.len())?;
        // SAFETY: `src..src+len` lies inside the pool (checked above), which is live host memory: an
        // owned mapping, or memory the caller promised live through `MemDesc::host_raw`. `dst` is a
        // distinct Rust slice, so the ranges do not overlap. The pool is only ever accessed through
        // raw pointers (no Rust reference to it exists while registered), so a peer's concurrent
        // write can change which bytes we copy but cannot invalidate a reference.
        unsafe { std::ptr::copy_nonoverlapping(src, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    /// Copies `src` into the pool at `offset` (filling a prefill's pages, poisoning a decode's pages
    /// before they are handed out).
    ///
    /// # Errors
    /// [`CopyError`] for a range outside the pool or a device pool.
    pub fn write_at(&self, offset: u64, src: &[u8]) -> Result<(), CopyError> {
        let dst = self.host_range(offset, src.len())?;
        // SAFETY: as in `read_at`: the range is inside live host memory that no Rust reference
        // covers, and `src` is a distinct slice.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len()) };
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
        self.host_range(offset, usize::try_from(len).unwrap_or(usize::MAX))?;
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
        let dst = self.host_range(offset, len)?;
        // SAFETY: as in `write_at`.
        unsafe { std::ptr::write_bytes(dst, byte, len) };
        Ok(())
    }
}
