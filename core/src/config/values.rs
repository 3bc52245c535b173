//! Validators for individual ConfigMap values. Each returns a message fit to follow
//! `<key> = "<value>": ` in a diagnostic.

use std::net::IpAddr;

use crate::platform::PlatformError;

/// Why a ConfigMap value is rejected. The message is fit to follow `<key> = "<value>": `.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ValueError {
    #[error("not a boolean (expected \"true\" or \"false\")")]
    NotBool,
    #[error("not a whole number (expected {min}..={max})")]
    NotWholeNumber { min: u32, max: u32 },
    #[error("out of range (expected {min}..={max})")]
    OutOfRange { min: u32, max: u32 },
    #[error("is empty")]
    Empty,
    #[error("must be a single word (no spaces or control characters)")]
    NotSingleWord,
    #[error("not an IP address or DNS name")]
    NotHostAddress,
    #[error("not a valid user name ([a-z_][a-z0-9_-]*, at most 32 characters)")]
    NotUserName,
    #[error("not a valid Kubernetes object name (lowercase letters, digits, '-' and '.')")]
    NotObjectName,
    /// A sudo command that is not an absolute path.
    #[error("{0:?} is not an absolute path (sudo commands must start with '/')")]
    SudoNotAbsolute(String),
    /// A sudo command with a character that would need escaping.
    #[error("{command:?} contains {found:?}; allowed are letters, digits, spaces and / . _ - + *")]
    SudoCharacter { command: String, found: char },
    #[error("no commands given")]
    NoSudoCommands,
    #[error("expected \"<algorithm> <base64 key>\" as in known_hosts")]
    HostKeyShape,
    #[error("unsupported host key algorithm {0:?}")]
    HostKeyAlgorithm(String),
    #[error("key is not valid base64")]
    HostKeyBase64,
    #[error(transparent)]
    Platform(#[from] PlatformError),
    /// A build-user `key-type` (see `build_user`).
    #[error("unknown key type (expected ed25519, rsa, rsa-3072 or rsa-4096)")]
    KeyType,
    /// A build-user `memory-max`.
    #[error(
        "not a memory size (expected bytes with an optional K, M, G or T suffix, e.g. 8G, or a \
         percentage 1%..100%)"
    )]
    MemorySize,
    /// A build-user `cpu-quota`, with the largest accepted percentage.
    #[error(
        "not a CPU quota (expected a percentage of one CPU, 1%..{max}%, e.g. 200% for two CPUs)"
    )]
    CpuQuota { max: u32 },
}

/// Splits a platform list: items separated by commas and/or whitespace, empty items (trailing
/// commas, folded lines) dropped.
pub fn split_list(value: &str) -> impl Iterator<Item = &str> {
    value
        .split(|c: char| c == ',' || c.is_whitespace())
        .filter(|s| !s.is_empty())
}

/// Splits a comma list whose items may contain spaces (tags, sudo commands); items are trimmed and
/// empty ones dropped.
pub fn split_commas(value: &str) -> impl Iterator<Item = &str> {
    value.split(',').map(str::trim).filter(|s| !s.is_empty())
}

/// `true` / `false`, case-insensitive.
pub fn parse_bool(value: &str) -> Result<bool, ValueError> {
    match value.trim().to_ascii_lowercase().as_str() {
        "true" => Ok(true),
        "false" => Ok(false),
        _ => Err(ValueError::NotBool),
    }
}

/// An integer in `min..=max`.
pub fn parse_u32_in(value: &str, min: u32, max: u32) -> Result<u32, ValueError> {
    let n: u32 = value
        .trim()
        .parse()
        .map_err(|_| ValueError::NotWholeNumber { min, max })?;
    if n < min || n > max {
        return Err(ValueError::OutOfRange { min, max });
    }
    Ok(n)
}

/// A single token: non-empty, no whitespace or control characters.
pub fn single_token(value: &str) -> Result<&str, ValueError> {
    let v = value.trim();
    if v.is_empty() {
        return Err(ValueError::Empty);
    }
    if v.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(ValueError::NotSingleWord);
    }
    Ok(v)
}

/// An IP address or an RFC 1123 DNS name.
pub fn host_address(value: &str) -> Result<&str, ValueError> {
    let v = value.trim();
    if v.parse::<IpAddr>().is_ok() || is_dns_name(v) {
        Ok(v)
    } else {
        Err(ValueError::NotHostAddress)
    }
}

