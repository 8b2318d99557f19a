//! Webhook signatures: HMAC-SHA256 over the raw body in the forms Stripe (`Stripe-Signature`, with a timestamp
//! and a tolerance against replays) and GitHub (`X-Hub-Signature-256`) use, and a generic form (a header, a
//! prefix, hex or base64). The comparison is constant-time; a request that fails is answered `401` and nothing of
//! it is stored.

use std::fmt;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::http::HeaderMap;
use base64::Engine as _;
use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::error::Error;

type HmacSha256 = Hmac<Sha256>;

/// A signing secret, read from the environment or a file. Its `Debug` form never shows it.
#[derive(Clone)]
pub struct Secret(Vec<u8>);

impl Secret {
    /// A secret given as bytes (tests, or a secret the program holds already).
    pub fn new(secret: impl Into<Vec<u8>>) -> Self {
        Secret(secret.into())
    }

    /// The value of the environment variable `name`; refused when it is unset or empty.
    pub fn from_env(name: &str) -> Result<Self, Error> {
        match std::env::var(name) {
            Ok(value) if !value.trim().is_empty() => Ok(Secret(value.trim().as_bytes().to_vec())),
            Ok(_) => Err(Error::Config(format!("the signing secret's environment variable {name} is empty: set it"))),
            Err(_) => Err(Error::Config(format!(
                "the signing secret's environment variable {name} is not set: export it (or name a file with secret_file)"
            ))),
        }
    }

    /// The contents of the file at `path`, without a trailing newline; refused when unreadable or empty.
    pub fn from_file(path: &std::path::Path) -> Result<Self, Error> {
        let text = std::fs::read(path)
            .map_err(|e| Error::Config(format!("the signing secret's file {} cannot be read: {e}", path.display())))?;
        let trimmed = text.trim_ascii();
        if trimmed.is_empty() {
            return Err(Error::Config(format!("the signing secret's file {} is empty", path.display())));
        }
        Ok(Secret(trimmed.to_vec()))
    }

    fn mac(&self) -> HmacSha256 {
        // HMAC takes a key of any length; this cannot fail.
        <HmacSha256 as Mac>::new_from_slice(&self.0).unwrap_or_else(|_| unreachable!("HMAC accepts any key length"))
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(…)")
    }
}

/// How a signature is encoded in its header (the generic form).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Encoding {
    /// Lower- or upper-case hexadecimal.
    #[default]
    Hex,
    /// Standard base64, with padding.
    Base64,
}

/// Which signature a webhook endpoint requires.
#[derive(Debug, Clone)]
pub enum Signature {
    /// Stripe's: `Stripe-Signature: t=<unix seconds>,v1=<hex>[,v1=…]`, HMAC-SHA256 of `"<t>.<body>"`; a timestamp
    /// further than `tolerance` from now is refused as a possible replay (Stripe's libraries use 5 minutes).
    Stripe {
        /// The endpoint's signing secret (`whsec_…`).
        secret: Secret,
        /// How far the signed timestamp may be from now.
        tolerance: Duration,
    },
    /// GitHub's: `X-Hub-Signature-256: sha256=<hex>`, HMAC-SHA256 of the body.
    GitHub {
        /// The webhook's secret.
        secret: Secret,
    },
    /// HMAC-SHA256 of the body in `header`, after `prefix` (for example `sha256=`), in `encoding`.
    Hmac {
        /// The header holding the signature.
        header: String,
        /// What precedes the signature in the header's value (may be empty).
        prefix: String,
        /// How the signature is written.
        encoding: Encoding,
        /// The shared secret.
        secret: Secret,
    },
}

/// Why a request's signature was refused: said in the `401`'s body and in the log, never with the secret.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct SignatureError(pub String);

impl Signature {
    /// The header this signature is read from.
    pub fn header(&self) -> &str {
        match self {
            Signature::Stripe { .. } => "stripe-signature",
            Signature::GitHub { .. } => "x-hub-signature-256",
            Signature::Hmac { header, .. } => header,
        }
    }

    /// Checks `body` against the signature in `headers`, at `now`.
    pub fn verify(&self, headers: &HeaderMap, body: &[u8], now: SystemTime) -> Result<(), SignatureError> {
        let name = self.header();
        let value = headers
            .get(name)
            .ok_or_else(|| SignatureError(format!("the {name} header is missing")))?
            .to_str()
            .map_err(|_| SignatureError(format!("the {name} header is not text")))?;
        match self {
            Signature::Stripe { secret, tolerance } => verify_stripe(secret, *tolerance, value, body, now),
            Signature::GitHub { secret } => {
                let hex = value
                    .strip_prefix("sha256=")
                    .ok_or_else(|| SignatureError(format!("the {name} header does not start with sha256=")))?;
                let given = decode_hex(hex).ok_or_else(|| SignatureError(format!("the {name} header is not hex")))?;
                check(secret.mac(), body, &given, name)
            }
            Signature::Hmac { prefix, encoding, secret, .. } => {
                let encoded = value
                    .strip_prefix(prefix.as_str())
                    .ok_or_else(|| SignatureError(format!("the {name} header does not start with {prefix}")))?;
                let given = match encoding {
                    Encoding::Hex => decode_hex(encoded),
                    Encoding::Base64 => base64::engine::general_purpose::STANDARD.decode(encoded.trim()).ok(),
                }
                .ok_or_else(|| SignatureError(format!("the {name} header is not {encoding:?}")))?;
                check(secret.mac(), body, &given, name)
            }
        }
    }
}

