//! A seeded fault-injecting [`Transport`] for tests: [`FaultTransport`] wraps a real transport, lets it
//! move the bytes, and on the way drops, duplicates, reorders, delays or corrupts incoming
//! notifications, and fails, stalls or strips outgoing posts (of their notification, or of one of
//! their writes), as a [`FaultPlan`] says.
//!
//! ```no_run
//! use std::sync::Arc;
//! use transfer_engine::core::RequestId;
//! use transfer_engine::transport::fault::{FaultPlan, FaultTransport, Match, RecvFault, Rule};
//! use transfer_engine::transport::ucx::{UcxConfig, UcxTransport};
//! use transfer_engine::transport::{Sink, Transport};
//!
//! let sink: Sink = Arc::new(|_| {});
//! // Drop the LAST notification rank 2 sends for request 7; everything else passes.
//! let plan = FaultPlan::new(42).on_recv(Rule::new(
//!     Match::request(RequestId(7)).rank(2).last(),
//!     RecvFault::Drop,
//! ));
//! let t = FaultTransport::new(plan, sink, |s| {
//!     Ok(Arc::new(UcxTransport::new(UcxConfig::default(), s)?) as Arc<dyn Transport>)
//! })?;
//! assert_eq!(t.counters().dropped, 0);
//! # Ok::<(), transfer_engine::transport::TransportError>(())
//! ```
//!
//! # Rules
//! A [`FaultPlan`] holds two ordered lists of [`Rule`]s: receive-side rules ([`RecvFault`]) see every
//! notification the inner transport hands to its sink; send-side rules ([`SendFault`]) see every
//! [`Transport::post`]. A rule applies when its [`Match`] matches (notifications are decoded with
//! [`crate::core::notify`]), it has fired fewer than [`Rule::times`] times, and a roll of the plan's
//! ChaCha8 generator comes under [`Rule::probability`]. The first rule that applies wins; at most one
//! fault is applied per event. A probability of 1 never draws from the generator, so exact-match rules
//! do not disturb the random sequence of probabilistic ones.
//!
//! The generator is seeded, so a plan makes the same decisions for the same sequence of events. Over a
//! real transport the interleaving of events from different peers is not deterministic, so only
//! exact-match rules (and probabilistic rules on a single ordered stream) reproduce exactly.
//!
//! # Library dependency
//! None of its own: it wraps any [`Transport`].
//!
//! # Thread safety
//! `FaultTransport` is `Send + Sync`; every method may be called from any thread. Receive-side faults
//! run on the inner transport's progress thread. Held notifications released by
//! [`FaultTransport::release_held`] and notifications given to [`FaultTransport::inject`] are handed to
//! the sink on the calling thread, so the sink may see two threads at once (the engines' sinks lock).
//! No lock of this module is held while the sink or a [`Done`] runs.
//!
//! # Resource cleanup
//! Dropping the wrapper drops the inner transport (if it held the last reference), discards held
//! notifications, and completes every still-stuck post with [`TransportError::Shutdown`] (each `Done`
//! still runs exactly once). Deregistrations deferred because of stuck posts are carried out then.

use super::{
    BackendKind, Done, Incoming, PeerId, RegionId, RemoteRegion, Sender, Sink, Transport,
    TransportError, TransportStats, WriteOp,
};
use crate::core::RequestId;
use crate::core::notify::{self, ChunkNotification, ChunkStatus, Notification};
use crate::mem::MemDesc;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};

/// The kind of a chunk notification, for [`Match::kind`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum NotifyKind {
    /// A chunk with more to follow.
    More,
    /// A rank's last chunk.
    Last,
    /// A rank's FAILURE notification.
    Failed,
}

impl NotifyKind {
    fn of(status: &ChunkStatus) -> Self {
        match status {
            ChunkStatus::More => NotifyKind::More,
            ChunkStatus::Last { .. } => NotifyKind::Last,
            ChunkStatus::Failed { .. } => NotifyKind::Failed,
        }
    }
}

