//! Fuzzes the environment parsing of the hook: `parse_size`, `parse_percent` and
//! `Config::from_lookup`, checking that nothing panics and that results keep their invariants.

#![no_main]

use std::ffi::OsString;
use std::os::unix::ffi::OsStringExt;

use libfuzzer_sys::fuzz_target;

// The hook's configuration crate. `from_env` and `log_level_from_env` read the real environment
// and are not fuzzed.
use vgpu_config::{ComputeProfile, Config, ConfigError, MAX_DEVICES, parse_percent, parse_size};

/// Variables that get a value from the input, in the order `from_lookup` checks them (the ones
/// that can fail first), then the ones that never fail.
fn variable_names() -> Vec<String> {
    let mut names = vec!["CUDA_DEVICE_MEMORY_LIMIT".to_owned()];
    names.extend((0..MAX_DEVICES).map(|index| format!("CUDA_DEVICE_MEMORY_LIMIT_{index}")));
    names.push("CUDA_DEVICE_SM_LIMIT".to_owned());
    names.extend((0..MAX_DEVICES).map(|index| format!("CUDA_DEVICE_SM_LIMIT_{index}")));
    names.push("CUDA_TASK_PRIORITY".to_owned());
    names.push("CUDA_DEVICE_MEMORY_SHARED_CACHE".to_owned());
    names.push("GPU_CORE_UTILIZATION_POLICY".to_owned());
    names.push("VGPU_COMPUTE_PROFILE".to_owned());
    names.push("LIBCUDA_LOG_LEVEL".to_owned());
    names
}

/// Positions in `variable_names` of the variables after the limits; everything up to
/// VGPU_COMPUTE_PROFILE can fail.
const PRIORITY: usize = 2 * MAX_DEVICES + 2;
const SHARED_CACHE: usize = PRIORITY + 1;
const POLICY: usize = PRIORITY + 2;
const COMPUTE_PROFILE: usize = PRIORITY + 3;
const LAST_FALLIBLE: usize = COMPUTE_PROFILE;

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        check_size(text);
        check_percent(text);
    }
    check_config(data);
});

fn check_size(text: &str) {
    let result = parse_size(text);
    match &result {
        Ok(bytes) => {
            // Re-rendered as plain bytes, an accepted size must parse back to itself.
            assert_eq!(parse_size(&bytes.to_string()), Ok(*bytes), "{text:?}");
        }
        Err(reason) => assert_single_line(reason),
    }
    // Units are case-insensitive and digits have no case, so the case of the text never changes
    // the outcome (only an error's wording, which quotes the unit).
    assert_eq!(parse_size(&text.to_ascii_uppercase()).ok(), result.ok(), "{text:?}");
}

fn check_percent(text: &str) {
    match parse_percent(text) {
        Ok(Some(percent)) => {
            assert!((1..=100).contains(&percent), "{text:?} -> {percent}");
            assert_eq!(text.parse::<u8>(), Ok(percent), "{text:?}");
        }
        Ok(None) => {
            assert!(matches!(text.parse::<u8>(), Ok(0 | 100)), "{text:?}");
        }
        Err(reason) => assert_single_line(&reason),
    }
}

fn check_config(data: &[u8]) {
    let names = variable_names();
    // NUL cannot occur inside an environment value, so it separates the values; variables past
    // the last value stay unset.
    let values: Vec<&[u8]> = data.split(|&byte| byte == 0).collect();
    let value_of = |name: &str| {
        let position = names.iter().position(|candidate| candidate == name)?;
        values.get(position).map(|value| OsString::from_vec(value.to_vec()))
    };

    match Config::from_lookup(value_of) {
        Ok(config) => check_valid_config(&config, &names, &values),
        Err(error) => check_error(&error, &names, &values),
    }
}

/// Value of variable `position` as text; None when unset or empty (both mean "not set").
fn text_at<'a>(values: &[&'a [u8]], position: usize) -> Option<&'a str> {
    let value = values.get(position).filter(|value| !value.is_empty())?;
    std::str::from_utf8(value).ok()
}

fn check_valid_config(config: &Config, names: &[String], values: &[&[u8]]) {
    assert!(config.log_level <= 4);
    // Recompute each device's memory limit from the raw values: a non-zero per-device value wins,
    // then a non-zero global value, else no limit.
    let nonzero_size = |position: usize| {
        text_at(values, position)
            .and_then(|text| parse_size(text).ok())
            .filter(|&bytes| bytes != 0)
    };
    for index in 0..MAX_DEVICES {
        let expected = nonzero_size(1 + index).or(nonzero_size(0));
        assert_eq!(config.memory_limit_of(index), expected, "{}", names[1 + index]);
        assert!(config.memory_limit[index].is_none_or(|bytes| bytes != 0));
        let sm_limit = config.sm_limit_of(index);
        assert!(sm_limit.is_none_or(|percent| (1..=100).contains(&percent)));
    }
    assert_eq!(config.memory_limit_of(MAX_DEVICES), None);
    assert_eq!(config.sm_limit_of(MAX_DEVICES), None);
    // A region path in use is absolute: a relative one would not be shared.
    assert!(config.shared_cache.is_absolute(), "{:?}", config.shared_cache);
    // `off` in any case turns the board profiles off; unset, empty or `auto` leaves them on.
    let off = text_at(values, COMPUTE_PROFILE).is_some_and(|text| text.eq_ignore_ascii_case("off"));
    let expected = if off { ComputeProfile::Off } else { ComputeProfile::Auto };
    assert_eq!(config.compute_profile, expected);
}

/// Whether a set, non-empty value of variable `position` is accepted on its own.
fn valid_at(position: usize, value: &[u8]) -> bool {
    let text = std::str::from_utf8(value);
    match position {
        0..=MAX_DEVICES => text.is_ok_and(|text| parse_size(text).is_ok()),
        PRIORITY => text.is_ok_and(|text| text.parse::<i32>().is_ok()),
        // Paths need not be UTF-8.
        SHARED_CACHE => value.starts_with(b"/"),
        POLICY => text.is_ok_and(|text| {
            ["default", "force", "disable"]
                .iter()
                .any(|name| text.eq_ignore_ascii_case(name))
        }),
        COMPUTE_PROFILE => text.is_ok_and(|text| ["auto", "off"].iter().any(|name| text.eq_ignore_ascii_case(name))),
        _ => text.is_ok_and(|text| parse_percent(text).is_ok()),
    }
}

fn check_error(error: &ConfigError, names: &[String], values: &[&[u8]]) {
    assert_single_line(&error.to_string());
    let position = names
        .iter()
        .position(|name| *name == error.variable)
        .unwrap_or_else(|| panic!("error names an unknown variable: {error}"));
    assert!(position <= LAST_FALLIBLE, "{error}");
    assert!(values.get(position).is_some_and(|value| !value.is_empty()), "{error}");
    // The first malformed variable is reported, so every variable checked before it is valid,
    // and the reported one is not.
    for (earlier, name) in names.iter().enumerate().take(position) {
        let Some(value) = values.get(earlier).filter(|value| !value.is_empty()) else {
            continue;
        };
        assert!(
            valid_at(earlier, value),
            "{name}={value:?} is malformed but {error} came first"
        );
    }
    assert!(!valid_at(position, values[position]), "{error}");
}

fn assert_single_line(text: &str) {
    assert!(!text.contains(['\n', '\r']), "{text:?}");
}
