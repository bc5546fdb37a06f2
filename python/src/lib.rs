//! `kvx._kvx`: the engines as Python classes.
//!
//! Every call that waits (engine start, a request's outcome, a chunk's writes, a decision) detaches
//! from the interpreter while it waits, so other Python threads run meanwhile. Engine work runs on one
//! tokio runtime per process; Python callbacks never run on its worker threads (they would block the
//! engine behind the interpreter lock).

mod channel;
mod decode;
mod errors;
mod held;
mod memory;
mod pending;
mod prefill;

use pyo3::prelude::*;
use std::sync::OnceLock;
use std::time::Duration;
use transfer_engine::core::planner::{HeadLayout, HeadOrder, KvLayout, RegionKind};
use transfer_engine::engine::BackendConfig;
use transfer_engine::engine::TpConfig;
use transfer_engine::transport::BackendKind;

/// The process's engine runtime, started on first use.
fn runtime() -> PyResult<&'static tokio::runtime::Runtime> {
    static RT: OnceLock<Result<tokio::runtime::Runtime, String>> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("kvx-engine")
            .enable_all()
            .build()
            .map_err(|e| e.to_string())
    })
    .as_ref()
    .map_err(|e| errors::config(format!("cannot start the engine runtime: {e}")))
}

/// Seconds from Python as a duration: finite, not negative, at most a year.
fn seconds(what: &str, s: f64) -> PyResult<Duration> {
    if s.is_finite() && (0.0..=31_536_000.0).contains(&s) {
        Ok(Duration::from_secs_f64(s))
    } else {
        Err(errors::config(format!(
            "{what} must be a finite number of seconds between 0 and a year, not {s}"
        )))
    }
}

/// `"ucx"` or `"nixl"`, with a name for the engine (NIXL agents are known by theirs): a
/// prefill's defaults, or with `decode` a decode engine's ([`BackendConfig::default_for_decode`]).
fn backend(name: &str, engine: &str, decode: bool) -> PyResult<BackendConfig> {
    let kind = match name {
        "ucx" => BackendKind::Ucx,
        "nixl" => BackendKind::Nixl,
        other => {
            return Err(errors::config(format!(
                "backend must be \"ucx\" or \"nixl\", not {other:?}"
            )));
        }
    };
    Ok(if decode {
        BackendConfig::default_for_decode(kind, engine)
    } else {
        BackendConfig::default_for(kind, engine)
    })
}

/// A side's TP rank and size, how the two sides' TP ranks map (`"identical"`, `"replicated"`: MLA,
/// every rank holds the whole latent; `"head_sliced"`: MHA/GQA heads split over the ranks) and the
/// model's KV heads (for `"head_sliced"`).
fn tp_config(rank: u16, size: u16, mode: &str, kv_heads: u32) -> PyResult<TpConfig> {
    use transfer_engine::control::TpMode;
    let mode = match mode {
        "identical" => TpMode::Identical,
        "replicated" => TpMode::Replicated,
        "head_sliced" => TpMode::HeadSliced,
        other => {
            return Err(errors::config(format!(
                "tp_mode must be \"identical\", \"replicated\" or \"head_sliced\", not {other:?}"
            )));
        }
    };
    if rank >= size {
        return Err(errors::config(format!(
            "TP rank {rank} is not below TP size {size}"
        )));
    }
    Ok(TpConfig {
        rank,
        size,
        mode,
        kv_heads,
    })
}

/// A secret from Python: bytes, or text (its UTF-8 bytes); `None` for none. An empty one is refused:
/// it would turn authentication off while looking configured.
fn secret(obj: Option<&Bound<'_, PyAny>>) -> PyResult<Option<transfer_engine::control::Secret>> {
    let Some(obj) = obj else { return Ok(None) };
    if obj.is_none() {
        return Ok(None);
    }
    let bytes = match obj.extract::<String>() {
        Ok(s) => s.into_bytes(),
        Err(_) => obj
            .extract::<Vec<u8>>()
            .map_err(|_| errors::config("secret must be bytes or str"))?,
    };
    if bytes.is_empty() {
        return Err(errors::config(
            "the secret is empty; pass None to run without one",
        ));
    }
    Ok(Some(transfer_engine::control::Secret::new(&bytes)))
}

/// Where one side keeps its KV cache: `[region][layer][page]`, packed from offset 0.
#[pyclass(module = "kvx._kvx", name = "Layout", frozen, eq)]
#[derive(Debug, Clone, PartialEq)]
struct Layout {
    inner: KvLayout,
}

