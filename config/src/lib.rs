//! Configuration read from the environment when the library loads: memory and compute limits per
//! device, where the shared region lives, the task priority, the utilisation policy, what the
//! compute limit is a share of, and the log level.
//!
//! The variable names and meanings are HAMi-core's, so that this library is a drop-in replacement,
//! but parsing is strict: HAMi-core turns a malformed limit into "no limit" (or into a surprising
//! value: `1gb` is 1 byte there), which silently removes the isolation a container was promised.
//! Here a malformed limit is a [`ConfigError`] and the caller fails closed.
//!
//! A crate of its own, so that everything reading these variables parses them the same way: the
//! hook (a cdylib, which nothing can link), the fuzz targets, and any other vgpu component.

use std::ffi::{OsStr, OsString};
use std::fmt;
use std::path::PathBuf;

/// Devices the shared region has room for (HAMi-core's 16); per-device variables go from `_0`
/// to `_15`.
pub use vgpu_region::MAX_DEVICES;

/// HAMi-core's default location of the shared region; HAMi's monitor looks for it there.
pub const DEFAULT_SHARED_CACHE: &str = "/tmp/cudevshr.cache";

const MEMORY_LIMIT_VAR: &str = "CUDA_DEVICE_MEMORY_LIMIT";
const SM_LIMIT_VAR: &str = "CUDA_DEVICE_SM_LIMIT";
const SHARED_CACHE_VAR: &str = "CUDA_DEVICE_MEMORY_SHARED_CACHE";
const TASK_PRIORITY_VAR: &str = "CUDA_TASK_PRIORITY";
const SHARED_CACHE_ANY_OWNER_VAR: &str = "VGPU_SHARED_CACHE_ANY_OWNER";
const UTILIZATION_POLICY_VAR: &str = "GPU_CORE_UTILIZATION_POLICY";
const COMPUTE_PROFILE_VAR: &str = "VGPU_COMPUTE_PROFILE";
const LOG_LEVEL_VAR: &str = "LIBCUDA_LOG_LEVEL";
const DISABLE_CONTROL_VAR: &str = "CUDA_DISABLE_CONTROL";
const OVERSUBSCRIBE_VAR: &str = "CUDA_OVERSUBSCRIBE";
const IDLE_RELEASE_VAR: &str = "CUDA_IDLE_RELEASE";
const PRIORITY_RELEASE_VAR: &str = "CUDA_PRIORITY_RELEASE";

const DEFAULT_TASK_PRIORITY: i32 = 1;
const DEFAULT_LOG_LEVEL: u8 = 2;
const MAX_LOG_LEVEL: u8 = 4;

/// Appended to every size error so the user sees what would have been accepted.
const SIZE_EXAMPLES: &str = "(expected a size such as 1g, 1024m, 512MiB or 1073741824)";
/// Appended to every percent error, for the same reason.
const PERCENT_EXAMPLES: &str = "(expected a whole number of percent from 0 to 100, such as 50)";

/// How the compute limit is applied (`GPU_CORE_UTILIZATION_POLICY`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UtilizationPolicy {
    /// `default` (or unset, or empty): limit only while the region's `utilization_switch`
    /// (written by HAMi's monitor) says the GPU is shared.
    FollowRegion,
    /// `force`: always limit.
    Force,
    /// `disable`: never limit.
    Disable,
}

/// The values HAMi sets (`default`, `force`, `disable`), in any case (HAMi-core compares with
/// `FORCE`/`force` and `DISABLE`/`disable`). HAMi-core takes anything else as the default; here
/// it is an error, since `forced` or `disabled` would otherwise silently not do what was asked.
fn parse_policy(text: &str) -> Result<UtilizationPolicy, String> {
    [
        ("default", UtilizationPolicy::FollowRegion),
        ("force", UtilizationPolicy::Force),
        ("disable", UtilizationPolicy::Disable),
    ]
    .into_iter()
    .find(|(name, _)| text.eq_ignore_ascii_case(name))
    .map(|(_, policy)| policy)
    .ok_or_else(|| "unknown policy (expected force, disable or default)".to_owned())
}

/// What the compute limit's share is of (`VGPU_COMPUTE_PROFILE`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ComputeProfile {
    /// `auto` (or unset, or empty): on a board with a profile (its power model, found by NVML's
    /// name), a share of the work the GPU does unlimited, its boost clock compensated; on any
    /// other GPU, a share of its time.
    Auto,
    /// `off`: a share of the GPU's time on every board.
    Off,
}

/// `auto` or `off`, in any case (as the policy above). Anything else is an error: a misspelt
/// `off` would otherwise leave the power model on.
fn parse_compute_profile(text: &str) -> Result<ComputeProfile, String> {
    [("auto", ComputeProfile::Auto), ("off", ComputeProfile::Off)]
        .into_iter()
        .find(|(name, _)| text.eq_ignore_ascii_case(name))
        .map(|(_, profile)| profile)
        .ok_or_else(|| "unknown value (expected auto or off)".to_owned())
}

/// Everything the hook needs from the environment, parsed once.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Config {
    /// Memory limit in bytes per CUDA device index (as the application sees devices); None = no limit.
    pub memory_limit: [Option<u64>; MAX_DEVICES],
    /// Compute share in percent per device, 1..=99; None = unlimited (unset, 0, or 100 all mean
    /// None).
    pub sm_limit: [Option<u8>; MAX_DEVICES],
    /// Path of the shared region file (`CUDA_DEVICE_MEMORY_SHARED_CACHE`).
    pub shared_cache: PathBuf,
    /// `VGPU_SHARED_CACHE_ANY_OWNER=1`: a region file owned by any user is used (when it is a
    /// valid region); by default only this process's user's and root's are.
    pub shared_cache_any_owner: bool,
    /// Written into the region's `priority` by its creator (`CUDA_TASK_PRIORITY`).
    pub task_priority: i32,
    /// `GPU_CORE_UTILIZATION_POLICY`.
    pub utilization_policy: UtilizationPolicy,
    /// `VGPU_COMPUTE_PROFILE`.
    pub compute_profile: ComputeProfile,
    /// `LIBCUDA_LOG_LEVEL`, 0..=4.
    pub log_level: u8,
    /// `CUDA_DISABLE_CONTROL=true` (HAMi's device plugin sets it for a container whose limits
    /// it does not enforce): the library passes every call through, with no region, no limit
    /// and no accounting; the other variables are then not read.
    pub control_disabled: bool,
    /// A `CUDA_DISABLE_CONTROL` value that is neither true nor false: HAMi's device plugin reads
    /// such a value as false (it mounts the library), so the limits apply; `cuInit` says so once.
    pub disable_control_unread: Option<String>,
    /// `CUDA_OVERSUBSCRIBE=true` (HAMi's device plugin sets it when the operator sells more memory
    /// than the card has): an allocation the limit allows but the device cannot back is served
    /// from host memory the GPU reaches (docs/memory-accounting.md, "Elastic memory").
    pub oversubscribe: bool,
    /// `CUDA_IDLE_RELEASE`: after this long without a launch, the process has its GPU memory
    /// checkpointed to host memory (`vgpu-smi suspend --release` on itself) until its next launch,
    /// copy or allocation.
    pub idle_release: Option<std::time::Duration>,
    /// `CUDA_PRIORITY_RELEASE=true`: while HAMi's monitor blocks the container by priority
    /// (`recent_kernel` -1), the process's GPU memory is released the same way.
    pub priority_release: bool,
}

