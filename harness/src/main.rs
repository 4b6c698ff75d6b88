//! The `rolloutpipe` binary (placeholder until the subcommands land).
fn main() {
    println!("rolloutpipe");
}
