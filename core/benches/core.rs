//! Placeholder until the benchmark lands (milestone 2).
fn main() {}