/// Which notifications (received, or carried by a post) a rule applies to.
///
/// Every field left `None` matches anything. A match with every field `None` ([`Match::any`]) matches
/// every event, including bytes that do not decode; a match with any field set needs a decodable chunk
/// notification whose fields agree.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Match {
    /// The request.
    pub request: Option<RequestId>,
    /// The sending PP rank, as the notification names it.
    pub pp_rank: Option<u16>,
    /// The chunk id.
    pub chunk: Option<u32>,
    /// More, LAST or FAILURE.
    pub kind: Option<NotifyKind>,
}

impl Match {
    /// Matches everything.
    pub fn any() -> Self {
        Match::default()
    }

    /// Notifications of `request`.
    pub fn request(request: RequestId) -> Self {
        Match {
            request: Some(request),
            ..Match::default()
        }
    }

    /// Also requires PP rank `rank`.
    #[must_use]
    pub fn rank(mut self, rank: u16) -> Self {
        self.pp_rank = Some(rank);
        self
    }

    /// Also requires chunk id `chunk`.
    #[must_use]
    pub fn chunk(mut self, chunk: u32) -> Self {
        self.chunk = Some(chunk);
        self
    }

    /// Also requires kind `kind`.
    #[must_use]
    pub fn kind(mut self, kind: NotifyKind) -> Self {
        self.kind = Some(kind);
        self
    }

    /// Also requires a LAST notification.
    #[must_use]
    pub fn last(self) -> Self {
        self.kind(NotifyKind::Last)
    }

    fn is_any(&self) -> bool {
        *self == Match::default()
    }

    fn matches(&self, n: Option<&ChunkNotification>) -> bool {
        if self.is_any() {
            return true;
        }
        let Some(n) = n else { return false };
        self.request.is_none_or(|r| r == n.request)
            && self.pp_rank.is_none_or(|r| r == n.pp_rank)
            && self.chunk.is_none_or(|c| c == n.chunk_id)
            && self.kind.is_none_or(|k| k == NotifyKind::of(&n.status))
    }
}

/// How [`RecvFault::Corrupt`] damages a notification's bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Corruption {
    /// XOR these byte offsets with `0xFF` (offsets past the end are ignored). Offset 0 is in the
    /// binary record's magic, so `Flip(vec![0])` always makes a record that does not decode.
    Flip(Vec<usize>),
    /// XOR this many positions, drawn from the plan's generator, with non-zero masks drawn from it.
    /// The result may still decode, as a different notification.
    Random(u32),
}

/// What to do to a received notification.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RecvFault {
    /// Never deliver it.
    Drop,
    /// Deliver it twice, back to back.
    Duplicate,
    /// Deliver it, and a copy of it again once `after` further notifications have been delivered
    /// (a duplicate that comes late).
    Replay {
        /// Deliveries the copy waits for (at least 1).
        after: u32,
    },
    /// Hold it and deliver it right after the next notification that is delivered (the same as
    /// `Delay { after: Some(1) }`). Held until [`FaultTransport::release_held`] if none follows.
    Reorder,
    /// Hold it until `after` further notifications have been delivered, then deliver it right after the
    /// last of them; with `None`, until [`FaultTransport::release_held`]. A notification that is itself
    /// held, dropped or injected does not count as delivered.
    Delay {
        /// Deliveries to wait for, or `None` for a release call.
        after: Option<u32>,
    },
    /// Deliver a damaged copy instead.
    Corrupt(Corruption),
}

