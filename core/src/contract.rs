//! Names shared with the Konflux multi-platform-controller (labels, annotations, finalizer, secret
//! layout, remote user names). They are a compatibility contract: existing Tasks, dashboards and
//! cleanup jobs depend on them, so they must never change.

use md5::{Digest, Md5};

/// The TaskRun param naming the platform.
pub const PLATFORM_PARAM: &str = "PLATFORM";

/// Label: platform label value; the scheduler's watch selector.
pub const TARGET_PLATFORM_LABEL: &str = "build.appstudio.redhat.com/target-platform";
/// Label: host name, instance id, or `localhost`.
pub const ASSIGNED_HOST_LABEL: &str = "build.appstudio.redhat.com/assigned-host";
/// Label: queued for this platform (removed when assigned).
pub const WAITING_FOR_PLATFORM_LABEL: &str = "build.appstudio.redhat.com/waiting-for-platform";
/// Label on internal TaskRuns, which are never allocated.
pub const TASK_TYPE_LABEL: &str = "build.appstudio.redhat.com/task-type";
/// Label `true` on every secret we create.
pub const MULTI_PLATFORM_SECRET_LABEL: &str = "build.appstudio.redhat.com/multi-platform-secret";
/// Label on the `host-config` ConfigMap.
pub const MULTI_PLATFORM_CONFIG_LABEL: &str = "build.appstudio.redhat.com/multi-platform-config";

/// Annotation: comma list of hosts whose provisioning failed for this TaskRun.
pub const FAILED_HOSTS_ANNOTATION: &str = "build.appstudio.redhat.com/failed-hosts";
/// Annotation: the dynamic instance of this TaskRun.
pub const CLOUD_INSTANCE_ID_ANNOTATION: &str = "build.appstudio.redhat.com/cloud-instance-id";
/// Annotation: the address of this TaskRun's dynamic instance.
pub const CLOUD_ADDRESS_ANNOTATION: &str = "build.appstudio.redhat.com/cloud-address";
/// Annotation: unix seconds when allocation started.
pub const ALLOCATION_START_TIME_ANNOTATION: &str =
    "build.appstudio.redhat.com/allocation-start-time";

/// Annotation: the controller's proof that it made the TaskRun's allocation (`v1:` and a hex
/// HMAC-SHA256 over namespace, name, UID and `assigned-host`). It cannot be forged without the
/// controller's key; it is still controller-only, so a tenant cannot strip or replace it either.
pub const ALLOCATION_PROOF_ANNOTATION: &str = "build.appstudio.redhat.com/multi-platform-proof";

/// Labels only the controller writes: a TaskRun's creator never sets them (the webhook removes
/// them at creation), and recovery rebuilds allocations from them.
pub const CONTROLLER_ONLY_LABELS: [&str; 2] = [ASSIGNED_HOST_LABEL, WAITING_FOR_PLATFORM_LABEL];
/// Annotations only the controller writes (see [`CONTROLLER_ONLY_LABELS`]).
pub const CONTROLLER_ONLY_ANNOTATIONS: [&str; 4] = [
    FAILED_HOSTS_ANNOTATION,
    CLOUD_INSTANCE_ID_ANNOTATION,
    CLOUD_ADDRESS_ANNOTATION,
    ALLOCATION_PROOF_ANNOTATION,
];

/// Finalizer held on remote TaskRuns until cleanup is durable.
pub const FINALIZER: &str = "appstudio.io/multi-platform-finalizer";

/// `assigned-host` value for platforms served in the pod.
pub const LOCALHOST: &str = "localhost";

/// Name of the host-config ConfigMap in the controller namespace.
pub const HOST_CONFIG_NAME: &str = "host-config";

/// Prefix of the per-TaskRun secret name.
pub const SECRET_PREFIX: &str = "multi-platform-ssh-";

/// Secret data keys (docs/architecture.md, "The contract with the Go controller").
pub mod secret_keys {
    /// One-time token to redeem at `otp-server`.
    pub const OTP: &str = "otp";
    /// URL of the OTP server's `/otp` endpoint.
    pub const OTP_SERVER: &str = "otp-server";
    /// PEM CA that signs the OTP server's certificate.
    pub const OTP_CA: &str = "otp-ca";
    /// `user@address`, or `localhost`.
    pub const HOST: &str = "host";
    /// The remote user's home directory.
    pub const USER_DIR: &str = "user-dir";
    /// A human message when allocation failed.
    pub const ERROR: &str = "error";
}

