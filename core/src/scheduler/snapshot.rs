//! The state the core is rebuilt from after a restart: TaskRun labels and annotations (design
//! §2) and the instances the cloud lists with a dynamic platform's instance tag. Plain data.

use std::collections::BTreeMap;

use super::time::Time;
use crate::contract;
use crate::platform::Platform;

/// Everything needed to rebuild the ledger.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Snapshot {
    /// Every TaskRun labelled `target-platform` (or otherwise ours) that still has our finalizer or
    /// is not done.
    pub taskruns: Vec<TaskRunRecord>,
    /// Every instance each dynamic platform's listing returned (see [`InstanceRecord`]).
    pub instances: Vec<InstanceRecord>,
    /// Dynamic platforms and pools whose listing failed: what runs on them is unknown. Their
    /// TaskRuns are held as recorded (nothing orphaned, relaunched or moved, no launches) until
    /// a listing of the platform arrives ([`Event::InstancesListed`](super::Event)), then
    /// recovered against it.
    pub unlisted: Vec<Platform>,
}

/// One TaskRun as recorded on the cluster.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TaskRunRecord {
    pub namespace: String,
    pub name: String,
    pub uid: String,
    /// The `PLATFORM` param.
    pub platform: String,
    /// Creation time, or a later `allocation-start-time` (never an earlier one: tenants can
    /// write the annotation, and an early one would put them ahead of older TaskRuns).
    pub since: Time,
    /// Retries started.
    pub retries: u32,
    /// Still `TaskRunPending`.
    pub gated: bool,
    /// Done or being deleted (cleanup is due).
    pub finished: bool,
    /// `assigned-host` label.
    pub assigned_host: Option<String>,
    /// Labelled `waiting-for-platform`.
    pub waiting: bool,
    /// `failed-hosts` annotation.
    pub failed_hosts: Vec<String>,
    /// `cloud-instance-id` annotation: a claim recovery checks against the cloud listing. (The
    /// `cloud-address` annotation is not read: addresses come from the listing only.)
    pub instance_id: Option<String>,
    /// The TaskRun's secret as recovery takes it: one that exists, or (an unknown
    /// [`secret_probe`](Self::secret_probe)) a remote one that may. The controller does not read
    /// tenants' Secrets: it learns only that the name is taken, and the kind follows from the
    /// labels its writes leave (`assigned-host` a host: remote; `localhost`: localhost; none: an
    /// error secret). Set with [`TaskRunRecord::learn_secret`].
    pub secret: Option<SecretKind>,
    /// The allocation the secret serves is the controller's: the secret exists and the TaskRun
    /// carries its proof ([`contract::ALLOCATION_PROOF_ANNOTATION`]) for this TaskRun and its
    /// `assigned-host`. Go-era TaskRuns and forged labels carry none: what they claim is kept
    /// only as far as the host config and the cloud listing confirm it. Never with an unknown
    /// answer.
    pub secret_proven: bool,
    /// What the lookup of the secret's name answered.
    pub secret_probe: SecretProbe,
    /// The proof annotation, when well-formed (checked by the controller, which holds the key).
    pub proof: Option<ProofTag>,
}

/// A well-formed allocation proof: its HMAC tag and, in the `v2` form, the id of the key that
/// made it (the controller keeps the key before a store-token rotation too).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProofTag {
    /// `None` for a `v1` proof (made before proofs named their key).
    pub key_id: Option<[u8; 4]>,
    pub mac: [u8; 32],
}

impl TaskRunRecord {
    /// Fills the allocation fields from the TaskRun's labels and annotations; `since` (set to the
    /// creation time first) only moves later.
    pub fn read_metadata(
        &mut self,
        labels: &BTreeMap<String, String>,
        annotations: &BTreeMap<String, String>,
    ) {
        let nonempty = |v: Option<&String>| v.filter(|s| !s.is_empty()).cloned();
        self.assigned_host = nonempty(labels.get(contract::ASSIGNED_HOST_LABEL));
        self.waiting = nonempty(labels.get(contract::WAITING_FOR_PLATFORM_LABEL)).is_some();
        self.instance_id = nonempty(annotations.get(contract::CLOUD_INSTANCE_ID_ANNOTATION));
        self.proof = annotations
            .get(contract::ALLOCATION_PROOF_ANNOTATION)
            .and_then(|v| parse_proof(v));
        self.failed_hosts = annotations
            .get(contract::FAILED_HOSTS_ANNOTATION)
            .map(|v| {
                v.split(',')
                    .map(str::trim)
                    .filter(|s| !s.is_empty())
                    .map(str::to_owned)
                    .collect()
            })
            .unwrap_or_default();
        if let Some(secs) = annotations
            .get(contract::ALLOCATION_START_TIME_ANNOTATION)
            .and_then(|v| v.trim().parse::<u64>().ok())
        {
            self.since = self.since.max(Time::from_secs(secs));
        }
    }
}

