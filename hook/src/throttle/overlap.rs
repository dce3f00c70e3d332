//! Kernels of several streams that run side by side: the share of their bracketed time in which
//! the GPU is busy with them together.
//!
//! Brackets of overlapping streams, summed, exceed the time the container's kernels occupy the
//! GPU. So when a sample begins, an event (a *probe*) is recorded on each other recently active
//! stream of the device, completing when the work queued there has run: until then that stream
//! had work too. The bracket over the number of streams with work is the sample's share; over
//! recent samples it is the factor every charge of the device is scaled by. A sample opens a
//! window even alone (a burst after the limiter's pause begins with one stream, the others join as
//! members); one alone that cannot open a window counts in full.
//!
//! A stream waiting on another stream's event counts as having work; the limit is then looser by
//! at most that wait.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use super::estimates::QUICK_SMOOTHING;
use crate::sys::cuda::CUstream;

/// Streams of a device remembered as recently active.
pub const RECENT_STREAMS: usize = 8;
/// A stream that launched within this long is active: another stream's samples probe it.
pub const ACTIVE_NS: u64 = 10_000_000;
/// How long after its sample began a window brackets the other streams' launches: longer than the
/// sample's kernel takes to come up in its queue and run, for the kernels the limiter sees.
pub const WINDOW_NS: u64 = 2_000_000;
/// A window opens at most this often: its members cost two event records each.
pub const WINDOW_SPACING_NS: u64 = 10_000_000;
/// The most launches a window brackets.
pub const MAX_MEMBERS: usize = 16;
/// The lowest factor: at most this many streams' kernels are taken to share the GPU at once.
pub const MIN_FACTOR: f64 = 1.0 / 16.0;

/// The streams of a device that launched recently, and when (lock-free: launches of any thread
/// update it; a lost update only makes a stream look idle a little early).
#[derive(Default)]
pub struct RecentStreams {
    streams: [AtomicUsize; RECENT_STREAMS],
    last_ns: [AtomicU64; RECENT_STREAMS],
}

impl RecentStreams {
    /// Notes a launch on `stream` at `now`, replacing the least recently active stream when it is
    /// new. Written at most once a millisecond per stream.
    pub fn note(&self, stream: CUstream, now: u64) {
        let handle = stream as usize;
        let mut oldest = 0;
        for (index, slot) in self.streams.iter().enumerate() {
            if slot.load(Ordering::Relaxed) == handle {
                let last = &self.last_ns[index];
                if now.saturating_sub(last.load(Ordering::Relaxed)) >= 1_000_000 {
                    last.store(now, Ordering::Relaxed);
                }
                return;
            }
            if self.last_ns[index].load(Ordering::Relaxed) < self.last_ns[oldest].load(Ordering::Relaxed) {
                oldest = index;
            }
        }
        self.streams[oldest].store(handle, Ordering::Relaxed);
        self.last_ns[oldest].store(now, Ordering::Relaxed);
    }

    /// Forgets `stream` (it is being destroyed).
    pub fn forget(&self, stream: CUstream) {
        let handle = stream as usize;
        for (index, slot) in self.streams.iter().enumerate() {
            if slot.load(Ordering::Relaxed) == handle {
                self.last_ns[index].store(0, Ordering::Relaxed);
            }
        }
    }

    /// The streams other than `stream` active at `now`.
    pub fn others(&self, stream: CUstream, now: u64) -> impl Iterator<Item = CUstream> + '_ {
        let handle = stream as usize;
        (0..RECENT_STREAMS).filter_map(move |index| {
            let other = self.streams[index].load(Ordering::Relaxed);
            let last = self.last_ns[index].load(Ordering::Relaxed);
            (other != handle && last != 0 && now.saturating_sub(last) < ACTIVE_NS).then_some(other as CUstream)
        })
    }
}

/// The default streams, which no probe is recorded on: the legacy stream (null or
/// `CU_STREAM_LEGACY`) waits for every blocking stream, and `CU_STREAM_PER_THREAD` names the
/// calling thread's own.
pub fn is_default_stream(stream: CUstream) -> bool {
    matches!(stream as usize, 0..=2)
}

