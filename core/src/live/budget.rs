//! What all rings together may keep past their own size for catch-up subscribers that still
//! need it (the engine-wide lag budget).

use super::*;

/// Memory that every ring of an engine together may hold past its own size for catch-up
/// subscribers that still need it.
#[derive(Debug)]
pub(crate) struct LagBudget {
    pub(super) limit: usize,
    pub(super) used: AtomicUsize,
}

impl LagBudget {
    pub(crate) fn new(limit: usize) -> Self {
        Self {
            limit,
            used: AtomicUsize::new(0),
        }
    }

    /// Bytes held now, by all rings.
    pub(crate) fn used(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }

    /// Moves one ring's charge from `*held` to `want`: always when it shrinks, when it grows
    /// only if the budget has room.
    pub(super) fn resize(&self, held: &mut usize, want: usize) -> bool {
        let mut used = self.used.load(Ordering::Relaxed);
        loop {
            let next = used - *held + want;
            if want > *held && next > self.limit {
                return false;
            }
            match self
                .used
                .compare_exchange_weak(used, next, Ordering::Relaxed, Ordering::Relaxed)
            {
                Ok(_) => {
                    *held = want;
                    return true;
                }
                Err(now) => used = now,
            }
        }
    }
}
