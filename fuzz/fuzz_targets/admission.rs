//! Fuzz target: AdmissionReview bytes through the admission core.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| mpc_fuzz::admission(data));
