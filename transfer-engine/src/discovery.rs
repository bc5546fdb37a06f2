//! Discovery through etcd (v3): engines find each other by a cluster name instead of addresses.
//!
//! Every engine puts one [`EngineRecord`] under `kvx/<cluster>/` with a lease it keeps alive
//! ([`Registration`]): decode its control address, each prefill rank the address of its vote mesh,
//! with role, PP and TP rank, the layout's summary and the engine start's incarnation. Engines
//! read the others through a [`Directory`], which lists the prefix and then follows it with a
//! watch. What goes into etcd is only what a peer needs to *reach* an engine: worker addresses,
//! rkeys and the shared secret travel on the authenticated control plane only, never here.
//!
//! A lease that expires deletes the record: a second liveness signal beside the control
//! connection, which also catches a process that is stopped rather than dead (its sockets stay
//! open). [`watch_decode`] turns such a deletion into [`DecodeEngine::evict`] and a record that
//! comes back into [`DecodeEngine::readmit`].
//!
//! When etcd restarts (or a client loses it for a while), the connection is made again: a
//! registration keeps its lease if etcd still has it and registers anew otherwise, and a
//! directory lists the prefix again. Engine-to-engine connections do not go through etcd and
//! keep working meanwhile.
//!
//! The one etcd client is the maintained `etcd-client` crate (gRPC through tonic).

use crate::control::Secret;
use crate::engine::{
    DecodeEngine, EngineError, MeshSocket, PrefillConfig, PrefillEngine, TpConfig,
};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::watch;

/// Where the cluster's records live.
#[derive(Debug, Clone)]
pub struct EtcdConfig {
    /// etcd endpoints, as `http://host:port` (or `https://` with [`tls`](Self::tls)).
    pub endpoints: Vec<String>,
    /// The cluster name: records live under `kvx/<cluster>/`, so clusters under different names
    /// never see each other. Non-empty, without `/`.
    pub cluster: String,
    /// The lease's time to live: a record outlives its engine (or a stopped engine) by at most
    /// this, and the engine renews it every third of it. At least one second (etcd counts in
    /// seconds).
    pub lease_ttl: Duration,
    /// How long the first contact with etcd is tried again, with pauses growing from 100 ms to
    /// 2 s, before a registration or directory fails to start (etcd may come up after the
    /// engines). Zero tries once.
    pub start_deadline: Duration,
    /// Name and password, for an etcd with authentication enabled.
    pub user: Option<EtcdUser>,
    /// TLS to etcd (`https://` endpoints).
    pub tls: Option<EtcdTls>,
    /// Bound on a directory's silence: a watch that brings nothing for this long is asked for a
    /// progress notification, and one that then brings nothing for as long again means etcd is
    /// unreachable or stopped: the directory says so ([`Directory::is_live`]), connects again and
    /// lists afresh.
    pub watch_liveness: Duration,
    /// The deployment's shared secret: give it the engines' `token`. Every record carries a MAC
    /// keyed from it over its key, its lease and its content, and a directory takes only records
    /// whose MAC checks, so whoever can write etcd without the secret cannot make a record up or
    /// change one (but can delete one, or put back a record whose lease ended under a lease
    /// granted with the same id). [`Secret::none`] (the default) is everyone's: anyone can seal
    /// with it. Engines under other secrets (or builds before the MAC) do not see each other's
    /// records, and each takes the other's record at its key for no start and overwrites it.
    pub secret: Secret,
}

/// etcd credentials. `Debug` never shows the password.
#[derive(Clone, PartialEq, Eq)]
pub struct EtcdUser {
    /// User name.
    pub name: String,
    /// Password.
    pub password: String,
}

impl std::fmt::Debug for EtcdUser {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdUser")
            .field("name", &self.name)
            .field("password", &"<redacted>")
            .finish()
    }
}

/// TLS settings for etcd, as PEM files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdTls {
    /// The certificate authority that signed etcd's certificate.
    pub ca: std::path::PathBuf,
    /// This client's certificate and key, for an etcd that asks for one (`--client-cert-auth`).
    pub identity: Option<(std::path::PathBuf, std::path::PathBuf)>,
    /// The name etcd's certificate carries, when it is not the endpoint's host.
    pub domain: Option<String>,
}

impl EtcdConfig {
    /// One endpoint, a cluster name, a 5 s lease.
    pub fn new(endpoint: impl Into<String>, cluster: impl Into<String>) -> Self {
        EtcdConfig {
            endpoints: vec![endpoint.into()],
            cluster: cluster.into(),
            lease_ttl: Duration::from_secs(5),
            start_deadline: Duration::from_secs(30),
            user: None,
            tls: None,
            watch_liveness: Duration::from_secs(5),
            secret: Secret::none(),
        }
    }

    /// `kvx/<cluster>/`.
    ///
    /// # Errors
    /// [`DiscoveryError::BadCluster`] for an empty name or one with `/`.
    pub fn prefix(&self) -> Result<String, DiscoveryError> {
        if self.cluster.is_empty() || self.cluster.contains('/') {
            return Err(DiscoveryError::BadCluster(self.cluster.clone()));
        }
        Ok(format!("kvx/{}/", self.cluster))
    }

    fn ttl_secs(&self) -> i64 {
        i64::try_from(self.lease_ttl.as_secs().max(1)).unwrap_or(i64::MAX)
    }

    async fn connect(&self) -> Result<etcd_client::Client, DiscoveryError> {
        let mut options = etcd_client::ConnectOptions::new()
            .with_connect_timeout(Duration::from_secs(2))
            .with_timeout(Duration::from_secs(5));
        if let Some(u) = &self.user {
            options = options.with_user(u.name.clone(), u.password.clone());
        }
        if let Some(t) = &self.tls {
            let read = |p: &std::path::Path| {
                std::fs::read(p).map_err(|e| DiscoveryError::Tls(format!("{}: {e}", p.display())))
            };
            let mut tls = etcd_client::TlsOptions::new()
                .ca_certificate(etcd_client::Certificate::from_pem(read(&t.ca)?));
            if let Some((cert, key)) = &t.identity {
                tls = tls.identity(etcd_client::Identity::from_pem(read(cert)?, read(key)?));
            }
            if let Some(d) = &t.domain {
                tls = tls.domain_name(d.clone());
            }
            options = options.with_tls(tls);
        }
        etcd_client::Client::connect(&self.endpoints, Some(options))
            .await
            .map_err(DiscoveryError::from)
    }