impl TaskRunRecord {
    /// Sets [`secret`](Self::secret), [`secret_proven`](Self::secret_proven) and
    /// [`secret_probe`](Self::secret_probe) from the lookup's answer and whether the TaskRun's
    /// proof verified for its `assigned-host` (`verified`).
    ///
    /// An unknown answer is never proven: nothing of it is re-armed, and it never ranks ahead of
    /// a proven allocation. For a TaskRun assigned a build host it counts as a remote secret that
    /// may stand (its build may be running: the host is not provisioned again over it, and the
    /// allocation is kept only as far as the config and the listing confirm it, as any unproven
    /// claim); otherwise as none (an error or localhost secret written again means the same).
    pub fn learn_secret(&mut self, probe: SecretProbe, verified: bool) {
        let kind = SecretKind::for_assigned_host(self.assigned_host.as_deref());
        self.secret = match probe {
            SecretProbe::Taken => Some(kind),
            SecretProbe::Unknown if kind == SecretKind::Remote => Some(kind),
            SecretProbe::Unknown | SecretProbe::Free | SecretProbe::NotAsked => None,
        };
        self.secret_proven = probe == SecretProbe::Taken && verified;
        self.secret_probe = probe;
    }
}

/// What the lookup of a TaskRun's secret name (a dry-run create) answered at recovery.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum SecretProbe {
    /// Not looked up: the TaskRun is queued or finished (its secret does not decide its state).
    #[default]
    NotAsked,
    /// No Secret has the name.
    Free,
    /// A Secret has the name.
    Taken,
    /// No answer: the API refused the lookup for good (403 from a namespace being deleted, a
    /// full Secret quota or an admission policy), or did not answer before recovery's deadline.
    Unknown,
}

/// A `v1:<64 hex digits>` or `v2:<8 hex digits of key id>:<64 hex digits>` proof.
fn parse_proof(v: &str) -> Option<ProofTag> {
    if let Some(mac) = v.strip_prefix("v1:") {
        return Some(ProofTag {
            key_id: None,
            mac: unhex(mac)?,
        });
    }
    let (key_id, mac) = v.strip_prefix("v2:")?.split_once(':')?;
    Some(ProofTag {
        key_id: Some(unhex(key_id)?),
        mac: unhex(mac)?,
    })
}

/// Exactly `2 * N` hex digits.
fn unhex<const N: usize>(hex: &str) -> Option<[u8; N]> {
    let hex = hex.as_bytes();
    if hex.len() != 2 * N {
        return None;
    }
    let digit = |c: u8| char::from(c).to_digit(16);
    let mut out = [0u8; N];
    for (o, pair) in out.iter_mut().zip(hex.chunks_exact(2)) {
        *o = (digit(pair[0])? * 16 + digit(pair[1])?) as u8;
    }
    Some(out)
}

impl SecretKind {
    /// The kind of secret the controller writes for a TaskRun labelled with `assigned_host`.
    pub fn for_assigned_host(assigned_host: Option<&str>) -> Self {
        match assigned_host {
            None => Self::Error,
            Some(contract::LOCALHOST) => Self::Localhost,
            Some(_) => Self::Remote,
        }
    }
}

/// Which of the secret's forms exists.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SecretKind {
    /// `otp`/`host`/`user-dir`.
    Remote,
    /// `host: localhost`.
    Localhost,
    /// `error`.
    Error,
}

/// One listed cloud instance: every instance carrying `MultiPlatformManaged=true` and the lister's
/// `instance-tag` in the lister's account and region, whoever launched it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InstanceRecord {
    /// Instance id.
    pub id: String,
    /// The platform whose config (credentials, region) listed it. A listing acts (orphans,
    /// stopped instances) only on instances of that platform; every live one counts toward its
    /// `max-instances`.
    pub platform: Platform,
    /// `multi-platform-instance` tag.
    pub instance_tag: String,
    /// Who launched it, by its cluster tag.
    pub ownership: Ownership,
    /// Our platform tag (label value, `linux-arm64`); on instances we launched.
    pub platform_label: Option<String>,
    /// Our owner tag: the UID of the TaskRun it was launched (or retagged) for, or a warm pool
    /// instance's name ([`LaunchId::owner_key`](super::LaunchId::owner_key)).
    pub owner: Option<String>,
    /// The `taskRunID` tag (`<namespace>:<name>`), which the Go controller writes too: what
    /// ties an instance it launched to its TaskRun.
    pub taskrun_id: Option<String>,
    /// Launch time.
    pub launched_at: Time,
    /// Lifecycle state.
    pub state: InstanceState,
    /// SSH address, when it has one.
    pub address: Option<String>,
}

