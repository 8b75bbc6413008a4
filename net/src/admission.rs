//! Connection caps in total and per source address, shared by every listener of the process.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use parking_lot::Mutex;

/// How many client connections the process takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// Open connections of all listeners together (each holds a file descriptor).
    pub max_connections: usize,
    /// Open connections from one source address, so one host cannot take every slot.
    pub max_connections_per_ip: usize,
}

/// Why a connection was turned away.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// The process holds `max_connections`.
    Total,
    /// The source address holds `max_connections_per_ip`.
    PerAddress,
}

/// The admission state every listener asks before serving a connection.
#[derive(Debug)]
pub struct Admission {
    limits: ConnectionLimits,
    open: AtomicUsize,
    per_ip: Mutex<HashMap<IpAddr, usize>>,
    refused_total: AtomicU64,
    refused_per_ip: AtomicU64,
}

impl Admission {
    pub fn new(limits: ConnectionLimits) -> Arc<Self> {
        Arc::new(Self {
            limits,
            open: AtomicUsize::new(0),
            per_ip: Mutex::new(HashMap::new()),
            refused_total: AtomicU64::new(0),
            refused_per_ip: AtomicU64::new(0),
        })
    }

    pub fn limits(&self) -> ConnectionLimits {
        self.limits
    }

    /// Takes a slot for a connection from `ip`, or says why there is none (counted).
    pub fn admit(self: &Arc<Self>, ip: IpAddr) -> Result<Slot, Refused> {
        // One lock for both counts, so two connections cannot both take the last slot.
        let mut per_ip = self.per_ip.lock();
        if self.open.load(Ordering::Relaxed) >= self.limits.max_connections {
            self.refused_total.fetch_add(1, Ordering::Relaxed);
            return Err(Refused::Total);
        }
        let from_ip = per_ip.entry(ip).or_insert(0);
        if *from_ip >= self.limits.max_connections_per_ip {
            self.refused_per_ip.fetch_add(1, Ordering::Relaxed);
            return Err(Refused::PerAddress);
        }
        *from_ip += 1;
        self.open.fetch_add(1, Ordering::Relaxed);
        Ok(Slot {
            admission: self.clone(),
            ip,
        })
    }

    /// Connections holding a slot now.
    pub fn open(&self) -> usize {
        self.open.load(Ordering::Relaxed)
    }

    /// Connections turned away at `max_connections` and at `max_connections_per_ip`.
    pub fn refused(&self) -> (u64, u64) {
        (
            self.refused_total.load(Ordering::Relaxed),
            self.refused_per_ip.load(Ordering::Relaxed),
        )
    }

    fn release(&self, ip: IpAddr) {
        let mut per_ip = self.per_ip.lock();
        if let Some(n) = per_ip.get_mut(&ip) {
            *n -= 1;
            if *n == 0 {
                // Addresses with no connection are forgotten: the map holds only open ones.
                per_ip.remove(&ip);
            }
        }
        self.open.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A connection's place under the caps, given back when dropped (the task serving it ended,
/// normally or by a panic).
#[derive(Debug)]
pub struct Slot {
    admission: Arc<Admission>,
    ip: IpAddr,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.admission.release(self.ip);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(last: u8) -> IpAddr {
        IpAddr::from([127, 0, 0, last])
    }

    #[test]
    fn caps_hold_in_total_and_per_address_and_slots_come_back() {
        let a = Admission::new(ConnectionLimits {
            max_connections: 3,
            max_connections_per_ip: 2,
        });
        let one = a.admit(ip(1)).unwrap();
        let two = a.admit(ip(1)).unwrap();
        assert_eq!(a.admit(ip(1)).unwrap_err(), Refused::PerAddress);
        let three = a.admit(ip(2)).unwrap();
        assert_eq!(a.admit(ip(3)).unwrap_err(), Refused::Total);
        assert_eq!(a.open(), 3);
        assert_eq!(a.refused(), (1, 1));
        drop(one);
        assert_eq!(a.open(), 2);
        let again = a.admit(ip(1)).unwrap();
        drop((two, three, again));
        assert_eq!(a.open(), 0);
        assert!(
            a.per_ip.lock().is_empty(),
            "no address is kept once its connections end"
        );
    }
}