/// What to do to a post.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SendFault {
    /// Post nothing; the post's [`Done`] gets `Err(TransportError::Injected(..))`, on a thread of its
    /// own (never inside [`Transport::post`], as a real progress thread would).
    FailPost,
    /// Leave the post stuck. Exactly: its writes are posted to the inner transport at once, **without**
    /// the notification, so the bytes land; the notification and the post's [`Done`] are held by the
    /// wrapper. Until [`FaultTransport::release_stuck`] the `Done` never runs, the post counts in
    /// [`TransportStats::in_flight`], and the registrations its writes name stay registered: a
    /// [`Transport::deregister`] of one of them is deferred (and counted in
    /// [`TransportStats::deferred_deregistrations`]) until every stuck post naming it is over. On
    /// release the notification is posted alone (no writes) and the `Done` gets that post's result,
    /// or the writes' error if they failed.
    ///
    /// Over the direct UCX backend, "without the notification" means an empty record: that backend
    /// always sends its active message, so the receiver sees an empty record (the decode engine counts
    /// it as malformed and drops it). NIXL sends nothing for an empty notification.
    Stuck,
    /// Post the writes but not the notification: the `Done` gets the writes' result. The same empty
    /// record as for [`SendFault::Stuck`] reaches a UCX receiver.
    DropNotification,
    /// Post the notification and every write but write number `index` (in the post's order; nothing
    /// is dropped from a post with fewer writes): the receiver is told a chunk is in place while part
    /// of it never left, as a lost write would look. The `Done` gets the other writes' result. Only a
    /// checksum or a check of the bytes can tell.
    DropWrite {
        /// Which write of the post to drop, from 0.
        index: u32,
    },
}

/// One fault, when it applies, and how often.
#[derive(Clone, Debug, PartialEq)]
pub struct Rule<F> {
    /// The fault.
    pub fault: F,
    /// What it applies to.
    pub when: Match,
    /// Chance, in `0.0..=1.0`, that it fires on a matching event (1 by default).
    pub probability: f64,
    /// Most times it fires (`None`: no limit).
    pub times: Option<u64>,
}

impl<F> Rule<F> {
    /// A rule that fires on every event `when` matches.
    pub fn new(when: Match, fault: F) -> Self {
        Rule {
            fault,
            when,
            probability: 1.0,
            times: None,
        }
    }

    /// Fires with chance `p` (clamped to `0.0..=1.0`).
    #[must_use]
    pub fn with_probability(mut self, p: f64) -> Self {
        self.probability = if p.is_nan() { 0.0 } else { p.clamp(0.0, 1.0) };
        self
    }

    /// Fires at most `n` times.
    #[must_use]
    pub fn times(mut self, n: u64) -> Self {
        self.times = Some(n);
        self
    }
}

/// The faults a [`FaultTransport`] injects.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct FaultPlan {
    /// Seed of the ChaCha8 generator behind probabilities and random corruption.
    pub seed: u64,
    /// Receive-side rules, first match wins.
    pub recv: Vec<Rule<RecvFault>>,
    /// Send-side rules, first match wins.
    pub send: Vec<Rule<SendFault>>,
}

impl FaultPlan {
    /// No faults; the generator seeded with `seed`.
    pub fn new(seed: u64) -> Self {
        FaultPlan {
            seed,
            ..FaultPlan::default()
        }
    }

    /// Adds a receive-side rule.
    #[must_use]
    pub fn on_recv(mut self, rule: Rule<RecvFault>) -> Self {
        self.recv.push(rule);
        self
    }

    /// Adds a send-side rule.
    #[must_use]
    pub fn on_send(mut self, rule: Rule<SendFault>) -> Self {
        self.send.push(rule);
        self
    }
}

/// What a [`FaultTransport`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FaultCounters {
    /// Notifications the inner transport received.
    pub received: u64,
    /// Notifications handed to the sink (copies, released and injected ones included).
    pub delivered: u64,
    /// Notifications dropped.
    pub dropped: u64,
    /// Notifications duplicated.
    pub duplicated: u64,
    /// Notifications held by [`RecvFault::Reorder`].
    pub reordered: u64,
    /// Notifications held by [`RecvFault::Delay`].
    pub delayed: u64,
    /// Held notifications delivered since.
    pub released_held: u64,
    /// Notifications corrupted.
    pub corrupted: u64,
    /// Notifications given to [`FaultTransport::inject`].
    pub injected: u64,
    /// Posts seen.
    pub posts: u64,
    /// Posts failed by [`SendFault::FailPost`].
    pub failed_posts: u64,
    /// Posts left stuck by [`SendFault::Stuck`].
    pub stuck: u64,
    /// Stuck posts released since.
    pub released_stuck: u64,
    /// Posts whose notification was dropped by [`SendFault::DropNotification`].
    pub dropped_notifications: u64,
    /// Writes dropped by [`SendFault::DropWrite`].
    pub dropped_writes: u64,
}

