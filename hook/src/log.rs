//! Logging: `tracing` events to stderr, one line each, prefixed with the pid.
//!
//! `LIBCUDA_LOG_LEVEL` (HAMi-core's variable) sets the level: 0 and 1 errors only, 2 (the default)
//! adds warnings, 3 info, 4 debug. Nothing is printed on stdout, and nothing at the default level
//! unless something is wrong, so tools that parse `nvidia-smi` output keep working.
//!
//! Lines are rate-limited per call site ([`RateLimit`]): an application that retries a failing
//! call in a tight loop must not fill a disk with identical lines (a `cuInit` refused for a
//! malformed limit, called in a loop, wrote 380 MB of stderr a minute).

use std::cell::Cell;
use std::fmt;
use std::sync::Once;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Instant;

use tracing::level_filters::LevelFilter;
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::layer::{Context, Layer, SubscriberExt};
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
        let level = level_for(vgpu_config::log_level_from_env());
        let lines = tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .event_format(PidLine);
        // Outermost first: the level filter (its hint keeps disabled levels a static check at the
        // call site), then the rate limit, which so sees only lines that would be written.
        let subscriber = tracing_subscriber::registry()
            .with(lines)
            .with(RateLimit)
            .with(LevelFilter::from_level(level));
        // Fails only if this library's own global default was already set; then it stays.
        let _ = tracing::subscriber::set_global_default(subscriber);
        // Our std is linked into this library alone, so this hook sees only our panics; the
        // guard that catches them writes the one line, so the hook stays silent.
        std::panic::set_hook(Box::new(|_| {}));
    });
}

/// `[vgpu pid 1234] WARN message key=value`, with the rate limit's note at the end when it has one.
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
        match take_note() {
            Note::None => {}
            Note::LastOfBurst => write!(
                writer,
                " (repeats of this line are suppressed from now on: at most one every {} s, with a count)",
                INTERVAL_MS / 1000
            )?,
            Note::Suppressed(0) => {}
            Note::Suppressed(count) => write!(writer, " ({count} similar lines suppressed since the last one)")?,
        }
        writeln!(writer)
    }
}

// ------------------------------------------------------------------ rate limit

/// The target of lines their call site writes at most once per subject (one per function the
/// library lacks, say): bounded by construction, so the rate limit lets every one through.
pub const ONCE_PER_SUBJECT: &str = "vgpu::once";

/// Lines written from one call site before the limit applies.
const BURST: u64 = 5;
/// After the burst, at most one line per call site in this many milliseconds.
const INTERVAL_MS: u64 = 10_000;
/// Call sites tracked apart; the library has a few dozen that can write at the default level,
/// and any beyond this share the last entry (so they are limited together, never unlimited).
const SITES: usize = 64;

/// What the formatter appends to the line the limit let through.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Note {
    None,
    /// The last line of the burst: say that repeats are suppressed from now on.
    LastOfBurst,
    /// The first line after suppression: how many were suppressed.
    Suppressed(u64),
}

thread_local! {
    // From the limit's decision to the formatter, which runs next on the same thread.
    static NOTE: Cell<Note> = const { Cell::new(Note::None) };
}

fn set_note(note: Note) {
    // Fails only during thread teardown; the line then goes without its note.
    let _ = NOTE.try_with(|cell| cell.set(note));
}

fn take_note() -> Note {
    NOTE.try_with(|cell| cell.replace(Note::None)).unwrap_or(Note::None)
}

/// The layer that drops repeated lines before they are formatted or written: only atomics, no
/// lock and no allocation, so a tight loop of failing calls stays cheap too.
struct RateLimit;

impl<S: Subscriber> Layer<S> for RateLimit {
    fn event_enabled(&self, event: &Event<'_>, _ctx: Context<'_, S>) -> bool {
        // Debug output is asked for explicitly (level 4), to see every call; lines their call
        // site writes once per subject (once per function) are bounded already.
        if *event.metadata().level() == Level::DEBUG || event.metadata().target() == ONCE_PER_SUBJECT {
            return true;
        }
        // A call site's metadata is a static of its own: its address names the site.
        let site = std::ptr::from_ref(event.metadata()).addr();
        match LIMITER.decide(site, now_ms()) {
            Some(note) => {
                set_note(note);
                true
            }
            None => false,
        }
    }
}

static LIMITER: Limiter = Limiter::new();

/// Milliseconds since the first line was considered.
fn now_ms() -> u64 {
    static START: OnceLock<Instant> = OnceLock::new();
    let start = START.get_or_init(Instant::now);
    u64::try_from(start.elapsed().as_millis()).unwrap_or(u64::MAX)
}

