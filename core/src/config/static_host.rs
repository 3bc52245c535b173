//! One `host.<name>.*` group: a static build host.

use std::collections::BTreeMap;

use super::build_user;
use super::entry::Sink;
use super::values::ValueError;
use super::{BuildUserSettings, MAX_CONCURRENCY, StaticHost, values};
use crate::platform::Platform;

const HOST_FIELDS: [&str; 8] = [
    "address",
    "user",
    "platform",
    "secret",
    "concurrency",
    "host-key",
    // Ours: takes no new TaskRun (as `concurrency: "0"` does).
    "drain",
    // Go-era key for a per-host sudo list; accepted and ignored with a warning below.
    "sudo-commands",
];

/// Parses one `host.<name>.*` group. On error returns the host's platform when it could be read
/// (so a platform whose every host is broken is reported as disabled, not unknown).
pub(super) fn parse_host(
    name: &str,
    f: &BTreeMap<&str, &str>,
    sink: &mut Sink,
) -> Result<(StaticHost, BuildUserSettings), Option<Platform>> {
    let key = |field: &str| format!("host.{name}.{field}");
    let mut ok = true;
    for (field, value) in f {
        if !HOST_FIELDS.contains(field) && !build_user::FIELDS.contains(field) {
            sink.warn(
                &key(field),
                Some(value),
                "unknown field, ignored by this version",
            );
        } else if *field == "sudo-commands" {
            sink.warn(
                &key(field),
                Some(value),
                "ignored: sudo-commands applies to dynamic platforms only",
            );
        }
    }
    if !values::is_label_value(name) {
        sink.error(
            &key("address"),
            None,
            format!("host name {name:?} cannot be used as a label value (at most 63 letters, digits, '-', '_' or '.', alphanumeric at both ends); host disabled"),
        );
        ok = false;
    }
    let mut req = |field: &str,
                   sink: &mut Sink,
                   check: &dyn Fn(&str) -> Result<String, ValueError>|
     -> Option<String> {
        match f.get(field) {
            None => {
                sink.error(
                    &key(field),
                    None,
                    format!("required for static host {name}; host disabled"),
                );
                ok = false;
                None
            }
            Some(v) => match check(v) {
                Ok(s) => Some(s),
                Err(e) => {
                    sink.error(&key(field), Some(v), format!("{e}; host disabled"));
                    ok = false;
                    None
                }
            },
        }
    };
    let platform = req("platform", sink, &|v| {
        Platform::parse(v)
            .map(|p| p.as_str().to_owned())
            .map_err(ValueError::from)
    })
    .and_then(|p| Platform::parse(&p).ok());
    let address = req("address", sink, &|v| {
        values::host_address(v).map(str::to_owned)
    });
    let user = req("user", sink, &|v| values::posix_user(v).map(str::to_owned));
    let secret = req("secret", sink, &|v| {
        values::object_name(v).map(str::to_owned)
    });
    let concurrency = match f.get("concurrency") {
        None => {
            sink.warn(&key("concurrency"), None, "not set; using 1");
            Some(1)
        }
        // 0 drains the host (operators' habit); the Go controller rejects it (below).
        Some(v) => match values::parse_u32_in(v, 0, MAX_CONCURRENCY) {
            Ok(n) => Some(n),
            Err(e) => {
                sink.error(&key("concurrency"), Some(v), format!("{e}; host disabled"));
                ok = false;
                None
            }
        },
    };
    let drain = match f.get("drain") {
        None => false,
        Some(v) => values::parse_bool(v).unwrap_or_else(|e| {
            sink.error(&key("drain"), Some(v), format!("{e}; host disabled"));
            ok = false;
            false
        }),
    };
    if concurrency == Some(0) {
        sink.warn(
            &key("concurrency"),
            f.get("concurrency").copied(),
            format!("host {name} is drained: it takes no new TaskRun, the builds on it finish; the Go controller rejects concurrency 0 and then serves no static platform of the cluster, so set drain: \"true\" (with the host's real concurrency) if a rollback to it must keep them"),
        );
    }
    if drain {
        sink.warn(
            &key("drain"),
            f.get("drain").copied(),
            format!("host {name} is drained: it takes no new TaskRun, the builds on it finish; the Go controller ignores drain and would give it builds again"),
        );
    }
    let host_key = match f.get("host-key") {
        None => {
            sink.warn(
                &key("host-key"),
                None,
                "not set: the host's SSH key is trusted on first contact (then kept in the known-hosts ConfigMap), so whoever answers at the address first is trusted; pin it (`ssh-keyscan -t ed25519 <address>`)",
            );
            None
        }
        Some(v) => match values::host_key(v) {
            Ok(k) => Some(k),
            Err(e) => {
                sink.error(&key("host-key"), Some(v), format!("{e}; host disabled"));
                ok = false;
                None
            }
        },
    };
    let build_user = BuildUserSettings::parse(
        |field| f.get(field).copied(),
        |field, value, message| {
            sink.error(
                &key(field),
                Some(value),
                format!("{message}; host disabled"),
            )
        },
    );
    match (ok, platform, address, user, secret, concurrency, build_user) {
        (
            true,
            Some(platform),
            Some(address),
            Some(user),
            Some(secret),
            Some(concurrency),
            Ok(build_user),
        ) => Ok((
            StaticHost {
                name: name.to_owned(),
                address,
                user,
                platform,
                secret,
                concurrency,
                host_key,
                drained: drain || concurrency == 0,
            },
            build_user,
        )),
        (_, platform, ..) => Err(platform),
    }
}
