//! Pure: the writes the controller sends about a TaskRun (docs/architecture.md, "The contract with
//! the Go controller" and "The controller shell").
//!
//! Every TaskRun write is a JSON Patch that starts with `test /metadata/uid`, so a TaskRun deleted
//! and recreated under the same name is never touched by a write meant for the old one (the API
//! server answers 422; the executor then checks whether the TaskRun is gone). That holds by
//! construction: the builders return a [`TaskRunPatch`], whose only constructor puts the UID test
//! first, and the executor sends TaskRun patches only as that type. Label and annotation
//! removals are written as `add ""` then `remove`, which succeeds whether or not the key exists, so
//! no read is needed first. Secrets are whole objects owned by their TaskRun, written without
//! reading what has the name (the controller cannot read tenants' Secrets). What recovery must
//! trust rides on the TaskRun instead: the allocation patch carries the controller's proof
//! ([`SecretProof`]) for the host it records.

use std::collections::BTreeMap;
use std::sync::RwLock;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use serde_json::json;

use crate::admission::PENDING_STATUS;
use crate::contract::{self, secret_keys};
use crate::jsonpatch::{Patch, PatchOp};
use aws_lc_rs::hmac;

use crate::provision::GoSecretLayout;
use crate::scheduler::{HostRef, Placement, ProofTag, SecretData, SecretKind, TaskRunRef};

/// Which metadata maps the TaskRun has (a JSON Patch `add` needs the parent to exist).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Maps {
    pub labels: bool,
    pub annotations: bool,
}

impl Maps {
    /// What a TaskRun marked by the webhook has: both maps.
    pub const MARKED: Maps = Maps {
        labels: true,
        annotations: true,
    };
}

/// A JSON Patch for one TaskRun, guarded by its UID: the first op is always
/// `test /metadata/uid` (see the module docs). Read it as a slice of ops; build it only with
/// [`TaskRunPatch::for_uid`]. The ops come from the builder the webhook uses too
/// ([`crate::jsonpatch`]).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[serde(transparent)]
pub struct TaskRunPatch(Patch);

impl TaskRunPatch {
    /// A patch for the TaskRun with this UID, holding only the UID test so far.
    pub fn for_uid(uid: &str) -> Self {
        let mut p = Patch::default();
        p.test("/metadata/uid", json!(uid));
        Self(p)
    }
}

impl std::ops::Deref for TaskRunPatch {
    type Target = [PatchOp];

    fn deref(&self) -> &[PatchOp] {
        self.0.ops()
    }
}

/// Sets the allocation labels and annotations of a TaskRun to exactly `placement`.
pub fn record(uid: &str, placement: &Placement, maps: Maps) -> TaskRunPatch {
    record_entries(uid, placement, None, maps)
}

/// [`record`], with the allocation's proof ([`SecretProof::sign_allocation`]) set to `proof`
/// (removed when `None`): what the controller writes.
pub fn record_proven(
    uid: &str,
    placement: &Placement,
    proof: Option<&str>,
    maps: Maps,
) -> TaskRunPatch {
    record_entries(uid, placement, Some(proof), maps)
}

fn record_entries(
    uid: &str,
    placement: &Placement,
    proof: Option<Option<&str>>,
    maps: Maps,
) -> TaskRunPatch {
    let mut ops = TaskRunPatch::for_uid(uid);
    ops.0.write_entries(
        "labels",
        maps.labels,
        &[
            (
                contract::ASSIGNED_HOST_LABEL,
                placement.assigned_host.as_deref(),
            ),
            (
                contract::WAITING_FOR_PLATFORM_LABEL,
                placement.waiting_for_platform.as_deref(),
            ),
        ],
    );
    let mut annotations = vec![
        (
            contract::FAILED_HOSTS_ANNOTATION,
            placement.failed_hosts.as_deref(),
        ),
        (
            contract::CLOUD_INSTANCE_ID_ANNOTATION,
            placement.instance_id.as_deref(),
        ),
        (
            contract::CLOUD_ADDRESS_ANNOTATION,
            placement.instance_address.as_deref(),
        ),
    ];
    if let Some(proof) = proof {
        annotations.push((contract::ALLOCATION_PROOF_ANNOTATION, proof));
    }
    ops.0
        .write_entries("annotations", maps.annotations, &annotations);
    ops
}

/// Clears `spec.status: TaskRunPending` (fails with 422 once it is already cleared).
pub fn ungate(uid: &str) -> TaskRunPatch {
    let mut ops = TaskRunPatch::for_uid(uid);
    ops.0.test("/spec/status", json!(PENDING_STATUS));
    ops.0.remove("/spec/status");
    ops
}

/// Removes our finalizer from `finalizers` (the TaskRun's current list); `None` when absent.
pub fn remove_finalizer(uid: &str, finalizers: &[String]) -> Option<TaskRunPatch> {
    let i = finalizers.iter().position(|f| f == contract::FINALIZER)?;
    let mut ops = TaskRunPatch::for_uid(uid);
    ops.0.remove_finalizer_at(i, true);
    Some(ops)
}