impl Default for Config {
    /// The configuration of an empty environment: no limits, HAMi-core's defaults elsewhere.
    fn default() -> Self {
        Self {
            memory_limit: [None; MAX_DEVICES],
            sm_limit: [None; MAX_DEVICES],
            shared_cache: PathBuf::from(DEFAULT_SHARED_CACHE),
            shared_cache_any_owner: false,
            task_priority: DEFAULT_TASK_PRIORITY,
            utilization_policy: UtilizationPolicy::FollowRegion,
            compute_profile: ComputeProfile::Auto,
            log_level: DEFAULT_LOG_LEVEL,
            control_disabled: false,
            oversubscribe: false,
            idle_release: None,
            priority_release: false,
            disable_control_unread: None,
        }
    }
}

/// A variable whose value could not be accepted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigError {
    pub variable: String,
    /// The value as set (lossily converted when it was not UTF-8).
    pub value: String,
    /// Why it was rejected, without the variable name.
    pub reason: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Escaped, so a name or value holding a newline still gives one log line, and shortened,
        // so a 100 kB value gives a short one.
        write!(
            f,
            "invalid {}={}: {}",
            Shortened::plain(&self.variable),
            Shortened::quoted(&self.value),
            self.reason
        )
    }
}

/// Text from the environment as an error shows it: escaped, and cut after [`Shortened::SHOWN`]
/// characters with the full length in bytes.
struct Shortened<'a> {
    text: &'a str,
    quoted: bool,
}

impl<'a> Shortened<'a> {
    const SHOWN: usize = 64;

    /// Quoted, as a value.
    fn quoted(text: &'a str) -> Self {
        Shortened { text, quoted: true }
    }

    /// Unquoted, as a variable name.
    fn plain(text: &'a str) -> Self {
        Shortened { text, quoted: false }
    }
}

impl fmt::Display for Shortened<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let end = self
            .text
            .char_indices()
            .nth(Self::SHOWN)
            .map_or(self.text.len(), |(index, _)| index);
        let shown = &self.text[..end];
        if self.quoted {
            write!(f, "{shown:?}")?;
        } else {
            write!(f, "{}", shown.escape_debug())?;
        }
        if end < self.text.len() {
            write!(f, "... ({} bytes)", self.text.len())?;
        }
        Ok(())
    }
}

impl std::error::Error for ConfigError {}

impl Config {
    /// Reads the configuration from `vars`, the whole environment as `std::env::vars_os` gives it.
    /// Unlike [`Config::from_lookup`], this also sees per-device variables that name no device
    /// (`CUDA_DEVICE_MEMORY_LIMIT_16`, `_00`), and refuses them.
    pub fn from_vars(vars: impl IntoIterator<Item = (OsString, OsString)>) -> Result<Config, ConfigError> {
        // Only ours are kept, so a large environment is walked once.
        let mut ours: Vec<(OsString, OsString)> = vars
            .into_iter()
            .filter(|(name, _)| {
                let name = name.as_encoded_bytes();
                name.starts_with(b"CUDA_")
                    || name.starts_with(b"GPU_")
                    || name.starts_with(b"LIBCUDA_")
                    || name.starts_with(b"VGPU_")
            })
            .collect();
        // Sorted, so the same environment always reports the same variable.
        ours.sort();
        let lookup = |wanted: &str| {
            ours.iter()
                .find(|(name, _)| name == wanted)
                .map(|(_, value)| value.clone())
        };
        Config::read(lookup, &ours)
    }

    /// Reads every variable through `lookup` (so tests need not touch the process environment).
    /// A lookup by name cannot list the per-device variables that name no device: see
    /// [`Config::from_vars`].
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<OsString>) -> Result<Config, ConfigError> {
        Config::read(lookup, &[])
    }

    /// Variables are checked in a fixed order (global memory limit, per-device memory variables
    /// of no device among `listed`, per-device memory limits 0..15, the same three for the SM
    /// limit, priority, `VGPU_SHARED_CACHE_ANY_OWNER`, shared region path, `CUDA_OVERSUBSCRIBE`, utilisation policy,
    /// `VGPU_COMPUTE_PROFILE`) and the first malformed one is the error, so the same environment
    /// always reports the same variable.
    fn read(lookup: impl Fn(&str) -> Option<OsString>, listed: &[(OsString, OsString)]) -> Result<Config, ConfigError> {
        let mut config = Config {
            log_level: log_level_from_value(lookup(LOG_LEVEL_VAR).as_deref()),
            ..Config::default()
        };
        if let Some(raw) = lookup(DISABLE_CONTROL_VAR).filter(|raw| !raw.is_empty()) {
            match raw.to_str().map(parse_disable_control) {
                Some(Ok(true)) => {
                    config.control_disabled = true;
                    return Ok(config);
                }
                Some(Ok(false)) => {}
                _ => config.disable_control_unread = Some(raw.to_string_lossy().into_owned()),
            }
        }

        // A value of 0 means "no limit from this variable", as in HAMi-core: a per-device 0 falls
        // back to the global limit, and a global 0 means unlimited.
        let global_memory_limit = read_setting(&lookup, MEMORY_LIMIT_VAR, parse_size)?.filter(|&bytes| bytes != 0);
        check_device_suffixes(listed, MEMORY_LIMIT_VAR)?;
        for (index, limit) in config.memory_limit.iter_mut().enumerate() {
            let variable = format!("{MEMORY_LIMIT_VAR}_{index}");
            let device_limit = read_setting(&lookup, &variable, parse_size)?.filter(|&bytes| bytes != 0);
            *limit = device_limit.or(global_memory_limit);
        }

        // Same fallback rule as HAMi-core: a per-device 0 takes the global value, while a
        // per-device 100 is an explicit "unlimited" that overrides a global limit.
        let global_sm_percent = read_setting(&lookup, SM_LIMIT_VAR, parse_percent_value)?.filter(|&p| p != 0);
        check_device_suffixes(listed, SM_LIMIT_VAR)?;
        for (index, limit) in config.sm_limit.iter_mut().enumerate() {
            let variable = format!("{SM_LIMIT_VAR}_{index}");
            let device_percent = read_setting(&lookup, &variable, parse_percent_value)?.filter(|&p| p != 0);
            *limit = device_percent.or(global_sm_percent).and_then(percent_to_limit);
        }

        if let Some(priority) = read_setting(&lookup, TASK_PRIORITY_VAR, parse_priority)? {
            config.task_priority = priority;
        }

        if let Some(any_owner) = read_setting(&lookup, SHARED_CACHE_ANY_OWNER_VAR, parse_switch)? {
            config.shared_cache_any_owner = any_owner;
        }

        // A path may legitimately be non-UTF-8, so it is taken as an OsString. An empty value
        // would name no file at all, so it means the default, like an unset one.
        if let Some(path) = lookup(SHARED_CACHE_VAR).filter(|value| !value.is_empty()) {
            let path = PathBuf::from(path);
            if !path.is_absolute() {
                return Err(ConfigError {
                    variable: SHARED_CACHE_VAR.to_owned(),
                    value: path.to_string_lossy().into_owned(),
                    reason: "not an absolute path (a relative one names another file in each working \
                             directory, so processes would not share one region and one limit)"
                        .to_owned(),
                });
            }
            config.shared_cache = path;
        }

        if let Some(oversubscribe) = read_setting(&lookup, OVERSUBSCRIBE_VAR, parse_oversubscribe)? {
            config.oversubscribe = oversubscribe;
        }
        config.idle_release = read_setting(&lookup, IDLE_RELEASE_VAR, parse_idle_release)?.flatten();
        if let Some(priority_release) = read_setting(&lookup, PRIORITY_RELEASE_VAR, parse_oversubscribe)? {
            config.priority_release = priority_release;
        }
        if let Some(policy) = read_setting(&lookup, UTILIZATION_POLICY_VAR, parse_policy)? {
            config.utilization_policy = policy;
        }
        if let Some(profile) = read_setting(&lookup, COMPUTE_PROFILE_VAR, parse_compute_profile)? {
            config.compute_profile = profile;
        }
        Ok(config)
    }

    /// Reads the process environment.
    pub fn from_env() -> Result<Config, ConfigError> {
        Config::from_vars(std::env::vars_os())
    }

    /// Limit of device `index` (None when index >= MAX_DEVICES or no limit).
    pub fn memory_limit_of(&self, index: usize) -> Option<u64> {
        self.memory_limit.get(index).copied().flatten()
    }

    /// Compute share of device `index` in percent (None when index >= MAX_DEVICES or unlimited).
    pub fn sm_limit_of(&self, index: usize) -> Option<u8> {
        self.sm_limit.get(index).copied().flatten()
    }
}

