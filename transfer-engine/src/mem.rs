//! Memory the engine registers: host buffers it owns, host memory the caller owns, CUDA device memory.
//!
//! A [`MemDesc`] is the plain description a transport registers (address, length, kind). It is built
//! either from a [`HostBuffer`] this module allocated (which the registration then owns), or through
//! the `unsafe` constructors whose `# Safety` sections list what the caller promises.

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
    /// description lives (the engine keeps registrations until every write touching them is over).
    /// Remote peers may write into it at any time while it is registered.
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
    /// made from this description lives.
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

    /// The description a transport registers. The buffer must outlive the registration; the engine
    /// guarantees that by owning the buffer inside the registration.
    pub fn desc(&self) -> MemDesc {
        MemDesc {
            addr: self.map.as_ptr() as u64,
            len: self.map.len() as u64,
            kind: MemKind::Host,
        }
    }
}
