//! Logging: `tracing` events to stderr, one line each, prefixed with the pid.
//!
//! `LIBCUDA_LOG_LEVEL` (HAMi-core's variable) sets the level: 0 and 1 errors only, 2 (the default)
//! adds warnings, 3 info, 4 debug. Nothing is printed on stdout, and nothing at the default level
//! unless something is wrong, so tools that parse `nvidia-smi` output keep working.

use std::fmt;
use std::sync::Once;

use tracing::{Event, Level, Subscriber};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::registry::LookupSpan;

/// The tracing level for a `LIBCUDA_LOG_LEVEL` value.
pub fn level_for(log_level: u8) -> Level {
    match log_level {
        0..=1 => Level::ERROR,
        2 => Level::WARN,
        3 => Level::INFO,
        _ => Level::DEBUG,
    }
}

/// Installs the subscriber and the panic hook once. Called on the slow paths that may log (first
/// resolution of a function, initialisation), never on the per-call path.
pub fn ensure() {
    static INSTALLED: Once = Once::new();
    INSTALLED.call_once(|| {
        let level = level_for(crate::config::log_level_from_env());
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(level)
            .with_writer(std::io::stderr)
            .event_format(PidLine)
            .finish();
        // Fails only if this library's own global default was already set; then it stays.
        let _ = tracing::subscriber::set_global_default(subscriber);
        // Our std is linked into this library alone, so this hook sees only our panics; the
        // guard that catches them writes the one line, so the hook stays silent.
        std::panic::set_hook(Box::new(|_| {}));
    });
}

/// `[vgpu pid 1234] WARN message key=value`.
struct PidLine;

impl<S, N> FormatEvent<S, N> for PidLine
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(&self, ctx: &FmtContext<'_, S, N>, mut writer: Writer<'_>, event: &Event<'_>) -> fmt::Result {
        // getpid per event, so lines after fork carry the child's pid.
        let pid = std::process::id();
        write!(writer, "[vgpu pid {pid}] {} ", event.metadata().level())?;
        ctx.field_format().format_fields(writer.by_ref(), event)?;
        writeln!(writer)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_follow_hami_core() {
        assert_eq!(level_for(0), Level::ERROR);
        assert_eq!(level_for(1), Level::ERROR);
        assert_eq!(level_for(2), Level::WARN);
        assert_eq!(level_for(3), Level::INFO);
        assert_eq!(level_for(4), Level::DEBUG);
        assert_eq!(level_for(9), Level::DEBUG);
    }
}