#[pymethods]
impl Layout {
    /// `heads` (KV heads this TP rank holds) and `head_bytes` (one head of one token) describe a
    /// page's heads, for head-sliced TP (`tp_mode="head_sliced"` on the engines); a page is then
    /// `page_bytes / (heads * head_bytes)` tokens, token-major (`[token][head]`, as SGLang and
    /// vLLM keep them) unless `head_major`. `key_column_bytes` (head-major only) says a head's
    /// part is K then V, K by columns of elements of that many bytes (`[element][token]`), V by
    /// rows: vLLM's CPU blocks, needed to map blocks of other sizes.
    #[new]
    #[pyo3(signature = (
        *, first_layer, num_layers, page_bytes, num_pages, split_kv = false, heads = 0,
        head_bytes = 0, head_major = false, key_column_bytes = 0,
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        first_layer: u32,
        num_layers: u32,
        page_bytes: u64,
        num_pages: u32,
        split_kv: bool,
        heads: u32,
        head_bytes: u64,
        head_major: bool,
        key_column_bytes: u32,
    ) -> PyResult<Self> {
        if key_column_bytes > 0 && !head_major {
            return Err(errors::config("key_column_bytes needs head_major=True"));
        }
        if num_layers == 0 || page_bytes == 0 || num_pages == 0 {
            return Err(errors::config(
                "num_layers, page_bytes and num_pages must be positive",
            ));
        }
        let regions = if split_kv {
            RegionKind::SplitKv
        } else {
            RegionKind::Fused
        };
        let mut inner = KvLayout::packed(first_layer, num_layers, regions, page_bytes, num_pages);
        if inner.buffer_len == u64::MAX {
            return Err(errors::config("the layout's size overflows 64 bits"));
        }
        if heads > 0 || head_bytes > 0 {
            let token_bytes = u64::from(heads).saturating_mul(head_bytes);
            if token_bytes == 0 || !page_bytes.is_multiple_of(token_bytes) {
                return Err(errors::config(format!(
                    "a page of {page_bytes} bytes is not a whole number of tokens of {heads} \
                     heads of {head_bytes} bytes"
                )));
            }
            let page_tokens = u32::try_from(page_bytes / token_bytes)
                .map_err(|_| errors::config("too many tokens per page"))?;
            inner = inner.with_heads(HeadLayout {
                num_heads: heads,
                head_bytes,
                page_tokens,
                order: if key_column_bytes > 0 {
                    HeadOrder::KeyColumns {
                        elem_bytes: key_column_bytes,
                    }
                } else if head_major {
                    HeadOrder::HeadMajor
                } else {
                    HeadOrder::TokenMajor
                },
            });
            inner
                .validate(transfer_engine::core::planner::Side::Src)
                .map_err(|e| errors::config(e.to_string()))?;
        } else if key_column_bytes > 0 {
            return Err(errors::config(
                "key_column_bytes needs heads and head_bytes",
            ));
        }
        Ok(Layout { inner })
    }

    /// KV heads per page this TP rank holds (0 when the layout has no head geometry).
    #[getter]
    fn heads(&self) -> u32 {
        self.inner.heads.map_or(0, |h| h.num_heads)
    }

    /// Bytes the pool must hold.
    #[getter]
    fn buffer_len(&self) -> u64 {
        self.inner.buffer_len
    }
    #[getter]
    fn first_layer(&self) -> u32 {
        self.inner.first_layer
    }
    #[getter]
    fn num_layers(&self) -> u32 {
        self.inner.num_layers
    }
    #[getter]
    fn page_bytes(&self) -> u64 {
        self.inner.page_bytes
    }
    #[getter]
    fn num_pages(&self) -> u32 {
        self.inner.num_pages
    }
    #[getter]
    fn split_kv(&self) -> bool {
        self.inner.regions == RegionKind::SplitKv
    }
    /// Bytes from one layer's pages to the next, within a region.
    #[getter]
    fn layer_stride(&self) -> u64 {
        self.inner.layer_stride
    }
    /// Bytes from the K region to the V region (0 when fused).
    #[getter]
    fn region_stride(&self) -> u64 {
        if self.split_kv() {
            self.inner.region_stride
        } else {
            0
        }
    }

    /// Offset in the pool of `page` of global layer `layer` in `region` (0 = K or fused, 1 = V).
    #[pyo3(signature = (layer, page, region = 0))]
    fn offset(&self, layer: u32, page: u32, region: u32) -> PyResult<u64> {
        let l = &self.inner;
        if !l.layers().contains(&layer) || page >= l.num_pages || region >= l.regions.count() {
            return Err(errors::config(format!(
                "layer {layer}, page {page}, region {region} is outside the layout (layers {:?}, {} pages, {} regions)",
                l.layers(),
                l.num_pages,
                l.regions.count()
            )));
        }
        Ok(l.base_offset
            + u64::from(region) * l.region_stride
            + u64::from(layer - l.first_layer) * l.layer_stride
            + u64::from(page) * l.page_bytes)
    }

    fn __repr__(&self) -> String {
        let l = &self.inner;
        format!(
            "Layout(first_layer={}, num_layers={}, page_bytes={}, num_pages={}, split_kv={}{})",
            l.first_layer,
            l.num_layers,
            l.page_bytes,
            l.num_pages,
            if self.split_kv() { "True" } else { "False" },
            l.heads.map_or(String::new(), |h| format!(
                ", heads={}, head_bytes={}{}",
                h.num_heads,
                h.head_bytes,
                match h.order {
                    HeadOrder::HeadMajor => ", head_major=True".to_string(),
                    HeadOrder::KeyColumns { elem_bytes } =>
                        format!(", head_major=True, key_column_bytes={elem_bytes}"),
                    HeadOrder::TokenMajor => String::new(),
                }
            ))
        )
    }
}

