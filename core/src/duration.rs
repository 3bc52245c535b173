//! The one duration syntax of every flag: `500ms`, `5s`, `2m`, `1h`, or plain seconds (`1.5`).

use std::time::Duration;

/// Why a flag value is not a duration; each variant holds the trimmed value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DurationError {
    #[error("{0:?} is not a duration (examples: 500ms, 5s, 2m, 1h)")]
    NotADuration(String),
    #[error("{0:?} must be between 0 and 30 days")]
    OutOfRange(String),
    #[error("{0:?} must be longer than zero")]
    Zero(String),
}

/// Longest duration any flag accepts.
const MAX: Duration = Duration::from_secs(30 * 24 * 3600);

/// Parses a duration between zero and 30 days.
pub fn parse(s: &str) -> Result<Duration, DurationError> {
    let t = s.trim();
    let (number, scale) = if let Some(n) = t.strip_suffix("ms") {
        (n, 0.001)
    } else if let Some(n) = t.strip_suffix('s') {
        (n, 1.0)
    } else if let Some(n) = t.strip_suffix('m') {
        (n, 60.0)
    } else if let Some(n) = t.strip_suffix('h') {
        (n, 3600.0)
    } else {
        (t, 1.0)
    };
    let v: f64 = number
        .trim()
        .parse()
        .map_err(|_| DurationError::NotADuration(t.to_owned()))?;
    let secs = v * scale;
    if !secs.is_finite() || secs < 0.0 || secs > MAX.as_secs_f64() {
        return Err(DurationError::OutOfRange(t.to_owned()));
    }
    Ok(Duration::from_secs_f64(secs))
}

/// [`parse`], refusing zero (periods, timeouts and TTLs).
pub fn parse_nonzero(s: &str) -> Result<Duration, DurationError> {
    let d = parse(s)?;
    if d.is_zero() {
        return Err(DurationError::Zero(s.trim().to_owned()));
    }
    Ok(d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units_fractions_and_bounds() {
        assert_eq!(parse("5s"), Ok(Duration::from_secs(5)));
        assert_eq!(parse("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse("1h"), Ok(Duration::from_secs(3600)));
        assert_eq!(parse("1.5"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse(" 30 "), Ok(Duration::from_secs(30)));
        assert_eq!(parse("0"), Ok(Duration::ZERO));
        assert!(parse("-1s").is_err());
        assert!(parse("soon").unwrap_err().to_string().contains("soon"));
        assert!(parse("2d").is_err());
        assert!(parse("721h").is_err());
        assert_eq!(parse_nonzero("0s"), Err(DurationError::Zero("0s".into())));
        assert_eq!(parse_nonzero("24h"), Ok(Duration::from_secs(86_400)));
    }

    /// Flag errors show these messages as they are.
    #[test]
    fn messages_read_exactly_as_documented() {
        assert_eq!(
            parse(" soon ").unwrap_err().to_string(),
            "\"soon\" is not a duration (examples: 500ms, 5s, 2m, 1h)"
        );
        assert_eq!(
            parse("721h").unwrap_err().to_string(),
            "\"721h\" must be between 0 and 30 days"
        );
        assert_eq!(
            parse_nonzero(" 0s ").unwrap_err().to_string(),
            "\"0s\" must be longer than zero"
        );
    }
}