/// LIBCUDA_LOG_LEVEL parsed on its own, for the logger, which starts before the full config:
/// never fails (malformed -> 2).
pub fn log_level_from_env() -> u8 {
    log_level_from_value(std::env::var_os(LOG_LEVEL_VAR).as_deref())
}

/// Logging must never stop CUDA, so anything but 0..=4 gives the default level.
fn log_level_from_value(value: Option<&OsStr>) -> u8 {
    value
        .and_then(OsStr::to_str)
        .and_then(|text| text.parse::<u8>().ok())
        .filter(|&level| level <= MAX_LOG_LEVEL)
        .unwrap_or(DEFAULT_LOG_LEVEL)
}

/// Reads one variable and parses it. Unset and empty both give `Ok(None)`: HAMi's device plugin
/// may set a variable to the empty string to mean "no value", and HAMi-core treats that as unset.
fn read_setting<T>(
    lookup: &impl Fn(&str) -> Option<OsString>,
    variable: &str,
    parse: fn(&str) -> Result<T, String>,
) -> Result<Option<T>, ConfigError> {
    let Some(raw) = lookup(variable) else {
        return Ok(None);
    };
    if raw.is_empty() {
        return Ok(None);
    }
    let error = |reason: String| ConfigError {
        variable: variable.to_owned(),
        value: raw.to_string_lossy().into_owned(),
        reason,
    };
    let text = raw.to_str().ok_or_else(|| error("not valid UTF-8".to_owned()))?;
    parse(text).map(Some).map_err(error)
}

/// Refuses a set `<base>_<suffix>` variable whose suffix is not a device index as HAMi-core writes
/// it, `0` to `15`: `_16` and above (the region has 16 devices), `_00`, `_+1` or `_x`. Nothing
/// reads such a variable, so accepting it would silently drop the limit it was meant to set.
/// Empty values configure nothing and pass, as everywhere.
fn check_device_suffixes(listed: &[(OsString, OsString)], base: &str) -> Result<(), ConfigError> {
    let prefix = format!("{base}_");
    for (name, value) in listed {
        let Some(suffix) = name.as_encoded_bytes().strip_prefix(prefix.as_bytes()) else {
            continue;
        };
        let index = std::str::from_utf8(suffix)
            .ok()
            .and_then(|text| text.parse::<usize>().ok());
        let canonical = index.is_some_and(|index| index.to_string().as_bytes() == suffix);
        if canonical && index.is_some_and(|index| index < MAX_DEVICES) {
            continue;
        }
        if value.is_empty() {
            continue;
        }
        let reason = if canonical {
            format!(
                "no such device: per-device variables go from {base}_0 to {base}_{}",
                MAX_DEVICES - 1
            )
        } else {
            format!(
                "the suffix is not a device index (per-device variables go from {base}_0 to {base}_{}, \
                 without leading zeros)",
                MAX_DEVICES - 1
            )
        };
        return Err(ConfigError {
            variable: name.to_string_lossy().into_owned(),
            value: value.to_string_lossy().into_owned(),
            reason,
        });
    }
    Ok(())
}

fn parse_priority(text: &str) -> Result<i32, String> {
    text.parse::<i32>().map_err(|_| {
        format!(
            "not a whole number from {} to {} (expected a priority such as 0 or 1)",
            i32::MIN,
            i32::MAX
        )
    })
}

/// `1` or `0`: a switch that widens what is trusted is never guessed from a typo.
/// `CUDA_DISABLE_CONTROL` as HAMi's device plugin reads it (Go's `strconv.ParseBool`): `1`, `t`,
/// `true` or `0`, `f`, `false`, in any case.
fn parse_disable_control(text: &str) -> Result<bool, String> {
    match text.to_ascii_lowercase().as_str() {
        "true" | "t" | "1" => Ok(true),
        "false" | "f" | "0" => Ok(false),
        _ => Err("expected true or false".to_owned()),
    }
}

/// `CUDA_OVERSUBSCRIBE` and `CUDA_PRIORITY_RELEASE`: `true` or `1` (what HAMi's device plugin
/// writes), `false` or `0`; any other value is refused rather than read as either, since each way
/// changes what a job may do.
fn parse_oversubscribe(text: &str) -> Result<bool, String> {
    match text {
        "true" | "1" => Ok(true),
        "false" | "0" => Ok(false),
        _ => Err("expected true or 1 (on), false or 0 (off)".to_owned()),
    }
}

/// `CUDA_IDLE_RELEASE`: a duration of at least a second (`90s`, `10m`, `1h`, or plain seconds);
/// `0` or `off` turns it off (`None`).
fn parse_idle_release(text: &str) -> Result<Option<std::time::Duration>, String> {
    const EXAMPLES: &str = "(expected a duration such as 90s, 10m or 1h, plain seconds, or 0 or off)";
    if text == "0" || text == "off" {
        return Ok(None);
    }
    let (number, unit) = text.split_at(text.find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len()));
    let scale = match unit {
        "" | "s" => 1,
        "m" => 60,
        "h" => 3600,
        _ => return Err(format!("not a duration {EXAMPLES}")),
    };
    let seconds = number
        .parse::<u64>()
        .ok()
        .and_then(|count| count.checked_mul(scale))
        .ok_or_else(|| format!("not a duration {EXAMPLES}"))?;
    if seconds == 0 {
        return Err(format!("a duration of at least 1 second {EXAMPLES}"));
    }
    Ok(Some(std::time::Duration::from_secs(seconds)))
}

fn parse_switch(text: &str) -> Result<bool, String> {
    match text {
        "1" => Ok(true),
        "0" => Ok(false),
        _ => Err("expected 1 (on) or 0 (off)".to_owned()),
    }
}

