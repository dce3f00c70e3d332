//! Turns for the tests that measure waits, times or shares, so that they do not share the CPUs
//! with each other: in one binary (a mutex) and across the binaries `scripts/run-tests.py` runs
//! side by side (a lock on a file of the target folder, which the kernel drops with a process that
//! dies holding it).

use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard, PoisonError};

/// The cargo target folder of the workspace this crate is built in.
fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
            manifest.ancestors().nth(2).unwrap_or(&manifest).join("target")
        })
}

/// Waits for this test's turn, which lasts until the returned [`Turn`] is dropped.
pub fn one_at_a_time() -> Turn {
    static TURN: Mutex<()> = Mutex::new(());
    let guard = TURN.lock().unwrap_or_else(PoisonError::into_inner);
    let target = target_dir();
    let file = std::fs::create_dir_all(&target)
        .and_then(|()| {
            std::fs::OpenOptions::new()
                .create(true)
                .truncate(false)
                .write(true)
                .open(target.join("test-turn.lock"))
        })
        .and_then(|file| file.lock().map(|()| file));
    // Without the file (a read-only target folder), the binaries' turns are not shared; the
    // binary's own still are.
    Turn {
        _file: file.ok(),
        _guard: guard,
    }
}

/// A test's turn ([`one_at_a_time`]); ends when dropped.
pub struct Turn {
    _file: Option<std::fs::File>,
    _guard: MutexGuard<'static, ()>,
}
