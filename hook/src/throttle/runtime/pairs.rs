//! The calling thread's open pair: a sample begun as the first launch of a pair
//! ([`crate::throttle::sensor`]), waiting for the thread's next launch on the same stream. Any
//! other next launch (another stream or device, one that is itself sampled, one on a stream that
//! ran empty or is being captured) gives it up, and so does the thread's exit. A pair a forked
//! child inherits belongs to its parent's limiter: it is forgotten, never touched (its sensor's
//! lock may have been held by another of the parent's threads at the fork).

use std::cell::RefCell;

use crate::sys::cuda::{CUresult, CUstream};
use crate::throttle::sensor::{self, InFlight};

use super::Runtime;

thread_local! {
    static OPEN_PAIR: RefCell<Option<OpenPair>> = const { RefCell::new(None) };
}

/// A pair's first launch, submitted; its events go back to their pool when it is dropped unended.
pub struct OpenPair {
    runtime: &'static Runtime,
    region_index: usize,
    launch: Option<Box<InFlight>>,
}

impl OpenPair {
    /// Whether the pair belongs to this process's limiter (not to a parent's before a fork).
    fn own(&self) -> bool {
        self.runtime.epoch == crate::session::epoch()
    }

    /// Ends the pair after its second launch, of `second_key`, returned `status`.
    pub fn close(mut self, second_key: u64, status: CUresult) {
        if let (Some(launch), Some(device)) = (self.launch.take(), self.runtime.devices.get(self.region_index)) {
            device.sensor.end_pair(*launch, second_key, status);
        }
    }
}

impl Drop for OpenPair {
    fn drop(&mut self) {
        let Some(launch) = self.launch.take() else {
            return;
        };
        match self.runtime.devices.get(self.region_index) {
            Some(device) if self.own() => device.sensor.abandon(*launch),
            // A parent's: its events stay out of the pool (a bounded leak, once per fork).
            _ => std::mem::forget(launch),
        }
    }
}

/// Keeps `launch`, a pair's first launch that the driver accepted, for the thread's next launch
/// (giving up any pair still open).
pub fn open(runtime: &'static Runtime, region_index: usize, launch: Box<InFlight>) {
    let pair = OpenPair {
        runtime,
        region_index,
        launch: Some(launch),
    };
    // During the thread's exit the slot is gone: the pair is dropped (given up) here.
    let _ = OPEN_PAIR.try_with(|slot| {
        if let Ok(mut slot) = slot.try_borrow_mut() {
            let previous = slot.replace(pair);
            drop(slot);
            drop(previous);
        }
    });
}

/// The thread's open pair if this launch, on `stream` of the device at `region_index`, is its
/// second one: `can_close` (the launch is measurable and not sampled itself), and the stream
/// still has work queued, so that no idle time falls between the two launches. Any open pair
/// that this launch cannot close is given up.
pub fn take_closable(region_index: usize, stream: CUstream, can_close: bool) -> Option<OpenPair> {
    let pair = OPEN_PAIR
        .try_with(|slot| slot.try_borrow_mut().ok().and_then(|mut slot| slot.take()))
        .ok()
        .flatten()?;
    let same =
        pair.own() && pair.region_index == region_index && pair.launch.as_ref().is_some_and(|l| l.stream() == stream);
    // The capture check first: a query of a stream being captured would invalidate its capture.
    (can_close && same && !crate::capture::capturing(stream) && sensor::stream_busy(stream)).then_some(pair)
}