/// Parses a memory size: a decimal number with an optional fraction, then an optional
/// case-insensitive binary unit (`b`; `k`, `kb`, `kib`; `m`..; `g`..; `t`..). `1g` = 1073741824,
/// as in HAMi-core. Returns the byte count; 0 is returned as is (the caller treats it as "no
/// limit"). `Err` holds the reason, without the variable name.
///
/// Unlike HAMi-core, which reads the number with `strtoul(.., 0)`, the number is always decimal:
/// `010g` is 10 GiB here (octal 8 GiB there) and `0x10` is rejected, because a limit that changes
/// meaning with a leading zero is a trap.
pub fn parse_size(text: &str) -> Result<u64, String> {
    if text.is_empty() {
        return Err(format!("empty value {SIZE_EXAMPLES}"));
    }
    if text.chars().any(char::is_whitespace) {
        return Err(format!("contains whitespace {SIZE_EXAMPLES}"));
    }
    if !text.starts_with(|c: char| c.is_ascii_digit()) {
        return Err(format!(
            "does not start with a decimal digit (signs and words are not accepted) {SIZE_EXAMPLES}"
        ));
    }
    // Named separately because HAMi-core accepted hexadecimal, so users may try it.
    if text.starts_with("0x") || text.starts_with("0X") {
        return Err(format!("hexadecimal is not accepted {SIZE_EXAMPLES}"));
    }
    if text.matches('.').count() > 1 {
        return Err(format!("more than one decimal point {SIZE_EXAMPLES}"));
    }

    let (integer_digits, after_integer) = split_leading_digits(text);
    let (fraction_digits, unit) = match after_integer.strip_prefix('.') {
        Some(after_point) => {
            let (fraction_digits, unit) = split_leading_digits(after_point);
            if fraction_digits.is_empty() {
                return Err(format!("no digits after the decimal point {SIZE_EXAMPLES}"));
            }
            (fraction_digits, unit)
        }
        None => ("", after_integer),
    };
    let unit_shift =
        unit_shift(unit).ok_or_else(|| format!("unknown unit {} {SIZE_EXAMPLES}", Shortened::quoted(unit)))?;

    let too_large = || format!("larger than the largest supported size, {} bytes", u64::MAX);
    let unit_bytes = 1u128 << unit_shift;
    let whole_part_bytes = parse_decimal_u128(integer_digits)
        .and_then(|integer| integer.checked_mul(unit_bytes))
        .ok_or_else(too_large)?;
    let fraction_part_bytes = fraction_bytes(fraction_digits, unit_shift)
        .ok_or_else(|| format!("not a whole number of bytes {SIZE_EXAMPLES}"))?;
    let total = whole_part_bytes
        .checked_add(fraction_part_bytes)
        .ok_or_else(too_large)?;
    u64::try_from(total).map_err(|_| too_large())
}

/// Parses a compute share: a whole number of percent, 0..=100, no sign, unit or fraction.
/// `Ok(None)` for 0 and 100, which both mean "unlimited"; otherwise `Ok(Some(1..=99))`.
pub fn parse_percent(text: &str) -> Result<Option<u8>, String> {
    parse_percent_value(text).map(percent_to_limit)
}

/// The raw 0..=100 value; kept apart from [`parse_percent`] because the per-device fallback must
/// tell 0 ("take the global value") from 100 ("explicitly unlimited").
fn parse_percent_value(text: &str) -> Result<u8, String> {
    if text.is_empty() {
        return Err(format!("empty value {PERCENT_EXAMPLES}"));
    }
    if !text.bytes().all(|byte| byte.is_ascii_digit()) {
        return Err(format!("not a whole number {PERCENT_EXAMPLES}"));
    }
    // All digits, so a parse failure can only be a number too large for u8.
    text.parse::<u8>()
        .ok()
        .filter(|&percent| percent <= 100)
        .ok_or_else(|| format!("greater than 100 {PERCENT_EXAMPLES}"))
}

fn percent_to_limit(percent: u8) -> Option<u8> {
    (1..=99).contains(&percent).then_some(percent)
}

/// Splits `text` after its leading ASCII digits.
fn split_leading_digits(text: &str) -> (&str, &str) {
    let end = text.find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len());
    text.split_at(end)
}

/// log2 of the unit's size in bytes; all units are binary, as in HAMi-core.
fn unit_shift(unit: &str) -> Option<u32> {
    match unit.to_ascii_lowercase().as_str() {
        "" | "b" => Some(0),
        "k" | "kb" | "kib" => Some(10),
        "m" | "mb" | "mib" => Some(20),
        "g" | "gb" | "gib" => Some(30),
        "t" | "tb" | "tib" => Some(40),
        _ => None,
    }
}

/// Value of ASCII decimal digits; None on overflow. Leading zeros are harmless.
fn parse_decimal_u128(digits: &str) -> Option<u128> {
    digits.bytes().try_fold(0u128, |value, digit| {
        value.checked_mul(10)?.checked_add(u128::from(digit - b'0'))
    })
}

