//! The board profiles of the boost compensation ([`super::boost`]): the constants of its power
//! model per kind of GPU, in `boards.toml` (built into the library), found by NVML's device name.
//!
//! A name matches a board when, with white space trimmed from both ends, it equals one of the
//! board's names exactly, case included: NVML names a board one way ("NVIDIA H200", "NVIDIA H100
//! 80GB HBM3"), and a near miss ("NVIDIA H200 NVL", an H100 PCIe) is another board, with other
//! power and clocks than the profile was fitted to. A GPU without a profile gets no power model:
//! its limit is a share of its time.
//!
//! The file is read where a device's compensation is chosen (once per device and process) and not
//! kept, so that no half-made copy is ever shared with a forked child. It is checked strictly:
//! every field present, none unknown, each within its rule, every name unique. The unit tests
//! check the file built in, so a malformed one fails them; were one built in anyway, every GPU
//! would get the time share, with the reason in the line that says so.

use serde::Deserialize;
use vgpu_config::ComputeProfile;

use super::boost::{Compensation, Profile};

/// The profiles built into the library.
const BOARDS: &str = include_str!("boards.toml");

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    board: Vec<Board>,
}

/// One `[[board]]`, as written (`boards.toml` says what each field is).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Board {
    names: Vec<String>,
    idle_share: f64,
    alpha: f64,
    beta: f64,
    heaviest_work: f64,
    max_factor: f64,
}

impl Board {
    /// The profile, if every value keeps its rule.
    fn check(&self) -> Result<Profile, String> {
        if self.names.is_empty() {
            return Err("no names".to_owned());
        }
        if let Some(name) = self.names.iter().find(|name| name.is_empty() || name.trim() != *name) {
            return Err(format!(
                "the name {name:?} is empty or has white space at an end (NVML's names are matched trimmed)"
            ));
        }
        let (idle, alpha, beta, heaviest, max) = (
            self.idle_share,
            self.alpha,
            self.beta,
            self.heaviest_work,
            self.max_factor,
        );
        // Each rule as the error says it; NaN keeps none.
        let rules = [
            (
                "idle_share",
                idle,
                (0.0..1.0).contains(&idle),
                "from 0 to below 1 (idle power is a part of the power limit)",
            ),
            (
                "alpha",
                alpha,
                (1.0..=3.0).contains(&alpha),
                "from 1 to 3 (dynamic power grows at least as the clock and at most as its cube)",
            ),
            (
                "beta",
                beta,
                beta > 0.0 && beta <= 1.0,
                "above 0 and at most 1 (a kernel speeds up at most as much as its clock)",
            ),
            (
                "heaviest_work",
                heaviest,
                heaviest > 0.0 && heaviest <= 2.0,
                "above 0 and at most 2 (times the board's default power limit)",
            ),
            (
                "max_factor",
                max,
                (1.0..=2.0).contains(&max),
                "from 1 to 2 (a factor below 1 would charge less than the time taken; no boost doubles a kernel's speed)",
            ),
        ];
        match rules.iter().find(|(_, _, kept, _)| !kept) {
            Some((field, value, _, rule)) => Err(format!("{field} = {value} is not {rule}")),
            None => Ok(Profile {
                idle_share: idle,
                alpha,
                beta,
                heaviest_work: heaviest,
                max_factor: max,
            }),
        }
    }
}

/// The boards of a profiles file, each with its names, checked; `Err` holds one line that says
/// where and why.
fn parse(text: &str) -> Result<Vec<(Vec<String>, Profile)>, String> {
    let file: File = toml::from_str(text).map_err(|error| {
        let line = error
            .span()
            .and_then(|span| text.get(..span.start))
            .map_or(String::new(), |before| {
                format!("line {}: ", before.matches('\n').count() + 1)
            });
        format!("{line}{}", error.message().trim().replace('\n', " "))
    })?;
    let mut boards: Vec<(Vec<String>, Profile)> = Vec::with_capacity(file.board.len());
    let mut seen = std::collections::HashSet::new();
    for (index, board) in file.board.into_iter().enumerate() {
        let which = || {
            let first = board.names.first().map_or(String::new(), |name| format!(" ({name:?})"));
            format!("board {}{first}", index + 1)
        };
        let profile = board.check().map_err(|error| format!("{}: {error}", which()))?;
        if let Some(name) = board.names.iter().find(|name| !seen.insert((*name).clone())) {
            return Err(format!("{}: the name {name:?} is listed twice", which()));
        }
        boards.push((board.names, profile));
    }
    Ok(boards)
}

