//! Goodput at an SLO: per policy, the highest load at which the TTFT p99 stays under a
//! target (`kvroute bench --slo-ttft-p99 100,250`), and with `--slo-tpot-p99` the time per
//! output token's p99 under its own at once (a joint SLO; `--disagg` sets 25 ms by default).
//!
//! Multi-turn is a closed loop: its load is how many users hold a conversation at once (each
//! sends its next turn after an answer and a think time), not how fast they arrive, so its
//! search is over the number of users ([`Load::of`]); the others' is over the arrival rate.
//!
//! The search, per workload and policy, probes whole runs (a fresh fleet each) at chosen
//! loads and keeps every probe; for each SLO in turn it brackets the goodput between the
//! highest load that met it (below the lowest that failed) and the lowest that failed: from
//! the workload's default it doubles or halves until both sides are seen, then bisects
//! (geometric mean) until they are within [`RESOLUTION`], at most [`MAX_PROBES`] probes per
//! SLO (probes of an earlier SLO count for the next). A probe with errors fails every SLO.
//!
//! Each probe records the CPU the bench process used (its fleet, router and front door run
//! in it) over the probe's wall time and cores: above [`HOST_BOUND`] the host, not the
//! fleet, is what limits the rate, and the report says so.

use serde::Serialize;

use crate::summary::Summary;

/// Bisection stops once the failing rate is within this factor of the meeting one.
pub const RESOLUTION: f64 = 1.2;
/// Probes per SLO at most.
pub const MAX_PROBES: usize = 6;
/// Lowest and highest loads probed (requests/s; users for multi-turn).
pub const MIN_RATE: f64 = 0.25;
pub const MAX_RATE: f64 = 512.0;
/// A probe whose process used more than this share of the machine's CPU is host-bound.
pub const HOST_BOUND: f64 = 0.8;

/// One probe: a whole run at one rate.
#[derive(Clone, Debug, Serialize)]
pub struct Probe {
    pub rate: f64,
    pub ttft_p99_ms: Option<f64>,
    pub ttft_p50_ms: Option<f64>,
    pub tpot_p99_ms: Option<f64>,
    /// The TPOT p99 it must stay under as well (ms; `None`: TTFT alone).
    pub slo_tpot_ms: Option<f64>,
    pub hit_rate: Option<f64>,
    /// In a disaggregated fleet, the share of requests split into two legs (the rest were
    /// kept in place).
    pub disaggregated_share: Option<f64>,
    pub errors: usize,
    pub wall_secs: f64,
    /// CPU seconds of the bench process over wall seconds x cores.
    pub cpu_share: Option<f64>,
}

impl Probe {
    pub fn new(rate: f64, summary: &Summary, wall_secs: f64, cpu_share: Option<f64>) -> Self {
        Self {
            rate,
            ttft_p99_ms: summary.ttft_ms.p99,
            ttft_p50_ms: summary.ttft_ms.p50,
            tpot_p99_ms: summary.tpot_ms.p99,
            slo_tpot_ms: None,
            hit_rate: summary.hit_rate,
            disaggregated_share: summary.disaggregated_share,
            errors: summary.errors,
            wall_secs,
            cpu_share,
        }
    }

    /// The TPOT p99 must also stay under `slo_tpot_ms` (the joint SLO).
    pub fn with_tpot_slo(self, slo_tpot_ms: Option<f64>) -> Self {
        Self { slo_tpot_ms, ..self }
    }

    pub fn meets(&self, slo_ms: f64) -> bool {
        let tpot = match self.slo_tpot_ms {
            Some(slo) => self.tpot_p99_ms.is_some_and(|p| p <= slo),
            None => true,
        };
        self.errors == 0 && self.ttft_p99_ms.is_some_and(|p| p < slo_ms) && tpot
    }

    pub fn host_bound(&self) -> bool {
        self.cpu_share.is_some_and(|c| c > HOST_BOUND)
    }
}

/// The goodput bracket of `slo_ms` among `probes`: the highest meeting rate below the lowest
/// failing one, and that failing one.
pub fn bracket(probes: &[Probe], slo_ms: f64) -> (Option<f64>, Option<f64>) {
    let failed = probes.iter().filter(|p| !p.meets(slo_ms)).map(|p| p.rate).reduce(f64::min);
    let met = probes
        .iter()
        .filter(|p| p.meets(slo_ms) && failed.is_none_or(|f| p.rate < f))
        .map(|p| p.rate)
        .reduce(f64::max);
    (met, failed)
}

