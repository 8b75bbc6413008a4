//! Which pages may open a WebSocket here. A browser sends cookies and credentials with a
//! WebSocket handshake whatever page starts it and applies no same-origin rule to the socket,
//! so any site a user visits could read live streams or speak MQTT through the user's browser
//! (cross-site WebSocket hijacking). The handshake's `Origin` says which page asked: requests
//! without one (devices, CLI tools and libraries, which send none) and same-origin pages are
//! let in; any other origin must be listed.

use axum::http::{HeaderMap, header};

/// Whether a WebSocket handshake with these request headers may proceed, given the origins
/// allowed beyond the same origin (`*` allows any).
pub(crate) fn allowed(headers: &HeaderMap, listed: &[String]) -> bool {
    let Some(origin) = headers.get(header::ORIGIN) else {
        return true;
    };
    let Ok(origin) = origin.to_str() else {
        return false;
    };
    if listed
        .iter()
        .any(|l| l == "*" || l.eq_ignore_ascii_case(origin))
    {
        return true;
    }
    let host = headers.get(header::HOST).and_then(|h| h.to_str().ok());
    host.is_some_and(|host| same_origin(origin, host))
}

/// Whether `origin` (`scheme://host[:port]`) names the same host and port as the request's
/// `Host` header, a missing port being the scheme's default.
fn same_origin(origin: &str, host: &str) -> bool {
    let Some((scheme, authority)) = origin.split_once("://") else {
        return false;
    };
    let default_port = match scheme.to_ascii_lowercase().as_str() {
        "http" | "ws" => "80",
        "https" | "wss" => "443",
        _ => return false,
    };
    let (origin_host, origin_port) = split_port(authority);
    let (host_host, host_port) = split_port(host);
    origin_host.eq_ignore_ascii_case(host_host)
        && origin_port.unwrap_or(default_port) == host_port.unwrap_or(default_port)
}

/// `host[:port]` → (host, port); an IPv6 literal keeps its brackets.
fn split_port(authority: &str) -> (&str, Option<&str>) {
    match authority.rsplit_once(':') {
        Some((h, p)) if !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()) => (h, Some(p)),
        _ => (authority, None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(origin: Option<&str>, host: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(header::HOST, host.parse().unwrap());
        if let Some(o) = origin {
            h.insert(header::ORIGIN, o.parse().unwrap());
        }
        h
    }

    #[test]
    fn no_origin_and_same_origin_are_allowed() {
        assert!(allowed(&headers(None, "gw:8080"), &[]));
        assert!(allowed(&headers(Some("http://gw:8080"), "gw:8080"), &[]));
        assert!(allowed(&headers(Some("https://GW"), "gw:443"), &[]));
        assert!(allowed(
            &headers(Some("http://[::1]:8080"), "[::1]:8080"),
            &[]
        ));
    }

    #[test]
    fn other_origins_only_when_listed() {
        let h = headers(Some("https://evil.example"), "gw:8080");
        assert!(!allowed(&h, &[]));
        assert!(!allowed(&headers(Some("http://gw:8081"), "gw:8080"), &[]));
        assert!(!allowed(&headers(Some("null"), "gw:8080"), &[]));
        assert!(!allowed(&headers(Some("http://gw"), "gw:8080"), &[]));
        assert!(allowed(&h, &["https://evil.example".to_owned()]));
        assert!(allowed(&h, &["*".to_owned()]));
    }
}