struct Armed<F> {
    rule: Rule<F>,
    fired: u64,
}

struct Held {
    sender: Sender,
    bytes: Vec<u8>,
    /// Deliveries still to wait for; `None`: until a release call.
    remaining: Option<u32>,
}

struct StuckPost {
    peer: PeerId,
    notification: Vec<u8>,
    /// Taken when the post is completed (or the wrapper dropped), so it runs once.
    done: Option<Done>,
    regions: Vec<RegionId>,
    /// The inner transport's result for the writes, once over.
    writes: Option<Result<(), TransportError>>,
    released: bool,
}

struct State {
    rng: ChaCha8Rng,
    recv: Vec<Armed<RecvFault>>,
    send: Vec<Armed<SendFault>>,
    held: Vec<Held>,
    stuck: HashMap<u64, StuckPost>,
    next_stuck: u64,
    /// Unfinished stuck posts naming each region.
    stuck_refs: HashMap<RegionId, u32>,
    /// Deregistrations waiting for stuck posts.
    deferred: Vec<RegionId>,
    /// Posts whose `Done` the wrapper holds while the inner transport does not count them.
    custody: u64,
    counters: FaultCounters,
}

impl State {
    fn arm(&mut self, plan: FaultPlan) {
        self.rng = ChaCha8Rng::seed_from_u64(plan.seed);
        self.recv = plan
            .recv
            .into_iter()
            .map(|rule| Armed { rule, fired: 0 })
            .collect();
        self.send = plan
            .send
            .into_iter()
            .map(|rule| Armed { rule, fired: 0 })
            .collect();
    }
}

/// Picks the first rule that applies, counting its firing.
fn choose<F: Clone>(
    rules: &mut [Armed<F>],
    rng: &mut ChaCha8Rng,
    n: Option<&ChunkNotification>,
) -> Option<F> {
    for a in rules.iter_mut() {
        if !a.rule.when.matches(n) || a.rule.times.is_some_and(|t| a.fired >= t) {
            continue;
        }
        let p = a.rule.probability;
        let fires = p >= 1.0 || (p > 0.0 && rng.random::<f64>() < p);
        if fires {
            a.fired += 1;
            return Some(a.rule.fault.clone());
        }
    }
    None
}

fn decode_chunk(bytes: &[u8]) -> Option<ChunkNotification> {
    match notify::decode(bytes) {
        Ok(Notification::Chunk(n)) => Some(n),
        _ => None,
    }
}