/// The profile of the board NVML names `name` (trimmed, then exact).
fn find(boards: &[(Vec<String>, Profile)], name: &str) -> Option<Profile> {
    let name = name.trim();
    boards
        .iter()
        .find(|(names, _)| names.iter().any(|known| known == name))
        .map(|(_, profile)| *profile)
}

/// How a device's limit is held, and one line that says why (for the log, once per device).
#[derive(Debug)]
pub struct Choice {
    pub compensation: Compensation,
    pub why: String,
}

/// The compensation for a GPU that NVML names `name` (`None`: NVML gave no name) under
/// `VGPU_COMPUTE_PROFILE`.
pub fn choose(setting: ComputeProfile, name: Option<&str>) -> Choice {
    choose_from(BOARDS, setting, name)
}

fn choose_from(profiles: &str, setting: ComputeProfile, name: Option<&str>) -> Choice {
    let time_share = |reason: String| Choice {
        compensation: Compensation::TimeShare,
        why: format!("{reason}: the limit is a share of the GPU's time, without boost compensation"),
    };
    if setting == ComputeProfile::Off {
        return time_share("VGPU_COMPUTE_PROFILE=off".to_owned());
    }
    let Some(name) = name else {
        return time_share("NVML gives no name for this GPU, so no board profile applies".to_owned());
    };
    let boards = match parse(profiles) {
        Ok(boards) => boards,
        Err(error) => {
            return time_share(format!(
                "the board profiles built into the library are malformed ({error})"
            ));
        }
    };
    match find(&boards, name) {
        Some(profile) => Choice {
            compensation: Compensation::Modelled(profile),
            why: format!(
                "{:?} has a board profile: the limit is a share of the work the GPU does unlimited, its boost clock \
                 compensated by the board's power model",
                name.trim()
            ),
        },
        None => time_share(format!("{:?} has no board profile", name.trim())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn modelled(choice: &Choice) -> Option<Profile> {
        match choice.compensation {
            Compensation::Modelled(profile) => Some(profile),
            Compensation::TimeShare => None,
        }
    }

    #[test]
    fn the_profiles_built_in_are_valid() {
        let boards = parse(BOARDS);
        let Ok(boards) = boards else {
            panic!("boards.toml: {boards:?}");
        };
        let names: Vec<&str> = boards
            .iter()
            .flat_map(|(names, _)| names.iter().map(String::as_str))
            .collect();
        for expected in ["NVIDIA H200", "NVIDIA H100 80GB HBM3", "NVIDIA H200 (vgpu fake)"] {
            assert!(names.contains(&expected), "{expected} in {names:?}");
        }
        // The H200's are the values its model was fitted with (docs/compute-limit.md).
        let h200 = find(&boards, "NVIDIA H200");
        let fitted = Profile {
            idle_share: 0.17,
            alpha: 1.5,
            beta: 0.66,
            heaviest_work: 1.3,
            max_factor: 1.25,
        };
        assert_eq!(h200, Some(fitted));
        // The H100's are the H200's but for the heaviest work, which its own GEMM set.
        let h100 = Profile {
            heaviest_work: 1.45,
            ..fitted
        };
        assert_eq!(find(&boards, "NVIDIA H100 80GB HBM3"), Some(h100));
        // The fake driver's GPU models the H200.
        assert_eq!(find(&boards, "NVIDIA H200 (vgpu fake)"), Some(fitted));
    }

    #[test]
    fn names_are_matched_trimmed_and_exactly() {
        let h200 = choose(ComputeProfile::Auto, Some("NVIDIA H200"));
        assert!(modelled(&h200).is_some(), "{h200:?}");
        assert!(
            h200.why.starts_with("\"NVIDIA H200\" has a board profile"),
            "{}",
            h200.why
        );
        for padded in [" NVIDIA H200", "NVIDIA H200\n", "\tNVIDIA H200  "] {
            assert_eq!(
                modelled(&choose(ComputeProfile::Auto, Some(padded))),
                modelled(&h200),
                "{padded:?}"
            );
        }
        for other in [
            "NVIDIA H200 NVL",
            "nvidia h200",
            "NVIDIA H100 PCIe",
            "NVIDIA H100",
            "NVIDIA H20",
            "NVIDIA A100-SXM4-80GB",
            "NVIDIA  H200",
            "",
        ] {
            let choice = choose(ComputeProfile::Auto, Some(other));
            assert_eq!(choice.compensation, Compensation::TimeShare, "{other:?}");
            assert!(
                choice
                    .why
                    .contains("has no board profile: the limit is a share of the GPU's time"),
                "{}",
                choice.why
            );
        }
    }

    #[test]
    fn off_or_no_name_is_the_time_share() {
        for name in [
            Some("NVIDIA H200"),
            Some("NVIDIA H100 80GB HBM3"),
            Some("unknown"),
            None,
        ] {
            let off = choose(ComputeProfile::Off, name);
            assert_eq!(off.compensation, Compensation::TimeShare, "{name:?}");
            assert!(off.why.starts_with("VGPU_COMPUTE_PROFILE=off: "), "{}", off.why);
        }
        let nameless = choose(ComputeProfile::Auto, None);
        assert_eq!(nameless.compensation, Compensation::TimeShare);
        assert!(nameless.why.starts_with("NVML gives no name"), "{}", nameless.why);
    }

    /// A board written with one field replaced (or, with `value` empty, left out).
    fn board_with(field: &str, value: &str) -> String {
        let fields = [
            ("names", "[\"GPU A\"]"),
            ("idle_share", "0.17"),
            ("alpha", "1.5"),
            ("beta", "0.66"),
            ("heaviest_work", "1.3"),
            ("max_factor", "1.25"),
        ];
        let mut text = "[[board]]\n".to_owned();
        for (name, default) in fields {
            let value = if name == field { value } else { default };
            if !value.is_empty() {
                text.push_str(&format!("{name} = {value}\n"));
            }
        }
        if !fields.iter().any(|(name, _)| *name == field) {
            text.push_str(&format!("{field} = {value}\n"));
        }
        text
    }

    #[test]
    fn malformed_profiles_are_refused_with_one_line_saying_where_and_why() {
        assert!(parse(&board_with("alpha", "1.5")).is_ok());
        let refused = [
            (board_with("alpha", ""), "missing field `alpha`"),
            (board_with("alpha", "\"1.5\""), "line 4: invalid type"),
            (board_with("gamma", "2.0"), "unknown field `gamma`"),
            (
                board_with("idle_share", "1.0"),
                "board 1 (\"GPU A\"): idle_share = 1 is not from 0 to below 1",
            ),
            (board_with("idle_share", "-0.1"), "idle_share = -0.1 is not"),
            (board_with("alpha", "0.5"), "alpha = 0.5 is not from 1 to 3"),
            (board_with("alpha", "nan"), "alpha = NaN is not"),
            (board_with("beta", "0.0"), "beta = 0 is not above 0"),
            (board_with("beta", "1.5"), "beta = 1.5 is not"),
            (board_with("heaviest_work", "13"), "heaviest_work = 13 is not"),
            (board_with("heaviest_work", "inf"), "heaviest_work = inf is not"),
            (board_with("max_factor", "0.9"), "max_factor = 0.9 is not from 1 to 2"),
            (board_with("max_factor", "12.5"), "max_factor = 12.5 is not"),
            (board_with("names", "[]"), "board 1: no names"),
            (board_with("names", "[\" GPU A\"]"), "white space at an end"),
            (board_with("names", "[\"\"]"), "is empty"),
            (board_with("names", "\"GPU A\""), "invalid type"),
            (
                board_with("names", "[\"GPU A\", \"GPU A\"]"),
                "the name \"GPU A\" is listed twice",
            ),
            (
                format!("{}{}", board_with("alpha", "1.5"), board_with("alpha", "2")),
                "board 2 (\"GPU A\"): the name \"GPU A\" is listed twice",
            ),
            ("[[board]\nnames = [".to_owned(), "line 1: "),
            ("boards = []\n".to_owned(), "unknown field `boards`"),
            (String::new(), "missing field `board`"),
        ];
        for (text, expected) in refused {
            let error = parse(&text).err().unwrap_or_default();
            assert!(error.contains(expected), "{text:?}: {error:?} lacks {expected:?}");
            assert!(!error.contains('\n'), "{text:?}: {error:?}");
        }
    }

    #[test]
    fn malformed_profiles_give_every_gpu_the_time_share() {
        let choice = choose_from(&board_with("beta", "2"), ComputeProfile::Auto, Some("GPU A"));
        assert_eq!(choice.compensation, Compensation::TimeShare);
        assert!(
            choice
                .why
                .starts_with("the board profiles built into the library are malformed (board 1"),
            "{}",
            choice.why
        );
        assert!(!choice.why.contains('\n'), "{}", choice.why);
        let known = choose_from(&board_with("beta", "0.5"), ComputeProfile::Auto, Some("GPU A"));
        assert_eq!(modelled(&known).map(|profile| profile.beta), Some(0.5));
    }
}
