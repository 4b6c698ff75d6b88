//! The `rolloutpipe` binary: parses the command line and hands off to `rolloutpipe_harness::cli`.
fn main() -> std::process::ExitCode {
    rolloutpipe_harness::cli::main()
}
