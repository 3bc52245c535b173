//! Coalesced instance lookups for probes. Probing each booting instance with its own
//! DescribeInstances every few seconds gets throttled in accounts several clusters share; the
//! batcher turns the lookups of one account and region that arrive within a short window into
//! one describe call by ids (paged by the provider) and fans the answer back out.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{Notify, watch};

use crate::cloud::{Cloud, CloudError, Credentials, ErrorClass, Instance, Operation, Scope};
use crate::config::DynamicPlatform;
use crate::scheduler::Ownership;

/// Tuning of a [`ProbeBatcher`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchOptions {
    /// How long the first lookup of a batch waits for others to join it. Against a probe period
    /// of seconds, a second's wait costs little latency and turns one call per probe into one
    /// call per window and account.
    pub window: Duration,
    /// Ids one batch takes at most; a full batch is sent at once. 1 disables batching.
    pub max_ids: usize,
}

impl Default for BatchOptions {
    fn default() -> Self {
        Self {
            window: Duration::from_secs(1),
            max_ids: crate::cloud::aws::MAX_IDS_PER_CALL,
        }
    }
}

/// Region and credentials: lookups sharing them share a call.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Key {
    region: String,
    access_key_id: String,
    fingerprint: String,
}

type Answer = Option<Arc<Result<Vec<Instance>, CloudError>>>;

/// A batch still taking ids.
struct Open {
    ids: Arc<Mutex<Vec<String>>>,
    answer: watch::Receiver<Answer>,
    full: Arc<Notify>,
}

/// Coalesces [`ProbeBatcher::describe`] calls per region and credentials. Cheap to share; the
/// describe call of a batch runs in its own task, so a caller that gives up (a timeout) does not
/// strand the others.
pub struct ProbeBatcher {
    cloud: Arc<dyn Cloud>,
    options: BatchOptions,
    open: Arc<Mutex<HashMap<Key, Open>>>,
}

impl std::fmt::Debug for ProbeBatcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProbeBatcher")
            .field("options", &self.options)
            .finish()
    }
}

impl ProbeBatcher {
    /// A batcher over `cloud`. Must be used inside a Tokio runtime.
    pub fn new(cloud: Arc<dyn Cloud>, options: BatchOptions) -> Self {
        Self {
            cloud,
            options,
            open: Arc::new(Mutex::new(HashMap::new())),
        }
    }

    /// One instance of the scope's platform by id, looked up together with the other lookups of
    /// the same region and credentials: `None` when the cloud does not know it, or it lacks the
    /// platform's tags, or another cluster launched it.
    pub async fn describe(
        &self,
        scope: Scope<'_>,
        id: &str,
    ) -> Result<Option<Instance>, CloudError> {
        let mut rx = self.join(scope, id);
        let answer = match rx.wait_for(Option::is_some).await {
            Ok(a) => a.clone().expect("waited for an answer"),
            // The batch task ended without answering (a panic in the provider).
            Err(_) => {
                return Err(CloudError::new(
                    scope.platform,
                    Operation::DescribeInstances,
                    ErrorClass::Other,
                    None,
                    "the batched lookup ended without an answer".into(),
                    0,
                ));
            }
        };
        match &*answer {
            Ok(found) => Ok(found
                .iter()
                .find(|i| {
                    i.id == id
                        && i.has_platform_tags(scope.platform)
                        && i.ownership != Ownership::Foreign
                })
                .cloned()),
            Err(e) => Err(e.clone()),
        }
    }

    /// Adds `id` to the open batch of the scope's account, opening one (and its task) if none
    /// takes more ids; returns where the answer will appear.
    fn join(&self, scope: Scope<'_>, id: &str) -> watch::Receiver<Answer> {
        let c: &Credentials = scope.credentials;
        let key = Key {
            region: scope.platform.region.clone(),
            access_key_id: c.key_id().to_owned(),
            fingerprint: c.fingerprint(),
        };
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(batch) = open.get(&key) {
            let mut ids = batch.ids.lock().unwrap_or_else(|e| e.into_inner());
            if ids.len() < self.options.max_ids {
                ids.push(id.to_owned());
                if ids.len() >= self.options.max_ids {
                    batch.full.notify_one();
                }
                return batch.answer.clone();
            }
        }
        let (tx, rx) = watch::channel(None);
        let batch = Open {
            ids: Arc::new(Mutex::new(vec![id.to_owned()])),
            answer: rx.clone(),
            full: Arc::new(Notify::new()),
        };
        if self.options.max_ids <= 1 {
            batch.full.notify_one();
        }
        self.spawn(
            key.clone(),
            &batch,
            tx,
            scope.platform.clone(),
            scope.credentials.clone(),
        );
        // A full batch left in the map is replaced; its task still answers its own ids.
        open.insert(key, batch);
        rx
    }

    fn spawn(
        &self,
        key: Key,
        batch: &Open,
        answer: watch::Sender<Answer>,
        platform: DynamicPlatform,
        credentials: Credentials,
    ) {
        let (cloud, open, window) = (self.cloud.clone(), self.open.clone(), self.options.window);
        let (ids, full) = (batch.ids.clone(), batch.full.clone());
        tokio::spawn(async move {
            tokio::select! {
                _ = tokio::time::sleep(window) => {}
                _ = full.notified() => {}
            }
            let ids = {
                // Closed under the map's lock: no lookup joins after this.
                let mut open = open.lock().unwrap_or_else(|e| e.into_inner());
                if open.get(&key).is_some_and(|b| Arc::ptr_eq(&b.ids, &ids)) {
                    open.remove(&key);
                }
                std::mem::take(&mut *ids.lock().unwrap_or_else(|e| e.into_inner()))
            };
            let scope = Scope {
                platform: &platform,
                credentials: &credentials,
            };
            tracing::debug!(
                platform = %platform.platform,
                region = %platform.region,
                ids = ids.len(),
                "describing a batch of instances"
            );
            let result = cloud.describe(scope, &ids).await;
            answer.send_replace(Some(Arc::new(result)));
        });
    }
}
