//! SIGINT / SIGTERM as a request to stop cleanly: the run finishes its current step, writes a
//! checkpoint, the trace and the summary, and exits non-zero saying how to resume. A second
//! SIGINT while the first is being handled ends the process at once (exit 130), for a user who
//! does not want to wait.
use std::sync::Arc;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::Context;
use signal_hook::consts::{SIGINT, SIGTERM};

static FLAG: OnceLock<Arc<AtomicBool>> = OnceLock::new();

/// Installs the handlers (idempotent). Until it is called, signals keep their default action.
pub fn install() -> anyhow::Result<()> {
    if FLAG.get().is_some() {
        return Ok(());
    }
    let flag = Arc::new(AtomicBool::new(false));
    for sig in [SIGINT, SIGTERM] {
        // Registered first, so it sees the flag before this signal sets it: only a second
        // signal (flag already set) exits at once.
        signal_hook::flag::register_conditional_shutdown(sig, 130, flag.clone())
            .context("installing the signal handlers")?;
        signal_hook::flag::register(sig, flag.clone()).context("installing the signal handlers")?;
    }
    let _ = FLAG.set(flag);
    Ok(())
}

/// Whether a stop was requested.
pub fn requested() -> bool {
    FLAG.get().is_some_and(|f| f.load(Ordering::Relaxed))
}