    /// [`connect`](Self::connect), tried again until [`start_deadline`](Self::start_deadline);
    /// then the last error.
    async fn connect_at_start(&self) -> Result<etcd_client::Client, DiscoveryError> {
        let deadline = tokio::time::Instant::now() + self.start_deadline;
        let mut pause = Duration::from_millis(100);
        loop {
            // The client connects lazily: its first call is what reaches etcd.
            let reached = match self.connect().await {
                Ok(mut c) => c.status().await.map(|_| c).map_err(DiscoveryError::from),
                Err(e) => Err(e),
            };
            match reached {
                Ok(c) => return Ok(c),
                // Refused credentials or unreadable certificates do not get better by waiting.
                Err(e) if e.is_refusal() => return Err(e),
                Err(e) if tokio::time::Instant::now() + pause > deadline => return Err(e),
                Err(e) => {
                    tracing::info!(error = %e, ?pause, "etcd not reachable yet; trying again");
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_secs(2));
                }
            }
        }
    }
}

/// What went wrong with etcd.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DiscoveryError {
    /// The cluster name cannot be a key prefix.
    #[error("cluster name {0:?} must be non-empty and without '/'")]
    BadCluster(String),
    /// An instance name that cannot be a key part.
    #[error("instance name {0:?} must be without '/' and not `_`")]
    BadInstance(String),
    /// etcd refused or could not be reached.
    #[error("etcd: {0}")]
    Etcd(#[from] etcd_client::Error),
    /// A TLS file that cannot be read.
    #[error("etcd TLS: {0}")]
    Tls(String),
    /// A record that does not parse (written by something else under our prefix).
    #[error("record {key}: {reason}")]
    BadRecord {
        /// Its key.
        key: String,
        /// Why it does not parse.
        reason: String,
    },
    /// What a caller waited for did not appear in time.
    #[error("timed out waiting for {0}")]
    Timeout(String),
    /// A prefill TP rank waited for a decode engine to write into, and the decode engines
    /// registered have TP sizes into none of whose ranks it writes (an MLA rank at or above
    /// decode's TP size): under this mapping it serves no decode and needs no engine.
    #[error(
        "prefill TP rank {rank} of {size} writes into no rank of the decode engines registered \
         (TP sizes {decode_sizes:?}): start no transfer engine on it"
    )]
    WritesNowhere {
        /// This rank's TP rank.
        rank: u16,
        /// Its TP size.
        size: u16,
        /// The TP sizes of the decode engines that were registered.
        decode_sizes: Vec<u16>,
    },
    /// The key holds the record of a later start of the same engine (a larger incarnation):
    /// this start is stale and does not overwrite it.
    #[error("{key} belongs to a later start (incarnation {theirs}, ours {ours})")]
    Superseded {
        /// The key.
        key: String,
        /// The later start's incarnation.
        theirs: u64,
        /// Ours.
        ours: u64,
    },
}

impl DiscoveryError {
    /// Whether etcd answered and refused us (credentials, permissions), or our TLS files cannot be
    /// read: trying again does not help.
    fn is_refusal(&self) -> bool {
        // gRPC status codes (a wire fact): 3 INVALID_ARGUMENT (etcd's "authentication failed"),
        // 7 PERMISSION_DENIED, 16 UNAUTHENTICATED.
        match self {
            DiscoveryError::Tls(_) => true,
            DiscoveryError::Etcd(etcd_client::Error::GRpcStatus(s)) => {
                matches!(s.code() as i32, 3 | 7 | 16)
            }
            _ => false,
        }
    }
}

impl From<DiscoveryError> for EngineError {
    fn from(e: DiscoveryError) -> Self {
        EngineError::Config(format!("discovery: {e}"))
    }
}

/// An engine's role in its record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RecordRole {
    /// A decode engine: `address` is its control address.
    Decode,
    /// A prefill PP rank: `address` is its vote mesh address.
    Prefill,
}

/// What an engine publishes about itself: how to reach it and what it is, nothing secret.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct EngineRecord {
    /// Decode or prefill.
    pub role: RecordRole,
    /// The engine's name.
    pub engine_id: String,
    /// Decode: its control address. Prefill: its vote mesh address (peers connect there).
    pub address: SocketAddr,
    /// TP rank.
    pub tp_rank: u16,
    /// TP size (1 in records of a start that did not give it): with the other side's TP size and
    /// the mapping ([`crate::engine::TpConfig::writes_into`]), which ranks of the other side
    /// this one links with.
    #[serde(default = "one")]
    pub tp_size: u16,
    /// PP rank (0 for decode).
    pub pp_rank: u16,
    /// PP size.
    pub pp_size: u16,
    /// The model's layer count.
    pub total_layers: u32,
    /// Tokens per page.
    pub page_tokens: u32,
    /// The first layer this engine holds and how many (decode: all).
    pub first_layer: u32,
    /// Layers held.
    pub num_layers: u32,
    /// The engine start's incarnation (see [`crate::core::membership`]).
    pub incarnation: u64,
    /// The instance: a prefill rank's prefill instance (its pipeline, as decode serves it), a
    /// decode engine's own name among the decode instances; `""` for the one instance of a
    /// cluster that has one. Without `/`.
    #[serde(default)]
    pub instance: String,
}

fn one() -> u16 {
    1
}

