//! Each tenant's recent use of the fleet, for flow control's reserve (docs/routing.md,
//! "Overload"): the prompt tokens the router sent to engines for it, decayed with a half-life
//! of [`HALF_LIFE`]. A tenant is *over its share* when it used more than
//! [`FlowConfig::over_share`](super::FlowConfig::over_share) times the mean of the tenants
//! that used the fleet lately (two of them at least): its requests then take a worker only
//! while the predicted wait there is within a fraction of the limit, and the headroom above
//! is kept for the others.

use std::sync::Arc;
use std::time::{Duration, Instant};

use rustc_hash::FxHashMap;

/// How fast a tenant's use is forgotten: half of it every this long.
pub const HALF_LIFE: Duration = Duration::from_secs(10);
/// Tenants remembered at most (the tenant is a client's header when no keys are set): past
/// it, those that used least are forgotten first.
pub const MAX_TENANTS: usize = 4_096;
/// Below this many tokens (decayed) a tenant no longer counts as using the fleet.
const FORGOTTEN: f64 = 1.0;

/// Decayed prompt tokens admitted per tenant.
#[derive(Debug, Default)]
pub struct Shares {
    /// Each tenant's use at its last update, and when that was.
    used: FxHashMap<Arc<str>, (f64, Instant)>,
}

fn decayed(value: f64, since: Instant, now: Instant) -> f64 {
    let half_lives = now.saturating_duration_since(since).as_secs_f64() / HALF_LIFE.as_secs_f64();
    value * 0.5f64.powf(half_lives)
}

impl Shares {
    /// `tokens` more of `tenant`'s prompts went to the engines.
    pub fn record(&mut self, tenant: &Arc<str>, tokens: f64, now: Instant) {
        let entry = self.used.entry(tenant.clone()).or_insert((0.0, now));
        *entry = (decayed(entry.0, entry.1, now) + tokens.max(1.0), now);
        if self.used.len() > MAX_TENANTS {
            self.used.retain(|_, (v, at)| decayed(*v, *at, now) >= FORGOTTEN);
        }
        while self.used.len() > MAX_TENANTS {
            let least = self
                .used
                .iter()
                .min_by(|a, b| decayed(a.1.0, a.1.1, now).total_cmp(&decayed(b.1.0, b.1.1, now)))
                .map(|(t, _)| t.clone());
            match least {
                Some(t) => self.used.remove(&t),
                None => break,
            };
        }
    }

    /// Whether `tenant` used more than `ratio` times the mean of the tenants using the fleet
    /// (never with fewer than two of them, nor with `ratio` 0: the reserve off).
    pub fn over(&self, tenant: &str, ratio: f64, now: Instant) -> bool {
        self.limit(ratio, now).is_some_and(|limit| self.used(tenant, now) > limit)
    }

    /// The use past which a tenant is over its share: `ratio` times the mean of the tenants
    /// using the fleet (`None`: fewer than two of them, or `ratio` 0). One pass over the
    /// tenants, for callers that judge several.
    pub fn limit(&self, ratio: f64, now: Instant) -> Option<f64> {
        if ratio <= 0.0 {
            return None;
        }
        let (mut sum, mut active) = (0.0, 0usize);
        for &(v, at) in self.used.values() {
            let v = decayed(v, at, now);
            if v >= FORGOTTEN {
                sum += v;
                active += 1;
            }
        }
        (active >= 2).then(|| ratio * sum / active as f64)
    }

    /// `tenant`'s use, decayed to `now`.
    pub fn used(&self, tenant: &str, now: Instant) -> f64 {
        self.used.get(tenant).map_or(0.0, |&(v, at)| decayed(v, at, now))
    }

    /// Tenants remembered.
    pub fn len(&self) -> usize {
        self.used.len()
    }

    pub fn is_empty(&self) -> bool {
        self.used.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tenant_at_ten_times_the_others_is_over_its_share_and_they_are_not() {
        let mut s = Shares::default();
        let now = Instant::now();
        let t = |n: &str| Arc::<str>::from(n);
        for _ in 0..10 {
            s.record(&t("heavy"), 1_000.0, now);
        }
        for n in ["a", "b", "c"] {
            s.record(&t(n), 1_000.0, now);
        }
        assert!(s.over("heavy", 1.5, now));
        assert!(!s.over("a", 1.5, now));
        assert!(!s.over("nobody", 1.5, now));
        assert!(!s.over("heavy", 0.0, now), "the reserve off");
        // Alone, or two alike, nobody is over a share.
        let mut two = Shares::default();
        two.record(&t("x"), 5_000.0, now);
        assert!(!two.over("x", 1.5, now));
        two.record(&t("y"), 5_000.0, now);
        assert!(!two.over("x", 1.5, now) && !two.over("y", 1.5, now));
    }

    #[test]
    fn use_is_forgotten_by_half_lives() {
        let mut s = Shares::default();
        let now = Instant::now();
        let (heavy, light) = (Arc::<str>::from("heavy"), Arc::<str>::from("light"));
        s.record(&heavy, 8_000.0, now);
        s.record(&light, 1_000.0, now);
        assert!(s.over("heavy", 1.5, now));
        // Three half-lives on, heavy's 8,000 count 1,000, as much as light's fresh 1,000.
        let later = now + HALF_LIFE * 3;
        s.record(&light, 1_000.0, later);
        assert!(!s.over("heavy", 1.5, later));
    }

    #[test]
    fn tenants_remembered_are_bounded() {
        let mut s = Shares::default();
        let now = Instant::now();
        for i in 0..MAX_TENANTS + 50 {
            s.record(&Arc::from(format!("t{i}")), 10.0 + i as f64, now);
        }
        assert_eq!(s.len(), MAX_TENANTS);
        // The least used went first.
        assert!(!s.used.contains_key("t0") && s.used.contains_key("t4145"));
    }
}
