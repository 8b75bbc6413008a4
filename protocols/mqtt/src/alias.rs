//! Topic aliases on the PUBLISHes the server sends (MQTT 5 §3.3.2.3.4): a client whose CONNECT
//! allows aliases (Topic Alias Maximum > 0) gets each topic name once, with an alias, and the
//! alias alone after. A reading of a few hundred bytes under a 60-byte name to many subscribers
//! then carries the name once per subscriber instead of once per message.
//!
//! Aliases go to names in the order they are first sent, up to the client's maximum (and at
//! most [`OUT_ALIAS_MAX`], which bounds the names a connection keeps); names past them go out
//! in full. An alias is never reassigned, so the mapping a client holds never changes under it.

use std::collections::HashMap;

/// The most aliases the server uses on one connection, whatever the client allows: each holds a
/// topic name in memory for as long as the connection lives.
pub(crate) const OUT_ALIAS_MAX: u16 = 64;

/// A connection's outgoing topic aliases.
#[derive(Debug, Default)]
pub(crate) struct OutAliases {
    max: u16,
    /// Alias → name (alias `i + 1` at `i`), and name → alias.
    names: Vec<Box<str>>,
    by_name: HashMap<Box<str>, u16>,
    /// The alias used last: a subscriber of one topic (the fan-out's case) finds its name
    /// by one comparison instead of hashing it and probing a table at every delivery.
    last: u16,
}

/// How a PUBLISH names its topic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Naming {
    /// The name in full, no alias (aliases off, or all used).
    Full,
    /// The name and an alias it sets.
    Set(u16),
    /// An empty name and the alias that stands for it.
    Use(u16),
}

impl OutAliases {
    /// Aliases for a client that accepts up to `client_max` (0: none).
    pub(crate) fn new(client_max: u16) -> Self {
        Self {
            max: client_max.min(OUT_ALIAS_MAX),
            ..Self::default()
        }
    }

    /// Whether any alias may be used.
    pub(crate) fn on(&self) -> bool {
        self.max > 0
    }

    /// How the next PUBLISH under `name` names it; the first time an alias is set, the name
    /// is kept, so call this only for a PUBLISH that is then written.
    pub(crate) fn naming(&mut self, name: &str) -> Naming {
        if self.last > 0 && *self.names[usize::from(self.last) - 1] == *name {
            return Naming::Use(self.last);
        }
        if let Some(&alias) = self.by_name.get(name) {
            self.last = alias;
            return Naming::Use(alias);
        }
        let used = self.names.len() as u16;
        if used >= self.max {
            return Naming::Full;
        }
        let alias = used + 1;
        self.names.push(name.into());
        self.by_name.insert(name.into(), alias);
        self.last = alias;
        Naming::Set(alias)
    }

    /// Forgets an alias set by a PUBLISH that was not written after all (the client never
    /// learnt it): only the newest alias can be undone.
    pub(crate) fn unset(&mut self, naming: Naming, name: &str) {
        if let Naming::Set(alias) = naming
            && usize::from(alias) == self.names.len()
        {
            self.names.pop();
            self.by_name.remove(name);
            self.last = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_get_aliases_in_order_up_to_the_maximum_and_keep_them() {
        let mut a = OutAliases::new(2);
        assert!(a.on());
        assert_eq!(a.naming("a/1"), Naming::Set(1));
        assert_eq!(a.naming("a/1"), Naming::Use(1));
        assert_eq!(a.naming("a/2"), Naming::Set(2));
        assert_eq!(a.naming("a/3"), Naming::Full, "both aliases are used");
        assert_eq!(a.naming("a/3"), Naming::Full);
        assert_eq!(a.naming("a/1"), Naming::Use(1));
        assert_eq!(a.naming("a/2"), Naming::Use(2));
    }

    #[test]
    fn no_aliases_for_a_client_that_takes_none_and_a_bounded_number_otherwise() {
        let mut none = OutAliases::new(0);
        assert!(!none.on());
        assert_eq!(none.naming("a"), Naming::Full);
        let mut many = OutAliases::new(u16::MAX);
        for i in 0..OUT_ALIAS_MAX {
            assert_eq!(many.naming(&format!("t/{i}")), Naming::Set(i + 1));
        }
        assert_eq!(many.naming("t/next"), Naming::Full);
    }

    #[test]
    fn an_alias_whose_publish_was_not_written_is_set_again_next_time() {
        let mut a = OutAliases::new(4);
        let n = a.naming("x");
        a.unset(n, "x");
        assert_eq!(a.naming("x"), Naming::Set(1));
        // An alias in use is never undone.
        a.unset(Naming::Use(1), "x");
        assert_eq!(a.naming("x"), Naming::Use(1));
    }
}