impl EngineRecord {
    /// The record's key under the cluster `prefix`: one key per role, instance, TP and PP rank
    /// (`<role>/<instance or _>/<tp>/<pp>`), so one cluster name holds many prefill and decode
    /// instances, and a restarted rank's record replaces its previous start's.
    ///
    /// # Errors
    /// [`DiscoveryError::BadInstance`] for an instance name with `/` or named `_`.
    pub fn key(&self, prefix: &str) -> Result<String, DiscoveryError> {
        let role = match self.role {
            RecordRole::Decode => "decode",
            RecordRole::Prefill => "prefill",
        };
        let instance = match self.instance.as_str() {
            "" => "_",
            "_" => return Err(DiscoveryError::BadInstance("_".into())),
            i if i.contains('/') => return Err(DiscoveryError::BadInstance(i.into())),
            i => i,
        };
        Ok(format!(
            "{prefix}{role}/{instance}/{}/{}",
            self.tp_rank, self.pp_rank
        ))
    }
}

/// An engine's record in etcd, kept alive until dropped (then revoked, so peers see it gone at
/// once rather than after the lease).
pub struct Registration {
    state: watch::Receiver<RegState>,
    /// The renewal task; `None` once revoked.
    task: Option<tokio::task::JoinHandle<()>>,
    client: etcd_client::Client,
}

impl std::fmt::Debug for Registration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registration")
            .field("state", &*self.state.borrow())
            .finish_non_exhaustive()
    }
}

/// How a registration stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RegState {
    /// The current lease.
    pub lease: i64,
    /// Times the record was put anew: after its lease was lost (etcd restarted without its data,
    /// or the engine could not renew it in time), or after someone deleted it.
    pub reregistered: u64,
    /// etcd cannot be reached now.
    pub unreachable: bool,
    /// A later start of the engine holds the key: this registration stopped (its lease revoked)
    /// and never writes the key again.
    pub superseded: bool,
}

impl Registration {
    /// Revokes the lease, deleting the record now, and stops renewing it.
    ///
    /// # Errors
    /// etcd did not take the revocation (the record then ends with its lease).
    pub async fn revoke(mut self) -> Result<(), DiscoveryError> {
        if let Some(task) = self.task.take() {
            task.abort();
            // Stopped for sure: it cannot put the record back after the revocation.
            let _ = task.await;
        }
        let lease = self.state.borrow().lease;
        let mut client = self.client.clone();
        client.lease_revoke(lease).await?;
        Ok(())
    }

    /// Puts `record` under `cfg`'s prefix with a new lease, and keeps it there. Every put, this
    /// first one and those that put the record back later, is a transaction conditioned on what
    /// the key holds: it takes the key only while it is empty or holds a start of the engine with
    /// a smaller (or the same) incarnation, so a stale start never overwrites its successor.
    ///
    /// # Errors
    /// etcd unreachable, a bad cluster name, or [`DiscoveryError::Superseded`].
    pub async fn register(cfg: &EtcdConfig, record: EngineRecord) -> Result<Self, DiscoveryError> {
        let key = record.key(&cfg.prefix()?)?;
        let json = serde_json::to_string(&record).map_err(|e| DiscoveryError::BadRecord {
            key: key.clone(),
            reason: e.to_string(),
        })?;
        let mut client = cfg.connect_at_start().await?;
        let mine = Owned {
            key,
            json,
            incarnation: record.incarnation,
            secret: cfg.secret.clone(),
        };
        let lease = client.lease_grant(cfg.ttl_secs(), None).await?.id();
        if let Err(e) = mine.put(&mut client, lease).await {
            let _ = client.lease_revoke(lease).await;
            return Err(e);
        }
        let (tx, rx) = watch::channel(RegState {
            lease,
            ..RegState::default()
        });
        let task = tokio::spawn(keep_alive(cfg.clone(), client.clone(), mine, tx));
        Ok(Registration {
            state: rx,
            task: Some(task),
            client,
        })
    }

    /// How the registration stands now.
    pub fn state(&self) -> RegState {
        *self.state.borrow()
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        let Some(task) = self.task.take() else {
            return;
        };
        task.abort();
        let lease = self.state.borrow().lease;
        // Best effort: revoke so that peers see the engine gone now, not a lease later.
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            let mut client = self.client.clone();
            rt.spawn(async move {
                let _ = client.lease_revoke(lease).await;
            });
        }
    }
}

/// A registration's key and record, and the incarnation that owns the key while it holds it.
struct Owned {
    key: String,
    /// The record, as JSON.
    json: String,
    incarnation: u64,
    secret: Secret,
}

impl Owned {
    /// What the key holds while this record holds it under `lease`.
    fn value(&self, lease: i64) -> Vec<u8> {
        seal(&self.secret, &self.key, lease, &self.json)
    }

    /// Puts the record under `lease`, in a transaction that succeeds only if the key still holds
    /// what was read just before (nothing, or a record of an incarnation no larger than ours);
    /// read and try again when something else wrote in between. `Ok(false)`: the key already
    /// held this record under this lease, nothing was written.
    async fn put(
        &self,
        client: &mut etcd_client::Client,
        lease: i64,
    ) -> Result<bool, DiscoveryError> {
        use etcd_client::{Compare, CompareOp, PutOptions, Txn, TxnOp};
        let value = self.value(lease);
        loop {
            let got = client.get(self.key.as_str(), None).await?;
            let guard = match got.kvs().first() {
                None => Compare::version(self.key.as_str(), CompareOp::Equal, 0),
                Some(kv) => {
                    // A record we cannot read, or whose MAC does not check (not written with
                    // the secret), is not a later start: ours replaces it.
                    let theirs = parse(&self.secret, &self.key, kv.lease(), kv.value())
                        .map_or(0, |r| r.incarnation);
                    if theirs > self.incarnation {
                        return Err(DiscoveryError::Superseded {
                            key: self.key.clone(),
                            theirs,
                            ours: self.incarnation,
                        });
                    }
                    if kv.value() == value.as_slice() && kv.lease() == lease {
                        return Ok(false);
                    }
                    Compare::mod_revision(self.key.as_str(), CompareOp::Equal, kv.mod_revision())
                }
            };
            let put = TxnOp::put(
                self.key.as_str(),
                value.clone(),
                Some(PutOptions::new().with_lease(lease)),
            );
            if client
                .txn(Txn::new().when([guard]).and_then([put]))
                .await?
                .succeeded()
            {
                return Ok(true);
            }
        }
    }
}

