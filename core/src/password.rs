//! Password hashes for the protocols' user lists (Kafka SASL/PLAIN, MQTT username/password):
//! `sha256:` and the lowercase hex SHA-256 of the password, compared in constant time.

use sha2::{Digest, Sha256};

/// The stored form of a password.
pub fn hash_password(password: &[u8]) -> String {
    let digest = Sha256::digest(password);
    let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    format!("sha256:{hex}")
}

/// Whether `password` matches a stored `sha256:` hash.
pub fn verify_password(stored: &str, password: &[u8]) -> bool {
    let computed = hash_password(password);
    let (a, b) = (stored.as_bytes(), computed.as_bytes());
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Whether `stored` has the form `sha256:` + 64 hex digits.
pub fn is_password_hash(stored: &str) -> bool {
    stored
        .strip_prefix("sha256:")
        .is_some_and(|hex| hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_hexdigit()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hashes_and_verifies() {
        let h = hash_password(b"secret");
        assert_eq!(
            h,
            "sha256:2bb80d537b1da3e38bd30361aa855686bde0eacd7162fef6a25fe97bf527a25b"
        );
        assert!(is_password_hash(&h));
        assert!(verify_password(&h, b"secret"));
        assert!(!verify_password(&h, b"Secret"));
        assert!(!verify_password("sha256:short", b"secret"));
        assert!(!is_password_hash("md5:abc"));
    }
}