/// The state the wrapped sink and the inner transport's callbacks share with the wrapper.
struct Shared {
    sink: Sink,
    state: Mutex<State>,
    /// The inner transport, set once it is built; weak because the inner transport holds our sink.
    inner: OnceLock<Weak<dyn Transport>>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // Nothing panics while holding this lock; a poisoned one still guards whole state.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn inner(&self) -> Option<Arc<dyn Transport>> {
        self.inner.get().and_then(Weak::upgrade)
    }

    fn deliver(&self, out: Vec<(Sender, Vec<u8>)>) {
        for (sender, bytes) in out {
            (self.sink)(Incoming::Notification {
                sender,
                bytes: &bytes,
            });
        }
    }

    /// The wrapped sink: runs on the inner transport's progress thread.
    fn on_incoming(&self, ev: Incoming<'_>) {
        let (sender, bytes) = match ev {
            Incoming::Notification { sender, bytes } => (sender, bytes),
            other => {
                (self.sink)(other);
                return;
            }
        };
        let n = decode_chunk(bytes);
        let mut out = Vec::new();
        let mut replay = None;
        {
            let mut st = self.lock();
            let st = &mut *st;
            st.counters.received += 1;
            match choose(&mut st.recv, &mut st.rng, n.as_ref()) {
                None => out.push((sender, bytes.to_vec())),
                Some(RecvFault::Drop) => st.counters.dropped += 1,
                Some(RecvFault::Duplicate) => {
                    st.counters.duplicated += 1;
                    out.push((sender.clone(), bytes.to_vec()));
                    out.push((sender, bytes.to_vec()));
                }
                Some(RecvFault::Replay { after }) => {
                    st.counters.duplicated += 1;
                    out.push((sender.clone(), bytes.to_vec()));
                    replay = Some(Held {
                        sender,
                        bytes: bytes.to_vec(),
                        remaining: Some(after.max(1)),
                    });
                }
                Some(f @ (RecvFault::Reorder | RecvFault::Delay { .. })) => {
                    let remaining = match f {
                        RecvFault::Delay { after } => {
                            st.counters.delayed += 1;
                            after
                        }
                        _ => {
                            st.counters.reordered += 1;
                            Some(1)
                        }
                    };
                    st.held.push(Held {
                        sender,
                        bytes: bytes.to_vec(),
                        remaining,
                    });
                }
                Some(RecvFault::Corrupt(c)) => {
                    st.counters.corrupted += 1;
                    let mut b = bytes.to_vec();
                    match c {
                        Corruption::Flip(offsets) => {
                            for o in offsets {
                                if let Some(x) = b.get_mut(o) {
                                    *x ^= 0xFF;
                                }
                            }
                        }
                        Corruption::Random(k) if !b.is_empty() => {
                            for _ in 0..k {
                                let i = st.rng.random_range(0..b.len());
                                b[i] ^= st.rng.random_range(1..=u8::MAX);
                            }
                        }
                        Corruption::Random(_) => {}
                    }
                    out.push((sender, b));
                }
            }
            if !out.is_empty() {
                // This event was delivered: count it against every notification held before it.
                let mut keep = Vec::with_capacity(st.held.len());
                let held = std::mem::take(&mut st.held);
                let mut released = 0u64;
                for mut h in held {
                    match &mut h.remaining {
                        Some(r) if *r <= 1 => {
                            released += 1;
                            out.push((h.sender, h.bytes));
                        }
                        Some(r) => {
                            *r -= 1;
                            keep.push(h);
                        }
                        None => keep.push(h),
                    }
                }
                st.held = keep;
                st.counters.released_held += released;
            }
            // Held after this delivery was counted: it waits for the ones after.
            st.held.extend(replay);
            st.counters.delivered += out.len() as u64;
        }
        self.deliver(out);
    }

    /// The inner transport finished a stuck post's writes (on its progress thread).
    fn stuck_writes_over(self: &Arc<Self>, id: u64, res: Result<(), TransportError>) {
        let launch = {
            let mut st = self.lock();
            let Some(p) = st.stuck.get_mut(&id) else {
                return;
            };
            if p.done.is_none() {
                // The wrapper was dropped meanwhile and already completed it.
                st.stuck.remove(&id);
                return;
            }
            p.writes = Some(res);
            if p.released {
                st.stuck.remove(&id)
            } else {
                // The inner transport no longer counts it; we hold its Done.
                st.custody += 1;
                None
            }
        };
        if let Some(p) = launch {
            self.launch(p);
        }
    }

    /// Finishes a released stuck post whose writes are over: posts its notification alone, or
    /// completes it with the writes' error.
    fn launch(self: &Arc<Self>, mut p: StuckPost) {
        let Some(done) = p.done.take() else { return };
        let regions = std::mem::take(&mut p.regions);
        let shared = self.clone();
        let finish: Done = Box::new(move |res| {
            done(res);
            shared.stuck_finished(&regions);
        });
        match (p.writes.take(), self.inner()) {
            (Some(Ok(())), Some(inner)) => inner.post(p.peer, Vec::new(), p.notification, finish),
            (Some(Err(e)), _) => run_elsewhere(move || finish(Err(e))),
            _ => run_elsewhere(move || finish(Err(TransportError::Shutdown))),
        }
    }

    /// A stuck post is over: its regions are free, and deferred deregistrations may proceed.
    fn stuck_finished(&self, regions: &[RegionId]) {
        let ready: Vec<RegionId> = {
            let mut st = self.lock();
            for r in regions {
                if let Some(n) = st.stuck_refs.get_mut(r) {
                    *n -= 1;
                    if *n == 0 {
                        st.stuck_refs.remove(r);
                    }
                }
            }
            let (ready, wait): (Vec<_>, Vec<_>) = std::mem::take(&mut st.deferred)
                .into_iter()
                .partition(|r| !st.stuck_refs.contains_key(r));
            st.deferred = wait;
            ready
        };
        if ready.is_empty() {
            return;
        }
        // Possibly on the inner transport's progress thread, whose own calls would wait for it.
        let inner = self.inner.get().cloned();
        run_elsewhere(move || {
            if let Some(inner) = inner.and_then(|w| w.upgrade()) {
                for r in ready {
                    // SAFETY: `r` was deregistered through this wrapper, whose caller made
                    // `Transport::deregister`'s promise for it; this carries it out.
                    if let Err(e) = unsafe { inner.deregister(r) } {
                        tracing::warn!(region = r.0, error = %e, "deferred deregistration failed");
                    }
                }
            }
        });
    }
}