/// Adds our finalizer; `None` when present.
pub fn add_finalizer(uid: &str, finalizers: Option<&[String]>) -> Option<TaskRunPatch> {
    let mut ops = TaskRunPatch::for_uid(uid);
    let list = finalizers.map(|l| l.iter().map(String::as_str));
    ops.0.add_finalizer(list).then_some(ops)
}

/// Marks a TaskRun the webhook missed with the webhook's own `marks` (its metadata operations),
/// guarded by the UID and the `resource_version` it was decided on.
pub fn adoption(
    uid: &str,
    resource_version: &str,
    marks: impl IntoIterator<Item = PatchOp>,
) -> TaskRunPatch {
    let mut ops = TaskRunPatch::for_uid(uid);
    ops.0
        .test("/metadata/resourceVersion", json!(resource_version));
    ops.0.extend(marks);
    ops
}

/// Where build steps redeem keys, and the CA that verifies that server.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OtpEndpoint {
    /// URL of `/otp` (the secret's `otp-server`).
    pub url: String,
    /// PEM CA (the secret's `otp-ca`).
    pub ca_pem: String,
}

/// Annotation holding [`SecretProof`]'s proof, on the TaskRun and on its secret: `v2:`, the
/// key id (8 hex digits) and `:`, then the hex HMAC-SHA256 (`v1:` proofs, made before proofs named
/// their key, have no key id).
pub const SECRET_PROOF_ANNOTATION: &str = contract::ALLOCATION_PROOF_ANNOTATION;

/// Proves an allocation (and the secret serving it) was made by this controller, for this
/// TaskRun and host.
///
/// Recovery must not take a tenant's claim for ours: a TaskRun's labels where no admission
/// policy guards them (or the Go controller's), or a Secret a tenant created under the right
/// name. The proof is an HMAC-SHA256 over the kind, the TaskRun's namespace, name and UID, and
/// the host it serves (`assigned-host`: host name or instance id; `localhost`; empty for an
/// error), in the annotation [`SECRET_PROOF_ANNOTATION`]. The allocation patch writes it onto the
/// TaskRun with the `assigned-host` it records, so recovery checks it without reading the
/// Secret (which the controller may not read); the secret carries one too, for an operator to
/// check. Recovery counts an allocation as ours only when the TaskRun's verifies
/// (constant-time) against its namespace, name, UID and `assigned-host`.
///
/// The key is derived from the OTP server's store token (`--otp-store-token-file`): every
/// replica that schedules already holds it, tenants never see it (it is mounted only into the
/// controller and the key server), and it needs no new Secret. The controller follows the token
/// file ([`SecretProof::rotate`]): proofs are made with the current token's key and name it by
/// its id, and verify against it or the key before (so a proof survives one rotation in a
/// running replica). A proof older than that degrades safely: its secret counts as unproven
/// (like the Go controller's), so recovery keeps the allocation only as far as the host config
/// and the cloud listing confirm it, and issues a fresh token instead of re-arming its.
pub struct SecretProof(RwLock<ProofKeys>);

/// The key proofs are made with, and the one before the last rotation.
struct ProofKeys {
    current: ProofKey,
    previous: Option<ProofKey>,
}

/// A proof key derived from a store token, and a digest of the token that tells tokens apart
/// without keeping them (its first four bytes are the key id).
struct ProofKey {
    key: hmac::Key,
    digest: [u8; 32],
}

impl ProofKey {
    /// Domain-separated: the token itself keys nothing else, and the digest reveals no key.
    fn from_store_token(token: &[u8]) -> Self {
        let root = hmac::Key::new(hmac::HMAC_SHA256, token);
        let derived = hmac::sign(&root, b"mpc TaskRun secret proof v1");
        let digest = hmac::sign(&root, b"mpc TaskRun secret proof key id");
        Self {
            key: hmac::Key::new(hmac::HMAC_SHA256, derived.as_ref()),
            digest: digest.as_ref().try_into().expect("HMAC-SHA256 is 32 bytes"),
        }
    }

    fn id(&self) -> [u8; 4] {
        let [a, b, c, d, ..] = self.digest;
        [a, b, c, d]
    }
}

impl SecretProof {
    /// The proof key derived from the store token.
    pub fn from_store_token(token: &[u8]) -> Self {
        Self(RwLock::new(ProofKeys {
            current: ProofKey::from_store_token(token),
            previous: None,
        }))
    }

    /// The store token is now `token`: proofs are made with its key from now on, and those made
    /// with the key until now still verify (one rotation back). Returns whether the key changed
    /// (the same token again changes nothing).
    pub fn rotate(&self, token: &[u8]) -> bool {
        let next = ProofKey::from_store_token(token);
        let mut keys = self.0.write().unwrap_or_else(|e| e.into_inner());
        if next.digest == keys.current.digest {
            return false;
        }
        let before = std::mem::replace(&mut keys.current, next);
        keys.previous = Some(before);
        true
    }

    /// The id of the key proofs are made with now (hex), as the proofs name it.
    pub fn key_id(&self) -> String {
        hex::encode(self.keys().current.id())
    }

