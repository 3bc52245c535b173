//! A Tekton stand-in: a small controller (kube-rs, against any API server) that does to TaskRuns
//! what the Tekton controller does that matters to this project: resolve the task spec into
//! `status.taskSpec`, honour `spec.status` `TaskRunPending`/`TaskRunCancelled`, create the pod,
//! report the `Succeeded` condition and retries (`ToBeRetried`, `status.retriesStatus`).
//!
//! Tests decide when a TaskRun ends ([`Tekton::finish`]) or make it run its steps for real on this
//! machine ([`Tekton::run_steps`]): the secret volumes are written to a temp dir and the step
//! scripts run with bash, their mount paths rewritten to that dir (a stand-in for a volume mount).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use kube::api::{Api, DynamicObject, PostParams};
use kube::core::{ApiResource, GroupVersionKind};
use kube::runtime::{WatchStreamExt, watcher};
use serde_json::{Value, json};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// Tekton stand-in failures.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The API refused a request.
    #[error("kube: {0}")]
    Kube(#[from] kube::Error),
    /// The TaskRun is not in a state that allows the action.
    #[error("taskrun {0}: {1}")]
    State(String, String),
    /// Running a step failed before it could report an exit code.
    #[error("step: {0}")]
    Step(String),
    /// I/O.
    #[error("I/O: {0}")]
    Io(#[from] std::io::Error),
}

/// How an attempt ends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// `Succeeded=True`.
    Succeeded,
    /// `Succeeded=False` (or `ToBeRetried` while `spec.retries` allows another attempt).
    Failed {
        /// Condition message.
        message: String,
    },
}

/// What running the steps produced.
#[derive(Debug, Clone)]
pub struct StepRun {
    /// Exit code of the last step run (the first that failed, or the last one).
    pub exit_code: i32,
    /// Combined stdout of the steps run.
    pub stdout: String,
    /// Combined stderr of the steps run.
    pub stderr: String,
    /// The outcome reported on the TaskRun.
    pub outcome: Outcome,
}

/// Options of [`Tekton::run_steps`].
#[derive(Debug, Clone)]
pub struct RunOptions {
    /// Longest a step may run.
    pub step_timeout: Duration,
    /// Report the outcome on the TaskRun afterwards.
    pub finish: bool,
    /// Extra environment for every step.
    pub env: Vec<(String, String)>,
}

impl Default for RunOptions {
    fn default() -> Self {
        Self {
            step_timeout: Duration::from_secs(120),
            finish: true,
            env: Vec::new(),
        }
    }
}

/// `tekton.dev/v1` TaskRun.
pub fn taskrun_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("tekton.dev", "v1", "TaskRun"),
        "taskruns",
    )
}

/// `tekton.dev/v1` Task.
pub fn task_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk("tekton.dev", "v1", "Task"), "tasks")
}

fn now() -> String {
    mpc_e2e_timestamp(time::OffsetDateTime::now_utc())
}

fn mpc_e2e_timestamp(t: time::OffsetDateTime) -> String {
    crate::apiserver::testing::timestamp(t)
}

