//! Review fixtures as the API server sends them: compact, fields in file order.

/// The JSON without whitespace between tokens, fields kept in file order (a `Value` round trip
/// would sort them).
pub fn compact(json: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(json.len());
    let (mut in_string, mut escaped) = (false, false);
    for &b in json {
        if in_string {
            out.push(b);
            match (escaped, b) {
                (true, _) => escaped = false,
                (false, b'\\') => escaped = true,
                (false, b'"') => in_string = false,
                _ => {}
            }
        } else if !b.is_ascii_whitespace() {
            in_string = b == b'"';
            out.push(b);
        }
    }
    let parsed: serde_json::Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(
        parsed,
        serde_json::from_slice::<serde_json::Value>(json).unwrap()
    );
    out
}