/// Renews the lease every third of its TTL; reconnects while etcd is away; puts the record again
/// with a new lease when the old one is gone, and under the live lease when someone deleted it,
/// both only while the key is not a later start's ([`Owned::put`]). Once a later start holds the
/// key, revokes its lease and stops for good.
async fn keep_alive(
    cfg: EtcdConfig,
    mut client: etcd_client::Client,
    mine: Owned,
    tx: watch::Sender<RegState>,
) {
    let period = Duration::from_secs_f64(cfg.lease_ttl.as_secs_f64().max(1.0) / 3.0);
    let key = mine.key.as_str();
    loop {
        let lease = tx.borrow().lease;
        // A lease that is gone (expired, or revoked from outside) cannot be kept alive: put the
        // record again under a new one, if the key is not a later start's.
        let gone = matches!(
            client.lease_time_to_live(lease, None).await,
            Ok(r) if r.ttl() <= 0
        );
        if gone {
            match client.lease_grant(cfg.ttl_secs(), None).await {
                Ok(l) => {
                    let fresh = l.id();
                    match mine.put(&mut client, fresh).await {
                        Ok(_) => {
                            tracing::info!(key, lease = fresh, "registered again in etcd");
                            tx.send_modify(|s| {
                                s.lease = fresh;
                                s.reregistered += 1;
                            });
                        }
                        Err(e) => {
                            let _ = client.lease_revoke(fresh).await;
                            if matches!(e, DiscoveryError::Superseded { .. }) {
                                tracing::error!(key, error = %e, "a later start holds this engine's key: registration stopped");
                                tx.send_modify(|s| s.superseded = true);
                                return;
                            }
                            tracing::warn!(key, error = %e, "etcd registration failed");
                            tokio::time::sleep(Duration::from_millis(500)).await;
                        }
                    }
                }
                Err(e) => {
                    tracing::warn!(key, error = %e, "etcd lease grant failed");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
            }
            continue;
        }
        // One keep-alive stream until it fails.
        if let Ok((mut keeper, mut stream)) = client.lease_keep_alive(lease).await {
            tx.send_modify(|s| s.unreachable = false);
            loop {
                if keeper.keep_alive().await.is_err() {
                    break;
                }
                // `restart`: the lease changed, so the keep-alive stream starts again.
                let (written, restart) = match tokio::time::timeout(period, stream.message()).await
                {
                    // A record deleted while its lease lives (by hand, or by another writer)
                    // would leave decode evicting this engine for good: put it back.
                    Ok(Ok(Some(r))) if r.ttl() > 0 => (mine.put(&mut client, lease).await, false),
                    Ok(Ok(Some(_))) => {
                        // The lease is gone: put the record again under a new one.
                        let fresh = match client.lease_grant(cfg.ttl_secs(), None).await {
                            Ok(l) => l.id(),
                            Err(e) => {
                                tracing::warn!(key, error = %e, "etcd registration failed");
                                break;
                            }
                        };
                        let put = mine.put(&mut client, fresh).await;
                        match &put {
                            Ok(_) => {
                                tracing::info!(key, lease = fresh, "registered again in etcd");
                                tx.send_modify(|s| s.lease = fresh);
                            }
                            Err(_) => {
                                let _ = client.lease_revoke(fresh).await;
                            }
                        }
                        (put.map(|_| true), true)
                    }
                    _ => break,
                };
                match written {
                    Ok(true) => tx.send_modify(|s| s.reregistered += 1),
                    Ok(false) => {}
                    Err(e @ DiscoveryError::Superseded { .. }) => {
                        tracing::error!(key, error = %e, "a later start holds this engine's key: registration stopped");
                        let lease = tx.borrow().lease;
                        let _ = client.lease_revoke(lease).await;
                        tx.send_modify(|s| s.superseded = true);
                        return;
                    }
                    Err(e) => {
                        tracing::warn!(key, error = %e, "etcd registration check failed");
                        break;
                    }
                }
                if restart {
                    break;
                }
                tokio::time::sleep(period).await;
            }
        }
        tx.send_modify(|s| s.unreachable = true);
        tokio::time::sleep(Duration::from_millis(500)).await;
        if let Ok(c) = cfg.connect().await {
            client = c;
        }
    }
}

/// A change the directory saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DirectoryEvent {
    /// A record was put (new, or a restarted engine's replacing its previous start's).
    Put(EngineRecord),
    /// A record was deleted: its lease expired or was revoked.
    Deleted(EngineRecord),
}

/// The cluster's records as etcd has them, followed with a watch.
#[derive(Debug, Clone)]
pub struct Directory {
    records: Arc<Mutex<HashMap<String, EngineRecord>>>,
    changed: watch::Receiver<u64>,
    events: tokio::sync::broadcast::Sender<DirectoryEvent>,
    /// Whether the watch follows etcd now (see [`EtcdConfig::watch_liveness`]).
    live: Arc<std::sync::atomic::AtomicBool>,
    /// Records ignored: unreadable, or their MAC did not check.
    refused: Arc<std::sync::atomic::AtomicU64>,
    _task: Arc<AbortOnDrop>,
}

