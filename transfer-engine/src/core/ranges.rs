//! First-fit allocation of byte ranges inside one buffer of fixed length: NIXL's staging memory and
//! a decode's landing memory are lent out this way, range by range.

/// The ranges taken from a buffer of `cap` bytes, each starting at a multiple of 64.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Ranges {
    cap: u64,
    /// `(offset, len)` of every range taken, in offset order.
    live: Vec<(u64, u64)>,
}

impl Ranges {
    /// Nothing taken from a buffer of `cap` bytes.
    pub fn new(cap: u64) -> Self {
        Ranges {
            cap,
            live: Vec::new(),
        }
    }

    /// Takes the lowest free range of `len` bytes (at an offset that is a multiple of 64) and
    /// returns its offset; `None` when none is free or `len` is 0.
    pub fn take(&mut self, len: u64) -> Option<u64> {
        if len == 0 {
            return None;
        }
        let mut at = 0u64;
        let mut slot = self.live.len();
        for (i, &(off, l)) in self.live.iter().enumerate() {
            if off.checked_sub(at)? >= len {
                slot = i;
                break;
            }
            at = off.checked_add(l)?.checked_next_multiple_of(64)?;
        }
        if slot == self.live.len() && self.cap.checked_sub(at)? < len {
            return None;
        }
        self.live.insert(slot, (at, len));
        Some(at)
    }

    /// Gives back the range taken at `off`; false if none was.
    pub fn give(&mut self, off: u64) -> bool {
        match self.live.binary_search_by_key(&off, |&(o, _)| o) {
            Ok(i) => {
                self.live.remove(i);
                true
            }
            Err(_) => false,
        }
    }

    /// Bytes taken now.
    pub fn taken(&self) -> u64 {
        self.live.iter().map(|&(_, l)| l).sum()
    }

    /// Ranges taken now.
    pub fn count(&self) -> usize {
        self.live.len()
    }
}
