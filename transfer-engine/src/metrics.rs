//! Prometheus metrics of the engines in this process, served on an address the user opts into.
//!
//! An engine whose config names a metrics address ([`DecodeConfig::metrics`],
//! [`PrefillConfig::metrics`]) joins the exporter serving that address in this process, starting it
//! if none does (port 0 starts one of its own). The exporter answers `GET /metrics` with the
//! OpenMetrics text of every live engine that joined it, read at scrape time from the engines'
//! counters (nothing is kept per scrape), encoded by the `prometheus-client` crate and served by
//! `hyper`. An engine that is dropped leaves the exporter; the exporter stops once none is left.
//!
//! Every sample carries `role` (`decode` or `prefill`), `engine` (the engine id) and `backend`
//! labels, so one endpoint serves many engines.
//!
//! [`DecodeConfig::metrics`]: crate::engine::DecodeConfig::metrics
//! [`PrefillConfig::metrics`]: crate::engine::PrefillConfig::metrics

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, OnceLock, Weak};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// Labels of one sample.
pub(crate) type Labels = Vec<(&'static str, String)>;

/// A value of one sample.
#[derive(Clone)]
pub(crate) enum Value {
    /// A counter (encoded with the `_total` suffix).
    Counter(u64),
    /// A gauge.
    Gauge(i64),
    /// A histogram, in seconds.
    Histogram(Histogram),
}

struct Family {
    help: &'static str,
    rows: Vec<(Labels, Value)>,
}

/// What the engines report in one scrape, grouped by metric name.
#[derive(Default)]
pub(crate) struct Samples {
    families: BTreeMap<&'static str, Family>,
}

impl Samples {
    /// Adds one sample of `name` (without `_total` for counters).
    pub(crate) fn add(&mut self, name: &'static str, help: &'static str, labels: Labels, v: Value) {
        self.families
            .entry(name)
            .or_insert_with(|| Family {
                help,
                rows: Vec::new(),
            })
            .rows
            .push((labels, v));
    }
}

/// The labels every sample of one engine carries (role, engine id, backend).
pub(crate) struct EngineLabels(Labels);

impl EngineLabels {
    pub(crate) fn new(role: &str, engine: &str, backend: &str) -> Self {
        EngineLabels(vec![
            ("role", role.to_string()),
            ("engine", engine.to_string()),
            ("backend", backend.to_string()),
        ])
    }

    /// The engine's labels alone.
    pub(crate) fn base(&self) -> Labels {
        self.0.clone()
    }

    /// The engine's labels and `key="value"`.
    pub(crate) fn with(&self, key: &'static str, value: &str) -> Labels {
        let mut l = self.0.clone();
        l.push((key, value.to_string()));
        l
    }
}

/// An engine that reports into scrapes.
pub(crate) trait Source: Send + Sync {
    /// Adds this engine's samples.
    fn collect(&self, out: &mut Samples);
}

/// A histogram of request durations in seconds, 10 µs to about 84 s.
pub(crate) fn seconds_histogram() -> Histogram {
    Histogram::new(exponential_buckets(1e-5, 2.0, 24))
}

#[derive(Default)]
struct Sources {
    list: Mutex<Vec<Weak<dyn Source>>>,
}

impl std::fmt::Debug for Sources {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Sources")
    }
}

impl Sources {
    fn live(&self) -> Vec<Arc<dyn Source>> {
        let mut list = self.list.lock().unwrap_or_else(|p| p.into_inner());
        list.retain(|w| w.strong_count() > 0);
        list.iter().filter_map(Weak::upgrade).collect()
    }
}

impl Collector for Sources {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let mut samples = Samples::default();
        for s in self.live() {
            s.collect(&mut samples);
        }
        // The process's, not one engine's: no engine labels.
        samples.add(
            "kvx_leaked_pools",
            "Pools this process leaked rather than freed while a peer's write could still land",
            Labels::new(),
            Value::Counter(crate::transport::leaked_pools()),
        );
        for (name, family) in samples.families {
            let kind = match family.rows.first().map(|r| &r.1) {
                Some(Value::Counter(_)) => MetricType::Counter,
                Some(Value::Gauge(_)) => MetricType::Gauge,
                Some(Value::Histogram(_)) => MetricType::Histogram,
                None => continue,
            };
            let mut f = encoder.encode_descriptor(name, family.help, None, kind)?;
            for (labels, value) in &family.rows {
                let e = f.encode_family(labels)?;
                match value {
                    Value::Counter(v) => ConstCounter::new(*v).encode(e)?,
                    Value::Gauge(v) => ConstGauge::new(*v).encode(e)?,
                    Value::Histogram(h) => h.encode(e)?,
                }
            }
        }
        Ok(())
    }
}

