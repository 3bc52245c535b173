//! Runs the real `kubectl` (on PATH, or `$KUBECTL`) against a kubeconfig, with its own discovery
//! cache.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use serde_json::Value;
use tokio::io::AsyncWriteExt;

/// Longest a single kubectl call may take.
const TIMEOUT: Duration = Duration::from_secs(20);

/// The documents `kubectl kustomize DIR` renders (no cluster needed); panics with kubectl's
/// error, as the tests that use it would.
pub fn kustomize(dir: &Path) -> Vec<Value> {
    let kubectl = std::env::var_os("KUBECTL").unwrap_or_else(|| "kubectl".into());
    let out = std::process::Command::new(kubectl)
        .arg("kustomize")
        .arg(dir)
        .output()
        .expect("kubectl runs (install it with e2e/setup.sh)");
    assert!(
        out.status.success(),
        "kubectl kustomize {}: {}",
        dir.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    crate::parse_documents(&String::from_utf8_lossy(&out.stdout)).expect("valid YAML")
}

/// A kubectl bound to one kubeconfig.
pub struct Kubectl {
    kubeconfig: PathBuf,
    // Discovery cache per instance: ports are reused across tests, a shared cache would lie.
    cache: tempfile::TempDir,
}

/// What a kubectl call printed.
pub struct Out {
    /// Exit status was 0.
    pub ok: bool,
    /// Standard output.
    pub stdout: String,
    /// Standard error.
    pub stderr: String,
}

impl Kubectl {
    /// A kubectl for the cluster described by `kubeconfig`.
    pub fn new(kubeconfig: &Path) -> Self {
        Self {
            kubeconfig: kubeconfig.to_owned(),
            cache: tempfile::tempdir().expect("temp dir for the kubectl cache"),
        }
    }

    /// The command with kubeconfig and cache set, for callers that stream its output.
    pub fn command(&self, args: &[&str]) -> tokio::process::Command {
        let bin = std::env::var_os("KUBECTL").unwrap_or_else(|| "kubectl".into());
        let mut c = tokio::process::Command::new(bin);
        c.arg("--kubeconfig")
            .arg(&self.kubeconfig)
            .arg("--cache-dir")
            .arg(self.cache.path())
            .args(args)
            .env_remove("KUBECONFIG")
            .kill_on_drop(true);
        c
    }

    /// Runs kubectl with `stdin` as its input and waits for it (panics after a timeout).
    pub async fn run(&self, args: &[&str], stdin: Option<&str>) -> Out {
        let mut c = self.command(args);
        c.stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = c
            .spawn()
            .expect("kubectl runs (install it with e2e/setup.sh)");
        let mut pipe = child.stdin.take().expect("piped stdin");
        if let Some(s) = stdin {
            pipe.write_all(s.as_bytes())
                .await
                .expect("kubectl reads its input");
        }
        drop(pipe);
        let o = tokio::time::timeout(TIMEOUT, child.wait_with_output())
            .await
            .expect("kubectl finished")
            .expect("kubectl output");
        Out {
            ok: o.status.success(),
            stdout: String::from_utf8_lossy(&o.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&o.stderr).into_owned(),
        }
    }

    /// Runs kubectl, asserts success, returns stdout.
    pub async fn ok(&self, args: &[&str]) -> String {
        let o = self.run(args, None).await;
        assert!(o.ok, "kubectl {args:?} failed: {}{}", o.stdout, o.stderr);
        o.stdout
    }

    /// Like [`Kubectl::ok`], feeding `input` on stdin.
    pub async fn ok_stdin(&self, args: &[&str], input: &str) -> String {
        let o = self.run(args, Some(input)).await;
        assert!(o.ok, "kubectl {args:?} failed: {}{}", o.stdout, o.stderr);
        o.stdout
    }

    /// Runs kubectl with `-o json` and parses the output.
    pub async fn json(&self, args: &[&str]) -> Value {
        let mut a = args.to_vec();
        a.extend(["-o", "json"]);
        serde_json::from_str(&self.ok(&a).await).expect("kubectl printed JSON")
    }
}