/// Runs `job` on a short-lived thread of its own (inline if no thread can be started), so a `Done` or
/// a blocking transport call never runs inside the caller's locks or on a progress thread.
fn run_elsewhere(job: impl FnOnce() + Send + 'static) {
    let job = Arc::new(Mutex::new(Some(job)));
    let j2 = job.clone();
    let spawned = std::thread::Builder::new()
        .name("fault-job".into())
        .spawn(move || {
            let f = j2.lock().ok().and_then(|mut g| g.take());
            if let Some(f) = f {
                f();
            }
        });
    if spawned.is_err() {
        let f = job.lock().ok().and_then(|mut g| g.take());
        if let Some(f) = f {
            f();
        }
    }
}

/// A [`Transport`] that forwards to a real one and injects the faults of a [`FaultPlan`].
///
/// Build it with [`FaultTransport::new`], which hands the real transport a wrapped sink. Keep an
/// `Arc` to steer it from a test (`release_held`, `release_stuck`, `set_plan`, `counters`) while an
/// engine uses it as its `Arc<dyn Transport>`.
pub struct FaultTransport {
    inner: Arc<dyn Transport>,
    shared: Arc<Shared>,
}

impl std::fmt::Debug for FaultTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FaultTransport")
            .field("kind", &self.inner.kind())
            .field("counters", &self.counters())
            .finish()
    }
}

impl FaultTransport {
    /// Builds the inner transport with `build` (handing it a sink that applies the receive-side
    /// rules before `sink` sees anything) and wraps it.
    ///
    /// # Errors
    /// Whatever `build` returns.
    pub fn new(
        plan: FaultPlan,
        sink: Sink,
        build: impl FnOnce(Sink) -> Result<Arc<dyn Transport>, TransportError>,
    ) -> Result<Arc<Self>, TransportError> {
        let mut state = State {
            rng: ChaCha8Rng::seed_from_u64(plan.seed),
            recv: Vec::new(),
            send: Vec::new(),
            held: Vec::new(),
            stuck: HashMap::new(),
            next_stuck: 0,
            stuck_refs: HashMap::new(),
            deferred: Vec::new(),
            custody: 0,
            counters: FaultCounters::default(),
        };
        state.arm(plan);
        let shared = Arc::new(Shared {
            sink,
            state: Mutex::new(state),
            inner: OnceLock::new(),
        });
        // The inner transport holds this sink, so it refers to the shared state weakly only through
        // `Shared::inner`; no cycle keeps the inner transport alive.
        let s2 = shared.clone();
        let wrapped: Sink = Arc::new(move |ev| s2.on_incoming(ev));
        let inner = build(wrapped)?;
        let _ = shared.inner.set(Arc::downgrade(&inner));
        Ok(Arc::new(FaultTransport { inner, shared }))
    }

    /// The wrapped transport.
    pub fn inner(&self) -> &Arc<dyn Transport> {
        &self.inner
    }

    /// What it did so far.
    pub fn counters(&self) -> FaultCounters {
        self.shared.lock().counters
    }

    /// Replaces every rule with `plan`'s and reseeds the generator with `plan.seed`. Held
    /// notifications and stuck posts stay held.
    pub fn set_plan(&self, plan: FaultPlan) {
        self.shared.lock().arm(plan);
    }

