//! Admission decision cost on one core: a ~3.5 KB taskRef review and a ~40 KB inline-Task review
//! (12 steps), both compact JSON with fields in the order the API server writes them
//! (`operation` before `object`). `decide/*_sorted_keys` are the same reviews with keys sorted,
//! which puts `object` first and costs the parser a second pass. `full_dom/*` parses the same
//! bytes into a `serde_json::Value` only, as a reference for what a full-DOM approach starts from.
//!
//! cargo bench -p mpc-core --bench admission

// The `mpc` binary's allocator, so these numbers are the binary's.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::hint::black_box;
use std::path::PathBuf;
use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use mpc_core::admission::{self, Decision};

#[path = "support/compact_json.rs"]
mod compact_json;
use compact_json::compact;

fn fixture(name: &str) -> Vec<u8> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/admission")
        .join(format!("{name}.json"));
    compact(&std::fs::read(path).unwrap())
}

/// The same review with every object's keys sorted.
fn sorted_keys(json: &[u8]) -> Vec<u8> {
    let v: serde_json::Value = serde_json::from_slice(json).unwrap();
    serde_json::to_vec(&v).unwrap()
}

fn config() -> mpc_core::config::HostConfig {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/admission/host-config.yaml");
    let (data, _) =
        mpc_core::config::read_configmap_yaml(&std::fs::read_to_string(path).unwrap()).unwrap();
    mpc_core::config::parse(&data).config
}

fn bench(c: &mut Criterion) {
    let cfg = config();
    let (small, large) = (fixture("taskref-bundle"), fixture("large-inline-taskspec"));
    let inputs = [
        ("taskref_3k", small.clone()),
        ("inline_40k", large.clone()),
        ("taskref_3k_sorted_keys", sorted_keys(&small)),
        ("inline_40k_sorted_keys", sorted_keys(&large)),
    ];
    for (name, body) in &inputs {
        // The benchmark must measure the real decision, not an early error.
        let r = admission::review(body, &cfg, 1_700_000_000).unwrap();
        assert_eq!(r.decision, Decision::Remote, "{name}");
        assert_eq!(r.patch_ops, 3, "{name}");
        eprintln!("{name}: {} bytes", body.len());
    }
    let mut g = c.benchmark_group("decide");
    for (name, body) in &inputs {
        g.throughput(Throughput::Bytes(body.len() as u64));
        g.bench_function(*name, |b| {
            b.iter(|| admission::review(black_box(body), black_box(&cfg), 1_700_000_000).unwrap())
        });
    }
    g.finish();
    let mut g = c.benchmark_group("full_dom");
    for (name, body) in &inputs[..2] {
        g.throughput(Throughput::Bytes(body.len() as u64));
        g.bench_function(*name, |b| {
            b.iter(|| serde_json::from_slice::<serde_json::Value>(black_box(body)).unwrap())
        });
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(4));
    targets = bench
}
criterion_main!(benches);
