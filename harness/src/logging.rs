//! Logging that cooperates with progress bars: every log line is written while the bars are
//! suspended (cleared, then redrawn below it), so a line such as "checkpoint saved" never tears
//! a bar; colours only when stderr is a terminal, so redirected logs carry no ANSI codes.
use std::io::{IsTerminal, Write};
use std::sync::LazyLock;

use indicatif::{MultiProgress, ProgressBar};

/// Every visible bar of the process lives here, so logging can suspend them all.
static BARS: LazyLock<MultiProgress> = LazyLock::new(MultiProgress::new);

/// Shows `bar` through the shared set (a hidden bar stays hidden).
pub fn add(bar: ProgressBar) -> ProgressBar {
    if bar.is_hidden() {
        return bar;
    }
    BARS.add(bar)
}

/// One log record, buffered and written in one piece with the bars suspended.
#[derive(Default)]
pub struct LogWriter(Vec<u8>);

impl Write for LogWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for LogWriter {
    fn drop(&mut self) {
        if self.0.is_empty() {
            return;
        }
        let buf = std::mem::take(&mut self.0);
        BARS.suspend(|| {
            let _ = std::io::stderr().lock().write_all(&buf);
        });
    }
}

/// Sets up `tracing` with `filter` (env-filter syntax; an invalid one falls back to `info`).
pub fn init(filter: &str) {
    let filter = tracing_subscriber::EnvFilter::try_new(filter)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(LogWriter::default)
        .init();
}
