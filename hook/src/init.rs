//! `cuInit` and the process's configuration.

use std::sync::OnceLock;

use crate::config::{Config, ConfigError};
use crate::sys::cuda::{CUDA_ERROR_INVALID_VALUE, CUresult};

/// The configuration, read from the environment once per process (a forked child inherits it,
/// which is right: it inherits the environment too).
pub fn config() -> Result<&'static Config, &'static ConfigError> {
    static CONFIG: OnceLock<Result<Config, ConfigError>> = OnceLock::new();
    CONFIG.get_or_init(Config::from_env).as_ref()
}

/// `cuInit`: a malformed limit fails initialisation (fail closed) instead of running unlimited.
pub fn cu_init(_name: &'static str, call: impl FnOnce() -> CUresult, _flags: std::ffi::c_uint) -> CUresult {
    crate::log::ensure();
    if let Err(error) = config() {
        // Logged on every failing cuInit: each one is a failure the operator should see.
        tracing::error!("{error}; CUDA initialisation refused");
        return CUDA_ERROR_INVALID_VALUE;
    }
    call()
}