impl InstanceRecord {
    /// The listing shows it as this TaskRun's: this cluster's instance carrying the TaskRun's
    /// UID as owner tag, or one without a cluster tag (the Go controller's) carrying its
    /// `taskRunID`. Never another cluster's. A `cloud-instance-id` annotation alone proves
    /// nothing: tenants can write it. (A proven one can stand against the owner tag:
    /// [`handed_to`](Self::handed_to).)
    pub fn belongs_to(&self, taskrun: &TaskRunRecord) -> bool {
        match self.ownership {
            Ownership::Ours => self.owner.as_deref() == Some(taskrun.uid.as_str()),
            Ownership::Untagged => {
                self.taskrun_id.as_deref()
                    == Some(contract::taskrun_id(&taskrun.namespace, &taskrun.name).as_str())
            }
            Ownership::Foreign => false,
        }
    }

    /// This cluster's instance of the TaskRun's platform, which the TaskRun's proven allocation
    /// ([`TaskRunRecord::secret_proven`]) names as its host: the controller placed the TaskRun
    /// on it, whatever the owner tag says. A hand-over retags the instance, but the retag has no
    /// result and runs apart from the previous owner's cleanup, so the tag may still name that
    /// owner (or its successor's retag may have failed). Unlike the annotation, the proof cannot
    /// come from a tenant: it is the controller's HMAC over the TaskRun's namespace, name, UID
    /// and `assigned-host`. Never another cluster's instance, nor the Go controller's.
    pub fn handed_to(&self, taskrun: &TaskRunRecord) -> bool {
        taskrun.secret_proven
            && taskrun.secret == Some(SecretKind::Remote)
            && taskrun.assigned_host.as_deref() == Some(self.id.as_str())
            && taskrun.instance_id.as_deref() == Some(self.id.as_str())
            && Platform::parse(&taskrun.platform).is_ok_and(|p| self.is_ours_for(&p.label_value()))
    }

    /// [`belongs_to`](Self::belongs_to) or [`handed_to`](Self::handed_to): the TaskRun's
    /// `cloud-instance-id` is confirmed.
    pub fn claimed_by(&self, taskrun: &TaskRunRecord) -> bool {
        self.belongs_to(taskrun) || self.handed_to(taskrun)
    }

    /// Launched by this cluster for the platform with this label value.
    pub fn is_ours_for(&self, label: &str) -> bool {
        self.ownership == Ownership::Ours && self.platform_label.as_deref() == Some(label)
    }
}

/// Who launched a listed instance, by its cluster identity tag.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ownership {
    /// Carries this cluster's identity: ours to adopt, retag and terminate.
    Ours,
    /// Carries no cluster identity (launched by the Go controller, or by hand): adopted only
    /// through a TaskRun of this cluster that names it (`cloud-instance-id`, or `assigned-host`
    /// for a pool), otherwise only counted toward `max-instances`.
    Untagged,
    /// Another cluster's: only counted toward `max-instances` (the shared bill guard).
    Foreign,
}

/// Cloud lifecycle state of an instance.
///
/// One meaning of gone: an instance that will not run (more) work. Stopping and stopped
/// instances are gone although they still exist: builds on them are lost, nothing is placed on
/// them, and ours are terminated (listings report them so they can be); they do not count
/// toward `max-instances` (no compute is billed). States a newer cloud reports that this
/// version does not know are taken as alive, and counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum InstanceState {
    /// Booting.
    Pending,
    /// Running (its SSH daemon may still be starting).
    Running,
    /// Terminating.
    ShuttingDown,
    Terminated,
    Stopping,
    Stopped,
    /// A state this version does not know.
    Unknown,
}

impl InstanceState {
    /// Every state, for metrics that report a value per state.
    pub const ALL: [InstanceState; 7] = [
        Self::Pending,
        Self::Running,
        Self::ShuttingDown,
        Self::Terminated,
        Self::Stopping,
        Self::Stopped,
        Self::Unknown,
    ];