#[derive(Debug)]
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl Directory {
    /// Lists `cfg`'s prefix and follows it.
    ///
    /// # Errors
    /// etcd unreachable, or a bad cluster name.
    pub async fn open(cfg: &EtcdConfig) -> Result<Self, DiscoveryError> {
        let prefix = cfg.prefix()?;
        let mut client = cfg.connect_at_start().await?;
        let records: Arc<Mutex<HashMap<String, EngineRecord>>> = Arc::default();
        let (ctx, crx) = watch::channel(0u64);
        let (events, _) = tokio::sync::broadcast::channel(1024);
        let refused = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let rev = list(cfg, &mut client, &records, &events, &refused).await?;
        let live = Arc::new(std::sync::atomic::AtomicBool::new(true));
        let task = tokio::spawn(follow(
            cfg.clone(),
            client,
            prefix,
            rev,
            Follow {
                records: records.clone(),
                changed: ctx,
                events: events.clone(),
                live: live.clone(),
                refused: refused.clone(),
            },
        ));
        Ok(Directory {
            records,
            changed: crx,
            events,
            live,
            refused,
            _task: Arc::new(AbortOnDrop(task)),
        })
    }

    /// Records the directory ignored since it opened, unreadable or not sealed with the
    /// deployment's secret for their key and lease ([`EtcdConfig::secret`]); each listing
    /// (after the watch broke) counts again those it finds.
    pub fn refused_records(&self) -> u64 {
        self.refused.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Whether the directory follows etcd now: false from the moment its watch went silent past
    /// [`EtcdConfig::watch_liveness`] (or broke) until it has connected again and listed afresh.
    /// Meanwhile its records are the last ones it saw.
    pub fn is_live(&self) -> bool {
        self.live.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Every record now.
    pub fn records(&self) -> Vec<EngineRecord> {
        lock(&self.records).values().cloned().collect()
    }

    /// Changes from now on (a receiver that falls 1024 events behind loses the oldest).
    pub fn events(&self) -> tokio::sync::broadcast::Receiver<DirectoryEvent> {
        self.events.subscribe()
    }

    /// Waits until `pick` finds what it wants in the records, or `timeout` passes.
    ///
    /// # Errors
    /// [`DiscoveryError::Timeout`] naming `what`.
    pub async fn wait_for<T>(
        &self,
        what: &str,
        timeout: Duration,
        pick: impl Fn(&[EngineRecord]) -> Option<T>,
    ) -> Result<T, DiscoveryError> {
        let mut changed = self.changed.clone();
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            if let Some(t) = pick(&self.records()) {
                return Ok(t);
            }
            match tokio::time::timeout_at(deadline, changed.changed()).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) | Err(_) => return Err(DiscoveryError::Timeout(what.to_string())),
            }
        }
    }

    /// A decode engine that prefill TP rank `tp.rank` (of instance `instance`, TP size `tp.size`)
    /// writes into ([`TpConfig::writes_into`]), and the vote mesh addresses of that TP rank's
    /// `pp_size` PP ranks, in rank order, once all are registered.
    ///
    /// # Errors
    /// [`DiscoveryError::Timeout`]; [`DiscoveryError::WritesNowhere`] where it timed out with
    /// decode engines registered and this rank writes into no rank of their TP sizes.
    pub async fn wait_for_cluster(
        &self,
        instance: &str,
        tp: &TpConfig,
        pp_size: u16,
        timeout: Duration,
    ) -> Result<(EngineRecord, Vec<SocketAddr>), DiscoveryError> {
        let tp_rank = tp.rank;
        let found = self
            .wait_for("a decode engine and every prefill rank", timeout, |rs| {
                let decode = rs.iter().find(|r| {
                    r.role == RecordRole::Decode
                        && tp.writes_into((tp.rank, tp.size), (r.tp_rank, r.tp_size))
                })?;
                // The PP peers are this instance's ranks only.
                let peers = (0..pp_size)
                    .map(|p| {
                        rs.iter()
                            .find(|r| {
                                r.role == RecordRole::Prefill
                                    && r.instance == instance
                                    && r.tp_rank == tp_rank
                                    && r.pp_rank == p
                            })
                            .map(|r| r.address)
                    })
                    .collect::<Option<Vec<_>>>()?;
                Some((decode.clone(), peers))
            })
            .await;
        if let Err(DiscoveryError::Timeout(_)) = found {
            // Told only once the wait is over: a decode instance of another TP size, one this
            // rank does write into, may register later.
            let mut decode_sizes: Vec<u16> = self
                .records()
                .iter()
                .filter(|r| r.role == RecordRole::Decode)
                .map(|r| r.tp_size)
                .collect();
            decode_sizes.sort_unstable();
            decode_sizes.dedup();
            // Only where the sizes do map: sizes that do not are a configuration error every rank
            // shares, and stay a timeout here.
            let nowhere = |&d: &u16| {
                tp.maps(tp.size, d) && !(0..d).any(|r| tp.writes_into((tp.rank, tp.size), (r, d)))
            };
            if !decode_sizes.is_empty() && decode_sizes.iter().all(nowhere) {
                return Err(DiscoveryError::WritesNowhere {
                    rank: tp.rank,
                    size: tp.size,
                    decode_sizes,
                });
            }
        }
        found
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// An etcd value: a record's JSON and the MAC that authenticates it.
#[derive(serde::Serialize, serde::Deserialize)]
struct Sealed {
    record: String,
    mac: String,
}

/// The MAC of record `json` under `key` and `lease`, keyed from `secret`: a record moved to
/// another key, or put under another lease, does not check.
fn record_mac(secret: &Secret, key: &str, lease: i64, json: &str) -> blake3::Hash {
    let mut h = blake3::Hasher::new_keyed(&secret.record_key());
    h.update(&(key.len() as u64).to_le_bytes());
    h.update(key.as_bytes());
    h.update(&lease.to_le_bytes());
    h.update(json.as_bytes());
    h.finalize()
}

/// The value that holds record `json` under `key` and `lease`.
fn seal(secret: &Secret, key: &str, lease: i64, json: &str) -> Vec<u8> {
    let sealed = Sealed {
        record: json.to_owned(),
        mac: record_mac(secret, key, lease, json).to_hex().to_string(),
    };
    // Two strings: their encoding cannot fail.
    serde_json::to_vec(&sealed).unwrap_or_default()
}

/// The value a registration of `record` under `cfg` puts under `lease` (for tests and tools that
/// write etcd themselves).
///
/// # Errors
/// A bad cluster or instance name.
pub fn sealed_value(
    cfg: &EtcdConfig,
    record: &EngineRecord,
    lease: i64,
) -> Result<Vec<u8>, DiscoveryError> {
    let key = record.key(&cfg.prefix()?)?;
    let json = serde_json::to_string(record).map_err(|e| DiscoveryError::BadRecord {
        key: key.clone(),
        reason: e.to_string(),
    })?;
    Ok(seal(&cfg.secret, &key, lease, &json))
}

/// The record `value` holds under `key` and `lease`, if its MAC checks.
fn parse(
    secret: &Secret,
    key: &str,
    lease: i64,
    value: &[u8],
) -> Result<EngineRecord, DiscoveryError> {
    let bad = |reason: String| DiscoveryError::BadRecord {
        key: key.to_string(),
        reason,
    };
    let sealed: Sealed = serde_json::from_slice(value).map_err(|e| bad(e.to_string()))?;
    let mac = blake3::Hash::from_hex(&sealed.mac).map_err(|e| bad(e.to_string()))?;
    // `blake3::Hash` compares in constant time.
    if mac != record_mac(secret, key, lease, &sealed.record) {
        return Err(bad(
            "its MAC does not check: not written with the deployment's secret, or moved".into(),
        ));
    }
    serde_json::from_str(&sealed.record).map_err(|e| bad(e.to_string()))
}

/// Replaces the records with the prefix's listing; returns its revision. Records that vanished
/// while the directory was not following are dropped without a `Deleted` event: only a watched
/// deletion says that an engine's lease ended.
async fn list(
    cfg: &EtcdConfig,
    client: &mut etcd_client::Client,
    records: &Mutex<HashMap<String, EngineRecord>>,
    events: &tokio::sync::broadcast::Sender<DirectoryEvent>,
    refused: &std::sync::atomic::AtomicU64,
) -> Result<i64, DiscoveryError> {
    let prefix = cfg.prefix()?;
    let resp = client
        .get(prefix, Some(etcd_client::GetOptions::new().with_prefix()))
        .await?;
    let rev = resp
        .header()
        .map_or(0, etcd_client::ResponseHeader::revision);
    let mut fresh = HashMap::new();
    for kv in resp.kvs() {
        let key = String::from_utf8_lossy(kv.key()).into_owned();
        match parse(&cfg.secret, &key, kv.lease(), kv.value()) {
            Ok(r) => {
                fresh.insert(key, r);
            }
            Err(e) => {
                refused.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                tracing::warn!(error = %e, "ignoring a record");
            }
        }
    }
    let mut map = lock(records);
    for (k, r) in &fresh {
        if map.get(k) != Some(r) {
            let _ = events.send(DirectoryEvent::Put(r.clone()));
        }
    }
    *map = fresh;
    Ok(rev)
}

/// What a directory's follower updates.
struct Follow {
    records: Arc<Mutex<HashMap<String, EngineRecord>>>,
    changed: watch::Sender<u64>,
    events: tokio::sync::broadcast::Sender<DirectoryEvent>,
    live: Arc<std::sync::atomic::AtomicBool>,
    refused: Arc<std::sync::atomic::AtomicU64>,
}

async fn follow(
    cfg: EtcdConfig,
    mut client: etcd_client::Client,
    prefix: String,
    mut rev: i64,
    f: Follow,
) {
    use std::sync::atomic::Ordering;
    let bound = cfg.watch_liveness.max(Duration::from_millis(10));
    loop {
        let opts = etcd_client::WatchOptions::new()
            .with_prefix()
            .with_prev_key()
            .with_progress_notify()
            .with_start_revision(rev + 1);
        // Creating the watch waits on a stopped etcd too (up to the client's own 5 s timeout), so it
        // is bounded like every answer the follower waits for.
        let watch = tokio::time::timeout(bound, client.watch(prefix.as_str(), Some(opts))).await;
        if let Ok(Ok(mut stream)) = watch {
            // Whether a progress notification was asked for and has not come yet.
            let mut asked = false;
            loop {
                let resp = match tokio::time::timeout(bound, stream.message()).await {
                    Ok(Ok(Some(resp))) => resp,
                    Ok(_) => break,
                    Err(_) if asked => {
                        tracing::warn!(
                            silent = ?bound * 2,
                            "etcd watch silent past its bound: connecting again"
                        );
                        break;
                    }
                    Err(_) => {
                        asked = true;
                        // The request itself waits on a stopped etcd (up to the client's own
                        // timeout), so it too is bounded: no answer within the bound is silence.
                        match tokio::time::timeout(bound, stream.request_progress()).await {
                            Ok(Ok(())) => continue,
                            _ => break,
                        }
                    }
                };
                asked = false;
                if resp.canceled() {
                    break;
                }
                if let Some(h) = resp.header() {
                    rev = rev.max(h.revision());
                }
                for ev in resp.events() {
                    let Some(kv) = ev.kv() else { continue };
                    let key = String::from_utf8_lossy(kv.key()).into_owned();
                    rev = rev.max(kv.mod_revision());
                    match ev.event_type() {
                        etcd_client::EventType::Put => {
                            match parse(&cfg.secret, &key, kv.lease(), kv.value()) {
                                Ok(r) => {
                                    lock(&f.records).insert(key, r.clone());
                                    let _ = f.events.send(DirectoryEvent::Put(r));
                                }
                                // The key no longer holds its record, nor its lease: as deleted
                                // (as a listing would find it), until the registration that
                                // owns the key puts the record back at its next renewal.
                                Err(e) => {
                                    f.refused.fetch_add(1, Ordering::Relaxed);
                                    tracing::warn!(error = %e, "ignoring a record");
                                    if let Some(r) = lock(&f.records).remove(&key) {
                                        let _ = f.events.send(DirectoryEvent::Deleted(r));
                                    }
                                }
                            }
                        }
                        etcd_client::EventType::Delete => {
                            let old = lock(&f.records).remove(&key).or_else(|| {
                                ev.prev_kv().and_then(|p| {
                                    parse(&cfg.secret, &key, p.lease(), p.value()).ok()
                                })
                            });
                            if let Some(r) = old {
                                let _ = f.events.send(DirectoryEvent::Deleted(r));
                            }
                        }
                    }
                }
                if !resp.events().is_empty() {
                    f.changed.send_modify(|n| *n += 1);
                }
            }
        }
        // etcd went away, went silent, or compacted past us: connect again and list afresh.
        f.live.store(false, Ordering::Release);
        f.changed.send_modify(|n| *n += 1);
        loop {
            tokio::time::sleep(Duration::from_millis(500)).await;
            let Ok(mut c) = cfg.connect().await else {
                continue;
            };
            if let Ok(r) = list(&cfg, &mut c, &f.records, &f.events, &f.refused).await {
                rev = r;
                client = c;
                f.live.store(true, Ordering::Release);
                f.changed.send_modify(|n| *n += 1);
                break;
            }
        }
    }
}

/// Brings decode `engine` in line with `directory`'s records as they stand (those of the prefill
/// ranks that write into its TP rank), for
/// when its events were missed (the directory's event queue overflowed): an evicted rank whose
/// start registered again is readmitted, and a connected rank whose record is gone (its lease
/// ended, the deletion unseen) is evicted. Nothing is evicted while the directory does not follow
/// etcd ([`Directory::is_live`]): its records may be stale then. Returns how many ranks were
/// evicted.
pub fn reconcile_decode(engine: &DecodeEngine, directory: &Directory) -> usize {
    let tp = engine.tp();
    let records: Vec<EngineRecord> = directory
        .records()
        .into_iter()
        .filter(|r| writes_into_decode(&tp, r))
        .collect();
    for r in &records {
        engine.readmit_in(&r.instance, r.pp_rank, r.incarnation);
    }
    if !directory.is_live() {
        return 0;
    }
    let mut evicted = 0;
    for (instance, rank, incarnation) in engine.connected_ranks() {
        // A start is known by its incarnation (its slot may differ from its PP rank where several
        // prefill TP ranks write into this decode TP rank).
        let registered = records
            .iter()
            .any(|r| r.instance == instance && r.incarnation == incarnation);
        if !registered && engine.evict_in(&instance, rank, incarnation) {
            tracing::warn!(
                rank,
                incarnation,
                "prefill rank's record is gone while it is connected: evicted"
            );
            evicted += 1;
        }
    }
    evicted
}

/// Whether prefill rank `r` writes into decode TP rank `tp` ([`TpConfig::writes_into`]).
fn writes_into_decode(tp: &TpConfig, r: &EngineRecord) -> bool {
    r.role == RecordRole::Prefill && tp.writes_into((r.tp_rank, r.tp_size), (tp.rank, tp.size))
}

/// Follows `directory` for decode `engine`, for the prefill ranks that write into its TP rank: a
/// prefill rank whose record is deleted while that start of it is connected is evicted (its lease
/// expired: the process died or is stopped), and readmitted if the same start registers again. A
/// named prefill instance is served once a rank of it registers, at that rank's PP and TP sizes.
/// Runs until the engine is dropped or the directory closes.
pub async fn watch_decode(engine: DecodeEngine, directory: Directory) {
    let tp = engine.tp();
    let mut events = directory.events();
    loop {
        let ev = match events.recv().await {
            Ok(ev) => ev,
            Err(tokio::sync::broadcast::error::RecvError::Lagged(n)) => {
                tracing::warn!(missed = n, "directory events missed: reconciling");
                reconcile_decode(&engine, &directory);
                continue;
            }
            Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
        };
        let (r, deleted) = match ev {
            DirectoryEvent::Deleted(r) => (r, true),
            DirectoryEvent::Put(r) => (r, false),
        };
        if !writes_into_decode(&tp, &r) {
            continue;
        }
        // A named prefill instance registering is served: its ranks may connect.
        if !deleted
            && !r.instance.is_empty()
            && let Err(e) = engine.add_instance(&r.instance, r.pp_size, r.tp_size)
        {
            tracing::warn!(instance = %r.instance, error = %e, "prefill instance not served");
        }
        if deleted && engine.evict_in(&r.instance, r.pp_rank, r.incarnation) {
            tracing::warn!(
                rank = r.pp_rank,
                incarnation = r.incarnation,
                "prefill rank's etcd lease ended while it is connected: evicted"
            );
        } else if !deleted && engine.readmit_in(&r.instance, r.pp_rank, r.incarnation) {
            tracing::info!(
                rank = r.pp_rank,
                "prefill rank registered again: readmitted"
            );
        }
    }
}

/// Makes `cfg` a prefill rank found through etcd: binds its vote mesh socket on `host` (any free
/// port), registers the rank (record `address`: that socket; its TP rank and size are `cfg.tp`'s),
/// and waits up to `timeout` for a decode engine it writes into and every PP rank of its TP rank
/// to be registered; then fills `cfg.decode`, `cfg.peers` and `cfg.mesh_socket`. The other decode
/// engines it writes into come with [`join_prefill`]. Keep the registration as long as the engine
/// runs.
///
/// # Errors
/// etcd unreachable, the socket cannot be bound, or the cluster incomplete at `timeout`
/// ([`DiscoveryError::WritesNowhere`] where the decode engines registered then are ones this rank
/// writes nothing into).
pub async fn find_prefill_cluster(
    etcd: &EtcdConfig,
    cfg: &mut PrefillConfig,
    host: std::net::IpAddr,
    timeout: Duration,
) -> Result<(Registration, Directory), DiscoveryError> {
    if cfg.pp_rank >= cfg.pp_size {
        return Err(DiscoveryError::BadRecord {
            key: "this rank".into(),
            reason: format!("pp_rank {} not below pp_size {}", cfg.pp_rank, cfg.pp_size),
        });
    }
    let mut address = SocketAddr::new(host, 0);
    if cfg.pp_size > 1 {
        let socket = MeshSocket::bind(address).map_err(|e| DiscoveryError::BadRecord {
            key: "the vote mesh socket".into(),
            reason: e.to_string(),
        })?;
        address = socket.local_addr().map_err(|e| DiscoveryError::BadRecord {
            key: "the vote mesh socket".into(),
            reason: e.to_string(),
        })?;
        cfg.mesh_socket = Some(Arc::new(socket));
    }
    let record = EngineRecord {
        role: RecordRole::Prefill,
        engine_id: cfg.engine_id.clone(),
        address,
        tp_rank: cfg.tp.rank,
        tp_size: cfg.tp.size,
        pp_rank: cfg.pp_rank,
        pp_size: cfg.pp_size,
        total_layers: cfg.total_layers,
        page_tokens: cfg.page_tokens,
        first_layer: cfg.layout.first_layer,
        num_layers: cfg.layout.num_layers,
        incarnation: cfg.incarnation,
        instance: cfg.instance.clone(),
    };
    let directory = Directory::open(etcd).await?;
    let registration = Registration::register(etcd, record).await?;
    let (decode, peers) = directory
        .wait_for_cluster(&cfg.instance, &cfg.tp, cfg.pp_size, timeout)
        .await?;
    cfg.decode = decode.address;
    if cfg.pp_size > 1 {
        cfg.peers = peers;
        // Our own entry is the socket we hold, whatever an older record of this rank said.
        cfg.peers[usize::from(cfg.pp_rank)] = address;
    }
    Ok((registration, directory))
}

/// Follows `directory` for prefill rank `engine`: a PP peer (a rank of the same prefill instance
/// and TP rank) that registers a new address (a restarted rank listens on a new port) is
/// reconnected to there. A peer whose lease ends is left to decode, which evicts it; this rank's
/// board still waits for that peer's votes (a stopped peer that resumes casts them) up to their
/// deadline. Every decode engine registered in the cluster that this rank writes into
/// ([`TpConfig::writes_into`]), now or later (other decode TP ranks and instances, a decode
/// restarted on a new address), is served too ([`PrefillEngine::add_decode`]). Runs until the
/// directory closes.
pub async fn watch_prefill(engine: PrefillEngine, directory: Directory) {
    let tp = engine.tp();
    let writes_into = |r: &EngineRecord| {
        r.role == RecordRole::Decode && tp.writes_into((tp.rank, tp.size), (r.tp_rank, r.tp_size))
    };
    let mut events = directory.events();
    let serve = |r: &EngineRecord| {
        let (engine, addr) = (engine.clone(), r.address);
        tokio::spawn(async move {
            if let Err(e) = engine.add_decode(addr).await {
                tracing::warn!(decode = %addr, error = %e, "registered decode engine not served");
            }
        });
    };
    let serve_all = || {
        for r in directory.records() {
            if writes_into(&r) {
                serve(&r);
            }
        }
    };
    serve_all();
    loop {
        let ev = match events.recv().await {
            Ok(ev) => ev,
            // Events were lost: every decode registered now (one already linked keeps its link).
            Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {
                serve_all();
                continue;
            }
            Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
        };
        let DirectoryEvent::Put(r) = ev else {
            continue;
        };
        match r.role {
            RecordRole::Decode if writes_into(&r) => serve(&r),
            RecordRole::Decode => {}
            RecordRole::Prefill
                if r.instance == engine.instance()
                    && r.tp_rank == tp.rank
                    && r.pp_rank != engine.pp_rank() =>
            {
                engine.set_peer_address(r.pp_rank, r.address);
            }
            RecordRole::Prefill => {}
        }
    }
}

/// An engine's membership in an etcd cluster: its registration, its directory and the task that
/// follows the directory for it (which holds a handle to the engine). Drop it before shutting the
/// engine down: that revokes the record and stops the task.
#[derive(Debug)]
pub struct Membership {
    /// The engine's record.
    pub registration: Registration,
    /// The cluster as etcd has it.
    pub directory: Directory,
    _follow: AbortOnDrop,
}

/// Registers decode engine `engine` with `record` (its TP rank and size set to the engine's) and
/// follows the cluster for it ([`watch_decode`]).
///
/// # Errors
/// etcd unreachable.
pub async fn join_decode(
    etcd: &EtcdConfig,
    engine: &DecodeEngine,
    mut record: EngineRecord,
) -> Result<Membership, DiscoveryError> {
    let tp = engine.tp();
    (record.tp_rank, record.tp_size) = (tp.rank, tp.size);
    let directory = Directory::open(etcd).await?;
    let registration = Registration::register(etcd, record).await?;
    let task = tokio::spawn(watch_decode(engine.clone(), directory.clone()));
    Ok(Membership {
        registration,
        directory,
        _follow: AbortOnDrop(task),
    })
}

/// Follows the cluster for prefill rank `engine`, started with a configuration from
/// [`find_prefill_cluster`] ([`watch_prefill`]).
pub fn join_prefill(
    engine: &PrefillEngine,
    registration: Registration,
    directory: Directory,
) -> Membership {
    let task = tokio::spawn(watch_prefill(engine.clone(), directory.clone()));
    Membership {
        registration,
        directory,
        _follow: AbortOnDrop(task),
    }
}

impl Membership {
    /// Leaves the cluster: stops following it and revokes the record, so that peers see the
    /// engine gone now rather than a lease later.
    ///
    /// # Errors
    /// etcd did not take the revocation.
    pub async fn leave(self) -> Result<(), DiscoveryError> {
        drop(self._follow);
        self.registration.revoke().await
    }
}