/// Tags on every cloud instance we launch (docs/architecture.md, "What the scheduler guarantees").
pub mod instance_tags {
    /// `true` on every managed instance.
    pub const MANAGED: &str = "MultiPlatformManaged";
    /// The configured instance tag.
    pub const INSTANCE: &str = "multi-platform-instance";
    /// `<namespace>:<taskrun name>` of the owner.
    pub const TASKRUN_ID: &str = "taskRunID";
}

/// The secret a TaskRun mounts: `multi-platform-ssh-<taskrun name>`.
pub fn secret_name(taskrun_name: &str) -> String {
    format!("{SECRET_PREFIX}{taskrun_name}")
}

/// The per-TaskRun remote user: `u-` + the first 28 hex digits of md5(name + namespace + "\n").
///
/// Bit-for-bit what the Go controller's provision and cleanup scripts compute with
/// `echo "$TASKRUN_NAME$NAMESPACE" | md5sum | cut -b-28` (the newline is `echo`'s), so each
/// implementation recognises and cleans up the other's users.
pub fn remote_user_name(taskrun_name: &str, namespace: &str) -> String {
    let mut h = Md5::new();
    h.update(taskrun_name.as_bytes());
    h.update(namespace.as_bytes());
    h.update(b"\n");
    let digest = h.finalize();
    // Hand-rolled hex: this runs once per allocation and the generic encoder dominated it.
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut user = String::with_capacity(30);
    user.push_str("u-");
    for b in &digest[..14] {
        user.push(char::from(HEX[usize::from(b >> 4)]));
        user.push(char::from(HEX[usize::from(b & 0xf)]));
    }
    user
}

/// Is `name` a per-TaskRun user ([`remote_user_name`]'s shape: `u-` + 28 lowercase hex digits)?
/// Only such users are ever removed from a host.
pub fn is_remote_user_name(name: &str) -> bool {
    name.strip_prefix("u-").is_some_and(|h| {
        h.len() == 28
            && h.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    })
}

/// `taskRunID` tag value: `<namespace>:<name>`.
pub fn taskrun_id(namespace: &str, name: &str) -> String {
    format!("{namespace}:{name}")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The Go scripts' own pipeline, run by bash as they run it.
    fn go_user_name(taskrun_name: &str, namespace: &str) -> String {
        let out = std::process::Command::new("bash")
            .args([
                "-c",
                r#"printf 'u-%s' "$(echo "$TASKRUN_NAME$NAMESPACE" | md5sum | cut -b-28)""#,
            ])
            .env("TASKRUN_NAME", taskrun_name)
            .env("NAMESPACE", namespace)
            .output()
            .expect("running bash, md5sum and cut (coreutils)");
        assert!(out.status.success(), "{out:?}");
        String::from_utf8(out.stdout).unwrap()
    }

    #[test]
    fn user_name_matches_the_go_scripts_pipeline() {
        let long_name = format!("{}.{}", "a".repeat(120), "0-9".repeat(40));
        let cases = [
            ("build-1", "tenant"),
            // Valid but unusual: dots, leading digits, a one-letter namespace, maximum lengths.
            ("my-app.on-push.7f3c9-build-container", "x"),
            ("0", "0-tenant"),
            ("a.b.c", &"n".repeat(63)),
            (long_name.as_str(), "rhtap-build-tenant"),
            ("a--b", "ns-1"),
        ];
        for (name, ns) in cases {
            let ours = remote_user_name(name, ns);
            assert_eq!(ours, go_user_name(name, ns), "{name:?} in {ns:?}");
            assert!(is_remote_user_name(&ours), "{ours}");
        }
        // Name and namespace are concatenated, as in the scripts.
        assert_eq!(remote_user_name("ab", "c"), remote_user_name("a", "bc"));
    }

    #[test]
    fn remote_user_names_are_recognised_strictly() {
        assert!(is_remote_user_name("u-0123456789abcdef0123456789ab"));
        assert!(!is_remote_user_name("u-0123456789ABCDEF0123456789ab"));
        assert!(!is_remote_user_name("u-0123456789abcdef0123456789abc"));
        assert!(!is_remote_user_name("u-short"));
        assert!(!is_remote_user_name("root"));
    }

    #[test]
    fn secret_name_prefix() {
        assert_eq!(secret_name("tr"), "multi-platform-ssh-tr");
    }
}