    fn keys(&self) -> std::sync::RwLockReadGuard<'_, ProofKeys> {
        self.0.read().unwrap_or_else(|e| e.into_inner())
    }

    fn message(kind: SecretKind, taskrun: &TaskRunRef, host: &str) -> Vec<u8> {
        let kind = match kind {
            SecretKind::Remote => "remote",
            SecretKind::Localhost => "localhost",
            SecretKind::Error => "error",
        };
        let uid = taskrun.uid().to_string();
        let mut m = Vec::with_capacity(128);
        // Length-prefixed: no two field lists encode alike.
        for part in [kind, taskrun.namespace(), taskrun.name(), &uid, host] {
            m.extend_from_slice(&(part.len() as u64).to_le_bytes());
            m.extend_from_slice(part.as_bytes());
        }
        m
    }

    /// The annotation value for a secret of `kind` serving `host`.
    pub fn sign(&self, kind: SecretKind, taskrun: &TaskRunRef, host: &str) -> String {
        let keys = self.keys();
        let tag = hmac::sign(&keys.current.key, &Self::message(kind, taskrun, host));
        format!(
            "v2:{}:{}",
            hex::encode(keys.current.id()),
            hex::encode(tag.as_ref())
        )
    }

    /// The TaskRun's proof for an allocation to `assigned_host` (a host or instance, or
    /// `localhost`).
    pub fn sign_allocation(&self, taskrun: &TaskRunRef, assigned_host: &str) -> String {
        let kind = SecretKind::for_assigned_host(Some(assigned_host));
        self.sign(kind, taskrun, assigned_host)
    }

    /// Whether `tag` (the TaskRun's proof, parsed) proves the allocation of `taskrun` to
    /// `assigned_host` (its label; without one there is nothing to prove), under the current
    /// key or the one before (the one the proof names; a `v1` proof names none).
    pub fn verify_allocation(
        &self,
        taskrun: &TaskRunRef,
        assigned_host: Option<&str>,
        tag: Option<&ProofTag>,
    ) -> bool {
        let (Some(host), Some(tag)) = (assigned_host, tag) else {
            return false;
        };
        let kind = SecretKind::for_assigned_host(Some(host));
        let message = Self::message(kind, taskrun, host);
        let keys = self.keys();
        [Some(&keys.current), keys.previous.as_ref()]
            .into_iter()
            .flatten()
            .filter(|k| tag.key_id.is_none_or(|id| id == k.id()))
            .any(|k| hmac::verify(&k.key, &message, &tag.mac).is_ok())
    }
}

impl std::fmt::Debug for SecretProof {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SecretProof(..)")
    }
}

/// The TaskRun's secret `multi-platform-ssh-<name>` (docs/architecture.md, "The contract with the
/// Go controller"), owned by the TaskRun and carrying the controller's proof.
pub fn secret(
    taskrun: &TaskRunRef,
    data: &SecretData,
    otp: &OtpEndpoint,
    proof: &SecretProof,
) -> Secret {
    let mut d: BTreeMap<String, ByteString> = BTreeMap::new();
    let mut put = |k: &str, v: &str| {
        d.insert(k.to_owned(), ByteString(v.as_bytes().to_vec()));
    };
    let (kind, host) = match data {
        SecretData::Remote { host, .. } => (SecretKind::Remote, host.name()),
        SecretData::Localhost => (SecretKind::Localhost, contract::LOCALHOST),
        SecretData::Error(_) => (SecretKind::Error, ""),
    };
    match data {
        SecretData::Remote {
            otp: token,
            host: HostRef::Instance {
                template, address, ..
            },
        } if let Some(go) = GoSecretLayout::new(template.os, address) => {
            // Windows and macOS: the Go controller's bytes (provision::handoff).
            put(secret_keys::OTP, token);
            put(
                secret_keys::OTP_SERVER,
                &GoSecretLayout::otp_server(&otp.url),
            );
            put(secret_keys::OTP_CA, &otp.ca_pem);
            put(secret_keys::HOST, &go.host);
            put(secret_keys::USER_DIR, &go.user_dir);
        }
        SecretData::Remote { otp: token, .. } => {
            put(secret_keys::OTP, token);
            put(secret_keys::OTP_SERVER, &otp.url);
            put(secret_keys::OTP_CA, &otp.ca_pem);
            if let Some(login) = data.login(taskrun) {
                put(secret_keys::HOST, &login);
            }
            if let Some(dir) = data.user_dir(taskrun) {
                put(secret_keys::USER_DIR, &dir);
            }
        }
        SecretData::Localhost => put(secret_keys::HOST, contract::LOCALHOST),
        SecretData::Error(message) => put(secret_keys::ERROR, message),
    }
    let mut secret = secret_probe(taskrun);
    secret.metadata.annotations = Some(BTreeMap::from([(
        SECRET_PROOF_ANNOTATION.to_owned(),
        proof.sign(kind, taskrun, host),
    )]));
    secret.data = Some(d);
    secret
}

/// The ownerReference to a TaskRun (no `blockOwnerDeletion`: deleting a TaskRun must not wait
/// for its secret).
pub fn owner(taskrun: &TaskRunRef) -> OwnerReference {
    OwnerReference {
        api_version: "tekton.dev/v1".to_owned(),
        kind: "TaskRun".to_owned(),
        name: taskrun.name().to_owned(),
        uid: taskrun.uid().to_string(),
        controller: None,
        block_owner_deletion: None,
    }
}