    /// Appends a receive-side rule.
    pub fn add_recv(&self, rule: Rule<RecvFault>) {
        self.shared.lock().recv.push(Armed { rule, fired: 0 });
    }

    /// Appends a send-side rule.
    pub fn add_send(&self, rule: Rule<SendFault>) {
        self.shared.lock().send.push(Armed { rule, fired: 0 });
    }

    /// Notifications held by [`RecvFault::Reorder`] or [`RecvFault::Delay`] right now.
    pub fn held(&self) -> usize {
        self.shared.lock().held.len()
    }

    /// Delivers every held notification now, in the order they arrived, on the calling thread.
    /// Returns how many.
    pub fn release_held(&self) -> usize {
        let out: Vec<(Sender, Vec<u8>)> = {
            let mut st = self.shared.lock();
            let held = std::mem::take(&mut st.held);
            st.counters.released_held += held.len() as u64;
            st.counters.delivered += held.len() as u64;
            held.into_iter().map(|h| (h.sender, h.bytes)).collect()
        };
        let n = out.len();
        self.shared.deliver(out);
        n
    }

    /// Posts left stuck and not yet released.
    pub fn stuck(&self) -> usize {
        self.shared
            .lock()
            .stuck
            .values()
            .filter(|p| !p.released)
            .count()
    }

    /// Releases every stuck post (see [`SendFault::Stuck`]): each one's notification is posted as soon
    /// as its writes are over, and its `Done` runs when that is. Returns how many were released.
    pub fn release_stuck(&self) -> usize {
        let (released, launch) = {
            let mut st = self.shared.lock();
            let st = &mut *st;
            let mut released = 0u64;
            let mut ready = Vec::new();
            for (&id, p) in st.stuck.iter_mut() {
                if p.released {
                    continue;
                }
                p.released = true;
                released += 1;
                if p.writes.is_some() {
                    ready.push(id);
                }
            }
            let mut launch = Vec::new();
            for id in ready {
                if let Some(p) = st.stuck.remove(&id) {
                    st.custody = st.custody.saturating_sub(1);
                    launch.push(p);
                }
            }
            st.counters.released_stuck += released;
            (released, launch)
        };
        for p in launch {
            self.shared.launch(p);
        }
        released as usize
    }

    /// Hands `bytes` to the sink as a notification from `sender`, on the calling thread, as if the
    /// inner transport had received it. No rule applies to it.
    pub fn inject(&self, sender: Sender, bytes: &[u8]) {
        {
            let mut st = self.shared.lock();
            st.counters.injected += 1;
            st.counters.delivered += 1;
        }
        (self.shared.sink)(Incoming::Notification { sender, bytes });
    }
}

impl Transport for FaultTransport {
    fn kind(&self) -> BackendKind {
        self.inner.kind()
    }

    fn metadata(&self) -> Result<Vec<u8>, TransportError> {
        self.inner.metadata()
    }

    fn name(&self) -> String {
        self.inner.name()
    }

    unsafe fn register(&self, mem: MemDesc) -> Result<(RegionId, RemoteRegion), TransportError> {
        // SAFETY: our caller made `Transport::register`'s promise for `mem`; we pass it on unchanged.
        unsafe { self.inner.register(mem) }
    }

    fn allocate(
        &self,
        len: u64,
    ) -> Result<Option<(RegionId, RemoteRegion, crate::mem::MemDesc)>, TransportError> {
        self.inner.allocate(len)
    }

    fn abandon(&self, id: RegionId) {
        self.inner.abandon(id);
    }

    /// Deferred while a stuck post names the region (see [`SendFault::Stuck`]); forwarded otherwise.
    unsafe fn deregister(&self, id: RegionId) -> Result<(), TransportError> {
        {
            let mut st = self.shared.lock();
            if st.stuck_refs.contains_key(&id) {
                if !st.deferred.contains(&id) {
                    st.deferred.push(id);
                }
                return Ok(());
            }
        }
        // SAFETY: our caller made `Transport::deregister`'s promise for `id`; passed on unchanged.
        unsafe { self.inner.deregister(id) }
    }