/// What a sample does about the overlap windows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WindowChoice {
    /// It leads a new window.
    Open,
    /// It counts in full: no other stream was active, and no window could open.
    Alone,
    /// It says nothing: other streams were active and a window was open or opened too lately.
    Unseen,
}

/// The rule of a sample taken at `now`, when the last window opened at `opened` and takes members
/// until `until`: it opens a window unless one is open or opened less than [`WINDOW_SPACING_NS`]
/// ago, also with no other stream active (a burst after the limiter's pause begins with one
/// stream, and the others join during its bracket); otherwise it counts in full when no other
/// stream was active (`others_active`), and not at all when some were.
pub fn window_choice(others_active: bool, now: u64, opened: u64, until: u64) -> WindowChoice {
    let can_open = now.saturating_sub(opened) >= WINDOW_SPACING_NS && now >= until;
    match (can_open, others_active) {
        (true, _) => WindowChoice::Open,
        (false, false) => WindowChoice::Alone,
        (false, true) => WindowChoice::Unseen,
    }
}

/// The union and the sum of brackets, each given as its start and end (ns) on one timeline.
pub fn union_and_sum(spans: &mut [(i64, i64)]) -> (u64, u64) {
    spans.sort_unstable();
    let (mut union, mut sum) = (0u64, 0u64);
    let mut covered: Option<(i64, i64)> = None;
    for &(start, end) in spans.iter() {
        let end = end.max(start);
        sum = sum.saturating_add(end.abs_diff(start));
        covered = match covered {
            Some((from, to)) if start <= to => Some((from, to.max(end))),
            Some((from, to)) => {
                union = union.saturating_add(to.abs_diff(from));
                Some((start, end))
            }
            None => Some((start, end)),
        };
    }
    if let Some((from, to)) = covered {
        union = union.saturating_add(to.abs_diff(from));
    }
    (union, sum)
}

/// How many of the container's streams had work during a bracket of `reading` ns: 1 for its own,
/// plus for each other stream the part of the bracket its spans cover (`(stream, (from, to))`, in
/// ns from the bracket's start; clipped to the bracket, overlapping spans of a stream counted
/// once).
pub fn streams_busy(reading: u64, spans: &mut [(usize, (i64, i64))]) -> f64 {
    let reading = reading.max(1) as i64;
    for (_, span) in spans.iter_mut() {
        *span = (span.0.clamp(0, reading), span.1.clamp(0, reading));
    }
    spans.sort_unstable();
    let mut others = 0u64;
    for group in spans.chunk_by(|a, b| a.0 == b.0) {
        let mut intervals: Vec<(i64, i64)> = group.iter().map(|&(_, span)| span).collect();
        others += union_and_sum(&mut intervals).0;
    }
    1.0 + others as f64 / reading as f64
}

/// The factor over recent samples: the time they occupied the GPU together over their brackets,
/// both averaged over the first [`QUICK_SMOOTHING`] samples, then decaying.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Window {
    union: f64,
    sum: f64,
    samples: u32,
}

impl Window {
    /// Adds a sample's share of the time the streams occupied the GPU together, and its bracket
    /// (ns).
    pub fn add(&mut self, union: u64, sum: u64) {
        if sum == 0 {
            return;
        }
        // The plain mean of the first samples, then decaying: a job's first second is charged
        // from its first samples, and a steady job is not moved much by one sample.
        self.samples = self.samples.saturating_add(1);
        let keep = 1.0 - 1.0 / (QUICK_SMOOTHING as f64).min(f64::from(self.samples));
        self.union = self.union * keep + union.min(sum) as f64;
        self.sum = self.sum * keep + sum as f64;
    }