fn verify_stripe(
    secret: &Secret,
    tolerance: Duration,
    value: &str,
    body: &[u8],
    now: SystemTime,
) -> Result<(), SignatureError> {
    let mut timestamp = None;
    let mut signatures = Vec::new();
    for part in value.split(',') {
        match part.trim().split_once('=') {
            Some(("t", t)) => timestamp = t.parse::<i64>().ok(),
            Some(("v1", hex)) => signatures.extend(decode_hex(hex)),
            _ => {}
        }
    }
    let t = timestamp.ok_or_else(|| SignatureError("the stripe-signature header has no timestamp t=".into()))?;
    if signatures.is_empty() {
        return Err(SignatureError("the stripe-signature header has no v1= signature".into()));
    }
    let now_s = now.duration_since(UNIX_EPOCH).map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX));
    let skew = now_s.saturating_sub(t).unsigned_abs();
    if skew > tolerance.as_secs() {
        return Err(SignatureError(format!(
            "the stripe-signature timestamp is {skew} s from now, outside the tolerance of {} s (a replay, or a clock off)",
            tolerance.as_secs()
        )));
    }
    let mut signed = t.to_string().into_bytes();
    signed.push(b'.');
    signed.extend_from_slice(body);
    for given in &signatures {
        let mut mac = secret.mac();
        mac.update(&signed);
        if mac.verify_slice(given).is_ok() {
            return Ok(());
        }
    }
    Err(SignatureError("no v1 signature in the stripe-signature header matches the body".into()))
}

/// Compares in constant time (`verify_slice`).
fn check(mut mac: HmacSha256, body: &[u8], given: &[u8], name: &str) -> Result<(), SignatureError> {
    mac.update(body);
    mac.verify_slice(given).map_err(|_| SignatureError(format!("the {name} signature does not match the body")))
}

fn decode_hex(text: &str) -> Option<Vec<u8>> {
    let text = text.trim();
    if !text.len().is_multiple_of(2) {
        return None;
    }
    (0..text.len()).step_by(2).map(|i| text.get(i..i + 2).and_then(|pair| u8::from_str_radix(pair, 16).ok())).collect()
}

/// The signature of `body` in the form `signature` expects, for tests and for a sender: the header's value.
pub fn sign(signature: &Signature, body: &[u8], now: SystemTime) -> String {
    let hex = |bytes: &[u8]| bytes.iter().map(|b| format!("{b:02x}")).collect::<String>();
    match signature {
        Signature::Stripe { secret, .. } => {
            let t = now.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
            let mut mac = secret.mac();
            mac.update(format!("{t}.").as_bytes());
            mac.update(body);
            format!("t={t},v1={}", hex(&mac.finalize().into_bytes()))
        }
        Signature::GitHub { secret } => {
            let mut mac = secret.mac();
            mac.update(body);
            format!("sha256={}", hex(&mac.finalize().into_bytes()))
        }
        Signature::Hmac { prefix, encoding, secret, .. } => {
            let mut mac = secret.mac();
            mac.update(body);
            let bytes = mac.finalize().into_bytes();
            let encoded = match encoding {
                Encoding::Hex => hex(&bytes),
                Encoding::Base64 => base64::engine::general_purpose::STANDARD.encode(bytes),
            };
            format!("{prefix}{encoded}")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(name: &str, value: &str) -> HeaderMap {
        let mut map = HeaderMap::new();
        map.insert(axum::http::HeaderName::from_bytes(name.as_bytes()).unwrap(), value.parse().unwrap());
        map
    }

    #[test]
    fn stripe_signatures_hold_within_the_tolerance_only() {
        let stripe = Signature::Stripe { secret: Secret::new("whsec_test"), tolerance: Duration::from_secs(300) };
        let now = SystemTime::now();
        let value = sign(&stripe, b"{\"id\":\"evt_1\"}", now);
        assert_eq!(stripe.verify(&headers("stripe-signature", &value), b"{\"id\":\"evt_1\"}", now), Ok(()));
        let err = stripe.verify(&headers("stripe-signature", &value), b"{\"id\":\"evt_2\"}", now).unwrap_err();
        assert!(err.0.contains("matches"), "{err}");
        let later = now + Duration::from_secs(301);
        let err = stripe.verify(&headers("stripe-signature", &value), b"{\"id\":\"evt_1\"}", later).unwrap_err();
        assert!(err.0.contains("tolerance"), "{err}");
        let err = stripe.verify(&HeaderMap::new(), b"{}", now).unwrap_err();
        assert!(err.0.contains("missing"), "{err}");
    }

    /// GitHub's documented example: secret "It's a Secret to Everybody", payload "Hello, World!".
    #[test]
    fn github_signatures_match_githubs_example() {
        let github = Signature::GitHub { secret: Secret::new("It's a Secret to Everybody") };
        let value = "sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17";
        assert_eq!(sign(&github, b"Hello, World!", SystemTime::now()), value);
        assert_eq!(github.verify(&headers("x-hub-signature-256", value), b"Hello, World!", SystemTime::now()), Ok(()));
        assert!(github.verify(&headers("x-hub-signature-256", value), b"Hello, World?", SystemTime::now()).is_err());
        assert!(github.verify(&headers("x-hub-signature-256", "sha256=zz"), b"Hello", SystemTime::now()).is_err());
    }

    #[test]
    fn the_generic_form_reads_its_header_prefix_and_encoding() {
        let generic = Signature::Hmac {
            header: "x-signature".into(),
            prefix: "v1:".into(),
            encoding: Encoding::Base64,
            secret: Secret::new("s3cret"),
        };
        let value = sign(&generic, b"body", SystemTime::now());
        assert!(value.starts_with("v1:"));
        assert_eq!(generic.verify(&headers("x-signature", &value), b"body", SystemTime::now()), Ok(()));
        assert!(generic.verify(&headers("x-signature", &value[3..]), b"body", SystemTime::now()).is_err());
        assert!(format!("{generic:?}").contains("Secret(…)"));
    }
}