    fn connect(
        &self,
        metadata: &[u8],
        regions: &[RemoteRegion],
        key: u64,
    ) -> Result<PeerId, TransportError> {
        self.inner.connect(metadata, regions, key)
    }

    fn disconnect(&self, peer: PeerId) {
        self.inner.disconnect(peer);
    }

    fn post(&self, peer: PeerId, mut writes: Vec<WriteOp>, notification: Vec<u8>, done: Done) {
        let n = decode_chunk(&notification);
        let fault = {
            let mut st = self.shared.lock();
            let st = &mut *st;
            st.counters.posts += 1;
            let fault = choose(&mut st.send, &mut st.rng, n.as_ref());
            match fault {
                Some(SendFault::FailPost) => {
                    st.counters.failed_posts += 1;
                    st.custody += 1;
                }
                Some(SendFault::DropNotification) => st.counters.dropped_notifications += 1,
                Some(SendFault::Stuck) => st.counters.stuck += 1,
                Some(SendFault::DropWrite { index }) => {
                    if let Ok(i) = usize::try_from(index)
                        && i < writes.len()
                    {
                        writes.remove(i);
                        st.counters.dropped_writes += 1;
                    }
                }
                None => {}
            }
            fault
        };
        match fault {
            None | Some(SendFault::DropWrite { .. }) => {
                self.inner.post(peer, writes, notification, done)
            }
            Some(SendFault::DropNotification) => self.inner.post(peer, writes, Vec::new(), done),
            Some(SendFault::FailPost) => {
                let shared = self.shared.clone();
                let what = match n {
                    Some(n) => format!(
                        "post of request {} rank {} chunk {} failed by plan",
                        n.request.0, n.pp_rank, n.chunk_id
                    ),
                    None => "post failed by plan".to_string(),
                };
                run_elsewhere(move || {
                    done(Err(TransportError::Injected(what)));
                    let mut st = shared.lock();
                    st.custody = st.custody.saturating_sub(1);
                });
            }
            Some(SendFault::Stuck) => {
                let mut regions: Vec<RegionId> = writes.iter().map(|w| w.local).collect();
                regions.sort_unstable();
                regions.dedup();
                let id = {
                    let mut st = self.shared.lock();
                    let id = st.next_stuck;
                    st.next_stuck += 1;
                    for r in &regions {
                        *st.stuck_refs.entry(*r).or_insert(0) += 1;
                    }
                    st.stuck.insert(
                        id,
                        StuckPost {
                            peer,
                            notification,
                            done: Some(done),
                            regions,
                            writes: None,
                            released: false,
                        },
                    );
                    id
                };
                let shared = self.shared.clone();
                self.inner.post(
                    peer,
                    writes,
                    Vec::new(),
                    Box::new(move |res| shared.stuck_writes_over(id, res)),
                );
            }
        }
    }

    /// The inner transport's counters, with posts whose `Done` the wrapper holds added to
    /// `in_flight` and deregistrations it defers added to `deferred_deregistrations`.
    fn stats(&self) -> TransportStats {
        let mut s = self.inner.stats();
        let st = self.shared.lock();
        s.in_flight += st.custody;
        s.deferred_deregistrations += st.deferred.len() as u64;
        s
    }
}

impl Drop for FaultTransport {
    fn drop(&mut self) {
        let (dones, deferred) = {
            let mut st = self.shared.lock();
            st.held.clear();
            let mut dones = Vec::new();
            for p in st.stuck.values_mut() {
                if let Some(d) = p.done.take() {
                    dones.push(d);
                }
            }
            // A stuck post whose writes are still in the inner transport finds no entry when they end.
            st.stuck.clear();
            st.stuck_refs.clear();
            st.custody = 0;
            (dones, std::mem::take(&mut st.deferred))
        };
        for d in dones {
            d(Err(TransportError::Shutdown));
        }
        for r in deferred {
            // SAFETY: as in `stuck_finished`: deregistrations our callers asked for, carried out.
            if let Err(e) = unsafe { self.inner.deregister(r) } {
                tracing::warn!(region = r.0, error = %e, "deferred deregistration failed");
            }
        }
    }
}