fn succeeded(tr: &Value) -> Option<&Value> {
    tr["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == "Succeeded")
}

/// Whether the TaskRun has finished (Succeeded True or False).
pub fn is_done(tr: &Value) -> bool {
    succeeded(tr).is_some_and(|c| c["status"] == "True" || c["status"] == "False")
}

/// The `Succeeded` condition's `(status, reason)`.
pub fn condition(tr: &Value) -> Option<(String, String)> {
    succeeded(tr).map(|c| {
        (
            c["status"].as_str().unwrap_or_default().to_owned(),
            c["reason"].as_str().unwrap_or_default().to_owned(),
        )
    })
}

fn set_condition(status: &mut Value, st: &str, reason: &str, message: &str) {
    status["conditions"] = json!([{
        "type": "Succeeded", "status": st, "reason": reason, "message": message,
        "lastTransitionTime": now(),
    }]);
}

/// The pod name of the current attempt (`<name>-pod`, `-retryN` for retries).
pub fn pod_name(tr: &Value) -> String {
    let name = tr["metadata"]["name"].as_str().unwrap_or_default();
    let retries = tr["status"]["retriesStatus"].as_array().map_or(0, Vec::len);
    if retries > 0 {
        format!("{name}-pod-retry{retries}")
    } else {
        format!("{name}-pod")
    }
}

/// A running stand-in controller.
pub struct Tekton {
    client: kube::Client,
    cancel: CancellationToken,
    task: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Tekton {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tekton").finish_non_exhaustive()
    }
}

impl Tekton {
    /// Starts reconciling TaskRuns in every namespace.
    pub fn start(client: kube::Client) -> Self {
        let cancel = CancellationToken::new();
        let task = tokio::spawn(run(client.clone(), cancel.clone()));
        Self {
            client,
            cancel,
            task: Some(task),
        }
    }

    fn api(&self, ns: &str) -> Api<DynamicObject> {
        Api::namespaced_with(self.client.clone(), ns, &taskrun_resource())
    }

    /// Reads a TaskRun as JSON.
    pub async fn get(&self, ns: &str, name: &str) -> Result<Value, Error> {
        Ok(serde_json::to_value(self.api(ns).get(name).await?).unwrap_or_default())
    }

    /// Waits until `pred` holds for the TaskRun (polling), or `timeout` passes.
    pub async fn wait_for(
        &self,
        ns: &str,
        name: &str,
        timeout: Duration,
        pred: impl Fn(&Value) -> bool,
    ) -> Result<Value, Error> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let tr = self.get(ns, name).await?;
            if pred(&tr) {
                return Ok(tr);
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(Error::State(
                    name.to_owned(),
                    format!(
                        "condition not reached in {timeout:?}; status: {}",
                        tr["status"]
                    ),
                ));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Ends the current attempt. A failure with retries left becomes `ToBeRetried`: the attempt
    /// is appended to `status.retriesStatus` and a new pod is started.
    pub async fn finish(&self, ns: &str, name: &str, outcome: Outcome) -> Result<Value, Error> {
        let api = self.api(ns);
        loop {
            let tr = self.get(ns, name).await?;
            if is_done(&tr) {
                return Err(Error::State(name.into(), "already finished".into()));
            }
            if tr["status"]["podName"].as_str().is_none_or(str::is_empty) {
                return Err(Error::State(
                    name.into(),
                    "has not started (no pod yet)".into(),
                ));
            }
            let mut new = tr.clone();
            let pod = tr["status"]["podName"]
                .as_str()
                .unwrap_or_default()
                .to_owned();
            let retries = tr["spec"]["retries"].as_u64().unwrap_or(0) as usize;
            let attempts = tr["status"]["retriesStatus"].as_array().map_or(0, Vec::len);
            let phase = match &outcome {
                Outcome::Succeeded => {
                    let s = &mut new["status"];
                    set_condition(s, "True", "Succeeded", "All Steps have completed executing");
                    s["completionTime"] = json!(now());
                    "Succeeded"
                }
                Outcome::Failed { message } if attempts < retries => {
                    let mut failed = tr["status"].clone();
                    set_condition(&mut failed, "False", "Failed", message);
                    failed["completionTime"] = json!(now());
                    if let Some(m) = failed.as_object_mut() {
                        m.remove("retriesStatus");
                    }
                    let s = &mut new["status"];
                    let mut rs = s["retriesStatus"].as_array().cloned().unwrap_or_default();
                    rs.push(failed);
                    s["retriesStatus"] = json!(rs);
                    if let Some(m) = s.as_object_mut() {
                        m.remove("startTime");
                        m.remove("completionTime");
                        m.remove("podName");
                    }
                    set_condition(s, "Unknown", "ToBeRetried", message);
                    "Failed"
                }
                Outcome::Failed { message } => {
                    let s = &mut new["status"];
                    set_condition(s, "False", "Failed", message);
                    s["completionTime"] = json!(now());
                    "Failed"
                }
            };
            let obj: DynamicObject =
                serde_json::from_value(new).map_err(|e| Error::Step(e.to_string()))?;
            match api.replace_status(name, &PostParams::default(), &obj).await {
                Ok(done) => {
                    set_pod_phase(&self.client, ns, &pod, phase).await;
                    return Ok(serde_json::to_value(done).unwrap_or_default());
                }
                Err(kube::Error::Api(e)) if e.code == 409 => continue,
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Runs the TaskRun's steps on this machine with bash (after it started), then (with
    /// `opts.finish`) reports the outcome: exit 0 → Succeeded, else Failed/ToBeRetried.
    pub async fn run_steps(
        &self,
        ns: &str,
        name: &str,
        opts: RunOptions,
    ) -> Result<StepRun, Error> {
        let tr = self
            .wait_for(ns, name, Duration::from_secs(30), |t| {
                t["status"]["podName"]
                    .as_str()
                    .is_some_and(|p| !p.is_empty())
            })
            .await?;
        let spec = tr["status"]["taskSpec"].clone();
        let dir = tempfile::Builder::new().prefix("e2e-step-").tempdir()?;
        let home = dir.path().join("home");
        std::fs::create_dir_all(&home)?;
        let params = params_of(&tr, &spec);
        let mounts = self
            .materialise_volumes(ns, &spec, dir.path(), &params, &tr)
            .await?;
        let mut out = StepRun {
            exit_code: 0,
            stdout: String::new(),
            stderr: String::new(),
            outcome: Outcome::Succeeded,
        };
        for step in spec["steps"].as_array().into_iter().flatten() {
            let script = step_script(step, &params, &tr, &mounts);
            let mut cmd = tokio::process::Command::new("bash");
            cmd.arg("-c").arg(&script);
            cmd.env_clear()
                .env(
                    "PATH",
                    std::env::var("PATH").unwrap_or_else(|_| "/usr/bin:/bin".into()),
                )
                .env("HOME", &home)
                .current_dir(dir.path())
                .kill_on_drop(true);
            for e in step["env"].as_array().into_iter().flatten() {
                if let (Some(n), Some(v)) = (e["name"].as_str(), e["value"].as_str()) {
                    cmd.env(n, substitute(v, &params, &tr));
                }
            }
            for (k, v) in &opts.env {
                cmd.env(k, v);
            }
            let output = tokio::time::timeout(opts.step_timeout, cmd.output())
                .await
                .map_err(|_| Error::Step(format!("step {} timed out", step["name"])))??;
            out.stdout
                .push_str(&String::from_utf8_lossy(&output.stdout));
            out.stderr
                .push_str(&String::from_utf8_lossy(&output.stderr));
            out.exit_code = output.status.code().unwrap_or(-1);
            if out.exit_code != 0 {
                out.outcome = Outcome::Failed {
                    message: format!(
                        "\"step-{}\" exited with code {}",
                        step["name"].as_str().unwrap_or_default(),
                        out.exit_code
                    ),
                };
                break;
            }
        }
        if opts.finish {
            self.finish(ns, name, out.outcome.clone()).await?;
        }
        Ok(out)
    }

    /// Writes every secret volume of the task spec under `root/<volume>`; returns the mount path
    /// → directory map of the volumes.
    async fn materialise_volumes(
        &self,
        ns: &str,
        spec: &Value,
        root: &Path,
        params: &BTreeMap<String, String>,
        tr: &Value,
    ) -> Result<BTreeMap<String, PathBuf>, Error> {
        let secrets: Api<k8s_openapi::api::core::v1::Secret> =
            Api::namespaced(self.client.clone(), ns);
        let mut dirs: BTreeMap<String, PathBuf> = BTreeMap::new();
        for v in spec["volumes"].as_array().into_iter().flatten() {
            let vname = v["name"].as_str().unwrap_or_default();
            let dir = root.join("volumes").join(vname);
            std::fs::create_dir_all(&dir)?;
            if let Some(sname) = v["secret"]["secretName"].as_str() {
                // Tekton substitutes params and context in volumes too (Konflux tasks name
                // `multi-platform-ssh-$(context.taskRun.name)`).
                let sname = &substitute(sname, params, tr);
                let optional = v["secret"]["optional"].as_bool() == Some(true);
                match secrets.get_opt(sname).await? {
                    Some(s) => {
                        for (k, b) in s.data.unwrap_or_default() {
                            std::fs::write(dir.join(&k), &b.0)?;
                        }
                        for (k, sv) in s.string_data.unwrap_or_default() {
                            std::fs::write(dir.join(&k), sv.as_bytes())?;
                        }
                    }
                    None if optional => {}
                    None => {
                        return Err(Error::Step(format!(
                            "secret {sname:?} of volume {vname:?} does not exist: the pod could not start"
                        )));
                    }
                }
            }
            dirs.insert(vname.to_owned(), dir);
        }
        Ok(dirs)
    }

    /// Stops the controller.
    pub async fn shutdown(mut self) {
        self.cancel.cancel();
        if let Some(t) = self.task.take() {
            let _ = t.await;
        }
    }
}

impl Drop for Tekton {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

fn params_of(tr: &Value, spec: &Value) -> BTreeMap<String, String> {
    let mut p = BTreeMap::new();
    for d in spec["params"].as_array().into_iter().flatten() {
        if let (Some(n), Some(v)) = (d["name"].as_str(), d["default"].as_str()) {
            p.insert(n.to_owned(), v.to_owned());
        }
    }
    for d in tr["spec"]["params"].as_array().into_iter().flatten() {
        if let (Some(n), Some(v)) = (d["name"].as_str(), d["value"].as_str()) {
            p.insert(n.to_owned(), v.to_owned());
        }
    }
    p
}

fn substitute(s: &str, params: &BTreeMap<String, String>, tr: &Value) -> String {
    let mut out = s.to_owned();
    for (k, v) in params {
        out = out.replace(&format!("$(params.{k})"), v);
        out = out.replace(&format!("$(params[\"{k}\"])"), v);
        out = out.replace(&format!("$(params['{k}'])"), v);
    }
    out = out.replace(
        "$(context.taskRun.name)",
        tr["metadata"]["name"].as_str().unwrap_or_default(),
    );
    out = out.replace(
        "$(context.taskRun.namespace)",
        tr["metadata"]["namespace"].as_str().unwrap_or_default(),
    );
    out.replace(
        "$(context.taskRun.uid)",
        tr["metadata"]["uid"].as_str().unwrap_or_default(),
    )
}

/// The step's script with parameters substituted and volume mount paths rewritten to the
/// directories holding the volume contents.
fn step_script(
    step: &Value,
    params: &BTreeMap<String, String>,
    tr: &Value,
    volumes: &BTreeMap<String, PathBuf>,
) -> String {
    let raw = match step["script"].as_str() {
        Some(s) => s.to_owned(),
        None => {
            let parts: Vec<String> = step["command"]
                .as_array()
                .into_iter()
                .flatten()
                .chain(step["args"].as_array().into_iter().flatten())
                .filter_map(|v| v.as_str().map(shell_quote))
                .collect();
            parts.join(" ")
        }
    };
    let mut script = substitute(&raw, params, tr);
    // Longest mount paths first so `/ssh/x` is not rewritten through `/ssh`.
    let mut mounts: Vec<(String, PathBuf)> = step["volumeMounts"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|m| {
            let dir = volumes.get(m["name"].as_str()?)?;
            Some((m["mountPath"].as_str()?.to_owned(), dir.clone()))
        })
        .collect();
    mounts.sort_by_key(|(p, _)| std::cmp::Reverse(p.len()));
    for (path, dir) in mounts {
        script = script.replace(&path, &dir.display().to_string());
    }
    script
}

fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', "'\\''"))
}

async fn set_pod_phase(client: &kube::Client, ns: &str, pod: &str, phase: &str) {
    use kube::api::{Patch, PatchParams};
    let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(client.clone(), ns);
    let patch = json!({"status": {"phase": phase}});
    if let Err(e) = pods
        .patch_status(pod, &PatchParams::default(), &Patch::Merge(&patch))
        .await
    {
        tracing::debug!(%pod, error = %e, "pod phase not updated");
    }
}

/// Watches TaskRuns and reconciles each event. A reconciliation that fails (an API error or
/// restart) is retried with a back-off from the TaskRun's current state, as Tekton's work queue
/// does: otherwise a TaskRun whose retry pod could not be started would wait for its next
/// change, which may never come.
async fn run(client: kube::Client, cancel: CancellationToken) {
    use tokio::time::Instant;
    const FIRST: Duration = Duration::from_millis(100);
    const MOST: Duration = Duration::from_secs(5);
    let api: Api<DynamicObject> = Api::all_with(client.clone(), &taskrun_resource());
    let mut stream = watcher::watcher(api, watcher::Config::default())
        .default_backoff()
        .boxed();
    let client = Arc::new(client);
    // (namespace, name) → (when to retry, the back-off after that).
    let mut requeue: BTreeMap<(String, String), (Instant, Duration)> = BTreeMap::new();
    loop {
        let due = requeue.values().map(|(at, _)| *at).min();
        let tr = tokio::select! {
            () = cancel.cancelled() => return,
            () = async {
                match due {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            } => {
                let now = Instant::now();
                let Some(key) = requeue.iter().find(|(_, (at, _))| *at <= now).map(|(k, _)| k.clone()) else {
                    continue;
                };
                let api: Api<DynamicObject> =
                    Api::namespaced_with((*client).clone(), &key.0, &taskrun_resource());
                match api.get_opt(&key.1).await {
                    Ok(Some(obj)) => serde_json::to_value(&obj).unwrap_or_default(),
                    Ok(None) => {
                        requeue.remove(&key);
                        continue;
                    }
                    Err(e) => {
                        tracing::debug!(error = %e, "taskrun requeue read failed");
                        let (at, backoff) = requeue.get_mut(&key).expect("found above");
                        *at = now + *backoff;
                        *backoff = (*backoff * 2).min(MOST);
                        continue;
                    }
                }
            }
            ev = stream.next() => {
                let Some(ev) = ev else { return };
                match ev {
                    Ok(watcher::Event::Apply(o) | watcher::Event::InitApply(o)) => {
                        serde_json::to_value(&o).unwrap_or_default()
                    }
                    Ok(_) => continue,
                    Err(e) => {
                        tracing::debug!(error = %e, "taskrun watch error");
                        continue;
                    }
                }
            }
        };
        let key = (
            tr["metadata"]["namespace"]
                .as_str()
                .unwrap_or_default()
                .to_owned(),
            tr["metadata"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_owned(),
        );
        match reconcile(&client, &tr).await {
            Ok(()) => {
                requeue.remove(&key);
            }
            Err(e) => {
                tracing::warn!(taskrun = %key.1, error = %e, "reconcile failed; retrying");
                let backoff = requeue.get(&key).map_or(FIRST, |(_, b)| *b);
                requeue.insert(key, (Instant::now() + backoff, (backoff * 2).min(MOST)));
            }
        }
    }
}

/// One reconciliation of a TaskRun, from its current state.
async fn reconcile(client: &kube::Client, tr: &Value) -> Result<(), Error> {
    if tr["metadata"]["deletionTimestamp"].is_string() || is_done(tr) {
        return Ok(());
    }
    let ns = tr["metadata"]["namespace"].as_str().unwrap_or_default();
    let name = tr["metadata"]["name"].as_str().unwrap_or_default();
    let mut status = tr["status"].clone();
    if !status.is_object() {
        status = json!({});
    }
    let before = status.clone();
    if status["taskSpec"].is_null() {
        match resolve_spec(client, ns, tr).await? {
            Ok(spec) => status["taskSpec"] = spec,
            Err(message) => {
                set_condition(&mut status, "False", "CouldntGetTask", &message);
                status["completionTime"] = json!(now());
                return write_status(client, tr, status).await;
            }
        }
    }
    let pod = pod_name(tr);
    match tr["spec"]["status"].as_str() {
        Some("TaskRunCancelled") => {
            set_condition(
                &mut status,
                "False",
                "TaskRunCancelled",
                &format!("TaskRun {name:?} was cancelled. "),
            );
            status["completionTime"] = json!(now());
            write_status(client, tr, status).await?;
            let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(client.clone(), ns);
            let _ = pods.delete(&pod, &Default::default()).await;
            return Ok(());
        }
        Some("TaskRunPending") => {
            if succeeded(tr).is_none_or(|c| c["reason"] != "TaskRunPending") {
                set_condition(
                    &mut status,
                    "Unknown",
                    "TaskRunPending",
                    &format!("TaskRun {name:?} is pending"),
                );
            }
        }
        _ => {
            if status["podName"].as_str().is_none_or(str::is_empty) {
                create_pod(client, tr, &status["taskSpec"], &pod).await?;
                status["podName"] = json!(pod);
                if status["startTime"].is_null() {
                    status["startTime"] = json!(now());
                }
                set_condition(
                    &mut status,
                    "Unknown",
                    "Running",
                    "Not all Steps in the Task have finished executing",
                );
            }
        }
    }
    if status != before {
        write_status(client, tr, status).await?;
    }
    Ok(())
}

async fn write_status(client: &kube::Client, tr: &Value, status: Value) -> Result<(), Error> {
    let ns = tr["metadata"]["namespace"].as_str().unwrap_or_default();
    let name = tr["metadata"]["name"].as_str().unwrap_or_default();
    let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), ns, &taskrun_resource());
    let mut new = tr.clone();
    new["status"] = status;
    // The resourceVersion of what we reconciled makes a concurrent change a 409; the next watch
    // event brings the newer state.
    let new: DynamicObject =
        serde_json::from_value(new).map_err(|e| Error::Step(format!("taskrun: {e}")))?;
    match api.replace_status(name, &PostParams::default(), &new).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(e)) if e.code == 409 || e.code == 404 => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// The task spec of a TaskRun: inline, or the named Task's; `Ok(Err(message))` when it cannot
/// be resolved (the TaskRun fails).
async fn resolve_spec(
    client: &kube::Client,
    ns: &str,
    tr: &Value,
) -> Result<Result<Value, String>, Error> {
    if tr["spec"]["taskSpec"].is_object() {
        return Ok(Ok(tr["spec"]["taskSpec"].clone()));
    }
    let Some(task) = tr["spec"]["taskRef"]["name"].as_str() else {
        if tr["spec"]["taskRef"]["resolver"].is_string() {
            return Ok(Err(
                "remote resolution (taskRef.resolver) is not supported by the Tekton stand-in"
                    .into(),
            ));
        }
        return Ok(Err("TaskRun has neither taskRef nor taskSpec".into()));
    };
    let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), ns, &task_resource());
    match api.get_opt(task).await? {
        Some(t) => Ok(Ok(t.data["spec"].clone())),
        None => Ok(Err(format!(
            "error when listing tasks for taskRun {}: tasks.tekton.dev {task:?} not found",
            tr["metadata"]["name"].as_str().unwrap_or_default()
        ))),
    }
}

async fn create_pod(
    client: &kube::Client,
    tr: &Value,
    spec: &Value,
    pod: &str,
) -> Result<(), Error> {
    let ns = tr["metadata"]["namespace"].as_str().unwrap_or_default();
    let name = tr["metadata"]["name"].as_str().unwrap_or_default();
    let uid = tr["metadata"]["uid"].as_str().unwrap_or_default();
    let mut labels: BTreeMap<String, String> = tr["metadata"]["labels"]
        .as_object()
        .into_iter()
        .flatten()
        .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_owned())))
        .collect();
    labels.insert("tekton.dev/taskRun".into(), name.into());
    labels.insert("tekton.dev/taskRunUID".into(), uid.into());
    labels.insert(
        "app.kubernetes.io/managed-by".into(),
        "tekton-pipelines".into(),
    );
    let containers: Vec<Value> = spec["steps"]
        .as_array()
        .into_iter()
        .flatten()
        .enumerate()
        .map(|(i, s)| {
            let mut c = json!({
                "name": format!("step-{}", s["name"].as_str().map(str::to_owned).unwrap_or_else(|| format!("unnamed-{i}"))),
                "image": s["image"].as_str().unwrap_or("busybox"),
                "command": ["/tekton/bin/entrypoint"],
            });
            for k in ["env", "volumeMounts", "workingDir", "resources"] {
                if !s[k].is_null() {
                    c[k] = s[k].clone();
                }
            }
            c
        })
        .collect();
    let pt = &tr["spec"]["podTemplate"];
    let mut pod_spec = json!({
        "restartPolicy": "Never",
        "containers": containers,
        "volumes": spec["volumes"].as_array().cloned().unwrap_or_default(),
        "serviceAccountName": tr["spec"]["serviceAccountName"].as_str().unwrap_or("default"),
    });
    for k in [
        "affinity",
        "nodeSelector",
        "tolerations",
        "securityContext",
        "priorityClassName",
        "runtimeClassName",
        "imagePullSecrets",
        "hostAliases",
    ] {
        if !pt[k].is_null() {
            pod_spec[k] = pt[k].clone();
        }
    }
    let pod_obj = json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {
            "name": pod, "namespace": ns, "labels": labels,
            "ownerReferences": [{"apiVersion": "tekton.dev/v1", "kind": "TaskRun", "name": name, "uid": uid,
                                 "controller": true, "blockOwnerDeletion": true}],
        },
        "spec": pod_spec,
    });
    let p: k8s_openapi::api::core::v1::Pod =
        serde_json::from_value(pod_obj).map_err(|e| Error::Step(format!("pod: {e}")))?;
    let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(client.clone(), ns);
    match pods.create(&PostParams::default(), &p).await {
        Ok(_) => {}
        Err(kube::Error::Api(e)) if e.code == 409 => {}
        Err(e) => return Err(e.into()),
    }
    set_pod_phase(client, ns, pod, "Running").await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scripts_get_params_and_mount_paths() {
        let tr = json!({"metadata": {"name": "tr", "namespace": "ns", "uid": "u"},
            "spec": {"params": [{"name": "PLATFORM", "value": "linux/arm64"}]}});
        let spec = json!({"params": [{"name": "PLATFORM"}, {"name": "X", "default": "d"}]});
        let params = params_of(&tr, &spec);
        let step = json!({"name": "s", "script": "cat /ssh/host /ssh-other/x; echo $(params.PLATFORM) $(params.X) $(context.taskRun.name)",
            "volumeMounts": [{"name": "ssh", "mountPath": "/ssh"}, {"name": "o", "mountPath": "/ssh-other"}]});
        let vols: BTreeMap<String, PathBuf> = [
            ("ssh".to_owned(), PathBuf::from("/tmp/a")),
            ("o".to_owned(), PathBuf::from("/tmp/b")),
        ]
        .into();
        let s = step_script(&step, &params, &tr, &vols);
        assert_eq!(s, "cat /tmp/a/host /tmp/b/x; echo linux/arm64 d tr");
    }

    #[test]
    fn retry_pod_names() {
        let mut tr = json!({"metadata": {"name": "tr"}, "status": {}});
        assert_eq!(pod_name(&tr), "tr-pod");
        tr["status"]["retriesStatus"] = json!([{}, {}]);
        assert_eq!(pod_name(&tr), "tr-pod-retry2");
    }
}
