//! MQTT topic names and filters: validation and matching (MQTT 3.1.1 §4.7, MQTT 5 §4.7).

/// A topic name a client may publish to: non-empty, no wildcards, no NUL, at most 65,535 bytes.
pub(crate) fn valid_name(name: &str) -> bool {
    !name.is_empty() && name.len() <= 65_535 && !name.contains(['+', '#', '\0'])
}

/// A topic filter a client may subscribe to: `+` fills a whole level, `#` is a whole last level.
pub(crate) fn valid_filter(filter: &str) -> bool {
    if filter.is_empty() || filter.len() > 65_535 || filter.contains('\0') {
        return false;
    }
    let levels: Vec<&str> = filter.split('/').collect();
    levels.iter().enumerate().all(|(i, level)| match *level {
        "#" => i == levels.len() - 1,
        "+" => true,
        l => !l.contains(['+', '#']),
    })
}

/// Whether `name` matches `filter`. Wildcards in the first level do not match names that start
/// with `$` (such as `$SYS/...`).
pub(crate) fn matches(filter: &str, name: &str) -> bool {
    // Without wildcards every level must be equal: one comparison instead of walking the
    // levels, which runs for every live delivery.
    if !filter.contains(['+', '#']) {
        return filter == name;
    }
    if name.starts_with('$') && (filter.starts_with('+') || filter.starts_with('#')) {
        return false;
    }
    let mut f = filter.split('/');
    let mut n = name.split('/');
    loop {
        match (f.next(), n.next()) {
            (Some("#"), _) => return true,
            (Some("+"), Some(_)) => {}
            (Some(a), Some(b)) if a == b => {}
            (None, None) => return true,
            _ => return false,
        }
    }
}

/// Whether some topic name could match both filters.
pub(crate) fn overlaps(a: &str, b: &str) -> bool {
    let mut x = a.split('/');
    let mut y = b.split('/');
    loop {
        match (x.next(), y.next()) {
            (Some("#"), _) | (_, Some("#")) => return true,
            (Some("+"), Some(_)) | (Some(_), Some("+")) => {}
            (Some(p), Some(q)) if p == q => {}
            (None, None) => return true,
            _ => return false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn validation() {
        assert!(valid_name("cameras/7/jpeg"));
        assert!(!valid_name("cameras/+/jpeg") && !valid_name("") && !valid_name("a/#"));
        for ok in ["#", "+", "a/+/c", "a/#", "+/+", "/"] {
            assert!(valid_filter(ok), "{ok}");
        }
        for bad in ["", "a/#/c", "a+/b", "a/b#", "##"] {
            assert!(!valid_filter(bad), "{bad}");
        }
    }

    #[test]
    fn matching() {
        let cases = [
            ("cameras/+/jpeg", "cameras/7/jpeg", true),
            ("cameras/+/jpeg", "cameras/7/png", false),
            ("cameras/#", "cameras", true),
            ("cameras/#", "cameras/7/jpeg", true),
            ("#", "anything/at/all", true),
            ("+", "a/b", false),
            ("a/b", "a/b", true),
            ("a/b", "a/bc", false),
            ("a/b", "a/b/", false),
            ("a", "a/b", false),
            ("", "", true),
            ("$SYS/load", "$SYS/load", true),
            ("+/x", "/x", true),
            ("#", "$SYS/load", false),
            ("$SYS/#", "$SYS/load", true),
        ];
        for (f, n, want) in cases {
            assert_eq!(matches(f, n), want, "{f} vs {n}");
        }
        assert!(overlaps("cameras/+/jpeg", "cameras/#"));
        assert!(overlaps("+/7/+", "cameras/+/jpeg"));
        assert!(!overlaps("cameras/+/jpeg", "sensors/#"));
    }

    proptest! {
        /// A name matched by both filters means they overlap.
        #[test]
        fn matching_both_implies_overlap(
            name in proptest::collection::vec("[ab]", 1..4),
            fa in proptest::collection::vec(prop_oneof!["[ab]", Just("+".to_string())], 1..4),
            fb in proptest::collection::vec(prop_oneof!["[ab]", Just("+".to_string()), Just("#".to_string())], 1..4),
        ) {
            let name = name.join("/");
            let fa = fa.join("/");
            let fb = fb.join("/");
            if valid_filter(&fb) && matches(&fa, &name) && matches(&fb, &name) {
                prop_assert!(overlaps(&fa, &fb));
            }
        }
    }
}