/// The exporter serving one address: the engines that joined it.
#[derive(Debug)]
pub(crate) struct Exporter {
    addr: SocketAddr,
    sources: Arc<Sources>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Exporter {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// An engine's membership of an exporter: the engine keeps it, and leaves when it is dropped.
#[derive(Debug)]
pub(crate) struct Joined {
    exporter: Arc<Exporter>,
}

impl Joined {
    /// The address the exporter listens on.
    pub(crate) fn addr(&self) -> SocketAddr {
        self.exporter.addr
    }
}

/// Exporters of this process by the address they were asked for and the one they bound (an
/// engine asking for port 0 gets one of its own). An
/// async lock, held across the bind, so two engines asking for one address at once share it.
fn exporters() -> &'static tokio::sync::Mutex<HashMap<SocketAddr, Weak<Exporter>>> {
    static E: OnceLock<tokio::sync::Mutex<HashMap<SocketAddr, Weak<Exporter>>>> = OnceLock::new();
    E.get_or_init(Default::default)
}

/// Joins `source` to the exporter on `addr`, starting it on the current tokio runtime if this
/// process serves none there.
///
/// # Errors
/// The address cannot be bound.
///
/// # Cancel safety
/// Cancel-safe: dropped before it returns, nothing joined (an exporter it started stops).
pub(crate) async fn join(addr: SocketAddr, source: Weak<dyn Source>) -> std::io::Result<Joined> {
    let mut map = exporters().lock().await;
    map.retain(|_, w| w.strong_count() > 0);
    if addr.port() != 0
        && let Some(e) = map.get(&addr).and_then(Weak::upgrade)
    {
        push(&e.sources, source);
        return Ok(Joined { exporter: e });
    }
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    let sources = Arc::new(Sources::default());
    push(&sources, source);
    let mut registry = Registry::default();
    registry.register_collector(Box::new(Shared(sources.clone())));
    let task = tokio::spawn(serve(listener, Arc::new(registry)));
    let exporter = Arc::new(Exporter {
        addr: local,
        sources,
        task,
    });
    // Under the address asked for and the one bound: an engine naming either shares it.
    if addr.port() != 0 {
        map.insert(addr, Arc::downgrade(&exporter));
    }
    map.insert(local, Arc::downgrade(&exporter));
    Ok(Joined { exporter })
}

fn push(sources: &Sources, s: Weak<dyn Source>) {
    sources
        .list
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .push(s);
}

/// The registry's view of the shared sources.
#[derive(Debug)]
struct Shared(Arc<Sources>);

impl Collector for Shared {
    fn encode(&self, encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        self.0.encode(encoder)
    }
}

/// The OpenMetrics text of `registry`.
fn render(registry: &Registry) -> String {
    let mut body = String::new();
    // Writing into a String does not fail; an encoder error would leave a partial body, which a
    // scraper reports as a parse error.
    if let Err(e) = prometheus_client::encoding::text::encode(&mut body, registry) {
        tracing::warn!(error = %e, "metrics: encoding failed");
    }
    body
}

async fn serve(listener: tokio::net::TcpListener, registry: Arc<Registry>) {
    use http_body_util::Full;
    use hyper::body::Bytes;
    use hyper::{Method, Request, Response, StatusCode};

    loop {
        let stream = match listener.accept().await {
            Ok((s, _)) => s,
            Err(e) => {
                tracing::warn!(error = %e, "metrics: accept failed");
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                continue;
            }
        };
        let registry = registry.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
                let registry = registry.clone();
                async move {
                    let found = req.method() == Method::GET && req.uri().path() == "/metrics";
                    let mut resp = if found {
                        Response::new(Full::new(Bytes::from(render(&registry))))
                    } else {
                        let mut r = Response::new(Full::new(Bytes::from_static(b"not found\n")));
                        *r.status_mut() = StatusCode::NOT_FOUND;
                        r
                    };
                    if found {
                        resp.headers_mut().insert(
                            hyper::header::CONTENT_TYPE,
                            hyper::header::HeaderValue::from_static(
                                "application/openmetrics-text; version=1.0.0; charset=utf-8",
                            ),
                        );
                    }
                    Ok::<_, std::convert::Infallible>(resp)
                }
            });
            let io = hyper_util::rt::TokioIo::new(stream);
            if let Err(e) = hyper::server::conn::http1::Builder::new()
                .serve_connection(io, service)
                .await
            {
                tracing::debug!(error = %e, "metrics: connection ended");
            }
        });
    }
}
