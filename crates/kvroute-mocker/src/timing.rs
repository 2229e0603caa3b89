//! The timing model of Dynamo's mocker (docs/mocker.md), fitted to a real GPU:
//! prefill of `t` uncached tokens takes `4.209989e-7 t^2 + 1.518344e-2 t + 16.50142` ms, a
//! decode step `-25.74 p^2 + 54.01 p + 5.74` ms where `p` is the share of the KV capacity the
//! running requests use; both divided by `speedup`.

use std::time::Duration;

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Timing {
    /// 1 = the formulas in real time; 100 = a hundred times faster.
    pub speedup: f64,
}

impl Default for Timing {
    fn default() -> Self {
        Self { speedup: 1.0 }
    }
}

impl Timing {
    pub fn prefill(&self, uncached_tokens: usize) -> Duration {
        let t = uncached_tokens as f64;
        let ms = 4.209_989e-7 * t * t + 1.518_344e-2 * t + 16.501_42;
        self.scaled(ms)
    }

    /// `kv_share`: running requests' KV blocks / capacity, in 0..=1.
    pub fn decode(&self, kv_share: f64) -> Duration {
        let p = kv_share.clamp(0.0, 1.0);
        self.scaled(-25.74 * p * p + 54.01 * p + 5.74)
    }

    /// A duration of the timing model's time in simulated time (divided by `speedup`).
    pub fn scale(&self, d: Duration) -> Duration {
        self.scaled(d.as_secs_f64() * 1e3)
    }

    fn scaled(&self, ms: f64) -> Duration {
        Duration::from_secs_f64((ms / self.speedup.max(1e-9)).max(0.0) / 1e3)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_points() {
        let t = Timing::default();
        // 1,000 uncached tokens: 0.421 + 15.183 + 16.501 = 32.105 ms.
        assert!((t.prefill(1000).as_secs_f64() * 1e3 - 32.105).abs() < 0.01);
        assert!((t.decode(0.0).as_secs_f64() * 1e3 - 5.74).abs() < 1e-9);
        assert!((t.decode(0.5).as_secs_f64() * 1e3 - (-6.435 + 27.005 + 5.74)).abs() < 1e-9);
        let fast = Timing { speedup: 100.0 };
        assert!((fast.prefill(1000).as_secs_f64() * 1e5 - 32.105).abs() < 0.01);
    }
}
