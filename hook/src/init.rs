//! `cuInit`: the process's configuration is checked, then the session starts (the shared region
//! opened and this process attached).

use crate::sys::cuda::{CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_OPERATING_SYSTEM, CUDA_SUCCESS, CUresult};

/// `cuInit`: a malformed limit fails initialisation (fail closed) instead of running unlimited.
pub fn cu_init(call: impl FnOnce() -> CUresult) -> CUresult {
    crate::log::ensure();
    let config = match crate::session::config() {
        Ok(config) => config,
        Err(error) => {
            // Logged on every failing cuInit: each one is a failure the operator should see.
            tracing::error!("{error}; CUDA initialisation refused");
            return CUDA_ERROR_INVALID_VALUE;
        }
    };
    if let Some(value) = &config.disable_control_unread {
        static SAID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
        if !SAID.swap(true, std::sync::atomic::Ordering::Relaxed) {
            tracing::warn!(
                "CUDA_DISABLE_CONTROL={value:?} is neither true nor false; read as false, as HAMi's device plugin \
                 reads it: the limits apply"
            );
        }
    }
    if config.control_disabled {
        static SAID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
        if !SAID.swap(true, std::sync::atomic::Ordering::Relaxed) {
            tracing::info!("CUDA_DISABLE_CONTROL is set: no limit, no accounting, every call passes through");
        }
        return call();
    }
    let result = call();
    if result != CUDA_SUCCESS {
        return result;
    }
    if let Err(error) = crate::session::start(config) {
        tracing::error!("{error}; CUDA initialisation refused");
        return CUDA_ERROR_OPERATING_SYSTEM;
    }
    result
}
