//! Memory from Python for an engine's pool, and what keeps it alive: the crate's one `unsafe` block.
//!
//! Three forms are accepted:
//! - an object with the buffer protocol (a numpy array, `bytearray`, `mmap`): writable and
//!   C-contiguous; the engine holds the buffer (so the exporter can neither resize nor free it);
//! - an object with `data_ptr()` (a torch tensor): contiguous; the engine holds a reference to it;
//! - `(pointer, length)` or a list of them: raw memory the caller keeps alive, as with NIXL's own
//!   registration calls. Adjacent regions (in address order) become one registration; otherwise each
//!   is registered on its own and they split the layout into equal segments, in order (SGLang's one
//!   buffer per layer, then per K and V).
//!
//! Each pool holds what keeps its memory alive, and drops it only once its registration is over: no
//! posted write still reads or writes the memory and no peer may write into it any more (a decode
//! `shutdown` that every rank confirmed); a pool whose engine cannot tell is leaked, never released.

use crate::errors;
use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};
use transfer_engine::engine::Pool;
use transfer_engine::mem::{MemDesc, MemKind};

/// What keeps a pool's memory alive.
enum Keep {
    /// A reference to the object that owns the memory (a tensor), or that holds a buffer export of
    /// it (a ctypes array made `from_buffer`).
    Object(Py<PyAny>),
    /// Raw memory: the caller's promise.
    Raw,
}

/// A pool's memory as Python gave it: one region, or several that split the layout.
pub(crate) struct Memory {
    descs: Vec<MemDesc>,
    keep: Keep,
}

fn device_kind(device: &str) -> PyResult<MemKind> {
    if device == "cpu" {
        return Ok(MemKind::Host);
    }
    if let Some(n) = device.strip_prefix("cuda:")
        && let Ok(device) = n.parse::<u32>()
    {
        return Ok(MemKind::Cuda { device });
    }
    if device == "cuda" {
        return Ok(MemKind::Cuda { device: 0 });
    }
    Err(errors::config(format!(
        "device must be \"cpu\", \"cuda\" or \"cuda:N\", not {device:?}"
    )))
}

fn desc(addr: u64, len: u64, kind: MemKind) -> PyResult<MemDesc> {
    if addr == 0 || len == 0 {
        return Err(errors::config(format!(
            "memory at {addr:#x} of {len} bytes: pointer and length must be non-zero"
        )));
    }
    if addr.checked_add(len).is_none() {
        return Err(errors::config(format!(
            "memory at {addr:#x} of {len} bytes wraps around the address space"
        )));
    }
    let len = usize::try_from(len).map_err(|_| errors::config("memory length overflows"))?;
    Ok(match kind {
        MemKind::Host => MemDesc::host_raw(addr as *mut u8, len),
        MemKind::Cuda { device } => MemDesc::cuda_raw(addr, len, device),
        _ => return Err(errors::config("unsupported memory kind")),
    })
}

fn pair(item: &Bound<'_, PyAny>) -> PyResult<(u64, u64)> {
    item.extract::<(u64, u64)>()
        .map_err(|_| errors::config("memory regions must be (pointer, length) pairs of integers"))
}

