//! What a handler's parameter receives, and how the generated `args(..)` attribute names it: the
//! one definition that `vgpu-codegen` (which binds a handler's parameters to a function's and
//! writes the attribute) and `hook-macros` (which reads it and passes the values) share.
//!
//! In the attribute, an argument is `call`, `entry_point`, a parameter's name, or a constant the
//! generator states, `per_thread = true` or `per_thread = false`.

use std::fmt;

/// The closure that calls the real function with the application's arguments.
pub const CALL: &str = "call";
/// The function's name.
pub const ENTRY_POINT: &str = "entry_point";
/// Whether the function is a per-thread-default-stream variant (`_ptsz`, `_ptds`): a constant.
pub const PER_THREAD: &str = "per_thread";

/// What a handler parameter receives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Arg {
    /// The closure that calls the real function.
    Call,
    /// The entry point's name.
    EntryPoint,
    /// The function's parameter of this name.
    Param(String),
    /// Whether the function is a per-thread-default-stream variant.
    PerThread(bool),
}

impl Arg {
    /// The argument an attribute names: `name`, with `value` when it was `name = value`.
    pub fn from_attribute(name: &str, value: Option<bool>) -> Result<Arg, String> {
        match (name, value) {
            (CALL, None) => Ok(Arg::Call),
            (ENTRY_POINT, None) => Ok(Arg::EntryPoint),
            (PER_THREAD, Some(value)) => Ok(Arg::PerThread(value)),
            (PER_THREAD, None) => Err(format!(
                "`{PER_THREAD}` is a constant the generator states: `{PER_THREAD} = true`"
            )),
            (name, Some(_)) => Err(format!(
                "`{name}` takes no value: only `{PER_THREAD}` is a stated constant"
            )),
            (name, None) => Ok(Arg::Param(name.to_string())),
        }
    }

    /// The constant the generator states, if this is one.
    pub fn constant(&self) -> Option<bool> {
        match self {
            Arg::PerThread(value) => Some(*value),
            _ => None,
        }
    }
}

impl fmt::Display for Arg {
    /// As the attribute names it.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Arg::Call => f.write_str(CALL),
            Arg::EntryPoint => f.write_str(ENTRY_POINT),
            Arg::Param(name) => f.write_str(name),
            Arg::PerThread(value) => write!(f, "{PER_THREAD} = {value}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_argument_reads_back_as_written() {
        for arg in [
            Arg::Call,
            Arg::EntryPoint,
            Arg::Param("h_stream".into()),
            Arg::PerThread(true),
            Arg::PerThread(false),
        ] {
            let text = arg.to_string();
            let (name, value) = match text.split_once(" = ") {
                Some((name, value)) => (name, Some(value == "true")),
                None => (text.as_str(), None),
            };
            assert_eq!(Arg::from_attribute(name, value), Ok(arg));
        }
    }

    #[test]
    fn a_constant_must_be_stated_and_only_per_thread_is_one() {
        assert!(Arg::from_attribute(PER_THREAD, None).is_err());
        assert!(Arg::from_attribute("dptr", Some(true)).is_err());
        assert!(Arg::from_attribute(CALL, Some(true)).is_err());
    }
}
