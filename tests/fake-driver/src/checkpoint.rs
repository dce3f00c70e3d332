//! The driver's checkpoint API (`cuCheckpointProcess*`), called by one process on another by pid,
//! as NVIDIA's cuda-checkpoint and `vgpu-smi suspend --release` call it.
//!
//! The states live in the truth (`P_CHECKPOINT` of the target's slot), so any process can drive
//! them: `Lock` (RUNNING -> LOCKED), `Checkpoint` (LOCKED -> CHECKPOINTED: the target's memory
//! leaves its devices), `Restore` (CHECKPOINTED -> LOCKED, when every device has room again;
//! `CUDA_ERROR_OUT_OF_MEMORY` and no change otherwise), `Unlock` (LOCKED -> RUNNING). A call in
//! the wrong state is `CUDA_ERROR_ILLEGAL_STATE`; a pid with no live slot in the truth (not a CUDA
//! process here) is `CUDA_ERROR_INVALID_VALUE`. The target's own driver calls wait while it is
//! not RUNNING, as the real driver's locks make them. `FAKE_CUDA_LOCK_REFUSED=1` in the target
//! makes every lock of it time out (`CUDA_ERROR_NOT_READY`): a process whose calls never drain.

use std::ffi::c_int;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use crate::cuda::*;
use crate::ffi::{CuResult, cu, put};
use crate::state;
use crate::truth::{CheckpointState, Truth};

/// This process's truth slot plus one (0: none yet).
static OWN_SLOT: AtomicUsize = AtomicUsize::new(0);

/// How often a held process looks at its state again.
const POLL: Duration = Duration::from_millis(2);

pub fn note_own_slot(slot: usize) {
    OWN_SLOT.store(slot + 1, Ordering::Release);
}

/// Waits while another process holds this one (LOCKED or CHECKPOINTED).
pub fn wait_while_held() {
    let slot = OWN_SLOT.load(Ordering::Acquire);
    if slot == 0 {
        return;
    }
    let Ok(truth) = state::truth() else { return };
    while truth.checkpoint_state(slot - 1) != CheckpointState::Running {
        std::thread::sleep(POLL);
    }
}

/// The truth and the live slot of `pid`.
fn target(pid: c_int) -> CuResult<(&'static Truth, usize)> {
    let truth = state::truth().map_err(|_| CUDA_ERROR_NOT_INITIALIZED)?;
    let pid = u32::try_from(pid).map_err(|_| CUDA_ERROR_INVALID_VALUE)?;
    let slot = truth.slot_of(pid).ok_or(CUDA_ERROR_INVALID_VALUE)?;
    Ok((truth, slot))
}

fn lock_refused(pid: c_int) -> bool {
    std::fs::read(format!("/proc/{pid}/environ"))
        .map(|environ| {
            environ
                .split(|byte| *byte == 0)
                .any(|entry| entry == b"FAKE_CUDA_LOCK_REFUSED=1")
        })
        .unwrap_or(false)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCheckpointProcessLock(pid: c_int, args: *mut CUcheckpointLockArgs) -> CUresult {
    cu(|| {
        let (truth, slot) = target(pid)?;
        // SAFETY: null or the caller's arguments.
        let timeout_ms = unsafe { args.as_ref() }.map_or(0, |args| args.timeoutMs);
        if lock_refused(pid) {
            std::thread::sleep(Duration::from_millis(u64::from(timeout_ms.max(1))));
            return Err(CUDA_ERROR_NOT_READY);
        }
        if truth.change_checkpoint_state(slot, CheckpointState::Running, CheckpointState::Locked) {
            Ok(())
        } else {
            Err(CUDA_ERROR_ILLEGAL_STATE)
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCheckpointProcessCheckpoint(pid: c_int, _args: *mut CUcheckpointCheckpointArgs) -> CUresult {
    cu(|| {
        let (truth, slot) = target(pid)?;
        if truth.checkpoint(slot) {
            Ok(())
        } else {
            Err(CUDA_ERROR_ILLEGAL_STATE)
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCheckpointProcessRestore(pid: c_int, _args: *mut CUcheckpointRestoreArgs) -> CUresult {
    cu(|| {
        let (truth, slot) = target(pid)?;
        if truth.checkpoint_state(slot) != CheckpointState::Checkpointed {
            return Err(CUDA_ERROR_ILLEGAL_STATE);
        }
        truth.restore(slot).map_err(|_| CUDA_ERROR_OUT_OF_MEMORY)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCheckpointProcessUnlock(pid: c_int, _args: *mut CUcheckpointUnlockArgs) -> CUresult {
    cu(|| {
        let (truth, slot) = target(pid)?;
        if truth.change_checkpoint_state(slot, CheckpointState::Locked, CheckpointState::Running) {
            Ok(())
        } else {
            Err(CUDA_ERROR_ILLEGAL_STATE)
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCheckpointProcessGetState(pid: c_int, state: *mut CUprocessState) -> CUresult {
    cu(|| {
        if state.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let (truth, slot) = target(pid)?;
        let value = match truth.checkpoint_state(slot) {
            CheckpointState::Running => CU_PROCESS_STATE_RUNNING,
            CheckpointState::Locked => CU_PROCESS_STATE_LOCKED,
            CheckpointState::Checkpointed => CU_PROCESS_STATE_CHECKPOINTED,
        };
        // SAFETY: out-pointer from the caller, checked non-null.
        unsafe { put(state, value) }
    })
}