/// RFC 1123 host name: dot-separated labels of letters, digits and '-', at most 253 characters.
pub fn is_dns_name(s: &str) -> bool {
    let s = s.strip_suffix('.').unwrap_or(s);
    !s.is_empty()
        && s.len() <= 253
        && s.split('.').all(|l| {
            let b = l.as_bytes();
            !b.is_empty()
                && b.len() <= 63
                && b[0] != b'-'
                && b[b.len() - 1] != b'-'
                && b.iter().all(|c| c.is_ascii_alphanumeric() || *c == b'-')
        })
}

/// A POSIX login name as `useradd` accepts it: `[a-z_][a-z0-9_-]*`, at most 32 characters.
pub fn posix_user(value: &str) -> Result<&str, ValueError> {
    let v = value.trim();
    let b = v.as_bytes();
    let ok = !b.is_empty()
        && b.len() <= 32
        && (b[0].is_ascii_lowercase() || b[0] == b'_')
        && b[1..]
            .iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'_' || *c == b'-');
    if ok {
        Ok(v)
    } else {
        Err(ValueError::NotUserName)
    }
}

/// A Kubernetes object name (DNS-1123 subdomain).
pub fn object_name(value: &str) -> Result<&str, ValueError> {
    let v = value.trim();
    let ok = !v.is_empty()
        && v.len() <= 253
        && v.split('.').all(|l| {
            let b = l.as_bytes();
            !b.is_empty()
                && b[0].is_ascii_alphanumeric()
                && b[b.len() - 1].is_ascii_alphanumeric()
                && b.iter()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
        });
    if ok {
        Ok(v)
    } else {
        Err(ValueError::NotObjectName)
    }
}

