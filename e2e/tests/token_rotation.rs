//! The OTP store token rotated under a running controller (docs/migration.md, "Rotating the OTP
//! store token"): the controller follows the token file as the OTP server does, so `/store-key`
//! keeps working without a restart, and its allocation proofs name the key that made them.

use std::time::Duration;

use e2e::product::Product;
use mpc::contract;
use serde_json::{Value, json};

const T: Duration = Duration::from_secs(60);

async fn secret_with_otp(
    p: &Product,
    ns: &str,
    name: &str,
) -> std::collections::BTreeMap<String, String> {
    let what = format!("secret of {ns}/{name} with otp");
    p.wait(T, &what, || async {
        p.secret(ns, name).await.filter(|s| s.contains_key("otp"))
    })
    .await
}

/// The key id of the TaskRun's allocation proof (`v2:<key id>:<tag>`).
fn proof_key_id(tr: &Value) -> String {
    let proof = tr["metadata"]["annotations"][contract::ALLOCATION_PROOF_ANNOTATION]
        .as_str()
        .unwrap_or_else(|| panic!("no proof: {tr}"));
    let mut parts = proof.split(':');
    assert_eq!(parts.next(), Some("v2"), "{proof}");
    let id = parts.next().unwrap_or_else(|| panic!("{proof}")).to_owned();
    assert_eq!(parts.next().map(str::len), Some(64), "{proof}");
    id
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rotated_store_token_is_followed_without_a_restart() {
    let mut p = Product::start(e2e::mpc_binary!(), &[("h1", 2)])
        .await
        .unwrap();
    p.start_controller("c1").await.unwrap();
    p.create_taskrun("tenant-a", "before", "linux/arm64", json!({}))
        .await
        .unwrap();
    secret_with_otp(&p, "tenant-a", "before").await;
    let before = p.taskrun("tenant-a", "before").await.unwrap();

    // The Secret updated in place, as kubelet does for a mounted Secret: both processes read
    // the same file.
    let token = p.dir.path().join("otp/store-token");
    let rotated = format!("rotated-{}", mpc::otp::token::Token::random().as_str());
    std::fs::write(&token, format!("{rotated}\n")).unwrap();
    // The OTP server re-reads its token file every second.
    tokio::time::sleep(Duration::from_secs(2)).await;

    p.create_taskrun("tenant-a", "after", "linux/arm64", json!({}))
        .await
        .unwrap();
    secret_with_otp(&p, "tenant-a", "after").await;
    p.build("tenant-a", "after").await;
    let after = p.taskrun("tenant-a", "after").await.unwrap();
    assert_ne!(
        proof_key_id(&before),
        proof_key_id(&after),
        "a proof names the key it was made with"
    );
    // The key stored before the rotation still redeems.
    p.build("tenant-a", "before").await;
    for name in ["before", "after"] {
        p.cleaned_up("tenant-a", name).await;
    }
}
