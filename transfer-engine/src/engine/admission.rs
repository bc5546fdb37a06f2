//! Who a listener lets run a handshake: at most [`MAX_PENDING_HANDSHAKES`] unauthenticated ones at
//! once, and once every place is taken a new connection takes the place of the oldest handshake of
//! the source address that holds the most places. A peer that proved the secret gives its place
//! back once its Hello is checked ([`Vouch`]): from then on no newer connection takes its
//! handshake (one chosen just before, while the peer sent its Hello, can still end it).
//!
//! So connections that arrive and say nothing from one address cannot keep real peers out: a peer
//! from another address gets a place (the silent ones are the oldest of the address that holds the
//! most), and one from the same address gets the place of that address's oldest. This mitigates
//! rather than closes: one address still holds up to half the places against another; 64
//! addresses (64 IPv6 /64 prefixes, which one IPv6 allocation holds many of) keep every place; and
//! opening connections faster than a real peer authenticates gives away the real peer's place from
//! its own address. An IPv6 address counts by its /64 prefix (one host can have a whole /64); IPv4
//! addresses, and IPv6 addresses that map one, count whole.
//!
//! [`Admission`] is the rule, without I/O (Python's side channels take it too, through the
//! package's `HandshakePlaces`); [`Places`] shares it between a listener's accept loop and its
//! handshake tasks, each of which holds a [`Place`] and gives up its handshake when told
//! ([`Place::evicted`]).

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::sync::{Arc, Mutex};

/// Unauthenticated control connections one listener lets run their handshake at once. Each
/// handshake is bounded by its deadline, which frees its place, and a newer connection takes the
/// place of an older one once every place is taken (see the module's documentation), so peers that
/// connect and say nothing cannot exhaust the process's descriptors and tasks, and from fewer
/// addresses than places cannot hold every place.
pub const MAX_PENDING_HANDSHAKES: usize = 64;

/// The first and the longest pause after an accept error (a full descriptor table fails every
/// accept at once: without a pause the loop would spin).
const ACCEPT_PAUSE: (std::time::Duration, std::time::Duration) = (
    std::time::Duration::from_millis(10),
    std::time::Duration::from_secs(1),
);

/// The address a connection's places are counted under.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Source {
    /// An IPv4 address (or an IPv6 address that maps one).
    V4(u32),
    /// The /64 prefix of an IPv6 address.
    V6(u64),
}

impl Source {
    pub(crate) fn of(ip: IpAddr) -> Self {
        match ip {
            IpAddr::V4(a) => Self::V4(u32::from(a)),
            IpAddr::V6(a) => match a.to_ipv4_mapped() {
                Some(v4) => Self::V4(u32::from(v4)),
                None => {
                    let o = a.octets();
                    Self::V6(u64::from_be_bytes([
                        o[0], o[1], o[2], o[3], o[4], o[5], o[6], o[7],
                    ]))
                }
            },
        }
    }
}

/// The places of one listener's handshakes, by the order they were taken. Sans-IO: the caller
/// closes the connection an [`admit`](Self::admit) gives up.
#[derive(Debug)]
pub struct Admission {
    cap: usize,
    next: u64,
    held: BTreeMap<u64, Source>,
}

impl Admission {
    /// At most `cap` places (at least one).
    #[must_use]
    pub fn new(cap: usize) -> Self {
        Self {
            cap: cap.max(1),
            next: 0,
            held: BTreeMap::new(),
        }
    }

    /// A place for a new connection from `ip`, and the place it takes where every place was held:
    /// the oldest of the source address that holds the most places, the new one counted (of
    /// sources holding as many, the one whose oldest place is oldest). Places are numbered from 0
    /// in the order they are taken.
    pub fn admit(&mut self, ip: IpAddr) -> (u64, Option<u64>) {
        self.admit_from(Source::of(ip))
    }

    pub(crate) fn admit_from(&mut self, source: Source) -> (u64, Option<u64>) {
        let evicted = if self.held.len() < self.cap {
            None
        } else {
            // Per source: places held (with the new one) and the oldest of them.
            let mut by_source: HashMap<Source, (usize, u64)> = HashMap::new();
            for (&seq, &s) in &self.held {
                // `held` iterates oldest first, so the first seen of a source is its oldest.
                by_source.entry(s).or_insert((0, seq)).0 += 1;
            }
            if let Some(e) = by_source.get_mut(&source) {
                e.0 += 1;
            }
            by_source
                .into_values()
                .max_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)))
                .map(|(_, oldest)| oldest)
        };
        if let Some(seq) = evicted {
            self.held.remove(&seq);
        }
        let seq = self.next;
        self.next += 1;
        self.held.insert(seq, source);
        (seq, evicted)
    }

    /// Gives a place back (a no-op for one already given up).
    pub fn release(&mut self, seq: u64) {
        self.held.remove(&seq);
    }

    #[cfg(test)]
    pub(crate) fn held(&self) -> impl Iterator<Item = (u64, Source)> + '_ {
        self.held.iter().map(|(&k, &v)| (k, v))
    }
}

