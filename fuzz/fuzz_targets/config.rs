//! Fuzz target: host-config ConfigMap YAML through the config parser and the last-good merge.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| mpc_fuzz::config(data));