/// Counters of one call site.
struct Site {
    /// The site's key (0: entry free).
    key: AtomicUsize,
    /// Lines from the site so far, written or not.
    seen: AtomicU64,
    /// Lines suppressed since the last written one.
    suppressed: AtomicU64,
    /// When the last line was written, in [`now_ms`] milliseconds.
    last_ms: AtomicU64,
}

impl Site {
    const fn new() -> Site {
        Site {
            key: AtomicUsize::new(0),
            seen: AtomicU64::new(0),
            suppressed: AtomicU64::new(0),
            last_ms: AtomicU64::new(0),
        }
    }
}

struct Limiter {
    sites: [Site; SITES],
}

impl Limiter {
    const fn new() -> Limiter {
        Limiter {
            sites: [const { Site::new() }; SITES],
        }
    }

    /// The entry of `key`, claimed on first use (open addressing; entries are never freed).
    fn site(&self, key: usize) -> &Site {
        // Fibonacci hashing spreads the addresses, which share their low bits.
        let start = (key as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 58;
        for offset in 0..SITES {
            let site = &self.sites[(start as usize + offset) % SITES];
            match site.key.compare_exchange(0, key, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return site,
                Err(existing) if existing == key => return site,
                Err(_) => {}
            }
        }
        &self.sites[SITES - 1]
    }

    /// Whether a line from `key` at `now` is written, and with which note.
    fn decide(&self, key: usize, now: u64) -> Option<Note> {
        let site = self.site(key);
        let seen = site.seen.fetch_add(1, Ordering::Relaxed);
        if seen < BURST {
            site.last_ms.fetch_max(now, Ordering::Relaxed);
            return Some(if seen + 1 == BURST {
                Note::LastOfBurst
            } else {
                Note::None
            });
        }
        let last = site.last_ms.load(Ordering::Relaxed);
        // One thread wins the interval's line; the others count as suppressed.
        if now.saturating_sub(last) >= INTERVAL_MS
            && site
                .last_ms
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            return Some(Note::Suppressed(site.suppressed.swap(0, Ordering::Relaxed)));
        }
        site.suppressed.fetch_add(1, Ordering::Relaxed);
        None
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

    #[test]
    fn a_site_writes_its_burst_then_one_line_per_interval_with_a_count() {
        let limiter = Limiter::new();
        let site = 0x1000;
        let mut now = 0;
        let mut written = Vec::new();
        for _ in 0..1000 {
            if let Some(note) = limiter.decide(site, now) {
                written.push((now, note));
            }
            now += 100;
        }
        // 100 s of one line every 100 ms: the burst at 0..400 ms, then one line per 10 s.
        let expected: Vec<(u64, Note)> = [
            (0, Note::None),
            (100, Note::None),
            (200, Note::None),
            (300, Note::None),
            (400, Note::LastOfBurst),
        ]
        .into_iter()
        .chain((1..=9).map(|n| (400 + n * INTERVAL_MS, Note::Suppressed(99))))
        .collect();
        assert_eq!(written, expected);
        // Every line is either written or counted.
        let counted: u64 = written
            .iter()
            .map(|(_, note)| match note {
                Note::Suppressed(count) => count + 1,
                _ => 1,
            })
            .sum::<u64>()
            + limiter.site(site).suppressed.load(Ordering::Relaxed);
        assert_eq!(counted, 1000);
    }

    #[test]
    fn sites_are_limited_apart_and_a_quiet_site_is_not_limited() {
        let limiter = Limiter::new();
        for _ in 0..100 {
            limiter.decide(0x1000, 0);
        }
        assert_eq!(limiter.decide(0x1000, 1), None);
        assert_eq!(limiter.decide(0x2000, 1), Some(Note::None));
        // A line every minute is never suppressed.
        let quiet = 0x3000;
        for minute in 0..20 {
            assert!(limiter.decide(quiet, minute * 60_000).is_some(), "minute {minute}");
        }
    }

    #[test]
    fn sites_beyond_the_table_share_its_last_entry() {
        let limiter = Limiter::new();
        for key in 1..=SITES {
            for _ in 0..BURST {
                assert!(limiter.decide(key * 64, 0).is_some(), "site {key}");
            }
        }
        // The table is full: a new site shares the last entry, whose burst is spent, so it is
        // limited (never unlimited).
        let newcomer = (SITES + 1) * 64;
        assert!(std::ptr::eq(limiter.site(newcomer), &limiter.sites[SITES - 1]));
        assert_eq!(limiter.decide(newcomer, 0), None);
    }
}