    /// The factor charges are scaled by: 1 before any sample.
    pub fn factor(&self) -> f64 {
        if self.sum <= 0.0 {
            return 1.0;
        }
        (self.union / self.sum).clamp(MIN_FACTOR, 1.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlapping_brackets_count_once_and_separate_ones_in_full() {
        // Four brackets of 200 us side by side, one of them late by 100 us.
        let mut spans = [(0, 200), (0, 200), (10, 210), (100, 300)];
        assert_eq!(union_and_sum(&mut spans), (300, 800));
        // One after another: no overlap.
        let mut spans = [(400, 500), (0, 100), (200, 300)];
        assert_eq!(union_and_sum(&mut spans), (300, 300));
        // Before the reference (negative offsets) and reversed ends are handled.
        let mut spans = [(-50, 50), (20, 10), (40, 60)];
        assert_eq!(union_and_sum(&mut spans), (110, 120));
        assert_eq!(union_and_sum(&mut []), (0, 0));
    }

    #[test]
    fn streams_busy_counts_each_other_stream_once_within_the_bracket() {
        // A bracket of 100 ns; stream 7 busy for 0-50 twice over and 40-60 (60 of it), stream 9
        // from before the bracket to after it (all 100).
        let mut spans = [(7, (0, 50)), (9, (-20, 130)), (7, (0, 50)), (7, (40, 60))];
        assert!((streams_busy(100, &mut spans) - 2.6).abs() < 1e-9);
        assert_eq!(streams_busy(100, &mut []), 1.0, "alone");
        assert_eq!(
            streams_busy(0, &mut [(3, (0, 10))]),
            2.0,
            "an empty bracket reads as 1 ns"
        );
    }

    #[test]
    fn a_sample_opens_a_window_when_it_can_alone_or_not() {
        let (opened, until) = (1_000_000_000, 1_000_000_000 + WINDOW_NS);
        let later = opened + WINDOW_SPACING_NS;
        for (others_active, now, expected) in [
            (true, later, WindowChoice::Open),
            (false, later, WindowChoice::Open),
            (true, until, WindowChoice::Unseen), // too soon
            (false, until, WindowChoice::Alone),
            (true, opened + 1, WindowChoice::Unseen), // open
        ] {
            assert_eq!(
                window_choice(others_active, now, opened, until),
                expected,
                "{others_active} at {now}"
            );
        }
    }

    #[test]
    fn the_factor_follows_the_groups_and_stays_bounded() {
        let mut window = Window::default();
        assert_eq!(window.factor(), 1.0);
        for _ in 0..100 {
            window.add(250, 1000);
        }
        assert!((window.factor() - 0.25).abs() < 1e-9);
        // Back to one stream: samples with no other stream take the factor back to 1 within a few
        // times the smoothing.
        for _ in 0..(4 * QUICK_SMOOTHING) {
            window.add(1000, 1000);
        }
        assert!(window.factor() > 0.95, "{}", window.factor());
        let mut window = Window::default();
        window.add(0, 1_000_000);
        assert_eq!(window.factor(), MIN_FACTOR);
        window.add(5, 0);
        assert_eq!(window.factor(), MIN_FACTOR, "an empty bracket says nothing");
        let mut window = Window::default();
        window.add(u64::MAX, 10);
        assert_eq!(window.factor(), 1.0, "a union above the sum counts as the sum");
    }

    #[test]
    fn recent_streams_are_the_active_others() {
        let recent = RecentStreams::default();
        let stream = |n: usize| n as CUstream;
        recent.note(stream(1), 1_000_000_000);
        recent.note(stream(2), 1_000_000_000);
        recent.note(stream(3), 1_000_000_000 - ACTIVE_NS);
        let others: Vec<_> = recent.others(stream(1), 1_000_000_001).collect();
        assert_eq!(others, vec![stream(2)]);
        // A ninth stream replaces the least recently active one.
        for n in 10..18 {
            recent.note(stream(n), 2_000_000_000 + n as u64);
        }
        assert_eq!(recent.others(stream(0), 2_000_000_100).count(), RECENT_STREAMS);
        assert_eq!(recent.others(stream(10), 2_000_000_100).count(), RECENT_STREAMS - 1);
        recent.forget(stream(11));
        assert_eq!(recent.others(stream(10), 2_000_000_100).count(), RECENT_STREAMS - 2);
        assert!(is_default_stream(stream(0)) && is_default_stream(stream(2)) && !is_default_stream(stream(3)));
    }
}
