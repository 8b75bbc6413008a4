//! A token bucket for per-connection rates (publishes per second, bytes per second): a
//! connection that goes past its rate waits (its socket goes unread meanwhile, so the sender
//! is slowed by TCP itself) rather than being cut off.

use std::time::Duration;

use tokio::time::Instant;

/// Messages and bytes per second one connection may send; 0: unlimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Rates {
    pub messages_per_second: u32,
    pub bytes_per_second: u64,
}

impl Rates {
    pub fn is_unlimited(&self) -> bool {
        self.messages_per_second == 0 && self.bytes_per_second == 0
    }
}

/// The buckets of one connection: each holds at most one second's worth, so a burst after a
/// quiet time is as large as one second's rate.
#[derive(Debug)]
pub struct RateLimit {
    rates: Rates,
    messages: f64,
    bytes: f64,
    last: Instant,
}

impl RateLimit {
    /// `None` when `rates` limit nothing.
    pub fn new(rates: Rates) -> Option<Self> {
        (!rates.is_unlimited()).then(|| Self {
            rates,
            messages: f64::from(rates.messages_per_second),
            bytes: rates.bytes_per_second as f64,
            last: Instant::now(),
        })
    }

    /// Takes one message of `bytes` and returns how long the sender must wait before the next
    /// one (zero while it is within its rates).
    pub fn take(&mut self, bytes: usize) -> Duration {
        let now = Instant::now();
        let elapsed = now.duration_since(self.last).as_secs_f64();
        self.last = now;
        let mut wait: f64 = 0.0;
        if self.rates.messages_per_second > 0 {
            let rate = f64::from(self.rates.messages_per_second);
            self.messages = (self.messages + elapsed * rate).min(rate) - 1.0;
            if self.messages < 0.0 {
                wait = wait.max(-self.messages / rate);
            }
        }
        if self.rates.bytes_per_second > 0 {
            let rate = self.rates.bytes_per_second as f64;
            self.bytes = (self.bytes + elapsed * rate).min(rate) - bytes as f64;
            if self.bytes < 0.0 {
                wait = wait.max(-self.bytes / rate);
            }
        }
        Duration::from_secs_f64(wait)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_burst_of_one_second_then_the_rate() {
        let mut r = RateLimit::new(Rates {
            messages_per_second: 10,
            bytes_per_second: 0,
        })
        .unwrap();
        for _ in 0..10 {
            assert_eq!(r.take(1), Duration::ZERO);
        }
        // The eleventh is a tenth of a second early.
        let wait = r.take(1);
        assert!((wait.as_secs_f64() - 0.1).abs() < 1e-6, "{wait:?}");
        tokio::time::advance(Duration::from_secs(2)).await;
        // Refilled, but never past one second's worth.
        for _ in 0..10 {
            assert_eq!(r.take(1), Duration::ZERO);
        }
        assert!(r.take(1) > Duration::ZERO);
    }

    #[tokio::test(start_paused = true)]
    async fn bytes_are_limited_by_size() {
        let mut r = RateLimit::new(Rates {
            messages_per_second: 0,
            bytes_per_second: 1000,
        })
        .unwrap();
        assert_eq!(r.take(1000), Duration::ZERO);
        let wait = r.take(500);
        assert!((wait.as_secs_f64() - 0.5).abs() < 1e-6, "{wait:?}");
        assert!(RateLimit::new(Rates::default()).is_none());
    }
}