/// Bytes contributed by the fractional digits `0.<fraction_digits>` of a unit of
/// `2^unit_shift` bytes, computed exactly; None when that is not a whole number of bytes.
///
/// With trailing zeros removed the fraction is F / 10^p, F not a multiple of 10. Times 2^s it is
/// whole only if 5^p divides F; F is then odd (a multiple of 5 but not of 10), so 2^p must divide
/// 2^s, i.e. p <= s <= 40. That bound keeps every step below inside u128 (5^40 < 2^94).
fn fraction_bytes(fraction_digits: &str, unit_shift: u32) -> Option<u128> {
    let significant = fraction_digits.trim_end_matches('0');
    let places = u32::try_from(significant.len()).ok()?;
    if places > unit_shift {
        return None;
    }
    // Long division of F by 5^p, digit by digit, so F itself (up to 40 digits) is never formed.
    let divisor = 5u128.pow(places);
    let mut quotient = 0u128;
    let mut remainder = 0u128;
    for digit in significant.bytes() {
        remainder = remainder * 10 + u128::from(digit - b'0');
        quotient = quotient * 10 + remainder / divisor;
        remainder %= divisor;
    }
    // F / 5^p < 2^p, so the shifted quotient is below 2^unit_shift.
    (remainder == 0).then(|| quotient << (unit_shift - places))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::ffi::OsStringExt;

    const GIB: u64 = 1 << 30;
    const MIB: u64 = 1 << 20;

    /// A lookup over fixed (name, value) pairs, standing in for the environment.
    fn lookup_of<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<OsString> + 'a {
        move |name| {
            vars.iter()
                .find(|(key, _)| *key == name)
                .map(|(_, value)| OsString::from(value))
        }
    }

    /// The configuration of an environment holding exactly these variables.
    fn config_of(vars: &[(&str, &str)]) -> Result<Config, ConfigError> {
        let config = Config::from_vars(
            vars.iter()
                .map(|(name, value)| (OsString::from(name), OsString::from(value))),
        );
        // A lookup by name sees the same, except the variables it cannot list.
        if config.is_ok() {
            assert_eq!(Config::from_lookup(lookup_of(vars)), config, "{vars:?}");
        }
        config
    }

    #[test]
    fn accepted_sizes() {
        let cases: &[(&str, u64)] = &[
            ("0", 0),
            ("0g", 0),
            ("0.0g", 0),
            ("1", 1),
            ("1b", 1),
            ("1B", 1),
            ("1.0b", 1),
            ("1073741824", GIB),
            ("1g", GIB),
            ("1G", GIB),
            ("1gb", GIB),
            ("1GB", GIB),
            ("1Gb", GIB),
            ("1gib", GIB),
            ("1GiB", GIB),
            ("1GIB", GIB),
            ("1024m", GIB),
            ("1024M", GIB),
            ("1024MB", GIB),
            ("1048576k", GIB),
            ("1048576K", GIB),
            ("1kb", 1024),
            ("1KiB", 1024),
            ("1k", 1024),
            ("1.5g", GIB + GIB / 2),
            ("1.50g", GIB + GIB / 2),
            ("1.25g", GIB + GIB / 4),
            ("1.000000000000000000000000000000000000000000000000000g", GIB),
            ("512MiB", 512 * MIB),
            ("512mb", 512 * MIB),
            ("2t", 2 << 40),
            ("2TiB", 2 << 40),
            ("2tb", 2 << 40),
            ("0.5k", 512),
            ("0.25k", 256),
            ("0.5m", 512 * 1024),
            // Decimal even with a leading zero (HAMi-core would read 010 as octal 8).
            ("010g", 10 * GIB),
            ("00000000000000000000000000000000000000000000000001g", GIB),
            ("18446744073709551615", u64::MAX),
            ("16777215t", u64::MAX - (1 << 40) + 1),
            ("16777215.5t", u64::MAX - (1 << 39) + 1),
            ("17179869183g", u64::MAX - GIB + 1),
            // 2^-40 TiB, the longest fraction that can still be a whole byte count.
            ("0.0000000000009094947017729282379150390625t", 1),
        ];
        for &(text, expected) in cases {
            assert_eq!(parse_size(text), Ok(expected), "parse_size({text:?})");
        }
    }

    #[test]
    fn rejected_sizes() {
        let cases = [
            "",
            " ",
            "1 g",
            " 1g",
            "1g ",
            "1\tg",
            "1g\n",
            "-1g",
            "+1g",
            "-0",
            "0x10",
            "0X10",
            "0x",
            "0o10",
            "0b1",
            "1.5.5g",
            "1..5g",
            "1.",
            "1.g",
            ".5g",
            "g",
            "b",
            "1p",
            "1pb",
            "1gg",
            "1gig",
            "1gi",
            "1ki",
            "1mibb",
            "1bb",
            "1e9",
            "1E9",
            "1,5g",
            "1_000",
            "nan",
            "NaN",
            "inf",
            "infinity",
            "1.5b",
            "0.5b",
            "0.1k",
            "0.3g",
            "0.00000000000009094947017729282379150390625t",
            "20000000000t",
            "16777216t",
            "17179869184g",
            "18446744073709551616",
            "99999999999999999999999999999999999999999999999999",
            "\u{ff11}g",
            "1\u{212a}",
            "1g\u{0}",
        ];
        for text in cases {
            assert!(
                parse_size(text).is_err(),
                "parse_size({text:?}) = {:?}",
                parse_size(text)
            );
        }
    }

    #[test]
    fn size_reasons_name_the_problem() {
        let reason_of = |text: &str| parse_size(text).err().unwrap_or_default();
        assert!(reason_of("1.5x").starts_with("unknown unit \"x\""));
        assert!(reason_of("18446744073709551616").contains("largest supported size"));
        assert!(reason_of("20000000000t").contains("largest supported size"));
        assert!(reason_of("1.5b").starts_with("not a whole number of bytes"));
        assert!(reason_of("0x10").starts_with("hexadecimal"));
        assert!(reason_of("-1g").starts_with("does not start with a decimal digit"));
        assert!(reason_of("1.2.3").starts_with("more than one decimal point"));
        assert!(reason_of("1 g").starts_with("contains whitespace"));
        assert!(reason_of("1.").starts_with("no digits after the decimal point"));
        assert!(reason_of("").starts_with("empty value"));
    }

    #[test]
    fn plain_byte_rendering_round_trips() {
        for text in ["1.5g", "512MiB", "2t", "0.5k", "16777215t", "7"] {
            let bytes = parse_size(text).unwrap_or_default();
            assert_ne!(bytes, 0, "{text}");
            assert_eq!(parse_size(&bytes.to_string()), Ok(bytes), "{text}");
        }
    }

    #[test]
    fn percent_values() {
        let accepted: &[(&str, Option<u8>)] = &[
            ("0", None),
            ("1", Some(1)),
            ("50", Some(50)),
            ("050", Some(50)),
            ("99", Some(99)),
            ("100", None),
            ("0100", None),
        ];
        for &(text, expected) in accepted {
            assert_eq!(parse_percent(text), Ok(expected), "parse_percent({text:?})");
        }
        let rejected = [
            "",
            "101",
            "255",
            "256",
            "1000",
            "4294967296",
            "-1",
            "+1",
            "50%",
            "5.5",
            "0.5",
            " 50",
            "50 ",
            "5e1",
            "0x10",
            "fifty",
        ];
        for text in rejected {
            assert!(parse_percent(text).is_err(), "parse_percent({text:?})");
        }
        assert!(
            parse_percent("101")
                .err()
                .unwrap_or_default()
                .starts_with("greater than 100")
        );
    }

    #[test]
    fn empty_environment_gives_defaults() {
        let config = config_of(&[]);
        assert_eq!(config, Ok(Config::default()));
        let config = config.expect("valid configuration");
        assert_eq!(config.memory_limit, [None; MAX_DEVICES]);
        assert_eq!(config.sm_limit, [None; MAX_DEVICES]);
        assert_eq!(config.shared_cache, PathBuf::from("/tmp/cudevshr.cache"));
        assert_eq!(config.task_priority, 1);
        assert_eq!(config.utilization_policy, UtilizationPolicy::FollowRegion);
        assert_eq!(config.compute_profile, ComputeProfile::Auto);
        assert_eq!(config.log_level, 2);
    }

    #[test]
    fn global_memory_limit_applies_to_every_device() {
        let config = config_of(&[("CUDA_DEVICE_MEMORY_LIMIT", "2g")]).expect("valid configuration");
        assert_eq!(config.memory_limit, [Some(2 * GIB); MAX_DEVICES]);
        assert_eq!(config.memory_limit_of(15), Some(2 * GIB));
        assert_eq!(config.memory_limit_of(16), None);
        assert_eq!(config.memory_limit_of(usize::MAX), None);
    }

    #[test]
    fn per_device_memory_limit_overrides_global() {
        let config = config_of(&[
            ("CUDA_DEVICE_MEMORY_LIMIT", "2g"),
            ("CUDA_DEVICE_MEMORY_LIMIT_1", "512m"),
            ("CUDA_DEVICE_MEMORY_LIMIT_15", "3g"),
            // 0 and empty both mean "not set here", so the global value applies (as in HAMi-core).
            ("CUDA_DEVICE_MEMORY_LIMIT_2", "0"),
            ("CUDA_DEVICE_MEMORY_LIMIT_3", ""),
        ])
        .expect("valid configuration");
        assert_eq!(config.memory_limit_of(0), Some(2 * GIB));
        assert_eq!(config.memory_limit_of(1), Some(512 * MIB));
        assert_eq!(config.memory_limit_of(2), Some(2 * GIB));
        assert_eq!(config.memory_limit_of(3), Some(2 * GIB));
        assert_eq!(config.memory_limit_of(14), Some(2 * GIB));
        assert_eq!(config.memory_limit_of(15), Some(3 * GIB));
        assert_eq!(config.memory_limit_of(16), None);
    }

    #[test]
    fn per_device_memory_limit_without_global() {
        let config = config_of(&[("CUDA_DEVICE_MEMORY_LIMIT_4", "1.5g")]).expect("valid configuration");
        for index in 0..MAX_DEVICES {
            let expected = (index == 4).then_some(GIB + GIB / 2);
            assert_eq!(config.memory_limit_of(index), expected, "device {index}");
        }
    }

    #[test]
    fn zero_or_empty_global_memory_limit_is_no_limit() {
        for value in ["0", "", "0k"] {
            let config = config_of(&[("CUDA_DEVICE_MEMORY_LIMIT", value)]);
            assert_eq!(config, Ok(Config::default()), "{value:?}");
        }
    }

    #[test]
    fn malformed_memory_limit_is_an_error_naming_variable_and_value() {
        let error = config_of(&[
            ("CUDA_DEVICE_MEMORY_LIMIT", "1g"),
            ("CUDA_DEVICE_MEMORY_LIMIT_1", "1.5x"),
        ])
        .expect_err("1.5x must be rejected");
        assert_eq!(error.variable, "CUDA_DEVICE_MEMORY_LIMIT_1");
        assert_eq!(error.value, "1.5x");
        assert_eq!(
            error.to_string(),
            "invalid CUDA_DEVICE_MEMORY_LIMIT_1=\"1.5x\": unknown unit \"x\" \
             (expected a size such as 1g, 1024m, 512MiB or 1073741824)"
        );
    }

    #[test]
    fn error_display_is_one_line_even_for_control_characters() {
        let result = config_of(&[("CUDA_DEVICE_MEMORY_LIMIT", "1g\nx\r")]);
        let text = result.err().map(|error| error.to_string()).unwrap_or_default();
        assert!(text.starts_with("invalid CUDA_DEVICE_MEMORY_LIMIT=\"1g\\nx\\r\": "));
        assert!(!text.contains('\n') && !text.contains('\r'), "{text}");
    }

    #[test]
    fn non_utf8_limit_is_rejected() {
        let lookup = |name: &str| (name == "CUDA_DEVICE_MEMORY_LIMIT_0").then(|| OsString::from_vec(vec![b'1', 0xff]));
        let error = Config::from_lookup(lookup).err();
        assert_eq!(
            error.as_ref().map(|e| (e.variable.as_str(), e.reason.as_str())),
            Some(("CUDA_DEVICE_MEMORY_LIMIT_0", "not valid UTF-8"))
        );
        assert_eq!(error.map(|e| e.value), Some("1\u{fffd}".to_owned()));
    }

    #[test]
    fn first_malformed_variable_in_fixed_order_wins() {
        let all_bad = [
            ("VGPU_COMPUTE_PROFILE", "none"),
            ("GPU_CORE_UTILIZATION_POLICY", "forced"),
            ("CUDA_DEVICE_MEMORY_SHARED_CACHE", "region"),
            ("CUDA_TASK_PRIORITY", "high"),
            ("CUDA_DEVICE_SM_LIMIT_3", "200"),
            ("CUDA_DEVICE_SM_LIMIT_16", "50"),
            ("CUDA_DEVICE_SM_LIMIT", "x"),
            ("CUDA_DEVICE_MEMORY_LIMIT_7", "1q"),
            ("CUDA_DEVICE_MEMORY_LIMIT_2", "1q"),
            ("CUDA_DEVICE_MEMORY_LIMIT_99", "1g"),
            ("CUDA_DEVICE_MEMORY_LIMIT_00", "1g"),
            ("CUDA_DEVICE_MEMORY_LIMIT", "1q"),
        ];
        let expected_order = [
            "CUDA_DEVICE_MEMORY_LIMIT",
            "CUDA_DEVICE_MEMORY_LIMIT_00",
            "CUDA_DEVICE_MEMORY_LIMIT_99",
            "CUDA_DEVICE_MEMORY_LIMIT_2",
            "CUDA_DEVICE_MEMORY_LIMIT_7",
            "CUDA_DEVICE_SM_LIMIT",
            "CUDA_DEVICE_SM_LIMIT_16",
            "CUDA_DEVICE_SM_LIMIT_3",
            "CUDA_TASK_PRIORITY",
            "CUDA_DEVICE_MEMORY_SHARED_CACHE",
            "GPU_CORE_UTILIZATION_POLICY",
            "VGPU_COMPUTE_PROFILE",
        ];
        // Drop the reported variable each round; the next one in the order must be reported.
        let mut remaining = all_bad.to_vec();
        for expected in expected_order {
            let error = config_of(&remaining).err().map(|e| e.variable);
            assert_eq!(error.as_deref(), Some(expected));
            remaining.retain(|(name, _)| *name != expected);
        }
        assert!(config_of(&remaining).is_ok());
    }

    #[test]
    fn sm_limit_edge_cases() {
        let cases: &[(&str, Option<u8>)] = &[
            ("0", None),
            ("1", Some(1)),
            ("50", Some(50)),
            ("99", Some(99)),
            ("100", None),
            ("", None),
        ];
        for &(value, expected) in cases {
            let config = config_of(&[("CUDA_DEVICE_SM_LIMIT", value)]);
            let limits = config.map(|c| c.sm_limit);
            assert_eq!(limits, Ok([expected; MAX_DEVICES]), "{value:?}");
        }
        for value in ["101", "-1", "50%", "5.5", "1g", " 50"] {
            let error = config_of(&[("CUDA_DEVICE_SM_LIMIT_0", value)]).err();
            assert_eq!(
                error.map(|e| (e.variable, e.value)),
                Some(("CUDA_DEVICE_SM_LIMIT_0".to_owned(), value.to_owned())),
                "{value:?}"
            );
        }
    }

    #[test]
    fn per_device_sm_limit_overrides_global() {
        let config = config_of(&[
            ("CUDA_DEVICE_SM_LIMIT", "50"),
            ("CUDA_DEVICE_SM_LIMIT_1", "25"),
            // 100 is an explicit "unlimited" for this device.
            ("CUDA_DEVICE_SM_LIMIT_2", "100"),
            // 0 means "not set here": the global 50 applies, as in HAMi-core.
            ("CUDA_DEVICE_SM_LIMIT_3", "0"),
        ])
        .expect("valid configuration");
        assert_eq!(config.sm_limit_of(0), Some(50));
        assert_eq!(config.sm_limit_of(1), Some(25));
        assert_eq!(config.sm_limit_of(2), None);
        assert_eq!(config.sm_limit_of(3), Some(50));
        assert_eq!(config.sm_limit_of(15), Some(50));
        assert_eq!(config.sm_limit_of(16), None);
    }

    #[test]
    fn shared_cache_any_owner_is_1_or_0() {
        let any_owner = |value: &str| {
            config_of(&[("VGPU_SHARED_CACHE_ANY_OWNER", value)]).map(|config| config.shared_cache_any_owner)
        };
        assert_eq!(config_of(&[]).map(|config| config.shared_cache_any_owner), Ok(false));
        assert_eq!(any_owner("1"), Ok(true));
        assert_eq!(any_owner("0"), Ok(false));
        assert_eq!(any_owner(""), Ok(false));
        for value in ["yes", "true", " 1", "2"] {
            let error = any_owner(value).err();
            assert_eq!(
                error.map(|e| e.variable),
                Some("VGPU_SHARED_CACHE_ANY_OWNER".to_owned()),
                "{value:?}"
            );
        }
    }

    #[test]
    fn oversubscribe_is_true_or_1_false_or_0() {
        let oversubscribe =
            |value: &str| config_of(&[("CUDA_OVERSUBSCRIBE", value)]).map(|config| config.oversubscribe);
        assert_eq!(config_of(&[]).map(|config| config.oversubscribe), Ok(false));
        assert_eq!(oversubscribe("true"), Ok(true));
        assert_eq!(oversubscribe("1"), Ok(true));
        assert_eq!(oversubscribe("false"), Ok(false));
        assert_eq!(oversubscribe("0"), Ok(false));
        assert_eq!(oversubscribe(""), Ok(false));
        for value in ["yes", "TRUE", "on", " 1", "2"] {
            let error = oversubscribe(value).err();
            assert_eq!(
                error.as_ref().map(|e| e.variable.as_str()),
                Some("CUDA_OVERSUBSCRIBE"),
                "{value:?}"
            );
            assert!(
                error.is_some_and(|e| e.to_string().contains("expected true or 1")),
                "{value:?}"
            );
        }
    }

    #[test]
    fn idle_release_is_a_duration_and_priority_release_a_switch() {
        let idle = |value: &str| config_of(&[("CUDA_IDLE_RELEASE", value)]).map(|config| config.idle_release);
        let secs = |seconds| Ok(Some(std::time::Duration::from_secs(seconds)));
        assert_eq!(config_of(&[]).map(|config| config.idle_release), Ok(None));
        assert_eq!(idle("10m"), secs(600));
        assert_eq!(idle("90s"), secs(90));
        assert_eq!(idle("45"), secs(45));
        assert_eq!(idle("1h"), secs(3600));
        assert_eq!(idle("0"), Ok(None));
        assert_eq!(idle("off"), Ok(None));
        assert_eq!(idle(""), Ok(None));
        for value in ["0s", "10 m", "-5", "1.5m", "10d", "99999999999999999999h", "m"] {
            let error = idle(value).err();
            assert_eq!(
                error.as_ref().map(|e| e.variable.as_str()),
                Some("CUDA_IDLE_RELEASE"),
                "{value:?}"
            );
        }
        let priority =
            |value: &str| config_of(&[("CUDA_PRIORITY_RELEASE", value)]).map(|config| config.priority_release);
        assert_eq!(priority("true"), Ok(true));
        assert_eq!(priority("0"), Ok(false));
        assert!(priority("yes").is_err());
    }

    #[test]
    fn task_priority() {
        let priority_of = |value: &str| config_of(&[("CUDA_TASK_PRIORITY", value)]).map(|config| config.task_priority);
        assert_eq!(priority_of("0"), Ok(0));
        assert_eq!(priority_of("1"), Ok(1));
        assert_eq!(priority_of("7"), Ok(7));
        assert_eq!(priority_of("-3"), Ok(-3));
        assert_eq!(priority_of(""), Ok(1));
        assert_eq!(priority_of("2147483647"), Ok(i32::MAX));
        for value in ["high", "1.0", "1 ", "2147483648", "0x1"] {
            let error = priority_of(value).err();
            assert_eq!(
                error.map(|e| e.variable),
                Some("CUDA_TASK_PRIORITY".to_owned()),
                "{value:?}"
            );
        }
    }

    #[test]
    fn utilization_policy() {
        let policy_of =
            |value: &str| config_of(&[("GPU_CORE_UTILIZATION_POLICY", value)]).map(|config| config.utilization_policy);
        // HAMi's values (and HAMi-core's spellings), in any case.
        assert_eq!(policy_of("force"), Ok(UtilizationPolicy::Force));
        assert_eq!(policy_of("FORCE"), Ok(UtilizationPolicy::Force));
        assert_eq!(policy_of("disable"), Ok(UtilizationPolicy::Disable));
        assert_eq!(policy_of("DISABLE"), Ok(UtilizationPolicy::Disable));
        assert_eq!(policy_of("Disable"), Ok(UtilizationPolicy::Disable));
        for value in ["", "default", "DEFAULT", "Default"] {
            assert_eq!(policy_of(value), Ok(UtilizationPolicy::FollowRegion), "{value:?}");
        }
        assert_eq!(
            config_of(&[]).map(|c| c.utilization_policy),
            Ok(UtilizationPolicy::FollowRegion)
        );
    }

    #[test]
    fn unknown_utilization_policy_is_an_error() {
        for value in [
            "forced", "disabled", " force", "force ", "on", "off", "1", "0", "none", "defaults",
        ] {
            let error = config_of(&[("GPU_CORE_UTILIZATION_POLICY", value)]).err();
            assert_eq!(
                error.map(|e| (e.variable, e.value, e.reason)),
                Some((
                    "GPU_CORE_UTILIZATION_POLICY".to_owned(),
                    value.to_owned(),
                    "unknown policy (expected force, disable or default)".to_owned()
                )),
                "{value:?}"
            );
        }
        let non_utf8 = |name: &str| (name == "GPU_CORE_UTILIZATION_POLICY").then(|| OsString::from_vec(vec![0xff]));
        assert_eq!(
            Config::from_lookup(non_utf8).err().map(|e| e.variable),
            Some("GPU_CORE_UTILIZATION_POLICY".to_owned())
        );
    }

    #[test]
    fn compute_profile_is_auto_or_off() {
        let profile_of =
            |value: &str| config_of(&[("VGPU_COMPUTE_PROFILE", value)]).map(|config| config.compute_profile);
        for value in ["auto", "AUTO", "Auto", ""] {
            assert_eq!(profile_of(value), Ok(ComputeProfile::Auto), "{value:?}");
        }
        for value in ["off", "OFF", "Off"] {
            assert_eq!(profile_of(value), Ok(ComputeProfile::Off), "{value:?}");
        }
        assert_eq!(config_of(&[]).map(|c| c.compute_profile), Ok(ComputeProfile::Auto));
        for value in [
            "on",
            "0",
            "1",
            "none",
            "disable",
            " off",
            "off ",
            "auto,off",
            "NVIDIA H200",
            "h200",
            "time",
        ] {
            let error = config_of(&[("VGPU_COMPUTE_PROFILE", value)]).err();
            assert_eq!(
                error
                    .as_ref()
                    .map(|e| (e.variable.as_str(), e.value.as_str(), e.reason.as_str())),
                Some(("VGPU_COMPUTE_PROFILE", value, "unknown value (expected auto or off)")),
                "{value:?}"
            );
            let line = error.map(|e| e.to_string()).unwrap_or_default();
            assert!(
                line.starts_with("invalid VGPU_COMPUTE_PROFILE=") && !line.contains('\n'),
                "{line}"
            );
        }
        let non_utf8 = |name: &str| (name == "VGPU_COMPUTE_PROFILE").then(|| OsString::from_vec(vec![b'o', 0xff]));
        assert_eq!(
            Config::from_lookup(non_utf8).err().map(|e| (e.variable, e.reason)),
            Some(("VGPU_COMPUTE_PROFILE".to_owned(), "not valid UTF-8".to_owned()))
        );
        // Read from the whole environment too.
        let vars = [("VGPU_COMPUTE_PROFILE", "off")].map(|(name, value)| (OsString::from(name), OsString::from(value)));
        assert_eq!(
            Config::from_vars(vars).map(|config| config.compute_profile),
            Ok(ComputeProfile::Off)
        );
    }

    #[test]
    fn the_whole_environment_includes_the_any_owner_switch() {
        let vars = [("VGPU_SHARED_CACHE_ANY_OWNER", "1"), ("HOME", "/root")]
            .map(|(name, value)| (OsString::from(name), OsString::from(value)));
        let config = Config::from_vars(vars).map_err(|error| error.to_string());
        assert_eq!(config.map(|config| config.shared_cache_any_owner), Ok(true));
    }

    #[test]
    fn per_device_variables_of_no_device_are_refused() {
        for base in ["CUDA_DEVICE_MEMORY_LIMIT", "CUDA_DEVICE_SM_LIMIT"] {
            let value = if base.contains("MEMORY") { "1g" } else { "50" };
            for suffix in ["15", "0"] {
                let name = format!("{base}_{suffix}");
                assert!(config_of(&[(&name, value)]).is_ok(), "{name}");
            }
            for (suffix, out_of_range) in [
                ("16", true),
                ("99", true),
                ("18446744073709551616", false),
                ("00", false),
                ("01", false),
                ("015", false),
                ("+1", false),
                ("-1", false),
                (" 1", false),
                ("1 ", false),
                ("x", false),
                ("", false),
                ("1_", false),
                ("0x1", false),
            ] {
                let name = format!("{base}_{suffix}");
                let error = config_of(&[(&name, value)]).err();
                assert_eq!(
                    error.as_ref().map(|e| (e.variable.as_str(), e.value.as_str())),
                    Some((name.as_str(), value)),
                    "{name:?}"
                );
                let reason = error.map(|e| e.reason).unwrap_or_default();
                let expected = if out_of_range {
                    "no such device"
                } else {
                    "the suffix is not a device index"
                };
                assert!(reason.starts_with(expected), "{name:?}: {reason}");
                assert!(reason.contains(&format!("{base}_0 to {base}_15")), "{name:?}: {reason}");
                // Empty configures nothing, as everywhere.
                assert!(config_of(&[(&name, "")]).is_ok(), "{name:?} empty");
            }
        }
        // Names that merely begin alike are not per-device variables.
        assert!(config_of(&[("CUDA_DEVICE_MEMORY_LIMITS", "x"), ("CUDA_DEVICE_SM_LIMITED", "x")]).is_ok());
        // A name need not be UTF-8.
        let mut name = b"CUDA_DEVICE_MEMORY_LIMIT_".to_vec();
        name.push(0xff);
        let error = Config::from_vars([(OsString::from_vec(name), OsString::from("1g"))]).err();
        assert_eq!(
            error.map(|e| e.variable),
            Some("CUDA_DEVICE_MEMORY_LIMIT_\u{fffd}".to_owned())
        );
    }

    #[test]
    fn relative_shared_cache_path_is_refused() {
        for path in ["region", "./region", "../tmp/region", "~/region", "tmp/cudevshr.cache"] {
            let error = config_of(&[("CUDA_DEVICE_MEMORY_SHARED_CACHE", path)]).err();
            assert_eq!(
                error.as_ref().map(|e| (e.variable.as_str(), e.value.as_str())),
                Some(("CUDA_DEVICE_MEMORY_SHARED_CACHE", path)),
                "{path:?}"
            );
            assert!(
                error.is_some_and(|e| e.reason.starts_with("not an absolute path")),
                "{path:?}"
            );
        }
    }

    #[test]
    fn a_long_value_gives_a_short_error_line() {
        let long = format!("1{}", "x".repeat(99_999));
        for (variable, value) in [
            ("CUDA_DEVICE_MEMORY_LIMIT", long.as_str()),
            ("CUDA_DEVICE_SM_LIMIT_3", long.as_str()),
            ("CUDA_TASK_PRIORITY", long.as_str()),
            ("GPU_CORE_UTILIZATION_POLICY", long.as_str()),
            ("VGPU_COMPUTE_PROFILE", long.as_str()),
            ("CUDA_DEVICE_MEMORY_SHARED_CACHE", long.as_str()),
        ] {
            let error = config_of(&[(variable, value)]).err();
            let line = error.map(|e| e.to_string()).unwrap_or_default();
            assert!(line.len() < 400, "{variable}: {} bytes: {line}", line.len());
            let shown = format!("invalid {variable}=\"1{}\"... (100000 bytes): ", "x".repeat(63));
            assert!(line.starts_with(&shown), "{variable}: {line}");
        }
        // The unit a size error quotes is shortened too.
        let line = config_of(&[("CUDA_DEVICE_MEMORY_LIMIT", &long)])
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            line.contains(&format!("unknown unit \"{}\"... (99999 bytes)", "x".repeat(64))),
            "{line}"
        );
        // So is a long variable name, and a newline in it stays escaped.
        let name = format!("CUDA_DEVICE_SM_LIMIT_\n{}", "9".repeat(100_000));
        let line = config_of(&[(&name, "50")])
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(line.len() < 400 && !line.contains('\n'), "{} bytes: {line}", line.len());
        // Cut on a character boundary, counted in characters.
        let wide = "\u{00e9}".repeat(100);
        let line = config_of(&[("CUDA_DEVICE_MEMORY_LIMIT", &wide)])
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            line.starts_with(&format!(
                "invalid CUDA_DEVICE_MEMORY_LIMIT=\"{}\"... (200 bytes)",
                "\u{00e9}".repeat(64)
            )),
            "{line}"
        );
        // A short value is shown whole.
        let line = config_of(&[("CUDA_DEVICE_MEMORY_LIMIT", "1x")])
            .err()
            .map(|e| e.to_string());
        assert!(
            line.is_some_and(|line| line.starts_with("invalid CUDA_DEVICE_MEMORY_LIMIT=\"1x\": unknown unit \"x\" "))
        );
    }

    #[test]
    fn log_level() {
        for (value, expected) in [
            ("0", 0),
            ("1", 1),
            ("3", 3),
            ("4", 4),
            ("5", 2),
            ("255", 2),
            ("256", 2),
            ("-1", 2),
            ("debug", 2),
            ("", 2),
        ] {
            let level = config_of(&[("LIBCUDA_LOG_LEVEL", value)]).map(|c| c.log_level);
            assert_eq!(level, Ok(expected), "{value:?}");
            assert_eq!(log_level_from_value(Some(OsStr::new(value))), expected, "{value:?}");
        }
        assert_eq!(log_level_from_value(None), 2);
    }

    #[test]
    fn shared_cache_path() {
        let path_of = |vars: &[(&str, &str)]| config_of(vars).map(|c| c.shared_cache);
        assert_eq!(
            path_of(&[("CUDA_DEVICE_MEMORY_SHARED_CACHE", "/run/vgpu/region")]),
            Ok(PathBuf::from("/run/vgpu/region"))
        );
        assert_eq!(
            path_of(&[("CUDA_DEVICE_MEMORY_SHARED_CACHE", "")]),
            Ok(PathBuf::from(DEFAULT_SHARED_CACHE))
        );
        // Paths need not be UTF-8, so this one is kept as given.
        let raw_path = vec![b'/', b't', 0xff];
        let lookup =
            |name: &str| (name == "CUDA_DEVICE_MEMORY_SHARED_CACHE").then(|| OsString::from_vec(raw_path.clone()));
        assert_eq!(
            Config::from_lookup(lookup).map(|c| c.shared_cache),
            Ok(PathBuf::from(OsString::from_vec(raw_path.clone())))
        );
    }

    #[test]
    fn from_env_reads_the_process_environment() {
        // Setting variables is unsafe with parallel tests, so compare against the environment the
        // runner already has.
        assert_eq!(Config::from_env(), Config::from_vars(std::env::vars_os()));
        assert_eq!(
            log_level_from_env(),
            log_level_from_value(std::env::var_os("LIBCUDA_LOG_LEVEL").as_deref())
        );
    }

    #[test]
    fn disable_control_passes_through_whatever_the_other_variables_say() {
        for value in ["true", "TRUE", "t", "1"] {
            let config = Config::from_lookup(lookup_of(&[
                ("CUDA_DISABLE_CONTROL", value),
                ("CUDA_DEVICE_MEMORY_LIMIT", "not a size"),
                ("CUDA_DEVICE_SM_LIMIT", "50"),
                ("LIBCUDA_LOG_LEVEL", "4"),
            ]))
            .expect("control disabled: the limits are not read");
            assert!(config.control_disabled, "{value}");
            assert_eq!(config.memory_limit_of(0), None);
            assert_eq!(config.sm_limit_of(0), None);
            assert_eq!(config.log_level, 4);
        }
        for value in ["false", "F", "0", ""] {
            let config = Config::from_lookup(lookup_of(&[
                ("CUDA_DISABLE_CONTROL", value),
                ("CUDA_DEVICE_SM_LIMIT", "50"),
            ]))
            .unwrap();
            assert!(!config.control_disabled, "{value}");
            assert_eq!(config.sm_limit_of(0), Some(50));
        }
        // What HAMi's device plugin reads as false (it then mounts the library): the limits apply,
        // and the value is kept for cuInit's warning.
        let config = Config::from_lookup(lookup_of(&[
            ("CUDA_DISABLE_CONTROL", "yes"),
            ("CUDA_DEVICE_SM_LIMIT", "50"),
        ]))
        .unwrap();
        assert!(!config.control_disabled);
        assert_eq!(config.sm_limit_of(0), Some(50));
        assert_eq!(config.disable_control_unread.as_deref(), Some("yes"));
    }
}