/// One listener's places, shared by its accept loop and its handshake tasks.
#[derive(Debug)]
pub(crate) struct Places {
    state: Mutex<PlacesState>,
}

#[derive(Debug)]
struct PlacesState {
    rule: Admission,
    /// Tells each held place's task to give up its handshake.
    evict: HashMap<u64, tokio::sync::oneshot::Sender<()>>,
}

impl Places {
    pub(crate) fn new() -> Arc<Self> {
        Arc::new(Self {
            state: Mutex::new(PlacesState {
                rule: Admission::new(MAX_PENDING_HANDSHAKES),
                evict: HashMap::new(),
            }),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, PlacesState> {
        // The state is a map updated in single steps: a panic elsewhere leaves it whole.
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A place for a connection from `ip`; where it takes another's, that one's task is told.
    fn take(self: &Arc<Self>, ip: IpAddr) -> (Place, bool) {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let mut st = self.lock();
        let (seq, evicted) = st.rule.admit(ip);
        if let Some(tell) = evicted.and_then(|old| st.evict.remove(&old)) {
            // Its task may have ended already; then there is no one to tell.
            let _ = tell.send(());
        }
        st.evict.insert(seq, tx);
        let place = Place {
            places: self.clone(),
            seq,
            evicted: Some(rx),
        };
        (place, evicted.is_some())
    }
}

/// A handshake's place; given back when dropped.
#[derive(Debug)]
pub(crate) struct Place {
    places: Arc<Places>,
    seq: u64,
    /// `None` once it resolved.
    evicted: Option<tokio::sync::oneshot::Receiver<()>>,
}

impl Place {
    /// What marks this place's peer as authenticated, for the handshake's checks to call.
    pub(crate) fn vouch(&self) -> Vouch {
        Vouch {
            places: self.places.clone(),
            seq: self.seq,
        }
    }

    /// Resolves once a newer connection took this place: the handshake should end at once.
    ///
    /// # Cancel safety
    /// Cancel safe: dropping the future loses nothing, a later call resolves as this one would.
    pub(crate) async fn evicted(&mut self) {
        if let Some(rx) = self.evicted.as_mut() {
            // The sender goes only with a word, or with the place itself: either is the end.
            let _ = rx.await;
            self.evicted = None;
        }
    }
}

/// Marks a handshake's peer as authenticated: [`Vouch::authenticated`].
#[derive(Debug)]
pub(crate) struct Vouch {
    places: Arc<Places>,
    seq: u64,
}

impl Vouch {
    /// The peer proved the secret: its place goes to the next connection, and no newer one takes
    /// its handshake (it ends at its deadline, as any).
    pub(crate) fn authenticated(&self) {
        self.places.lock().rule.release(self.seq);
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        let mut st = self.places.lock();
        st.rule.release(self.seq);
        st.evict.remove(&self.seq);
    }
}

/// The next connection, with its place among the handshakes in progress. Every connection that
/// the listener accepts gets one; where it takes an older handshake's place, or is gone before it
/// could be set up, `refused` is called. After any other accept error (no descriptors, buffers or
/// memory) the loop pauses, twice as long each time in a row, up to a second.
pub(super) async fn admit(
    listener: &crate::control::Listener,
    places: &Arc<Places>,
    mut refused: impl FnMut(),
) -> (crate::control::Connection, Place) {
    let mut pause = ACCEPT_PAUSE.0;
    loop {
        match listener.accept().await {
            Ok(conn) => {
                let (place, took) = places.take(conn.peer_addr().ip());
                if took {
                    refused();
                    tracing::debug!(peer = %conn.peer_addr(), "every handshake place taken: an older handshake of the busiest address gave way");
                }
                return (conn, place);
            }
            // One connection's own failure (reset by its peer before it was set up): the next
            // is accepted at once, or a peer resetting connections would stall the listener.
            Err(e) if e.is_peer_gone() => {
                refused();
                tracing::debug!(error = %e, "connection gone before it was set up");
            }
            Err(e) => {
                tracing::warn!(error = %e, ?pause, "accept failed; pausing");
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(ACCEPT_PAUSE.1);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::net::{Ipv4Addr, Ipv6Addr};

    #[test]
    fn sources_count_ipv6_by_prefix_and_mapped_ipv4_as_ipv4() {
        let a: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 1, 2, 0, 0, 0, 1);
        let b: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 1, 2, 0xffff, 0, 0, 9);
        let c: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 1, 3, 0, 0, 0, 1);
        assert_eq!(Source::of(a.into()), Source::of(b.into()));
        assert_ne!(Source::of(a.into()), Source::of(c.into()));
        let v4 = Ipv4Addr::new(10, 0, 0, 7);
        assert_eq!(
            Source::of(IpAddr::V6(v4.to_ipv6_mapped())),
            Source::of(v4.into())
        );
        assert_ne!(
            Source::of(Ipv4Addr::new(10, 0, 0, 8).into()),
            Source::of(v4.into())
        );
    }

    #[test]
    fn a_newcomer_from_another_address_takes_the_place_of_the_busiest_addresss_oldest() {
        let (flood, real) = (Source::V4(1), Source::V4(2));
        let mut a = Admission::new(4);
        let seqs: Vec<u64> = (0..4).map(|_| a.admit_from(flood).0).collect();
        let (_, gone) = a.admit_from(real);
        assert_eq!(gone, Some(seqs[0]));
        // The flood's next one takes its own oldest, not the real peer's.
        let (_, gone) = a.admit_from(flood);
        assert_eq!(gone, Some(seqs[1]));
        assert_eq!(a.held().filter(|&(_, s)| s == real).count(), 1);
    }

    #[test]
    fn an_authenticated_peers_handshake_is_never_given_up() {
        let places = Places::new();
        let ip = IpAddr::V4(Ipv4Addr::LOCALHOST);
        let (mut first, _) = places.take(ip);
        first.vouch().authenticated();
        // Every place taken and taken again, from the same address: the vouched one stays.
        let mut rest: Vec<Place> = Vec::new();
        for _ in 0..3 * MAX_PENDING_HANDSHAKES {
            rest.push(places.take(ip).0);
        }
        let told = |p: &mut Place| {
            p.evicted.as_mut().is_none_or(|rx| {
                !matches!(
                    rx.try_recv(),
                    Err(tokio::sync::oneshot::error::TryRecvError::Empty)
                )
            })
        };
        assert!(!told(&mut first));
        let given_up = rest.iter_mut().map(told).filter(|&t| t).count();
        assert_eq!(given_up, 2 * MAX_PENDING_HANDSHAKES);
    }

    proptest! {
        /// Whatever the order of arrivals and departures: never more places than the cap, and a
        /// place is given up only while every place is held, only by the source that holds the
        /// most (the newcomer counted), and only its oldest.
        #[test]
        fn places_go_to_the_busiest_sources_oldest_first(
            cap in 1usize..8,
            ops in proptest::collection::vec((0u32..4, any::<bool>(), 0usize..16), 1..200),
        ) {
            let mut a = Admission::new(cap);
            for (src, arrive, pick) in ops {
                let held: Vec<(u64, Source)> = a.held().collect();
                if arrive || held.is_empty() {
                    let source = Source::V4(src);
                    let (seq, gone) = a.admit_from(source);
                    prop_assert!(held.iter().all(|&(s, _)| s < seq));
                    match gone {
                        None => prop_assert!(held.len() < cap),
                        Some(g) => {
                            prop_assert_eq!(held.len(), cap);
                            let count = |s: Source| {
                                held.iter().filter(|&&(_, x)| x == s).count()
                                    + usize::from(s == source)
                            };
                            let of = held.iter().find(|&&(q, _)| q == g).map(|&(_, s)| s);
                            let Some(of) = of else {
                                return Err(TestCaseError::fail("gave up a place not held"));
                            };
                            // Of the sources holding the most, the one whose oldest place is oldest.
                            let oldest_of = |s: Source| {
                                held.iter().filter(|&&(_, x)| x == s).map(|&(q, _)| q).min()
                            };
                            for &(_, s) in &held {
                                prop_assert!(count(of) >= count(s));
                                if count(s) == count(of) {
                                    prop_assert!(oldest_of(of) <= oldest_of(s));
                                }
                            }
                            let oldest = held.iter().filter(|&&(_, x)| x == of).map(|&(q, _)| q).min();
                            prop_assert_eq!(oldest, Some(g));
                        }
                    }
                    prop_assert!(a.held().count() <= cap);
                    prop_assert!(a.held().any(|(q, _)| q == seq));
                } else {
                    let (seq, _) = held[pick % held.len()];
                    a.release(seq);
                    prop_assert!(a.held().all(|(q, _)| q != seq));
                }
            }
        }
    }
}
