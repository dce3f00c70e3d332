//! `cuInit` and the process's configuration.

use std::sync::OnceLock;

use crate::sys::cuda::{CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_OPERATING_SYSTEM, CUDA_SUCCESS, CUresult};
use vgpu_config::{Config, ConfigError};

/// The configuration, read from the environment once per process (a forked child inherits it,
/// which is right: it inherits the environment too).
pub fn config() -> Result<&'static Config, &'static ConfigError> {
    static CONFIG: OnceLock<Result<Config, ConfigError>> = OnceLock::new();
    CONFIG.get_or_init(Config::from_env).as_ref()
}

/// `cuInit`: a malformed limit fails initialisation (fail closed) instead of running unlimited.
pub fn cu_init(call: impl FnOnce() -> CUresult) -> CUresult {
    crate::log::ensure();
    let config = match config() {
        Ok(config) => config,
        Err(error) => {
            // Logged on every failing cuInit: each one is a failure the operator should see.
            tracing::error!("{error}; CUDA initialisation refused");
            return CUDA_ERROR_INVALID_VALUE;
        }
    };
    let result = call();
    if result != CUDA_SUCCESS {
        return result;
    }
    if let Err(error) = crate::memory::start(config) {
        tracing::error!("{error}; CUDA initialisation refused");
        return CUDA_ERROR_OPERATING_SYSTEM;
    }
    result
}