/// A Kubernetes label value: at most 63 characters, alphanumeric at both ends, `-_.` inside.
pub fn is_label_value(s: &str) -> bool {
    let b = s.as_bytes();
    b.is_empty()
        || (b.len() <= 63
            && b[0].is_ascii_alphanumeric()
            && b[b.len() - 1].is_ascii_alphanumeric()
            && b.iter()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.')))
}

/// A cloud tag: key and value.
pub type Tag = (String, String);
/// A rejected tag item and why.
pub type BadTag = (String, String);

/// `k=v,k=v` cloud tags. Values may contain spaces; keys may not start with `aws:` (reserved).
pub fn instance_tags(value: &str) -> Result<Vec<Tag>, Vec<BadTag>> {
    let mut tags = Vec::new();
    let mut bad = Vec::new();
    for item in split_commas(value) {
        match item.split_once('=') {
            Some((k, v)) => {
                let (k, v) = (k.trim(), v.trim());
                let problem = if k.is_empty() {
                    Some("tag key is empty")
                } else if k.len() > 128 {
                    Some("tag key longer than 128 characters")
                } else if v.len() > 256 {
                    Some("tag value longer than 256 characters")
                } else if k.to_ascii_lowercase().starts_with("aws:") {
                    Some("tag keys starting with aws: are reserved by AWS")
                } else {
                    None
                };
                match problem {
                    Some(p) => bad.push((item.to_owned(), p.to_owned())),
                    None => tags.push((k.to_owned(), v.to_owned())),
                }
            }
            None => bad.push((item.to_owned(), "expected key=value".to_owned())),
        }
    }
    if bad.is_empty() { Ok(tags) } else { Err(bad) }
}

/// Comma-separated sudo commands (`/usr/bin/podman, /usr/bin/rm /some/file`).
///
/// Each must be an absolute path optionally followed by arguments, built from characters that need
/// no escaping in a sudoers `Cmnd` and no quoting in a shell: this keeps both the sudoers file and
/// the provisioning command safe without relying on escaping.
pub fn sudo_commands(value: &str) -> Result<Vec<String>, ValueError> {
    let mut out = Vec::new();
    for item in split_commas(value) {
        if !item.starts_with('/') {
            return Err(ValueError::SudoNotAbsolute(item.to_owned()));
        }
        if let Some(c) = item.chars().find(|c| {
            !(c.is_ascii_alphanumeric() || matches!(c, '/' | '.' | '_' | '-' | '+' | '*' | ' '))
        }) {
            return Err(ValueError::SudoCharacter {
                command: item.to_owned(),
                found: c,
            });
        }
        out.push(item.split_whitespace().collect::<Vec<_>>().join(" "));
    }
    if out.is_empty() {
        return Err(ValueError::NoSudoCommands);
    }
    Ok(out)
}

/// Why sudo on `command` (as [`sudo_commands`] normalised it) amounts to root, if it does: a
/// shell, a command that runs another one as root (`su`, `sudo`, `env`, ...), an interpreter, or
/// a wildcard in the command's path. Arguments are not judged: `/usr/bin/rm /etc/x` is fine.
pub fn sudo_grants_root(command: &str) -> Option<String> {
    const RUNS_ANYTHING: [&str; 24] = [
        "sh",
        "bash",
        "dash",
        "ash",
        "zsh",
        "ksh",
        "mksh",
        "csh",
        "tcsh",
        "fish",
        "busybox",
        "su",
        "sudo",
        "sudoedit",
        "doas",
        "runuser",
        "pkexec",
        "env",
        "nsenter",
        "chroot",
        "setpriv",
        "unshare",
        "systemd-run",
        "xargs",
    ];
    const INTERPRETERS: [&str; 5] = ["python", "perl", "ruby", "node", "lua"];
    let path = command.split(' ').next().unwrap_or(command);
    if path.contains('*') {
        return Some(format!("{path:?} matches any command in its directory"));
    }
    let base = path.rsplit('/').next().unwrap_or(path);
    if RUNS_ANYTHING.contains(&base) {
        return Some(format!("{path:?} runs any command as root"));
    }
    let stem = base.trim_end_matches(|c: char| c.is_ascii_digit() || c == '.');
    if INTERPRETERS.contains(&stem) {
        return Some(format!(
            "{path:?} is an interpreter: it runs any code as root"
        ));
    }
    None
}

/// An OpenSSH public host key line: `<algorithm> <base64> [comment]`.
pub fn host_key(value: &str) -> Result<String, ValueError> {
    use base64::Engine;
    let mut parts = value.split_whitespace();
    let (Some(alg), Some(b64)) = (parts.next(), parts.next()) else {
        return Err(ValueError::HostKeyShape);
    };
    const ALGS: [&str; 7] = [
        "ssh-ed25519",
        "ecdsa-sha2-nistp256",
        "ecdsa-sha2-nistp384",
        "ecdsa-sha2-nistp521",
        "ssh-rsa",
        "rsa-sha2-256",
        "rsa-sha2-512",
    ];
    if !ALGS.contains(&alg) {
        return Err(ValueError::HostKeyAlgorithm(alg.to_owned()));
    }
    if base64::engine::general_purpose::STANDARD
        .decode(b64)
        .is_err()
    {
        return Err(ValueError::HostKeyBase64);
    }
    Ok(format!("{alg} {b64}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_tolerate_folding_and_trailing_commas() {
        let v: Vec<_> = split_list("linux/x86_64,local,localhost,").collect();
        assert_eq!(v, ["linux/x86_64", "local", "localhost"]);
        let v: Vec<_> = split_list(" linux/arm64 ,\n  linux/amd64,,\n").collect();
        assert_eq!(v, ["linux/arm64", "linux/amd64"]);
        assert_eq!(split_list(" , ").count(), 0);
    }

    #[test]
    fn tags_keep_spaces_in_values() {
        let t =
            instance_tags("Project=Konflux,ManagedBy=Konflux Infra Team,cost-center=670,").unwrap();
        assert_eq!(t[1], ("ManagedBy".into(), "Konflux Infra Team".into()));
        assert_eq!(t.len(), 3);
        let bad = instance_tags("a=b,novalue,aws:x=1").unwrap_err();
        assert_eq!(bad.len(), 2);
        assert_eq!(bad[0].0, "novalue");
    }

    #[test]
    fn sudo_commands_are_validated() {
        let c = sudo_commands("/usr/bin/podman, /usr/bin/rm  /usr/share/containers/mounts.conf")
            .unwrap();
        assert_eq!(
            c,
            [
                "/usr/bin/podman",
                "/usr/bin/rm /usr/share/containers/mounts.conf"
            ]
        );
        assert!(sudo_commands("podman").is_err());
        assert!(sudo_commands("/bin/sh -c 'id'").is_err());
        assert!(sudo_commands("/bin/true; rm -rf /").is_err());
        assert!(sudo_commands("/bin/x $(id)").is_err());
        assert!(sudo_commands(" , ").is_err());
    }

    #[test]
    fn sudo_commands_that_amount_to_root() {
        for root in [
            "/bin/sh",
            "/usr/bin/bash",
            "/bin/su -",
            "/usr/bin/sudo /bin/id",
            "/usr/bin/env",
            "/usr/bin/python3",
            "/usr/bin/python3.12 -m http.server",
            "/usr/bin/*",
            "/usr/local/bin/pod*",
            "/usr/bin/systemd-run",
        ] {
            assert!(sudo_grants_root(root).is_some(), "{root}");
        }
        for fine in [
            "/usr/bin/podman",
            "/usr/bin/rm /usr/share/containers/mounts.conf",
            "/usr/bin/buildah",
            "/usr/bin/shasum",
            "/usr/bin/bashbug-not",
        ] {
            assert_eq!(sudo_grants_root(fine), None, "{fine}");
        }
    }

    #[test]
    fn addresses_users_names() {
        assert!(host_address("10.250.68.16").is_ok());
        assert!(host_address("fe80::1").is_ok());
        assert!(host_address("s390x-1.example.com").is_ok());
        assert!(host_address("bad host").is_err());
        assert!(host_address("a;b").is_err());
        assert!(posix_user("root").is_ok());
        assert!(posix_user("ec2-user").is_ok());
        assert!(posix_user("Root").is_err());
        assert!(posix_user("a b").is_err());
        assert!(object_name("ibm-s390x-static-ssh-key").is_ok());
        assert!(object_name("Bad_Name").is_err());
        assert!(is_label_value("s390x-static-1"));
        assert!(is_label_value("host.with.dots"));
        assert!(!is_label_value("-x"));
    }

    #[test]
    fn numbers_and_bools() {
        assert_eq!(parse_u32_in(" 4 ", 1, 8), Ok(4));
        assert!(parse_u32_in("9", 1, 8).is_err());
        assert!(parse_u32_in("four", 1, 8).is_err());
        assert_eq!(parse_bool("TRUE"), Ok(true));
        assert!(parse_bool("yes").is_err());
    }

    #[test]
    fn host_keys() {
        assert!(host_key("ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIB2a comment").is_ok());
        assert!(host_key("ssh-dss AAAA").is_err());
        assert!(host_key("ssh-ed25519").is_err());
        assert!(host_key("ssh-ed25519 !!!").is_err());
    }

    /// Diagnostics quote these messages verbatim (and operators grep for them): the text is part
    /// of the contract.
    #[test]
    fn messages_read_exactly_as_documented() {
        fn msg<T, E: std::fmt::Display>(r: Result<T, E>) -> String {
            r.err().expect("an error").to_string()
        }
        assert_eq!(
            msg(parse_bool("yes")),
            "not a boolean (expected \"true\" or \"false\")"
        );
        assert_eq!(
            msg(parse_u32_in("x", 1, 8)),
            "not a whole number (expected 1..=8)"
        );
        assert_eq!(
            msg(parse_u32_in("9", 1, 8)),
            "out of range (expected 1..=8)"
        );
        assert_eq!(msg(single_token(" ")), "is empty");
        assert_eq!(
            msg(single_token("a b")),
            "must be a single word (no spaces or control characters)"
        );
        assert_eq!(msg(host_address("a b")), "not an IP address or DNS name");
        assert_eq!(
            msg(posix_user("Root")),
            "not a valid user name ([a-z_][a-z0-9_-]*, at most 32 characters)"
        );
        assert_eq!(
            msg(object_name("Bad_Name")),
            "not a valid Kubernetes object name (lowercase letters, digits, '-' and '.')"
        );
        assert_eq!(
            msg(sudo_commands("podman")),
            "\"podman\" is not an absolute path (sudo commands must start with '/')"
        );
        assert_eq!(
            msg(sudo_commands("/bin/true; rm")),
            "\"/bin/true; rm\" contains ';'; allowed are letters, digits, spaces and / . _ - + *"
        );
        assert_eq!(msg(sudo_commands(" , ")), "no commands given");
        assert_eq!(
            msg(host_key("ssh-ed25519")),
            "expected \"<algorithm> <base64 key>\" as in known_hosts"
        );
        assert_eq!(
            msg(host_key("ssh-dss AAAA")),
            "unsupported host key algorithm \"ssh-dss\""
        );
        assert_eq!(msg(host_key("ssh-ed25519 !!!")), "key is not valid base64");
    }
}