    /// The state's name as EC2 spells it (`shutting-down`); a bounded metric label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::Running => "running",
            Self::ShuttingDown => "shutting-down",
            Self::Terminated => "terminated",
            Self::Stopping => "stopping",
            Self::Stopped => "stopped",
            Self::Unknown => "unknown",
        }
    }

    /// Will not run (more) work: on its way down, down, or stopped.
    pub fn is_gone(self) -> bool {
        matches!(
            self,
            Self::ShuttingDown | Self::Terminated | Self::Stopping | Self::Stopped
        )
    }

    /// On its way down or down: nothing left to terminate.
    pub fn is_terminating(self) -> bool {
        matches!(self, Self::ShuttingDown | Self::Terminated)
    }

    /// Counts toward `max-instances`: booting, running, or unknown (maybe alive and billed).
    pub fn counts_toward_limit(self) -> bool {
        !self.is_gone()
    }
}

#[cfg(test)]
mod tests {
    use super::InstanceState::*;

    #[test]
    fn proofs_parse_only_in_their_one_form() {
        let tag: String = (0..32).map(|i| format!("{:02x}", i * 7)).collect();
        let want: [u8; 32] = std::array::from_fn(|i| (i * 7) as u8);
        assert_eq!(
            super::parse_proof(&format!("v1:{tag}")),
            Some(super::ProofTag {
                key_id: None,
                mac: want
            })
        );
        assert_eq!(
            super::parse_proof(&format!("v2:0a0b0c0d:{tag}")),
            Some(super::ProofTag {
                key_id: Some([10, 11, 12, 13]),
                mac: want
            })
        );
        for bad in [
            String::new(),
            tag.clone(),
            format!("v2:{tag}"),
            format!("v2::{tag}"),
            format!("v2:0a0b0c:{tag}"),
            format!("v2:0a0b0c0d0e:{tag}"),
            format!("v2:0a0b0c0z:{tag}"),
            format!("v2:0a0b0c0d:{tag}:"),
            format!("v1:0a0b0c0d:{tag}"),
            format!("v3:0a0b0c0d:{tag}"),
            format!("v1:{}", &tag[2..]),
            format!("v1:{tag}00"),
            format!("v1:zz{}", &tag[2..]),
        ] {
            assert_eq!(super::parse_proof(&bad), None, "{bad}");
        }
        use super::SecretKind;
        assert_eq!(SecretKind::for_assigned_host(None), SecretKind::Error);
        assert_eq!(
            SecretKind::for_assigned_host(Some("localhost")),
            SecretKind::Localhost
        );
        assert_eq!(
            SecretKind::for_assigned_host(Some("h1")),
            SecretKind::Remote
        );
    }

    /// What the lookup answered, as recovery takes it: an unknown answer is never proven, and
    /// stands for a secret only where a build may be using it (an assigned build host).
    #[test]
    fn an_unknown_secret_is_never_proven_and_may_stand_only_for_a_build_host() {
        use super::{SecretKind, SecretProbe, TaskRunRecord};
        let learn = |host: Option<&str>, probe, verified| {
            let mut r = TaskRunRecord {
                assigned_host: host.map(str::to_owned),
                ..TaskRunRecord::default()
            };
            r.learn_secret(probe, verified);
            assert_eq!(r.secret_probe, probe);
            (r.secret, r.secret_proven)
        };
        let remote = Some(SecretKind::Remote);
        for verified in [true, false] {
            assert_eq!(
                learn(Some("h1"), SecretProbe::Taken, verified),
                (remote, verified)
            );
            assert_eq!(
                learn(Some("h1"), SecretProbe::Unknown, verified),
                (remote, false)
            );
            for probe in [SecretProbe::Free, SecretProbe::NotAsked] {
                assert_eq!(learn(Some("h1"), probe, verified), (None, false));
            }
            for host in [None, Some("localhost")] {
                assert_eq!(learn(host, SecretProbe::Unknown, verified), (None, false));
            }
        }
        assert_eq!(
            learn(None, SecretProbe::Taken, false),
            (Some(SecretKind::Error), false)
        );
        assert_eq!(
            learn(Some("localhost"), SecretProbe::Taken, true),
            (Some(SecretKind::Localhost), true)
        );
    }

    #[test]
    fn gone_means_stopped_or_going_down() {
        for s in [ShuttingDown, Terminated, Stopping, Stopped] {
            assert!(s.is_gone(), "{s:?}");
            assert!(!s.counts_toward_limit(), "{s:?}");
        }
        for s in [Pending, Running, Unknown] {
            assert!(!s.is_gone(), "{s:?}");
            assert!(s.counts_toward_limit(), "{s:?}");
        }
        let terminating: Vec<_> = super::InstanceState::ALL
            .into_iter()
            .filter(|s| s.is_terminating())
            .collect();
        assert_eq!(terminating, [ShuttingDown, Terminated]);
    }
}