/// The next rate to probe for `slo_ms`, or `None` when the bracket is tight enough (or the
/// rate left the probed range).
pub fn next_rate(probes: &[Probe], slo_ms: f64, start: f64) -> Option<f64> {
    match bracket(probes, slo_ms) {
        (None, None) => Some(start),
        (Some(met), None) => Some(met * 2.0).filter(|r| *r <= MAX_RATE),
        (None, Some(failed)) => Some(failed / 2.0).filter(|r| *r >= MIN_RATE),
        (Some(met), Some(failed)) => (failed / met > RESOLUTION).then(|| (met * failed).sqrt()),
    }
}

/// What a workload's goodput search varies.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Load {
    /// Arrivals per second (open loop).
    Rate,
    /// Users holding a conversation at once (closed loop).
    Users,
}

impl Load {
    pub fn of(kind: crate::workload::WorkloadKind) -> Self {
        match kind {
            crate::workload::WorkloadKind::MultiTurn | crate::workload::WorkloadKind::Sessions => {
                Self::Users
            }
            _ => Self::Rate,
        }
    }

    pub fn unit(self) -> &'static str {
        match self {
            Self::Rate => "req/s",
            Self::Users => "users",
        }
    }

    /// The step loads are rounded to, so a bisection does not probe 23.9999 beside 24 (and
    /// users come whole).
    fn quantum(self) -> f64 {
        match self {
            Self::Rate => 0.01,
            Self::Users => 1.0,
        }
    }
}

/// Runs the search for every SLO: `probe(load)` runs one probe.
pub fn search(
    slos_ms: &[f64],
    start: f64,
    load: Load,
    mut probe: impl FnMut(f64) -> anyhow::Result<Probe>,
) -> anyhow::Result<Vec<Probe>> {
    let mut probes: Vec<Probe> = Vec::new();
    for &slo in slos_ms {
        for _ in 0..MAX_PROBES {
            let Some(rate) = next_rate(&probes, slo, start) else { break };
            let rate = ((rate / load.quantum()).round() * load.quantum()).max(load.quantum());
            if probes.iter().any(|p| (p.rate - rate).abs() < 1e-9) {
                break;
            }
            probes.push(probe(rate)?);
        }
    }
    probes.sort_by(|a, b| a.rate.total_cmp(&b.rate));
    Ok(probes)
}

/// One policy's probes on one workload.
#[derive(Clone, Debug, Serialize)]
pub struct PolicyGoodput {
    pub label: String,
    pub probes: Vec<Probe>,
}

impl PolicyGoodput {
    /// The goodput at `slo_ms` (`None`: not even the lowest rate probed met it).
    pub fn goodput(&self, slo_ms: f64) -> Option<f64> {
        bracket(&self.probes, slo_ms).0
    }
}

/// Every policy's search on one workload.
#[derive(Clone, Debug, Serialize)]
pub struct GoodputResult {
    pub workload: crate::workload::WorkloadKind,
    pub load: Load,
    pub start_rate: f64,
    pub slos_ms: Vec<f64>,
    pub policies: Vec<PolicyGoodput>,
}

