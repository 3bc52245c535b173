//! `mpc simulate` on a 24 h trace of 50,000 TaskRuns, both policies (the default output).
//!
//! `cargo bench -p mpc-core --bench simulate`

// The `mpc` binary's allocator, so these numbers are the binary's.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use mpc_core::simulate::{self, PolicyChoice, workload};

fn benches(c: &mut Criterion) {
    let (config, errors) = simulate::load_config(simulate::EXAMPLE_CONFIG, "example").unwrap();
    assert_eq!(errors, 0);
    let day = workload::bursty_day(50_000, 1);
    let mut g = c.benchmark_group("simulate");
    g.sample_size(10);
    g.bench_function("day_50k_taskruns_both_policies", |b| {
        b.iter(|| {
            let o = simulate::run_policies(&config, &day, PolicyChoice::Both, 1);
            black_box(o.len())
        })
    });
    g.bench_function("day_50k_taskruns_mpc_only", |b| {
        b.iter(|| black_box(simulate::run_policies(&config, &day, PolicyChoice::Mpc, 1).len()))
    });
    g.finish();
}

criterion_group!(simulate_benches, benches);
criterion_main!(simulate_benches);