/// The prefill TP ranks (of `prefill_tp`) that write into decode TP rank `decode_rank` (of
/// `decode_tp`), in the order the decode rank numbers them: heads sliced over the ranks when
/// `kv_heads` (the model's KV heads) is positive, whole pages from one rank (MLA) when it is 0.
#[pyfunction]
fn tp_sources(
    prefill_tp: u32,
    decode_tp: u32,
    kv_heads: u32,
    decode_rank: u32,
) -> PyResult<Vec<u32>> {
    use transfer_engine::core::topology::{TpShape, sources};
    let shape = |tp_size| TpShape { tp_size, kv_heads };
    sources(shape(prefill_tp), shape(decode_tp), decode_rank)
        .map(|v| v.into_iter().map(|s| s.prefill_rank).collect())
        .map_err(|e| errors::config(format!("TP topology: {e}")))
}

/// The decode TP ranks (of `decode_tp`) that prefill TP rank `prefill_rank` (of `prefill_tp`) writes
/// into, as [`tp_sources`] maps them.
#[pyfunction]
fn tp_targets(
    prefill_tp: u32,
    decode_tp: u32,
    kv_heads: u32,
    prefill_rank: u32,
) -> PyResult<Vec<u32>> {
    use transfer_engine::core::topology::{TpShape, targets};
    let shape = |tp_size| TpShape { tp_size, kv_heads };
    targets(shape(prefill_tp), shape(decode_tp), prefill_rank)
        .map(|v| v.into_iter().map(|(d, _)| d).collect())
        .map_err(|e| errors::config(format!("TP topology: {e}")))
}

/// The version of the engine this module was built from.
#[pyfunction]
fn version() -> &'static str {
    env!("CARGO_PKG_VERSION")
}

/// The engines' log on stderr, filtered by `KVX_LOG` (`tracing` directives such as `info` or
/// `transfer_engine=debug`; `off` for none), warnings and errors by default: what an engine says
/// about a lost rank or a refused peer reaches the server's log beside the server's own lines.
/// Nothing is installed where the process already has a global subscriber.
fn init_log() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("KVX_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .with_thread_names(true)
        .try_init();
}

#[pymodule]
fn _kvx(m: &Bound<'_, PyModule>) -> PyResult<()> {
    init_log();
    m.add_class::<Layout>()?;
    m.add_class::<channel::ChannelHandshake>()?;
    m.add_class::<channel::Channel>()?;
    m.add_class::<channel::HandshakePlaces>()?;
    m.add_function(wrap_pyfunction!(channel::seal_box, m)?)?;
    m.add_function(wrap_pyfunction!(channel::open_box, m)?)?;
    m.add_function(wrap_pyfunction!(channel::mac_key, m)?)?;
    m.add_function(wrap_pyfunction!(tp_sources, m)?)?;
    m.add_function(wrap_pyfunction!(tp_targets, m)?)?;
    m.add_class::<decode::DecodeEngine>()?;
    m.add_class::<prefill::PrefillEngine>()?;
    m.add_class::<prefill::IncomingRequest>()?;
    m.add_class::<prefill::MeshSocket>()?;
    m.add_class::<pending::Pending>()?;
    m.add_class::<pending::Outcome>()?;
    m.add_function(wrap_pyfunction!(version, m)?)?;
    Ok(())
}