/// CPU seconds this process has used (user + system), from `/proc/self/stat`.
pub fn process_cpu_secs() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the command name (which may hold spaces) in parentheses.
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the whole line: 11 and 12 after the name.
    let ticks: f64 = fields.get(11)?.parse::<f64>().ok()? + fields.get(12)?.parse::<f64>().ok()?;
    // The kernel reports them in USER_HZ, 100 on every Linux architecture we run on.
    Some(ticks / 100.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A probe that measured `p99` ms and nothing else.
    fn probe(rate: f64, p99: f64) -> Probe {
        Probe {
            rate,
            ttft_p99_ms: Some(p99),
            ttft_p50_ms: None,
            tpot_p99_ms: None,
            slo_tpot_ms: None,
            hit_rate: None,
            disaggregated_share: None,
            errors: 0,
            wall_secs: 1.0,
            cpu_share: None,
        }
    }

    /// A fleet whose p99 grows with the rate past a knee: the search finds each SLO's
    /// goodput within the resolution, sharing probes between SLOs, within its bounds.
    #[test]
    fn the_search_brackets_each_slo() {
        let p99 = |rate: f64| if rate <= 30.0 { 40.0 + rate } else { 70.0 + (rate - 30.0) * 20.0 };
        let mut calls = 0;
        let probes = search(&[100.0, 250.0], 24.0, Load::Rate, |rate| {
            calls += 1;
            Ok(probe(rate, p99(rate)))
        })
        .unwrap();
        assert_eq!(calls, probes.len());
        let result = PolicyGoodput { label: "kv".into(), probes };
        // True goodputs: p99 < 100 below 31.5; < 250 below 39.
        let at100 = result.goodput(100.0).unwrap();
        let at250 = result.goodput(250.0).unwrap();
        assert!((31.5 / RESOLUTION..31.5).contains(&at100), "{at100}");
        assert!((39.0 / RESOLUTION..39.0).contains(&at250), "{at250}");
        assert!(calls <= 2 * MAX_PROBES, "{calls} probes");
        // A fleet that fails everything: goodput none, the search stops at the floor.
        let none = search(&[100.0], 24.0, Load::Rate, |rate| Ok(probe(rate, 1e6))).unwrap();
        assert_eq!(bracket(&none, 100.0).0, None);
        assert!(none.len() <= MAX_PROBES);
        // Errors fail a probe whatever its latency.
        let failed = Probe { errors: 1, ..none[0].clone() };
        assert!(!Probe { ttft_p99_ms: Some(1.0), ..failed }.meets(100.0));
    }

    /// The joint SLO: a probe meets it only with both p99s under their targets, and a
    /// search over a fleet whose TPOT fails first finds the TPOT's knee.
    #[test]
    fn the_joint_slo_needs_both() {
        let joint = |rate: f64, ttft: f64, tpot: f64| {
            Probe { tpot_p99_ms: Some(tpot), ..probe(rate, ttft) }.with_tpot_slo(Some(25.0))
        };
        assert!(joint(1.0, 100.0, 20.0).meets(250.0));
        assert!(!joint(1.0, 100.0, 30.0).meets(250.0));
        assert!(!joint(1.0, 300.0, 20.0).meets(250.0));
        // Without a TPOT measured, the joint SLO cannot be met.
        assert!(!probe(1.0, 100.0).with_tpot_slo(Some(25.0)).meets(250.0));
        assert!(probe(1.0, 100.0).with_tpot_slo(None).meets(250.0));
        // TTFT is fine everywhere; TPOT passes 25 ms above 6 req/s.
        let probes =
            search(&[250.0], 4.0, Load::Rate, |r| Ok(joint(r, 50.0, 15.0 + 2.0 * r))).unwrap();
        let g = PolicyGoodput { label: "kv".into(), probes }.goodput(250.0).unwrap();
        assert!((5.0 / RESOLUTION..=5.0).contains(&g), "{g}");
    }

    /// Users come whole: a search over users probes integers only, each once.
    #[test]
    fn a_search_over_users_probes_whole_users() {
        let probes =
            search(&[100.0], 24.0, Load::Users, |users| Ok(probe(users, 3.0 * users))).unwrap();
        assert!(probes.iter().all(|p| p.rate.fract() == 0.0 && p.rate >= 1.0), "{probes:?}");
        let mut seen: Vec<f64> = probes.iter().map(|p| p.rate).collect();
        seen.dedup();
        assert_eq!(seen.len(), probes.len());
        // p99 = 3 ms per user: 33 users meet 100 ms, 34 do not.
        let g = PolicyGoodput { label: "kv".into(), probes }.goodput(100.0).unwrap();
        assert!((33.0 / RESOLUTION..=33.0).contains(&g), "{g}");
        assert_eq!(Load::of(crate::workload::WorkloadKind::MultiTurn), Load::Users);
        assert_eq!(Load::of(crate::workload::WorkloadKind::SharedPrefix), Load::Rate);
    }

    #[test]
    fn cpu_time_is_counted() {
        let before = process_cpu_secs().unwrap();
        // Work until the counter moves (it ticks every 10 ms of CPU).
        let mut x = 1u64;
        let t0 = std::time::Instant::now();
        while process_cpu_secs().unwrap() <= before && t0.elapsed().as_secs() < 10 {
            for _ in 0..100_000 {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
            }
        }
        std::hint::black_box(x);
        let spent = process_cpu_secs().unwrap() - before;
        assert!(spent > 0.0 && spent < 10.0, "{spent}");
    }
}