impl Memory {
    /// Memory from `obj` (see the module doc); `device` applies to raw pointers.
    pub(crate) fn from_py(obj: &Bound<'_, PyAny>, device: &str) -> PyResult<Memory> {
        let py = obj.py();
        if obj.is_instance_of::<PyTuple>() || obj.is_instance_of::<PyList>() {
            let kind = device_kind(device)?;
            let regions: Vec<(u64, u64)> = if obj.is_instance_of::<PyTuple>() {
                vec![pair(obj)?]
            } else {
                obj.try_iter()?
                    .map(|i| pair(&i?))
                    .collect::<PyResult<_>>()?
            };
            let Some(&(start, first_len)) = regions.first() else {
                return Err(errors::config("memory is an empty list of regions"));
            };
            let mut end = start
                .checked_add(first_len)
                .ok_or_else(|| errors::config("memory region wraps around"))?;
            let adjacent = regions[1..].iter().all(|&(addr, len)| {
                let ok = addr == end;
                end = addr.saturating_add(len);
                ok
            });
            let descs = if adjacent {
                vec![desc(start, end - start, kind)?]
            } else {
                regions
                    .iter()
                    .map(|&(addr, len)| desc(addr, len, kind))
                    .collect::<PyResult<_>>()?
            };
            return Ok(Memory {
                descs,
                keep: Keep::Raw,
            });
        }
        if obj.hasattr("data_ptr")? {
            // A tensor: its own storage, contiguous, on its own device.
            if !obj.call_method0("is_contiguous")?.extract::<bool>()? {
                return Err(errors::config("the tensor must be contiguous"));
            }
            let addr: u64 = obj.call_method0("data_ptr")?.extract()?;
            let n: u64 = obj.call_method0("numel")?.extract()?;
            let size: u64 = obj.call_method0("element_size")?.extract()?;
            let dev = obj.getattr("device")?;
            let kind = match dev.getattr("type")?.extract::<String>()?.as_str() {
                "cpu" => MemKind::Host,
                "cuda" => MemKind::Cuda {
                    device: dev.getattr("index")?.extract::<Option<u32>>()?.unwrap_or(0),
                },
                other => {
                    return Err(errors::config(format!(
                        "tensors on {other:?} are not supported (cpu or cuda)"
                    )));
                }
            };
            let len = n
                .checked_mul(size)
                .ok_or_else(|| errors::config("tensor size overflows"))?;
            return Ok(Memory {
                descs: vec![desc(addr, len, kind)?],
                keep: Keep::Object(obj.clone().unbind()),
            });
        }
        // Anything with the buffer protocol, viewed as bytes (a cast needs it C-contiguous). The
        // stable ABI of Python 3.10 has no buffer calls: a ctypes array made `from_buffer` holds the
        // export and tells the address.
        let view = py
            .import("builtins")?
            .getattr("memoryview")?
            .call1((obj,))
            .map_err(|_| {
                errors::config(
                    "memory must be a writable buffer (numpy array, bytearray, mmap), a tensor with data_ptr(), or (pointer, length) pairs",
                )
            })?;
        let bytes = view
            .call_method1("cast", ("B",))
            .map_err(|_| errors::config("the buffer must be C-contiguous"))?;
        if bytes.getattr("readonly")?.extract::<bool>()? {
            return Err(errors::config(
                "the buffer is read-only: peers write into the pool",
            ));
        }
        let len: u64 = bytes.getattr("nbytes")?.extract()?;
        let ctypes = py.import("ctypes")?;
        let array = ctypes
            .getattr("c_char")?
            .call_method1("__mul__", (len,))?
            .call_method1("from_buffer", (&bytes,))?;
        let addr: u64 = ctypes.getattr("addressof")?.call1((&array,))?.extract()?;
        Ok(Memory {
            descs: vec![desc(addr, len, MemKind::Host)?],
            keep: Keep::Object(array.unbind()),
        })
    }

    /// The pools to register (one per region). Each holds a reference to the Python object the
    /// memory belongs to, which it drops only when it is dropped itself: after its registration is
    /// over and no peer may still write into it (a pool an engine leaks keeps the object forever).
    pub(crate) fn into_pools(self) -> Vec<Pool> {
        let owner = match self.keep {
            Keep::Object(obj) => Some(std::sync::Arc::new(obj)),
            Keep::Raw => None,
        };
        let mut pools = Vec::with_capacity(self.descs.len());
        for d in self.descs {
            // SAFETY: each region is one live allocation of its kind for as long as the pool holds
            // `owner`, as `Pool::borrowed_with` asks: the ctypes array holds a buffer export, which
            // keeps its exporter from resizing or freeing the memory (numpy refuses to resize an
            // array with exports, and the export holds the array); a tensor reference keeps its
            // storage. Raw pointers (no owner) are the caller's documented promise, the one NIXL's
            // registration makes, for as long as the engine may use them. The pool drops `owner`
            // only after its registration ended with every write over (see `Registration`), or never;
            // nothing of ours takes Rust references into the memory (copies go through the pool's
            // atomic copies).
            pools.push(unsafe {
                match &owner {
                    Some(o) => Pool::borrowed_with(d, Box::new(o.clone())),
                    None => Pool::borrowed(d),
                }
            });
        }
        pools
    }

    /// Bytes, all regions together.
    pub(crate) fn len(&self) -> u64 {
        self.descs.iter().map(|d| d.len()).sum()
    }
}
