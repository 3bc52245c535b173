//! POSIX shell quoting for the one command line each remote operation sends.
//!
//! sshd hands the command line to the admin user's login shell, so every value must reach that
//! shell as exactly one literal word. Scripts are constants; values travel only as positional
//! parameters (`sh -c SCRIPT NAME ARG...`), each quoted here. Single quotes are used because
//! nothing is special inside them except the closing quote, which is written as `'\''`.

use std::borrow::Cow;

/// A value that cannot be passed as a shell word at all.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("a command argument contains a NUL byte, which no shell word can carry")]
pub struct NulInArgument;

/// Characters that never need quoting in any position of a POSIX shell word.
fn is_plain(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '_' | '@' | '%' | '+' | ':' | ',' | '.' | '/' | '-')
}

/// Quotes `s` as one shell word: unchanged when it is made only of plain characters, otherwise in
/// single quotes.
pub fn quote(s: &str) -> Result<Cow<'_, str>, NulInArgument> {
    if s.contains('\0') {
        return Err(NulInArgument);
    }
    if !s.is_empty() && s.chars().all(is_plain) {
        return Ok(Cow::Borrowed(s));
    }
    let mut out = String::with_capacity(s.len() + 2);
    out.push('\'');
    for c in s.chars() {
        if c == '\'' {
            out.push_str("'\\''");
        } else {
            out.push(c);
        }
    }
    out.push('\'');
    Ok(Cow::Owned(out))
}

/// `[prefix...] sh -c SCRIPT NAME ARGS...` as one command line, every part quoted.
///
/// `prefix` is a fixed list of words (for example `sudo -n`) chosen by this crate.
pub fn sh_command(
    prefix: &[&str],
    script: &str,
    name: &str,
    args: &[&str],
) -> Result<String, NulInArgument> {
    let mut words: Vec<Cow<'_, str>> = Vec::with_capacity(prefix.len() + 4 + args.len());
    for p in prefix {
        words.push(quote(p)?);
    }
    words.push(Cow::Borrowed("sh"));
    words.push(Cow::Borrowed("-c"));
    words.push(quote(script)?);
    words.push(quote(name)?);
    for a in args {
        words.push(quote(a)?);
    }
    Ok(words.join(" "))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A strict POSIX-shell tokeniser for what [`quote`] may produce: plain characters, single
    /// quoted sections, and `\'` between them. Anything else unquoted (`$`, backquote, `;`, `|`,
    /// `&`, redirections, globs, `~`, `#`, newlines, double quotes...) is an error, so a pass proves
    /// no metacharacter reaches the shell unquoted.
    pub(crate) fn tokenize(line: &str) -> Result<Vec<String>, String> {
        let mut words = Vec::new();
        let mut cur: Option<String> = None;
        let mut chars = line.chars().peekable();
        while let Some(c) = chars.next() {
            match c {
                ' ' => {
                    if let Some(w) = cur.take() {
                        words.push(w);
                    }
                }
                '\'' => {
                    let w = cur.get_or_insert_with(String::new);
                    loop {
                        match chars.next() {
                            Some('\'') => break,
                            Some(q) => w.push(q),
                            None => return Err("unterminated single quote".into()),
                        }
                    }
                }
                '\\' => match chars.next() {
                    Some('\'') => cur.get_or_insert_with(String::new).push('\''),
                    other => return Err(format!("unexpected escape {other:?}")),
                },
                c if is_plain(c) => cur.get_or_insert_with(String::new).push(c),
                c => return Err(format!("unquoted metacharacter {c:?}")),
            }
        }
        if let Some(w) = cur.take() {
            words.push(w);
        }
        Ok(words)
    }

    #[test]
    fn plain_words_stay_readable() {
        assert_eq!(quote("u-0123abc").unwrap(), "u-0123abc");
        assert_eq!(quote("/usr/bin/podman").unwrap(), "/usr/bin/podman");
        assert_eq!(quote("").unwrap(), "''");
        assert_eq!(quote("a b").unwrap(), "'a b'");
        assert_eq!(quote("it's").unwrap(), "'it'\\''s'");
        assert_eq!(quote("~root").unwrap(), "'~root'");
        assert!(quote("a\0b").is_err());
    }

    #[test]
    fn tokenizer_rejects_unquoted_metacharacters() {
        assert!(tokenize("sh -c $(id)").is_err());
        assert!(tokenize("a;b").is_err());
        assert!(tokenize("a\nb").is_err());
        assert_eq!(tokenize("a 'b c' 'd'\\''e'").unwrap(), ["a", "b c", "d'e"]);
    }

    fn hostile() -> impl Strategy<Value = String> {
        // Bias towards shell syntax, plus arbitrary Unicode.
        prop_oneof![
            proptest::collection::vec(
                prop_oneof![
                    Just("'".to_owned()),
                    Just("\"".to_owned()),
                    Just("$(".to_owned()),
                    Just("`".to_owned()),
                    Just(";".to_owned()),
                    Just("\n".to_owned()),
                    Just("\\".to_owned()),
                    Just("'\\''".to_owned()),
                    Just("&&".to_owned()),
                    Just("|".to_owned()),
                    Just(">".to_owned()),
                    Just("*".to_owned()),
                    Just("~".to_owned()),
                    Just("#".to_owned()),
                    Just(" ".to_owned()),
                    "[a-z0-9/._-]{0,6}",
                ],
                0..12
            )
            .prop_map(|v| v.concat()),
            "[^\\x00]{0,40}",
        ]
    }

    proptest! {
        #[test]
        fn every_value_round_trips_as_one_word(s in hostile()) {
            let q = quote(&s).unwrap();
            prop_assert_eq!(tokenize(&q).unwrap(), vec![s.clone()]);
        }

        #[test]
        fn sh_command_arguments_round_trip(
            script in hostile(),
            args in proptest::collection::vec(hostile(), 0..5),
        ) {
            let refs: Vec<&str> = args.iter().map(String::as_str).collect();
            let line = sh_command(&["sudo", "-n"], &script, "mpc", &refs).unwrap();
            let mut expected = vec!["sudo".to_owned(), "-n".into(), "sh".into(), "-c".into(), script.clone(), "mpc".into()];
            expected.extend(args.iter().cloned());
            prop_assert_eq!(tokenize(&line).unwrap(), expected);
        }
    }
}