/// What a dry-run create sends to learn whether the TaskRun's secret exists without reading it:
/// the name, and what the admission policy on the controller's Secret writes requires (every
/// secret the controller writes starts as this).
pub fn secret_probe(taskrun: &TaskRunRef) -> Secret {
    Secret {
        metadata: ObjectMeta {
            name: Some(taskrun.secret_name()),
            namespace: Some(taskrun.namespace().to_owned()),
            labels: Some(BTreeMap::from([(
                contract::MULTI_PLATFORM_SECRET_LABEL.to_owned(),
                "true".to_owned(),
            )])),
            owner_references: Some(vec![owner(taskrun)]),
            ..ObjectMeta::default()
        },
        type_: Some("Opaque".to_owned()),
        ..Secret::default()
    }
}

/// Whether a secret is owned by exactly this TaskRun (same UID).
pub fn owned_by(secret: &Secret, taskrun: &TaskRunRef) -> bool {
    let uid = taskrun.uid().to_string();
    secret
        .metadata
        .owner_references
        .as_deref()
        .unwrap_or_default()
        .iter()
        .any(|o| o.kind == "TaskRun" && o.uid == uid)
}

/// What a secret holds, whoever wrote it.
pub fn secret_kind(secret: &Secret) -> Option<SecretKind> {
    let data = secret.data.as_ref()?;
    if data.contains_key(secret_keys::ERROR) {
        Some(SecretKind::Error)
    } else if data.contains_key(secret_keys::OTP) {
        Some(SecretKind::Remote)
    } else if data
        .get(secret_keys::HOST)
        .is_some_and(|h| h.0 == contract::LOCALHOST.as_bytes())
    {
        Some(SecretKind::Localhost)
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use serde_json::Value;

    use super::*;
    use crate::scheduler::Uid;

    fn apply(doc: &Value, ops: &[PatchOp]) -> Result<Value, Box<dyn std::error::Error>> {
        let patch: json_patch::Patch = serde_json::from_value(serde_json::to_value(ops)?)?;
        let mut d = doc.clone();
        json_patch::patch(&mut d, &patch)?;
        Ok(d)
    }

    fn proof() -> SecretProof {
        SecretProof::from_store_token(b"store-token")
    }

    fn taskrun() -> Value {
        serde_json::from_str(include_str!(
            "../../tests/fixtures/controller/taskrun-waiting.json"
        ))
        .unwrap()
    }

    #[test]
    fn record_sets_and_clears_exactly_and_is_idempotent() {
        let doc = taskrun();
        let uid = doc["metadata"]["uid"].as_str().unwrap().to_owned();
        let assigned = Placement {
            assigned_host: Some(Arc::from("host-1")),
            failed_hosts: Some("host-0".into()),
            ..Placement::default()
        };
        let once = apply(&doc, &record(&uid, &assigned, Maps::MARKED)).unwrap();
        let twice = apply(&once, &record(&uid, &assigned, Maps::MARKED)).unwrap();
        assert_eq!(once, twice);
        let labels = &once["metadata"]["labels"];
        assert_eq!(labels[contract::ASSIGNED_HOST_LABEL], "host-1");
        assert!(labels.get(contract::WAITING_FOR_PLATFORM_LABEL).is_none());
        assert_eq!(labels[contract::TARGET_PLATFORM_LABEL], "linux-arm64");
        let ann = &once["metadata"]["annotations"];
        assert_eq!(ann[contract::FAILED_HOSTS_ANNOTATION], "host-0");
        assert!(ann.get(contract::CLOUD_INSTANCE_ID_ANNOTATION).is_none());
        assert!(
            ann.get(contract::ALLOCATION_START_TIME_ANNOTATION)
                .is_some()
        );
    }

    #[test]
    fn writes_for_another_uid_fail() {
        let doc = taskrun();
        assert!(
            apply(
                &doc,
                &record("other-uid", &Placement::default(), Maps::MARKED)
            )
            .is_err()
        );
        assert!(apply(&doc, &ungate("other-uid")).is_err());
    }

    /// Every TaskRun write the controller sends, built for the TaskRun `doc` (whose UID is
    /// `uid`) in a state where the write applies. A new builder belongs here.
    fn every_taskrun_write(doc: &Value, uid: &str) -> Vec<(&'static str, Value, Vec<PatchOp>)> {
        let with_finalizer = {
            let mut d = doc.clone();
            d["metadata"]["finalizers"] = json!(["x", contract::FINALIZER]);
            d
        };
        let without_finalizer = {
            let mut d = doc.clone();
            d["metadata"]["finalizers"] = json!(["x"]);
            d
        };
        let no_finalizers = {
            let mut d = doc.clone();
            d["metadata"].as_object_mut().unwrap().remove("finalizers");
            d
        };
        let gated = {
            let mut d = doc.clone();
            d["spec"]["status"] = PENDING_STATUS.into();
            d
        };
        let unmarked = {
            let mut d = doc.clone();
            let m = d["metadata"].as_object_mut().unwrap();
            m.insert("finalizers".into(), json!([]));
            m.insert("annotations".into(), json!({}));
            m["labels"]
                .as_object_mut()
                .unwrap()
                .retain(|k, _| !k.starts_with("build.appstudio.redhat.com/"));
            d
        };
        let config = {
            let text = include_str!("../../core/tests/fixtures/admission/host-config.yaml");
            let (data, _) = crate::config::read_configmap_yaml(text).unwrap();
            crate::config::parse(&data).config
        };
        let placement = Placement {
            assigned_host: Some(Arc::from("host-1")),
            ..Placement::default()
        };
        let list = |d: &Value| -> Vec<String> {
            serde_json::from_value(d["metadata"]["finalizers"].clone()).unwrap()
        };
        vec![
            (
                "record",
                doc.clone(),
                record(uid, &placement, Maps::MARKED).to_vec(),
            ),
            (
                "record_proven",
                doc.clone(),
                record_proven(uid, &placement, Some("proof"), Maps::MARKED).to_vec(),
            ),
            ("ungate", gated.clone(), ungate(uid).to_vec()),
            (
                "remove_finalizer",
                with_finalizer.clone(),
                remove_finalizer(uid, &list(&with_finalizer))
                    .unwrap()
                    .to_vec(),
            ),
            (
                "add_finalizer",
                without_finalizer.clone(),
                add_finalizer(uid, Some(&list(&without_finalizer)))
                    .unwrap()
                    .to_vec(),
            ),
            (
                "add_finalizer (no list)",
                no_finalizers,
                add_finalizer(uid, None).unwrap().to_vec(),
            ),
            (
                "adoption_patch",
                unmarked.clone(),
                crate::controller::sources::adopt::adoption_patch(
                    &unmarked,
                    &config,
                    1_700_000_000,
                )
                .unwrap()
                .to_vec(),
            ),
        ]
    }

    /// A TaskRun deleted and recreated under the same name (same finalizers, labels, status)
    /// must refuse every write meant for the old one: each guard but the UID's passes on it.
    #[test]
    fn every_taskrun_write_starts_with_the_uid_test_and_a_namesake_refuses_it() {
        let doc = taskrun();
        let uid = doc["metadata"]["uid"].as_str().unwrap().to_owned();
        for (name, target, ops) in every_taskrun_write(&doc, &uid) {
            let test_uid = PatchOp::Test {
                path: "/metadata/uid".into(),
                value: json!(uid),
            };
            assert_eq!(ops.first(), Some(&test_uid), "{name}: first op");
            apply(&target, &ops).unwrap_or_else(|e| panic!("{name}: applies to its TaskRun: {e}"));
            let mut namesake = target.clone();
            namesake["metadata"]["uid"] = "recreated-uid".into();
            assert!(
                apply(&namesake, &ops).is_err(),
                "{name}: a recreated TaskRun of the same name accepted a write for the old one"
            );
        }
    }

    #[test]
    fn missing_maps_are_created_only_when_needed() {
        let mut doc = taskrun();
        doc["metadata"]
            .as_object_mut()
            .unwrap()
            .remove("annotations");
        let uid = doc["metadata"]["uid"].as_str().unwrap().to_owned();
        let none = Maps {
            labels: true,
            annotations: false,
        };
        assert!(apply(&doc, &record(&uid, &Placement::default(), Maps::MARKED)).is_err());
        let cleared = apply(&doc, &record(&uid, &Placement::default(), none)).unwrap();
        assert!(cleared["metadata"].get("annotations").is_none());
        let p = Placement {
            instance_id: Some(Arc::from("i-1")),
            ..Placement::default()
        };
        let set = apply(&doc, &record(&uid, &p, none)).unwrap();
        assert_eq!(
            set["metadata"]["annotations"][contract::CLOUD_INSTANCE_ID_ANNOTATION],
            "i-1"
        );
    }

    #[test]
    fn ungate_and_finalizers() {
        let mut doc = taskrun();
        let uid = doc["metadata"]["uid"].as_str().unwrap().to_owned();
        doc["spec"]["status"] = PENDING_STATUS.into();
        let open = apply(&doc, &ungate(&uid)).unwrap();
        assert!(open["spec"].get("status").is_none());
        assert!(apply(&open, &ungate(&uid)).is_err(), "already un-gated");

        doc["metadata"]["finalizers"] = json!(["x", contract::FINALIZER, "y"]);
        let list: Vec<String> =
            serde_json::from_value(doc["metadata"]["finalizers"].clone()).unwrap();
        let removed = apply(&doc, &remove_finalizer(&uid, &list).unwrap()).unwrap();
        assert_eq!(removed["metadata"]["finalizers"], json!(["x", "y"]));
        assert!(remove_finalizer(&uid, &["x".into()]).is_none());
        let added = apply(
            &removed,
            &add_finalizer(&uid, Some(&["x".into(), "y".into()])).unwrap(),
        )
        .unwrap();
        assert_eq!(
            added["metadata"]["finalizers"],
            json!(["x", "y", contract::FINALIZER])
        );
        assert!(add_finalizer(&uid, Some(&[contract::FINALIZER.into()])).is_none());
    }

    #[test]
    fn secrets_match_the_consumer_contract() {
        let r = TaskRunRef::new("tenant", "build-1", Uid::new("u-1"));
        let otp = OtpEndpoint {
            url: "https://otp.example/otp".into(),
            ca_pem: "PEM".into(),
        };
        let host = crate::scheduler::HostRef::Static(Arc::new(crate::config::StaticHost {
            name: "h1".into(),
            address: "10.0.0.1".into(),
            user: "root".into(),
            platform: crate::platform::Platform::parse("linux/arm64").unwrap(),
            secret: "s".into(),
            concurrency: 1,
            host_key: None,
            drained: false,
        }));
        let s = secret(
            &r,
            &SecretData::Remote {
                otp: "tok".into(),
                host,
            },
            &otp,
            &proof(),
        );
        let data = s.data.as_ref().unwrap();
        let get = |k: &str| String::from_utf8(data[k].0.clone()).unwrap();
        let user = r.remote_user();
        assert_eq!(get("host"), format!("{user}@10.0.0.1"));
        assert_eq!(get("user-dir"), format!("/home/{user}"));
        assert_eq!(get("otp-server"), otp.url);
        assert_eq!(get("otp"), "tok");
        assert_eq!(
            s.metadata.name.as_deref(),
            Some("multi-platform-ssh-build-1")
        );
        assert!(owned_by(&s, &r));
        assert!(!owned_by(
            &s,
            &TaskRunRef::new("tenant", "build-1", Uid::new("u-2"))
        ));
        let o = &s.metadata.owner_references.as_ref().unwrap()[0];
        assert_eq!(o.block_owner_deletion, None);
        assert_eq!(secret_kind(&s), Some(crate::scheduler::SecretKind::Remote));
        let local = secret(&r, &SecretData::Localhost, &otp, &proof());
        assert_eq!(
            secret_kind(&local),
            Some(crate::scheduler::SecretKind::Localhost)
        );
        assert_eq!(local.data.as_ref().unwrap().len(), 1);
        let err = secret(&r, &SecretData::Error("no".into()), &otp, &proof());
        assert_eq!(secret_kind(&err), Some(crate::scheduler::SecretKind::Error));
    }

    #[test]
    fn windows_and_macos_secrets_carry_gos_bytes() {
        let r = TaskRunRef::new("tenant", "build-w", Uid::new("u-w"));
        let otp = OtpEndpoint {
            url: "https://otp.example/otp".into(),
            ca_pem: "PEM".into(),
        };
        for (platform, os, dir) in [
            (
                "windows-4xlarge/amd64",
                crate::config::HostOs::Windows,
                "C:\\\\Users\\\\konflux-builder\n",
            ),
            (
                "macos-mac2metal/arm64",
                crate::config::HostOs::MacOs,
                "/Users/konflux-builder\n",
            ),
        ] {
            let mut template = crate::cloud::testing::platform();
            template.platform = crate::platform::Platform::parse(platform).unwrap();
            template.os = os;
            let host = crate::scheduler::HostRef::Instance {
                id: "i-0123".into(),
                address: "10.0.1.7".into(),
                template: Arc::new(template),
            };
            let s = secret(
                &r,
                &SecretData::Remote {
                    otp: "tok".into(),
                    host,
                },
                &otp,
                &proof(),
            );
            let data = s.data.as_ref().unwrap();
            let get = |k: &str| data[k].0.clone();
            assert_eq!(get("host"), b"konflux-builder@10.0.1.7\n", "{platform}");
            assert_eq!(get("user-dir"), dir.as_bytes(), "{platform}");
            assert_eq!(get("otp-server"), b"https://otp.example/otp\n");
            assert_eq!(get("otp"), b"tok", "no newline on otp");
            assert_eq!(secret_kind(&s), Some(crate::scheduler::SecretKind::Remote));
        }
    }

    /// A `v2:<key id>:<mac>` proof, parsed as recovery reads it.
    fn tag(value: &str) -> ProofTag {
        let (id, mac) = value.strip_prefix("v2:").unwrap().split_once(':').unwrap();
        ProofTag {
            key_id: Some(hex::decode(id).unwrap().try_into().unwrap()),
            mac: hex::decode(mac).unwrap().try_into().unwrap(),
        }
    }

    #[test]
    fn only_the_controllers_allocation_of_this_taskrun_and_host_is_proven() {
        let r = TaskRunRef::new("tenant", "build-1", Uid::new("u-1"));
        let ours = tag(&proof().sign_allocation(&r, "h1"));
        assert!(proof().verify_allocation(&r, Some("h1"), Some(&ours)));
        // The same proof for another host, TaskRun, or UID (a namesake), or under another key
        // (a rotated token): not proven.
        assert!(!proof().verify_allocation(&r, Some("h2"), Some(&ours)));
        assert!(!proof().verify_allocation(&r, None, Some(&ours)));
        assert!(!proof().verify_allocation(&r, Some("h1"), None));
        let namesake = TaskRunRef::new("tenant", "build-1", Uid::new("u-2"));
        assert!(!proof().verify_allocation(&namesake, Some("h1"), Some(&ours)));
        let other_ns = TaskRunRef::new("tenant2", "build-1", Uid::new("u-1"));
        assert!(!proof().verify_allocation(&other_ns, Some("h1"), Some(&ours)));
        assert!(
            !SecretProof::from_store_token(b"rotated").verify_allocation(
                &r,
                Some("h1"),
                Some(&ours)
            )
        );
        // Copied from the tenant's other TaskRun, or made up.
        let copied = tag(&proof().sign_allocation(&namesake, "h1"));
        assert!(!proof().verify_allocation(&r, Some("h1"), Some(&copied)));
        let made_up = ProofTag {
            mac: [0; 32],
            ..ours
        };
        assert!(!proof().verify_allocation(&r, Some("h1"), Some(&made_up)));
        // A proof is for its kind: a host named like localhost is the localhost allocation.
        let local = tag(&proof().sign_allocation(&r, contract::LOCALHOST));
        assert!(proof().verify_allocation(&r, Some(contract::LOCALHOST), Some(&local)));
        assert_eq!(
            proof().sign_allocation(&r, contract::LOCALHOST),
            proof().sign(SecretKind::Localhost, &r, contract::LOCALHOST)
        );
        // The secret carries the proof of the allocation it serves.
        let host = crate::scheduler::HostRef::Static(Arc::new(crate::config::StaticHost {
            name: "h1".into(),
            address: "127.0.0.2".into(),
            user: "root".into(),
            platform: crate::platform::Platform::parse("linux/arm64").unwrap(),
            secret: "s".into(),
            concurrency: 1,
            host_key: None,
            drained: false,
        }));
        let remote = SecretData::Remote {
            otp: "tok".into(),
            host,
        };
        let written = secret(&r, &remote, &OtpEndpoint::default(), &proof());
        assert_eq!(
            written.metadata.annotations.as_ref().unwrap()[SECRET_PROOF_ANNOTATION],
            proof().sign_allocation(&r, "h1")
        );
    }

    /// Each field the proof covers (docs/migration.md, docs/threat-model.md: the kind, the
    /// TaskRun's namespace, name and UID, the host) changed alone makes another proof, which
    /// does not verify for the original; so does a character moved across a field boundary.
    #[test]
    fn the_proof_covers_kind_namespace_name_uid_and_host_each() {
        let p = proof();
        let r = TaskRunRef::new("tenant", "build-1", Uid::new("u-1"));
        let ours = p.sign(SecretKind::Remote, &r, "h1");
        assert!(p.verify_allocation(&r, Some("h1"), Some(&tag(&ours))));
        let others = [
            ("kind", p.sign(SecretKind::Localhost, &r, "h1")),
            ("kind", p.sign(SecretKind::Error, &r, "h1")),
            (
                "namespace",
                p.sign(
                    SecretKind::Remote,
                    &TaskRunRef::new("tenant2", "build-1", Uid::new("u-1")),
                    "h1",
                ),
            ),
            (
                "name",
                p.sign(
                    SecretKind::Remote,
                    &TaskRunRef::new("tenant", "build-2", Uid::new("u-1")),
                    "h1",
                ),
            ),
            (
                "uid",
                p.sign(
                    SecretKind::Remote,
                    &TaskRunRef::new("tenant", "build-1", Uid::new("u-2")),
                    "h1",
                ),
            ),
            ("host", p.sign(SecretKind::Remote, &r, "h2")),
            (
                "boundary",
                p.sign(
                    SecretKind::Remote,
                    &TaskRunRef::new("tenan", "tbuild-1", Uid::new("u-1")),
                    "h1",
                ),
            ),
            (
                "boundary",
                p.sign(
                    SecretKind::Remote,
                    &TaskRunRef::new("tenant", "build-1u", Uid::new("-1")),
                    "h1",
                ),
            ),
        ];
        for (field, other) in &others {
            assert_ne!(*other, ours, "{field}: the same proof");
            assert!(
                !p.verify_allocation(&r, Some("h1"), Some(&tag(other))),
                "{field}: another allocation's proof verifies for this one"
            );
        }
    }

    /// A rotated store token: proofs are made with the new key and name it, those made before
    /// still verify (one rotation back), older ones do not; `v1` proofs (no key id) too.
    #[test]
    fn a_proof_survives_one_store_token_rotation() {
        let r = TaskRunRef::new("tenant", "build-1", Uid::new("u-1"));
        let p = SecretProof::from_store_token(b"first");
        let first = tag(&p.sign_allocation(&r, "h1"));
        let legacy = ProofTag {
            key_id: None,
            ..first
        };
        let first_id = p.key_id();
        assert!(!p.rotate(b"first"), "the same token is no rotation");
        assert!(p.rotate(b"second"));
        assert_ne!(p.key_id(), first_id);
        let second = tag(&p.sign_allocation(&r, "h1"));
        assert_eq!(second.key_id.map(hex::encode), Some(p.key_id()));
        assert_ne!(second.mac, first.mac);
        for t in [&first, &legacy, &second] {
            assert!(p.verify_allocation(&r, Some("h1"), Some(t)), "{t:?}");
        }
        // A proof naming a key this controller does not hold is unproven, valid tag or not.
        let unknown = ProofTag {
            key_id: Some([0; 4]),
            ..first
        };
        assert!(!p.verify_allocation(&r, Some("h1"), Some(&unknown)));
        assert!(p.rotate(b"third"));
        assert!(!p.verify_allocation(&r, Some("h1"), Some(&first)));
        assert!(!p.verify_allocation(&r, Some("h1"), Some(&legacy)));
        assert!(p.verify_allocation(&r, Some("h1"), Some(&second)));
        // The key follows the token alone: another replica holding it makes the same proofs.
        assert_eq!(
            p.sign_allocation(&r, "h1"),
            SecretProof::from_store_token(b"third").sign_allocation(&r, "h1")
        );
    }

    #[test]
    fn the_allocation_patch_carries_the_proof_and_a_cleared_one_drops_it() {
        let doc = taskrun();
        let uid = doc["metadata"]["uid"].as_str().unwrap().to_owned();
        let assigned = Placement {
            assigned_host: Some(Arc::from("host-1")),
            ..Placement::default()
        };
        let with = apply(
            &doc,
            &record_proven(&uid, &assigned, Some("v1:ab"), Maps::MARKED),
        )
        .unwrap();
        assert_eq!(
            with["metadata"]["annotations"][SECRET_PROOF_ANNOTATION],
            "v1:ab"
        );
        // `record` leaves the proof as it is.
        let kept = apply(&with, &record(&uid, &assigned, Maps::MARKED)).unwrap();
        assert_eq!(
            kept["metadata"]["annotations"][SECRET_PROOF_ANNOTATION],
            "v1:ab"
        );
        let cleared = apply(
            &with,
            &record_proven(&uid, &Placement::default(), None, Maps::MARKED),
        )
        .unwrap();
        assert!(
            cleared["metadata"]["annotations"]
                .get(SECRET_PROOF_ANNOTATION)
                .is_none()
        );
        // A TaskRun without annotations gets the map with the proof in it.
        let mut bare = doc.clone();
        bare["metadata"]
            .as_object_mut()
            .unwrap()
            .remove("annotations");
        let maps = Maps {
            labels: true,
            annotations: false,
        };
        let set = apply(&bare, &record_proven(&uid, &assigned, Some("v1:cd"), maps)).unwrap();
        assert_eq!(
            set["metadata"]["annotations"][SECRET_PROOF_ANNOTATION],
            "v1:cd"
        );
    }

    #[test]
    fn recovery_reads_back_the_proof_the_allocation_patch_wrote() {
        let doc = taskrun();
        let m = &doc["metadata"];
        let r = TaskRunRef::new(
            m["namespace"].as_str().unwrap(),
            m["name"].as_str().unwrap(),
            Uid::new(m["uid"].as_str().unwrap()),
        );
        let uid = r.uid().to_string();
        let placement = Placement {
            assigned_host: Some(Arc::from("i-0abc")),
            instance_id: Some(Arc::from("i-0abc")),
            ..Placement::default()
        };
        let signed = proof().sign_allocation(&r, "i-0abc");
        let written = apply(
            &doc,
            &record_proven(&uid, &placement, Some(&signed), Maps::MARKED),
        )
        .unwrap();
        let map = |k: &str| -> BTreeMap<String, String> {
            serde_json::from_value(written["metadata"][k].clone()).unwrap()
        };
        let mut rec = crate::scheduler::TaskRunRecord::default();
        rec.read_metadata(&map("labels"), &map("annotations"));
        assert_eq!(rec.assigned_host.as_deref(), Some("i-0abc"));
        assert!(proof().verify_allocation(&r, rec.assigned_host.as_deref(), rec.proof.as_ref()));
    }

    #[test]
    fn the_existence_probe_passes_the_secret_write_policy_and_holds_nothing() {
        let r = TaskRunRef::new("tenant", "build-1", Uid::new("u-1"));
        let p = secret_probe(&r);
        assert_eq!(
            p.metadata.name.as_deref(),
            Some("multi-platform-ssh-build-1")
        );
        assert_eq!(p.type_.as_deref(), Some("Opaque"));
        assert!(owned_by(&p, &r));
        assert_eq!(
            p.metadata.labels.as_ref().unwrap()[contract::MULTI_PLATFORM_SECRET_LABEL],
            "true"
        );
        assert!(p.data.is_none() && p.string_data.is_none());
    }

    /// The bytes every TaskRun write sends (`tests/fixtures/controller/taskrun-writes.txt`, made
    /// when each write still built its JSON by hand, before they shared the webhook's builder).
    #[test]
    fn every_taskrun_write_sends_the_same_bytes() {
        let doc = taskrun();
        let uid = doc["metadata"]["uid"].as_str().unwrap().to_owned();
        let mut got: Vec<String> = every_taskrun_write(&doc, &uid)
            .into_iter()
            .map(|(name, _, ops)| format!("{name}: {}", serde_json::to_string(&ops).unwrap()))
            .collect();
        let full = Placement {
            assigned_host: Some(Arc::from("h/1")),
            waiting_for_platform: Some("linux-arm64".into()),
            failed_hosts: Some("h~0".into()),
            instance_id: Some(Arc::from("i-1")),
            instance_address: Some(Arc::from("10.0.0.1")),
        };
        for (labels, annotations) in [(false, false), (true, false), (false, true)] {
            let maps = Maps {
                labels,
                annotations,
            };
            for p in [&full, &Placement::default()] {
                let ops = record_proven("u", p, None, maps);
                got.push(format!(
                    "record {labels} {annotations}: {}",
                    serde_json::to_string(&ops).unwrap()
                ));
            }
        }
        let want = include_str!("../../tests/fixtures/controller/taskrun-writes.txt");
        assert_eq!(got.join("\n"), want.trim_end());
    }
}
